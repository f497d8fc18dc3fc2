"""The node agent: one executor per stage, driving fill jobs from the training's bubble signals.

One thread runs a ``selectors`` loop over the executors' datagram sockets, the fill jobs' control
channels and exit descriptors, plus a timer heap for the watchdog. Nothing in it waits on a fill
job: control lines are read when they arrive, and writes that would block are queued.

Per executor (stage k): the PROFILE gives the bubble cycle; the queued job is planned against it
(``bubbles.plan``; a job that fits no bubble is rejected), started through the ``Launcher``,
initialized and armed in the executor's fill mode. Each BUBBLE_END arms a watchdog: a job still
inside a step ``grace`` after the bubble ended is SIGKILLed. ITERATION messages from the lowest
stage feed the slowdown guard, whose share goes to every armed job.

Isolation (``bubbles.agent.isolation``) fails closed: a fill job starts only while the chosen mode
works (or the user allowed running unisolated). A supervisor thread runs the mode's health check,
which may block on subprocesses, and hands the result to the loop through the wake-up socket; the
loop stops fill jobs whose isolation was lost and resubmits them (a new ``Job`` record, at most
``MAX_ISOLATION_RESUBMISSIONS`` times) to start afresh once isolation works again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import os
import selectors
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.agent.guard import GuardConfig, SlowdownGuard
from bubbles.agent.ledger import HarvestLedger
from bubbles.api import FillJobSpec
from bubbles.cycle import BubbleCycle
from bubbles.lifecycle import FillState, InvalidTransition, transition
from bubbles.plan import FillNode, PlanError, bubbles_of, plan_partitions

from bubbles import control, paths, wire

from .isolation import (
    READY,
    UNAVAILABLE,
    UNISOLATED,
    Isolation,
    IsolationConfig,
    IsolationStatus,
    effective_status,
    make_isolation,
)
from .launcher import FillProcess, Launcher, LaunchRequest, ProcessLauncher, assign_device
from .metrics import AgentMetrics, IsolationTotals, JobTotals, Snapshot, StageTotals

log = logging.getLogger("bubbles.agent")

MODE_NAMES = {wire.FillMode.OFF: "off", wire.FillMode.NAIVE: "naive", wire.FillMode.HARVEST: "harvest"}
MAX_STEP_RECORDS = 200_000
MAX_BUBBLE_RECORDS = 200_000
MAX_EVENTS = 10_000
_MAX_OPEN_BUBBLES = 256
_STOP_WAIT_S = 2.0
MAX_ISOLATION_RESUBMISSIONS = 3  # restarts of one fill job after losing its isolation


@dataclass
class AgentConfig:
    run_dir: Path
    training: str
    executors: int = 1
    mode: wire.FillMode = wire.FillMode.HARVEST
    grace_s: float = 0.050
    budget: float = 0.01
    pin_cores: bool = True
    metrics_port: int | None = None  # None: no endpoint; 0: any free port
    metrics_addr: str = "127.0.0.1"
    ready_file: Path | None = None
    guard: GuardConfig | None = None  # default: GuardConfig(budget=budget)
    devices: tuple[str, ...] = ()  # "cpu" | "cuda:N", executor k gets devices[k % len]; () = CPU core k
    isolation: IsolationConfig = field(default_factory=IsolationConfig)


@dataclass
class Job:
    """The agent's record of one fill job."""

    spec: FillJobSpec
    stage: int
    state: FillState = FillState.SUBMITTED
    reason: str = ""
    steps: int = 0
    flops: float = 0.0
    proc: FillProcess | None = None
    lines: control.LineBuffer = field(default_factory=control.LineBuffer)
    out: bytearray = field(default_factory=bytearray)
    in_step: tuple[int, int] | None = None  # (step start ns, bubble seq) between step_begin and step
    armed: str | None = None  # "harvest" | "naive" | None
    step_s: float | None = None
    planned_with_step: bool = False
    finished: bool = False
    last_error: str = ""
    job_totals: dict[str, list[float]] = field(default_factory=dict)  # mode -> [steps, flops]
    isolation: str | None = None  # at launch: the isolation mode it was a client of, or "unisolated"
    isolation_epoch: int = 0  # IsolationStatus.epoch at launch
    resubmission: int = 0  # how often this spec was resubmitted after losing isolation

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def iterative(self) -> bool:
        return self.spec.iterative


@dataclass
class Executor:
    index: int
    device: str
    core: int | None
    mode: wire.FillMode
    sock: socket.socket | None = None
    cycle: BubbleCycle | None = None
    queue: deque[Job] = field(default_factory=deque)
    active: Job | None = None
    open_bubbles: dict[int, wire.BubbleStart] = field(default_factory=dict)

    @property
    def mode_name(self) -> str:
        return MODE_NAMES[self.mode]


