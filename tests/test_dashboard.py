"""The Grafana dashboard: generated from code (tools/dashboard.py, Grafana's own SDK) and committed, shipped in the
chart's ConfigMap unchanged, and every query naming only metrics the exporters really define."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from bubbles.agent.core import IsolationTotals, JobTotals, Snapshot, StageTotals
from bubbles.agent.metrics import AgentMetrics, NodeMetrics, names
from bubbles.core.identity import GpuKey
from bubbles.operator.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "bubbles" / "dashboards" / "bubbles.json"
GPU = GpuKey("_local", "t", 0, 0)  # the agent's series are per GPU: stage and rank
AT = 'namespace="_local",rank="0",stage="0",training="t"}'  # its labels, as the exposition sorts them


def exported_names() -> set[str]:
    """Every sample name the agent (cluster mode) and the operator export, each metric given a value."""
    snap = Snapshot([StageTotals(0, "cuda:0", "harvest", 1.0, 0.5, 0.01)],
                    [JobTotals(0, "cuda:0", "harvest", "fj", 10, 1e12)], [(0, 0, "cuda:0", "RUNNING")],
                    IsolationTotals("mps", "ready", 0, 0), baseline_s=0.1, budget=0.01)
    agent = AgentMetrics("t", lambda: snap)
    agent.kill(GPU, "cuda:0", "fj")
    agent.rejected(GPU, "datagram")
    agent.iteration(GPU, 0.1)
    node = NodeMetrics(lambda: [agent.registry], lambda: {"waiting": 1})
    node.refused.inc()
    op = OperatorMetrics()
    op.observe([{"metadata": {"namespace": "ml", "name": "fj"},
                 "status": {"phase": "Running", "assignment": {"training": "t", "node": "n"},
                            "progress": {"percent": 40.0}, "eta": "2026-11-23T10:00:00Z", "recoveredFlops": 1.0}}])
    op.placement_latency.observe(1.0)
    op.completion.observe(100.0)
    op.reconcile_errors.inc()
    op.api_writes.labels("pod").inc()
    text = (generate_latest(node.registry) + generate_latest(op.registry)).decode()
    return names(text.splitlines())


def queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def test_the_committed_dashboard_is_what_the_generator_makes() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "dashboard.py"), "--check"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_query_uses_only_metric_names_the_code_exports() -> None:
    exported = exported_names()
    used = {m for expr in queries() for m in re.findall(r"\bbubbles_[a-z_]+\b", expr)}
    assert used, "the dashboard queries no bubbles metric"
    assert used <= exported, f"not exported by any bubbles component: {sorted(used - exported)}"
    # and the headline panels are there
    assert any("bubbles_recovered_flops_total" in q for q in queries())
    assert any("bubbles_guard_baseline_seconds" in q and "bubbles_slowdown_budget" in q
               for q in (" ".join(queries()),))


def test_the_dashboard_has_a_stable_uid_and_a_datasource_variable() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "bubbles-harvest"
    (var,) = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert var["name"] == "datasource" and var["query"] == "prometheus"
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_the_chart_ships_the_dashboard_unchanged() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart")
    import yaml

    out = helm.Chart.load(str(ROOT / "helm" / "bubbles")).render({}, name="b", namespace="x", is_install=True)
    cm = yaml.safe_load(out["bubbles/templates/dashboard.yaml"])
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["bubbles.json"]) == json.loads(DASHBOARD.read_text())
    off = helm.Chart.load(str(ROOT / "helm" / "bubbles")).render({"dashboard": {"enabled": False}}, name="b",
                                                                 namespace="x", is_install=True)
    assert not off["bubbles/templates/dashboard.yaml"].strip()


def test_a_fill_job_that_was_never_killed_exports_zero_kills_not_no_data() -> None:
    # The "Guard share and kills" panel sums rate(bubbles_fill_kills_total): with no series at all it shows "No data".
    snap = Snapshot([StageTotals(0, "cuda:0", "harvest", 1.0, 0.5, 0.01)],
                    [JobTotals(0, "cuda:0", "harvest", "fj", 10, 1e12)], [(0, 0, "cuda:0", "RUNNING")],
                    None, baseline_s=0.1, budget=0.01)
    agent = AgentMetrics("t", lambda: snap)
    generate_latest(agent.registry)  # the first scrape sees the job
    body = generate_latest(agent.registry).decode()
    assert f'bubbles_fill_kills_total{{device="cuda:0",fill_job="fj",{AT} 0.0' in body
    # A training without tail steps exports the tail's counters at 0, so its panel draws 0, not "No data".
    assert f'bubbles_tail_filled_bubble_seconds_total{{device="cuda:0",mode="harvest",{AT} 0.0' in body
    tail = Snapshot([StageTotals(0, "cuda:0", "harvest", 1.0, 0.5, 0.01, 0.2, 0.004)], [], [], None)
    body = generate_latest(AgentMetrics("t", lambda: tail).registry).decode()
    assert f'bubbles_tail_overrun_seconds_total{{device="cuda:0",mode="harvest",{AT} 0.004' in body


def test_the_kill_series_of_a_job_the_agent_let_go_of_goes_with_it() -> None:
    jobs = [JobTotals(0, "cuda:0", "harvest", "old", 10, 1e12), JobTotals(0, "cuda:0", "harvest", "new", 1, 1e11)]
    snap = Snapshot([StageTotals(0, "cuda:0", "harvest", 1.0, 0.5, 0.01)], jobs, [], None)
    agent = AgentMetrics("t", lambda: snap)
    agent.kill(GPU, "cuda:0", "old")
    assert f'fill_job="old",{AT} 1.0' in generate_latest(agent.registry).decode()
    snap.jobs.pop(0)  # the core kept only the latest finished records
    body = generate_latest(agent.registry).decode()
    assert 'fill_job="old"' not in body and 'bubbles_fill_kills_total{device="cuda:0",fill_job="new"' in body
    # A job killed in its first step has no totals yet, but its record is held: its kill is exported.
    first = Snapshot([], [], [], None, held_jobs=((0, 0, "cuda:0", "big"),))
    agent = AgentMetrics("t", lambda: first)
    agent.kill(GPU, "cuda:0", "big")
    assert f'bubbles_fill_kills_total{{device="cuda:0",fill_job="big",{AT} 1.0' in \
        generate_latest(agent.registry).decode()


def test_a_trainings_recovered_flops_series_goes_with_its_last_fill_job_and_stays_while_it_is_requeued() -> None:
    """The operator's per-training gauge is the sum over its FillJobs: with none left, the series is removed, not
    left at its last value (which would read as FLOPs still recovered); a job waiting to be placed again still counts
    for the training it ran on."""
    op = OperatorMetrics()

    def job(training: str, flops: float) -> dict[str, Any]:
        return {"metadata": {"namespace": "ml", "name": f"fj-{training}"},
                "status": {"phase": "Succeeded", "assignment": {"training": training}, "recoveredFlops": flops}}

    def series() -> dict[str, float]:
        return {s.labels["training"]: s.value for m in op.registry.collect() for s in m.samples
                if s.name == "bubbles_operator_recovered_flops"}

    op.observe([job("a", 1e12), job("b", 2e12)])
    assert series() == {"a": 1e12, "b": 2e12}
    op.observe([job("b", 3e12)])  # a's last FillJob was deleted
    assert series() == {"b": 3e12}
    # b's job is requeued (evicted: no assignment while it waits): its FLOPs still count for b, no dip, no gap...
    requeued = job("b", 3e12)
    requeued["status"] = {"phase": "Queued", "recoveredFlops": 3e12}
    op.observe([requeued])
    assert series() == {"b": 3e12}
    # ...until it is placed on another training, which it then counts for.
    op.observe([{**job("c", 4e12), "metadata": {"namespace": "ml", "name": "fj-b"}}])
    assert series() == {"c": 4e12}
    op.observe([])
    op.observe([requeued])  # deleted in between: a new FillJob of that name starts with no history
    assert series() == {}
