"""How fill processes are kept apart from the training on one node: the isolation modes and their health.

Three modes, chosen by the user (docs/gpu.md has the trade-off table):

- ``contexts`` (default): every fill job is a separate process with its own CUDA context, time-sliced
  by the GPU. A fatal GPU fault in a fill job kills only that job. Memory is capped per process by
  the SDK (the caching allocator's fraction). Fill processes get an empty private
  ``CUDA_MPS_PIPE_DIRECTORY`` so that they cannot join an MPS daemon that runs on the node.
- ``mps``: fill jobs are clients of the node's MPS control daemon (the training must be one too):
  kernels run concurrently and MPS enforces each client's pinned memory limit, but all clients of a
  server share one fault domain. The agent detects a running daemon or starts one, and supervises it.
- ``none``: explicit unisolated sharing; only the SDK's allocator cap applies.

An ``Isolation`` reports its raw health as an ``IsolationStatus``; the agent turns that into the
effective state (``effective_status``) and fails closed: no fill job starts unless the state is
``ready`` or, with ``--allow-unisolated`` or mode ``none``, ``unisolated``. ``start()`` and ``check()``
may block on subprocesses (bounded by timeouts): the agent calls ``check()`` from a supervisor thread,
never from its event loop. ``client_env()`` is cheap and thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bubbles.core import paths
from bubbles.core.api import MPS_CLIENT, NOT_MPS_CLIENT, DaemonStatus, IsolationMode, IsolationState, IsolationStatus
from bubbles.core.control import cuda_device_index
from bubbles.core.mps_client import DEFAULT_FILL_THREAD_PERCENTAGE, fill_client_env

from . import mps
from .core import effective_status as effective_status  # re-exported beside the backends

log = logging.getLogger("bubbles.agent.isolation")

READY = IsolationState.READY
UNAVAILABLE = IsolationState.UNAVAILABLE
RECOVERING = IsolationState.RECOVERING
UNISOLATED = IsolationState.UNISOLATED

NVIDIA_SMI = "nvidia-smi"
COMPUTE_MODE_QUERY = ("--query-gpu=index,compute_mode", "--format=csv,noheader")
_MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class IsolationConfig:
    mode: IsolationMode = IsolationMode.CONTEXTS
    allow_unisolated: bool = False
    mps_control: str | None = None  # None: nvidia-cuda-mps-control on PATH
    mps_pipe_dir: Path | None = None  # None: $CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps
    mps_log_dir: Path | None = None  # None: $CUDA_MPS_LOG_DIRECTORY or /var/log/nvidia-mps
    mps_thread_percentage: int = DEFAULT_FILL_THREAD_PERCENTAGE
    # own: start a control daemon when none answers (and stop it at exit if no client uses it); external: another
    # component runs it (in a cluster, the chart's mps-daemon DaemonSet: a daemon in the agent's container would die
    # with it, taking the trainings' MPS servers along, on every upgrade of the agent), and the agent never starts,
    # stops or kills one.
    mps_daemon: str = "own"
    check_interval_s: float = 1.0
    command_timeout_s: float = 2.0
    nvidia_smi: str | None = None  # None: nvidia-smi on PATH (not checked if absent)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", IsolationMode.parse(self.mode, "isolation mode"))
        if not 1 <= self.mps_thread_percentage <= 100:
            raise ValueError(f"MPS active thread percentage must be 1..100, got {self.mps_thread_percentage}")
        if self.mps_daemon not in ("own", "external"):
            raise ValueError(f"MPS daemon must be own or external, got {self.mps_daemon!r}")
        if not self.check_interval_s > 0:
            raise ValueError(f"isolation check interval must be > 0 s, got {self.check_interval_s}")
        if not self.command_timeout_s > 0:
            raise ValueError(f"isolation command timeout must be > 0 s, got {self.command_timeout_s}")





# -- GPU compute mode (nvidia-smi) ---------------------------------------------------------------------
def parse_compute_modes(text: str) -> dict[int, str]:
    """``{index: MODE}`` from ``nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader``.

    Modes are normalised to upper case with underscores (``DEFAULT``, ``EXCLUSIVE_PROCESS``, ``PROHIBITED``).
    """
    modes: dict[int, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        index, sep, mode = line.partition(",")
        if not sep or not index.strip().isdigit() or not mode.strip():
            raise ValueError(f"unexpected nvidia-smi line {line.strip()!r} (wanted 'index, compute_mode')")
        modes[int(index)] = mode.strip().upper().replace(" ", "_")
    return modes


def compute_mode_problem(modes: dict[int, str], indices: Sequence[int], *, allow_exclusive: bool) -> str | None:
    """Why these GPUs cannot host fill jobs next to the training in this mode; None if they can."""
    for i in sorted(set(indices)):
        mode = modes.get(i)
        if mode is None:
            listed = ", ".join(map(str, sorted(modes))) or "none"
            return f"no GPU with index {i} (nvidia-smi lists {listed}); fix --devices"
        if mode == "PROHIBITED":
            return (f"GPU {i} is in PROHIBITED compute mode: no process may create a CUDA context on it; set it to "
                    f"DEFAULT (nvidia-smi -i {i} -c DEFAULT) or remove cuda:{i} from --devices")
        if mode.startswith("EXCLUSIVE") and not allow_exclusive:
            return (f"GPU {i} is in {mode} compute mode: only one CUDA context may use it, so fill jobs cannot "
                    f"have contexts of their own next to the training; use --isolation mps (the training must "
                    f"then be a client of the same MPS daemon), or set the compute mode to DEFAULT "
                    f"(nvidia-smi -i {i} -c DEFAULT)")
    return None


class GpuModeCheck:
    """Checks the compute mode of the GPUs fill jobs use, with nvidia-smi if it is installed.

    Re-runs nvidia-smi at most every ``recheck_s`` (it takes a good fraction of a second on a busy node).
    """

    def __init__(self, indices: Sequence[int], nvidia_smi: str | None, *, allow_exclusive: bool,
                 timeout_s: float = 5.0, recheck_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.indices = sorted(set(indices))
        self.program = nvidia_smi
        self.allow_exclusive = allow_exclusive
        self.timeout_s = timeout_s
        self.recheck_s = recheck_s
        self.clock = clock
        self.modes: dict[int, str] = {}
        self.note = ""
        self._problem: str | None = None
        self._checked_at: float | None = None

    def problem(self) -> str | None:
        """Why the GPUs cannot be used (None if they can); ``note`` says what was checked."""
        if not self.indices:
            return None
        now = self.clock()
        if self._checked_at is not None and now - self._checked_at < self.recheck_s:
            return self._problem
        self._checked_at = now
        self._problem = self._query()
        return self._problem

    def _query(self) -> str | None:
        if self.program is None:
            self.note = "compute mode not checked (nvidia-smi not on PATH)"
            return None
        try:
            done = subprocess.run([self.program, *COMPUTE_MODE_QUERY], capture_output=True, text=True,
                                  timeout=self.timeout_s, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            return (f"nvidia-smi did not answer within {self.timeout_s:g} s; the GPU driver may be hung: check "
                    "the node (nvidia-smi)")
        except OSError as exc:
            return f"cannot run {self.program}: {exc.strerror or exc}"
        if done.returncode != 0:
            said = (done.stdout.strip() + " " + done.stderr.strip()).strip() or "no output"
            return (f"nvidia-smi exited with code {done.returncode} ({said}); the GPUs cannot be checked, so no "
                    "fill job starts: fix the driver or run without cuda devices")
        try:
            self.modes = parse_compute_modes(done.stdout)
        except ValueError as exc:
            return f"cannot read the GPUs' compute modes: {exc}"
        self.note = "compute mode " + ", ".join(f"GPU {i}: {self.modes.get(i, '?')}" for i in self.indices)
        return compute_mode_problem(self.modes, self.indices, allow_exclusive=self.allow_exclusive)


# -- isolation backends --------------------------------------------------------------------------------
class Isolation(ABC):
    """One isolation mode on this node. Subclasses: ``NoIsolation``, ``ContextsIsolation``, ``MpsIsolation``."""

    mode: IsolationMode

    def __init__(self) -> None:
        self._status_lock = threading.Lock()
        self._status = IsolationStatus(self.mode, UNAVAILABLE, "not started")

    @abstractmethod
    def start(self) -> IsolationStatus:
        """Set up (may start a daemon); blocks for a bounded time. Called once before fill jobs are admitted."""

    @abstractmethod
    def check(self) -> IsolationStatus:
        """Health check (and recovery); blocks for a bounded time. Called periodically off the event loop."""

    @abstractmethod
    def client_env(self, device: str, memory_bytes: int) -> dict[str, str]:
        """Environment for a fill process on ``device`` with a hard limit of ``memory_bytes``."""

    def close(self) -> None:  # noqa: B027 - a do-nothing default: most modes set up nothing to undo
        """Undo what ``start()`` set up (called once every fill process has stopped)."""

    def verify_client(self, pid: int, device: str) -> str | None:
        """None if the fill process ``pid``, which has initialized ``device``, is isolated as this mode promises;
        otherwise why not. May block for a bounded time: called off the event loop. Most modes have nothing to
        check beyond the environment they gave the process."""
        return None

    def training_membership(self, pid: int, device: str) -> str | None:
        """What the training's process ``pid`` (on ``device``, CUDA initialized) is to this mode's shared server:
        ``"client"``, ``"not a client: ..."`` saying what that costs and what to do, or None when nothing is to be
        told (a mode without a server, a CPU device, a daemon whose PID namespace is not this agent's). May block for
        a bounded time: called off the event loop. Said, never acted on: the fill jobs' own isolation holds either
        way."""
        return None

    def status(self) -> IsolationStatus:
        with self._status_lock:
            return self._status

    def _set(self, state: IsolationState, detail: str, daemon: DaemonStatus | None = None) -> IsolationStatus:
        with self._status_lock:
            epoch = self._status.epoch + (state == READY and self._status.state != READY)
            self._status = IsolationStatus(self.mode, state, detail, daemon, epoch)
            return self._status


class NoIsolation(Isolation):
    """Mode ``none``: fill jobs share the accelerator with no limits beyond the SDK's allocator cap."""

    mode = IsolationMode.NONE

    def start(self) -> IsolationStatus:
        return self._set(UNISOLATED, "isolation mode none: fill jobs share the accelerator unisolated, capped only "
                                     "by their allocator's memory fraction")

    def check(self) -> IsolationStatus:
        return self.status()

    def client_env(self, device: str, memory_bytes: int) -> dict[str, str]:
        return {}


class ContextsIsolation(Isolation):
    """Mode ``contexts``: separate processes and CUDA contexts, kept off any MPS daemon on the node."""

    mode = IsolationMode.CONTEXTS

    def __init__(self, private_pipe_dir: Path, gpu_check: GpuModeCheck) -> None:
        super().__init__()
        # A CUDA process joins MPS if a control daemon answers in $CUDA_MPS_PIPE_DIRECTORY (default
        # /tmp/nvidia-mps). Pointing fill processes at an empty directory of our own keeps them out of any
        # daemon on the node (the device plugin's, or one the training uses), so each has its own context.
        self.private_pipe_dir = private_pipe_dir
        self.gpu_check = gpu_check

    def start(self) -> IsolationStatus:
        try:
            paths.make_private_dir(self.private_pipe_dir)
        except OSError as exc:
            return self._set(UNAVAILABLE, f"cannot create the private MPS pipe directory {self.private_pipe_dir}: "
                                          f"{exc.strerror or exc}; check --run-dir")
        return self.check()

    def check(self) -> IsolationStatus:
        if (self.private_pipe_dir / mps.CONTROL_SOCKET).exists():
            return self._set(UNAVAILABLE, f"an MPS control daemon listens in {self.private_pipe_dir}, the empty "
                                          "directory meant to keep fill jobs off MPS; stop that daemon")
        problem = self.gpu_check.problem()
        if problem is not None:
            return self._set(UNAVAILABLE, problem)
        if not self.gpu_check.indices:
            return self._set(READY, "CPU devices: every fill job is a separate OS process")
        devices = ", ".join(f"cuda:{i}" for i in self.gpu_check.indices)
        return self._set(READY, f"separate CUDA contexts on {devices}, kept off MPS ({self.gpu_check.note})")

    def client_env(self, device: str, memory_bytes: int) -> dict[str, str]:
        return {mps.PIPE_ENV: str(self.private_pipe_dir)}


class MpsIsolation(Isolation):
    """Mode ``mps``: fill jobs are MPS clients with a pinned memory limit, a thread share and low priority.

    Uses a control daemon that already answers in the pipe directory (never stopping it), else starts one
    and owns it: restarts it with backoff if it dies, and quits it on ``close()``.
    """

    mode = IsolationMode.MPS

    def __init__(self, config: IsolationConfig, gpu_check: GpuModeCheck, fallback_log_dir: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.config = config
        self.gpu_check = gpu_check
        self.clock = clock
        self.thread_percentage = config.mps_thread_percentage
        pipe_dir = config.mps_pipe_dir or Path(os.environ.get(mps.PIPE_ENV) or mps.DEFAULT_PIPE_DIR)
        log_dir = config.mps_log_dir or Path(os.environ.get(mps.LOG_ENV) or mps.DEFAULT_LOG_DIR)
        mps.check_pipe_dir(pipe_dir)  # before creating anything
        if config.mps_daemon != "external" and not _writable_dir(log_dir):  # external: no daemon of ours logs
            log.warning("MPS log directory %s is not writable; the daemon logs to %s instead", log_dir,
                        fallback_log_dir)
            log_dir = fallback_log_dir
        program = mps.resolve_program(config.mps_control)
        self.missing = "" if program else (
            f"{mps.CONTROL_PROGRAM} not found on PATH; install the NVIDIA driver's utilities, pass --mps-control "
            "PATH, or choose --isolation contexts")
        self.control = mps.MpsControl(program or mps.CONTROL_PROGRAM, pipe_dir, log_dir, config.command_timeout_s)
        self.owned = False
        self.external = self.daemon_external  # the daemon we use was started by someone else (e.g. the device plugin)
        self.pid: int | None = None
        self.restarts = 0
        self.started_once = False
        self.attempts = 0  # failed start attempts since the last success
        self.next_attempt = 0.0
        self.backoff_s = 0.5

    def client_env(self, device: str, memory_bytes: int) -> dict[str, str]:
        # The fill Pods the operator makes get the same (mps_client.fill_client_env), with the device as they see it.
        return {**self.control.env(), **fill_client_env(self.control.pipe_dir, self.thread_percentage,
                                                         cuda_device_index(device), memory_bytes)}

    def _daemon(self) -> DaemonStatus:
        return DaemonStatus(self.owned, self.pid, self.restarts, str(self.control.pipe_dir))

    def start(self) -> IsolationStatus:
        if self.missing:
            return self._set(UNAVAILABLE, self.missing)
        problem = self.gpu_check.problem()
        if problem is not None:
            return self._set(UNAVAILABLE, problem)
        try:
            self.control.server_list()
        except mps.MpsError as exc:
            if self.daemon_external:
                return self._set(UNAVAILABLE, self._no_external_daemon(exc))
            log.info("no MPS control daemon answers in %s (%s): starting one", self.control.pipe_dir, exc)
            if not self._try_start():
                return self.status()
        else:
            self.owned, self.external = False, True
            self.pid = self.control.daemon_pid()
            log.info("using the MPS control daemon already running in %s (pid %s); this agent will not stop it",
                     self.control.pipe_dir, self.pid)
        return self._ready()

    def check(self) -> IsolationStatus:
        if self.missing:
            return self.status()
        problem = self.gpu_check.problem()
        if problem is not None:
            return self._set(UNAVAILABLE, problem, self._daemon())
        previous = self.status()
        try:
            self.control.server_list()
        except mps.MpsError as exc:
            return self._lost_or_retry(previous, exc)
        if previous.state != READY:
            pid = self.control.daemon_pid()
            if not self.owned or self.pid != pid:
                # Answering, but not the daemon we started: someone else runs it now.
                self.owned, self.external, self.pid = False, True, pid
            log.info("MPS control daemon in %s answers again (pid %s)", self.control.pipe_dir, self.pid)
            return self._ready()
        return previous

    def close(self) -> None:
        """Stop the daemon this agent started, unless a client (the training) still uses it: then leave it
        running and say so. ``quit`` makes the daemon refuse new clients and, if it does not answer, killing it
        would take its servers and their clients down: neither may happen under a live training. Call it after
        the agent's fill processes have stopped."""
        if not self.owned:
            return
        try:
            clients = self.live_clients()
        except mps.MpsError as exc:
            # Not answering: whether a training still uses its servers cannot be known, so it is not killed.
            log.warning("left the MPS control daemon in %s (pid %s) as it is: it does not answer (%s), so whether a "
                        "training still uses it is unknown; stop it by hand once none does", self.control.pipe_dir,
                        self.pid, exc)
            self.owned = False
            self._set(UNAVAILABLE, f"stopped; the MPS control daemon (pid {self.pid}) did not answer and was left "
                                   "as it is", self._daemon())
            return
        if clients:
            log.warning("left the MPS control daemon in %s (pid %s) running: its servers still have clients (pids "
                        "%s), e.g. the training; stop it once they have exited: echo quit | %s", self.control.pipe_dir,
                        self.pid, ", ".join(map(str, clients)), self.control.program)
            self.owned = False
            self._set(UNAVAILABLE, f"stopped; the MPS control daemon (pid {self.pid}) was left running for its "
                                   f"clients (pids {', '.join(map(str, clients))})", self._daemon())
            return
        try:
            self.control.quit()
            log.info("stopped the MPS control daemon this agent started (pid %s)", self.pid)
        except mps.MpsError as exc:
            # It answered a moment ago with no client left: nothing runs on its servers that killing could hurt.
            if self.pid is not None and self.control.kill_daemon(self.pid):
                log.warning("the MPS control daemon (pid %s) did not quit (%s): killed it", self.pid, exc)
        self.owned = False
        self._set(UNAVAILABLE, "stopped", self._daemon())

    def verify_client(self, pid: int, device: str) -> str | None:
        """Whether ``pid`` is a client of one of the daemon's servers (``get_client_list``). A process joins MPS only
        if, when it initialized CUDA, the daemon answered in its ``$CUDA_MPS_PIPE_DIRECTORY`` and (in a Pod) it shared
        the daemon's /dev/shm; otherwise it runs in a context of its own, with none of the limits it was admitted under.
        The daemon lists PIDs as its own PID namespace numbers them: a PID missing from its lists is refused only when
        that namespace is this agent's (the daemon this agent started, or a process of ours by its pid file; in
        cluster mode the agent has the host's), and said otherwise. ``mps.MpsError`` when the daemon does not answer
        (the check could not be made)."""
        if cuda_device_index(device) is None:
            return None  # nothing to join on a CPU device
        listed = self._membership(pid)
        if listed is None:
            return None
        if not self._daemon_is_ours():
            log.warning("fill process %d is not among the clients of the MPS daemon in %s (%s); that daemon does not "
                        "run in this agent's PID namespace and may list PIDs of another, so the process was not "
                        "refused", pid, self.control.pipe_dir, listed)
            return None
        return (f"process {pid} is not a client of the MPS server in {self.control.pipe_dir} ({listed}), so it runs "
                "without its pinned memory limit and SM share. It must initialize CUDA with $CUDA_MPS_PIPE_DIRECTORY "
                "set to that directory, after the daemon started; a fill Pod also needs that directory and the "
                "agent's /dev/shm directory mounted (the operator's --fill-mps-pipe-dir and --fill-mps-shm-dir, set "
                "by the chart when agent.isolation is mps)")

    def training_membership(self, pid: int, device: str) -> str | None:
        if cuda_device_index(device) is None or not self._daemon_is_ours():
            return None  # nothing to join on a CPU; a daemon of another PID namespace lists PIDs we cannot compare
        listed = self._membership(pid)
        if listed is None:
            return MPS_CLIENT
        return (f"{NOT_MPS_CLIENT}: the training's process {pid} is not a client of the MPS server in "
                f"{self.control.pipe_dir}. It runs in a CUDA context of its own, so the GPU time-slices between it "
                "and the fill jobs instead of running their kernels beside its own at a lower priority: harvesting "
                "still stops at each bubble's end, but fill steps cost the training more. Start the training after "
                "the agent's MPS daemon, with $CUDA_MPS_PIPE_DIRECTORY set to that directory and the same UID (in a "
                "Pod: the chart's agent.mps.pipeDir and agent.mps.shmDir mounted, as "
                f"examples/cluster/training-pod.yaml shows). The daemon lists: {listed[:500]}")

    def _membership(self, pid: int) -> str | None:
        """None if ``pid`` is a client of one of the daemon's servers; else the servers and clients listed, for a
        message. ``mps.MpsError`` when the daemon does not answer."""
        clients = self.control.clients()
        if any(pid in pids for pids in clients.values()):
            return None
        return "; ".join(f"server {server}: {', '.join(map(str, pids)) or 'no clients'}"
                         for server, pids in sorted(clients.items())) or "no server running"

    def _daemon_is_ours(self) -> bool:
        """Whether the daemon runs in this agent's PID namespace, so that the PIDs it lists are ours: the daemon this
        agent started, or one it finds a process of its own by the daemon's pid file."""
        daemon = self.control.daemon_pid()
        return daemon is not None and ((self.owned and daemon == self.pid) or _is_our_mps_daemon(daemon))

    def live_clients(self) -> list[int]:
        """The PIDs of the processes connected to the daemon's servers that are still alive."""
        pids = sorted({pid for clients in self.control.clients().values() for pid in clients})
        return [pid for pid in pids if _alive(pid)]

    # -- internals ---------------------------------------------------------------------------------
    def _ready(self) -> IsolationStatus:
        who = "started by this agent" if self.owned else "not started by this agent"
        detail = f"MPS control daemon in {self.control.pipe_dir} (pid {self.pid}, {who})"
        with contextlib.suppress(mps.MpsError):
            default = self.control.default_thread_percentage()
            if default is not None and default < 100:
                # A default applies to every client of the server, the training included.
                log.warning("the MPS daemon's default active thread percentage is %g%%: the training, an MPS client "
                            "too, is held to it as well", default)
                detail += f"; daemon default active thread percentage {default:g}%"
        return self._set(READY, detail, self._daemon())

    @property
    def daemon_external(self) -> bool:
        """--mps-daemon external: never start, stop or kill a daemon."""
        return self.config.mps_daemon == "external"

    def _no_external_daemon(self, exc: mps.MpsError) -> str:
        return (f"no MPS control daemon answers in {self.control.pipe_dir} ({exc}); with --mps-daemon external "
                "another component runs it (with the chart, the mps-daemon DaemonSet's Pod on this node: kubectl "
                "get pods -l app.kubernetes.io/component=mps-daemon -A); fill jobs wait until it answers")

    def _try_start(self) -> bool:
        """Start a daemon we will own; on failure schedule the next attempt with exponential backoff."""
        now = self.clock()
        if self.owned and self.pid is not None:
            # Ours, but not answering: a new daemon will not start while it holds the socket. Slow is not hung,
            # though (a server's start-up is a cuInit and a context: seconds on a busy node), and killing it would
            # take its servers down with it, and with them their clients, the training among them: while any server
            # of it lives, it is left alone and looked at again later.
            servers = self.control.servers_alive(self.pid)
            if servers:
                self.next_attempt = now + self.backoff_s
                self.backoff_s = min(_MAX_BACKOFF_S, self.backoff_s * 2)
                detail = (f"the MPS control daemon in {self.control.pipe_dir} (pid {self.pid}) does not answer, but "
                          f"its server(s) (pids {', '.join(map(str, servers))}) still run, perhaps for the training: "
                          "it is not killed; fill jobs wait until it answers again. If it never does, restart it by "
                          "hand once no training uses it")
                log.error("%s", detail)
                self._set(RECOVERING, detail, self._daemon())
                return False
            self.control.kill_daemon(self.pid)
        try:
            pid = self.control.start_daemon(ready_timeout_s=max(5.0, self.config.command_timeout_s))
        except mps.MpsError as exc:
            self.attempts += 1
            self.next_attempt = now + self.backoff_s
            state = RECOVERING if self.started_once else UNAVAILABLE
            what = "restart" if self.started_once else "start"
            detail = (f"cannot {what} the MPS control daemon in {self.control.pipe_dir} (attempt {self.attempts}: "
                      f"{exc}); retrying in {self.backoff_s:g} s; fix the daemon or choose --isolation contexts")
            log.error("%s", detail)
            self.backoff_s = min(_MAX_BACKOFF_S, self.backoff_s * 2)
            self._set(state, detail, self._daemon())
            return False
        if self.started_once:
            self.restarts += 1
            log.warning("restarted the MPS control daemon in %s (pid %s, restart %d)", self.control.pipe_dir, pid,
                        self.restarts)
        else:
            log.info("started the MPS control daemon in %s (pid %s); it is stopped when the agent exits",
                     self.control.pipe_dir, pid)
        self.started_once = True
        self.owned, self.external = True, False
        self.pid = pid
        self.attempts = 0
        self.backoff_s = 0.5
        return True

    def _lost_or_retry(self, previous: IsolationStatus, exc: mps.MpsError) -> IsolationStatus:
        if previous.state == READY:
            detail = f"MPS control daemon in {self.control.pipe_dir} (pid {self.pid}) stopped answering: {exc}"
            log.error("isolation lost: %s", detail)
            self.next_attempt = self.clock()  # restart at the next check, once the agent has seen the loss
            return self._set(RECOVERING, detail, self._daemon())
        if self.daemon_external and previous.state == UNAVAILABLE:
            return self._set(UNAVAILABLE, self._no_external_daemon(exc))  # none has answered yet
        if self.external:
            return self._set(RECOVERING, f"the MPS control daemon in {self.control.pipe_dir} was not started by this "
                                         f"agent and does not answer ({exc}); waiting for its owner to restart it",
                             self._daemon())
        if self.clock() < self.next_attempt:
            return previous
        if self._try_start():
            return self._ready()
        return self.status()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process (the training may run as another user)
    return True


def _is_our_mps_daemon(pid: int) -> bool:
    """Whether ``pid``, as the daemon's pid file has it, is an MPS control daemon in this process's PID namespace (so
    the PIDs it lists are ours): the process of that number here is the control program, in our namespace."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        same_ns = os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except OSError:
        return False
    return same_ns and b"nvidia-cuda-mps-control" in cmdline


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def make_isolation(config: IsolationConfig, devices: Sequence[str], agent_dir: Path) -> Isolation:
    """The backend for ``config.mode``; ``agent_dir`` (``<run_dir>/<namespace>/<training>``) holds its private
    directories.

    Raises ValueError for a configuration that cannot work (e.g. an MPS pipe directory that is too long).
    """
    indices = [i for d in devices if (i := cuda_device_index(d)) is not None]
    program = config.nvidia_smi
    if program is None:
        import shutil

        program = shutil.which(NVIDIA_SMI)
    if config.mode == "none":
        return NoIsolation()
    if config.mode == "contexts":
        return ContextsIsolation(agent_dir / "no-mps",
                                 GpuModeCheck(indices, program, allow_exclusive=False,
                                              timeout_s=max(5.0, config.command_timeout_s)))
    return MpsIsolation(config, GpuModeCheck(indices, program, allow_exclusive=True,
                                             timeout_s=max(5.0, config.command_timeout_s)),
                        agent_dir / "mps-log")
