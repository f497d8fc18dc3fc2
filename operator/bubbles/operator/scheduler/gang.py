"""Gang placement: a fill job over N executors of one group at once (``FillJobRequest.gpus``), in their shared bubbles.

A group is the executors a gang may span together: in the operator the usable GPUs of one stage of one training in
one Pod on one node (the processes of a gang meet over the node's loopback, and the agent that drives them is that
node's); in the simulator one executor class. A gang's bubble in each slot is the shortest of its executors' (and its
free memory the least): the gang steps together, so a step fits only where it fits every GPU.

Why a step of its own beside ``Scheduler`` rather than inside it: the scheduler's policies score one queued job for
one idle executor at a time (PipeFill 4.4), and its ETAs replay that; a gang needs N idle executors of one group at
the same moment, which no per-executor score can express without making every policy gang-aware. So this step
chooses the group and its N executors, then marks them busy in the scheduler (``Scheduler.occupy``) for the gang's
run: the per-executor scheduler, its policies and its projections stay as they are and see the gang's executors as
taken until they are released. Plain functions over the scheduler's data, no Kubernetes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bubbles.core.plan import Bubble
from bubbles.operator.scheduler.core import ExecutorClass, FillConfig, FillJobRequest, Scheduler, best_rate


@dataclass(frozen=True)
class GangGroup:
    """Executors a gang may span together (the scheduler's executor indices, in the order a gang's ranks take them:
    the stage's ranks in the operator)."""

    name: str
    executors: tuple[int, ...]


@dataclass(frozen=True)
class GangPlacement:
    """A decision: the gang ``job`` runs on ``executors`` (of ``group``) from ``start_s`` to ``end_s``, in the
    bubbles they share (``shared``)."""

    job: FillJobRequest
    group: str
    executors: tuple[int, ...]
    shared: ExecutorClass
    config: FillConfig
    steps: int  # the gang's steps (each one a step of every process)
    start_s: float
    end_s: float

    @property
    def processing_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def filled_s(self) -> float:
        """Bubble time its work occupies, over all its executors."""
        return self.steps * self.config.step_s * len(self.executors)


def shared_class(classes: Sequence[ExecutorClass], name: str = "") -> ExecutorClass:
    """The bubbles a gang on executors of ``classes`` (one per executor) runs in: slot by slot, the shortest bubble
    and the least free memory of them; the longest iteration. A stage's ranks run one schedule, so their slots pair
    up one to one (should one report fewer, the gang has only the slots all of them have)."""
    if not classes:
        raise ValueError("a gang needs at least one executor")
    slots = min(len(c.bubbles) for c in classes)
    bubbles = tuple(
        Bubble(min(c.bubbles[i].duration_s for c in classes), min(c.bubbles[i].free_bytes for c in classes),
               f"{classes[0].bubbles[i].label} (shared by {len(classes)} GPUs)" if classes[0].bubbles[i].label
               else "")
        for i in range(slots))
    return ExecutorClass(name or "+".join(c.name for c in classes), bubbles, max(c.iteration_s for c in classes),
                         len(classes))


def shared_bubble_s(classes: Sequence[ExecutorClass]) -> float:
    """Bubble time per iteration that all of ``classes`` share (what a gang on them may fill)."""
    return sum(b.duration_s for b in shared_class(classes).bubbles)


def processing_s(job: FillJobRequest, shared: ExecutorClass) -> tuple[float, FillConfig | None, int]:
    """The gang's processing time in the bubbles ``shared`` (inf where no configuration fits), the configuration and
    its steps: each step of the gang does ``gpus`` x the configuration's batch."""
    rate = best_rate(shared.bubbles, shared.iteration_s, job.profile)
    if rate is None or rate.steps_per_cycle <= 0:
        return math.inf, None, 0
    steps = math.ceil(job.samples / (rate.config.batch_size * job.gpus))
    return steps * shared.iteration_s / rate.steps_per_cycle + job.setup_s, rate.config, steps


def _eligible(sched: Scheduler, job: FillJobRequest, executors: Iterable[int]) -> list[int]:
    if job.eligible is None:
        return list(executors)
    return [e for e in executors if sched.classes[int(sched.executor_class[e])].name in job.eligible]


def choose_executors(sched: Scheduler, candidates: Sequence[int], n: int) -> tuple[int, ...]:
    """``n`` of ``candidates`` with the most bubble time they all share, in ``candidates``' order: greedily, from the
    one with the most bubble time alone, each next one the one that keeps the most shared. Executors of one class
    have the same bubbles: the first ``n`` are taken."""
    if len(candidates) < n:
        raise ValueError(f"{len(candidates)} executors cannot hold a gang of {n}")
    cls = [sched.classes[int(sched.executor_class[e])] for e in candidates]
    if all(c is cls[0] for c in cls):
        return tuple(candidates[:n])
    left = list(range(len(candidates)))
    first = max(left, key=lambda i: (shared_bubble_s([cls[i]]), -i))
    chosen = [first]
    left.remove(first)
    while len(chosen) < n:
        best = max(left, key=lambda i: (shared_bubble_s([cls[j] for j in (*chosen, i)]), -i))
        chosen.append(best)
        left.remove(best)
    return tuple(candidates[i] for i in sorted(chosen))


def _options(sched: Scheduler, job: FillJobRequest, groups: Sequence[GangGroup], free_only: bool,
             now_s: float) -> list[tuple[float, float, str, tuple[int, ...], ExecutorClass]]:
    """(start, end, group, executors, shared class) of each group that can hold the gang: now on its idle executors
    (``free_only``), else once the gang's best executors of it are free (expected: the scheduler's busy times)."""
    out = []
    for g in groups:
        cand = _eligible(sched, job, g.executors)
        if free_only:
            cand = [e for e in cand if sched.idle(e)]
        if len(cand) < job.gpus:
            continue
        if free_only:
            chosen = choose_executors(sched, cand, job.gpus)
            start = now_s
        else:
            # The gang waits for N of them: the N that free up first (then their shared bubbles).
            soonest = sorted(cand, key=lambda e: (max(now_s, float(sched.busy_until_s[e])), e))[:job.gpus]
            chosen = tuple(sorted(soonest, key=cand.index))
            start = max(max(now_s, float(sched.busy_until_s[e])) for e in chosen)
        shared = shared_class([sched.classes[int(sched.executor_class[e])] for e in chosen], g.name)
        proc, _, _ = processing_s(job, shared)
        if math.isfinite(proc):
            out.append((start, start + proc, g.name, chosen, shared))
    return out


def place_gang(sched: Scheduler, job: FillJobRequest, groups: Sequence[GangGroup],
               now_s: float) -> GangPlacement | None:
    """Start the gang ``job`` now on ``job.gpus`` idle executors of one group, where it finishes first (the most
    bubble time its executors share, where memory allows); they are marked busy in ``sched`` until its end. None
    where no group has that many idle executors it fits: never a part of a gang."""
    options = _options(sched, job, groups, True, now_s)
    if not options:
        return None
    _start, end, group, chosen, shared = min(options, key=lambda o: (o[1], -sum(b.duration_s for b in o[4].bubbles),
                                                                    o[2]))
    _proc, config, steps = processing_s(job, shared)
    assert config is not None  # options hold finite processing times only
    for e in chosen:
        sched.occupy(e, job.job_id, end)
    return GangPlacement(job, group, chosen, shared, config, steps, now_s, end)


def gang_eta_s(sched: Scheduler, job: FillJobRequest, groups: Sequence[GangGroup], now_s: float) -> float:
    """When the waiting gang ``job`` is expected to finish: on the group where it would end first once the executors
    it needs there free up (their expected ends), counting no other queued job; inf where no group holds it."""
    return min((o[1] for o in _options(sched, job, groups, False, now_s)), default=math.inf)


def fits_somewhere(sched: Scheduler, job: FillJobRequest, groups: Sequence[GangGroup]) -> bool:
    """Whether some group has ``job.gpus`` eligible executors whose shared bubbles fit the gang (busy or not)."""
    return bool(_options(sched, job, groups, False, 0.0))
