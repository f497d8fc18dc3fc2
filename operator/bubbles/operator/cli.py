"""``bubbles operator``: the control-plane operator for FillJob and PipelineTraining resources.

It watches the custom resources and the training Pods (kopf), places fill jobs on profiled bubbles with
``bubbles.scheduler``, creates each fill job's Pod on its training's node and keeps both resources' status
current (``bubbles.operator.shell``). With ``--leader-election`` (the default) only the holder of a
coordination.k8s.io Lease acts. Bad flags exit 2 with a message saying what to fix.

Status (2026-11-23): the node agents do not serve the operator yet (their gRPC service is planned in the
operator issue), so no bubble profile reaches it: FillJobs are validated and queued with that reason, and
PipelineTrainings report their Pods and that no hook reports.

Nothing here imports kopf, kubernetes, torch or DeepSpeed at module level: ``bubbles operator --help`` works
on any install.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path


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
    parser.add_argument("--identity", default=None, metavar="NAME",
                        help="this replica's name in the Lease (default: the host name, i.e. the Pod's name)")
    scope = parser.add_argument_group("which namespaces to watch")
    where = scope.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", action="append", default=[], metavar="NAME",
                       help="watch FillJob and PipelineTraining resources in this namespace; repeatable "
                            "(default: the namespace the operator's pod runs in)")
    where.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (needs a ClusterRole instead of a Role)")
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
                        help="port on which each node's `bubbles agent` serves the operator (gRPC; planned: the "
                             "agent does not serve it yet; default 7070)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO)")


def _fail(message: str) -> int:
    print(f"bubbles operator: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.metrics_port <= 65535:
        return _fail(f"--metrics-port must be a TCP port (0 = no endpoint), got {args.metrics_port}")
    if not args.interval > 0:
        return _fail(f"--interval must be > 0 seconds, got {args.interval}")
    from bubbles.scheduler import UnknownPolicyError, get_policy

    try:
        get_policy(args.policy)
    except UnknownPolicyError as exc:
        return _fail(str(exc))
    import asyncio
    import signal

    from .agents import InMemoryAgents
    from .kube import Connection
    from .shell import Operator, OperatorConfig

    try:
        connection = Connection.from_environment(args.kubeconfig)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    config = OperatorConfig(
        namespaces=tuple(args.namespace), clusterwide=args.all_namespaces or not args.namespace,
        policy=args.policy, interval_s=args.interval, leader_election=args.leader_election,
        lease_name=args.lease_name, lease_namespace=args.lease_namespace or connection.namespace or "default",
        identity=args.identity or socket.gethostname(), metrics_port=args.metrics_port or None,
        metrics_addr=args.metrics_addr)
    log = logging.getLogger("bubbles.operator")
    log.warning("the node agents do not serve the operator yet (planned): no bubble profile reaches it, so fill "
                "jobs are validated and queued but not placed")
    op = Operator(config, connection, InMemoryAgents())

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await op.run(stop)

    asyncio.run(main())
    return 0
