"""Accounting of harvesting: bubble time offered, fill time that landed in it, and fill time that did not.

Records arrive in any order (a fill step's report can beat the BUBBLE_END of the bubble it ran
in), so the ledger only stores intervals and computes everything in ``totals()`` with sorted
sweeps. Times are ``time.monotonic_ns()`` integers, so the sums are exact until the final
conversion to seconds.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, Generic, TypeVar

from bubbles.core.identity import GpuKey
from bubbles.core.stats import percentile

# What the ledger keeps records by: one timeline of bubbles and steps each. The agent keys them by GPU (a rank of a
# stage: bubbles of one rank are no bubbles of another); a reader of stats files by (stage, rank); plain stages too.
K = TypeVar("K", int, tuple[int, int], GpuKey)

_NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class StepRecord:
    """One fill-job step as reported: where (``stage``: the key the ledger keeps it by) and when it ran, and the
    work it did."""

    stage: Any
    job: str
    start_ns: int
    end_ns: int
    flops: float
    # A step the ledger cut at a fold (see ``HarvestLedger``): this record is its rest, from the cut; how long it ran
    # before, and how much of that was outside every bubble, are already in the folded totals.
    carried_ns: int = 0
    carried_overrun_ns: int = 0
    tail: bool = False  # started past its bubble's predicted end, on the tail's risk (``gate: tail``)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class LedgerTotals:
    """What harvesting achieved and what it cost the training."""

    bubble_s: float  # bubble time offered (union of bubble intervals, per stage, summed)
    filled_s: float  # fill-step time inside a bubble of the step's own stage
    fill_steps: int
    fill_flops: float
    overruns: int  # steps with any time outside every bubble of their stage
    overrun_s: float  # fill-step time outside bubbles: fill work competing with the training
    overrun_p99_ms: float  # 99th percentile of the positive overruns; 0.0 if none
    max_overrun_ms: float
    step_s: float = 0.0  # total fill-step time; filled_s + overrun_s == step_s
    # Of filled_s and overrun_s, the tail steps' (started past a bubble's predicted end on the tail's risk).
    tail_filled_s: float = 0.0
    tail_overrun_s: float = 0.0




SETTLE_NS = 10 * _NS_PER_S  # records older than this (behind a stage's newest) are folded into running totals
FOLD_MIN_RECORDS = 5_000  # ... once this many records are held (then each time the count has doubled)
NEVER_FOLD = 1 << 62
OVERRUN_SAMPLES = 10_000  # folded overruns kept per stage for the p99: the most recent


@dataclass
class _Folded:
    """A stage's settled records, summed: what ``totals`` adds to the records still held."""

    bubble_ns: int = 0
    filled_ns: int = 0
    step_ns: int = 0
    steps: int = 0
    flops: float = 0.0
    tail_filled_ns: int = 0
    tail_overrun_ns: int = 0
    overruns: int = 0  # steps with any time outside every bubble, counted when the step is complete
    max_overrun_ns: int = 0
    late: int = 0  # records that arrived after their time had been folded (see ``HarvestLedger``)
    overrun_samples: deque[int] = field(default_factory=lambda: deque(maxlen=OVERRUN_SAMPLES))

    @property
    def overrun_ns(self) -> int:
        """Step time outside every bubble: all step time is filled or overrun."""
        return self.step_ns - self.filled_ns

    def ran(self, inside_ns: int, duration_ns: int, tail: bool) -> None:
        """Step time: ``duration_ns``, of which ``inside_ns`` in a bubble (the rest overrun); a tail step's too."""
        self.filled_ns += inside_ns
        self.step_ns += duration_ns
        if tail:
            self.tail_filled_ns += inside_ns
            self.tail_overrun_ns += duration_ns - inside_ns

    def add(self, other: _Folded, samples: bool = True) -> None:
        """Add ``other``'s sums (and its overrun samples, unless ``samples`` is False)."""
        self.bubble_ns += other.bubble_ns
        self.filled_ns += other.filled_ns
        self.step_ns += other.step_ns
        self.tail_filled_ns += other.tail_filled_ns
        self.tail_overrun_ns += other.tail_overrun_ns
        self.steps += other.steps
        self.flops += other.flops
        self.overruns += other.overruns
        self.max_overrun_ns = max(self.max_overrun_ns, other.max_overrun_ns)
        self.late += other.late
        if samples:
            self.overrun_samples.extend(other.overrun_samples)

    def step_overran(self, ns: int) -> None:
        """A whole step spent ``ns`` > 0 outside every bubble."""
        self.overruns += 1
        self.max_overrun_ns = max(self.max_overrun_ns, ns)
        self.overrun_samples.append(ns)


