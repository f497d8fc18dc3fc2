"""A fill job's plan (bubbles.agent.core.planning): the steps per iteration it states, its comparison with what ran,
and why they differ where they do by more than the stated factor; through the core with a fake clock, and the
watch alone for each reason. The rate model itself: tests/test_plan.py; on real processes: tests/test_agent.py."""

from __future__ import annotations

import itertools

import pytest
from helpers.agent_core import MS, armed, gpu, line, make_core

from bubbles.agent.core import PLAN_FACTOR, PLAN_SLACK_STEPS, AgentCore, JobRecord, PlanWatch, within_factor
from bubbles.agent.core.planning import PLAN_CHECK_ITERATIONS, PLAN_MIN_ITERATIONS
from bubbles.core import wire

SEQ = itertools.count(1)


def test_the_stated_factor() -> None:
    assert PLAN_FACTOR == 2.0 and PLAN_SLACK_STEPS == 0.5
    assert within_factor(4.0, 2.0) and within_factor(4.0, 8.0) and not within_factor(4.0, 1.9)
    assert not within_factor(4.0, 8.1) and not within_factor(0.0, 1.0)
    assert within_factor(0.2, 0.6) and within_factor(0.0, 0.5)  # a few tenths of a step: no error worth a reason


def bubbles_with_steps(core: AgentCore, job: JobRecord, n: int, step_ms: float, per_bubble: int,
                       latency_ms: float = 0.2, predicted_ms: float = 5.0) -> None:
    """``n`` bubbles of stage 0 played through the core: START, the job's steps, END; 10 ms apart."""
    clock = core.clock
    for _ in range(n):
        seq, t0 = next(SEQ), clock.now  # type: ignore[attr-defined]
        core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, seq, t0, t0 + int(predicted_ms * MS)))
        start = t0 + int(latency_ms * MS)
        for _ in range(per_bubble):
            end = start + int(step_ms * MS)
            core.on_control_line(job, line("step", start_ns=start, end_ns=end, flops=1.0, bubble_seq=seq,
                                           signal_ns=t0, mode="harvest"))
            start = end
        core.on_datagram(gpu(0), wire.encode_bubble_end(0, 0, seq, t0 + int((predicted_ms + 0.5) * MS)))
        clock.now += 10 * MS  # type: ignore[attr-defined]


def plan_events(core: AgentCore) -> list[str]:
    return [e["message"] for e in core.events if e["kind"] == "plan"]


def test_the_plan_is_stated_compared_with_what_ran_and_made_again_with_what_was_measured() -> None:
    core, _, _ = make_core()
    job = armed(core)  # step_time 1ms in its spec; one 5 ms bubble per iteration
    # Stated at admission, from the spec: steps start at 0, 1, 2, 3, 4 ms of the 5 ms predicted (no latency known).
    (stated,) = plan_events(core)
    assert stated.startswith("planned: 5.00 fill steps per iteration; 1 of 1 bubbles' predicted lengths fit a first "
                             "step of 1.00 ms") and "(step time from the spec)" in stated
    assert core.stats()["jobs"][0]["plan_steps_per_iteration"] == 5.0
    assert core.stats()["jobs"][0]["ran_steps_per_iteration"] is None
    # The steps take 2.4 ms, not 1: two per bubble ran. Compared once enough iterations ran, not before.
    bubbles_with_steps(core, job, PLAN_MIN_ITERATIONS - 1, step_ms=2.4, per_bubble=2)
    assert len(plan_events(core)) == 1
    bubbles_with_steps(core, job, 1, step_ms=2.4, per_bubble=2)
    compared, replanned = plan_events(core)[1:]
    assert compared.startswith("planned 5.00 fill steps per iteration, ran 2.00 (x0.40) over 8 iterations: off by "
                               "more than 2x: step time: ")
    assert "2.40 ms measured vs 1.00 ms in the spec" in compared
    assert replanned == "re-planned: 2.00 fill steps per iteration (was 5.00), with step times measured in its bubbles"
    st = core.stats()["jobs"][0]
    assert (st["plan_steps_per_iteration"], st["ran_steps_per_iteration"], st["plan_ratio"]) == (5.0, 2.0, 0.4)
    assert st["plan_reason"].startswith("step time: ") and st["plan_basis"] == "spec"
    # The plan made with what was measured holds: said once, as the verdict changed.
    bubbles_with_steps(core, job, PLAN_CHECK_ITERATIONS, step_ms=2.4, per_bubble=2)
    assert plan_events(core)[-1] == "planned 2.00 fill steps per iteration, ran 2.00 (x1.00) over 16 iterations: " \
                                    "within 2x"
    st = core.stats()["jobs"][0]
    assert (st["plan_ratio"], st["plan_reason"], st["plan_basis"]) == (1.0, "", "measured")
    bubbles_with_steps(core, job, PLAN_CHECK_ITERATIONS, step_ms=2.4, per_bubble=2)
    assert len(plan_events(core)) == 4  # the same verdict is not said again


