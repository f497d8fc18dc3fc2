"""A stage's bubble cycle: the idle slots that repeat every iteration of the training, as plain data.

The hook measures it, the agent packs fill jobs into it, the scheduler and the simulator reason
about it. ``to_dict``/``from_dict`` are the wire and file form; ``from_dict`` validates everything
it reads, because a profile arrives over a socket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bubbles.core.stats import percentile

# Where in the schedule a bubble sits (PipeFill's vocabulary):
#   fill     - warm-up: a stage waits for its first activation before any forward pass
#   fwd-bwd  - between a stage's last warm-up forward and its first backward
#   steady   - the short waits inside 1F1B's steady state
#   drain    - cool-down: the wait for the last gradients and the end-of-batch loss broadcast
BUBBLE_KINDS = ("fill", "fwd-bwd", "steady", "drain")


@dataclass(frozen=True)
class BubbleSlot:
    """One bubble of the cycle: where it is, how long it lasts, and how much memory is free."""

    slot: int  # index among this stage's bubbles, in schedule order
    position: int  # index of the waiting instruction within the iteration's instruction stream
    instruction: str  # e.g. "RecvGrad", "RecvActivation", "LossBroadcast"
    kind: str  # one of BUBBLE_KINDS
    duration_s: float  # median over the profiled iterations
    p10_s: float
    p90_s: float
    free_bytes: int  # accelerator memory free for fill work during this bubble
    # The training's live tensors during this bubble (the probe's reading; 0: unknown, e.g. on CPU or in a
    # profile written before this field existed). Free memory already leaves room for the training's peak.
    allocated_bytes: int = 0


@dataclass(frozen=True)
class BubbleCycle:
    """The repeating bubbles of one pipeline stage."""

    training: str
    stage: int
    stages: int
    microbatches: int
    schedule: str  # "TrainSchedule" | "InferenceSchedule" | a custom PipeSchedule's class name
    iteration_s: float  # median iteration time measured while profiling (no fill work)
    slots: tuple[BubbleSlot, ...]
    samples: int  # profiled iterations behind the statistics
    # All the time the stage waited per iteration (median per wait instruction, summed), including
    # waits too short to be signalled as bubbles; 0.0 when unknown (a cycle built by hand).
    wait_s: float = 0.0
    # Bytes the memory probe kept back from every slot's free_bytes for what the training's allocator peak does
    # not show (cuDNN/cuBLAS workspaces, a longer batch later): the safety margin, stated so a reader of the
    # profile knows free_bytes is already net of it. 0: no margin (a static probe, CPU) or unknown.
    memory_margin_bytes: int = 0

    @property
    def bubble_s(self) -> float:
        """Time per iteration in the signalled bubbles: what fill jobs can use."""
        return sum(s.duration_s for s in self.slots)

    @property
    def bubble_ratio(self) -> float:
        """Share of the iteration in signalled bubbles."""
        return self.bubble_s / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def idle_ratio(self) -> float:
        """Share of the iteration the stage waited at all (every wait, signalled or too short)."""
        idle = max(self.wait_s, self.bubble_s)
        return idle / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def theory_ratio(self) -> float:
        return theoretical_bubble_ratio(self.stages, self.microbatches)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["slots"] = [asdict(s) for s in self.slots]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> BubbleCycle:
        """Build a cycle from untrusted data; raise ValueError naming the first bad field."""
        if not isinstance(d, dict):
            raise ValueError("bubble cycle must be an object")
        training = _field(d, "training", str)
        stage = _nonneg_int(d, "stage")
        stages = _nonneg_int(d, "stages")
        if stages < 1 or stage >= stages:
            raise ValueError(f"stage {stage} is outside a pipeline of {stages} stages")
        raw_slots = _field(d, "slots", list)
        slots = tuple(_slot_from_dict(i, s) for i, s in enumerate(raw_slots))
        return cls(
            training=training,
            stage=stage,
            stages=stages,
            microbatches=max(1, _nonneg_int(d, "microbatches")),
            schedule=_field(d, "schedule", str),
            iteration_s=_nonneg_float(d, "iteration_s"),
            slots=slots,
            samples=_nonneg_int(d, "samples"),
            wait_s=_nonneg_float(d, "wait_s") if "wait_s" in d else 0.0,
            memory_margin_bytes=_nonneg_int(d, "memory_margin_bytes") if "memory_margin_bytes" in d else 0,
        )


def theoretical_bubble_ratio(stages: int, microbatches: int) -> float:
    """The ideal bubble share of a synchronous pipeline, (p-1)/(m+p-1), for GPipe and 1F1B alike."""
    if stages < 1 or microbatches < 1:
        raise ValueError("stages and microbatches must be >= 1")
    return (stages - 1) / (microbatches + stages - 1)


def robust_stats(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of measured durations: one slow iteration does not move the median."""
    if not samples:
        raise ValueError("no samples")
    return percentile(samples, 50), percentile(samples, 10), percentile(samples, 90)


