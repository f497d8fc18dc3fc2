"""A fill job's execution plan: PipeFill's Algorithm 1 (section 4.3) as plain data and functions.

A fill job's step is a chain of nodes that must run in order. The plan replicates the chain
(one replica per training step of the fill job) and cuts it into partitions, one per bubble,
walking the stage's bubble cycle over and over, so that no partition outlasts its bubble or
needs more memory than the bubble has free. Greedy earliest fit is optimal in bubbles consumed
for an ordered chain; ``min_bubbles_bruteforce`` lets the tests check that on small instances.

Algorithm 1 packs medians: it says whether a job fits and how much work one cycle's bubble time could hold, not
how many steps the fill runtime will start. ``plan_rate`` says that: it replays the runtime's gate
(``bubbles.training.gating``) over each bubble's *predicted* length (the smaller of its 10th percentile and median,
which the hook signals), after the signal's latency, with a bubble's first step gated and timed apart from the later
ones (it refills the caches the training evicted). The agent states it, and compares it with what ran.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

from bubbles.core.api import FillNode
from bubbles.core.cycle import BubbleCycle

_GIB = 2**30
# Durations are float sums: without slack, 0.2 + 0.1 does not "fit" into a 0.3 s bubble and the plan
# loses a bubble (or, in Algorithm 1's replication, a whole step) to rounding. One part in 10^9 is
# far below what a profile can resolve.
_REL_SLACK = 1e-9


@dataclass(frozen=True)
class Bubble:
    """One bubble of a cycle as the planner sees it: its length and free memory."""

    duration_s: float
    free_bytes: int
    # For error messages only (e.g. "stage 0 slot 3 (RecvGrad, fwd-bwd)"): bubbles that differ only in their label
    # are equal, so plans cached per bubble shape are shared across stages and trainings.
    label: str = field(default="", compare=False)


@dataclass(frozen=True)
class Partition:
    """A run of consecutive nodes of the unrolled chain executed inside one bubble."""

    bubble: int  # index into the cycle's bubbles
    cycle: int  # which repetition of the cycle (0 = the first)
    first_node: int  # inclusive indices into the unrolled chain (steps * nodes_per_step nodes)
    last_node: int
    duration_s: float  # sum of its nodes' durations; <= the bubble's, up to float rounding (1e-9 relative)
    memory_bytes: int  # max of its nodes' memory: the nodes run one after another

    @property
    def nodes(self) -> int:
        return self.last_node - self.first_node + 1


@dataclass(frozen=True)
class ExecutionPlan:
    """Where each node of ``steps`` replicas of a fill job's step runs, bubble by bubble."""

    partitions: tuple[Partition, ...]
    steps: int
    nodes_per_step: int
    cycles: int  # bubble cycles needed (a partially used last cycle counts as 1)
    bubbles_per_cycle: int
    usable: frozenset[int]  # bubble indices in which at least one node of the step fits

    @property
    def bubbles_used(self) -> int:
        """Bubbles that run at least one node."""
        return len(self.partitions)

    @property
    def bubbles_consumed(self) -> int:
        """Bubbles passed in cyclic order up to and including the last one used (skipped ones count)."""
        if not self.partitions:
            return 0
        last = self.partitions[-1]
        return last.cycle * self.bubbles_per_cycle + last.bubble + 1

    def steps_per_cycle(self) -> float:
        """Fill-job steps completed per bubble cycle (that is, per training iteration)."""
        return self.steps / self.cycles

    def usable_bubbles(self) -> frozenset[int]:
        """Indices of the bubbles in which at least one node of the step fits."""
        return self.usable


class PlanError(ValueError):
    """A node of the fill job fits no bubble of the cycle, so no plan exists."""

    def __init__(self, message: str, *, job: str = "", node: int = -1) -> None:
        super().__init__(message)
        self.job = job
        self.node = node


@dataclass(frozen=True)
class StepTime:
    """How one size of a fill job's step runs in bubbles, as the fill runtime's gate sees it (``StepGates``).

    A step starts only if its gate (a high percentile of its recent durations, or the profiled or stated step time
    until enough have run) fits in what is left of the bubble's predicted length; it then takes its typical duration
    (the agent gives the mean: over many steps, what they take in all). A bubble's first step is gated and timed apart
    from the later ones. ``size`` None: a job without step sizes."""

    first_gate_s: float
    later_gate_s: float
    first_s: float
    later_s: float
    size: int | None = None


