"""Simulator speed: 24 simulated hours of an 8,192-GPU training with ~50,000 generated fill jobs.

Usage: .venv/bin/python benchmarks/simulator_speed.py [--alibaba PATH] [--jobs 50000] [--hours 24]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from bubbles.operator.simulator import MainJob, generate_trace, load_profiles, read_alibaba, simulate, summarize
from bubbles.operator.simulator.report import format_summary

DEFAULT = os.environ.get(
    "BUBBLES_ALIBABA_TRACE", "/work/shared/data/alibaba-gpu-2023/openb_pod_list_default.csv"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--alibaba", default=DEFAULT)
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--policy", default="sjf")
    args = ap.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    t0 = time.perf_counter()
    profiles = load_profiles()
    tasks, stats = read_alibaba(args.alibaba)
    print(
        f"trace: {stats.rows} rows, {stats.candidates} GPU tasks not LS, "
        f"{stats.share_kept:.1%} under 1 GPU-hour, "
        f"median {stats.median_gpu_hours:.3f} GPU-hours"
    )
    trace = generate_trace(tasks, profiles, jobs=args.jobs, hours=args.hours, seed=0)
    jobs = [t.to_fill_job(profiles) for t in trace]
    t1 = time.perf_counter()
    main_job = MainJob(stages=16, microbatches=8, data_parallel=512)
    res = simulate(main_job, jobs, args.policy, hours=args.hours)
    t2 = time.perf_counter()
    print(format_summary([summarize(res)]))
    print(
        f"events {res.events}; trace generation {t1 - t0:.1f} s, simulation {t2 - t1:.1f} s, "
        f"total {t2 - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
