"""The demo report's figures over rounds, from synthetic records: medians with distribution-free intervals, a verdict
that never presents drift as a speed-up, and a machine flagged as noisy. Pure: no training, no agent."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bubbles.core.api import FillMode
from bubbles.core.stats import median_interval
from bubbles.demo.orchestrate.phases import format_phases, iterations_by_round
from bubbles.demo.report import format_breakdown, format_summary, over_rounds, round_figures

MS = 1_000_000


def test_the_median_interval_is_the_order_statistics_with_enough_coverage() -> None:
    assert median_interval([5, 1, 4, 2, 3, 6]) == (1, 6)  # n = 6: [x1, x6] covers 1 - 2/64 = 96.9%
    assert median_interval(list(range(1, 10))) == (2, 8)  # n = 9: [x2, x8] covers 96.1%; [x3, x7] only 82%
    assert median_interval([1, 2, 3, 4, 5]) is None  # 5 values cannot give 95% (at most 93.75%)
    assert median_interval([1, 2, 3, 4, 5], confidence=0.9) == (1, 5)
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0], confidence=1.0)


def rank(rounds: int, iterations: int, time_of: Any, seed: int = 0) -> dict[str, Any]:
    """A rank record of ``rounds`` rounds of off/naive/harvest, ``iterations`` each, after 3 profiling iterations;
    ``time_of(round, mode, rng)`` gives an iteration's seconds."""
    rng = random.Random(seed)
    phases, times = ["profile"] * 3, [0.1] * 3
    for r in range(rounds):
        for mode in (FillMode.OFF, FillMode.NAIVE, FillMode.HARVEST):
            for _ in range(iterations):
                phases.append(mode.label)
                times.append(time_of(r, mode, rng))
    ends, t = [], 10**12
    for x in times:
        t += int(x * 1e9)
        ends.append(t)
    return {"phase": phases, "iteration_s": times, "iteration_end_ns": ends}


def test_rounds_follow_the_phase_plan_and_drop_the_settling_iterations() -> None:
    r = rank(3, 4, lambda *_: 0.1)
    rounds = iterations_by_round(r, settle=2)
    assert len(rounds) == 3 and all(list(x) == [FillMode.OFF, FillMode.NAIVE, FillMode.HARVEST] for x in rounds)
    assert rounds[0][FillMode.OFF] == [5, 6] and rounds[2][FillMode.HARVEST] == [3 + 12 * 2 + 8 + 2, 3 + 12 * 2 + 8 + 3]
    assert format_phases(4, 3).count("harvest") == 3


def test_each_round_is_measured_against_its_own_baseline_so_drift_between_rounds_cancels() -> None:
    # The machine gets 5% slower every round; harvesting costs 1%, naive 80%.
    factor = {FillMode.OFF: 1.0, FillMode.NAIVE: 1.8, FillMode.HARVEST: 1.01}
    r = rank(6, 6, lambda rnd, mode, rng: 0.1 * 1.05**rnd * factor[mode] * (1 + rng.uniform(-0.002, 0.002)))
    o = over_rounds(round_figures(r, None, settle=2))
    assert o["rounds"] == 6 and o["harvest_slowdown"]["median"] == pytest.approx(0.01, abs=0.004)
    lo, hi = o["harvest_slowdown"]["interval"]
    assert 0 < lo <= hi < 0.02 and o["harvest_verdict"].startswith("slower")
    assert o["naive_slowdown"]["median"] == pytest.approx(0.8, abs=0.01)
    assert o["noise"]["noisy"] is True  # 5% a round for 6 rounds: 28% between the first and the last


def test_a_negative_median_the_interval_does_not_support_is_reported_as_none_measurable() -> None:
    def noisy(_rnd: int, mode: FillMode, rng: random.Random) -> float:
        return 0.1 * (1.8 if mode is FillMode.NAIVE else 1.0) * (1 + rng.uniform(-0.03, 0.03))

    for seed in range(20):
        report = {"stages": 2, "microbatches": 8, "iterations": 0,
                  "bubble_ratio": {"measured": {}, "signalled": {}, "theory": 0.1}, "modes": {
                      name: {"main_iteration_s": None, "slowdown": None, "fill_steps": 0, "fill_flops": 0,
                             "filled_share": 0, "bubble_s": 0, "overruns": 0, "overrun_p99_ms": 0}
                      for name in ("baseline", "naive", "harvest")}, "guard": {}}
        o = over_rounds(round_figures(rank(6, 6, noisy, seed), None, settle=2))
        report["over_rounds"] = o
        text = format_summary(report)
        line = next(x for x in text.splitlines() if "harvesting slows the training" in x)
        lo, hi = o["harvest_slowdown"]["interval"]
        if lo < 0 < hi:
            assert "no measurable slowdown" in line
            if o["harvest_slowdown"]["median"] < 0:
                assert "none measurable;" in line
        assert "noisy" not in text  # +-3% per iteration is not a noisy machine


