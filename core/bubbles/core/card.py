"""The hook card (``hook.json``) and its lock (``hook.lock``): what a training's hook tells the node's agent about one
rank of a stage (a harvested GPU, ``identity.GpuKey``), written by the hook and read by the agent, both here.

The GPU's directory is writable by the fill jobs too, so nothing here follows a link, waits on an open (a FIFO planted
under a name would hold the training or the agent) or takes anything but a regular file. The lock lives exactly as
long as the hook's process: a card whose lock nobody holds is stale. Standard library only.

Versions (``VERSION``; the card only grows, so a reader takes the fields it knows from a newer card):
1. the stage, its Pod, device and GPU, and the process that wrote it;
2. ``lock``: the hook holds the stage's ``hook.lock`` while its process lives (false where the file system has no
   flock), so a card whose lock nobody holds is stale;
3. the hook signals the fill sockets in the stage's ``fills/``, the directory a fill Pod mounts (``fills`` in the
   JSON, for readers that predate the version field).
4. every rank of a stage writes its own card, in its own directory ``<namespace>/<training>/stage-<k>/rank-<r>/``
   (``paths.gpu_dir``): ``rank`` (its index among the stage's ranks) and ``ranks`` (how many the stage has); the
   namespace is ``_local`` outside Kubernetes. Cards before v4 are in ``<training>/stage-<k>/`` (one rank per stage,
   read as rank 0 of 1, their namespace ``_local`` where they name none).
A card without ``version`` was written before the field existed: its version follows from ``fills`` and ``lock``.

Where cards are (a *card root*): the node's run directory, which training Pods reach by hostPath as the agent's UID;
or a training Pod's own directory, ``<run_dir>/_pods/<pod uid>/``, which the agent publishes to that Pod alone as its
CSI volume (``csi.bubbles.dev``) and where the hook writes the same tree. A card found in a Pod's directory is that
Pod's word, and counts only for the namespace the kubelet named when it published the volume (``pod_card_problem``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core import paths
from bubbles.core.identity import LOCAL_NAMESPACE, MAX_RANKS, GpuKey, check_namespace

VERSION = 4
FILLS_VERSION = 3  # the first version whose hook signals fills/ (a cluster agent places fill Pods only beside it)
MAX_CARD_BYTES = 64 * 1024  # a card is a few hundred bytes
RANKS_VERSION = 4  # the first version with a card per rank, in the namespaced layout
LOCK_WAIT_S = 0.5  # the agent checks the lock for microseconds; a live twin of the stage holds it for good


@dataclass(frozen=True)
class Card:
    """What a training's hook says about one rank of one stage (``hook.json``)."""

    training: str
    stage: int
    stages: int
    namespace: str
    pod: str
    device: str
    gpu_uuid: str | None
    rank: int = 0  # its index among the stage's ranks (card v4 on; 0 before)
    ranks: int = 1  # how many ranks the stage has (tensor x data parallel; card v4 on; 1 before)
    # Which process wrote it, compared as ``instance``: a restarted process under the same Pod name differs.
    pid: int | str = field(default="", compare=False)
    started_ns: int | str = field(default="", compare=False)
    lock: bool = False  # its process holds the stage's hook.lock while it lives (card v2 on)
    version: int = VERSION
    instance: str = field(init=False)  # "<pid>@<started_ns>"

    @property
    def key(self) -> GpuKey:
        """The GPU it speaks for (a card before v4 that names no namespace was a training outside Kubernetes, or one
        whose Pod did not pass its namespace: ``_local``)."""
        return GpuKey(self.namespace or LOCAL_NAMESPACE, self.training, self.stage, self.rank)

    def directory(self, root: Path | str) -> Path:
        """Where its files are under the card root ``root`` (the node's run directory or a Pod's directory):
        ``paths.gpu_dir`` from v4, the stage directory of the old layout before."""
        if self.version >= RANKS_VERSION:
            return paths.gpu_dir(root, self.key)
        return paths.legacy_stage_dir(root, self.training, self.stage)

    @property
    def fills(self) -> bool:
        """Whether its hook signals the fill sockets in the stage's ``fills/`` (card v3 on)."""
        return self.version >= FILLS_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "instance", f"{self.pid}@{self.started_ns}")

    @classmethod
    def parse(cls, d: Any, where: str) -> Card:
        """ValueError naming ``where`` and the field when the card is not usable."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: a card must be a JSON object")
        try:
            training = paths.check_name("training", d["training"])
            stage, stages = d["stage"], d["stages"]
            if not (isinstance(stage, int) and isinstance(stages, int) and 0 <= stage < stages <= 4096):
                raise ValueError(f"stage {stage!r} of {stages!r} stages is not a stage index")
            pod, ns, device = d.get("pod"), d.get("namespace", ""), d.get("device", "cpu")
            if not isinstance(pod, str) or not pod or not isinstance(ns, str) or not isinstance(device, str):
                raise ValueError("pod (non-empty), namespace and device must be strings")
            uuid = d.get("gpu_uuid")
            if uuid is not None and not isinstance(uuid, str):
                raise ValueError("gpu_uuid must be a string or null")
            version = d.get("version")
            if version is None:  # written before the field existed
                version = FILLS_VERSION if d.get("fills") is True else 2 if d.get("lock") is True else 1
            elif not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise ValueError(f"version {version!r} is not a card version (an integer from 1)")
            rank, ranks = 0, 1
            if version >= RANKS_VERSION:
                r, n = d.get("rank"), d.get("ranks")
                if not (isinstance(r, int) and isinstance(n, int) and not isinstance(r, bool)
                        and 0 <= r < n <= MAX_RANKS):
                    raise ValueError(f"rank {r!r} of {n!r} ranks is not a rank of the stage: rank must be an "
                                     f"integer from 0 to ranks - 1, ranks from 1 to {MAX_RANKS}")
                rank, ranks = r, n
                check_namespace(ns)
        except KeyError as exc:
            raise ValueError(f"{where}: the card has no {exc.args[0]!r}") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return cls(training, stage, stages, ns, pod, device, uuid, rank, ranks, pid=d.get("pid", ""),
                   started_ns=d.get("started_ns", ""), lock=d.get("lock") is True, version=version)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``hook.json``."""
        return {"training": self.training, "stage": self.stage, "stages": self.stages, "namespace": self.namespace,
                "pod": self.pod, "device": self.device, "gpu_uuid": self.gpu_uuid, "pid": self.pid,
                "started_ns": self.started_ns, "lock": self.lock, "fills": self.fills, "version": self.version,
                "rank": self.rank, "ranks": self.ranks}


