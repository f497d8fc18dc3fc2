"""`bubbles demo`: the whole mechanism on one machine with no GPU and no cluster.

It starts the node agent, a real DeepSpeed pipeline training on CPU (gloo, one process per stage,
each pinned to a core that stands in for its GPU) and one fill job per stage, then runs three modes
on the same training, interleaved so that drift of a shared machine hits all three alike:
baseline (no fill work), naive co-location (fill jobs run freely) and bubble harvesting.
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
from pathlib import Path
from typing import Any

from bubbles.core import paths
from bubbles.core.api import FillMode
from bubbles.demo.orchestrate.phases import COMPARED_MODES, format_phases
from bubbles.demo.orchestrate.processes import (
    EchoedProcess,
    free_port,
    stop_gracefully,
    tail,
    wait_for_file,
    wait_for_fill_jobs,
)

IMAGE_ENTRY = "bubbles.fill_examples.image_classification:ImageClassification"
INFERENCE_ENTRY = "bubbles.fill_examples.batch_inference:BatchInference"
TRAINING = "demo"
AGENT_READY_TIMEOUT_S = 60.0
# 4 GiB: the free memory the CPU demo reports for every bubble (there is no allocator to ask on CPU).
DEMO_FREE_BYTES = 4 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, 2-4 (default 2)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel (model-parallel) ranks per stage, 1-4 (default 1): stages x tp processes, "
                        "each rank's bubbles harvested on their own")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per iteration (default 8)")
    p.add_argument("--iterations", type=int, default=8,
                   help="training iterations per mode and round (default 8; the first 2 of each "
                        "phase are not counted while the switch settles)")
    p.add_argument("--repeats", type=int, default=6,
                   help="rounds of baseline/naive/harvest (default 6: the fewest that give each figure a 95%% "
                        "interval over rounds)")
    p.add_argument("--hidden", type=int, default=1024, help="width of the training's layers (default 1024)")
    p.add_argument("--layers", type=int, default=8, help="layers of the training model (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="samples per micro-batch (default 16)")
    p.add_argument("--slowdown-budget", type=float, default=0.01,
                   help="training slowdown the guard allows while harvesting (default 0.01 = 1%%)")
    p.add_argument("--grace-ms", type=float, default=50.0,
                   help="how long after a bubble ends a fill step may run before it is killed (default 50)")
    p.add_argument("--gradient-clipping", type=float, default=1.0,
                   help="the training's DeepSpeed gradient clipping (default 1.0, as real trainings use; 0 turns it "
                        "off)")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--timeline", type=Path, help="write a PNG Gantt chart of a few harvesting iterations here")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve the agent's Prometheus metrics on 127.0.0.1:PORT while the demo runs, for a "
                        "Prometheus of your own to scrape (default 0: a free port, printed at start)")
    p.add_argument("--workdir", type=Path,
                   help="keep the run's files (agent stats, per-rank records, logs) here instead of a "
                        "temporary directory")


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each saying what to do."""
    errors = []
    if not 2 <= args.stages <= 4:
        errors.append(f"--stages {args.stages}: the CPU demo runs 2 to 4 stages")
    if not 1 <= args.tp <= 4:
        errors.append(f"--tp {args.tp}: give 1 to 4 tensor-parallel ranks per stage")
    elif args.stages * args.tp > 8:
        errors.append(f"--stages {args.stages} x --tp {args.tp} is {args.stages * args.tp} training processes; the "
                      "CPU demo runs at most 8 (e.g. --stages 2 --tp 4)")
    if args.microbatches < 1:
        errors.append(f"--microbatches {args.microbatches}: use 1 or more")
    if args.iterations < 4:
        errors.append(f"--iterations {args.iterations}: use 4 or more (2 per phase settle and are not counted)")
    if args.repeats < 1:
        errors.append(f"--repeats {args.repeats}: use 1 or more")
    if args.hidden < 8 or args.layers < args.stages or args.micro_batch_size < 1:
        errors.append("--hidden must be >= 8, --layers >= --stages, --micro-batch-size >= 1")
    if not 0 < args.slowdown_budget < 1:
        errors.append(f"--slowdown-budget {args.slowdown_budget}: give a fraction in (0, 1), e.g. 0.01 for 1%")
    if not 0 <= args.metrics_port <= 65535:
        errors.append(f"--metrics-port {args.metrics_port}: give a TCP port (1-65535), or 0 for a free one")
    if not 0 <= args.gradient_clipping < float("inf"):
        errors.append(f"--gradient-clipping {args.gradient_clipping}: give a max gradient norm >= 0 (0: off)")
    if args.grace_ms <= 0:
        errors.append(f"--grace-ms {args.grace_ms}: must be > 0")
    for flag in ("report", "timeline"):
        path = getattr(args, flag)
        if path is not None and path.exists() and path.is_dir():
            errors.append(f"--{flag} {path} is a directory: give a file path")
    return errors


