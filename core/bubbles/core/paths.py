"""Where the node-local channels between the hook, the agent and fill jobs live.

Layout under the run directory (one per node); each harvested GPU (``identity.GpuKey``: namespace, training, stage,
rank within the stage) has a directory of its own::

    <run_dir>/<namespace>/<training>/stage-<k>/rank-<r>/agent.sock              the agent's datagram socket for it
    <run_dir>/<namespace>/<training>/stage-<k>/rank-<r>/hook.json               the hook's card: its Pod, GPU, process
    <run_dir>/<namespace>/<training>/stage-<k>/rank-<r>/hook.lock               held (flock) by the rank's process
    <run_dir>/<namespace>/<training>/stage-<k>/rank-<r>/fills/fill-<job>.sock   an armed fill job's datagram socket
    <run_dir>/_attach/attach.sock                                               cluster mode: where fill Pods attach

``<namespace>`` is the training Pod's namespace, or ``_local`` outside Kubernetes. Hooks before card v4 wrote
``<run_dir>/<training>/stage-<k>/`` (one rank per stage, no namespace): ``legacy_stage_dir``, which agents read for
one release (docs/upgrading.md).

The hook sends every bubble signal to the agent's socket and to each ``*.sock`` in ``fills/``, so the fill job
that harvests the GPU hears of a bubble directly (one hop, no relay through the agent), and the agent hears
the same signal for accounting, the slowdown guard and the grace-period watchdog. Fill sockets have a directory
of their own, and attaching one of its own too, so that a fill Pod mounts only those two: the GPU's other files
(the training's lock and card, the agent's socket) and the node's other trainings stay out of its reach.
Directories are created with mode 0700: only the training's user can signal or listen.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey, check_name, check_namespace

__all__ = ["LOCAL_NAMESPACE", "GpuKey", "check_name", "check_namespace"]  # re-exported: where callers find them

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
# Not a name a namespace can have (check_namespace): a namespace named so would share the fill Pods' mount.
ATTACH_DIR_NAME = "_attach"
NAMESPACE_ENV = "POD_NAMESPACE"  # the training Pod's namespace, from the downward API
ATTACH_SOCKET_NAME = "attach.sock"

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


def default_namespace() -> str:
    """The training's namespace: ``$POD_NAMESPACE`` (the downward API), else ``_local``."""
    return os.environ.get(NAMESPACE_ENV) or LOCAL_NAMESPACE


def training_dir(run_dir: Path | str, namespace: str, training: str) -> Path:
    """Where a training's GPUs' directories are on this node."""
    return Path(run_dir) / check_namespace(namespace) / check_name("training", training)


def gpu_dir(run_dir: Path | str, key: GpuKey) -> Path:
    """The directory of one harvested GPU (a rank of a stage): its agent socket, card, lock and ``fills/``."""
    return training_dir(run_dir, key.namespace, key.training) / f"stage-{key.stage}" / f"rank-{key.rank}"


def gpu_relpath(key: GpuKey) -> str:
    """``gpu_dir`` relative to the run directory, with '/' (what a Pod's mount names under the node's run dir)."""
    return posixpath.join(key.namespace, key.training, f"stage-{key.stage}", f"rank-{key.rank}")


def legacy_stage_dir(run_dir: Path | str, training: str, stage: int) -> Path:
    """Where a hook before card v4 kept a stage's files (one rank per stage, no namespace)."""
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage}")
    return Path(run_dir) / check_name("training", training) / f"stage-{stage}"


def agent_socket(run_dir: Path | str, key: GpuKey) -> Path:
    return gpu_dir(run_dir, key) / AGENT_SOCKET_NAME


def fills_dir(run_dir: Path | str, key: GpuKey) -> Path:
    """Where the GPU's fill jobs bind their sockets (the one directory of it a fill Pod mounts)."""
    return gpu_dir(run_dir, key) / FILLS_DIR_NAME


def fill_socket(run_dir: Path | str, key: GpuKey, job: str) -> Path:
    return fills_dir(run_dir, key) / f"{FILL_SOCKET_PREFIX}{check_name('fill job', job)}{SOCKET_SUFFIX}"


# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


PODS_DIR_NAME = "_pods"  # <run_dir>/_pods/<pod uid>/: a Pod's own directory, its CSI volume (no namespace is so named)


def as_the_pod_sees(path: Path | str) -> Path:
    """A path in a Pod's own directory (``<run_dir>/_pods/<pod uid>/<rest>``) as that Pod reaches it, at
    ``MOUNTED_RUN_DIR/<rest>``; any other path as it is. What a socket's length is checked on: the agent binds in a
    Pod's directory through a descriptor of it (a short path), and the Pod's processes use the path in their mount."""
    parts = Path(path).parts
    for i in range(1, len(parts) - 2):
        if parts[i] == PODS_DIR_NAME:
            return MOUNTED_RUN_DIR.joinpath(*parts[i + 2:])
    return Path(path)


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


def hook_card(run_dir: Path | str, key: GpuKey) -> Path:
    return gpu_dir(run_dir, key) / HOOK_CARD_NAME


def hook_lock(run_dir: Path | str, key: GpuKey) -> Path:
    return gpu_dir(run_dir, key) / HOOK_LOCK_NAME


def attach_dir(run_dir: Path | str) -> Path:
    """The directory of the attach socket (a fill Pod mounts it: a socket file mounted alone would keep the inode
    it had when the Pod started, and lose the agent at its first restart)."""
    return Path(run_dir) / ATTACH_DIR_NAME


def attach_socket(run_dir: Path | str) -> Path:
    return attach_dir(run_dir) / ATTACH_SOCKET_NAME
