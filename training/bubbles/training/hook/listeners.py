"""The hook's edge: non-blocking datagrams to every ``*.sock`` listener of a stage directory (the agent and armed fill
jobs). A missing or dead listener is dropped, a full one loses that datagram; nothing here blocks or raises OSError."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from bubbles.core import paths

_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.EPROTOTYPE,
                          errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR})
_FULL_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})
MAX_LISTENERS = 16  # sockets a stage's signals go to, the agent's among them (see Listeners._refresh)


class Listeners:
    """The ``*.sock`` endpoints of one stage directory and of its ``fills/`` (``paths``); ``send`` never blocks
    and never raises OSError. Fill sockets in the stage directory itself (where agents that predate card v3 had
    fill jobs bind them) are listeners too."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fills = directory / paths.FILLS_DIR_NAME
        self._agent_path = str(directory / paths.AGENT_SOCKET_NAME)  # the agent's: a name in fills/ is a fill's
        # Two sending sockets: datagrams queued at a receiver count against the sender's buffer until read, so fill
        # processes that stopped reading (26 of them were enough) would otherwise leave no room for the agent's.
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        try:
            self._agent_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            self._sock.close()
            raise
        self._agent_sock.setblocking(False)
        # With device timing the event thread sends BUBBLE_START/END while the training's thread sends the
        # rest; uncontended, the lock costs a fraction of a microsecond.
        self._lock = threading.Lock()
        self._mtime: tuple[tuple[int, int], tuple[int, int] | None] | None = None
        self._targets: tuple[str, ...] = ()
        # path -> identity (inode, ctime) of a dropped listener's file, so a dead listener's leftover
        # socket file is not taken back on every re-listing while a re-bound one is
        self._gone: dict[str, tuple[int, int]] = {}
        self.sent = 0
        self.dropped = 0  # datagrams lost to a full queue
        self.removed = 0  # listeners dropped as gone
        self.ignored = 0  # fill sockets left out past MAX_LISTENERS

    @property
    def targets(self) -> tuple[str, ...]:
        return self._targets

    def refresh(self, greeting: Callable[[], Sequence[bytes]] | None = None) -> list[str]:
        """Re-list the directory if its mtime changed; return listeners that appeared since last time. Each of them
        gets ``greeting()``'s datagrams first: they go out under the lock every other send takes, so nothing the event
        thread sends (an ITERATION, a BUBBLE_START) reaches a new listener before its bubble profile."""
        with self._lock:
            new = self._refresh()
            if new and greeting is not None:
                for data in greeting():
                    self._send(data, new)
            return new

    def _is_agent(self, path: str) -> bool:
        return path == self._agent_path

    def _refresh(self) -> list[str]:
        try:
            st = os.stat(self.directory)
        except OSError:
            self._mtime = None
            return []
        try:
            # Not followed: fills/ replaced by a link would have the training list (and send into) another directory.
            fst = os.stat(self.fills, follow_symlinks=False)
            fills = (fst.st_mtime_ns, fst.st_ino) if stat.S_ISDIR(fst.st_mode) else None
        except OSError:
            fills = None
        stamp = ((st.st_mtime_ns, st.st_ino), fills)
        if stamp == self._mtime:
            return []
        self._mtime = stamp
        found: dict[str, tuple[int, int]] = {}
        try:
            for directory in (self.directory, self.fills) if fills is not None else (self.directory,):
                with os.scandir(directory) as it:
                    for entry in it:
                        if entry.name.endswith(paths.SOCKET_SUFFIX):
                            est = entry.stat(follow_symlinks=False)
                            # Sockets only: a link would have sendto resolve its target in the training's file system.
                            if stat.S_ISSOCK(est.st_mode):
                                found[entry.path] = (est.st_ino, est.st_ctime_ns)
        except OSError:
            self._mtime = None  # listed again at the next refresh, not only when the directory changes again
            return []
        self._gone = {p: ino for p, ino in self._gone.items() if found.get(p) == ino}
        known = set(self._targets)
        new = sorted(p for p in found if p not in known and p not in self._gone)
        # Every listener costs each signal a sendto on the training's path: the agent always, fill sockets up to
        # MAX_LISTENERS in all (a stage runs one fill job at a time: more are leftovers, or a fill job's mischief).
        kept = [p for p in self._targets if p in found]
        room = max(0, MAX_LISTENERS - 1 - sum(not self._is_agent(p) for p in kept))
        fresh = [p for p in new if not self._is_agent(p)]
        if len(fresh) > room:
            self.ignored += len(fresh) - room
            left_out = set(fresh[room:])
            new = [p for p in new if p not in left_out]
        # Fill jobs first: they start work on a BUBBLE_START, while the agent only keeps accounts and its
        # watchdog; the agent's sendto must not delay the fill job's wake-up.
        self._targets = tuple(sorted((*kept, *new), key=self._is_agent))
        return new

    def send(self, data: bytes, targets: Sequence[str] | None = None) -> None:
        with self._lock:
            self._send(data, self._targets if targets is None else targets)

    def _send(self, data: bytes, targets: Sequence[str]) -> None:
        for path in targets:
            try:
                (self._agent_sock if self._is_agent(path) else self._sock).sendto(data, path)
                self.sent += 1
            except OSError as exc:
                if exc.errno in _FULL_ERRNOS:
                    self.dropped += 1
                else:  # gone (ENOENT, ECONNREFUSED) or not ours to write to: stop trying
                    self._drop(path)

    def _drop(self, path: str) -> None:
        if path not in self._targets:
            return
        self._targets = tuple(p for p in self._targets if p != path)
        self.removed += 1
        if self.ignored:
            self._mtime = None  # sockets left out past MAX_LISTENERS: listed again, one may have room now
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            self._gone[path] = (st.st_ino, st.st_ctime_ns)

    def close(self) -> None:
        with self._lock:
            self._sock.close()
            self._agent_sock.close()
            self._targets = ()

