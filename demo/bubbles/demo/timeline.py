"""The demo's timeline: a Gantt chart with one row per pipeline stage showing the training's compute,
its bubbles and the fill-job steps that ran in them, over a few iterations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bubbles.core.api import FillMode

COMPUTE_COLOR = "#3b6ea8"
BUBBLE_COLOR = "#f2c14e"
WAIT_COLOR = "#d9d9d9"
FILL_COLOR = "#3a9d5d"
OVERRUN_COLOR = "#d1495b"


def choose_window(rank0: Mapping[str, Any], mode: FillMode, iterations: int) -> tuple[int, int] | None:
    """(first_ns, last_ns) spanning ``iterations`` consecutive traced iterations of ``mode`` on stage 0,
    skipping the first two of the phase (the switch settles)."""
    trace = rank0.get("trace") or []
    phases = rank0["phase"]
    traced = sorted({ev[0] for ev in trace if ev[0] < len(phases) and phases[ev[0]] == mode.label})
    if not traced:
        return None
    picked = traced[2:2 + iterations] if len(traced) > 2 + iterations else traced[-iterations:]
    spans = [(ev[2], ev[3]) for ev in trace if ev[0] in picked]
    return min(s for s, _ in spans), max(e for _, e in spans)


def draw_timeline(ranks: Sequence[Mapping[str, Any]], agent_stats: Mapping[str, Any] | None, path: Path, *,
                  mode: FillMode = FillMode.HARVEST, iterations: int = 3, title: str | None = None,
                  breakdown: Mapping[str, Mapping[str, float]] | None = None) -> bool:
    """Write the PNG; return False (and write nothing) when the ranks carry no trace of ``mode``. ``breakdown``:
    the report's per-stage breakdown (``report["breakdown"]["by_stage"]``), computed from ``agent_stats`` if not
    given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from bubbles.demo.report import gpu_label

    ranks = sorted(ranks, key=lambda r: (r["stage"], r.get("stage_rank", 0)))
    window = choose_window(ranks[0], mode, iterations)
    if window is None:
        return False
    t0, t1 = window
    pad = (t1 - t0) * 0.02
    lo, hi = t0 - pad, t1 + pad

    def ms(t: float) -> float:
        return (t - t0) / 1e6

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 1.4 + 0.9 * len(ranks)), dpi=130,
                                 gridspec_kw={"width_ratios": [4, 1.2]})
    steps = (agent_stats or {}).get("steps", [])
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        compute, bubbles, waits = [], [], []
        for _, name, s, e, slot in rank.get("trace") or []:
            if e < lo or s > hi:
                continue
            seg = (ms(s), max(ms(e) - ms(s), 1e-3))
            if slot >= 0:
                bubbles.append(seg)
            elif name in ("ForwardPass", "BackwardPass", "OptimizerStep", "LoadMicroBatch"):
                compute.append(seg)
            else:
                waits.append(seg)
        ax.broken_barh(compute, (y + 0.45, 0.45), facecolors=COMPUTE_COLOR)
        ax.broken_barh(waits, (y + 0.45, 0.45), facecolors=WAIT_COLOR)  # over compute: a wait inside an instruction
        ax.broken_barh(bubbles, (y + 0.45, 0.45), facecolors=BUBBLE_COLOR)
        fills = [(ms(st["start_ns"]), max(ms(st["end_ns"]) - ms(st["start_ns"]), 1e-3)) for st in steps
                 if (st["stage"], st.get("rank", 0)) == (rank["stage"], rank.get("stage_rank", 0))
                 and st["end_ns"] >= lo and st["start_ns"] <= hi]
        ax.broken_barh(fills, (y + 0.05, 0.35), facecolors=FILL_COLOR)
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))])
    ax.set_yticklabels([f"stage {gpu_label(r)}" for r in ranks])
    ax.set_xlim(ms(lo), ms(hi))
    ax.set_xlabel("time (ms)")
    shape = f"{ranks[0]['stages']}-stage" + (f" x {ranks[0]['stage_ranks']}-rank"
                                             if int(ranks[0].get("stage_ranks", 1)) > 1 else "")
    ax.set_title(title or f"{shape} DeepSpeed pipeline on CPU, {mode.label} mode, {iterations} iterations")
    ax.legend(handles=[Patch(color=COMPUTE_COLOR, label="training compute"),
                       Patch(color=BUBBLE_COLOR, label="bubble (signalled)"),
                       Patch(color=WAIT_COLOR, label="other waits/comm"),
                       Patch(color=FILL_COLOR, label="fill-job step")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12), ncol=4,
              frameon=False)
    ax.grid(axis="x", alpha=0.3)
    if breakdown is None:
        from bubbles.demo.report import harvest_breakdown

        breakdown = harvest_breakdown(agent_stats, max(int(r.get("stage_ranks", 1)) for r in ranks))["by_stage"]
    _draw_breakdown(bx, ranks, breakdown)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


BREAKDOWN_COLORS = {"filled": FILL_COLOR, "guard": "#8e6bbf", "no_job": "#bdbdbd", "latency": "#e07b39",
                    "too_short": "#9e9e5e", "past_prediction": "#7fb3d5"}


def _draw_breakdown(ax: Any, ranks: Sequence[Mapping[str, Any]], by_stage: Mapping[str, Mapping[str, float]]) -> None:
    """Beside the timeline: one bar per GPU, its harvesting bubble time split by where it went."""
    from matplotlib.patches import Patch

    from bubbles.agent.ledger import BREAKDOWN
    from bubbles.demo.report import gpu_label

    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        d = by_stage.get(gpu_label(rank), {})
        total = d.get("bubble_s") or 0.0
        left = 0.0
        for key, _ in BREAKDOWN:
            share = d.get(key, 0.0) / total if total else 0.0
            ax.barh(y + 0.5, share * 100, left=left, height=0.6, color=BREAKDOWN_COLORS[key])
            if share >= 0.08:
                ax.text(left + share * 50, y + 0.5, f"{share:.0%}", ha="center", va="center", fontsize=7)
            left += share * 100
    ax.set_xlim(0, 100)
    ax.set_ylim(0, len(ranks))
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))])
    ax.set_yticklabels([f"stage {gpu_label(r)}" for r in ranks])
    ax.set_xlabel("% of all harvesting bubble time")
    ax.set_title("where the bubble time went (whole run)", fontsize=9)
    labels = {"filled": "filled", "guard": "guard", "no_job": "no job", "latency": "latency",
              "too_short": "too short", "past_prediction": "past prediction"}
    ax.legend(handles=[Patch(color=BREAKDOWN_COLORS[k], label=labels[k]) for k, _ in BREAKDOWN],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12), ncol=3, frameon=False,
              fontsize=7)
