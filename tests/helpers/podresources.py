"""A stand-in for the kubelet's PodResources API: a real gRPC server of ``v1.PodResourcesLister`` on a real Unix socket
(tests/test_podresources.py, tests/test_device_plugin_kubelet.py). It lists what a test (or the stand-in kubelet, as
it allocates devices) put in ``pods``, as the kubelet lists its Pods' devices; ``unimplemented``: it answers List as
a kubelet without v1 does."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path

import grpc

from bubbles.agent.podresources.pb.podresources.v1 import api_pb2 as pb
from bubbles.agent.podresources.pb.podresources.v1 import api_pb2_grpc as pb_grpc

# (namespace, pod) -> container -> resource -> device IDs
Listing = dict[tuple[str, str], dict[str, dict[str, list[str]]]]


class StandInPodResources(pb_grpc.PodResourcesListerServicer):
    """See the module documentation. ``calls``: how many List calls it answered."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.lock = threading.Lock()
        self.pods: Listing = {}
        self.unimplemented = False
        self.calls = 0
        self.server: grpc.Server | None = None

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{self.socket}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def hold(self, namespace: str, pod: str, container: str, devices: Mapping[str, Sequence[str]]) -> None:
        """Container ``container`` of Pod ``namespace/pod`` holds ``devices`` ({resource: device IDs})."""
        with self.lock:
            mine = self.pods.setdefault((namespace, pod), {}).setdefault(container, {})
            for resource, ids in devices.items():
                mine.setdefault(resource, []).extend(ids)

    def List(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        if self.unimplemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown service v1.PodResourcesLister")
        with self.lock:
            self.calls += 1
            return pb.ListPodResourcesResponse(pod_resources=[
                pb.PodResources(namespace=ns, name=name, containers=[
                    pb.ContainerResources(name=c, devices=[pb.ContainerDevices(resource_name=r, device_ids=ids)
                                                           for r, ids in held.items()])
                    for c, held in containers.items()])
                for (ns, name), containers in self.pods.items()])
