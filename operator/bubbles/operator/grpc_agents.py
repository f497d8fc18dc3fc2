"""The operator's side of the node agents' gRPC API: ``GrpcAgents``, an ``AgentDirectory`` over the network.

Each node's agent is found through ``resolve`` (node name -> ``host:port``; the shell resolves it from the agent
DaemonSet's Pods) and called with TLS: the agent's certificate is checked against ``ca`` (with one name,
``server_name``, for every node's agent, as the chart issues it), and the operator proves itself with a client
certificate (mutual TLS) and/or a bearer token. Calls are bounded by ``timeout_s``. An agent that misses a call is
not down at once (one slow answer must not evict every fill job on the node): its last report stands in for
``down_after_s``; after that it counts as down and the reconcile requeues its jobs. ``assign`` and ``cancel``
never raise: the reconcile sends an assignment again every round until the agent reports the run, and a cancel
that does not arrive is covered by the fill Pod's deletion in the same round (its process ends with its Pod).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from bubbles.core import versions
from bubbles.core.agentapi import (
    API_VERSION,
    SERVICE,
    TOKEN_METADATA,
    ApiError,
    AssignmentMessage,
    assignment_to_pb,
    report_from_pb,
)
from bubbles.core.agentapi.v1alpha1 import agent_pb2 as pb
from bubbles.core.agentapi.v1alpha1 import agent_pb2_grpc as pb_grpc
from bubbles.core.resources import NodeReport

from .decide import Assignment

log = logging.getLogger("bubbles.operator.agents")
IDLE_CLOSE_S = 600.0  # a node's channel and what is kept for it go once it has not been called for this long


class AgentCredentialsError(ValueError):
    """Client credentials that cannot work; the text says what to provide."""


@dataclass(frozen=True)
class ClientSecurity:
    """How the operator calls the agents (files mounted from the chart's Secret)."""

    ca: Path  # verifies the agents' server certificates
    cert: Path | None = None  # the operator's client certificate (mutual TLS)
    key: Path | None = None
    token_file: Path | None = None
    server_name: str = "bubbles-agent"  # the name in the agents' certificate (one certificate for every node)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise AgentCredentialsError("--agent-client-cert and --agent-client-key go together")
        if self.cert is None and self.token_file is None:
            raise AgentCredentialsError("the operator needs a client certificate (--agent-client-cert/-key) or a "
                                        "token (--agent-token-file) to call the node agents")
        try:
            ca = self.ca.read_bytes()
            key = self.key.read_bytes() if self.key is not None else None
            cert = self.cert.read_bytes() if self.cert is not None else None
        except OSError as exc:
            raise AgentCredentialsError(f"cannot read the agent TLS files: {exc}") from None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self.token_file is None:
            return ()
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise AgentCredentialsError(f"cannot read the agent token file: {exc}") from None
        return ((TOKEN_METADATA, f"Bearer {token}"),)


def failure(exc: grpc.aio.AioRpcError) -> str:
    """What a failed call says, with the versions where the agent does not serve this operator's API version."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return (f"UNIMPLEMENTED: the agent does not serve the agent API {API_VERSION} ({SERVICE}) that this operator "
                f"(release {versions.release()}) speaks; it runs another release: upgrade the chart so the operator "
                "and every agent run the same release")
    return f"{exc.code().name}: {exc.details()}"


def assignment_message(a: Assignment) -> AssignmentMessage:
    """What the agent API carries of an assignment: the training by name (its namespace is the FillJob's), the GPUs
    as the stage's ranks."""
    if a.job is None:
        raise ValueError(f"assignment of {a.namespace}/{a.name} carries no fill-job spec")
    return AssignmentMessage(a.uid, a.generation, a.attempt, a.namespace, a.name, a.training.split("/", 1)[-1],
                             a.stage, a.pod, a.device, a.fill_pod, a.job, a.gpu_uuid, a.slowdown_budget,
                             a.max_fill_share, a.tail_risk, a.ranks)


class GrpcAgents:
    """``AgentDirectory`` over gRPC; see the module's documentation."""

    def __init__(self, resolve: Callable[[str], str | None], security: ClientSecurity, timeout_s: float = 2.0,
                 down_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.resolve = resolve
        self.security = security
        self.timeout_s = timeout_s
        self.down_after_s = down_after_s
        self.clock = clock
        self._last: dict[str, tuple[float, NodeReport]] = {}  # node -> (when, its last good report)
        self._credentials = security.channel_credentials()
        self._metadata = security.metadata()
        self._channels: dict[str, tuple[str, grpc.aio.Channel, pb_grpc.AgentStub]] = {}  # node -> address, ...
        self._closing: list[grpc.aio.Channel] = []
        self._logged: dict[str, float] = {}
        self._used: dict[str, float] = {}  # node -> when it was last called (self.clock)
        self._next_prune = -math.inf

    def _prune(self) -> None:
        """Close what is kept for nodes not called for ``IDLE_CLOSE_S``: in a cluster that scales its nodes, a node
        that has gone (or no longer runs a training) would otherwise keep its channel, its last report and its log
        throttle for the operator's life. At most once a minute."""
        now = self.clock()
        if now < self._next_prune:
            return
        self._next_prune = now + 60.0
        for node in [n for n, t in self._used.items() if now - t > IDLE_CLOSE_S]:
            have = self._channels.pop(node, None)
            if have is not None:
                self._closing.append(have[1])
            for kept in (self._used, self._last, self._logged):
                kept.pop(node, None)

    def held(self) -> set[str]:
        """The nodes this client holds a channel to."""
        return set(self._channels)

    def _stub(self, node: str) -> pb_grpc.AgentStub | None:
        self._used[node] = self.clock()
        address = self.resolve(node)
        if address is None:
            self._warn(node, f"no bubbles agent found on node {node} (is the agent DaemonSet running there?)")
            return None
        have = self._channels.get(node)
        if have is not None and have[0] == address:
            return have[2]
        if have is not None:  # the node's agent moved (a new Pod): its old channel is closed in the background
            self._closing.append(have[1])
        channel = grpc.aio.secure_channel(address, self._credentials, options=[
            ("grpc.ssl_target_name_override", self.security.server_name),
            ("grpc.default_authority", self.security.server_name)])
        stub = pb_grpc.AgentStub(channel)
        self._channels[node] = (address, channel, stub)
        return stub

    def _warn(self, node: str, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(node, -1e9) >= 30.0:  # at most every 30 s per node
            self._logged[node] = now
            log.warning("%s", message)

    async def report(self, node: str) -> NodeReport | None:
        """The node's report; its last good one for ``down_after_s`` after the agent stops answering; then None."""
        self._prune()
        while self._closing:
            await self._closing.pop().close()
        report = await self._ask(node)
        now = self.clock()
        if report is not None:
            self._last[node] = (now, report)
            return report
        last = self._last.get(node)
        if last is not None and now - last[0] <= self.down_after_s:
            return last[1]
        self._last.pop(node, None)
        return None

    async def _ask(self, node: str) -> NodeReport | None:
        stub = self._stub(node)
        if stub is None:
            return None
        try:
            reply = await stub.Report(pb.ReportRequest(), timeout=self.timeout_s, metadata=self._metadata)
            report = report_from_pb(reply)
        except grpc.aio.AioRpcError as exc:
            self._warn(node, f"the bubbles agent on {node} did not answer: {failure(exc)}")
            return None
        except ApiError as exc:
            self._warn(node, f"the bubbles agent on {node} sent a report this operator cannot use: {exc}")
            return None
        if report.node != node:
            self._warn(node, f"the agent resolved for node {node} says it runs on {report.node!r}: not used")
            return None
        return report

    async def assign(self, assignment: Assignment) -> None:
        if assignment.job is None:
            raise ValueError(f"assignment of {assignment.namespace}/{assignment.name} carries no fill-job spec")
        stub = self._stub(assignment.node)
        if stub is None:
            return
        try:
            await stub.Assign(assignment_to_pb(assignment_message(assignment)), timeout=self.timeout_s,
                              metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            self._warn(assignment.node, f"assigning {assignment.namespace}/{assignment.name} to the agent on "
                       f"{assignment.node} failed ({failure(exc)}); told again next round")

    async def cancel(self, node: str, uid: str) -> None:
        stub = self._stub(node)
        if stub is None:
            return
        try:
            await stub.Cancel(pb.CancelRequest(uid=uid, reason="the FillJob was deleted, evicted or finished"),
                              timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            self._warn(node, f"cancelling {uid} on the agent on {node} failed ({failure(exc)})")

    async def close(self) -> None:
        for _, channel, _ in self._channels.values():
            await channel.close()
        for channel in self._closing:
            await channel.close()
        self._channels.clear()
        self._closing.clear()
