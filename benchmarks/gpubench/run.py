"""The one-GPU harvesting benchmark: a pipeline stage's real compute with the bubbles of a 1F1B schedule, alone
and with fill jobs under naive co-location, MPS only and bubble harvesting, side by side in one run.

    python benchmarks/gpu_harvest.py [--device cuda|cpu] [--smoke] [--out DIR] ...

For each fill job (image classification, BERT-style batch inference) and each isolation (``contexts``:
separate CUDA contexts, time-sliced; ``mps``: MPS clients, concurrent kernels, the fill job at client priority
1 below the training's 0) it starts the real node agent (``bubbles agent``) with that fill job, then the
training (``gpubench.train``: one emulated stage, instrumented by the real hook), which runs phases
off / naive / harvest interleaved ``--repeats`` times, so drift of the machine hits every regime alike. Before
the runs, each fill job runs alone on the device for ``--solo-seconds`` (the throughput cost savings S need).

Progress goes to stderr; the markdown table to stdout; ``report.json``, ``report.md`` and ``chart.png`` (slowdown
against share of bubble time filled) to ``--out``. ``--smoke`` runs tiny sizes on CPU in well under a minute
(the test suite runs it); MPS there is the stand-in control program of ``tests/fakes`` and is labelled so.
Exit codes: 0 every run measured, 1 a run failed (the report says which and why), 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubbles.agent.mps import MpsControl, MpsError
from bubbles.core import control
from bubbles.core.api import FillInterface, FillMode
from bubbles.demo.orchestrate.phases import COMPARED_MODES, format_phases
from bubbles.demo.orchestrate.processes import (
    EchoedProcess,
    free_port,
    stop_gracefully,
    tail,
    wait_for_file,
    wait_for_fill_jobs,
)
from bubbles.training.sdk.env import tail_risk
from gpubench.clocks import ClockReader, ClockSampler, NvmlClockReader

TRAINING = "gpubench"
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = BENCHMARKS_DIR.parent
STAND_IN_MPS = REPO_ROOT / "tests" / "fakes" / "nvidia-cuda-mps-control"
STAND_IN_LABEL = "stand-in MPS (no GPU)"
ISOLATIONS = ("contexts", "mps")
AGENT_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FillJobPreset:
    """A fill job as the benchmark runs it: its entry and arguments on a GPU and on a CPU (smoke)."""

    entry: str
    gpu_args: dict[str, Any]
    cpu_args: dict[str, Any] | None  # None: a GPU-only preset
    gpu_memory: str  # the hard limit a GPU fill job must declare (isolation: MPS pinned memory, allocator cap)

    def args(self, device: str) -> dict[str, Any]:
        return dict(self.gpu_args if device.startswith("cuda") else self.cpu_args or {})


_RESNET = {"arch": "resnet", "batch_size": 64, "width": 64, "dtype": "bfloat16"}
_BERT = {"batch_size": 32, "seq_len": 128, "width": 768, "layers": 12, "heads": 12, "ffn": 3072, "vocab": 30522,
         "dtype": "bfloat16"}
JOBS = {
    # ResNet-18 layout on CIFAR-sized images, batch 64, bf16 (H100, 2026-11-24: 7.8 ms a step alone, launch-bound)
    "image-classification": FillJobPreset(
        "bubbles.fill_examples.image_classification:ImageClassification", _RESNET, {"batch_size": 4, "width": 8},
        "4Gi"),
    # BERT-base shape (width 768, 12 layers, 12 heads, seq 128), 32 sequences a step, bf16 (H100: 4.4 ms alone)
    "batch-inference": FillJobPreset(
        "bubbles.fill_examples.batch_inference:BatchInference", _BERT, {"batch_size": 16}, "4Gi"),
    # The same two with each step size replayed as a CUDA graph (GPU only): beside the eager ones in one run, the
    # graphs' effect is measured against a reference of the same run. Not run by default.
    "image-classification-graphs": FillJobPreset(
        "bubbles.fill_examples.image_classification:ImageClassification", {**_RESNET, "cuda_graphs": True}, None,
        "4Gi"),
    "batch-inference-graphs": FillJobPreset(
        "bubbles.fill_examples.batch_inference:BatchInference", {**_BERT, "cuda_graphs": True}, None, "4Gi"),
}
DEFAULT_JOBS = ("image-classification", "batch-inference")

# Sizes: full mode (an H200: hidden 4096, seq 2048, 4 blocks a stage, p=4, m=8) and smoke mode (CPU, tiny).
FULL = {"stage": 0, "stages": 4, "microbatches": 8, "hidden": 4096, "heads": 32, "ffn_mult": 4, "seq": 2048,
        "micro_batch": 1, "blocks": 4, "iterations": 20, "repeats": 6, "settle": 2, "solo_seconds": 5.0,
        "warmup_iterations": 2, "profile_iterations": 5, "calibration_steps": 10, "p2p_latency_ms": 0.1,
        "wait_jitter": 0.1, "link_gb_per_s": 200.0, "stage_memory_gb": 60.0}
SMOKE = {"stage": 0, "stages": 4, "microbatches": 4, "hidden": 128, "heads": 4, "ffn_mult": 4, "seq": 128,
         "micro_batch": 1, "blocks": 2, "iterations": 6, "repeats": 1, "settle": 2, "solo_seconds": 1.0,
         "warmup_iterations": 1, "profile_iterations": 3, "calibration_steps": 5, "p2p_latency_ms": 0.1,
         "wait_jitter": 0.1, "link_gb_per_s": 200.0, "stage_memory_gb": 0.0}
SIZE_FLAGS = ("stage", "stages", "microbatches", "hidden", "heads", "ffn_mult", "seq", "micro_batch", "blocks",
              "iterations", "repeats", "settle", "solo_seconds", "p2p_latency_ms", "wait_jitter", "link_gb_per_s",
              "stage_memory_gb")
_FLOAT_FLAGS = ("solo_seconds", "p2p_latency_ms", "wait_jitter", "link_gb_per_s", "stage_memory_gb")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_harvest.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default: cuda when a GPU is visible, else cpu; cpu implies --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and few iterations (the CPU default; a check that everything runs)")
    p.add_argument("--out", type=Path, default=Path("out/gpu-harvest"), help="report directory")
    p.add_argument("--workdir", type=Path, default=None,
                   help="the runs' files (logs, agent stats, training records) (default: OUT/work)")
    p.add_argument("--jobs", default=",".join(DEFAULT_JOBS),
                   help=f"comma list of fill jobs, of {', '.join(JOBS)} (default {','.join(DEFAULT_JOBS)}; the "
                        "-graphs ones replay their steps as CUDA graphs, GPU only)")
    p.add_argument("--fill-args", action="append", default=[], metavar="JOB=JSON",
                   help="override a fill job's arguments, e.g. 'image-classification={\"batch_size\": 32}' "
                        "(repeatable)")
    p.add_argument("--modes", default=",".join(m.label for m in COMPARED_MODES),
                   help="the fill modes each round runs, the baseline (off) first: off,harvest leaves out naive "
                        "co-location and MPS sharing (a third less time, or more rounds in the same time) "
                        f"(default {','.join(m.label for m in COMPARED_MODES)})")
    p.add_argument("--isolations", default=",".join(ISOLATIONS),
                   help="comma list of isolations to run: contexts, mps (default both)")
    for name in SIZE_FLAGS:
        kind = float if name in _FLOAT_FLAGS else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       help=f"default {FULL[name]} (smoke {SMOKE[name]})")
    p.add_argument("--price-training", type=float, default=3.50,
                   help="P_I: $ per hour of the training's GPU (default 3.50; S depends only on P_II / P_I)")
    p.add_argument("--price-fill", type=float, default=None,
                   help="P_II: $ per hour of the dedicated GPU the fill jobs' solo throughput stands for "
                        "(default: P_I, as the solo throughput is measured on this same device)")
    p.add_argument("--slowdown-budget", type=float, default=0.01, help="the agent's slowdown guard (default 1%%)")
    p.add_argument("--grace-ms", type=float, default=50.0, help="the agent's kill grace after bubble end")
    p.add_argument("--tail-risk", default=None,
                   help="the fill runtime's $BUBBLES_TAIL_RISK: how likely a step started past a bubble's predicted "
                        "end may be to outlive it (0: no such steps; default: the environment's, else the "
                        "runtime's default)")
    p.add_argument("--mps-control", type=Path, default=None,
                   help="MPS control program (default: nvidia-cuda-mps-control on PATH; on CPU the stand-in)")
    p.add_argument("--run-timeout-s", type=float, default=None,
                   help="give up on a run after this long (default 300 s full, 120 s smoke)")
    return p


def resolve(args: argparse.Namespace) -> list[str]:
    """Fill in defaults (full or smoke sizes) and return every problem with the flags, each saying what to do."""
    errors = []
    if args.device is None:
        args.device = "cuda" if _cuda_available() else "cpu"
    dev = str(args.device)
    if dev != "cpu" and not (dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
        errors.append(f"--device {dev}: use cuda (an NVIDIA GPU), cuda:N, or cpu (smoke mode)")
    elif dev.startswith("cuda") and not _cuda_available():
        errors.append(f"--device {dev}: no CUDA device is visible here; use --device cpu --smoke")
    if dev == "cuda":
        args.device = "cuda:0"
    if dev == "cpu":
        args.smoke = True  # there is no full-size CPU mode: tiny sizes are all a CPU can run in minutes
    preset = SMOKE if args.smoke else FULL
    for name in SIZE_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.warmup_iterations = preset["warmup_iterations"]
    args.profile_iterations = preset["profile_iterations"]
    args.calibration_steps = preset["calibration_steps"]
    for name in ("stages", "microbatches", "hidden", "heads", "ffn_mult", "seq", "micro_batch", "blocks",
                 "iterations", "repeats"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.stages < 2:
        errors.append(f"--stages {args.stages}: a pipeline has at least 2 stages")
    if not 0 <= args.stage < max(args.stages, 1):
        errors.append(f"--stage {args.stage}: the pipeline has stages 0..{args.stages - 1}; pick one of them")
    if args.hidden >= 1 and args.heads >= 1 and args.hidden % args.heads:
        errors.append(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.settle < 0 or args.settle >= args.iterations:
        errors.append(f"--settle {args.settle}: must be >= 0 and below --iterations {args.iterations} "
                      "(that many iterations of each phase are dropped)")
    if not args.solo_seconds > 0:
        errors.append(f"--solo-seconds {args.solo_seconds}: give a duration > 0")
    if args.p2p_latency_ms < 0:
        errors.append(f"--p2p-latency-ms {args.p2p_latency_ms}: must be >= 0")
    if not 0 <= args.wait_jitter <= 2:
        errors.append(f"--wait-jitter {args.wait_jitter}: a coefficient of variation from 0 (fixed waits) to 2")
    if args.tail_risk is None:
        args.tail_risk = os.environ.get(control.TAIL_RISK_ENV, "")
    try:
        args.tail_risk = tail_risk(str(args.tail_risk))
    except ValueError as exc:
        errors.append(f"--tail-risk: {exc}")
    if not args.link_gb_per_s >= 0:
        errors.append(f"--link-gb-per-s {args.link_gb_per_s}: a bandwidth >= 0 (0: sends cost nothing)")
    if not args.stage_memory_gb >= 0:
        errors.append(f"--stage-memory-gb {args.stage_memory_gb}: the GiB the training's stage holds, >= 0 "
                      "(0: no ballast)")
    args.job_list = _known_list("--jobs", args.jobs, tuple(JOBS), "fill job(s)", errors)
    if not str(args.device).startswith("cuda"):
        for job in args.job_list:
            if job in JOBS and JOBS[job].cpu_args is None:
                errors.append(f"--jobs {job}: replays CUDA graphs, which need a GPU; leave it out on {args.device}")
    args.job_args = {j: JOBS[j].args(str(args.device)) for j in JOBS}
    for item in args.fill_args:
        job, sep, text = item.partition("=")
        try:
            extra = json.loads(text) if sep else None
        except json.JSONDecodeError:
            extra = None
        if job.strip() not in JOBS or not isinstance(extra, dict):
            errors.append(f"--fill-args {item!r}: write JOB=JSON-object with JOB one of {', '.join(JOBS)}, "
                          """e.g. 'image-classification={"batch_size": 32}'""")
            continue
        args.job_args[job.strip()].update(extra)
    args.isolation_list = _known_list("--isolations", args.isolations, ISOLATIONS, "isolation(s)", errors)
    labels = _known_list("--modes", args.modes, tuple(m.label for m in COMPARED_MODES), "mode(s)", errors)
    args.mode_list = [m for m in COMPARED_MODES if m.label in labels]
    if labels and (labels[0] != FillMode.OFF.label or len(set(labels)) != len(labels) or len(labels) < 2):
        errors.append(f"--modes {args.modes}: give off (the baseline every round is compared with) first, then "
                      "one or both of naive and harvest, each once")
    if not args.price_training > 0:
        errors.append(f"--price-training {args.price_training}: give a price per GPU-hour > 0")
    if args.price_fill is None:
        args.price_fill = args.price_training
    elif not args.price_fill >= 0:
        errors.append(f"--price-fill {args.price_fill}: give a price per GPU-hour >= 0")
    if not 0 < args.slowdown_budget < 1:
        errors.append(f"--slowdown-budget {args.slowdown_budget}: a fraction in (0, 1), e.g. 0.01 for 1%")
    if not args.grace_ms > 0:
        errors.append(f"--grace-ms {args.grace_ms}: must be > 0")
    if args.mps_control is not None and not (args.mps_control.is_file() and os.access(args.mps_control, os.X_OK)):
        errors.append(f"--mps-control {args.mps_control}: not an executable file; give the path of "
                      "nvidia-cuda-mps-control")
    if args.run_timeout_s is None:
        args.run_timeout_s = 120.0 if args.smoke else 300.0
    elif not args.run_timeout_s > 0:
        errors.append(f"--run-timeout-s {args.run_timeout_s}: must be > 0")
    if args.out.exists() and not args.out.is_dir():
        errors.append(f"--out {args.out} is a file: give a directory")
    return errors


def _known_list(flag: str, text: object, known: tuple[str, ...], what: str, errors: list[str]) -> list[str]:
    """A comma-separated flag value as a list; an error naming the unknown entries and the known ones."""
    items = [i.strip() for i in str(text).split(",") if i.strip()]
    unknown = [i for i in items if i not in known]
    if unknown or not items:
        errors.append(f"{flag} {text}: unknown {what} {', '.join(unknown) or '(none given)'}; "
                      f"choose from {', '.join(known)}")
    return items


def mps_control_for(args: argparse.Namespace) -> tuple[Path | None, str, str | None]:
    """(control program, label, reason it cannot run) for the mps isolation on this device."""
    if args.device == "cpu":
        control = args.mps_control or (STAND_IN_MPS if STAND_IN_MPS.exists() else None)
        if control is None:
            return None, STAND_IN_LABEL, f"the stand-in {STAND_IN_MPS} is missing (run from the repository)"
        return control, STAND_IN_LABEL, None
    found = args.mps_control or (Path(p) if (p := shutil.which("nvidia-cuda-mps-control")) else None)
    if found is None:
        return None, "MPS", ("nvidia-cuda-mps-control is not on PATH: install the CUDA driver's MPS or pass "
                             "--mps-control PATH")
    return found, "MPS", None


def estimate_s(args: argparse.Namespace) -> float:
    """A rough estimate of the whole run's time (printed up front; assumes ~400 TFLOPS bf16 on a GPU)."""
    b, s, h, f = args.micro_batch, args.seq, args.hidden, args.ffn_mult
    fwd = args.blocks * (2 * b * s * h * (4 * h + 2 * f * h) + 4 * b * s * s * h)
    rate, overhead_s, startup_s = (4e14, 0.0, 25.0) if args.device != "cpu" else (3e9, 0.015, 12.0)
    compute = args.microbatches * 3 * fwd / rate
    iteration = compute * (args.microbatches + args.stages - 1) / args.microbatches + overhead_s
    per_run = startup_s + iteration * (args.warmup_iterations + args.profile_iterations
                                       + len(getattr(args, "mode_list", COMPARED_MODES)) * args.repeats
                                       * args.iterations)
    runs = len(args.job_list) * len(args.isolation_list)
    return runs * per_run + len(args.job_list) * (args.solo_seconds + 3) + startup_s / 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = resolve(args)
    if errors:
        for e in errors:
            print(f"gpu_harvest: error: {e}", file=sys.stderr)
        return 2
    work = args.workdir if args.workdir is not None else args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    return _run_all(args, work)


