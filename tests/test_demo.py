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
from bubbles.cycle import theoretical_bubble_ratio

COMPUTE = {"ForwardPass", "BackwardPass", "OptimizerStep"}
# A fill step that was running when its bubble ended early keeps the core for at most about one
# step (0.5-2 ms here) plus one scheduler slice (1.4 ms on this kernel) before the training gets it back.
OVERLAP_TOLERANCE_MS = 4.0


@pytest.mark.parametrize("flags,message", [
    (["--stages", "9"], "2 to 4 stages"),
    (["--iterations", "1"], "--iterations 1"),
    (["--slowdown-budget", "2"], "fraction in (0, 1)"),
    (["--microbatches", "0"], "--microbatches 0"),
    (["--grace-ms", "-5"], "--grace-ms"),
    (["--metrics-port", "70000"], "--metrics-port 70000: give a TCP port"),
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
def test_harvesting_costs_the_training_less_than_naive_colocation(demo_run: dict[str, Any]) -> None:
    modes = demo_run["report"]["modes"]
    assert modes["harvest"]["slowdown"] < modes["naive"]["slowdown"]


def _overlaps_ms(ranks: list[dict[str, Any]], steps: list[dict[str, Any]], mode: str) -> list[float]:
    """Per fill step of ``mode``: how long it overlapped its stage's compute, over the traced iterations."""
    out = []
    for rank in ranks:
        trace = rank.get("trace") or []
        compute = sorted((s, e) for _, name, s, e, _slot in trace if name in COMPUTE)
        if not compute:
            continue
        lo, hi = compute[0][0], compute[-1][1]
        for st in steps:
            if st["stage"] != rank["stage"] or st["mode"] != mode or st["start_ns"] < lo or st["end_ns"] > hi:
                continue
            ov = sum(max(0, min(e, st["end_ns"]) - max(s, st["start_ns"])) for s, e in compute)
            out.append(ov / 1e6)
    return out


@pytest.mark.deepspeed
def test_fill_steps_run_only_inside_bubbles(demo_run: dict[str, Any]) -> None:
    harvest = _overlaps_ms(demo_run["ranks"], demo_run["stats"]["steps"], "harvest")
    assert len(harvest) >= 10, "too few traced harvesting steps to judge"
    late = [ov for ov in harvest if ov > OVERLAP_TOLERANCE_MS]
    # Timestamps are wall-clock: a step that the OS preempted when the training woke up (its bubble ended
    # earlier than predicted) spans the training's compute without running during it. Allow that for at
    # most 1 step in 20.
    assert len(late) <= max(1, len(harvest) // 20), f"{len(late)} of {len(harvest)} steps overlapped compute: {late}"
    # The measure does see co-location: naive steps run through the training's compute.
    naive = _overlaps_ms(demo_run["ranks"], demo_run["stats"]["steps"], "naive")
    if naive:
        assert sum(ov > 0 for ov in naive) > len(naive) / 2


@pytest.mark.deepspeed
def test_timeline_is_a_png(demo_run: dict[str, Any]) -> None:
    data = Path(demo_run["timeline"]).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
