"""The agent's Prometheus metrics, in its own registry (tests and several agents never collide).

Harvest totals (bubble seconds, filled seconds, steps, FLOPs, overruns) are computed from the
ledgers when scraped, so they always agree with the stats file; events (kills, rejected
messages) and the latest iteration time and share are ordinary counters and gauges. The isolation
state (``bubbles_isolation_ready``, ``bubbles_isolation_state``, ``bubbles_isolation_losses_total``,
``bubbles_mps_daemon_restarts_total``) is read from the agent's status at scrape time too.
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

from .core import IsolationTotals, JobTotals, Snapshot, StageTotals

__all__ = ["AgentMetrics", "IsolationTotals", "JobTotals", "Snapshot", "StageTotals", "names"]


ISOLATION_STATES = IsolationState.labels()


class _HarvestCollector(Collector):
    def __init__(self, training: str, snapshot: Callable[[], Snapshot],
                 seen_job: Callable[[int, str, str], object] = lambda stage, device, job: None,
                 jobs_now: Callable[[set[tuple[int, str, str]]], object] = lambda jobs: None) -> None:
        self.training = training
        self.snapshot = snapshot
        self.seen_job = seen_job
        self.jobs_now = jobs_now

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        labels = ["training", "stage", "device", "mode"]
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
            lv = [self.training, str(s.stage), s.device, s.mode]
            bubble.add_metric(lv, s.bubble_s)
            filled.add_metric(lv, s.filled_s)
            overrun.add_metric(lv, s.overrun_s)
            tail_filled.add_metric(lv, s.tail_filled_s)
            tail_overrun.add_metric(lv, s.tail_overrun_s)
        newer = CounterMetricFamily("bubbles_newer_messages", "Datagrams of a kind only a newer hook sends, ignored by "
                                    "this agent (upgrade the agent)", labels=["training"])
        newer.add_metric([self.training], snap.newer_messages)
        late = CounterMetricFamily("bubbles_late_records", "Steps and bubbles reported after their time was folded "
                                   "into the totals, counted against fill work", labels=["training"])
        late.add_metric([self.training], snap.late_records)
        jl = [*labels, "fill_job"]
        steps = CounterMetricFamily("bubbles_fill_steps", "Fill-job steps completed", labels=jl)
        flops = CounterMetricFamily("bubbles_recovered_flops", "FLOPs of completed fill steps", labels=jl)
        for j in snap.jobs:
            lv = [self.training, str(j.stage), j.device, j.mode, j.job]
            steps.add_metric(lv, j.steps)
            self.seen_job(j.stage, j.device, j.job)
            flops.add_metric(lv, j.flops)
        # Every job still held, killed in its first step (no totals yet) included.
        self.jobs_now({(j.stage, j.device, j.job) for j in snap.jobs} | set(snap.held_jobs))
        jobs = GaugeMetricFamily("bubbles_fill_jobs", "Fill jobs by life-cycle state",
                                 labels=["training", "stage", "device", "state"])
        counts: dict[tuple[int, str, str], int] = {}
        for key in snap.job_states:
            counts[key] = counts.get(key, 0) + 1
        for (stage, device, state), n in sorted(counts.items()):
            jobs.add_metric([self.training, str(stage), device, state], n)
        yield from (bubble, filled, overrun, tail_filled, tail_overrun, newer, late, steps, flops, jobs)
        budget = GaugeMetricFamily("bubbles_slowdown_budget", "The training slowdown the guard tolerates (0.01 = 1%)",
                                   labels=["training"])
        budget.add_metric([self.training], snap.budget)
        yield budget
        if snap.baseline_s is not None:
            baseline = GaugeMetricFamily("bubbles_guard_baseline_seconds", "The training's iteration time without fill "
                                         "work, as the slowdown guard measured it", labels=["training"])
            baseline.add_metric([self.training], snap.baseline_s)
            yield baseline
        iso = snap.isolation
        if iso is None:
            return
        ready = GaugeMetricFamily("bubbles_isolation_ready",
                                  "1 while the chosen isolation mode works; 0 while fill jobs are held back or run "
                                  "unisolated", labels=["training", "mode"])
        ready.add_metric([self.training, iso.mode], 1.0 if iso.state == "ready" else 0.0)
        current = GaugeMetricFamily("bubbles_isolation_state", "1 for the isolation's current state, 0 for the others",
                                  labels=["training", "mode", "state"])
        for name in ISOLATION_STATES:
            current.add_metric([self.training, iso.mode, name], 1.0 if iso.state == name else 0.0)
        losses = CounterMetricFamily("bubbles_isolation_losses", "Times working isolation was lost (fill jobs "
                                     "that were its clients are stopped and resubmitted)", labels=["training", "mode"])
        losses.add_metric([self.training, iso.mode], iso.losses)
        yield from (ready, current, losses)
        if snap.training_mps_clients:
            client = GaugeMetricFamily("bubbles_training_mps_client", "1 while the training's process on the stage is "
                                       "a client of the node's MPS server, 0 while it is not (under mps isolation; "
                                       "absent while not known)", labels=["training", "stage", "device"])
            for stage, device, yes in snap.training_mps_clients:
                client.add_metric([self.training, str(stage), device], 1.0 if yes else 0.0)
            yield client
        if iso.mps_restarts is not None:
            restarts = CounterMetricFamily("bubbles_mps_daemon_restarts",
                                           "MPS control daemon restarts by this agent after losing it",
                                           labels=["training"])
            restarts.add_metric([self.training], iso.mps_restarts)
            yield restarts


class AgentMetrics:
    """Every metric the agent exports; ``snapshot`` is called (from the scrape thread) for the totals."""

    def __init__(self, training: str, snapshot: Callable[[], Snapshot]) -> None:
        self.training = training
        self.registry = CollectorRegistry()
        r = self.registry
        self.kills = Counter("bubbles_fill_kills",
                             "Fill jobs SIGKILLed: in a step past its bubble's end and the grace period, in init past "
                             "its deadline, or still running 30 s after being asked to stop",
                             ["training", "stage", "device", "fill_job"], registry=None)  # after the collector
        self.rejected_total = Counter("bubbles_rejected_messages", "Malformed datagrams or control lines dropped, and "
                                      "datagrams from a process other than the training's",
                                      ["training", "stage", "source"], registry=r)
        self.missed_ends = Counter("bubbles_missed_bubble_ends",
                                   "Plain fill commands frozen by the agent because their bubble's END had not come "
                                   "within twice its predicted length (an END lost, or a bubble that long)",
                                   ["training", "stage"], registry=r)
        self.iteration_s = Gauge("bubbles_main_iteration_seconds", "Latest training iteration time",
                               ["training", "stage"], registry=r)
        self.share_gauge = Gauge("bubbles_fill_share", "Share of each bubble the slowdown guard gives fill work",
                           ["training"], registry=r)
        self.share_gauge.labels(training).set(1.0)
        # Every fill job's kill counter exists from its first scrape, at 0: "no kills" is a 0 on the dashboard,
        # not "No data" (a labelled counter is otherwise born only at its first increment).
        self._kill_series: set[tuple[int, str, str]] = set()
        self._kill_lock = threading.Lock()
        r.register(_HarvestCollector(training, snapshot, self._seen_job, self._jobs_now))
        r.register(self.kills)  # collected after the jobs are: a job's series is born and let go of in one scrape
        self._server: Any = None

    def _seen_job(self, stage: int, device: str, job: str) -> None:
        with self._kill_lock:
            self.kills.labels(self.training, str(stage), device, job)
            self._kill_series.add((stage, device, job))

    def _jobs_now(self, jobs: set[tuple[int, str, str]]) -> None:
        """Drop the kill series of jobs the core has let go of (it keeps the latest finished ones): one series per
        job ever would grow for good. The dashboard sums their rates, which a series that ends does not upset."""
        with self._kill_lock:  # the scrape thread; kill() comes from the agent's
            for stage, device, job in self._kill_series - jobs:
                with contextlib.suppress(KeyError):
                    self.kills.remove(self.training, str(stage), device, job)
            self._kill_series &= jobs

    # The core's MetricsSink: what is counted rather than derived from the core's state.
    def kill(self, stage: int, device: str, job: str) -> None:
        with self._kill_lock:
            self.kills.labels(self.training, str(stage), device, job).inc()
            self._kill_series.add((stage, device, job))

    def rejected(self, stage: int, source: str) -> None:
        self.rejected_total.labels(self.training, str(stage), source).inc()

    def missed_end(self, stage: int) -> None:
        self.missed_ends.labels(self.training, str(stage)).inc()

    def iteration(self, stage: int, seconds: float) -> None:
        self.iteration_s.labels(self.training, str(stage)).set(seconds)

    def share(self, value: float) -> None:
        self.share_gauge.labels(self.training).set(value)

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
