"""Run `bubbles demo` several times and tabulate what each run reports (docs/benchmarks.md's five-run table).

    .venv/bin/python benchmarks/demo_runs.py --runs 5 --out out/demo-runs
    .venv/bin/python benchmarks/demo_runs.py --runs 1 --busy-core 1 --out out/demo-busy   # a core kept busy
    .venv/bin/python benchmarks/demo_runs.py --runs 6 --tail-risks 0,0.1 --out out/demo-tail  # A/B, in turn

Each run is a fresh `bubbles demo` process with the default flags (6 rounds of baseline, naive and harvest); its
report's figures over rounds (median and 95% interval) go in one row. ``--busy-core K`` keeps core K busy with an
unrelated process (a Python spin loop pinned to it) for the whole run. The table says per run whether the demo met
the harvesting issue's bar: at least 40% of bubble time filled, and a training slowdown at most a sixth of naive
co-location's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bubbles.core import control
from bubbles.training.sdk.env import tail_risk


def spin_on(core: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(proc.pid, {core})
    return proc


def one_run(out: Path, k: int, busy_core: int | None, tail_risk: str | None = None,
            clipping: str | None = None) -> dict[str, Any]:
    report = out / f"report-{k}.json"
    busy = spin_on(busy_core) if busy_core is not None else None
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "bubbles.cli", "demo", "--report", str(report),
                               "--workdir", str(out / f"run-{k}"), "--timeline", str(out / f"timeline-{k}.png"),
                               *(["--gradient-clipping", clipping] if clipping else [])],
                              capture_output=True, text=True, timeout=1800,
                              env={**os.environ, **({control.TAIL_RISK_ENV: tail_risk} if tail_risk else {})})
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    (out / f"stdout-{k}.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"run {k} failed ({proc.returncode}); see {out / f'stdout-{k}.txt'}")
    r = json.loads(report.read_text())
    r["wall_s"] = time.monotonic() - t0
    r["tail_risk"] = tail_risk or "default"
    r["clipping"] = clipping or "default"
    return r


def row(k: int, r: dict[str, Any]) -> tuple[str, bool]:
    o = r["over_rounds"]

    def fig(key: str, signed: bool = True) -> str:
        f = o[key]
        if f["median"] is None:
            return "-"
        fmt = "{:+.1%}" if signed else "{:.1%}"
        iv = f" [{fmt.format(f['interval'][0])}, {fmt.format(f['interval'][1])}]" if f["interval"] else ""
        return fmt.format(f["median"]) + iv

    filled = o["harvest_filled_share"]["median"] or 0.0
    harvest, naive = o["harvest_slowdown"]["median"], o["naive_slowdown"]["median"]
    met = filled >= 0.40 and harvest is not None and naive is not None and naive > 0 and harvest <= naive / 6
    b = r["breakdown"]["all"]
    total = b["bubble_s"] or 1.0
    where = ", ".join(f"{k} {b[k] / total:.0%}" for k in ("guard", "no_job", "latency", "too_short",
                                                          "past_prediction") if b.get(k))
    if b.get("tail_s"):
        where += f"; tail steps filled {b['tail_s'] / total:.1%}, overran {b.get('tail_overrun_s', 0.0) * 1e3:.1f} ms"
    probes = r["guard"].get("probes") or {}
    ratio = r.get("bubble_ratio", {}).get("signalled", {})
    bubbles = ", ".join(f"{100 * v:.1f}%" if v is not None else "-" for v in ratio.values())
    return (f"| {k} | {r.get('tail_risk', 'default')} | {r.get('clipping', 'default')} | {bubbles} | "
            f"{fig('harvest_filled_share', signed=False)} | "
            f"{fig('harvest_slowdown')} | "
            f"{fig('naive_slowdown')} | {o['harvest_verdict'].split(':')[0]} | "
            f"{'yes' if o['noise']['noisy'] else 'no'} | {(r['guard'].get('share') or 0):.2f} "
            f"({sum(probes.values())} probes) | {where} | {'met' if met else 'not met'} | {r['wall_s']:.0f} s |",
            met)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--busy-core", type=int, help="keep this core busy with an unrelated process during each run")
    p.add_argument("--out", type=Path, default=Path("out/demo-runs"))
    p.add_argument("--tail-risks", default="",
                   help="comma-separated $BUBBLES_TAIL_RISK values the runs take in turn (an A/B comparison), e.g. "
                        "0,0.1; empty: the default")
    p.add_argument("--gradient-clippings", default="",
                   help="comma-separated --gradient-clipping values of the demo's training, taken in turn (an A/B "
                        "comparison), e.g. 1.0,0; empty: the demo's default (1.0)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs {args.runs}: use 1 or more")
    risks = [v.strip() for v in args.tail_risks.split(",") if v.strip()]
    for v in risks:
        try:
            tail_risk(v)
        except ValueError as exc:
            p.error(f"--tail-risks: {exc}")
    clippings = [v.strip() for v in args.gradient_clippings.split(",") if v.strip()]
    for v in clippings:
        try:
            ok = float(v) >= 0
        except ValueError:
            ok = False
        if not ok:
            p.error(f"--gradient-clippings: {v!r} is not a max gradient norm >= 0 (0 turns clipping off)")
    if args.busy_core is not None and args.busy_core not in os.sched_getaffinity(0):
        p.error(f"--busy-core {args.busy_core}: this process may use cores {sorted(os.sched_getaffinity(0))}")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["| run | tail risk | clipping | signalled bubbles per stage | bubble time filled | harvest slowdown "
             "| naive slowdown | verdict | noisy | guard share | where the rest went | bar | wall |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: |"]
    met = 0
    for k in range(1, args.runs + 1):
        print(f"run {k}/{args.runs} ...", file=sys.stderr, flush=True)
        text, ok = row(k, one_run(args.out, k, args.busy_core, risks[(k - 1) % len(risks)] if risks else None,
                                  clippings[(k - 1) % len(clippings)] if clippings else None))
        met += ok
        lines.append(text)
        print(text, flush=True)
    lines.append(f"\nbar met in {met} of {args.runs} runs")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