class HarvestLedger(Generic[K]):
    """Bubble and fill-step intervals per stage (or per GPU: whatever key ``K`` the caller keeps one timeline by),
    totalled on demand, in bounded memory.

    An agent runs for weeks; holding every record would grow without end, and every scrape and report (under the
    agent's lock) would sort them all. So once ``fold_at`` records are held, each stage's records are *folded* up to
    a cut ``settle_ns`` before its newest record: what lies before the cut is summed into running totals and let go.
    A bubble or a step that spans the cut is split there (a step's rest carries what it ran before, so it is still
    counted once, with its whole overrun). The fold is exact: the totals are what they would have been with every
    record held, as long as no record arrives after its time was folded (a step reported more than ``settle_ns``
    after it started: the runtime reports a bubble's steps at its end, and naive steps every 20 ms, so only a naive
    step that long does). Such a late record cannot be matched with the
    records it overlapped any more: a late step is counted as overrun whole (the side that errs against fill work),
    the part of a late bubble before the cut as bubble time, and both in ``late``. The overrun p99 covers the last
    ``OVERRUN_SAMPLES`` folded overruns per stage and those held.
    """

    def __init__(self, settle_ns: int = SETTLE_NS, fold_at: int = FOLD_MIN_RECORDS,
                 floor: Callable[[K], int | None] = lambda _key: None) -> None:
        """``floor(stage)``: a time no fold may cut past (the start of the stage's oldest bubble still open, whose
        record comes at its END: a bubble longer than ``settle_ns`` would otherwise arrive late)."""
        if settle_ns < 0 or fold_at < 1:
            raise ValueError("HarvestLedger needs settle_ns >= 0 and fold_at >= 1")
        self.settle_ns = settle_ns
        self.fold_at = fold_at
        self.floor: Callable[[K], int | None] = floor
        self._bubbles: dict[K, list[tuple[int, int]]] = {}
        self._steps: dict[K, list[StepRecord]] = {}
        self._folded: dict[K, _Folded] = {}
        self._cut: dict[K, int] = {}  # stage -> everything before it is folded
        self._held = 0
        self._next_fold = fold_at

    @classmethod
    def holding_all(cls) -> HarvestLedger[K]:
        """A ledger that never folds: for records added in any order (a finished run's, read back)."""
        return cls(fold_at=NEVER_FOLD)

    def add_bubble(self, stage: K, start_ns: int, end_ns: int) -> None:
        """Record one bubble of ``stage`` (from its BUBBLE_START to its BUBBLE_END)."""
        _check_interval(stage, start_ns, end_ns)
        cut = self._cut.get(stage)
        if cut is not None and start_ns < cut:
            f = self._folded[stage]
            f.late += 1
            f.bubble_ns += min(end_ns, cut) - start_ns
            if end_ns <= cut:
                return
            start_ns = cut  # the rest meets the steps still held
        self._bubbles.setdefault(stage, []).append((start_ns, end_ns))
        self._added()

    def add_step(self, stage: K, job: str, start_ns: int, end_ns: int, flops: float, tail: bool = False) -> None:
        """Record one fill-job step that ran on ``stage``'s accelerator (``tail``: started past its bubble's predicted
        end, on the tail's risk)."""
        _check_interval(stage, start_ns, end_ns)
        valid = isinstance(flops, int | float) and not isinstance(flops, bool) and math.isfinite(flops)
        if not valid or flops < 0:
            raise ValueError(f"flops must be a finite number >= 0, got {flops!r}")
        cut = self._cut.get(stage)
        if cut is not None and start_ns < cut:
            f = self._folded[stage]
            f.late += 1
            f.steps += 1
            f.flops += float(flops)
            f.ran(0, end_ns - start_ns, tail)  # none of it matched with a bubble any more: all overrun
            if end_ns > start_ns:
                f.step_overran(end_ns - start_ns)
            return
        self._steps.setdefault(stage, []).append(StepRecord(stage, job, start_ns, end_ns, float(flops), tail=tail))
        self._added()

    def stages(self) -> tuple[K, ...]:
        """Stages with any bubble or step recorded, ascending."""
        return tuple(sorted(set(self._bubbles) | set(self._steps) | set(self._folded)))

    def held(self) -> int:
        """How many records are held (not folded yet)."""
        return self._held

    def late(self) -> int:
        """Records that arrived after their time was folded (see the class)."""
        return sum(f.late for f in self._folded.values())

    def bubble_intervals(self, stage: K) -> tuple[tuple[int, int], ...]:
        """The stage's held bubbles as (start_ns, end_ns), sorted by start, as recorded (not merged)."""
        return tuple(sorted(self._bubbles.get(stage, ())))

    def step_records(self) -> tuple[StepRecord, ...]:
        """The held fill steps, sorted by (stage, start)."""
        return tuple(sorted((r for rs in self._steps.values() for r in rs),
                            key=lambda r: (r.stage, r.start_ns, r.end_ns)))

    def totals(self, stage: K | None = None, percentiles: bool = True) -> LedgerTotals:
        """Sum up every stage, or only ``stage``: the folded totals plus a sweep of the held records, O(n log n).
        ``percentiles=False`` leaves the overrun p99 at 0 (it sorts up to ``OVERRUN_SAMPLES`` per stage)."""
        stages: tuple[K, ...] = self.stages() if stage is None else (stage,)
        sums = _Folded()
        samples: list[int] = []
        for st in stages:
            for part in (_sweep(self._bubbles.get(st, ()), self._steps.get(st, ())), self._folded.get(st)):
                if part is None:
                    continue
                sums.add(part, samples=False)  # the samples of every stage: more than one deque holds
                if percentiles:
                    samples += part.overrun_samples
        return LedgerTotals(
            bubble_s=sums.bubble_ns / _NS_PER_S,
            filled_s=sums.filled_ns / _NS_PER_S,
            fill_steps=sums.steps,
            fill_flops=sums.flops,
            overruns=sums.overruns,
            overrun_s=sums.overrun_ns / _NS_PER_S,
            overrun_p99_ms=percentile([ns / 1e6 for ns in samples], 99) if samples and percentiles else 0.0,
            max_overrun_ms=sums.max_overrun_ns / 1e6,
            step_s=sums.step_ns / _NS_PER_S,
            tail_filled_s=sums.tail_filled_ns / _NS_PER_S,
            tail_overrun_s=sums.tail_overrun_ns / _NS_PER_S,
        )

    # -- folding ------------------------------------------------------------------------------------------------
    def _added(self) -> None:
        self._held += 1
        if self._held >= self._next_fold:
            for stage in self.stages():
                self.fold(stage)
            # Amortized: where most records are within the settling window a fold frees little; wait for twice as many
            # before the next.
            self._next_fold = max(self.fold_at, 2 * self._held)

    def fold(self, stage: K) -> None:
        """Fold ``stage``'s records up to ``settle_ns`` before its newest (see the class)."""
        bubbles = self._bubbles.get(stage, [])
        steps = self._steps.get(stage, [])
        newest = max([b for _, b in bubbles] + [r.end_ns for r in steps], default=None)
        if newest is None:
            return
        cut = newest - self.settle_ns
        if (floor := self.floor(stage)) is not None:
            cut = min(cut, floor)
        if stage in self._cut and cut <= self._cut[stage]:
            return
        covered = _Coverage([(a, min(b, cut)) for a, b in bubbles if a < cut])
        done = _sweep((), [r for r in steps if r.end_ns <= cut], covered)
        rests: list[StepRecord] = []
        for r in steps:
            if r.start_ns < cut < r.end_ns:  # split: the part before the cut is counted now, the step when complete
                inside = covered.between(r.start_ns, cut)
                done.ran(inside, cut - r.start_ns, r.tail)
                rests.append(replace(r, start_ns=cut, carried_ns=r.carried_ns + cut - r.start_ns,
                                     carried_overrun_ns=r.carried_overrun_ns + cut - r.start_ns - inside))
        self._folded.setdefault(stage, _Folded()).add(done)  # done.bubble_ns: covered's
        kept_b = [(max(a, cut), b) for a, b in bubbles if b > cut]
        kept_s = [r for r in steps if r.start_ns >= cut and r.end_ns > cut] + rests  # one of whole, split, kept
        self._held -= len(bubbles) + len(steps) - len(kept_b) - len(kept_s)
        self._bubbles[stage] = kept_b
        self._steps[stage] = kept_s
        self._cut[stage] = cut


