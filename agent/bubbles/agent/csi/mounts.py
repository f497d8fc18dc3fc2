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
UMOUNT_NOFOLLOW = 0x8  # never unmount through a link planted at the target


class Mounter(Protocol):
    """What the plugin needs of the kernel (a fake could stand in; the tests use the real one, as root)."""

    def bind(self, source: str, target: str) -> None: ...
    def unmount(self, target: str) -> None: ...
    def is_mounted(self, target: str) -> bool: ...


class KernelMounter:
    """Bind mounts by system call; OSError (with errno) when the kernel refuses."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                                     ctypes.c_void_p]
        self._libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def bind(self, source: str, target: str) -> None:
        # Not MS_REC: what is mounted below the source (nothing, normally) stays out of the Pod.
        if self._libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            hint = " (the agent needs CAP_SYS_ADMIN: run it privileged)" if err == errno.EPERM else ""
            raise OSError(err, f"cannot bind-mount {source} at {target}: {os.strerror(err)}{hint}")

    def unmount(self, target: str) -> None:
        if self._libc.umount2(os.fsencode(target), UMOUNT_NOFOLLOW) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot unmount {target}: {os.strerror(err)}")

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
