"""Bind mounts through mount(2) and umount2(2) (ctypes), so the agent's image needs no mount(8).

The agent must be allowed to mount (CAP_SYS_ADMIN: a privileged container, as every CSI node plugin is), and for the
kubelet to see the mount, the kubelet's directory must reach the agent's container with ``mountPropagation:
Bidirectional`` (the chart's job, next step of issue 36).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Protocol

MS_BIND = 0x1000  # <sys/mount.h>
MS_REC = 0x4000
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8  # never unmount through a link planted at the target


class Mounter(Protocol):
    """What the plugin needs of the kernel (a fake could stand in; the tests use the real one, as root)."""

    def bind(self, source: str, target: str, recursive: bool = False) -> None: ...
    def unmount(self, target: str) -> None: ...
    def detach(self, target: str) -> None: ...
    def is_mounted(self, target: str) -> bool: ...
    def mounts_below(self, path: str) -> list[str]: ...


class KernelMounter:
    """Bind mounts by system call; OSError (with errno) when the kernel refuses."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                                     ctypes.c_void_p]
        self._libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def bind(self, source: str, target: str, recursive: bool = False) -> None:
        """Bind ``source`` at ``target``; ``recursive`` (MS_REC): with what is mounted below ``source`` (a Pod's
        directory with the MPS directories in it), else without it."""
        flags = MS_BIND | (MS_REC if recursive else 0)
        if self._libc.mount(os.fsencode(source), os.fsencode(target), None, flags, None) != 0:
            err = ctypes.get_errno()
            hint = " (the agent needs CAP_SYS_ADMIN: run it privileged)" if err == errno.EPERM else ""
            raise OSError(err, f"cannot bind-mount {source} at {target}: {os.strerror(err)}{hint}")

    def unmount(self, target: str) -> None:
        if self._libc.umount2(os.fsencode(target), UMOUNT_NOFOLLOW) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot unmount {target}: {os.strerror(err)}")

    def detach(self, target: str) -> None:
        """Detach the mount at ``target`` and what is mounted below it (MNT_DETACH: gone from the tree at once, freed
        once unused). Follows a link at ``target``: meant for ``/proc/self/fd/<fd>`` of a directory opened without
        following links, which names that directory and nothing else."""
        if self._libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot detach the mount at {target}: {os.strerror(err)}")

    def mounts_below(self, path: str) -> list[str]:
        """The mount points strictly below ``path`` as /proc/self/mountinfo lists them, deepest first (``path`` is
        resolved: give one with nothing a Pod can write above its last component)."""
        root = os.path.realpath(path).rstrip("/") + "/"
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            points = {p for p in (_unescape(line.split(" ")[4]) for line in f if line.count(" ") >= 5)
                      if p.startswith(root)}
        return sorted(points, key=lambda p: (-p.count("/"), p))

    def is_mounted(self, target: str) -> bool:
        """Whether something is mounted at ``target`` (a bind mount of a directory of the same file system too, which
        ``os.path.ismount`` misses): /proc/self/mountinfo lists it."""
        want = os.path.realpath(target)
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                return any(_unescape(line.split(" ")[4]) == want for line in f if line.count(" ") >= 5)
        except OSError:
            return os.path.ismount(target)


def _unescape(field: str) -> str:
    """A mountinfo path field: the kernel writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
