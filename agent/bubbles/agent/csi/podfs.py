"""Inside a Pod's directory without following what the Pod planted: the MPS directories' bind mounts made there, and
every mount below a directory released before anything removes it.

A Pod writes its own directory (``<run_dir>/_pods/<uid>/``, 0777: any UID of the Pod) through its volume, so any name
in it may be a symbolic link the Pod made, to anywhere on the node as the agent sees it, or may be renamed while the
agent works: ``mps/`` moved aside with its mounts in it, a link planted in its place. Followed, such a link would make
the agent mount the MPS directories over a directory of the node's, unmount something of the node's, or, in a
``shutil.rmtree``, delete the MPS server's files through a live bind mount. So here:

- a path inside the directory is opened one component at a time from the directory's descriptor with ``O_NOFOLLOW``
  (as the attach socket's ``_attach`` is, ``bubbles.agent.cluster``); a component that is not a real directory (a
  link, a file) is removed (``unlinkat``, which never follows) and made again, where the caller makes them;
- a mount is made onto, and a mount detached at, ``/proc/self/fd/<fd>`` of the directory so opened: that names the
  directory itself, whatever its name is by then;
- the mounts below a directory are found by where the kernel says they are (``/proc/self/mountinfo``), wherever the
  Pod moved them, and the directory is removed only once none is left (``remove_tree``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from .mounts import Mounter

log = logging.getLogger("bubbles.agent.csi")

MPS_DIR_MODE = 0o755  # the agent's: a Pod of another UID cannot rename or replace what is in it
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 3  # a Pod racing the agent to plant a link again gets this many tries, then the publish fails
_RELEASE_ROUNDS = 4  # mountinfo read again after each round: a Pod may have moved mounts while they were detached


def fd_path(fd: int) -> str:
    """The path that names what ``fd`` is open on, links and renames notwithstanding (mount(2) and umount2(2) take
    it)."""
    return f"/proc/self/fd/{fd}"


def _open_dir(parent_fd: int, name: str) -> int:
    return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def _make_dir(parent_fd: int, name: str, where: str) -> int:
    """The real directory ``name`` in ``parent_fd``, opened; made (``MPS_DIR_MODE``) if missing, and made again in
    place of anything else (a link, a file) found there."""
    for _ in range(_ATTEMPTS):
        try:
            return _open_dir(parent_fd, name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            log.warning("CSI: %s/%s is not a directory (a link or a file the Pod made there): replaced", where, name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent_fd)  # unlinkat: removes a link itself, never what it points at
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, MPS_DIR_MODE, dir_fd=parent_fd)
            fd = _open_dir(parent_fd, name)
            os.fchmod(fd, MPS_DIR_MODE)  # whatever the umask
            return fd
    raise OSError(errno.ELOOP, f"{where}/{name} was replaced again while the agent made it a directory (the Pod keeps "
                  "planting something there): the kubelet retries the publish")


@contextlib.contextmanager
def open_inside(directory: Path, subdir: str, *, make: bool) -> Iterator[int]:
    """A descriptor of ``<directory>/<subdir>`` opened one component at a time without following any link; with
    ``make``, missing components are made and anything but a real directory replaced by one, else OSError (ELOOP,
    ENOTDIR, ENOENT) for such a component. ``directory`` itself is the agent's (a Pod's directory, a kubelet
    target): only its last component is not followed."""
    fds = [os.open(directory, _DIR_FLAGS)]
    try:
        where = str(directory)
        for name in subdir.split("/"):
            fds.append(_make_dir(fds[-1], name, where) if make else _open_dir(fds[-1], name))
            where = f"{where}/{name}"
        yield fds[-1]
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _same_dir(fd: int, source: str) -> bool:
    """Whether ``fd`` is open on ``source`` itself (its bind mount: the same device and inode)."""
    seen, want = os.fstat(fd), os.stat(source)
    return stat.S_ISDIR(want.st_mode) and (seen.st_dev, seen.st_ino) == (want.st_dev, want.st_ino)


def mount_inside(mounter: Mounter, directory: Path, source: str, subdir: str) -> bool:
    """Bind ``source`` at ``<directory>/<subdir>`` (the directories made as ``open_inside`` makes them) unless it is
    mounted there already; True if this call mounted it. OSError if ``source`` is not a directory or the kernel
    refuses."""
    if not os.path.isdir(source):
        raise OSError(errno.ENOENT, f"{source} is not a directory, so Pods cannot be given it: start the agent after "
                      "the directory exists (the chart's hostPath makes it), or give the right path")
    with open_inside(directory, subdir, make=True) as fd:
        if _same_dir(fd, source):
            return False
        mounter.bind(source, fd_path(fd))
        return True


def release_mounts(mounter: Mounter, directory: Path) -> list[str]:
    """Detach every mount below ``directory``, deepest first, each opened from ``directory`` without following links
    (one the Pod moved, or hid behind a link, is found again in the next round); what is still mounted below it
    after a few rounds (empty: nothing). A mount point that cannot be opened so is left alone, never unmounted by a
    path the Pod could have redirected."""
    root = os.path.realpath(directory).rstrip("/") + "/"
    for _ in range(_RELEASE_ROUNDS):
        points = mounter.mounts_below(str(directory))
        if not points:
            return []
        for point in points:
            try:
                with open_inside(directory, point[len(root):], make=False) as fd:
                    mounter.detach(fd_path(fd))
            except OSError as exc:  # moved, hidden behind a link, or not a mount's root: the next round sees
                log.debug("CSI: %s not detached this round: %s", point, exc)
    return mounter.mounts_below(str(directory))


def remove_tree(mounter: Mounter, directory: Path) -> bool:
    """Remove ``directory`` (a Pod's) once nothing is mounted below it, so that the removal cannot reach through a
    bind mount into the MPS server's files; False (and an error logged, the directory kept) if something stays
    mounted there."""
    left = release_mounts(mounter, directory)
    if left:
        log.error("CSI: kept %s: still mounted below it: %s; unmount them (umount -l) and remove it by hand",
                  directory, ", ".join(left))
        return False
    shutil.rmtree(directory, ignore_errors=True)  # its fd-based walk deletes links, never follows them
    return True
