"""What the operator sees (``ClusterView``, ``GpuView``, ``FillPodSettings``) and what it decides (``Decisions``,
grouped by FillJob: ``FillJobDecisions``; ``Assignment``; ``Event``)."""

from __future__ import annotations

import datetime as dt
import math
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import PurePosixPath
from typing import Any

from bubbles.core import mps_client
from bubbles.core.api import FillJobSpec
from bubbles.core.cycle import BubbleCycle
from bubbles.core.identity import GpuKey
from bubbles.core.nodeaccess import GpuAccess, NodeAccess
from bubbles.core.paths import MOUNTED_RUN_DIR
from bubbles.core.resources import JobProgress
from bubbles.core.resources.schema import DNS_NAME_PATTERN

# Where the fill Pod finds the node agent's sockets: its own CSI volume (NodeAccess.CSI), or directories of the node's
# run directory (NodeAccess.HOST_PATH).
RUN_DIR = str(MOUNTED_RUN_DIR)
# The UID fill Pods run as where they reach the agent through their CSI volume: non-root, as Pod Security restricted
# wants, and no one's in particular (distroless images' "nonroot"); the agent's UID no longer matters to them.
DEFAULT_FILL_RUN_AS_USER = 65532
# A fill job whose step time is not given is planned with this until the agent measures it.
PROVISIONAL_STEP_S = 1e-3

# -- what the operator sees ------------------------------------------------------------------------------
# A replica's first seconds of reconciling: a placed job whose training Pod it has not seen is left as it is, not
# evicted (its watches list the cluster as it starts; without the grace a restarted operator would evict and
# re-place a running job whose Pod was listed after its FillJob).
STARTUP_GRACE_S = 10.0

@dataclass(frozen=True)
class GpuView:
    """One harvested GPU (a rank of a pipeline stage) of one training Pod: the Pod from the API server, the GPU's
    bubbles from its node's agent (one ``StageReport`` each). A Pod that runs several stages or ranks is several of
    these; a Pod no agent reports a GPU of yet is one with ``stage`` -1 (``reported`` False), so that its training's
    status can say why."""

    training: str  # "namespace/name" of the PipelineTraining
    stage: int  # -1: the Pod's GPUs are not reported (yet)
    pod: str
    pod_uid: str
    node: str
    device: str
    cycle: BubbleCycle | None = None  # None until the hook has profiled the GPU (or after the Pod restarted)
    agent_up: bool = True
    hook_reporting: bool = False
    iteration_s: float | None = None  # latest iteration time while harvesting
    baseline_iteration_s: float | None = None  # the guard's baseline (no fill work)
    bubble_s: float = 0.0  # bubble time seen so far while harvesting
    filled_s: float = 0.0  # fill-step time inside those bubbles
    gpu_uuid: str | None = None  # the GPU's UUID, when the agent knows it (NVML)
    # The extended resource that is this GPU (nodeaccess.resource_name), where the node's agent serves its device
    # plugin (StageReport.gpu_resource); "" where it does not.
    gpu_resource: str = ""
    training_membership: str = ""  # under MPS: "client", "not a client: ..." (resources.StageReport), or unknown ""
    tolerations: tuple[Mapping[str, Any], ...] = ()  # the training Pod's: it runs on the node, so they fit its taints
    rank: int = 0  # its index among its stage's ranks (identity.GpuKey)
    ranks: int = 1  # how many ranks the stage has, as its hook reports

    @property
    def reported(self) -> bool:
        return self.stage >= 0

    def same_for_jobs(self, other: GpuView) -> bool:
        """Whether a FillJob placed on this GPU is decided alike on ``other``: every field equal but the training's
        figures (``FIGURES``), which only its PipelineTraining's status reads (they move with every report)."""
        return self is other or all(getattr(self, f) == getattr(other, f) for f in _DECIDING_FIELDS)

    @property
    def key(self) -> GpuKey:
        """Which GPU it is; ValueError for a Pod whose GPUs are not reported (``reported`` False). Made once per view
        (a key checks its parts as it is made, and a round asks each GPU's many times)."""
        key: GpuKey | None = self.__dict__.get("_key")
        if key is None:
            namespace, _, name = self.training.partition("/")
            key = GpuKey(namespace, name, self.stage, self.rank)
            object.__setattr__(self, "_key", key)  # not a field: neither compared nor copied by replace()
        return key

    @property
    def where(self) -> str:
        """The GPU in words, for statuses and Events: "ml/llama stage 0 rank 1"."""
        return f"{self.training} stage {self.stage} rank {self.rank}"


