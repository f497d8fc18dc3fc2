"""The custom resources users write (``FillJob``, ``PipelineTraining``, group ``bubbles.dev``), defined once.

Each resource's ``spec`` is a table of ``Field`` values. From that one table come the CRD's structural
OpenAPI schema (``openapi_schema``, used by ``bubbles.operator.crd`` to write ``crds/``), the operator's own
validation (``validate``: the same rules the API server enforces, for emulators and for messages that name
the field and the fix) and the defaults (``apply_defaults``). The typed views (``FillJobResource``,
``PipelineTrainingResource``) are built from a validated spec, and a FillJob maps onto the agent's
``bubbles.core.api.FillJobSpec``. Statuses use the phases, conditions and field names here, so the operator, the
CRDs' printer columns and the docs cannot drift apart. Pure: no Kubernetes client, no I/O.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bubbles.core.api import (
    DEFAULT_TAIL_RISK,
    MAX_INIT_TIMEOUT_S,
    MAX_TAIL_RISK,
    FillInterface,
    FillJobSpec,
    FillState,
    WorkloadKind,
    check_init_timeout,
    parse_duration,
    parse_quantity,
    parse_spec,
)
from bubbles.core.paths import MOUNTED_RUN_DIR, is_plain_absolute

GROUP = "bubbles.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = f"{GROUP}/fill-job-cleanup"

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|k)?$"
CPU_PATTERN = r"^[0-9]+(\.[0-9]+)?m?$"  # cores (2, 0.5) or millicores (500m)
DURATION_PATTERN = r"^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?(ns|us|µs|ms|s)?$"
TIMEOUT_PATTERN = r"^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?(ns|us|µs|ms|s|m|h)?$"  # also minutes and hours
ENTRY_PATTERN = r"^[\w.]+:[\w.]+$"
IMAGE_PATTERN = r"^[^\s]+$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # what Kubernetes accepts as an environment variable's name
DNS_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # a Secret's, a ConfigMap's, a claim's name
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a volume's name
# The fill Pod's own volumes and the container paths they are mounted at (bubbles.operator.decide.fill_pod): a job's
# spec.volumes may not take their names, and neither its volumes nor its checkpoint may lie in those paths (the agent's
# sockets, the MPS server's shared memory) or in the container's system trees.
RUNTIME_VOLUMES = ("bubbles-attach", "bubbles-fills", "mps-pipe", "mps-shm", "checkpoint")
RUNTIME_PATHS = (str(MOUNTED_RUN_DIR), "/dev", "/proc", "/sys")
VOLUME_SOURCES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir")
# Variables the fill Pod's runtime is given by the operator (and the CUDA driver and NVIDIA's runtime read): a job's
# own env may not set them.
RESERVED_ENV_PREFIXES = ("BUBBLES_", "CUDA_", "NVIDIA_")
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class FillJobPhase(enum.StrEnum):
    """``status.phase`` of a FillJob: where it is on its way through the cluster."""

    PENDING = "Pending"  # accepted, not yet validated against the cluster's trainings
    QUEUED = "Queued"  # valid, waiting for a bubble it fits
    PLACED = "Placed"  # assigned to (training, stage, node, device); its Pod is being created
    RUNNING = "Running"  # its fill process runs steps in the bubbles
    PAUSED = "Paused"  # placed and started, but its stage's training sends no bubble signals (HOOK_SILENCE_S)
    SUCCEEDED = "Succeeded"  # did all its work
    FAILED = "Failed"  # invalid, or out of restarts; the message says why

    @property
    def terminal(self) -> bool:
        return self in (FillJobPhase.SUCCEEDED, FillJobPhase.FAILED)


class ConditionType(enum.StrEnum):
    """Condition types of both resources, as Kubernetes' own APIs write them."""

    ADMITTED = "Admitted"
    PLACED = "Placed"
    RUNNING = "Running"
    EVICTED = "Evicted"
    FINISHED = "Finished"
    HOOK_REPORTING = "HookReporting"
    PROFILED = "Profiled"
    BUDGET_EXCEEDED = "BudgetExceeded"


