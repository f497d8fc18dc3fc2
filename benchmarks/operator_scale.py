"""Operator at scale on a real kube-apiserver: placement latency and API writes per placement.

128 PipelineTrainings of 8 stages each (1,024 training Pods, one per GPU, 8 per node) report a bubble cycle
through ``InMemoryAgents`` (the scale of the control plane is measured, not 128 agents' gRPC); 1,000 FillJobs are
created one after the other by a client as fast as it can, and a watch records when each is first seen
``Placed``. The operator runs in a process of its own, as it does in its Deployment (``--operator-child``: this
script again), against a real kube-apiserver 1.20 with etcd (tools/kube-from-debian.sh), as the operator's
ServiceAccount under its RBAC rules; the load generator and the watch run in this process.

    .venv/bin/python benchmarks/operator_scale.py --runs 3 --out out/bench/operator-scale.json

Latency is from the create call's return to the watch event showing Placed (client-side clock, so it
includes the watch's delivery). Writes are counted by the operator's KubeWriter by kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.crds import crds_for_1_20  # noqa: E402
from helpers.kubeapi import (  # noqa: E402
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    OPERATOR_TOKEN,
    ApiServer,
    api_server,
    find_assets,
)
from helpers.operator_thread import OperatorThread  # noqa: E402

from bubbles.core.resources import NodeReport, StageReport  # noqa: E402
from bubbles.core.stats import percentile  # noqa: E402
from bubbles.operator.agents import InMemoryAgents  # noqa: E402
from bubbles.operator.kube import Connection  # noqa: E402
from bubbles.operator.rbac import cluster_role, cluster_role_binding  # noqa: E402
from bubbles.operator.shell import GC_FULL_S, Operator, OperatorConfig  # noqa: E402

NS = "scale"
CYCLE = {"training": "t", "stage": 0, "stages": 8, "microbatches": 16, "schedule": "TrainSchedule",
         "iteration_s": 0.1, "samples": 5,
         "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": 0.01,
                    "p10_s": 0.01, "p90_s": 0.01, "free_bytes": 2**30}]}


def setup(kube: ApiServer, trainings: int, stages: int) -> InMemoryAgents:
    items: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NS},
         "automountServiceAccountToken": False},
        cluster_role(), cluster_role_binding(OPERATOR_NAMESPACE, OPERATOR_SA)]
    agents = InMemoryAgents()
    for t in range(trainings):
        name = f"train-{t:03d}"
        items.append({"apiVersion": "bubbles.dev/v1alpha1", "kind": "PipelineTraining",
                      "metadata": {"name": name, "namespace": NS},
                      "spec": {"selector": {"matchLabels": {"training": name}}}})
        node = f"node-{t:03d}"
        reports = []
        for k in range(stages):
            pod = f"{name}-{k}"
            items.append({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": pod, "namespace": NS, "labels": {"training": name}},
                          "spec": {"nodeName": node, "automountServiceAccountToken": False,
                                   "containers": [{"name": "train", "image": "train:1"}]}})
            reports.append(StageReport(NS, name, pod, k, f"cuda:{k}", {**CYCLE, "stage": k}, True))
        agents.reports[node] = NodeReport(node, tuple(reports))
    for i in range(0, len(items), 200):
        kube.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                 "items": items[i:i + 200]}))
    return agents


def operator_child(spec_path: Path) -> int:
    """The operator alone in this process: ``spec_path`` names the API server, the agents' reports and where to
    write the operator's counts when SIGTERM ends it."""
    import signal

    spec = json.loads(spec_path.read_text())
    agents = InMemoryAgents()
    for rep in spec["reports"]:
        report = NodeReport.from_dict(rep)
        agents.reports[report.node] = report
    conn = Connection(spec["url"], token=OPERATOR_TOKEN, ca_path=spec["ca_path"], namespace=OPERATOR_NAMESPACE)
    op = Operator(OperatorConfig(interval_s=spec["interval_s"], lease_namespace=OPERATOR_NAMESPACE,
                                 write_concurrency=spec.get("write_concurrency", OperatorConfig.write_concurrency),
                                 full_pass_s=spec.get("full_pass_s", OperatorConfig.full_pass_s),
                                 gc_full_s=spec.get("gc_full_s", GC_FULL_S)), conn, agents)
    thread = OperatorThread(op)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    ready = Path(spec["stats"] + ".ready")
    while op.rounds < 1 and not done.is_set():
        time.sleep(0.05)
    ready.write_text("ready\n")
    done.wait()
    thread.close(60)
    sums: dict[str, dict[str, float]] = {}
    for metric in op.metrics.api_write_seconds.collect():
        for sample in metric.samples:
            if sample.name.endswith(("_sum", "_count")):
                sums.setdefault(sample.labels["kind"], {})[sample.name.rsplit("_", 1)[1]] = sample.value
    Path(spec["stats"]).write_text(json.dumps({
        "write_ms_mean": {k: round(v["sum"] / v["count"] * 1e3, 1) for k, v in sums.items() if v.get("count")},
        "writes": dict(op.writes_total), "rounds": op.rounds,
        "round_ms_max": {k: round(max(r[i] for r in op.round_s) * 1e3, 1)
                         for i, k in enumerate(("see", "decide", "act"))},
        "round_ms_p50": {k: round(percentile([r[i] for r in op.round_s], 50) * 1e3, 1)
                         for i, k in enumerate(("see", "decide", "act"))},
        "round_ms_p99": {k: round(percentile([r[i] for r in op.round_s], 99) * 1e3, 1)
                         for i, k in enumerate(("see", "decide", "act"))}}))
    return 0


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds a process has used (Linux /proc), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(names: tuple[str, ...]) -> dict[str, int]:
    """This process's children whose program is one of ``names`` (the API server's etcd and kube-apiserver)."""
    found: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            prog = Path((d / "cmdline").read_bytes().split(b"\0")[0].decode()).name
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and prog in names:
            found[prog] = int(d.name)
    return found


