"""The demo's report: pure functions from the training ranks' records and the agent's stats to the
JSON report and the short human summary. No processes, no files: the CLI does the I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bubbles.agent.ledger import BREAKDOWN, bubble_breakdown, filled_share, mode_records
from bubbles.core.api import FillMode
from bubbles.core.cycle import BubbleCycle, theoretical_bubble_ratio
from bubbles.core.stats import median_interval, percentile
from bubbles.demo.orchestrate.phases import iteration_times_by_mode, iterations_by_round

# The report's name of each fill mode (its key in ``modes``): OFF is the baseline the other two are compared with.
MODE_NAMES = {FillMode.OFF: "baseline", FillMode.NAIVE: "naive", FillMode.HARVEST: "harvest"}
# The machine was noisy: the baseline moved more than this within a round (median over rounds) or between rounds,
# or other processes took more than this share of its CPU time during the run. Idle runs on the project's 2-core VM:
# 5-9% within, 4-15% between, other processes under 5% (docs/benchmarks.md).
NOISY_WITHIN = 0.15
NOISY_BETWEEN = 0.25
NOISY_OTHER_CPU = 0.15
FILL_FIELDS = ("fill_steps", "fill_flops", "bubble_s", "filled_s", "overruns", "overrun_s", "overrun_p99_ms",
               "max_overrun_ms")




def build_report(ranks: Sequence[Mapping[str, Any]], agent_stats: Mapping[str, Any] | None, *,
                 settle: int = 2, machine: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Assemble the demo report (docs/demo.md: `bubbles demo --report`). ``machine``: what else used the CPU
    (``machine_load``), when known."""
    if not ranks:
        raise ValueError("no training ranks reported")
    ranks = sorted(ranks, key=lambda r: (r["stage"], r.get("stage_rank", 0)))
    stages = int(ranks[0]["stages"])
    microbatches = int(ranks[0]["microbatches"])
    # Every stage ends each iteration in the same all-reduce, so their iteration times agree; the first
    # stage's are the reference.
    by_mode = iteration_times_by_mode(ranks[0], settle)
    measured: dict[str, float | None] = {}
    signalled: dict[str, float | None] = {}
    for r in ranks:  # with several ranks per stage, keyed by GPU ("<stage>/rank-<r>"), else by stage
        cycle = BubbleCycle.from_dict(r["cycle"]) if r.get("cycle") else None
        measured[gpu_label(r)] = cycle.idle_ratio if cycle else None
        signalled[gpu_label(r)] = cycle.bubble_ratio if cycle else None
    agent_modes = (agent_stats or {}).get("modes", {})
    baseline = _median(by_mode.get(FillMode.OFF, []))
    modes: dict[str, dict[str, Any]] = {}
    for mode, name in MODE_NAMES.items():
        times = by_mode.get(mode, [])
        fill = agent_modes.get(mode.label, {})  # the agent's stats key its modes by label
        med = _median(times)
        entry: dict[str, Any] = {
            "iterations": len(times),
            "main_iteration_s": med,
            "main_iteration_p90_s": _quantile(times, 0.9),
            "slowdown": (med / baseline - 1.0) if (med is not None and baseline) else None,
        }
        for f in FILL_FIELDS:
            entry[f] = fill.get(f, 0)
        entry["filled_share"] = (entry["filled_s"] / entry["bubble_s"]) if entry["bubble_s"] else 0.0
        modes[name] = entry
    guard = (agent_stats or {}).get("guard", {})
    figures = round_figures(ranks[0], agent_stats, settle)
    rounds = over_rounds(figures)
    if machine is not None:
        rounds["noise"]["other_cpu_share"] = machine["other_cpu_share"]
        rounds["noise"]["noisy"] = rounds["noise"]["noisy"] or machine["other_cpu_share"] > NOISY_OTHER_CPU
    return {
        "rounds": figures,
        "over_rounds": rounds,
        "machine": dict(machine) if machine is not None else None,
        "breakdown": harvest_breakdown(agent_stats, max(int(r.get("stage_ranks", 1)) for r in ranks)),
        "gpus": per_gpu(ranks, agent_stats),
        "stages": stages,
        "ranks_per_stage": max(int(r.get("stage_ranks", 1)) for r in ranks),
        "microbatches": microbatches,
        "iterations": len(ranks[0]["iteration_s"]),
        # measured: every wait of the stage; signalled: the waits long enough to be offered to fill jobs.
        "bubble_ratio": {"measured": measured, "signalled": signalled,
                         "theory": theoretical_bubble_ratio(stages, microbatches)},
        "modes": modes,
        "guard": {
            "budget": (agent_stats or {}).get("budget"),
            "share": guard.get("share"),
            "slowdown_held": guard.get("slowdown_held"),
            "baseline_s": guard.get("baseline_s"),
            "probes": guard.get("probes", {}),
        },
        "jobs": (agent_stats or {}).get("jobs", []),
        "losses_identical_across_stages": len({tuple(r["losses"]) for r in ranks}) == 1,
    }


