"""What the operator decides, as one pure function of what it sees: ``reconcile(view) -> Decisions``.

The kopf handlers (``bubbles.operator.handlers``) gather the view (FillJobs, PipelineTrainings, the
training Pods, what the node agents report) and carry the decisions out (status patches, fill Pods,
assignments to agents, Events). Nothing here calls Kubernetes or an agent, reads a clock or sleeps: the time
comes in with the view, so every decision can be replayed in a test.

Level-triggered: the status of each FillJob is the record of where it runs. A job whose status names an
assignment is placed, whatever the operator remembers, so a restarted operator places nothing twice.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from bubbles.core import mps_client, paths
from bubbles.core.api import MPS_CLIENT, FillJobSpec, FillState, WorkloadKind
from bubbles.core.cycle import BubbleCycle
from bubbles.core.paths import MOUNTED_RUN_DIR
from bubbles.core.plan import Bubble, FillNode
from bubbles.core.resources import (
    API_VERSION,
    FINALIZER,
    HOOK_SILENCE_S,
    VOLUME_SOURCES,
    Condition,
    ConditionType,
    FillJobPhase,
    FillJobResource,
    JobProgress,
    PipelineTrainingResource,
    ResourceError,
    inside,
    rfc3339,
    selector_matches,
    set_condition,
)
from bubbles.operator.scheduler import (
    ExecutorClass,
    FillConfig,
    FillJobRequest,
    FillProfile,
    Scheduler,
    best_rate,
    get_policy,
)

# Where the fill Pod finds the node agent's sockets (a hostPath shared with the training's Pods).
RUN_DIR = str(MOUNTED_RUN_DIR)
# A fill job whose step time is not given is planned with this until the agent measures it.
PROVISIONAL_STEP_S = 1e-3
ACTIVE = (FillJobPhase.PLACED, FillJobPhase.RUNNING, FillJobPhase.PAUSED)
MAX_ETA_S = dt.datetime(9000, 1, 1, tzinfo=dt.UTC).timestamp()


# -- what the operator sees ------------------------------------------------------------------------------
# A replica's first seconds of reconciling: a placed job whose training Pod it has not seen is left as it is, not
# evicted (its watches list the cluster as it starts; before 2026-11-24 a restarted operator could evict and
# re-place a running job whose Pod was listed after its FillJob).
STARTUP_GRACE_S = 10.0

@dataclass(frozen=True)
class StageView:
    """One pipeline stage of one training Pod: the Pod from the API server, its bubbles from its node's agent."""

    training: str  # "namespace/name" of the PipelineTraining
    stage: int
    pod: str
    pod_uid: str
    node: str
    device: str
    cycle: BubbleCycle | None = None  # None until the hook has profiled the stage (or after the Pod restarted)
    agent_up: bool = True
    hook_reporting: bool = False
    iteration_s: float | None = None  # latest iteration time while harvesting
    baseline_iteration_s: float | None = None  # the guard's baseline (no fill work)
    bubble_s: float = 0.0  # bubble time seen so far while harvesting
    filled_s: float = 0.0  # fill-step time inside those bubbles
    gpu_uuid: str | None = None  # the GPU's UUID, when the agent knows it (NVML)
    training_membership: str = ""  # under MPS: "client", "not a client: ..." (resources.StageReport), or unknown ""

    @property
    def key(self) -> str:
        return f"{self.training}/{self.stage}/{self.pod}"


@dataclass(frozen=True)
class ClusterView:
    now: dt.datetime
    fill_jobs: Sequence[Mapping[str, Any]]  # FillJob objects as the API server has them (with status)
    trainings: Sequence[Mapping[str, Any]]  # PipelineTraining objects
    stages: Sequence[StageView]
    progress: Mapping[str, JobProgress] = field(default_factory=dict)  # by FillJob uid
    policy: str = "fifo"
    # Fill Pods that failed, "namespace/name" -> why (the kubelet's reason): their jobs are evicted.
    failed_pods: Mapping[str, str] = field(default_factory=dict)
    # Fill Pods whose process exited 0, "namespace/name" -> what the kubelet says: a job whose agent holds no process
    # for it then has lost its run (its agent restarted and the process left with the old one's channel).
    ended_pods: Mapping[str, str] = field(default_factory=dict)
    fill_pods: FillPodSettings = field(default_factory=lambda: FillPodSettings())
    # Fill Pods the API server refused to create (admission: a quota, a LimitRange, Pod Security), by FillJob uid ->
    # (its message, when: epoch seconds): the job stays queued saying why, and is placed again after pod_retry_s.
    refused_pods: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    pod_retry_s: float = 30.0
    # Fill Pods not started yet, "namespace/name" -> (the kubelet's reason and message when it reports a failure to
    # start them: ErrImagePull, ImagePullBackOff, CreateContainerConfigError...; "" while it is only starting, its
    # creation: epoch seconds): a failure is said on the job at once, and the job is taken off its stage once its Pod
    # is pod_start_timeout_s old and still not started (a volume that never mounts is said in Events only).
    waiting_pods: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    pod_start_timeout_s: float = 600.0
    # What a fill process's own CUDA context takes on a GPU beside its memory limit, which the node agents plan on top
    # of a job's memory outside MPS (their --cuda-context-mib): a stage's free memory is cut by it here, or jobs the
    # agent would refuse are placed.
    cuda_context_bytes: int = 0
    # How long this replica has been reconciling: its watches may not have listed every object yet in its first
    # seconds (a training Pod it has not seen is not a Pod that is gone). inf: long enough.
    acting_s: float = math.inf


@dataclass(frozen=True)
class FillPodSettings:
    """What every fill Pod shares with its node's agent: set where the agent's DaemonSet is (the chart)."""

    node_run_dir: str = RUN_DIR  # the agent's run directory on the node (a hostPath), mounted at RUN_DIR in the Pod
    run_as_user: int | None = None  # the UID the agent runs as: its sockets are private to it
    run_as_group: int | None = None
    # The agents run --isolation mps with this pipe directory: fill Pods on a GPU join that MPS server.
    mps_pipe_dir: str | None = None
    mps_thread_percentage: int = mps_client.DEFAULT_FILL_THREAD_PERCENTAGE
    # The node directory the agent's Pod mounts at /dev/shm, where the MPS server keeps what it shares with its
    # clients: fill Pods on MPS mount it there too (and so does the training's Pod).
    mps_shm_dir: str = mps_client.DEFAULT_SHM_DIR

    def __post_init__(self) -> None:
        if not self.node_run_dir.startswith("/"):
            raise ValueError(f"the node's run directory must be an absolute path, got {self.node_run_dir!r}")
        for what, v in (("user", self.run_as_user), ("group", self.run_as_group)):
            if v is not None and v < 0:
                raise ValueError(f"fill Pods' {what} id must be >= 0, got {v}")
        if self.mps_pipe_dir is not None:
            if not self.mps_pipe_dir.startswith("/"):
                raise ValueError(f"the MPS pipe directory must be an absolute path, got {self.mps_pipe_dir!r}")
            # Written plainly ("/tmp/nvidia-mps/" is /tmp/nvidia-mps): fill Pods' paths are compared with it.
            object.__setattr__(self, "mps_pipe_dir", posixpath.normpath(self.mps_pipe_dir))
            mps_client.check_pipe_dir(PurePosixPath(self.mps_pipe_dir))
            shm = PurePosixPath(mps_client.check_shm_dir(self.mps_shm_dir))
            for name, other in (("MPS pipe directory", self.mps_pipe_dir),
                                ("node's run directory", self.node_run_dir)):
                o = PurePosixPath(other)
                if shm == o or o in shm.parents or shm in o.parents:
                    raise ValueError(f"the MPS /dev/shm directory {self.mps_shm_dir} must be apart from the {name} "
                                     f"{other}: fill Pods mount both, and each must hold only its own files")
        mps_client.check_thread_percentage(self.mps_thread_percentage)


