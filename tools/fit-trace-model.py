#!/usr/bin/env python3
"""Fit the simulator's packaged fill-job trace model to the Alibaba GPU trace (2023).

    tools/fit-trace-model.py PATH/openb_pod_list_default.csv [--out operator/bubbles/simulator/data/...]

`bubbles simulate` with no trace generates fill jobs from this model: the quantiles of the inter-arrival gaps and of
the sizes (GPU-hours) of the tasks PipeFill's filter keeps (``bubbles.operator.simulator.trace.read_alibaba``: not
latency-sensitive, scheduled, at most 1 GPU-hour). Run it again when the filter changes; the file records its source
and the counts it was fitted to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "core"), str(ROOT / "operator")]

from bubbles.operator.simulator.trace import TRACE_MODEL_PATH, TraceError, read_alibaba  # noqa: E402

QUANTILES = 101  # 0%, 1%, ..., 100%


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pods", type=Path, help="openb_pod_list_default.csv of cluster-trace-gpu-v2023")
    p.add_argument("--out", type=Path, default=TRACE_MODEL_PATH, help=f"default {TRACE_MODEL_PATH}")
    args = p.parse_args()
    try:
        tasks, stats = read_alibaba(args.pods)
    except TraceError as exc:
        print(f"fit-trace-model: {exc}", file=sys.stderr)
        return 2
    if len(tasks) < 2:
        print(f"fit-trace-model: {args.pods} leaves {len(tasks)} task(s) after the filter; a model needs at least "
              "2: pass the full openb_pod_list_default.csv", file=sys.stderr)
        return 2
    kept = sorted(tasks, key=lambda t: t.arrival_s)
    arrivals = np.array([t.arrival_s for t in kept])
    gaps = np.diff(arrivals)
    sizes = np.array([t.gpu_hours for t in kept if t.gpu_hours > 0])
    q = np.linspace(0, 1, QUANTILES)
    model = {
        "source": {
            "trace": "Alibaba GPU cluster trace 2023, cluster-trace-gpu-v2023/csv/openb_pod_list_default.csv "
                     "(github.com/alibaba/clusterdata)",
            "citation": "Weng et al., Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation "
                        "Gradient Descent, USENIX ATC 2023",
            "filter": "PipeFill section 5.3: qos other than LS, at least one GPU, scheduled; GPU-hours = num_gpu x "
                      "(deletion_time - scheduled_time) / 3600, kept up to 1 GPU-hour",
            "fitted_with": "tools/fit-trace-model.py",
            "rows": stats.rows,
            "candidates": stats.candidates,
            "kept": stats.kept,
            "share_kept": round(stats.share_kept, 4),
            "span_days": round(float(arrivals[-1] - arrivals[0]) / 86400, 1),
        },
        "gap_s_quantiles": [round(float(v), 3) for v in np.quantile(gaps, q)],
        "gpu_hours_quantiles": [float(f"{v:.6g}") for v in np.quantile(sizes, q)],
    }
    args.out.write_text(json.dumps(model, indent=1) + "\n")
    print(f"{args.out}: {stats.kept} tasks of {stats.candidates} ({stats.share_kept:.1%}) over "
          f"{model['source']['span_days']} days; median gap {np.median(gaps):.0f} s, median size "
          f"{np.median(sizes):.3f} GPU-hours")
    return 0


if __name__ == "__main__":
    sys.exit(main())
