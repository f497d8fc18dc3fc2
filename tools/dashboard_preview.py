"""Draw a PNG preview of the Grafana dashboard from a real Prometheus (no Grafana server needed).

    .venv/bin/python tools/dashboard_preview.py --prometheus http://127.0.0.1:9090 --minutes 10 --out preview.png

Every panel of helm/bubbles/dashboards/bubbles.json is drawn at its grid position with its own queries, evaluated
by Prometheus's HTTP API over the time range (``$__rate_interval`` becomes ``--rate-interval``): time series as
lines, stat panels as their last value, the table as its rows at the end of the range. It is a preview of the data
the dashboard would show, not a pixel copy of Grafana. tests/test_dashboard_prometheus.py draws it from the agents
and operator of a running demo; the README's picture comes from there.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "bubbles" / "dashboards" / "bubbles.json"
RATE = "$__rate_interval"


class QueryError(Exception):
    """Prometheus refused a query (it did not parse, or failed to evaluate)."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix seconds, value), NaN kept out

    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None


def panel_queries(dashboard: dict[str, Any], rate_interval: str) -> list[tuple[dict[str, Any], dict[str, Any], str]]:
    """(panel, target, expression with Grafana's variables filled in) for every query of every panel."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel, target, target["expr"].replace(RATE, rate_interval)))
    return out


def query_range(prometheus: str, expr: str, start: float, end: float, step: float,
                timeout_s: float = 30.0) -> list[Series]:
    """The expression evaluated at every step in [start, end]; QueryError with Prometheus's message if refused."""
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"})
    try:
        with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=timeout_s) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
        try:
            body = json.load(e)
        except ValueError:
            raise QueryError(f"{expr}: HTTP {e.code}") from None
    if body.get("status") != "success":
        raise QueryError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
    out = []
    for item in body["data"]["result"]:
        points = [(float(t), float(v)) for t, v in item["values"] if math.isfinite(float(v))]
        out.append(Series(item["metric"], points))
    return out


def legend(fmt: str | None, labels: dict[str, str]) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def fmt_value(v: float, unit: str | None) -> str:
    if unit == "percentunit":
        return f"{100 * v:.1f}%"
    if unit == "s":
        return f"{v:.2f} s"
    if v != 0 and (abs(v) < 0.01 or abs(v) >= 1e5):
        return f"{v:.3g}"
    return f"{v:.2f}"


def render(dashboard: dict[str, Any], prometheus: str, start: float, end: float, out: Path,
           rate_interval: str = "10s", step: float = 1.0) -> dict[str, int]:
    """Draw the dashboard to ``out`` (PNG); returns, per query expression, how many series had data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_w, unit_h = 0.75, 0.42  # inches per grid column / row
    fig = plt.figure(figsize=(24 * unit_w, rows * unit_h + 0.8), facecolor="#111217")
    fig.suptitle(f"{dashboard['title']} (preview from Prometheus, {time.strftime('%Y-%m-%d', time.gmtime(end))}, "
                 f"{end - start:.0f} s)", color="#d8d9da", fontsize=13, x=0.01, ha="left")
    top = 1 - 0.8 / (rows * unit_h + 0.8)
    found: dict[str, int] = {}

    def axes(g: dict[str, int]) -> Any:
        # Room inside the grid cell for the title above and the tick labels left of and below the plot.
        pad_l, pad_r, pad_t, pad_b = 0.032, 0.004, 0.014, 0.018
        x0, w = g["x"] / 24 + pad_l, g["w"] / 24 - pad_l - pad_r
        y1 = top * (1 - g["y"] / rows) - pad_t
        h = top * g["h"] / rows - pad_t - pad_b
        ax = fig.add_axes((x0, y1 - h, w, h), facecolor="#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=7)
        return ax

    for panel in panels:
        g, kind, unit = panel["gridPos"], panel["type"], panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if kind == "row":
            fig.text(g["x"] / 24 + 0.004, top * (1 - (g["y"] + 0.7) / rows), panel["title"], color="#d8d9da",
                     fontsize=11, weight="bold")
            continue
        results = []
        for target in panel.get("targets", []):
            expr = target["expr"].replace(RATE, rate_interval)
            series = query_range(prometheus, expr, start, end, step)
            found[expr] = sum(1 for s in series if s.points)
            results.append((target, series))
        ax = axes(g)
        ax.set_title(panel["title"], color="#d8d9da", fontsize=9, loc="left")
        if kind == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            values = [v for _, series in results for s in series if (v := s.last()) is not None]
            text = fmt_value(values[0], unit) if values else "No data"
            ax.text(0.5, 0.45, text, color="#73bf69" if values else "#9fa7b3", fontsize=22, ha="center",
                    va="center", transform=ax.transAxes, weight="bold")
        elif kind == "timeseries":
            drawn = 0
            for target, series in results:
                for s in series:
                    if s.points:
                        ts, vs = zip(*s.points, strict=True)
                        ax.plot([t - start for t in ts], vs, lw=1.4, label=legend(target.get("legendFormat"),
                                                                                    s.labels))
                        drawn += 1
            if unit == "percentunit":
                ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
            ax.set_xlim(0, end - start)
            ax.set_xlabel("seconds", color="#9fa7b3", fontsize=7)
            ax.grid(color="#2c3235", lw=0.5)
            if drawn:
                ax.legend(fontsize=7, loc="upper left", facecolor="#181b1f", edgecolor="#2c3235",
                          labelcolor="#d8d9da", ncol=2)
            else:
                ax.text(0.5, 0.5, "No data", color="#9fa7b3", ha="center", transform=ax.transAxes)
        elif kind == "table":
            ax.set_xticks([])
            ax.set_yticks([])
            table: dict[tuple[str, ...], list[str]] = {}
            keys = ("namespace", "fill_job", "training", "node")
            for i, (_target, series) in enumerate(results):
                for s in series:
                    v = s.last()
                    if v is None or s.points[-1][0] < end - 2 * step:  # gone before the end: no longer running
                        continue
                    row = table.setdefault(tuple(s.labels.get(k, "") for k in keys), ["", ""])
                    row[i] = (f"{100 * v:.0f}%" if i == 0 else
                              time.strftime("%H:%M:%S UTC", time.gmtime(v / 1000)) if v > 0 else "-")
            header = [*keys, "progress", "ETA"]
            lines = [list(k) + v for k, v in sorted(table.items())] or [["No data"] + [""] * 5]
            tab = ax.table(cellText=lines, colLabels=header, loc="upper center", cellLoc="left")
            tab.auto_set_font_size(False)
            tab.set_fontsize(8)
            for cell in tab.get_celld().values():
                cell.set_facecolor("#181b1f")
                cell.set_edgecolor("#2c3235")
                cell.get_text().set_color("#d8d9da")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--minutes", type=float, default=15.0, help="draw the last N minutes (default 15)")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes (default 1m)")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD, help="dashboard JSON (default: the chart's)")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error(f"--minutes {args.minutes}: give a positive number of minutes")
    end = time.time()
    try:
        dashboard = json.loads(args.dashboard.read_text())
        found = render(dashboard, args.prometheus.rstrip("/"), end - 60 * args.minutes, end, args.out,
                       args.rate_interval, step=max(1.0, 60 * args.minutes / 400))
    except (OSError, ValueError, QueryError) as e:
        print(f"dashboard_preview: error: {e}", file=sys.stderr)
        return 1
    empty = [e for e, n in found.items() if n == 0]
    print(f"wrote {args.out}: {len(found) - len(empty)} of {len(found)} queries had data")
    for e in empty:
        print(f"  no data: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
