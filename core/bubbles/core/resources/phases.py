"""Where a resource is and what happened to it: the FillJob's phases and both resources' conditions.

The operator writes them in the statuses, the CRDs' printer columns show them and the docs name them: one
definition here keeps the three from drifting apart. ``set_condition`` updates a list of conditions as
``meta.SetStatusCondition`` does; ``conditions_field`` is their schema in both statuses.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .schema import Field


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
    """``t`` as Kubernetes writes times: RFC 3339 in UTC, to the second."""
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


def conditions_field() -> Field:
    """``status.conditions`` of either resource: a list of ``Condition``s."""
    return Field("conditions", "array", "the latest observations of the object's state", items=Field(
        "condition", "object", "one condition", fields=(
            Field("type", "string", "the condition's type, e.g. Placed", required=True, max_length=316),
            Field("status", "string", "True, False or Unknown", required=True, enum=("True", "False", "Unknown")),
            Field("reason", "string", "why, in one CamelCase word", required=True, max_length=1024),
            Field("message", "string", "why, for people", max_length=32768),
            Field("lastTransitionTime", "string", "when the status last changed (RFC 3339)"),
            Field("observedGeneration", "integer", "the generation the condition was set for", minimum=0),
        )))
