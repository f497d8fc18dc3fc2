"""The slowdown guard on synthetic trainings: what it cuts, when, and what its pauses cost.

    .venv/bin/python benchmarks/guard_synthetic.py [--seeds 30] [--iterations 2000] [--noise 0.05]

Each scenario drives ``bubbles.agent.guard.SlowdownGuard`` (default ``GuardConfig``, budget 1%) with iteration times
``cost(i, share in effect) * (1 + uniform(-noise, noise))``; the share in effect is 0 while the guard pauses fill
work. Scenarios: pure noise; a real harm of 3% at the full share (proportional to the share); a 10% step in the
training's own speed at iteration 300 (both arms); a harm of 0.5% (under the budget). Per scenario, over the seeds:
the share of iterations run without fill work (the guard's cost), how many seeds saw a cut and when the first came,
the mean share in effect, and the probes' outcomes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

from bubbles.agent.guard import GuardConfig, SlowdownGuard

SCENARIOS: dict[str, Callable[[int, float], float]] = {
    "noise only": lambda _i, _s: 1.0,
    "3% harm at full share": lambda _i, s: 1 + 0.03 * s,
    "10% step in the baseline": lambda i, _s: 1.0 if i < 300 else 1.10,
    "0.5% harm (under budget)": lambda _i, s: 1 + 0.005 * s,
}


@dataclass(frozen=True)
class Run:
    off: float  # share of iterations without fill work
    first_cut: int | None
    mean_share: float
    probes: dict[str, int]


def drive(cost: Callable[[int, float], float], iterations: int, seed: int, noise: float) -> Run:
    guard = SlowdownGuard(1.0, GuardConfig(budget=0.01))
    rng = random.Random(seed)
    share, paused, off, first_cut, shares = guard.share, False, 0, None, []
    for i in range(iterations):
        effective = 0.0 if paused else share
        off += paused
        shares.append(effective)
        d = guard.observe(cost(i, effective) * (1 + rng.uniform(-noise, noise)))
        if d.share < share and first_cut is None:
            first_cut = i
        share, paused = d.share, d.fill_paused
    return Run(off / iterations, first_cut, statistics.fmean(shares), dict(guard.probes))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--noise", type=float, default=0.05, help="uniform noise per iteration, +-this share")
    args = p.parse_args()
    if args.seeds < 1 or args.iterations < 100 or not 0 <= args.noise < 1:
        p.error("--seeds must be >= 1, --iterations >= 100 and --noise in [0, 1), e.g. 0.05")
    print(f"{args.seeds} seeds x {args.iterations} iterations, noise +-{args.noise:.0%}, budget 1%\n")
    print("| scenario | iterations without fill work | seeds with a cut | first cut (median, max) | mean share "
          "| probes: cut / clear / undecided |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, cost in SCENARIOS.items():
        runs = [drive(cost, args.iterations, seed, args.noise) for seed in range(args.seeds)]
        cuts = sorted(r.first_cut for r in runs if r.first_cut is not None)
        when = f"{cuts[len(cuts) // 2]}, {cuts[-1]}" if cuts else "-"
        probes = {k: sum(r.probes[k] for r in runs) for k in ("cut", "clear", "undecided")}
        print(f"| {name} | {statistics.fmean(r.off for r in runs):.1%} | {len(cuts)}/{args.seeds} | {when} | "
              f"{statistics.fmean(r.mean_share for r in runs):.2f} | "
              f"{probes['cut']} / {probes['clear']} / {probes['undecided']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
