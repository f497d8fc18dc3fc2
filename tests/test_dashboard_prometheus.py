"""Every query of the Grafana dashboard, evaluated by a real Prometheus scraping real exporters.

Prometheus (Debian's package, tools/prometheus-from-debian.sh) scrapes, every second:
- the node agent of a running ``bubbles demo`` (real DeepSpeed on CPU, real fill jobs harvesting its bubbles);
- the operator, on the real API server under its RBAC, placing FillJobs through mutual-TLS gRPC onto a node agent
  (tests/helpers/local_node.py) whose fill processes attach and run: one finishes, one keeps running.
Every panel's every query must parse and return data over the run. The same run draws the README's preview
(tools/dashboard_preview.py); set BUBBLES_DASHBOARD_PREVIEW=docs/dashboard-preview.png to keep it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.kubeapi import OPERATOR_NAMESPACE, OPERATOR_TOKEN, ApiServer
from helpers.local_node import LocalNode
from helpers.operator_kube import NS, cluster_fixture, get, phase, until  # noqa: F401  (the cluster fixture)
from helpers.operator_thread import OperatorThread
from helpers.prometheus import RATE_INTERVAL, SCRAPE_S, Prometheus, find_prometheus

from bubbles.demo.orchestrate.processes import free_port
from bubbles.operator.grpc_agents import GrpcAgents
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig

pytestmark = [pytest.mark.kube, pytest.mark.deepspeed]
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import dashboard_preview  # noqa: E402

DASHBOARD = json.loads((ROOT / "helm" / "bubbles" / "dashboards" / "bubbles.json").read_text())
@pytest.fixture
def prometheus_binary() -> str:
    binary, why = find_prometheus()
    if binary is None:
        pytest.skip(f"PROMETHEUS TIER SKIPPED: {why}")
    return binary


def fill_job(name: str, steps: int, deadline: str | None = None) -> dict[str, object]:
    spec: dict[str, object] = {"image": "fill:1", "entry": "bubbles.fill_examples.spin:SpinJob",
                               "args": {"step_us": 500},  # spins: it computes nothing and reports 0 FLOPs
                               "trainingSelector": {"matchLabels": {"app": "dash"}},
                               "profile": {"memory": "16Mi", "stepTime": "1ms"},
                               "work": {"steps": steps}}
    if deadline:
        spec["deadline"] = deadline
    return {"apiVersion": "bubbles.dev/v1alpha1", "kind": "FillJob", "metadata": {"name": name, "namespace": NS},
            "spec": spec}


@pytest.fixture
def cluster_with_fill_jobs(cluster: ApiServer, tmp_path: Path) -> Iterator[tuple[LocalNode, int]]:
    """A two-stage training on node-dash, its agent, and the operator (metrics on) placing two FillJobs there."""
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "bubbles.dev/v1alpha1", "kind": "PipelineTraining",
         "metadata": {"name": "dash", "namespace": NS, "labels": {"app": "dash"}},
         "spec": {"selector": {"matchLabels": {"app": "dash"}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dash-0", "namespace": NS, "labels": {"app": "dash"}},
         "spec": {"nodeName": "node-dash", "automountServiceAccountToken": False,
                  "containers": [{"name": "train", "image": "train:1"}]}}]}))
    node = LocalNode("node-dash", NS, "dash", "dash-0", tmp_path / "node", stages=2, metrics=True)
    operator_port = free_port()
    conn = Connection(cluster.url, token=OPERATOR_TOKEN, ca_path=cluster.ca_path, namespace=OPERATOR_NAMESPACE)
    op = OperatorThread(Operator(OperatorConfig(interval_s=0.3, lease_namespace=OPERATOR_NAMESPACE,
                                                metrics_port=operator_port),
                                 conn, GrpcAgents({"node-dash": node.address}.get, node.client_security)))
    try:
        yield node, operator_port
    finally:
        op.close()
        node.close()
        cluster.kubectl("delete", "fj", "short", "long", "-n", NS, "--wait=false", check=False)


def test_every_dashboard_query_returns_data_from_a_running_demo_and_operator(
        cluster: ApiServer, cluster_with_fill_jobs: tuple[LocalNode, int], prometheus_binary: str,
        tmp_path: Path) -> None:
    node, operator_port = cluster_with_fill_jobs
    demo_port = free_port()
    prom = Prometheus(prometheus_binary, tmp_path, {
        "bubbles-agent": [(f"127.0.0.1:{demo_port}", {"node": "demo-node"}),
                          (f"127.0.0.1:{node.metrics_port}", {"node": "node-dash"})],
        "bubbles-operator": [(f"127.0.0.1:{operator_port}", {})]})
    start = time.time()
    demo = None
    try:
        # First the demo, alone on the machine (extra load makes its guard hold fill work back, rightly): real
        # DeepSpeed harvesting, its agent scraped while it runs.
        iterations = int(os.environ.get("BUBBLES_DASHBOARD_ITERATIONS", "60"))
        demo_log = (tmp_path / "demo.log").open("w")
        demo = subprocess.Popen([sys.executable, "-m", "bubbles.cli", "demo", "--iterations", str(iterations),
                                 "--repeats", "1", "--metrics-port", str(demo_port), "--workdir",
                                 str(tmp_path / "demo")], stdout=demo_log, stderr=subprocess.STDOUT)
        assert demo.wait(timeout=400) == 0, (tmp_path / "demo.log").read_text()[-3000:]
        demo_log.close()
        # The cluster path: one job to finish (completion time), one that keeps running (progress and ETA).
        soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 600))  # the long one will miss it
        for job in (fill_job("short", 1500), fill_job("long", 10**7, deadline=soon)):
            cluster.kubectl("create", "-f", "-", input_text=json.dumps(job))
        for name in ("short", "long"):
            try:
                until(f"{name} placed", lambda n=name: phase(cluster, n) in ("Placed", "Running"))
            except AssertionError as e:
                raise AssertionError(f"{e}: {(get(cluster, 'fj', name) or {}).get('status')}") from None
            until(f"{name}'s Pod", lambda n=name: get(cluster, "pod", f"fj-{n}-a0"))
            node.start_pod(cluster, f"fj-{name}-a0")
        until("short Succeeded", lambda: phase(cluster, "short") == "Succeeded", timeout_s=120)
        until("long Running", lambda: phase(cluster, "long") == "Running", timeout_s=60)
        time.sleep(2 * SCRAPE_S)  # the operator's and node's last figures scraped
        health = prom.targets_up()
        assert health[f"http://127.0.0.1:{operator_port}/metrics"] == "up", health
        assert health[f"http://127.0.0.1:{node.metrics_port}/metrics"] == "up", health
        end = time.time()
        found: dict[str, int] = {}
        for _panel, _target, expr in dashboard_preview.panel_queries(DASHBOARD, RATE_INTERVAL):
            series = dashboard_preview.query_range(prom.url, expr, start, end, SCRAPE_S)  # raises if it does not parse
            found[expr] = sum(1 for s in series if s.points)
        empty = [expr for expr, n in found.items() if n == 0]
        assert not empty, f"dashboard queries with no data over the run: {empty}"
        preview = Path(os.environ.get("BUBBLES_DASHBOARD_PREVIEW") or tmp_path / "preview.png")
        drawn = dashboard_preview.render(DASHBOARD, prom.url, start, end, preview, RATE_INTERVAL, step=SCRAPE_S)
        assert drawn == found and preview.stat().st_size > 20_000
        # Both nodes' agents feed the per-node panel; only the demo's fill jobs do real work (the spin jobs report 0).
        per_node = dashboard_preview.query_range(
            prom.url, f'sum by (node) (rate(bubbles_recovered_flops_total{{mode="harvest"}}[{RATE_INTERVAL}]))',
            start, end, SCRAPE_S)
        assert {s.labels["node"] for s in per_node} == {"demo-node", "node-dash"}
        positive = {s.labels["node"] for s in per_node if any(v > 0 for _, v in s.points)}
        raw = dashboard_preview.query_range(prom.url, "bubbles_recovered_flops_total", start, end, SCRAPE_S)
        assert positive == {"demo-node"}, ((tmp_path / "demo.log").read_text()[-1500:],
                                                        [(s.labels, s.points[-3:]) for s in raw])
    finally:
        if demo is not None and demo.poll() is None:
            demo.kill()
            demo.wait()
        prom.close()