# -- the agent's side: reading ----------------------------------------------------------------------------------


def read_card(path: Path) -> Card:
    """The card at ``path``, read as a file a fill job may have replaced: never through a link, never waiting on an
    open (a FIFO would hold the agent), at most MAX_CARD_BYTES. Raises OSError or ValueError, saying what is wrong."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = os.read(fd, MAX_CARD_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CARD_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CARD_BYTES} bytes, not a card")
    try:
        return Card.parse(json.loads(data), str(path))
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply, not a card") from None


def _is_namespace(name: str) -> bool:
    try:
        check_namespace(name)
    except ValueError:
        return False
    return True


def read_cards(root: Path) -> tuple[list[Card], list[str]]:
    """Every card under ``root`` (a card root: the node's run directory or a Pod's directory; the v4 layout, and the
    stage directories of hooks before it), and what is wrong with the ones that cannot be used. Only the v4 tree's
    namespaces are looked in: the node's own directories (``_attach``, the Pods' ``_pods``) are no namespace's, and a
    Pod's directory is read on its own, as that Pod's (``read_pod_cards``)."""
    cards, problems = [], []
    found = sorted(p for p in root.glob(f"*/*/stage-*/rank-*/{paths.HOOK_CARD_NAME}")
                   if _is_namespace(p.relative_to(root).parts[0]))
    found += sorted(root.glob(f"*/stage-*/{paths.HOOK_CARD_NAME}"))  # hooks before card v4
    for path in found:
        try:
            card = read_card(path)
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
            continue
        if path.parent != card.directory(root):
            problems.append(f"{path}: the card names {card.key} (card v{card.version}), not its directory")
            continue
        cards.append(card)
    return cards, problems


def pod_card_problem(card: Card, namespace: str, pod: str) -> str | None:
    """Why a card found in the directory of Pod ``namespace``/``pod`` (its CSI volume, named by the kubelet) does not
    count, with what to do; None when it does.

    The kubelet, not the Pod, says whose directory it is; the card is what the Pod says of itself. A Pod may speak
    only for its own namespace: a card naming another would have the agent serve (and the operator place fill jobs
    beside) another namespace's training. Its Pod name is not judged: the hook takes it from ``$POD_NAME`` or the
    hostname, which may differ from the Pod's name (a Pod's ``spec.hostname``, a name past 63 characters cut short),
    so the agent takes the kubelet's name instead (``read_pod_cards``)."""
    if card.version < RANKS_VERSION:
        return (f"the hook writes card v{card.version}, before a card per rank, which a Pod's {paths.MOUNTED_RUN_DIR} "
                f"volume does not serve: upgrade bubbles in the training's image (card v{RANKS_VERSION} or later)")
    if card.key.namespace != namespace:
        return (f"the card names namespace {card.key.namespace!r}, but the kubelet published this volume for Pod "
                f"{pod} in namespace {namespace!r}, and a Pod's cards count only for its own namespace: set "
                "POD_NAMESPACE from the downward API (env: valueFrom: fieldRef: fieldPath: metadata.namespace) in the "
                "training's container")
    return None


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def read_pod_cards(root: Path, namespace: str, pod: str) -> tuple[list[Card], list[str]]:
    """The cards in the directory of Pod ``namespace``/``pod`` (``root``: its CSI volume on the node) that count
    (``pod_card_problem``), each with the Pod's name as the kubelet gave it, and what is wrong with the others.

    A GPU directory that resolves outside ``root`` (the Pod made a part of its path a link) does not count either:
    the agent, root on the node, would bind its socket and make ``fills/`` wherever the link points."""
    cards, problems = read_cards(root)
    real_root = os.path.realpath(root)
    out = []
    for card in cards:
        where = card.directory(root)
        problem = pod_card_problem(card, namespace, pod)
        if problem is None and not _inside(os.path.realpath(where), real_root):
            problem = (f"its directory resolves to {os.path.realpath(where)}, outside the Pod's volume: a part of "
                       "its path is a link; let the hook make its directories (remove the link)")
        if problem is not None:
            problems.append(f"{where / paths.HOOK_CARD_NAME} (the volume of Pod {namespace}/{pod}): {problem}")
            continue
        out.append(card if card.pod == pod else dataclasses.replace(card, pod=pod))
    return out, problems


