"""What one operator round costs in process, without an API server: the shell's ``view()`` and the pure decision.

A cluster like ``operator_scale.py``'s (128 PipelineTrainings x 8 stages = 1,024 training Pods and GPUs, each with the
same bubble cycle, ``CYCLE``) in an ``Operator``'s ``Store``, its agents ``InMemoryAgents``; N FillJobs brought to a
steady state through the operator's own rounds (placed, some pinned to stage 0 so that some wait, some finished),
the decided writes applied to the store as an API server would (each a new resourceVersion, fill Pods created and
deleted). Then R rounds are timed, each after a few changes: ``--arrivals`` new FillJobs and ``--finishes`` running
jobs reported finished by their agents; with ``--agents progress`` every reported run's steps also move each round
(a real agent's reports), with ``--agents silent`` (operator_scale.py's ``InMemoryAgents``) no agent reports a run.

    .venv/bin/python benchmarks/round_cost.py --jobs 100 1000 5000 [--rounds 20] [--profile out/round.prof]

Prints per size the median and p90 of ``view()`` and of the decision per round (milliseconds), and with
``--profile`` the top of a cProfile of the decision rounds at the largest size (what takes the round's time). With
``--round incremental`` (or ``both``) the decision is the operator's incremental round (``decide.reconcile_round``)
and, with ``both``, each round's decisions are checked equal to a full round's on the same view. Timings move with the
machine's load: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bubbles.core.api import FillState
from bubbles.core.resources import FINALIZER, JobProgress, NodeReport, StageReport
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.decide import ClusterView, DecideCache, Decisions, reconcile
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig

NS = "scale"
CYCLE = {"training": "t", "stage": 0, "stages": 8, "microbatches": 16, "schedule": "TrainSchedule",
         "iteration_s": 0.1, "samples": 5,
         "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": 0.01,
                    "p10_s": 0.01, "p90_s": 0.01, "free_bytes": 2**30}]}
T0 = dt.datetime(2026, 11, 23, 8, 0, tzinfo=dt.UTC)


class Cluster:
    """An operator's store and agents, with the decisions of each round applied as the API server and the agents
    would: a status patch, a finalizer, a fill Pod (Running at once) each a new resourceVersion; an assignment is a run
    the agent reports (``agents``: "silent" reports none, "progress" reports each, its steps moving every round)."""

    def __init__(self, trainings: int = 128, stages: int = 8, agents: str = "silent", round_s: float = 0.2) -> None:
        self.now = T0
        self.round_s = round_s
        self.loop = asyncio.new_event_loop()  # one loop for every round, as the operator's
        self.agents = InMemoryAgents()
        self.mode = agents
        self.op = Operator(OperatorConfig(), Connection("http://127.0.0.1:9", insecure=True), self.agents,
                           wall=lambda: self.now)
        self.op._started = time.monotonic() - 3600  # long past the start-up grace
        self.rv = 0
        self.stage_reports: dict[str, tuple[StageReport, ...]] = {}
        self.runs: dict[str, dict[str, JobProgress]] = {}  # node -> uid -> what its agent reports
        self.node_of: dict[str, str] = {}  # uid -> node of its run
        self.seq = 0
        for t in range(trainings):
            name = f"train-{t:03d}"
            self.put("trainings", {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
                                   "spec": {"selector": {"matchLabels": {"training": name}}}})
            node = f"node-{t:03d}"
            reports = []
            for k in range(stages):
                pod = f"{name}-{k}"
                self.put("pods", {"metadata": {"name": pod, "namespace": NS, "uid": f"uid-{pod}",
                                               "labels": {"training": name}},
                                  "spec": {"nodeName": node, "containers": [{"name": "train", "image": "train:1"}]},
                                  "status": {"phase": "Running"}})
                reports.append(StageReport(NS, name, pod, k, f"cuda:{k}", {**CYCLE, "stage": k}, True))
            self.stage_reports[node] = tuple(reports)
            self.runs[node] = {}
            self.agents.reports[node] = NodeReport(node, tuple(reports))

    def put(self, kind: str, obj: dict[str, Any], deleted: bool = False) -> None:
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        self.op.store.put(kind, obj, deleted=deleted)

    def add_job(self, pinned: bool = False) -> str:
        name = f"job-{self.seq:05d}"
        self.seq += 1
        spec: dict[str, Any] = {"image": "fill:1", "entry": "pkg.mod:Job",
                                "profile": {"memory": "64Mi", "stepTime": "2ms"}, "work": {"steps": 100000}}
        if pinned:
            spec["stage"] = 0
        created = (self.now - dt.timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.put("fill_jobs", {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1,
                                            "creationTimestamp": created}, "spec": spec})
        return f"uid-{name}"

    def report(self, node: str) -> None:
        # A silent agent still reports a finished run, so that its job can finish.
        runs = tuple(r for r in self.runs[node].values() if self.mode != "silent" or r.state is FillState.STOPPED)
        if self.agents.reports[node].jobs != runs:  # an unchanged report is the same object, as the agents' are
            self.agents.reports[node] = NodeReport(node, self.stage_reports[node], runs)

    def finish(self, uid: str) -> None:
        """The agent reports the run finished (it keeps reporting it until it is cancelled)."""
        node = self.node_of.get(uid)
        if node is None:
            return
        run = self.runs[node][uid]
        self.runs[node][uid] = replace(run, state=FillState.STOPPED, steps_done=100000, reason="finished")
        self.report(node)

    def progress(self) -> None:
        """Every reported run made some steps since the last round."""
        for node, runs in self.runs.items():
            if not runs:
                continue
            for uid, run in runs.items():
                if run.state is FillState.SUBMITTED:
                    runs[uid] = replace(run, state=FillState.RUNNING)
                elif run.state is FillState.RUNNING:
                    runs[uid] = replace(run, steps_done=run.steps_done + 10)
            self.report(node)

    def apply(self, d: Decisions) -> None:
        """The decisions carried out: what the API server answers goes into the store, what the agents are told
        into their reports."""
        store = self.op.store
        changed_nodes: set[str] = set()
        for key, j in sorted(d.fill_jobs.items()):
            obj = store.fill_jobs.get(key)
            if obj is None:
                continue
            for ns, name in j.delete_pods:
                pod = store.pods.get(f"{ns}/{name}")
                if pod is not None:
                    self.put("pods", pod, deleted=True)
            if j.cancel_on is not None:
                if self.runs.get(j.cancel_on, {}).pop(j.uid, None) is not None:
                    changed_nodes.add(j.cancel_on)
                self.node_of.pop(j.uid, None)
            meta = dict(obj["metadata"])
            if j.add_finalizer:
                meta["finalizers"] = [*(meta.get("finalizers") or []), FINALIZER]
            if j.create_pod is not None:
                pod = j.create_pod
                self.put("pods", {**pod, "status": {"phase": "Running"}})
            if j.assignment is not None:
                a = j.assignment
                if self.runs[a.node].get(a.uid) is None or self.runs[a.node][a.uid].attempt != a.attempt:
                    self.runs[a.node][a.uid] = JobProgress(a.uid, FillState.SUBMITTED, attempt=a.attempt)
                    self.node_of[a.uid] = a.node
                    changed_nodes.add(a.node)
            new = {**obj, "metadata": meta}
            if j.status is not None:
                new["status"] = j.status
            if j.remove_finalizer:
                self.put("fill_jobs", new, deleted=True)
            elif j.status is not None or j.add_finalizer:
                self.put("fill_jobs", new)
        for key, status in d.training_status.items():
            obj = store.trainings.get(key)
            if obj is not None:
                self.put("trainings", {**obj, "status": status})
        for node in changed_nodes:
            self.report(node)

    def tick(self) -> None:
        self.now += dt.timedelta(seconds=self.round_s)

    def view(self) -> ClusterView:
        return self.loop.run_until_complete(self.op.view())

    def close(self) -> None:
        self.loop.close()


def settle(c: Cluster, jobs: int, pinned_every: int, finished_share: float, decide: Callable[..., Decisions]) -> None:
    """N FillJobs brought to a steady state: placed where they fit, ``finished_share`` of the placed ones finished."""
    for i in range(jobs):
        c.add_job(pinned=pinned_every > 0 and i % pinned_every == 0)
    for _ in range(3):
        c.apply(decide(c.view()))
        c.tick()
    placed = [uid for uid in c.node_of]
    for uid in placed[: int(len(placed) * finished_share)]:
        c.finish(uid)
    for _ in range(4):
        c.progress()
        c.apply(decide(c.view()))
        c.tick()


def phases(c: Cluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for obj in c.op.store.fill_jobs.values():
        ph = str((obj.get("status") or {}).get("phase"))
        out[ph] = out.get(ph, 0) + 1
    return out


def measure(jobs: int, rounds: int, args: argparse.Namespace, profile: cProfile.Profile | None) -> dict[str, Any]:
    c = Cluster(args.trainings, args.stages, args.agents)
    full_cache = DecideCache()
    incremental = args.round in ("incremental", "both")
    if incremental:  # imported here: the full round alone measures a tree without it (before/after)
        from bubbles.operator.decide import reconcile_round

    def decide(view: ClusterView) -> Decisions:
        if incremental:
            return reconcile_round(view, c.op.cache)
        return reconcile(view, full_cache)

    settle(c, jobs, args.pinned_every, args.finished, decide)
    before = phases(c)
    view_ms: list[float] = []
    decide_ms: list[float] = []
    full_ms: list[float] = []
    mismatches = 0
    examined: list[int] = []
    finishing = iter(list(c.node_of))
    for _ in range(rounds):
        for _ in range(args.arrivals):
            c.add_job()
        for _ in range(args.finishes):
            uid = next(finishing, None)
            if uid is not None:
                c.finish(uid)
        if args.agents == "progress":
            c.progress()
        t0 = time.thread_time()
        view = c.view()
        t1 = time.thread_time()
        if profile is not None:
            profile.enable()
        d = decide(view)
        if profile is not None:
            profile.disable()
        t2 = time.thread_time()
        view_ms.append((t1 - t0) * 1e3)
        decide_ms.append((t2 - t1) * 1e3)
        if args.round == "both":
            examined.append(c.op.cache.rounds.examined)
            t3 = time.thread_time()
            oracle = reconcile(view, full_cache)
            full_ms.append((time.thread_time() - t3) * 1e3)
            mismatches += d != oracle
        c.apply(d)
        c.tick()
    c.close()

    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median_ms": round(statistics.median(xs), 2), "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 2)}

    out: dict[str, Any] = {"jobs": jobs, "phases_before": before, "phases_after": phases(c),
                           "view": stats(view_ms), "decide": stats(decide_ms)}
    if full_ms:
        out["full"] = stats(full_ms)
        out["decide_over_full"] = round(statistics.median(decide_ms) / statistics.median(full_ms), 3)
        out["mismatched_rounds"] = mismatches
        out["jobs_looked_at_median"] = statistics.median(examined)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, nargs="+", default=[100, 1000, 5000])
    p.add_argument("--trainings", type=int, default=128)
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per size")
    p.add_argument("--arrivals", type=int, default=2, help="new FillJobs before each timed round")
    p.add_argument("--finishes", type=int, default=2, help="runs reported finished before each timed round")
    p.add_argument("--pinned-every", type=int, default=5,
                   help="every k-th FillJob is pinned to stage 0 (so that some wait); 0: none")
    p.add_argument("--finished", type=float, default=0.3, help="share of the placed jobs finished in the set-up")
    p.add_argument("--agents", choices=("silent", "progress"), default="silent",
                   help="silent: agents report no run (operator_scale.py's); progress: every run, steps moving")
    p.add_argument("--round", choices=("full", "incremental", "both"), default="full")
    p.add_argument("--profile", type=Path, default=None, help="cProfile the largest size's decisions into this file")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if min(args.jobs) < 1 or args.rounds < 1 or args.trainings < 1 or args.stages < 1:
        p.error("--jobs, --rounds, --trainings and --stages must be >= 1")
    results = []
    for n in args.jobs:
        prof = cProfile.Profile() if args.profile is not None and n == max(args.jobs) else None
        res = measure(n, args.rounds, args, prof)
        results.append(res)
        print(json.dumps(res), flush=True)
        if prof is not None:
            args.profile.parent.mkdir(parents=True, exist_ok=True)
            prof.dump_stats(str(args.profile))
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(35)
            print(text.getvalue())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
