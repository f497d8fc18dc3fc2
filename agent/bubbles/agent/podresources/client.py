"""Asking the kubelet's PodResources API: a thin gRPC shell, one ``List`` per call on a channel of its own.

The device plugin asks once per container start that holds a GPU's slots, so nothing is kept between calls: a kubelet
that restarted (and made its socket again) is simply asked on the new one. ``list_devices`` raises
``PodResourcesUnavailable`` saying why when the kubelet cannot be asked; the caller fails closed.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from . import ContainerDevices
from .pb.podresources.v1 import api_pb2 as pb
from .pb.podresources.v1 import api_pb2_grpc as pb_grpc

LIST_TIMEOUT_S = 5.0  # the kubelet waits 30 s for a PreStartContainer answer; this leaves it time to say why
# As the kubelet's own PodResources client allows (16 MiB): a node of many Pods lists more than gRPC's default 4 MiB.
MAX_MESSAGE_BYTES = 16 << 20


class PodResourcesUnavailable(OSError):
    """The kubelet's PodResources API cannot be asked now; the message says why."""


def from_pb(response: pb.ListPodResourcesResponse) -> tuple[ContainerDevices, ...]:
    """Every (container, resource) that holds devices, in the kubelet's order."""
    return tuple(ContainerDevices(p.namespace, p.name, c.name, d.resource_name, tuple(d.device_ids))
                 for p in response.pod_resources for c in p.containers for d in c.devices)


def list_devices(socket: Path, timeout_s: float = LIST_TIMEOUT_S) -> tuple[ContainerDevices, ...]:
    """What the kubelet serving ``socket`` lists now; PodResourcesUnavailable when the socket is not there, or the
    kubelet does not answer ``v1.PodResourcesLister.List`` within ``timeout_s``."""
    if not socket.is_socket():
        what = "is not a socket" if socket.exists() else "does not exist"
        raise PodResourcesUnavailable(f"{socket} {what}")
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    try:
        with grpc.insecure_channel(f"unix:{socket}", options=options) as channel:
            response = pb_grpc.PodResourcesListerStub(channel).List(pb.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNIMPLEMENTED:
            raise PodResourcesUnavailable("the kubelet does not serve PodResources v1 (Kubernetes 1.20 or later "
                                          "does)") from None
        raise PodResourcesUnavailable(f"{code.name}: {exc.details()}") from None
    return from_pb(response)
