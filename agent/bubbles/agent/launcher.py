"""How the agent starts fill processes: a ``Launcher`` interface and ``ProcessLauncher``, local subprocesses.

In cluster mode the launcher is ``bubbles.agent.cluster.AttachLauncher``: it starts nothing and hands over
the fill Pod's process that attached to the agent, whose environment is the Pod's, set by the operator. The
executor only sees ``FillProcess``. What isolates a locally started fill process from the training (MPS client
variables, a private MPS pipe directory) comes from ``bubbles.agent.isolation`` as ``LaunchRequest.env``:
``ProcessLauncher`` only passes it on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core import control
from bubbles.core.api import FillInterface, FillJobSpec


@dataclass(frozen=True)
class LaunchRequest:
    spec: FillJobSpec
    socket_path: Path  # fill-<job>.sock the job binds while armed
    device: str = "cpu"  # "cpu" or "cuda:N"
    core: int | None = None  # CPU core to pin to; None: no pinning
    env: dict[str, str] = field(default_factory=dict)  # from the isolation mode (Isolation.client_env)
    # A gang's member (FillJobSpec.gpus > 1): its place, the gang's size and rendezvous port; None for a single job.
    gang_rank: int | None = None
    gang_size: int = 1
    gang_port: int | None = None


class FillProcess(ABC):
    """A running fill job as the executor sees it."""

    pid: int
    control: socket.socket | None  # the agent's end of the control channel; None for plain commands
    exit_fd: int  # becomes readable when the process exits (a pidfd)

    @abstractmethod
    def send_signal(self, sig: int) -> None: ...

    @abstractmethod
    def poll(self) -> int | None:
        """Exit code if the process has exited, else None."""

    @abstractmethod
    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the exit; the exit code or None."""

    @abstractmethod
    def close(self) -> None:
        """Release the descriptors (after the process has exited)."""

    def before_command(self, type_: str, fields: dict[str, Any]) -> None:  # noqa: B027 - a default, not abstract
        """The agent is about to send ``type_`` (a ``bubbles.core.control`` command) to this process. Nothing here; a
        process whose fill sockets the agent holds (``bubbles.agent.cluster.AttachedProcess``, control v5) makes their
        paths appear before an ``arm`` and go before a ``disarm``. Never raises."""

class Launcher(ABC):
    @abstractmethod
    def launch(self, request: LaunchRequest) -> FillProcess:
        """Start the fill job's process; raise OSError if it cannot start."""

class LocalProcess(FillProcess):
    def __init__(self, popen: subprocess.Popen[bytes], ctrl: socket.socket | None) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.control = ctrl
        self.exit_fd = os.pidfd_open(popen.pid)
        self._group_ended = False

    # The process leads a process group of its own (start_new_session), and what it starts joins it: a wrapper's
    # children (sh -c, torchrun, multiprocessing) are paused, resumed and killed with it. Until the leader is reaped
    # its PID cannot be reused, and after that it stays allocated while any member of its group lives: signalling
    # the group by that number reaches no one else.

    def send_signal(self, sig: int) -> None:
        if self.popen.returncode is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:  # no member this user may signal (a setuid child): the leader at least
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self.exit_fd, sig)

    def poll(self) -> int | None:
        if self.popen.returncode is None and self._exited(0.0):
            self._end_group()
        return self.popen.poll()

    def wait(self, timeout_s: float) -> int | None:
        if self.popen.returncode is None:
            if not self._exited(timeout_s):
                return None
            self._end_group()
        return self.popen.wait()  # exited: at once

    def _exited(self, timeout_s: float) -> bool:
        """Whether the leader has exited, without reaping it: until it is reaped its PID, and so its group's number,
        cannot be taken by another process."""
        if self.exit_fd < 0:  # closed: the plain way
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        return bool(select.select([self.exit_fd], [], [], timeout_s)[0])

    def _end_group(self) -> None:
        """The leader has exited, not yet reaped: what it left running in its group (holding memory, a GPU) goes too.
        A child that left the group (setsid, setpgid) is not found this way."""
        if not self._group_ended:
            self._group_ended = True
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
            self.exit_fd = -1

