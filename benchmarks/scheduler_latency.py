"""Scheduler decision latency: N GPUs in 16 executor classes (one per pipeline stage), Q queued fill jobs.

Each decision is what happens when an executor frees up: the scheduler picks the policy's best queued job for that
executor and starts it (Scheduler.release). Every executor is filled first and the queue is kept at its size (one job
submitted after each decision), so each decision sees Q queued jobs. Two paths: ``index`` (the class's queue index,
where the policy offers one; the indexes are made in the set-up, ``Scheduler.index_all``) and ``scan`` (every queued
job scored at each decision, ``Scheduler(..., index=False)``). With both, each policy runs the same workload on each
path and the script says whether they chose the same jobs. Prints median and p99 per policy and path.
With ``--runs R`` each policy and path runs R times (the same workload each time) and the line gives the median
of the runs' medians and p99s with their range; ``--json FILE`` keeps every run's figures.
Usage: .venv/bin/python benchmarks/scheduler_latency.py [--gpus 8192] [--queued 10000] [--decisions 2000]
       [--policy sjf ...] [--path index|scan|both] [--runs 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from bubbles.operator.scheduler import FillJobRequest, Scheduler
from bubbles.operator.simulator import MainJob, load_profiles

STAGES = 16


def run(policy: str, index: bool, gpus: int, queued: int, decisions: int) -> tuple[np.ndarray, list[str], str]:
    """Latencies in ms of ``decisions`` releases, the jobs they started, and a line about the set-up."""
    profiles = list(load_profiles().values())
    classes = MainJob(stages=STAGES, microbatches=8, data_parallel=gpus // STAGES).executor_classes()
    rng = np.random.default_rng(0)
    s = Scheduler(classes, policy, index=index)
    t0 = time.perf_counter()
    n_exec = len(s.busy_until_s)
    for k in range(n_exec + queued):
        prof = profiles[k % len(profiles)]
        dl = float(rng.uniform(3600, 86400)) if k % 5 == 0 else None
        s.submit(FillJobRequest(f"j{k}", prof, int(rng.integers(100, 100_000)), 0.0, dl), 0.0)
    s.index_all(0.0)
    setup_s = time.perf_counter() - t0
    lat, chosen = [], []
    now = 1.0
    running = sorted(s.running)
    for d in range(decisions):
        e = running[int(rng.integers(0, len(running)))]
        now += 0.01
        t = time.perf_counter()
        p = s.release(e, now)
        lat.append(time.perf_counter() - t)
        chosen.append("" if p is None else p.job.job_id)
        if p is None:
            running.remove(e)
        # keep the queue at its size
        prof = profiles[d % len(profiles)]
        s.submit(FillJobRequest(f"n{d}", prof, 1000, now), now, place=False)
    how = "index" if s.indexed else "scan"
    return np.array(lat) * 1e3, chosen, f"{how}, queued {s.queued}, set-up {setup_s:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8_192, help=f"executors, a multiple of {STAGES} (default 8192)")
    ap.add_argument("--queued", type=int, default=10_000, help="queued fill jobs each decision sees (default 10000)")
    ap.add_argument("--decisions", type=int, default=2_000)
    ap.add_argument("--policy", action="append", help="repeatable; default: fifo, sjf, makespan, deadline, a mix")
    ap.add_argument("--path", choices=["index", "scan", "both"], default="both",
                    help="decide by the queue index, by scanning the queue, or both on the same workload")
    ap.add_argument("--runs", type=int, default=1, help="runs per policy and path (figures: median [min, max])")
    ap.add_argument("--json", type=Path, help="write every run's figures to this file")
    args = ap.parse_args()
    if args.gpus < STAGES or args.gpus % STAGES:
        ap.error(f"--gpus must be a positive multiple of {STAGES} (the pipeline's stages); got {args.gpus}")
    if args.queued < 0 or args.decisions < 1:
        ap.error("--queued must be >= 0 and --decisions >= 1")
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}; "
          f"{args.gpus} GPUs in {STAGES} classes, {args.queued} queued, {args.decisions} decisions")
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    paths = {"index": [True], "scan": [False], "both": [True, False]}[args.path]
    record: list[dict[str, object]] = []
    for policy in args.policy or ["fifo", "sjf", "makespan", "deadline", "0.5*sjf+0.5*deadline"]:
        picks = []
        for index in paths:
            medians, p99s, maxes = [], [], []
            for r in range(args.runs):
                ms, chosen, about = run(policy, index, args.gpus, args.queued, args.decisions)
                if r == 0:
                    picks.append(chosen)
                elif chosen != picks[-1]:
                    raise SystemExit(f"{policy}: run {r + 1} chose other jobs than run 1 on the same workload")
                medians.append(float(np.median(ms)))
                p99s.append(float(np.percentile(ms, 99)))
                maxes.append(float(ms.max()))
                record.append({"policy": policy, "path": "index" if index else "scan", "run": r + 1,
                               "median_ms": medians[-1], "p99_ms": p99s[-1], "max_ms": maxes[-1], "about": about})
            print(f"{policy:<22} {'index' if index else 'scan':<5}  decision median {_spread(medians)} ms  "
                  f"p99 {_spread(p99s)} ms  max {max(maxes):.3f} ms  ({about}{_runs(args.runs)})")
        if len(picks) == 2:
            print(f"{'':<22} same choices on both paths: {'yes' if picks[0] == picks[1] else 'NO'}")
            record.append({"policy": policy, "same_choices": picks[0] == picks[1]})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gpus": args.gpus, "queued": args.queued, "decisions": args.decisions,
                                         "machine": platform.processor() or platform.machine(),
                                         "runs": record}, indent=1))


def _spread(xs: list[float]) -> str:
    """One run: its figure; several: the median of the runs [min, max]."""
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{float(np.median(xs)):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def _runs(n: int) -> str:
    return f"; {n} runs" if n > 1 else ""

if __name__ == "__main__":
    main()