def test_a_job_without_a_step_time_is_planned_when_its_runtime_reports_one() -> None:
    core, _, _ = make_core()
    job = armed(core, step_time=None)  # type: ignore[arg-type]
    assert plan_events(core) == [] and core.stats()["jobs"][0]["plan_steps_per_iteration"] is None
    core.on_control_line(job, line("profile", step_s=0.002, sizes=[]))
    (stated,) = plan_events(core)
    assert stated.startswith("planned: 2.00 fill steps per iteration") and "(step time from the profile)" in stated


# -- the watch alone: each reason --------------------------------------------------------------------------------
def run(w: PlanWatch, n: int, steps_ms: list[float], *, predicted_ms: float = 5.0, latency_ms: float = 0.2,
        offered: bool = True, length_ms: float | None = None, tail_from: int = 99, slots: int = 1) -> None:
    """``n`` bubbles as the watch sees them: each with steps of ``steps_ms`` (the ``tail_from``-th on past the
    predicted end), lasting ``length_ms`` (default: past the prediction)."""
    for _ in range(n):
        seq, t0 = next(SEQ), next(SEQ) * 100 * int(MS)
        start = t0 + int(latency_ms * MS)
        for i, d in enumerate(steps_ms if offered else []):
            w.step(seq, None, start, start + int(d * MS), t0, tail=i >= tail_from)
            start += int(d * MS)
        length = length_ms if length_ms is not None else predicted_ms + 0.5
        w.bubble(seq, int(predicted_ms * MS), int(length * MS), offered, 1.0, slots)


def planned(step_s: float = 0.001, predicted_ms: float = 5.0, slots: int = 1) -> PlanWatch:
    w = PlanWatch(step_s)
    assert w.make(tuple((predicted_ms * 1e-3,) for _ in range(slots)), 0.0) is not None
    return w


def check(w: PlanWatch, predicted_ms: float = 5.0, slots: int = 1) -> tuple[float, float, str]:
    chk = w.check(tuple((predicted_ms * 1e-3,) for _ in range(slots)), 0.0, slots)
    assert chk is not None
    return chk.planned, chk.ran, chk.reason


def test_reason_the_guard_withheld_bubbles() -> None:
    w = planned()
    run(w, 8, [1.0] * 4)
    run(w, 24, [], offered=False)  # the guard paused fill work: the job disarmed
    planned_, ran, reason = check(w)
    assert (planned_, ran) == (5.0, 1.0)
    assert reason == "guard withheld: the slowdown guard paused fill work in 75% of the job's bubbles and gave it " \
                     "100% of the others"


def test_reason_bubbles_ended_before_their_predicted_end() -> None:
    w = planned()
    run(w, 16, [1.0], length_ms=1.5)  # each ended 1.5 ms in, long before the 5 ms predicted
    _, ran, reason = check(w)
    assert ran == 1.0 and reason == "bubbles shorter than predicted: 100% of the job's bubbles ended before their " \
                                    "predicted end"


def test_reason_no_bubble_fits_a_first_step() -> None:
    w = planned()
    run(w, 16, [6.0], latency_ms=0.0)  # one 6 ms step a bubble ran: its gate learnt since, none fits
    planned_, _, reason = check(w)
    assert planned_ == 5.0
    assert reason.startswith("no bubble fits a first step: one needs 6.00 ms of a bubble's predicted length (its gate "
                             "after 0.00 ms of signal latency), the longest is 5.00 ms")


def test_reason_steps_past_the_predicted_end() -> None:
    w = planned(step_s=0.004, predicted_ms=5.0)  # one 4 ms step fits the 5 ms predicted
    run(w, 16, [4.0, 1.0, 1.0, 1.0, 1.0], tail_from=1)  # and four more, on the tail risk's word
    planned_, ran, reason = check(w)
    assert (planned_, ran) == (1.0, 5.0)
    assert reason == "steps past the predicted end: 64 of the 80 steps that ran started after their bubble's " \
                     "predicted end (the fill job's tail risk), which the plan does not count"


