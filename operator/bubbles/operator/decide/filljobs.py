"""FillJob tracking: each job admitted or failed, a placed job followed (its progress, its ETA) or evicted when its
GPU, Pod, agent or process is gone, a deleted one cleaned up."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from bubbles.core.api import FillState
from bubbles.core.identity import GpuKey
from bubbles.core.resources import (
    FINALIZER,
    HOOK_SILENCE_S,
    ConditionType,
    FillJobPhase,
    FillJobResource,
    JobProgress,
    PipelineTrainingResource,
    ResourceError,
    rfc3339,
)
from bubbles.operator.scheduler import best_rate, shared_class

from .cache import DecideCache
from .pods import check_paths, not_starting
from .status import ACTIVE, Assigned, FillJobStatus, condition_of
from .view import STARTUP_GRACE_S, Assignment, ClusterView, Decisions, Event, GpuView, gpu_context_bytes, key_of

MAX_ETA_S = dt.datetime(9000, 1, 1, tzinfo=dt.UTC).timestamp()
# A due time (Outlook.due) is brought this much earlier: the decision it bounds compares times as floats, rounded.
CLOCK_MARGIN_S = 1e-3

# A FillJob as this round sees it: its object, its parsed spec, the status being built.
Seen = tuple[Mapping[str, Any], FillJobResource, FillJobStatus]


def see_fill_jobs(view: ClusterView, out: Decisions, cache: DecideCache, gpus: Mapping[GpuKey, GpuView],
                  trainings: Mapping[str, PipelineTrainingResource], invalid: Mapping[str, str],
                  ) -> tuple[dict[str, Seen], dict[GpuKey, tuple[str, float]]]:
    """Every FillJob of the view: deleted ones cleaned up, final ones let go of, invalid ones failed, new ones
    admitted, placed ones tracked. Returns the valid ones by key and the GPUs they keep busy (GPU key ->
    (FillJob uid, expected end))."""
    now_s = view.now.timestamp()
    valid: dict[str, Seen] = {}
    busy: dict[GpuKey, tuple[str, float]] = {}
    for obj in view.fill_jobs:
        seen = see_fill_job(obj, view, out, cache, gpus, trainings, invalid, busy, now_s, Outlook())
        if seen is not None:
            valid[seen[2].key] = seen
    return valid, busy


@dataclass
class Outlook:
    """What a job's decision of this round holds on beyond its inputs (its object, its GPUs' views, its run's
    progress, its Pod's state): the time from which it may change with nothing else changed (``due_s``), and the GPUs
    it keeps busy with what their expected end is computed from at any time (``busy_keys``, ``end``)."""

    due_s: float = math.inf
    busy_keys: tuple[GpuKey, ...] = ()
    end: EndEstimate | None = None

    def due(self, at_s: float) -> None:
        """The decision may change with the clock alone from ``at_s`` (a float's rounding early, to be safe)."""
        self.due_s = min(self.due_s, at_s - CLOCK_MARGIN_S)


@dataclass(frozen=True)
class EndEstimate:
    """What a placed job's expected end is computed from (``expected_end_s``): it moves with the clock alone."""

    job: FillJobResource
    assignment: Assigned
    progress: JobProgress | None
    done: int
    rate: float

    def at(self, now_s: float) -> float:
        return expected_end_s(self.job, self.assignment, self.progress, self.done, self.rate, now_s)


def expected_end_s(job: FillJobResource, a: Assigned, prog: JobProgress | None, done: int, rate: float,
                   now_s: float) -> float:
    """When a placed job is expected to finish at ``rate`` steps per second, ``done`` steps done, seen at ``now_s``
    (inf where it makes no progress)."""
    return now_s + _init_left_s(job, a, prog, now_s) + (job.steps - done) / rate if rate > 0 else math.inf


def see_fill_job(obj: Mapping[str, Any], view: ClusterView, out: Decisions, cache: DecideCache,
                 gpus: Mapping[GpuKey, GpuView], trainings: Mapping[str, PipelineTrainingResource],
                 invalid: Mapping[str, str], busy: dict[GpuKey, tuple[str, float]], now_s: float, outlook: Outlook,
                 parsed: FillJobResource | None = None) -> Seen | None:
    """One FillJob of the view (``see_fill_jobs``): its decisions into ``out``, the GPUs it keeps busy into ``busy``,
    what they rest on into ``outlook``. Returns it where it is valid (not deleted, not final, its spec valid).
    ``parsed``: its spec parsed already (by an earlier round, from this very object)."""
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        clean_up(obj, out)
        return None
    st = FillJobStatus(obj, view.now, out)
    phase = st.phase_now
    if phase is not None and phase.terminal:  # final: neither parsed nor looked at again (thousands pile up)
        a = st.assignment
        if a.node and st.uid in view.progress:
            # The agent still holds the run: it lets go of it now that the final status is stored (told every
            # round until it stops reporting the job, so a lost call costs a round).
            out.cancel_run(st.key, st.uid, str(a.node))
        st.finish()
        return None
    try:
        job = parsed if parsed is not None else cache.fill_job(obj)
        if phase not in ACTIVE:  # a Pod made already has the mounts it has: a changed setting does not stop it
            check_paths(job, view.fill_pods)
    except ResourceError as exc:
        a = Assigned.read(st.status.pop("assignment", None))
        if a.pod:  # it ran: its spec was edited into an invalid one; stop it, free its stage
            out.delete_pod(st.key, st.uid, str(meta.get("namespace", "")), str(a.pod))
        if a.node:
            out.cancel_run(st.key, st.uid, str(a.node))
        st.status.pop("eta", None)
        st.condition(ConditionType.ADMITTED, False, "InvalidSpec", str(exc))
        st.phase(FillJobPhase.FAILED, f"invalid spec: {exc} (a Failed FillJob is not read again: delete it and "
                 "apply it corrected)", event="InvalidSpec", warning=True)
        st.finish()
        return None
    if phase is None or phase is FillJobPhase.PENDING:
        st.condition(ConditionType.ADMITTED, True, "Valid", "the spec is valid")
        st.status.setdefault("restarts", 0)
        st.status.setdefault("counters", {"kills": 0, "placements": 0, "evictions": 0})
        st.status.update(progress_fields(job, 0, 0.0))
        st.phase(FillJobPhase.QUEUED, "waiting for a bubble it fits", event="Queued")
    if st.phase_now in ACTIVE:
        _track(out, view, cache, st, job, gpus, trainings, busy, now_s, invalid, outlook)
    return (obj, job, st)


def progress_fields(job: FillJobResource, done: int, flops: float) -> dict[str, Any]:
    if not flops and job.flops_per_step:
        flops = done * job.flops_per_step  # a job that reports none (a plain command): what its spec says a step is
    pct = 100.0 * min(done, job.steps) / job.steps if job.steps else 0.0
    return {"progress": {"stepsDone": done, "stepsTotal": job.steps, "percent": round(pct, 1)},
            "progressText": f"{pct:.0f}% ({done}/{job.steps})", "recoveredFlops": float(flops)}



class Limits(TypedDict):
    """A PipelineTraining's limits as an assignment carries them to the agent."""

    slowdown_budget: float | None
    max_fill_share: float | None
    tail_risk: float | None


def limits(training: PipelineTrainingResource | None) -> Limits:
    """The training's slowdown budget, largest fill share and tail risk, which the agent on its node applies."""
    if training is None:
        return {"slowdown_budget": None, "max_fill_share": None, "tail_risk": None}
    return {"slowdown_budget": training.slowdown_budget, "max_fill_share": training.max_fill_share,
            "tail_risk": training.tail_risk}


def clean_up(obj: Mapping[str, Any], out: Decisions) -> None:
    """A deleted FillJob: stop its fill process, delete its Pod, then let the deletion finish."""
    meta = obj.get("metadata") or {}
    if FINALIZER not in (meta.get("finalizers") or []):
        return
    a = Assigned.read((obj.get("status") or {}).get("assignment"))
    key, uid = key_of(obj), str(meta.get("uid", ""))
    if a.pod:
        out.delete_pod(key, uid, str(meta.get("namespace", "")), str(a.pod))
    if a.node:
        out.cancel_run(key, uid, str(a.node))
    out.release(key, uid)
    out.events.append(Event("FillJob", str(meta.get("namespace", "")), str(meta.get("name", "")),
                            str(meta.get("uid", "")), "Normal", "Deleted",
                            f"stopped; its Pod {a.pod} is deleted" if a.pod else "deleted"))


def _track(out: Decisions, view: ClusterView, cache: DecideCache, st: FillJobStatus, job: FillJobResource,
           gpus: Mapping[GpuKey, GpuView], trainings: Mapping[str, PipelineTrainingResource],
           busy: dict[GpuKey, tuple[str, float]], now_s: float, invalid: Mapping[str, str] | None = None,
           outlook: Outlook | None = None) -> None:
    """A placed job: follow its progress, or evict it when its GPU (any of a gang's), Pod or agent is gone (or its
    training's spec turned invalid: ``invalid``, training key -> why). ``outlook``: told when the decision may change
    with the clock alone, and what its GPUs' expected end is computed from."""
    outlook = outlook if outlook is not None else Outlook()
    a = st.assignment
    gkeys = a.gpu_keys(job.namespace)
    # Its rank runs in another Pod now: the job's Pod (its process, its bubbles) is gone for it.
    held = [g if g is not None and g.pod == a.training_pod else None for g in (gpus.get(k) for k in gkeys)]
    missing = [r for r, g in zip(a.ranks, held, strict=False) if g is None] if held else list(a.ranks)
    on = [g for g in held if g is not None]
    gpu = on[0] if on and not missing else None  # its first rank's: the node, the Pod, the agent are all its GPUs'
    ranks_said = f"rank{'s' if len(missing) > 1 else ''} {','.join(map(str, missing))}"
    uid = job.uid
    prog = view.progress.get(uid)
    if prog is not None and prog.attempt != st.restarts:
        prog = None  # an earlier attempt's run (stopped when this one was placed): not this run's progress
    # Its Pod not started yet (judged only while no process of it runs): (the kubelet's reason or "", since when).
    waiting = view.waiting_pods.get(f"{job.namespace}/{a.pod}") \
        if prog is None or prog.state is FillState.SUBMITTED else None
    if waiting is not None and waiting[0]:
        waiting = (_kubelet_words(st.status, str(a.pod), waiting[0]), waiting[1])
    if waiting is not None:
        outlook.due(waiting[1] + view.pod_start_timeout_s)  # its Pod's start times out then
    lost = None
    ended_itself = False  # the fill Pod (or its process) ended on its own: kept for its logs, not deleted
    # The training's doing (its Pod or spec changed), not the job's: not counted as a restart. Unless the job had its
    # process on the training's GPU: a fatal fault of one MPS client reaches every client of its server, the training
    # among them, so a training Pod restarted, replaced or gone then may be the job's doing (counted, as before).
    on_gpu = prog is not None and (a.device or "").startswith("cuda") and (
        prog.state in (FillState.PAUSED, FillState.RUNNING, FillState.STOPPED) or prog.steps_done > 0)
    training_side = False
    if gpu is None and view.acting_s < STARTUP_GRACE_S:
        return  # just started: the training Pod may not be in the watch's first listing yet; look again next round
    if gpu is None:
        tkey, tpod = f"{job.namespace}/{a.training}", a.training_pod
        if tkey in (invalid or {}):
            lost = (f"PipelineTraining {a.training}'s spec turned invalid ({(invalid or {})[tkey]}): its "
                    "bubbles are not used until it is fixed")
            training_side = True
        elif any(s.pod == tpod and s.training == tkey for s in view.gpus):
            # The Pod is there, its GPU is not reported: the node's agent restarted (it lost its fill processes).
            # (A silent hook leaves the GPU reported, hook_reporting False: the job is Paused, below.)
            lost = (f"the bubbles agent on node {a.node} no longer reports stage {a.stage} {ranks_said} of "
                    f"{a.training} (training Pod {tpod} still runs: the agent restarted)")
        else:
            lost = f"training Pod {tpod} (stage {a.stage} {ranks_said} of {a.training}) is gone"
            training_side = not on_gpu
    elif not gpu.agent_up:
        lost = f"the bubbles agent on node {gpu.node} stopped answering"
    elif a.training_pod_uid and gpu.pod_uid and a.training_pod_uid != gpu.pod_uid:
        lost = f"training Pod {gpu.pod} was replaced by a new Pod of the same name: its bubbles are re-measured"
        training_side = not on_gpu
    elif any(g.cycle is None for g in on):
        lost = f"training Pod {gpu.pod} restarted: its bubbles are re-measured before anything runs there"
        training_side = not on_gpu
    elif (failed := view.failed_pods.get(f"{job.namespace}/{a.pod}")) is not None:
        lost = f"fill Pod {a.pod} failed: {failed}"
        ended_itself = True
    elif (prog is None or prog.state is FillState.SUBMITTED) and \
            (ended := view.ended_pods.get(f"{job.namespace}/{a.pod}")) is not None:
        # A finished run is reported as STOPPED by the agent before its process exits; an agent that knows no
        # process for the job while its Pod has ended lost the run (it restarted).
        lost = (f"fill Pod {a.pod} ended ({ended}) but the agent on {a.node} holds no run of the job "
                "(the agent restarted?)")
        ended_itself = True
    elif waiting is not None and now_s - waiting[1] >= view.pod_start_timeout_s:
        why = waiting[0] or f"still being created (a volume that does not mount? kubectl describe pod {a.pod})"
        lost = (f"fill Pod {a.pod} did not start within {view.pod_start_timeout_s:g} s of its creation "
                f"(the operator's --fill-pod-start-timeout): {why}")
    if prog is not None and prog.state is FillState.STOPPED:
        if prog.reason == "finished" or prog.steps_done >= job.steps:
            st.status.update(progress_fields(job, max(prog.steps_done, job.steps), prog.flops))
            st.status.pop("eta", None)
            st.condition(ConditionType.FINISHED, True, "Succeeded", f"did {job.steps} steps")
            st.condition(ConditionType.RUNNING, False, "Finished", "the job finished")
            st.phase(FillJobPhase.SUCCEEDED, f"finished {job.steps} steps in the bubbles of {a.training}",
                     event="Succeeded")
            return
        lost = f"the fill process stopped: {prog.reason}"
        ended_itself = True
    if lost is not None:
        _evict(st, job, lost, a, keep_pod=ended_itself, counted=not training_side)
        if st.evicted:
            # The job is placed again from the next round (see placement.place): until then the GPUs it had are held
            # for it, or a job of lower priority would take them now and keep them.
            for g in on:
                busy[g.key] = (uid, now_s)
        return
    assert gpu is not None
    if prog is None:
        # The agent does not know this run (just placed, or the agent restarted): tell it again. Idempotent on the
        # agent's side (uid, generation, attempt), so a lost or repeated call costs nothing.
        uuids = tuple(g.gpu_uuid for g in on if g.gpu_uuid)
        resources = tuple(g.gpu_resource for g in on if g.gpu_resource)
        out.assign_job(st.key, st.uid, Assignment(
            job.uid, job.generation, job.namespace, job.name, gpu.training, gpu.stage, gpu.node, gpu.pod,
            gpu.device, str(a.pod or ""), st.restarts, gpu.gpu_uuid, job.job,
            **limits(trainings.get(gpu.training)), ranks=a.ranks, gpu_uuids=uuids if len(uuids) == len(on) else (),
            gpu_resources=resources if len(resources) == len(on) else ()))
    done = prog.steps_done if prog is not None else st.steps_done
    flops = prog.flops if prog is not None else st.recovered_flops
    st.status.update(progress_fields(job, done, flops))
    if prog is not None:
        st.count("kills", at_least=prog.kills)
    rate = _steps_per_s(cache, job, on, trainings.get(gpu.training), gpu_context_bytes(view, gpu))
    end = EndEstimate(job, a, prog, done, rate)
    end_s = end.at(now_s)
    for g in on:
        busy[g.key] = (uid, end_s)
    outlook.busy_keys, outlook.end = tuple(g.key for g in on), end
    outlook.due(set_eta(st, job, end_s))
    if waiting is not None and waiting[0]:
        what, hint = not_starting(waiting[0], str(a.pod))
        st.condition(ConditionType.RUNNING, False, "PodNotStarting", f"fill Pod {a.pod}: {waiting[0]}")
        # The phase's message (and its Event) names the kind of failure only: the kubelet's own words alternate
        # (ErrImagePull, ImagePullBackOff) with every retry, and are in the condition.
        st.phase(FillJobPhase.PLACED, f"fill Pod {a.pod} has not started: {what}; {hint}. It is taken off "
                 f"its GPU and queued again if it has not started {view.pod_start_timeout_s:g} s after its "
                 "creation", event="PodNotStarting", warning=True)
    elif st.phase_now is FillJobPhase.PLACED and \
            condition_of(st.status, ConditionType.RUNNING).get("reason") == "PodNotStarting":
        st.condition(ConditionType.RUNNING, False, "Starting", f"fill Pod {a.pod} started")
        st.phase(FillJobPhase.PLACED, placed_message(on))
    if prog is not None and prog.state in (FillState.RUNNING, FillState.PAUSED):
        if silent := next((g for g in on if not g.hook_reporting), None):
            gpu = silent  # a gang steps only in bubbles all its GPUs share: one silent GPU pauses it
            # No bubbles while the training sends no signals (stopped, evaluating or checkpointing, hung), so no fill
            # steps: said, so that a job making no progress says why. It keeps its GPU and its process.
            st.condition(ConditionType.RUNNING, False, "TrainingSilent", f"no bubble signals from {gpu.where} "
                         f"(training Pod {gpu.pod})")
            st.phase(FillJobPhase.PAUSED, f"paused: the training's hook on {gpu.where} "
                     f"(Pod {gpu.pod}) has sent no bubble signals for {HOOK_SILENCE_S:g} s (the training stopped, "
                     "is evaluating or checkpointing, or hangs); fill work runs only in its bubbles, so the job "
                     "runs again at its next one", event="Paused")
            return
        st.condition(ConditionType.RUNNING, True, "Running", f"steps run in the bubbles of stage {gpu.stage} "
                     f"{_ranks_words(on)} on {gpu.node}")
        st.phase(FillJobPhase.RUNNING, f"running in the bubbles of {_where(on)} on {gpu.node}", event="Running")


def _kubelet_words(status: Mapping[str, Any], pod: str, why: str) -> str:
    """What keeps a fill Pod from starting, as said: the kubelet's "Reason: message", except that its back-off between
    image pulls (``ImagePullBackOff: Back-off pulling image ...``) keeps the words of the failed pull said before it
    (``ErrImagePull: <the registry's error>``), which say why; the kubelet alternates the two with every retry, and
    the status would be rewritten each time for less."""
    if why.split(":", 1)[0].strip() != "ImagePullBackOff":
        return why
    said = condition_of(status, ConditionType.RUNNING)
    prefix = f"fill Pod {pod}: "
    message = str(said.get("message") or "")
    if said.get("reason") == "PodNotStarting" and message.startswith(prefix + "ErrImagePull"):
        return message[len(prefix):]
    return why




def _ranks_words(on: Sequence[GpuView]) -> str:
    """"rank 1", or a gang's "ranks 0,1"."""
    return f"rank{'s' if len(on) > 1 else ''} {','.join(str(g.rank) for g in on)}"


def _where(on: Sequence[GpuView]) -> str:
    """The GPUs in words: "ml/llama stage 0 rank 1", or a gang's "ml/llama stage 0 ranks 0,1"."""
    return f"{on[0].training} stage {on[0].stage} {_ranks_words(on)}"


def placed_message(on: GpuView | Sequence[GpuView]) -> str:
    """The Placed condition's words: the GPU (a gang's GPUs), its Pod, node and device(s)."""
    on = [on] if isinstance(on, GpuView) else sorted(on, key=lambda g: g.rank)
    devices = ", ".join(g.device for g in on)
    return f"placed on {_where(on)} ({on[0].pod} on {on[0].node}, {devices})"


def _evict(st: FillJobStatus, job: FillJobResource, why: str, a: Assigned, *, keep_pod: bool = False,
           counted: bool = True) -> None:
    """Take the job off its GPU: requeue it, or fail it past its restart limit. Its Pod is deleted unless
    ``keep_pod`` (it ended on its own: kept, like a Job's failed Pods, for ``kubectl logs``; it holds nothing, and
    goes with the FillJob, its owner). Not ``counted``: the training's doing (its Pod gone, replaced or restarted, its
    spec turned invalid), which a job cannot avoid: a new attempt (``status.restarts`` names its Pod) that does not
    count against ``spec.restartLimit``, as Kubernetes' Pod failure policies leave disruptions uncounted."""
    restarts = st.restarts + 1  # the attempt's number
    st.count("evictions")
    if not counted:
        st.count("trainingDisruptions")
    used = restarts - st.counter("trainingDisruptions")  # the restarts the job's limit counts
    if a.pod and keep_pod:
        why = f"{why} (its Pod {a.pod} is kept for its logs)"
    elif a.pod:
        st.out.delete_pod(st.key, st.uid, job.namespace, str(a.pod))
    if a.node:
        st.out.cancel_run(st.key, job.uid, str(a.node))
    st.status.pop("assignment", None)
    st.status.pop("eta", None)
    st.condition(ConditionType.RUNNING, False, "Evicted", why)
    st.condition(ConditionType.PLACED, False, "Evicted", why)
    if used > job.restart_limit:
        st.status["restarts"] = restarts - 1
        st.condition(ConditionType.EVICTED, True, "RestartLimit", why)
        st.phase(FillJobPhase.FAILED, f"{why}; failed after {job.restart_limit} restart(s) (spec.restartLimit)",
                 event="Failed", warning=True)
        return
    st.status["restarts"] = restarts
    st.evicted = True
    resume = f", resuming from {job.checkpoint_path}" if job.checkpoint_path else ", starting over (no checkpoint)"
    st.condition(ConditionType.EVICTED, True, "Requeued", why)
    count = (f"{used}/{job.restart_limit} restarts used" if counted else
             f"not counted against spec.restartLimit, the training's doing; {used}/{job.restart_limit} used")
    st.phase(FillJobPhase.QUEUED, f"{why}; back in the queue ({count}){resume}", event="Evicted", warning=True)


def _init_left_s(job: FillJobResource, a: Assigned, prog: JobProgress | None, now_s: float) -> float:
    """What is left of the job's spec.profile.initTime: from its placement (assignment.placedAt) until its process
    has initialized on its device (the agent reports it PAUSED or RUNNING); 0 once it has, or when it took longer."""
    if not job.init_s or (prog is not None and prog.state not in (FillState.SUBMITTED, FillState.CREATED)):
        return 0.0
    try:
        if a.placed_at is None:
            raise ValueError("not said")
        placed = dt.datetime.fromisoformat(str(a.placed_at).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0  # placed by an operator that did not say when: counted from the first step on
    return max(0.0, job.init_s - (now_s - placed))


def _steps_per_s(cache: DecideCache, job: FillJobResource, on: Sequence[GpuView],
                 training: PipelineTrainingResource | None, context_bytes: int = 0) -> float:
    """The job's steps per second on its GPUs (a gang's: in the bubbles they all share)."""
    if not on or any(g.cycle is None for g in on) or training is None:
        return 0.0
    classes = [cache.executor_class(g, training, context_bytes) for g in on]
    cls = classes[0] if len(classes) == 1 else shared_class(classes)
    rate = best_rate(cls.bubbles, cls.iteration_s, cache.profile(job))  # cached per bubble shape and profile
    return rate.steps_per_cycle / cls.iteration_s if rate else 0.0


def set_eta(st: FillJobStatus, job: FillJobResource, end_s: float) -> float:
    """Set the ETA, keeping the one written before while the new estimate is within max(30 s, 5% of the time
    left) of it: an estimate that moves with every round would rewrite every status every round. Returns until when
    (epoch seconds) the same would be decided were nothing but the clock to move, for an estimate that moves with the
    clock no faster than it (a placed job's: ``expected_end_s``)."""
    now_s = st.now.timestamp()
    if math.isfinite(end_s) and end_s > MAX_ETA_S:
        end_s = math.inf  # beyond any calendar (a huge job at a trickle): no ETA
    holds_s = math.inf
    if math.isfinite(end_s):
        holds_s = now_s + (MAX_ETA_S - end_s)  # from then, beyond any calendar
        old = st.before.get("eta")
        kept = False
        if old:
            old_s = dt.datetime.fromisoformat(str(old).replace("Z", "+00:00")).timestamp()
            off, slack = abs(old_s - end_s), max(30.0, 0.05 * max(0.0, end_s - now_s))
            if off <= slack:
                end_s, kept = old_s, True
                # Kept while the estimate stays within the slack: it moves at most as fast as the clock, and the
                # slack shrinks at most 0.05 times as fast (never below 30 s).
                holds_s = min(holds_s, now_s + max(30.0 - off, (slack - off) / 1.05))
        if not kept:
            holds_s = now_s  # a new ETA: looked at again next round
        st.status["eta"] = rfc3339(dt.datetime.fromtimestamp(end_s, dt.UTC))
        if job.deadline is not None:
            st.status["deadlineFeasible"] = end_s <= job.deadline.timestamp()
    else:
        st.status.pop("eta", None)
        if job.deadline is not None:
            st.status["deadlineFeasible"] = False
    return holds_s