# A GpuView's figures of the training on it, which no FillJob's decision reads (GpuView.same_for_jobs).
FIGURES = frozenset({"iteration_s", "baseline_iteration_s", "bubble_s", "filled_s", "training_membership"})
_DECIDING_FIELDS = tuple(f.name for f in fields(GpuView) if f.name not in FIGURES)


@dataclass(frozen=True)
class ClusterView:
    now: dt.datetime
    fill_jobs: Sequence[Mapping[str, Any]]  # FillJob objects as the API server has them (with status)
    trainings: Sequence[Mapping[str, Any]]  # PipelineTraining objects
    gpus: Sequence[GpuView]  # every harvested GPU of every selected training Pod, and the Pods not reported yet
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
    # Tolerations every fill Pod gets beside its training Pod's (the chart's operator.fillPodTolerations).
    tolerations: tuple[Mapping[str, Any], ...] = ()
    # The RuntimeClass every fill Pod runs with unless its FillJob names one (the chart's
    # operator.fillRuntimeClassName): where the NVIDIA container runtime is beside the node's default one (GPU Operator
    # with CDI, k3s).
    runtime_class: str | None = None
    # How fill Pods reach the agent's sockets: their own CSI volume (no hostPath, any UID: Pod Security restricted), or
    # the node's run directory by hostPath as the agent's UID (run_as_user, run_as_group: Pod Security privileged).
    node_access: NodeAccess = NodeAccess.CSI
    # How a fill Pod gets its GPU(s): by requesting each one's extended resource from the agent's device plugin (the
    # kubelet applies it), or NVIDIA_VISIBLE_DEVICES=<UUID> (only where the NVIDIA runtime honours it).
    gpu_access: GpuAccess = GpuAccess.DEVICE_PLUGIN
    # The UID (and group, and fsGroup for claims) fill Pods run as in csi mode; not root. Under MPS it must be the
    # trainings' UID: an MPS server serves one UID (the chart passes agent.runAsUser there).
    fill_run_as_user: int = DEFAULT_FILL_RUN_AS_USER

    def __post_init__(self) -> None:
        for what, enum_type, flag in (("node_access", NodeAccess, "--node-access"),
                                      ("gpu_access", GpuAccess, "--fill-gpu-access")):
            value = getattr(self, what)
            try:
                object.__setattr__(self, what, enum_type(value))
            except ValueError:
                raise ValueError(f"{flag} must be one of {', '.join(m.value for m in enum_type)}, got "
                                 f"{value!r}") from None
        if isinstance(self.fill_run_as_user, bool) or not isinstance(self.fill_run_as_user, int) \
                or self.fill_run_as_user < 1:
            raise ValueError(f"fill Pods' UID (--fill-run-as-user) must be a whole number of 1 or more, got "
                             f"{self.fill_run_as_user!r}: Pod Security restricted refuses root (e.g. 65532)")
        for i, t in enumerate(self.tolerations):
            check_toleration(t, f"fill Pod toleration {i}")
        if self.runtime_class is not None and (len(self.runtime_class) > 253
                                               or not re.match(DNS_NAME_PATTERN, self.runtime_class)):
            raise ValueError(f"the fill Pods' RuntimeClass {self.runtime_class!r} is not a RuntimeClass name "
                             "(lower-case letters, digits, '-' and '.', at most 253), e.g. nvidia")
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


TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def check_toleration(t: Any, where: str) -> None:
    """ValueError saying what is wrong unless ``t`` is a Pod toleration as the API server accepts it."""
    if not isinstance(t, Mapping) or not t:
        raise ValueError(f"{where} must be an object like {{key: nvidia.com/gpu, operator: Exists, effect: "
                         f"NoSchedule}}, got {t!r}")
    if unknown := sorted(set(t) - TOLERATION_KEYS):
        raise ValueError(f"{where} has field(s) {', '.join(unknown)}; a toleration has "
                         f"{', '.join(sorted(TOLERATION_KEYS))}")
    op = t.get("operator", "Equal")
    if op not in ("Exists", "Equal"):
        raise ValueError(f"{where}: operator must be Exists or Equal, got {op!r}")
    if op == "Exists" and t.get("value"):
        raise ValueError(f"{where}: operator Exists takes no value")
    if not t.get("key") and op != "Exists":
        raise ValueError(f"{where}: a toleration without a key must have operator Exists (it tolerates every taint)")
    if t.get("effect", "") not in ("", *TAINT_EFFECTS):
        raise ValueError(f"{where}: effect must be one of {', '.join(TAINT_EFFECTS)} (or empty: all), got "
                         f"{t.get('effect')!r}")
    secs = t.get("tolerationSeconds")
    if secs is not None and (not isinstance(secs, int) or isinstance(secs, bool) or t.get("effect") != "NoExecute"):
        raise ValueError(f"{where}: tolerationSeconds must be a whole number of seconds, with effect NoExecute")
    for k in ("key", "value"):
        if t.get(k) is not None and not isinstance(t[k], str):
            raise ValueError(f"{where}: {k} must be a string, got {t[k]!r}")


# -- what it decides ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """A FillJob placed on GPUs of one stage of one training Pod (``ranks``: one for a single-GPU job, N for a gang):
    what the agent on ``node`` is told, and what the fill Pod is given."""

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
    gpu_uuid: str | None = None  # the UUID of the GPU of ranks[0]
    job: FillJobSpec | None = field(default=None, compare=False)  # what the agent plans and drives
    slowdown_budget: float | None = None  # the PipelineTraining's limits, for the agent's slowdown guard
    max_fill_share: float | None = None
    tail_risk: float | None = None  # and for the fill processes' steps past a bubble's predicted end
    tolerations: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)  # the training Pod's
    # The stage's ranks (GpuKey.rank) the job's processes run on, one per process, in order: one for a single-GPU
    # job, spec.gpus for a gang (its process i on ranks[i]).
    ranks: tuple[int, ...] = (0,)
    # Every rank's GPU UUID, in ranks' order, where the agent knows them all (else (): the Pod sees no GPU); a
    # single-GPU job may leave it out and give gpu_uuid alone.
    gpu_uuids: tuple[str, ...] = ()
    # Every rank's GPU resource (GpuView.gpu_resource), in ranks' order, where the agent reports them all (else ()).
    gpu_resources: tuple[str, ...] = ()

    @property
    def uuids(self) -> tuple[str, ...]:
        """The UUIDs of the GPUs its processes run on, in ranks' order; () where any is unknown."""
        if self.gpu_uuids:
            return self.gpu_uuids
        return (self.gpu_uuid,) if self.gpu_uuid and len(self.ranks) == 1 else ()

    @property
    def gpu_keys(self) -> tuple[GpuKey, ...]:
        namespace, _, name = self.training.partition("/")
        return tuple(GpuKey(namespace, name, self.stage, r) for r in self.ranks)


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
class FillJobDecisions:
    """What is decided for one FillJob this round; the shell carries it out in one order (its Pod deleted, its run
    cancelled, finalizer and Pod, assignment, status, finalizer released)."""

    uid: str  # the FillJob decided on (one re-created under its name since is another)
    status: dict[str, Any] | None = None  # the whole status, where it changed
    create_pod: dict[str, Any] | None = None
    delete_pods: list[tuple[str, str]] = field(default_factory=list)  # (namespace, name)
    cancel_on: str | None = None  # the node whose agent lets go of the job's run
    assignment: Assignment | None = None  # what that node's agent is told
    add_finalizer: bool = False  # the job now holds resources
    remove_finalizer: bool = False  # deleted, its clean-up done

    @property
    def writes(self) -> bool:
        """Whether the round writes anything to the API for the job (a cancellation is a call to its agent)."""
        return (self.status is not None or self.create_pod is not None or bool(self.delete_pods)
                or self.assignment is not None or self.add_finalizer or self.remove_finalizer)


