"""The demo's report: pure functions from the training ranks' records and the agent's stats to the
JSON report and the short human summary. No processes, no files: the CLI does the I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bubbles.api import FillMode
from bubbles.cycle import BubbleCycle, theoretical_bubble_ratio
from bubbles.orchestrate.phases import iteration_times_by_mode
from bubbles.stats import percentile

# The report's name of each fill mode (its key in ``modes``): OFF is the baseline the other two are compared with.
MODE_NAMES = {FillMode.OFF: "baseline", FillMode.NAIVE: "naive", FillMode.HARVEST: "harvest"}
FILL_FIELDS = ("fill_steps", "fill_flops", "bubble_s", "filled_s", "overruns", "overrun_s", "overrun_p99_ms",
               "max_overrun_ms")




def build_report(ranks: Sequence[Mapping[str, Any]], agent_stats: Mapping[str, Any] | None, *,
                 settle: int = 2) -> dict[str, Any]:
    """Assemble the demo report (see README: `bubbles demo --report`)."""
    if not ranks:
        raise ValueError("no training ranks reported")
    ranks = sorted(ranks, key=lambda r: r["stage"])
    stages = int(ranks[0]["stages"])
    microbatches = int(ranks[0]["microbatches"])
    # Every stage ends each iteration in the same all-reduce, so their iteration times agree; the first
    # stage's are the reference.
    by_mode = iteration_times_by_mode(ranks[0], settle)
    measured: dict[str, float | None] = {}
    signalled: dict[str, float | None] = {}
    for r in ranks:
        cycle = BubbleCycle.from_dict(r["cycle"]) if r.get("cycle") else None
        measured[str(r["stage"])] = cycle.idle_ratio if cycle else None
        signalled[str(r["stage"])] = cycle.bubble_ratio if cycle else None
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
    return {
        "stages": stages,
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
        },
        "jobs": (agent_stats or {}).get("jobs", []),
        "losses_identical_across_stages": len({tuple(r["losses"]) for r in ranks}) == 1,
    }


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
    naive, harvest = report["modes"][MODE_NAMES[FillMode.NAIVE]], report["modes"][MODE_NAMES[FillMode.HARVEST]]
    if naive["slowdown"] is not None and harvest["slowdown"] is not None:
        lines.append(f"harvesting vs naive co-location: training slowdown {harvest['slowdown'] * 100:+.1f}% "
                     f"vs {naive['slowdown'] * 100:+.1f}%, fill steps {harvest['fill_steps']} vs "
                     f"{naive['fill_steps']}")
    return "\n".join(lines)


def _median(xs: Sequence[float]) -> float | None:
    return percentile(xs, 50) if xs else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    return percentile(xs, 100 * q) if xs else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"