# -- what it decides ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """A FillJob placed on one stage: what the agent on ``node`` is told, and what the fill Pod is given."""

    uid: str
    generation: int
    namespace: str
    name: str
    training: str
    stage: int
    node: str
    pod: str  # the training Pod
    device: str
    fill_pod: str  # the fill job's Pod
    attempt: int
    gpu_uuid: str | None = None
    job: FillJobSpec | None = field(default=None, compare=False)  # what the agent plans and drives
    slowdown_budget: float | None = None  # the PipelineTraining's limits, for the agent's slowdown guard
    max_fill_share: float | None = None
    tail_risk: float | None = None  # and for the fill processes' steps past a bubble's predicted end


@dataclass(frozen=True)
class Event:
    kind: str  # FillJob | PipelineTraining
    namespace: str
    name: str
    uid: str
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decisions:
    fill_job_status: dict[str, dict[str, Any]] = field(default_factory=dict)  # "ns/name" -> whole status
    training_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    create_pods: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[tuple[str, str]] = field(default_factory=list)  # (namespace, name)
    assign: list[Assignment] = field(default_factory=list)
    cancel: list[tuple[str, str]] = field(default_factory=list)  # (node, FillJob uid)
    events: list[Event] = field(default_factory=list)
    add_finalizer: list[str] = field(default_factory=list)  # "ns/name" of FillJobs that now hold resources
    remove_finalizer: list[str] = field(default_factory=list)  # deleted FillJobs whose clean-up is done


