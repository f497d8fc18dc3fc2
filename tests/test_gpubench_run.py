"""The one-GPU harvesting benchmark (gpubench): the smoke mode end to end (one shared run: the real agent, the real
fill processes, the stand-in MPS control program of tests/fakes), the CLI's bad flags, a run that cannot be measured,
the MPS membership check, the GPU checks script and the CUDA-graph presets."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.gpubench import one_thread

from bubbles.agent.ledger import BREAKDOWN
from gpubench.run import main as bench_main

__all__ = ["one_thread"]  # the autouse fixture, from helpers.gpubench

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------
# the smoke mode end to end, and the CLI's bad flags


@pytest.mark.parametrize("flags,message", [
    (["--device", "gpu"], "--device gpu: use cuda (an NVIDIA GPU), cuda:N, or cpu"),
    (["--device", "cpu", "--hidden", "-8"], "--hidden -8: must be >= 1"),
    (["--device", "cpu", "--stage", "7", "--stages", "4"], "--stage 7: the pipeline has stages 0..3"),
    (["--device", "cpu", "--jobs", "image-classification,video-gen"], "unknown fill job(s) video-gen"),
    (["--device", "cpu", "--isolations", "vm"], "unknown isolation(s) vm"),
    (["--device", "cpu", "--jobs", "batch-inference-graphs"], "--jobs batch-inference-graphs: replays CUDA graphs"),
    (["--device", "cpu", "--settle", "9", "--iterations", "6"], "--settle 9: must be >= 0 and below"),
    (["--device", "cpu", "--price-training", "0"], "--price-training 0"),
    (["--device", "cpu", "--fill-args", "image-classification=[1]"], "write JOB=JSON-object"),
    (["--device", "cpu", "--mps-control", "/no/such/mps-control"], "not an executable file"),
    (["--device", "cpu", "--slowdown-budget", "5"], "a fraction in (0, 1)"),
    (["--device", "cpu", "--wait-jitter", "-0.1"], "--wait-jitter -0.1: a coefficient of variation"),
    (["--device", "cpu", "--link-gb-per-s", "-5"], "--link-gb-per-s -5.0: a bandwidth >= 0"),
    (["--device", "cpu", "--stage-memory-gb", "-1"], "--stage-memory-gb -1.0: the GiB the training's stage holds"),
    (["--device", "cpu", "--tail-risk", "0.9"], "--tail-risk: $BUBBLES_TAIL_RISK='0.9': give the accepted chance"),
    (["--device", "cpu", "--modes", "off,replay"], "--modes off,replay: unknown mode(s) replay"),
    (["--device", "cpu", "--modes", "harvest,off"], "--modes harvest,off: give off (the baseline"),
    (["--device", "cpu", "--modes", "off"], "--modes off: give off (the baseline"),
    (["--device", "cpu", "--modes", "off,harvest,harvest"], "each once"),
])
def test_bad_benchmark_flags_exit_2_saying_what_to_do(flags: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(flags) == 2
    assert message in capsys.readouterr().err


def test_the_tail_risk_reaches_the_agents_environment_and_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.core import control
    from gpubench.run import _env, build_parser, resolve

    monkeypatch.setenv(control.TAIL_RISK_ENV, "0.2")
    args = build_parser().parse_args(["--device", "cpu"])
    assert resolve(args) == []
    assert args.tail_risk == 0.2  # the environment's, when the flag is not given
    args = build_parser().parse_args(["--device", "cpu", "--tail-risk", "0"])
    assert resolve(args) == []
    assert _env(args, None)[control.TAIL_RISK_ENV] == "0.0"  # the agent, and the fill processes it starts


def test_a_run_of_only_the_baseline_and_harvesting_reports_just_those(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_harvest.py"), "--device", "cpu",
                           "--modes", "off,harvest", "--jobs", "batch-inference", "--isolations", "contexts",
                           "--out", str(tmp_path / "report"), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["regime"] for r in report["regimes"]] == ["baseline", "harvesting (contexts)"]
    record = json.loads((tmp_path / "work" / "batch-inference-contexts" / "train.json").read_text())
    assert {p["mode"] for p in record["phases"]} == {"off", "harvest"}
    assert report["config"]["modes"] == "off,harvest"


def test_unparseable_benchmark_flag_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        bench_main(["--stages", "four"])
    assert exc.value.code == 2


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-harvest")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_harvest.py"), "--device", "cpu",
                           "--out", str(out / "report"), "--workdir", str(out / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"report": json.loads((out / "report" / "report.json").read_text()), "out": out / "report",
            "work": out / "work", "stdout": proc.stdout, "stderr": proc.stderr, "seconds": time.monotonic() - t0}


EXPECTED_REGIMES = {"baseline", "naive co-location", "MPS only", "harvesting (contexts)", "harvesting (MPS)"}
FIELDS = ("iteration_median_s", "iteration_p99_s", "slowdown", "slowdown_p99", "fill_samples_per_s",
          "recovered_tflops", "fill_share", "overruns", "overrun_p99_ms", "cost_savings", "goal_met")


def test_smoke_run_reports_every_regime_of_every_fill_job(smoke: dict[str, Any]) -> None:
    report = smoke["report"]
    assert report["config"]["smoke"] is True
    assert report["config"]["device"] == "cpu"
    assert all(r["ok"] for r in report["runs"]), report["runs"]
    by_job: dict[str, set[str]] = {}
    for r in report["regimes"]:
        by_job.setdefault(r["job"], set()).add(r["regime"])
        for field in FIELDS:
            assert field in r, (r["regime"], field)
        for field in ("iteration_median_s", "iteration_p99_s", "fill_samples_per_s", "recovered_tflops",
                      "fill_share", "overrun_p99_ms"):
            assert math.isfinite(r[field]), (r["regime"], field, r[field])
            assert r[field] >= 0, (r["regime"], field, r[field])
        if r["regime"] != "baseline":
            for field in ("slowdown", "slowdown_p99", "cost_savings"):
                assert r[field] is not None, (r["regime"], field)
                assert math.isfinite(r[field]), (r["regime"], field)
            assert isinstance(r["goal_met"], bool)
    assert by_job == {"image-classification": EXPECTED_REGIMES, "batch-inference": EXPECTED_REGIMES}
    assert report["prices"]["training_gpu_hour"] > 0
    assert report["prices"]["fill_gpu_hour"] > 0
    assert set(report["solo"]) == {"image-classification", "batch-inference"}
    assert all(s["samples_per_s"] > 0 for s in report["solo"].values())


def test_smoke_run_harvests_and_the_baseline_does_no_fill_work(smoke: dict[str, Any]) -> None:
    for r in smoke["report"]["regimes"]:
        if r["regime"] == "baseline":
            assert r["fill_steps"] == 0
        elif r["mode"] == "harvest":
            assert r["fill_steps"] > 0, r
            assert r["fill_share"] > 0, r
            # where the bubble time went: shares that add up to all of it, the filled one the run's own figure
            b = r["breakdown"]
            assert sum(b[k] for k, _ in BREAKDOWN) == pytest.approx(1.0, abs=1e-6), b
            assert min(b.values()) >= 0, b
            assert b["tail"] <= b["filled"] + 1e-9, b  # what steps past the predicted end filled is part of it
            assert b["filled"] == pytest.approx(r["fill_share"], abs=0.05), (b, r["fill_share"])
        else:  # naive co-location and MPS only: the fill job runs freely, so it always does work
            assert r["fill_steps"] > 0, r


def test_smoke_report_says_where_bubble_time_went_and_the_fill_jobs_step_times(smoke: dict[str, Any]) -> None:
    md = (smoke["out"] / "report.md").read_text()
    assert "Where the harvest phases' bubble time went" in md
    assert "| past_prediction | tail |" in md
    assert smoke["report"]["config"]["tail_risk"] == 0.1
    assert ", tail risk 0.1;" in md
    assert all(r["fill_step_profile"] and r["fill_step_profile"].startswith("step time")
               for r in smoke["report"]["runs"]), smoke["report"]["runs"]
    assert "timed at init: step time" in md
    assert "harvest steps by size: " in md
    assert "SM clock not recorded: a CPU run has no SM clock" in md
    for r in smoke["report"]["runs"]:  # every harvest step has one of its job's sizes (a quarter, a half, a whole)
        sizes = r["harvest_steps_by_size"]
        assert sizes, sizes
        assert sum(sizes.values()) > 0, sizes
        assert set(sizes) <= {"1", "2", "4", "8", "16"}, sizes


def test_smoke_run_labels_mps_as_the_stand_in(smoke: dict[str, Any]) -> None:
    report = smoke["report"]
    for r in report["regimes"]:
        if r["isolation"] == "mps":
            assert r["isolation_label"] == "stand-in MPS (no GPU)"
    mps_runs = [r for r in report["runs"] if r["isolation"] == "mps"]
    assert mps_runs and all(r["agent_isolation"]["mode"] == "mps" and r["agent_isolation"]["state"] == "ready"
                            for r in mps_runs)
    # The training was an MPS client at priority 0 (the stand-in ignores it, a real daemon would not).
    assert "stand-in MPS (no GPU)" in smoke["stdout"]
    # Nothing joins the stand-in: the report says membership was not verified, not that it was.
    assert all(r["mps_membership"].startswith("not verifiable") for r in mps_runs)


def test_mps_membership_needs_the_training_and_the_fill_job_on_one_server() -> None:
    from gpubench.run import mps_membership_problem

    assert mps_membership_problem({7: [100, 200]}, 100) is None
    late = mps_membership_problem({7: [200]}, 100)  # the training initialized CUDA before the daemon ran
    assert late is not None
    assert "training (pid 100) is not a client" in late
    assert "not MPS" in late
    alone = mps_membership_problem({7: [100], 8: [200]}, 100)
    assert alone is not None
    assert "fill job is not a client of the training's MPS server" in alone
    assert "no server" in (mps_membership_problem({}, 100) or "")


def test_smoke_run_prints_the_table_labelled_as_a_smoke_run(smoke: dict[str, Any]) -> None:
    out = smoke["stdout"]
    assert "SMOKE RUN on CPU" in out
    assert "Not a performance measurement" in out
    assert "| fill job | regime |" in out
    assert "cost savings S" in out
    assert "P_I $3.50/GPU-hour" in out
    assert (smoke["out"] / "report.md").read_text().strip() == out.strip()
    assert (smoke["out"] / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "estimated" in smoke["stderr"]  # the run time estimate comes up front


def test_smoke_run_losses_are_finite_and_the_modelled_bubbles_were_profiled(smoke: dict[str, Any]) -> None:
    for r in smoke["report"]["runs"]:
        assert r["losses_finite"]
        assert r["profiled_bubbles"] >= 1
        assert r["model"]["converged"]
        assert 0 < r["model"]["bubble_share"] < 1
        assert r["profiled_bubble_share"] > 0


def test_a_run_that_cannot_be_measured_exits_1_and_the_report_says_why(tmp_path: Path) -> None:
    # An MPS control program that answers nothing: the agent fails closed (no fill job starts), so the run
    # measures nothing; the script still writes its report, with the reason, and exits 1.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_harvest.py"), "--device", "cpu",
                           "--jobs", "batch-inference", "--isolations", "mps", "--mps-control", "/bin/false",
                           "--solo-seconds", "0.2", "--run-timeout-s", "12", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (run,) = report["runs"]
    assert run["ok"] is False
    assert run["error"]
    assert report["regimes"] == []
    assert "FAILED" in proc.stdout


def test_the_gpu_checks_script_says_what_is_missing_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    script = ROOT / "tools" / "gpu-checks.sh"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script), str(tmp_path / "a")], capture_output=True, text=True, env=bare,
                          timeout=60)
    assert proc.returncode == 2
    assert "nvidia-smi not found" in proc.stderr
    # a driver but a torch without CUDA (this machine's): the script names the interpreter to change
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    (fake / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", str(script), str(tmp_path / "b")], capture_output=True, text=True, timeout=60,
                          env={**bare, "PATH": f"{fake}:/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 2
    assert "has no CUDA torch" in proc.stderr
    assert "set PYTHON" in proc.stderr


def test_the_graphs_presets_are_the_eager_ones_with_cuda_graphs_on_a_gpu_and_not_run_by_default() -> None:
    from gpubench.run import DEFAULT_JOBS, JOBS

    assert set(DEFAULT_JOBS) == {"image-classification", "batch-inference"}
    for eager in DEFAULT_JOBS:
        graphs = JOBS[f"{eager}-graphs"]
        assert graphs.entry == JOBS[eager].entry
        assert graphs.args("cuda:0") == {**JOBS[eager].args("cuda:0"), "cuda_graphs": True}
        assert "cuda_graphs" not in JOBS[eager].args("cuda:0")
