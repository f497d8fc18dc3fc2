"""The one-GPU benchmark's report: pure functions from the runs' records to the regimes' figures, the markdown
table and the chart. No processes: ``gpubench.run`` does the I/O.

Per regime (a fill job under one fill mode and one isolation, against the baseline phases of the same run):

- slowdown I (FreeRide's time increase): median iteration time / baseline median - 1; also at the p99; and per
  round (a pass over the modes: each round's mode against the same round's baseline), with a distribution-free
  95% interval for its median over rounds (``stats.median_interval``; 6 rounds or more, ``--repeats``);
- fill throughput: the fill job's samples per second of the regime's wall time;
- recovered TFLOPS: the fill job's FLOPs per second of the regime's wall time;
- share of bubble time filled: the agent's ledger, fill-step time inside bubbles / bubble time; also per round
  (the agent's records within each phase of the mode), with the same interval;
- overruns past bubble end: count and p99 (ms) from the same ledger;
- cost savings S (FreeRide, appendix A.3) with C_no = P_I T_no, C_with = P_I T_with and
  C_side = P_II W / Th_II, W the fill samples done while co-located and Th_II the job's samples per second
  alone on the device (measured in the same run); per training iteration, so the run's length cancels:
  S = (P_II thr t_with / Th_II - P_I (t_with - t_no)) / (P_I t_no), thr the co-located fill throughput.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bubbles.agent.ledger import BREAKDOWN, bubble_breakdown, filled_share, mode_records
from bubbles.core.api import FillMode
from bubbles.core.stats import median_interval, percentile
from bubbles.demo.orchestrate.phases import COMPARED_MODES, iteration_times_by_mode, iterations_by_round
from gpubench.clocks import clocks_by_mode
from gpubench.clocks import describe as describe_clocks

MAX_SLOWDOWN = 0.005  # issue 14's goal: at most 0.5% slower training ...
MIN_FILL_SHARE = 0.70  # ... while filling at least 70% of bubble time (FreeRide 1.1%, PipeFill < 2% at 68%)
BASELINE = "baseline"  # the regime name of the OFF phases, whatever the isolation
REGIME_NAMES = {  # (fill mode, isolation) -> regime name
    (FillMode.NAIVE, "contexts"): "naive co-location",
    (FillMode.NAIVE, "mps"): "MPS only",
    (FillMode.HARVEST, "contexts"): "harvesting (contexts)",
    (FillMode.HARVEST, "mps"): "harvesting (MPS)",
}
REGIME_ORDER = (BASELINE, "naive co-location", "MPS only", "harvesting (contexts)", "harvesting (MPS)")


def cost_savings(*, t_no_s: float, t_with_s: float, fill_per_s: float, solo_per_s: float,
                 price_training: float, price_fill: float) -> float | None:
    """FreeRide's S per training iteration (see the module docstring); None when a term is unknown."""
    if not (t_no_s > 0 and solo_per_s > 0 and price_training > 0) or any(
            not math.isfinite(x) for x in (t_no_s, t_with_s, fill_per_s, solo_per_s, price_fill)):
        return None
    c_no = price_training * t_no_s
    c_extra = price_training * (t_with_s - t_no_s)
    c_side = price_fill * fill_per_s * t_with_s / solo_per_s
    return (c_side - c_extra) / c_no


def phase_wall_s(record: Mapping[str, Any]) -> dict[FillMode, float]:
    """Wall time per fill mode, summed over the run's phases of that mode (the record's ``phases[].mode`` is a
    FillMode label)."""
    out: dict[FillMode, float] = {}
    for i, ph in enumerate(record.get("phases", [])):
        mode = FillMode.parse(ph["mode"], f"phases[{i}].mode")
        out[mode] = out.get(mode, 0.0) + (ph["end_ns"] - ph["start_ns"]) / 1e9
    return out


def round_slowdowns(record: Mapping[str, Any], mode: FillMode, settle: int) -> list[float]:
    """Each round's slowdown of ``mode``: its median iteration against the same round's baseline median."""
    times: Sequence[float] = record["iteration_s"]
    out = []
    for r in iterations_by_round(record, settle):
        base, mine = r.get(FillMode.OFF, []), r.get(mode, [])
        if base and mine:
            out.append(percentile([times[i] for i in mine], 50) / percentile([times[i] for i in base], 50) - 1)
    return out


