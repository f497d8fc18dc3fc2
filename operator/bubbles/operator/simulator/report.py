"""What a simulation recovered, as numbers (JSON-ready) and as a short text summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from bubbles.operator.simulator.engine import JobOutcome, SimResult


def summarize(r: SimResult) -> dict[str, Any]:
    """Recovered TFLOPS (per GPU and total), GPU-equivalents, bubble figures, JCTs, makespan, misses."""
    main = r.main
    gpus = main.gpus
    horizon_s = r.horizon_s
    # One pass over the outcomes (a million of them at a week of 100,000 GPUs); the sums are sum() over the same
    # values in the same order as one generator per figure would give, so the same floats.
    flops_each: list[float] = []
    gpu_s_each: list[float] = []
    filled_each: list[float] = []
    jct_each: list[float] = []
    ends: list[float] = []
    starts: list[float] = []
    completed = rejected = with_deadline = misses = 0
    gangs: list[JobOutcome] = []
    for o in r.outcomes:
        job = o.job
        profile = job.profile
        samples_done = o.samples_done
        flops_each.append(samples_done * profile.flops_per_sample)
        gpu_s_each.append(samples_done / profile.isolated_samples_per_s)
        filled_each.append(o.filled_s)
        p = o.placement
        if o.done:
            completed += 1
            if p is not None:
                jct_each.append(p.end_s - job.arrival_s)
                ends.append(p.end_s)
        if job.arrival_s <= horizon_s:  # submitted
            starts.append(job.arrival_s)
            if o.rejected:
                rejected += 1
            if job.gpus > 1:
                gangs.append(o)
            dl = job.deadline_s
            if dl is not None:
                with_deadline += 1
                end = p.end_s if (o.done and p) else math.inf
                if end > dl and (o.done or dl <= horizon_s):
                    misses += 1
    flops = sum(flops_each)
    gpu_s_equiv = sum(gpu_s_each)
    filled_s = sum(filled_each)
    bubble_ratio = main.bubble_ratio()
    bubble_s_total = gpus * horizon_s * bubble_ratio
    jcts = np.array(jct_each, dtype=float)
    submitted = len(starts)
    per_gpu = flops / (gpus * horizon_s) / 1e12 if horizon_s > 0 else 0.0
    out: dict[str, Any] = {
        "policy": r.policy,
        "main_job": main.to_dict(),
        "gpus": gpus,
        "simulated_s": horizon_s,
        "events": r.events,
        "bubble_ratio": bubble_ratio,
        "fillable_bubble_ratio": main.fillable_ratio(),
        "bubble_time_filled_share": filled_s / bubble_s_total if bubble_s_total > 0 else 0.0,
        "recovered_flops": flops,
        "recovered_tflops_per_gpu": per_gpu,
        "recovered_tflops_total": per_gpu * gpus,
        "gpu_equivalents": gpu_s_equiv / horizon_s if horizon_s > 0 else 0.0,
        "jobs": {
            "submitted": submitted,
            "completed": completed,
            "unfinished": submitted - completed - rejected,
            "rejected": rejected,
            "with_deadline": with_deadline,
            "deadline_misses": misses,
        },
        "jct_s": {
            "mean": float(jcts.mean()) if len(jcts) else None,
            "p50": float(np.percentile(jcts, 50)) if len(jcts) else None,
            "p99": float(np.percentile(jcts, 99)) if len(jcts) else None,
        },
        "makespan_s": (max(ends) - min(starts)) if ends and starts else None,
    }
    if gangs:  # only where the trace has any: reports without gang jobs stay as they were
        gang_done = [o for o in gangs if o.done]
        gang_jcts = [o.jct_s for o in gang_done if o.jct_s is not None]
        out["gangs"] = {
            "submitted": len(gangs),
            "gpus": sorted({o.job.gpus for o in gangs}),
            "completed": len(gang_done),
            "started": sum(1 for o in gangs if o.placement is not None),
            "rejected": sum(1 for o in gangs if o.rejected),
            "jct_mean_s": float(np.mean(gang_jcts)) if gang_jcts else None,
            "recovered_flops": sum(o.flops for o in gangs),
            "bubble_time_filled_s": sum(o.filled_s for o in gangs),
        }
    return out


def comparison(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: the first run's headline figures plus every policy's summary."""
    if not summaries:
        raise ValueError("nothing to report")
    head = summaries[0]
    return {
        "bubble_ratio": head["bubble_ratio"],
        "gpus": head["gpus"],
        "main_job": head["main_job"],
        "policies": {s["policy"]: s for s in summaries},
    }


def format_summary(summaries: Sequence[dict[str, Any]]) -> str:
    s0 = summaries[0]
    mj = s0["main_job"]
    lines = [
        f"main job: {mj['stages']} stages x {mj['microbatches']} micro-batches, {mj['schedule']}, "
        f"{s0['gpus']} GPUs, iteration {mj['iteration_s']:.2f} s, simulated {s0['simulated_s'] / 3600:.2f} h",
        f"bubble ratio {s0['bubble_ratio']:.1%} (fillable {s0['fillable_bubble_ratio']:.1%}, "
        f"{mj['fill_fraction']:.0%} of each bubble offered to fill jobs)",
    ]
    head = (
        f"{'policy':<16}{'TFLOPS/GPU':>11}{'GPU-equiv':>11}{'filled':>8}{'done':>8}{'left':>7}"
        f"{'JCT mean':>10}{'p50':>9}{'p99':>9}{'makespan':>10}{'missed':>7}"
    )
    lines.append(head)
    for s in summaries:
        j, jct = s["jobs"], s["jct_s"]
        lines.append(
            f"{s['policy']:<16}{s['recovered_tflops_per_gpu']:>11.2f}{s['gpu_equivalents']:>11.1f}"
            f"{s['bubble_time_filled_share']:>8.1%}{j['completed']:>8}{j['unfinished']:>7}"
            f"{_dur(jct['mean']):>10}{_dur(jct['p50']):>9}{_dur(jct['p99']):>9}{_dur(s['makespan_s']):>10}"
            f"{j['deadline_misses']:>7}"
        )
    for s in summaries:
        g = s.get("gangs")
        if g:
            lines.append(
                f"{s['policy']}: gang jobs ({'/'.join(map(str, g['gpus']))} GPUs each): {g['completed']} of "
                f"{g['submitted']} done, {g['started'] - g['completed']} running, mean JCT {_dur(g['jct_mean_s'])}, "
                f"{g['recovered_flops'] / 1e15:.3g} PFLOP recovered"
            )
    rej = s0["jobs"]["rejected"]
    if rej:
        lines.append(f"{rej} jobs fit no bubble and were rejected (see model profiles or --free-gib)")
    return "\n".join(lines)


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"
