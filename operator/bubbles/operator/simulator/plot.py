"""PNG charts of simulation results (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_sweep(path: str | Path, sweep: Sequence[dict[str, Any]]) -> None:
    """Recovered utilization vs cluster size: TFLOPS per GPU recovered and the bubble ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [s["gpus"] for s in sweep]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(gpus, [s["recovered_tflops_per_gpu"] for s in sweep], "o-", label="recovered TFLOPS per GPU")
    ax.set_xlabel("GPUs of the main job")
    ax.set_ylabel("TFLOPS per GPU recovered by fill jobs")
    ax.set_xscale("log", base=2)
    ax2 = ax.twinx()
    ax2.plot(gpus, [100 * s["bubble_ratio"] for s in sweep], "s--", color="tab:red", label="bubble ratio")
    ax2.set_ylabel("bubble ratio (%)")
    ax.set_title(f"Recovered utilization vs cluster size ({sweep[0]['policy']})")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_jct(path: str | Path, summaries: Sequence[dict[str, Any]]) -> None:
    """Fill-job completion time (mean, p50, p99) and makespan per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["policy"] for s in summaries]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.2
    for k, key in enumerate(("mean", "p50", "p99")):
        vals = [(s["jct_s"][key] or 0.0) / 60 for s in summaries]
        ax.bar([i + (k - 1.5) * width for i in range(len(names))], vals, width, label=f"JCT {key}")
    ax.bar(
        [i + 1.5 * width for i in range(len(names))],
        [(s["makespan_s"] or 0.0) / 60 for s in summaries],
        width,
        label="makespan",
    )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("minutes")
    ax.set_yscale("log")
    ax.set_title("Fill-job completion time per policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
