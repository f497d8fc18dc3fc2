"""The operator's Prometheus metrics (its own registry), set from each reconcile's outcome."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bubbles.core.resources import FillJobPhase


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_length = Gauge("bubbles_operator_queue_length", "FillJobs waiting for a bubble (phase Queued)",
                                  registry=r)
        self.fill_jobs = Gauge("bubbles_operator_fill_jobs", "FillJobs by phase", ["phase"], registry=r)
        self.placement_latency = Histogram(
            "bubbles_operator_placement_latency_seconds", "From a FillJob's creation to its first placement",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800, 3600), registry=r)
        self.deadline_misses = Gauge("bubbles_operator_deadline_misses",
                                     "FillJobs whose expected finish misses their deadline", registry=r)
        self.recovered_flops = Gauge("bubbles_operator_recovered_flops",
                                     "FLOPs fill jobs did in the bubbles of a training (sum over its FillJobs; "
                                     "a requeued one counts for the training it last ran on)",
                                     ["namespace", "training"], registry=r)
        self._flops_series: set[tuple[str, str]] = set()  # the label sets recovered_flops holds
        # FillJob (namespace, name) -> the training it last ran on: a requeued job (no assignment while it waits)
        # still counts there, so the series does not dip or vanish until it is placed again.
        self._ran_on: dict[tuple[str, str], str] = {}
        self.reconcile_errors = Counter("bubbles_operator_reconcile_errors", "Reconcile rounds that failed",
                                        registry=r)
        self.reconciles = Counter("bubbles_operator_reconciles", "Reconcile rounds", registry=r)
        self.api_writes = Counter("bubbles_operator_api_writes", "Writes to the Kubernetes API by kind", ["kind"],
                                  registry=r)
        self.api_write_seconds = Histogram(
            "bubbles_operator_api_write_seconds", "How long each write to the Kubernetes API took, by kind (the "
            "request's round trip, from the write thread; a slow API server shows here before in placement latency)",
            ["kind"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.leader = Gauge("bubbles_operator_leader", "1 while this replica holds the leader Lease", registry=r)
        self.completion = Histogram(
            "bubbles_operator_completion_seconds", "From a FillJob's creation to its success",
            buckets=(10, 30, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400, 259200), registry=r)
        # Where a placed job runs, to the GPU: its stage and the stage's ranks it runs on ("0"; "0,1" for a job over
        # two GPUs), as the agents' series name a GPU (namespace, training, stage, rank).
        placed = ["namespace", "fill_job", "training", "stage", "ranks", "node"]
        self.progress = Gauge("bubbles_operator_fill_job_progress_ratio",
                              "Share of its steps a placed FillJob has done", placed, registry=r)
        self.eta = Gauge("bubbles_operator_fill_job_eta_timestamp_seconds",
                         "When a placed FillJob is expected to finish (Unix time)", placed, registry=r)
        self._server: Any = None

    def observe(self, fill_jobs: Sequence[Mapping[str, Any]]) -> None:
        """Phases, queue, deadline misses and recovered FLOPs from the FillJobs as they are now."""
        phases = {p.value: 0 for p in FillJobPhase}
        misses = 0
        flops: dict[tuple[str, str], float] = {}
        ran_on, self._ran_on = self._ran_on, {}
        for obj in fill_jobs:
            st = obj.get("status") or {}
            phase = st.get("phase")
            if phase in phases:
                phases[phase] += 1
            if st.get("deadlineFeasible") is False and phase not in ("Succeeded", "Failed"):
                misses += 1
            meta = obj.get("metadata") or {}
            job = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            training = (st.get("assignment") or {}).get("training") or ran_on.get(job)
            if training:
                self._ran_on[job] = training  # kept for the FillJobs that still exist, and only those
                key = (job[0], training)
                flops[key] = flops.get(key, 0.0) + float(st.get("recoveredFlops") or 0.0)
        for phase, n in phases.items():
            self.fill_jobs.labels(phase).set(n)
        self.queue_length.set(phases[FillJobPhase.QUEUED.value])
        self.deadline_misses.set(misses)
        for (ns, training), v in flops.items():
            self.recovered_flops.labels(ns, training).set(v)
        for gone in self._flops_series - set(flops):  # no FillJob of it left: its series goes, not a stale value
            self.recovered_flops.remove(*gone)
        self._flops_series = set(flops)
        # One series per placed job (the table of running jobs): rebuilt each round, so finished jobs drop out.
        self.progress.clear()
        self.eta.clear()
        for obj in fill_jobs:
            st = obj.get("status") or {}
            a = st.get("assignment") or {}
            if st.get("phase") not in ("Placed", "Running", "Paused") or not a:
                continue
            meta = obj.get("metadata") or {}
            ranks = ",".join(str(r) for r in a.get("ranks") or (0,))  # (0,): placed by an operator before ranks
            labels = (meta.get("namespace", ""), meta.get("name", ""), a.get("training", ""), str(a.get("stage", "")),
                      ranks, a.get("node", ""))
            done = (st.get("progress") or {}).get("percent")
            if done is not None:
                self.progress.labels(*labels).set(float(done) / 100)
            if st.get("eta"):
                import datetime as dt

                when = dt.datetime.fromisoformat(str(st["eta"]).replace("Z", "+00:00"))
                self.eta.labels(*labels).set(when.timestamp())

    def serve(self, port: int, addr: str) -> int:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
