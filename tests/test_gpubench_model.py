"""The one-GPU harvesting benchmark (gpubench): the pipeline model on the instruction streams of DeepSpeed's real
``TrainSchedule`` (iteration and waits against the textbook relation, where the waits sit, bad inputs)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers.gpubench import ds_streams, passes

from bubbles.training.hook import candidate_slots
from gpubench.pipeline_model import simulate_pipeline

# ---------------------------------------------------------------------------------------------------
# the pipeline model


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 16)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.003, 0.0075)])
def test_deepspeed_1f1b_iteration_and_wait_follow_the_textbook_relation(p: int, m: int, f: float, b: float) -> None:
    # The exact relation for DeepSpeed's TrainSchedule with zero latency and zero-length other instructions:
    # every stage's steady-state batch lasts (m + p - 1)(F + B) and waits (p - 1)(F + B) of it.
    waits = simulate_pipeline(ds_streams(p, m), microbatches=m, durations_s=passes(f, b))
    assert waits.converged
    for st in waits.stages:
        assert st.iteration_s == pytest.approx((m + p - 1) * (f + b), rel=1e-9)
        assert st.wait_s == pytest.approx((p - 1) * (f + b), rel=1e-9)
        assert st.busy_s == pytest.approx(m * (f + b), rel=1e-9)
        assert st.bubble_share == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)


def test_optimizer_step_lengthens_the_iteration_not_the_waits() -> None:
    plain = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 2))
    with_opt = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 2, 0.5))
    for a, b in zip(plain.stages, with_opt.stages, strict=True):
        assert b.iteration_s == pytest.approx(a.iteration_s + 0.5)
        assert b.waits_s == pytest.approx(a.waits_s)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 3), (4, 4), (4, 8)])
def test_waits_sit_where_the_hook_expects_bubbles(p: int, m: int) -> None:
    # Stage s of DeepSpeed's 1F1B (m >= p, no barrier between batches) waits s(F + B) for its first
    # activation (fill), (p - 1 - s)B for its first gradient (fwd-bwd) and F for each of its p - 1 - s last
    # gradients (drain): (p - 1)(F + B) in all.
    f, b = 1.0, 2.5
    waits = simulate_pipeline(ds_streams(p, m), microbatches=m, durations_s=passes(f, b))
    for st in waits.stages:
        s = st.stage
        cands = {c.position: c for c in candidate_slots(st.stream)}
        waiting = {pos: w for pos, w in st.waits_s.items() if w > 1e-12}
        assert set(waiting) <= set(cands), f"stage {s} waits where the hook sees no candidate"
        by_kind: dict[str, list[float]] = {}
        for pos, w in sorted(waiting.items()):
            by_kind.setdefault(cands[pos].kind, []).append(w)
        expected: dict[str, list[float]] = {}
        if s > 0:
            expected["fill"] = [s * (f + b)]
        if s < p - 1:
            expected["fwd-bwd"] = [(p - 1 - s) * b]
            expected["drain"] = [f] * (p - 1 - s)
        assert by_kind.keys() == expected.keys(), (s, by_kind)
        for kind, ws in expected.items():
            assert by_kind[kind] == pytest.approx(ws), (s, kind)


def test_p2p_latency_lengthens_every_stage_s_waits() -> None:
    base = simulate_pipeline(ds_streams(4, 8), microbatches=8, durations_s=passes(1, 2))
    slow = simulate_pipeline(ds_streams(4, 8), microbatches=8, durations_s=passes(1, 2), p2p_latency_s=0.1)
    for a, b in zip(base.stages, slow.stages, strict=True):
        assert b.wait_s > a.wait_s
        assert b.iteration_s > a.iteration_s
        assert b.busy_s == pytest.approx(a.busy_s)


def test_streams_can_be_given_as_a_callable() -> None:
    as_list = simulate_pipeline(ds_streams(3, 4), microbatches=4, durations_s=passes(1, 1))
    as_fn = simulate_pipeline(lambda s: ds_streams(3, 4)[s], stages=3, microbatches=4, durations_s=passes(1, 1))
    assert as_list == as_fn


@pytest.mark.parametrize("kwargs,message", [
    ({"streams": ds_streams(2, 4), "microbatches": 0}, "microbatches must be an integer >= 1"),
    ({"streams": ds_streams(2, 4)[:1], "microbatches": 4}, "at least 2 stages"),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "durations_s": {"ForwardPass": -1.0}},
     "duration of ForwardPass must be a finite number"),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "durations_s": {"BackwardPass": math.nan}},
     "duration of BackwardPass"),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "p2p_latency_s": -0.001}, "p2p_latency_s must be"),
    ({"streams": [ds_streams(2, 2)[0], ds_streams(2, 4)[1]], "microbatches": 4},
     "must be the same schedule's"),
    ({"streams": [ds_streams(2, 4)[1], ds_streams(2, 4)[0]], "microbatches": 4}, "no stage -1 to receive from"),
    ({"streams": [["RecvGrad", "SendActivation"], ["RecvActivation", "SendGrad"]], "microbatches": 1},
     "the streams deadlock"),
    ({"streams": lambda s: ds_streams(2, 4)[s], "microbatches": 4}, "give stages="),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "stages": 3}, "give one per stage"),
])
def test_bad_model_inputs_raise_with_what_to_fix(kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("durations_s", passes(1, 1))
    streams = kwargs.pop("streams")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate_pipeline(streams, **kwargs)


def test_asking_for_a_stage_outside_the_pipeline_says_which_exist() -> None:
    waits = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 1))
    with pytest.raises(ValueError, match=r"stage 7 is outside the pipeline's 4 stages \(0..3\)"):
        waits.stage(7)
