"""A gang's processes (a fill job over N GPUs of one stage, ``FillJobSpec.gpus``): their settings, how the leader tells
the others which steps to run, and a fill Pod's launcher of one process per GPU.

Every process of a gang does collectives with the others, so each step must run in all of them or in none: a step
that one process takes and another does not waits in its collective until the other's next step, bubbles later,
and the agent's watchdog kills it. Gates computed apart would disagree near a bubble's end (their clocks are read
microseconds apart, their step times learned apart). So one process decides: gang rank 0, the *leader*, gates on the
bubbles the N GPUs share (``bubbles.training.gating.GangGate`` over every GPU's fill socket) and, before each step it
takes, sends each *follower* a command to take it too (``encode_command``), over an abstract Unix datagram socket
named by the gang's port (``follower_address``); a follower runs exactly the steps it is told, and binds no fill
socket. The processes are all of one image, so this channel needs no version.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bubbles.core import control

STEP = 1  # run one step
PASS_END = 2  # the leader's pass over a bubble is over: report what ran (state PAUSED)
FLAG_TAIL = 1  # the step started past its bubble's predicted end (``gate: tail``)
FLAG_NAIVE = 2  # the step runs in naive mode (back to back, not in a bubble)
_COMMAND = struct.Struct("<BBqqi")  # kind, flags, bubble seq, signal ns, size (-1: none)
STOP_CHILDREN_S = 30.0  # how long the launcher's other processes have to exit after one failed, before SIGKILL


class GangBroken(RuntimeError):
    """The leader could not reach a follower: that process is gone, and the gang cannot step without it."""


@dataclass(frozen=True)
class GangSettings:
    """A gang process's place: its ``rank`` among ``size`` processes, and the ``port`` where they meet."""

    rank: int
    size: int
    port: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def gang_size(text: str) -> int:
    """``$BUBBLES_GANG_SIZE``: the gang's processes, 1 to ``control.MAX_GANG``."""
    try:
        size = int(text.strip())
    except ValueError:
        size = 0
    if not 1 <= size <= control.MAX_GANG:
        raise ValueError(f"${control.GANG_SIZE_ENV}={text!r}: give the GPUs of the gang, from 1 to {control.MAX_GANG} "
                         "(the fill job's gpus; the agent or the operator sets it)")
    return size


def gang_settings(environ: dict[str, str] | os._Environ[str] | None = None) -> GangSettings | None:
    """The gang settings in the environment; None for a single-GPU job (no ``$BUBBLES_GANG_SIZE``, or 1 without a
    rank). ValueError naming the variable and what to give where one is bad or missing."""
    env = os.environ if environ is None else environ
    size_text, rank_text = env.get(control.GANG_SIZE_ENV), env.get(control.GANG_RANK_ENV)
    if size_text is None:
        if rank_text is not None:
            raise ValueError(f"${control.GANG_RANK_ENV} is set but ${control.GANG_SIZE_ENV} is not: a gang process "
                             "needs both (the agent sets them)")
        return None
    size = gang_size(size_text)
    if rank_text is None:
        if size == 1:
            return None
        raise ValueError(f"${control.GANG_SIZE_ENV}={size} without ${control.GANG_RANK_ENV}: only a fill Pod's first "
                         "process (which starts one per GPU) runs so")
    try:
        rank = int(rank_text.strip())
    except ValueError:
        rank = -1
    if not 0 <= rank < size:
        raise ValueError(f"${control.GANG_RANK_ENV}={rank_text!r}: give the process's place in the gang, from 0 to "
                         f"{size - 1}")
    return GangSettings(rank, size, gang_port(env.get(control.GANG_PORT_ENV, "")))


def gang_port(text: str) -> int:
    """``$BUBBLES_GANG_PORT``: a TCP port on 127.0.0.1, 1 to 65535."""
    try:
        port = int(text.strip())
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ValueError(f"${control.GANG_PORT_ENV}={text!r}: give the TCP port (1 to 65535) on 127.0.0.1 where the "
                         "gang's processes meet (the agent picks a free one)")
    return port


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the gang's leader listens there soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CREDENTIALS_BYTES = struct.calcsize("3i")  # struct ucred: pid, uid, gid


