"""The event-driven simulator (PipeFill section 5.1): fill-job arrivals and completions are the events.

Gang jobs (``FillJobRequest.gpus`` N > 1) run on N executors of one class at once (``scheduler.gang``): one waits
until N of a class are idle together (it is tried before the single jobs whenever executors free up, in arrival
order), never runs on part of them, and runs in their bubbles.

Between events nothing changes state, so time jumps from one event to the next; a job's run time
on an executor comes from the scheduler (its execution plan over that executor's bubble cycle),
never from stepping a clock. Jobs still running when the main job's time is up are credited with
the share of their work done by then (work is conserved: FLOPs = samples processed x FLOPs per
sample of the job's profile).

What an event costs is kept to the event itself (a week of 100,000 GPUs is two million of them): jobs are put in
arrival order once (a stable sort), their processing times on every class computed a block of arrivals at a time
(``Scheduler.processing_times_many``, the numbers ``submit`` would compute), a job that starts at once never enters
the scheduler's queue, and Python's cycle collector rests during the run (``simulator.gcpause``). The decisions are
the ones the step-by-step path makes (tests/test_simulator_equivalence.py replays them through the scheduler's queue
and compares every outcome).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bubbles.operator.scheduler.core import ExecutorClass, FillJobRequest, Placement, Scheduler
from bubbles.operator.scheduler.gang import GangGroup, GangPlacement, fits_somewhere, place_gang
from bubbles.operator.scheduler.policies import Policy
from bubbles.operator.simulator.gcpause import gc_paused
from bubbles.operator.simulator.mainjob import MainJob

# Arrivals whose processing times are computed at once: large enough that numpy's cost per call vanishes, small enough
# that the block's (arrivals x classes) array stays small.
PROC_BLOCK = 16_384


@dataclass(slots=True)
class JobOutcome:
    """What happened to one fill job."""

    job: FillJobRequest
    placement: Placement | GangPlacement | None = None
    done: bool = False
    samples_done: float = 0.0
    filled_s: float = 0.0  # bubble time its work occupied
    rejected: str = ""  # why the scheduler refused it (fits no bubble), else ""

    @property
    def flops(self) -> float:
        return self.samples_done * self.job.profile.flops_per_sample

    @property
    def jct_s(self) -> float | None:
        if not self.done or self.placement is None:
            return None
        return self.placement.end_s - self.job.arrival_s


@dataclass
class SimResult:
    """The outcome of one simulation: the main job, the policy, the horizon and every job's outcome."""

    main: MainJob
    policy: str
    horizon_s: float
    outcomes: list[JobOutcome] = field(default_factory=list)
    events: int = 0


