"""The fill runtime's gates replayed on bubbles recorded on an H100: what share of the bubble time each gating policy
fills, and how much its steps overrun, for fill steps of a given length.

    .venv/bin/python benchmarks/gate_replay.py [--step-ms 1,2,4,8] [--risks 0,0.02,0.05,0.1] [--seeds 20]
    .venv/bin/python benchmarks/gate_replay.py --extract RUN_DIR... --out FILE   # a fixture from gpu_harvest runs

What is real: the bubbles (each harvest-phase bubble's slot and length as the agent recorded it, in order, from
``benchmarks/gpu_harvest.py`` on the H100; ``benchmarks/data/h100-bubbles-2026-11-24.json``), the shape of the fill
steps' durations (the same runs' in-bubble steps, device-synchronized) and the decisions:
``bubbles.training.gating.StepGates`` and ``TailRisk`` and the hook's prediction
(``bubbles.core.cycle.RecentLengths``: each slot's 10th percentile over its last
32 lengths), the code the runtime and the hook run. What is modelled: a step's duration is a draw from the recorded
ones scaled to a median of ``--step-ms`` (what a shorter step, such as a CUDA-graph replay, would take), independent
of the training; the first step of a bubble starts ``--latency-ms`` after it (0.7 ms: the recorded median over the
runs' first 15 s, before the clock drift fixed in 123a019 grew it), later ones ``--gap-ms`` after the last (0.17 ms,
the recorded median); the runtime learns of a bubble's end ``--end-lag-ms`` after it (0.3 ms: the p90 of a blocking
helper's wake-up under Python load at the hook's 200 us switch interval, benchmarks/gpu_event_wake.py on the H100),
and may start steps until then; an overrun is charged in full to the training (under MPS the training's kernels
share the SMs with the step's rather than wait, so it costs less). Not a measurement of a training: it says which
step length and which tail risk reach which fill on these bubbles, for the next GPU run to confirm.

Per policy: the share of the bubble time filled (median and the range over ``--seeds`` draws of the durations), the
share filled by steps the prediction did not allow (the tail's), the overrun per iteration (ms; as a share of the
recorded iteration when the fixture states one), and of the bubbles whose tails got steps, the share that ended
while one ran (what ``TailRisk``'s per-bubble bound estimates), over all draws.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubbles.core.cycle import RecentLengths
from bubbles.core.stats import percentile
from bubbles.training.gating import StepGates, TailRisk
from bubbles.training.sdk.profiling import INIT_PROFILE_STEPS, INIT_PROFILE_WARMUP, PROFILE_MARGIN

DATA = Path(__file__).resolve().parent / "data" / "h100-bubbles-2026-11-24.json"
PROFILE_ITERATIONS = 8  # the hook's profile: the prediction is seeded with this many iterations' lengths


@dataclass(frozen=True)
class Recorded:
    """One run's harvest bubbles (slot, length ns) in order and its fill steps' durations (ns)."""

    name: str
    bubbles: tuple[tuple[int, int], ...]
    durations_ns: tuple[int, ...]
    iteration_ns: int  # the run's median iteration while harvesting (0: unknown)


@dataclass(frozen=True)
class Outcome:
    filled: float  # share of the bubble time
    tail: float  # of it, what the steps the prediction did not allow filled (started on TailRisk's word)
    overrun_ms_per_iteration: float
    overruns: int
    steps: int
    tail_bubbles: int = 0  # bubbles in which such a step ran
    tail_overran: int = 0  # of those, the ones that ended while such a step ran (TailRisk bounds this share)


def replay(run: Recorded, *, step_ms: float, risk: float, seed: int, latency_ms: float = 0.7,
           gap_ms: float = 0.17, end_lag_ms: float = 0.3) -> Outcome:
    """One pass over the recorded bubbles with the runtime's gates (see the module doc). Pure, seeded."""
    rng = random.Random(seed)
    scale = step_ms * 1e6 / statistics.median(run.durations_ns)

    def draw() -> int:
        return max(1, int(rng.choice(run.durations_ns) * scale))

    # The runtime's profile at init: INIT_PROFILE_STEPS timed steps, the warm-up ones dropped, p90 times the margin.
    timed = [draw() for _ in range(INIT_PROFILE_STEPS)][INIT_PROFILE_WARMUP:]
    gates = StepGates([(None, percentile(timed, 90) * PROFILE_MARGIN / 1e9)])
    tail = TailRisk(risk) if risk > 0 else None
    slots = sorted({slot for slot, _ in run.bubbles})
    seeds = {slot: [n for s, n in run.bubbles[:PROFILE_ITERATIONS * len(slots)] if s == slot] for slot in slots}
    recent = RecentLengths({slot: v or [1] for slot, v in seeds.items()})
    latency_ns, gap_ns, lag_ns = int(latency_ms * 1e6), int(gap_ms * 1e6), int(end_lag_ms * 1e6)
    total = filled = tail_filled = overrun = 0
    overruns = steps = tail_bubbles = tail_overran = 0
    for slot, length in run.bubbles:
        total += length
        predicted = recent.predicted_ns(slot)
        t, ran, since, tailed = latency_ns, 0, None, False
        while t < length + lag_ns:  # the runtime learns of the end only when its END signal arrives
            first = ran == 0
            fits = gates.fitting(predicted - t, first)
            past = False
            if not fits and tail is not None:
                since = t if since is None else since
                fits = tail.fitting(slot, t, gates, first, since_ns=since)
                past = bool(fits)
            if not fits:
                break
            d = draw()
            inside = max(0, min(t + d, length) - t)
            filled += inside
            tail_filled += inside if past else 0
            tail_bubbles += past and not tailed
            tailed = tailed or past
            if t + d > length:
                overrun += t + d - length
                overruns += 1
                tail_overran += past
            gates.observe(None, first, d)
            steps += 1
            ran += 1
            t += d + gap_ns
        recent.add(slot, length)
        if tail is not None:
            tail.ended(slot, length)
            tail.end_lag(lag_ns)
    iterations = max(1, len(run.bubbles) // max(1, len(slots)))
    return Outcome(filled=filled / total if total else 0.0, tail=tail_filled / total if total else 0.0,
                   overrun_ms_per_iteration=overrun / 1e6 / iterations, overruns=overruns, steps=steps,
                   tail_bubbles=tail_bubbles, tail_overran=tail_overran)


def load(path: Path) -> list[Recorded]:
    """The fixture's runs; a missing or malformed file is an error that says what to do."""
    try:
        doc = json.loads(path.read_text())
        runs = [Recorded(name, tuple((int(s), int(n)) for s, n in r["bubbles"]),
                         tuple(int(d) for d in r["durations_ns"]), int(r.get("iteration_ns", 0)))
                for name, r in doc["runs"].items()]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"gate_replay: cannot read recorded bubbles from {path}: {exc}; make one with --extract "
                         "from benchmarks/gpu_harvest.py run directories") from None
    bad = [r.name for r in runs if not r.bubbles or not r.durations_ns or any(n <= 0 for _, n in r.bubbles)
           or any(d <= 0 for d in r.durations_ns)]
    if not runs or bad:
        raise SystemExit(f"gate_replay: {path} has runs without bubbles or step durations (or non-positive ones): "
                         f"{bad or 'no runs'}")
    return runs