def round_fill_shares(record: Mapping[str, Any], stats: Mapping[str, Any], mode: FillMode) -> list[float]:
    """Each phase of ``mode``'s share of bubble time filled, from the agent's bubble and step records in it."""
    bubbles, steps = mode_records(stats, mode.label)
    shares = (filled_share(bubbles, steps, ph["start_ns"], ph["end_ns"])
              for ph in record.get("phases", []) if ph["mode"] == mode.label)
    return [s for s in shares if s is not None]


def harvest_breakdown(stats: Mapping[str, Any]) -> dict[str, float] | None:
    """Where the harvest phases' bubble time went, as shares of it (``ledger.BREAKDOWN``'s keys), from the agent's
    bubble and step records; None without bubble time."""
    d = bubble_breakdown(*mode_records(stats, FillMode.HARVEST.label))
    if not d["bubble_s"]:
        return None
    return {**{key: d[key] / d["bubble_s"] for key, _ in BREAKDOWN}, "tail": d["tail_s"] / d["bubble_s"]}


def harvest_steps_by_size(stats: Mapping[str, Any]) -> dict[str, int]:
    """How many fill steps of each size ran in the harvest phases ("whole" for a job without step sizes)."""
    out: dict[str, int] = {}
    for st in mode_records(stats, FillMode.HARVEST.label)[1]:
        key = "whole" if st.get("size") is None else str(st["size"])
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)))


def fill_step_profile(stats: Mapping[str, Any]) -> str | None:
    """The fill job's step times as its runtime measured them at init (by step size), from the agent's events."""
    msgs = [str(e.get("message", "")) for e in stats.get("events", []) if e.get("kind") == "profile"
            and str(e.get("message", "")).startswith("step time")]
    return msgs[-1] if msgs else None


def regimes_of_run(run: Mapping[str, Any], solo: Mapping[str, Any], *, settle: int, price_training: float,
                   price_fill: float) -> list[dict[str, Any]]:
    """The regimes one (fill job, isolation) run measured: its baseline, naive and harvest phases."""
    record, stats = run["training"], run.get("agent_stats") or {}
    job, isolation = run["job"], run["isolation"]
    times = iteration_times_by_mode(record, settle)
    walls = phase_wall_s(record)
    base = times.get(FillMode.OFF, [])
    base_med = percentile(base, 50) if base else None
    base_p99 = percentile(base, 99) if base else None
    solo_per_s = float((solo.get(job) or {}).get("samples_per_s", 0.0))
    out = []
    for mode in COMPARED_MODES:
        ts = times.get(mode, [])
        if not ts:
            continue
        fill = (stats.get("modes") or {}).get(mode.label, {})  # the agent's stats key its modes by label
        wall = walls.get(mode, 0.0)
        med, p99 = percentile(ts, 50), percentile(ts, 99)
        steps = int(fill.get("fill_steps", 0))
        samples = steps * int(run.get("samples_per_step", 0))
        fill_per_s = samples / wall if wall > 0 else 0.0
        bubble_s, filled_s = float(fill.get("bubble_s", 0.0)), float(fill.get("filled_s", 0.0))
        slowdown = med / base_med - 1 if base_med else None
        share = filled_s / bubble_s if bubble_s > 0 else 0.0
        # Coverage (share) counts a step's wall time: a step slowed to half its speed (time slices beside the
        # training's context, an MPS SM share) covers twice the bubble time for the same work. The work the bubbles
        # held, against what the job does alone on the device in as much time, says how much of it was work.
        work = samples / (solo_per_s * bubble_s) if mode is FillMode.HARVEST and solo_per_s > 0 and bubble_s > 0 \
            else None
        name = BASELINE if mode is FillMode.OFF else REGIME_NAMES[(mode, isolation)]
        entry: dict[str, Any] = {
            "job": job, "regime": name, "mode": mode.label, "isolation": isolation,
            "isolation_label": run.get("isolation_label", isolation),
            "iterations": len(ts), "wall_s": wall,
            "iteration_median_s": med, "iteration_p99_s": p99,
            "slowdown": slowdown,
            "slowdown_p99": p99 / base_p99 - 1 if base_p99 else None,
            "fill_steps": steps, "fill_samples": samples, "fill_samples_per_s": fill_per_s,
            "fill_flops": float(fill.get("fill_flops", 0.0)),
            "recovered_tflops": float(fill.get("fill_flops", 0.0)) / wall / 1e12 if wall > 0 else 0.0,
            "bubble_s": bubble_s, "filled_s": filled_s, "fill_share": share, "fill_work_share": work,
            "overruns": int(fill.get("overruns", 0)), "overrun_p99_ms": float(fill.get("overrun_p99_ms", 0.0)),
            "cost_savings": None, "goal_met": None,
        }
        if mode is FillMode.HARVEST:
            entry["breakdown"] = harvest_breakdown(stats)
        if mode is not FillMode.OFF:
            slow_rounds = round_slowdowns(record, mode, settle)
            share_rounds = round_fill_shares(record, stats, mode)
            entry.update({
                "slowdown_rounds": slow_rounds,
                "slowdown_interval": median_interval(slow_rounds) if slow_rounds else None,
                "fill_share_rounds": share_rounds,
                "fill_share_interval": median_interval(share_rounds) if share_rounds else None,
            })
        if mode is not FillMode.OFF and base_med:
            entry["cost_savings"] = cost_savings(t_no_s=base_med, t_with_s=med, fill_per_s=fill_per_s,
                                                 solo_per_s=solo_per_s, price_training=price_training,
                                                 price_fill=price_fill)
            entry["goal_met"] = bool(slowdown is not None and slowdown <= MAX_SLOWDOWN and share >= MIN_FILL_SHARE)
        out.append(entry)
    return out