def fill_job_specs(stages: int, tp: int = 1) -> list[dict[str, Any]]:
    """One fill job per GPU (``tp`` per stage, each naming only its stage: the agent puts each on the rank with the
    most bubble time no other job takes), alternating the two example jobs by stage."""
    specs = []
    for stage in range(stages):
        for r in range(tp):
            suffix = f"s{stage}" if tp == 1 else f"s{stage}-{r}"
            if stage % 2 == 0:
                specs.append({"name": f"image-classification-{suffix}", "interface": "iterative",
                              "entry": IMAGE_ENTRY, "memory": "256Mi", "stage": stage})
            else:
                specs.append({"name": f"batch-inference-{suffix}", "interface": "iterative", "entry": INFERENCE_ENTRY,
                              "memory": "256Mi", "stage": stage})
    return specs


def run(args: argparse.Namespace) -> int:
    errors = validate(args)
    if errors:
        for e in errors:
            print(f"bubbles demo: error: {e}", file=sys.stderr)
        return 2
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return _run_in(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="bubbles-demo-") as tmp:
        return _run_in(args, Path(tmp))


def _run_in(args: argparse.Namespace, work: Path) -> int:
    run_dir, ranks_dir = work / "run", work / "ranks"
    specs = fill_job_specs(args.stages, args.tp)
    # The deepest rank of each stage: the GPUs' sockets are no longer than its.
    keys = {s["name"]: paths.GpuKey(paths.LOCAL_NAMESPACE, TRAINING, s["stage"], args.tp - 1) for s in specs}
    if any(paths.socket_path_problem(paths.fill_socket(run_dir, keys[s["name"]], s["name"])) for s in specs):
        # A deep --workdir would make the fill jobs' sockets longer than a Unix socket path may be: keep the
        # sockets in a short private directory instead (removed at the end), the rest of the files in --workdir.
        short = Path(tempfile.mkdtemp(prefix="bubbles-run-"))
        print(f"  --workdir is too deep for Unix socket paths: sockets in {short}", flush=True)
        try:
            return _run_with(args, work, short, ranks_dir, specs)
        finally:
            shutil.rmtree(short, ignore_errors=True)
    return _run_with(args, work, run_dir, ranks_dir, specs)


