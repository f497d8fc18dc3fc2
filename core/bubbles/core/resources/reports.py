"""What node agents report to the operator: each training stage they see (``StageReport``), each placed fill
job's progress (``JobProgress``), both in one ``NodeReport`` per node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bubbles.core.api import FillState
from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey

# A stage whose hook has sent nothing for this long reports no hook (StageReport.hook_reporting False): its training
# stopped, evaluates or checkpoints, or hangs. A training hook sends several messages per iteration (each bubble's start
# and end), so a stage that trains is far from this silent.
HOOK_SILENCE_S = 30.0


@dataclass(frozen=True)
class StageReport:
    """One harvested GPU on a node, as its agent sees it: one rank of one pipeline stage of one training (its key is
    ``identity.GpuKey(namespace, training, stage, rank)``; a stage with tensor- or data-parallel ranks on the node
    reports one of these per rank)."""

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
    rank: int = 0  # its index among the stage's ranks (0 from agents that predate ranks)
    ranks: int = 1  # how many ranks the stage has, on every node together
    # The extended resource through which a fill Pod asks the kubelet for this GPU ("bubbles.dev/gpu-<index>", served by
    # the node agent's device plugin), or "" where the agent serves none (no device plugin, a CPU training, an agent
    # before it): the operator then reaches the GPU as its --fill-gpu-access says.
    gpu_resource: str = ""

    @property
    def key(self) -> GpuKey:
        """Which GPU it is (a namespace an agent before GPU keys left empty reads as ``_local``)."""
        return GpuKey(self.namespace or LOCAL_NAMESPACE, self.training, self.stage, self.rank)

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
