"""A FillJob's status as the reconcile builds it: its phase, moved only along ``PHASE_TRANSITIONS``, its conditions,
and the Events its changes raise; written back as a whole status where it changed."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from bubbles.core.identity import GpuKey
from bubbles.core.resources import Condition, ConditionType, FillJobPhase, set_condition

from .view import Decisions, Event, key_of

ACTIVE = (FillJobPhase.PLACED, FillJobPhase.RUNNING, FillJobPhase.PAUSED)

# Where a FillJob's phase may go from where it is (None: no phase yet, or one this operator does not know). A phase
# may be set again (a new message); a final one is never set again.
_FROM_ACTIVE = frozenset({FillJobPhase.PLACED, FillJobPhase.RUNNING, FillJobPhase.PAUSED, FillJobPhase.QUEUED,
                          FillJobPhase.SUCCEEDED, FillJobPhase.FAILED})
PHASE_TRANSITIONS: Mapping[FillJobPhase | None, frozenset[FillJobPhase]] = MappingProxyType({
    None: frozenset({FillJobPhase.QUEUED, FillJobPhase.FAILED}),  # admitted, or its spec is invalid
    FillJobPhase.PENDING: frozenset({FillJobPhase.QUEUED, FillJobPhase.FAILED}),
    FillJobPhase.QUEUED: frozenset({FillJobPhase.QUEUED, FillJobPhase.PLACED, FillJobPhase.FAILED}),
    FillJobPhase.PLACED: _FROM_ACTIVE,  # runs, pauses, finishes, or is evicted (requeued or failed)
    FillJobPhase.RUNNING: _FROM_ACTIVE,
    FillJobPhase.PAUSED: _FROM_ACTIVE,
    FillJobPhase.SUCCEEDED: frozenset(),
    FillJobPhase.FAILED: frozenset(),
})


class InvalidTransition(ValueError):
    """A FillJob's phase set where ``PHASE_TRANSITIONS`` does not lead from its current one."""


def check_transition(old: FillJobPhase | None, new: FillJobPhase) -> None:
    """InvalidTransition unless ``PHASE_TRANSITIONS`` allows ``old`` -> ``new``."""
    if new not in PHASE_TRANSITIONS[old]:
        raise InvalidTransition(f"a FillJob's phase cannot go from {old.value if old else 'none'} to {new.value}")


def status_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("status") or {})


def phase_of(status: Mapping[str, Any]) -> FillJobPhase | None:
    """The status's phase, None where it has none this operator knows."""
    try:
        return FillJobPhase(str(status.get("phase")))
    except ValueError:
        return None


def condition_of(status: Mapping[str, Any], type_: ConditionType) -> Mapping[str, Any]:
    """The condition of ``type_`` in ``status`` ({} if it has none)."""
    return next((c for c in status.get("conditions") or () if c.get("type") == type_.value), {})


@dataclass(frozen=True)
class Assigned:
    """``status.assignment``, read once: where a placed FillJob runs (a field the status lacks: None). Placement writes
    the assignment whole (``placement._assign``); nothing edits one in place."""

    training: str | None = None  # the PipelineTraining's name, in the FillJob's namespace
    stage: int | None = None
    ranks: tuple[int, ...] = (0,)  # the stage's ranks it runs on ((0,) where an operator before ranks placed it)
    gpu_uuids: tuple[str, ...] = ()
    node: str | None = None
    device: str | None = None
    pod: str | None = None  # the fill job's Pod
    training_pod: str | None = None
    training_pod_uid: str | None = None
    placed_at: str | None = None  # RFC 3339

    @classmethod
    def read(cls, raw: Mapping[str, Any] | None) -> Assigned:
        """The assignment in a status's ``assignment`` object (None or {}: not placed)."""
        d = raw or {}
        ranks = tuple(int(r) for r in d.get("ranks") or (0,))
        return cls(d.get("training"), d.get("stage"), ranks, tuple(str(u) for u in d.get("gpuUUIDs") or ()),
                   d.get("node"), d.get("device"), d.get("pod"), d.get("trainingPod"), d.get("trainingPodUid"),
                   d.get("placedAt"))

    def gpu_keys(self, namespace: str) -> tuple[GpuKey, ...]:
        """The GPUs it runs on (one per rank), () where the status names none that can be (not placed)."""
        try:
            return tuple(GpuKey(namespace, str(self.training), int(self.stage if self.stage is not None else -1), r)
                         for r in self.ranks)
        except ValueError:
            return ()

    def gpu_key(self, namespace: str) -> GpuKey | None:
        """The GPU of its first rank (a single-GPU job's one), or None where it is not placed."""
        keys = self.gpu_keys(namespace)
        return keys[0] if keys else None


