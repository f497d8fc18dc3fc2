"""How the operator reaches the node agents: the ``AgentDirectory`` interface.

The operator asks each node's agent for its ``NodeReport`` (the bubble cycles its trainings' hooks
reported, the progress of the fill jobs it drives), tells it about assignments and cancellations, and never
waits on an agent for long: an agent that does not answer counts as down, and the fill jobs it ran are
requeued by the pure reconcile.

Two directories implement it: ``GrpcAgents`` (``grpc_agents.py``), the agents over gRPC, what `bubbles operator`
uses with ``--agent-ca``; and ``InMemoryAgents``, agents as plain data, which the tests drive.
"""

from __future__ import annotations

from typing import Protocol

from bubbles.core.resources import NodeReport

from .decide import Assignment


class AgentDirectory(Protocol):
    async def report(self, node: str) -> NodeReport | None:
        """The node's report, or None if its agent does not answer (it is then treated as down)."""

    async def assign(self, assignment: Assignment) -> None:
        """Tell the node's agent which fill job will connect for which GPUs (a stage's ranks; idempotent per uid)."""

    async def cancel(self, node: str, uid: str) -> None:
        """Tell the node's agent to stop the fill job (idempotent)."""


class InMemoryAgents:
    """Agents as plain data: reports set by the caller, assignments and cancellations recorded."""

    def __init__(self) -> None:
        self.reports: dict[str, NodeReport] = {}
        self.down: set[str] = set()
        self.assigned: list[Assignment] = []
        self.cancelled: list[tuple[str, str]] = []
        self._keys: set[tuple[str, int]] = set()  # (FillJob uid, attempt)

    async def report(self, node: str) -> NodeReport | None:
        if node in self.down:
            return None
        return self.reports.get(node, NodeReport(node))

    async def assign(self, assignment: Assignment) -> None:
        if (assignment.uid, assignment.attempt) not in self._keys:  # told again every round: kept once
            self._keys.add((assignment.uid, assignment.attempt))
            self.assigned.append(assignment)

    async def cancel(self, node: str, uid: str) -> None:
        if (node, uid) not in self.cancelled:
            self.cancelled.append((node, uid))