def build_report(*, config: Mapping[str, Any], solo: Mapping[str, Any], runs: Sequence[Mapping[str, Any]],
                 settle: int, price_training: float, price_fill: float) -> dict[str, Any]:
    """The whole report: configuration, prices, goals, solo throughputs, per-run facts and every regime."""
    regimes: list[dict[str, Any]] = []
    run_facts: list[dict[str, Any]] = []
    for run in runs:
        fact: dict[str, Any] = {"job": run["job"], "isolation": run["isolation"],
                                "isolation_label": run.get("isolation_label", run["isolation"]),
                                "ok": run.get("error") is None, "error": run.get("error")}
        if run.get("error") is None:
            rec = run["training"]
            stats = run.get("agent_stats") or {}
            cycle = rec.get("cycle") or {}
            slots = cycle.get("slots", [])
            iteration = float(cycle.get("iteration_s", 0.0))
            fact.update({
                "model": rec.get("model"),
                "profiled_bubble_share": sum(s["duration_s"] for s in slots) / iteration if iteration else 0.0,
                "profiled_bubbles": len(slots),
                "timing": rec.get("timing"),
                "losses_finite": all(math.isfinite(float.fromhex(x)) for x in rec.get("losses", [])),
                "agent_isolation": stats.get("isolation"),
                "mps_membership": run.get("mps_membership"),  # mps runs: verified, or why it cannot be
                "kills": stats.get("kills", 0),
                "guard": stats.get("guard", {}),
                "hook": rec.get("hook", {}),
                "fill_step_profile": fill_step_profile(stats),
                "harvest_steps_by_size": harvest_steps_by_size(stats),
                "sm_clock": clocks_by_mode(run.get("sm_clock_samples") or [], rec.get("phases", []), settle),
                "sm_clock_error": run.get("sm_clock_error"),
            })
            regimes += [dict(r, run=len(run_facts)) for r in regimes_of_run(
                run, solo, settle=settle, price_training=price_training, price_fill=price_fill)]
        run_facts.append(fact)
    job_order = {job: i for i, job in enumerate(dict.fromkeys(r["job"] for r in runs))}
    regimes.sort(key=lambda r: (job_order[r["job"]], REGIME_ORDER.index(r["regime"]), r["isolation"]))
    return {
        "config": dict(config),
        "prices": {"training_gpu_hour": price_training, "fill_gpu_hour": price_fill,
                   "note": "P_I prices the training's GPU, P_II the dedicated GPU whose throughput Th_II is "
                           "measured (here: the same device, alone); S depends only on P_II / P_I"},
        "goals": {"max_slowdown": MAX_SLOWDOWN, "min_fill_share": MIN_FILL_SHARE},
        "solo": dict(solo),
        "runs": run_facts,
        "regimes": regimes,
    }


