"""The core's state, and what it does to one fill job: state changes, control commands and signals (as actions),
stops, kills and resubmissions, and the timers that end in them. ``AgentCore`` (``.agent``) decides when."""

from __future__ import annotations

import itertools
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bubbles.core import paths
from bubbles.core.api import FillMode, FillState, IsolationState, IsolationStatus
from bubbles.core.identity import GpuKey
from bubbles.core.lifecycle import transition

from ..guard import SlowdownGuard
from ..ledger import HarvestLedger
from .actions import Action, Release, Send, Signal
from .config import CoreConfig
from .ending import Ending, TrainingEnd
from .records import BubbleRecord, EventRecord, ExecutorState, Gang, JobRecord, StepRecord
from .reporting import MetricsSink, NullSink
from .timers import TimerKind, Timers

log = logging.getLogger("bubbles.agent")

MAX_EVENTS = 10_000
MAX_STOPPED_JOBS = 1_000  # finished job records kept (stats, reports); the oldest go first
MAX_ISOLATION_RESUBMISSIONS = 3  # restarts of one fill job after losing its isolation
# How long a fill process asked to stop (cancelled, its training restarted, its isolation lost) may take to exit, its
# checkpoint saved, before it is SIGKILLed: one that ignores the request (SIGTERM trapped) would otherwise run on,
# never paused again, through the training's compute. Kubernetes' default grace for a Pod.
STOP_GRACE_S = 30.0


class _RateLimitedLog:
    """Log at most once per interval; say how many were suppressed in between."""

    def __init__(self, clock: Callable[[], int], interval_s: float = 1.0) -> None:
        self.clock = clock
        self.interval_ns = int(interval_s * 1e9)
        self.last_ns: int | None = None
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if self.last_ns is None or now - self.last_ns >= self.interval_ns:
            extra = f" ({self.suppressed} more suppressed)" if self.suppressed else ""
            log.warning(msg + extra, *args)
            self.last_ns = now
            self.suppressed = 0
        else:
            self.suppressed += 1


