"""The fill-job life cycle (FreeRide section 3.1) as one explicit state machine.

SUBMITTED -> CREATED -> PAUSED <-> RUNNING, and STOPPED from any state. The agent drives it, the
operator mirrors it in ``status.phase``; every transition goes through ``transition`` so an invalid
one raises instead of silently corrupting a job's record.
"""

from __future__ import annotations

from bubbles.core.api import FillState

__all__ = ["FillState", "InvalidTransition", "can_transition", "transition"]

_ALLOWED: dict[FillState, frozenset[FillState]] = {
    FillState.SUBMITTED: frozenset({FillState.CREATED, FillState.STOPPED}),
    FillState.CREATED: frozenset({FillState.PAUSED, FillState.STOPPED}),
    FillState.PAUSED: frozenset({FillState.RUNNING, FillState.STOPPED}),
    FillState.RUNNING: frozenset({FillState.PAUSED, FillState.STOPPED}),
    FillState.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


def can_transition(current: FillState, target: FillState) -> bool:
    return target in _ALLOWED[current]


def transition(current: FillState, target: FillState) -> FillState:
    """Return ``target`` if the life cycle allows it from ``current``; raise InvalidTransition otherwise."""
    if target not in _ALLOWED[current]:
        raise InvalidTransition(f"fill job cannot go from {current} to {target}")
    return target
