"""Placement: queued FillJobs onto free profiled GPUs, by priority tier, then by the scheduling policy (looked up by
name); a placed job gets its assignment, its fill Pod and its finalizer. The scheduler's executors are GPUs (one
executor class each, named by its ``GpuKey``): the ranks of a stage are placed on one by one, each with its own
bubbles (its own waits, its own free memory)."""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from bubbles.core.identity import GpuKey
from bubbles.core.resources import (
    FINALIZER,
    ConditionType,
    FillJobPhase,
    FillJobResource,
    PipelineTrainingResource,
    rfc3339,
    selector_matches,
)
from bubbles.operator.scheduler import FillJobRequest, Scheduler, get_policy

from .cache import DecideCache
from .filljobs import Seen, limits, placed_message, set_eta
from .pods import fill_pod, fill_pod_name
from .status import FillJobStatus
from .view import (
    PROVISIONAL_STEP_S,
    Assignment,
    ClusterView,
    Decisions,
    FillPodSettings,
    GpuView,
    gpu_context_bytes,
    key_of,
)


@functools.cache
def policy(name: str) -> Any:
    """The policy object for ``name`` (entry points are looked up once per process; policies hold no state)."""
    return get_policy(name)


def _eligible(job: FillJobResource, training_keys: Sequence[str], trainings: Mapping[str, PipelineTrainingResource],
              memo: dict[str, list[str]]) -> list[str]:
    key = f"{job.namespace}|{sorted(job.training_selector.items())!r}"
    if key not in memo:
        memo[key] = [k for k in training_keys if trainings[k].namespace == job.namespace
                     and selector_matches(job.training_selector, trainings[k].labels)]
    return memo[key]


def stage_counts(gpus: Mapping[GpuKey, GpuView], trainings: Mapping[str, PipelineTrainingResource]) -> dict[str, int]:
    """How many stages each training has, where known: its spec.stages, else what its hooks' profiles say (None
    known: left out)."""
    counts = {k: t.stages for k, t in trainings.items() if t.stages is not None}
    for g in gpus.values():
        if g.training not in counts and g.cycle is not None:
            counts[g.training] = max(counts.get(g.training, 0), g.cycle.stages)
    return counts


