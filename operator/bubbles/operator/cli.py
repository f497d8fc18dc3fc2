"""``bubbles operator``: the control-plane operator for FillJob and PipelineTraining resources.

It watches the custom resources and the training Pods (kopf), places fill jobs on profiled bubbles with
``bubbles.operator.scheduler``, creates each fill job's Pod on its training's node and keeps both resources' status
current (``bubbles.operator.shell``). With ``--leader-election`` (the default) only the holder of a
coordination.k8s.io Lease acts. Bad flags exit 2 with a message saying what to fix.

The node agents are called over gRPC with TLS (``bubbles.operator.grpc_agents``): ``--agent-ca`` and a client
certificate or token. Without ``--agent-ca`` no agent is called: FillJobs are validated and queued, and
PipelineTrainings report their Pods and that no hook reports (a warning says so at start).

Nothing here imports kopf, kubernetes, torch or DeepSpeed at module level: ``bubbles operator --help`` works
on any install.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

from bubbles.core.api import DEFAULT_CUDA_CONTEXT_MIB, check_cuda_context_mib

from .fillpod_flags import add_fill_pod_arguments, fill_pod_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the Kubernetes operator: reconcile FillJob and PipelineTraining resources, place fill jobs in the "
        "bubbles of profiled trainings, create their Pods and keep their status current."
    )
    parser.add_argument("--kubeconfig", type=Path, default=None, metavar="FILE",
                        help="kubeconfig to use (default: the Pod's ServiceAccount in a cluster, else $KUBECONFIG "
                             "or ~/.kube/config)")
    parser.add_argument("--policy", default="fifo", metavar="NAME",
                        help="scheduling policy among queued jobs of equal priority: fifo, sjf, makespan, deadline "
                             "or one registered in the bubbles.policies entry-point group (default fifo)")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between reconcile rounds when nothing changes (default 2)")
    parser.add_argument("--full-pass-interval", type=float, default=30.0, metavar="SECONDS",
                        help="a round looks again only at what changed since the last; at least this often at every "
                             "FillJob and PipelineTraining, a safety net (default 30)")
    parser.add_argument("--identity", default=None, metavar="NAME",
                        help="this replica's name in the Lease (default: the host name, i.e. the Pod's name)")
    scope = parser.add_argument_group("which namespaces to watch")
    where = scope.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", action="append", default=[], metavar="NAME",
                       help="watch FillJob and PipelineTraining resources in this namespace; repeatable "
                            "(default: every namespace, as --all-namespaces)")
    where.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace, the default when no --namespace is given (needs a ClusterRole, "
                            "not a Role)")
    metrics = parser.add_argument_group("metrics")
    metrics.add_argument("--metrics-port", type=int, default=8080, metavar="PORT",
                         help="port of the Prometheus /metrics endpoint (0 = no endpoint; default 8080)")
    metrics.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDR",
                         help="bind address of the /metrics endpoint (default 0.0.0.0, for the pod's Service)")
    ha = parser.add_argument_group("leader election (more than one replica)")
    ha.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                    help="only the holder of a coordination.k8s.io Lease reconciles; the other replicas "
                         "wait (default: on; --no-leader-election for a single replica or a local run)")
    ha.add_argument("--lease-name", default="bubbles-operator", metavar="NAME",
                    help="name of the leader-election Lease (default bubbles-operator)")
    ha.add_argument("--lease-namespace", default=None, metavar="NAME",
                    help="namespace of the Lease (default: the operator pod's own namespace)")
    agents = parser.add_argument_group("node agents")
    agents.add_argument("--agent-port", type=int, default=7070, metavar="PORT",
                        help="port on which each node's `bubbles agent --cluster` serves the operator (gRPC; "
                             "default 7070)")
    agents.add_argument("--agent-selector", default="app.kubernetes.io/name=bubbles,app.kubernetes.io/component=agent",
                        metavar="LABELS", help="labels of the agent DaemonSet's Pods (key=value,...), through which "
                                               "the operator finds each node's agent")
    agents.add_argument("--agent-ca", type=Path, default=None, metavar="FILE",
                        help="CA certificate that signed the agents' server certificate; without it no agent is "
                             "called and nothing is placed")
    agents.add_argument("--agent-client-cert", type=Path, default=None, metavar="FILE",
                        help="the operator's client certificate for mutual TLS with the agents")
    agents.add_argument("--agent-client-key", type=Path, default=None, metavar="FILE",
                        help="its private key")
    agents.add_argument("--agent-token-file", type=Path, default=None, metavar="FILE",
                        help="a bearer token the agents accept (where no client certificate is issued)")
    agents.add_argument("--agent-server-name", default="bubbles-agent", metavar="NAME",
                        help="the name in the agents' server certificate (default bubbles-agent)")
    agents.add_argument("--agent-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="how long one call to an agent may take (default 2)")
    agents.add_argument("--agent-down-after", type=float, default=10.0, metavar="SECONDS",
                        help="an agent that has not answered for this long is down: its fill jobs are requeued "
                             "(default 10)")
    fill = parser.add_argument_group("fill Pods (what they share with the node agents)")
    fill.add_argument("--fill-pod-start-timeout", type=float, default=600.0, metavar="SECONDS",
                      help="a fill Pod the kubelet cannot start (its image cannot be pulled, a Secret it needs is "
                           "missing) is said on its FillJob at once, and taken off the stage and queued again this "
                           "long after its creation (default 600, at most 86400)")
    fill.add_argument("--fill-cuda-context-mib", type=int, default=DEFAULT_CUDA_CONTEXT_MIB, metavar="MIB",
                      help="what a fill process's own CUDA context takes on a GPU beside its memory limit, as the "
                           "agents' --cuda-context-mib: outside MPS the operator places a job only where its memory "
                           "and this fit (default 512; the chart sets both from agent.cudaContextMiB)")
    add_fill_pod_arguments(fill)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO)")


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.strip().partition("=")
    if not sep or not key or not value:
        raise ValueError(f"{text!r} is not key=value (e.g. app.kubernetes.io/component=agent)")
    return key, value


def _fail(message: str) -> int:
    print(f"bubbles operator: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.metrics_port <= 65535:
        return _fail(f"--metrics-port must be a TCP port (0 = no endpoint), got {args.metrics_port}")
    if not args.interval > 0:
        return _fail(f"--interval must be > 0 seconds, got {args.interval}")
    if not args.full_pass_interval > 0:
        return _fail(f"--full-pass-interval must be > 0 seconds, got {args.full_pass_interval}")
    from bubbles.operator.scheduler import UnknownPolicyError, get_policy

    try:
        get_policy(args.policy)
    except UnknownPolicyError as exc:
        return _fail(str(exc))
    import asyncio
    import signal

    from .agents import InMemoryAgents
    from .kube import Connection
    from .shell import GC_FULL_S, Operator, OperatorConfig

    if not 1 <= args.agent_port <= 65535:
        return _fail(f"--agent-port must be a TCP port, got {args.agent_port}")
    if not 0 < args.fill_pod_start_timeout <= 86400:
        return _fail(f"--fill-pod-start-timeout must be > 0 and at most 86400 seconds (a day), got "
                     f"{args.fill_pod_start_timeout:g}")
    try:
        check_cuda_context_mib(args.fill_cuda_context_mib, "--fill-cuda-context-mib")
    except ValueError as exc:
        return _fail(str(exc))
    if not args.agent_timeout > 0:
        return _fail(f"--agent-timeout must be > 0 seconds, got {args.agent_timeout}")
    if not args.agent_down_after >= 0:
        return _fail(f"--agent-down-after must be >= 0 seconds, got {args.agent_down_after}")
    try:
        selector = tuple(_label(part) for part in args.agent_selector.split(","))
    except ValueError as exc:
        return _fail(f"--agent-selector: {exc}")
    security = None
    if args.agent_ca is not None:
        from .grpc_agents import AgentCredentialsError, ClientSecurity

        security = ClientSecurity(args.agent_ca, args.agent_client_cert, args.agent_client_key,
                                  args.agent_token_file, args.agent_server_name)
        try:
            security.channel_credentials()  # read and check the files now, before anything starts
            security.metadata()
        except AgentCredentialsError as exc:
            return _fail(str(exc))
    elif args.agent_client_cert or args.agent_client_key or args.agent_token_file:
        return _fail("--agent-client-cert, --agent-client-key and --agent-token-file need --agent-ca (the CA that "
                     "signed the agents' server certificate)")
    fill_pods = fill_pod_settings(args)
    if isinstance(fill_pods, str):
        return _fail(fill_pods)
    try:
        connection = Connection.from_environment(args.kubeconfig)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    config = OperatorConfig(
        namespaces=tuple(args.namespace), clusterwide=args.all_namespaces or not args.namespace,
        policy=args.policy, interval_s=args.interval, leader_election=args.leader_election,
        lease_name=args.lease_name, lease_namespace=args.lease_namespace or connection.namespace or "default",
        identity=args.identity or socket.gethostname(), metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr, agent_selector=selector, agent_port=args.agent_port, fill_pods=fill_pods,
        pod_start_timeout_s=args.fill_pod_start_timeout, cuda_context_bytes=args.fill_cuda_context_mib << 20,
        full_pass_s=args.full_pass_interval, gc_full_s=GC_FULL_S)
    log = logging.getLogger("bubbles.operator")
    if security is None:
        log.warning("no --agent-ca: the node agents are not called, so no bubble profile reaches the operator and "
                    "fill jobs are validated and queued but not placed")
        op = Operator(config, connection, InMemoryAgents())
    else:
        from .grpc_agents import GrpcAgents

        holder: list[Operator] = []
        agents = GrpcAgents(lambda node: holder[0].agent_address(node), security, args.agent_timeout,
                            args.agent_down_after)
        op = Operator(config, connection, agents)
        holder.append(op)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await op.run(stop)

    asyncio.run(main())
    return 0
