"""The types every side of bubbles shares, defined once: one enum per concept, the fill-job spec with its
validation, and the typed status the agent reports.

Inside the training (the hook, the SDK), on the node (the agent) and in the control plane (the operator,
the scheduler) these are the only spellings of a fill mode, an isolation mode, a life-cycle state or a
fill job. Pure: no I/O but ``load_spec``'s file read, no third-party imports but YAML in ``load_spec``.

A fill-job spec, as a file for ``bubbles agent --fill-job`` (and, next, a FillJob resource's ``spec``)::

    name: image-classification
    interface: iterative             # or imperative (how the job is paused between bubbles)
    kind: training                   # optional: training or batch-inference (what the job does)
    entry: bubbles.fill_examples.image_classification:ImageClassification
    args: {batch_size: 4}
    memory: 64Mi                     # bytes or a Kubernetes quantity; a hard limit, required on GPUs
    step_time: 1.5ms                 # optional; profiled in the first bubbles when absent
    steps: 1000                      # optional; the job finishes after that many steps
    nodes: [{duration: 1ms, memory: 32Mi}]   # optional: the step as a chain for the planner
    stage: 0                         # optional: which executor (pipeline stage) to harvest
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core.paths import check_name


class _Named:
    """Mixin for enums whose members are written as lower-case words (in YAML, JSON, flags and metric labels)."""

    name: str

    @property
    def label(self) -> str:
        value = getattr(self, "value", None)
        return value if isinstance(value, str) else self.name.lower()

    @classmethod
    def labels(cls) -> tuple[str, ...]:
        return tuple(m.label for m in cls)  # type: ignore[attr-defined]

    @classmethod
    def parse(cls, text: object, what: str) -> Any:
        """The member written ``text`` (case-insensitive); ValueError naming ``what`` and the choices."""
        if isinstance(text, cls):
            return text
        if isinstance(text, str):
            for m in cls:  # type: ignore[attr-defined]
                if m.label == text.strip().lower():
                    return m
        raise ValueError(f"{what} must be one of {', '.join(cls.labels())}, got {text!r}")


class FillMode(_Named, enum.IntEnum):
    """What the agent lets fill jobs do; the demo and the benchmarks switch it to compare in one run.

    The integer values are the wire protocol's (``bubbles.core.wire``'s FILL_MODE datagram)."""

    OFF = 0  # no fill work (the baseline)
    NAIVE = 1  # fill jobs run freely, ignoring bubbles (FreeRide's "Naive")
    HARVEST = 2  # fill steps only inside bubbles (the product)


class FillInterface(_Named, enum.StrEnum):
    """How a fill job is driven between bubbles (FreeRide's two programming interfaces)."""

    ITERATIVE = "iterative"  # the SDK runs one step at a time, each gated by a bubble (preferred; bounds GPU work)
    IMPERATIVE = "imperative"  # any program, frozen and thawed with SIGSTOP/SIGCONT


class WorkloadKind(_Named, enum.StrEnum):
    """What a fill job does (the scheduler's profiles and the FillJob resource use the same words)."""

    TRAINING = "training"
    BATCH_INFERENCE = "batch-inference"


class IsolationMode(_Named, enum.StrEnum):
    """How fill processes are kept apart from the training on a GPU (docs/gpu.md has the trade-offs)."""

    CONTEXTS = "contexts"  # separate CUDA contexts, time-sliced: a fault stays in its process (default)
    MPS = "mps"  # MPS clients: concurrent kernels and enforced memory limits, one fault domain
    NONE = "none"  # explicit unisolated sharing


class IsolationState(_Named, enum.StrEnum):
    """The health of the chosen isolation, as the agent acts on it (it fails closed)."""

    READY = "ready"  # isolation works: fill jobs may start
    UNAVAILABLE = "unavailable"  # it does not: fill jobs wait
    RECOVERING = "recovering"  # an owned MPS daemon is being restarted: fill jobs wait
    UNISOLATED = "unisolated"  # it does not, and the user allowed running without it

    @property
    def usable(self) -> bool:
        """Whether fill jobs may run in this state."""
        return self in (IsolationState.READY, IsolationState.UNISOLATED)


class FillState(enum.StrEnum):
    """A fill job's life cycle (FreeRide section 3.1); ``bubbles.core.lifecycle`` holds its transitions."""

    SUBMITTED = "SUBMITTED"  # accepted and planned, no process yet
    CREATED = "CREATED"  # process started, context in host memory only
    PAUSED = "PAUSED"  # initialized on the accelerator, waiting for a bubble
    RUNNING = "RUNNING"  # executing steps inside a bubble
    STOPPED = "STOPPED"  # finished, cancelled, failed or killed; resources released


@dataclass(frozen=True)
class DaemonStatus:
    """The MPS control daemon as the agent sees it."""

    owned: bool  # started by this agent (and so quit by it at shutdown)
    pid: int | None
    restarts: int  # times this agent started it again after losing it
    pipe_dir: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class IsolationStatus:
    """The health of the agent's isolation: raw from its backend, or effective (what the agent acts on)."""

    mode: IsolationMode
    state: IsolationState
    detail: str
    daemon: DaemonStatus | None = None
    # Bumped each time isolation is (re)established: a fill job launched in an earlier epoch belongs to a
    # mechanism that has since been lost (e.g. its MPS server died), even if the agent missed the outage.
    epoch: int = 0

    @property
    def usable(self) -> bool:
        """Whether fill jobs may run: isolated (ready) or knowingly without isolation (unisolated)."""
        return IsolationState(self.state).usable

    def to_dict(self) -> dict[str, Any]:
        return {"mode": str(self.mode), "state": str(self.state), "detail": self.detail,
                "daemon": self.daemon.to_dict() if self.daemon else None}


@dataclass(frozen=True)
class JobStatus:
    """One fill job as the agent reports it (the stats file's ``jobs``, next the operator's FillJob status)."""

    name: str
    stage: int
    state: FillState
    reason: str
    steps: int
    flops: float
    step_s: float | None
    isolation: str | None  # the isolation mode it was launched under, "unisolated", or None before launch
    resubmission: int
    # The agent's plan against what ran (docs/agent.md#the-plan): fill steps per iteration the plan said (None before
    # a step time is known) and that ran over the job's recent iterations (None until compared), their ratio
    # (ran / planned; None when either is), why they are more than the stated factor apart ("" when not), and where
    # the compared plan's step times came from ("spec", "profile", "measured"; "" without a plan).
    plan_steps_per_iteration: float | None = None
    ran_steps_per_iteration: float | None = None
    plan_ratio: float | None = None
    plan_reason: str = ""
    plan_basis: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": str(self.state)}


@dataclass(frozen=True)
class ModeTotals:
    """Harvest totals of one fill mode (from the agent's ledger)."""

    fill_steps: int
    fill_flops: float
    bubble_s: float
    filled_s: float
    overruns: int
    overrun_s: float
    overrun_p99_ms: float
    max_overrun_ms: float


@dataclass(frozen=True)
class GuardStatus:
    """The slowdown guard: the share of each bubble it gives fill work and what it measured."""

    share: float
    stage: int | None  # the stage whose iterations it watches (the lowest reporting one)
    baseline_s: float | None
    slowdown_held: float | None  # the slowdown measured at the share it holds
    history: tuple[tuple[int, float, float | None], ...] = ()  # (iteration, share, slowdown or None)
    phase: str = "harvest"  # harvest (watching) | probe (with and without fill work, paired) | refresh
    probes: tuple[tuple[str, int], ...] = ()  # probes by outcome: cut, clear, undecided


@dataclass(frozen=True)
class ExecutorStatus:
    stage: int
    device: str
    mode: FillMode
    profiled: bool
    training_pid: int | None = None  # the training's process on this stage, in the agent's PID namespace
    # What it is to the isolation's shared server: "" (not asked: no MPS, a CPU device, not profiled yet), "pending",
    # "client", "not a client: ..." (what that costs, what to do), "unknown" (the daemon's PIDs are not the agent's)
    training_membership: str = ""


@dataclass(frozen=True)
class AgentStatus:
    """Everything one agent reports (``bubbles agent --stats``, the demo and the benchmarks read it).

    ``to_dict`` is the stats file's JSON; ``events``, ``steps`` and ``bubbles`` are raw records kept as
    written (bounded in number)."""

    training: str
    budget: float
    grace_ms: float
    guard: GuardStatus
    modes: dict[str, ModeTotals]
    isolation: IsolationStatus
    isolation_losses: int
    executors: tuple[ExecutorStatus, ...]
    jobs: tuple[JobStatus, ...]
    kills: int
    rejected_messages: int
    rejected_jobs: int
    events: tuple[dict[str, Any], ...] = ()
    steps: tuple[dict[str, Any], ...] = ()
    bubbles: tuple[dict[str, Any], ...] = ()
    # Why the agent stopped by itself (--exit-when-done): its exit status and the reason; None while it serves, or
    # when a signal stopped it.
    ended: tuple[int, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "training": self.training, "budget": self.budget, "grace_ms": self.grace_ms,
            "guard": {**asdict(self.guard), "history": [list(h) for h in self.guard.history],
                      "probes": dict(self.guard.probes)},
            "modes": {mode: asdict(totals) for mode, totals in self.modes.items()},
            "isolation": self.isolation.to_dict(), "isolation_losses": self.isolation_losses,
            "executors": [{**asdict(e), "mode": e.mode.label} for e in self.executors],
            "jobs": [j.to_dict() for j in self.jobs],
            "kills": self.kills, "rejected_messages": self.rejected_messages, "rejected_jobs": self.rejected_jobs,
            "events": list(self.events), "steps": list(self.steps), "bubbles": list(self.bubbles),
            "ended": {"code": self.ended[0], "reason": self.ended[1]} if self.ended is not None else None,
        }


@dataclass(frozen=True)
class FillNode:
    """One node of a fill job's step chain: how long it runs and how much memory it needs."""

    duration_s: float
    memory_bytes: int


class SpecError(ValueError):
    """A fill-job spec that cannot be run; the message names the field and what to do."""


# What a stage's training process is to its node's MPS server, as the agent answers (``ExecutorStatus``,
# ``resources.StageReport``): a client, or not ("not a client: " then what that costs and what to do).
MPS_CLIENT = "client"
NOT_MPS_CLIENT = "not a client"


def known_membership(text: str) -> str:
    """``text`` if it is a known answer about a training's MPS membership (``MPS_CLIENT``, or one starting with
    ``NOT_MPS_CLIENT``), else "": not known (not checked yet, a check under way, nothing to tell, a newer agent's
    word)."""
    return text if text == MPS_CLIENT or text.startswith(NOT_MPS_CLIENT) else ""


# Steps past a bubble's predicted end (the fill runtime's tail, ``gating.TailRisk``): the accepted chance that
# such a step outlives its bubble. The fill process's ``$BUBBLES_TAIL_RISK`` sets its own (default below); the
# training's limit (a PipelineTraining's ``spec.tailRisk``, the agent's ``--tail-risk``) caps it.
DEFAULT_TAIL_RISK = 0.1
MAX_TAIL_RISK = 0.5


def check_tail_risk(value: Any, where: str) -> float:
    """``value`` as a tail risk, a number from 0 (no steps past a bubble's predicted end) to ``MAX_TAIL_RISK``;
    ValueError naming ``where`` and the range otherwise (NaN, booleans and strings included)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= MAX_TAIL_RISK
    if not ok:
        raise ValueError(f"{where} must be the accepted chance that a fill step started past a bubble's predicted "
                         f"end outlives the bubble, from 0 (never start one) to {MAX_TAIL_RISK}, e.g. "
                         f"{DEFAULT_TAIL_RISK}; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class FillJobSpec:
    """A fill job as the user describes it; ``parse_spec`` is the one place that validates it."""

    name: str
    interface: FillInterface
    entry: str | None  # "module:Class" (iterative; imperative jobs may use it too)
    command: tuple[str, ...] | None  # argv of an imperative job run as a plain process
    args: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    memory_bytes: int = 0
    step_time_s: float | None = None
    nodes: tuple[FillNode, ...] = ()
    stage: int | None = None
    kind: WorkloadKind | None = None  # what the job does, when the user says
    init_timeout_s: float | None = None  # how long its init may take; None: the agent's --init-timeout
    flops_per_step: float | None = None  # FLOPs of one step, counted for steps whose job reports none
    # GPUs of one stage the job runs on together, one process each (a gang): placed, started, paused, resumed and
    # stopped together, in the bubbles all of them share (from the last GPU's start to the first GPU's end).
    gpus: int = 1

    @property
    def iterative(self) -> bool:
        return self.interface is FillInterface.ITERATIVE

    def plan_nodes(self, step_s: float | None = None) -> tuple[FillNode, ...] | None:
        """The step chain for the planner: ``nodes``, else one (step time, memory) node; None if unknown."""
        if self.nodes:
            return self.nodes
        s = step_s if step_s is not None else self.step_time_s
        if s is None:
            return None
        return (FillNode(s, self.memory_bytes),)

    @property
    def gating_step_s(self) -> float | None:
        """The step time the runtime gates on: the spec's, else the sum of the nodes, else unknown."""
        if self.step_time_s is not None:
            return self.step_time_s
        if self.nodes:
            return sum(n.duration_s for n in self.nodes)
        return None


_FIELDS = ("name", "interface", "kind", "entry", "command", "args", "steps", "memory", "step_time", "nodes",
           "stage", "init_timeout", "flops_per_step", "gpus")
MAX_GPUS = 64  # GPUs one fill job may ask for (a node's GPUs of one stage: 8 on today's nodes)
MAX_INIT_TIMEOUT_S = 86400.0  # a day: longer is a job that will never start
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTPE]i?|k|m)?\s*$")
_UNITS = {
    None: 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|ms|s|m|h)?\s*$")