def simulate(
    main: MainJob,
    jobs: Sequence[FillJobRequest],
    policy: str | Policy = "fifo",
    *,
    hours: float | None = None,
    classes: Sequence[ExecutorClass] | None = None,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Run ``jobs`` in the bubbles of ``main`` under ``policy`` for ``hours`` (None: until all are done).

    Jobs arriving after the horizon are not submitted. ``progress`` is called with the fraction of
    simulated time (or of jobs, without a horizon) now and then.
    """
    with gc_paused():
        return _simulate(main, jobs, policy, hours, classes, progress)


def _simulate(
    main: MainJob,
    jobs: Sequence[FillJobRequest],
    policy: str | Policy,
    hours: float | None,
    classes: Sequence[ExecutorClass] | None,
    progress: Callable[[float], None] | None,
) -> SimResult:
    sched = Scheduler(classes if classes is not None else main.executor_classes(), policy)
    groups, first = [], 0
    for c in sched.classes:  # a gang's executors: of one class (one stage)
        groups.append(GangGroup(c.name, tuple(range(first, first + c.executors))))
        first += c.executors
    waiting: list[FillJobRequest] = []  # gangs, in arrival order
    gang_on: dict[int, GangPlacement] = {}  # executor -> the gang running on it
    in_order = [jobs[k] for k in arrival_order(jobs)]
    arrivals = [j.arrival_s for j in in_order]
    n_jobs = len(in_order)
    horizon_s = math.inf if hours is None else hours * 3600.0
    outcomes = {j.job_id: JobOutcome(j) for j in jobs}
    if len(outcomes) != len(jobs):
        raise ValueError("fill job ids must be unique; the trace has duplicates")
    proc_block = np.empty((0, len(sched.classes)))
    heappush, heappop, inf = heapq.heappush, heapq.heappop, math.inf  # local names: looked up once per event
    completions: list[tuple[float, int, int]] = []  # (end_s, seq, executor)
    seq = 0
    events = 0
    nxt = 0
    last_report = -1.0
    now = 0.0

    def started(p: Placement | None) -> None:
        nonlocal seq
        if p is None:
            return
        outcomes[p.job.job_id].placement = p
        heappush(completions, (p.end_s, seq, p.executor))
        seq += 1

    def gang_started(g: GangPlacement) -> None:
        nonlocal seq
        outcomes[g.job.job_id].placement = g
        for e in g.executors:
            gang_on[e] = g
        heappush(completions, (g.end_s, seq, g.executors[0]))
        seq += 1

    def start_gangs(t: float) -> None:
        for job in list(waiting):
            g = place_gang(sched, job, groups, t)
            if g is not None:
                waiting.remove(job)
                gang_started(g)

    def freed(executors: Sequence[int], t: float) -> None:
        """Executors just released (not filled): waiting gangs first, then the queued single jobs."""
        start_gangs(t)
        for e in executors:
            if sched.idle(e):
                started(sched.fill(e, t))

    while True:
        t_arr = arrivals[nxt] if nxt < n_jobs else inf
        t_done = completions[0][0] if completions else inf
        now = t_done if t_done < t_arr else t_arr  # min(t_arr, t_done)
        if now == inf or now > horizon_s:
            break
        events += 1
        if t_done <= t_arr:  # completions first: a freed executor can take the arriving job
            _, _, e = heappop(completions)
            g = gang_on.get(e)
            if g is not None:
                o = outcomes[g.job.job_id]
                o.done, o.samples_done, o.filled_s = True, float(g.job.samples), g.filled_s
                for x in g.executors:
                    del gang_on[x]
                    sched.release(x, now, fill=False)
                freed(g.executors, now)
            else:
                p = sched.running[e]
                o = outcomes[p.job.job_id]
                o.done, o.samples_done, o.filled_s = True, float(p.job.samples), p.filled_s
                if waiting:
                    sched.release(e, now, fill=False)
                    freed((e,), now)
                else:
                    p_next = sched.release(e, now)
                    if p_next is not None:
                        started(p_next)
        else:
            job = in_order[nxt]
            row = nxt % PROC_BLOCK
            if row == 0:  # the next block of arrivals' processing times
                proc_block = sched.processing_times_many(in_order[nxt : nxt + PROC_BLOCK])
            nxt += 1
            if job.gpus > 1:
                if fits_somewhere(sched, job, groups):
                    g_now = place_gang(sched, job, groups, now)
                    if g_now is not None:
                        gang_started(g_now)
                    else:
                        waiting.append(job)
                else:
                    outcomes[job.job_id].rejected = (f"fill job {job.job_id!r} asks for {job.gpus} executors of one "
                                                     "class whose bubbles it fits; no class has that many")
            else:
                try:
                    p_now = sched.submit(job, now, proc_s=proc_block[row])
                except ValueError as err:
                    outcomes[job.job_id].rejected = str(err)
                else:
                    if p_now is not None:  # started() inline: the common case, once per job
                        outcomes[job.job_id].placement = p_now
                        heappush(completions, (p_now.end_s, seq, p_now.executor))
                        seq += 1
        if progress is not None:
            frac = now / horizon_s if horizon_s < math.inf else nxt / max(1, n_jobs)
            if frac - last_report >= 0.01:
                last_report = frac
                progress(min(1.0, frac))

    end_s = (
        horizon_s
        if horizon_s < math.inf
        else max((o.placement.end_s for o in outcomes.values() if o.done and o.placement), default=0.0)
    )
    if horizon_s < math.inf:
        gangs = {id(g): g for g in gang_on.values()}  # each gang once (it is on several executors)
        running: list[Placement | GangPlacement] = [*sched.running.values(), *gangs.values()]
        for run in running:  # partial credit for work done by the horizon
            o = outcomes[run.job.job_id]
            work_s = run.processing_s - run.job.setup_s  # the steps, after the job's setup
            share = (end_s - run.start_s - run.job.setup_s) / work_s if work_s > 0 else 1.0
            share = min(max(share, 0.0), 1.0)
            o.samples_done = share * run.job.samples
            o.filled_s = share * run.filled_s
    if progress is not None:
        progress(1.0)
    name = sched.policy.name
    return SimResult(main=main, policy=name, horizon_s=end_s, outcomes=list(outcomes.values()), events=events)


def arrival_order(jobs: Sequence[FillJobRequest]) -> list[int]:
    """Indices of ``jobs`` by arrival time, ties in trace order."""
    arrival_s = np.array([j.arrival_s for j in jobs], dtype=float)
    if np.isnan(arrival_s).any():  # NaN orders differently in numpy than in Python's sort: keep Python's
        return sorted(range(len(jobs)), key=lambda k: (jobs[k].arrival_s, k))
    return np.argsort(arrival_s, kind="stable").tolist()
