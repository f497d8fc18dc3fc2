"""The agent's gRPC service and the operator's client, over real TLS on localhost.

Who may call is the point: mutual TLS with the operator's certificate, or a bearer token; a call with neither,
with a certificate from another CA, or with a wrong token is refused. The node behind the service is the real
``NodeAgent``; the client is the operator's ``GrpcAgents``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.agent_cluster import NODE, TR, assignment, write_card
from helpers.pki import SERVER_NAME, Pki

from bubbles.agent.cluster import ClusterConfig, NodeAgent
from bubbles.agent.config import AgentConfig
from bubbles.agent.isolation import IsolationConfig
from bubbles.agent.rpc import RpcServer, SecurityError, ServerSecurity, serve
from bubbles.core.agentapi import API_VERSION, SERVICE, assignment_to_pb
from bubbles.core.agentapi.v1alpha1 import agent_pb2 as pb
from bubbles.core.agentapi.v1alpha1 import agent_pb2_grpc as pb_grpc
from bubbles.core.api import FillState, IsolationMode, parse_spec
from bubbles.demo.orchestrate.processes import free_ports
from bubbles.operator.decide import Assignment
from bubbles.operator.grpc_agents import IDLE_CLOSE_S, AgentCredentialsError, ClientSecurity, GrpcAgents


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.make(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeAgent]:
    template = AgentConfig(run_dir=tmp_path / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template))
    n.start()
    yield n
    n.stop()


def start(node: NodeAgent, pki: Pki, *, mtls: bool = True, token: bool = False) -> RpcServer:
    security = ServerSecurity(pki.server.cert, pki.server.key, pki.ca.cert if mtls else None,
                              pki.token if token else None)
    return serve(node, "127.0.0.1:0", security, health_address="127.0.0.1:0", watch_condition=node.changed)


def stub(server: RpcServer, pki: Pki, client: str | None = "client") -> pb_grpc.AgentStub:
    issued = {"client": pki.client, "stranger": pki.stranger, None: None}[client]
    creds = grpc.ssl_channel_credentials(pki.ca.cert.read_bytes(), issued.key.read_bytes() if issued else None,
                                         issued.cert.read_bytes() if issued else None)
    channel = grpc.secure_channel(f"127.0.0.1:{server.port}", creds,
                                  options=[("grpc.ssl_target_name_override", SERVER_NAME)])
    return pb_grpc.AgentStub(channel)


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()  # type: ignore[no-any-return]


def test_mutual_tls_admits_the_operator_and_refuses_everyone_else(node: NodeAgent, pki: Pki) -> None:
    server = start(node, pki)
    try:
        assert stub(server, pki).Report(pb.ReportRequest(), timeout=10).node == NODE
        # No client certificate, or one from another CA: the handshake fails, nothing reaches the service.
        assert code_of(lambda: stub(server, pki, None).Report(pb.ReportRequest(), timeout=10)) \
            == grpc.StatusCode.UNAVAILABLE
        assert code_of(lambda: stub(server, pki, "stranger").Report(pb.ReportRequest(), timeout=10)) \
            == grpc.StatusCode.UNAVAILABLE
        # Health answers on the plain-text health port, and nothing else does there.
        health = grpc.insecure_channel(f"127.0.0.1:{server.health_port}")
        reply = health_pb2_grpc.HealthStub(health).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert code_of(lambda: pb_grpc.AgentStub(health).Report(pb.ReportRequest(), timeout=10)) \
            == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def test_a_token_is_the_fallback_and_a_wrong_or_missing_one_is_refused(node: NodeAgent, pki: Pki) -> None:
    server = start(node, pki, mtls=False, token=True)
    try:
        s = stub(server, pki, None)
        assert code_of(lambda: s.Report(pb.ReportRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: s.Report(pb.ReportRequest(), timeout=10,
                                        metadata=(("authorization", "Bearer wrong-token-but-long"),))) \
            == grpc.StatusCode.UNAUTHENTICATED
        token = pki.token.read_text().strip()
        good = (("authorization", f"Bearer {token}"),)
        assert s.Report(pb.ReportRequest(), timeout=10, metadata=good).node == NODE
        assert code_of(lambda: s.Cancel(pb.CancelRequest(uid="x"), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_a_server_without_credentials_does_not_start(node: NodeAgent, pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="TLS certificate and key"):
        serve(node, "127.0.0.1:0", ServerSecurity())
    with pytest.raises(SecurityError, match="authenticate the operator"):
        serve(node, "127.0.0.1:0", ServerSecurity(pki.server.cert, pki.server.key))
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(SecurityError, match="shorter than 16 bytes"):
        serve(node, "127.0.0.1:0", ServerSecurity(pki.server.cert, pki.server.key, token_file=short))


def test_assign_is_idempotent_and_bad_messages_get_a_clear_status(node: NodeAgent, pki: Pki) -> None:
    server = start(node, pki)
    try:
        s = stub(server, pki)
        request = assignment_to_pb(assignment())
        assert s.Assign(request, timeout=10).outcome == pb.AssignReply.ACCEPTED
        assert s.Assign(request, timeout=10).outcome == pb.AssignReply.ALREADY_ASSIGNED  # retried: nothing new
        assert s.Assign(assignment_to_pb(assignment(attempt=1)), timeout=10).outcome == pb.AssignReply.SUPERSEDED
        with pytest.raises(grpc.RpcError) as info:
            s.Assign(request, timeout=10)  # the old attempt, late
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "older" in info.value.details()
        (job,) = s.Report(pb.ReportRequest(), timeout=10).jobs
        assert (job.uid, job.attempt, job.state) == ("uid-1", 1, "SUBMITTED")
        for broken, why in ((pb.AssignRequest(), "uid"),
                            (pb.AssignRequest(uid="u", training="t", fill_pod="p"), "no spec"),
                            (pb.AssignRequest(uid="u", training="t", fill_pod="p", spec=pb.FillJobSpec(
                                name="x", interface="sideways", entry="m:C")), "interface")):
            with pytest.raises(grpc.RpcError) as info:
                s.Assign(broken, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in info.value.details()
        assert s.Cancel(pb.CancelRequest(uid="uid-1"), timeout=10).found is True
        assert s.Cancel(pb.CancelRequest(uid="uid-1"), timeout=10).found is False  # idempotent
        assert list(s.Report(pb.ReportRequest(), timeout=10).jobs) == []
    finally:
        server.stop()


def test_watch_streams_a_report_on_each_change(node: NodeAgent, pki: Pki) -> None:
    server = start(node, pki)
    try:
        stream = stub(server, pki).Watch(pb.WatchRequest(interval_s=30), timeout=20)
        first = next(stream)
        assert list(first.jobs) == []
        node.assign(assignment())
        second = next(stream)
        assert [j.uid for j in second.jobs] == ["uid-1"]
        stream.cancel()
    finally:
        server.stop()


def operator_assignment(node_name: str = NODE) -> Assignment:
    spec = parse_spec({"name": "fj", "entry": "bubbles.fill_examples.spin:SpinJob", "memory": "16Mi"})
    # With the PipelineTraining's limits, as the operator sends them (decide._limits).
    return Assignment("uid-9", 1, "ml", "fj", "ml/t", 0, node_name, "llama-0", "cpu", "fj-fj-a0", 0, None, spec,
                      slowdown_budget=0.02, max_fill_share=0.5, tail_risk=0.03)


def test_the_operators_client_reports_assigns_and_cancels(node: NodeAgent, pki: Pki) -> None:
    server = start(node, pki)
    write_card(node.run_dir)
    node.scan()
    address = f"127.0.0.1:{server.port}"

    async def scenario() -> None:
        agents = GrpcAgents({NODE: address}.get, ClientSecurity(pki.ca.cert, pki.client.cert, pki.client.key))
        try:
            report = await agents.report(NODE)
            assert report is not None and report.node == NODE
            assert [(s.training, s.pod, s.stage) for s in report.stages] == [("t", "llama-0", 0)]
            await agents.assign(operator_assignment())
            await agents.assign(operator_assignment())  # told again every round: kept once
            report = await agents.report(NODE)
            assert report is not None
            (job,) = report.jobs
            assert (job.uid, job.state) == ("uid-9", FillState.SUBMITTED)
            core = node.trainings[TR].agent.core  # the training's limits crossed the wire to its agent
            assert (core.config.guard.budget, core.config.guard.max_share, core.config.tail_risk) == (0.02, 0.5, 0.03)
            await agents.cancel(NODE, "uid-9")
            report = await agents.report(NODE)
            assert report is not None and report.jobs == ()
            assert await agents.report("node-without-agent") is None  # unresolved: counted as down
        finally:
            await agents.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()

    async def after_stop() -> None:
        agents = GrpcAgents({NODE: address}.get, ClientSecurity(pki.ca.cert, pki.client.cert, pki.client.key),
                            timeout_s=1.0)
        try:
            assert await agents.report(NODE) is None  # never answered: down, within the timeout
            await agents.assign(operator_assignment())  # does not raise: the next round tells it again
        finally:
            await agents.close()

    asyncio.run(after_stop())


def test_an_agent_that_misses_a_call_is_down_only_after_the_grace(node: NodeAgent, pki: Pki) -> None:
    server = start(node, pki)
    now = [0.0]

    async def scenario() -> None:
        agents = GrpcAgents({NODE: f"127.0.0.1:{server.port}"}.get,
                            ClientSecurity(pki.ca.cert, pki.client.cert, pki.client.key), timeout_s=1.0,
                            down_after_s=10.0, clock=lambda: now[0])
        try:
            good = await agents.report(NODE)
            assert good is not None
            server.stop(0)
            now[0] = 9.0
            assert await agents.report(NODE) == good  # one missed answer: the last report stands in
            now[0] = 10.5
            assert await agents.report(NODE) is None  # silent for longer than the grace: down
        finally:
            await agents.close()

    asyncio.run(scenario())


def test_a_node_no_longer_called_loses_its_channel_and_what_was_kept_for_it(node: NodeAgent, pki: Pki) -> None:
    """Nodes come and go in a cluster that scales: what the operator keeps per node must go with them."""
    server = start(node, pki)
    now = [0.0]

    async def scenario() -> None:
        addresses = {NODE: f"127.0.0.1:{server.port}", "gone": "127.0.0.1:1"}
        agents = GrpcAgents(addresses.get, ClientSecurity(pki.ca.cert, pki.client.cert, pki.client.key),
                            timeout_s=1.0, clock=lambda: now[0])
        try:
            await agents.report("gone")  # its agent does not answer; a channel is held for it all the same
            assert await agents.report(NODE) is not None and agents.held() == {NODE, "gone"}
            now[0] = IDLE_CLOSE_S - 1
            assert await agents.report(NODE) is not None and agents.held() == {NODE, "gone"}  # not yet
            now[0] = IDLE_CLOSE_S + 61  # "gone" last called IDLE_CLOSE_S + 61 s ago; NODE 62 s ago
            assert await agents.report(NODE) is not None
            assert agents.held() == {NODE}
            assert await agents.report("gone") is None and agents.held() == {NODE, "gone"}  # back: a new channel
        finally:
            await agents.close()

    asyncio.run(scenario())


def test_the_client_refuses_to_start_without_a_way_to_authenticate(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(AgentCredentialsError, match="client certificate"):
        GrpcAgents(lambda n: None, ClientSecurity(pki.ca.cert))
    with pytest.raises(AgentCredentialsError, match="go together"):
        GrpcAgents(lambda n: None, ClientSecurity(pki.ca.cert, cert=pki.client.cert))
    with pytest.raises(AgentCredentialsError, match="cannot read"):
        GrpcAgents(lambda n: None, ClientSecurity(tmp_path / "missing.crt", token_file=pki.token))


def test_bubbles_agent_cluster_flags_are_checked_before_anything_starts(tmp_path: Path, pki: Pki) -> None:
    def agent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(tmp_path / "run"),
                               *args], capture_output=True, text=True, timeout=60)

    tls = ("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key))
    for args, message in ((("--cluster",), "needs the node's name"),
                          (("--cluster", "--node", "n"), "TLS only"),
                          (("--cluster", "--node", "n", *tls), "authenticate the operator"),
                          (("--cluster", "--node", "n", *tls, "--client-ca", str(tmp_path / "nope")), "does not exist"),
                          (("--cluster", "--node", "n", *tls, "--token-file", str(pki.token), "--listen", "7070"),
                           "HOST:PORT"),
                          (("--cluster", "--node", "n", *tls, "--token-file", str(pki.token), "--gpus", "cuda:0"),
                           "GPU-<uuid>=cuda:N"),
                          (("--node", "n"), "only apply with --cluster")):
        result = agent(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def test_bubbles_agent_cluster_serves_health_and_metrics_and_stops_on_sigterm(tmp_path: Path, pki: Pki) -> None:
    import signal
    import time
    import urllib.request

    grpc_port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bubbles.cli", "agent", "--cluster", "--node", "node-x",
         "--run-dir", str(tmp_path / "run"), "--listen", f"127.0.0.1:{grpc_port}",
         "--health-listen", f"127.0.0.1:{health_port}", "--tls-cert", str(pki.server.cert), "--tls-key",
         str(pki.server.key), "--client-ca", str(pki.ca.cert), "--metrics-port", str(metrics_port),
         "--isolation", "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{health_port}"))
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service="bubbles.agentapi.v1alpha1.Agent"),
                                     timeout=2)
                break
            except grpc.RpcError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'bubbles_fill_assignments{state="waiting"} 0.0' in text
        creds = grpc.ssl_channel_credentials(pki.ca.cert.read_bytes(), pki.client.key.read_bytes(),
                                             pki.client.cert.read_bytes())
        channel = grpc.secure_channel(f"127.0.0.1:{grpc_port}", creds,
                                      options=[("grpc.ssl_target_name_override", SERVER_NAME)])
        assert pb_grpc.AgentStub(channel).Report(pb.ReportRequest(), timeout=10).node == "node-x"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_an_agent_serving_another_api_version_is_reported_with_both_versions(
        pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    """An agent of another release serves another gRPC package (a breaking change gets one): each call answers
    UNIMPLEMENTED, and the operator's log names its API version and what to upgrade instead of a bare status code."""
    import concurrent.futures
    import logging

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))  # serves no bubbles.agentapi.v1alpha1 at all
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(pki.server.key.read_bytes(), pki.server.cert.read_bytes())], pki.ca.cert.read_bytes(), True))
    server.start()

    async def scenario() -> None:
        agents = GrpcAgents({NODE: f"127.0.0.1:{port}"}.get,
                            ClientSecurity(pki.ca.cert, pki.client.cert, pki.client.key), timeout_s=5.0)
        try:
            assert await agents.report(NODE) is None
        finally:
            await agents.close()

    try:
        with caplog.at_level(logging.WARNING, logger="bubbles.operator.agents"):
            asyncio.run(scenario())
    finally:
        server.stop(0)
    (said,) = [r.getMessage() for r in caplog.records if NODE in r.getMessage()]
    assert "UNIMPLEMENTED" in said
    assert f"the agent API {API_VERSION} ({SERVICE})" in said
    assert "upgrade the chart so the operator and every agent run the same release" in said
