"""Placement: queued FillJobs onto free profiled stages, by priority tier, then by the scheduling policy (looked
up by name); a placed job gets its assignment, its fill Pod and its finalizer."""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

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
    StageView,
    key_of,
    stage_context_bytes,
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


def place(view: ClusterView, out: Decisions, cache: DecideCache, valid: Mapping[str, Seen],
          stages: Mapping[str, StageView], trainings: Mapping[str, PipelineTrainingResource],
          busy: Mapping[str, tuple[str, float]], now_s: float) -> None:
    """Queued jobs onto free profiled stages: by priority tier, then by the scheduling policy."""
    usable = [s for s in stages.values() if s.cycle is not None and s.agent_up]
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
    classes = [cache.executor_class(s, trainings[s.training], stage_context_bytes(view, s)) for s in usable]
    by_name = {c.name: s for c, s in zip(classes, usable, strict=True)}
    sched = Scheduler(classes, policy(view.policy))
    for e, c in enumerate(classes):
        if c.name in busy:
            sched.occupy(e, busy[c.name][0], busy[c.name][1])
    requests: dict[str, Seen] = {}
    tiers: dict[int, list[FillJobRequest]] = {}
    class_names: dict[str, set[str]] = {}  # training -> names of its usable stages' classes
    for c in classes:
        class_names.setdefault(by_name[c.name].training, set()).add(c.name)
    eligible_sets: dict[tuple[str, ...], frozenset[str]] = {}
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
        key_allowed = tuple(allowed)
        eligible = eligible_sets.get(key_allowed)
        if eligible is None:
            eligible = eligible_sets[key_allowed] = frozenset().union(*(class_names.get(a, ()) for a in allowed))
        created = (obj.get("metadata") or {}).get("creationTimestamp")
        arrival = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() if created else now_s
        req = FillJobRequest(job.uid or key_of(obj), cache.profile(job), job.steps * job.samples_per_step,
                             arrival_s=arrival, deadline_s=job.deadline.timestamp() if job.deadline else None,
                             eligible=eligible, setup_s=job.init_s)
        if not eligible or not math.isfinite(min(sched.processing_times_s(req))):
            why = (f"fits no profiled bubble of {', '.join(allowed)}: each step needs "
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
            stage = by_name[cls_name]
            _assign(out, st, job, stage, end_s, view.fill_pods, trainings.get(stage.training))
            continue
        position += 1
        st.status["queuePosition"] = position
        set_eta(st, job, etas.get(req_id, math.inf))
        st.condition(ConditionType.PLACED, False, "AllBubblesBusy", "every stage it fits runs another fill job")
        st.phase(FillJobPhase.QUEUED, "waiting: every bubble it fits is in use")



def _assign(out: Decisions, st: FillJobStatus, job: FillJobResource, stage: StageView, end_s: float,
            settings: FillPodSettings, training: PipelineTrainingResource | None) -> None:
    attempt = st.restarts
    pod = fill_pod_name(job.name, attempt)
    a = Assignment(job.uid, job.generation, job.namespace, job.name, stage.training, stage.stage, stage.node,
                   stage.pod, stage.device, pod, attempt, stage.gpu_uuid, job.job, **limits(training),
                   tolerations=stage.tolerations)
    out.assign_job(st.key, st.uid, a)
    out.create_pod(st.key, st.uid, fill_pod(job, a, settings))
    if FINALIZER not in (st.meta.get("finalizers") or []):
        out.hold(st.key, st.uid)
    st.count("placements")
    st.status["assignment"] = {"training": stage.training.split("/", 1)[-1], "stage": stage.stage,
                               "node": stage.node, "device": stage.device, "pod": pod, "trainingPod": stage.pod,
                               "trainingPodUid": stage.pod_uid, "placedAt": rfc3339(st.now)}
    st.status.pop("queuePosition", None)
    set_eta(st, job, end_s)
    msg = placed_message(stage)
    st.condition(ConditionType.PLACED, True, "Placed", msg)
    st.phase(FillJobPhase.PLACED, msg, event="Placed")


