"""What the device plugin advertises and answers: pure functions over the node's GPUs (no gRPC, no sockets).

One extended resource per GPU (``bubbles.dev/gpu-<index>``, the GPU's NVML index on this node), because the kubelet
chooses the devices within a resource itself: with one resource for all GPUs a fill Pod could not be pinned to the
training's GPU, only given *a* GPU. A resource that *is* one GPU makes the Pod's request name it. The resource's
devices are ``fill_slots`` interchangeable slots (``<UUID>::<k>``, the form NVIDIA's plugin gives a shared GPU's
replicas): how many fill Pods may hold that GPU at once. Every slot is healthy while its GPU is.

``allocate`` answers the kubelet's ``Allocate`` with that GPU's UUID in the form the administrator chose
(``GpuStrategy``), as NVIDIA's own device plugin does for its device-list strategies.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bubbles.core import nodeaccess

API_VERSION = "v1beta1"  # the RegisterRequest's version: the only device plugin API the kubelet has
RESOURCE_DOMAIN = nodeaccess.RESOURCE_DOMAIN
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_FILL_SLOTS = 4
MAX_FILL_SLOTS = 64  # far above what one GPU's bubbles can hold; a bound so a typo does not advertise thousands
CDI_GPU_KIND = "nvidia.com/gpu"  # the CDI spec NVIDIA's toolkit generates (nvidia-ctk cdi generate) names GPUs by UUID
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"  # the CDI annotation form container runtimes read (container-device-interface)
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
DEVICE_MOUNTS_ROOT = "/var/run/nvidia-container-devices"  # the NVIDIA runtime's volume-mounts list, one file per GPU
# What a CDI answer sets NVIDIA_VISIBLE_DEVICES to: no GPU through the NVIDIA runtime's own variable. CUDA base images
# set NVIDIA_VISIBLE_DEVICES=all in their ENV; where the NVIDIA runtime still reads it (its legacy mode, the node's
# default runtime beside CDI; its cdi mode turns "all" into every GPU's CDI device) the container would see every GPU
# of the node, the trainings' among them, besides the one CDI injects. The kubelet's variables override the image's.
# NVIDIA's own CDI specs (nvidia-ctk cdi generate) set the same in their containerEdits.
NO_VISIBLE_DEVICES = "void"


class GpuStrategy(enum.StrEnum):
    """How ``Allocate`` hands a GPU to the container: the administrator picks the one the node's runtime honours."""

    CDI = "cdi"  # ContainerAllocateResponse.cdi_devices: kubelet 1.28+ (on by default from 1.29) and a CDI runtime
    CDI_ANNOTATIONS = "cdi-annotations"  # cdi.k8s.io/ annotations: a CDI runtime under an older kubelet
    VOLUME_MOUNTS = "volume-mounts"  # NVIDIA runtime with accept-nvidia-visible-devices-as-volume-mounts
    ENVVAR = "envvar"  # NVIDIA_VISIBLE_DEVICES from the kubelet: the NVIDIA runtime's legacy mode

    @classmethod
    def parse(cls, text: object, what: str = "--gpu-strategy") -> GpuStrategy:
        """The strategy written ``text``; ValueError naming ``what`` and the choices."""
        if isinstance(text, cls):
            return text
        if isinstance(text, str):
            for s in cls:
                if s.value == text.strip().lower():
                    return s
        raise ValueError(f"{what} must be one of {', '.join(s.value for s in cls)} (the form the node's container "
                         f"runtime accepts a GPU in; docs/agent.md), got {text!r}")


def check_fill_slots(slots: object, what: str = "--fill-slots") -> int:
    """``slots`` if it is a whole number of fill slots per GPU; ValueError saying the range otherwise."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_FILL_SLOTS:
        raise ValueError(f"{what} must be a whole number from 1 to {MAX_FILL_SLOTS} (how many fill Pods may share "
                         f"one GPU at once), got {slots!r}")
    return slots


@dataclass(frozen=True, order=True)
class NodeGpu:
    """A GPU of this node as the plugin knows it: NVML's index, its UUID, and whether NVML still answers for it."""

    index: int
    uuid: str
    healthy: bool = True


