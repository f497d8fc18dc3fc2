"""`bubbles demo` end to end: real DeepSpeed on CPU, the real agent, real fill processes.

One demo run is shared by the tests of this module (a launch costs tens of seconds on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bubbles.cli import main
from bubbles.core.cycle import theoretical_bubble_ratio
from bubbles.training.hook.collectives import is_collective

COMPUTE = {"ForwardPass", "BackwardPass", "OptimizerStep"}
# A fill step that was running when its bubble ended early keeps the core for about one step (0.5-2 ms here) plus
# one scheduler slice (1.4 ms on this kernel) before the training gets it back: beyond this it is "late".
OVERLAP_TOLERANCE_MS = 4.0


@pytest.mark.parametrize("flags,message", [
    (["--stages", "9"], "2 to 4 stages"),
    (["--iterations", "1"], "--iterations 1"),
    (["--slowdown-budget", "2"], "fraction in (0, 1)"),
    (["--microbatches", "0"], "--microbatches 0"),
    (["--grace-ms", "-5"], "--grace-ms"),
    (["--metrics-port", "70000"], "--metrics-port 70000: give a TCP port"),
    (["--gradient-clipping", "-1"], "--gradient-clipping -1.0: give a max gradient norm >= 0"),
    (["--gradient-clipping", "nan"], "--gradient-clipping nan"),
    (["--tp", "0"], "--tp 0: give 1 to 4 tensor-parallel ranks per stage"),
    (["--stages", "4", "--tp", "3"], "--stages 4 x --tp 3 is 12 training processes"),
])
def test_bad_flags_are_rejected_with_what_to_do(flags: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *flags]) == 2
    assert message in capsys.readouterr().err


def test_unparseable_flag_value_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--stages", "two"])
    assert exc.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("demo")
    report, timeline = work / "report.json", work / "timeline.png"
    proc = subprocess.run(
        [sys.executable, "-m", "bubbles.cli", "demo", "--stages", "2", "--iterations", "8", "--repeats", "1",
         "--report", str(report), "--timeline", str(timeline), "--workdir", str(work / "run")],
        capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted((work / "run" / "ranks").glob("rank-*.json"))]
    stats = json.loads((work / "run" / "agent-stats.json").read_text())
    return {"report": json.loads(report.read_text()), "timeline": timeline, "ranks": ranks, "stats": stats,
            "stdout": proc.stdout}


@pytest.mark.deepspeed
def test_report_has_the_documented_fields(demo_run: dict[str, Any]) -> None:
    r = demo_run["report"]
    assert r["stages"] == 2 and r["microbatches"] == 8 and r["iterations"] > 0
    assert set(r["bubble_ratio"]["measured"]) == {"0", "1"}
    assert r["bubble_ratio"]["theory"] == pytest.approx(theoretical_bubble_ratio(2, 8))
    for mode in ("baseline", "naive", "harvest"):
        m = r["modes"][mode]
        for field in ("main_iteration_s", "slowdown", "fill_steps", "fill_flops", "bubble_s", "filled_s",
                      "overruns", "overrun_p99_ms"):
            assert field in m, (mode, field)
    assert "slowdown guard" in demo_run["stdout"]


@pytest.mark.deepspeed
def test_every_stage_has_bubbles_and_the_pipeline_at_least_the_ideal_share(demo_run: dict[str, Any]) -> None:
    # (p-1)/(m+p-1) is the share of an ideal pipeline of equal stages. The demo's stages run real CPU
    # compute on a shared 2-core machine, so one can be the bottleneck in a run: it idles less than the
    # ideal and its neighbour more. The measured share is each wait's median summed, over an iteration that
    # also holds the optimizer step and host overheads the ideal formula leaves out, so the pipeline's mean can
    # fall a little below the ideal (seen: 10.7% against 11.1% in a clean-clone run on 2026-11-23): the check
    # allows a fifth (per-stage checks on equal stages are in test_hook_deepspeed).
    r = demo_run["report"]
    ratios = r["bubble_ratio"]["measured"]
    for stage, ratio in ratios.items():
        assert ratio is not None and ratio > 0, f"stage {stage} found no bubble cycle"
    mean = sum(ratios.values()) / len(ratios)
    assert mean >= 0.8 * r["bubble_ratio"]["theory"], (ratios, r["bubble_ratio"]["theory"])


@pytest.mark.deepspeed
def test_harvest_does_fill_work_and_baseline_does_none(demo_run: dict[str, Any]) -> None:
    modes = demo_run["report"]["modes"]
    assert modes["baseline"]["fill_steps"] == 0
    assert modes["harvest"]["fill_steps"] > 0 and modes["harvest"]["fill_flops"] > 0
    assert modes["harvest"]["filled_s"] > 0


@pytest.mark.deepspeed
def test_every_harvesting_bubble_millisecond_is_accounted_for(demo_run: dict[str, Any]) -> None:
    r = demo_run["report"]
    d, harvest = r["breakdown"]["all"], r["modes"]["harvest"]
    parts = ("filled", "guard", "no_job", "latency", "too_short", "past_prediction")
    assert sum(d[k] for k in parts) == pytest.approx(d["bubble_s"], rel=1e-6)
    # The same bubbles and steps the agent's ledger totals: the filled time agrees (a step in no recorded bubble's
    # start range is the only difference) and nothing is left unexplained.
    assert d["bubble_s"] == pytest.approx(harvest["bubble_s"], rel=1e-6)
    assert d["filled"] == pytest.approx(harvest["filled_s"], rel=0.05, abs=1e-3)
    assert d["filled"] > 0 and set(r["breakdown"]["by_stage"]) == {"0", "1"}
    assert "where the harvesting bubbles' time went: filled" in demo_run["stdout"]


@pytest.mark.deepspeed
def test_harvesting_costs_the_training_less_than_naive_colocation(demo_run: dict[str, Any]) -> None:
    modes = demo_run["report"]["modes"]
    assert modes["harvest"]["slowdown"] < modes["naive"]["slowdown"]


def _minus(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` with every part that a hole covers cut out (both sorted by start)."""
    out = []
    for s, e in spans:
        for hs, he in holes:
            if he <= s or hs >= e:
                continue
            if hs > s:
                out.append((s, hs))
            s = max(s, he)
        if s < e:
            out.append((s, e))
    return out


