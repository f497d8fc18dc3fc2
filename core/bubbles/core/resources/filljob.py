"""The ``FillJob`` resource: its spec's table, the fill Pod's reserved names and paths, the typed view
``FillJobResource`` (which maps onto the agent's ``bubbles.core.api.FillJobSpec``) and its status's table.
"""

from __future__ import annotations

import datetime as dt
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bubbles.core.api import (
    MAX_GPUS,
    MAX_INIT_TIMEOUT_S,
    FillInterface,
    FillJobSpec,
    WorkloadKind,
    check_init_timeout,
    parse_duration,
    parse_quantity,
    parse_spec,
)
from bubbles.core.identity import MAX_STAGES
from bubbles.core.paths import MOUNTED_RUN_DIR, is_plain_absolute

from .phases import FillJobPhase, conditions_field
from .schema import (
    DNS_LABEL_PATTERN,
    DNS_NAME_PATTERN,
    ENTRY_PATTERN,
    ENV_NAME_PATTERN,
    IMAGE_PATTERN,
    Field,
    ResourceError,
    label_selector_field,
    parse_cpu,
    valid_spec,
)

# The fill Pod's own volumes and the container paths they are mounted at (bubbles.operator.decide.fill_pod): a job's
# spec.volumes may not take their names, and neither its volumes nor its checkpoint may lie in those paths (the agent's
# sockets, the MPS server's shared memory) or in the container's system trees.
RUNTIME_VOLUMES = ("bubbles-attach", "bubbles-fills", "mps-pipe", "mps-shm", "checkpoint")
RUNTIME_PATHS = (str(MOUNTED_RUN_DIR), "/dev", "/proc", "/sys")
VOLUME_SOURCES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir")
# Variables the fill Pod's runtime is given by the operator (and the CUDA driver and NVIDIA's runtime read): a job's
# own env may not set them.
RESERVED_ENV_PREFIXES = ("BUBBLES_", "CUDA_", "NVIDIA_")


def _pod_resources(name: str, description: str) -> Field:
    return Field(name, "object", description, fields=(
        Field("cpu", "cpu", "CPU: cores or millicores, e.g. 2 or 500m"),
        Field("memory", "quantity", "host memory, e.g. 4Gi"),
    ))


