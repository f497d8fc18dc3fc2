"""Scheduler decision latency: 8,192 GPUs in 16 executor classes, 10,000 queued fill jobs.

Each decision is what happens when an executor frees up: score the whole queue for that executor
with the policy and start the best job (Scheduler.release). Prints median and p99 per policy.
Usage: .venv/bin/python benchmarks/scheduler_latency.py [--queued 10000] [--decisions 2000]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from bubbles.operator.scheduler import FillJobRequest, Scheduler
from bubbles.operator.simulator import MainJob, load_profiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--decisions", type=int, default=2_000)
    ap.add_argument("--policy", action="append")
    args = ap.parse_args()
    profiles = list(load_profiles().values())
    main_job = MainJob(stages=16, microbatches=8, data_parallel=512)
    classes = main_job.executor_classes()
    rng = np.random.default_rng(0)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}")
    for policy in args.policy or ["fifo", "sjf", "makespan", "deadline", "0.5*sjf+0.5*deadline"]:
        s = Scheduler(classes, policy)
        t0 = time.perf_counter()
        # Fill every executor first so that the queue really holds `queued` jobs.
        n_exec = len(s.busy_until_s)
        for k in range(n_exec + args.queued):
            prof = profiles[k % len(profiles)]
            dl = float(rng.uniform(3600, 86400)) if k % 5 == 0 else None
            s.submit(FillJobRequest(f"j{k}", prof, int(rng.integers(100, 100_000)), 0.0, dl), 0.0)
        setup_s = time.perf_counter() - t0
        lat = []
        now = 1.0
        for d in range(args.decisions):
            e = int(rng.integers(0, n_exec))
            while e not in s.running:
                e = int(rng.integers(0, n_exec))
            now += 0.01
            t = time.perf_counter()
            s.release(e, now)
            lat.append(time.perf_counter() - t)
            # keep the queue at its size
            prof = profiles[d % len(profiles)]
            s.submit(FillJobRequest(f"n{d}", prof, 1000, now), now, place=False)
        ms = np.array(lat) * 1e3
        print(
            f"{policy:<22} queued {s.queued:>6}  decision median {np.median(ms):.3f} ms  "
            f"p99 {np.percentile(ms, 99):.3f} ms  (setup {setup_s:.1f} s)"
        )


if __name__ == "__main__":
    main()