def extract(dirs: Sequence[Path]) -> dict[str, Any]:
    """A fixture from gpu_harvest run directories (each with the agent's ``agent-stats.json``), named by directory."""
    runs: dict[str, Any] = {}
    for d in dirs:
        stats = json.loads((d / "agent-stats.json").read_text())
        bubbles = sorted((b for b in stats.get("bubbles", []) if b.get("mode") == "harvest"),
                         key=lambda b: b["start_ns"])
        steps = [s for s in stats.get("steps", []) if s.get("mode") == "harvest"]
        train = d / "train.json"
        iteration_ns = 0
        if train.exists():  # the training's record: an iteration time and the phase it ran in, per iteration
            t = json.loads(train.read_text())
            times = [s for s, ph in zip(t.get("iteration_s", []), t.get("phase", []), strict=False) if ph == "harvest"]
            iteration_ns = int(statistics.median(times) * 1e9) if times else 0
        runs[d.name] = {"bubbles": [[b["slot"], b["end_ns"] - b["start_ns"]] for b in bubbles
                                    if b["end_ns"] > b["start_ns"]],
                        "durations_ns": [s["end_ns"] - s["start_ns"] for s in steps if s["end_ns"] > s["start_ns"]],
                        "iteration_ns": iteration_ns}
    return {"source": "the harvest phases of benchmarks/gpu_harvest.py runs (agent-stats.json): bubble slot and "
                      "length in order, fill-step durations", "runs": runs}


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v >= 0 for v in values):  # NaN fails too
        raise SystemExit(f"gate_replay: {what} takes comma-separated numbers >= 0, e.g. 1,2,4; got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="recorded bubbles (default: the H100 runs)")
    p.add_argument("--step-ms", default="1,2,4,8", help="median fill-step lengths to replay, ms")
    p.add_argument("--risks", default="0,0.02,0.05,0.1",
                   help="TailRisk's max_risk per policy; 0: steps only where the prediction allows them")
    p.add_argument("--seeds", type=int, default=20, help="draws of the step durations per policy")
    p.add_argument("--latency-ms", type=float, default=0.7, help="bubble start to its first step")
    p.add_argument("--gap-ms", type=float, default=0.17, help="one step's end to the next one's start")
    p.add_argument("--end-lag-ms", type=float, default=0.3,
                   help="a bubble's end to its END signal's arrival: until then steps may still start")
    p.add_argument("--extract", type=Path, nargs="+", metavar="RUN_DIR",
                   help="write a fixture from these gpu_harvest run directories to --out instead of replaying")
    p.add_argument("--out", type=Path, help="with --extract: the fixture; else the results as JSON")
    args = p.parse_args(argv)
    if args.extract:
        if not args.out:
            raise SystemExit("gate_replay: --extract needs --out FILE for the fixture")
        args.out.write_text(json.dumps(extract(args.extract)) + "\n")
        print(f"wrote {args.out}")
        return 0
    steps_ms = _floats(args.step_ms, "--step-ms")
    risks = _floats(args.risks, "--risks")
    if any(s == 0 for s in steps_ms) or any(r >= 0.5 for r in risks):
        raise SystemExit("gate_replay: --step-ms must be > 0 and --risks below 0.5")
    if args.seeds < 1 or not args.latency_ms >= 0 or not args.gap_ms >= 0 or not args.end_lag_ms >= 0:
        raise SystemExit("gate_replay: --seeds must be >= 1, --latency-ms, --gap-ms and --end-lag-ms >= 0")
    runs = load(args.data)
    results = []
    print("| recorded run | step (median) | tail risk | filled (range over seeds) | of it past the prediction | "
          "overrun per iteration | overruns per 100 steps | tail bubbles that overran |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run in runs:
        for step_ms in steps_ms:
            for risk in risks:
                outs = [replay(run, step_ms=step_ms, risk=risk, seed=k, latency_ms=args.latency_ms,
                               gap_ms=args.gap_ms, end_lag_ms=args.end_lag_ms) for k in range(args.seeds)]
                fill = sorted(o.filled for o in outs)
                over = statistics.median(o.overrun_ms_per_iteration for o in outs)
                per100 = statistics.median(100 * o.overruns / max(1, o.steps) for o in outs)
                tailed = sum(o.tail_bubbles for o in outs)
                tail_share = sum(o.tail_overran for o in outs) / tailed if tailed else None
                share = f" ({over * 1e6 / run.iteration_ns:.2%})" if run.iteration_ns else ""
                row = {"run": run.name, "step_ms": step_ms, "risk": risk, "filled_median": statistics.median(fill),
                       "filled_range": [fill[0], fill[-1]], "tail_median": statistics.median(o.tail for o in outs),
                       "overrun_ms_per_iteration": over, "overruns_per_100_steps": per100,
                       "tail_bubbles": tailed, "tail_bubbles_overran_share": tail_share}
                results.append(row)
                print(f"| {run.name} | {step_ms:g} ms | {risk:g} | {row['filled_median']:.1%} "
                      f"[{fill[0]:.1%}, {fill[-1]:.1%}] | {row['tail_median']:.1%} | {over:.2f} ms{share} | "
                      f"{per100:.1f} | {'—' if tail_share is None else f'{tail_share:.1%} of {tailed}'} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "seeds": args.seeds, "latency_ms": args.latency_ms,
                                        "gap_ms": args.gap_ms, "end_lag_ms": args.end_lag_ms,
                                        "data": str(args.data)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