def label(stage: int, rank: int, ranks: int) -> str:
    """The report's name of a GPU: its stage alone where the stage has one rank, else ``<stage>/rank-<r>``."""
    return str(stage) if ranks == 1 else f"{stage}/rank-{rank}"


def gpu_label(record: Mapping[str, Any]) -> str:
    """``label`` of a rank record's GPU."""
    return label(int(record["stage"]), int(record.get("stage_rank", 0)), int(record.get("stage_ranks", 1)))


def per_gpu(ranks: Sequence[Mapping[str, Any]], agent_stats: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Each GPU (a core on CPU) of the training with its bubbles and the fill work in them while harvesting: its
    stage and rank, the share of the iteration it waits and the share signalled as bubbles, the harvesting
    bubbles' time, the part of it fill steps used, and the steps and FLOPs of the fill jobs that ran there."""
    bubbles, steps = _harvest_records(agent_stats)
    out = []
    for r in ranks:
        stage, rank = int(r["stage"]), int(r.get("stage_rank", 0))
        cycle = BubbleCycle.from_dict(r["cycle"]) if r.get("cycle") else None
        mine_b = [b for b in bubbles if int(b["stage"]) == stage and int(b.get("rank", 0)) == rank]
        mine_s = [st for st in steps if int(st["stage"]) == stage and int(st.get("rank", 0)) == rank]
        d = bubble_breakdown(mine_b, mine_s)
        jobs = [j for j in (agent_stats or {}).get("jobs", [])
                if int(j.get("stage", -1)) == stage and int(j.get("rank", 0)) == rank]
        out.append({"gpu": gpu_label(r), "stage": stage, "rank": rank, "process": r.get("rank"),
                    "waits": cycle.idle_ratio if cycle else None, "signalled": cycle.bubble_ratio if cycle else None,
                    "bubble_s": d.get("bubble_s", 0.0), "filled_s": d.get("filled", 0.0),
                    "fill_steps": len(mine_s), "jobs": sorted(str(j.get("name")) for j in jobs)})
    return out


def _harvest_records(agent_stats: Mapping[str, Any] | None) -> tuple[list[Any], list[Any]]:
    """The agent's bubble and step records of harvest mode."""
    return mode_records(agent_stats, FillMode.HARVEST.label)


def round_figures(rank0: Mapping[str, Any], agent_stats: Mapping[str, Any] | None,
                  settle: int) -> list[dict[str, float]]:
    """Each round's figures, measured against that round's own baseline: ``baseline_s`` (its median iteration),
    ``baseline_spread`` (p90 / p10 - 1 of those iterations), ``naive_slowdown``, ``harvest_slowdown`` and
    ``harvest_filled_share`` (from the agent's records of the round's harvesting iterations)."""
    times: Sequence[float] = rank0["iteration_s"]
    ends: Sequence[int] | None = rank0.get("iteration_end_ns")
    bubbles, steps = _harvest_records(agent_stats)
    out = []
    for r in iterations_by_round(rank0, settle):
        base_times = [times[i] for i in r.get(FillMode.OFF, [])]
        if not base_times:
            continue
        base = percentile(base_times, 50)
        fig = {"baseline_s": base, "baseline_spread": percentile(base_times, 90) / percentile(base_times, 10) - 1}
        for mode in (FillMode.NAIVE, FillMode.HARVEST):
            idx = r.get(mode, [])
            if idx:
                fig[f"{MODE_NAMES[mode]}_slowdown"] = percentile([times[i] for i in idx], 50) / base - 1
        idx = r.get(FillMode.HARVEST, [])
        if idx and ends and len(ends) == len(times):
            share = filled_share(bubbles, steps, ends[idx[0]] - int(times[idx[0]] * 1e9), ends[idx[-1]])
            if share is not None:
                fig["harvest_filled_share"] = share
        out.append(fig)
    return out


def over_rounds(figures: Sequence[Mapping[str, float]], confidence: float = 0.95) -> dict[str, Any]:
    """Each figure's median over the rounds with a distribution-free ``confidence`` interval (None with fewer than 6
    rounds), a verdict on the harvesting slowdown, and whether the machine was noisy."""
    out: dict[str, Any] = {"rounds": len(figures)}
    for key in ("baseline_s", "naive_slowdown", "harvest_slowdown", "harvest_filled_share"):
        xs = [f[key] for f in figures if f.get(key) is not None]
        out[key] = {"median": percentile(xs, 50) if xs else None,
                    "interval": median_interval(xs, confidence) if xs else None, "rounds": len(xs)}
    h = out["harvest_slowdown"]
    if h["median"] is None:
        verdict = "no harvesting rounds"
    elif h["interval"] is None:
        verdict = f"inconclusive: {h['rounds']} rounds are too few for a 95% interval (6 or more: --repeats)"
    elif h["interval"][0] > 0:
        verdict = "slower: the whole interval is above 0"
    elif h["interval"][1] < 0:
        verdict = ("inconclusive: every harvesting round ran faster than its baseline, which fill work cannot "
                   "cause: the machine drifted between phases")
    else:
        verdict = "no measurable slowdown: the interval includes 0"
    out["harvest_verdict"] = verdict
    spreads = [f["baseline_spread"] for f in figures]
    bases = [f["baseline_s"] for f in figures]
    within = percentile(spreads, 50) if spreads else 0.0
    between = max(bases) / min(bases) - 1 if bases else 0.0
    out["noise"] = {"baseline_spread_within_rounds": within, "baseline_spread_between_rounds": between,
                    "noisy": within > NOISY_WITHIN or between > NOISY_BETWEEN}
    return out


def harvest_breakdown(agent_stats: Mapping[str, Any] | None, ranks: int = 1) -> dict[str, Any]:
    """Where the harvesting bubbles' time went (``ledger.bubble_breakdown``), in all and per GPU (``by_stage``,
    keyed by ``label``: the stage where each has one rank; ``ranks`` per stage)."""
    bubbles, steps = _harvest_records(agent_stats)
    gpus = sorted({(int(b["stage"]), int(b.get("rank", 0))) for b in bubbles})

    def on(records: list[Any], gpu: tuple[int, int]) -> list[Any]:
        return [x for x in records if (int(x["stage"]), int(x.get("rank", 0))) == gpu]

    return {"all": bubble_breakdown(bubbles, steps),
            "by_stage": {label(k, r, ranks): bubble_breakdown(on(bubbles, (k, r)), on(steps, (k, r)))
                         for k, r in gpus}}


def format_breakdown(d: Mapping[str, float]) -> str:
    """``filled 38.0%, withheld by the guard 4.1%, ...`` of the bubble time; the overrun after it."""
    total = d.get("bubble_s") or 0.0
    if not total:
        return "no harvesting bubbles recorded"
    short = {"filled": "filled", "guard": "withheld by the guard", "no_job": "no job armed",
             "latency": "signal/resume latency", "too_short": "too short for a step",
             "past_prediction": "past the predicted end"}
    parts = [f"{short[k]} {d[k] / total:.1%}" for k, _ in BREAKDOWN if d.get(k)]
    tail = (f" (steps the prediction did not allow, started on the tail's risk, filled {d['tail_s'] / total:.1%} "
            f"and overran by {d.get('tail_overrun_s', 0.0) * 1e3:.1f} ms)") \
        if d.get("tail_s") or d.get("tail_overrun_s") else ""
    return (f"{', '.join(parts)} of {total * 1e3:.0f} ms; fill steps overran their bubbles by "
            f"{d.get('overrun_s', 0.0) * 1e3:.1f} ms in all{tail}")


def format_summary(report: Mapping[str, Any]) -> str:
    """A short human summary of the report."""
    lines = [
        f"bubbles demo: {report['stages']} stages, {report['microbatches']} micro-batches, "
        f"{report['iterations']} iterations on CPU (gloo)",
        "bubble ratio per stage: "
        + ", ".join(f"stage {s}: {_pct(v)}" for s, v in report["bubble_ratio"]["measured"].items())
        + f"  (ideal (p-1)/(m+p-1) = {_pct(report['bubble_ratio']['theory'])}); signalled as bubbles: "
        + ", ".join(f"{_pct(v)}" for v in report["bubble_ratio"]["signalled"].values()),
        "",
        f"{'mode':<10}{'iteration':>12}{'slowdown':>10}{'fill steps':>12}{'GFLOP':>10}"
        f"{'bubble filled':>15}{'overruns':>10}{'p99 ms':>9}",
    ]
    for name, m in report["modes"].items():
        it = f"{m['main_iteration_s'] * 1000:.1f} ms" if m["main_iteration_s"] else "-"
        slow = "-" if name == MODE_NAMES[FillMode.OFF] or m["slowdown"] is None else f"{m['slowdown'] * 100:+.1f}%"
        filled = f"{_pct(m['filled_share'])}" if m["bubble_s"] else "-"
        lines.append(f"{name:<10}{it:>12}{slow:>10}{m['fill_steps']:>12}{m['fill_flops'] / 1e9:>10.2f}"
                     f"{filled:>15}{m['overruns']:>10}{m['overrun_p99_ms']:>9.2f}")
    g = report["guard"]
    if g.get("budget") is not None:
        held = g.get("slowdown_held")
        lines += ["", f"slowdown guard: budget {g['budget'] * 100:.1f}%, settled share "
                  f"{(g.get('share') or 0) * 100:.0f}% of each bubble, slowdown held "
                  + ("-" if held is None else f"{held * 100:+.1f}%")]
    if report.get("over_rounds", {}).get("rounds"):
        lines += ["", *format_rounds(report["over_rounds"])]
    if report.get("breakdown", {}).get("all", {}).get("bubble_s"):
        lines.append("where the harvesting bubbles' time went: " + format_breakdown(report["breakdown"]["all"]))
    if report.get("ranks_per_stage", 1) > 1:
        lines += ["", f"{'GPU':<16}{'waits':>8}{'signalled':>11}{'bubbles':>10}{'filled':>9}"
                  f"{'fill steps':>12}  fill jobs"]
        for g in report["gpus"]:
            filled = _pct(g["filled_s"] / g["bubble_s"]) if g["bubble_s"] else "-"
            lines.append(f"{'stage ' + g['gpu']:<16}{_pct(g['waits']):>8}{_pct(g['signalled']):>11}"
                         f"{g['bubble_s'] * 1e3:>8.0f}ms{filled:>9}{g['fill_steps']:>12}  {', '.join(g['jobs'])}")
    naive, harvest = report["modes"][MODE_NAMES[FillMode.NAIVE]], report["modes"][MODE_NAMES[FillMode.HARVEST]]
    if naive["slowdown"] is not None and harvest["slowdown"] is not None:
        lines.append(f"harvesting vs naive co-location: training slowdown {harvest['slowdown'] * 100:+.1f}% "
                     f"vs {naive['slowdown'] * 100:+.1f}%, fill steps {harvest['fill_steps']} vs "
                     f"{naive['fill_steps']}")
    return "\n".join(lines)


def format_rounds(o: Mapping[str, Any]) -> list[str]:
    """The over-rounds figures as lines: median, 95% interval, verdict, noise."""
    def fmt(v: float, unit: str) -> str:
        return {"ms": f"{v * 1e3:.1f} ms", "signed": f"{v * 100:+.1f}%", "share": f"{v * 100:.1f}%"}[unit]

    def figure(key: str, unit: str = "signed") -> str:
        f = o[key]
        if f["median"] is None:
            return "-"
        interval = (f" (95% interval {fmt(f['interval'][0], unit)} to {fmt(f['interval'][1], unit)})"
                    if f["interval"] else " (no 95% interval: fewer than 6 rounds)")
        return fmt(f["median"], unit) + interval

    h = o["harvest_slowdown"]
    slow = figure("harvest_slowdown")
    if h["median"] is not None and h["median"] < 0 and "inconclusive" not in o["harvest_verdict"]:
        slow = "none measurable; " + slow  # a negative median the interval does not support is not a speed-up
    lines = [f"over {o['rounds']} rounds (each mode against its own round's baseline; median and 95% interval):",
             f"  baseline iteration {figure('baseline_s', 'ms')}",
             f"  naive co-location slows the training {figure('naive_slowdown')}",
             f"  harvesting slows the training {slow}: {o['harvest_verdict']}",
             f"  harvesting fills {figure('harvest_filled_share', 'share')} of the bubble time"]
    n, naive = o["noise"], o["naive_slowdown"]["median"]
    if naive and h["median"] is not None and naive > 0:
        lines.append(f"  harvesting costs the training {max(h['median'], 0) / naive:.0%} of what naive co-location "
                     "costs it")
    if n["noisy"]:
        other = n.get("other_cpu_share")
        busy = f", other processes took {other:.0%} of its CPU time" if other is not None else ""
        lines.append(f"  the machine was noisy: the baseline moved {n['baseline_spread_within_rounds']:.0%} within and "
                     f"{n['baseline_spread_between_rounds']:.0%} between rounds{busy}: these figures are less certain "
                     "than their intervals say")
    return lines


def machine_load(busy_s: float, own_cpu_s: float, wall_s: float, cpus: int) -> dict[str, float]:
    """What share of the machine's CPU time went to processes other than the demo's: ``busy_s`` of the machine (all
    CPUs, /proc/stat) and ``own_cpu_s`` of the demo's processes over ``wall_s``."""
    capacity = wall_s * cpus
    other = max(0.0, busy_s - own_cpu_s)
    return {"busy_cpu_s": busy_s, "demo_cpu_s": own_cpu_s, "wall_s": wall_s, "cpus": cpus,
            "other_cpu_share": other / capacity if capacity > 0 else 0.0}


def _median(xs: Sequence[float]) -> float | None:
    return percentile(xs, 50) if xs else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    return percentile(xs, 100 * q) if xs else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"