@dataclass(frozen=True)
class Condition:
    """One entry of ``status.conditions`` (the shape of ``metav1.Condition``)."""

    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str  # CamelCase, machine-readable
    message: str  # for people: what happened and what to do
    last_transition_time: str = ""  # RFC 3339
    observed_generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message,
                "lastTransitionTime": self.last_transition_time, "observedGeneration": self.observed_generation}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Condition:
        return cls(str(d.get("type", "")), str(d.get("status", "Unknown")), str(d.get("reason", "")),
                   str(d.get("message", "")), str(d.get("lastTransitionTime", "")), int(d.get("observedGeneration", 0)))


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: Sequence[Mapping[str, Any]], new: Condition, now: dt.datetime) -> list[dict[str, Any]]:
    """``conditions`` with ``new`` in place of the one of its type; the transition time moves only when the
    status changes (as ``meta.SetStatusCondition`` does)."""
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions:
        if c.get("type") != new.type:
            out.append(dict(c))
            continue
        found = True
        old = Condition.from_dict(c)
        when = old.last_transition_time if old.status == new.status and old.last_transition_time else rfc3339(now)
        out.append(Condition(new.type, new.status, new.reason, new.message, when, new.observed_generation).to_dict())
    if not found:
        out.append(Condition(new.type, new.status, new.reason, new.message, rfc3339(now),
                             new.observed_generation).to_dict())
    return out


# -- the field tables --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field of a resource's spec: its schema, its checks and its default, in one place."""

    name: str
    type: str  # string | integer | number | boolean | object | array | quantity | cpu | duration | map
    description: str
    required: bool = False
    default: Any = None
    enum: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    items: Field | None = None  # for arrays
    fields: tuple[Field, ...] = ()  # for objects
    one_of: tuple[tuple[str, ...], ...] = ()  # for objects: exactly one of each group may be set
    free_form: bool = False  # objects: any JSON (x-kubernetes-preserve-unknown-fields)


def parse_cpu(value: Any) -> float | None:
    """Cores from a Kubernetes CPU quantity (``2``, ``0.5``, ``500m``); None if it is not one."""
    if isinstance(value, bool | float):  # the CRD takes an integer or a string, as Kubernetes does
        return None
    try:
        if isinstance(value, int):
            return float(value) if value >= 0 else None
        if isinstance(value, str) and re.match(CPU_PATTERN, value):
            return float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    except OverflowError:
        return None
    return None


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


