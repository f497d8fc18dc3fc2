"""The node agent's API between the operator and every node's agent (``proto/.../agent.proto``, gRPC).

The messages carry the core's own types (``resources.NodeReport`` and its parts, ``api.FillJobSpec``);
this module converts between them and the generated protobuf classes, so neither side handles protobuf values
directly. Both the agent (server) and the operator (client) load it; it needs the ``grpcio`` and ``protobuf``
packages that their extras install, and nothing else from bubbles but the core.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bubbles.core.api import (
    FillInterface,
    FillJobSpec,
    FillNode,
    FillState,
    SpecError,
    WorkloadKind,
    check_flops_per_step,
    check_gpus,
    check_init_timeout,
    check_tail_risk,
    known_membership,
)
from bubbles.core.identity import LOCAL_NAMESPACE, MAX_RANKS, GpuKey
from bubbles.core.resources import JobProgress, NodeReport, StageReport

from .v1alpha1 import agent_pb2 as pb

# The API's version is its gRPC package: a change an older peer would misread gets a new package (v1beta1, v1...), which
# an agent serves beside the old one for a release, so an operator and its agents can be upgraded one after the other.
# A peer that serves none of the caller's packages answers UNIMPLEMENTED, which the operator reports with both versions.
API_VERSION = "v1alpha1"
SERVICE = f"bubbles.agentapi.{API_VERSION}.Agent"
TOKEN_METADATA = "authorization"  # "Bearer <token>", the fallback when mutual TLS is not set up


class ApiError(ValueError):
    """A message that does not hold what its core type needs; the text says which field and why."""


@dataclass(frozen=True)
class AssignmentMessage:
    """What ``Assign`` carries, as plain values: which fill job (by uid, generation and attempt) attaches where."""

    uid: str
    generation: int
    attempt: int
    namespace: str
    name: str
    training: str
    stage: int
    pod: str
    device: str
    fill_pod: str
    spec: FillJobSpec
    gpu_uuid: str | None = None
    # The PipelineTraining's limits for the slowdown guard; None leaves the training's as they are (at first the
    # agent's own --slowdown-budget and a share of 1).
    slowdown_budget: float | None = None
    max_fill_share: float | None = None
    tail_risk: float | None = None  # the PipelineTraining's spec.tailRisk (caps the fill processes' own)
    # The ranks of the stage (GpuKey.rank) the job's processes run on, one per process; (0,) from operators that
    # predate ranks.
    ranks: tuple[int, ...] = (0,)

    @property
    def gpu_keys(self) -> tuple[GpuKey, ...]:
        """The GPUs it was placed on."""
        return tuple(GpuKey(self.namespace or LOCAL_NAMESPACE, self.training, self.stage, r) for r in self.ranks)

    @property
    def key(self) -> tuple[int, int]:
        """Newer is larger: a restart (attempt) or an edit (generation)."""
        return (self.attempt, self.generation)


# -- core -> protobuf ---------------------------------------------------------------------------------------
def stage_to_pb(s: StageReport) -> pb.StageReport:
    msg = pb.StageReport(namespace=s.namespace, training=s.training, pod=s.pod, stage=s.stage, device=s.device,
                         cycle_json=json.dumps(s.cycle) if s.cycle is not None else "",
                         hook_reporting=s.hook_reporting, bubble_s=s.bubble_s, filled_s=s.filled_s,
                         gpu_uuid=s.gpu_uuid or "", training_membership=s.training_membership, rank=s.rank,
                         ranks=s.ranks, gpu_resource=s.gpu_resource)
    if s.iteration_s is not None:
        msg.iteration_s = s.iteration_s
    if s.baseline_iteration_s is not None:
        msg.baseline_iteration_s = s.baseline_iteration_s
    return msg


def progress_to_pb(j: JobProgress) -> pb.JobProgress:
    return pb.JobProgress(uid=j.uid, state=str(j.state), steps_done=j.steps_done, flops=j.flops, reason=j.reason,
                          kills=j.kills, attempt=j.attempt)


def report_to_pb(r: NodeReport) -> pb.NodeReport:
    return pb.NodeReport(node=r.node, stages=[stage_to_pb(s) for s in r.stages],
                         jobs=[progress_to_pb(j) for j in r.jobs])


def spec_to_pb(s: FillJobSpec) -> pb.FillJobSpec:
    msg = pb.FillJobSpec(name=s.name, interface=str(s.interface), entry=s.entry or "", command=list(s.command or ()),
                         args_json=json.dumps(s.args, sort_keys=True), memory_bytes=s.memory_bytes,
                         nodes=[pb.FillNode(duration_s=n.duration_s, memory_bytes=n.memory_bytes) for n in s.nodes],
                         kind=str(s.kind) if s.kind is not None else "")
    if s.steps is not None:
        msg.steps = s.steps
    if s.step_time_s is not None:
        msg.step_time_s = s.step_time_s
    if s.stage is not None:
        msg.stage = s.stage
    if s.gpus != 1:
        msg.gpus = s.gpus
    if s.init_timeout_s is not None:
        msg.init_timeout_s = s.init_timeout_s
    if s.flops_per_step is not None:
        msg.flops_per_step = s.flops_per_step
    return msg


def assignment_to_pb(a: AssignmentMessage) -> pb.AssignRequest:
    msg = pb.AssignRequest(uid=a.uid, generation=a.generation, attempt=a.attempt, namespace=a.namespace,
                           name=a.name, training=a.training, stage=a.stage, pod=a.pod, device=a.device,
                           gpu_uuid=a.gpu_uuid or "", fill_pod=a.fill_pod, spec=spec_to_pb(a.spec),
                           ranks=list(a.ranks))
    if a.slowdown_budget is not None:
        msg.slowdown_budget = a.slowdown_budget
    if a.max_fill_share is not None:
        msg.max_fill_share = a.max_fill_share
    if a.tail_risk is not None:
        msg.tail_risk = a.tail_risk
    return msg


# -- protobuf -> core (validating: the other side may run another version, or be something else) --------------
def _enum(cls: Any, text: str, where: str) -> Any:
    try:
        return cls(text)
    except ValueError:
        raise ApiError(f"{where} is {text!r}; expected one of {', '.join(str(v) for v in cls)}") from None


def stage_from_pb(m: pb.StageReport) -> StageReport:
    cycle = None
    if m.cycle_json:
        try:
            cycle = json.loads(m.cycle_json)
        except ValueError as exc:
            raise ApiError(f"stage {m.stage} of {m.training!r}: cycle_json is not JSON ({exc})") from None
        if not isinstance(cycle, dict):
            raise ApiError(f"stage {m.stage} of {m.training!r}: cycle_json must be a JSON object")
    if m.stage < 0:
        raise ApiError(f"stage of {m.training!r} is {m.stage}; stages count from 0")
    ranks = m.ranks or 1  # an agent before ranks sends none: one rank per stage
    if not 0 <= m.rank < ranks <= MAX_RANKS:
        raise ApiError(f"stage {m.stage} of {m.training!r}: rank {m.rank} of {ranks} ranks is not a rank of the stage")
    return StageReport(m.namespace, m.training, m.pod, m.stage, m.device, cycle, m.hook_reporting,
                       m.iteration_s if m.HasField("iteration_s") else None,
                       m.baseline_iteration_s if m.HasField("baseline_iteration_s") else None,
                       m.bubble_s, m.filled_s, m.gpu_uuid or None, _membership(m.training_membership), m.rank, ranks,
                       _gpu_resource(m))


MAX_MEMBERSHIP_CHARS = 2048
# An extended resource's name: a DNS-subdomain prefix, '/', and a name of at most 63 characters.
_RESOURCE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def _gpu_resource(m: pb.StageReport) -> str:
    if m.gpu_resource and not _RESOURCE_RE.match(m.gpu_resource):
        raise ApiError(f"stage {m.stage} of {m.training!r}: gpu_resource {m.gpu_resource[:100]!r} is not an extended "
                       "resource name (prefix/name, as bubbles.dev/gpu-0)")
    return m.gpu_resource


def _membership(text: str) -> str:
    """A stage's ``training_membership``: a known answer (``api.known_membership``; anything else, from a newer agent
    say, reads as not known), cut to ``MAX_MEMBERSHIP_CHARS``."""
    return known_membership(text)[:MAX_MEMBERSHIP_CHARS]


def progress_from_pb(m: pb.JobProgress) -> JobProgress:
    if not m.uid:
        raise ApiError("a job's progress has no uid")
    return JobProgress(m.uid, _enum(FillState, m.state, f"job {m.uid}'s state"), m.steps_done, m.flops, m.reason,
                       m.kills, m.attempt)


def report_from_pb(m: pb.NodeReport) -> NodeReport:
    return NodeReport(m.node, tuple(stage_from_pb(s) for s in m.stages), tuple(progress_from_pb(j) for j in m.jobs))


def spec_from_pb(m: pb.FillJobSpec) -> FillJobSpec:
    where = f"fill job {m.name!r}"
    try:
        args = json.loads(m.args_json) if m.args_json else {}
    except ValueError as exc:
        raise ApiError(f"{where}: args_json is not JSON ({exc})") from None
    if not isinstance(args, dict):
        raise ApiError(f"{where}: args_json must be a JSON object")
    if not m.entry and not m.command:
        raise ApiError(f"{where} has neither entry nor command")
    if m.memory_bytes < 0:
        raise ApiError(f"{where}: memory_bytes is {m.memory_bytes}; it must be >= 0")
    if m.HasField("steps") and m.steps < 1:
        raise ApiError(f"{where}: steps is {m.steps}; it must be >= 1")
    if m.HasField("step_time_s") and not m.step_time_s > 0:
        raise ApiError(f"{where}: step_time_s is {m.step_time_s}; it must be > 0")
    try:
        if m.HasField("init_timeout_s"):
            check_init_timeout(m.init_timeout_s, f"{where}: init_timeout_s")
        if m.HasField("flops_per_step"):
            check_flops_per_step(m.flops_per_step, f"{where}: flops_per_step")
        gpus = check_gpus(m.gpus or 1, f"{where}: gpus")  # 0: an operator before gang jobs, one GPU
    except SpecError as exc:
        raise ApiError(str(exc)) from None
    return FillJobSpec(
        name=m.name, interface=_enum(FillInterface, m.interface, f"{where}'s interface"), entry=m.entry or None,
        command=tuple(m.command) or None, args=args, steps=m.steps if m.HasField("steps") else None,
        memory_bytes=m.memory_bytes, step_time_s=m.step_time_s if m.HasField("step_time_s") else None,
        nodes=tuple(FillNode(n.duration_s, n.memory_bytes) for n in m.nodes),
        stage=m.stage if m.HasField("stage") else None,
        kind=_enum(WorkloadKind, m.kind, f"{where}'s kind") if m.kind else None,
        init_timeout_s=m.init_timeout_s if m.HasField("init_timeout_s") else None,
        flops_per_step=m.flops_per_step if m.HasField("flops_per_step") else None, gpus=gpus)


def assignment_from_pb(m: pb.AssignRequest) -> AssignmentMessage:
    if not m.uid:
        raise ApiError("Assign needs the FillJob's uid")
    if m.stage < 0 or m.attempt < 0 or m.generation < 0:
        raise ApiError(f"Assign for {m.uid}: stage, attempt and generation must be >= 0 "
                       f"(got {m.stage}, {m.attempt}, {m.generation})")
    if not m.training or not m.fill_pod:
        raise ApiError(f"Assign for {m.uid}: training and fill_pod are required")
    ranks = tuple(m.ranks) or (0,)  # an operator before ranks names none: the stage's one rank
    if len(set(ranks)) != len(ranks) or not all(0 <= r < MAX_RANKS for r in ranks):
        raise ApiError(f"Assign for {m.uid}: ranks {list(ranks)} must be distinct ranks of the stage, each from 0 to "
                       f"{MAX_RANKS - 1}")
    if not m.HasField("spec"):
        raise ApiError(f"Assign for {m.uid} carries no spec")
    budget = m.slowdown_budget if m.HasField("slowdown_budget") else None
    if budget is not None and not 0 < budget < 1:  # NaN fails too
        raise ApiError(f"Assign for {m.uid}: slowdown_budget is {budget}; it must be in (0, 1), e.g. 0.01 for 1% "
                       "(the PipelineTraining's spec.slowdownBudget)")
    share = m.max_fill_share if m.HasField("max_fill_share") else None
    if share is not None and not 0 <= share <= 1:
        raise ApiError(f"Assign for {m.uid}: max_fill_share is {share}; it must be in [0, 1] "
                       "(the PipelineTraining's spec.maxFillShare)")
    tail = m.tail_risk if m.HasField("tail_risk") else None
    if tail is not None:
        try:
            check_tail_risk(tail, f"Assign for {m.uid}: tail_risk (the PipelineTraining's spec.tailRisk)")
        except ValueError as exc:
            raise ApiError(str(exc)) from None
    return AssignmentMessage(m.uid, m.generation, m.attempt, m.namespace, m.name, m.training, m.stage, m.pod,
                             m.device, m.fill_pod, spec_from_pb(m.spec), m.gpu_uuid or None, budget, share, tail,
                             ranks)
