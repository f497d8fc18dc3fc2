"""Where and how long one pipeline stage waits: a simulation of all stages of a synchronous pipeline.

Pure: instruction streams in (the class names DeepSpeed's ``TrainSchedule`` yields for every stage, built by
the caller), per-instruction durations in, per-stage waits out. No torch, no deepspeed.

The model (what the one-GPU benchmark needs to put the waits of stage ``s`` at the right places):

- every stage executes its stream in order, one instruction at a time; ``ForwardPass``, ``BackwardPass``,
  ``OptimizerStep`` (and anything else given a duration) take their duration, the rest take 0;
- sends do not block (NCCL's ``send`` returns to the stage at once); the data reaches the neighbour
  ``p2p_latency_s`` after the send has finished;
- ``RecvActivation``/``RecvGrad`` complete when the matching send of the neighbour has happened plus the
  latency; sends and receives are matched in order per link and direction (stage s's k-th SendActivation
  feeds stage s+1's k-th RecvActivation, stage s+1's k-th SendGrad stage s's k-th RecvGrad);
- after its stream every stage runs the end-of-batch loss broadcast (``_aggregate_total_loss``) from the last
  stage: it completes when the last stage has finished its stream (plus the latency); the last stage, the
  source, does not wait;
- iterations follow each other with no barrier (DeepSpeed has none), so a stage that finishes early starts
  its next batch early and waits there instead. The waits reported are those of the periodic steady state,
  found by simulating batches until one batch's waits repeat the previous one's. (With DeepSpeed's default
  gradient clipping the optimizer step is an all-reduce over the pipeline, a barrier that moves the later
  stages' first-activation wait to the end of the batch; stage 0, the last to finish, waits the same.)

With zero latency and zero-length other instructions, DeepSpeed's 1F1B gives every stage the same steady-state
iteration ``(m + p - 1)(F + B)`` (plus the optimizer step, which lengthens the iteration but moves no wait),
of which it waits exactly ``(p - 1)(F + B)``; with ``m >= p`` stage ``s`` waits ``s(F + B)`` for its first
activation (fill), ``(p - 1 - s)B`` for its first gradient (fwd-bwd) and ``F`` for each of its ``p - 1 - s``
last gradients (drain). Both relations are tested on DeepSpeed's real schedule. A latency lengthens the waits
by more than one latency per receive: DeepSpeed posts a stage's RecvGrad before its SendActivation in the
same step, so a late gradient also delays the next stage's activation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

LOSS_BROADCAST = "LossBroadcast"  # same name the hook gives the end-of-batch wait (bubbles.hook)
RECEIVES = {"RecvActivation": ("SendActivation", -1), "RecvGrad": ("SendGrad", +1)}  # recv -> (send, from)
SENDS = {"SendActivation": +1, "SendGrad": -1}  # send -> direction of the receiving neighbour
MAX_BATCHES = 64  # batches simulated at most while looking for the steady state
_REL_TOL = 1e-9


@dataclass(frozen=True)
class StageWaits:
    """One stage's steady-state batch: how long it waits at each wait position and per batch."""

    stage: int
    stream: tuple[str, ...]
    # position in the stream -> seconds waited there; receives at their index, the loss broadcast at len(stream)
    waits_s: dict[int, float]
    iteration_s: float
    busy_s: float  # time spent executing instructions with a duration

    @property
    def wait_s(self) -> float:
        return sum(self.waits_s.values())

    @property
    def bubble_share(self) -> float:
        """Share of the iteration the stage waits."""
        return self.wait_s / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def loss_broadcast_s(self) -> float:
        return self.waits_s.get(len(self.stream), 0.0)


@dataclass(frozen=True)
class PipelineWaits:
    """Every stage's steady-state waits, and how many batches it took to reach the steady state."""

    stages: tuple[StageWaits, ...]
    microbatches: int
    batches_simulated: int
    converged: bool

    @property
    def iteration_s(self) -> float:
        return max(s.iteration_s for s in self.stages)

    def stage(self, index: int) -> StageWaits:
        if not 0 <= index < len(self.stages):
            p = len(self.stages)
            raise ValueError(f"stage {index} is outside the pipeline's {p} stages (0..{p - 1})")
        return self.stages[index]