def format_table(report: Mapping[str, Any]) -> str:
    """The markdown table of every regime, with the header lines a reader needs to judge it."""
    cfg = report["config"]
    prices = report["prices"]
    lines = []
    if cfg.get("smoke"):
        lines.append("**SMOKE RUN on CPU: tiny sizes, a core stands in for the GPU. Not a performance "
                     "measurement.**\n")
    lines.append(f"device {cfg.get('device')}, stage {cfg.get('stage')} of {cfg.get('stages')}, "
                 f"{cfg.get('microbatches')} micro-batches, {cfg.get('iterations')} iterations per phase x "
                 f"{cfg.get('repeats')} repeats (first {cfg.get('settle')} of each phase not counted), tail risk "
                 f"{cfg.get('tail_risk', 'default')}; prices: "
                 f"P_I ${prices['training_gpu_hour']:.2f}/GPU-hour (training), P_II "
                 f"${prices['fill_gpu_hour']:.2f}/GPU-hour (dedicated fill GPU)")
    for name, s in report["solo"].items():
        lines.append(f"- {name} alone on the device: {s['samples_per_s']:.1f} samples/s, "
                     f"{s['flops_per_s'] / 1e12:.3f} TFLOPS, step {s['step_median_s'] * 1e3:.2f} ms")
    for r in report["runs"]:
        if not r["ok"]:
            lines.append(f"- run {r['job']} / {r['isolation_label']}: FAILED: {r['error']}")
        elif r.get("model"):
            m = r["model"]
            lines.append(f"- run {r['job']} / {r['isolation_label']}: modelled bubbles "
                         f"{m['bubble_share'] * 100:.1f}% of {m['iteration_s'] * 1e3:.1f} ms (F "
                         f"{m['forward_s'] * 1e3:.2f} ms, B {m['backward_s'] * 1e3:.2f} ms), profiled "
                         f"{r['profiled_bubble_share'] * 100:.1f}% in {r['profiled_bubbles']} bubbles"
                         + (", waits jittered alike in a round's modes (common random numbers)"
                            if m.get("paired_waits") and m.get("wait_jitter") else "")
                         + _signal_facts(r.get("hook") or {}))
            if r.get("sm_clock"):
                lines.append(f"  - {describe_clocks(r['sm_clock'])}"
                             + (f" (sampling stopped early: {r['sm_clock_error']})" if r.get("sm_clock_error") else ""))
            elif r.get("sm_clock_error"):
                lines.append(f"  - SM clock not recorded: {r['sm_clock_error']}")
    lines += ["", "| fill job | regime | isolation | iteration (median) | slowdown I median / p99 | slowdown, 95% "
              "interval over rounds | fill samples/s | recovered TFLOPS | bubble time filled (interval) | overruns "
              "(p99 ms) | cost savings S | goal |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in report["regimes"]:
        base = r["regime"] == BASELINE
        slow = "—" if base else f"{_pct(r['slowdown'], sign=True)} / {_pct(r['slowdown_p99'], sign=True)}"
        goal = "—" if r["goal_met"] is None else ("met" if r["goal_met"] else "not met")
        filled = "—" if base else f"{_pct(r['fill_share'])} {_interval(r.get('fill_share_interval'), False)}"
        if r.get("fill_work_share") is not None:
            filled += f"; work {_pct(r['fill_work_share'])}"
        lines.append(
            f"| {r['job']} | {r['regime']} | {r['isolation_label']} | {r['iteration_median_s'] * 1e3:.2f} ms | "
            f"{slow} | {'—' if base else _rounds(r)} | {r['fill_samples_per_s']:.1f} | "
            f"{r['recovered_tflops']:.4f} | {filled} | {r['overruns']} ({r['overrun_p99_ms']:.2f}) | "
            f"{'—' if base else _pct(r['cost_savings'], sign=True)} | {goal} |")
    broken = [r for r in report["regimes"] if r.get("breakdown")]
    if broken:
        keys = [key for key, _ in BREAKDOWN] + ["tail"]
        lines += ["", "Where the harvest phases' bubble time went, from the agent's records (the columns: "
                  "`bubbles.agent.ledger.BREAKDOWN`; too_short: no step size fit in what was left, "
                  "past_prediction: after the slot's predicted end, not filled; tail: of filled, what steps that "
                  "the prediction did not allow filled, started on `bubbles.training.gating.TailRisk`'s word):", "",
                  "| fill job | isolation | " + " | ".join(keys) + " |",
                  "| --- | --- |" + " ---: |" * len(keys)]
        for r in broken:
            lines.append(f"| {r['job']} | {r['isolation_label']} | "
                         + " | ".join(_pct(r["breakdown"].get(k, 0.0)) for k in keys) + " |")
    steps = [r for r in report["runs"] if r.get("fill_step_profile")]
    if steps:
        lines += [""] + [f"- {r['job']} / {r['isolation_label']}, timed at init: {r['fill_step_profile']}; "
                         "harvest steps by size: " + (", ".join(f"{k}: {n}" for k, n in
                                                               (r.get("harvest_steps_by_size") or {}).items())
                                                      or "none")
                         for r in steps]
    g = report["goals"]
    lines += ["", f"Goal: slowdown at most {g['max_slowdown'] * 100:g}% while filling at least "
                  f"{g['min_fill_share'] * 100:.0f}% of bubble time (FreeRide: 1.1%; PipeFill: under 2% at 68%). "
                  "Bubble time filled counts the fill steps' wall time; \"work\" (harvesting) is the samples done "
                  "in the bubbles against what the job does alone on the device in as much time: below the time "
                  "filled when steps ran slower beside the training."]
    return "\n".join(lines)


def draw_chart(report: Mapping[str, Any], path: Path) -> bool:
    """Slowdown against share of bubble time filled, one point per regime and job; False if nothing to draw."""
    points = [r for r in report["regimes"] if r["regime"] != BASELINE and r["slowdown"] is not None]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8, 4.5))
    g = report["goals"]
    slow = [r["slowdown"] * 100 for r in points]
    low, high = min(-1.0, min(slow) * 2), max(2.0, max(slow) * 3)  # room around the points (symlog)
    # The goal region: at most MAX_SLOWDOWN slower while filling at least MIN_FILL_SHARE of bubble time.
    goal = f"goal: slowdown <= {g['max_slowdown'] * 100:g}%, filled >= {g['min_fill_share'] * 100:.0f}%"
    ax.fill_between([g["min_fill_share"] * 100, 100], low, g["max_slowdown"] * 100, color="tab:green", alpha=0.12,
                    label=goal)
    ax.axhline(0, color="0.6", lw=0.8)
    markers = {job: m for job, m in zip(dict.fromkeys(r["job"] for r in points), "os^Dv", strict=False)}
    colors = {name: f"C{i}" for i, name in enumerate(REGIME_ORDER)}
    for r in points:
        ax.scatter(r["fill_share"] * 100, r["slowdown"] * 100, marker=markers.get(r["job"], "o"),
                   color=colors.get(r["regime"], "k"), s=60, label=f"{r['regime']} / {r['job']}")
    ax.set_xlabel("share of bubble time filled (%)")
    ax.set_ylabel("training slowdown I (%)")
    ax.set_yscale("symlog", linthresh=1.0)  # 1% (the goal) and +100% (naive on a busy GPU) on one axis
    ax.set_ylim(low, high)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}%"))
    ax.set_xlim(0, 100)
    title = "one-GPU harvesting benchmark"
    if report["config"].get("smoke"):
        title += " — SMOKE RUN on CPU, not performance"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _interval(iv: Sequence[float] | None, sign: bool) -> str:
    return f"[{_pct(iv[0], sign=sign)}, {_pct(iv[1], sign=sign)}]" if iv else ""


def _rounds(r: Mapping[str, Any]) -> str:
    """A regime's slowdown interval over rounds, or how many rounds there were when too few for one."""
    n = len(r.get("slowdown_rounds") or [])
    iv = r.get("slowdown_interval")
    return _interval(iv, True) if iv else f"— ({n} round{'s' if n != 1 else ''}; 6 needed: --repeats)"


def _signal_facts(hook: Mapping[str, Any]) -> str:
    """The hook's device-timing facts for a run line: how its helper thread waited, and how late it woke."""
    p50, p90 = hook.get("signal_wake_lag_us_p50"), hook.get("signal_wake_lag_us_p90")
    if p50 is None:
        return ""
    tail = f", p90 {p90:.0f} us" if p90 is not None else ""
    wait = hook.get("event_wait") or "block"
    return f"; signals: helper thread {wait}s on events, woke {p50:.0f} us late (p50{tail})"


def _pct(v: float | None, *, sign: bool = False) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v * 100:+.1f}%" if sign else f"{v * 100:.1f}%"