_CUDA_DEVICE = re.compile(r"cuda:(\d+)")


def gpus_from_devices(devices: Mapping[str, str]) -> tuple[NodeGpu, ...]:
    """The agent's {UUID: "cuda:N"} (``bubbles.agent.gpus``, in NVML's order) as healthy GPUs by index; ValueError
    for a device that is not ``cuda:N`` or an index named twice."""
    out: dict[int, NodeGpu] = {}
    for uuid, device in devices.items():
        m = _CUDA_DEVICE.fullmatch(device)
        if m is None:
            raise ValueError(f"GPU {uuid} is {device!r}, not cuda:N; the device plugin needs each GPU's NVML index")
        index = int(m.group(1))
        if index in out:
            raise ValueError(f"GPUs {out[index].uuid} and {uuid} are both cuda:{index}; give each its own index")
        out[index] = NodeGpu(index, uuid)
    return tuple(sorted(out.values()))


def track_gpus(known: Iterable[NodeGpu], seen: Mapping[str, str] | None) -> tuple[NodeGpu, ...]:
    """The GPUs after a new look at the node. ``seen``: what NVML lists now ({UUID: "cuda:N"}), None when it could
    not be asked. A GPU seen is healthy (with the UUID now at its index); one known but not seen, or every known one
    when NVML failed, stays with its UUID and is unhealthy, so its resource stays advertised with unhealthy slots: the
    kubelet places no new Pod there and forgets none that hold a slot."""
    now = {g.index: g for g in gpus_from_devices(seen or {})}
    out = {g.index: NodeGpu(g.index, g.uuid, healthy=False) for g in known}
    out.update(now)
    return tuple(sorted(out.values()))


def resource_name(index: int) -> str:
    """The extended resource that is GPU ``index`` of this node (``nodeaccess.resource_name``)."""
    return nodeaccess.resource_name(index)


def slot_id(uuid: str, slot: int) -> str:
    """A fill slot's device ID (at most 63 characters: a 40-character UUID and its slot number)."""
    return f"{uuid}::{slot}"


@dataclass(frozen=True)
class Advertised:
    """One extended resource: its GPU and how many fill slots it offers."""

    gpu: NodeGpu
    fill_slots: int

    @property
    def name(self) -> str:
        return resource_name(self.gpu.index)

    @property
    def endpoint(self) -> str:
        """The plugin's socket, a file name in the kubelet's device-plugins directory (as RegisterRequest wants)."""
        return f"bubbles-gpu-{self.gpu.index}.sock"

    def devices(self) -> tuple[tuple[str, str], ...]:
        """(device ID, health) per fill slot: what ListAndWatch sends."""
        health = HEALTHY if self.gpu.healthy else UNHEALTHY
        return tuple((slot_id(self.gpu.uuid, k), health) for k in range(self.fill_slots))


def plan_resources(gpus: Iterable[NodeGpu], fill_slots: int) -> dict[str, Advertised]:
    """The resources to advertise, by name: one per GPU."""
    check_fill_slots(fill_slots)
    return {resource_name(g.index): Advertised(g, fill_slots) for g in sorted(gpus)}


@dataclass(frozen=True)
class Options:
    """DevicePluginOptions: PreStartContainer, where the plugin checks that the container's Pod is a fill Pod assigned
    that GPU (``guard``: ``Allocate`` is not told the Pod); no GetPreferredAllocation (the slots of a resource are
    interchangeable)."""

    pre_start_required: bool = True
    get_preferred_allocation_available: bool = False