def test_a_wait_inside_an_instruction_is_cut_out_of_its_compute() -> None:
    assert _minus([(0, 10), (20, 30)], [(4, 6), (25, 40)]) == [(0, 4), (6, 10), (20, 25)]
    assert _minus([(0, 10)], []) == [(0, 10)] and _minus([(0, 10)], [(0, 10)]) == []


def _overlaps(ranks: list[dict[str, Any]], steps: list[dict[str, Any]],
              mode: str) -> tuple[list[tuple[float, bool]], float]:
    """Per fill step of ``mode`` over the traced iterations of that mode: (ms it overlapped its stage's compute,
    whether it started inside that compute); and the stages' compute time in those iterations, in ms."""
    out, compute_ms = [], 0.0
    for rank in ranks:
        trace, phase = rank.get("trace") or [], rank["phase"]
        compute = sorted((s, e) for it, name, s, e, _slot in trace if name in COMPUTE and phase[it] == mode)
        # OptimizerStep holds gradient clipping's all-reduce, a wait (and a bubble) of its own: not compute
        compute = _minus(compute, sorted((s, e) for it, name, s, e, _slot in trace
                                         if is_collective(name) and phase[it] == mode))
        if not compute:
            continue
        compute_ms += sum(e - s for s, e in compute) / 1e6
        lo, hi = compute[0][0], compute[-1][1]
        for st in steps:
            if st["stage"] != rank["stage"] or st["mode"] != mode or st["start_ns"] < lo or st["end_ns"] > hi:
                continue
            ov = sum(max(0, min(e, st["end_ns"]) - max(s, st["start_ns"])) for s, e in compute)
            inside = any(s <= st["start_ns"] < e for s, e in compute)
            out.append((ov / 1e6, inside))
    return out, compute_ms


