"""The node's bookkeeping in cluster mode, as pure code: assignments from the operator and attaching fill Pods.

The operator tells a node's agent which fill job (by FillJob uid, generation and attempt) will run on which
training stage (``assign``), and when to stop it (``cancel``). The fill job's Pod then starts its process,
which connects to the agent's node-local attach socket and says who it is; ``attach`` decides whether the
agent admits it: only a process the operator assigned, seeing the GPU it was assigned, and visible to the
agent (so the watchdog can stop it). ``NodeBook`` keeps those records and says what to do; the shell
(``bubbles.agent.cluster``) owns the sockets, the trainings' agents and the gRPC server.

A gang job (its spec's ``gpus`` N > 1) attaches N processes, one per GPU, each saying its gang rank (``attach_gang``);
the job starts once all N are in, and a gang still short of processes ``GANG_ATTACH_S`` after its first attached is
given up (``gangs_overdue``): the ones that came are refused, and the assignment reports why.

Idempotency: ``assign`` is keyed by (uid, attempt, generation). The same key again changes nothing (a retried
call never starts a job twice); a larger key supersedes (the old run is stopped); a smaller one is stale and
refused.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from bubbles.core.agentapi import AssignmentMessage

# How long a gang's first process waits for the others to attach: under the SDK's own wait for its welcome (30 s, from
# its own connect), so that the processes that came hear why they are refused instead of timing out.
GANG_ATTACH_S = 25.0


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    ALREADY_ASSIGNED = "already-assigned"
    SUPERSEDED = "superseded"


class StaleAssignment(ValueError):
    """An assignment older than the one the agent holds (a delayed retry): refused, nothing changes."""


class AttachRefused(ValueError):
    """A fill process the agent will not admit; the text says why and what to do."""


@dataclass
class AssignedJob:
    """One assignment and where it stands on this node."""

    message: AssignmentMessage
    assigned_ns: int
    attached_pid: int | None = None  # the fill process, once admitted (a gang's: its leader, once all N are in)
    cancelled: str | None = None  # the reason, once cancelled
    gang_pids: dict[int, int] = field(default_factory=dict)  # a gang's processes attached so far, by gang rank
    gang_since_ns: int | None = None  # when its first one attached

    @property
    def gang_size(self) -> int:
        """Its processes: the spec's ``gpus`` (1 for a single-GPU job)."""
        return self.message.spec.gpus

    @property
    def uid(self) -> str:
        return self.message.uid

    @property
    def job_name(self) -> str:
        """The name the training's agent knows it by: unique per attempt, so a retry never meets its own past."""
        return attempt_name(self.message.name, self.message.attempt)


def attempt_name(name: str, attempt: int) -> str:
    return f"{name}-a{attempt}" if len(name) <= 56 else f"{name[:56].rstrip('-_.')}-a{attempt}"


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    message: str
    stop: AssignedJob | None = None  # a superseded run the shell must stop


