"""The CSI node plugin's shell: carries out what ``publish.plan_publish``/``plan_unpublish`` decide (directories,
bind mounts, the state file) and keeps the book of published volumes for the rest of the agent (``published()``).

One lock serializes publishes and unpublishes: the kubelet sends a few per Pod start and stop, never a stream. The book
is written to ``<run_dir>/_pods/csi-volumes.json`` after each change, so an agent restarted (a new DaemonSet Pod)
knows which Pod owns which directory and unpublishes what it published before. A state file it cannot read is set
aside (``.unreadable``) with a warning and the agent starts with an empty book: the kubelet's unpublish still undoes
each mount (a target in the kubelet's Pods is cleaned whether the book knows it or not); only those Pods' directories
are left behind.

A ``role: fill`` volume is the operator's fill Pods' alone: ``FillPods`` (injected; the node agent,
``bubbles.agent.cluster.NodeAgent``) says whether the Pod the kubelet names is the fill Pod of a live assignment, and
serves the Pod's own attach socket in its directory from the publish (``published``) to the unpublish
(``unpublished``); ``start`` hands it the fill volumes an earlier agent published. A training's volume is not asked
about.

Where the agent runs MPS (``mps``: its pipe and shared-memory directories, from the command line), each Pod's directory
carries them as bind mounts at ``mps/pipe`` and ``mps/shm`` (``podfs.mount_inside``: made without following what the
Pod planted), and the directory is bind-mounted at the target recursively, so the target carries them and the
container runtime's bind of the target (recursive) carries them into the Pod. An unpublish detaches what is mounted
below the target, then the target, and with the Pod's last volume what is mounted below the Pod's directory before
removing it (``podfs.remove_tree``: never through a live mount). ``start`` detaches what a crashed agent left mounted
in Pods' directories its book does not know (their targets keep their own copies; a retried publish mounts them
again), so that no later removal of such a directory reaches the MPS server's files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Protocol

from bubbles.core.nodeaccess import Role
from bubbles.core.paths import make_private_dir

from . import podfs
from .mounts import KernelMounter, Mounter
from .publish import (
    PODS_DIR_NAME,
    STATE_FILE_NAME,
    MpsDirs,
    PodVolume,
    PublishRequest,
    Refused,
    Status,
    book_from_json,
    book_to_json,
    mps_dirs_problem,
    plan_publish,
    plan_unpublish,
)

log = logging.getLogger("bubbles.agent.csi")

# The Pod's directory is writable by every user: the kubelet does not tell the plugin which UID the Pod runs as, and
# none need be shared with the agent. Only that Pod reaches it (its own mount; <run_dir>/_pods/ itself is 0700).
POD_DIR_MODE = 0o777
TARGET_DIR_MODE = 0o750  # as the kubelet makes its volume directories


class FillPods(Protocol):
    """What the plugin asks of the node agent about fill Pods' volumes (``role: fill``)."""

    def admit_fill_volume(self, volume: PodVolume) -> str | None:
        """Why ``volume``'s Pod may not have a fill volume (not an assigned fill Pod), with what to do; None: it may."""

    def fill_volume_published(self, volume: PodVolume) -> None:
        """``volume`` is mounted for its Pod (again, on a retry or after the agent restarted): serve the Pod."""

    def fill_volume_unpublished(self, volume: PodVolume) -> None:
        """``volume`` is about to be unmounted: stop serving the Pod there."""


