"""What the incremental round (``rounds.reconcile_round``) remembers between rounds: each FillJob's last decision and
what it read, each PipelineTraining's last status, the parsed PipelineTrainings; one ``RoundMemo`` per
``DecideCache``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bubbles.core.identity import GpuKey
from bubbles.core.resources import FillJobResource, PipelineTrainingResource, ResourceError

from .view import ClusterView, GpuView, key_of

if TYPE_CHECKING:
    from .filljobs import EndEstimate
    from .trainings import TrainingInputs

# What a FillJob's repeated decision may hold: its agent told its assignment again, or told to let go of its run.
REPEATABLE = frozenset({"assign", "cancel"})


@dataclass(frozen=True)
class JobReads:
    """Where a FillJob's decision looks beyond its object, read once from it: its run's uid, its GPUs, its Pod."""

    uid: str
    gpu_keys: tuple[GpuKey, ...] = ()
    pod: str = ""  # "namespace/name" of its fill Pod; "" where it reads nothing of it
    progress_only: bool = False  # a final job: only whether its agent still reports its run

    def inputs(self, view: ClusterView, gpus: Mapping[GpuKey, GpuView]) -> tuple[Any, ...]:
        """What the decision read of ``view`` (compared with ``same_inputs``)."""
        if self.progress_only:
            return (self.uid in view.progress,)
        if not self.gpu_keys:
            return ()
        pod = self.pod
        return (*(gpus.get(k) for k in self.gpu_keys), view.progress.get(self.uid), view.waiting_pods.get(pod),
                view.failed_pods.get(pod), view.ended_pods.get(pod))


def same_inputs(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether a FillJob's decision reads the same of inputs ``a`` as of ``b`` (``JobReads.inputs``): equal, each
    pair compared as itself first (the shell hands a GPU's view and a run's progress over as the same object while they
    are unchanged), a GPU's view but for the training's figures (``GpuView.same_for_jobs``)."""
    if a == b:
        return True
    return len(a) == len(b) and all(
        x is y or (x.same_for_jobs(y) if isinstance(x, GpuView) and isinstance(y, GpuView) else x == y)
        for x, y in zip(a, b, strict=True))


@dataclass
class JobMemo:
    """A FillJob as the last round that looked at it decided."""

    obj: Mapping[str, Any]  # the object it was decided on
    key: str  # "namespace/name"
    job: FillJobResource | None  # its parsed spec, or None where it was not parsed
    uid: str
    # The decision to take again while nothing changes ((kind, what) in order: ``REPEATABLE`` kinds only), or None:
    # looked at every round.
    repeat: tuple[tuple[str, Any], ...] | None = None
    reads: JobReads | None = None
    inputs: tuple[Any, ...] = ()
    due_s: float = math.inf
    busy_keys: tuple[GpuKey, ...] = ()  # the GPUs it keeps busy, until end.at(now)
    end: EndEstimate | None = None
    active: tuple[str, tuple[GpuKey, ...]] | None = None  # (training key, GPU keys) where it is placed


@dataclass
class TrainingMemo:
    obj: Mapping[str, Any]
    training: PipelineTrainingResource
    inputs: TrainingInputs
    status: dict[str, Any] | None
    repeatable: bool  # the status depends on nothing but its inputs (no condition stamped with this round's time)


@dataclass
class RoundMemo:
    """What ``reconcile_round`` remembers between rounds (one per ``DecideCache``)."""

    jobs: dict[int, JobMemo] = field(default_factory=dict)  # by id() of the object it holds
    trainings: dict[str, TrainingMemo] = field(default_factory=dict)
    # PipelineTraining key -> (its object, parsed or None, why invalid or None)
    parsed: dict[str, tuple[Mapping[str, Any], PipelineTrainingResource | None, str | None]] = field(
        default_factory=dict)
    settings: tuple[Any, ...] | None = None  # what every memo holds for (``_settings``)
    full_at_s: float = -math.inf  # when the last full pass was (the view's clock)
    now_s: float = -math.inf  # the last round's clock
    examined: int = 0  # FillJobs the last round looked at (the rest took their last decision again)
    full: bool = False  # whether the last round was a full pass

    def parse_trainings(self, objs: Sequence[Mapping[str, Any]]) -> tuple[dict[str, PipelineTrainingResource],
                                                                          dict[str, str]]:
        """The valid PipelineTrainings by key, and why each invalid one is: parsed again only when its object is
        another, and the same parsed object kept while its spec reads the same (so that comparing is cheap)."""
        trainings: dict[str, PipelineTrainingResource] = {}
        invalid: dict[str, str] = {}
        parsed: dict[str, tuple[Mapping[str, Any], PipelineTrainingResource | None, str | None]] = {}
        for t in objs:
            key = key_of(t)
            have = self.parsed.get(key)
            if have is None or have[0] is not t:
                try:
                    tr: PipelineTrainingResource | None = PipelineTrainingResource.from_object(t)
                    why = None
                except ResourceError as exc:
                    tr, why = None, str(exc)
                if have is not None and tr is not None and have[1] == tr:
                    tr = have[1]
                have = (t, tr, why)
            parsed[key] = have
            if have[1] is not None:
                trainings[key] = have[1]
            else:
                invalid[key] = str(have[2])
        self.parsed = parsed
        return trainings, invalid