# -- helpers ------------------------------------------------------------------------------------------------
def key_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def fill_pod_name(name: str, attempt: int) -> str:
    """Deterministic, so a retried create conflicts instead of starting the job twice; a name too long for a
    Pod keeps a hash of the whole so two long names never share a Pod."""
    full = f"fj-{name}-a{attempt}"
    if len(full) <= 253:
        return full
    return f"fj-{name[:200]}-{_digest(name)}-a{attempt}"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 characters): long ones keep a prefix and a hash of the whole."""
    return text if len(text) <= 63 else f"{text[:50].rstrip('-_.')}-{_digest(text)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


_PARSED: dict[tuple[str, str, str, str], FillJobResource] = {}


def _parse(obj: Mapping[str, Any]) -> FillJobResource:
    """``FillJobResource.from_object``, remembered per (identity, spec): re-validating a thousand unchanged specs
    every round would dominate the round. The key holds the spec itself, so the memo never changes a result."""
    meta = obj.get("metadata") or {}
    key = (str(meta.get("uid") or ""), str(meta.get("namespace") or ""), str(meta.get("name") or ""),
           json.dumps(obj.get("spec"), sort_keys=True, default=str))
    job = _PARSED.get(key)
    if job is None:
        if len(_PARSED) > 100_000:
            _PARSED.clear()
        job = _PARSED[key] = FillJobResource.from_object(obj)
    return job


_PROFILES: dict[tuple[Any, ...], FillProfile] = {}


def _profile(job: FillJobResource) -> FillProfile:
    """The scheduler's profile of a job, one object per shape: the scheduler caches a profile's processing
    times per object, so jobs of one shape share them (a memo of pure values, bounded by the shapes seen)."""
    step_s = job.job.gating_step_s or PROVISIONAL_STEP_S
    nodes = tuple(job.job.plan_nodes(step_s) or (FillNode(step_s, job.job.memory_bytes),))
    kind = job.job.kind or WorkloadKind.TRAINING
    key = (kind, job.samples_per_step, job.flops_per_step, nodes)
    prof = _PROFILES.get(key)
    if prof is None:
        if len(_PROFILES) > 10_000:
            _PROFILES.clear()
        shape = f"{kind}:{job.samples_per_step}:" + ",".join(f"{n.duration_s:.9g}/{n.memory_bytes}" for n in nodes)
        prof = _PROFILES[key] = FillProfile(shape, kind, job.flops_per_step or 0.0, 0.0,
                                            (FillConfig("spec", job.samples_per_step, nodes),))
    return prof



@functools.cache
def _policy(name: str) -> Any:
    """The policy object for ``name`` (entry points are looked up once per process; policies hold no state)."""
    return get_policy(name)


# stage key -> (cycle, share, reserve, stage number, class): a stage's class is rebuilt only when its cycle object or
# its training's share or reserve changes (the shell hands the same cycle object over while the report is unchanged).
_CLASSES: dict[str, tuple[Any, float, int, int, ExecutorClass]] = {}


def executor_class(stage: StageView, training: PipelineTrainingResource, context_bytes: int = 0) -> ExecutorClass:
    """The scheduler's view of one stage: its bubbles cut to the training's share and memory reserve (and the fill
    process's CUDA context, ``context_bytes``, where the agent plans one: ``stage_context_bytes``)."""
    assert stage.cycle is not None
    reserve = training.memory_reserve_bytes + context_bytes
    have = _CLASSES.get(stage.key)
    if have is not None and have[0] is stage.cycle and have[1] == training.max_fill_share \
            and have[2] == reserve and have[3] == stage.stage:
        return have[4]
    bubbles = tuple(Bubble(s.duration_s * training.max_fill_share,
                           max(0, s.free_bytes - reserve),
                           f"{stage.training} stage {stage.stage} slot {s.slot}") for s in stage.cycle.slots)
    cls = ExecutorClass(stage.key, bubbles, stage.cycle.iteration_s, 1)
    if len(_CLASSES) > 100_000:
        _CLASSES.clear()
    _CLASSES[stage.key] = (stage.cycle, training.max_fill_share, reserve, stage.stage, cls)
    return cls


def stage_context_bytes(view: ClusterView, stage: StageView) -> int:
    """The CUDA-context allowance the stage's agent adds to a job's memory: on a GPU, outside MPS."""
    gpu = bool(stage.gpu_uuid) or stage.device.startswith("cuda")
    return view.cuda_context_bytes if gpu and view.fill_pods.mps_pipe_dir is None else 0


def _status(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("status") or {})


def _phase(status: Mapping[str, Any]) -> FillJobPhase | None:
    try:
        return FillJobPhase(str(status.get("phase")))
    except ValueError:
        return None


class _JobState:
    """The status being built for one FillJob (its conditions kept, its events collected)."""

    def __init__(self, obj: Mapping[str, Any], now: dt.datetime, out: Decisions) -> None:
        self.obj = obj
        self.meta = obj.get("metadata") or {}
        self.generation = int(self.meta.get("generation") or 1)
        self.before = _status(obj)
        self.status = dict(self.before)
        self.now = now
        self.out = out
        self.queued_event: Event | None = None
        self.evicted = False  # evicted this round: placed again from the next one (see _place)

    def condition(self, type_: ConditionType, ok: bool, reason: str, message: str) -> None:
        self.status["conditions"] = set_condition(self.status.get("conditions") or [], Condition(
            type_.value, "True" if ok else "False", reason, message, observed_generation=self.generation), self.now)

    def phase(self, phase: FillJobPhase, message: str, *, event: str | None = None, warning: bool = False) -> None:
        changed = self.before.get("phase") != phase.value or self.before.get("message") != message
        self.status["phase"] = phase.value
        self.status["message"] = message
        if event is not None and changed:
            ev = Event("FillJob", self.meta.get("namespace", ""), self.meta.get("name", ""), self.meta.get("uid", ""),
                       "Warning" if warning else "Normal", event, message)
            self.out.events.append(ev)
            if event == "Queued":
                self.queued_event = ev

    def finish(self) -> None:
        if self.status.get("phase") != FillJobPhase.QUEUED.value and self.queued_event is not None:
            self.out.events.remove(self.queued_event)  # queued and placed in one round: one story
        self.status["observedGeneration"] = self.generation
        if self.status != self.before:
            self.out.fill_job_status[key_of(self.obj)] = self.status


def _progress_fields(job: FillJobResource, done: int, flops: float) -> dict[str, Any]:
    if not flops and job.flops_per_step:
        flops = done * job.flops_per_step  # a job that reports none (a plain command): what its spec says a step is
    pct = 100.0 * min(done, job.steps) / job.steps if job.steps else 0.0
    return {"progress": {"stepsDone": done, "stepsTotal": job.steps, "percent": round(pct, 1)},
            "progressText": f"{pct:.0f}% ({done}/{job.steps})", "recoveredFlops": float(flops)}


# -- the decision -------------------------------------------------------------------------------------------
def reconcile(view: ClusterView) -> Decisions:
    """Every decision for the cluster as it is now: statuses, fill Pods, assignments, cancellations, Events."""
    out = Decisions()
    now_s = view.now.timestamp()
    trainings: dict[str, PipelineTrainingResource] = {}
    invalid: dict[str, str] = {}
    for t in view.trainings:
        try:
            trainings[key_of(t)] = PipelineTrainingResource.from_object(t)
        except ResourceError as exc:
            invalid[key_of(t)] = str(exc)  # said in its status; it selects no Pod until it is fixed
    stages = {s.key: s for s in view.stages if s.training in trainings}

    valid: dict[str, tuple[Mapping[str, Any], FillJobResource, _JobState]] = {}
    busy: dict[str, tuple[str, float]] = {}  # stage key -> (FillJob uid, expected end)
    for obj in view.fill_jobs:
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            _clean_up(obj, out)
            continue
        st = _JobState(obj, view.now, out)
        phase = _phase(st.status)
        if phase is not None and phase.terminal:  # final: neither parsed nor looked at again (thousands pile up)
            a = st.status.get("assignment") or {}
            uid = str(meta.get("uid", ""))
            if a.get("node") and uid in view.progress:
                # The agent still holds the run: it lets go of it now that the final status is stored (told every
                # round until it stops reporting the job, so a lost call costs a round).
                out.cancel.append((str(a["node"]), uid))
            st.finish()
            continue
        try:
            job = _parse(obj)
            if phase not in ACTIVE:  # a Pod made already has the mounts it has: a changed setting does not stop it
                _check_paths(job, view.fill_pods)
        except ResourceError as exc:
            a = st.status.pop("assignment", None) or {}
            if a.get("pod"):  # it ran: its spec was edited into an invalid one; stop it, free its stage
                out.delete_pods.append((str(meta.get("namespace", "")), str(a["pod"])))
            if a.get("node"):
                out.cancel.append((str(a["node"]), str(meta.get("uid", ""))))
            st.status.pop("eta", None)
            st.condition(ConditionType.ADMITTED, False, "InvalidSpec", str(exc))
            st.phase(FillJobPhase.FAILED, f"invalid spec: {exc} (a Failed FillJob is not read again: delete it and "
                     "apply it corrected)", event="InvalidSpec", warning=True)
            st.finish()
            continue
        if phase is None or phase is FillJobPhase.PENDING:
            st.condition(ConditionType.ADMITTED, True, "Valid", "the spec is valid")
            st.status.setdefault("restarts", 0)
            st.status.setdefault("counters", {"kills": 0, "placements": 0, "evictions": 0})
            st.status.update(_progress_fields(job, 0, 0.0))
            st.phase(FillJobPhase.QUEUED, "waiting for a bubble it fits", event="Queued")
        if _phase(st.status) in ACTIVE:
            _track(out, view, st, job, stages, trainings, busy, now_s, invalid)
        valid[key_of(obj)] = (obj, job, st)

    _place(view, out, valid, stages, trainings, busy, now_s)
    for _obj, _job, st in valid.values():
        st.finish()
    _training_statuses(view, out, trainings, stages, valid)
    _invalid_training_statuses(view, out, invalid)
    return out


def _clean_up(obj: Mapping[str, Any], out: Decisions) -> None:
    """A deleted FillJob: stop its fill process, delete its Pod, then let the deletion finish."""
    meta = obj.get("metadata") or {}
    if FINALIZER not in (meta.get("finalizers") or []):
        return
    a = (obj.get("status") or {}).get("assignment") or {}
    if a.get("pod"):
        out.delete_pods.append((str(meta.get("namespace", "")), str(a["pod"])))
    if a.get("node"):
        out.cancel.append((str(a["node"]), str(meta.get("uid", ""))))
    out.remove_finalizer.append(key_of(obj))
    out.events.append(Event("FillJob", str(meta.get("namespace", "")), str(meta.get("name", "")),
                            str(meta.get("uid", "")), "Normal", "Deleted",
                            f"stopped; its Pod {a['pod']} is deleted" if a.get("pod") else "deleted"))


def _track(out: Decisions, view: ClusterView, st: _JobState, job: FillJobResource, stages: Mapping[str, StageView],
           trainings: Mapping[str, PipelineTrainingResource], busy: dict[str, tuple[str, float]],
           now_s: float, invalid: Mapping[str, str] | None = None) -> None:
    """A placed job: follow its progress, or evict it when its stage, Pod or agent is gone (or its training's spec
    turned invalid: ``invalid``, training key -> why)."""
    a = st.status.get("assignment") or {}
    skey = f"{job.namespace}/{a.get('training')}/{a.get('stage')}/{a.get('trainingPod')}"
    stage = stages.get(skey)
    uid = job.uid
    prog = view.progress.get(uid)
    if prog is not None and prog.attempt != int(st.status.get("restarts", 0)):
        prog = None  # an earlier attempt's run (stopped when this one was placed): not this run's progress
    # Its Pod not started yet (judged only while no process of it runs): (the kubelet's reason or "", since when).
    waiting = view.waiting_pods.get(f"{job.namespace}/{a.get('pod')}") \
        if prog is None or prog.state is FillState.SUBMITTED else None
    if waiting is not None and waiting[0]:
        waiting = (_kubelet_words(st.status, str(a.get("pod")), waiting[0]), waiting[1])
    lost = None
    ended_itself = False  # the fill Pod (or its process) ended on its own: kept for its logs, not deleted
    # The training's doing (its Pod or spec changed), not the job's: not counted as a restart. Unless the job had its
    # process on the training's GPU: a fatal fault of one MPS client reaches every client of its server, the training
    # among them, so a training Pod restarted, replaced or gone then may be the job's doing (counted, as before).
    on_gpu = prog is not None and a.get("device", "").startswith("cuda") and (
        prog.state in (FillState.PAUSED, FillState.RUNNING, FillState.STOPPED) or prog.steps_done > 0)
    training_side = False
    if stage is None and view.acting_s < STARTUP_GRACE_S:
        return  # just started: the training Pod may not be in the watch's first listing yet; look again next round
    if stage is None:
        tkey, tpod = f"{job.namespace}/{a.get('training')}", a.get("trainingPod")
        if tkey in (invalid or {}):
            lost = (f"PipelineTraining {a.get('training')}'s spec turned invalid ({(invalid or {})[tkey]}): its "
                    "bubbles are not used until it is fixed")
            training_side = True
        elif any(s.pod == tpod and s.training == tkey for s in view.stages):
            # The Pod is there, its stage is not reported: the node's agent restarted (it lost its fill processes).
            # (A silent hook leaves the stage reported, hook_reporting False: the job is Paused, below.)
            lost = (f"the bubbles agent on node {a.get('node')} no longer reports stage {a.get('stage')} of "
                    f"{a.get('training')} (training Pod {tpod} still runs: the agent restarted)")
        else:
            lost = f"training Pod {tpod} (stage {a.get('stage')} of {a.get('training')}) is gone"
            training_side = not on_gpu
    elif not stage.agent_up:
        lost = f"the bubbles agent on node {stage.node} stopped answering"
    elif a.get("trainingPodUid") and stage.pod_uid and a["trainingPodUid"] != stage.pod_uid:
        lost = f"training Pod {stage.pod} was replaced by a new Pod of the same name: its bubbles are re-measured"
        training_side = not on_gpu
    elif stage.cycle is None:
        lost = f"training Pod {stage.pod} restarted: its bubbles are re-measured before anything runs there"
        training_side = not on_gpu
    elif (failed := view.failed_pods.get(f"{job.namespace}/{a.get('pod')}")) is not None:
        lost = f"fill Pod {a.get('pod')} failed: {failed}"
        ended_itself = True
    elif (prog is None or prog.state is FillState.SUBMITTED) and \
            (ended := view.ended_pods.get(f"{job.namespace}/{a.get('pod')}")) is not None:
        # A finished run is reported as STOPPED by the agent before its process exits; an agent that knows no
        # process for the job while its Pod has ended lost the run (it restarted).
        lost = (f"fill Pod {a.get('pod')} ended ({ended}) but the agent on {a.get('node')} holds no run of the job "
                "(the agent restarted?)")
        ended_itself = True
    elif waiting is not None and now_s - waiting[1] >= view.pod_start_timeout_s:
        why = waiting[0] or f"still being created (a volume that does not mount? kubectl describe pod {a.get('pod')})"
        lost = (f"fill Pod {a.get('pod')} did not start within {view.pod_start_timeout_s:g} s of its creation "
                f"(the operator's --fill-pod-start-timeout): {why}")
    if prog is not None and prog.state is FillState.STOPPED:
        if prog.reason == "finished" or prog.steps_done >= job.steps:
            st.status.update(_progress_fields(job, max(prog.steps_done, job.steps), prog.flops))
            st.status.pop("eta", None)
            st.condition(ConditionType.FINISHED, True, "Succeeded", f"did {job.steps} steps")
            st.condition(ConditionType.RUNNING, False, "Finished", "the job finished")
            st.phase(FillJobPhase.SUCCEEDED, f"finished {job.steps} steps in the bubbles of {a.get('training')}",
                     event="Succeeded")
            return
        lost = f"the fill process stopped: {prog.reason}"
        ended_itself = True
    if lost is not None:
        _evict(st, job, lost, a, keep_pod=ended_itself, counted=not training_side)
        if stage is not None and st.evicted:
            # The job is placed again from the next round (see _place): until then the stage it had is held for
            # it, or a job of lower priority would take it now and keep it.
            busy[skey] = (uid, now_s)
        return
    assert stage is not None
    if prog is None:
        # The agent does not know this run (just placed, or the agent restarted): tell it again. Idempotent on the
        # agent's side (uid, generation, attempt), so a lost or repeated call costs nothing.
        out.assign.append(Assignment(job.uid, job.generation, job.namespace, job.name, stage.training, stage.stage,
                                     stage.node, stage.pod, stage.device, str(a.get("pod") or ""),
                                     int(st.status.get("restarts", 0)), stage.gpu_uuid, job.job,
                                     **_limits(trainings.get(stage.training))))
    done = prog.steps_done if prog is not None else int((st.status.get("progress") or {}).get("stepsDone", 0))
    flops = prog.flops if prog is not None else float(st.status.get("recoveredFlops", 0.0))
    st.status.update(_progress_fields(job, done, flops))
    if prog is not None:
        counters = dict(st.status.get("counters") or {})
        counters["kills"] = max(int(counters.get("kills", 0)), prog.kills)
        st.status["counters"] = counters
    rate = _steps_per_s(job, stage, trainings.get(stage.training), stage_context_bytes(view, stage))
    end_s = now_s + _init_left_s(job, a, prog, now_s) + (job.steps - done) / rate if rate > 0 else math.inf
    busy[skey] = (uid, end_s)
    _eta(st, job, end_s)
    if waiting is not None and waiting[0]:
        what, hint = _not_starting(waiting[0], str(a.get("pod")))
        st.condition(ConditionType.RUNNING, False, "PodNotStarting", f"fill Pod {a.get('pod')}: {waiting[0]}")
        # The phase's message (and its Event) names the kind of failure only: the kubelet's own words alternate
        # (ErrImagePull, ImagePullBackOff) with every retry, and are in the condition.
        st.phase(FillJobPhase.PLACED, f"fill Pod {a.get('pod')} has not started: {what}; {hint}. It is taken off "
                 f"the stage and queued again if it has not started {view.pod_start_timeout_s:g} s after its "
                 "creation", event="PodNotStarting", warning=True)
    elif _phase(st.status) is FillJobPhase.PLACED and \
            _condition(st.status, ConditionType.RUNNING).get("reason") == "PodNotStarting":
        st.condition(ConditionType.RUNNING, False, "Starting", f"fill Pod {a.get('pod')} started")
        st.phase(FillJobPhase.PLACED, _placed_message(stage))
    if prog is not None and prog.state in (FillState.RUNNING, FillState.PAUSED):
        if not stage.hook_reporting:
            # No bubbles while the training sends no signals (stopped, evaluating or checkpointing, hung), so no fill
            # steps: said, so that a job making no progress says why. It keeps its stage and its process.
            st.condition(ConditionType.RUNNING, False, "TrainingSilent", f"no bubble signals from stage {stage.stage} "
                         f"of {stage.training} (training Pod {stage.pod})")
            st.phase(FillJobPhase.PAUSED, f"paused: the training's hook on {stage.training} stage {stage.stage} "
                     f"(Pod {stage.pod}) has sent no bubble signals for {HOOK_SILENCE_S:g} s (the training stopped, "
                     "is evaluating or checkpointing, or hangs); fill work runs only in its bubbles, so the job "
                     "runs again at its next one", event="Paused")
            return
        st.condition(ConditionType.RUNNING, True, "Running", f"steps run in the bubbles of stage {stage.stage} "
                     f"on {stage.node}")
        st.phase(FillJobPhase.RUNNING, f"running in the bubbles of {stage.training} stage {stage.stage} on "
                 f"{stage.node}", event="Running")


# Kubelet reasons a container waits for that are failures to start it, not steps of starting it.
_IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                            "RegistryUnavailable", "ImageInspectError", "SignatureValidationFailed"})