def _sweep(bubbles: Iterable[tuple[int, int]], steps: Iterable[StepRecord],
           covered: _Coverage | None = None) -> _Folded:
    """One stage's records summed: bubble time as the union of its bubbles (or ``covered``'s), each step's time inside
    and outside it; a step's overrun includes what it carried from before a fold."""
    if covered is None:
        covered = _Coverage(list(bubbles))
    out = _Folded(bubble_ns=covered.total_ns)
    for r in steps:
        inside = covered.between(r.start_ns, r.end_ns)
        out.ran(inside, r.duration_ns, r.tail)
        out.flops += r.flops
        out.steps += 1
        whole = r.duration_ns - inside + r.carried_overrun_ns
        if whole > 0:
            out.step_overran(whole)
    return out


class _Coverage:
    """The union of intervals, answering "how much of [a, b) is covered" by binary search."""

    def __init__(self, intervals: Sequence[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted(intervals):
            if end <= start:
                continue
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self._starts = [s for s, _ in merged]
        self._ends = [e for _, e in merged]
        # _before[i]: covered length of the first i merged intervals
        self._before = [0, *accumulate(e - s for s, e in merged)]
        self.total_ns = self._before[-1]

    def up_to(self, t: int) -> int:
        """Covered length in (-inf, t)."""
        i = bisect_right(self._starts, t)  # intervals starting at or before t
        if i == 0:
            return 0
        return self._before[i - 1] + min(t, self._ends[i - 1]) - self._starts[i - 1]

    def between(self, a: int, b: int) -> int:
        return self.up_to(b) - self.up_to(a)


def _check_interval(stage: object, start_ns: int, end_ns: int) -> None:
    for name, v in (("start_ns", start_ns), ("end_ns", end_ns)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer (time.monotonic_ns()), got {v!r}")
    if isinstance(stage, GpuKey):
        return
    if isinstance(stage, bool) or not isinstance(stage, int | tuple):
        raise ValueError(f"stage must be an integer, (stage, rank) or a GpuKey, got {stage!r}")
    if any(k < 0 for k in (stage if isinstance(stage, tuple) else (stage,))):
        raise ValueError(f"stage must be >= 0, got {stage}")
    if end_ns < start_ns:
        raise ValueError(f"interval ends before it starts ({start_ns} > {end_ns}): swap the timestamps")


# -- where the bubble time went ---------------------------------------------------------------------------------
BREAKDOWN = (
    ("filled", "filled by fill steps"),
    ("guard", "withheld by the slowdown guard (probes' and refreshes' pauses, the share it cut)"),
    ("no_job", "no fill job armed on the stage"),
    ("latency", "signal and resume latency (before the first step, between steps)"),
    ("too_short", "too short for a step (a bubble, or the tail after the last step)"),
    ("past_prediction", "past the predicted end (the slot's 10th-percentile length), where a step starts only at a "
                        "small risk of outliving its bubble (bubbles.training.gating.TailRisk)"),
)


def bubble_breakdown(bubbles: Iterable[Mapping[str, Any]], steps: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Split the bubbles' time into where it went (``BREAKDOWN``'s keys, seconds; they sum to ``bubble_s``), and the
    fill-step time that ran past its bubble's end (``overrun_s``: not bubble time, the training waited for it).

    ``bubbles`` are the agent's bubble records (``stage``, ``rank``, ``start_ns``, ``end_ns``, ``predicted_end_ns``,
    ``guard_paused``, ``share``, ``job``, ``step_s``; the agent's ``status().bubbles``), ``steps`` its step records
    (``stage``, ``rank``, ``start_ns``, ``end_ns``, ``tail``); pass one mode's of each. A step belongs to the bubble
    it started in, of its own GPU (stage and rank; a record without ``rank``, from an agent before ranks, is rank 0).
    Of the filled time and the overrun, ``tail_s`` and ``tail_overrun_s`` are those of the steps the predicted end
    did not allow (``tail``: started on ``bubbles.training.gating.TailRisk``'s word). Pure.
    """
    by_stage: dict[tuple[int, int], list[tuple[int, int]]] = {}
    tails: set[tuple[tuple[int, int], int, int]] = set()
    for st in steps:
        gpu = _gpu_of(st)
        by_stage.setdefault(gpu, []).append((int(st["start_ns"]), int(st["end_ns"])))
        if st.get("tail"):
            tails.add((gpu, int(st["start_ns"]), int(st["end_ns"])))
    for v in by_stage.values():
        v.sort()
    starts = {k: [a for a, _ in v] for k, v in by_stage.items()}
    out = dict.fromkeys((k for k, _ in BREAKDOWN), 0)
    bubble_ns = overrun_ns = tail_ns = tail_overrun_ns = 0
    for b in bubbles:
        s, e = int(b["start_ns"]), int(b["end_ns"])
        if e <= s:
            continue
        bubble_ns += e - s
        stage = _gpu_of(b)
        lo, hi = bisect_left(starts.get(stage, []), s), bisect_left(starts.get(stage, []), e)
        theirs = by_stage.get(stage, [])[lo:hi]
        mine = _merge(theirs)
        filled = sum(min(b_, e) - a for a, b_ in mine)
        overrun_ns += sum(max(0, b_ - e) for _, b_ in theirs)
        if tails:
            tail_ns += sum(min(b_, e) - a for a, b_ in theirs if (stage, a, b_) in tails)
            tail_overrun_ns += sum(max(0, b_ - e) for a, b_ in theirs if (stage, a, b_) in tails)
        out["filled"] += filled
        if b.get("guard_paused"):
            out["guard"] += e - s - filled
            continue
        if not b.get("job"):
            out["no_job"] += e - s - filled
            continue
        predicted = int(b.get("predicted_end_ns") or e)
        p = min(max(predicted, s), e)  # steps start only before the predicted end
        u = s + int(float(b.get("share", 1.0)) * (max(predicted, s) - s))  # ... and within the guard's share of it
        step_ns = int(float(b.get("step_s") or 0.0) * 1e9)
        cursor = s
        for k, (a, b_) in enumerate([*mine, (e, e)]):
            if a > cursor:  # an uncovered segment [cursor, a)
                where = "none" if not mine else "tail" if k == len(mine) else "before"
                _attribute(out, cursor, a, u=u, p=p, where=where, step_ns=step_ns)
            cursor = max(cursor, min(b_, e))
    return {**{k: v / _NS_PER_S for k, v in out.items()}, "bubble_s": bubble_ns / _NS_PER_S,
            "overrun_s": overrun_ns / _NS_PER_S, "tail_s": tail_ns / _NS_PER_S,
            "tail_overrun_s": tail_overrun_ns / _NS_PER_S}


def mode_records(status: Mapping[str, Any] | None, mode: str) -> tuple[list[Mapping[str, Any]],
                                                                      list[Mapping[str, Any]]]:
    """The bubble and step records of one fill mode (its label) in the agent's status (``bubbles``, ``steps``).
    Pure."""
    status = status or {}
    return ([b for b in status.get("bubbles", []) if b.get("mode") == mode],
            [st for st in status.get("steps", []) if st.get("mode") == mode])


def filled_share(bubbles: Iterable[Mapping[str, Any]], steps: Iterable[Mapping[str, Any]], t0_ns: int,
                 t1_ns: int) -> float | None:
    """The share of the bubble time in a window (the bubbles and steps that start in ``[t0_ns, t1_ns)``) that fill
    steps covered, as ``Ledger.totals`` counts it (a step's time inside any bubble of its stage, wherever the step
    started: under naive co-location steps run through bubbles without starting in them); None when no bubble time
    falls there. Pure."""
    ledger = HarvestLedger[tuple[int, int]].holding_all()  # records in no particular order: none may count as late
    for b in bubbles:
        if t0_ns <= int(b["start_ns"]) < t1_ns:
            ledger.add_bubble(_gpu_of(b), int(b["start_ns"]), int(b["end_ns"]))
    for st in steps:
        if t0_ns <= int(st["start_ns"]) < t1_ns:
            ledger.add_step(_gpu_of(st), str(st.get("job", "")), int(st["start_ns"]), int(st["end_ns"]), 0.0)
    totals = ledger.totals()
    return totals.filled_s / totals.bubble_s if totals.bubble_s else None


def _gpu_of(record: Mapping[str, Any]) -> tuple[int, int]:
    """(stage, rank) of a bubble or step record (rank 0 in records of agents before ranks)."""
    return int(record["stage"]), int(record.get("rank", 0))


def _merge(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in intervals:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _attribute(out: dict[str, int], a: int, b: int, *, u: int, p: int, where: str, step_ns: int) -> None:
    """Give the uncovered segment [a, b) of a bubble to its categories. Before the usable end (the earlier of the
    share's end ``u`` and the predicted end ``p``) it is latency (before or between steps; a bubble with no step
    whose usable part could hold one) or too short (no step could fit in what was left); between ``u`` and ``p``
    the guard's; after ``p`` past the prediction."""
    usable_end = min(u, p)
    before = max(0, min(b, usable_end) - a)
    if before:
        short = where != "before" and usable_end - a < step_ns
        out["too_short" if short else "latency"] += before
    out["guard"] += max(0, min(b, p) - max(a, u))
    out["past_prediction"] += max(0, b - max(a, p))
