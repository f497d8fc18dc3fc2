"""The hook's pure part: a stage's instruction stream -> its candidate waits -> its bubble cycle.

Candidate bubbles are the waits that really block a stage on others: ``RecvActivation``, ``RecvGrad``, the sends
(``SendActivation``, ``SendGrad``), the collectives inside ``OptimizerStep``, ``ReduceGrads`` and ``ReduceTiedGrads``
(records named ``<instruction>.<op>``, see ``collectives``) and the end-of-batch loss broadcast (reported as
``LossBroadcast`` at position ``len(instruction stream)``). Tested directly on the streams of DeepSpeed's real schedule
classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bubbles.core.cycle import BubbleCycle, BubbleSlot, robust_stats

from .collectives import is_collective

LOSS_BROADCAST = "LossBroadcast"
WAIT_INSTRUCTIONS = frozenset({"RecvActivation", "RecvGrad"})
# A send waits for its receiver: gloo's blocks the host until the peer posts its receive (a peer still busy with its
# backward pass keeps it there for milliseconds), NCCL's holds the GPU. Sends are timed and profiled like receives; one
# whose receiver is already waiting takes microseconds and stays under the profile's minimum bubble.
SEND_INSTRUCTIONS = frozenset({"SendActivation", "SendGrad"})


@dataclass(frozen=True)
class Candidate:
    """A wait in a stage's instruction stream that may be a bubble."""

    position: int  # index in the iteration's instruction stream; LossBroadcast: len(stream)
    instruction: str
    kind: str  # one of cycle.BUBBLE_KINDS


def instruction_stream(schedule: Iterable[Iterable[Any]]) -> list[str]:
    """The flat list of instruction class names a ``PipeSchedule`` makes a stage execute, in order."""
    return [type(cmd).__name__ for step in schedule for cmd in step]


def candidate_slots(stream: Sequence[str], *, loss_broadcast: bool = True, sends: bool = True) -> list[Candidate]:
    """Classify every wait of one iteration's stream (receives, collectives inside instructions; with ``sends`` sends).

    - fill: before the stage's first ForwardPass (waiting for the first activation);
    - fwd-bwd: the last RecvGrad before the stage's first BackwardPass (end of 1F1B warm-up);
    - drain: after the stage's last ForwardPass or last BackwardPass (waiting for the remaining
      gradients), and the end-of-batch loss broadcast;
    - steady: every other wait.
    """
    def first(name: str) -> int | None:
        return next((i for i, n in enumerate(stream) if n == name), None)

    def last(name: str) -> int | None:
        return next((i for i in range(len(stream) - 1, -1, -1) if stream[i] == name), None)

    first_fwd, last_fwd = first("ForwardPass"), last("ForwardPass")
    first_bwd, last_bwd = first("BackwardPass"), last("BackwardPass")
    fwd_bwd = None
    if first_bwd is not None:
        fwd_bwd = next((i for i in range(first_bwd - 1, -1, -1) if stream[i] == "RecvGrad"), None)
    out = []
    for i, name in enumerate(stream):
        if name not in WAIT_INSTRUCTIONS and not (sends and name in SEND_INSTRUCTIONS) and not is_collective(name):
            continue
        if i == fwd_bwd:
            kind = "fwd-bwd"
        elif first_fwd is not None and i < first_fwd:
            kind = "fill"
        elif (last_fwd is not None and i > last_fwd) or (last_bwd is not None and i > last_bwd):
            kind = "drain"
        else:
            kind = "steady"
        out.append(Candidate(i, name, kind))
    if loss_broadcast:
        out.append(Candidate(len(stream), LOSS_BROADCAST, "drain"))
    return out


def build_cycle(*, training: str, stage: int, stages: int, microbatches: int, schedule: str,
                candidates: Sequence[Candidate], durations_s: Sequence[Sequence[float]],
                free_bytes: Sequence[int], iteration_s: Sequence[float], min_bubble_s: float,
                allocated_bytes: Sequence[int] | None = None, memory_margin_bytes: int = 0) -> BubbleCycle:
    """Aggregate profiled iterations into a cycle.

    ``durations_s[k][j]`` is the measured length of ``candidates[j]`` in profiled iteration ``k``;
    ``free_bytes[j]`` the lowest free memory seen at candidate ``j`` and ``allocated_bytes[j]`` the most
    the training held there. A candidate whose median is at least ``min_bubble_s`` becomes a bubble;
    slots are numbered in schedule order.
    """
    if not durations_s or not iteration_s:
        raise ValueError("no profiled iterations")
    if allocated_bytes is None:
        allocated_bytes = [0] * len(candidates)
    if (any(len(row) != len(candidates) for row in durations_s) or len(free_bytes) != len(candidates)
            or len(allocated_bytes) != len(candidates)):
        raise ValueError("durations and memory readings must have one entry per candidate")
    slots: list[BubbleSlot] = []
    wait_s = 0.0
    for j, cand in enumerate(candidates):
        med, p10, p90 = robust_stats([row[j] for row in durations_s])
        wait_s += med
        if med >= min_bubble_s:
            slots.append(BubbleSlot(slot=len(slots), position=cand.position, instruction=cand.instruction,
                                    kind=cand.kind, duration_s=med, p10_s=p10, p90_s=p90,
                                    free_bytes=max(0, int(free_bytes[j])),
                                    allocated_bytes=max(0, int(allocated_bytes[j]))))
    return BubbleCycle(training=training, stage=stage, stages=stages, microbatches=microbatches,
                       schedule=schedule, iteration_s=robust_stats(iteration_s)[0], slots=tuple(slots),
                       samples=len(durations_s), wait_s=wait_s, memory_margin_bytes=memory_margin_bytes)