def pod_not_starting(pod: Mapping[str, Any]) -> str | None:
    """Why the kubelet cannot start a Pending Pod ("Reason: message" of its first container that waits for a failure
    to start it), or None while it is only starting (ContainerCreating, PodInitializing) or not started at all."""
    st = pod.get("status") or {}
    for c in [*(st.get("initContainerStatuses") or ()), *(st.get("containerStatuses") or ())]:
        w = (c.get("state") or {}).get("waiting") or {}
        reason = str(w.get("reason") or "")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            return f"{reason}: {w['message']}" if w.get("message") else reason
    # A Pod the scheduler places (one with a claim: fill_pod_place) and cannot: the scheduler's own words.
    for c in st.get("conditions") or ():
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return f"Unschedulable: {c['message']}" if c.get("message") else "Unschedulable"
    return None


def _kubelet_words(status: Mapping[str, Any], pod: str, why: str) -> str:
    """What keeps a fill Pod from starting, as said: the kubelet's "Reason: message", except that its back-off between
    image pulls (``ImagePullBackOff: Back-off pulling image ...``) keeps the words of the failed pull said before it
    (``ErrImagePull: <the registry's error>``), which say why; the kubelet alternates the two with every retry, and
    the status would be rewritten each time for less."""
    if why.split(":", 1)[0].strip() != "ImagePullBackOff":
        return why
    said = _condition(status, ConditionType.RUNNING)
    prefix = f"fill Pod {pod}: "
    message = str(said.get("message") or "")
    if said.get("reason") == "PodNotStarting" and message.startswith(prefix + "ErrImagePull"):
        return message[len(prefix):]
    return why