def predicted_length(lengths: Sequence[float]) -> float:
    """A bubble's predicted length from its measured ones: the smaller of their 10th percentile and median. Not
    the median: a fill step must end before the training needs the core/GPU again, and a median is overrun by
    half of all bubbles."""
    _med, p10, _p90 = robust_stats(lengths)
    return min(p10, _med)


SHIFT_RUN = 3  # this many lengths in a row ...
SHIFT_FACTOR = 2.0  # ... each at least this many times the prediction: the bubble has changed (see RecentLengths)


class RecentLengths:
    """Each signalled bubble's predicted length, kept current from its recent lengths. Pure.

    A profile of a few iterations at the start is a noisy and, as the training and the machine change, stale
    estimate: seeded with the profiled lengths, this keeps each position's last ``window`` lengths (``add``), and
    ``predicted_ns`` applies ``predicted_length`` to them.

    A low percentile of a long window moves up slowly: a bubble that became 100 times longer than profiled (a data
    loader that stalls the neighbour, a slower peer) would keep its short prediction for most of the window, and a
    fill job whose steps fit the new length would run nothing for 30 iterations. So when ``shift_run`` lengths in a
    row are each at least ``shift_factor`` times the prediction, the older lengths are forgotten and the window
    starts again from those (``add`` returns True, ``shifts`` counts it): the prediction becomes the smallest of
    them at once. The other way, shorter bubbles pull the low percentile down within a few lengths anyway. The
    price of moving up fast is overruns if the long bubbles were a passing spell: the fill runtime's tail-risk bound
    still applies past the prediction, and the agent's ledger counts every overrun (``overrun_s``).
    """

    def __init__(self, seeds: dict[int, Sequence[int]], window: int = 32, *, shift_run: int | None = None,
                 shift_factor: float = SHIFT_FACTOR) -> None:
        if window < 1 or any(not v for v in seeds.values()):
            raise ValueError("RecentLengths needs window >= 1 and at least one seed length per position")
        if shift_run is None:
            shift_run = min(SHIFT_RUN, window)
        if not 1 <= shift_run <= window or shift_factor <= 1.0:
            raise ValueError("RecentLengths needs 1 <= shift_run <= window and shift_factor > 1")
        self.window = window
        self.shift_run = shift_run
        self.shift_factor = shift_factor
        self.shifts = 0
        self._lengths = {pos: list(v)[-window:] for pos, v in seeds.items()}
        self._predicted = {pos: int(predicted_length(v)) for pos, v in self._lengths.items()}
        self._run = dict.fromkeys(self._lengths, 0)

    def add(self, position: int, length_ns: int) -> bool:
        """Keep ``length_ns``; True if it completed a run of far longer bubbles and the window restarted."""
        kept = self._lengths.get(position)
        if kept is None:
            return False
        kept.append(length_ns)
        if len(kept) > self.window:
            del kept[0]
        if length_ns < self.shift_factor * max(self._predicted[position], 1):
            self._run[position] = 0
            return False
        self._run[position] += 1
        if self._run[position] < self.shift_run:
            return False
        del kept[:-self.shift_run]
        self._run[position] = 0
        self._predicted[position] = int(predicted_length(kept))
        self.shifts += 1
        return True

    def predicted_ns(self, position: int) -> int:
        """The prediction from the lengths kept now (and the one later lengths are compared with)."""
        self._predicted[position] = predicted = int(predicted_length(self._lengths[position]))
        return predicted


def _slot_from_dict(i: int, s: Any) -> BubbleSlot:
    if not isinstance(s, dict):
        raise ValueError(f"slots[{i}] must be an object")
    kind = _field(s, "kind", str)
    if kind not in BUBBLE_KINDS:
        raise ValueError(f"slots[{i}].kind {kind!r} is not one of {', '.join(BUBBLE_KINDS)}")
    return BubbleSlot(
        slot=_nonneg_int(s, "slot"),
        position=_nonneg_int(s, "position"),
        instruction=_field(s, "instruction", str),
        kind=kind,
        duration_s=_nonneg_float(s, "duration_s"),
        p10_s=_nonneg_float(s, "p10_s"),
        p90_s=_nonneg_float(s, "p90_s"),
        free_bytes=_nonneg_int(s, "free_bytes"),
        allocated_bytes=_nonneg_int(s, "allocated_bytes") if "allocated_bytes" in s else 0,
    )


def _field(d: dict[str, Any], name: str, typ: type) -> Any:
    if name not in d:
        raise ValueError(f"missing field {name!r}")
    v = d[name]
    if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
        raise ValueError(f"field {name!r} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _nonneg_int(d: dict[str, Any], name: str) -> int:
    v = _field(d, name, int)
    if v < 0:
        raise ValueError(f"field {name!r} must be >= 0, got {v}")
    return int(v)


def _nonneg_float(d: dict[str, Any], name: str) -> float:
    if name not in d:
        raise ValueError(f"missing field {name!r}")
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"field {name!r} must be a finite number >= 0, got {v!r}")
    return float(v)
