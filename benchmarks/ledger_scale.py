"""The agent's ledger over a long run: what a scrape or a report costs, and how many records it holds.

Every Prometheus scrape and every report to the operator totals the ledger under the agent's lock, the lock its
event loop takes for each bubble signal. A ledger that held every record (before 2026-11-24) sorted all of them
each time, so that cost grew with the agent's uptime. This replays a stage's records, as ``AgentCore`` adds them,
for ``--hours`` of a training: an iteration of ``--iteration-ms`` with one bubble of ``--bubble-ms``, filled with
steps of ``--step-ms`` back to back (every tenth bubble's last step overruns by a quarter of a step). At each
checkpoint it times ``totals()`` (the median and range of ``--repeats`` calls) with folding (the agent's ledger)
and without (every record held, as before), in the same run, and counts the records held.

    .venv/bin/python benchmarks/ledger_scale.py --hours 1 --json out/bench/ledger-scale.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bubbles.agent.ledger import HarvestLedger

MS = 1_000_000


def _iteration(led: HarvestLedger, i: int, args: argparse.Namespace) -> int:
    """Add iteration ``i``'s bubble and steps; return how many records."""
    t = i * int(args.iteration_ms * MS)
    bubble = int(args.bubble_ms * MS)
    step = int(args.step_ms * MS)
    led.add_bubble(0, t, t + bubble)
    n = max(1, bubble // step)
    for k in range(n):
        a = t + k * step
        late = step // 4 if k == n - 1 and i % 10 == 0 else 0
        led.add_step(0, "fj", a, a + step + late, 1e9)
    return n + 1


def _time_totals(led: HarvestLedger, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        led.totals()
        led.totals(0)  # the agent's snapshot asks per stage, its status for all
        out.append(time.perf_counter() - t0)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    iterations = int(args.hours * 3600_000 / args.iteration_ms)
    checkpoints = sorted({max(1, int(iterations * f)) for f in (0.125, 0.25, 0.5, 1.0)})
    folding, held = HarvestLedger(), HarvestLedger.holding_all()
    rows = []
    records = 0
    add_s = {"folding": 0.0, "held": 0.0}
    done = 0
    for cp in checkpoints:
        for name, led in (("folding", folding), ("held", held)):
            t0 = time.perf_counter()
            n = 0
            for i in range(done, cp):
                n += _iteration(led, i, args)
            add_s[name] += time.perf_counter() - t0
        records += n
        done = cp
        f_t, h_t = _time_totals(folding, args.repeats), _time_totals(held, args.repeats)
        rows.append({"hours": round(cp * args.iteration_ms / 3600_000, 4), "records": records,
                     "held_folding": folding.held(), "held_all": held.held(),
                     "totals_ms_folding": [round(x * 1e3, 3) for x in f_t],
                     "totals_ms_held": [round(x * 1e3, 3) for x in h_t]})
        r = rows[-1]
        print(f"  {r['hours']:.3f} h: {records:,} records; totals() {statistics.median(f_t) * 1e3:.2f} ms folding "
              f"({folding.held():,} held) against {statistics.median(h_t) * 1e3:.1f} ms holding all", flush=True)
    same = folding.totals() == held.totals()
    return {"config": {k: getattr(args, k) for k in ("hours", "iteration_ms", "bubble_ms", "step_ms", "repeats")},
            "rows": rows, "add_us_per_record": {k: round(v / records * 1e6, 3) for k, v in add_s.items()},
            "totals_identical": same}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| uptime | records | held (folding) | `totals()` folding, ms | holding all, ms | ratio |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        f, h = r["totals_ms_folding"], r["totals_ms_held"]
        mf, mh = statistics.median(f), statistics.median(h)
        lines.append(f"| {r['hours'] * 60:.1f} min | {r['records']:,} | {r['held_folding']:,} | {mf:.2f} "
                     f"[{min(f):.2f}, {max(f):.2f}] | {mh:.1f} [{min(h):.1f}, {max(h):.1f}] | {mh / mf:.0f}x |")
    a = result["add_us_per_record"]
    lines.append(f"\nAdding a record: {a['folding']:.2f} us folding, {a['held']:.2f} us holding all (mean). "
                 f"Totals identical: {result['totals_identical']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hours", type=float, default=1.0, help="uptime replayed (default 1)")
    p.add_argument("--iteration-ms", type=float, default=220.0, help="training iteration (default 220, the H100 runs')")
    p.add_argument("--bubble-ms", type=float, default=40.0, help="one bubble per iteration (default 40)")
    p.add_argument("--step-ms", type=float, default=1.0, help="fill step (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="totals() calls timed per checkpoint (default 5)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    problems = []
    if not 0 < args.hours <= 48:
        problems.append(f"--hours must be in (0, 48], got {args.hours}")
    if not 0 < args.bubble_ms < args.iteration_ms:
        problems.append(f"--bubble-ms must be > 0 and below --iteration-ms ({args.iteration_ms}), got {args.bubble_ms}")
    if not 0 < args.step_ms <= args.bubble_ms:
        problems.append(f"--step-ms must be > 0 and at most --bubble-ms ({args.bubble_ms}), got {args.step_ms}")
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    if problems:
        p.error("; ".join(problems))
    result = run(args)
    print(markdown(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["totals_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