@dataclass
class Decisions:
    """Every decision of one round: by FillJob ("namespace/name"), by PipelineTraining, and the Events in the order
    they were decided. The flat views (``create_pods``, ``assign``...) list one kind across FillJobs in that order."""

    fill_jobs: dict[str, FillJobDecisions] = field(default_factory=dict)
    training_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    _taken: list[tuple[str, str, Any]] = field(default_factory=list)  # (kind, FillJob key, what) in decided order

    def _job(self, kind: str, key: str, uid: str, what: Any) -> FillJobDecisions:
        self._taken.append((kind, key, what))
        return self.fill_jobs.setdefault(key, FillJobDecisions(uid))

    def write_status(self, key: str, uid: str, status: dict[str, Any]) -> None:
        self._job("status", key, uid, status).status = status

    def create_pod(self, key: str, uid: str, pod: dict[str, Any]) -> None:
        self._job("create_pod", key, uid, pod).create_pod = pod

    def delete_pod(self, key: str, uid: str, namespace: str, name: str) -> None:
        self._job("delete_pod", key, uid, (namespace, name)).delete_pods.append((namespace, name))

    def cancel_run(self, key: str, uid: str, node: str) -> None:
        self._job("cancel", key, uid, (node, uid)).cancel_on = node

    def assign_job(self, key: str, uid: str, assignment: Assignment) -> None:
        self._job("assign", key, uid, assignment).assignment = assignment

    def hold(self, key: str, uid: str) -> None:
        """The job now holds resources: its finalizer is added."""
        self._job("add_finalizer", key, uid, key).add_finalizer = True

    def release(self, key: str, uid: str) -> None:
        """The deleted job's clean-up is done: its finalizer is removed."""
        self._job("remove_finalizer", key, uid, key).remove_finalizer = True

    def position(self) -> tuple[int, int]:
        """How many decisions and Events are taken so far (``since``'s argument)."""
        return len(self._taken), len(self.events)

    def since(self, position: tuple[int, int]) -> tuple[list[tuple[str, str, Any]], list[Event]]:
        """What was decided after ``position``: (kind, FillJob key, what) in decided order, and the Events."""
        return self._taken[position[0]:], self.events[position[1]:]

    def _all(self, kind: str) -> Iterator[tuple[str, Any]]:
        return ((key, what) for k, key, what in self._taken if k == kind)

    @property
    def fill_job_status(self) -> dict[str, dict[str, Any]]:
        """"namespace/name" -> whole status, of every FillJob whose status changed."""
        return dict(self._all("status"))

    @property
    def create_pods(self) -> list[dict[str, Any]]:
        return [pod for _, pod in self._all("create_pod")]

    @property
    def delete_pods(self) -> list[tuple[str, str]]:
        """(namespace, name) of the fill Pods to delete."""
        return [pod for _, pod in self._all("delete_pod")]

    @property
    def assign(self) -> list[Assignment]:
        return [a for _, a in self._all("assign")]

    @property
    def cancel(self) -> list[tuple[str, str]]:
        """(node, FillJob uid) of the runs the agents let go of."""
        return [run for _, run in self._all("cancel")]

    @property
    def add_finalizer(self) -> list[str]:
        return [key for key, _ in self._all("add_finalizer")]

    @property
    def remove_finalizer(self) -> list[str]:
        return [key for key, _ in self._all("remove_finalizer")]


def key_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def gpu_context_bytes(view: ClusterView, gpu: GpuView) -> int:
    """The CUDA-context allowance the GPU's agent adds to a job's memory: on a GPU, outside MPS."""
    on_gpu = bool(gpu.gpu_uuid) or gpu.device.startswith("cuda")
    return view.cuda_context_bytes if on_gpu and view.fill_pods.mps_pipe_dir is None else 0


def gpus_by_key(gpus: Iterable[GpuView]) -> dict[GpuKey, GpuView]:
    """The reported GPUs by key. A key is one rank of one stage: should two Pods report it at once (a replaced Pod
    its agent still reports beside the new one), the one whose hook reports wins, then the Pod named first, so that
    every round picks the same."""
    out: dict[GpuKey, GpuView] = {}
    for g in sorted((g for g in gpus if g.reported), key=lambda g: (not g.hook_reporting, g.pod)):
        out.setdefault(g.key, g)
    return out
