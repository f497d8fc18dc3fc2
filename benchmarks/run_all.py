"""Run every benchmark one after another (never in parallel: they share 2 cores) and print their tables.

    .venv/bin/python benchmarks/run_all.py [--quick]

Results go to docs/benchmarks.md by hand, with the machine and the date: the numbers move with the
machine's load, so each figure there says how it was measured."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not for reporting)")
    p.add_argument("--out", type=Path, default=Path("out/bench"), help="directory for JSON results")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [
        ["hook_overhead.py", "--calls", "20000" if args.quick else "100000", "--json",
         str(args.out / "hook-overhead.json")],
        ["signal_latency.py", "--signals", "300" if args.quick else "3000", "--json",
         str(args.out / "signal-latency.json")],
        ["scheduler_latency.py", "--decisions", "200" if args.quick else "2000"],
        ["simulator_speed.py", "--jobs", "5000" if args.quick else "50000", "--json",
         str(args.out / "simulator-speed.json")],
        ["round_cost.py", "--jobs", "100", "1000", "--rounds", "5" if args.quick else "20", "--round", "both", "--json",
         str(args.out / "round-cost.json")],
        ["guard_synthetic.py", "--seeds", "5" if args.quick else "30"],
        ["gate_replay.py", "--seeds", "3" if args.quick else "20", "--out", str(args.out / "gate-replay.json")],
        ["step_gap.py", "--rounds", "2" if args.quick else "6", "--json", str(args.out / "step-gap.json")],
        ["ledger_scale.py", "--hours", "0.1" if args.quick else "1", "--json", str(args.out / "ledger-scale.json")],
        ["datagram_credentials.py", "--rounds", "2" if args.quick else "8", "--json",
         str(args.out / "datagram-credentials.json")],
    ]
    failed = 0
    for script, *flags in runs:
        print(f"\n## {script}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / script), *flags])
        failed += rc != 0
    if args.quick:
        print(f"\n## demo (bubbles demo --report {args.out / 'demo-report.json'})", flush=True)
        failed += subprocess.call([sys.executable, "-m", "bubbles.cli", "demo", "--report",
                                   str(args.out / "demo-report.json"), "--timeline",
                                   str(args.out / "demo-timeline.png"), "--repeats", "1", "--iterations", "6"]) != 0
    else:  # five runs, as docs/benchmarks.md's table
        print(f"\n## demo_runs.py (five runs of bubbles demo, in {args.out / 'demo-runs'})", flush=True)
        failed += subprocess.call([sys.executable, str(HERE / "demo_runs.py"), "--runs", "5", "--out",
                                   str(args.out / "demo-runs")]) != 0
    # The one-GPU harvesting benchmark picks its mode itself: full size on a GPU, the smoke run (no figures,
    # a check that everything runs) on a CPU-only machine.
    print(f"\n## gpu_harvest.py (report in {args.out / 'gpu-harvest'})", flush=True)
    failed += subprocess.call([sys.executable, str(HERE / "gpu_harvest.py"), "--out", str(args.out / "gpu-harvest")]
                              + (["--smoke"] if args.quick else [])) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