def one_run(kube: ApiServer, jobs: int, agents: InMemoryAgents, interval_s: float, workdir: Path,
            rate: float | None = None, full_pass_s: float = OperatorConfig.full_pass_s,
            gc_full_s: float = GC_FULL_S,
            write_concurrency: int = OperatorConfig.write_concurrency) -> dict[str, Any]:
    import subprocess

    import kubernetes

    conn = Connection(kube.url, token=OPERATOR_TOKEN, ca_path=kube.ca_path, namespace=OPERATOR_NAMESPACE)
    stats = workdir / f"operator-{time.monotonic_ns()}.json"
    spec = workdir / "child.json"
    spec.write_text(json.dumps({"url": kube.url, "ca_path": kube.ca_path, "interval_s": interval_s,
                                "full_pass_s": full_pass_s, "gc_full_s": gc_full_s,
                                "write_concurrency": write_concurrency,
                                "stats": str(stats), "reports": [r.to_dict() for r in agents.reports.values()]}))
    child = subprocess.Popen([sys.executable, __file__, "--operator-child", str(spec)])
    ready = Path(f"{stats}.ready")
    deadline = time.monotonic() + 120
    while not ready.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the operator process did not start its first round")
        time.sleep(0.05)
    admin = Connection(kube.url, token="bubbles-test-admin-token", ca_path=kube.ca_path).api_client()
    custom = kubernetes.client.CustomObjectsApi(admin)
    created: dict[str, float] = {}
    placed: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        w = kubernetes.watch.Watch()
        while not stop.is_set():
            for ev in w.stream(custom.list_namespaced_custom_object, "bubbles.dev", "v1alpha1", NS, "filljobs",
                               timeout_seconds=5):
                obj = ev["object"]
                name = obj["metadata"]["name"]
                if (obj.get("status") or {}).get("phase") == "Placed" and name not in placed:
                    placed[name] = time.monotonic()
                if stop.is_set():
                    break

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)
    procs = {**_children(("kube-apiserver", "etcd")), "operator": child.pid, "client": os.getpid()}
    cpu0 = {k: _cpu_s(pid) for k, pid in procs.items()}
    t0 = time.monotonic()
    for i in range(jobs):
        if rate is not None:  # a steady arrival rate instead of a burst
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        name = f"job-{i:04d}"
        custom.create_namespaced_custom_object("bubbles.dev", "v1alpha1", NS, "filljobs", {
            "apiVersion": "bubbles.dev/v1alpha1", "kind": "FillJob", "metadata": {"name": name},
            "spec": {"image": "fill:1", "entry": "pkg.mod:Job", "profile": {"memory": "64Mi", "stepTime": "2ms"},
                     "work": {"steps": 100000}}})
        created[name] = time.monotonic()
    apply_s = time.monotonic() - t0
    deadline = time.monotonic() + 120
    while len(placed) < jobs and time.monotonic() < deadline:
        time.sleep(0.1)
    # CPU each process used from the first create to the last placement (2 cores here: at most 2 s a second in all).
    window_s = time.monotonic() - t0
    cpu = {k: round(_cpu_s(pid) - cpu0[k], 1) for k, pid in procs.items()}
    time.sleep(interval_s * 2)  # the last round's write counts
    stop.set()
    child.terminate()
    child.wait(90)
    counts = json.loads(stats.read_text())
    lat = [placed[n] - created[n] for n in created if n in placed]
    writes = counts["writes"]
    n = len(placed)
    # Clean up for the next run: delete the jobs (the next operator releases their finalizers) and their Pods.
    kube.kubectl("delete", "fj", "--all", "-n", NS, "--wait=false")
    kube.kubectl("delete", "pods", "-n", NS, "-l", "app.kubernetes.io/component=fill-job", "--wait=false",
                 "--grace-period=0", "--force")
    cleaner = OperatorThread(Operator(OperatorConfig(interval_s=0.5), conn, agents))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = json.loads(kube.kubectl("get", "fj", "-n", NS, "-o", "json").stdout)["items"]
        if not left:
            break
        time.sleep(0.5)
    cleaner.close(60)
    return {
        "jobs": jobs, "placed": n, "apply_s": round(apply_s, 2),
        "latency_p50_s": round(percentile(lat, 50), 3) if lat else None,
        "latency_p99_s": round(percentile(lat, 99), 3) if lat else None,
        "latency_max_s": round(max(lat), 3) if lat else None,
        "window_s": round(window_s, 1), "cpu_s": cpu,
        # The five slowest placements: (seconds into the run when created, latency), to tell a stall from a queue.
        "slowest": sorted(((round(created[n] - t0, 1), round(placed[n] - created[n], 2)) for n in created
                           if n in placed), key=lambda x: -x[1])[:5],
        "writes": writes, "write_ms_mean": counts["write_ms_mean"], "rounds": counts["rounds"],
        "round_ms_max": counts["round_ms_max"],
        "round_ms_p50": counts["round_ms_p50"], "round_ms_p99": counts["round_ms_p99"],
        "object_writes_per_placement": round((writes.get("status", 0) + writes.get("pod", 0)
                                              + writes.get("finalizer", 0)) / n, 2) if n else None,
        "events_per_placement": round(writes.get("event", 0) / n, 2) if n else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainings", type=int, default=128)
    p.add_argument("--stages", type=int, default=8, help="stages (training Pods, GPUs) per training")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--interval", type=float, default=1.0, help="the operator's idle reconcile interval (s)")
    p.add_argument("--full-pass-interval", type=float, default=OperatorConfig.full_pass_s,
                   help="the operator's --full-pass-interval (s; 0: every round a full pass, as before issue 37)")
    p.add_argument("--gc-full-interval", type=float, default=GC_FULL_S,
                   help="the operator process's full garbage collections (s; 0: Python's collector as it is)")
    p.add_argument("--rate", type=float, default=None, metavar="JOBS_PER_S",
                   help="create the FillJobs at this steady rate (default: as fast as the client can, a burst)")
    p.add_argument("--write-concurrency", type=int, default=OperatorConfig.write_concurrency,
                   help="the operator's API writes in flight at once (OperatorConfig.write_concurrency)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--operator-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.operator_child is not None:
        return operator_child(args.operator_child)
    if min(args.trainings, args.stages, args.jobs, args.runs, args.write_concurrency) < 1:
        p.error("--trainings, --stages, --jobs, --runs and --write-concurrency must be >= 1")
    if args.rate is not None and not args.rate > 0:
        p.error("--rate must be > 0 jobs per second")
    if not (args.full_pass_interval >= 0 and args.gc_full_interval >= 0):  # NaN fails too
        p.error("--full-pass-interval and --gc-full-interval are seconds >= 0 (0: every round a full pass; "
                "Python's collector as it is)")
    assets, why = find_assets()
    if assets is None:
        print(f"operator_scale: {why}", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.WARNING)
    runs = []
    with tempfile.TemporaryDirectory() as tmp, api_server(Path(tmp), assets) as kube:
        # Kubernetes 1.20 predates the CRDs' CEL rules: applied without them, as the tests' API server takes them.
        kube.kubectl("apply", "-f", str(crds_for_1_20(Path(tmp) / "crds")))
        kube.kubectl("wait", "--for", "condition=established", "--timeout", "30s", "crd/filljobs.bubbles.dev")
        t0 = time.monotonic()
        agents = setup(kube, args.trainings, args.stages)
        print(f"[operator_scale] {args.trainings} trainings x {args.stages} stages set up in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        for r in range(args.runs):
            res = one_run(kube, args.jobs, agents, args.interval, Path(tmp), args.rate, args.full_pass_interval,
                          args.gc_full_interval, args.write_concurrency)
            runs.append(res)
            print(f"[operator_scale] run {r + 1}: {json.dumps(res)}", flush=True)
    p50 = [r["latency_p50_s"] for r in runs if r["latency_p50_s"] is not None]
    p99 = [r["latency_p99_s"] for r in runs if r["latency_p99_s"] is not None]
    summary = {"write_concurrency": args.write_concurrency, "trainings": args.trainings,
               "stages": args.stages, "jobs": args.jobs, "rate": args.rate, "runs": runs,
               "median_of_p50_s": statistics.median(p50) if p50 else None,
               "median_of_p99_s": statistics.median(p99) if p99 else None,
               "p99_range_s": [min(p99), max(p99)] if p99 else None}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