def _key_ref(name: str, what: str) -> Field:
    return Field(name, "object", f"a key of a {what} in the FillJob's namespace", fields=(
        Field("name", "string", f"the {what}'s name", required=True, max_length=253, pattern=DNS_NAME_PATTERN),
        Field("key", "string", "the key", required=True, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$"),
        Field("optional", "boolean", f"start the Pod even if the {what} or its key is missing"),
    ))


# Rules across the spec's fields (CEL, at the spec's level): what the structural schema cannot say.
FILL_JOB_RULES: tuple[tuple[str, str], ...] = (
    ("has(self.entry) != has(self.command)",
     "give entry (module:Class of an IterativeFillJob) or command (an argv for an imperative job): one of them"),
    ("!has(self.command) || (has(self.interface) && self.interface == 'imperative')",
     "command is for imperative jobs: set interface: imperative, or use entry"),
)

FILL_JOB_SPEC: tuple[Field, ...] = (
    Field("image", "string", "container image of the fill job, with the bubbles SDK installed", required=True,
          pattern=IMAGE_PATTERN, max_length=512),
    Field("entry", "string", "the job's class as module:Class (an IterativeFillJob or ImperativeFillJob); "
          "the image runs it with the bubbles runtime", pattern=ENTRY_PATTERN, max_length=256),
    Field("command", "array", "argv of an imperative job run as a plain program (instead of entry)",
          min_items=1, items=Field("arg", "string", "one argument", max_length=4096)),
    Field("args", "object", "keyword arguments for the job's class (plain JSON)", free_form=True),
    Field("kind", "string", "what the job does", enum=tuple(k.value for k in WorkloadKind),
          default=WorkloadKind.TRAINING.value),
    Field("interface", "string", "how the job is paused between bubbles: iterative (steps gated by bubble "
          "signals; required on GPUs) or imperative (frozen and thawed)", enum=tuple(i.value for i in FillInterface),
          default=FillInterface.ITERATIVE.value),
    Field("profile", "object", "what one step costs; fields left out are measured on the first run", fields=(
        Field("stepTime", "duration", "time of one step on the target GPU, e.g. 2ms"),
        Field("memory", "quantity", "accelerator memory the job may use, a hard limit (e.g. 4Gi); required "
              "on GPUs", required=True),
        Field("flopsPerStep", "number", "FLOPs of one step, counted for each step whose job reports none itself (a "
              "step() that returns None): in the FillJob's recoveredFlops and the node agent's metrics", minimum=0),
        Field("initTime", "timeout", "how long the job takes from its placement to its first step (its Pod "
              "starting, its image pulled, init() loading its model and data), e.g. 3m: its ETA and the scheduler "
              "count it, as its stage is held meanwhile. Left out: none counted"),
    ), required=True),
    Field("work", "object", "how much work the job does; it succeeds when done", fields=(
        Field("steps", "integer", "steps to run", minimum=1),
        Field("samples", "integer", "samples to process (with samplesPerStep)", minimum=1),
        Field("samplesPerStep", "integer", "samples one step processes (its batch size)", minimum=1),
    ), one_of=(("steps", "samples"),), required=True,
       rules=(("!has(self.samples) || has(self.samplesPerStep)",
               "samples needs samplesPerStep (the job's batch size)"),)),
    Field("priority", "integer", "higher runs first among queued jobs", default=0, minimum=-1000, maximum=1000),
    Field("deadline", "string", "finish by this time (RFC 3339, e.g. 2026-11-24T08:00:00Z); the status says "
          "whether the current plan meets it", pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$"),
    label_selector_field("trainingSelector", "which PipelineTrainings' bubbles the job may use (labels of the "
                         "PipelineTraining objects); empty or left out: any"),
    Field("stage", "integer", "the pipeline stage whose GPUs the job may use (0-based), e.g. the one with the "
          "longest bubbles or the most free memory; left out: any stage. A stage the training does not have keeps "
          "the job queued, saying so", minimum=0, maximum=MAX_STAGES - 1),
    Field("gpus", "integer", "GPUs the job runs on together, one process each (a gang): GPUs of one stage of one "
          "training in one Pod on one node, placed, started, paused and stopped together, in the bubbles they all "
          "share. Every process takes each step (work.steps counts the gang's steps; profile is one process's). "
          "More than any stage has on a node keeps the job queued, saying so", default=1, minimum=1,
          maximum=MAX_GPUS),
    Field("runtimeClassName", "string", "the RuntimeClass the job's Pod runs with (e.g. nvidia, where the NVIDIA "
          "container runtime is not the node's default one); left out: the chart's operator.fillRuntimeClassName, else "
          "the node's default runtime", max_length=253, pattern=DNS_NAME_PATTERN),
    Field("checkpoint", "object", "where the job keeps its state to resume after a preemption", fields=(
        Field("path", "string", "the directory inside the fill job's Pod where the SDK keeps the job's state "
              "(checkpoint() on stop, restore() at start)", required=True, max_length=1024, pattern=r"^/"),
        Field("claimName", "string", "a PersistentVolumeClaim mounted at path, so the state outlives the Pod (left "
              "out: path must be storage the image or the node provides)", max_length=253,
              pattern=DNS_NAME_PATTERN),
    )),
    Field("initTimeout", "timeout", "how long the job's init (loading its model and data, before its first step) "
          "may take before the node agent kills it, more than 0 and at most 24h, e.g. 30m; left out: the agent's "
          "--init-timeout (the chart's agent.initTimeoutSeconds, default 600 s)"),
    Field("restartLimit", "integer", "how often the job is restarted before it fails, after a loss of its own (its "
          "Pod failed or did not start, its process stopped with an error, its node's agent or isolation was lost); "
          "losses the training causes (its Pod gone, replaced or restarted, its spec turned invalid) do not count, "
          "unless the job's process was already on the training's GPU (whose faults under MPS reach the training)",
          default=3, minimum=0, maximum=100),
    Field("env", "array", "environment variables of the fill job's container, as a container's env: a value, or "
          "valueFrom a key of a Secret or ConfigMap in the FillJob's namespace (credentials, where the data is). "
          "Names the runtime is given (BUBBLES_*, CUDA_*, NVIDIA_*) are refused", max_items=128,
          rules=(("self.all(e, self.exists_one(f, f.name == e.name))", "give each variable once"),),
          items=Field("variable", "object", "one variable", rules=(
              ("!(has(self.value) && has(self.valueFrom))", "give value or valueFrom, not both"),
              ("!self.name.startsWith('BUBBLES_') && !self.name.startsWith('CUDA_') "
               "&& !self.name.startsWith('NVIDIA_')",
               "names starting with BUBBLES_, CUDA_ or NVIDIA_ are the runtime's: choose another name")), fields=(
              Field("name", "string", "its name", required=True, max_length=253, pattern=ENV_NAME_PATTERN),
              Field("value", "string", "its value", max_length=32768),
              Field("valueFrom", "object", "where its value comes from: a Secret's or a ConfigMap's key only (not "
                    "fieldRef or resourceFieldRef)", fields=(
                  _key_ref("secretKeyRef", "Secret"), _key_ref("configMapKeyRef", "ConfigMap"),
              ), one_of=(("secretKeyRef", "configMapKeyRef"),)),
          ))),
    Field("imagePullSecrets", "array", "Secrets (in the FillJob's namespace) to pull spec.image from a private "
          "registry with", max_items=16, items=Field("secret", "object", "one Secret", fields=(
              Field("name", "string", "the Secret's name", required=True, max_length=253, pattern=DNS_NAME_PATTERN),
          ))),
    Field("volumes", "array", "the job's own volumes, each mounted in its Pod at mountPath: a PersistentVolumeClaim "
          "(the data it reads, where it writes results), a ConfigMap or a Secret in the FillJob's namespace, or an "
          "emptyDir for scratch space; one source each", max_items=16,
          rules=(("self.all(v, self.exists_one(w, w.name == v.name))", "give each volume a name of its own"),
                 ("self.all(v, self.exists_one(w, w.mountPath == v.mountPath))",
                  "mount each volume at a path of its own")),
          items=Field("volume", "object", "one volume and where the job sees it", fields=(
              Field("name", "string", "its name, unique in the job (a DNS label; not one of the runtime's: "
                    f"{', '.join(RUNTIME_VOLUMES)})", required=True, max_length=63, pattern=DNS_LABEL_PATTERN),
              Field("mountPath", "string", "where the job's container sees it: an absolute path, apart from the "
                    f"runtime's ({', '.join(RUNTIME_PATHS)})", required=True, max_length=1024, pattern=r"^/"),
              Field("subPath", "string", "a directory or file inside the volume to mount instead of its root "
                    "(relative, without '..')", max_length=1024, pattern=r"^[^/]"),
              Field("readOnly", "boolean", "mount it read-only (left out: read-write, as in Kubernetes)"),
              Field("persistentVolumeClaim", "object", "a PersistentVolumeClaim in the FillJob's namespace", fields=(
                  Field("claimName", "string", "the claim's name", required=True, max_length=253,
                        pattern=DNS_NAME_PATTERN),
                  Field("readOnly", "boolean", "attach the claim read-only"),
              )),
              Field("configMap", "object", "a ConfigMap in the FillJob's namespace, a file per key", fields=(
                  Field("name", "string", "the ConfigMap's name", required=True, max_length=253,
                        pattern=DNS_NAME_PATTERN),
                  Field("optional", "boolean", "start the Pod even if the ConfigMap is missing"),
              )),
              Field("secret", "object", "a Secret in the FillJob's namespace, a file per key", fields=(
                  Field("secretName", "string", "the Secret's name", required=True, max_length=253,
                        pattern=DNS_NAME_PATTERN),
                  Field("optional", "boolean", "start the Pod even if the Secret is missing"),
              )),
              Field("emptyDir", "object", "scratch space that lives as long as the Pod (each attempt starts empty)",
                    fields=(
                  Field("medium", "string", "where: the node's disk (\"\", left out) or its memory (Memory)",
                        enum=("", "Memory")),
                  Field("sizeLimit", "quantity", "the most it may hold, e.g. 10Gi (its Pod is evicted past it)"),
              )),
          ), one_of=(VOLUME_SOURCES,))),
    Field("resources", "object", "the fill Pod's own CPU and host memory, as a container's resources (its "
          "accelerator memory is profile.memory); needed where a ResourceQuota counts them. Left out: none, and the "
          "Pod is BestEffort, the first a node short of memory evicts", fields=(
              _pod_resources("requests", "what the Pod is scheduled with and counted against quotas"),
              _pod_resources("limits", "the most the Pod may use"),
          )),
)


# -- the paths a job's own storage may take in its container ---------------------------------------------------
def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (both plain absolute paths)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def checkpoint_path(path: str) -> str:
    """spec.checkpoint.path written plainly (``/ckpt/`` is ``/ckpt``): specs written before its checks stay valid."""
    return posixpath.normpath("/" + path.lstrip("/"))


def mount_path_problem(path: str, taken: Sequence[str] = RUNTIME_PATHS) -> str | None:
    """Why ``path`` cannot be where a fill job's own storage is in its container (None: it can): it must be absolute,
    written plainly, not the root, and outside every directory of ``taken`` (the runtime's)."""
    if not is_plain_absolute(path):
        return "must be an absolute path written without '.' or '..' parts or repeated or trailing slashes"
    if path == "/":
        return "cannot be the container's root"
    for t in taken:
        if inside(path, t):
            return (f"lies in {t}, which the fill runtime uses itself (the node agent's sockets, the MPS server's "
                    "shared memory, the container's system files): choose a path apart from it")
    return None


# -- the typed view --------------------------------------------------------------------------------------------
def _parse_time(text: str, where: str = "spec.deadline") -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:  # the schema's pattern admits dates that do not exist (2026-02-30)
        raise ResourceError(f"{where} {text!r} is not a valid time: {exc}") from None


@dataclass(frozen=True)
class FillJobResource:
    """A validated FillJob as the operator and the scheduler use it."""

    name: str
    namespace: str
    uid: str
    generation: int
    image: str
    job: FillJobSpec  # what the node agent runs (bubbles.core.api), with the same validation as a spec file
    priority: int
    steps: int  # work, in steps
    samples_per_step: int
    deadline: dt.datetime | None
    training_selector: dict[str, Any] = field(default_factory=dict)
    checkpoint_path: str | None = None
    checkpoint_claim: str | None = None
    restart_limit: int = 3
    labels: dict[str, str] = field(default_factory=dict)
    pod_resources: dict[str, dict[str, str]] = field(default_factory=dict)  # spec.resources, values as strings
    env: tuple[dict[str, Any], ...] = ()  # spec.env, as a container's
    image_pull_secrets: tuple[str, ...] = ()  # spec.imagePullSecrets' names
    volumes: tuple[dict[str, Any], ...] = ()  # spec.volumes, checked (names and paths apart from the runtime's)
    init_s: float = 0.0  # spec.profile.initTime: placement to first step, as the user expects it
    stage: int | None = None  # spec.stage: the one stage whose GPUs it may use (None: any)
    runtime_class: str | None = None  # spec.runtimeClassName: its Pod's RuntimeClass (None: the chart's, or none)

    @property
    def gpus(self) -> int:
        """spec.gpus: the GPUs of one stage it runs on together (1: a single-GPU job; more: a gang)."""
        return self.job.gpus

    @property
    def flops_per_step(self) -> float | None:
        """spec.profile.flopsPerStep, as the node agent gets it in the job's spec."""
        return self.job.flops_per_step

    def container_paths(self) -> list[tuple[str, str]]:
        """(field, path) of every path the job's own storage takes in its container: its volumes' mount paths and
        its checkpoint directory."""
        paths = [(f"spec.volumes[{i}].mountPath", str(v["mountPath"])) for i, v in enumerate(self.volumes)]
        return paths + ([("spec.checkpoint.path", self.checkpoint_path)] if self.checkpoint_path else [])

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> FillJobResource:
        """From a FillJob object (metadata + spec); ResourceError listing everything that is wrong."""
        meta = obj.get("metadata") or {}
        s = valid_spec(FILL_JOB_SPEC, obj)
        profile, work = s["profile"], s["work"]
        if s.get("entry") is None and s.get("command") is None:
            raise ResourceError("spec needs entry (module:Class of an IterativeFillJob) or command (an argv for an "
                                "imperative job)")
        spb = int(work.get("samplesPerStep") or 1)
        steps = int(work["steps"]) if work.get("steps") is not None else -(-int(work["samples"]) // spb)
        if work.get("samples") is not None and work.get("samplesPerStep") is None:
            raise ResourceError("spec.work.samples needs spec.work.samplesPerStep (the job's batch size)")
        agent_spec: dict[str, Any] = {
            "name": meta.get("name", ""), "interface": s["interface"], "kind": s["kind"],
            "args": s.get("args") or {}, "memory": profile["memory"], "steps": steps,
        }
        if s.get("entry") is not None:
            agent_spec["entry"] = s["entry"]
        if s.get("command") is not None:
            agent_spec["command"] = s["command"]
        if profile.get("stepTime") is not None:
            agent_spec["step_time"] = profile["stepTime"]
        if profile.get("flopsPerStep") is not None:
            agent_spec["flops_per_step"] = profile["flopsPerStep"]
        if s.get("gpus") is not None:
            agent_spec["gpus"] = s["gpus"]
        if s.get("initTimeout") is not None:
            try:
                check_init_timeout(parse_duration(s["initTimeout"], "spec.initTimeout", long=True), "spec.initTimeout")
            except ValueError as exc:
                raise ResourceError(str(exc)) from None
            agent_spec["init_timeout"] = s["initTimeout"]
        try:
            job = parse_spec(agent_spec, "spec")
        except ValueError as exc:
            raise ResourceError(str(exc)) from None
        init_s = 0.0
        if profile.get("initTime") is not None:
            try:
                init_s = parse_duration(profile["initTime"], "spec.profile.initTime", long=True)
            except ValueError as exc:
                raise ResourceError(str(exc)) from None
            if init_s > MAX_INIT_TIMEOUT_S:
                raise ResourceError(f"spec.profile.initTime must be at most a day (how long the job takes from its "
                                    f"placement to its first step), got {profile['initTime']}")
            if job.init_timeout_s is not None and init_s > job.init_timeout_s:
                raise ResourceError(f"spec.profile.initTime ({profile['initTime']}) is more than spec.initTimeout "
                                    f"({s['initTimeout']}): the node agent would kill the job before its init is "
                                    "expected to end; raise spec.initTimeout or lower spec.profile.initTime")
        if job.memory_bytes <= 0:
            raise ResourceError(f"spec.profile.memory must be more than 0, got {profile['memory']!r}: it is the job's "
                                "hard limit of accelerator memory (e.g. 4Gi)")
        pod_resources = {kind: {k: str(v) for k, v in (s.get("resources") or {}).get(kind, {}).items()
                                if v is not None}
                         for kind in ("requests", "limits") if (s.get("resources") or {}).get(kind)}
        for key, amount in (("cpu", parse_cpu), ("memory", lambda v: parse_quantity(v, "memory"))):
            req, lim = pod_resources.get("requests", {}).get(key), pod_resources.get("limits", {}).get(key)
            if req is not None and lim is not None and amount(req) > amount(lim):  # type: ignore[operator]
                raise ResourceError(f"spec.resources.requests.{key} ({req}) must not be more than "
                                    f"spec.resources.limits.{key} ({lim})")
        deadline = _parse_time(s["deadline"]) if s.get("deadline") else None
        env = tuple(dict(v) for v in s.get("env") or ())
        seen: set[str] = set()
        for i, v in enumerate(env):
            name = str(v.get("name"))
            if name.startswith(RESERVED_ENV_PREFIXES):
                raise ResourceError(f"spec.env[{i}].name {name!r}: names starting with "
                                    f"{', '.join(RESERVED_ENV_PREFIXES)} are the fill runtime's, set by the operator; "
                                    "choose another name")
            if name in seen:
                raise ResourceError(f"spec.env[{i}].name {name!r} is given twice; give each variable once")
            if v.get("value") is not None and v.get("valueFrom") is not None:
                raise ResourceError(f"spec.env[{i}] ({name}) has both value and valueFrom; give one")
            seen.add(name)
        volumes = _checked_volumes(s)
        return cls(
            name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")), uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation") or 1), image=s["image"], job=job, priority=int(s["priority"]),
            steps=steps, samples_per_step=spb,
            deadline=deadline, training_selector=dict(s.get("trainingSelector") or {}),
            checkpoint_path=checkpoint_path(s["checkpoint"]["path"]) if (s.get("checkpoint") or {}).get("path")
            else None,
            checkpoint_claim=(s.get("checkpoint") or {}).get("claimName"), restart_limit=int(s["restartLimit"]),
            labels=dict(meta.get("labels") or {}), pod_resources=pod_resources, env=env,
            image_pull_secrets=tuple(str(p["name"]) for p in s.get("imagePullSecrets") or ()), volumes=volumes,
            init_s=init_s, stage=int(s["stage"]) if s.get("stage") is not None else None,
            runtime_class=s.get("runtimeClassName") or None,
        )


def _checked_volumes(s: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """spec.volumes (the schema already checked), with what the schema cannot say: names apart from each other and
    from the runtime's volumes, mount paths (and the checkpoint's path) apart from each other and from the
    runtime's, sub-paths inside their volumes. ResourceError for the first that is not."""
    volumes = tuple(dict(v) for v in s.get("volumes") or ())
    checkpoint = s.get("checkpoint") or {}
    paths: dict[str, str] = {}  # path -> the field it is given in
    if checkpoint.get("path"):
        path = checkpoint_path(str(checkpoint["path"]))
        problem = mount_path_problem(path)
        if problem:
            raise ResourceError(f"spec.checkpoint.path {checkpoint['path']!r} {problem}")
        if checkpoint.get("claimName"):  # mounted there; without a claim it may lie in a volume of the job's
            paths[path] = "spec.checkpoint.path"
    names: set[str] = set()
    for i, v in enumerate(volumes):
        where, name, path = f"spec.volumes[{i}]", str(v["name"]), str(v["mountPath"])
        if name in RUNTIME_VOLUMES or re.fullmatch(r"bubbles-fills-[0-9]+", name):
            raise ResourceError(f"{where}.name {name!r} is the name of a volume the fill runtime mounts itself "
                                f"({', '.join(RUNTIME_VOLUMES)}, and a gang's bubbles-fills-<i>); choose another "
                                "name")
        if name in names:
            raise ResourceError(f"{where}.name {name!r} is given twice; give each volume a name of its own")
        names.add(name)
        problem = mount_path_problem(path)
        if problem:
            raise ResourceError(f"{where}.mountPath {path!r} {problem}")
        if path in paths:
            raise ResourceError(f"{where}.mountPath {path!r} is also {paths[path]}: mount each volume at a path of "
                                "its own")
        paths[path] = f"{where}.mountPath"
        sub = v.get("subPath")
        if sub is not None and ".." in sub.split("/"):  # absolute ones: refused by the schema's pattern
            raise ResourceError(f"{where}.subPath {sub!r} must be a path inside the volume: relative, without '..'")
    return volumes


# -- its status (written by the operator; declared in full so the API server prunes none of it) ----------------
FILL_JOB_STATUS: tuple[Field, ...] = (
    Field("phase", "string", "where the job is", enum=tuple(p.value for p in FillJobPhase)),
    Field("message", "string", "the latest reason, for people"),
    Field("observedGeneration", "integer", "the spec generation this status is for", minimum=0),
    Field("assignment", "object", "where the job runs: GPUs (ranks) of one stage of one training", fields=(
        Field("training", "string", "the PipelineTraining whose bubbles it fills"),
        Field("stage", "integer", "the pipeline stage", minimum=0),
        Field("ranks", "array", "the stage's ranks (GPUs) its processes run on, one per process", max_items=4096,
              items=Field("rank", "integer", "a rank's index among its stage's ranks", minimum=0)),
        Field("gpuUUIDs", "array", "those GPUs' UUIDs, where their agent knows them (NVML)", max_items=4096,
              items=Field("uuid", "string", "a GPU's UUID, e.g. GPU-5b7c...", max_length=128)),
        Field("node", "string", "the node"),
        Field("device", "string", "the device, e.g. cuda:0"),
        Field("pod", "string", "the fill job's Pod"),
        Field("trainingPod", "string", "the training's Pod whose bubbles it fills"),
        Field("trainingPodUid", "string", "that Pod's uid: a new Pod under the same name is another training process"),
        Field("placedAt", "string", "when it was placed (RFC 3339): the ETA counts what is left of "
              "spec.profile.initTime from then until the job runs"),
    )),
    Field("progress", "object", "how much of its work is done", fields=(
        Field("stepsDone", "integer", "steps completed", minimum=0),
        Field("stepsTotal", "integer", "steps to do", minimum=0),
        Field("percent", "number", "share done, 0-100", minimum=0, maximum=100),
    )),
    Field("progressText", "string", "progress for kubectl's columns, e.g. 40% (400/1000)"),
    Field("eta", "string", "when the job is expected to finish (RFC 3339)"),
    Field("deadlineFeasible", "boolean", "whether the expected finish meets spec.deadline"),
    Field("restarts", "integer", "restarts so far (the current attempt's number: its Pod's name ends a<N>); those "
          "the training caused (counters.trainingDisruptions) do not count against spec.restartLimit", minimum=0),
    Field("recoveredFlops", "number", "FLOPs of the steps done in bubbles", minimum=0),
    Field("queuePosition", "integer", "place in the queue while Queued (1: next)", minimum=0),
    Field("counters", "object", "events counted for this job", fields=(
        Field("kills", "integer", "steps killed for overrunning their bubble", minimum=0),
        Field("placements", "integer", "times the job was placed", minimum=0),
        Field("evictions", "integer", "times it lost its place (agent, node or training gone)", minimum=0),
        Field("trainingDisruptions", "integer", "of those, the training's doing (its Pod gone, replaced or "
              "restarted before the job was on its GPU, its spec turned invalid): not counted against "
              "spec.restartLimit", minimum=0),
    )),
    conditions_field(),
)
