"""Placement: queued FillJobs onto free profiled GPUs, by priority tier, then by the scheduling policy (looked up by
name); a placed job gets its assignment, its fill Pod and its finalizer. The scheduler's executors are GPUs (one
executor class each, named by its ``GpuKey``): the ranks of a stage are placed on one by one, each with its own
bubbles (its own waits, its own free memory).

A gang (``spec.gpus`` N > 1) goes onto N free GPUs of one stage in one training Pod (so one node, one agent) at once,
or waits: never a part of it. Its group is chosen by ``scheduler.gang.place_gang`` (the most bubble time its GPUs
share), which reserves the GPUs in the scheduler. In each priority tier the gangs are placed before the single-GPU
jobs: placed after them, a gang would find a GPU of every stage taken whenever single jobs wait, and never start."""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bubbles.core.identity import GpuKey
from bubbles.core.nodeaccess import GpuAccess
from bubbles.core.resources import (
    FINALIZER,
    ConditionType,
    FillJobPhase,
    FillJobResource,
    PipelineTrainingResource,
    rfc3339,
    selector_matches,
)
from bubbles.operator.scheduler import (
    ExecutorClass,
    FillJobRequest,
    GangGroup,
    Scheduler,
    fits_somewhere,
    gang_eta_s,
    get_policy,
    place_gang,
)

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


def gang_groups(gpus: Sequence[GpuView]) -> dict[tuple[str, int, str, str], list[GpuView]]:
    """The GPUs a gang may span together: (training, stage, node, training Pod) -> its GPUs by rank. One Pod: the
    agent drives a gang as one run of one training Pod, and follows it by that Pod."""
    out: dict[tuple[str, int, str, str], list[GpuView]] = {}
    for g in sorted(gpus, key=lambda g: (g.training, g.stage, g.node, g.pod, g.rank)):
        out.setdefault((g.training, g.stage, g.node, g.pod), []).append(g)
    return out


def most_gpus(gpus: Mapping[GpuKey, GpuView], allowed: Sequence[str], stage: int | None) -> tuple[int, str]:
    """The most GPUs one stage of the ``allowed`` trainings (of ``stage``, where pinned) has in one Pod on one node,
    and where, in words ("training ml/llama stage 1 on node-a")."""
    mine = [g for g in gpus.values() if g.training in allowed and (stage is None or g.stage == stage)]
    best = max(gang_groups(mine).items(), key=lambda kv: len(kv[1]), default=None)  # ties: the first, by name
    if best is None:
        return 0, ""
    (training, k, node, pod), members = best
    return len(members), f"training {training} stage {k} on {node} (Pod {pod})"