@dataclass(frozen=True)
class RatePlan:
    """What ``plan_rate`` expects one iteration to run: fill steps per bubble of the cycle and in all."""

    per_bubble: tuple[float, ...]  # steps expected in each bubble of the cycle (a mean over its predicted lengths)
    first_need_s: float  # what a bubble's predicted length must offer for a first step: latency plus the least gate
    longest_s: float  # the longest usable predicted length (times the share)

    @property
    def steps_per_iteration(self) -> float:
        return sum(self.per_bubble)

    @property
    def fitting(self) -> int:
        """Bubbles of the cycle whose predicted length fits a first step (at least sometimes)."""
        return sum(1 for n in self.per_bubble if n > 0)


# A bound on the steps of one bubble (a 1 s bubble of 10 us steps): only a degenerate input comes near it.
MAX_STEPS_PER_BUBBLE = 100_000


def predicted_lengths(cycle: BubbleCycle) -> tuple[float, ...]:
    """Each slot's predicted length from a profile: the smaller of its 10th percentile and median, as the hook
    predicts a bubble's end (``bubbles.core.cycle.predicted_length``) until it has lengths of its own."""
    return tuple(min(s.p10_s, s.duration_s) for s in cycle.slots)


def steps_in_bubble(predicted_s: float, steps: Sequence[StepTime], latency_s: float = 0.0, share: float = 1.0) -> int:
    """The fill steps the runtime is expected to start in a bubble of predicted length ``predicted_s``: from
    ``latency_s`` after its signal, while some size's gate fits before ``share * predicted_s``, the largest size that
    fits (``steps`` smallest first, as ``StepGates.fitting``), each taking its typical duration.

    In closed form, as the agent computes it in its loop: what is left only shrinks, so the sizes that fit only fall
    away, and after the first step the runtime runs the largest size that fits until its gate no longer does, then the
    next: one run of steps per size at most."""
    usable = share * predicted_s * (1 + _REL_SLACK)
    t = latency_s
    fits = [st for st in steps if t + st.first_gate_s <= usable]
    if not fits:
        return 0
    t += fits[-1].first_s
    n = 1
    for _ in range(len(steps)):
        fits = [st for st in steps if t + st.later_gate_s <= usable]
        if not fits or n >= MAX_STEPS_PER_BUBBLE:
            break
        st = fits[-1]
        k = min(math.floor((usable - st.later_gate_s - t) / st.later_s) + 1, MAX_STEPS_PER_BUBBLE - n)
        n += k
        t += k * st.later_s
    return n


def plan_rate(slots: Sequence[Sequence[float]], steps: Sequence[StepTime], latency_s: float = 0.0,
              share: float = 1.0) -> RatePlan:
    """The fill steps the runtime is expected to start per iteration: for each bubble of the cycle, the mean over its
    predicted lengths (``slots[k]``: one from a profile, or the hook's recent predictions for that bubble) of
    ``steps_in_bubble``. Steps the runtime may start past the prediction (``TailRisk``) and bubbles that end before it
    are not counted: the plan states what the prediction allows. ValueError for malformed input."""
    if not steps:
        raise ValueError("plan_rate needs at least one step time")
    for st in steps:
        times = (st.first_gate_s, st.later_gate_s, st.first_s, st.later_s)
        if not all(_finite_nonneg(t) and t > 0 for t in times):
            raise ValueError(f"step times must be finite and > 0, got {st!r}")
    if not all(lengths and all(_finite_nonneg(p) for p in lengths) for lengths in slots):
        raise ValueError(f"each bubble needs predicted lengths, finite and >= 0, got {[list(x) for x in slots]!r}")
    if not _finite_nonneg(latency_s):
        raise ValueError(f"latency_s must be finite and >= 0, got {latency_s!r}")
    if not (_finite_nonneg(share) and share <= 1):
        raise ValueError(f"share must be in [0, 1], got {share!r}")
    per_bubble = tuple(sum(k * steps_in_bubble(p, steps, latency_s, share) for p, k in Counter(lengths).items())
                       / len(lengths) for lengths in slots)  # the hook's predictions repeat: each length once
    return RatePlan(per_bubble, latency_s + min(st.first_gate_s for st in steps),
                    share * max((p for lengths in slots for p in lengths), default=0.0))