class NodeBook:
    """Assignments by FillJob uid (see the module's documentation); the clock is injected."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.jobs: dict[str, AssignedJob] = {}

    def assign(self, msg: AssignmentMessage) -> Decision:
        have = self.jobs.get(msg.uid)
        if have is not None and have.cancelled is None:
            if have.message.key == msg.key:
                return Decision(Outcome.ALREADY_ASSIGNED, f"{msg.namespace}/{msg.name} attempt {msg.attempt} "
                                f"(generation {msg.generation}) is already assigned here")
            if msg.key < have.message.key:
                raise StaleAssignment(
                    f"{msg.namespace}/{msg.name}: attempt {msg.attempt} generation {msg.generation} is older than "
                    f"attempt {have.message.attempt} generation {have.message.generation}, which this agent holds")
            self.jobs[msg.uid] = AssignedJob(msg, self.clock())
            return Decision(Outcome.SUPERSEDED, f"{msg.namespace}/{msg.name}: attempt {msg.attempt} generation "
                            f"{msg.generation} replaces attempt {have.message.attempt} generation "
                            f"{have.message.generation}", stop=have)
        if have is not None and msg.key <= have.message.key:
            raise StaleAssignment(f"{msg.namespace}/{msg.name} attempt {msg.attempt} was cancelled on this node; "
                                  "place it again as a new attempt")
        self.jobs[msg.uid] = AssignedJob(msg, self.clock())
        return Decision(Outcome.ACCEPTED, f"{msg.namespace}/{msg.name} attempt {msg.attempt}: waiting for its Pod "
                        f"{msg.fill_pod} to attach to stage {msg.stage} of {msg.training}")

    def cancel(self, uid: str, reason: str) -> AssignedJob | None:
        """Mark ``uid`` cancelled; the record the shell must stop, or None if there is nothing to stop."""
        have = self.jobs.get(uid)
        if have is None or have.cancelled is not None:
            return None
        have.cancelled = reason or "cancelled by the operator"
        return have

    def attach(self, uid: str, pid: int, seen_gpu: str | None) -> AssignedJob:
        """Admit the fill process that says it is ``uid``'s (``pid`` as the agent sees it; ``seen_gpu``: the UUID of
        the one GPU the process sees, None on CPU); AttachRefused saying why not."""
        have = self.jobs.get(uid)
        if have is None:
            raise AttachRefused(f"no fill job with uid {uid} is assigned to this node: the operator places fill "
                                "Pods and tells the agent first; a Pod started by hand is not admitted")
        if have.cancelled is not None:
            raise AttachRefused(f"fill job {have.message.name} (uid {uid}) was cancelled: {have.cancelled}")
        if have.attached_pid is not None:
            raise AttachRefused(f"fill job {have.message.name} (uid {uid}) already has a process attached (pid "
                                f"{have.attached_pid}); one process per fill job")
        if pid <= 0:
            raise AttachRefused("the agent cannot see the fill process (it runs in a PID namespace the agent does not "
                                "see), so its watchdog could not stop it: run the agent with hostPID: true")
        want = have.message.gpu_uuid
        if want and seen_gpu != want:
            raise AttachRefused(
                f"fill job {have.message.name} was assigned GPU {want} (stage {have.message.stage} of "
                f"{have.message.training}) but its process sees {seen_gpu or 'no GPU'}: the container runtime "
                "did not expose the GPU named in NVIDIA_VISIBLE_DEVICES (see docs/architecture.md, 'How a fill "
                "Pod reaches the training's GPU')")
        have.attached_pid = pid
        return have

    def attach_gang(self, uid: str, pid: int, gang_rank: int | None) -> AssignedJob:
        """Admit one process of a gang job (``gang_rank``: the rank its ``hello`` says; None from an SDK before gangs);
        AttachRefused saying why not: as ``attach``, and a rank missing, out of range or taken already."""
        have = self.jobs.get(uid)
        if have is None or have.cancelled is not None:
            return self.attach(uid, pid, None)  # refused, with attach's reason
        name, size = have.message.name, have.gang_size
        if gang_rank is None:
            raise AttachRefused(f"fill job {name} is a gang of {size} GPUs, but its process says no gang rank: the SDK "
                                "in the fill job's image predates gang jobs (control v4); upgrade bubbles in the "
                                "image, whose process starts one process per GPU")
        if not 0 <= gang_rank < size:
            raise AttachRefused(f"fill job {name} is a gang of {size} GPUs (gang ranks 0 to {size - 1}), but a process "
                                f"says gang rank {gang_rank}")
        if gang_rank in have.gang_pids:
            raise AttachRefused(f"fill job {name} already has gang rank {gang_rank}'s process attached (pid "
                                f"{have.gang_pids[gang_rank]}); one process per gang rank")
        if have.attached_pid is not None:
            raise AttachRefused(f"fill job {name} (uid {uid}) has all {size} processes attached already")
        if pid <= 0:
            raise AttachRefused("the agent cannot see the fill process (it runs in a PID namespace the agent does not "
                                "see), so its watchdog could not stop it: run the agent with hostPID: true")
        have.gang_pids[gang_rank] = pid
        if have.gang_since_ns is None:
            have.gang_since_ns = self.clock()
        if len(have.gang_pids) == size:
            have.attached_pid = have.gang_pids[0]
        return have

    def fill_pod_job(self, namespace: str, pod: str) -> AssignedJob | None:
        """The live (not cancelled) assignment whose fill Pod is ``namespace``/``pod``, or None: what a fill Pod's CSI
        volume is admitted for, and whose process its own attach socket serves. The FillJob's namespace is its Pod's
        (an operator before namespaces named none: ``_local``, which no Pod's namespace is)."""
        return next((have for have in self.jobs.values() if have.cancelled is None
                     and have.message.fill_pod == pod and have.message.namespace == namespace), None)

    def gangs_overdue(self, now_ns: int, wait_s: float = GANG_ATTACH_S) -> list[AssignedJob]:
        """Gangs whose first process attached more than ``wait_s`` ago and that are still short of processes: given
        up (their attached processes forgotten; the shell refuses them and says why)."""
        late = [have for have in self.jobs.values()
                if have.gang_since_ns is not None and have.attached_pid is None and have.cancelled is None
                and now_ns - have.gang_since_ns > int(wait_s * 1e9)]
        for have in late:
            have.gang_pids.clear()
            have.gang_since_ns = None
        return late

    def left_gang(self, uid: str, gang_rank: int) -> None:
        """Gang rank ``gang_rank``'s process of ``uid`` was refused after all (or is gone before its gang started)."""
        have = self.jobs.get(uid)
        if have is not None and have.attached_pid is None:
            have.gang_pids.pop(gang_rank, None)
            if not have.gang_pids:
                have.gang_since_ns = None

    def detached(self, uid: str) -> None:
        """The attached process is gone (its exit is reported through the training's agent)."""
        have = self.jobs.get(uid)
        if have is not None:
            have.attached_pid = None
            have.gang_pids.clear()
            have.gang_since_ns = None

    def forget_before(self, cutoff_ns: int) -> list[str]:
        """Drop cancelled records assigned before ``cutoff_ns`` (bounded memory); the uids dropped."""
        gone = [u for u, j in self.jobs.items() if j.cancelled is not None and j.assigned_ns < cutoff_ns]
        for u in gone:
            del self.jobs[u]
        return gone
