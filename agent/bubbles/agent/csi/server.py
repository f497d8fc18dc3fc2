"""The CSI node plugin's gRPC services on Unix sockets, and its registration with the kubelet: thin shells.

- ``csi.v1.Identity`` and ``csi.v1.Node`` on the CSI socket (default
  ``/var/lib/kubelet/plugins/csi.bubbles.dev/csi.sock``): every answer comes from ``plugin.CsiNodePlugin``; a
  ``publish.Refused`` becomes its gRPC status with its message, an OSError (the kernel refused a mount) INTERNAL.
- ``pluginregistration.Registration`` on ``<kubelet_dir>/plugins_registry/csi.bubbles.dev-reg.sock``: the kubelet's
  plugin watcher finds the socket, asks ``GetInfo`` (a CSI plugin, its name, the CSI socket, CSI 1.0.0), calls
  ``NodeGetInfo`` on the CSI socket and records the node in its CSINode object, then tells the outcome with
  ``NotifyRegistrationStatus``. This takes the node-driver-registrar sidecar's place.

Both sockets are the kubelet's to call: their directory is the kubelet's (root's), the sockets are 0600. Removing the
registration socket at stop unregisters the plugin.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import wrappers_pb2

from bubbles.core import versions

from . import socket_problem
from .pb.csi.v1 import csi_pb2 as csi
from .pb.csi.v1 import csi_pb2_grpc as csi_grpc
from .pb.pluginregistration.v1 import api_pb2 as reg
from .pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from .plugin import CsiNodePlugin
from .publish import DRIVER_NAME, PublishRequest, Refused

log = logging.getLogger("bubbles.agent.csi")

CSI_VERSIONS = ("1.0.0",)  # what the kubelet is told this plugin speaks (it accepts any 1.x)
PLUGIN_TYPE = "CSIPlugin"  # pluginregistration's name for a CSI driver (the other: DevicePlugin)
SOCKET_MODE = 0o600


class IdentityServicer(csi_grpc.IdentityServicer):
    """Who the plugin is; always ready once it serves (it has nothing to initialize)."""

    def GetPluginInfo(self, request: csi.GetPluginInfoRequest,
                      context: grpc.ServicerContext) -> csi.GetPluginInfoResponse:
        return csi.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=versions.release())

    def GetPluginCapabilities(self, request: csi.GetPluginCapabilitiesRequest,
                              context: grpc.ServicerContext) -> csi.GetPluginCapabilitiesResponse:
        return csi.GetPluginCapabilitiesResponse()  # a node plugin only: no controller service, no topology

    def Probe(self, request: csi.ProbeRequest, context: grpc.ServicerContext) -> csi.ProbeResponse:
        return csi.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class NodeServicer(csi_grpc.NodeServicer):
    """Publish and unpublish, through the plugin; no capability (no staging, no stats, no expansion)."""

    def __init__(self, plugin: CsiNodePlugin) -> None:
        self.plugin = plugin

    def NodePublishVolume(self, request: csi.NodePublishVolumeRequest,
                          context: grpc.ServicerContext) -> csi.NodePublishVolumeResponse:
        access = (request.volume_capability.WhichOneof("access_type") or ""
                  if request.HasField("volume_capability") else "")
        req = PublishRequest(request.volume_id, request.target_path, dict(request.volume_context), access or "",
                             request.readonly)
        try:
            self.plugin.publish(req)
        except Refused as exc:
            log.warning("CSI: NodePublishVolume %s refused: %s", request.volume_id, exc)
            context.abort(grpc.StatusCode[exc.status.value], str(exc))
        except OSError as exc:
            log.error("CSI: NodePublishVolume %s failed: %s", request.volume_id, exc)
            context.abort(grpc.StatusCode.INTERNAL, f"{DRIVER_NAME}: {exc}")
        return csi.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: csi.NodeUnpublishVolumeRequest,
                            context: grpc.ServicerContext) -> csi.NodeUnpublishVolumeResponse:
        try:
            self.plugin.unpublish(request.volume_id, request.target_path)
        except Refused as exc:
            context.abort(grpc.StatusCode[exc.status.value], str(exc))
        except OSError as exc:
            log.error("CSI: NodeUnpublishVolume %s failed: %s", request.volume_id, exc)
            context.abort(grpc.StatusCode.INTERNAL, f"{DRIVER_NAME}: {exc}")
        return csi.NodeUnpublishVolumeResponse()

    def NodeGetCapabilities(self, request: csi.NodeGetCapabilitiesRequest,
                            context: grpc.ServicerContext) -> csi.NodeGetCapabilitiesResponse:
        return csi.NodeGetCapabilitiesResponse()  # no STAGE_UNSTAGE_VOLUME: the kubelet publishes directly

    def NodeGetInfo(self, request: csi.NodeGetInfoRequest, context: grpc.ServicerContext) -> csi.NodeGetInfoResponse:
        return csi.NodeGetInfoResponse(node_id=self.plugin.node_id)


@dataclass
class RegistrationServicer(reg_grpc.RegistrationServicer):
    """Answers the kubelet's plugin watcher, and keeps what it last said (``registered``, ``error``)."""

    endpoint: str
    registered: bool | None = None  # None: the kubelet has not said yet
    error: str = ""
    notified: threading.Event = field(default_factory=threading.Event)

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=self.endpoint,
                              supported_versions=list(CSI_VERSIONS))

    def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg.RegistrationStatusResponse:
        self.registered, self.error = request.plugin_registered, request.error
        if request.plugin_registered:
            log.info("CSI: the kubelet registered %s (endpoint %s)", DRIVER_NAME, self.endpoint)
        else:
            log.error("CSI: the kubelet refused to register %s: %s", DRIVER_NAME, request.error or "(no reason given)")
        self.notified.set()
        return reg.RegistrationStatusResponse()