class ProcessLauncher(Launcher):
    """Fill jobs as child processes: ``python -m bubbles.sdk`` with an inherited socketpair end.

    An imperative job (``command`` argv, or an ImperativeFillJob ``entry``) gets no control channel:
    the agent pauses and resumes it with SIGSTOP/SIGCONT only. Pinning is applied right after the
    start and, for SDK jobs, again by the runtime before torch starts its threads.
    """

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def launch(self, request: LaunchRequest) -> FillProcess:
        spec = request.spec
        env = dict(os.environ)
        env.update(request.env)
        env[control.JOB_ENV] = spec.name
        env[control.SOCKET_ENV] = str(request.socket_path)
        env[control.DEVICE_ENV] = request.device
        env[control.MEMORY_ENV] = str(spec.memory_bytes)
        if spec.gating_step_s is not None:
            env[control.STEP_S_ENV] = repr(spec.gating_step_s)
        if spec.steps is not None:
            env[control.MAX_STEPS_ENV] = str(spec.steps)
        if request.core is not None:
            env[control.CORE_ENV] = str(request.core)
        if request.gang_rank is not None:
            env[control.GANG_RANK_ENV] = str(request.gang_rank)
            env[control.GANG_SIZE_ENV] = str(request.gang_size)
            env[control.GANG_PORT_ENV] = str(request.gang_port)
        else:  # not a gang's, whatever the agent's own environment says
            for name in (control.GANG_RANK_ENV, control.GANG_SIZE_ENV, control.GANG_PORT_ENV):
                env.pop(name, None)
        ours: socket.socket | None = None
        theirs: socket.socket | None = None
        pass_fds: tuple[int, ...] = ()
        if spec.command:
            argv = list(spec.command)
        elif spec.interface is FillInterface.IMPERATIVE:
            # Paused and resumed from outside only: no control channel.
            assert spec.entry is not None
            argv = [self.python, "-m", "bubbles.sdk", "--entry", spec.entry, "--args", json.dumps(spec.args)]
        else:
            assert spec.entry is not None
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            env[control.CONTROL_FD_ENV] = str(theirs.fileno())
            argv = [self.python, "-m", "bubbles.sdk", "--entry", spec.entry, "--args", json.dumps(spec.args)]
            pass_fds = (theirs.fileno(),)
        try:
            popen = subprocess.Popen(argv, env=env, pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        except OSError:
            if ours is not None:
                ours.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()
        if request.core is not None:
            # If this fails (exited already, or the core is not ours) the runtime pins itself too.
            with contextlib.suppress(OSError):
                os.sched_setaffinity(popen.pid, {request.core})
        # The OOM killer's first choice, before the training (control.FILL_OOM_SCORE_ADJ; the SDK sets it too, from
        # inside, and a process that exited already has nothing to set).
        with contextlib.suppress(OSError):
            Path(f"/proc/{popen.pid}/oom_score_adj").write_text(str(control.FILL_OOM_SCORE_ADJ))
        if ours is not None:
            ours.setblocking(False)
        return LocalProcess(popen, ours)

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: where a gang's processes meet (its leader listens there
    once its init begins; a port taken meanwhile fails the gang's init, and the job says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_device(executor: int, pin: bool) -> tuple[str, int | None]:
    """CPU: executor k stands in for a stage's accelerator on core k % cpu_count (when pinning)."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[executor % len(cores)]
    return f"cpu:{core}", (core if pin else None)


_CUDA_DEVICE = re.compile(r"^cuda:(0|[1-9][0-9]{0,3})$")


def parse_devices(text: str) -> tuple[str, ...]:
    """``--devices``: comma-separated ``cpu`` or ``cuda:N`` entries; ValueError saying what is wrong."""
    entries = [e.strip() for e in text.split(",")]
    if not text.strip() or any(not e for e in entries):
        raise ValueError(f"--devices must be a comma-separated list of cpu or cuda:N entries (e.g. cuda:0,cuda:1), "
                         f"got {text!r}")
    for e in entries:
        if e != "cpu" and not _CUDA_DEVICE.match(e):
            hint = " (write cuda:0: the GPU index is required)" if e in ("cuda", "gpu") else ""
            raise ValueError(f"--devices entry {e!r} is neither cpu nor cuda:N with N a GPU index{hint}")
    return tuple(entries)


def assign_device(executor: int, devices: Sequence[str], pin: bool) -> tuple[str, int | None]:
    """Executor k's device: ``devices[k % len(devices)]``; a ``cpu`` entry (or no list) is ``default_device``.

    A CUDA device needs no core pinning: the GPU, not a core, is what the fill job shares with the stage.
    """
    if not devices or devices[executor % len(devices)] == "cpu":
        return default_device(executor, pin)
    return devices[executor % len(devices)], None

