"""The agent's decisions, as a pure core: inputs in, actions out, the clock injected.

Like DeepSpeed's pipeline schedules, which yield instructions for the engine to execute, ``AgentCore``
never touches a socket, a process, a thread or the wall clock. Its inputs are the training's datagrams
(``on_datagram``), a fill process's control lines (``on_control_line``), launch results, process exits,
isolation health (``on_isolation``), the answers to the MPS membership checks (``isolation_verified``,
``training_membership``) and timer ticks (``tick``); what it decides comes out of ``take_actions()`` as
``Launch``, ``Send``, ``Signal``, ``Release``, ``VerifyIsolation`` and ``VerifyTraining`` values, which the shell
(``bubbles.agent.server.Agent``) carries out (the two checks off its loop). Tests drive it with plain calls and a
fake clock.

Per executor (one harvested GPU: a rank of a pipeline stage, named by its ``GpuKey``): the PROFILE gives the
bubble cycle; the queued job is planned against it (``bubbles.core.plan``; a job that fits no bubble is rejected),
launched, initialized and armed in the executor's fill mode. Each BUBBLE_END arms a watchdog: a job still inside a
step ``grace`` after the bubble ended is SIGKILLed. ITERATION messages from one GPU (the lowest stage's lowest rank)
feed the training's one slowdown guard, whose share and pause go to every armed job on every GPU. Isolation fails
closed: a fill job starts only while the chosen mode works (or the user
allowed running unisolated); jobs whose isolation was lost are stopped and resubmitted (a new record, at
most ``MAX_ISOLATION_RESUBMISSIONS`` times).

A gang job (``FillJobSpec.gpus`` N > 1, an SDK job) is N records, one per GPU of one stage (``records.Gang``): placed
on N GPUs of one stage together (``_place_gang``), launched once all N GPUs are free (``_admit_gang``), armed together
once all N have finished their init (``JobControl._apply_gang_mode``), and stopped together, with the reason of the
member that stopped first (``JobControl._stop_gang``): a watchdog's kill, a failure or an early exit of one process
ends them all, since the others' collectives would wait for it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bubbles.core import control, paths, wire
from bubbles.core.api import (
    MPS_CLIENT,
    AgentStatus,
    FillJobSpec,
    FillMode,
    FillNode,
    FillState,
    IsolationMode,
    IsolationState,
    IsolationStatus,
    check_tail_risk,
)
from bubbles.core.cycle import BubbleCycle
from bubbles.core.identity import GpuKey
from bubbles.core.lifecycle import InvalidTransition
from bubbles.core.plan import PlanError, bubbles_of, plan_partitions

from ..guard import SlowdownGuard
from .actions import Action, Launch, VerifyIsolation, VerifyTraining
from .ending import Ending, HookFacts
from .jobs import JobControl
from .membership import TRAINING_RECHECK_S, TrainingMembership, may_ask
from .planning import PLAN_FACTOR, slot_predictions, start_lag, start_lag_s, within_factor
from .records import MODE_SETTLE_ITERATIONS, UNISOLATED, ExecutorState, Gang, JobRecord, OpenBubble
from .reporting import Snapshot, snapshot_of, status_of, summary_of
from .timers import Timer, TimerKind

log = logging.getLogger("bubbles.agent")

MAX_STEP_RECORDS = 200_000
MAX_BUBBLE_RECORDS = 200_000
# A fill job goes to the GPU with the most bubble time (of its stage, for one that names a stage), once every
# candidate GPU has profiled, or this long after the first one did (a GPU may never profile: its rank not running).
PLACE_WAIT_NS = 5_000_000_000
FUTURE_SLACK_NS = 1_000_000_000  # a record stamped later than now plus this is refused (a wrong clock)
MAX_OPEN_BUBBLES = 256


def sent_by_the_training(pid: int, holder: int | None) -> bool:
    """Whether a datagram from process ``pid`` is the training's: the hook holds its GPU's ``hook.lock`` for its
    process's life (``holder``, None where no process holds it or it cannot be told, as on a file system without
    flock). While a process holds it, only that one speaks for the GPU."""
    return holder is None or holder == pid


def effective_status(raw: IsolationStatus, allow_unisolated: bool) -> IsolationStatus:
    """What the agent acts on: ``raw``, or ``unisolated`` where isolation is broken but the user allows that."""
    if raw.usable or not allow_unisolated:
        return raw
    return replace(raw, state=IsolationState.UNISOLATED,
                   detail=f"{raw.detail}; fill jobs run WITHOUT isolation because --allow-unisolated is set")


# -- the core -----------------------------------------------------------------------------------------------
class AgentCore(JobControl):
    """Every decision of the node agent for one training's GPUs on this node; see the module's documentation."""

    # -- the shell's side of the conversation --------------------------------------------------------------
    def take_actions(self) -> list[Action]:
        """The actions decided since the last call, in order."""
        actions, self._actions = self._actions, []
        return actions

    def next_deadline_ns(self) -> int | None:
        """When ``tick`` has work next (a watchdog), or None."""
        return self._timers.next_deadline_ns()

    def due_watchdogs(self, now_ns: int) -> list[JobRecord]:
        """Jobs whose watchdog is due: the shell reads their pending control lines before ``tick``."""
        return self._timers.due_jobs(now_ns)

    # -- inputs ------------------------------------------------------------------------------------------
    def submit(self, spec: FillJobSpec, on: GpuKey | Sequence[GpuKey] | None = None) -> JobRecord:
        """Queue a fill job (SUBMITTED) on the GPU with the fewest jobs (of its stage, for one that names a stage)
        until the candidates have profiled, when it is placed for good (``_place``), or on GPU ``on`` where it was
        placed already (cluster mode: the operator's assignment; a gang's N GPUs, by gang rank); ValueError if it
        cannot be queued (a duplicate name, no GPU of such a stage, a GPU job without a memory limit, a gang that is
        not an SDK job or whose GPUs are not N of one stage). A gang's record returned is its leader's (gang rank 0).
        """
        if any(j.name == spec.name and j.state is not FillState.STOPPED for j in self.jobs):
            raise ValueError(f"a fill job named {spec.name!r} is already running; names must be unique")
        if spec.gpus > 1 or (on is not None and not isinstance(on, GpuKey)):
            return self._submit_gang(spec, None if on is None else tuple([on] if isinstance(on, GpuKey) else on))
        if on is not None and not self.serves(on):
            raise ValueError(f"fill job {spec.name!r} was placed on {on}, which this agent does not serve (no hook of "
                             "that rank has written its card here)")
        candidates = [self.executor(on)] if on is not None else self._candidates(spec)
        if not candidates:
            if spec.stage is None:
                raise ValueError(f"fill job {spec.name!r}: the agent serves no GPU yet (no hook of training "
                                 f"{self.config.training!r} has written its card); submit it once the training runs")
            served = sorted({e.stage for e in self.executors})
            raise ValueError(f"fill job {spec.name!r} asks for stage {spec.stage}, but the agent serves no GPU of it "
                             f"(it serves stage(s) {', '.join(map(str, served)) or 'none'}); raise --executors or "
                             "fix 'stage'")
        ex = min(candidates, key=lambda e: (len(e.queue) + (e.active is not None), e.key))
        if control.cuda_device_index(ex.device) is not None and spec.memory_bytes <= 0:
            raise ValueError(f"fill job {spec.name!r} would run on {ex.device} but declares no memory limit; "
                             "a GPU fill job must set 'memory', a hard limit (e.g. memory: 2Gi), so that it "
                             "cannot take the training's memory")
        job = JobRecord(next(self._ids), spec, ex.key, placed=on is not None, assigned=on is not None)
        self._add_job(job)
        ex.queue.append(job)
        self._event(ex.key, job.name, "submitted", "queued")
        if self.serving:
            self._admit(ex)
        return job

    def _submit_gang(self, spec: FillJobSpec, on: tuple[GpuKey, ...] | None) -> JobRecord:
        """``submit`` for a gang: its leader queued like a single job until placed (``_place_gang``), or all N
        members queued on ``on``, where the operator placed them."""
        if not spec.iterative:
            raise ValueError(f"fill job {spec.name!r} asks for {spec.gpus} GPUs (gpus: {spec.gpus}), but only an SDK "
                             "job (entry: module:Class of an IterativeFillJob) runs as a gang: its processes step "
                             "together on the bubbles their GPUs share, which the SDK's runtime gates; run a plain "
                             "command or an imperative job with gpus: 1")
        if on is not None:
            if len(on) != spec.gpus or len(set(on)) != len(on) or len({k.stage for k in on}) != 1:
                raise ValueError(f"fill job {spec.name!r} asks for {spec.gpus} GPUs of one stage (gpus: {spec.gpus}) "
                                 f"but was placed on {', '.join(map(str, on))}: a gang needs {spec.gpus} distinct "
                                 "ranks of one stage")
            missing = [k for k in on if not self.serves(k)]
            if missing:
                raise ValueError(f"fill job {spec.name!r} was placed on {missing[0]}, which this agent does not serve "
                                 "(no hook of that rank has written its card here)")
        candidates = [self.executor(k) for k in on] if on is not None else self._candidates(spec)
        if not candidates:
            raise ValueError(f"fill job {spec.name!r}: the agent serves no GPU " + (
                f"of stage {spec.stage}" if spec.stage is not None else "yet") + " (no hook of training "
                f"{self.config.training!r} has written its card there); submit it once the training runs")
        if any(control.cuda_device_index(e.device) is not None for e in candidates) and spec.memory_bytes <= 0:
            raise ValueError(f"fill job {spec.name!r} would run on GPUs but declares no memory limit; a GPU fill job "
                             "must set 'memory', a hard limit per process (e.g. memory: 2Gi)")
        gang = Gang(next(self._ids), spec.gpus)
        keys = on if on is not None else (min(candidates, key=lambda e: (len(e.queue) + (e.active is not None),
                                                                          e.key)).key,)
        for rank, key in enumerate(keys):
            job = JobRecord(next(self._ids), spec, key, placed=on is not None, assigned=on is not None, gang=gang,
                            gang_rank=rank)
            gang.members.append(job)
            self._add_job(job)
            self.executor(key).queue.append(job)
        lead = gang.members[0]
        self._event(lead.key, lead.name, "submitted", f"queued: a gang of {spec.gpus} GPUs"
                    + (f" on {self._gpus_of(gang)}" if on is not None else ""))
        if self.serving:
            for key in keys:
                self._admit(self.executor(key))
        return lead

    @staticmethod
    def _gpus_of(gang: Gang) -> str:
        """The GPUs of a placed gang, for a person: "stage 0 ranks 0, 1"."""
        return f"stage {gang.members[0].stage} ranks {', '.join(str(m.rank) for m in gang.members)}"

    def _candidates(self, spec: FillJobSpec) -> list[ExecutorState]:
        """The GPUs a job may run on: its stage's, or every one for a job that names none."""
        return [e for e in self.executors if spec.stage is None or e.stage == spec.stage]

    def start_serving(self) -> None:
        """The executors' sockets are bound: from now on a profiled GPU admits its queued jobs."""
        self.serving = True

    def add_executor(self, key: GpuKey, directory: Path, device: str, core: int | None = None,
                     why: str = "") -> ExecutorState:
        """Serve one more GPU of the training (a rank or stage found after the start: its hook's card appeared);
        ``directory``: where its agent socket and ``fills/`` are. ValueError if it is served already or is another
        training's. Jobs waiting to be placed wait for its profile too (within PLACE_WAIT_NS of the first)."""
        ex = self._add(key, directory, device, core)
        log.info("%s: served on %s%s", key, device, f" ({why})" if why else "")
        self._event(key, "", "gpu", f"served on {device}" + (f": {why}" if why else ""))
        return ex

    def on_datagram(self, key: GpuKey, data: bytes, pid: int | None = None) -> None:
        """One datagram from the training's hook, received on GPU ``key``'s socket; ``pid``: its sender's process in
        this agent's PID namespace, where the kernel could say (None: it could not, or the server did not ask)."""
        ex = self.executor(key)
        try:
            msg = wire.decode(data)
        except wire.NewerMessage as exc:
            # A newer hook in the training's image: not garbage, and it does not stop the kinds this agent knows.
            self.newer_messages += 1
            if (exc.version, exc.kind) not in self._newer_seen and len(self._newer_seen) < 64:
                self._newer_seen.add((exc.version, exc.kind))
                log.warning("%s: the training's hook is newer than this agent: %s", ex.key, exc)
                self._event(ex.key, "", "datagram", f"from a newer hook: {exc}")
            return
        except wire.WireError as exc:
            self._reject(ex.key, "datagram", str(exc))
            return
        if msg.stage != ex.stage:
            self._reject(ex.key, "datagram", f"{msg.kind.name} for stage {msg.stage} sent to the socket of {ex.key} "
                         f"(stage {ex.stage})")
            return
        ex.last_message_ns = self.clock()
        self.training_end.heard(ex.key, ex.last_message_ns)
        if pid is not None and pid > 0 and pid != ex.training_pid:  # a valid message's sender: the training's process
            ex.training_pid = pid
            ex.training_membership = ex.training_membership.for_new_process()
        self._on_message(ex, msg)
        if (ex.training_membership.needs_asking and ex.cycle is not None and ex.training_pid is not None
                and self.isolation_raw.mode is IsolationMode.MPS):
            self._ask_training_membership(ex)

    def _ask_training_membership(self, ex: ExecutorState) -> None:
        """Under MPS on a GPU, ask what the training's process is to the server: at most once every
        ``TRAINING_RECHECK_S`` per GPU, whatever the processes sending (a check could not be made, nothing could be
        told, a new process), and only while the isolation is ready."""
        now = self.clock()
        if not may_ask(ex.device, self.isolation_raw, ex.training_asked_ns, now):
            return
        assert ex.training_pid is not None
        ex.training_membership, ex.training_asked_ns = TrainingMembership.PENDING, now
        self._actions.append(VerifyTraining(ex.key, ex.training_pid, ex.device))

    def training_membership(self, key: GpuKey, pid: int, answer: str | None, *, transient: bool = False) -> None:
        """The answer to ``VerifyTraining``: ``Isolation.training_membership``'s, or (``transient``) why the check
        could not be made, asked again later. An answer about a process the GPU no longer has is dropped, and the
        GPU's current process asked about instead (no sooner than the rate allows)."""
        ex = self.executor(key)
        if not ex.training_membership.pending:
            return
        if ex.training_pid != pid:
            ex.training_membership = TrainingMembership.NOT_ASKED
            return
        if transient:
            ex.training_membership = TrainingMembership.NOT_ASKED
            log.warning("%s: could not check whether the training (pid %d) is an MPS client: %s; asking again "
                        "in %.0f s", key, pid, answer, TRAINING_RECHECK_S)
            return
        ex.training_membership = TrainingMembership.of_answer(answer)  # None: unknown now; asked again later
        if answer is None:
            return
        if answer == MPS_CLIENT:
            log.info("%s: the training (pid %d) is a client of the node's MPS server", key, pid)
            self._event(key, "", "training", f"the training's process {pid} is a client of the node's MPS server")
        else:
            log.warning("%s: the training is %s", key, answer)
            self._event(key, "", "training", answer)

    def cancel(self, name: str, reason: str) -> bool:
        """Stop the fill job ``name`` (queued or running) with ``reason``; False if no such job is live."""
        live = [j for j in self.jobs if j.name == name and j.state is not FillState.STOPPED]
        for job in live:  # a gang's members all (each leaves its queue; stopping one stops the others)
            ex = self.executor(job.key)
            if job in ex.queue:
                ex.queue.remove(job)
            self._stop_job(job, reason)
        for job in live:
            ex = self.executor(job.key)
            if ex.active is None:
                self._admit(ex)
        return bool(live)

    def set_guard_limits(self, budget: float | None, max_share: float | None, source: str,
                         tail_risk: float | None = None) -> bool:
        """Apply a training's own slowdown budget, largest fill share and tail risk (None keeps the agent's); True if
        anything changed. The tail risk goes to every running fill process at once (``limits``).

        ValueError (from ``GuardConfig``, ``check_tail_risk``) if they are out of range; nothing changes then.
        """
        g = self.config.guard
        budget = g.budget if budget is None else budget
        max_share = g.max_share if max_share is None else max_share
        if tail_risk is not None:
            check_tail_risk(tail_risk, "the tail risk")
        if (budget, max_share) == (g.budget, g.max_share):
            return self._set_tail_risk(tail_risk, source)
        new = replace(g, budget=budget, max_share=max_share, initial_share=min(g.initial_share, max_share),
                      min_share=min(g.min_share, max_share))
        self._set_tail_risk(tail_risk, source)
        self.config = replace(self.config, guard=new)
        if self.guard is not None:
            self.guard.retune(new)
        self._event(self.guard_key, "", "guard",
                    f"limits from {source}: slowdown budget {budget:.2%}, largest fill share {max_share:.2f}")
        log.info("slowdown guard: limits from %s: budget %.2f%%, largest fill share %.2f", source, budget * 100,
                 max_share)
        self._set_share(min(self.share, max_share) if self.guard is not None else new.initial_share)
        return True

    def _set_tail_risk(self, risk: float | None, source: str) -> bool:
        if risk is None or risk == self.config.tail_risk:
            return False
        self.config = replace(self.config, tail_risk=risk)
        self._event(self.guard_key, "", "guard", f"tail risk from {source}: {risk:g}")
        log.info("fill steps past a bubble's predicted end: risk %g from %s", risk, source)
        for e in self.executors:
            if e.active is not None and e.active.armed is not None:
                self._send_limits(e.active)
        return True

    def _set_share(self, share: float) -> None:
        """A new share of each bubble for fill work: exported, and sent to every armed job."""
        if share == self.share:
            return
        self.share = share
        self.sink.share(share)
        for e in self.executors:
            if e.active is not None and e.active.armed is not None:
                self._send(e.active, "share", share=share)

    def reset_gpu(self, key: GpuKey, reason: str) -> None:
        """The process behind GPU ``key`` changed (its training Pod restarted): forget its bubble cycle, so nothing is
        admitted there until the new hook has profiled it, and stop the fill job that ran in the old bubbles."""
        ex = self.executor(key)
        ex.cycle = None
        ex.open_bubbles.clear()
        ex.predicted.clear()  # the new process's bubbles are predicted afresh
        ex.last_message_ns = None
        ex.training_membership = ex.training_membership.for_new_process()
        ex.training_pid = None
        if key == self.guard_key:
            self.guard = None
        job = ex.active
        if job is not None and job.state is not FillState.STOPPED:
            self._stop_job(job, reason)
        self._event(key, "", "reset", reason)

    def on_control_line(self, job: JobRecord, line: bytes) -> None:
        """One line from a fill process's control channel."""
        try:
            ev = control.parse_event(line)
        except control.ControlError as exc:
            self._reject(job.key, "control", f"fill job {job.name!r}: {exc}")
            return
        if ev.unknown:
            new = {f"{ev.type}.{name}" for name in ev.unknown} - job.unknown_fields
            if new:  # once per field and job: a newer SDK sends them on every step
                job.unknown_fields |= new
                message = (f"ignored field(s) {', '.join(sorted(new))} this agent does not know (the fill job's "
                           "SDK is newer than the agent: upgrade the agent to use them)")
                log.warning("%s: fill job %r: %s", job.key, job.name, message)
                self._event(job.key, job.name, "control", message)
        self._on_event(job, ev)

    def launched(self, job: JobRecord, *, has_control: bool) -> None:
        """The shell started ``job``'s process (after a ``Launch``)."""
        raw = self.isolation_raw
        job.isolation = raw.mode.label if raw.state == IsolationState.READY and raw.mode != IsolationMode.NONE \
            else UNISOLATED
        job.isolation_epoch = raw.epoch
        if job.reason.startswith("waiting for isolation"):
            job.reason = ""
        job.launched = True
        job.has_control = has_control
        job.step_s = job.spec.gating_step_s
        self._set_state(job, FillState.CREATED)
        if has_control:
            self._send(job, "init")
            deadline = self.clock() + int(self._init_timeout_s(job) * 1e9)
            self._timers.push(deadline, job, TimerKind.INIT_DEADLINE)
        else:
            # A plain command has no init handshake: the mode decides at once whether it is frozen (until its
            # stage's first bubble) or runs freely (naive).
            self._set_state(job, FillState.PAUSED)
            self._apply_mode(self.executor(job.key), job)

    def launch_failed(self, job: JobRecord, error: str) -> None:
        """The shell could not start ``job``'s process; the next queued job gets its turn."""
        log.error("%s: fill job %r failed to start: %s", job.key, job.name, error)
        ex = self.executor(job.key)
        if ex.active is job:
            ex.active = None
        self._set_state(job, FillState.STOPPED, f"failed to start: {error}")
        self._admit(ex)

    def on_exit(self, job: JobRecord, code: int | None) -> None:
        """``job``'s process exited with ``code`` (its pending control lines already delivered)."""
        if not job.launched:
            return
        if job.state is not FillState.STOPPED:
            if job.gang is not None and not job.finished and code == 0:
                # Without "finished" and unasked: gone before its gang (its channel closed, say); the others would
                # wait for it in their collectives.
                self._set_state(job, FillState.STOPPED, "failed: its process exited (code 0) before the gang had "
                                "finished")
            elif job.finished or code == 0:
                self._set_state(job, FillState.STOPPED, "finished")
            else:
                detail = f": {job.last_error}" if job.last_error else ""
                log.error("%s: fill job %r exited with code %s%s", job.key, job.name, code, detail)
                self._set_state(job, FillState.STOPPED, f"failed: exited with code {code}{detail}")
        self._release(job)
        ex = self.executor(job.key)
        if ex.active is job:
            ex.active = None
            self._admit(ex)

    def tick(self, now_ns: int) -> None:
        """Fire the watchdogs that are due at ``now_ns``."""
        while (timer := self._timers.pop_due(now_ns)) is not None:
            self._fire(timer)

    def _fire(self, timer: Timer) -> None:
        job = timer.job
        if timer.kind is TimerKind.INIT_DEADLINE:
            self._init_overdue(job)
        elif timer.kind is TimerKind.STOP_DEADLINE:
            self._stop_overdue(job)
        elif timer.kind is TimerKind.END_OVERDUE:
            self._end_overdue(job, bubble_seq=timer.bubble_seq)
        else:
            self._watchdog(job, timer.bubble_seq, timer.bubble_end_ns)

    def on_isolation(self, raw: IsolationStatus) -> None:
        """Act on a health check: record changes, stop jobs whose isolation is gone, admit or hold jobs."""
        prev_raw, prev = self.isolation_raw, self.isolation_status
        status = effective_status(raw, self.config.allow_unisolated)
        self.isolation_raw, self.isolation_status = raw, status
        if prev_raw.state == IsolationState.READY and raw.state != IsolationState.READY:
            self.isolation_losses += 1
        if (status.state, status.detail) != (prev.state, prev.detail):
            level = {IsolationState.READY: logging.INFO,
                     IsolationState.UNISOLATED: logging.WARNING}.get(status.state, logging.ERROR)
            log.log(level, "isolation (%s) %s: %s", status.mode, status.state.upper(), status.detail)
            self._event(None, "", "isolation", f"{status.state}: {status.detail}")
        for ex in self.executors:
            job = ex.active
            if job is None or not job.launched or job.state is FillState.STOPPED:
                continue
            if status.usable and not (job.isolation == raw.mode
                                      and (raw.state != IsolationState.READY or job.isolation_epoch != raw.epoch)):
                continue
            # READY again but in a new epoch: the outage was shorter than a check interval.
            lost = raw.detail if raw.state != IsolationState.READY \
                else f"{raw.mode} isolation was re-established ({raw.detail})"
            self._stop_job(job, f"isolation lost: {lost}")
            self._resubmit(job)
        for ex in self.executors:
            if status.usable:
                self._admit(ex)
            else:
                self._hold(ex)

    def begin_shutdown(self) -> list[JobRecord]:
        """Cancel queued jobs and ask running ones to stop; the jobs whose processes the shell must reap."""
        why = self._shutdown_why()
        for job in self.jobs:
            if job.state is FillState.SUBMITTED:
                self._set_state(job, FillState.STOPPED, f"cancelled: {why}")
            elif job.launched and job.state is not FillState.STOPPED:
                self._ask_to_stop(job)
        return [j for j in self.jobs if j.launched]

    def reaped_at_shutdown(self, job: JobRecord) -> None:
        """``job``'s process is gone at shutdown (its pending control lines already delivered)."""
        if job.state is not FillState.STOPPED:
            self._set_state(job, FillState.STOPPED, "finished" if job.finished else f"stopped: {self._shutdown_why()}")
        self._release(job)

    def _shutdown_why(self) -> str:
        if self.ended is None:
            return "agent shut down"
        return "agent shut down (the training ended)" if self.ended.code == 0 else "agent shut down (no training)"

    # -- bubble signals ------------------------------------------------------------------------------------
    def foreign_datagram(self, key: GpuKey, pid: int, holder: int | None) -> None:
        """A datagram on GPU ``key``'s socket from process ``pid`` while process ``holder`` holds its hook lock (the
        training's): refused unread. Fill processes share the GPU directories, and a PROFILE sent by one would have
        set the free memory fill jobs are planned against."""
        self._reject(key, "datagram", f"sent by process {pid}, not by the training's process {holder} (which holds "
                                      f"the GPU's {paths.HOOK_LOCK_NAME})")

    def _on_message(self, ex: ExecutorState, msg: wire.Message) -> None:
        if isinstance(msg, wire.BubbleStart):
            job = ex.active
            armed = job if job is not None and job.armed is FillMode.HARVEST and job.state is not FillState.STOPPED \
                else None
            ex.open_bubbles[msg.seq] = OpenBubble(msg, self.fill_paused, self.share, armed.name if armed else "",
                                                  (armed.step_s or 0.0) if armed else 0.0)
            ex.note_start(msg.slot, msg.predicted_end_ns - msg.start_ns, start_lag(self.clock() - msg.start_ns))
            if len(ex.open_bubbles) > MAX_OPEN_BUBBLES:  # ENDs lost: forget the oldest
                ex.open_bubbles.pop(next(iter(ex.open_bubbles)))
            if (job is not None and job.launched and not job.iterative and ex.mode is FillMode.HARVEST
                    and not self.fill_paused and job.state in (FillState.PAUSED, FillState.RUNNING)):
                if job.state is FillState.PAUSED:
                    self._signal(job, signal.SIGCONT)
                    self._set_state(job, FillState.RUNNING)
                # A plain command runs until this bubble's END freezes it. Should the END be lost (the agent's
                # socket full: the hook never waits), it is frozen here instead, once the bubble has lasted twice
                # its predicted length plus the grace: an END lost costs the training at most that, not the time
                # until some later END arrives.
                predicted = max(0, msg.predicted_end_ns - msg.start_ns)
                deadline = msg.start_ns + 2 * predicted + int(self.config.grace_s * 1e9)
                self._timers.push(deadline, job, TimerKind.END_OVERDUE, bubble_seq=msg.seq)
        elif isinstance(msg, wire.BubbleEnd):
            ob = ex.open_bubbles.pop(msg.seq, None)
            if ob is not None and msg.end_ns > self.clock() + FUTURE_SLACK_NS:
                self._reject(ex.key, "datagram", f"BUBBLE_END stamped {(msg.end_ns - self.clock()) / 1e9:.1f} s in "
                             "the future (the hook must stamp CLOCK_MONOTONIC)")
            elif ob is not None and msg.end_ns >= ob.start.start_ns:
                self.ledgers[ex.mode.label].add_bubble(ex.key, ob.start.start_ns, msg.end_ns)
                if len(self.bubbles) < MAX_BUBBLE_RECORDS:
                    self.bubbles.append({"stage": ex.stage, "rank": ex.rank, "slot": msg.slot,
                                         "start_ns": ob.start.start_ns,
                                         "end_ns": msg.end_ns, "mode": ex.mode.label,
                                         "predicted_end_ns": ob.start.predicted_end_ns,
                                         "guard_paused": ob.guard_paused, "share": ob.share, "job": ob.job,
                                         "step_s": ob.step_s})
                self._plan_bubble(ex, ob, msg)
            job = ex.active
            if job is None or ex.mode is not FillMode.HARVEST or job.state is FillState.STOPPED:
                return
            if job.iterative:
                deadline = msg.end_ns + int(self.config.grace_s * 1e9)
                self._timers.push(deadline, job, TimerKind.WATCHDOG, bubble_seq=msg.seq, bubble_end_ns=msg.end_ns)
            elif job.state is FillState.RUNNING:
                self._signal(job, signal.SIGSTOP)
                self._set_state(job, FillState.PAUSED)
        elif isinstance(msg, wire.Iteration):
            ex.last_iteration_s = msg.duration_ns / 1e9
            self.sink.iteration(ex.key, msg.duration_ns / 1e9)
            self._on_iteration(ex, msg)
            self._place_waiting()  # a job that names no stage, waiting for profiles that may never come
        elif isinstance(msg, wire.Profile):
            try:
                cycle = BubbleCycle.from_dict(msg.cycle)
            except ValueError as exc:
                self._reject(ex.key, "profile", f"invalid bubble cycle: {exc}")
                return
            first = ex.cycle is None
            ex.cycle = cycle
            if first:
                ex.profiled_ns = self.clock()
                log.info("%s: bubble cycle with %d bubble(s), %.1f ms of %.1f ms per iteration",
                         ex.key, len(cycle.slots), cycle.bubble_s * 1e3, cycle.iteration_s * 1e3)
                self._event(ex.key, "", "profile", f"{len(cycle.slots)} bubbles, "
                            f"{cycle.bubble_s * 1e3:.2f} ms of {cycle.iteration_s * 1e3:.2f} ms")
            self._admit(ex)
            self._place_waiting()  # the last profile a job that names no stage waited for
        elif isinstance(msg, wire.FillModeChange) and msg.mode is not ex.mode:
            log.info("%s: fill mode %s -> %s", ex.key, ex.mode.label, msg.mode.label)
            self._event(ex.key, "", "mode", msg.mode.label)
            ex.mode = msg.mode
            ex.since_mode_change = 0
            ex.open_bubbles.clear()
            if ex.active is not None:
                self._apply_mode(ex, ex.active)

    def _on_iteration(self, ex: ExecutorState, msg: wire.Iteration) -> None:
        """One GPU's iteration time. The training's one guard on this node is fed by one GPU, the lowest stage's
        lowest rank that reports (a lower one heard later takes over, with a new guard): every rank of a pipeline
        iterates in lockstep, so its iteration time is the training's, and the guard's share and pause apply to the
        fill jobs on every GPU of the training. Feeding it every rank would count each iteration several times."""
        if self.guard_key is None or ex.key < self.guard_key:
            self.guard_key = ex.key
            self.guard = None
        ex.since_mode_change += 1
        if ex.key != self.guard_key or msg.duration_ns <= 0:
            return
        if ex.since_mode_change <= MODE_SETTLE_ITERATIONS:
            return  # a mode switch reaches the fill processes asynchronously: not this mode's iterations yet
        if ex.mode is FillMode.NAIVE:
            return
        if self.guard is None:
            if ex.cycle is None or ex.cycle.iteration_s <= 0:
                return
            self.guard = SlowdownGuard(ex.cycle.iteration_s, self.config.guard)
        if ex.mode is FillMode.OFF:  # no fill work at all: a baseline measurement for free
            self.guard.observe_unfilled(msg.duration_ns / 1e9)
            return
        decision = self.guard.observe(msg.duration_ns / 1e9)
        if decision.slowdown is not None:
            log.info("slowdown guard: %s", decision.reason)
        self._set_share(decision.share)
        if decision.event is not None:
            self._event(ex.key, "", "guard", decision.event)
        if decision.fill_paused != self.fill_paused:
            self.fill_paused = decision.fill_paused
            for e in self.executors:
                if e.active is not None:
                    self._apply_mode(e, e.active)

    # -- control events ------------------------------------------------------------------------------------
    def _on_event(self, job: JobRecord, ev: control.ControlMessage) -> None:
        ex = self.executor(job.key)
        if ev.type == "step_begin":
            job.in_step = (ev["t_ns"], ev["bubble_seq"])
        elif ev.type == "step":
            job.in_step = None
            job.steps += 1
            # A step that reports no FLOPs counts what its spec says one step does (a FillJob's flopsPerStep).
            flops = ev["flops"] or job.spec.flops_per_step or 0.0
            job.flops += flops
            mode = ev.get("mode") or ex.mode.label
            totals = job.job_totals.setdefault(mode, [0, 0.0])
            totals[0] += 1
            totals[1] += flops
            try:
                if ev["end_ns"] > self.clock() + FUTURE_SLACK_NS:  # one such stamp would fold the stage's ledger away
                    raise ValueError(f"step ends {(ev['end_ns'] - self.clock()) / 1e9:.1f} s in the future (steps are "
                                     "stamped with CLOCK_MONOTONIC)")
                self.ledgers[mode].add_step(job.key, job.name, ev["start_ns"], ev["end_ns"], float(flops),
                                            tail=ev.get("gate") == "tail")
            except ValueError as exc:
                self._reject(job.key, "control", f"fill job {job.name!r}: {exc}")
            if mode == FillMode.HARVEST.label and ev.get("bubble_seq", -1) >= 0:
                job.plan.step(ev["bubble_seq"], ev.get("size"), ev["start_ns"], ev["end_ns"], ev.get("signal_ns", 0),
                              ev.get("gate") == "tail")
            if len(self.steps) < MAX_STEP_RECORDS:
                self.steps.append({"stage": job.stage, "rank": job.rank, "job": job.name, "start_ns": ev["start_ns"],
                                   "end_ns": ev["end_ns"], "flops": flops, "mode": mode,
                                   "signal_ns": ev.get("signal_ns", 0), "bubble_seq": ev.get("bubble_seq", -1),
                                   "size": ev.get("size"),  # the step size, for a job with step_sizes
                                   "tail": ev.get("gate") == "tail"})  # on TailRisk's word, not the prediction's
        elif ev.type == "state":
            if job.state is FillState.STOPPED:
                return
            target = FillState(ev["state"])
            if target is FillState.CREATED or target is job.state:
                return
            try:
                self._set_state(job, target)
            except InvalidTransition as exc:
                self._reject(job.key, "control", f"fill job {job.name!r}: {exc}")
                return
            if target is FillState.PAUSED and job.armed is None:
                if self._must_verify(ex, job):
                    # Its init is done, so it has initialized CUDA: now it is an MPS client, or it never will be.
                    job.verification = "pending"
                    self._actions.append(VerifyIsolation(job, ex.device))
                    return
                self._apply_mode(ex, job)
        elif ev.type == "profile":
            job.step_s = float(ev["step_s"])
            sizes = ev.get("sizes") or []
            detail = f" (by step size: {', '.join(f'{n}: {t * 1e3:.3f} ms' for n, t in sizes)})" if sizes else ""
            self._event(job.key, job.name, "profile", f"step time {job.step_s * 1e3:.3f} ms{detail}")
            job.plan.reported_times(job.step_s, sizes)
            if not job.planned_with_step and ex.cycle is not None and job.state is not FillState.STOPPED:
                job.planned_with_step = True
                self._plan(ex, job, (FillNode(job.step_s, job.spec.memory_bytes),))
            elif job.plan.planned is None and ex.cycle is not None and job.state is not FillState.STOPPED:
                self._state_plan(ex, job)
        elif ev.type == "finished":
            job.finished = True
            self._stop_job(job, "finished")
        elif ev.type == "error" and ev["message"].startswith("rejected command: unknown command type 'limits'"):
            # An SDK older than the training's tail limit: it keeps its own risk. Said once; not the job's error (a
            # later failure of the job must not be reported as this).
            if "limits" not in job.unknown_fields:
                job.unknown_fields.add("limits")
                message = ("its SDK is older than the limits command: the training's tailRisk does not reach it (it "
                           "keeps its own BUBBLES_TAIL_RISK; upgrade the fill job's image)")
                log.warning("%s: fill job %r: %s", job.key, job.name, message)
                self._event(job.key, job.name, "control", message)
        elif ev.type == "error":
            job.last_error = ev["message"]
            log.error("%s: fill job %r reports: %s", job.key, job.name, job.last_error)
            self._event(job.key, job.name, "error", job.last_error)

    # -- jobs ----------------------------------------------------------------------------------------------
    def _admit(self, ex: ExecutorState) -> None:
        """Launch the next queued job on ``ex`` if it is free, the cycle is known and isolation allows it."""
        if not self.serving:
            return
        if not self.isolation_status.usable:
            self._hold(ex)
            return
        if ex.active is None and not ex.queue and ex.cycle is not None:
            self._take_waiting(ex)
        while ex.active is None and ex.queue and ex.cycle is not None:
            job = ex.queue[0]
            if job.state is FillState.SUBMITTED and not job.placed:
                if not (self._place_gang(job) if job.gang is not None else self._place(job)):
                    return  # the other GPUs' profiles are due: placed when they come (on_datagram)
                if job.key != ex.key:
                    self._admit(self.executor(job.key))
                    continue
            if job.gang is not None and job.state is FillState.SUBMITTED:
                if not self._admit_gang(job.gang):
                    return  # its other GPUs are busy or not profiled: launched when the last is free
                continue
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
            # As the hook reaches it: in a training Pod's own directory the agent binds through a descriptor of it.
            problem = paths.socket_path_problem(paths.as_the_pod_sees(self._fill_socket(job)))
            if problem is not None:
                log.error("%s: fill job %r not started: %s", ex.key, job.name, problem)
                self._set_state(job, FillState.STOPPED, f"not started: {problem}")
                continue
            ex.active = job
            self._actions.append(Launch(job, ex.device, ex.core, self._fill_socket(job),
                                        isolated=self.isolation_raw.state == IsolationState.READY))

    def _take_waiting(self, ex: ExecutorState) -> None:
        """``ex`` is idle, profiled and has nothing queued: take the longest-waiting job that queues behind another
        on a GPU it may run on (its stage's, or any for a job that names none). A GPU found or profiled after a job was
        placed (a rank whose card came late, whose hook had no iteration to greet the agent's new socket in) would
        otherwise idle while the job waits behind another on its stage's first GPU. Neither a job the operator
        placed (its Pod attached on that GPU) nor a gang's member (placed with the others) moves."""
        waiting = [j for e in self.executors if e is not ex for i, j in enumerate(e.queue)
                   if (e.active is not None or i > 0) and j.state is FillState.SUBMITTED
                   and not j.assigned and j.gang is None and (j.spec.stage is None or j.spec.stage == ex.stage)]
        if not waiting:
            return
        job = min(waiting, key=lambda j: j.id)
        self.executor(job.key).queue.remove(job)
        was, job.key = job.key, ex.key
        ex.queue.append(job)
        assert ex.cycle is not None
        message = (f"moved from {was}, where it waited behind another job, to stage {ex.stage} rank {ex.rank}: idle, "
                   f"{ex.cycle.bubble_s * 1e3:.1f} ms of bubbles per iteration")
        log.info("fill job %r %s", job.name, message)
        self._event(ex.key, job.name, "placed", message)

    def _ready_candidates(self, job: JobRecord) -> list[ExecutorState] | None:
        """``job``'s candidate GPUs that have profiled, or None while the others' profiles are still due (every
        candidate profiled, or PLACE_WAIT_NS since the first profile): what ``_place`` and ``_place_gang`` choose
        among."""
        candidates = self._candidates(job.spec)
        profiled = [e for e in candidates if e.cycle is not None]
        if not profiled:
            return None
        first = min(e.profiled_ns for e in profiled if e.profiled_ns is not None)
        if len(profiled) < len(candidates) and self.clock() - first < PLACE_WAIT_NS:
            return None
        return profiled

    def _place(self, job: JobRecord) -> bool:
        """Put a job on one of its candidate GPUs (its stage's, or every one for a job that names none): the GPU with
        the most bubble time per iteration not taken by other jobs (a GPU that runs or queues one has none free; then
        the fewest jobs there, then the lowest key, break ties); False while other candidates' profiles are still due
        (every candidate profiled, or PLACE_WAIT_NS since the first profile). A newcomer's spec need not know which
        GPU waits."""
        profiled = self._ready_candidates(job)
        if profiled is None:
            return False

        def others(e: ExecutorState) -> int:
            return len([j for j in e.queue if j is not job]) + (e.active is not None)

        def free_bubble_s(e: ExecutorState) -> float:
            return e.cycle.bubble_s if e.cycle is not None and others(e) == 0 else 0.0

        best = max(profiled, key=lambda e: (free_bubble_s(e), e.cycle.bubble_s if e.cycle else 0.0, -others(e),
                                            _reversed(e.key)))
        job.placed = True
        if best.key != job.key:
            old = self.executor(job.key)
            old.queue.remove(job)
            best.queue.append(job)
            job.key = best.key
        if len(self._candidates(job.spec)) == 1:
            return True  # nothing to choose: said as "queued" already
        assert best.cycle is not None
        message = (f"on stage {best.stage} rank {best.rank}, the most bubble time free: "
                   f"{best.cycle.bubble_s * 1e3:.1f} ms of {best.cycle.iteration_s * 1e3:.1f} ms per iteration ("
                   + ", ".join(f"stage {e.stage} rank {e.rank}: {free_bubble_s(e) * 1e3:.1f} ms free"
                               for e in profiled if e.cycle)
                   + ")")
        log.info("fill job %r placed %s", job.name, message)
        self._event(best.key, job.name, "placed", message)
        return True

    def _place_waiting(self) -> None:
        """Place the queued jobs not placed yet, where the time to wait for profiles has run out; launch a gang
        whose GPUs have all come free."""
        for ex in list(self.executors):
            if ex.cycle is not None and ex.active is None and ex.queue:
                head = ex.queue[0]
                if not head.placed or head.gang is not None:
                    self._admit(ex)

    def _place_gang(self, job: JobRecord) -> bool:
        """Put a gang's leader and its N-1 other members on N GPUs of one stage: of the stages with N profiled GPUs
        (its own, for one that names a stage), the N GPUs whose shared bubble time (``_shared_bubble_s``) is the
        most, free GPUs before busy ones; False while profiles are due (as ``_place``). A gang no stage holds is
        rejected (STOPPED, said), True then."""
        gang = job.gang
        assert gang is not None
        profiled = self._ready_candidates(job)
        if profiled is None:
            return False

        def others(e: ExecutorState) -> int:
            return len([j for j in e.queue if j is not job]) + (e.active is not None)

        by_stage: dict[int, list[ExecutorState]] = {}
        for e in profiled:
            by_stage.setdefault(e.stage, []).append(e)
        choices = []
        for stage, exs in by_stage.items():
            if len(exs) < gang.size:
                continue
            chosen = sorted(sorted(exs, key=lambda e: (others(e), -(e.cycle.bubble_s if e.cycle else 0.0),
                                                       e.key))[:gang.size], key=lambda e: e.key)
            shared = _shared_bubble_s(chosen)
            free = all(others(e) == 0 for e in chosen)
            choices.append(((free, shared, -sum(others(e) for e in chosen), -stage), chosen, shared))
        if not choices:
            counts = {k: len(v) for k, v in sorted(by_stage.items())}
            served = ", ".join(f"stage {k}: {n}" for k, n in counts.items()) or "none"
            where = f"stage {job.spec.stage}" if job.spec.stage is not None else "any stage"
            reason = (f"rejected: it asks for {gang.size} GPUs of one stage (gpus: {gang.size}), but {where} has fewer "
                      f"profiled GPUs here ({served}); lower gpus to a stage's ranks on this node, or name a stage "
                      "that has them")
            log.error("fill job %r %s", job.name, reason)
            self.rejected_jobs += 1
            job.placed = True
            self._stop_job(job, reason)
            return True
        _, chosen, shared = max(choices, key=lambda c: c[0])
        job.placed = True
        if chosen[0].key != job.key:
            self.executor(job.key).queue.remove(job)
            chosen[0].queue.append(job)
            job.key = chosen[0].key
        for rank, e in enumerate(chosen[1:], start=1):
            member = JobRecord(next(self._ids), job.spec, e.key, placed=True, gang=gang, gang_rank=rank,
                               resubmission=job.resubmission)
            gang.members.append(member)
            self._add_job(member)
            e.queue.append(member)
        iteration_s = chosen[0].cycle.iteration_s if chosen[0].cycle else 0.0
        message = (f"on {self._gpus_of(gang)}, the most bubble time the {gang.size} share: {shared * 1e3:.1f} ms of "
                   f"{iteration_s * 1e3:.1f} ms per iteration")
        log.info("fill job %r placed %s", job.name, message)
        self._event(job.key, job.name, "placed", message)
        return True

    def _admit_gang(self, gang: Gang) -> bool:
        """Launch a gang's N members at once, when each is first in its GPU's queue and every one of its GPUs is free
        and profiled; False while not. True once launched, or rejected (a member's plan or socket; the others stop
        with it)."""
        members = gang.members
        exs = [self.executor(m.key) for m in members]
        if len(members) < gang.size or any(e.active is not None or e.cycle is None or not e.queue or e.queue[0] is not m
                                           for m, e in zip(members, exs, strict=True)):
            return False
        for e in exs:
            e.queue.popleft()
        for m, e in zip(members, exs, strict=True):
            if m.state is not FillState.SUBMITTED:
                return True
            nodes = m.spec.plan_nodes()
            m.planned_with_step = nodes is not None
            if nodes is None:
                nodes = (FillNode(1e-9, m.spec.memory_bytes),)
            if not self._plan(e, m, nodes, steps=None if m.planned_with_step else 1):
                return True
            problem = paths.socket_path_problem(paths.as_the_pod_sees(self._fill_socket(m)))
            if problem is not None:
                log.error("%s: fill job %r not started: %s", e.key, m.name, problem)
                self._set_state(m, FillState.STOPPED, f"not started: {problem}")
                return True
        isolated = self.isolation_raw.state == IsolationState.READY
        for m, e in zip(members, exs, strict=True):
            e.active = m
        for m, e in zip(members, exs, strict=True):
            self._actions.append(Launch(m, e.device, e.core, self._fill_socket(m), isolated=isolated,
                                        sockets=self._gang_sockets(m)))
        return True

    def _context_bytes(self, ex: ExecutorState) -> int:
        """What a fill process on ``ex`` takes beside its allocator's cap: its CUDA context, on a GPU outside MPS."""
        if control.cuda_device_index(ex.device) is None or self.config.isolation_mode is IsolationMode.MPS:
            return 0
        return self.config.cuda_context_bytes

    def _plan(self, ex: ExecutorState, job: JobRecord, nodes: tuple[FillNode, ...], steps: int | None = None) -> bool:
        """Check the job against the stage's cycle; reject it (STOPPED) if it fits no bubble.

        ``steps=None`` plans as many steps as one cycle's bubble time holds (Algorithm 1).
        """
        assert ex.cycle is not None
        context = self._context_bytes(ex)
        if context:
            nodes = tuple(FillNode(n.duration_s, n.memory_bytes + context) for n in nodes)
        try:
            plan = plan_partitions(bubbles_of(ex.cycle), nodes, steps=steps, job=job.name)
        except PlanError as exc:
            self.rejected_jobs += 1
            reason = str(exc)
            if context:
                reason += (f" Its memory there is spec.memory plus {context >> 20} MiB for its own CUDA context "
                           f"(isolation {self.config.isolation_mode.label}; the agent's --cuda-context-mib).")
            if ex.cycle.slots and all(s.free_bytes == 0 for s in ex.cycle.slots):
                # 0 is what a training without a memory probe reports (a CPU training by default).
                reason += (" The training reported no free memory in any bubble: on CPU set BUBBLES_FREE_BYTES"
                           " in the training's environment, or pass instrument(engine, memory_probe=...).")
            log.error("%s: fill job %r rejected: %s", ex.key, job.name, reason)
            self._stop_job(job, f"rejected: {reason}")
            return False
        except ValueError as exc:  # e.g. a cycle with no bubbles
            self.rejected_jobs += 1
            log.error("%s: fill job %r cannot be planned: %s", ex.key, job.name, exc)
            self._stop_job(job, f"rejected: {exc}")
            return False
        if steps is None:
            self._state_plan(ex, job)
        else:
            log.info("%s: fill job %r fits bubbles %s; its steps per iteration are planned once its step time "
                     "is known", ex.key, job.name, sorted(plan.usable_bubbles()))
        return True

    def _state_plan(self, ex: ExecutorState, job: JobRecord) -> None:
        """Make the job's first plan of fill steps per iteration (``.planning``), and say it."""
        assert ex.cycle is not None
        if not job.iterative:
            return  # a plain command has no steps the agent sees
        rate = job.plan.make(slot_predictions(ex.cycle, ex.predicted), start_lag_s(ex.start_lags))
        if rate is None or job.plan.inputs is None:
            return
        inputs = job.plan.inputs
        first = inputs.steps[0]
        message = (f"planned: {rate.steps_per_iteration:.2f} fill steps per iteration; {rate.fitting} of "
                   f"{len(rate.per_bubble)} bubbles' predicted lengths fit a first step of "
                   f"{first.first_gate_s * 1e3:.2f} ms after {inputs.latency_s * 1e3:.2f} ms of signal latency (step "
                   f"time from the {inputs.basis})")
        log.info("%s: fill job %r %s", ex.key, job.name, message)
        self._event(ex.key, job.name, "plan", message)
        if rate.fitting == 0:
            log.warning("%s: fill job %r: no bubble's predicted length (the longest %.2f ms) fits a first step "
                        "(%.2f ms with the latency): it runs steps only past a prediction, or once bubbles lengthen",
                        ex.key, job.name, rate.longest_s * 1e3, rate.first_need_s * 1e3)

    def _plan_bubble(self, ex: ExecutorState, ob: OpenBubble, end: wire.BubbleEnd) -> None:
        """A bubble of ``ex`` ended: it counts for its active job's plan if the job served it (armed in harvest, or
        withheld by the guard), and the plan is compared with what ran when that is due."""
        job = ex.active
        if (job is None or ex.cycle is None or not job.iterative or not job.launched or ex.mode is not FillMode.HARVEST
                or job.state not in (FillState.PAUSED, FillState.RUNNING) or job.verification == "pending"
                or not (ob.job == job.name or ob.guard_paused)):
            return
        slots = len(ex.cycle.slots)
        job.plan.bubble(end.seq, ob.start.predicted_end_ns - ob.start.start_ns, end.end_ns - ob.start.start_ns,
                        ob.job == job.name, ob.share, slots)
        if not job.plan.due(slots):
            return
        before = job.plan.last
        chk = job.plan.check(slot_predictions(ex.cycle, ex.predicted), start_lag_s(ex.start_lags), slots)
        if chk is None:
            return
        ratio = f" (x{chk.ratio:.2f})" if chk.ratio is not None else ""
        verdict = f"off by more than {PLAN_FACTOR:g}x: {chk.reason}" if chk.reason else f"within {PLAN_FACTOR:g}x"
        message = (f"planned {chk.planned:.2f} fill steps per iteration, ran {chk.ran:.2f}{ratio} over "
                   f"{chk.iterations:.0f} iterations: {verdict}")
        said_before = before.reason.split(":", 1)[0] if before is not None else None
        if said_before != chk.reason.split(":", 1)[0]:  # the first comparison, or a new verdict
            log.log(logging.WARNING if chk.reason else logging.INFO, "%s: fill job %r %s", ex.key, job.name,
                    message)
            self._event(ex.key, job.name, "plan", message)
        if not within_factor(chk.planned, chk.replanned):
            basis = chk.replanned_basis
            source = "measured in its bubbles" if basis == "measured" else f"from the {basis}"
            message = (f"re-planned: {chk.replanned:.2f} fill steps per iteration (was {chk.planned:.2f}), with step "
                       f"times {source}")
            log.info("%s: fill job %r %s", ex.key, job.name, message)
            self._event(ex.key, job.name, "plan", message)

    def watch_hooks(self, facts: Mapping[GpuKey, HookFacts]) -> Ending | None:
        """What the shell found of each GPU's hook (``--exit-when-done``; ``.ending``): the agent's end once the
        training has ended (or never started within the start timeout), else None. Said once."""
        now = self.clock()
        for key, f in facts.items():
            self.training_end.observe(key, f, now)
        if not self.config.exit_when_done:
            return None
        if self.ended is None:
            ending = self.training_end.verdict(now)
            if ending is None:
                return None
            self.ended = ending
            log.log(logging.INFO if ending.code == 0 else logging.ERROR, "%s; stopping the fill jobs", ending.reason)
            self._event(None, "", "ended", ending.reason)
        return self.ended

    def _must_verify(self, ex: ExecutorState, job: JobRecord) -> bool:
        """Whether ``job`` waits for ``VerifyIsolation`` before it is armed: an SDK job on a GPU, launched as an MPS
        client (a plain command has no moment at which it must have joined; CPU processes have nothing to join)."""
        return (job.verification == "" and job.has_control and job.isolation == IsolationMode.MPS.label
                and ex.device.startswith("cuda"))

    def isolation_verified(self, job: JobRecord, problem: str | None, *, transient: bool = False) -> None:
        """The answer to ``VerifyIsolation``: None, the process is isolated as promised (it is armed now); else why
        not, and the job is stopped (fail closed: a fill job outside the isolation it was admitted under could take
        memory the training needs). ``transient``: the check could not be made (the daemon did not answer); then, as
        when the isolation changed since the launch, the job is stopped and resubmitted, as after an isolation loss."""
        if job.verification != "pending" or job.state is FillState.STOPPED:
            return
        if problem is None:
            job.verification = "verified"
            self._event(job.key, job.name, "isolation", f"verified: a client of the node's {job.isolation} server")
            self._apply_mode(self.executor(job.key), job)
            return
        job.verification = ""
        if transient or job.isolation_epoch != self.isolation_raw.epoch:
            log.warning("%s: fill job %r stopped and resubmitted: isolation not verified: %s", job.key,
                        job.name, problem)
            self._stop_job(job, f"isolation not verified: {problem}")
            self._resubmit(job)
            return
        log.error("%s: fill job %r stopped: isolation not verified: %s", job.key, job.name, problem)
        self._stop_job(job, f"isolation not verified: {problem}")

    # -- reporting -----------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The totals the metrics endpoint exports."""
        return snapshot_of(self)

    def status(self) -> AgentStatus:
        """Everything the agent reports, typed (``stats()`` is its JSON form)."""
        return status_of(self)

    def stats(self) -> dict[str, Any]:
        """The status as the stats file's JSON (see the agent's documentation for the format), each executor and job
        with its GPU's namespace and rank beside its stage (``AgentStatus`` has only the stage)."""
        out = self.status().to_dict()
        for entry, ex in zip(out["executors"], self.executors, strict=True):
            entry.update(namespace=ex.key.namespace, rank=ex.rank, key=str(ex.key))
        for entry, job in zip(out["jobs"], self.jobs, strict=True):
            entry.update(rank=job.rank, key=str(job.key))
            if job.gang is not None:
                # One progress for the gang: its processes step together.
                entry["gang"] = {"rank": job.gang_rank, "size": job.gang.size,
                                 "gpus": [str(k) for k in job.gang.keys], "steps": job.gang.steps,
                                 "flops": job.gang.flops}
        out["namespace"] = self.config.namespace
        out["guard"]["rank"] = self.guard_key.rank if self.guard_key is not None else None
        return out

    def summary(self) -> str:
        """What was harvested, per GPU, in a few lines for a person (``reporting.summary_of``)."""
        return summary_of(self)


def _shared_bubble_s(exs: Sequence[ExecutorState]) -> float:
    """The bubble time per iteration that GPUs of one stage share: slot by slot, the shortest of their bubbles (their
    schedules line up), or the least of their totals where their profiles list different slots."""
    cycles = [e.cycle for e in exs if e.cycle is not None]
    if not cycles:
        return 0.0
    if len({len(c.slots) for c in cycles}) != 1:
        return min(c.bubble_s for c in cycles)
    return sum(min(slots) for slots in zip(*([s.duration_s for s in c.slots] for c in cycles), strict=True))


def _reversed(key: GpuKey) -> tuple[int, int]:
    """A key's order turned round, so that ``max`` prefers the lowest stage and rank."""
    return (-key.stage, -key.rank)