OPTIONS = Options()


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerAllocation:
    """What the kubelet applies to one container (a ContainerAllocateResponse)."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


class AllocationRefused(ValueError):
    """An Allocate the plugin must refuse. ``code``: the gRPC status name the shell answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def container_allocation(gpu: NodeGpu, strategy: GpuStrategy) -> ContainerAllocation:
    """The GPU ``gpu`` for one container, in the form ``strategy`` names. The CDI forms also set
    NVIDIA_VISIBLE_DEVICES to ``void`` (``NO_VISIBLE_DEVICES``: an image's ``all`` must not show the node's GPUs)."""
    if strategy is GpuStrategy.CDI:
        return ContainerAllocation(envs={VISIBLE_DEVICES: NO_VISIBLE_DEVICES},
                                   cdi_devices=(f"{CDI_GPU_KIND}={gpu.uuid}",))
    if strategy is GpuStrategy.CDI_ANNOTATIONS:
        # One key per GPU: a container holds at most one allocation of a resource, and a gang's container holds
        # several resources (GPUs), whose keys must not collide. The name part is at most 63 characters.
        key = f"{CDI_ANNOTATION_PREFIX}{RESOURCE_DOMAIN}_gpu-{gpu.index}"
        return ContainerAllocation(envs={VISIBLE_DEVICES: NO_VISIBLE_DEVICES},
                                   annotations={key: f"{CDI_GPU_KIND}={gpu.uuid}"})
    if strategy is GpuStrategy.VOLUME_MOUNTS:
        # The NVIDIA runtime reads the list from the file names under the root, which an unprivileged Pod cannot
        # forge by setting a variable (accept-nvidia-visible-devices-envvar-when-unprivileged = false).
        return ContainerAllocation(envs={VISIBLE_DEVICES: DEVICE_MOUNTS_ROOT},
                                   mounts=(Mount(f"{DEVICE_MOUNTS_ROOT}/{gpu.uuid}", "/dev/null"),))
    return ContainerAllocation(envs={VISIBLE_DEVICES: gpu.uuid})


def allocate(served: Mapping[str, Advertised], resource: str, containers: Sequence[Sequence[str]],
             strategy: GpuStrategy) -> tuple[ContainerAllocation, ...]:
    """The answer to an AllocateRequest for ``resource``: one ContainerAllocation per container request, each the
    resource's GPU. AllocationRefused for a resource not served here, a device ID not advertised, an empty request,
    or a GPU that is unhealthy now (the container would start without a working GPU)."""
    have = served.get(resource)
    if have is None:
        known = ", ".join(sorted(served)) or "none"
        raise AllocationRefused("NOT_FOUND", f"bubbles device plugin: resource {resource!r} is not served on this "
                                             f"node (served: {known}); request one of those")
    ids = {d for d, _ in have.devices()}
    out = []
    for n, devices in enumerate(containers):
        if not devices:
            raise AllocationRefused("INVALID_ARGUMENT", f"bubbles device plugin: container request {n} for "
                                                        f"{resource} names no device")
        unknown = sorted(set(devices) - ids)
        if unknown:
            raise AllocationRefused("INVALID_ARGUMENT", f"bubbles device plugin: {resource} has no device "
                                                        f"{', '.join(unknown)} (it advertises {have.fill_slots} "
                                                        f"slots of GPU {have.gpu.uuid})")
        if not have.gpu.healthy:
            raise AllocationRefused("FAILED_PRECONDITION", f"bubbles device plugin: GPU {have.gpu.uuid} "
                                                           f"({resource}) is unhealthy (NVML does not answer for "
                                                           "it); the Pod can be placed again once it recovers")
        out.append(container_allocation(have.gpu, strategy))
    return tuple(out)


def preferred_allocation(available: Sequence[str], must_include: Sequence[str], size: int) -> tuple[str, ...]:
    """GetPreferredAllocation (not announced, answered all the same): the slots that must be in, then the lowest
    available, ``size`` in all. The slots of one GPU are interchangeable, so any choice would do."""
    chosen = list(dict.fromkeys(must_include))
    for d in sorted(available, key=_slot_order):
        if len(chosen) >= size:
            break
        if d not in chosen:
            chosen.append(d)
    return tuple(chosen[:max(size, len(must_include))])


def _slot_order(device: str) -> tuple[str, int]:
    uuid, _, slot = device.rpartition("::")
    return (uuid, int(slot)) if slot.isdigit() else (device, -1)
