"""``bubbles template``: the Pod the operator would create for a FillJob placed on a stage of a node, as YAML.

An administrator asked to let FillJobs run in a namespace, and the policy engines that guard it (Pod Security
admission, Kyverno, Gatekeeper), see exactly what the operator will create there before anything runs: the same
``decide.fill_pod`` the operator calls, with the fill Pods' settings from the chart's values file or the operator's
own flags. Nothing here talks to a cluster.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bubbles.core import nodeaccess, paths
from bubbles.core.api import read_yaml
from bubbles.core.nodeaccess import GpuAccess
from bubbles.core.resources import DNS_NAME_PATTERN

from .decide.view import check_toleration
from .fillpod_flags import add_fill_pod_arguments, fill_pod_settings

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # a manifest not yet applied has no uid
_RESOURCE = re.compile(re.escape(nodeaccess.RESOURCE_DOMAIN) + r"/gpu-(0|[1-9][0-9]{0,3})")

# Chart value -> the operator flag the chart passes it as (helm/bubbles/templates/operator-deployment.yaml).
CHART_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("nodeAccess",), "node_access"),
    (("operator", "fillGpuAccess"), "fill_gpu_access"),
    (("operator", "fillRunAsUser"), "fill_run_as_user"),
    (("agent", "runDir"), "node_run_dir"),
    (("agent", "runAsUser"), "fill_uid"),
    (("agent", "runAsGroup"), "fill_gid"),
    (("operator", "fillPodTolerations"), "fill_pod_tolerations"),
)
CHART_MPS_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("agent", "mps", "pipeDir"), "fill_mps_pipe_dir"),
    (("agent", "mps", "shmDir"), "fill_mps_shm_dir"),
    (("agent", "mps", "threadPercentage"), "fill_mps_thread_percentage"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the Pod the operator would create for FILLJOB placed on rank R of stage K of NODE (YAML, for kubectl, "
        "Pod Security admission or a policy engine to check before a namespace is granted).")
    parser.add_argument("filljob", type=Path, metavar="FILLJOB", help="a FillJob manifest (YAML, as for kubectl apply)")
    parser.add_argument("--node", required=True, help="the node of the training's Pod")
    parser.add_argument("--stage", type=int, required=True, metavar="K", help="the pipeline stage it fills")
    parser.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                        help="the stage's rank (GPU) it fills, its index among the stage's ranks (default 0); a gang "
                             "(spec.gpus N) fills N ranks: give --rank N times, or --ranks")
    parser.add_argument("--ranks", default=None, metavar="R,R...",
                        help="the stage's ranks a gang fills, comma-separated (e.g. 0,1), instead of --rank")
    parser.add_argument("--gpu-uuid", action="append", default=None, metavar="UUID",
                        help="that rank's GPU, as its node's agent reports it (a gang: once per rank, in order)")
    parser.add_argument("--gpu-resource", action="append", default=None, metavar="NAME",
                        help="that GPU's extended resource, as its node's agent reports it (bubbles.dev/gpu-<index>, "
                             "its NVML index; a gang: once per rank, in order); needed with --gpu-uuid under "
                             "--fill-gpu-access devicePlugin")
    parser.add_argument("--device", default="cuda:0", help="that rank's device (default cuda:0)")
    parser.add_argument("--training", default="training", metavar="NAME",
                        help="the PipelineTraining, in the FillJob's namespace (default: training)")
    parser.add_argument("--training-pod", default=None, metavar="POD",
                        help="the training's Pod on NODE (default: NAME-K)")
    parser.add_argument("--training-pod-tolerations", default="[]", metavar="JSON",
                        help="that Pod's tolerations, a JSON list: the fill Pod gets them too (default: none)")
    parser.add_argument("--attempt", type=int, default=0, metavar="N", help="the attempt (status.restarts; default 0)")
    parser.add_argument("--values", type=Path, default=None, metavar="FILE",
                        help="the chart's values as Helm has them (helm get values RELEASE -n NAMESPACE --all): the "
                             "fill Pods' settings the chart passes the operator; a flag below given as well wins")
    fill = parser.add_argument_group("fill Pods (what they share with the node agents; as the operator's flags)")
    add_fill_pod_arguments(fill)


def _fail(message: str) -> int:
    print(f"bubbles template: {message}", file=sys.stderr)
    return 2


def _dig(values: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return None
        values = values[key]
    return values


def apply_values(args: argparse.Namespace, values: Any) -> None:
    """Take each fill-Pod setting from the chart's ``values`` where its flag was left at its default (ValueError
    where the file is not a values mapping)."""
    if not isinstance(values, dict):
        raise ValueError("is not a mapping of chart values (helm get values RELEASE --all -o yaml writes one)")
    pairs = list(CHART_FLAGS)
    mps = _dig(values, ("agent", "isolation")) == "mps"
    if mps:
        pairs += CHART_MPS_FLAGS
    csi = (_dig(values, ("nodeAccess",)) or "csi") == "csi"
    for path, dest in pairs:
        value = _dig(values, path)
        if dest == "fill_run_as_user" and (not csi or value in (None, "")):
            # As the chart passes it: only in csi mode; unset, under MPS the agents' (the trainings') UID.
            value = _dig(values, ("agent", "runAsUser")) if csi and mps else None
        if dest in ("node_run_dir", "fill_uid", "fill_gid") and csi:
            continue  # the chart passes the hostPath settings only in hostPath mode
        if value is None or getattr(args, dest) != _parser().get_default(dest):
            continue
        setattr(args, dest, json.dumps(value) if dest == "fill_pod_tolerations" else value)


def render(obj: Any, *, node: str, stage: int, device: str, training: str, training_pod: str,
           tolerations: tuple[dict[str, Any], ...], gpu_uuid: str | None, attempt: int,
           settings: Any, rank: int = 0, ranks: tuple[int, ...] | None = None,
           gpu_uuids: tuple[str, ...] = (), gpu_resources: tuple[str, ...] = ()) -> dict[str, Any]:
    """The Pod ``decide.fill_pod`` makes for the FillJob ``obj`` placed so (ValueError saying what is wrong with it):
    on ``rank``, or a gang's ``ranks`` (as many as its spec.gpus) with their ``gpu_uuids`` and ``gpu_resources``."""
    from bubbles.core.resources import FillJobResource, ResourceError

    from .decide import Assignment, fill_pod, fill_pod_name
    from .decide.pods import check_paths

    if not isinstance(obj, dict) or obj.get("kind") != "FillJob":
        raise ValueError("is not a FillJob manifest (kind: FillJob)")
    meta = dict(obj.get("metadata") or {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", PLACEHOLDER_UID)
    meta.setdefault("generation", 1)
    try:
        job = FillJobResource.from_object({**obj, "metadata": meta})
        check_paths(job, settings)
    except ResourceError as exc:
        raise ValueError(f"is not a valid FillJob: {exc}") from None
    ranks = ranks if ranks is not None else (rank,)
    if len(ranks) != job.gpus:
        raise ValueError(f"asks for {job.gpus} GPU(s) (spec.gpus) and is placed on {len(ranks)} rank(s) "
                         f"({','.join(map(str, ranks))}): give as many ranks (--rank, or --ranks 0,1)")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {','.join(map(str, ranks))} name a rank twice: a gang runs on distinct GPUs")
    if gpu_uuids and len(gpu_uuids) != len(ranks):
        raise ValueError(f"{len(gpu_uuids)} --gpu-uuid for {len(ranks)} rank(s): give one per rank, in order")
    if gpu_resources and len(gpu_resources) != len(ranks):
        raise ValueError(f"{len(gpu_resources)} --gpu-resource for {len(ranks)} rank(s): give one per rank, in order")
    if gpu_uuids and not gpu_resources and settings.gpu_access is GpuAccess.DEVICE_PLUGIN:
        raise ValueError("fill Pods get their GPUs from the agents' device plugin (--fill-gpu-access devicePlugin): "
                         "give each --gpu-uuid's --gpu-resource (bubbles.dev/gpu-<its index>), or --fill-gpu-access "
                         "envvar")
    for r in gpu_resources:
        if not _RESOURCE.fullmatch(r):
            raise ValueError(f"--gpu-resource {r!r} is not a GPU's resource as the agents' device plugin names it: "
                             "bubbles.dev/gpu-<index>, e.g. bubbles.dev/gpu-0")
    a = Assignment(job.uid, job.generation, job.namespace, job.name, f"{job.namespace}/{training}", stage, node,
                   training_pod, device, fill_pod_name(job.name, attempt), attempt,
                   gpu_uuids[0] if gpu_uuids else gpu_uuid, job.job, tolerations=tolerations, ranks=ranks,
                   gpu_uuids=gpu_uuids if len(ranks) > 1 else (), gpu_resources=gpu_resources)
    return fill_pod(job, a, settings)


def _ranks(args: argparse.Namespace) -> tuple[int, ...]:
    """The ranks of --rank (repeated) or --ranks; ValueError saying what is wrong."""
    if args.ranks is not None and args.rank is not None:
        raise ValueError("give --rank (once per rank) or --ranks, not both")
    if args.ranks is not None:
        try:
            return tuple(int(r) for r in args.ranks.split(","))
        except ValueError:
            raise ValueError(f"--ranks {args.ranks!r} must be ranks separated by commas, e.g. 0,1") from None
    return tuple(args.rank or (0,))


def run(args: argparse.Namespace) -> int:
    try:
        ranks = _ranks(args)
    except ValueError as exc:
        return _fail(str(exc))
    if args.stage < 0 or args.attempt < 0 or min(ranks) < 0:
        return _fail("--stage, --rank and --attempt must be >= 0")
    if args.values is not None:
        try:
            apply_values(args, read_yaml(args.values, "values file"))
        except (OSError, ValueError) as exc:
            return _fail(f"--values {args.values}: {exc}")
    settings = fill_pod_settings(args)
    if isinstance(settings, str):
        return _fail(settings)
    try:
        paths.check_name("training", args.training)
        if not re.match(DNS_NAME_PATTERN, args.node) or len(args.node) > 253:
            raise ValueError(f"--node {args.node!r} is not a node name (a DNS subdomain, e.g. gpu-node-7)")
    except ValueError as exc:
        return _fail(str(exc))
    try:
        tolerations = json.loads(args.training_pod_tolerations)
        if not isinstance(tolerations, list):
            raise ValueError("not a list")
        for i, tol in enumerate(tolerations):
            check_toleration(tol, f"--training-pod-tolerations[{i}]")
    except ValueError as exc:
        return _fail(f"--training-pod-tolerations must be a JSON list of tolerations ({exc})")
    try:
        obj = read_yaml(args.filljob, "FillJob manifest")
        pod = render(obj, node=args.node, stage=args.stage, device=args.device, training=args.training,
                     training_pod=args.training_pod or f"{args.training}-{args.stage}", tolerations=tuple(tolerations),
                     gpu_uuid=None, attempt=args.attempt, settings=settings, ranks=ranks,
                     gpu_uuids=tuple(args.gpu_uuid or ()), gpu_resources=tuple(args.gpu_resource or ()))
    except (OSError, ValueError) as exc:
        return _fail(f"{args.filljob}: {exc}")
    import yaml

    from .podsecurity import check

    sys.stdout.write(yaml.safe_dump(pod, sort_keys=False))
    # On stderr, so what is printed above stays a manifest: the level a namespace's Pod Security admission must allow.
    print(f"bubbles template: Pod Security Standards: this Pod {check(pod).summary()}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return p
