"""Simulator speed: how long `bubbles simulate` takes, phase by phase (trace generation, simulation, summary).

Usage: .venv/bin/python benchmarks/simulator_speed.py [--gpus 8192] [--jobs 50000] [--hours 24] [--policy sjf]
           [--runs 1] [--alibaba PATH | --packaged-model] [--json FILE]

The fill jobs come from the Alibaba GPU trace (--alibaba, default $BUBBLES_ALIBABA_TRACE or the shared copy) or, with
--packaged-model, from the trace model packaged with bubbles, as `bubbles simulate` without --alibaba does: issue 37's
command `bubbles simulate --gpus 100000 --jobs 1000000 --hours 168` is
`--packaged-model --gpus 100000 --jobs 1000000 --hours 168`. The main job is PipeFill's: 16 stages x 8 micro-batches,
GPipe, --gpus GPUs. Each run does every phase again and prints wall and CPU seconds per phase (the median, min and max
over --runs); the CPU seconds are this process's, less moved by other work on the machine than the wall seconds. The
first run also plans each job profile on each stage (about a second; later runs in the process find the plans cached,
as a second --policy of `bubbles simulate` does). Every run must give the same results (the simulator is
deterministic): the benchmark fails where one does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bubbles.operator.simulator import MainJob, load_profiles, read_alibaba, simulate, summarize
from bubbles.operator.simulator.report import format_summary
from bubbles.operator.simulator.trace import generate_table, load_trace_model

DEFAULT = os.environ.get(
    "BUBBLES_ALIBABA_TRACE", "/work/shared/data/alibaba-gpu-2023/openb_pod_list_default.csv"
)
PHASES = ("trace", "simulation", "summary")


def one_run(args: argparse.Namespace) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """Every phase once: (wall s, CPU s) per phase, and the summary."""
    marks = [(time.perf_counter(), time.process_time())]

    def mark() -> None:
        marks.append((time.perf_counter(), time.process_time()))

    profiles = load_profiles()
    if args.packaged_model:
        tasks: Any = load_trace_model().columns(max(2 * args.jobs, 2000), seed=args.seed)
    else:
        tasks, _stats = read_alibaba(args.alibaba)
    table = generate_table(tasks, profiles, jobs=args.jobs, hours=args.hours, seed=args.seed)
    jobs = table.fill_jobs(profiles)
    mark()
    main_job = MainJob(stages=16, microbatches=8, data_parallel=args.gpus // 16)
    res = simulate(main_job, jobs, args.policy, hours=args.hours)
    mark()
    summary = summarize(res)
    mark()
    times = {p: (b[0] - a[0], b[1] - a[1]) for p, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}
    return times, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alibaba", type=Path, default=Path(DEFAULT), help="Alibaba pod list (default %(default)s)")
    ap.add_argument("--packaged-model", action="store_true",
                    help="generate from the packaged trace model instead, as `bubbles simulate` does by default")
    ap.add_argument("--gpus", type=int, default=8192, help="GPUs of the main job, a multiple of 16 (default 8192)")
    ap.add_argument("--jobs", type=int, default=50_000, help="fill jobs to generate (default 50000)")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours (default 24)")
    ap.add_argument("--policy", default="sjf", help="scheduling policy (default sjf)")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    ap.add_argument("--runs", type=int, default=1, help="runs of every phase (default 1)")
    ap.add_argument("--json", type=Path, help="write the timings and the summary here")
    args = ap.parse_args()
    if args.gpus < 16 or args.gpus % 16:
        ap.error(f"--gpus {args.gpus}: use a positive multiple of 16 (the main job's stages)")
    if args.runs < 1 or args.jobs < 1:
        ap.error("--runs and --jobs must be 1 or more")
    source = "the packaged trace model" if args.packaged_model else str(args.alibaba)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{args.gpus} GPUs (16 stages x 8 micro-batches), {args.jobs} jobs from {source}, {args.hours:g} h, "
          f"{args.policy}, {args.runs} run(s)")
    runs: list[dict[str, tuple[float, float]]] = []
    first: dict[str, Any] | None = None
    for k in range(args.runs):
        times, summary = one_run(args)
        runs.append(times)
        if first is None:
            first = summary
        elif summary != first:
            raise SystemExit(f"run {k + 1} gave other results than run 1: the simulator is meant to be deterministic")
        print(f"run {k + 1}: " + ", ".join(f"{p} {w:.2f} s (CPU {c:.2f} s)" for p, (w, c) in times.items())
              + f", total {sum(w for w, _ in times.values()):.2f} s")
    assert first is not None
    print(format_summary([first]))
    rows: dict[str, dict[str, float]] = {}
    print(f"{'phase':<12}{'wall median':>12}{'min':>8}{'max':>8}{'CPU median':>12}{'min':>8}{'max':>8}")
    for phase in (*PHASES, "total"):
        wall = [sum(r[p][0] for p in PHASES) if phase == "total" else r[phase][0] for r in runs]
        cpu = [sum(r[p][1] for p in PHASES) if phase == "total" else r[phase][1] for r in runs]
        rows[phase] = {"wall_median_s": statistics.median(wall), "wall_min_s": min(wall), "wall_max_s": max(wall),
                       "cpu_median_s": statistics.median(cpu), "cpu_min_s": min(cpu), "cpu_max_s": max(cpu)}
        v = rows[phase]
        print(f"{phase:<12}{v['wall_median_s']:>12.2f}{v['wall_min_s']:>8.2f}{v['wall_max_s']:>8.2f}"
              f"{v['cpu_median_s']:>12.2f}{v['cpu_min_s']:>8.2f}{v['cpu_max_s']:>8.2f}")
    print(f"events {first['events']}; load average {os.getloadavg()[0]:.2f} at the end")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "phases": rows,
                                         "runs": runs, "events": first["events"], "summary": first}, indent=2))
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
