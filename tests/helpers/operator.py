"""Set-ups of the operator's decision tests: a training, its GPUs (stages' ranks) and their bubble cycles, fill jobs,
and one reconcile round whose decided statuses are written back into the objects, as the API server would."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from bubbles.core.cycle import BubbleCycle
from bubbles.core.nodeaccess import GpuAccess, NodeAccess, resource_name
from bubbles.operator.decide import (
    ClusterView,
    Decisions,
    FillPodSettings,
    GpuView,
    JobProgress,
    reconcile,
)

NOW = dt.datetime(2026, 11, 23, 8, 0, tzinfo=dt.UTC)


RUN_VOLUMES = ["bubbles-attach", "bubbles-fills"]  # a hostPath fill Pod's two directories of the node's run directory
CSI_VOLUMES = ["bubbles-attach"]  # a csi fill Pod's one volume, its own directory on the node
# Today's (before issue 36) fill Pods: the node's run directory by hostPath, as the agent's UID, the GPU by
# NVIDIA_VISIBLE_DEVICES.
HOST_PATH = FillPodSettings(node_access=NodeAccess.HOST_PATH, gpu_access=GpuAccess.ENVVAR)


MIB = 2**20


def cycle(stage: int = 0, bubble_s: float = 0.010, free: int = 1024 * MIB, iteration_s: float = 0.100) -> BubbleCycle:
    return BubbleCycle.from_dict({
        "training": "llama", "stage": stage, "stages": 2, "microbatches": 8, "schedule": "TrainSchedule",
        "iteration_s": iteration_s, "samples": 5,
        "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": bubble_s,
                   "p10_s": bubble_s, "p90_s": bubble_s, "free_bytes": free}]})


def stage(k: int = 0, pod: str = "llama-0", node: str = "node-a", rank: int = 0, **kw: Any) -> GpuView:
    """Rank ``rank`` of stage ``k`` of ml/llama, one GPU (cuda:<rank> of its Pod). One with a UUID is served by its
    agent's device plugin (as the chart's default is) as resource_name(rank), unless ``gpu_resource`` says else."""
    fields: dict[str, Any] = {"hook_reporting": True, "ranks": rank + 1, "device": f"cuda:{rank}", **kw}
    if fields.get("gpu_uuid") and "gpu_resource" not in fields:
        fields["gpu_resource"] = resource_name(rank)
    if "cycle" not in fields:
        fields["cycle"] = cycle(k)
    return GpuView("ml/llama", k, pod, f"uid-{pod}", node, rank=rank, **fields)


def training(labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "llama", "namespace": "ml", "uid": "t-uid", "generation": 1,
                         "labels": labels or {"team": "a"}},
            "spec": {"selector": {"matchLabels": {"app": "llama"}}, **spec}}


def fill_job(name: str = "fj", created: str = "2026-11-23T07:00:00Z", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"image": "fill:1", "entry": "pkg.mod:Job", "profile": {"memory": "64Mi", "stepTime": "2ms"},
                            "work": {"steps": 1000}}
    body.update(spec)
    return {"metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created}, "spec": body}


def step(jobs: list[dict[str, Any]], stages: list[GpuView], trainings: list[dict[str, Any]] | None = None,
         progress: dict[str, JobProgress] | None = None, now: dt.datetime = NOW,
         failed_pods: dict[str, str] | None = None, fill_pods: FillPodSettings | None = None,
         ended_pods: dict[str, str] | None = None, acting_s: float = math.inf,
         waiting_pods: dict[str, tuple[str, float]] | None = None, cuda_context_bytes: int = 0) -> Decisions:
    """One reconcile; the decided statuses are written into the objects (the API server's part)."""
    trainings = trainings if trainings is not None else [training()]
    d = reconcile(ClusterView(now, jobs, trainings, stages, progress or {}, failed_pods=failed_pods or {},
                              ended_pods=ended_pods or {}, fill_pods=fill_pods or FillPodSettings(),
                              acting_s=acting_s, waiting_pods=waiting_pods or {}, pod_start_timeout_s=600.0,
                              cuda_context_bytes=cuda_context_bytes))
    for obj in jobs:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if key in d.fill_job_status:
            obj["status"] = d.fill_job_status[key]
    for obj in trainings:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if key in d.training_status:
            obj["status"] = d.training_status[key]
    return d


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def waiting_pod(*states: tuple[str, str]) -> dict[str, Any]:
    return {"status": {"phase": "Pending", "containerStatuses": [
        {"name": f"c{i}", "state": {"waiting": {"reason": r, **({"message": m} if m else {})}}}
        for i, (r, m) in enumerate(states)]}}
