"""The fill Pods' settings as command-line flags: what every fill Pod shares with the node agents, which the chart
passes the operator from the agents' values. ``bubbles operator`` and ``bubbles template`` take the same flags."""

from __future__ import annotations

import argparse
from typing import Any


def add_fill_pod_arguments(fill: Any) -> None:
    """The settings every fill Pod shares with the node agents (the chart passes the agents' values): ``bubbles
    operator`` and ``bubbles template`` take the same flags."""
    fill.add_argument("--node-access", default="csi", metavar="csi|hostPath",
                      help="how fill Pods reach the node agents' sockets: csi (default; a CSI inline volume of "
                           "csi.bubbles.dev per Pod, served by the agents' CSI node plugin: no hostPath, runs as "
                           "--fill-run-as-user, Pod Security restricted) or hostPath (directories of the agents' run "
                           "directory, as the agents' UID --fill-uid: Pod Security privileged). The chart passes "
                           "nodeAccess")
    fill.add_argument("--fill-gpu-access", default="devicePlugin", metavar="devicePlugin|envvar",
                      help="how a fill Pod gets its GPUs: devicePlugin (default; it requests each GPU's resource "
                           "bubbles.dev/gpu-<index> from the agents' device plugin, as the agents report it) or "
                           "envvar (NVIDIA_VISIBLE_DEVICES=<UUID>, only where the NVIDIA runtime honours it from "
                           "unprivileged Pods). The chart passes operator.fillGpuAccess")
    fill.add_argument("--fill-run-as-user", type=int, default=None, metavar="UID",
                      help="with --node-access csi: the UID (and group, and fsGroup for claims) fill Pods run as; "
                           "not root (default 65532). Under MPS the trainings' UID: an MPS server serves one UID (the "
                           "chart passes operator.fillRunAsUser, else agent.runAsUser under MPS)")
    fill.add_argument("--node-run-dir", default="/run/bubbles", metavar="PATH",
                      help="with --node-access hostPath: the agents' run directory on the nodes, mounted into every "
                           "fill Pod (default /run/bubbles; the chart passes agent.runDir)")
    fill.add_argument("--fill-uid", type=int, default=None, metavar="UID",
                      help="with --node-access hostPath: run fill Pods as this user, the agents' UID (their sockets "
                           "are private to it; the chart passes agent.runAsUser). Default: the image's user")
    fill.add_argument("--fill-gid", type=int, default=None, metavar="GID",
                      help="and this group (agent.runAsGroup; hostPath)")
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
    from .decide.view import DEFAULT_FILL_RUN_AS_USER

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
    if args.fill_run_as_user is not None and args.node_access != "csi":
        return (f"--fill-run-as-user applies with --node-access csi; with --node-access {args.node_access} fill Pods "
                "run as the agents' UID (--fill-uid, --fill-gid)")
    try:
        return FillPodSettings(args.node_run_dir, args.fill_uid, args.fill_gid, args.fill_mps_pipe_dir,
                               DEFAULT_FILL_THREAD_PERCENTAGE if args.fill_mps_thread_percentage is None
                               else args.fill_mps_thread_percentage,
                               DEFAULT_SHM_DIR if args.fill_mps_shm_dir is None else args.fill_mps_shm_dir,
                               tuple(tolerations), args.fill_runtime_class or None, node_access=args.node_access,
                               gpu_access=args.fill_gpu_access,
                               fill_run_as_user=DEFAULT_FILL_RUN_AS_USER if args.fill_run_as_user is None
                               else args.fill_run_as_user)
    except ValueError as exc:
        return (f"--node-access/--fill-gpu-access/--fill-run-as-user/--node-run-dir/--fill-uid/--fill-gid/"
                f"--fill-mps-*/--fill-pod-tolerations/--fill-runtime-class: {exc}")

