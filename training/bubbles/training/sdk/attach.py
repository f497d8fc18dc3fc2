"""A fill Pod's process joining the node's agent: over the attach socket, as an SDK job or as a plain command."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bubbles.core import control, paths, versions
from bubbles.training.probes import gpu_uuid


@dataclass
class Attached:
    """A fill process admitted by the node's agent: the connection (now the control channel), the agent's
    ``welcome``, and the fill sockets the agent passed with it (control v5: by their paths, in the training's
    ``fills/``, non-blocking; None where it passed none and the process binds its own, as over the node's socket)."""

    sock: socket.socket
    welcome: control.ControlMessage
    passed: dict[str, socket.socket] | None

    def close(self) -> None:
        self.sock.close()
        for s in (self.passed or {}).values():
            s.close()


def attach_to_agent(device: str, timeout_s: float = 30.0) -> tuple[socket.socket, control.ControlMessage]:
    """Connect to the node agent's attach socket, say who this process is (``$BUBBLES_FILL_JOB_UID``,
    ``$BUBBLES_FILL_ATTEMPT``, the GPU it sees) and return the connection (now the control channel) and the agent's
    ``welcome``; OSError or ValueError saying why the agent refused or could not be reached. Fill sockets the agent
    passed are closed: ``attach`` keeps them."""
    attached = attach(device, timeout_s)
    for s in (attached.passed or {}).values():
        s.close()
    return attached.sock, attached.welcome


def attach(device: str, timeout_s: float = 30.0) -> Attached:
    """``attach_to_agent``, keeping the fill sockets the agent passed with its welcome (a fill Pod's own attach
    socket, control v5); ValueError where the welcome says one number of them and another came."""
    path = paths.attach_socket(paths.default_run_dir())
    uid = os.environ.get(control.UID_ENV, "")
    try:
        attempt = int(os.environ.get(control.ATTEMPT_ENV, "0"))
    except ValueError:
        raise ValueError(f"${control.ATTEMPT_ENV} must be an integer (the operator sets it)") from None
    hello: dict[str, Any] = {"uid": uid, "attempt": attempt, "pid": os.getpid(), "protocol": control.VERSION}
    gang_rank = os.environ.get(control.GANG_RANK_ENV)
    if gang_rank is not None:  # a gang's process (checked by gang_settings before): which of its GPUs' it is
        hello["gang_rank"] = int(gang_rank)
    seen = gpu_uuid(device)
    if seen is not None:
        hello["gpu"] = seen
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    fds: list[int] = []
    passed: dict[str, socket.socket] | None = None
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise OSError(f"cannot reach the node's bubbles agent at {path} ({exc.strerror or exc}): is the agent "
                          f"running on this node, and is its run directory mounted at {path.parent}?") from None
        sock.sendall(control.encode("hello", **hello))
        # One line and not a byte more: the agent's first commands (init) may follow its welcome on the same stream
        # at once, and they are the control channel's to read. A byte at a time, once per process; descriptors the
        # agent passes come with the welcome's first byte.
        reply = bytearray()
        while not reply.endswith(b"\n"):
            chunk, got, flags, _ = socket.recv_fds(sock, 1, control.MAX_GANG)
            fds += got
            if flags & socket.MSG_CTRUNC:
                raise ValueError(f"the agent passed more than {control.MAX_GANG} descriptors with its reply")
            if not chunk:
                raise OSError("the node's bubbles agent closed the connection without answering")
            reply += chunk
            if len(reply) > control.MAX_LINE_BYTES:
                raise ValueError("the agent's reply is too long")
        msg = control.parse_reply(bytes(reply))
        if msg.type == "refused":
            raise ValueError(f"the node's bubbles agent refused this fill process: {msg['reason']}")
        if control.peer_version(msg) < control.MIN_VERSION:
            raise ValueError(versions.needs_newer("the node's bubbles agent", "control", control.peer_version(msg),
                                                  control.MIN_VERSION, "the chart (the operator and the agents)"))
        names = control.passed_sockets(msg)
        if len(fds) != len(names or ()):
            raise ValueError(f"the node's bubbles agent said it passed {len(names or ())} fill socket(s) with its "
                             f"welcome, but {len(fds)} came: a bug of the agent's; restart the fill Pod, and report it")
        passed = None
        if names is not None:
            passed = {}
            for name, fd in zip(names, list(fds), strict=True):
                s = socket.socket(fileno=fd)
                fds.remove(fd)
                passed[name] = s
                if s.family != socket.AF_UNIX or s.type != socket.SOCK_DGRAM:
                    raise ValueError(f"the node's bubbles agent passed fill socket {name} as a {s.family.name} "
                                     f"{s.type.name} socket, not a Unix datagram socket: a bug of the agent's")
                s.setblocking(False)
    except BaseException:
        sock.close()
        for fd in fds:
            os.close(fd)
        for s in (passed or {}).values():
            s.close()
        raise
    sock.settimeout(None)
    return Attached(sock, msg, passed)


def exec_attached(command: Sequence[str]) -> int:
    """``python -m bubbles.sdk --exec -- ARGV...``: a plain command as a fill Pod runs it. Attach to the node's
    agent (which then pauses and resumes this process around bubbles with SIGSTOP/SIGCONT), then become ``ARGV``
    (same process, so the agent's handle on it stays valid). Returns only on an error."""
    argv = list(command[1:] if command[:1] == ["--"] else command)
    if not argv:
        print("bubbles.sdk: --exec needs a command: python -m bubbles.sdk --exec -- PROGRAM ARGS...", file=sys.stderr)
        return 2
    if not os.environ.get(control.UID_ENV):
        print(f"bubbles.sdk: --exec runs a fill Pod's command; ${control.UID_ENV} (set by the operator) is missing",
              file=sys.stderr)
        return 2
    device = os.environ.get(control.DEVICE_ENV, "cpu")
    try:
        sock, _welcome = attach_to_agent(device)
    except (OSError, ValueError) as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 3
    sock.close()  # the agent holds its end; this process is its handle now
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"bubbles.sdk: cannot run {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 0  # not reached
