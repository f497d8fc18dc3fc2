"""The cluster simulator: bubble model vs PipeFill, trace reading/generation, work conservation, CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbles.cli import main as bubbles_main
from bubbles.core.api import WorkloadKind
from bubbles.core.cycle import theoretical_bubble_ratio
from bubbles.core.plan import Bubble
from bubbles.operator.simulator import (
    MainJob,
    generate_trace,
    load_profiles,
    read_alibaba,
    read_trace,
    simulate,
    summarize,
)
from bubbles.operator.simulator.profiles import parse_profiles
from bubbles.operator.simulator.trace import TRACE_MODEL_PATH, TraceError, TraceJob, load_trace_model, write_trace

FIXTURE = Path(__file__).parent / "fixtures" / "alibaba-excerpt.csv"
PROFILES = load_profiles()


@pytest.fixture(scope="module")
def tasks():
    kept, stats = read_alibaba(FIXTURE)
    assert stats.candidates > 100 and 0.7 < stats.share_kept < 0.95
    return kept


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 32), m=st.integers(1, 64), schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_bubble_ratio_is_the_pipeline_formula(p: int, m: int, schedule: str) -> None:
    j = MainJob(stages=p, microbatches=m, data_parallel=1, schedule=schedule, fill_fraction=1.0)
    assert j.bubble_ratio() == pytest.approx(theoretical_bubble_ratio(p, m))
    if schedule == "gpipe":
        assert j.fillable_ratio() == pytest.approx(j.bubble_ratio())
        cyc = j.cycle(p // 2)
        assert cyc.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    else:
        assert j.fillable_ratio() <= j.bubble_ratio() + 1e-12


def test_pipefill_physical_setting_is_about_65_percent() -> None:
    j = MainJob(stages=16, microbatches=8)
    assert j.bubble_ratio() == pytest.approx(15 / 23)
    assert abs(j.bubble_ratio() - 0.65) < 0.01
    # 1F1B fwd-bwd bubble from section 4.5, stage 0 of 16 with 8 micro-batches: 15*bwd + 8*fwd
    one = MainJob(stages=16, microbatches=8, schedule="1f1b")
    assert one.stage_bubbles_s(0) == pytest.approx((0.0, 15 * 0.08 + 8 * 0.04))
    assert len(j.executor_classes()) == 16 and sum(c.executors for c in j.executor_classes()) == 8192


def test_main_job_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="schedule 'pipedream' is not one of gpipe, 1f1b"):
        MainJob(schedule="pipedream")
    with pytest.raises(ValueError, match="fwd_s must be a number of seconds > 0"):
        MainJob(fwd_s=0)


def _jobs(tasks, n: int, hours: float = 4.0, seed: int = 1, **kw):
    return [
        t.to_fill_job(PROFILES) for t in generate_trace(tasks, PROFILES, jobs=n, hours=hours, seed=seed, **kw)
    ]


def test_generator_follows_pipefill(tasks) -> None:
    trace = generate_trace(tasks, PROFILES, jobs=500, hours=2.0, seed=3, deadline_share=0.2)
    assert len(trace) == 500
    assert all(0 <= t.arrival_s <= 2 * 3600 + 1 for t in trace)
    assert [t.arrival_s for t in trace] == sorted(t.arrival_s for t in trace)
    big = [t for t in trace if t.model in ("swin-large", "xlm-roberta-xl")]
    assert big and all(t.kind is WorkloadKind.BATCH_INFERENCE for t in big)
    small = [t for t in trace if t.model == "bert-base"]
    assert {t.kind for t in small} == {WorkloadKind.TRAINING, WorkloadKind.BATCH_INFERENCE}
    # No job is larger than 1 GPU-hour of isolated work.
    for t in trace:
        prof = PROFILES[(t.model, t.kind)]
        assert t.samples / prof.isolated_samples_per_s <= 3600 + 1
    assert 50 < sum(t.deadline_s is not None for t in trace) < 150


def test_a_generated_deadline_leaves_room_for_the_jobs_start_up(tasks) -> None:
    plain = generate_trace(tasks, PROFILES, jobs=50, hours=1.0, seed=4, deadline_share=1.0)
    slow = generate_trace(tasks, PROFILES, jobs=50, hours=1.0, seed=4, deadline_share=1.0, setup_s=120.0)
    assert [t.arrival_s for t in slow] == [t.arrival_s for t in plain]
    assert all(s.deadline_s == pytest.approx(p.deadline_s + 120.0) for s, p in zip(slow, plain, strict=True)
               if p.deadline_s is not None and s.deadline_s is not None)
    assert all(t.deadline_s is not None for t in slow)
    with pytest.raises(ValueError, match="setup_s must be >= 0"):
        generate_trace(tasks, PROFILES, jobs=5, hours=1.0, setup_s=-1.0)


def test_trace_round_trip_and_errors(tmp_path: Path, tasks) -> None:
    trace = generate_trace(tasks, PROFILES, jobs=20, hours=1.0, seed=0, deadline_share=0.5)
    p = tmp_path / "t.csv"
    write_trace(p, trace)
    back = read_trace(p, PROFILES)
    assert [(t.job_id, t.model, t.kind, t.samples) for t in back] == [
        (t.job_id, t.model, t.kind, t.samples) for t in trace
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,model,kind,samples\n0,bert-base,training,10\nsoon,bert-base,training,10\n")
    with pytest.raises(TraceError, match="line 3: arrival_s must be a number"):
        read_trace(bad, PROFILES)
    bad.write_text("arrival_s,model,kind,samples\n0,gpt-9,training,10\n")
    with pytest.raises(TraceError, match=r"no profile for model 'gpt-9'.*known: .*bert-base/training"):
        read_trace(bad, PROFILES)
    bad.write_text("arrival_s,model,kind,samples\n0,bert-base,pretraining,10\n")
    with pytest.raises(TraceError, match=r"line 2: kind must be one of training, batch-inference, got 'pretraining'"):
        read_trace(bad, PROFILES)
    bad.write_text("arrival,model\n1,x\n")
    with pytest.raises(TraceError, match="needs the columns arrival_s"):
        read_trace(bad, PROFILES)
    with pytest.raises(TraceError, match="not an Alibaba GPU trace"):
        read_alibaba(bad)
    bad.write_text("arrival_s,model,kind,steps,batch_size,deadline_s\n5,bert-base,training,3,8,1\n")
    with pytest.raises(TraceError, match="deadline_s 1 is before arrival_s 5"):
        read_trace(bad, PROFILES)


def test_profiles_file_errors() -> None:
    with pytest.raises(ValueError, match=r"models\[0\].kind must be one of training, batch-inference, got 'tuning'"):
        parse_profiles({"models": [{"model": "m", "kind": "tuning", "flops_per_sample": 1,
                                    "isolated_samples_per_s": 1, "configs": []}]})
    with pytest.raises(ValueError, match=r"models\[0\].configs\[0\].step_s must be a number > 0"):
        parse_profiles(
            {
                "models": [
                    {
                        "model": "m",
                        "kind": "training",
                        "flops_per_sample": 1,
                        "isolated_samples_per_s": 1,
                        "configs": [
                            {"name": "a", "batch_size": 1, "step_s": -1, "memory_bytes": 1, "nodes": 1}
                        ],
                    }
                ]
            }
        )


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 120), hours=st.floats(0.2, 6.0), seed=st.integers(0, 10))
def test_work_is_conserved(tasks, n: int, hours: float, seed: int) -> None:
    main = MainJob(stages=4, microbatches=4, data_parallel=2)
    jobs = _jobs(tasks, n, hours=4.0, seed=seed)
    res = simulate(main, jobs, "sjf", hours=hours)
    s = summarize(res)
    expected = 0.0
    for o in res.outcomes:
        if o.done:
            assert o.samples_done == o.job.samples
        assert 0 <= o.samples_done <= o.job.samples
        expected += o.samples_done * o.job.profile.flops_per_sample
    assert s["recovered_flops"] == pytest.approx(expected)
    assert 0 <= s["bubble_time_filled_share"] <= main.fill_fraction + 1e-9
    # No executor runs two jobs at once.
    by_exec: dict[int, list[tuple[float, float]]] = {}
    for o in res.outcomes:
        if o.placement is not None:
            by_exec.setdefault(o.placement.executor, []).append((o.placement.start_s, o.placement.end_s))
    for spans in by_exec.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(spans))


def test_a_jobs_setup_time_delays_its_completion_and_earns_no_work(tasks) -> None:
    """--init-s: each job holds its GPU that long before its first step. Drained, every job still does all of its
    work, each later; at a horizon, a job still in its setup there has done nothing."""
    main = MainJob(stages=4, microbatches=4, data_parallel=2)
    trace = generate_trace(tasks, PROFILES, jobs=40, hours=1.0, seed=2)
    plain = simulate(main, [t.to_fill_job(PROFILES) for t in trace], "fifo", hours=None)
    slow = simulate(main, [t.to_fill_job(PROFILES, setup_s=600.0) for t in trace], "fifo", hours=None)
    assert summarize(slow)["recovered_flops"] == pytest.approx(summarize(plain)["recovered_flops"])
    jct = {o.job.job_id: o.jct_s for o in plain.outcomes}
    assert all(o.done and o.jct_s >= jct[o.job.job_id] + 600.0 - 1e-6 for o in slow.outcomes)
    cut = simulate(main, [t.to_fill_job(PROFILES, setup_s=600.0) for t in trace], "fifo", hours=0.1)  # 360 s
    assert all(o.samples_done == 0 for o in cut.outcomes)
    assert summarize(cut)["recovered_flops"] == 0


def _hetero(main: MainJob):
    # Half the stages have little free memory (as early 1F1B stages do): jobs run unequally fast there.
    return [
        c
        if k % 2 == 0
        else dataclasses.replace(
            c, bubbles=tuple(Bubble(b.duration_s, int(1.5 * 2**30), b.label) for b in c.bubbles)
        )
        for k, c in enumerate(main.executor_classes())
    ]


def test_sjf_vs_makespan_as_in_pipefill_section_6_3(tasks) -> None:
    main = MainJob(stages=4, microbatches=4, data_parallel=4)
    classes = _hetero(main)

    def totals(n: int) -> dict[str, tuple[float, float]]:
        out = {}
        for policy in ("sjf", "makespan"):
            jct = mk = 0.0
            for seed in (1, 2, 3):
                s = summarize(simulate(main, _jobs(tasks, n, seed=seed), policy, hours=None, classes=classes))
                jct += s["jct_s"]["mean"]
                mk += s["makespan_s"]
            out[policy] = (jct, mk)
        return out

    low = totals(150)
    assert low["sjf"][0] < low["makespan"][0]  # SJF: lower mean JCT at low load
    high = totals(400)
    assert high["makespan"][1] < high["sjf"][1]  # makespan-minimizing: lower makespan at high load


def test_cli_runs_writes_report_and_plot(tmp_path: Path, capsys) -> None:
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    rc = bubbles_main(
        [
            "simulate",
            "--stages",
            "4",
            "--microbatches",
            "4",
            "--gpus",
            "16",
            "--hours",
            "2",
            "--alibaba",
            str(FIXTURE),
            "--jobs",
            "50",
            "--policy",
            "sjf",
            "--report",
            str(report),
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    doc = json.loads(report.read_text())
    assert doc["bubble_ratio"] == pytest.approx(3 / 7)
    assert {"recovered_tflops_per_gpu", "gpu_equivalents", "jct_s", "makespan_s"} <= set(
        doc["policies"]["sjf"]
    )
    assert plot.read_bytes()[:4] == b"\x89PNG" and len(doc["sweep"]) >= 2
    trace = tmp_path / "t.csv"
    write_trace(trace, [TraceJob("a", 0.0, "bert-base", WorkloadKind.TRAINING, 1000)])
    rc = bubbles_main(
        [
            "simulate",
            "--stages",
            "4",
            "--gpus",
            "8",
            "--trace",
            str(trace),
            "--policy",
            "fifo",
            "--policy",
            "makespan",
            "--plot",
            str(plot),
            "--hours",
            "1",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "fifo" in out and "makespan" in out and "bubble ratio" in out


def test_simulate_reports_its_progress_up_to_the_end(tasks) -> None:
    main = MainJob(stages=4, microbatches=4, data_parallel=2)
    for hours in (2.0, None):  # a fraction of the simulated time, or of the jobs when running until all are done
        seen: list[float] = []
        simulate(main, _jobs(tasks, 300, hours=2.0), "sjf", hours=hours, progress=seen.append)
        assert seen[-1] == 1.0 and len(seen) > 10 and seen == sorted(seen)


def test_a_long_run_shows_its_progress_and_its_sweep_ends_with_that_run(tmp_path: Path, capsys) -> None:
    report = tmp_path / "r.json"
    argv = ["simulate", "--stages", "4", "--gpus", "64", "--jobs", "1000", "--hours", "2", "--report", str(report),
            "--plot", str(tmp_path / "p.png")]
    assert bubbles_main(argv) == 0
    bars = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sjf ")]
    assert len(bars) >= 4 and "100.0%" in bars[-1]  # not a terminal: a line per quarter
    doc = json.loads(report.read_text())
    assert [s["gpus"] for s in doc["sweep"]] == [8, 16, 32, 64]
    assert doc["sweep"][-1]["recovered_tflops_per_gpu"] == doc["policies"]["sjf"]["recovered_tflops_per_gpu"]
    assert bubbles_main([*argv, "--quiet"]) == 0
    assert "[" not in capsys.readouterr().err


def test_the_sweep_run_beside_the_main_run_is_the_sweep_run_after_it(tmp_path: Path, capsys,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With two CPUs the plot's smaller sizes run in a forked process beside the main run; with one, after it, in
    the same process: the same report either way (a simulation is deterministic)."""
    import multiprocessing

    import bubbles.operator.simulator.cli as sim_cli

    forks: list[str] = []
    real_get_context = multiprocessing.get_context

    def counting(method: str | None = None) -> object:
        forks.append(str(method))
        return real_get_context(method)

    argv = ["simulate", "--stages", "4", "--gpus", "64", "--jobs", "600", "--hours", "2", "--quiet",
            "--plot", str(tmp_path / "p.png")]
    monkeypatch.setattr(multiprocessing, "get_context", counting)
    monkeypatch.setattr(sim_cli.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert bubbles_main([*argv, "--report", str(tmp_path / "forked.json")]) == 0
    assert forks == ["fork"]
    monkeypatch.setattr(sim_cli.os, "sched_getaffinity", lambda _pid: {0})
    assert bubbles_main([*argv, "--report", str(tmp_path / "here.json")]) == 0
    assert forks == ["fork"]  # one CPU: no process
    capsys.readouterr()
    forked, here = (json.loads((tmp_path / f).read_text()) for f in ("forked.json", "here.json"))
    assert [s["gpus"] for s in forked["sweep"]] == [8, 16, 32, 64]
    assert forked == here


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "zb"], "use gpipe or 1f1b"),
        (["--gpus", "10"], "multiple of stages x tensor-parallel"),
        (["--policy", "nope"], "known policies: deadline, fifo, makespan, sjf"),
        (["--hours", "0"], "--hours 0.0: must be > 0"),
        (["--fill-fraction", "2"], "must be in (0, 1]"),
        (["--init-s", "-1"], "--init-s -1.0: must be seconds from 0 to 86400"),
        (["--init-s", "nan"], "--init-s nan: must be seconds from 0 to 86400"),
    ],
)
def test_cli_bad_flags_say_what_to_do(argv: list[str], message: str, capsys) -> None:
    assert bubbles_main(["simulate", "--alibaba", str(FIXTURE), "--jobs", "5", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_config_and_missing_trace(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default plot lands here
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"stages": 4, "micro_batches": 8}))
    assert bubbles_main(["simulate", "--config", str(cfg), "--alibaba", str(FIXTURE)]) == 2
    assert "unknown key 'micro_batches'; known keys: stages, microbatches" in capsys.readouterr().err
    cfg.write_text("{stages: 4")
    assert bubbles_main(["simulate", "--config", str(cfg), "--alibaba", str(FIXTURE)]) == 2
    assert "cannot be parsed" in capsys.readouterr().err
    cfg.write_text(json.dumps({"stages": 4, "microbatches": 4, "gpus": 8, "hours": 0.5}))
    assert bubbles_main(["simulate", "--config", str(cfg), "--alibaba", str(FIXTURE), "--jobs", "10"]) == 0
    assert bubbles_main(["simulate", "--config", str(cfg), "--alibaba", str(FIXTURE), "--trace", "x.csv"]) == 2
    assert "give --trace or --alibaba, not both" in capsys.readouterr().err
    assert bubbles_main(["simulate", "--config", str(cfg), "--trace", str(tmp_path / "none.csv")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_with_no_arguments_it_runs_on_the_packaged_trace_model_plots_and_says_what_to_change(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BUBBLES_ALIBABA_TRACE", raising=False)
    assert bubbles_main(["simulate", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "fill jobs: 2000 generated from a model of the Alibaba GPU trace 2023" in out
    assert "bubble ratio 65.2%" in out and "What changes what: --stages" in out
    assert "the load, not the bubbles, limits what is recovered" in out  # 2,000 jobs leave 8,192 GPUs mostly idle
    assert (tmp_path / "bubbles-simulate.png").read_bytes()[:4] == b"\x89PNG"
    assert bubbles_main(["simulate", "--quiet", "--no-plot", "--jobs", "10", "--gpus", "16", "--stages", "4"]) == 0


def test_the_packaged_trace_model_reproduces_the_trace_it_was_fitted_to(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = load_trace_model()
    assert model.source["kept"] == 2180 and model.source["candidates"] == 2613  # docs/simulator.md's filter counts
    # The fitting tool on the excerpt: the model samples what the excerpt holds (medians within 15%).
    out = tmp_path / "model.json"
    subprocess.run([sys.executable, str(Path(__file__).parent.parent / "tools" / "fit-trace-model.py"),
                    str(FIXTURE), "--out", str(out)], check=True, capture_output=True)
    fitted = load_trace_model(out)
    kept, _ = read_alibaba(FIXTURE)
    real = sorted(t.gpu_hours for t in kept if t.gpu_hours > 0)
    sampled = sorted(t.gpu_hours for t in fitted.tasks(4000, seed=1))
    assert sampled[len(sampled) // 2] == pytest.approx(real[len(real) // 2], rel=0.15)
    arrivals = sorted(t.arrival_s for t in kept)
    span = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    synthetic = fitted.tasks(4000, seed=1)
    assert (synthetic[-1].arrival_s - synthetic[0].arrival_s) / 3999 == pytest.approx(span, rel=0.15)


def test_the_fitting_tool_refuses_a_file_that_is_not_the_trace(tmp_path: Path) -> None:
    import subprocess
    import sys

    tool = Path(__file__).parent.parent / "tools" / "fit-trace-model.py"
    out = tmp_path / "model.json"
    for text, message in (("a,b\n1,2\n", "not an Alibaba GPU trace pod list"),
                          (FIXTURE.read_text().splitlines()[0] + "\n", "a model needs at least 2")):
        bad = tmp_path / "pods.csv"
        bad.write_text(text)
        proc = subprocess.run([sys.executable, str(tool), str(bad), "--out", str(out)], capture_output=True,
                              text=True)
        assert proc.returncode == 2 and message in proc.stderr and not out.exists()


@pytest.mark.parametrize(("text", "message"), [
    ("{", "is not a trace model"),
    (json.dumps({"gap_s_quantiles": [1, 0], "gpu_hours_quantiles": [0, 1]}), "non-decreasing"),
    (json.dumps({"gpu_hours_quantiles": [0, 1]}), "regenerate it with tools/fit-trace-model.py"),
])
def test_a_broken_trace_model_says_how_to_regenerate_it(tmp_path: Path, text: str, message: str) -> None:
    bad = tmp_path / "m.json"
    bad.write_text(text)
    with pytest.raises(TraceError, match=message):
        load_trace_model(bad)
    assert TRACE_MODEL_PATH.exists()


def test_the_training_shape_is_tp_x_pp_x_dp_under_short_names_too() -> None:
    import argparse

    from bubbles.operator.simulator.cli import add_arguments, settings

    p = argparse.ArgumentParser()
    add_arguments(p)
    short = settings(p.parse_args(["--tp", "8", "--pp", "4", "--dp", "2"]))
    long = settings(p.parse_args(["--tensor-parallel", "8", "--stages", "4", "--data-parallel", "2"]))
    assert short == long and (short["tensor_parallel"], short["stages"], short["data_parallel"]) == (8, 4, 2)
    main = MainJob(stages=4, microbatches=8, data_parallel=2, tensor_parallel=8)
    assert main.gpus == 64 and [c.executors for c in main.executor_classes()] == [16] * 4


# -- gang jobs ---------------------------------------------------------------------------------------------------
def test_no_gang_share_leaves_the_trace_and_the_results_as_they_were(tasks) -> None:
    from bubbles.operator.simulator.trace import with_gangs

    main = MainJob(stages=4, microbatches=4, data_parallel=4)
    jobs = [t.to_fill_job(PROFILES) for t in generate_trace(tasks, PROFILES, jobs=60, hours=2, seed=1)]
    assert with_gangs(jobs, 0.0, 4) == jobs and with_gangs(jobs, 0.5, 1) == jobs
    assert summarize(simulate(main, with_gangs(jobs, 0.0, 2), "sjf", hours=2)) == \
        summarize(simulate(main, jobs, "sjf", hours=2))
    assert "gangs" not in summarize(simulate(main, jobs, "sjf", hours=2))
    # The same share and seed draw the same jobs.
    assert with_gangs(jobs, 0.3, 2, seed=5) == with_gangs(jobs, 0.3, 2, seed=5)
    with pytest.raises(ValueError, match="share of gang jobs"):
        with_gangs(jobs, 1.5, 2)


def test_a_gang_runs_on_that_many_executors_of_one_stage_at_once_and_conserves_work() -> None:
    main = MainJob(stages=2, microbatches=4, data_parallel=2)  # 2 executors per stage
    prof = PROFILES[("bert-base", WorkloadKind.TRAINING)]
    from bubbles.operator.scheduler import FillJobRequest

    single = FillJobRequest("single", prof, 20_000, 0.0)
    gang = FillJobRequest("gang", prof, 20_000, 1.0, gpus=2)
    too_big = FillJobRequest("big", prof, 100, 2.0, gpus=3)
    res = simulate(main, [single, gang, too_big], "fifo")
    out = {o.job.job_id: o for o in res.outcomes}
    g = out["gang"].placement
    assert g is not None and out["gang"].done and len(g.executors) == 2  # type: ignore[union-attr]
    s = out["single"].placement
    assert s is not None
    # On the other stage at once (the single one holds one executor of the stage it went to), on both of its
    # executors, twice as fast as the single job: it splits the same samples between its two processes.
    assert {main.executor_classes()[0].executors} == {2}
    assert g.start_s == 1.0
    assert g.processing_s == pytest.approx(s.processing_s / 2, rel=0.01)
    assert out["gang"].samples_done == 20_000 and out["gang"].flops == 20_000 * prof.flops_per_sample
    assert "no class has that many" in out["big"].rejected
    summ = summarize(res)
    assert summ["gangs"]["submitted"] == 2 and summ["gangs"]["completed"] == 1 and summ["gangs"]["gpus"] == [2, 3]


def test_a_gang_waits_for_all_of_its_executors() -> None:
    main = MainJob(stages=2, microbatches=4, data_parallel=2)  # 2 executors per stage
    prof = PROFILES[("bert-base", WorkloadKind.TRAINING)]
    from bubbles.operator.scheduler import FillJobRequest

    stage0 = frozenset({main.executor_classes()[0].name})  # both may use stage 0 only
    first = FillJobRequest("first", prof, 20_000, 0.0, eligible=stage0)
    gang = FillJobRequest("gang", prof, 20_000, 1.0, eligible=stage0, gpus=2)
    res = simulate(main, [first, gang], "fifo")
    out = {o.job.job_id: o for o in res.outcomes}
    first_p, gang_p = out["first"].placement, out["gang"].placement
    assert first_p is not None and gang_p is not None
    assert gang_p.start_s == pytest.approx(first_p.end_s)  # not at its arrival, with one executor idle


def test_cli_gang_flags(capsys) -> None:
    argv = ["simulate", "--stages", "2", "--gpus", "8", "--alibaba", str(FIXTURE), "--jobs", "40", "--hours", "1",
            "--no-plot", "--quiet"]
    assert bubbles_main([*argv, "--gang-share", "0.5", "--gang-gpus", "2"]) == 0
    assert "gang jobs (2 GPUs each)" in capsys.readouterr().out
    assert bubbles_main([*argv, "--gang-share", "0.5", "--gang-gpus", "5"]) == 2
    assert "a stage has 4 GPUs" in capsys.readouterr().err
    assert bubbles_main([*argv, "--gang-share", "2"]) == 2
    assert "--gang-share 2.0: must be in [0, 1]" in capsys.readouterr().err