_LONG_UNITS = ("m", "h")  # minutes and hours: for timeouts only (a step time of "5m" is a slip, not 5 minutes)
_DUR_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "m": 60.0, "h": 3600.0}


def parse_quantity(value: Any, where: str) -> int:
    """Bytes from an integer or a Kubernetes quantity (``512Mi``, ``2Gi``, ``1G``)."""
    if isinstance(value, bool):
        raise SpecError(f"{where} must be bytes or a quantity like 512Mi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SpecError(f"{where} must be >= 0, got {value}")
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _QUANTITY.match(value)
        if m and m.group(2) != "m":  # "m" (milli) makes no sense for bytes
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    raise SpecError(f"{where} must be bytes or a Kubernetes quantity like 512Mi or 2Gi, got {value!r}")


def parse_duration(value: Any, where: str, long: bool = False) -> float:
    """Seconds from a number or a string like ``2ms``, ``500us``, ``0.002``; with ``long`` also ``20m``, ``1h``."""
    m = _DURATION.match(value) if isinstance(value, str) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        s = float(value)
    elif m and (long or m.group(2) not in _LONG_UNITS):
        s = float(m.group(1)) * _DUR_UNITS[m.group(2)]
    elif long:
        raise SpecError(f"{where} must be a duration like 30m, 1h, 90s or 600 (seconds), got {value!r}")
    else:
        raise SpecError(f"{where} must be a duration like 2ms, 500us or 0.002 (seconds), got {value!r}")
    if not math.isfinite(s) or s <= 0:
        raise SpecError(f"{where} must be a duration > 0, got {value!r}")
    return s


def parse_spec(data: Any, source: str = "spec") -> FillJobSpec:
    """Validate a loaded spec object; raise SpecError naming the first bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a fill-job spec must be a mapping with at least 'name' and 'entry'")
    unknown = sorted(set(map(str, data)) - set(_FIELDS))
    if unknown:
        raise SpecError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                        f"known fields: {', '.join(_FIELDS)}")
    if "name" not in data:
        raise SpecError(f"{source}: missing field 'name' (a DNS-label name like image-classification)")
    try:
        name = check_name("fill job", data["name"])
    except ValueError as exc:
        raise SpecError(f"{source}: field 'name': {exc}") from None
    raw_kind = data.get("kind")
    if raw_kind in FillInterface.labels():  # the spelling of bubbles 0.1's spec files
        raise SpecError(f"{source}: field 'kind' says what the job does ({' or '.join(WorkloadKind.labels())}); "
                        f"{raw_kind!r} is an interface: write 'interface: {raw_kind}'")
    try:
        interface = FillInterface.parse(data.get("interface", "iterative"), f"{source}: field 'interface'")
        kind = None if raw_kind is None else WorkloadKind.parse(raw_kind, f"{source}: field 'kind'")
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    entry = data.get("entry")
    command = data.get("command")
    if entry is not None and (not isinstance(entry, str) or not re.match(r"^[\w.]+:[\w.]+$", entry)):
        raise SpecError(f"{source}: field 'entry' must look like 'package.module:ClassName', got {entry!r}")
    if command is not None:
        if interface is not FillInterface.IMPERATIVE:
            raise SpecError(f"{source}: field 'command' is for imperative jobs; "
                            "set interface: imperative or use entry")
        if (not isinstance(command, list) or not command
                or not all(isinstance(a, str) and a for a in command)):
            raise SpecError(f"{source}: field 'command' must be a non-empty list of strings (an argv)")
        if entry is not None:
            raise SpecError(f"{source}: give either 'entry' or 'command', not both")
    if entry is None and command is None:
        what = ("'entry' (module:Class)" if interface is FillInterface.ITERATIVE
                else "'command' (argv) or 'entry' (module:Class)")
        raise SpecError(f"{source}: missing field {what}")
    args = data.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise SpecError(f"{source}: field 'args' must be a mapping of keyword arguments for the job's class")
    try:
        json.dumps(args, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"{source}: field 'args' must be plain JSON data: {exc}") from None
    steps = data.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise SpecError(f"{source}: field 'steps' must be an integer >= 1 (or omitted to run until stopped)")
    memory = parse_quantity(data.get("memory", 0), f"{source}: field 'memory'")
    step_time = data.get("step_time")
    step_time_s = None if step_time is None else parse_duration(step_time, f"{source}: field 'step_time'")
    raw_nodes = data.get("nodes")
    nodes: list[FillNode] = []
    if raw_nodes is not None:
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise SpecError(f"{source}: field 'nodes' must be a non-empty list of {{duration, memory}}")
        for i, nd in enumerate(raw_nodes):
            where = f"{source}: field 'nodes[{i}]'"
            if not isinstance(nd, dict) or "duration" not in nd or set(nd) - {"duration", "memory"}:
                raise SpecError(f"{where} must be a mapping with 'duration' and optional 'memory'")
            nodes.append(FillNode(parse_duration(nd["duration"], f"{where}.duration"),
                                  parse_quantity(nd.get("memory", memory), f"{where}.memory")))
    stage = data.get("stage")
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int) or stage < 0):
        raise SpecError(f"{source}: field 'stage' must be an executor index >= 0 (or omitted)")
    init_timeout = data.get("init_timeout")
    init_timeout_s = None if init_timeout is None else check_init_timeout(
        parse_duration(init_timeout, f"{source}: field 'init_timeout'", long=True), f"{source}: field 'init_timeout'")
    flops_per_step = data.get("flops_per_step")
    if flops_per_step is not None:
        flops_per_step = check_flops_per_step(flops_per_step, f"{source}: field 'flops_per_step'")
    gpus = check_gpus(data.get("gpus", 1), f"{source}: field 'gpus'")
    return FillJobSpec(
        name=name, interface=interface, kind=kind, entry=entry, command=tuple(command) if command else None,
        args=dict(args), steps=steps, memory_bytes=memory, step_time_s=step_time_s, nodes=tuple(nodes), stage=stage,
        init_timeout_s=init_timeout_s, flops_per_step=flops_per_step, gpus=gpus,
    )


def check_gpus(value: Any, where: str) -> int:
    """``value`` as the GPUs a fill job runs on together (1 to MAX_GPUS); SpecError saying so otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GPUS:
        raise SpecError(f"{where} must be an integer from 1 to {MAX_GPUS}: the GPUs of one pipeline stage the job "
                        f"runs on together, one process each (1, the default, for a single-GPU job); got {value!r}")
    return value


def check_flops_per_step(value: Any, where: str) -> float:
    """``value`` as FLOPs of one step (a finite number >= 0); SpecError saying so otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SpecError(f"{where} must be a number >= 0 (the FLOPs one step of the job does, counted for steps whose "
                        f"job reports none), got {value!r}")
    return float(value)


def check_init_timeout(seconds: float, where: str) -> float:
    """``seconds`` if it can bound a fill job's init (more than 0, at most a day); SpecError saying so otherwise."""
    if not 0 < seconds <= MAX_INIT_TIMEOUT_S:
        raise SpecError(f"{where} must be more than 0 and at most a day (how long the job's init, loading its model "
                        f"and data, may take before the agent kills it), got {seconds:g} s")
    return seconds


# What a fill process's own CUDA context (and the modules loaded outside its allocator) takes on a GPU beside the
# allocator cap its memory sets: planned on top of that memory outside MPS, by the agent (--cuda-context-mib) and
# the operator (--fill-cuda-context-mib) alike. A guess until measured on a GPU (tests/test_probes.py, gpu).
DEFAULT_CUDA_CONTEXT_MIB = 512
MAX_CUDA_CONTEXT_MIB = 16384


def check_cuda_context_mib(mib: Any, flag: str) -> int:
    """``mib`` if it is whole MiB from 0 to MAX_CUDA_CONTEXT_MIB; ValueError naming ``flag`` otherwise."""
    if isinstance(mib, bool) or not isinstance(mib, int) or not 0 <= mib <= MAX_CUDA_CONTEXT_MIB:
        raise ValueError(f"{flag} must be whole MiB from 0 to {MAX_CUDA_CONTEXT_MIB} (what a fill process's own CUDA "
                         f"context takes on its GPU), got {mib}")
    return mib


def read_yaml(path: Path, what: str, error: type[ValueError] = ValueError) -> Any:
    """The data in a YAML (or JSON: YAML is a superset) file; ``error`` saying which ``what`` for a missing or
    unreadable file and for text that is not YAML."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML/JSON: {exc}") from None


def load_spec(path: str | Path) -> FillJobSpec:
    """Read and validate a YAML or JSON spec file; raise SpecError for a missing or invalid file."""
    p = Path(path)
    return parse_spec(read_yaml(p, "fill-job spec", SpecError), str(p))