def card_is_stale(root: Path, card: Card) -> bool:
    """Whether ``card`` (found under the card root ``root``) has its process gone: nothing holds its stage's
    ``hook.lock`` (a card that says its process holds none, or whose lock file cannot be read, is taken as live). A
    stale card is removed, under the lock, unless a new process has written its own meanwhile."""
    if not card.lock:
        return False
    import fcntl

    try:
        fd = os.open(card.directory(root) / paths.HOOK_LOCK_NAME,
                     os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: the hook's process (or a child it forked) lives
            return False
        path = card.directory(root) / paths.HOOK_CARD_NAME
        try:
            now = read_card(path)
        except (OSError, ValueError):
            return True  # gone or unreadable already
        if now.instance != card.instance:
            return False  # a new process took over between the read and the lock: its card stays
        with contextlib.suppress(OSError):
            path.unlink()
        return True
    finally:
        os.close(fd)  # releases the lock


def hook_lock_held(directory: Path) -> bool | None:
    """Whether a process holds the ``hook.lock`` in ``directory`` (a GPU's, ``paths.gpu_dir``), i.e. its hook's
    process lives: True or False, or None where it cannot be told (no lock file, a file system without flock). Takes a
    free lock for an instant, as ``card_is_stale`` does (a hook starting then waits for it), and, unlike it, removes
    nothing."""
    import fcntl

    try:
        fd = os.open(directory / paths.HOOK_LOCK_NAME, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        return False
    finally:
        os.close(fd)  # releases the lock if it was taken


# -- the hook's side: the lock and the writing ------------------------------------------------------------------

# The hook.lock descriptors this process holds. A child forked from the training (a DataLoader worker) shares each
# lock's open file and would keep the lock, and so the card, alive after the training died. Children close their
# copies right after the fork: the lock lives exactly as long as the training's own process. (A child that carries
# on as the training after its parent exits has no lock then: its card is taken for stale, which stops fill work for
# that stage and never the training.)
_HELD_LOCKS: set[int] = set()


def _drop_locks_in_child() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_locks_in_child)


def hold_lock(path: Path, wait_s: float = LOCK_WAIT_S) -> int | None:
    """Hold ``hook.lock`` at ``path`` for this process's life: its descriptor, or None if it cannot be had within
    ``wait_s`` (another live process of this stage holds it). OSError where it cannot be opened or flock is missing."""
    import fcntl

    # Never through a link, never waiting to open (a FIFO planted under the name would hold the training here),
    # and only a regular file: the stage directory is writable by the fill jobs too.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    _HELD_LOCKS.add(fd)  # from the open on: a fork while it waits must not leave the child sharing the lock
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                _HELD_LOCKS.discard(fd)
                os.close(fd)
                return None
            time.sleep(0.005)
        except OSError:  # a file system without flock: no lock, and no leaked descriptor
            _HELD_LOCKS.discard(fd)
            os.close(fd)
            raise


def release_lock(fd: int) -> None:
    """Let go of a lock ``hold_lock`` took (in a forked child, which closed its copy at the fork, nothing to do)."""
    if fd in _HELD_LOCKS:  # not in a forked child, which closed its copy (and may reuse the number)
        _HELD_LOCKS.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def write_card(path: Path, card: Card) -> None:
    """Write ``card`` at ``path``, replacing any file there in one rename; raises OSError."""
    # A new file of a name no one could plant beforehand (mkstemp: O_EXCL, no link followed), then renamed over the
    # card: nothing in the directory can make this write block or land elsewhere.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(card.to_dict()) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