class JobControl:
    """The core's state and its effects on jobs; the base of ``AgentCore``, which holds the decisions."""

    def __init__(self, config: CoreConfig, clock: Callable[[], int], sink: MetricsSink | None = None) -> None:
        paths.check_name("training", config.training)
        paths.check_namespace(config.namespace)
        self.config = config
        self.clock = clock
        self.sink: MetricsSink = sink or NullSink()
        # One per harvested GPU, in key order (stage, then rank); more are added as their ranks appear (add_executor).
        self.executors: list[ExecutorState] = []
        self._by_key: dict[GpuKey, ExecutorState] = {}
        self.jobs: list[JobRecord] = []
        # A ledger folds no further back than the oldest bubble still open: its record comes at its END.
        self.ledgers = {m.label: HarvestLedger[GpuKey](floor=self._oldest_open_bubble) for m in FillMode}
        self.steps: list[StepRecord] = []
        self.bubbles: list[BubbleRecord] = []
        self.events: list[EventRecord] = []
        self.rejected_messages = 0
        self.rejected_jobs = 0
        self.kills = 0
        self.missed_ends = 0  # plain commands frozen because their bubble's END never came
        # One guard for the training on this node, fed by one GPU's iterations (``AgentCore._on_iteration``).
        self.guard: SlowdownGuard | None = None
        self.guard_key: GpuKey | None = None
        self.share = 1.0
        self.fill_paused = False
        # The raw status from the isolation backend, and the effective one the core acts on (effective_status).
        self.isolation_raw = IsolationStatus(config.isolation_mode, IsolationState.UNAVAILABLE, "not started")
        self.isolation_status = self.isolation_raw
        self.isolation_losses = 0
        self.serving = False  # the shell has bound the executors' sockets: queued jobs may be admitted
        self._actions: list[Action] = []
        self._timers = Timers()
        self._ids = itertools.count()
        self._rejected_log = _RateLimitedLog(clock)
        self._missed_end_log = _RateLimitedLog(clock)
        self._newer_seen: set[tuple[int, int]] = set()  # (version, kind) of messages from a newer hook, said once
        self.newer_messages = 0
        # When the training has ended (--exit-when-done), and the end once decided (``AgentCore.watch_hooks``).
        self.training_end = TrainingEnd(config.training, clock(), config.start_timeout_s)
        self.ended: Ending | None = None
        for k, (device, core) in enumerate(config.executors):  # local mode: rank 0 of each stage, from the start
            key = self.key(k)
            self._add(key, paths.gpu_dir(config.run_dir, key), device, core)

    def key(self, stage: int, rank: int = 0) -> GpuKey:
        """The key of rank ``rank`` of stage ``stage`` of the training this core serves."""
        return GpuKey(self.config.namespace, self.config.training, stage, rank)

    def executor(self, key: GpuKey) -> ExecutorState:
        """The executor of GPU ``key``; KeyError if this core does not serve it."""
        return self._by_key[key]

    def serves(self, key: GpuKey) -> bool:
        return key in self._by_key

    def _add(self, key: GpuKey, directory: Path, device: str, core: int | None) -> ExecutorState:
        if key.training_key != (self.config.namespace, self.config.training):
            raise ValueError(f"GPU {key} is not of training {self.config.namespace}/{self.config.training}, which "
                             "this agent serves")
        if key in self._by_key:
            raise ValueError(f"GPU {key} is served already")
        ex = ExecutorState(key, directory, device, core, self.config.mode)
        self._by_key[key] = ex
        self.executors.append(ex)
        self.executors.sort(key=lambda e: e.key)
        return ex

    def remove_executor(self, key: GpuKey) -> None:
        """Stop serving GPU ``key`` right after it was added (the shell could not bind its socket); ValueError if a
        job is queued or runs there already."""
        ex = self.executor(key)
        if ex.queue or ex.active is not None:
            raise ValueError(f"GPU {key} has fill jobs; it cannot be let go of")
        del self._by_key[key]
        self.executors.remove(ex)

    def _event(self, key: GpuKey | None, job: str, kind: str, message: str) -> None:
        """Keep an event of GPU ``key`` (None: the node's or the training's: stage and rank -1)."""
        if len(self.events) < MAX_EVENTS:
            stage, rank = (key.stage, key.rank) if key is not None else (-1, -1)
            self.events.append({"t_ns": self.clock(), "stage": stage, "rank": rank, "job": job, "kind": kind,
                                "message": message})

    def _reject(self, key: GpuKey, source: str, why: str) -> None:
        self.rejected_messages += 1
        self.sink.rejected(key, source)
        self._rejected_log.warning("%s: dropped a %s message: %s", key, source, why)

    def _set_state(self, job: JobRecord, target: FillState, reason: str = "") -> None:
        if job.state is target:
            return
        job.state = transition(job.state, target)
        if reason:
            job.reason = reason
        if target in (FillState.CREATED, FillState.STOPPED) or reason:
            self._event(job.key, job.name, "state", f"{target}" + (f": {reason}" if reason else ""))
        if target is FillState.STOPPED:
            job.armed = None
            ex = self.executor(job.key)
            if ex.active is job and not job.launched:
                ex.active = None
            if job.gang is not None:
                self._stop_gang(job, job.reason)

    def _stop_gang(self, job: JobRecord, reason: str) -> None:
        """A gang's member stopped: so do the others (their collectives would wait for it forever), with its reason;
        a failure names the member it came from. Queued members leave their queues."""
        assert job.gang is not None
        if reason.startswith(("failed", "killed")):
            reason = f"{reason} (gang rank {job.gang_rank}: stage {job.stage} rank {job.rank})"
        for peer in job.gang.members:
            if peer is job or peer.state is FillState.STOPPED:
                continue
            queue = self.executor(peer.key).queue
            if peer in queue:
                queue.remove(peer)
            self._stop_job(peer, reason)
    def _add_job(self, job: JobRecord) -> None:
        """Keep ``job``'s record, and let go of the oldest finished ones beyond MAX_STOPPED_JOBS: an agent on a cluster
        node serves hundreds of fill jobs a day for weeks (their totals stay in the ledgers)."""
        self.jobs.append(job)
        done = [j for j in self.jobs if j.state is FillState.STOPPED and not j.launched]
        if len(done) > MAX_STOPPED_JOBS:
            drop = {id(j) for j in done[:len(done) - MAX_STOPPED_JOBS]}
            self.jobs = [j for j in self.jobs if id(j) not in drop]

    def _oldest_open_bubble(self, key: GpuKey) -> int | None:
        ex = self._by_key.get(key)
        opened = ex.open_bubbles if ex is not None else {}
        return min((ob.start.start_ns for ob in opened.values()), default=None)

    def _send(self, job: JobRecord, type_: str, **fields: Any) -> None:
        if job.launched and job.has_control:
            self._actions.append(Send(job, type_, fields))

    def _signal(self, job: JobRecord, sig: int) -> None:
        if job.launched:
            self._actions.append(Signal(job, sig))

    def _release(self, job: JobRecord) -> None:
        job.launched = False
        self._actions.append(Release(job, self._fill_socket(job)))

    def _gang_sockets(self, job: JobRecord) -> tuple[Path, ...]:
        """A gang member's fill sockets: one per GPU of the gang, its own GPU's first (``arm.sockets``); its own alone
        for a single-GPU job. The gang's leader binds them all; the hook of each GPU signals the one in its fills/."""
        own = self._fill_socket(job)
        if job.gang is None:
            return (own,)
        return (own, *(self._fill_socket(m) for m in job.gang.members if m is not job))

    def _fill_socket(self, job: JobRecord) -> Path:
        """Where ``job`` binds its socket: in its GPU's ``fills/`` (``paths.fill_socket``; a pre-v4 card's stage
        directory has one too)."""
        name = f"{paths.FILL_SOCKET_PREFIX}{paths.check_name('fill job', job.name)}{paths.SOCKET_SUFFIX}"
        return self.executor(job.key).directory / paths.FILLS_DIR_NAME / name

    def _send_limits(self, job: JobRecord) -> None:
        """The training's tail risk to ``job``'s process, unless it has it already (or there is none to send)."""
        risk = self.config.tail_risk
        if risk is not None and job.tail_risk_sent != risk and job.launched and job.has_control:
            self._send(job, "limits", tail_risk=risk)
            job.tail_risk_sent = risk

    def _apply_mode(self, ex: ExecutorState, job: JobRecord) -> None:
        """Arm, re-arm or disarm the active job for the executor's mode and the guard's pause."""
        if job.gang is not None:
            self._apply_gang_mode(job.gang)
            return
        if not job.launched or job.state not in (FillState.PAUSED, FillState.RUNNING) or job.verification == "pending":
            return
        want = self._wanted_mode(ex)
        if not job.iterative:
            if want is FillMode.NAIVE:
                self._signal(job, signal.SIGCONT)
                self._set_state(job, FillState.RUNNING)
            else:
                self._signal(job, signal.SIGSTOP)
                self._set_state(job, FillState.PAUSED)
            job.armed = want
            return
        if want is job.armed:
            return
        if want is None:
            self._send(job, "disarm")
        else:
            self._send_limits(job)  # before arm: the first bubble already follows the training's limit
            self._send(job, "arm", mode=want.label, share=self.share, socket=str(self._fill_socket(job)))
        job.armed = want
        job.in_step = None

    def _wanted_mode(self, ex: ExecutorState) -> FillMode | None:
        """The mode an active job of ``ex`` is armed in now: the executor's, unless the guard paused harvesting."""
        want: FillMode | None = None if ex.mode is FillMode.OFF else ex.mode
        if self.fill_paused and want is FillMode.HARVEST:
            want = None
        return want

    def _apply_gang_mode(self, gang: Gang) -> None:
        """Arm a gang's members together or not at all: only once every member has finished its init (and had its
        isolation verified), and only in a mode all its GPUs are in. A member armed alone would start steps whose
        collectives wait for peers that are not stepping."""
        members = gang.members
        ready = len(members) == gang.size and all(
            m.launched and m.state in (FillState.PAUSED, FillState.RUNNING) and m.verification != "pending"
            for m in members)
        wants = {self._wanted_mode(self.executor(m.key)) for m in members}
        want = wants.pop() if ready and len(wants) == 1 else None
        for m in members:
            if not m.launched or m.state not in (FillState.PAUSED, FillState.RUNNING) or want is m.armed:
                continue
            if want is None:
                self._send(m, "disarm")
            else:
                self._send_limits(m)
                sockets = [str(p) for p in self._gang_sockets(m)]
                self._send(m, "arm", mode=want.label, share=self.share, socket=sockets[0], sockets=sockets)
            m.armed = want
            m.in_step = None

    def _hold(self, ex: ExecutorState) -> None:
        """Fail closed: queued jobs stay SUBMITTED and say what they wait for."""
        for job in ex.queue:
            if job.state is FillState.SUBMITTED:
                job.reason = f"waiting for isolation: {self.isolation_status.detail}"

    def _resubmit(self, job: JobRecord) -> None:
        """Queue ``job``'s spec again as a new record (STOPPED is final), at most MAX_ISOLATION_RESUBMISSIONS."""
        if not self.config.relaunch:
            job.reason += " (the operator restarts it in a new Pod)"
            return
        count = job.resubmission + 1
        if job.gang is not None and count <= MAX_ISOLATION_RESUBMISSIONS:
            self._resubmit_gang(job.gang, count)
            return
        if count > MAX_ISOLATION_RESUBMISSIONS:
            job.reason += f" (not resubmitted: already restarted {MAX_ISOLATION_RESUBMISSIONS} times after " \
                          "isolation losses)"
            log.error("%s: fill job %r lost its isolation again; not resubmitted after %d restarts",
                      job.key, job.name, MAX_ISOLATION_RESUBMISSIONS)
            self._event(job.key, job.name, "resubmit", "not resubmitted: restart limit reached")
            return
        again = JobRecord(next(self._ids), job.spec, job.key, resubmission=count)
        again.reason = f"resubmitted after isolation loss ({count}/{MAX_ISOLATION_RESUBMISSIONS})"
        self._add_job(again)
        self.executor(job.key).queue.appendleft(again)
        log.warning("%s: fill job %r resubmitted after isolation loss (%d/%d)", job.key, job.name, count,
                    MAX_ISOLATION_RESUBMISSIONS)
        self._event(job.key, job.name, "resubmit", again.reason)

    def _resubmit_gang(self, gang: Gang, count: int) -> None:
        """Queue a gang again as a new one on the same GPUs, at the head of each of their queues."""
        again = Gang(next(self._ids), gang.size)
        for old in gang.members:
            member = JobRecord(next(self._ids), old.spec, old.key, resubmission=count, placed=True, gang=again,
                               gang_rank=old.gang_rank)
            member.reason = f"resubmitted after isolation loss ({count}/{MAX_ISOLATION_RESUBMISSIONS})"
            again.members.append(member)
            self._add_job(member)
            self.executor(member.key).queue.appendleft(member)
        lead = again.members[0]
        log.warning("%s: gang fill job %r resubmitted after isolation loss (%d/%d)", lead.key, lead.name, count,
                    MAX_ISOLATION_RESUBMISSIONS)
        self._event(lead.key, lead.name, "resubmit", lead.reason)

    def _stop_job(self, job: JobRecord, reason: str, sig: int | None = None) -> None:
        """STOPPED with ``reason``; ask the process to stop (or signal it) if it runs."""
        if job.state is FillState.STOPPED:
            return
        if job.launched:
            if sig is not None:
                self._signal(job, sig)
            else:
                self._ask_to_stop(job)
        self._set_state(job, FillState.STOPPED, reason)

    def _ask_to_stop(self, job: JobRecord) -> None:
        self._send(job, "stop")
        self._signal(job, signal.SIGCONT)
        if not job.has_control:
            self._signal(job, signal.SIGTERM)
        if job.launched and not job.stop_deadline:
            job.stop_deadline = True
            deadline = self.clock() + int(STOP_GRACE_S * 1e9)
            self._timers.push(deadline, job, TimerKind.STOP_DEADLINE)

    def _stop_overdue(self, job: JobRecord) -> None:
        """The stop request's grace is over: a process still there is killed (its record is STOPPED already, or the
        agent is shutting down)."""
        if not job.launched:
            return
        why = f"killed: still running {STOP_GRACE_S:g} s after it was asked to stop"
        log.error("%s: fill job %r %s", job.key, job.name, why)
        self._event(job.key, job.name, "kill", why)
        self.kills += 1
        self.sink.kill(job.key, self.executor(job.key).device, job.name)
        self._signal(job, signal.SIGCONT)
        self._signal(job, signal.SIGKILL)

    def _init_timeout_s(self, job: JobRecord) -> float:
        return job.spec.init_timeout_s if job.spec.init_timeout_s is not None else self.config.init_timeout_s

    def _init_overdue(self, job: JobRecord) -> None:
        """The init deadline: a job still CREATED (its init not done) is killed; the stage's next job gets its turn."""
        if job.state is not FillState.CREATED or not job.launched:
            return
        limit = self._init_timeout_s(job)
        whose = ("its own limit, FillJob spec.initTimeout or spec-file init_timeout" if job.spec.init_timeout_s
                 is not None else "the agent's --init-timeout; a job that needs longer sets FillJob spec.initTimeout "
                 "or spec-file init_timeout")
        why = (f"killed: its init did not finish within {limit:g} s of its start ({whose}; see the job's output; under "
               "MPS a process of a UID other than the server's waits in CUDA's initialization)")
        log.error("%s: fill job %r %s", job.key, job.name, why)
        self._event(job.key, job.name, "kill", why)
        self.kills += 1
        self.sink.kill(job.key, self.executor(job.key).device, job.name)
        self._stop_job(job, why, sig=signal.SIGKILL)

    def _watchdog(self, job: JobRecord, seq: int, end_ns: int) -> None:
        """Grace period over: kill the job if it is still in a step that belongs to the ended bubble."""
        if job.state is FillState.STOPPED or job.armed is not FillMode.HARVEST or job.in_step is None:
            return
        began_ns, step_seq = job.in_step
        if step_seq != seq and began_ns > end_ns:
            return  # a step of a later bubble: its own bubble's end arms its own watchdog
        ex = self.executor(job.key)
        grace_ms = round(self.config.grace_s * 1e3)
        overdue_ms = (self.clock() - end_ns) / 1e6
        self.kills += 1
        self.sink.kill(ex.key, ex.device, job.name)
        log.error("%s: fill job %r still in a step %.1f ms after bubble %d ended: SIGKILL",
                  ex.key, job.name, overdue_ms, seq)
        self._event(ex.key, job.name, "kill", f"still in a step {overdue_ms:.1f} ms after bubble {seq} ended")
        self._stop_job(job, f"killed: did not pause within {grace_ms} ms of bubble end", sig=signal.SIGKILL)

    def _end_overdue(self, job: JobRecord, bubble_seq: int) -> None:
        """A plain command thawed for bubble ``bubble_seq``, whose END has not come by its deadline: frozen, unless
        the END came (the bubble is closed), a later bubble opened (its own deadline covers it), or the job is no
        longer running in harvest mode."""
        ex = self.executor(job.key)
        if (ex.active is not job or job.state is not FillState.RUNNING or ex.mode is not FillMode.HARVEST
                or not ex.open_bubbles or next(reversed(ex.open_bubbles)) != bubble_seq):
            return
        self.missed_ends += 1
        self.sink.missed_end(ex.key)
        self._signal(job, signal.SIGSTOP)
        self._set_state(job, FillState.PAUSED)
        self._missed_end_log.warning("%s: no END for bubble %d by twice its predicted length: fill job %r "
                                   "frozen (an END the hook could not send)", ex.key, bubble_seq, job.name)