class FillJobStatus:
    """The status being built for one FillJob (its conditions kept, its events collected)."""

    def __init__(self, obj: Mapping[str, Any], now: dt.datetime, out: Decisions) -> None:
        self.obj = obj
        self.meta = obj.get("metadata") or {}
        self.key = key_of(obj)
        self.uid = str(self.meta.get("uid", ""))
        self.generation = int(self.meta.get("generation") or 1)
        self.before = status_of(obj)
        self.status = dict(self.before)
        self.now = now
        self.out = out
        self.queued_event: Event | None = None
        self.evicted = False  # evicted this round: placed again from the next one (see placement.place)

    @property
    def phase_now(self) -> FillJobPhase | None:
        return phase_of(self.status)

    @property
    def restarts(self) -> int:
        """The attempt's number (``status.restarts``): its Pod's and its run's."""
        return int(self.status.get("restarts", 0))

    @property
    def assignment(self) -> Assigned:
        """Where the job is placed (``status.assignment``; every field None where it is not)."""
        return Assigned.read(self.status.get("assignment"))

    @property
    def steps_done(self) -> int:
        """``status.progress.stepsDone`` as last written (0 before any)."""
        return int((self.status.get("progress") or {}).get("stepsDone", 0))

    @property
    def recovered_flops(self) -> float:
        """``status.recoveredFlops`` as last written."""
        return float(self.status.get("recoveredFlops", 0.0))

    def counter(self, name: str) -> int:
        """``status.counters[name]`` (0 before any)."""
        return int((self.status.get("counters") or {}).get(name, 0))

    def condition(self, type_: ConditionType, ok: bool, reason: str, message: str) -> None:
        self.status["conditions"] = set_condition(self.status.get("conditions") or [], Condition(
            type_.value, "True" if ok else "False", reason, message, observed_generation=self.generation), self.now)

    def phase(self, phase: FillJobPhase, message: str, *, event: str | None = None, warning: bool = False) -> None:
        """Set the phase and its message (InvalidTransition where ``PHASE_TRANSITIONS`` does not allow it), with
        ``event`` raised where either changed."""
        check_transition(self.phase_now, phase)
        changed = self.before.get("phase") != phase.value or self.before.get("message") != message
        self.status["phase"] = phase.value
        self.status["message"] = message
        if event is not None and changed:
            ev = Event("FillJob", self.meta.get("namespace", ""), self.meta.get("name", ""), self.meta.get("uid", ""),
                       "Warning" if warning else "Normal", event, message)
            self.out.events.append(ev)
            if event == "Queued":
                self.queued_event = ev

    def count(self, counter: str, at_least: int | None = None) -> None:
        """Add one to ``status.counters[counter]`` (or raise it to ``at_least``)."""
        counters = dict(self.status.get("counters") or {})
        counters[counter] = max(int(counters.get(counter, 0)), at_least) if at_least is not None \
            else int(counters.get(counter, 0)) + 1
        self.status["counters"] = counters

    def finish(self) -> None:
        if self.status.get("phase") != FillJobPhase.QUEUED.value and self.queued_event is not None:
            self.out.events.remove(self.queued_event)  # queued and placed in one round: one story
        self.status["observedGeneration"] = self.generation
        if self.status != self.before:
            self.out.write_status(self.key, self.uid, self.status)