def place(view: ClusterView, out: Decisions, cache: DecideCache, valid: Mapping[str, Seen],
          gpus: Mapping[GpuKey, GpuView], trainings: Mapping[str, PipelineTrainingResource],
          busy: Mapping[GpuKey, tuple[str, float]], now_s: float) -> None:
    """Queued jobs onto free profiled GPUs: by priority tier, then by the scheduling policy."""
    usable = [g for g in gpus.values() if g.cycle is not None and g.agent_up]
    # A job evicted this round is placed from the next: its eviction (Pod deleted, run cancelled, restarts counted) is
    # written first, whatever becomes of its next Pod (one the API server refuses writes nothing of its round).
    queued = [(obj, job, st) for obj, job, st in valid.values()
              if st.phase_now is FillJobPhase.QUEUED and not st.evicted]
    if not queued:
        return
    if not usable:
        for _obj, _job, st in queued:
            why = ("no PipelineTraining has reported its bubbles yet (is the hook attached, and the agent running on "
                   "its nodes?)")
            st.condition(ConditionType.PLACED, False, "NoProfiledTraining", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
        return
    classes = [cache.executor_class(g, trainings[g.training], gpu_context_bytes(view, g)) for g in usable]
    by_name = {c.name: g for c, g in zip(classes, usable, strict=True)}
    sched = Scheduler(classes, policy(view.policy))
    for e, g in enumerate(usable):  # one executor per class: executor e is class e
        if g.key in busy:
            sched.occupy(e, busy[g.key][0], busy[g.key][1])
    requests: dict[str, Seen] = {}
    tiers: dict[int, list[FillJobRequest]] = {}
    class_names: dict[tuple[str, int | None], set[str]] = {}  # (training, stage or None: any) -> its usable GPUs
    for c in classes:
        g = by_name[c.name]
        class_names.setdefault((g.training, None), set()).add(c.name)
        class_names.setdefault((g.training, g.stage), set()).add(c.name)
    counts: dict[str, int] | None = None
    eligible_sets: dict[tuple[tuple[str, ...], int | None], frozenset[str]] = {}
    training_keys = sorted(trainings)
    selector_memo: dict[str, list[str]] = {}
    for obj, job, st in queued:
        refused = view.refused_pods.get(job.uid)
        if refused is not None and now_s - refused[1] < view.pod_retry_s:
            fix = ("change what refuses it (a ResourceQuota, a LimitRange, the namespace's Pod Security level)"
                   if refused[0].startswith("403") else
                   "the cluster finds the Pod's spec invalid: a cluster policy, or a bug to report with this message")
            why = (f"the API server refused its Pod: {refused[0]}. It is placed again every {view.pod_retry_s:g} s "
                   f"until its Pod is admitted: {fix}")
            before: Mapping[str, Any] = next(
                (c for c in st.before.get("conditions") or () if c.get("type") == "Placed"), {})
            st.condition(ConditionType.PLACED, False, "PodRefused", why)
            # One Warning Event while the refusal lasts, though its words may change (a quota's counts do).
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}", warning=True,
                     event=None if before.get("reason") == "PodRefused" else "PodRefused")
            continue
        allowed = _eligible(job, training_keys, trainings, selector_memo)
        if not allowed:
            why = "no PipelineTraining in this namespace matches spec.trainingSelector"
            st.condition(ConditionType.PLACED, False, "NoMatchingTraining", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NoMatchingTraining", warning=True)
            continue
        if job.stage is not None:
            counts = counts if counts is not None else stage_counts(gpus, trainings)
            having = [a for a in allowed if a not in counts or job.stage < counts[a]]
            if not having:
                have = ", ".join(f"{a} has {counts[a]} (0-{counts[a] - 1})" for a in allowed)
                why = (f"spec.stage {job.stage} is no stage of the PipelineTrainings it may use: {have}; set "
                       "spec.stage to one of theirs, or leave it out to use any stage")
                st.condition(ConditionType.PLACED, False, "NoSuchStage", why)
                st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NoSuchStage", warning=True)
                continue
            allowed = having
        key_allowed = (tuple(allowed), job.stage)
        eligible = eligible_sets.get(key_allowed)
        if eligible is None:
            eligible = eligible_sets[key_allowed] = frozenset().union(
                *(class_names.get((a, job.stage), ()) for a in allowed))
        created = (obj.get("metadata") or {}).get("creationTimestamp")
        arrival = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() if created else now_s
        req = FillJobRequest(job.uid or key_of(obj), cache.profile(job), job.steps * job.samples_per_step,
                             arrival_s=arrival, deadline_s=job.deadline.timestamp() if job.deadline else None,
                             eligible=eligible, setup_s=job.init_s)
        if not eligible and job.stage is not None:
            why = (f"no GPU of stage {job.stage} of {', '.join(allowed)} has reported its bubbles yet (spec.stage "
                   f"pins the job there)")
            st.condition(ConditionType.PLACED, False, "StageNotProfiled", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
            continue
        if not eligible or not math.isfinite(min(sched.processing_times_s(req))):
            pinned = f"stage {job.stage} of " if job.stage is not None else ""
            why = (f"fits no profiled bubble of {pinned}{', '.join(allowed)}: each step needs "
                   f"{(job.job.gating_step_s or PROVISIONAL_STEP_S) * 1e3:.3g} ms and "
                   f"{job.job.memory_bytes / 2**20:.0f} MiB; lower spec.profile.memory or the step's batch")
            st.condition(ConditionType.PLACED, False, "NoBubbleFits", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NoBubbleFits", warning=True)
            continue
        requests[req.job_id] = (obj, job, st)
        tiers.setdefault(job.priority, []).append(req)
    placed: dict[str, tuple[str, float]] = {}
    for prio in sorted(tiers, reverse=True):
        for req in tiers[prio]:
            sched.submit(req, now_s, place=False)
        for p in sched.dispatch(now_s):
            placed[p.job.job_id] = (sched.classes[p.class_index].name, p.end_s)
    etas = sched.expected_completions(now_s)
    position = 0
    for req_id, (_obj, job, st) in requests.items():
        if req_id in placed:
            cls_name, end_s = placed[req_id]
            gpu = by_name[cls_name]
            _assign(out, st, job, gpu, end_s, view.fill_pods, trainings.get(gpu.training))
            continue
        position += 1
        st.status["queuePosition"] = position
        set_eta(st, job, etas.get(req_id, math.inf))
        st.condition(ConditionType.PLACED, False, "AllBubblesBusy", "every GPU it fits runs another fill job")
        st.phase(FillJobPhase.QUEUED, "waiting: every bubble it fits is in use")



def _assign(out: Decisions, st: FillJobStatus, job: FillJobResource, gpu: GpuView, end_s: float,
            settings: FillPodSettings, training: PipelineTrainingResource | None) -> None:
    attempt = st.restarts
    pod = fill_pod_name(job.name, attempt)
    a = Assignment(job.uid, job.generation, job.namespace, job.name, gpu.training, gpu.stage, gpu.node,
                   gpu.pod, gpu.device, pod, attempt, gpu.gpu_uuid, job.job, **limits(training),
                   tolerations=gpu.tolerations, ranks=(gpu.rank,))
    out.assign_job(st.key, st.uid, a)
    out.create_pod(st.key, st.uid, fill_pod(job, a, settings))
    if FINALIZER not in (st.meta.get("finalizers") or []):
        out.hold(st.key, st.uid)
    st.count("placements")
    st.status["assignment"] = {"training": gpu.training.split("/", 1)[-1], "stage": gpu.stage,
                               "ranks": list(a.ranks), **({"gpuUUIDs": [gpu.gpu_uuid]} if gpu.gpu_uuid else {}),
                               "node": gpu.node, "device": gpu.device, "pod": pod, "trainingPod": gpu.pod,
                               "trainingPodUid": gpu.pod_uid, "placedAt": rfc3339(st.now)}
    st.status.pop("queuePosition", None)
    set_eta(st, job, end_s)
    msg = placed_message(gpu)
    st.condition(ConditionType.PLACED, True, "Placed", msg)
    st.phase(FillJobPhase.PLACED, msg, event="Placed")
