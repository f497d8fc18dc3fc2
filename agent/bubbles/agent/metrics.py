"""The agent's Prometheus metrics, in its own registry (tests and several agents never collide).

Harvest totals (bubble seconds, filled seconds, steps, FLOPs, overruns) are computed from the
ledgers when scraped, so they always agree with the stats file; events (kills, rejected
messages) and the latest iteration time and share are ordinary counters and gauges. The isolation
state (``bubbles_isolation_ready``, ``bubbles_isolation_state``, ``bubbles_isolation_losses_total``,
``bubbles_mps_daemon_restarts_total``) is read from the agent's status at scrape time too.

Series of one GPU carry ``namespace`` (the training's; ``_local`` outside Kubernetes), ``stage`` and ``rank`` (its
index among the stage's ranks): every rank of a stage is harvested on its own. Sum over ``rank`` for a stage's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bubbles.core.api import IsolationState
from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey

from .core import IsolationTotals, JobTotals, Snapshot, StageTotals

__all__ = ["AgentMetrics", "IsolationTotals", "JobTotals", "Snapshot", "StageTotals", "names"]


ISOLATION_STATES = IsolationState.labels()


_JobSeries = tuple[int, int, str, str]  # (stage, rank, device, fill job)


class _HarvestCollector(Collector):
    def __init__(self, training: str, namespace: str, snapshot: Callable[[], Snapshot],
                 seen_job: Callable[[int, int, str, str], object] = lambda stage, rank, device, job: None,
                 jobs_now: Callable[[set[_JobSeries]], object] = lambda jobs: None) -> None:
        self.training = training
        self.namespace = namespace
        self.snapshot = snapshot
        self.seen_job = seen_job
        self.jobs_now = jobs_now

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        t, ns = self.training, self.namespace
        labels = ["training", "namespace", "stage", "rank", "device", "mode"]
        bubble = CounterMetricFamily("bubbles_bubble_seconds", "Bubble time signalled by the training",
                                     labels=labels)
        filled = CounterMetricFamily("bubbles_filled_bubble_seconds",
                                     "Fill-step time that ran inside a bubble", labels=labels)
        overrun = CounterMetricFamily("bubbles_overrun_seconds",
                                      "Fill-step time outside every bubble (costs the training)",
                                      labels=labels)
        tail_filled = CounterMetricFamily("bubbles_tail_filled_bubble_seconds",
                                          "Of the filled bubble time, what fill steps started past a bubble's "
                                          "predicted end filled (the tail: the training's tailRisk)", labels=labels)
        tail_overrun = CounterMetricFamily("bubbles_tail_overrun_seconds",
                                           "Of the overrun, the tail steps' (started past a bubble's predicted end)",
                                           labels=labels)
        for s in snap.stages:
            lv = [t, ns, str(s.stage), str(s.rank), s.device, s.mode]
            bubble.add_metric(lv, s.bubble_s)
            filled.add_metric(lv, s.filled_s)
            overrun.add_metric(lv, s.overrun_s)
            tail_filled.add_metric(lv, s.tail_filled_s)
            tail_overrun.add_metric(lv, s.tail_overrun_s)
        newer = CounterMetricFamily("bubbles_newer_messages", "Datagrams of a kind only a newer hook sends, ignored by "
                                    "this agent (upgrade the agent)", labels=["training", "namespace"])
        newer.add_metric([t, ns], snap.newer_messages)
        late = CounterMetricFamily("bubbles_late_records", "Steps and bubbles reported after their time was folded "
                                   "into the totals, counted against fill work", labels=["training", "namespace"])
        late.add_metric([t, ns], snap.late_records)
        jl = [*labels, "fill_job"]
        steps = CounterMetricFamily("bubbles_fill_steps", "Fill-job steps completed", labels=jl)
        flops = CounterMetricFamily("bubbles_recovered_flops", "FLOPs of completed fill steps", labels=jl)
        for j in snap.jobs:
            lv = [t, ns, str(j.stage), str(j.rank), j.device, j.mode, j.job]
            steps.add_metric(lv, j.steps)
            self.seen_job(j.stage, j.rank, j.device, j.job)
            flops.add_metric(lv, j.flops)
        # Every job still held, killed in its first step (no totals yet) included.
        self.jobs_now({(j.stage, j.rank, j.device, j.job) for j in snap.jobs} | set(snap.held_jobs))
        jobs = GaugeMetricFamily("bubbles_fill_jobs", "Fill jobs by life-cycle state",
                                 labels=["training", "namespace", "stage", "rank", "device", "state"])
        counts: dict[tuple[int, int, str, str], int] = {}
        for key in snap.job_states:
            counts[key] = counts.get(key, 0) + 1
        for (stage, rank, device, state), n in sorted(counts.items()):
            jobs.add_metric([t, ns, str(stage), str(rank), device, state], n)
        yield from (bubble, filled, overrun, tail_filled, tail_overrun, newer, late, steps, flops, jobs)
        budget = GaugeMetricFamily("bubbles_slowdown_budget", "The training slowdown the guard tolerates (0.01 = 1%)",
                                   labels=["training", "namespace"])
        budget.add_metric([t, ns], snap.budget)
        yield budget
        if snap.baseline_s is not None:
            baseline = GaugeMetricFamily("bubbles_guard_baseline_seconds", "The training's iteration time without fill "
                                         "work, as the slowdown guard measured it", labels=["training", "namespace"])
            baseline.add_metric([t, ns], snap.baseline_s)
            yield baseline
        iso = snap.isolation
        if iso is None:
            return
        ready = GaugeMetricFamily("bubbles_isolation_ready",
                                  "1 while the chosen isolation mode works; 0 while fill jobs are held back or run "
                                  "unisolated", labels=["training", "namespace", "mode"])
        ready.add_metric([t, ns, iso.mode], 1.0 if iso.state == "ready" else 0.0)
        current = GaugeMetricFamily("bubbles_isolation_state", "1 for the isolation's current state, 0 for the others",
                                  labels=["training", "namespace", "mode", "state"])
        for name in ISOLATION_STATES:
            current.add_metric([t, ns, iso.mode, name], 1.0 if iso.state == name else 0.0)
        losses = CounterMetricFamily("bubbles_isolation_losses", "Times working isolation was lost (fill jobs "
                                     "that were its clients are stopped and resubmitted)",
                                     labels=["training", "namespace", "mode"])
        losses.add_metric([t, ns, iso.mode], iso.losses)
        yield from (ready, current, losses)
        if snap.training_mps_clients:
            client = GaugeMetricFamily("bubbles_training_mps_client", "1 while the training's process on the GPU is "
                                       "a client of the node's MPS server, 0 while it is not (under mps isolation; "
                                       "absent while not known)",
                                       labels=["training", "namespace", "stage", "rank", "device"])
            for stage, rank, device, yes in snap.training_mps_clients:
                client.add_metric([t, ns, str(stage), str(rank), device], 1.0 if yes else 0.0)
            yield client
        if iso.mps_restarts is not None:
            restarts = CounterMetricFamily("bubbles_mps_daemon_restarts",
                                           "MPS control daemon restarts by this agent after losing it",
                                           labels=["training", "namespace"])
            restarts.add_metric([t, ns], iso.mps_restarts)
            yield restarts


class AgentMetrics:
    """Every metric the agent exports; ``snapshot`` is called (from the scrape thread) for the totals."""

    def __init__(self, training: str, snapshot: Callable[[], Snapshot], namespace: str = LOCAL_NAMESPACE) -> None:
        self.training = training
        self.namespace = namespace
        self.registry = CollectorRegistry()
        r = self.registry
        self.kills = Counter("bubbles_fill_kills",
                             "Fill jobs SIGKILLed: in a step past its bubble's end and the grace period, in init past "
                             "its deadline, or still running 30 s after being asked to stop",
                             ["training", "namespace", "stage", "rank", "device", "fill_job"],
                             registry=None)  # after the collector
        self.rejected_total = Counter("bubbles_rejected_messages", "Malformed datagrams or control lines dropped, and "
                                      "datagrams from a process other than the training's",
                                      ["training", "namespace", "stage", "rank", "source"], registry=r)
        self.missed_ends = Counter("bubbles_missed_bubble_ends",
                                   "Plain fill commands frozen by the agent because their bubble's END had not come "
                                   "within twice its predicted length (an END lost, or a bubble that long)",
                                   ["training", "namespace", "stage", "rank"], registry=r)
        self.iteration_s = Gauge("bubbles_main_iteration_seconds", "Latest training iteration time",
                               ["training", "namespace", "stage", "rank"], registry=r)
        self.share_gauge = Gauge("bubbles_fill_share", "Share of each bubble the slowdown guard gives fill work",
                           ["training", "namespace"], registry=r)
        self.share_gauge.labels(training, namespace).set(1.0)
        # Every fill job's kill counter exists from its first scrape, at 0: "no kills" is a 0 on the dashboard,
        # not "No data" (a labelled counter is otherwise born only at its first increment).
        self._kill_series: set[_JobSeries] = set()
        self._kill_lock = threading.Lock()
        r.register(_HarvestCollector(training, namespace, snapshot, self._seen_job, self._jobs_now))
        r.register(self.kills)  # collected after the jobs are: a job's series is born and let go of in one scrape
        self._server: Any = None

    def _kill_labels(self, stage: int, rank: int, device: str, job: str) -> list[str]:
        return [self.training, self.namespace, str(stage), str(rank), device, job]

    def _seen_job(self, stage: int, rank: int, device: str, job: str) -> None:
        with self._kill_lock:
            self.kills.labels(*self._kill_labels(stage, rank, device, job))
            self._kill_series.add((stage, rank, device, job))

    def _jobs_now(self, jobs: set[_JobSeries]) -> None:
        """Drop the kill series of jobs the core has let go of (it keeps the latest finished ones): one series per
        job ever would grow for good. The dashboard sums their rates, which a series that ends does not upset."""
        with self._kill_lock:  # the scrape thread; kill() comes from the agent's
            for series in self._kill_series - jobs:
                with contextlib.suppress(KeyError):
                    self.kills.remove(*self._kill_labels(*series))
            self._kill_series &= jobs

    # The core's MetricsSink: what is counted rather than derived from the core's state.
    def kill(self, key: GpuKey, device: str, job: str) -> None:
        with self._kill_lock:
            self.kills.labels(*self._kill_labels(key.stage, key.rank, device, job)).inc()
            self._kill_series.add((key.stage, key.rank, device, job))

    def rejected(self, key: GpuKey, source: str) -> None:
        self.rejected_total.labels(self.training, self.namespace, str(key.stage), str(key.rank), source).inc()

    def missed_end(self, key: GpuKey) -> None:
        self.missed_ends.labels(self.training, self.namespace, str(key.stage), str(key.rank)).inc()

    def iteration(self, key: GpuKey, seconds: float) -> None:
        self.iteration_s.labels(self.training, self.namespace, str(key.stage), str(key.rank)).set(seconds)

    def share(self, value: float) -> None:
        self.share_gauge.labels(self.training, self.namespace).set(value)

    def serve(self, port: int, addr: str) -> int:
        """Start the HTTP endpoint in a daemon thread; return the bound port (useful with port 0)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class NodeMetrics:
    """Cluster mode's one endpoint for the node: every training's metrics (each training's agent keeps its own
    registry; families of one name are merged, as the exposition format needs) and the node's own: assignments
    by state and refused attach attempts."""

    def __init__(self, registries: Callable[[], list[CollectorRegistry]],
                 assignments: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.refused = Counter("bubbles_attach_refused", "Fill processes the agent refused to admit (not assigned "
                               "here, another attempt, another GPU, an invisible PID, a bad hello)",
                               registry=self.registry)
        self.registry.register(_NodeCollector(registries, assignments))
        self._server: Any = None

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


class _NodeCollector(Collector):
    def __init__(self, registries: Callable[[], list[CollectorRegistry]],
                 assignments: Callable[[], dict[str, int]]) -> None:
        self.registries = registries
        self.assignments = assignments

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self.registries():
            for family in registry.collect():
                have = merged.get(family.name)
                if have is None:
                    merged[family.name] = family
                else:
                    have.samples.extend(family.samples)
        yield from merged.values()
        states = GaugeMetricFamily("bubbles_fill_assignments", "Fill jobs the operator assigned to this node, by "
                                   "state (waiting: its Pod has not attached yet)", labels=["state"])
        for state, n in sorted(self.assignments().items()):
            states.add_metric([state], n)
        yield states


def names(lines: Iterable[str]) -> set[str]:
    """Metric names in a Prometheus text exposition (for tests and checks)."""
    out = set()
    for line in lines:
        if line and not line.startswith("#"):
            out.add(line.split("{", 1)[0].split(" ", 1)[0])
    return out