def test_reason_the_bubbles_predicted_lengths_moved() -> None:
    w = planned(predicted_ms=10.0)  # planned with 10 ms bubbles: ten 1 ms steps
    run(w, 16, [1.0, 1.0], predicted_ms=2.0, latency_ms=0.0)  # the hook now predicts 2 ms
    planned_, ran, reason = check(w, predicted_ms=2.0)
    assert (planned_, ran) == (10.0, 2.0)
    assert reason == "bubbles shorter than predicted: their predicted lengths sum to 2.00 ms per iteration now, " \
                     "10.00 ms when planned"


def test_reason_the_signal_latency() -> None:
    w = planned(step_s=0.002, predicted_ms=4.0)  # two 2 ms steps in 4 ms, with no latency
    run(w, 16, [2.0], predicted_ms=4.0, latency_ms=1.5)  # the first starts 1.5 ms late: one fits
    planned_, ran, reason = check(w, predicted_ms=4.0)
    assert (planned_, ran) == (2.0, 1.0) and reason == ""  # within the factor: no reason
    w = planned(step_s=0.001, predicted_ms=4.0)
    run(w, 16, [1.0] * 1, predicted_ms=4.0, latency_ms=2.9)  # four planned, one ran: 2.9 ms of latency
    planned_, ran, reason = check(w, predicted_ms=4.0)
    assert (planned_, ran) == (4.0, 1.0)
    assert reason == "signal latency: a bubble's first step started 2.90 ms after its signal, 0.00 ms planned"


def test_within_the_factor_there_is_no_reason_and_the_window_is_whole_iterations() -> None:
    w = planned(predicted_ms=2.0, slots=3)  # three 2 ms bubbles an iteration: 2 steps each, 6 an iteration
    run(w, 3 * 16, [1.0, 1.0, 1.0, 1.0], predicted_ms=2.0, slots=3, latency_ms=0.0)  # twice that: the factor's edge
    planned_, ran, reason = check(w, predicted_ms=2.0, slots=3)
    assert (planned_, ran, reason) == (6.0, 12.0, "")
    assert PlanWatch(0.001).check(((0.005,),), 0.0, 1) is None  # no comparison without a window
    assert PlanWatch(None).make(((0.005,),), 0.0) is None  # nor a plan without a step time


def test_reason_steps_too_slow_though_too_few_of_each_size_ran_to_measure_it() -> None:
    w = PlanWatch(None)
    w.reported_times(0.001, [[1, 0.001], [2, 0.001], [4, 0.001]])  # the profile at init: 1 ms, whatever the size
    assert w.make(((0.005,),), 0.0) is not None and w.planned is not None
    assert w.planned.steps_per_iteration == 5.0  # size 4 each time, from 0 to 4 ms
    for i, size in enumerate([4, 2, 1, 4, 2, 1, 4, 2] + [None] * 8):  # one 8 ms step every other bubble at first
        seq = next(SEQ)
        if size is not None and i % 2 == 0:
            w.step(seq, size, 10 * seq, 10 * seq + 8_000_000, 10 * seq, tail=False)
        w.bubble(seq, 5_000_000, 5_500_000, True, 1.0, 1)
    planned_, ran, reason = check(w)
    assert (planned_, ran) == (5.0, 0.25)
    assert reason == "step time: the 4 steps that ran took 8.00 ms on average, at most 1.00 ms in the fill job's " \
                     "profile at init (too few of each size ran to measure it apart)"


def test_a_first_step_time_reported_far_below_the_measured_one_is_the_runtime_forgetting_and_the_plan_follows() -> None:
    """The runtime's measured gate forgot its slower half (StepGates.refused) and said so with a profile report of
    its median: the plan drops the same slow durations, or it would keep planning 0 steps with what no longer gates
    the job. A report near the measured 90th percentile (the runtime's usual one) keeps them."""
    w = planned(step_s=0.001, predicted_ms=5.0)
    run(w, 28, [1.0])
    run(w, 4, [9.0])  # a busy spell: the first steps' 90th percentile past the 5 ms bubble
    times = w.step_times()
    assert times is not None and times[0][0].first_gate_s > 0.005
    w.reported_times(0.0085, [])  # about the 90th percentile: nothing forgotten
    times = w.step_times()
    assert times is not None and times[0][0].first_gate_s > 0.005
    w.reported_times(0.001, [])  # the median: the runtime forgot its slower half
    times = w.step_times()
    assert times is not None and times[0][0].first_gate_s == pytest.approx(0.001)
    assert w.make(((0.005,),), 0.0) is not None and w.planned is not None and w.planned.steps_per_iteration > 0
