"""The fill Pod, as pure ``build_*``-style functions of a FillJob and its assignment: its name, its place, its
mounts, its manifest; and what the kubelet says when it cannot start one."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any

from bubbles.core import control, mps_client, nodeaccess, paths
from bubbles.core.nodeaccess import GpuAccess, NodeAccess
from bubbles.core.resources import API_VERSION, VOLUME_SOURCES, FillJobResource, ResourceError, inside

from .view import RUN_DIR, Assignment, FillPodSettings


def fill_pod_name(name: str, attempt: int) -> str:
    """Deterministic, so a retried create conflicts instead of starting the job twice; a name too long for a
    Pod keeps a hash of the whole so two long names never share a Pod."""
    full = f"fj-{name}-a{attempt}"
    if len(full) <= 253:
        return full
    return f"fj-{name[:200]}-{_digest(name)}-a{attempt}"


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 characters): long ones keep a prefix and a hash of the whole."""
    return text if len(text) <= 63 else f"{text[:50].rstrip('-_.')}-{_digest(text)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


# Kubelet reasons a container waits for that are failures to start it, not steps of starting it.
_IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                            "RegistryUnavailable", "ImageInspectError", "SignatureValidationFailed"})


def pod_not_starting(pod: Mapping[str, Any]) -> str | None:
    """Why the kubelet cannot start a Pending Pod ("Reason: message" of its first container that waits for a failure
    to start it), or None while it is only starting (ContainerCreating, PodInitializing) or not started at all."""
    st = pod.get("status") or {}
    for c in [*(st.get("initContainerStatuses") or ()), *(st.get("containerStatuses") or ())]:
        w = (c.get("state") or {}).get("waiting") or {}
        reason = str(w.get("reason") or "")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            return f"{reason}: {w['message']}" if w.get("message") else reason
    # A Pod the scheduler places (one with a claim: fill_pod_place) and cannot: the scheduler's own words.
    for c in st.get("conditions") or ():
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return f"Unschedulable: {c['message']}" if c.get("message") else "Unschedulable"
    return None



def not_starting(why: str, pod: str) -> tuple[str, str]:
    """What keeps a fill Pod from starting, from the kubelet's "Reason: message", and what to do about it."""
    reason = why.split(":", 1)[0].strip()
    if reason in _IMAGE_REASONS:
        return ("its image cannot be pulled", "check spec.image, and that the node can pull it (a private registry "
                "needs spec.imagePullSecrets, or an image pull secret on the namespace's default ServiceAccount)")
    if reason == "CreateContainerConfigError":
        return ("its container cannot be configured", f"a Secret or ConfigMap it needs may be missing (kubectl "
                f"describe pod {pod})")
    if reason == "Unschedulable":
        return ("the scheduler cannot place it on its training's node", "a claim of spec.volumes or "
                "spec.checkpoint bound to a volume that node cannot reach (another zone or node), or spec.resources "
                "more than the node has free; the scheduler's words are in the Running condition")
    return (reason or "the kubelet cannot start it", f"see kubectl describe pod {pod}")



# A fill Pod goes only to its training's node, where a cordon or a NoSchedule taint must not keep it out (the training
# is there already): as the DaemonSet controller does for its Pods.
NO_SCHEDULE_ANYWHERE = MappingProxyType({"operator": "Exists", "effect": "NoSchedule"})


def fill_pod_place(node: str, tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The fill Pod's place: the training's node (the bubbles are its GPU's), through the scheduler. A required node
    affinity on metadata.name pins it there, as the DaemonSet controller pins its Pods; never ``nodeName``, which
    skips the scheduler: current API servers refuse it beside scheduling gates (which Kueue's Pod integration and
    other admission webhooks add), and a claim of a WaitForFirstConsumer StorageClass is never bound without the
    scheduler. Tolerations: every NoSchedule taint (as above), then ``tolerations``, the training Pod's (it runs on
    that node: its NoExecute taints too) and the chart's, each once."""
    merged: list[dict[str, Any]] = []
    for t in (NO_SCHEDULE_ANYWHERE, *tolerations):
        if dict(t) not in merged:
            merged.append(dict(t))
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
            "tolerations": merged}