def test_a_round_where_harvesting_always_ran_faster_is_called_drift_not_a_result() -> None:
    def faster(_rnd: int, mode: FillMode, rng: random.Random) -> float:
        return 0.1 * {FillMode.OFF: 1.0, FillMode.NAIVE: 1.8, FillMode.HARVEST: 0.9}[mode]

    o = over_rounds(round_figures(rank(6, 6, faster), None, settle=2))
    assert o["harvest_verdict"].startswith("inconclusive") and "drifted" in o["harvest_verdict"]
    short = over_rounds(round_figures(rank(3, 6, faster), None, settle=2))
    assert short["harvest_slowdown"]["interval"] is None and "too few" in short["harvest_verdict"]


def test_the_filled_share_per_round_comes_from_the_agents_records_of_that_round() -> None:
    r = rank(6, 6, lambda *_: 0.1)
    rounds = iterations_by_round(r, settle=2)
    bubbles, steps = [], []
    for k, rd in enumerate(rounds):
        for i in rd[FillMode.HARVEST]:
            start = r["iteration_end_ns"][i] - 50 * MS
            bubbles.append({"stage": 0, "start_ns": start, "end_ns": start + 10 * MS, "mode": "harvest",
                            "predicted_end_ns": start + 10 * MS, "share": 1.0, "guard_paused": False, "job": "fj",
                            "step_s": 0.001})
            filled = (k + 1) * MS  # round k fills k+1 ms of each 10 ms bubble
            steps.append({"stage": 0, "start_ns": start, "end_ns": start + filled, "mode": "harvest"})
    figs = round_figures(r, {"bubbles": bubbles, "steps": steps}, settle=2)
    assert [round(f["harvest_filled_share"], 3) for f in figs] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    o = over_rounds(figs)
    assert o["harvest_filled_share"]["median"] == pytest.approx(0.35)
    assert o["harvest_filled_share"]["interval"] == pytest.approx((0.1, 0.6))


def test_other_processes_taking_the_cpu_make_the_report_say_the_machine_was_noisy() -> None:
    from bubbles.demo.report import build_report, machine_load

    load = machine_load(busy_s=90.0, own_cpu_s=50.0, wall_s=50.0, cpus=2)
    assert load["other_cpu_share"] == pytest.approx(0.4)
    assert machine_load(busy_s=10.0, own_cpu_s=12.0, wall_s=10.0, cpus=2)["other_cpu_share"] == 0.0

    def steady(_rnd: int, mode: FillMode, _rng: random.Random) -> float:
        return 0.1 * (1.8 if mode is FillMode.NAIVE else 1.0)

    r = rank(6, 6, steady)
    r.update(stage=0, stages=2, microbatches=8, losses=["0x1p+0"], cycle=None)
    quiet = build_report([r], None, machine=machine_load(52.0, 50.0, 50.0, 2))
    assert quiet["over_rounds"]["noise"]["noisy"] is False and "noisy" not in format_summary(quiet)
    busy = build_report([r], None, machine=load)
    assert busy["over_rounds"]["noise"]["noisy"] is True
    assert "other processes took 40% of its CPU time" in format_summary(busy)


def test_the_breakdown_line_says_what_the_tails_steps_filled_and_overran() -> None:
    base = {"filled": 0.4, "latency": 0.1, "too_short": 0.2, "past_prediction": 0.3, "bubble_s": 1.0,
            "overrun_s": 0.02, "tail_s": 0.0, "tail_overrun_s": 0.0}
    assert "tail" not in format_breakdown(base)  # no step the prediction refused: nothing to say
    line = format_breakdown({**base, "tail_s": 0.05, "tail_overrun_s": 0.004})
    assert "filled 40.0%" in line and "past the predicted end 30.0%" in line
    assert "steps the prediction did not allow, started on the tail's risk, filled 5.0% and overran by 4.0 ms" in line
    # A tail step that filled nothing but overran (it started as its bubble ended) is still reported.
    assert "filled 0.0% and overran by 7.8 ms" in format_breakdown({**base, "tail_overrun_s": 0.0078})
