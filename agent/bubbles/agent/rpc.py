"""The agent's gRPC service for the operator (``proto/bubbles/agentapi/v1alpha1/agent.proto``): a thin shell.

Every answer comes from the node (``bubbles.agent.cluster.NodeAgent``: ``report``, ``assign``, ``cancel``); this
module only converts messages (``bubbles.core.agentapi``), authenticates and serves.

Who may call: only the operator. The server always runs TLS (its certificate and key, from the chart's Secret)
and checks every call against each credential it is configured with:

- ``client_ca``: mutual TLS; a client without a certificate signed by that CA fails the handshake.
- ``token_file``: the caller sends ``authorization: Bearer <token>``; a missing or wrong token gets
  UNAUTHENTICATED. (The fallback where no client certificates are issued; with both set, both are required.)

A server configured with neither is refused at start (``SecurityError``); there is no plain-text mode.
``grpc.health.v1.Health`` answers without a token, on the same port and, for kubelet probes that cannot speak
TLS, on an optional plain-text health port that serves nothing else.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bubbles.core.agentapi import SERVICE, TOKEN_METADATA, ApiError, AssignmentMessage, assignment_from_pb, report_to_pb
from bubbles.core.agentapi.v1alpha1 import agent_pb2 as pb
from bubbles.core.agentapi.v1alpha1 import agent_pb2_grpc as pb_grpc
from bubbles.core.resources import NodeReport

from .node import Decision, Outcome, StaleAssignment

log = logging.getLogger("bubbles.agent.rpc")

DEFAULT_WATCH_INTERVAL_S = 5.0


class SecurityError(ValueError):
    """A server or client configuration that would not authenticate; the text says what to provide."""


class NodeService(Protocol):
    """What the service answers from (``NodeAgent``)."""

    def report(self) -> NodeReport: ...
    def assign(self, msg: AssignmentMessage) -> Decision: ...
    def cancel(self, uid: str, reason: str) -> bool: ...

    @property
    def version(self) -> int: ...


@dataclass(frozen=True)
class ServerSecurity:
    """The agent's credentials (files mounted from a Secret)."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None
    token_file: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise SecurityError("the agent's gRPC server needs a TLS certificate and key (--tls-cert, --tls-key)")
        if self.client_ca is None and self.token_file is None:
            raise SecurityError("the agent's gRPC server needs a way to authenticate the operator: a client CA for "
                                "mutual TLS (--client-ca) or a token file (--token-file)")
        try:
            pair = (self.key.read_bytes(), self.cert.read_bytes())
            ca = self.client_ca.read_bytes() if self.client_ca is not None else None
        except OSError as exc:
            raise SecurityError(f"cannot read the agent's TLS files: {exc}") from None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def token(self) -> bytes | None:
        if self.token_file is None:
            return None
        try:
            token = self.token_file.read_bytes().strip()
        except OSError as exc:
            raise SecurityError(f"cannot read the token file: {exc}") from None
        if len(token) < 16:
            raise SecurityError(f"the token in {self.token_file} is shorter than 16 bytes; use a random token "
                                "(the chart generates one)")
        return token


class AgentServicer(pb_grpc.AgentServicer):
    """The four calls, each authorized first."""

    def __init__(self, node: NodeService, token: bytes | None, watch_condition: Any = None) -> None:
        self.node = node
        self.token = token
        self.condition = watch_condition  # a threading.Condition notified when the report changes

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.token is None:
            return  # mutual TLS only: the handshake already checked the client's certificate
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                text = value if isinstance(value, str) else value.decode(errors="replace")
                got = text.removeprefix("Bearer ").strip().encode()
        if not got or not hmac.compare_digest(got, self.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "bubbles agent: a valid bearer token is required (authorization: Bearer <token>)")

    def Report(self, request: pb.ReportRequest, context: grpc.ServicerContext) -> pb.NodeReport:
        self._authorize(context)
        return report_to_pb(self.node.report())

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.NodeReport]:
        self._authorize(context)
        interval = request.interval_s if request.interval_s > 0 else DEFAULT_WATCH_INTERVAL_S
        if not interval <= 3600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"interval_s must be in (0, 3600], got {interval}")
        seen = -1
        while context.is_active():
            version = self.node.version
            if version != seen:
                seen = version
                yield report_to_pb(self.node.report())
                continue
            if self.condition is not None:
                with self.condition:
                    if self.node.version == seen:
                        self.condition.wait(interval)
            else:
                import time

                time.sleep(min(interval, 0.5))
            if self.node.version == seen:
                seen = -1  # nothing changed for a whole interval: report anyway (a heartbeat)

    def Assign(self, request: pb.AssignRequest, context: grpc.ServicerContext) -> pb.AssignReply:
        self._authorize(context)
        try:
            msg = assignment_from_pb(request)
            decision = self.node.assign(msg)
        except StaleAssignment as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ApiError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        outcome = {Outcome.ACCEPTED: pb.AssignReply.ACCEPTED, Outcome.ALREADY_ASSIGNED: pb.AssignReply.ALREADY_ASSIGNED,
                   Outcome.SUPERSEDED: pb.AssignReply.SUPERSEDED}[decision.outcome]
        return pb.AssignReply(outcome=outcome, message=decision.message)

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelReply:
        self._authorize(context)
        if not request.uid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Cancel needs the FillJob's uid")
        return pb.CancelReply(found=self.node.cancel(request.uid, request.reason))


@dataclass
class RpcServer:
    """A running server: ``port`` (the one bound, when 0 was asked), ``health_port``, ``stop()``."""

    server: grpc.Server
    port: int
    health_server: grpc.Server | None
    health_port: int | None
    health: health.HealthServicer

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        if self.health_server is not None:
            self.health_server.stop(grace_s).wait()


def serve(node: NodeService, address: str, security: ServerSecurity, *, health_address: str | None = None,
          watch_condition: Any = None, workers: int = 8) -> RpcServer:
    """Start the service on ``address`` (``host:port``; port 0: any free port) with ``security``."""
    token = security.token()
    servicer = AgentServicer(node, token, watch_condition)
    health_servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bubbles-rpc"),
                         options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_AgentServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port(address, security.credentials())
    if port == 0:
        raise OSError(f"cannot listen on {address} (in use, or not an address of this host)")
    server.start()
    health_server = None
    health_port = None
    if health_address is not None:
        health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="bubbles-health"),
                                    options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(health_address)
        if health_port == 0:
            server.stop(0)
            raise OSError(f"cannot listen on {health_address} for health checks")
        health_server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("gRPC service for the operator on %s (port %d, %s)%s", address, port,
             "mutual TLS" + (" and token" if token else "") if security.client_ca else "TLS and token",
             f"; health checks on {health_address} (port {health_port})" if health_address else "")
    return RpcServer(server, port, health_server, health_port, health_servicer)