def _not_starting(why: str, pod: str) -> tuple[str, str]:
    """What keeps a fill Pod from starting, from the kubelet's "Reason: message", and what to do about it."""
    reason = why.split(":", 1)[0].strip()
    if reason in _IMAGE_REASONS:
        return ("its image cannot be pulled", "check spec.image, and that the node can pull it (a private registry "
                "needs spec.imagePullSecrets, or an image pull secret on the namespace's default ServiceAccount)")
    if reason == "CreateContainerConfigError":
        return ("its container cannot be configured", f"a Secret or ConfigMap it needs may be missing (kubectl "
                f"describe pod {pod})")
    if reason == "Unschedulable":
        return ("the scheduler cannot place it on its training's node", "a claim of spec.volumes or "
                "spec.checkpoint bound to a volume that node cannot reach (another zone or node), or spec.resources "
                "more than the node has free; the scheduler's words are in the Running condition")
    return (reason or "the kubelet cannot start it", f"see kubectl describe pod {pod}")


def _condition(status: Mapping[str, Any], type_: ConditionType) -> Mapping[str, Any]:
    """The condition of ``type_`` in ``status`` ({} if it has none)."""
    return next((c for c in status.get("conditions") or () if c.get("type") == type_.value), {})


def _placed_message(stage: StageView) -> str:
    return f"placed on {stage.training} stage {stage.stage} ({stage.pod} on {stage.node}, {stage.device})"


def _evict(st: _JobState, job: FillJobResource, why: str, a: Mapping[str, Any], *, keep_pod: bool = False,
           counted: bool = True) -> None:
    """Take the job off its stage: requeue it, or fail it past its restart limit. Its Pod is deleted unless
    ``keep_pod`` (it ended on its own: kept, like a Job's failed Pods, for ``kubectl logs``; it holds nothing, and
    goes with the FillJob, its owner). Not ``counted``: the training's doing (its Pod gone, replaced or restarted, its
    spec turned invalid), which a job cannot avoid: a new attempt (``status.restarts`` names its Pod) that does not
    count against ``spec.restartLimit``, as Kubernetes' Pod failure policies leave disruptions uncounted."""
    restarts = int(st.status.get("restarts", 0)) + 1  # the attempt's number
    counters = dict(st.status.get("counters") or {})
    counters["evictions"] = int(counters.get("evictions", 0)) + 1
    if not counted:
        counters["trainingDisruptions"] = int(counters.get("trainingDisruptions", 0)) + 1
    used = restarts - int(counters.get("trainingDisruptions", 0))  # the restarts the job's limit counts
    st.status["counters"] = counters
    if a.get("pod") and keep_pod:
        why = f"{why} (its Pod {a['pod']} is kept for its logs)"
    elif a.get("pod"):
        st.out.delete_pods.append((job.namespace, str(a["pod"])))
    if a.get("node"):
        st.out.cancel.append((str(a["node"]), job.uid))
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