class _RateLimitedLog:
    """Log at most once per interval; say how many were suppressed in between."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self.last_ns = -self.interval_ns
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic_ns()
        if now - self.last_ns >= self.interval_ns:
            extra = f" ({self.suppressed} more suppressed)" if self.suppressed else ""
            log.warning(msg + extra, *args)
            self.last_ns = now
            self.suppressed = 0
        else:
            self.suppressed += 1


class Agent:
    """Serves one training's stages on this node; ``run()`` until ``request_stop()`` (or a signal)."""

    def __init__(self, config: AgentConfig, specs: list[FillJobSpec] | None = None,
                 launcher: Launcher | None = None, isolation: Isolation | None = None) -> None:
        if config.executors < 1:
            raise ValueError(f"executors must be >= 1, got {config.executors}")
        paths.check_name("training", config.training)
        self.config = config
        self.launcher = launcher or ProcessLauncher()
        self.executors: list[Executor] = []
        for k in range(config.executors):
            device, core = assign_device(k, config.devices, config.pin_cores)
            self.executors.append(Executor(k, device, core, config.mode))
        agent_dir = paths.stage_dir(config.run_dir, config.training, 0).parent
        self.isolation = isolation or make_isolation(config.isolation, [ex.device for ex in self.executors],
                                                     agent_dir)
        # The raw status from the backend, and the effective one the agent acts on (effective_status).
        self.isolation_raw = IsolationStatus(self.isolation.mode, UNAVAILABLE, "not started")
        self.isolation_status = self.isolation_raw
        self.isolation_losses = 0
        self._isolation_update: IsolationStatus | None = None  # from the supervisor thread, for the loop
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop = threading.Event()
        self.jobs: list[Job] = []
        self.ledgers = {name: HarvestLedger() for name in MODE_NAMES.values()}
        self.steps: list[dict[str, Any]] = []
        self.bubbles: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.rejected_messages = 0
        self.rejected_jobs = 0
        self.kills = 0
        self.guard_config = config.guard or GuardConfig(budget=config.budget)
        self.guard: SlowdownGuard | None = None
        self.guard_stage: int | None = None
        self.share = 1.0
        self.fill_paused = False
        self.lock = threading.RLock()
        self.metrics = AgentMetrics(config.training, self._snapshot)
        self.metrics_port: int | None = None
        self._sel = selectors.DefaultSelector()
        self._timers: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self._rejected_log = _RateLimitedLog()
        for spec in specs or []:
            self.submit(spec)

    # -- setup and teardown ------------------------------------------------------------------------
    def submit(self, spec: FillJobSpec) -> Job:
        """Queue a fill job (SUBMITTED) on its stage, or on the executor with the fewest jobs."""
        with self.lock:
            if any(j.name == spec.name and j.state is not FillState.STOPPED for j in self.jobs):
                raise ValueError(f"a fill job named {spec.name!r} is already running; names must be unique")
            if spec.stage is not None:
                if spec.stage >= len(self.executors):
                    raise ValueError(f"fill job {spec.name!r} asks for stage {spec.stage}, but the agent has "
                                     f"{len(self.executors)} executor(s); raise --executors or fix 'stage'")
                ex = self.executors[spec.stage]
            else:
                ex = min(self.executors, key=lambda e: len(e.queue) + (e.active is not None))
            if control.cuda_device_index(ex.device) is not None and spec.memory_bytes <= 0:
                raise ValueError(f"fill job {spec.name!r} would run on {ex.device} but declares no memory limit; "
                                 "a GPU fill job must set 'memory', a hard limit (e.g. memory: 2Gi), so that it "
                                 "cannot take the training's memory")
            job = Job(spec, ex.index)
            self.jobs.append(job)
            ex.queue.append(job)
            self._event(ex.index, job.name, "submitted", "queued")
            if self._sel.get_map() and ex.sock is not None:
                self._admit(ex)
            return job

    def start(self) -> None:
        """Set up isolation, bind every executor's socket, start the metrics endpoint, write the ready file.

        Isolation that does not work is not an error here: fill jobs then wait (fail closed) while the
        supervisor keeps checking, and the status says why.
        """
        status = self.isolation.start()  # may block (bounded): before the loop, so it stalls no bubble
        with self.lock:
            self._apply_isolation(status)
        try:
            self._bind()
        except BaseException:
            self.isolation.close()  # e.g. quit the MPS daemon just started: run() will not do it
            raise

    def _bind(self) -> None:
        """Bind the executors' sockets, serve metrics, write the ready file."""
        for ex in self.executors:
            path = paths.agent_socket(self.config.run_dir, self.config.training, ex.index)
            paths.make_private_dir(path.parent)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            s.bind(str(path))
            s.setblocking(False)
            ex.sock = s
            self._sel.register(s, selectors.EVENT_READ, lambda _m, ex=ex: self._on_datagrams(ex))
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_addr, self.metrics_port)
        if self.config.ready_file is not None:
            tmp = Path(f"{self.config.ready_file}.tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "metrics_port": self.metrics_port}) + "\n")
            tmp.replace(self.config.ready_file)
        log.info("agent for training %r serving %d executor(s) (%s) under %s in %s mode; isolation %s: %s",
                 self.config.training, len(self.executors), ", ".join(ex.device for ex in self.executors),
                 paths.stage_dir(self.config.run_dir, self.config.training, 0).parent, MODE_NAMES[self.config.mode],
                 self.isolation_status.mode, self.isolation_status.state)

    def request_stop(self) -> None:
        """Ask ``run()`` to return (thread- and signal-safe)."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def run(self) -> None:
        """Serve until ``request_stop()``; then stop every fill job, close the sockets, undo isolation."""
        if not any(ex.sock for ex in self.executors):
            self.start()
        self._supervisor_stop.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="bubbles-isolation", daemon=True)
        self._supervisor.start()
        try:
            while not self._stop:
                timeout = None
                if self._timers:
                    timeout = max(0.0, (self._timers[0][0] - time.monotonic_ns()) / 1e9)
                events = self._sel.select(timeout)
                with self.lock:
                    for key, mask in events:
                        key.data(mask)
                    now = time.monotonic_ns()
                    while self._timers and self._timers[0][0] <= now:
                        _, _, fn = heapq.heappop(self._timers)
                        fn()
        finally:
            self._supervisor_stop.set()
            # A check in progress finishes within its command timeout (a daemon start within a few seconds).
            self._supervisor.join(self.config.isolation.command_timeout_s + 10.0)
            with self.lock:
                self._shutdown()
            # After the fill processes have exited: an MPS daemon this agent owns is quit only now.
            self.isolation.close()

    def _supervise(self) -> None:
        """Supervisor thread: run the isolation health check every interval and hand the result to the loop.

        The check may block on subprocesses (bounded by timeouts), which is why it runs here and not in
        the loop. An exception in the check counts as isolation not working (fail closed).
        """
        interval_s = self.config.isolation.check_interval_s
        while not self._supervisor_stop.wait(interval_s):
            try:
                status = self.isolation.check()
            except Exception as exc:  # a bug in a backend must not end supervision
                log.exception("isolation health check failed")
                status = IsolationStatus(self.isolation.mode, UNAVAILABLE, f"health check failed: {exc!r}",
                                         self.isolation_raw.daemon, self.isolation_raw.epoch)
            with self.lock:
                if status == self.isolation_raw:  # nothing changed: leave the loop serving bubble signals
                    continue
                self._isolation_update = status
            with contextlib.suppress(OSError):
                self._wake_w.send(b"i")

    def _shutdown(self) -> None:
        for job in self.jobs:
            if job.state is FillState.SUBMITTED:
                self._set_state(job, FillState.STOPPED, "cancelled: agent shut down")
            elif job.proc is not None and job.state is not FillState.STOPPED:
                self._send(job, "stop")
                job.proc.send_signal(signal.SIGCONT)
                if job.proc.control is None:
                    job.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_WAIT_S
        for job in self.jobs:
            if job.proc is None:
                continue
            if job.proc.wait(max(0.0, deadline - time.monotonic())) is None:
                job.proc.send_signal(signal.SIGKILL)
                job.proc.wait(1.0)
            self._drain_control(job)
            if job.state is not FillState.STOPPED:
                self._set_state(job, FillState.STOPPED,
                                "finished" if job.finished else "stopped: agent shut down")
            self._close_proc(job)
        for ex in self.executors:
            if ex.sock is not None:
                self._sel.unregister(ex.sock)
                ex.sock.close()
                ex.sock = None
                with contextlib.suppress(FileNotFoundError):
                    paths.agent_socket(self.config.run_dir, self.config.training, ex.index).unlink()
        self.metrics.close()

    def _on_wake(self, _mask: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        update, self._isolation_update = self._isolation_update, None
        if update is not None:
            self._apply_isolation(update)

    def wake_fd(self) -> int:
        """A descriptor for ``signal.set_wakeup_fd``: a signal then interrupts the select at once."""
        return self._wake_w.fileno()

    # -- bubble signals ----------------------------------------------------------------------------
    def _reject(self, stage: int, source: str, why: str) -> None:
        self.rejected_messages += 1
        self.metrics.rejected.labels(self.config.training, str(stage), source).inc()
        self._rejected_log.warning("stage %d: dropped a malformed %s message: %s", stage, source, why)

    def _on_datagrams(self, ex: Executor) -> None:
        assert ex.sock is not None
        for _ in range(1024):  # bounded, so one flooding stage cannot starve the others
            try:
                data = ex.sock.recv(wire.MAX_DATAGRAM_BYTES + 1)
            except BlockingIOError:
                return
            try:
                msg = wire.decode(data)
            except wire.WireError as exc:
                self._reject(ex.index, "datagram", str(exc))
                continue
            if msg.stage != ex.index:
                self._reject(ex.index, "datagram", f"{msg.kind.name} for stage {msg.stage} sent to stage "
                             f"{ex.index}'s socket")
                continue
            self._on_message(ex, msg)

    def _on_message(self, ex: Executor, msg: wire.Message) -> None:
        if isinstance(msg, wire.BubbleStart):
            ex.open_bubbles[msg.seq] = msg
            if len(ex.open_bubbles) > _MAX_OPEN_BUBBLES:  # ENDs lost: forget the oldest
                ex.open_bubbles.pop(next(iter(ex.open_bubbles)))
            job = ex.active
            if (job is not None and not job.iterative and ex.mode is wire.FillMode.HARVEST
                    and not self.fill_paused and job.state is FillState.PAUSED):
                assert job.proc is not None
                job.proc.send_signal(signal.SIGCONT)
                self._set_state(job, FillState.RUNNING)
        elif isinstance(msg, wire.BubbleEnd):
            start = ex.open_bubbles.pop(msg.seq, None)
            if start is not None and msg.end_ns >= start.start_ns:
                self.ledgers[ex.mode_name].add_bubble(ex.index, start.start_ns, msg.end_ns)
                if len(self.bubbles) < MAX_BUBBLE_RECORDS:
                    self.bubbles.append({"stage": ex.index, "slot": msg.slot, "start_ns": start.start_ns,
                                         "end_ns": msg.end_ns, "mode": ex.mode_name})
            job = ex.active
            if job is None or ex.mode is not wire.FillMode.HARVEST or job.state is FillState.STOPPED:
                return
            if job.iterative:
                deadline = msg.end_ns + int(self.config.grace_s * 1e9)
                self._at(deadline, lambda: self._watchdog(ex, job, msg.seq, msg.end_ns))
            elif job.state is FillState.RUNNING:
                assert job.proc is not None
                job.proc.send_signal(signal.SIGSTOP)
                self._set_state(job, FillState.PAUSED)
        elif isinstance(msg, wire.Iteration):
            self.metrics.iteration.labels(self.config.training, str(ex.index)).set(msg.duration_ns / 1e9)
            self._on_iteration(ex, msg)
        elif isinstance(msg, wire.Profile):
            try:
                cycle = BubbleCycle.from_dict(msg.cycle)
            except ValueError as exc:
                self._reject(ex.index, "profile", f"invalid bubble cycle: {exc}")
                return
            first = ex.cycle is None
            ex.cycle = cycle
            if first:
                log.info("stage %d: bubble cycle with %d bubble(s), %.1f ms of %.1f ms per iteration",
                         ex.index, len(cycle.slots), cycle.bubble_s * 1e3, cycle.iteration_s * 1e3)
                self._event(ex.index, "", "profile", f"{len(cycle.slots)} bubbles, "
                            f"{cycle.bubble_s * 1e3:.2f} ms of {cycle.iteration_s * 1e3:.2f} ms")
            self._admit(ex)
        elif isinstance(msg, wire.FillModeChange) and msg.mode is not ex.mode:
            log.info("stage %d: fill mode %s -> %s", ex.index, ex.mode_name, MODE_NAMES[msg.mode])
            self._event(ex.index, "", "mode", MODE_NAMES[msg.mode])
            ex.mode = msg.mode
            ex.open_bubbles.clear()
            if ex.active is not None:
                self._apply_mode(ex, ex.active)

    def _on_iteration(self, ex: Executor, msg: wire.Iteration) -> None:
        if self.guard_stage is None or ex.index < self.guard_stage:
            self.guard_stage = ex.index
            self.guard = None
        if ex.index != self.guard_stage or ex.mode is not wire.FillMode.HARVEST or msg.duration_ns <= 0:
            return
        if self.guard is None:
            if ex.cycle is None or ex.cycle.iteration_s <= 0:
                return
            self.guard = SlowdownGuard(ex.cycle.iteration_s, self.guard_config)
        decision = self.guard.observe(msg.duration_ns / 1e9)
        if decision.slowdown is not None:
            log.info("slowdown guard: %s", decision.reason)
        if decision.share != self.share:
            self.share = decision.share
            self.metrics.share.labels(self.config.training).set(self.share)
            for job in self._live_jobs():
                if job.armed is not None:
                    self._send(job, "share", share=self.share)
        if decision.fill_paused != self.fill_paused:
            self.fill_paused = decision.fill_paused
            self._event(ex.index, "", "guard", "baseline refresh: fill paused" if self.fill_paused
                        else "baseline refreshed: fill resumed")
            for e in self.executors:
                if e.active is not None:
                    self._apply_mode(e, e.active)

    # -- isolation ---------------------------------------------------------------------------------
    def _apply_isolation(self, raw: IsolationStatus) -> None:
        """Act on a health check: log and record changes, stop jobs whose isolation is gone, admit or hold jobs."""
        prev_raw, prev = self.isolation_raw, self.isolation_status
        status = effective_status(raw, self.config.isolation.allow_unisolated)
        self.isolation_raw, self.isolation_status = raw, status
        if prev_raw.state == READY and raw.state != READY:
            self.isolation_losses += 1
        if (status.state, status.detail) != (prev.state, prev.detail):
            level = {READY: logging.INFO, UNISOLATED: logging.WARNING}.get(status.state, logging.ERROR)
            log.log(level, "isolation (%s) %s: %s", status.mode, status.state.upper(), status.detail)
            self._event(-1, "", "isolation", f"{status.state}: {status.detail}")
        for ex in self.executors:
            job = ex.active
            if job is None or job.proc is None or job.state is FillState.STOPPED:
                continue
            if status.usable and not (job.isolation == raw.mode
                                      and (raw.state != READY or job.isolation_epoch != raw.epoch)):
                continue
            # READY again but in a new epoch: the outage was shorter than a check interval.
            lost = raw.detail if raw.state != READY else f"{raw.mode} isolation was re-established ({raw.detail})"
            self._stop_job(job, f"isolation lost: {lost}")
            self._resubmit(job)
        if status.usable:
            for ex in self.executors:
                self._admit(ex)
        else:
            for ex in self.executors:
                self._hold(ex)

    def _hold(self, ex: Executor) -> None:
        """Fail closed: queued jobs stay SUBMITTED and say what they wait for."""
        for job in ex.queue:
            if job.state is FillState.SUBMITTED:
                job.reason = f"waiting for isolation: {self.isolation_status.detail}"

    def _resubmit(self, job: Job) -> None:
        """Queue ``job``'s spec again as a new job record (STOPPED is final), at most MAX_ISOLATION_RESUBMISSIONS."""
        count = job.resubmission + 1
        if count > MAX_ISOLATION_RESUBMISSIONS:
            job.reason += f" (not resubmitted: already restarted {MAX_ISOLATION_RESUBMISSIONS} times after isolation " \
                          "losses)"
            log.error("stage %d: fill job %r lost its isolation again; not resubmitted after %d restarts", job.stage,
                      job.name, MAX_ISOLATION_RESUBMISSIONS)
            self._event(job.stage, job.name, "resubmit", "not resubmitted: restart limit reached")
            return
        again = Job(job.spec, job.stage, resubmission=count)
        again.reason = f"resubmitted after isolation loss ({count}/{MAX_ISOLATION_RESUBMISSIONS})"
        self.jobs.append(again)
        self.executors[job.stage].queue.appendleft(again)
        log.warning("stage %d: fill job %r resubmitted after isolation loss (%d/%d)", job.stage, job.name, count,
                    MAX_ISOLATION_RESUBMISSIONS)
        self._event(job.stage, job.name, "resubmit", again.reason)

    # -- jobs --------------------------------------------------------------------------------------
    def _live_jobs(self) -> list[Job]:
        return [ex.active for ex in self.executors if ex.active is not None]

    def _event(self, stage: int, job: str, kind: str, message: str) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append({"t_ns": time.monotonic_ns(), "stage": stage, "job": job, "kind": kind,
                                "message": message})

    def _set_state(self, job: Job, target: FillState, reason: str = "") -> None:
        if job.state is target:
            return
        job.state = transition(job.state, target)
        if reason:
            job.reason = reason
        if target in (FillState.CREATED, FillState.STOPPED) or reason:
            self._event(job.stage, job.name, "state", f"{target}" + (f": {reason}" if reason else ""))
        if target is FillState.STOPPED:
            job.armed = None
            ex = self.executors[job.stage]
            if ex.active is job and job.proc is None:
                ex.active = None

    def _admit(self, ex: Executor) -> None:
        """Start the next queued job on ``ex`` if it is free, the cycle is known and isolation allows it."""
        if not self.isolation_status.usable:
            self._hold(ex)
            return
        while ex.active is None and ex.queue and ex.cycle is not None:
            job = ex.queue.popleft()
            if job.state is not FillState.SUBMITTED:
                continue
            nodes = job.spec.plan_nodes()
            job.planned_with_step = nodes is not None
            if nodes is None:
                # Step time unknown until the runtime profiles it: check the memory now, the time later.
                nodes = (FillNode(1e-9, job.spec.memory_bytes),)
            if not self._plan(ex, job, nodes, steps=None if job.planned_with_step else 1):
                continue
            self._launch(ex, job)

    def _plan(self, ex: Executor, job: Job, nodes: tuple[FillNode, ...], steps: int | None = None) -> bool:
        """Check the job against the stage's cycle; reject it (STOPPED) if it fits no bubble.

        ``steps=None`` plans as many steps as one cycle's bubble time holds (Algorithm 1).
        """
        assert ex.cycle is not None
        try:
            plan = plan_partitions(bubbles_of(ex.cycle), nodes, steps=steps, job=job.name)
        except PlanError as exc:
            self.rejected_jobs += 1
            reason = str(exc)
            if ex.cycle.slots and all(s.free_bytes == 0 for s in ex.cycle.slots):
                # 0 is what a training without a memory probe reports (a CPU training by default).
                reason += (" The training reported no free memory in any bubble: on CPU set BUBBLES_FREE_BYTES"
                           " in the training's environment, or pass instrument(engine, memory_probe=...).")
            log.error("stage %d: fill job %r rejected: %s", ex.index, job.name, reason)
            self._stop_job(job, f"rejected: {reason}")
            return False
        except ValueError as exc:  # e.g. a cycle with no bubbles
            self.rejected_jobs += 1
            log.error("stage %d: fill job %r cannot be planned: %s", ex.index, job.name, exc)
            self._stop_job(job, f"rejected: {exc}")
            return False
        log.info("stage %d: fill job %r planned: %.2f steps per iteration in bubbles %s", ex.index, job.name,
                 plan.steps_per_cycle(), sorted(plan.usable_bubbles()))
        return True

    def _launch(self, ex: Executor, job: Job) -> None:
        sock_path = paths.fill_socket(self.config.run_dir, self.config.training, ex.index, job.name)
        raw = self.isolation_raw
        try:
            # Isolated only while the backend works; otherwise (allowed unisolated) no client variables.
            env = self.isolation.client_env(ex.device, job.spec.memory_bytes) if raw.state == READY else {}
            req = LaunchRequest(job.spec, sock_path, device=ex.device, core=ex.core, env=env)
            proc = self.launcher.launch(req)
        except (OSError, ValueError) as exc:
            log.error("stage %d: fill job %r failed to start: %s", ex.index, job.name, exc)
            self._set_state(job, FillState.STOPPED, f"failed to start: {exc}")
            return
        job.isolation = raw.mode if raw.state == READY and raw.mode != "none" else UNISOLATED
        job.isolation_epoch = raw.epoch
        if job.reason.startswith("waiting for isolation"):
            job.reason = ""
        job.proc = proc
        job.step_s = job.spec.gating_step_s
        ex.active = job
        self._set_state(job, FillState.CREATED)
        self._sel.register(proc.exit_fd, selectors.EVENT_READ, lambda _m: self._on_exit(job))
        if proc.control is not None:
            self._sel.register(proc.control, selectors.EVENT_READ, lambda m: self._on_control(job, m))
            self._send(job, "init")
        else:
            # A plain command has no init handshake: it is paused until its stage's first bubble.
            proc.send_signal(signal.SIGSTOP)
            self._set_state(job, FillState.PAUSED)
            self._apply_mode(ex, job)

    def _apply_mode(self, ex: Executor, job: Job) -> None:
        """Arm, re-arm or disarm the active job for the executor's mode and the guard's pause."""
        if job.proc is None or job.state not in (FillState.PAUSED, FillState.RUNNING):
            return
        want: str | None = {wire.FillMode.OFF: None, wire.FillMode.NAIVE: "naive",
                            wire.FillMode.HARVEST: "harvest"}[ex.mode]
        if self.fill_paused and want == "harvest":
            want = None
        if not job.iterative:
            if want == "naive":
                job.proc.send_signal(signal.SIGCONT)
                self._set_state(job, FillState.RUNNING)
            else:
                job.proc.send_signal(signal.SIGSTOP)
                self._set_state(job, FillState.PAUSED)
            job.armed = want
            return
        if want == job.armed:
            return
        if want is None:
            self._send(job, "disarm")
        else:
            sock_path = paths.fill_socket(self.config.run_dir, self.config.training, ex.index, job.name)
            self._send(job, "arm", mode=want, share=self.share, socket=str(sock_path))
        job.armed = want
        job.in_step = None

    def _stop_job(self, job: Job, reason: str, sig: int | None = None) -> None:
        """STOPPED with ``reason``; ask the process to stop (or signal it) if it runs."""
        if job.state is FillState.STOPPED:
            return
        if job.proc is not None:
            if sig is not None:
                job.proc.send_signal(sig)
            else:
                self._send(job, "stop")
                job.proc.send_signal(signal.SIGCONT)
                if job.proc.control is None:
                    job.proc.send_signal(signal.SIGTERM)
        self._set_state(job, FillState.STOPPED, reason)

    def _send(self, job: Job, type_: str, **fields: Any) -> None:
        proc = job.proc
        if proc is None or proc.control is None:
            return
        job.out += control.encode(type_, **fields)
        self._flush(job)

    def _flush(self, job: Job) -> None:
        proc = job.proc
        if proc is None or proc.control is None or not job.out:
            return
        try:
            n = proc.control.send(job.out)
            del job.out[:n]
        except BlockingIOError:
            pass
        except OSError:
            job.out.clear()  # the process is gone; its exit is handled by the pidfd
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if job.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(proc.control, mask, lambda m: self._on_control(job, m))

    def _on_control(self, job: Job, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(job)
        if mask & selectors.EVENT_READ:
            self._drain_control(job)

    def _drain_control(self, job: Job) -> None:
        proc = job.proc
        if proc is None or proc.control is None or proc.control.fileno() < 0:
            return
        while True:
            try:
                data = proc.control.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(proc.control)
                return
            for line in job.lines.feed(data):
                try:
                    ev = control.parse_event(line)
                except control.ControlError as exc:
                    self._reject(job.stage, "control", f"fill job {job.name!r}: {exc}")
                    continue
                self._on_event(job, ev)

    def _on_event(self, job: Job, ev: control.ControlMessage) -> None:
        ex = self.executors[job.stage]
        if ev.type == "step_begin":
            job.in_step = (ev["t_ns"], ev["bubble_seq"])
        elif ev.type == "step":
            job.in_step = None
            job.steps += 1
            job.flops += ev["flops"]
            mode = ev.get("mode") or ex.mode_name
            totals = job.job_totals.setdefault(mode, [0, 0.0])
            totals[0] += 1
            totals[1] += ev["flops"]
            try:
                self.ledgers[mode].add_step(job.stage, job.name, ev["start_ns"], ev["end_ns"],
                                            float(ev["flops"]))
            except ValueError as exc:
                self._reject(job.stage, "control", f"fill job {job.name!r}: {exc}")
            if len(self.steps) < MAX_STEP_RECORDS:
                self.steps.append({"stage": job.stage, "job": job.name, "start_ns": ev["start_ns"],
                                   "end_ns": ev["end_ns"], "flops": ev["flops"], "mode": mode,
                                   "signal_ns": ev.get("signal_ns", 0),
                                   "bubble_seq": ev.get("bubble_seq", -1)})
        elif ev.type == "state":
            if job.state is FillState.STOPPED:
                return
            target = FillState(ev["state"])
            if target is FillState.CREATED or target is job.state:
                return
            try:
                self._set_state(job, target)
            except InvalidTransition as exc:
                self._reject(job.stage, "control", f"fill job {job.name!r}: {exc}")
                return
            if target is FillState.PAUSED and job.armed is None:
                self._apply_mode(ex, job)
        elif ev.type == "profile":
            job.step_s = float(ev["step_s"])
            self._event(job.stage, job.name, "profile", f"step time {job.step_s * 1e3:.3f} ms")
            if not job.planned_with_step and ex.cycle is not None and job.state is not FillState.STOPPED:
                job.planned_with_step = True
                self._plan(ex, job, (FillNode(job.step_s, job.spec.memory_bytes),))
        elif ev.type == "finished":
            job.finished = True
            self._stop_job(job, "finished")
        elif ev.type == "error":
            job.last_error = ev["message"]
            log.error("stage %d: fill job %r reports: %s", job.stage, job.name, job.last_error)
            self._event(job.stage, job.name, "error", job.last_error)

    def _on_exit(self, job: Job) -> None:
        proc = job.proc
        if proc is None:
            return
        self._drain_control(job)
        code = proc.wait(1.0)
        if job.state is not FillState.STOPPED:
            if job.finished or code == 0:
                self._set_state(job, FillState.STOPPED, "finished")
            else:
                detail = f": {job.last_error}" if job.last_error else ""
                log.error("stage %d: fill job %r exited with code %s%s", job.stage, job.name, code, detail)
                self._set_state(job, FillState.STOPPED, f"failed: exited with code {code}{detail}")
        self._close_proc(job)
        ex = self.executors[job.stage]
        if ex.active is job:
            ex.active = None
            self._admit(ex)

    def _close_proc(self, job: Job) -> None:
        proc = job.proc
        if proc is None:
            return
        for fd in (proc.control, proc.exit_fd):
            if fd is None or (isinstance(fd, int) and fd < 0):
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(fd)
        proc.close()
        # Leave no stale socket behind for the hook if the job died while armed.
        with contextlib.suppress(FileNotFoundError):
            paths.fill_socket(self.config.run_dir, self.config.training, job.stage, job.name).unlink()

    # -- watchdog ----------------------------------------------------------------------------------
    def _at(self, deadline_ns: int, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (deadline_ns, next(self._seq), fn))

    def _watchdog(self, ex: Executor, job: Job, seq: int, end_ns: int) -> None:
        """Grace period over: kill the job if it is still in a step that belongs to the ended bubble."""
        if job.state is FillState.STOPPED or job.armed != "harvest":
            return
        self._drain_control(job)  # a step report may be waiting
        step = job.in_step
        if step is None or job.state is FillState.STOPPED:
            return
        began_ns, step_seq = step
        if step_seq != seq and began_ns > end_ns:
            return  # a step of a later bubble: its own bubble's end arms its own watchdog
        grace_ms = round(self.config.grace_s * 1e3)
        overdue_ms = (time.monotonic_ns() - end_ns) / 1e6
        self.kills += 1
        self.metrics.kills.labels(self.config.training, str(ex.index), ex.device, job.name).inc()
        log.error("stage %d: fill job %r still in a step %.1f ms after bubble %d ended: SIGKILL",
                  ex.index, job.name, overdue_ms, seq)
        self._event(ex.index, job.name, "kill",
                    f"still in a step {overdue_ms:.1f} ms after bubble {seq} ended")
        self._stop_job(job, f"killed: did not pause within {grace_ms} ms of bubble end", sig=signal.SIGKILL)

    # -- reporting ---------------------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        with self.lock:
            stages: list[StageTotals] = []
            for mode, ledger in self.ledgers.items():
                for st in ledger.stages():
                    t = ledger.totals(st)
                    dev = self.executors[st].device if st < len(self.executors) else "cpu"
                    stages.append(StageTotals(st, dev, mode, t.bubble_s, t.filled_s, t.overrun_s))
            jobs = [JobTotals(j.stage, self.executors[j.stage].device, mode, j.name, int(v[0]), float(v[1]))
                    for j in self.jobs for mode, v in j.job_totals.items()]
            states = [(j.stage, self.executors[j.stage].device, str(j.state)) for j in self.jobs]
            iso_st = self.isolation_status
            iso = IsolationTotals(iso_st.mode, iso_st.state, self.isolation_losses,
                                  iso_st.daemon.restarts if iso_st.daemon is not None else None)
            return Snapshot(stages, jobs, states, iso)

    def stats(self) -> dict[str, Any]:
        """Everything the demo and the benchmarks read (see the agent's documentation for the format)."""
        with self.lock:
            modes = {}
            for mode, ledger in self.ledgers.items():
                t = ledger.totals()
                modes[mode] = {"fill_steps": t.fill_steps, "fill_flops": t.fill_flops, "bubble_s": t.bubble_s,
                               "filled_s": t.filled_s, "overruns": t.overruns, "overrun_s": t.overrun_s,
                               "overrun_p99_ms": t.overrun_p99_ms, "max_overrun_ms": t.max_overrun_ms}
            g = self.guard
            return {
                "training": self.config.training,
                "budget": self.guard_config.budget,
                "grace_ms": self.config.grace_s * 1e3,
                "guard": {
                    "share": self.share,
                    "stage": self.guard_stage,
                    "baseline_s": g.baseline_s if g else None,
                    "slowdown_held": g.slowdown_held() if g else None,
                    "history": [list(h) for h in g.history] if g else [],
                },
                "modes": modes,
                "isolation": self.isolation_status.to_dict(),
                "isolation_losses": self.isolation_losses,
                "executors": [{"stage": ex.index, "device": ex.device, "mode": ex.mode_name,
                               "profiled": ex.cycle is not None} for ex in self.executors],
                "jobs": [{"name": j.name, "stage": j.stage, "state": str(j.state), "reason": j.reason,
                          "steps": j.steps, "flops": j.flops, "step_s": j.step_s, "isolation": j.isolation,
                          "resubmission": j.resubmission} for j in self.jobs],
                "kills": self.kills,
                "rejected_messages": self.rejected_messages,
                "rejected_jobs": self.rejected_jobs,
                "events": list(self.events),
                "steps": list(self.steps),
                "bubbles": list(self.bubbles),
            }

    def write_stats(self, path: Path) -> None:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(self.stats(), separators=(",", ":")) + "\n")
        tmp.replace(path)