def bubbles_of(cycle: BubbleCycle) -> tuple[Bubble, ...]:
    """The planner's view of a profiled cycle, in schedule order, labelled for error messages."""
    return tuple(
        Bubble(
            duration_s=s.duration_s,
            free_bytes=s.free_bytes,
            label=f"stage {cycle.stage} slot {s.slot} ({s.instruction}, {s.kind})",
        )
        for s in cycle.slots
    )


def plan_partitions(
    bubbles: Sequence[Bubble],
    nodes: Sequence[FillNode],
    steps: int | None = None,
    job: str = "",
) -> ExecutionPlan:
    """Pack ``steps`` replicas of the node chain into the repeating bubbles, earliest fit first.

    With ``steps=None`` the chain is replicated as in Algorithm 1 lines 3-7: as many whole steps as
    fit in one cycle's total bubble time, at least one. Raises PlanError if some node fits no
    bubble, ValueError for malformed input.
    """
    _validate(bubbles, nodes)
    if steps is None:
        steps = replicas_for(bubbles, nodes)
    elif isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (or None to fill one cycle), got {steps!r}")
    usable = _check_every_node_fits(bubbles, nodes, job)

    n = len(nodes)
    total = steps * n
    partitions: list[Partition] = []
    pos = 0  # next node of the unrolled chain
    k = 0  # global bubble index: cycle * len(bubbles) + bubble
    # Terminates: every node fits some bubble, so each pass over the cycle places at least one node.
    while pos < total:
        b = bubbles[k % len(bubbles)]
        first = pos
        dur_s = 0.0
        mem = 0
        while pos < total:
            node = nodes[pos % n]
            if not _room_for(dur_s + node.duration_s, node.memory_bytes, b):
                break
            dur_s += node.duration_s
            mem = max(mem, node.memory_bytes)
            pos += 1
        if pos > first:
            partitions.append(
                Partition(
                    bubble=k % len(bubbles),
                    cycle=k // len(bubbles),
                    first_node=first,
                    last_node=pos - 1,
                    duration_s=dur_s,
                    memory_bytes=mem,
                )
            )
        k += 1
    return ExecutionPlan(
        partitions=tuple(partitions),
        steps=steps,
        nodes_per_step=n,
        cycles=math.ceil(k / len(bubbles)),
        bubbles_per_cycle=len(bubbles),
        usable=usable,
    )


def replicas_for(bubbles: Sequence[Bubble], nodes: Sequence[FillNode]) -> int:
    """Algorithm 1 lines 3-7: whole steps whose total duration fits in one cycle's bubble time, >= 1."""
    step_s = sum(nd.duration_s for nd in nodes)
    total_s = sum(b.duration_s for b in bubbles)
    return max(1, math.floor(total_s / step_s * (1 + _REL_SLACK)))


def plan_wall_time_s(plan: ExecutionPlan, cycle_iteration_s: float) -> float:
    """Upper bound on the wall time to run the plan: every cycle it touches counts as a full iteration.

    The last cycle is usually only partly used, so the true time is shorter by at most one
    iteration; schedulers compare jobs with it, where a common bias does not matter.
    """
    if not math.isfinite(cycle_iteration_s) or cycle_iteration_s <= 0:
        raise ValueError(f"cycle_iteration_s must be a finite number > 0, got {cycle_iteration_s!r}")
    return plan.cycles * cycle_iteration_s


def min_bubbles_bruteforce(bubbles: Sequence[Bubble], nodes: Sequence[FillNode], steps: int) -> int:
    """The fewest bubbles consumed (cyclic order, skipped ones counted) over every way to cut the chain.

    Exhaustive over cut points and skipped bubbles, memoized on (next node, next bubble); for
    tests on small instances. Raises PlanError if some node fits no bubble.
    """
    _validate(bubbles, nodes)
    _check_every_node_fits(bubbles, nodes, "")
    n, nb = len(nodes), len(bubbles)
    total = steps * n
    # Greedy never needs more than one cycle per node, so no better cut lies beyond this many bubbles.
    limit = total * nb + nb

    @cache
    def best(pos: int, k: int) -> float:
        if pos == total:
            return k
        if k >= limit:
            return math.inf
        b = bubbles[k % nb]
        result = best(pos, k + 1)  # leave this bubble empty
        dur_s = 0.0
        end = pos
        while end < total:
            node = nodes[end % n]
            if not _room_for(dur_s + node.duration_s, node.memory_bytes, b):
                break
            dur_s += node.duration_s
            end += 1
            result = min(result, best(end, k + 1))
        return result

    found = best(0, 0)
    best.cache_clear()
    return int(found)


