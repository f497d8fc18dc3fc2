"""Accounting of harvesting: bubble time offered, fill time that landed in it, and fill time that did not.

Records arrive in any order (a fill step's report can beat the BUBBLE_END of the bubble it ran
in), so the ledger only stores intervals and computes everything in ``totals()`` with sorted
sweeps. Times are ``time.monotonic_ns()`` integers, so the sums are exact until the final
conversion to seconds.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from bubbles.stats import percentile

_NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class StepRecord:
    """One fill-job step as reported: where and when it ran, and the work it did."""

    stage: int
    job: str
    start_ns: int
    end_ns: int
    flops: float

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




class HarvestLedger:
    """Bubble and fill-step intervals per stage, totalled on demand."""

    def __init__(self) -> None:
        self._bubbles: dict[int, list[tuple[int, int]]] = {}
        self._steps: list[StepRecord] = []

    def add_bubble(self, stage: int, start_ns: int, end_ns: int) -> None:
        """Record one bubble of ``stage`` (from its BUBBLE_START to its BUBBLE_END)."""
        _check_interval(stage, start_ns, end_ns)
        self._bubbles.setdefault(stage, []).append((start_ns, end_ns))

    def add_step(self, stage: int, job: str, start_ns: int, end_ns: int, flops: float) -> None:
        """Record one fill-job step that ran on ``stage``'s accelerator."""
        _check_interval(stage, start_ns, end_ns)
        valid = isinstance(flops, int | float) and not isinstance(flops, bool) and math.isfinite(flops)
        if not valid or flops < 0:
            raise ValueError(f"flops must be a finite number >= 0, got {flops!r}")
        self._steps.append(StepRecord(stage, job, start_ns, end_ns, float(flops)))

    def stages(self) -> tuple[int, ...]:
        """Stages with any bubble or step recorded, ascending."""
        return tuple(sorted(set(self._bubbles) | {s.stage for s in self._steps}))

    def bubble_intervals(self, stage: int) -> tuple[tuple[int, int], ...]:
        """The stage's bubbles as (start_ns, end_ns), sorted by start, as recorded (not merged)."""
        return tuple(sorted(self._bubbles.get(stage, ())))

    def step_records(self) -> tuple[StepRecord, ...]:
        """All fill steps, sorted by (stage, start)."""
        return tuple(sorted(self._steps, key=lambda r: (r.stage, r.start_ns, r.end_ns)))

    def totals(self, stage: int | None = None) -> LedgerTotals:
        """Sum up every stage, or only ``stage``; O(n log n) in the records."""
        stages = self.stages() if stage is None else (stage,)
        bubble_ns = filled_ns = step_ns = 0
        flops = 0.0
        steps = 0
        overruns_ns: list[int] = []
        by_stage: dict[int, list[StepRecord]] = {}
        for r in self._steps:
            by_stage.setdefault(r.stage, []).append(r)
        for st in stages:
            covered = _Coverage(self._bubbles.get(st, []))
            bubble_ns += covered.total_ns
            for r in by_stage.get(st, []):
                inside = covered.between(r.start_ns, r.end_ns)
                filled_ns += inside
                step_ns += r.duration_ns
                flops += r.flops
                steps += 1
                if r.duration_ns - inside > 0:
                    overruns_ns.append(r.duration_ns - inside)
        overruns_ms = [ns / 1e6 for ns in overruns_ns]
        return LedgerTotals(
            bubble_s=bubble_ns / _NS_PER_S,
            filled_s=filled_ns / _NS_PER_S,
            fill_steps=steps,
            fill_flops=flops,
            overruns=len(overruns_ns),
            overrun_s=sum(overruns_ns) / _NS_PER_S,
            overrun_p99_ms=percentile(overruns_ms, 99) if overruns_ms else 0.0,
            max_overrun_ms=max(overruns_ms, default=0.0),
            step_s=step_ns / _NS_PER_S,
        )


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


def _check_interval(stage: int, start_ns: int, end_ns: int) -> None:
    for name, v in (("stage", stage), ("start_ns", start_ns), ("end_ns", end_ns)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer (time.monotonic_ns()), got {v!r}")
    if stage < 0:
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
                        "small risk of outliving its bubble (bubbles.gating.TailRisk)"),
)


def bubble_breakdown(bubbles: Iterable[Mapping[str, Any]], steps: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Split the bubbles' time into where it went (``BREAKDOWN``'s keys, seconds; they sum to ``bubble_s``), and the
    fill-step time that ran past its bubble's end (``overrun_s``: not bubble time, the training waited for it).

    ``bubbles`` are the agent's bubble records (``stage``, ``start_ns``, ``end_ns``, ``predicted_end_ns``,
    ``guard_paused``, ``share``, ``job``, ``step_s``; the agent's ``status().bubbles``), ``steps`` its step records
    (``stage``, ``start_ns``, ``end_ns``, ``tail``); pass one mode's of each. A step belongs to the bubble it started
    in. Of the filled time and the overrun, ``tail_s`` and ``tail_overrun_s`` are those of the steps the predicted end
    did not allow (``tail``: started on ``bubbles.gating.TailRisk``'s word). Pure.
    """
    by_stage: dict[int, list[tuple[int, int]]] = {}
    tails: set[tuple[int, int, int]] = set()
    for st in steps:
        by_stage.setdefault(int(st["stage"]), []).append((int(st["start_ns"]), int(st["end_ns"])))
        if st.get("tail"):
            tails.add((int(st["stage"]), int(st["start_ns"]), int(st["end_ns"])))
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
        stage = int(b["stage"])
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
    ledger = HarvestLedger()
    for b in bubbles:
        if t0_ns <= int(b["start_ns"]) < t1_ns:
            ledger.add_bubble(int(b["stage"]), int(b["start_ns"]), int(b["end_ns"]))
    for st in steps:
        if t0_ns <= int(st["start_ns"]) < t1_ns:
            ledger.add_step(int(st["stage"]), str(st.get("job", "")), int(st["start_ns"]), int(st["end_ns"]), 0.0)
    totals = ledger.totals()
    return totals.filled_s / totals.bubble_s if totals.bubble_s else None


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
