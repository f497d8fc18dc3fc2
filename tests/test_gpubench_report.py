"""The one-GPU harvesting benchmark (gpubench): the report's formulas (FreeRide's I and S), each regime against its
run's baseline, per round with an interval over rounds, and a failed run reported with its reason."""

from __future__ import annotations

import pytest

from gpubench.report import cost_savings, regimes_of_run

# ---------------------------------------------------------------------------------------------------
# the report's formulas


def test_cost_savings_follow_freeride_s_definition() -> None:
    # No slowdown, fill work at the solo rate, same prices: the side task's whole dedicated-GPU cost is saved.
    assert cost_savings(t_no_s=1.0, t_with_s=1.0, fill_per_s=50, solo_per_s=50, price_training=2,
                        price_fill=2) == pytest.approx(1.0)
    # 10% slower and no fill work: a 10% cost increase.
    assert cost_savings(t_no_s=1.0, t_with_s=1.1, fill_per_s=0, solo_per_s=50, price_training=2,
                        price_fill=2) == pytest.approx(-0.1)
    # FreeRide's numbers: (P_II W / Th_II - P_I dT) / (P_I T_no)
    s = cost_savings(t_no_s=2.0, t_with_s=2.02, fill_per_s=10, solo_per_s=40, price_training=3.96, price_fill=0.18)
    assert s == pytest.approx((0.18 * 10 * 2.02 / 40 - 3.96 * 0.02) / (3.96 * 2.0))
    assert cost_savings(t_no_s=1.0, t_with_s=1.0, fill_per_s=1, solo_per_s=0, price_training=1,
                        price_fill=1) is None


def test_regimes_of_a_run_compare_each_mode_with_the_same_run_s_baseline() -> None:
    phases = ["profile"] * 2 + ["off"] * 4 + ["naive"] * 4 + ["harvest"] * 4
    times = [0.2, 0.2, *(0.9, 0.9, 1.0, 1.0), *(0.9, 0.9, 2.0, 2.0), *(0.9, 0.9, 1.005, 1.005)]
    record = {"phase": phases, "iteration_s": times, "phases": [
        {"mode": "off", "start_ns": 0, "end_ns": 4 * 10**9}, {"mode": "naive", "start_ns": 0, "end_ns": 8 * 10**9},
        {"mode": "harvest", "start_ns": 0, "end_ns": 4 * 10**9}]}
    stats = {"modes": {"naive": {"fill_steps": 80, "fill_flops": 8e12, "bubble_s": 1.0, "filled_s": 0.9},
                       "harvest": {"fill_steps": 40, "fill_flops": 4e12, "bubble_s": 1.0, "filled_s": 0.7,
                                   "overruns": 2, "overrun_p99_ms": 0.4}}}
    run = {"job": "j", "isolation": "contexts", "training": record, "agent_stats": stats, "samples_per_step": 5}
    got = {r["regime"]: r for r in regimes_of_run(run, {"j": {"samples_per_s": 100.0}}, settle=2,
                                                    price_training=1.0, price_fill=1.0)}
    assert set(got) == {"baseline", "naive co-location", "harvesting (contexts)"}
    assert got["naive co-location"]["slowdown"] == pytest.approx(1.0)
    assert got["naive co-location"]["recovered_tflops"] == pytest.approx(1.0)  # 8e12 FLOPs in 8 s
    assert got["naive co-location"]["fill_samples_per_s"] == pytest.approx(50.0)
    harvest = got["harvesting (contexts)"]
    assert harvest["slowdown"] == pytest.approx(0.005)
    assert harvest["fill_share"] == pytest.approx(0.7)
    # The work in the bubbles against the job alone in as much time: 200 samples, 100/s alone, 1 s of bubbles.
    assert harvest["fill_work_share"] == pytest.approx(200 / (100.0 * 1.0))
    assert got["naive co-location"]["fill_work_share"] is None  # naive steps are not bubble work
    assert harvest["goal_met"] is True
    assert harvest["overruns"] == 2
    assert harvest["cost_savings"] == pytest.approx((50 * 1.005 / 100 - 0.005) / 1.0)
    assert got["naive co-location"]["goal_met"] is False


