"""The hook's pure part (``bubbles.training.hook.profile``): ``candidate_slots`` and ``build_cycle`` on the instruction
streams of DeepSpeed's real schedule classes."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as S

from bubbles.core.cycle import BUBBLE_KINDS, BubbleCycle
from bubbles.training.hook import (
    Candidate,
    build_cycle,
    candidate_slots,
    instruction_stream,
)

SHAPES = [(p, m) for p in (2, 3, 4) for m in (1, 2, 4, 8)]


# ---------------------------------------------------------------------------------------------------
# classification on DeepSpeed's real schedules


@pytest.mark.parametrize("p,m", SHAPES)
def test_train_schedule_waits_are_classified(p: int, m: int) -> None:
    for s in range(p):
        stream = instruction_stream(S.TrainSchedule(micro_batches=m, stages=p, stage_id=s))
        cands = candidate_slots(stream, sends=False)
        waits = [i for i, n in enumerate(stream) if n in ("RecvActivation", "RecvGrad")]
        assert [c.position for c in cands] == [*waits, len(stream)]
        assert all(stream[c.position] == c.instruction for c in cands[:-1])
        assert cands[-1] == Candidate(len(stream), "LossBroadcast", "drain")
        assert {c.kind for c in cands} <= set(BUBBLE_KINDS)
        kinds = [c.kind for c in cands]
        first_fwd = stream.index("ForwardPass")
        # fill: exactly the first activation a non-first stage waits for, before any forward
        assert kinds.count("fill") == (1 if s > 0 else 0)
        if s > 0:
            assert cands[0].kind == "fill" and cands[0].position < first_fwd
        # fwd-bwd: one RecvGrad right before the first backward, on every stage but the last
        fb = [c for c in cands if c.kind == "fwd-bwd"]
        assert len(fb) == (1 if s < p - 1 else 0)
        if fb:
            first_bwd = stream.index("BackwardPass")
            assert fb[0].instruction == "RecvGrad" and fb[0].position < first_bwd
            assert "RecvGrad" not in stream[fb[0].position + 1:first_bwd]
        # drain: waits after the last forward, plus the loss broadcast
        last_fwd = len(stream) - 1 - stream[::-1].index("ForwardPass")
        for c in cands[:-1]:
            if c.kind == "drain":
                assert c.position > last_fwd
            elif c.kind == "steady":
                assert first_fwd < c.position < last_fwd


@pytest.mark.parametrize("p,m", SHAPES)
def test_inference_schedule_waits_are_classified(p: int, m: int) -> None:
    for s in range(p):
        stream = instruction_stream(S.InferenceSchedule(micro_batches=m, stages=p, stage_id=s))
        cands = candidate_slots(stream, sends=False)
        assert "RecvGrad" not in {c.instruction for c in cands}
        assert sum(c.instruction == "RecvActivation" for c in cands) == (m if s > 0 else 0)
        kinds = [c.kind for c in cands]
        assert kinds[-1] == "drain" and cands[-1].instruction == "LossBroadcast"
        assert "fwd-bwd" not in kinds
        if s > 0:
            assert kinds[:m] == ["fill"] + ["steady"] * (m - 1)


def test_two_stage_stream_by_hand() -> None:
    stream = instruction_stream(S.TrainSchedule(micro_batches=3, stages=2, stage_id=0))
    got = [(c.position, c.instruction, c.kind) for c in candidate_slots(stream, sends=False)]
    # L F SA L F RG SA B L F RG SA B RG B ...: the RecvGrad before the first backward ends warm-up;
    # after the last forward the stage waits for the remaining gradients.
    assert got == [(5, "RecvGrad", "fwd-bwd"), (10, "RecvGrad", "drain"), (13, "RecvGrad", "drain"),
                   (18, "LossBroadcast", "drain")]
    last = instruction_stream(S.TrainSchedule(micro_batches=3, stages=2, stage_id=1))
    got = [(c.position, c.kind) for c in candidate_slots(last, loss_broadcast=False, sends=False)]
    assert got == [(0, "fill"), (5, "steady"), (10, "steady")]


@pytest.mark.parametrize("p,m", SHAPES)
def test_sends_are_waits_by_default(p: int, m: int) -> None:
    # A send waits for its receiver (gloo blocks the host, NCCL the GPU): every send is a candidate, classified like
    # the receives around it.
    for s in range(p):
        stream = instruction_stream(S.TrainSchedule(micro_batches=m, stages=p, stage_id=s))
        cands = candidate_slots(stream)
        sends = [i for i, n in enumerate(stream) if n in ("SendActivation", "SendGrad")]
        assert [c.position for c in cands if c.instruction.startswith("Send")] == sends
        assert len(sends) == (m if s < p - 1 else 0) + (m if s > 0 else 0)
        last_fwd = len(stream) - 1 - stream[::-1].index("ForwardPass")
        for c in cands:
            if c.instruction.startswith("Send") and c.position > last_fwd:
                assert c.kind == "drain"


def test_collectives_inside_instructions_are_drain_waits() -> None:
    # The records of collectives inside OptimizerStep and ReduceGrads come before their instruction's own record: the
    # gradient norm's all-reduce of clipping (the pipeline's drain) and the data-parallel all-reduce.
    stream = instruction_stream(S.TrainSchedule(micro_batches=2, stages=2, stage_id=1))
    i = stream.index("ReduceGrads")
    stream[i:i] = ["ReduceGrads.all_reduce"]
    j = stream.index("OptimizerStep")
    stream[j:j] = ["OptimizerStep.all_reduce", "OptimizerStep.all_reduce"]
    cands = candidate_slots(stream)
    inner = [(c.position, c.instruction, c.kind) for c in cands if "." in c.instruction]
    assert inner == [(i, "ReduceGrads.all_reduce", "drain"), (j, "OptimizerStep.all_reduce", "drain"),
                     (j + 1, "OptimizerStep.all_reduce", "drain")]
    # a name that is not a collective of those instructions is not a wait
    assert not [c for c in candidate_slots(["ForwardPass.all_reduce", "OptimizerStep.frobnicate", "ForwardPass"])
                if c.instruction != "LossBroadcast"]


# ---------------------------------------------------------------------------------------------------
# aggregation


def test_build_cycle_takes_medians_thresholds_and_numbers_slots() -> None:
    cands = [Candidate(0, "RecvActivation", "fill"), Candidate(4, "RecvGrad", "steady"),
             Candidate(9, "LossBroadcast", "drain")]
    durations = [[0.010, 0.0001, 0.003], [0.012, 0.0002, 0.100], [0.011, 0.0009, 0.004]]
    cycle = build_cycle(training="t", stage=1, stages=2, microbatches=4, schedule="TrainSchedule",
                        candidates=cands, durations_s=durations, free_bytes=[100, 200, 300],
                        iteration_s=[0.05, 0.07, 0.06], min_bubble_s=0.0005)
    assert [(s.slot, s.position, s.instruction, s.kind) for s in cycle.slots] == [
        (0, 0, "RecvActivation", "fill"), (1, 9, "LossBroadcast", "drain")]
    assert cycle.slots[0].duration_s == pytest.approx(0.011)
    assert cycle.slots[1].duration_s == pytest.approx(0.004)  # one slow iteration does not move it
    assert cycle.slots[1].p90_s > cycle.slots[1].duration_s
    assert [s.free_bytes for s in cycle.slots] == [100, 300]
    assert cycle.iteration_s == pytest.approx(0.06) and cycle.samples == 3
    assert BubbleCycle.from_dict(cycle.to_dict()) == cycle


def test_build_cycle_rejects_misshapen_samples() -> None:
    cands = [Candidate(0, "RecvGrad", "steady")]
    with pytest.raises(ValueError):
        build_cycle(training="t", stage=0, stages=2, microbatches=1, schedule="X", candidates=cands,
                    durations_s=[[0.1, 0.2]], free_bytes=[0], iteration_s=[1.0], min_bubble_s=0)
    with pytest.raises(ValueError):
        build_cycle(training="t", stage=0, stages=2, microbatches=1, schedule="X", candidates=cands,
                    durations_s=[], free_bytes=[0], iteration_s=[], min_bubble_s=0)