def fill_pod_node(spec: Mapping[str, Any]) -> str | None:
    """The node a fill Pod spec (``fill_pod``'s) is meant for: its nodeName, or the node its affinity requires."""
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    terms = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
              .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
    for term in terms:
        for f in term.get("matchFields") or ():
            if f.get("key") == "metadata.name" and f.get("operator") == "In" and len(f.get("values") or ()) == 1:
                return str(f["values"][0])
    return None


def check_paths(job: FillJobResource, settings: FillPodSettings) -> None:
    """ResourceError if the job's own storage (its volumes, its checkpoint) would lie in the MPS pipe directory its
    Pod mounts (the operator's --fill-mps-pipe-dir: a setting of the cluster's, unlike the paths the spec checks). In
    csi mode the Pod finds the pipe directory in its own volume under RUN_DIR, which the spec keeps apart already."""
    pipe = settings.mps_pipe_dir  # written plainly (FillPodSettings)
    if not pipe or settings.node_access is NodeAccess.CSI:
        return
    for where, path in job.container_paths():
        if inside(path, pipe):
            raise ResourceError(f"{where} {path!r} lies in {pipe}, the MPS pipe directory every fill Pod on a GPU "
                                "mounts (the operator's --fill-mps-pipe-dir, the chart's agent.mps.pipeDir): choose "
                                "a path apart from it")


def fill_pod_mounts(training: str, stage: int, node_run_dir: str, rank: int = 0,
                    ranks: Sequence[int] | None = None) -> list[tuple[str, str, str]]:
    """(volume name, path on the node, path in the Pod) of the directories of the node's run directory a fill Pod
    mounts, each at its place under RUN_DIR: the agent's attach socket's, and its GPU's fill sockets'
    (``paths.gpu_dir``): a gang's Pod (``ranks``, N of them) each of its GPUs' (volumes ``bubbles-fills``,
    ``bubbles-fills-1``... in ranks' order). Not the run directory: the GPU's other files (the training's lock and
    card, the agent's socket) and the node's other trainings stay out of the fill job's reach. ``training`` is
    ``namespace/name``."""
    namespace, _, name = training.rpartition("/")
    out = [("bubbles-attach", posixpath.join(node_run_dir, paths.ATTACH_DIR_NAME),
            posixpath.join(RUN_DIR, paths.ATTACH_DIR_NAME))]
    for i, r in enumerate(ranks if ranks is not None else (rank,)):
        key = paths.GpuKey(namespace or paths.LOCAL_NAMESPACE, name, stage, r)
        fills = posixpath.join(paths.gpu_relpath(key), paths.FILLS_DIR_NAME)
        out.append((f"bubbles-fills-{i}" if i else "bubbles-fills", posixpath.join(node_run_dir, fills),
                    posixpath.join(RUN_DIR, fills)))
    return out


# The csi Pod's one volume: a name FillJob specs may not use (resources.RUNTIME_VOLUMES); its attach socket is in it.
CSI_VOLUME = "bubbles-attach"


def fill_pod_gpu_error(a: Assignment, settings: FillPodSettings) -> str | None:
    """Why the fill Pod of ``a`` cannot be made (it would run without its GPU), or None: the fill Pods get their GPUs
    from the agent's device plugin, and the agent reports a GPU of the assignment without its resource."""
    if settings.gpu_access is not GpuAccess.DEVICE_PLUGIN or not a.uuids or len(a.gpu_resources) == len(a.uuids):
        return None
    return (f"the node agent on {a.node} reports no device-plugin resource for the GPU(s) of {a.training} stage "
            f"{a.stage} ranks {','.join(map(str, a.ranks))}, and fill Pods get their GPUs from the kubelet "
            "(the operator's --fill-gpu-access devicePlugin): enable the agent's device plugin (the chart's "
            "agent.devicePlugin.enabled) or choose operator.fillGpuAccess: envvar")


