"""Generate the Grafana dashboard (helm/bubbles/dashboards/bubbles.json) from code, with Grafana's own SDK.

    .venv/bin/python tools/dashboard.py            # write it
    .venv/bin/python tools/dashboard.py --check    # exit 1 if the committed file differs (the tests run this)

Every query uses only metric names the exporters define (tests/test_dashboard.py holds them to it). ``node`` on
the agents' series comes from the chart's ServiceMonitor (the Pod's node name, relabelled). A harvested GPU is named
on the agents' series as everywhere: ``namespace``, ``training``, ``stage``, ``rank`` (bubbles.core.identity.GpuKey).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

OUT = Path(__file__).resolve().parent.parent / "helm" / "bubbles" / "dashboards" / "bubbles.json"
UID = "bubbles-harvest"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
HARVEST = 'mode="harvest"'


def q(expr: str, legend: str = "", ref: str = "A", instant: bool = False, table_format: bool = False) -> Any:
    b = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        b = b.legend_format(legend)
    if instant:
        b = b.instant()
    if table_format:
        b = b.format("table")
    return b


def ts(title: str, desc: str, unit: str, *queries: Any, w: int = 12, x: int = 0, y: int = 0,
       stack: bool = False) -> Any:
    p = (timeseries.Panel().title(title).description(desc).unit(unit).datasource(DS)
         .grid_pos(GridPos(h=8, w=w, x=x, y=y)))
    for query in queries:
        p = p.with_target(query)
    if stack:
        from grafana_foundation_sdk.builders.common import StackingConfig
        from grafana_foundation_sdk.models.common import StackingMode

        p = p.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40)
    return p


def single(title: str, desc: str, unit: str, query: Any, x: int, y: int = 0, w: int = 6) -> Any:
    return stat.Panel().title(title).description(desc).unit(unit).datasource(DS).grid_pos(
        GridPos(h=4, w=w, x=x, y=y)).with_target(query)


def build() -> dict[str, Any]:
    flops = f"rate(bubbles_recovered_flops_total{{{HARVEST}}}[{RATE}])"
    bubble = f"rate(bubbles_bubble_seconds_total{{{HARVEST}}}[{RATE}])"
    filled = f"rate(bubbles_filled_bubble_seconds_total{{{HARVEST}}}[{RATE}])"
    overrun = f"rate(bubbles_overrun_seconds_total{{{HARVEST}}}[{RATE}])"
    tail_filled = f"rate(bubbles_tail_filled_bubble_seconds_total{{{HARVEST}}}[{RATE}])"
    tail_overrun = f"rate(bubbles_tail_overrun_seconds_total{{{HARVEST}}}[{RATE}])"
    d = (dashboard.Dashboard("bubbles: recovered GPU work in pipeline bubbles").uid(UID)
         .tags(["bubbles", "gpu", "pipeline-parallel"]).refresh("30s").time("now-6h", "now").timezone("browser")
         .editable()
         .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    d = d.with_row(dashboard.Row("Recovered work").grid_pos(GridPos(h=1, w=24, x=0, y=0)))
    d = d.with_panel(single("Recovered TFLOPS", "FLOP/s of fill-job steps that ran inside bubbles, whole cluster",
                            "none", q(f"sum({flops}) / 1e12"), x=0, y=1))
    d = d.with_panel(single("GPU-equivalents in bubbles", "Bubble seconds filled per second: how many whole GPUs "
                            "the fill jobs' work amounts to", "none", q(f"sum({filled})"), x=6, y=1))
    d = d.with_panel(single("Share of bubble time filled", "Filled bubble seconds over all bubble seconds",
                            "percentunit", q(f"sum({filled}) / sum({bubble})"), x=12, y=1))
    d = d.with_panel(single("Fill jobs queued", "FillJobs waiting for a bubble (phase Queued)", "none",
                            q("max(bubbles_operator_queue_length)"), x=18, y=1))
    d = d.with_panel(ts("Recovered TFLOPS per training", "FLOP/s of fill steps in each training's bubbles", "none",
                        q(f"sum by (namespace, training) ({flops}) / 1e12", "{{namespace}}/{{training}}"),
                        w=8, x=0, y=5))
    d = d.with_panel(ts("Recovered TFLOPS per GPU", "FLOP/s of fill steps in each harvested GPU's bubbles: one "
                        "rank of one stage of one training (tensor- and data-parallel ranks each have their own)",
                        "none", q(f"sum by (namespace, training, stage, rank) ({flops}) / 1e12",
                                  "{{namespace}}/{{training}} stage {{stage}} rank {{rank}}"), w=8, x=8, y=5))
    d = d.with_panel(ts("Recovered TFLOPS per node", "FLOP/s of fill steps by the node the agent runs on", "none",
                        q(f"sum by (node) ({flops}) / 1e12", "{{node}}"), w=8, x=16, y=5))
    d = d.with_row(dashboard.Row("Bubbles and where their time went").grid_pos(GridPos(h=1, w=24, x=0, y=13)))
    d = d.with_panel(ts("Bubble ratio per stage", "Share of each stage's time its GPU waits in a bubble",
                        "percentunit", q(f"sum by (training, stage) ({bubble})", "{{training}} stage {{stage}}"),
                        w=8, x=0, y=14))
    d = d.with_panel(ts("Bubble time: filled, idle, overrun", "Of all bubble time: filled by fill steps, left idle; "
                        "overrun is fill-step time past a bubble's end (it costs the training)", "percentunit",
                        q(f"sum({filled}) / sum({bubble})", "filled", "A"),
                        q(f"clamp_min(sum({bubble}) - sum({filled}), 0) / sum({bubble})", "idle", "B"),
                        q(f"sum({overrun}) / sum({bubble})", "overrun", "C"), w=8, x=8, y=14, stack=True))
    d = d.with_panel(ts("Past the predicted end (the tail)", "Of all bubble time: what fill steps started past a "
                        "bubble's predicted end filled, and how far they ran past its end. Each training's "
                        "spec.tailRisk bounds the risk they take; 0 turns them off", "percentunit",
                        q(f"sum by (training) ({tail_filled}) / sum by (training) ({bubble})",
                          "{{training}} filled", "A"),
                        q(f"sum by (training) ({tail_overrun}) / sum by (training) ({bubble})",
                          "{{training}} overrun", "B"), w=8, x=16, y=14))
    d = d.with_row(dashboard.Row("What harvesting costs the trainings").grid_pos(GridPos(h=1, w=24, x=0, y=22)))
    d = d.with_panel(ts("Slowdown against budget", "Each training's latest iteration time over its guard's baseline, "
                        "minus 1; the dashed line is its budget", "percentunit",
                        q("max by (training) (bubbles_main_iteration_seconds) / max by (training) "
                          "(bubbles_guard_baseline_seconds) - 1", "{{training}} slowdown", "A"),
                        q("max by (training) (bubbles_slowdown_budget)", "{{training}} budget", "B"), x=0, y=23))
    d = d.with_panel(ts("Guard share and kills", "The share of each bubble the slowdown guard gives fill work; fill "
                        "jobs killed for overrunning a bubble per minute", "none",
                        q("max by (training) (bubbles_fill_share)", "{{training}} share", "A"),
                        q("sum by (training) (rate(bubbles_fill_kills_total[$__rate_interval])) * 60",
                          "{{training}} kills/min", "B"), x=12, y=23))
    d = d.with_row(dashboard.Row("Fill-job queue").grid_pos(GridPos(h=1, w=24, x=0, y=31)))
    d = d.with_panel(ts("Fill jobs by phase", "FillJobs in each phase", "none",
                        q("max by (phase) (bubbles_operator_fill_jobs)", "{{phase}}"), w=8, x=0, y=32))
    d = d.with_panel(ts("Wait and completion", "Creation to first placement (wait) and to success (completion), "
                        "95th percentile", "s",
                        q("histogram_quantile(0.95, sum by (le) (rate(bubbles_operator_placement_latency_seconds_bucket"
                          f"[{RATE}])))", "wait p95", "A"),
                        q("histogram_quantile(0.95, sum by (le) (rate(bubbles_operator_completion_seconds_bucket"
                          f"[{RATE}])))", "completion p95", "B"), w=8, x=8, y=32))
    d = d.with_panel(ts("Deadline misses", "FillJobs whose expected finish misses their deadline", "none",
                        q("max(bubbles_operator_deadline_misses)", "misses"), w=8, x=16, y=32))
    running = (table.Panel().title("Running fill jobs").description("Placed FillJobs: progress and expected finish")
               .datasource(DS).grid_pos(GridPos(h=8, w=24, x=0, y=40))
               .with_target(q("max by (namespace, fill_job, training, stage, ranks, node) "
                              "(bubbles_operator_fill_job_progress_ratio)", ref="A", instant=True, table_format=True))
               .with_target(q("max by (namespace, fill_job, training, stage, ranks, node) "
                              "(bubbles_operator_fill_job_eta_timestamp_seconds) * 1000",
                              ref="B", instant=True, table_format=True)))
    d = d.with_panel(running)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if the committed dashboard is not what this makes")
    args = p.parse_args(argv)
    text = json.dumps(build(), indent=2, sort_keys=True) + "\n"
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what tools/dashboard.py makes: run it and commit the result", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