def place(view: ClusterView, out: Decisions, cache: DecideCache, valid: Mapping[str, Seen],
          gpus: Mapping[GpuKey, GpuView], trainings: Mapping[str, PipelineTrainingResource],
          busy: Mapping[GpuKey, tuple[str, float]], now_s: float) -> None:
    """Queued jobs onto free profiled GPUs: by priority tier, then by the scheduling policy. A GPU its fill Pod could
    not be given (``lacks_resource``) is no place for a job: the jobs that could use only such GPUs say why."""
    # A job evicted this round is placed from the next: its eviction (Pod deleted, run cancelled, restarts counted) is
    # written first, whatever becomes of its next Pod (one the API server refuses writes nothing of its round).
    queued = [(obj, job, st) for obj, job, st in valid.values()
              if st.phase_now is FillJobPhase.QUEUED and not st.evicted]
    if not queued:
        return
    frame = gpu_frame(view, cache, gpus, trainings)
    usable, no_resource, classes, by_name = frame.usable, frame.no_resource, frame.classes, frame.by_name
    groups, class_names = frame.groups, frame.class_names
    if not usable:
        memo: dict[str, list[str]] = {}
        for _obj, job, st in queued:
            if lacking := _lacking(no_resource, _eligible(job, sorted(trainings), trainings, memo), job.stage):
                _say_no_resource(st, lacking)
                continue
            why = ("no PipelineTraining has reported its bubbles yet (is the hook attached, and the agent running on "
                   "its nodes?)")
            st.condition(ConditionType.PLACED, False, "NoProfiledTraining", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
        return
    # Scanning, not indexed: a round builds its scheduler afresh with a class per GPU, so an index would be built per
    # class every round (Python work per queued job) to serve a few decisions; the index pays where one scheduler
    # lives across decisions (the simulator). Its processing-time tables are the frame's, kept across rounds.
    sched = Scheduler(classes, policy(view.policy), index=False, tables=frame.tables)
    for e, g in enumerate(usable):  # one executor per class: executor e is class e
        if (held := busy.get(g.key)) is not None:
            sched.occupy(e, held[0], held[1])
    requests: dict[str, Seen] = {}
    tiers: dict[int, list[FillJobRequest]] = {}
    gangs: dict[int, list[FillJobRequest]] = {}  # by priority, in arrival order
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
        if job.gpus > 1:
            most, where = most_gpus(gpus, allowed, job.stage)
            if most < job.gpus:
                pinned = f"stage {job.stage} " if job.stage is not None else "one stage "
                why = (f"asks for {job.gpus} GPUs of {pinned}in one Pod on one node (spec.gpus); the most any "
                       f"{'such ' if job.stage is not None else ''}stage has there is {most}"
                       f"{f' ({where})' if where else ''}: lower spec.gpus, or run the training with more GPUs "
                       "per stage on a node")
                st.condition(ConditionType.PLACED, False, "NotEnoughGPUs", why)
                st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NotEnoughGPUs", warning=True)
                continue
        # A gang's work: every process takes each of its steps (its profile is one process's).
        req = FillJobRequest(job.uid or key_of(obj), cache.profile(job),
                             job.steps * job.samples_per_step * job.gpus,
                             arrival_s=arrival, deadline_s=job.deadline.timestamp() if job.deadline else None,
                             eligible=eligible, setup_s=job.init_s, gpus=job.gpus)
        if job.gpus > 1:
            if not fits_somewhere(sched, req, groups):
                if not any(len([e for e in grp.executors if classes[e].name in eligible]) >= job.gpus
                           for grp in groups):
                    if lacking := _lacking(no_resource, allowed, job.stage):
                        _say_no_resource(st, lacking)
                        continue
                    which = f"stage {job.stage}" if job.stage is not None else "one stage"
                    why = (f"fewer than {job.gpus} GPUs of {which} of {', '.join(allowed)} in one Pod have reported "
                           "their bubbles yet (a gang runs on all of its GPUs at once)")
                    st.condition(ConditionType.PLACED, False, "StageNotProfiled", why)
                    st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
                    continue
                why = (f"fits the bubbles that {job.gpus} GPUs of one stage of {', '.join(allowed)} share nowhere (a "
                       f"gang steps in the shortest bubble of its GPUs): each step needs "
                       f"{(job.job.gating_step_s or PROVISIONAL_STEP_S) * 1e3:.3g} ms and "
                       f"{job.job.memory_bytes / 2**20:.0f} MiB; lower spec.profile.memory or the step's batch, or "
                       "spec.gpus")
                st.condition(ConditionType.PLACED, False, "NoBubbleFits", why)
                st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NoBubbleFits", warning=True)
                continue
            requests[req.job_id] = (obj, job, st)
            gangs.setdefault(job.priority, []).append(req)
            continue
        if not eligible and (lacking := _lacking(no_resource, allowed, job.stage)):
            _say_no_resource(st, lacking)
            continue
        if not eligible and job.stage is not None:
            why = (f"no GPU of stage {job.stage} of {', '.join(allowed)} has reported its bubbles yet (spec.stage "
                   f"pins the job there)")
            st.condition(ConditionType.PLACED, False, "StageNotProfiled", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
            continue
        if not eligible or not math.isfinite(sched.processing_times_s(req).min()):  # numpy's min: no Python loop
            pinned = f"stage {job.stage} of " if job.stage is not None else ""
            why = (f"fits no profiled bubble of {pinned}{', '.join(allowed)}: each step needs "
                   f"{(job.job.gating_step_s or PROVISIONAL_STEP_S) * 1e3:.3g} ms and "
                   f"{job.job.memory_bytes / 2**20:.0f} MiB; lower spec.profile.memory or the step's batch")
            st.condition(ConditionType.PLACED, False, "NoBubbleFits", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NoBubbleFits", warning=True)
            continue
        requests[req.job_id] = (obj, job, st)
        tiers.setdefault(job.priority, []).append(req)
    placed: dict[str, tuple[tuple[str, ...], float]] = {}  # job id -> (its GPUs' class names, expected end)
    for prio in sorted(set(tiers) | set(gangs), reverse=True):
        for req in sorted(gangs.get(prio, ()), key=lambda r: (r.arrival_s, r.job_id)):
            gp = place_gang(sched, req, groups, now_s)
            if gp is not None:
                placed[req.job_id] = (tuple(sched.classes[e].name for e in gp.executors), gp.end_s)
        for req in tiers.get(prio, ()):
            sched.submit(req, now_s, place=False)
        for p in sched.dispatch(now_s):
            placed[p.job.job_id] = ((sched.classes[p.class_index].name,), p.end_s)
    etas = sched.expected_completions(now_s)
    position = 0
    for req_id, (_obj, job, st) in requests.items():
        if req_id in placed:
            cls_names, end_s = placed[req_id]
            on = [by_name[n] for n in cls_names]
            _assign(out, st, job, on, end_s, view.fill_pods, trainings.get(on[0].training))
            continue
        position += 1
        st.status["queuePosition"] = position
        if job.gpus > 1:
            req = next(r for r in gangs[job.priority] if r.job_id == req_id)
            set_eta(st, job, gang_eta_s(sched, req, groups, now_s))
            why = (f"fewer than {job.gpus} GPUs of every stage it fits are free in one Pod (a gang starts on all of "
                   "its GPUs at once)")
            st.condition(ConditionType.PLACED, False, "AllBubblesBusy", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
            continue
        set_eta(st, job, etas.get(req_id, math.inf))
        st.condition(ConditionType.PLACED, False, "AllBubblesBusy", "every GPU it fits runs another fill job")
        st.phase(FillJobPhase.QUEUED, "waiting: every bubble it fits is in use")



@dataclass
class GpuFrame:
    """What placement makes of a round's GPUs before it looks at any job: the usable ones (profiled, their agent up,
    their fill Pod able to get them), those it could not give a fill Pod (``lacks_resource``), a scheduler class for
    each usable one (executor e is class e, GPU ``usable[e]``), the groups a gang may span, the class names of each
    training and of each of its stages, and the schedulers' processing-time tables over these classes. Kept in the
    ``DecideCache`` while the GPUs' views, their trainings and the settings it reads are the same."""

    usable: list[GpuView]
    no_resource: list[GpuView]
    classes: list[ExecutorClass]
    by_name: dict[str, GpuView]
    groups: list[GangGroup]
    class_names: dict[tuple[str, int | None], set[str]]  # (training, stage or None: any) -> its usable GPUs' classes
    tables: dict[int, Any] = field(default_factory=dict)  # Scheduler(tables=...)


def gpu_frame(view: ClusterView, cache: DecideCache, gpus: Mapping[GpuKey, GpuView],
              trainings: Mapping[str, PipelineTrainingResource]) -> GpuFrame:
    """The round's ``GpuFrame``: the cache's while what it is made of is the same."""
    profiled = tuple(g for g in gpus.values() if g.cycle is not None and g.agent_up)
    key = (profiled, dict(trainings), view.fill_pods.gpu_access, view.fill_pods.mps_pipe_dir, view.cuda_context_bytes)
    if cache.gpu_frame is not None and cache.gpu_frame[0] == key:
        frame: GpuFrame = cache.gpu_frame[1]
        return frame
    no_resource = [g for g in profiled if lacks_resource(view, g)]
    usable = [g for g in profiled if not lacks_resource(view, g)]
    classes = [cache.executor_class(g, trainings[g.training], gpu_context_bytes(view, g)) for g in usable]
    by_name = {c.name: g for c, g in zip(classes, usable, strict=True)}
    executor_of = {g.key: e for e, g in enumerate(usable)}
    groups = [GangGroup(f"{tk} stage {k} on {node} (Pod {pod})", tuple(executor_of[g.key] for g in members))
              for (tk, k, node, pod), members in gang_groups(usable).items()]
    class_names: dict[tuple[str, int | None], set[str]] = {}
    for c, g in zip(classes, usable, strict=True):
        class_names.setdefault((g.training, None), set()).add(c.name)
        class_names.setdefault((g.training, g.stage), set()).add(c.name)
    frame = GpuFrame(usable, no_resource, classes, by_name, groups, class_names)
    cache.gpu_frame = (key, frame)
    return frame


def lacks_resource(view: ClusterView, gpu: GpuView) -> bool:
    """Whether a fill Pod on ``gpu`` would run without it: fill Pods get their GPUs from the agents' device plugins
    (FillPodSettings.gpu_access), and the GPU's agent reports no resource for it. A GPU whose UUID is not known gets
    NVIDIA_VISIBLE_DEVICES=void (a CPU training's stage), with or without a resource."""
    return view.fill_pods.gpu_access is GpuAccess.DEVICE_PLUGIN and bool(gpu.gpu_uuid) and not gpu.gpu_resource


def _lacking(no_resource: Sequence[GpuView], allowed: Sequence[str], stage: int | None) -> list[GpuView]:
    return [g for g in no_resource if g.training in allowed and (stage is None or g.stage == stage)]


def _say_no_resource(st: FillJobStatus, lacking: Sequence[GpuView]) -> None:
    g = sorted(lacking, key=lambda g: (g.node, g.training, g.stage, g.rank))[0]
    more = f" (and {len(lacking) - 1} more GPU(s))" if len(lacking) > 1 else ""
    why = (f"the bubbles agent on node {g.node} reports no device-plugin resource for GPU {g.gpu_uuid} "
           f"({g.where}){more}, and fill Pods get their GPUs from the kubelet (the operator's --fill-gpu-access "
           "devicePlugin): enable the agents' device plugin (the chart's agent.devicePlugin.enabled) or choose "
           "operator.fillGpuAccess: envvar")
    st.condition(ConditionType.PLACED, False, "NoGpuResource", why)
    st.phase(FillJobPhase.QUEUED, f"waiting: {why}", event="NoGpuResource", warning=True)


def _assign(out: Decisions, st: FillJobStatus, job: FillJobResource, on: Sequence[GpuView], end_s: float,
            settings: FillPodSettings, training: PipelineTrainingResource | None) -> None:
    """Place the job on the GPUs ``on`` (one; a gang's N of one stage in one Pod, by rank)."""
    on = sorted(on, key=lambda g: g.rank)
    gpu = on[0]
    attempt = st.restarts
    pod = fill_pod_name(job.name, attempt)
    uuids = tuple(g.gpu_uuid for g in on if g.gpu_uuid)
    resources = tuple(g.gpu_resource for g in on if g.gpu_resource)
    a = Assignment(job.uid, job.generation, job.namespace, job.name, gpu.training, gpu.stage, gpu.node,
                   gpu.pod, gpu.device, pod, attempt, gpu.gpu_uuid, job.job, **limits(training),
                   tolerations=gpu.tolerations, ranks=tuple(g.rank for g in on),
                   gpu_uuids=uuids if len(uuids) == len(on) else (),
                   gpu_resources=resources if len(resources) == len(on) else ())
    out.assign_job(st.key, st.uid, a)
    out.create_pod(st.key, st.uid, fill_pod(job, a, settings))
    if FINALIZER not in (st.meta.get("finalizers") or []):
        out.hold(st.key, st.uid)
    st.count("placements")
    st.status["assignment"] = {"training": gpu.training.split("/", 1)[-1], "stage": gpu.stage,
                               "ranks": list(a.ranks), **({"gpuUUIDs": list(uuids)} if uuids else {}),
                               "node": gpu.node, "device": gpu.device, "pod": pod, "trainingPod": gpu.pod,
                               "trainingPodUid": gpu.pod_uid, "placedAt": rfc3339(st.now)}
    st.status.pop("queuePosition", None)
    set_eta(st, job, end_s)
    msg = placed_message(on)
    st.condition(ConditionType.PLACED, True, "Placed", msg)
    st.phase(FillJobPhase.PLACED, msg, event="Placed")