@pytest.mark.deepspeed
def test_fill_steps_run_only_inside_bubbles(demo_run: dict[str, Any]) -> None:
    harvest, compute_ms = _overlaps(demo_run["ranks"], demo_run["stats"]["steps"], "harvest")
    naive, naive_compute_ms = _overlaps(demo_run["ranks"], demo_run["stats"]["steps"], "naive")
    assert len(harvest) >= 10, "too few traced harvesting steps to judge"
    # The agent starts a step only inside a bubble: none starts while the training computes (seen: 0 of 194 over
    # three runs on 2026-11-23; naive co-location starts about half of its steps there).
    started = sum(inside for _, inside in harvest)
    assert started <= max(1, len(harvest) // 20), f"{started} of {len(harvest)} harvesting steps started in compute"
    # A step that started in a bubble can run past its end: by up to a step, or longer when the OS preempted it
    # (timestamps are wall-clock; 2 cores, 4+ busy processes). What the training feels is the share of its compute
    # time that fill work overlapped, held against naive co-location in the same run: seen 0.3-1.0% against 90-92%
    # over three runs on 2026-11-23 (and about 1.5% in a CI run where 4 of 49 steps ran 4.6-7.4 ms past their
    # bubble). The training's slowdown itself is the benchmark's (docs/benchmarks.md).
    late = sorted(round(ov, 1) for ov, _ in harvest if ov > OVERLAP_TOLERANCE_MS)
    share = sum(ov for ov, _ in harvest) / compute_ms
    assert naive, "no traced naive steps to hold harvesting against"
    naive_share = sum(ov for ov, _ in naive) / naive_compute_ms
    assert sum(inside for _, inside in naive) > len(naive) / 4, "the measure does not see co-location"
    assert share < naive_share / 20, (f"harvesting overlapped {share:.2%} of its phase's compute against naive "
                                      f"co-location's {naive_share:.2%} ({len(late)} steps late by ms: {late})")


@pytest.mark.deepspeed
def test_timeline_is_a_png(demo_run: dict[str, Any]) -> None:
    data = Path(demo_run["timeline"]).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.fixture(scope="module")
def demo_tp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``bubbles demo --tp 2``, as the README gives it, shortened: 2 stages x 2 tensor-parallel ranks (4 processes),
    a fill job per GPU."""
    work = tmp_path_factory.mktemp("demo-tp")
    report = work / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bubbles.cli", "demo", "--tp", "2", "--iterations", "8", "--repeats", "1",
         "--report", str(report), "--workdir", str(work / "run")],
        capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"report": json.loads(report.read_text()), "stdout": proc.stdout,
            "stats": json.loads((work / "run" / "agent-stats.json").read_text())}


@pytest.mark.deepspeed
def test_the_tp_demo_fills_every_gpu_and_lists_each_with_its_bubbles(demo_tp_run: dict[str, Any]) -> None:
    r = demo_tp_run["report"]
    assert r["stages"] == 2 and r["ranks_per_stage"] == 2
    gpus = {(g["stage"], g["rank"]): g for g in r["gpus"]}
    assert sorted(gpus) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key, g in gpus.items():
        assert g["signalled"] and g["signalled"] > 0, (key, g)  # every rank's hook signalled its own bubbles
        assert g["bubble_s"] > 0 and g["filled_s"] > 0 and g["fill_steps"] > 0, (key, g)  # and every GPU was filled
        assert len(g["jobs"]) == 1, (key, g)  # one fill job per GPU: the agent spread each stage's two
    assert len({j for g in gpus.values() for j in g["jobs"]}) == 4
    assert set(r["bubble_ratio"]["measured"]) == {"0/rank-0", "0/rank-1", "1/rank-0", "1/rank-1"}
    assert r["losses_identical_across_stages"]
    table = demo_tp_run["stdout"][demo_tp_run["stdout"].index("GPU "):]
    assert all(f"stage {k}/rank-{r_}" in table for k in (0, 1) for r_ in (0, 1)), table