def simulate_pipeline(streams: Sequence[Sequence[str]] | Callable[[int], Sequence[str]], *,
                      microbatches: int, durations_s: Mapping[str, float], stages: int | None = None,
                      p2p_latency_s: float = 0.0) -> PipelineWaits:
    """Simulate batches of a synchronous pipeline until its waits repeat (see the module docstring).

    ``streams`` is one instruction-name list per stage, or a callable ``stage -> list`` (then ``stages`` is
    required). Raises ValueError for bad inputs (fewer than 2 stages or 1 micro-batch, negative or infinite
    durations, sends and receives that do not match, streams that deadlock), saying what to fix.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if callable(streams):
        if stages is None:
            raise ValueError("give stages=<number of pipeline stages> when streams is a callable")
        _check_stages(stages)
        stage_streams = [tuple(streams(s)) for s in range(stages)]
    else:
        stage_streams = [tuple(s) for s in streams]
        if stages is not None and stages != len(stage_streams):
            raise ValueError(f"stages={stages} but {len(stage_streams)} streams were given; give one per stage")
        _check_stages(len(stage_streams))
    p = len(stage_streams)
    for name, d in durations_s.items():
        if isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d) or d < 0:
            raise ValueError(f"duration of {name} must be a finite number of seconds >= 0, got {d!r}")
    if isinstance(p2p_latency_s, bool) or not isinstance(p2p_latency_s, int | float) \
            or not math.isfinite(p2p_latency_s) or p2p_latency_s < 0:
        raise ValueError(f"p2p_latency_s must be a finite number of seconds >= 0, got {p2p_latency_s!r}")
    _check_links(stage_streams)

    sim = _Simulation(stage_streams, durations_s, float(p2p_latency_s))
    previous: list[dict[int, float]] | None = None
    batch_end = [0.0] * p  # when each stage finished its previous batch (its loss broadcast)
    converged = False
    batches = 0
    result: list[StageWaits] = []
    while batches < MAX_BATCHES:
        waits, ends, busy = sim.run_batch()
        batches += 1
        result = [StageWaits(stage=s, stream=stage_streams[s], waits_s=waits[s],
                             iteration_s=ends[s] - batch_end[s], busy_s=busy[s]) for s in range(p)]
        batch_end = ends
        if previous is not None and all(_same(previous[s], waits[s]) for s in range(p)):
            converged = True
            break
        previous = waits
    return PipelineWaits(stages=tuple(result), microbatches=microbatches, batches_simulated=batches,
                         converged=converged)


def _check_stages(stages: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(f"a pipeline needs at least 2 stages, got {stages!r}")


def _check_links(streams: Sequence[Sequence[str]]) -> None:
    """Every receive must have a matching send on the neighbour: same count per link and direction."""
    p = len(streams)
    for s, stream in enumerate(streams):
        for recv, (send, src_offset) in RECEIVES.items():
            n_recv = stream.count(recv)
            src = s + src_offset
            if not 0 <= src < p:
                if n_recv:
                    raise ValueError(f"stage {s} has {recv} but no stage {src} to receive from; "
                                     "give the streams of every stage in stage order")
                continue
            n_send = streams[src].count(send)
            if n_send != n_recv:
                raise ValueError(f"stage {s} has {n_recv} {recv} but stage {src} has {n_send} {send}: "
                                 "the streams must be the same schedule's, for the same micro-batches")


def _same(a: Mapping[int, float], b: Mapping[int, float]) -> bool:
    if a.keys() != b.keys():
        return False
    scale = max([1e-12, *a.values(), *b.values()])
    return all(abs(a[k] - b[k]) <= _REL_TOL * scale for k in a)


class _Simulation:
    """The running state of all stages across batches: clocks, positions and the sends seen per link."""

    def __init__(self, streams: Sequence[tuple[str, ...]], durations_s: Mapping[str, float],
                 latency_s: float) -> None:
        self.streams = streams
        self.dur = {name: float(d) for name, d in durations_s.items()}
        self.latency_s = latency_s
        p = len(streams)
        self.clock = [0.0] * p
        # (sending stage, send name) -> completion times of that stage's sends, in order, over all batches
        self.sent: dict[tuple[int, str], list[float]] = {}
        self.received: dict[tuple[int, str], int] = {}  # (receiving stage, recv name) -> how many consumed
        self.stream_end: list[float] = []  # the last stage's stream end per batch (the broadcast's source)

    def run_batch(self) -> tuple[list[dict[int, float]], list[float], list[float]]:
        p = len(self.streams)
        pos = [0] * p
        waits: list[dict[int, float]] = [{} for _ in range(p)]
        busy = [0.0] * p
        batch = len(self.stream_end)
        done = [False] * p
        while not all(done):
            progressed = False
            for s in range(p):
                while not done[s]:
                    stream = self.streams[s]
                    if pos[s] == len(stream):  # the end-of-batch loss broadcast
                        if s == p - 1:
                            self.stream_end.append(self.clock[s])
                            waits[s][pos[s]] = 0.0
                        elif len(self.stream_end) > batch:
                            ready = self.stream_end[batch] + self.latency_s
                            waits[s][pos[s]] = max(0.0, ready - self.clock[s])
                            self.clock[s] = max(self.clock[s], ready)
                        else:
                            break  # the last stage has not finished this batch yet
                        done[s] = True
                        progressed = True
                        break
                    name = stream[pos[s]]
                    if name in RECEIVES:
                        send, offset = RECEIVES[name]
                        times = self.sent.get((s + offset, send), [])
                        k = self.received.get((s, name), 0)
                        if k >= len(times):
                            break  # the neighbour has not sent it yet
                        self.received[(s, name)] = k + 1
                        ready = times[k] + self.latency_s
                        waits[s][pos[s]] = max(0.0, ready - self.clock[s])
                        self.clock[s] = max(self.clock[s], ready)
                    d = self.dur.get(name, 0.0)
                    self.clock[s] += d
                    busy[s] += d
                    if name in SENDS:
                        self.sent.setdefault((s, name), []).append(self.clock[s])
                    pos[s] += 1
                    progressed = True
            if not progressed:
                stuck = [f"stage {s} at position {pos[s]} ({self._at(s, pos[s])})" for s in range(p) if not done[s]]
                raise ValueError("the streams deadlock: " + "; ".join(stuck)
                                 + ". Give every stage's stream of one schedule (DeepSpeed's TrainSchedule)")
        return waits, list(self.clock), busy

    def _at(self, s: int, pos: int) -> str:
        stream = self.streams[s]
        return stream[pos] if pos < len(stream) else LOSS_BROADCAST