def _label_selector(name: str, description: str, required: bool = False) -> Field:
    return Field(name, "object", description, required=required, fields=(
        Field("matchLabels", "map", "labels every selected object has (key: value)"),
        Field("matchExpressions", "array", "set-based requirements, as in any Kubernetes label selector",
              items=Field("requirement", "object", "one requirement", fields=(
                  Field("key", "string", "the label's key", required=True, pattern=LABEL_KEY_PATTERN),
                  Field("operator", "string", "how the values are matched", required=True,
                        enum=("In", "NotIn", "Exists", "DoesNotExist")),
                  Field("values", "array", "values for In and NotIn", items=Field("value", "string", "a value")),
              ))),
    ))


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
    ), one_of=(("steps", "samples"),), required=True),
    Field("priority", "integer", "higher runs first among queued jobs", default=0, minimum=-1000, maximum=1000),
    Field("deadline", "string", "finish by this time (RFC 3339, e.g. 2026-11-24T08:00:00Z); the status says "
          "whether the current plan meets it", pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$"),
    _label_selector("trainingSelector", "which PipelineTrainings' bubbles the job may use (labels of the "
                    "PipelineTraining objects); empty or left out: any"),
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
          items=Field("variable", "object", "one variable", fields=(
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

PIPELINE_TRAINING_SPEC: tuple[Field, ...] = (
    _label_selector("selector", "labels of the training's Pods (one Pod per pipeline stage and replica)",
                    required=True),
    Field("stages", "integer", "pipeline stages, as a check: the status says (condition SpecMatches) when the hook "
          "reports others; left out: what the hook reports", minimum=1, maximum=1024),
    Field("microbatches", "integer", "micro-batches per iteration, as a check like stages; left out: what the "
          "hook reports", minimum=1, maximum=65536),
    Field("slowdownBudget", "number", "training slowdown harvesting may cause (0.01 = 1%)", default=0.01,
          minimum=0.0001, maximum=0.5),
    Field("maxFillShare", "number", "the largest share of each bubble fill work may use", default=1.0,
          minimum=0.0, maximum=1.0),
    Field("memoryReserve", "quantity", "accelerator memory fill jobs never touch, on top of what the hook "
          "measured free", default="0"),
    Field("tailRisk", "number", "the most risk a fill step started past a bubble's predicted end may take of "
          "outliving the bubble (0: never start one); caps each fill job's own setting, applies to running fill "
          "jobs at once", default=DEFAULT_TAIL_RISK, minimum=0.0, maximum=MAX_TAIL_RISK),
)


# -- schema ------------------------------------------------------------------------------------------------
def openapi_schema(f: Field) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one field (what a Kubernetes 1.20 API server enforces: no CEL)."""
    s: dict[str, Any] = {"description": f.description}
    if f.type in ("string", "integer", "number", "boolean"):
        s["type"] = f.type
    elif f.type == "quantity":
        s.update({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN})
    elif f.type == "cpu":
        s.update({"x-kubernetes-int-or-string": True, "pattern": CPU_PATTERN})
    elif f.type == "duration":
        s.update({"type": "string", "pattern": DURATION_PATTERN})
    elif f.type == "timeout":
        s.update({"type": "string", "pattern": TIMEOUT_PATTERN})
    elif f.type == "map":
        s.update({"type": "object", "additionalProperties": {"type": "string"}})
    elif f.type == "array":
        s["type"] = "array"
        s["items"] = openapi_schema(f.items) if f.items else {"type": "string"}
    elif f.type == "object":
        s["type"] = "object"
        if f.free_form:
            s["x-kubernetes-preserve-unknown-fields"] = True
        else:
            s["properties"] = {c.name: openapi_schema(c) for c in f.fields}
            required = [c.name for c in f.fields if c.required]
            if required:
                s["required"] = required
    else:
        raise ValueError(f"unknown field type {f.type!r}")
    if f.enum:
        s["enum"] = list(f.enum)
    if f.minimum is not None:
        s["minimum"] = f.minimum
    if f.maximum is not None:
        s["maximum"] = f.maximum
    if f.pattern and "pattern" not in s:
        s["pattern"] = f.pattern
    if f.max_length is not None:
        s["maxLength"] = f.max_length
    if f.min_items is not None:
        s["minItems"] = f.min_items
    if f.max_items is not None:
        s["maxItems"] = f.max_items
    if f.default is not None:
        s["default"] = f.default
    return s


def spec_schema(fields: Sequence[Field], description: str) -> dict[str, Any]:
    return openapi_schema(Field("spec", "object", description, fields=tuple(fields)))


# -- validation and defaults ---------------------------------------------------------------------------------
class ResourceError(ValueError):
    """A resource the operator cannot act on; the message names the field and what to do."""


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


def _check(f: Field, value: Any, path: str, errors: list[str]) -> None:
    where = f"{path}"
    if f.type == "string":
        if not isinstance(value, str):
            errors.append(f"{where} must be a string, got {value!r}")
            return
        if f.max_length is not None and len(value) > f.max_length:
            errors.append(f"{where} must be at most {f.max_length} characters")
        if f.pattern and not re.match(f.pattern, value):
            errors.append(f"{where} {value!r} is not valid: {f.description}")
    elif f.type in ("integer", "number"):
        ok = isinstance(value, int) if f.type == "integer" else isinstance(value, int | float)
        if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
            errors.append(f"{where} must be {'an integer' if f.type == 'integer' else 'a number'}, got {value!r}")
            return
        if f.minimum is not None and value < f.minimum:
            errors.append(f"{where} must be >= {f.minimum:g}, got {value}")
        if f.maximum is not None and value > f.maximum:
            errors.append(f"{where} must be <= {f.maximum:g}, got {value}")
    elif f.type == "boolean":
        if not isinstance(value, bool):
            errors.append(f"{where} must be true or false, got {value!r}")
    elif f.type == "quantity":
        try:
            parse_quantity(value, where)
        except ValueError as exc:
            errors.append(str(exc))
    elif f.type == "cpu":
        if parse_cpu(value) is None:
            errors.append(f"{where} must be CPU cores or millicores like 2, 0.5 or 500m, got {value!r}")
    elif f.type in ("duration", "timeout"):
        try:
            parse_duration(value, where, long=f.type == "timeout")
        except ValueError as exc:
            errors.append(str(exc))
    elif f.type == "map":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            errors.append(f"{where} must be a map of strings to strings")
    elif f.type == "array":
        if not isinstance(value, list):
            errors.append(f"{where} must be a list, got {value!r}")
            return
        if f.min_items is not None and len(value) < f.min_items:
            errors.append(f"{where} must have at least {f.min_items} item(s)")
        if f.max_items is not None and len(value) > f.max_items:
            errors.append(f"{where} must have at most {f.max_items} item(s)")
        if f.items is not None:
            for i, v in enumerate(value):
                _check(f.items, v, f"{where}[{i}]", errors)
    elif f.type == "object":
        if not isinstance(value, dict):
            errors.append(f"{where} must be an object, got {value!r}")
            return
        if not f.free_form:
            _check_object(f.fields, f.one_of, value, where, errors)
    if f.enum and value not in f.enum:
        errors.append(f"{where} must be one of {', '.join(f.enum)}, got {value!r}")


def _check_object(fields: Sequence[Field], one_of: Sequence[tuple[str, ...]], value: Mapping[str, Any], path: str,
                  errors: list[str]) -> None:
    known = {f.name: f for f in fields}
    for name in value:
        if name not in known:
            errors.append(f"{path}.{name} is not a known field; known fields: {', '.join(known)}")
    for f in fields:
        if f.name in value and value[f.name] is not None:
            _check(f, value[f.name], f"{path}.{f.name}", errors)
        elif f.required:
            errors.append(f"{path}.{f.name} is required: {f.description}")
    for group in one_of:
        given = [n for n in group if value.get(n) is not None]
        if len(given) != 1:
            errors.append(f"{path} needs exactly one of {', '.join(group)}, got "
                          f"{', '.join(given) if given else 'none'}")


def validate(fields: Sequence[Field], spec: Any, path: str = "spec") -> list[str]:
    """Every rule of the table broken by ``spec`` (an empty list: valid)."""
    if not isinstance(spec, dict):
        return [f"{path} must be an object"]
    errors: list[str] = []
    _check_object(fields, (), spec, path, errors)
    return errors


def apply_defaults(fields: Sequence[Field], spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with every defaulted field that was left out filled in (as the API server would)."""
    out = dict(spec)
    for f in fields:
        if out.get(f.name) is None and f.default is not None:
            out[f.name] = f.default
        elif f.type == "object" and not f.free_form and isinstance(out.get(f.name), dict):
            out[f.name] = apply_defaults(f.fields, out[f.name])
    return out


def _valid_spec(fields: Sequence[Field], obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object's spec, checked against ``fields`` (ResourceError listing every problem) and defaulted."""
    errors = validate(fields, obj.get("spec"))
    if errors:
        raise ResourceError("; ".join(errors))
    return apply_defaults(fields, obj["spec"])


# -- label selectors -----------------------------------------------------------------------------------------
def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy a Kubernetes label selector (empty or None: everything)."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# -- typed views ---------------------------------------------------------------------------------------------
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
        s = _valid_spec(FILL_JOB_SPEC, obj)
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
            init_s=init_s,
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
        if name in RUNTIME_VOLUMES:
            raise ResourceError(f"{where}.name {name!r} is the name of a volume the fill runtime mounts itself "
                                f"({', '.join(RUNTIME_VOLUMES)}); choose another name")
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


@dataclass(frozen=True)
class PipelineTrainingResource:
    """A validated PipelineTraining."""

    name: str
    namespace: str
    uid: str
    generation: int
    selector: dict[str, Any]
    stages: int | None
    microbatches: int | None
    slowdown_budget: float
    max_fill_share: float
    memory_reserve_bytes: int
    labels: dict[str, str] = field(default_factory=dict)
    tail_risk: float = DEFAULT_TAIL_RISK

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PipelineTrainingResource:
        meta = obj.get("metadata") or {}
        s = _valid_spec(PIPELINE_TRAINING_SPEC, obj)
        if not (s.get("selector") or {}).get("matchLabels") and not (s.get("selector") or {}).get("matchExpressions"):
            raise ResourceError("spec.selector must select the training's Pods, e.g. matchLabels: {app: llama-70b}")
        return cls(
            name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")), uid=str(meta.get("uid", "")),
            generation=int(meta.get("generation") or 1), selector=dict(s["selector"]), stages=s.get("stages"),
            microbatches=s.get("microbatches"), slowdown_budget=float(s["slowdownBudget"]),
            max_fill_share=float(s["maxFillShare"]),
            memory_reserve_bytes=parse_quantity(s["memoryReserve"], "spec.memoryReserve"),
            labels=dict(meta.get("labels") or {}), tail_risk=float(s["tailRisk"]),
        )


# -- statuses (written by the operator; declared in full so the API server prunes none of it) ---------------
def _conditions() -> Field:
    return Field("conditions", "array", "the latest observations of the object's state", items=Field(
        "condition", "object", "one condition", fields=(
            Field("type", "string", "the condition's type, e.g. Placed", required=True, max_length=316),
            Field("status", "string", "True, False or Unknown", required=True, enum=("True", "False", "Unknown")),
            Field("reason", "string", "why, in one CamelCase word", required=True, max_length=1024),
            Field("message", "string", "why, for people", max_length=32768),
            Field("lastTransitionTime", "string", "when the status last changed (RFC 3339)"),
            Field("observedGeneration", "integer", "the generation the condition was set for", minimum=0),
        )))


FILL_JOB_STATUS: tuple[Field, ...] = (
    Field("phase", "string", "where the job is", enum=tuple(p.value for p in FillJobPhase)),
    Field("message", "string", "the latest reason, for people"),
    Field("observedGeneration", "integer", "the spec generation this status is for", minimum=0),
    Field("assignment", "object", "where the job runs", fields=(
        Field("training", "string", "the PipelineTraining whose bubbles it fills"),
        Field("stage", "integer", "the pipeline stage", minimum=0),
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
    _conditions(),
)

PIPELINE_TRAINING_STATUS: tuple[Field, ...] = (
    Field("observedGeneration", "integer", "the spec generation this status is for", minimum=0),
    Field("pods", "integer", "training Pods the selector matches", minimum=0),
    Field("stages", "array", "per pipeline stage and Pod: where it runs and its profiled bubbles", items=Field(
        "stage", "object", "one stage", fields=(
            Field("stage", "integer", "the stage's index", minimum=0),
            Field("pod", "string", "the training Pod"),
            Field("node", "string", "its node"),
            Field("device", "string", "its device"),
            Field("iterationSeconds", "number", "its profiled iteration time", minimum=0),
            Field("bubbleRatio", "number", "share of the iteration it idles", minimum=0, maximum=1),
            Field("bubbles", "array", "its profiled bubble cycle", items=Field("bubble", "object", "one bubble",
                  fields=(
                      Field("slot", "integer", "position in the cycle", minimum=0),
                      Field("durationSeconds", "number", "median length", minimum=0),
                      Field("freeBytes", "integer", "accelerator memory free in it", minimum=0),
                  ))),
        ))),
    Field("bubbleRatio", "number", "share of the training's GPU time spent in bubbles", minimum=0, maximum=1),
    Field("iterationSeconds", "number", "iteration time without harvesting", minimum=0),
    Field("iterationSecondsHarvesting", "number", "iteration time while fill jobs run", minimum=0),
    Field("slowdown", "number", "iteration time lost to harvesting (0.004 = 0.4%)"),
    Field("slowdownText", "string", "slowdown against the budget, for kubectl's columns"),
    Field("shareFilled", "number", "share of bubble time fill jobs used", minimum=0, maximum=1),
    Field("recoveredFlopsPerSecond", "number", "fill-job FLOP/s recovered from the bubbles", minimum=0),
    Field("fillJobs", "integer", "fill jobs placed on this training", minimum=0),
    _conditions(),
)


# -- what node agents report to the operator -------------------------------------------------------------------
# A stage whose hook has sent nothing for this long reports no hook (StageReport.hook_reporting False): its training
# stopped, evaluates or checkpoints, or hangs. A training hook sends several messages per iteration (each bubble's start
# and end), so a stage that trains is far from this silent.
HOOK_SILENCE_S = 30.0


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage of one training Pod on a node, as its agent sees it."""

    namespace: str
    training: str  # the PipelineTraining's name (the training's $BUBBLES_TRAINING)
    pod: str
    stage: int
    device: str
    cycle: dict[str, Any] | None = None  # BubbleCycle.to_dict() once the hook has profiled the stage
    hook_reporting: bool = False  # a hook message within HOOK_SILENCE_S
    iteration_s: float | None = None  # latest iteration time while harvesting
    baseline_iteration_s: float | None = None  # the slowdown guard's baseline (no fill work)
    bubble_s: float = 0.0
    filled_s: float = 0.0
    gpu_uuid: str | None = None  # the stage GPU's UUID (from NVML), what a fill Pod names to reach that GPU
    # Under MPS on a GPU, what the training's process is to the node's MPS server: "client", "not a client: ..." (what
    # that costs, what to do), or "" (not known: not checked yet, no MPS, or nothing the agent can tell)
    training_membership: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageReport:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class JobProgress:
    """What a node agent reports of one placed fill job (by its FillJob's uid)."""

    uid: str
    state: FillState
    steps_done: int = 0
    flops: float = 0.0
    reason: str = ""
    kills: int = 0
    attempt: int = 0  # the FillJob's status.restarts when this run was placed: older attempts' progress is stale

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "state": str(self.state)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobProgress:
        return cls(str(d["uid"]), FillState(d["state"]), int(d.get("steps_done", 0)), float(d.get("flops", 0.0)),
                   str(d.get("reason", "")), int(d.get("kills", 0)), int(d.get("attempt", 0)))


@dataclass(frozen=True)
class NodeReport:
    """Everything one node's agent tells the operator."""

    node: str
    stages: tuple[StageReport, ...] = ()
    jobs: tuple[JobProgress, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "stages": [s.to_dict() for s in self.stages],
                "jobs": [j.to_dict() for j in self.jobs]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeReport:
        return cls(str(d["node"]), tuple(StageReport.from_dict(s) for s in d.get("stages", ())),
                   tuple(JobProgress.from_dict(j) for j in d.get("jobs", ())))