def _run_with(args: argparse.Namespace, work: Path, run_dir: Path, ranks_dir: Path,
              specs: list[dict[str, Any]]) -> int:
    from bubbles.demo.report import build_report, format_summary, machine_load
    from bubbles.demo.timeline import draw_timeline

    ranks_dir.mkdir(parents=True, exist_ok=True)
    load_start = _cpu_snapshot()
    # A kept --workdir may hold a previous run's files: none of them may stand in for this run's.
    for stale in [*ranks_dir.glob("rank-*.json"), work / "agent-stats.json", work / "agent.ready", work / "start"]:
        stale.unlink(missing_ok=True)
    spec_paths = []
    for spec in specs:
        path = work / f"{spec['name']}.json"
        path.write_text(json.dumps(spec))
        spec_paths.append(path)
    stats_path, ready_path, start_path = work / "agent-stats.json", work / "agent.ready", work / "start"
    metrics_port = args.metrics_port or free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    agent_cmd = [sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(run_dir), "--training", TRAINING,
                 "--executors", str(args.stages), "--mode", FillMode.OFF.label, "--stats", str(stats_path),
                 "--ready-file", str(ready_path), "--grace-ms", str(args.grace_ms),
                 "--slowdown-budget", str(args.slowdown_budget), "--pin-cores", "--metrics-port", str(metrics_port)]
    for path in spec_paths:
        agent_cmd += ["--fill-job", str(path)]
    phases = format_phases(args.iterations, args.repeats)
    train_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.stages * args.tp),
                 "--master_port", str(free_port()), "-m", "bubbles.demo.train",
                 "--microbatches", str(args.microbatches), "--micro-batch-size", str(args.micro_batch_size),
                 "--hidden", str(args.hidden), "--layers", str(args.layers), "--phases", phases,
                 "--gradient-clipping", str(args.gradient_clipping), "--tp", str(args.tp),
                 "--run-dir", str(run_dir), "--training", TRAINING, "--out", str(ranks_dir), "--pin-cores",
                 "--trace", "--free-bytes", str(DEMO_FREE_BYTES), "--start-file", str(start_path)]
    total = args.repeats * len(COMPARED_MODES) * args.iterations
    shape = f"{args.stages}-stage" + (f" x {args.tp} tensor-parallel ranks" if args.tp > 1 else "")
    print(f"bubbles demo: {shape} DeepSpeed pipeline on CPU, {args.microbatches} micro-batches, "
          f"{total} iterations (baseline, naive, harvest x {args.repeats}); files in {work}", flush=True)
    agent_log = (work / "agent.log").open("w")
    agent = subprocess.Popen(agent_cmd, env=env, stdout=agent_log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        if not wait_for_file(ready_path, agent, AGENT_READY_TIMEOUT_S):
            print(f"bubbles demo: error: the agent did not start; its log:\n{tail(work / 'agent.log')}",
                  file=sys.stderr)
            return 1
        print(f"  agent ready (metrics: http://127.0.0.1:{metrics_port}/metrics); starting the training", flush=True)
        train_log = work / "train.log"
        starter = threading.Thread(target=_start_when_fill_jobs_ready,
                                   args=(metrics_port, len(specs), start_path, agent), daemon=True)
        starter.start()
        rc = EchoedProcess(train_cmd, env, train_log, prefix="[bubbles]", stream=sys.stdout,
                           new_session=False).wait()
        if rc != 0:
            print(f"bubbles demo: error: the training exited with {rc}; its log:\n{tail(train_log)}",
                  file=sys.stderr)
            return 1
    finally:
        stop_gracefully(agent)
        agent_log.close()
    ranks = [json.loads(p.read_text()) for p in sorted(ranks_dir.glob("rank-*.json"))]
    if len(ranks) != args.stages * args.tp:
        print(f"bubbles demo: error: expected {args.stages * args.tp} rank records in {ranks_dir}, found {len(ranks)}",
              file=sys.stderr)
        return 1
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    if stats is None:
        print(f"bubbles demo: warning: the agent wrote no stats; its log:\n{tail(work / 'agent.log')}",
              file=sys.stderr)
    load_end = _cpu_snapshot()
    machine = None
    if load_start is not None and load_end is not None:
        machine = machine_load(load_end[0] - load_start[0], load_end[1] - load_start[1], load_end[2] - load_start[2],
                               os.cpu_count() or 1)
    report = build_report(ranks, stats, machine=machine)
    print()
    print(format_summary(report))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nreport: {args.report}")
    if args.timeline:
        if draw_timeline(ranks, stats, args.timeline, breakdown=report["breakdown"]["by_stage"]):
            print(f"timeline: {args.timeline}")
        else:
            print("timeline: no traced harvesting iterations to draw", file=sys.stderr)
    return 0




def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(CPU seconds the whole machine was busy, CPU seconds of this process's finished children, monotonic time);
    None where /proc/stat is not there. Children count once waited for: the training, the agent and, through the
    agent, the fill processes."""
    import resource
    import time

    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return busy, r.ru_utime + r.ru_stime + me.ru_utime + me.ru_stime, time.monotonic()


def _start_when_fill_jobs_ready(port: int, jobs: int, start_path: Path, agent: subprocess.Popen[Any],
                                timeout_s: float = 120.0) -> None:
    """Create ``start_path`` once the agent reports every fill job initialized (or it cannot be): the
    training profiles its bubbles, the agent then starts the fill processes, and only then do the
    measured phases begin, so start-up work is not charged to any mode."""
    outcome = wait_for_fill_jobs(port, jobs, agent, timeout_s)
    if outcome == "ready":
        print("  fill jobs initialized; measuring", flush=True)
    elif outcome != "agent exited":
        print(f"  warning: not every fill job initialized ({outcome}; the agent's log says why); measuring anyway",
              flush=True)
    start_path.touch()