def fill_pod(job: FillJobResource, a: Assignment, settings: FillPodSettings | None = None) -> dict[str, Any]:
    """The fill job's Pod: on the training's node, on the GPU it was placed on, reaching the agent's node-local
    sockets at RUN_DIR. A gang's one Pod (``a.ranks``: N ranks) sees its N GPUs (cuda:0..N-1 in ranks' order) and is
    told the gang's size; the SDK starts one process per GPU, each told its gang rank.

    - ``settings.node_access`` csi: one CSI inline volume (role fill) at RUN_DIR, the Pod's own directory on the node
      with its own attach socket (the agent passes the fill sockets as file descriptors); the Pod runs as
      ``fill_run_as_user``, non-root, RuntimeDefault seccomp, no capabilities: Pod Security restricted. hostPath: the
      node's ``_attach`` and its GPUs' ``fills/`` directories by hostPath, as the agent's UID (``fill_pod_mounts``).
    - ``settings.gpu_access`` devicePlugin: the container requests each GPU's extended resource (the kubelet hands it
      over as the agent's device plugin says); ValueError where a GPU's resource is unknown (``fill_pod_gpu_error``:
      the Pod would run without it). envvar: NVIDIA_VISIBLE_DEVICES=<UUID>. Either way, a training whose GPU is not
      known (a CPU training) gives NVIDIA_VISIBLE_DEVICES=void: no GPU at all."""
    settings = settings or FillPodSettings()
    csi = settings.node_access is NodeAccess.CSI
    if (gpu_error := fill_pod_gpu_error(a, settings)) is not None:
        raise ValueError(gpu_error)
    mounts = [] if csi else fill_pod_mounts(a.training, a.stage, settings.node_run_dir, ranks=a.ranks)
    env = [
        {"name": "BUBBLES_FILL_JOB", "value": job.name},
        {"name": "BUBBLES_FILL_JOB_UID", "value": job.uid},  # with the attempt: how the process attaches to the agent
        {"name": "BUBBLES_FILL_ATTEMPT", "value": str(a.attempt)},
        {"name": "BUBBLES_TRAINING", "value": a.training.split("/", 1)[-1]},
        {"name": "BUBBLES_STAGE", "value": str(a.stage)},
        {"name": "BUBBLES_RANKS", "value": ",".join(map(str, a.ranks))},  # the stage's ranks (GPUs) it runs on
        {"name": "BUBBLES_DEVICE", "value": a.device},
        {"name": "BUBBLES_RUN_DIR", "value": RUN_DIR},
        {"name": "BUBBLES_MEMORY_BYTES", "value": str(job.job.memory_bytes)},
        {"name": "BUBBLES_MAX_STEPS", "value": str(job.steps)},
    ]
    if len(a.ranks) > 1:
        env.append({"name": control.GANG_SIZE_ENV, "value": str(len(a.ranks))})
    uuids = a.uuids
    gpu_limits: dict[str, str] = {}
    if uuids and settings.gpu_access is GpuAccess.DEVICE_PLUGIN:
        # Each GPU's resource, one slot of it: the kubelet asks the agent's device plugin, which hands over that GPU in
        # the form the node's runtime takes (and neutralizes an image's NVIDIA_VISIBLE_DEVICES=all where it must).
        # CUDA_VISIBLE_DEVICES (UUIDs) orders them as the ranks are, whatever order the runtime gives them in, and
        # shows nothing else: a GPU the kubelet did not give is not there to show.
        gpu_limits = {r: "1" for r in a.gpu_resources}
        env.append({"name": "CUDA_VISIBLE_DEVICES", "value": ",".join(uuids)})
        env = [e if e["name"] != "BUBBLES_DEVICE" else {"name": "BUBBLES_DEVICE", "value": "cuda:0"} for e in env]
    elif uuids:
        # The training's GPU(s), without asking the device plugin for any (they are the training's): the NVIDIA
        # container runtime exposes the GPUs this names to a Pod that requests none. Inside, they are the only GPUs, in
        # this order: cuda:0 (a gang's process i: cuda:i).
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": ",".join(uuids)})
        env = [e if e["name"] != "BUBBLES_DEVICE" else {"name": "BUBBLES_DEVICE", "value": "cuda:0"} for e in env]
    else:
        # No GPU of the training's is known: none at all, whatever the image's own ENV says (CUDA and PyTorch base
        # images set NVIDIA_VISIBLE_DEVICES=all, which on a node whose default runtime is NVIDIA's shows every GPU,
        # the trainings' among them). A GPU job here then fails at its start, closed.
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
    mps = settings.mps_pipe_dir if uuids else None
    # In csi mode the agent bind-mounts the node's MPS pipe directory into the Pod's own volume when it publishes it.
    pipe_in_pod = posixpath.join(RUN_DIR, nodeaccess.POD_MPS_PIPE_SUBDIR) if csi else mps
    if mps and pipe_in_pod:
        # The node's MPS server, as the agent's own fill processes join it: its pipe directory, the SM share, priority
        # below the training's, and the job's memory pinned on the one GPU the Pod sees (device 0). Variables the
        # CUDA driver reads when the process initializes CUDA: the Pod's environment has them from the start.
        # A job that declares no memory gets no pinned limit here: the node's agent refuses a GPU job without one,
        # with the reason, once its Pod attaches (raising here would stop every reconcile round).
        pinned_on = 0 if job.job.memory_bytes > 0 else None
        mps_env = mps_client.fill_client_env(PurePosixPath(pipe_in_pod), settings.mps_thread_percentage, pinned_on,
                                             job.job.memory_bytes)
        if pinned_on is not None and len(uuids) > 1:  # a gang's processes: the limit on each of its GPUs
            mps_env[mps_client.PINNED_LIMIT_ENV] = ",".join(mps_client.pinned_limit(i, job.job.memory_bytes)
                                                            for i in range(len(uuids)))
        env += [{"name": k, "value": v} for k, v in sorted(mps_env.items())]
    if job.job.gating_step_s is not None:
        env.append({"name": "BUBBLES_STEP_S", "value": repr(job.job.gating_step_s)})
    if job.checkpoint_path:
        env.append({"name": "BUBBLES_CHECKPOINT", "value": job.checkpoint_path})
    env += [dict(v) for v in job.env]  # spec.env: the job's own (names apart from the runtime's, checked)
    container: dict[str, Any] = {
        "name": "fill", "image": job.image, "env": env,
        "volumeMounts": ([{"name": CSI_VOLUME, "mountPath": RUN_DIR}] if csi else
                         [{"name": name, "mountPath": in_pod} for name, _, in_pod in mounts]),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    # spec.resources: the Pod's own CPU and host memory (quotas count them); and its GPUs' resources, requested and
    # limited alike (an extended resource is never overcommitted).
    resources = {kind: dict(v) for kind, v in job.pod_resources.items()}
    for kind in ("requests", "limits") if gpu_limits else ():
        resources.setdefault(kind, {}).update(gpu_limits)
    if resources:
        container["resources"] = resources
    if job.job.command:
        # The SDK attaches the process to the node's agent, then execs the command (same PID: the agent's handle).
        container["command"] = ["python", "-m", "bubbles.sdk", "--exec", "--", *job.job.command]
    else:
        container["command"] = ["python", "-m", "bubbles.sdk", "--entry", str(job.job.entry)]
        if job.job.args:
            container["env"].append({"name": "BUBBLES_FILL_ARGS", "value": json.dumps(job.job.args)})
    claims = bool(job.checkpoint_path and job.checkpoint_claim) or any(
        v.get("persistentVolumeClaim") for v in job.volumes)
    security: dict[str, Any]
    if csi:
        # Pod Security restricted: not root, the runtime's default seccomp profile (and, on the container, no
        # capabilities and no privilege escalation). Its volume is its own, so any UID reaches the agent through it.
        uid = settings.fill_run_as_user
        security = {"runAsUser": uid, "runAsGroup": uid, "runAsNonRoot": True,
                    "seccompProfile": {"type": "RuntimeDefault"}}
        group: int | None = uid
    else:
        security = {k: v for k, v in (("runAsUser", settings.run_as_user),
                                      ("runAsGroup", settings.run_as_group)) if v is not None}
        group = settings.run_as_group
    if claims and group is not None:
        # The job runs as a UID of the operator's choosing, not as whoever wrote its claims' files: the kubelet gives
        # the claims' files to its group (once, where their root does not have it already) so that the job can write
        # its results. (The CSI volume is left alone: its CSIDriver says fsGroupPolicy None.)
        security.update(fsGroup=group, fsGroupChangePolicy="OnRootMismatch")
    volumes: list[dict[str, Any]]
    if csi:
        # The Pod's own directory on the node, published by the node's agent (the kubelet names the Pod to it).
        volumes = [{"name": CSI_VOLUME, "csi": {"driver": nodeaccess.CSI_DRIVER,
                                                "volumeAttributes": {nodeaccess.ROLE_KEY: nodeaccess.Role.FILL.value}}}]
    else:
        # Both made by the node's agent before it reports the stage (the hook makes fills/ too): a Pod finds them there.
        volumes = [{"name": name, "hostPath": {"path": on_node, "type": "Directory"}} for name, on_node, _ in mounts]
    if mps and csi:
        # The MPS server's /dev/shm, in the Pod's volume too (the agent's bind mount of the node's directory): not host
        # IPC, and no hostPath.
        container["volumeMounts"].append({"name": CSI_VOLUME, "mountPath": mps_client.SHM_MOUNT,
                                          "subPath": nodeaccess.POD_MPS_SHM_SUBDIR})
    elif mps:
        # The agent's pipe directory, and its /dev/shm (a node directory the agent's Pod mounts there: the MPS server
        # keeps its shared state with its clients in /dev/shm). Not host IPC: the node's other IPC stays out.
        container["volumeMounts"] += [{"name": "mps-pipe", "mountPath": mps},
                                      {"name": "mps-shm", "mountPath": mps_client.SHM_MOUNT}]
        volumes += [{"name": "mps-pipe", "hostPath": {"path": mps, "type": "Directory"}},
                    {"name": "mps-shm", "hostPath": {"path": settings.mps_shm_dir, "type": "Directory"}}]
    if job.checkpoint_path and job.checkpoint_claim:
        # The job's state outlives its Pod: the next attempt (another node, maybe) restores from it.
        container["volumeMounts"].append({"name": "checkpoint", "mountPath": job.checkpoint_path})
        volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": job.checkpoint_claim}})
    for v in job.volumes:  # spec.volumes: the job's own (names and paths apart from the runtime's, checked)
        (source,) = [k for k in VOLUME_SOURCES if v.get(k) is not None]
        container["volumeMounts"].append({"name": v["name"], "mountPath": v["mountPath"],
                                          **{k: v[k] for k in ("subPath", "readOnly") if v.get(k) is not None}})
        volumes.append({"name": v["name"], source: dict(v[source])})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": a.fill_pod, "namespace": job.namespace,
            "labels": {"app.kubernetes.io/managed-by": "bubbles", "app.kubernetes.io/component": "fill-job",
                       "bubbles.dev/fill-job": label_value(job.name),
                       "bubbles.dev/training": label_value(a.training.split("/", 1)[-1])},
            "annotations": {"bubbles.dev/fill-job-uid": job.uid, "bubbles.dev/attempt": str(a.attempt)},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": "FillJob", "name": job.name, "uid": job.uid,
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            **fill_pod_place(a.node, (*a.tolerations, *settings.tolerations)),
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            **({"securityContext": security} if security else {}),
            **({"imagePullSecrets": [{"name": n} for n in job.image_pull_secrets]} if job.image_pull_secrets else {}),
            # The job's own RuntimeClass, else the chart's: the kubelet runs the Pod with that handler (the NVIDIA
            # container runtime where it is not the node's default).
            **({"runtimeClassName": rc} if (rc := job.runtime_class or settings.runtime_class) else {}),
            "containers": [container],
            "volumes": volumes,
        },
    }