def _unix_server(path: Path, private_dir: bool) -> tuple[grpc.Server, str]:
    """A gRPC server bound to the Unix socket ``path`` (a socket left there by an earlier agent is replaced)."""
    problem = socket_problem(path)
    if problem is not None:
        raise OSError(problem)
    if private_dir:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    else:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)  # the kubelet's own; made only where missing
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket; remove it, or give another --kubelet-dir")
        os.unlink(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="bubbles-csi"),
                         options=[("grpc.so_reuseport", 0)])
    address = f"unix://{path}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {path}")
    return server, address


@dataclass
class CsiServer:
    """The running CSI and registration servers; ``stop()`` removes their sockets (the kubelet then unregisters)."""

    servers: list[grpc.Server]
    sockets: list[Path]
    registration: RegistrationServicer | None

    def stop(self, grace_s: float = 1.0) -> None:
        # The registration socket goes first, so the kubelet stops sending to a plugin that is going away.
        for server, sock in reversed(list(zip(self.servers, self.sockets, strict=True))):
            server.stop(grace_s).wait()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)


def serve(plugin: CsiNodePlugin, csi_path: Path, registration_path: Path | None) -> CsiServer:
    """Serve the plugin on ``csi_path`` and, unless None, register it with the kubelet through ``registration_path``
    (created last, so the kubelet finds it only once the CSI socket answers). OSError saying what to fix."""
    servers: list[grpc.Server] = []
    sockets: list[Path] = []
    registration = None
    try:
        server, _ = _unix_server(csi_path, private_dir=True)
        csi_grpc.add_IdentityServicer_to_server(IdentityServicer(), server)
        csi_grpc.add_NodeServicer_to_server(NodeServicer(plugin), server)
        server.start()
        os.chmod(csi_path, SOCKET_MODE)
        servers.append(server)
        sockets.append(csi_path)
        if registration_path is not None:
            registration = RegistrationServicer(str(csi_path))
            server, _ = _unix_server(registration_path, private_dir=False)
            reg_grpc.add_RegistrationServicer_to_server(registration, server)
            server.start()
            os.chmod(registration_path, SOCKET_MODE)
            servers.append(server)
            sockets.append(registration_path)
    except BaseException:
        CsiServer(servers, sockets, registration).stop(0)
        raise
    log.info("CSI node plugin %s on %s%s", DRIVER_NAME, csi_path,
             f", registering through {registration_path}" if registration_path is not None else "")
    return CsiServer(servers, sockets, registration)