def _validate(bubbles: Sequence[Bubble], nodes: Sequence[FillNode]) -> None:
    if not bubbles:
        raise ValueError("the cycle has no bubbles: profile the training first, or lower min_bubble_s")
    if not nodes:
        raise ValueError("the fill job's step has no nodes: profile at least one node of its step")
    for i, b in enumerate(bubbles):
        if not _finite_nonneg(b.duration_s) or not _int_nonneg(b.free_bytes):
            raise ValueError(
                f"bubble {i} {b.label!r} needs a finite duration_s >= 0 and an integer free_bytes >= 0, "
                f"got duration_s={b.duration_s!r}, free_bytes={b.free_bytes!r}"
            )
    for i, nd in enumerate(nodes):
        # A zero-length node would make Algorithm 1's replication loop run forever.
        if not _finite_nonneg(nd.duration_s) or nd.duration_s == 0 or not _int_nonneg(nd.memory_bytes):
            raise ValueError(
                f"node {i} needs a finite duration_s > 0 and an integer memory_bytes >= 0, "
                f"got duration_s={nd.duration_s!r}, memory_bytes={nd.memory_bytes!r}; "
                "re-profile the fill job's step"
            )


def _check_every_node_fits(bubbles: Sequence[Bubble], nodes: Sequence[FillNode], job: str) -> frozenset[int]:
    """Raise PlanError for the first node no bubble can hold; return the bubbles some node fits."""
    usable: set[int] = set()
    for i, nd in enumerate(nodes):
        fits = [j for j, b in enumerate(bubbles) if _fits(nd, b)]
        if not fits:
            raise PlanError(_no_fit_message(bubbles, nd, i, job), job=job, node=i)
        usable.update(fits)
    return frozenset(usable)


def _fits(nd: FillNode, b: Bubble) -> bool:
    return _room_for(nd.duration_s, nd.memory_bytes, b)


def _room_for(duration_s: float, memory_bytes: int, b: Bubble) -> bool:
    """Line 12 of Algorithm 1, with <= rather than the paper's <: work exactly as long as the bubble fits."""
    return duration_s <= b.duration_s * (1 + _REL_SLACK) and memory_bytes <= b.free_bytes


def _no_fit_message(bubbles: Sequence[Bubble], nd: FillNode, i: int, job: str) -> str:
    who = f"fill job {job!r}" if job else "the fill job"
    needs = f"{_ms(nd.duration_s)} and {_gib(nd.memory_bytes)} for node {i} of its step"
    longest = max(bubbles, key=lambda b: b.duration_s)
    roomiest = max(bubbles, key=lambda b: b.free_bytes)
    if longest.duration_s < nd.duration_s and roomiest.free_bytes < nd.memory_bytes:
        return (
            f"{who} needs {needs}, but every bubble is too short and too small: the longest is "
            f"{_name(longest)} at {_ms(longest.duration_s)}, the roomiest {_name(roomiest)} has "
            f"{_gib(roomiest.free_bytes)} free. Lower the batch size, split the step into shorter nodes, "
            "or offload state to host memory."
        )
    if longest.duration_s < nd.duration_s:
        return (
            f"{who} needs {needs}, but no bubble is long enough: the longest is {_name(longest)} at "
            f"{_ms(longest.duration_s)}. Lower the batch size or split the step into shorter nodes."
        )
    if roomiest.free_bytes < nd.memory_bytes:
        return (
            f"{who} needs {needs}, but no bubble has enough memory: the roomiest is {_name(roomiest)} "
            f"with {_gib(roomiest.free_bytes)} free. Lower the batch size or offload state to host memory."
        )
    roomy = [b for b in bubbles if b.free_bytes >= nd.memory_bytes]
    long_enough = [b for b in bubbles if b.duration_s >= nd.duration_s]
    best_roomy = max(roomy, key=lambda b: b.duration_s)
    best_long = max(long_enough, key=lambda b: b.free_bytes)
    return (
        f"{who} needs {needs}, but no bubble has both: the longest bubble with enough memory is "
        f"{_name(best_roomy)} at {_ms(best_roomy.duration_s)}; the roomiest bubble long enough "
        f"({_name(best_long)}) has {_gib(best_long.free_bytes)} free. "
        "Lower the batch size or split the step into shorter nodes."
    )


def _name(b: Bubble) -> str:
    return b.label or "an unlabelled bubble"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def _finite_nonneg(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _int_nonneg(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