def _say(message: str) -> None:
    print(f"gpu_harvest: {message}", file=sys.stderr, flush=True)


def _run_all(args: argparse.Namespace, work: Path) -> int:
    from gpubench.report import build_report, draw_chart, format_table

    mode = "SMOKE (not performance)" if args.smoke else "full"
    _say(f"{mode} run on {args.device}: stage {args.stage} of {args.stages}, {args.microbatches} micro-batches, "
         f"jobs {', '.join(args.job_list)}, isolations {', '.join(args.isolation_list)}; estimated "
         f"{estimate_s(args) / 60:.1f} min; files in {work}")
    solo = _run_solo(args, work)
    runs = []
    for job in args.job_list:
        for isolation in args.isolation_list:
            runs.append(_run_one(args, work, job, isolation))
    config = {k: getattr(args, k) for k in (*SIZE_FLAGS, "device", "smoke", "slowdown_budget", "grace_ms",
                                             "warmup_iterations", "profile_iterations", "tail_risk", "modes")}
    config["jobs"] = {j: {"entry": JOBS[j].entry, "args": args.job_args[j]} for j in args.job_list}
    report = build_report(config=config, solo=solo, runs=runs, settle=args.settle,
                          price_training=args.price_training, price_fill=args.price_fill)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    table = format_table(report)
    (args.out / "report.md").write_text(table + "\n")
    if draw_chart(report, args.out / "chart.png"):
        _say(f"chart: {args.out / 'chart.png'}")
    print(table, flush=True)
    _say(f"report: {args.out / 'report.json'}")
    return 0 if all(r.get("error") is None for r in runs) else 1


