"""Fill sockets the agent binds for a fill process that attached through its Pod's own attach socket (control v5).

Such a process reaches nothing of the training's directory (its Pod mounts only its own CSI volume) and may run as any
UID, so it cannot bind its fill socket in the training's ``fills/`` as a process of the hostPath layout does. The agent
binds it there instead and passes the bound socket to the process with the ``welcome`` (SCM_RIGHTS); the process reads
the hook's datagrams on the descriptor, the path never in its reach.

Bound once per process, at its welcome, rather than at each ``arm``: the welcome is the one line the agent writes on a
blocking connection of its own, before the connection becomes the job's control channel, so the descriptors travel
with it in one sendmsg, and the agent's control stream (buffered, flushed by the training's agent loop) carries text
only. What each ``arm`` did when the process bound its socket, the agent does with a name: the socket is bound under a
parked name in the same ``fills/`` (``<fill socket>.parked``: not ``*.sock``, so the hook does not send to it), and
``link()`` makes the fill socket's own path a second name of it before an ``arm`` in harvest mode goes out; ``unlink()``
removes that name before a ``disarm`` or ``stop`` goes out, and ``remove()`` both names once the process is gone. The
hook finds the path appear and disappear as it did, its listing sees a new ctime at each link, and a datagram queued
before an ``arm`` is dropped by the process at that ``arm``.

Mode 0666: the training's process, whatever its UID, writes to it (sendto needs write permission on the socket); the
directory it is in is the training Pod's alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Collection, Sequence
from pathlib import Path

from bubbles.core import paths

log = logging.getLogger("bubbles.agent.cluster")

PARKED_SUFFIX = ".parked"  # the name the socket is bound under: not *.sock, so no listener of the hook's
SOCKET_MODE = 0o666


def parked_path(path: Path) -> Path:
    """Where the fill socket of ``path`` is bound while it is not armed."""
    return path.with_name(path.name + PARKED_SUFFIX)


class PassedFillSockets:
    """Datagram sockets bound by the agent at ``paths`` (parked), to be passed to one fill process; OSError saying
    which path could not be bound (nothing is left bound then)."""

    def __init__(self, sockets: Sequence[Path]) -> None:
        self.paths = tuple(sockets)
        self._socks: list[socket.socket] = []
        self._inodes: dict[Path, int] = {}
        try:
            for path in self.paths:
                # The length that matters is the hook's (the path in the training's mount): the agent binds through a
                # descriptor of the directory, whose path on the node is longer by _pods/<pod uid>.
                if (problem := paths.socket_path_problem(paths.as_the_pod_sees(path))) is not None:
                    raise OSError(problem)
                parked = parked_path(path)
                for stale in (parked, path):  # left by a process (or an agent) before this one
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socks.append(s)
                dir_fd = os.open(parked.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    s.bind(f"/proc/self/fd/{dir_fd}/{parked.name}")
                    os.chmod(f"/proc/self/fd/{dir_fd}/{parked.name}", SOCKET_MODE)
                    self._inodes[path] = os.stat(parked.name, dir_fd=dir_fd, follow_symlinks=False).st_ino
                except OSError as exc:
                    raise OSError(exc.errno, f"cannot bind the fill socket {parked}: {exc.strerror or exc}") from None
                finally:
                    os.close(dir_fd)
        except BaseException:
            self.remove()
            raise

    def fds(self) -> list[int]:
        """The descriptors to pass, in the order of ``paths``."""
        return [s.fileno() for s in self._socks]

    def release(self) -> None:
        """Close the agent's own copies once passed: the process holds the sockets now (the names stay the agent's)."""
        for s in self._socks:
            s.close()
        self._socks = []

    def link(self, wanted: Collection[str]) -> None:
        """Give each socket of ``wanted`` (fill socket paths, as ``arm`` names them) its fill socket's name; OSError
        where one cannot be linked. A path that is not one of these sockets is left alone."""
        for path in self.paths:
            if str(path) not in wanted or self._linked(path):
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # something left there (by an earlier process of the job): the hook drops it
            os.link(parked_path(path), path)

    def unlink(self) -> None:
        """Take the fill socket names away (the sockets stay bound, parked): the hook stops sending."""
        for path in self.paths:
            if self._linked(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def remove(self) -> None:
        """Both names gone, and the agent's copies closed: the process is gone or was never welcomed."""
        self.unlink()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(parked := parked_path(path)).st_ino == self._inodes.get(path):
                    parked.unlink()
        self.release()

    def _linked(self, path: Path) -> bool:
        """Whether ``path`` is a name of this object's socket (not another's, bound there since)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inodes.get(path)

    def apply(self, command: str, fields: dict[str, object]) -> None:
        """Before the agent sends ``command`` to the process: link the paths an ``arm`` in harvest mode names, unlink
        them before anything else that ends listening (``arm`` in naive mode, ``disarm``, ``stop``). Never raises: a
        path that cannot be linked leaves the process armed without signals, and says so."""
        try:
            if command == "arm" and fields.get("mode") == "harvest":
                named = fields.get("sockets") or [fields.get("socket")]
                self.link({p for p in named if isinstance(p, str)} if isinstance(named, list) else set())
            elif command in ("arm", "disarm", "stop"):
                self.unlink()
        except OSError as exc:
            log.error("fill sockets %s: cannot %s them for %s: %s", ", ".join(map(str, self.paths)),
                      "link" if command == "arm" else "unlink", command, exc)