def test_each_regime_has_its_slowdown_and_fill_share_per_round_with_an_interval_over_rounds() -> None:
    from gpubench.report import build_report, format_table

    phases: list[str] = []
    times: list[float] = []
    phase_records = []
    bubbles, steps = [], []
    harvest_slow = [0.01, -0.02, 0.03, 0.0, 0.02, 0.04]  # each round's harvest against that round's baseline
    t = 0
    for k, h in enumerate(harvest_slow):
        base = 1.0 + 0.1 * k  # the machine drifts from round to round: each round has its own baseline
        for mode, it in (("off", base), ("naive", 2 * base), ("harvest", base * (1 + h))):
            phases += [mode] * 3
            times += [it] * 3
            phase_records.append({"mode": mode, "start_ns": t, "end_ns": t + 10**9})
            if mode == "harvest":  # a bubble of 10 ms, half filled in round k ... plus k ms
                bubbles.append({"stage": 0, "mode": "harvest", "start_ns": t + 1000, "end_ns": t + 1000 + 10**7,
                                "predicted_end_ns": t + 1000 + 10**7, "job": "j", "share": 1.0, "step_s": 0.001,
                                "guard_paused": False})
                steps.append({"stage": 0, "mode": "harvest", "start_ns": t + 1000,
                              "end_ns": t + 1000 + (5 + k) * 10**6})
            t += 10**9
    record = {"phase": phases, "iteration_s": times, "phases": phase_records}
    stats = {"modes": {"harvest": {"bubble_s": 0.06, "filled_s": 0.045}}, "bubbles": bubbles, "steps": steps}
    run = {"job": "j", "isolation": "contexts", "training": record, "agent_stats": stats, "samples_per_step": 1}
    got = {r["regime"]: r for r in regimes_of_run(run, {}, settle=0, price_training=1.0, price_fill=1.0)}
    harvest = got["harvesting (contexts)"]
    assert harvest["slowdown_rounds"] == pytest.approx(harvest_slow)
    assert harvest["slowdown_interval"] == pytest.approx((-0.02, 0.04))  # 6 rounds: the extremes, 96.9%
    assert harvest["fill_share_rounds"] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert harvest["fill_share_interval"] == pytest.approx((0.5, 1.0))
    assert got["naive co-location"]["slowdown_rounds"] == pytest.approx([1.0] * 6)
    report = build_report(config={"device": "cpu", "repeats": 6}, solo={}, runs=[run], settle=0,
                          price_training=1.0, price_fill=1.0)
    assert "[-2.0%, +4.0%]" in format_table(report)
    few = regimes_of_run({**run, "training": {**record, "phase": phases[:9 * 3], "iteration_s": times[:9 * 3]}},
                         {}, settle=0, price_training=1.0, price_fill=1.0)
    table = format_table({**report, "regimes": few})
    assert "— (3 rounds; 6 needed: --repeats)" in table


def test_a_failed_run_is_reported_as_failed_with_its_reason() -> None:
    from gpubench.report import build_report, format_table

    failed = {"job": "batch-inference", "isolation": "mps", "isolation_label": "MPS",
              "error": "nvidia-cuda-mps-control is not on PATH"}
    report = build_report(config={"device": "cuda:0", "smoke": False}, solo={}, runs=[failed], settle=2,
                          price_training=3.5, price_fill=3.5)
    assert report["runs"] == [{"job": "batch-inference", "isolation": "mps", "isolation_label": "MPS",
                               "ok": False, "error": "nvidia-cuda-mps-control is not on PATH"}]
    assert report["regimes"] == []
    table = format_table(report)
    assert "run batch-inference / MPS: FAILED: nvidia-cuda-mps-control is not on PATH" in table
    assert "SMOKE" not in table
