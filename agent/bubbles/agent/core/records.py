"""The core's state: a fill job's record, an open bubble, an executor (one harvested GPU: a rank of a pipeline stage on
this node, named by its ``GpuKey``), and the raw step, bubble and event records the status carries (typed dicts: the
stats file's JSON is what they are)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from bubbles.core import wire
from bubbles.core.api import FillJobSpec, FillMode, FillState, JobStatus
from bubbles.core.cycle import BubbleCycle
from bubbles.core.identity import GpuKey

from .membership import TrainingMembership
from .planning import LAG_WINDOW, LENGTH_WINDOW, PlanWatch

# Iterations after a fill-mode change the slowdown guard does not see: fill work of the old mode may still run.
MODE_SETTLE_ITERATIONS = 2
UNISOLATED = "unisolated"  # JobRecord.isolation of a job launched without working isolation


@dataclass(eq=False)
class JobRecord:
    """The agent's record of one running (or queued, or ended) fill job; identity is the object."""

    id: int
    spec: FillJobSpec
    key: GpuKey  # the GPU it is queued or runs on (a job that names no stage moves when placed: AgentCore._place)
    state: FillState = FillState.SUBMITTED
    reason: str = ""
    steps: int = 0
    flops: float = 0.0
    launched: bool = False  # a process exists (until its exit is handled)
    has_control: bool = False  # the process speaks the control protocol (SDK jobs)
    in_step: tuple[int, int] | None = None  # (step start ns, bubble seq) between step_begin and step
    armed: FillMode | None = None  # the mode the job was armed in; None: disarmed
    tail_risk_sent: float | None = None  # the last ``limits.tail_risk`` sent to its process
    unknown_fields: set[str] = field(default_factory=set)  # "type.field" it sent that this agent does not know
    step_s: float | None = None
    planned_with_step: bool = False
    placed: bool = False  # a job that names no stage: moved to the GPU with the most bubble time (AgentCore._place)
    assigned: bool = False  # placed by the operator (cluster mode): it stays on its GPU, where its Pod attached
    finished: bool = False
    last_error: str = ""
    job_totals: dict[str, list[float]] = field(default_factory=dict)  # mode label -> [steps, flops]
    isolation: str | None = None  # at launch: the isolation mode it was a client of, or "unisolated"
    isolation_epoch: int = 0  # IsolationStatus.epoch at launch
    resubmission: int = 0  # how often this spec was resubmitted after losing isolation
    verification: str = ""  # "" (none asked), "pending" (a VerifyIsolation out), "verified"
    stop_deadline: bool = False  # asked to stop, with a SIGKILL timed STOP_GRACE_S later
    gang: Gang | None = None  # a gang job's records (one per GPU), this among them; None: a single-GPU job
    gang_rank: int = 0  # its place in the gang: its process's $BUBBLES_GANG_RANK
    plan: PlanWatch = field(init=False)  # what it is planned to run per iteration, and how that compares

    def __post_init__(self) -> None:
        self.plan = PlanWatch(self.spec.gating_step_s)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stage(self) -> int:
        """The pipeline stage it runs in (its GPU's)."""
        return self.key.stage

    @property
    def rank(self) -> int:
        """Its GPU's rank among the stage's ranks."""
        return self.key.rank

    @property
    def iterative(self) -> bool:
        return self.spec.iterative

    def status(self) -> JobStatus:
        chk = self.plan.last
        planned = chk.planned if chk is not None else (
            self.plan.planned.steps_per_iteration if self.plan.planned is not None else None)
        basis = chk.basis if chk is not None else self.plan.inputs.basis if self.plan.inputs is not None else ""
        return JobStatus(self.name, self.stage, self.state, self.reason, self.steps, self.flops, self.step_s,
                         self.isolation, self.resubmission, plan_steps_per_iteration=planned,
                         ran_steps_per_iteration=chk.ran if chk is not None else None,
                         plan_ratio=chk.ratio if chk is not None else None,
                         plan_reason=chk.reason if chk is not None else "", plan_basis=basis)