def _init_left_s(job: FillJobResource, a: Mapping[str, Any], prog: JobProgress | None, now_s: float) -> float:
    """What is left of the job's spec.profile.initTime: from its placement (assignment.placedAt) until its process
    has initialized on its device (the agent reports it PAUSED or RUNNING); 0 once it has, or when it took longer."""
    if not job.init_s or (prog is not None and prog.state not in (FillState.SUBMITTED, FillState.CREATED)):
        return 0.0
    try:
        placed = dt.datetime.fromisoformat(str(a["placedAt"]).replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        return 0.0  # placed by an operator that did not say when: counted from the first step on
    return max(0.0, job.init_s - (now_s - placed))


def _steps_per_s(job: FillJobResource, stage: StageView, training: PipelineTrainingResource | None,
                 context_bytes: int = 0) -> float:
    if stage.cycle is None or training is None:
        return 0.0
    cls = executor_class(stage, training, context_bytes)
    rate = best_rate(cls.bubbles, cls.iteration_s, _profile(job))  # cached per bubble shape and profile
    return rate.steps_per_cycle / stage.cycle.iteration_s if rate else 0.0


def _eta(st: _JobState, job: FillJobResource, end_s: float) -> None:
    """Set the ETA, keeping the one written before while the new estimate is within max(30 s, 5% of the time
    left) of it: an estimate that moves with every round would rewrite every status every round."""
    if math.isfinite(end_s) and end_s > MAX_ETA_S:
        end_s = math.inf  # beyond any calendar (a huge job at a trickle): no ETA
    if math.isfinite(end_s):
        old = st.before.get("eta")
        if old:
            old_s = dt.datetime.fromisoformat(str(old).replace("Z", "+00:00")).timestamp()
            if abs(old_s - end_s) <= max(30.0, 0.05 * max(0.0, end_s - st.now.timestamp())):
                end_s = old_s
        st.status["eta"] = rfc3339(dt.datetime.fromtimestamp(end_s, dt.UTC))
        if job.deadline is not None:
            st.status["deadlineFeasible"] = end_s <= job.deadline.timestamp()
    else:
        st.status.pop("eta", None)
        if job.deadline is not None:
            st.status["deadlineFeasible"] = False


def _eligible(job: FillJobResource, training_keys: Sequence[str], trainings: Mapping[str, PipelineTrainingResource],
              memo: dict[str, list[str]]) -> list[str]:
    key = f"{job.namespace}|{sorted(job.training_selector.items())!r}"
    if key not in memo:
        memo[key] = [k for k in training_keys if trainings[k].namespace == job.namespace
                     and selector_matches(job.training_selector, trainings[k].labels)]
    return memo[key]


def _place(view: ClusterView, out: Decisions, valid: Mapping[str, tuple[Mapping[str, Any], FillJobResource, _JobState]],
           stages: Mapping[str, StageView], trainings: Mapping[str, PipelineTrainingResource],
           busy: Mapping[str, tuple[str, float]], now_s: float) -> None:
    """Queued jobs onto free profiled stages: by priority tier, then by the scheduling policy."""
    usable = [s for s in stages.values() if s.cycle is not None and s.agent_up]
    # A job evicted this round is placed from the next: its eviction (Pod deleted, run cancelled, restarts counted) is
    # written first, whatever becomes of its next Pod (one the API server refuses writes nothing of its round).
    queued = [(obj, job, st) for obj, job, st in valid.values()
              if _phase(st.status) is FillJobPhase.QUEUED and not st.evicted]
    if not queued:
        return
    if not usable:
        for _obj, _job, st in queued:
            why = ("no PipelineTraining has reported its bubbles yet (is the hook attached, and the agent running on "
                   "its nodes?)")
            st.condition(ConditionType.PLACED, False, "NoProfiledTraining", why)
            st.phase(FillJobPhase.QUEUED, f"waiting: {why}")
        return
    classes = [executor_class(s, trainings[s.training], stage_context_bytes(view, s)) for s in usable]
    by_name = {c.name: s for c, s in zip(classes, usable, strict=True)}
    sched = Scheduler(classes, _policy(view.policy))
    for e, c in enumerate(classes):
        if c.name in busy:
            sched.occupy(e, busy[c.name][0], busy[c.name][1])
    requests: dict[str, tuple[Mapping[str, Any], FillJobResource, _JobState]] = {}
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
        req = FillJobRequest(job.uid or key_of(obj), _profile(job), job.steps * job.samples_per_step,
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
        _eta(st, job, etas.get(req_id, math.inf))
        st.condition(ConditionType.PLACED, False, "AllBubblesBusy", "every stage it fits runs another fill job")
        st.phase(FillJobPhase.QUEUED, "waiting: every bubble it fits is in use")


def _limits(training: PipelineTrainingResource | None) -> dict[str, float | None]:
    """The training's slowdown budget, largest fill share and tail risk, which the agent on its node applies."""
    if training is None:
        return {"slowdown_budget": None, "max_fill_share": None, "tail_risk": None}
    return {"slowdown_budget": training.slowdown_budget, "max_fill_share": training.max_fill_share,
            "tail_risk": training.tail_risk}


def _assign(out: Decisions, st: _JobState, job: FillJobResource, stage: StageView, end_s: float,
            settings: FillPodSettings, training: PipelineTrainingResource | None) -> None:
    attempt = int(st.status.get("restarts", 0))
    pod = fill_pod_name(job.name, attempt)
    a = Assignment(job.uid, job.generation, job.namespace, job.name, stage.training, stage.stage, stage.node,
                   stage.pod, stage.device, pod, attempt, stage.gpu_uuid, job.job, **_limits(training))
    out.assign.append(a)
    out.create_pods.append(fill_pod(job, a, settings))
    if FINALIZER not in (st.meta.get("finalizers") or []):
        out.add_finalizer.append(key_of(st.obj))
    counters = dict(st.status.get("counters") or {})
    counters["placements"] = int(counters.get("placements", 0)) + 1
    st.status["counters"] = counters
    st.status["assignment"] = {"training": stage.training.split("/", 1)[-1], "stage": stage.stage,
                               "node": stage.node, "device": stage.device, "pod": pod, "trainingPod": stage.pod,
                               "trainingPodUid": stage.pod_uid, "placedAt": rfc3339(st.now)}
    st.status.pop("queuePosition", None)
    _eta(st, job, end_s)
    msg = _placed_message(stage)
    st.condition(ConditionType.PLACED, True, "Placed", msg)
    st.phase(FillJobPhase.PLACED, msg, event="Placed")


def fill_pod_place(node: str, claims: bool) -> dict[str, Any]:
    """The fill Pod's place: the training's node (the bubbles are its GPU's). ``nodeName`` where it has no
    PersistentVolumeClaim: no scheduler involved, no taint of a GPU node in the way. With a claim the scheduler must
    see the Pod, or a claim of a WaitForFirstConsumer StorageClass (most clouds' default) is never bound and the
    Pod never starts: then the node by a required affinity (on metadata.name, as the DaemonSet controller pins its
    Pods), tolerating the node's NoSchedule taints as nodeName would."""
    if not claims:
        return {"nodeName": node}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
            "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}]}


def fill_pod_node(spec: Mapping[str, Any]) -> str | None:
    """The node a fill Pod spec (``fill_pod``'s) is meant for: its nodeName, or the node its affinity requires."""
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    terms = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
              .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
    for term in terms:
        for f in term.get("matchFields") or ():
            if f.get("key") == "metadata.name" and f.get("operator") == "In" and len(f.get("values") or ()) == 1:
                return str(f["values"][0])
    return None


def _check_paths(job: FillJobResource, settings: FillPodSettings) -> None:
    """ResourceError if the job's own storage (its volumes, its checkpoint) would lie in the MPS pipe directory its
    Pod mounts (the operator's --fill-mps-pipe-dir: a setting of the cluster's, unlike the paths the spec checks)."""
    pipe = settings.mps_pipe_dir  # written plainly (FillPodSettings)
    if not pipe:
        return
    for where, path in job.container_paths():
        if inside(path, pipe):
            raise ResourceError(f"{where} {path!r} lies in {pipe}, the MPS pipe directory every fill Pod on a GPU "
                                "mounts (the operator's --fill-mps-pipe-dir, the chart's agent.mps.pipeDir): choose "
                                "a path apart from it")


def fill_pod_mounts(training: str, stage: int, node_run_dir: str) -> list[tuple[str, str, str]]:
    """(volume name, path on the node, path in the Pod) of the two directories of the node's run directory a fill Pod
    mounts, each at its place under RUN_DIR: the agent's attach socket's, and its stage's fill sockets'. Not the run
    directory: the stage's other files (the training's lock and card, the agent's socket) and the node's other
    trainings stay out of the fill job's reach."""
    name = training.split("/", 1)[-1]
    fills = posixpath.join(name, f"stage-{stage}", paths.FILLS_DIR_NAME)
    return [("bubbles-attach", posixpath.join(node_run_dir, paths.ATTACH_DIR_NAME),
             posixpath.join(RUN_DIR, paths.ATTACH_DIR_NAME)),
            ("bubbles-fills", posixpath.join(node_run_dir, fills), posixpath.join(RUN_DIR, fills))]


def fill_pod(job: FillJobResource, a: Assignment, settings: FillPodSettings | None = None) -> dict[str, Any]:
    """The fill job's Pod: on the training's node, next to its stage, reaching the agent's node-local sockets (two
    directories of the node's run directory, under RUN_DIR, as the agent's UID: ``fill_pod_mounts``)."""
    settings = settings or FillPodSettings()
    mounts = fill_pod_mounts(a.training, a.stage, settings.node_run_dir)
    env = [
        {"name": "BUBBLES_FILL_JOB", "value": job.name},
        {"name": "BUBBLES_FILL_JOB_UID", "value": job.uid},  # with the attempt: how the process attaches to the agent
        {"name": "BUBBLES_FILL_ATTEMPT", "value": str(a.attempt)},
        {"name": "BUBBLES_TRAINING", "value": a.training.split("/", 1)[-1]},
        {"name": "BUBBLES_STAGE", "value": str(a.stage)},
        {"name": "BUBBLES_DEVICE", "value": a.device},
        {"name": "BUBBLES_RUN_DIR", "value": RUN_DIR},
        {"name": "BUBBLES_MEMORY_BYTES", "value": str(job.job.memory_bytes)},
        {"name": "BUBBLES_MAX_STEPS", "value": str(job.steps)},
    ]
    if a.gpu_uuid:
        # The training's GPU, without asking the device plugin for one (it is the training's): the NVIDIA container
        # runtime exposes the GPU this names to a Pod that requests none. Inside, it is the only GPU: cuda:0.
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": a.gpu_uuid})
        env = [e if e["name"] != "BUBBLES_DEVICE" else {"name": "BUBBLES_DEVICE", "value": "cuda:0"} for e in env]
    else:
        # No GPU of the training's is known: none at all, whatever the image's own ENV says (CUDA and PyTorch base
        # images set NVIDIA_VISIBLE_DEVICES=all, which on a node whose default runtime is NVIDIA's shows every GPU,
        # the trainings' among them). A GPU job here then fails at its start, closed.
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
    mps = settings.mps_pipe_dir if a.gpu_uuid else None
    if mps:
        # The node's MPS server, as the agent's own fill processes join it: its pipe directory, the SM share, priority
        # below the training's, and the job's memory pinned on the one GPU the Pod sees (device 0). Variables the
        # CUDA driver reads when the process initializes CUDA: the Pod's environment has them from the start.
        # A job that declares no memory gets no pinned limit here: the node's agent refuses a GPU job without one,
        # with the reason, once its Pod attaches (raising here would stop every reconcile round).
        pinned_on = 0 if job.job.memory_bytes > 0 else None
        mps_env = mps_client.fill_client_env(PurePosixPath(mps), settings.mps_thread_percentage, pinned_on,
                                             job.job.memory_bytes)
        env += [{"name": k, "value": v} for k, v in sorted(mps_env.items())]
    if job.job.gating_step_s is not None:
        env.append({"name": "BUBBLES_STEP_S", "value": repr(job.job.gating_step_s)})
    if job.checkpoint_path:
        env.append({"name": "BUBBLES_CHECKPOINT", "value": job.checkpoint_path})
    env += [dict(v) for v in job.env]  # spec.env: the job's own (names apart from the runtime's, checked)
    container: dict[str, Any] = {
        "name": "fill", "image": job.image, "env": env,
        "volumeMounts": [{"name": name, "mountPath": in_pod} for name, _, in_pod in mounts],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if job.pod_resources:  # spec.resources: the Pod's own CPU and host memory (quotas count them)
        container["resources"] = {kind: dict(v) for kind, v in job.pod_resources.items()}
    if job.job.command:
        # The SDK attaches the process to the node's agent, then execs the command (same PID: the agent's handle).
        container["command"] = ["python", "-m", "bubbles.sdk", "--exec", "--", *job.job.command]
    else:
        container["command"] = ["python", "-m", "bubbles.sdk", "--entry", str(job.job.entry)]
        if job.job.args:
            container["env"].append({"name": "BUBBLES_FILL_ARGS", "value": json.dumps(job.job.args)})
    security: dict[str, Any] = {k: v for k, v in (("runAsUser", settings.run_as_user),
                                                  ("runAsGroup", settings.run_as_group)) if v is not None}
    claims = bool(job.checkpoint_path and job.checkpoint_claim) or any(
        v.get("persistentVolumeClaim") for v in job.volumes)
    if claims and settings.run_as_group is not None:
        # The job runs as the agent's UID, not as whoever wrote its claims' files: the kubelet gives the claims' files
        # to its group (once, where their root does not have it already) so that the job can write its results.
        security.update(fsGroup=settings.run_as_group, fsGroupChangePolicy="OnRootMismatch")
    # Both made by the node's agent before it reports the stage (the hook makes fills/ too): a Pod finds them there.
    volumes: list[dict[str, Any]] = [{"name": name, "hostPath": {"path": on_node, "type": "Directory"}}
                                     for name, on_node, _ in mounts]
    if mps:
        # The agent's pipe directory, and its /dev/shm (a node directory the agent's Pod mounts there: the MPS server
        # keeps its shared state with its clients in /dev/shm). Not host IPC: the node's other IPC stays out.
        container["volumeMounts"] += [{"name": "mps-pipe", "mountPath": mps},
                                      {"name": "mps-shm", "mountPath": mps_client.SHM_MOUNT}]
        volumes += [{"name": "mps-pipe", "hostPath": {"path": mps, "type": "Directory"}},
                    {"name": "mps-shm", "hostPath": {"path": settings.mps_shm_dir, "type": "Directory"}}]
    if job.checkpoint_path and job.checkpoint_claim:
        # The job's state outlives its Pod: the next attempt (another node, maybe) restores from it.
        container["volumeMounts"].append({"name": "checkpoint", "mountPath": job.checkpoint_path})
        volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": job.checkpoint_claim}})
    for v in job.volumes:  # spec.volumes: the job's own (names and paths apart from the runtime's, checked)
        (source,) = [k for k in VOLUME_SOURCES if v.get(k) is not None]
        container["volumeMounts"].append({"name": v["name"], "mountPath": v["mountPath"],
                                          **{k: v[k] for k in ("subPath", "readOnly") if v.get(k) is not None}})
        volumes.append({"name": v["name"], source: dict(v[source])})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": a.fill_pod, "namespace": job.namespace,
            "labels": {"app.kubernetes.io/managed-by": "bubbles", "app.kubernetes.io/component": "fill-job",
                       "bubbles.dev/fill-job": label_value(job.name),
                       "bubbles.dev/training": label_value(a.training.split("/", 1)[-1])},
            "annotations": {"bubbles.dev/fill-job-uid": job.uid, "bubbles.dev/attempt": str(a.attempt)},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": "FillJob", "name": job.name, "uid": job.uid,
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            **fill_pod_place(a.node, claims),
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            **({"securityContext": security} if security else {}),
            **({"imagePullSecrets": [{"name": n} for n in job.image_pull_secrets]} if job.image_pull_secrets else {}),
            "containers": [container],
            "volumes": volumes,
        },
    }


def _training_statuses(view: ClusterView, out: Decisions, trainings: Mapping[str, PipelineTrainingResource],
                       stages: Mapping[str, StageView],
                       valid: Mapping[str, tuple[Mapping[str, Any], FillJobResource, _JobState]]) -> None:
    by_key = {key_of(t): t for t in view.trainings}
    placed_on: dict[str, int] = {}
    for _o, j, st in valid.values():
        if _phase(st.status) in ACTIVE:
            tk = f"{j.namespace}/{(st.status.get('assignment') or {}).get('training')}"
            placed_on[tk] = placed_on.get(tk, 0) + 1
    by_training: dict[str, list[StageView]] = {}
    for s in stages.values():
        by_training.setdefault(s.training, []).append(s)
    for tkey, tr in trainings.items():
        obj = by_key[tkey]
        before = _status(obj)
        status = dict(before)
        mine = by_training.get(tkey, [])
        status["pods"] = len({s.pod for s in mine})
        status["stages"] = [{
            **({"stage": s.stage} if s.stage >= 0 else {}),  # unknown until the Pod's hook reports
            "pod": s.pod, "node": s.node, **({"device": s.device} if s.device else {}),
            **({"iterationSeconds": s.cycle.iteration_s, "bubbleRatio": round(s.cycle.bubble_ratio, 4),
                "bubbles": [{"slot": b.slot, "durationSeconds": b.duration_s, "freeBytes": b.free_bytes}
                            for b in s.cycle.slots]} if s.cycle else {}),
        } for s in sorted(mine, key=lambda s: (s.stage, s.pod))]
        profiled = [s for s in mine if s.cycle is not None]
        gen = tr.generation
        conds = set_condition(status.get("conditions") or [], Condition(
            ConditionType.ADMITTED.value, "True", "Valid", "the spec is valid", observed_generation=gen), view.now)
        silent = [s.pod for s in mine if not s.hook_reporting]
        # Silent and never profiled: a hook to set up. Silent after it was profiled is the training's pause (an
        # evaluation, a checkpoint), stop or hang: said apart (Silent), with no set-up advice.
        unheard = [s for s in mine if not s.hook_reporting and s.cycle is None]
        unscheduled = sorted(s.pod for s in mine if not s.node)
        no_agent = sorted({s.node for s in mine if s.node and not s.agent_up})
        if not mine:
            conds = set_condition(conds, Condition("HookReporting", "False", "NoPods", "no Pod matches spec.selector",
                                                   observed_generation=gen), view.now)
        elif unscheduled:
            conds = set_condition(conds, Condition(
                "HookReporting", "False", "NotScheduled", f"Pod(s) {', '.join(unscheduled)} not on a node yet",
                observed_generation=gen), view.now)
        elif no_agent:
            # Not the hook's fault: nothing on the node can hear it (no agent Pod there, or the operator cannot call
            # the agents at all).
            conds = set_condition(conds, Condition(
                "HookReporting", "False", "NoAgent", f"no bubbles agent answers on node(s) {', '.join(no_agent)}: the "
                "agent DaemonSet must run there (its nodes need one of the chart's agent.gpuNodeLabels set to "
                "\"true\"), and the operator needs --agent-ca to call it", observed_generation=gen), view.now)
        elif silent and not unheard:
            conds = set_condition(conds, Condition(
                "HookReporting", "False", "Silent", f"no bubble signals for {HOOK_SILENCE_S:g} s from "
                f"{', '.join(sorted(silent))}, profiled before: the training stopped, is evaluating or checkpointing, "
                "or hangs. Fill jobs on those stages are Paused until it trains again", observed_generation=gen),
                view.now)
        elif silent:
            # A silent Pod beside one of the training's reporting Pods on its node may be a second process of a stage
            # already reported there (the hook stands such a twin down: one process per stage and node is harvested).
            shared = sorted(s.pod for s in unheard if any(o.hook_reporting and o.node == s.node for o in mine))
            twin = (f". {', '.join(shared)} share a node with Pods of this training that report: if one runs a stage "
                    "already reported there (tensor-parallel ranks or data-parallel replicas of one stage on one "
                    "node), its hook stood down, as one process per stage and node is harvested (its log says so)"
                    if shared else "")
            pods = ", ".join(sorted(s.pod for s in unheard))
            conds = set_condition(conds, Condition(
                "HookReporting", "False", "NoHook", f"no bubble signals from {pods}: attach the "
                "hook (bubbles.hook.instrument(engine)), set BUBBLES_TRAINING to this PipelineTraining's name and "
                f"mount the node's bubbles run directory (the chart's agent.runDir) at /run/bubbles{twin}",
                observed_generation=gen), view.now)
        else:
            conds = set_condition(conds, Condition("HookReporting", "True", "Reporting",
                                                   f"all {len(mine)} stage(s) report", observed_generation=gen),
                                  view.now)
        conds = set_condition(conds, Condition(
            "Profiled", "True" if mine and len(profiled) == len(mine) else "False",
            "Profiled" if mine and len(profiled) == len(mine) else "Profiling",
            f"{len(profiled)} of {len(mine)} stage(s) profiled", observed_generation=gen), view.now)
        differ = [f"spec.{what} is {want}, the hook reports {', '.join(map(str, sorted(got)))}"
                  for what, want, got in (
                      ("stages", tr.stages, {s.cycle.stages for s in profiled if s.cycle}),
                      ("microbatches", tr.microbatches, {s.cycle.microbatches for s in profiled if s.cycle}))
                  if want is not None and got and got != {want}]
        if profiled and (tr.stages is not None or tr.microbatches is not None
                         or any(c.get("type") == "SpecMatches" for c in conds)):
            # Said, not acted on: the hook's figures are what the bubbles were measured with.
            conds = set_condition(conds, Condition(
                "SpecMatches", "False" if differ else "True", "Differs" if differ else "Matches",
                "; ".join(differ) + " (the hook's are used: fix the spec or the selector)" if differ
                else "the hook reports what the spec says", observed_generation=gen), view.now)
        told = sorted((s for s in mine if s.training_membership), key=lambda s: (s.stage, s.pod))
        outside = [s for s in told if s.training_membership != MPS_CLIENT]
        had = any(c.get("type") == "MpsClient" for c in conds)
        said: Condition | None = None
        # Said, never acted on: the fill jobs' own isolation holds either way; what the training loses outside MPS is
        # concurrency (its kernels time-slice with the fill jobs' instead of running beside them). True only when every
        # profiled stage is known to be a client; a partial view (a stage restarted, not checked again yet) changes
        # nothing; nothing known at all (isolation no longer mps) says Unknown where something was said before.
        if outside:
            # The first stage's words in full, the others named (the status has room for one message, not many).
            first, more = outside[0], [f"{s.stage} ({s.pod} on {s.node})" for s in outside[1:]]
            text = f"stage {first.stage} ({first.pod} on {first.node}): {first.training_membership}" + (
                f"; likewise stage(s) {', '.join(more[:20])}" + (f" and {len(more) - 20} more" if len(more) > 20
                                                                 else "") if more else "")
            said = Condition("MpsClient", "False", "NotMpsClient", text, observed_generation=gen)
        elif profiled and all(s.training_membership == MPS_CLIENT for s in profiled):
            said = Condition("MpsClient", "True", "MpsClient", f"the training's process on every profiled stage "
                             f"({len(profiled)}) is a client of its node's MPS server", observed_generation=gen)
        elif not told and had:
            said = Condition("MpsClient", "Unknown", "NotChecked", "no stage's training process has been checked "
                             "against its node's MPS server (the agents do not run mps isolation, or the check is "
                             "under way)", observed_generation=gen)
        if said is not None:
            conds = set_condition(conds, said, view.now)
        if profiled:
            bubble = sum(s.cycle.bubble_s for s in profiled if s.cycle)
            it = sum(s.cycle.iteration_s for s in profiled if s.cycle)
            status["bubbleRatio"] = round(bubble / it, 4) if it else 0.0
            status["iterationSeconds"] = sum(s.baseline_iteration_s or s.cycle.iteration_s
                                             for s in profiled if s.cycle) / len(profiled)
        harvesting = [s for s in profiled if s.iteration_s]
        if harvesting:
            status["iterationSecondsHarvesting"] = sum(s.iteration_s or 0.0 for s in harvesting) / len(harvesting)
            base = status.get("iterationSeconds") or 0.0
            slowdown = status["iterationSecondsHarvesting"] / base - 1 if base else 0.0
            status["slowdown"] = round(slowdown, 5)
            status["slowdownText"] = f"{slowdown:+.2%} of {tr.slowdown_budget:.2%}"
            over = slowdown > tr.slowdown_budget
            conds = set_condition(conds, Condition(
                "BudgetExceeded", "True" if over else "False", "OverBudget" if over else "WithinBudget",
                f"harvesting slows the training by {slowdown:+.2%}; the budget is {tr.slowdown_budget:.2%}",
                observed_generation=gen), view.now)
        bubble_total = sum(s.bubble_s for s in mine)
        if bubble_total > 0:
            status["shareFilled"] = round(sum(s.filled_s for s in mine) / bubble_total, 4)
        status["fillJobs"] = placed_on.get(tkey, 0)
        status["conditions"] = conds
        status["observedGeneration"] = gen
        if status != before:
            out.training_status[tkey] = status




def _invalid_training_statuses(view: ClusterView, out: Decisions, invalid: Mapping[str, str]) -> None:
    """A PipelineTraining the operator cannot read says why in its status, with one Warning Event per new reason."""
    by_key = {key_of(t): t for t in view.trainings}
    for tkey, why in invalid.items():
        obj = by_key[tkey]
        meta = obj.get("metadata") or {}
        before = _status(obj)
        message = (f"invalid spec: {why}; it selects no Pod until it is fixed (kubectl edit pt {meta.get('name')} "
                   f"-n {meta.get('namespace')})")
        # Only this condition: what was measured or said under an earlier, valid spec no longer holds.
        conds = set_condition([c for c in before.get("conditions") or () if c.get("type") == "Admitted"], Condition(
            ConditionType.ADMITTED.value, "False", "InvalidSpec", message,
            observed_generation=int(meta.get("generation") or 1)), view.now)
        status = {"conditions": conds, "observedGeneration": int(meta.get("generation") or 1)}
        if status != before:
            out.training_status[tkey] = status
        if _condition(before, ConditionType.ADMITTED).get("message") != message:
            out.events.append(Event("PipelineTraining", str(meta.get("namespace", "")), str(meta.get("name", "")),
                                    str(meta.get("uid", "")), "Warning", "InvalidSpec", message))