def sender_uid(ancdata: Sequence[tuple[int, int, bytes]]) -> int | None:
    """The sending process's UID from a datagram's SCM_CREDENTIALS (the socket has SO_PASSCRED), or None."""
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= CREDENTIALS_BYTES:
            return int(struct.unpack("3i", payload[:CREDENTIALS_BYTES])[1])
    return None


def follower_address(port: int, rank: int) -> bytes:
    """Where follower ``rank`` of the gang meeting at ``port`` reads the leader's commands: an abstract Unix socket
    (no file to leave behind; the gang's processes share a network namespace, a Pod's or the node's)."""
    return f"\0bubbles-gang-{port}-{rank}".encode()


def encode_command(kind: int, bubble_seq: int, signal_ns: int, size: int | None, flags: int = 0) -> bytes:
    return _COMMAND.pack(kind, flags, bubble_seq, signal_ns, -1 if size is None else size)


def decode_command(data: bytes) -> tuple[int, int, int, int, int | None] | None:
    """``(kind, flags, bubble_seq, signal_ns, size)`` of a leader's command; None for anything else."""
    if len(data) != _COMMAND.size:
        return None
    kind, flags, seq, signal_ns, size = _COMMAND.unpack(data)
    if kind not in (STEP, PASS_END):
        return None
    return kind, flags, seq, signal_ns, None if size < 0 else size


def child_environments(environ: dict[str, str], size: int) -> list[dict[str, str]]:
    """A fill Pod's gang: the environment of each of its ``size`` processes, one per GPU the Pod sees: its gang rank,
    the gang's port, and on a GPU its own device (``CUDA_VISIBLE_DEVICES``: the i-th of the Pod's, as
    ``$BUBBLES_DEVICE`` ``cuda:0``). ValueError where the Pod sees fewer GPUs than the gang needs."""
    port = environ.get(control.GANG_PORT_ENV) or str(free_port())
    gang_port(port)
    device = environ.get(control.DEVICE_ENV, "cpu")
    cuda = control.cuda_device_index(device) is not None
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if cuda and visible and len(visible) < size:
        raise ValueError(f"the gang has {size} processes, one per GPU, but the Pod sees {len(visible)} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={','.join(visible)}): the operator mounts one per rank it placed")
    out = []
    for rank in range(size):
        env = dict(environ)
        env.update({control.GANG_RANK_ENV: str(rank), control.GANG_SIZE_ENV: str(size), control.GANG_PORT_ENV: port})
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = visible[rank] if visible else str(rank)
            env[control.DEVICE_ENV] = "cuda:0"
        out.append(env)
    return out


def run_gang(argv: Sequence[str], size: int) -> int:
    """A fill Pod's ``python -m bubbles.sdk`` for a gang: one child per GPU (``child_environments``), each attaching
    to the node's agent as its gang rank. Returns the first failure's exit status (the others are asked to stop with
    SIGTERM, and killed ``STOP_CHILDREN_S`` later), or 0 once every child exited cleanly. SIGTERM to this process goes
    to every child."""
    try:
        envs = child_environments(dict(os.environ), size)
    except ValueError as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 2
    children = [subprocess.Popen([sys.executable, "-m", "bubbles.sdk", *argv], env=env) for env in envs]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(OSError):
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    by_pid = {child.pid: (rank, child) for rank, child in enumerate(children)}
    code = 0
    while by_pid:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in by_pid:
            continue
        rank, child = by_pid.pop(pid)
        child.returncode = rc = os.waitstatus_to_exitcode(status)
        if rc == 0:
            continue
        code = rc if rc > 0 else 128 - rc  # killed by a signal: the shell's convention
        print(f"bubbles.sdk: gang rank {rank} exited with status {rc}: stopping the others", file=sys.stderr,
              flush=True)
        forward(signal.SIGTERM, None)
        deadline = time.monotonic() + STOP_CHILDREN_S
        for _, other in by_pid.values():
            try:
                other.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                other.kill()
                other.wait()
        break
    return code