def _run_solo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each fill job alone on the device; an empty dict (and a warning) if that fails."""
    jobs_file = work / "solo-jobs.json"
    jobs_file.write_text(json.dumps([{"name": j, "entry": JOBS[j].entry, "args": args.job_args[j]}
                                     for j in args.job_list]))
    out = work / "solo.json"
    cmd = [sys.executable, "-m", "gpubench.solo", "--device", args.device, "--jobs", str(jobs_file),
           "--seconds", str(args.solo_seconds), "--out", str(out)]
    if args.device == "cpu":
        cmd += ["--pin-core", str(args.stage)]
    _say("measuring each fill job alone on the device")
    private = work / "no-mps"
    private.mkdir(mode=0o700, exist_ok=True)
    rc = EchoedProcess(cmd, _env(args, None, private), work / "solo.log", prefix="[gpubench]",
                       timeout_s=args.run_timeout_s).wait()
    if rc != 0 or not out.exists():
        _say(f"warning: the solo measurement failed (exit {rc}); cost savings S will be missing:\n"
             f"{tail(work / 'solo.log')}")
        return {}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _env(args: argparse.Namespace, mps_pipe: Path | None, private: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if isinstance(args.tail_risk, float):  # the agent passes its environment on to the fill processes
        env[control.TAIL_RISK_ENV] = repr(args.tail_risk)
    # The benchmark's own processes (python -m gpubench.train / .solo) import it from benchmarks/: it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCHMARKS_DIR), env.get("PYTHONPATH", "")) if p)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    if mps_pipe is not None:  # the training is an MPS client of the agent's daemon, at the higher priority
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps_pipe)
        env["CUDA_MPS_CLIENT_PRIORITY"] = "0"
    elif private is not None:
        # Not MPS: an empty private pipe directory keeps the training out of any MPS daemon on the node
        # (a CUDA process joins MPS when it finds the daemon's pipe directory).
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(private)
        env.pop("CUDA_MPS_CLIENT_PRIORITY", None)
    return env


def _run_one(args: argparse.Namespace, work: Path, job: str, isolation: str) -> dict[str, Any]:
    """One agent + one training process for (fill job, isolation); the run's records or its error."""
    preset = JOBS[job]
    label = isolation
    run: dict[str, Any] = {"job": job, "isolation": isolation, "isolation_label": label, "error": None,
                           "samples_per_step": int(args.job_args[job].get("batch_size", 0))}
    mps_control = None
    if isolation == "mps":
        mps_control, label, why = mps_control_for(args)
        run["isolation_label"] = label
        if why is not None:
            run["error"] = why
            _say(f"{job} / {isolation}: skipped: {why}")
            return run
    here = work / f"{job}-{isolation}"
    here.mkdir(parents=True, exist_ok=True)
    for stale in ("agent-stats.json", "agent.ready", "start", "train.json"):
        (here / stale).unlink(missing_ok=True)
    # Socket paths must stay under 108 bytes: the run and MPS directories live in a short temporary directory.
    short = Path(tempfile.mkdtemp(prefix="gb-", dir="/tmp"))
    try:
        return _run_in(args, here, short, run, preset, mps_control)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _run_in(args: argparse.Namespace, here: Path, short: Path, run: dict[str, Any], preset: FillJobPreset,
            mps_control: Path | None) -> dict[str, Any]:
    job, isolation = run["job"], run["isolation"]
    run_dir, pipe_dir, private = short / "run", short / "mps-pipe", short / "no-mps"
    for d in (pipe_dir, private):
        d.mkdir(mode=0o700)
    spec = {"name": job, "interface": FillInterface.ITERATIVE.label, "entry": preset.entry, "args": args.job_args[job],
            "stage": args.stage, "memory": preset.gpu_memory if args.device != "cpu" else "256Mi"}
    spec_path = here / "fill-job.json"
    spec_path.write_text(json.dumps(spec))
    stats_path, ready_path, start_path = here / "agent-stats.json", here / "agent.ready", here / "start"
    record_path = here / "train.json"
    port = free_port()
    agent_cmd = [sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(run_dir), "--training", TRAINING,
                 "--executors", str(args.stage + 1), "--mode", FillMode.OFF.label, "--stats", str(stats_path),
                 "--ready-file", str(ready_path), "--grace-ms", str(args.grace_ms),
                 "--slowdown-budget", str(args.slowdown_budget), "--metrics-port", str(port),
                 "--fill-job", str(spec_path), "--isolation", isolation]
    if args.device != "cpu":
        agent_cmd += ["--devices", args.device]
    if isolation == "mps":
        agent_cmd += ["--mps-control", str(mps_control), "--mps-pipe-dir", str(pipe_dir),
                      "--mps-log-dir", str(short / "mps-log")]
    phases = format_phases(args.iterations, args.repeats, args.mode_list)
    train_cmd = [sys.executable, "-m", "gpubench.train", "--device", args.device,
                 "--stage", str(args.stage), "--stages", str(args.stages), "--microbatches", str(args.microbatches),
                 "--hidden", str(args.hidden), "--heads", str(args.heads), "--ffn-mult", str(args.ffn_mult),
                 "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--blocks", str(args.blocks),
                 "--p2p-latency-ms", str(args.p2p_latency_ms), "--calibration-steps", str(args.calibration_steps),
                 "--wait-jitter", str(args.wait_jitter), "--link-gb-per-s", str(args.link_gb_per_s),
                 "--stage-memory-gb", str(args.stage_memory_gb),
                 "--phases", phases, "--warmup-iterations", str(args.warmup_iterations),
                 "--profile-iterations", str(args.profile_iterations), "--run-dir", str(run_dir),
                 "--training", TRAINING, "--start-file", str(start_path), "--out", str(record_path),
                 "--start-timeout-s", str(args.run_timeout_s), "--agent-ready-file", str(ready_path)]
    if args.device == "cpu":
        train_cmd += ["--pin-core", str(args.stage)]  # the core the agent pins this stage's fill job to
    _say(f"{job} / {run['isolation_label']}: starting the agent and the training")
    agent_log = (here / "agent.log").open("w")
    agent = subprocess.Popen(agent_cmd, env=_env(args, None), stdout=agent_log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    training: EchoedProcess | None = None
    try:
        env = _env(args, pipe_dir if isolation == "mps" else None, private)
        ready: dict[str, Any] = {}
        verify = None
        if isolation == "mps" and run["isolation_label"] == "MPS":  # the stand-in has no clients to list
            verify = MpsControl(str(mps_control), pipe_dir, short / "mps-log")

        def start_training() -> EchoedProcess:
            return EchoedProcess(train_cmd, env, here / "train.log", prefix="[gpubench]",
                                 timeout_s=args.run_timeout_s)

        if isolation != "mps":
            # The training starts at once and imports and builds its model while the agent starts; it calibrates
            # and profiles only once the agent's ready file exists (the agent must hear the profiled cycle).
            training = start_training()
        if not wait_for_file(ready_path, agent, AGENT_READY_TIMEOUT_S):
            if training is not None:
                training.kill()
            run["error"] = f"the agent did not start (exit {agent.poll()}): {_last_error(here / 'agent.log')}"
            _say(f"{job} / {isolation}: {run['error']}\n{tail(here / 'agent.log')}")
            return run
        _say(f"{job} / {run['isolation_label']}: agent ready")
        if training is None:
            # MPS: CUDA decides when a process initializes it whether it is a client of the daemon in its pipe
            # directory. The agent starts that daemon before it writes its ready file; a training started
            # earlier would run in a context of its own, and the regime would not be MPS.
            training = start_training()
        clocks = _start_clock_sampler(args.device)
        if isinstance(clocks, str):
            run["sm_clock_error"] = clocks
        starter = threading.Thread(target=_start_when_fill_job_ready,
                                   args=(port, start_path, agent, args.run_timeout_s / 2, ready,
                                         verify, training.proc.pid), daemon=True)
        starter.start()
        try:
            rc = training.wait()
        finally:
            if not isinstance(clocks, str):
                run["sm_clock_samples"] = clocks.stop()
                if clocks.error:
                    run["sm_clock_error"] = clocks.error
        if rc != 0 or not record_path.exists():
            run["error"] = f"the training exited with {rc}: {_last_error(here / 'train.log')}"
            _say(f"{job} / {isolation}: {run['error']}\n{tail(here / 'train.log')}")
            return run
        starter.join(timeout=5)
        if ready.get("mps_problem"):
            run["error"] = str(ready["mps_problem"])
            _say(f"{job} / {isolation}: {run['error']}")
            return run
        if isolation == "mps":
            run["mps_membership"] = ("verified" if verify is not None
                                     else "not verifiable: the stand-in lists no clients")
        if not ready.get("ready"):
            # Without an initialized fill job every phase would be a baseline: the run measured nothing.
            run["error"] = f"the fill job was never initialized: {_last_error(here / 'agent.log')}"
            _say(f"{job} / {isolation}: {run['error']}\n{tail(here / 'agent.log')}")
            return run
    finally:
        stop_gracefully(agent)
        agent_log.close()
    run["training"] = json.loads(record_path.read_text())
    if stats_path.exists():
        run["agent_stats"] = json.loads(stats_path.read_text())
    else:
        run["error"] = f"the agent wrote no stats: {_last_error(here / 'agent.log')}"
    return run


def _start_clock_sampler(device: str, reader: ClockReader | None = None) -> ClockSampler | str:
    """A started sampler of ``device``'s SM clock (``gpubench.clocks``), or why there is none (a CPU run, no NVML)."""
    if not device.startswith("cuda"):
        return "a CPU run has no SM clock"
    if reader is None:
        from bubbles.training.probes import gpu_uuid

        uuid = gpu_uuid(device)
        if uuid is None:
            return f"torch cannot say the UUID of {device}, which NVML needs"
        try:
            nvml_reader = NvmlClockReader(uuid)
        except RuntimeError as exc:
            return str(exc)
        if nvml_reader.reasons_problem:
            _say(f"warning: NVML gives no clocks event reasons ({nvml_reader.reasons_problem}): the SM clock alone "
                 "is sampled")
        reader = nvml_reader
    return ClockSampler(reader).start()


def _start_when_fill_job_ready(port: int, start_path: Path, agent: subprocess.Popen[Any], timeout_s: float,
                               ready: dict[str, Any], verify: MpsControl | None = None,
                               training_pid: int = 0) -> None:
    """Create ``start_path`` once the agent's metrics show the fill job initialized, so its start-up lands in
    no measured phase; also when it cannot be (``ready["ready"]`` says which), so the training is not left
    waiting. With ``verify`` (real MPS), first check that the training and the fill job joined the daemon:
    ``ready["mps_problem"]`` says what is wrong if not, and the run is failed."""
    outcome = wait_for_fill_jobs(port, 1, agent, timeout_s, poll_s=0.05)
    ready["ready"] = outcome == "ready"
    if outcome == "ready" and verify is not None:
        try:
            problem = mps_membership_problem(verify.clients(), training_pid)
        except MpsError as exc:
            problem = f"cannot list the MPS daemon's clients ({exc}): the regime cannot be reported as MPS"
        if problem is not None:
            ready["mps_problem"] = problem
            ready["ready"] = False
        else:
            _say("  MPS membership verified: the training and the fill job are clients of one server")
    if ready["ready"]:
        _say("  fill job initialized; measuring")
    elif outcome == "stopped":
        _say("  the fill job stopped before it was initialized (the agent's log says why)")
    elif outcome == "timeout":
        _say("  warning: the fill job did not report ready")
    start_path.touch()


def mps_membership_problem(clients: dict[int, list[int]], training_pid: int) -> str | None:
    """None if the training is a client of an MPS server that has another client too (the fill job); else what
    is wrong, for a run that must not be reported as MPS. ``clients``: ``MpsControl.clients()``."""
    listed = "; ".join(f"server {s}: clients {c or 'none'}" for s, c in sorted(clients.items())) or "no server"
    for _server, pids in clients.items():
        if training_pid in pids:
            if len(set(pids)) < 2:
                return (f"the fill job is not a client of the training's MPS server ({listed}): it runs in a "
                        "context of its own, so the regime is not MPS")
            return None
    return (f"the training (pid {training_pid}) is not a client of the MPS daemon ({listed}): it initialized CUDA "
            "outside MPS, so the regime is not MPS")


def _last_error(path: Path) -> str:
    """The last line of a log that looks like an error, for the report's one-line reason."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    for line in reversed(text):
        if "error" in line.lower() or "Error" in line:
            return line.strip()[:300]
    return (text[-1].strip()[:300] if text else "(empty log)")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main())
