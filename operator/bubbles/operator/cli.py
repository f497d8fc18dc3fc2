"""``bubbles operator``: the control-plane operator (planned; the reconcilers are the next issue).

What exists today is the command line the operator will take, so that the Helm chart, the image and the
docs can be written against it: ``bubbles operator --help`` lists every flag. Running it says that the
reconcilers are not built yet and exits 2. The planned operator (kopf) reconciles ``FillJob`` and
``PipelineTraining`` resources, places fill jobs with ``bubbles.scheduler`` and talks to the node agents;
it never imports torch or DeepSpeed (import-linter contract ``operator`` in pyproject.toml).

Nothing here imports kopf, kubernetes, torch or DeepSpeed at module level: ``bubbles operator --help``
works on an install of the ``operator`` extra and on one without it.
"""

from __future__ import annotations

import argparse
import sys

PLANNED = (
    "Planned: the kopf reconcilers for FillJob and PipelineTraining are the subject of the operator issue and "
    "are not built yet; these flags are the interface they will take."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the Kubernetes operator, which will reconcile FillJob and PipelineTraining resources, place fill "
        f"jobs with the scheduler and drive the node agents. {PLANNED} Running it today says so and exits 2."
    )
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
                        help="port on which each node's `bubbles agent` will serve the operator (gRPC, planned "
                             "with the operator; default 7070)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO)")


def run(args: argparse.Namespace) -> int:
    print(f"bubbles operator: nothing to run yet. {PLANNED} "
          "Meanwhile `bubbles simulate` drives the scheduler and `bubbles agent` runs a node.",
          file=sys.stderr)
    return 2
