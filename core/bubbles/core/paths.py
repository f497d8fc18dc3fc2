"""Where the node-local channels between the hook, the agent and fill jobs live.

Layout under the run directory (one per node)::

    <run_dir>/<training>/stage-<k>/agent.sock              the agent's datagram socket for stage k
    <run_dir>/<training>/stage-<k>/hook.json               the hook's card: which Pod and GPU the stage runs on
    <run_dir>/<training>/stage-<k>/hook.lock               held (flock) by the training's process while it lives
    <run_dir>/<training>/stage-<k>/fills/fill-<job>.sock   an armed fill job's datagram socket
    <run_dir>/_attach/attach.sock                          cluster mode: where fill Pods' processes attach

The hook sends every bubble signal to the agent's socket and to each ``*.sock`` in ``fills/``, so the fill job
that harvests the stage hears of a bubble directly (one hop, no relay through the agent), and the agent hears
the same signal for accounting, the slowdown guard and the grace-period watchdog. Fill sockets have a directory
of their own, and attaching one of its own too, so that a fill Pod mounts only those two: the stage's other files
(the training's lock and card, the agent's socket) and the node's other trainings stay out of its reach.
Directories are created with mode 0700: only the training's user can signal or listen.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

RUN_DIR_ENV = "BUBBLES_RUN_DIR"
TRAINING_ENV = "BUBBLES_TRAINING"
DEFAULT_TRAINING = "default"
AGENT_SOCKET_NAME = "agent.sock"
FILL_SOCKET_PREFIX = "fill-"
SOCKET_SUFFIX = ".sock"
HOOK_CARD_NAME = "hook.json"
# Held (flock) by the hook's process while it lives, so a node's agent can tell a card whose process is gone (a Pod
# deleted or crashed leaves its card on the node) from a live one, across PID namespaces.
HOOK_LOCK_NAME = "hook.lock"
FILLS_DIR_NAME = "fills"
# Not a name a training can have (check_name): a training named so would share the fill Pods' mount.
ATTACH_DIR_NAME = "_attach"
ATTACH_SOCKET_NAME = "attach.sock"

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")


# Where a Pod mounts the node's run directory (the chart's agent.runDir): the training's, the agent's, every fill Pod's.
MOUNTED_RUN_DIR = Path("/run/bubbles")


def is_plain_absolute(path: str) -> bool:
    """Whether ``path`` is absolute and written plainly: no '.' or '..' parts, no repeated or trailing slashes (as the
    API server wants a hostPath or a mount path, and as containment is judged by comparing strings)."""
    return path.startswith("/") and not path.startswith("//") and posixpath.normpath(path) == path


def default_run_dir(mounted: Path = MOUNTED_RUN_DIR) -> Path:
    """``$BUBBLES_RUN_DIR``; else ``/run/bubbles`` when this user can use it, or create it; else a per-user
    directory in /tmp.

    In a Pod ``/run/bubbles`` is the node's run directory mounted there (a hostPath the agent owns): ``/run`` itself
    is root's, so the directory counts when it is writable, not only when ``/run`` is."""
    env = os.environ.get(RUN_DIR_ENV)
    if env:
        return Path(env)
    run = mounted
    if os.access(run, os.W_OK | os.X_OK) or (not os.path.lexists(run) and os.access(run.parent, os.W_OK)):
        return run
    return Path(f"/tmp/bubbles-{os.getuid()}")


def default_training() -> str:
    return os.environ.get(TRAINING_ENV, DEFAULT_TRAINING)


def check_name(kind: str, name: str) -> str:
    """Validate a training or fill-job name used in paths (DNS-label style, like Kubernetes names)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{kind} name {name!r} is not valid: use 1-63 lower-case letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return name


def stage_dir(run_dir: Path | str, training: str, stage: int) -> Path:
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage}")
    return Path(run_dir) / check_name("training", training) / f"stage-{stage}"


def agent_socket(run_dir: Path | str, training: str, stage: int) -> Path:
    return stage_dir(run_dir, training, stage) / AGENT_SOCKET_NAME


def fills_dir(run_dir: Path | str, training: str, stage: int) -> Path:
    """Where stage ``stage``'s fill jobs bind their sockets (the one directory of the stage a fill Pod mounts)."""
    return stage_dir(run_dir, training, stage) / FILLS_DIR_NAME


def fill_socket(run_dir: Path | str, training: str, stage: int, job: str) -> Path:
    return fills_dir(run_dir, training, stage) / f"{FILL_SOCKET_PREFIX}{check_name('fill job', job)}{SOCKET_SUFFIX}"


# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


def socket_path_problem(path: Path | str) -> str | None:
    """Why ``path`` cannot be bound as a Unix socket (too long for ``sun_path``), with what to do; else None."""
    n = len(os.fsencode(str(path)))
    if n <= MAX_SOCKET_PATH_BYTES:
        return None
    return (f"socket path {path} is {n} bytes, longer than the {MAX_SOCKET_PATH_BYTES} a Unix socket allows: use a "
            f"shorter run directory (--run-dir or BUBBLES_RUN_DIR), training name or fill-job name")


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) readable only by this user; tighten it if it already exists."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def hook_card(run_dir: Path | str, training: str, stage: int) -> Path:
    return stage_dir(run_dir, training, stage) / HOOK_CARD_NAME


def hook_lock(run_dir: Path | str, training: str, stage: int) -> Path:
    return stage_dir(run_dir, training, stage) / HOOK_LOCK_NAME


def attach_dir(run_dir: Path | str) -> Path:
    """The directory of the attach socket (a fill Pod mounts it: a socket file mounted alone would keep the inode
    it had when the Pod started, and lose the agent at its first restart)."""
    return Path(run_dir) / ATTACH_DIR_NAME


def attach_socket(run_dir: Path | str) -> Path:
    return attach_dir(run_dir) / ATTACH_SOCKET_NAME
