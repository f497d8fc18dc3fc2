"""The fill Pods' settings as command-line flags: what every fill Pod shares with the node agents, which the chart
passes the operator from the agents' values. ``bubbles operator`` and ``bubbles template`` take the same flags."""

from __future__ import annotations

import argparse
from typing import Any


def add_fill_pod_arguments(fill: Any) -> None:
    """The settings every fill Pod shares with the node agents (the chart passes the agents' values): ``bubbles
    operator`` and ``bubbles template`` take the same flags."""
    fill.add_argument("--node-run-dir", default="/run/bubbles", metavar="PATH",
                      help="the agents' run directory on the nodes, mounted into every fill Pod (default /run/bubbles; "
                           "the chart passes agent.runDir)")
    fill.add_argument("--fill-uid", type=int, default=None, metavar="UID",
                      help="run fill Pods as this user: the agents' UID (their sockets are private to it; the chart "
                           "passes agent.runAsUser). Default: the image's user")
    fill.add_argument("--fill-gid", type=int, default=None, metavar="GID", help="and this group (agent.runAsGroup)")
    fill.add_argument("--fill-mps-pipe-dir", default=None, metavar="PATH",
                      help="the agents run --isolation mps with this MPS pipe directory: fill Pods on a GPU join that "
                           "MPS server (the directory and --fill-mps-shm-dir mounted, the CUDA_MPS_* variables; the "
                           "chart passes agent.mps.pipeDir when agent.isolation is mps). Default: fill Pods are not "
                           "MPS clients")
    fill.add_argument("--fill-mps-thread-percentage", type=int, default=None, metavar="P",
                      help="the SM share of a fill Pod on MPS, 1-100, as the agents' --mps-thread-percentage "
                           "(default 50; needs --fill-mps-pipe-dir)")
    fill.add_argument("--fill-mps-shm-dir", default=None, metavar="PATH",
                      help="the node directory the agents' Pods mount at /dev/shm (the MPS server's shared state): "
                           "fill Pods on MPS mount it there too (default /dev/shm/bubbles-mps; the chart passes "
                           "agent.mps.shmDir; needs --fill-mps-pipe-dir)")
    fill.add_argument("--fill-runtime-class", default=None, metavar="NAME",
                      help="the RuntimeClass fill Pods run with unless their FillJob names one "
                           "(spec.runtimeClassName), e.g. nvidia where the NVIDIA container runtime is not the node's "
                           "default (the chart passes operator.fillRuntimeClassName). Default: the node's default "
                           "runtime")
    fill.add_argument("--fill-pod-tolerations", default="[]", metavar="JSON",
                      help="tolerations every fill Pod gets, a JSON list as in a Pod's spec.tolerations (the chart "
                           "passes operator.fillPodTolerations); each fill Pod also gets its training Pod's "
                           "tolerations and tolerates every NoSchedule taint of its training's node. Default: none")


def fill_pod_settings(args: argparse.Namespace) -> Any:
    """The FillPodSettings the flags of ``add_fill_pod_arguments`` give, or the error to print (a str)."""
    import json

    from bubbles.core.mps_client import DEFAULT_FILL_THREAD_PERCENTAGE, DEFAULT_SHM_DIR

    from .decide import FillPodSettings

    if args.fill_mps_thread_percentage is not None and args.fill_mps_pipe_dir is None:
        return "--fill-mps-thread-percentage needs --fill-mps-pipe-dir (the MPS pipe directory the agents use)"
    if args.fill_mps_shm_dir is not None and args.fill_mps_pipe_dir is None:
        return "--fill-mps-shm-dir needs --fill-mps-pipe-dir (the MPS pipe directory the agents use)"
    try:
        tolerations = json.loads(args.fill_pod_tolerations)
    except ValueError as exc:
        return (f"--fill-pod-tolerations must be a JSON list of tolerations ({exc}), e.g. "
                '\'[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]\'')
    if not isinstance(tolerations, list):
        return f"--fill-pod-tolerations must be a JSON list of tolerations, got {tolerations!r}"
    try:
        return FillPodSettings(args.node_run_dir, args.fill_uid, args.fill_gid, args.fill_mps_pipe_dir,
                               DEFAULT_FILL_THREAD_PERCENTAGE if args.fill_mps_thread_percentage is None
                               else args.fill_mps_thread_percentage,
                               DEFAULT_SHM_DIR if args.fill_mps_shm_dir is None else args.fill_mps_shm_dir,
                               tuple(tolerations), args.fill_runtime_class or None)
    except ValueError as exc:
        return f"--node-run-dir/--fill-uid/--fill-gid/--fill-mps-*/--fill-pod-tolerations/--fill-runtime-class: {exc}"