class CsiNodePlugin:
    """Publishes ``csi.bubbles.dev`` volumes on this node: ``<run_dir>/_pods/<pod uid>/`` bind-mounted at each target
    the kubelet names under ``<kubelet_dir>/pods/``. ``publish``/``unpublish`` raise ``publish.Refused`` (the gRPC
    status and what to change) or OSError (the kernel refused: the kubelet retries). ``mps``: the node's MPS
    directories, carried by every Pod's directory (None: the agent runs no MPS, and no ``mps/`` is made); ValueError
    saying what to give if they cannot be."""

    def __init__(self, node_id: str, run_dir: Path, kubelet_dir: Path, mounter: Mounter | None = None,
                 fill_pods: FillPods | None = None, mps: MpsDirs | None = None) -> None:
        if mps is not None:
            problem = mps_dirs_problem(mps, str(run_dir))
            if problem is not None:
                raise ValueError(problem)
        self.mps = mps
        self.node_id = node_id
        self.run_dir = run_dir
        self.kubelet_dir = kubelet_dir
        self.mounter: Mounter = mounter if mounter is not None else KernelMounter()
        # None: no node agent serves fill Pods here (the plugin alone, as in its own tests): fill volumes are refused.
        self.fill_pods = fill_pods
        self._lock = threading.Lock()
        self._book: dict[str, PodVolume] = {}

    @property
    def pods_dir(self) -> Path:
        return self.run_dir / PODS_DIR_NAME

    @property
    def kubelet_pods_dir(self) -> Path:
        return self.kubelet_dir / "pods"

    @property
    def state_file(self) -> Path:
        return self.pods_dir / STATE_FILE_NAME

    def start(self) -> None:
        """Create ``<run_dir>/_pods/`` and read the book an earlier agent left."""
        make_private_dir(self.pods_dir)
        try:
            text = self.state_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            self._release_unknown_pod_dirs()
            return
        try:
            book = book_from_json(text)
        except ValueError as exc:
            aside = self.state_file.with_name(STATE_FILE_NAME + ".unreadable")
            os.replace(self.state_file, aside)
            log.warning("CSI state file %s %s; set aside as %s, starting with no published volume (the kubelet's "
                        "unpublishes still undo their mounts)", self.state_file, exc, aside)
            self._release_unknown_pod_dirs()
            return
        with self._lock:
            self._book = book
        log.info("CSI: %d published volume(s) known from %s", len(book), self.state_file)
        self._release_unknown_pod_dirs()
        for volume in self.published():
            if volume.role is Role.FILL and self.fill_pods is not None:
                try:
                    self.fill_pods.fill_volume_published(volume)
                except OSError as exc:  # its Pod cannot attach; the rest of the node is served
                    log.error("CSI: cannot serve fill Pod %s/%s again in %s: %s", volume.namespace, volume.pod,
                              volume.directory, exc)

    def _release_unknown_pod_dirs(self) -> None:
        """Detach what is mounted in the Pods' directories the book does not know (left by an agent that crashed
        before writing its book); the directories themselves stay, as the book cannot say whose they are."""
        with self._lock:
            known = {Path(v.directory) for v in self._book.values()}
        with os.scandir(self.pods_dir) as entries:
            dirs = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        for directory in sorted(set(dirs) - known):
            if not self.mounter.mounts_below(str(directory)):
                continue
            left = podfs.release_mounts(self.mounter, directory)
            log.warning("CSI: detached what an earlier agent left mounted in %s, a Pod's directory not in its book%s",
                        directory, f"; still mounted: {', '.join(left)}" if left else "")

    def published(self) -> tuple[PodVolume, ...]:
        """The volumes published on this node, by Pod: which Pod (namespace, name, uid, role) owns which directory."""
        with self._lock:
            return tuple(sorted(self._book.values(), key=lambda v: (v.namespace, v.pod, v.volume_id)))

    def publish(self, request: PublishRequest) -> PodVolume:
        """Mount the Pod's directory at the request's target (again, if a retry finds the mount gone), with the MPS
        directories in it where the agent runs MPS. A publish that fails leaves nothing mounted that no other volume
        of the Pod uses, and the Pod's directory only if it was there before."""
        with self._lock:
            plan = plan_publish(self._book, request, run_dir=str(self.run_dir),
                                kubelet_pods_dir=str(self.kubelet_pods_dir), mps=self.mps)
            volume = plan.volume
            if volume.role is Role.FILL:
                self._admit_fill(volume)
            directory, target = Path(volume.directory), Path(volume.target_path)
            made_dir = not directory.exists()
            make_private_dir(self.pods_dir)
            directory.mkdir(mode=POD_DIR_MODE, exist_ok=True)
            os.chmod(directory, POD_DIR_MODE)
            made_target = not target.exists()
            try:
                for sub in plan.submounts:
                    podfs.mount_inside(self.mounter, directory, sub.source, sub.subdir)
                target.mkdir(mode=TARGET_DIR_MODE, parents=True, exist_ok=True)
                if not self.mounter.is_mounted(str(target)):
                    if plan.submounts:
                        self.mounter.bind(str(directory), str(target), recursive=True)  # the target carries them
                    else:
                        self.mounter.bind(str(directory), str(target))
            except OSError:
                if made_target:
                    with contextlib.suppress(OSError):
                        target.rmdir()
                if not any(v.uid == volume.uid for v in self._book.values()):  # no other volume uses its mounts
                    if plan.submounts:
                        left = podfs.release_mounts(self.mounter, directory)
                        if made_dir and not left:
                            shutil.rmtree(directory, ignore_errors=True)
                    elif made_dir:
                        with contextlib.suppress(OSError):
                            directory.rmdir()
                raise
            if not plan.already:
                self._book[volume.volume_id] = volume
                self._save()
                log.info("CSI: published %s for Pod %s/%s (%s, role %s) at %s%s", volume.directory, volume.namespace,
                         volume.pod, volume.uid, volume.role, volume.target_path,
                         " with the MPS directories" if plan.submounts else "")
            if volume.role is Role.FILL and self.fill_pods is not None:
                # After the mount and the book (an OSError here fails the publish: the kubelet retries, and the retry
                # finds the volume published and serves it again).
                self.fill_pods.fill_volume_published(volume)
            return volume

    def _admit_fill(self, volume: PodVolume) -> None:
        """Refused (FAILED_PRECONDITION: the kubelet retries, so an assignment that comes a moment after its Pod is
        in time) unless the node agent says ``volume``'s Pod is an assigned fill Pod."""
        why = ("no node agent serves fill Pods here (the agent runs --csi without --cluster)" if self.fill_pods is None
               else self.fill_pods.admit_fill_volume(volume))
        if why is not None:
            raise Refused(Status.FAILED_PRECONDITION, why)

    def unpublish(self, volume_id: str, target_path: str) -> None:
        """Undo the mounts at the target (what is mounted below it first), remove that directory, forget the volume,
        and remove its Pod's directory with the Pod's last volume, once nothing is mounted below it. OK for a volume
        not published there (CSI wants it idempotent)."""
        with self._lock:
            plan = plan_unpublish(self._book, volume_id, target_path, kubelet_pods_dir=str(self.kubelet_pods_dir))
            if plan.volume is not None and plan.volume.role is Role.FILL and self.fill_pods is not None:
                self.fill_pods.fill_volume_unpublished(plan.volume)
            if plan.target is not None:
                if self.mounter.is_mounted(plan.target):
                    # The MPS directories the recursive bind carried first (unmounting the target with them in it
                    # fails: busy); what stays mounted makes the unmount fail, and the kubelet retries.
                    podfs.release_mounts(self.mounter, Path(plan.target))
                    self.mounter.unmount(plan.target)
                try:
                    os.rmdir(plan.target)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # not empty: not a directory this plugin made; the kubelet removes its own
                    log.warning("CSI: left %s in place after unpublishing %s: %s", plan.target, volume_id, exc)
            if plan.volume is None:
                return
            del self._book[volume_id]
            self._save()
            if plan.pod_dir is not None:
                podfs.remove_tree(self.mounter, Path(plan.pod_dir))
            log.info("CSI: unpublished %s of Pod %s/%s from %s", volume_id, plan.volume.namespace, plan.volume.pod,
                     target_path)

    def _save(self) -> None:
        """Write the book over the state file (a new file renamed over it: a crash leaves the old one or the new)."""
        fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE_NAME}.", dir=self.pods_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(book_to_json(self._book))
            os.replace(tmp, self.state_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
