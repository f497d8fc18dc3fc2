"""Whether a container may start with a GPU's fill slots: the device plugin's answer to ``PreStartContainer``, pure.

The kubelet gives a ``bubbles.dev/gpu-<index>`` slot to any Pod that requests one, and ``Allocate`` is not told which
Pod it serves. But that GPU is a training's: only the fill Pods the bubbles operator assigned to it may run there,
because only they are driven by the agent (paused outside the bubbles, killed when a bubble ends). So the plugin
announces ``pre_start_required``, and before each container holding slots starts, the kubelet calls
``PreStartContainer`` with its device IDs; the shell asks the kubelet's PodResources API which Pod holds them
(``bubbles.agent.podresources``) and the node agent which fill Pods it was assigned (``FillPodGpus``), and
``check_pre_start`` decides. A refusal fails that container's start (the kubelet says the message in the Pod's events
and tries again at its next sync), so a Pod assigned a moment later still starts.

The whole Pod is checked, not only the resource asked about: every ``bubbles.dev/gpu-*`` slot any of its containers
holds must be one of its assignment's GPUs (a gang's Pod holds one resource per GPU, each checked when the kubelet
calls that resource's plugin). Where the kubelet cannot be asked, the container is refused (``unreachable``): a Pod
let through would run on a training's GPU unguarded. So is an init container holding slots: the PodResources API
lists a Pod's containers, not its init containers (the operator's fill Pods give none a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bubbles.agent.podresources import ContainerDevices

from .decide import RESOURCE_DOMAIN, Advertised

GPU_RESOURCE_PREFIX = f"{RESOURCE_DOMAIN}/gpu-"
# What a Pod's owner reads in the event; the reason a refused Pod is not a fill Pod.
ONLY_FILL_PODS = "only FillJobs' Pods may request bubbles.dev/gpu-*: create a FillJob"


@dataclass(frozen=True)
class FillPodGpus:
    """A fill Pod the operator assigned to this node: its namespace and name, the FillJob and training it is for, and
    the GPUs (UUIDs) its assignment puts it on that this node knows (from the training's hook cards; empty while
    none is known). ``cancelled``: the reason, once the assignment was cancelled."""

    namespace: str
    pod: str
    job: str
    training: str  # "<namespace>/<name>", for the messages
    gpu_uuids: tuple[str, ...]
    cancelled: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A container the plugin refuses to let start. ``code``: the gRPC status name the shell answers with."""

    code: str
    message: str


def _refuse(code: str, message: str) -> Refusal:
    return Refusal(code, f"bubbles device plugin: {message}")


def unreachable(socket: Path, problem: str, resource: str) -> Refusal:
    """The refusal when the kubelet's PodResources API at ``socket`` cannot say who holds ``resource``'s slots."""
    return _refuse("UNAVAILABLE", f"cannot tell which Pod holds {resource}: the kubelet's PodResources API at "
                                  f"{socket} did not answer ({problem}); the container is refused, as a Pod let "
                                  "through would run on a training's GPU unguarded. Check that the agent's container "
                                  "mounts the kubelet's pod-resources directory at that path (--pod-resources-socket) "
                                  "and that the kubelet serves PodResources v1 (Kubernetes 1.20 or later); the "
                                  "kubelet starts the container again at its next sync")


def _gpu_of(served: Mapping[str, Advertised], resource: str, device_ids: Iterable[str]) -> str:
    """The GPU (UUID) a ``bubbles.dev/gpu-*`` resource's slots are of: the served resource's, else what its slot IDs
    name (a resource not served here any more)."""
    have = served.get(resource)
    if have is not None:
        return have.gpu.uuid
    uuids = sorted({d.rpartition("::")[0] or d for d in device_ids})
    return ", ".join(uuids) or "?"


def _pod_name(namespace: str, pod: str) -> str:
    return f"{namespace}/{pod}"