@dataclass(eq=False)
class Gang:
    """A gang job (``FillJobSpec.gpus`` N > 1): N records of one spec, one per GPU of one stage, each with its own
    process; placed, launched, armed and stopped together (``AgentCore``). Its processes step together (the leader
    tells the others each step: ``bubbles.training.sdk.gang``), so its steps are the fewest any of them ran, and its
    FLOPs all of theirs."""

    id: int
    size: int
    members: list[JobRecord] = field(default_factory=list)  # by gang rank; all N once placed

    @property
    def keys(self) -> tuple[GpuKey, ...]:
        return tuple(m.key for m in self.members)

    @property
    def steps(self) -> int:
        return min((m.steps for m in self.members), default=0)

    @property
    def flops(self) -> float:
        return sum(m.flops for m in self.members)


@dataclass(frozen=True)
class OpenBubble:
    """A bubble between its START and END, with what the agent offered it: the accounting of where its time went
    (``ledger.bubble_breakdown``) needs the guard's pause and share, and the armed harvesting job and step time."""

    start: wire.BubbleStart
    guard_paused: bool
    share: float
    job: str  # the armed harvesting job, or ""
    step_s: float  # its step time, or 0


@dataclass(eq=False)
class ExecutorState:
    """One executor: one harvested GPU on this node (a rank of a pipeline stage; a CPU core stands in for it on CPU),
    as the core sees it. Its key names it; stage and rank come from the key."""

    key: GpuKey
    directory: Path  # where its agent socket and fills/ are: paths.gpu_dir, or a pre-v4 card's stage directory
    device: str
    core: int | None
    mode: FillMode
    cycle: BubbleCycle | None = None
    profiled_ns: int | None = None  # when its first profile came
    queue: deque[JobRecord] = field(default_factory=deque)
    active: JobRecord | None = None
    open_bubbles: dict[int, OpenBubble] = field(default_factory=dict)  # by seq
    last_message_ns: int | None = None  # when the stage's hook was last heard from (a valid datagram)
    last_iteration_s: float | None = None  # the latest iteration time the stage's hook reported
    since_mode_change: int = MODE_SETTLE_ITERATIONS  # iterations reported since the fill mode last changed
    # The training's process on this stage, as the kernel named the sender of its hook's datagrams in this agent's PID
    # namespace (SCM_CREDENTIALS), and what it is to the isolation's shared server (an MPS client or not; see
    # .membership for when it is asked).
    training_pid: int | None = None
    training_membership: TrainingMembership = TrainingMembership.NOT_ASKED
    training_asked_ns: int | None = None  # when last asked: a check that could not be made is asked again later
    # The hook's recent predicted lengths per slot (from its STARTs), and this agent's lag in reading a START: what
    # the fill jobs' plans are made with (.planning).
    predicted: dict[int, deque[int]] = field(default_factory=dict)
    start_lags: deque[int] = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))

    @property
    def stage(self) -> int:
        return self.key.stage

    @property
    def rank(self) -> int:
        return self.key.rank

    def note_start(self, slot: int, predicted_ns: int, lag_ns: int | None) -> None:
        """A bubble's START: its predicted length, and how late this agent read it (None: not a latency)."""
        if predicted_ns >= 0:
            self.predicted.setdefault(slot, deque(maxlen=LENGTH_WINDOW)).append(predicted_ns)
        if lag_ns is not None:
            self.start_lags.append(lag_ns)


class StepRecord(TypedDict):
    """One fill step, as the stats file's ``steps`` lists it."""

    stage: int
    rank: int  # its GPU's rank within the stage
    job: str
    start_ns: int
    end_ns: int
    flops: float
    mode: str  # the fill mode's label
    signal_ns: int
    bubble_seq: int
    size: int | None  # the step size, for a job with step_sizes
    tail: bool  # on TailRisk's word, not the prediction's


class BubbleRecord(TypedDict):
    """One bubble between its START and END, with what the agent offered it (``ledger.bubble_breakdown`` reads it)."""

    stage: int
    rank: int  # its GPU's rank within the stage
    slot: int
    start_ns: int
    end_ns: int
    mode: str
    predicted_end_ns: int
    guard_paused: bool
    share: float
    job: str  # the armed harvesting job, or ""
    step_s: float  # its step time, or 0


class EventRecord(TypedDict):
    """One thing the agent did or saw, as the stats file's ``events`` lists it."""

    t_ns: int
    stage: int  # -1: the node's (isolation) or the training's (its end)
    rank: int  # the GPU's rank within the stage; -1 with stage -1
    job: str
    kind: str
    message: str