def check_pre_start(served: Mapping[str, Advertised], resource: str, device_ids: Sequence[str],
                    listing: Sequence[ContainerDevices], assigned: Sequence[FillPodGpus]) -> Refusal | None:
    """None when the container holding ``device_ids`` of ``resource`` may start, else why not (see the module
    documentation). ``served``: the plugin's resources; ``listing``: every container's devices, as the kubelet's
    PodResources API lists them; ``assigned``: the fill Pods the node agent holds assignments for."""
    have = served.get(resource)
    if have is None:
        known = ", ".join(sorted(served)) or "none"
        return _refuse("NOT_FOUND", f"resource {resource!r} is not served on this node (served: {known})")
    if not device_ids:
        return _refuse("INVALID_ARGUMENT", f"PreStartContainer for {resource} names no device")
    advertised = {d for d, _ in have.devices()}
    unknown = sorted(set(device_ids) - advertised)
    if unknown:
        return _refuse("INVALID_ARGUMENT", f"{resource} has no device {', '.join(unknown)} (it advertises "
                                           f"{have.fill_slots} slots of GPU {have.gpu.uuid})")
    wanted = set(device_ids)
    holders = [c for c in listing if c.resource == resource and wanted & set(c.device_ids)]
    unlisted = sorted(wanted - {d for c in holders for d in c.device_ids})
    if unlisted:
        return _refuse("FAILED_PRECONDITION", f"the kubelet's PodResources API lists no container holding "
                                              f"{', '.join(unlisted)} of {resource}, so whose Pod it is cannot be "
                                              "told; the container is refused (the kubelet starts it again at its "
                                              "next sync)")
    for namespace, pod in sorted({(c.namespace, c.pod) for c in holders}):
        refusal = _check_pod(served, namespace, pod, listing, assigned)
        if refusal is not None:
            return refusal
    return None


def _check_pod(served: Mapping[str, Advertised], namespace: str, pod: str, listing: Sequence[ContainerDevices],
               assigned: Sequence[FillPodGpus]) -> Refusal | None:
    """None when every GPU slot Pod ``namespace/pod`` holds is of a GPU its live assignment names."""
    name = _pod_name(namespace, pod)
    mine = [a for a in assigned if (a.namespace, a.pod) == (namespace, pod)]
    live = [a for a in mine if a.cancelled is None]
    if not live:
        if mine:
            a = mine[0]
            return _refuse("PERMISSION_DENIED", f"fill Pod {name}'s assignment (FillJob {a.job}, training "
                                                f"{a.training}) was cancelled ({a.cancelled}): it may no longer run "
                                                "on the training's GPU; the FillJob's next attempt is a new Pod")
        return _refuse("PERMISSION_DENIED", f"Pod {name} requests a bubbles.dev/gpu-* resource but is not a fill Pod "
                                            f"the bubbles operator assigned to this node: {ONLY_FILL_PODS}")
    allowed = {u for a in live for u in a.gpu_uuids}
    # Every GPU the Pod holds, by resource: a gang's other GPUs too, so no call lets a Pod through that another would
    # refuse.
    held: dict[str, set[str]] = {}
    for c in listing:
        if (c.namespace, c.pod) == (namespace, pod) and c.resource.startswith(GPU_RESOURCE_PREFIX):
            held.setdefault(c.resource, set()).update(c.device_ids)
    foreign = {r: _gpu_of(served, r, ids) for r, ids in sorted(held.items())}
    foreign = {r: gpu for r, gpu in foreign.items() if gpu not in allowed}
    if not foreign:
        return None
    jobs = ", ".join(sorted({a.job for a in live}))
    asked = ", ".join(f"{r} (GPU {gpu})" for r, gpu in foreign.items())
    if not allowed:
        return _refuse("PERMISSION_DENIED", f"fill Pod {name} (FillJob {jobs}, training {live[0].training}) requests "
                                            f"{asked}, but no GPU of its assignment is known on this node (the "
                                            "training's hook has written no card here yet, or its Pod is gone); the "
                                            "kubelet starts the container again at its next sync")
    return _refuse("PERMISSION_DENIED", f"fill Pod {name} (FillJob {jobs}) is assigned GPU(s) "
                                        f"{', '.join(sorted(allowed))} of training {live[0].training}; it requests "
                                        f"{asked} of another training (or of none): a fill Pod may hold only its "
                                        "assignment's GPUs, which the operator requests; was the Pod's spec "
                                        "edited, or did the training move?")
