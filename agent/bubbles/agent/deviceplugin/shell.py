"""The device plugin's gRPC shell: a server per resource on a Unix socket, registered with the kubelet.

Every decision comes from ``decide``; this module serves, registers and watches:

- **One server per resource** (``bubbles-gpu-<index>.sock`` in the kubelet's device-plugins directory), because the
  kubelet calls a plugin per resource, on the endpoint it registered, and says nothing else of which resource it means.
- **Registration**: each server registers its resource with the kubelet's ``Registration`` service
  (``kubelet.sock``), once it serves. A kubelet that is not there yet, or refuses, is tried again every check interval
  (said once while it lasts). A kubelet that restarts re-creates ``kubelet.sock`` and removes every plugin socket: on
  a new ``kubelet.sock``, or a plugin socket gone, that server is started again on a new socket and registers again.
- **Health**: the node's GPUs are read again every health interval (NVML; a fixed list from ``--gpus`` is always
  healthy). A GPU NVML no longer answers for makes its slots unhealthy and every ``ListAndWatch`` stream of its
  resource sends the new list; a GPU that appears gets its own server. NVML failing from the start: no resource is
  advertised, said once, and read again each interval.
- **Who may start**: ``PreStartContainer`` asks the injected check (``PreStartCheck``; in the agent a
  ``PodResourcesGuard``: the kubelet's PodResources API and the node agent's assignments, decided by ``guard``) and
  answers its refusal as the call's error, which fails that container's start.

``DevicePlugins.start`` raises OSError when a socket cannot be bound; the loop it starts logs what goes wrong after
that and carries on until ``stop``, which ends every stream and removes the sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from bubbles.agent.podresources import ContainerDevices
from bubbles.agent.podresources.client import PodResourcesUnavailable, list_devices
from bubbles.core.paths import MAX_SOCKET_PATH_BYTES

from . import decide, guard
from .decide import Advertised, AllocationRefused, GpuStrategy, NodeGpu
from .guard import FillPodGpus, Refusal
from .pb.deviceplugin.v1beta1 import api_pb2 as pb
from .pb.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

log = logging.getLogger("bubbles.agent.deviceplugin")

DEFAULT_DIRECTORY = Path("/var/lib/kubelet/device-plugins")  # the kubelet's (pluginapi.DevicePluginPath)
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT_S = 5.0
STREAM_POLL_S = 0.5  # how often a ListAndWatch stream looks whether the kubelet has gone

GpuReader = Callable[[], Mapping[str, str]]  # {UUID: "cuda:N"} now; raises when the GPUs cannot be read
# (the resources served, the resource called, the container's device IDs) -> None to let it start, else why not
PreStartCheck = Callable[[Mapping[str, Advertised], str, Sequence[str]], Refusal | None]


@dataclass(frozen=True)
class PluginConfig:
    """How the device plugin runs (``--device-plugin``, ``--gpu-strategy``, ``--fill-slots``,
    ``--device-plugin-dir``)."""

    strategy: GpuStrategy = GpuStrategy.CDI
    fill_slots: int = decide.DEFAULT_FILL_SLOTS
    directory: Path = DEFAULT_DIRECTORY
    health_interval_s: float = 5.0
    check_interval_s: float = 1.0  # kubelet restarts, lost sockets, registrations to try again

    def __post_init__(self) -> None:
        decide.check_fill_slots(self.fill_slots)
        if not self.health_interval_s > 0 or not self.check_interval_s > 0:
            raise ValueError("the device plugin's health and check intervals must be > 0 seconds")


def allocation_to_pb(a: decide.ContainerAllocation) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=a.envs, annotations=a.annotations,
        mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                for m in a.mounts],
        cdi_devices=[pb.CDIDevice(name=n) for n in a.cdi_devices])


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """One resource's plugin: answers from ``DevicePlugins``, which holds the node's GPUs."""

    def __init__(self, plugins: DevicePlugins, resource: str) -> None:
        self.plugins = plugins
        self.resource = resource
        self.closed = threading.Event()  # set when this server is stopped: its streams end

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        o = decide.OPTIONS
        return pb.DevicePluginOptions(pre_start_required=o.pre_start_required,
                                      get_preferred_allocation_available=o.get_preferred_allocation_available)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        sent: list[tuple[tuple[str, str], ...] | None] = [None]  # what this stream last sent (read by the wait)
        changed = self.plugins.changed
        while context.is_active() and not self.closed.is_set():
            with changed:
                changed.wait_for(lambda: self.closed.is_set() or self.plugins.devices(self.resource) != sent[0],
                                 timeout=STREAM_POLL_S)
                devices = self.plugins.devices(self.resource)
            if self.closed.is_set():
                return
            if devices != sent[0]:
                sent[0] = devices
                yield pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=h) for i, h in devices])

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse(container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=decide.preferred_allocation(
                r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size))
            for r in request.container_requests])

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        try:
            answers = decide.allocate(self.plugins.served(), self.resource,
                                      [list(r.devices_ids) for r in request.container_requests],
                                      self.plugins.config.strategy)
        except AllocationRefused as exc:
            log.warning("%s", exc)
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return pb.AllocateResponse(container_responses=[allocation_to_pb(a) for a in answers])

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> pb.PreStartContainerResponse:
        devices = list(request.devices_ids)
        try:
            refusal = self.plugins.pre_start(self.plugins.served(), self.resource, devices)
        except Exception as exc:  # a bug in the check must not let a Pod through: refused, and said
            log.exception("%s: the PreStartContainer check failed", self.resource)
            refusal = Refusal("INTERNAL", f"bubbles device plugin: the check of the container's Pod failed ({exc}); "
                                          "the container is refused (see the agent's log)")
        if refusal is not None:
            log.warning("%s: PreStartContainer for %s refused: %s", self.resource, ", ".join(devices),
                        refusal.message)
            context.abort(getattr(grpc.StatusCode, refusal.code), refusal.message)
        log.info("%s: PreStartContainer for %s: the container may start", self.resource, ", ".join(devices))
        return pb.PreStartContainerResponse()


@dataclass(eq=False)
class _Endpoint:
    """A resource's running server and whether the kubelet has its registration."""

    resource: str
    socket: Path
    server: grpc.Server
    servicer: DevicePluginServicer
    registered_with: tuple[int, int] | None = None  # the kubelet.sock (inode, ctime) that took its registration

    def close(self) -> None:
        self.servicer.closed.set()
        self.server.stop(grace=None)
        with contextlib.suppress(FileNotFoundError):
            # The kubelet may already have removed it, or a new server bound a new socket at the path.
            if self.socket.exists() and not self.socket.is_socket():
                return
            self.socket.unlink()


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


class DevicePlugins:
    """Every resource of the node: its server, its registration, its GPU's health; see the module documentation.
    ``pre_start``: whether a container holding slots may start."""

    def __init__(self, config: PluginConfig, read_gpus: GpuReader, pre_start: PreStartCheck,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.read_gpus = read_gpus
        self.pre_start = pre_start
        self.clock = clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.gpus: tuple[NodeGpu, ...] = ()
        self.resources: dict[str, Advertised] = {}
        self.endpoints: dict[str, _Endpoint] = {}
        self._gpu_problem: str | None = None
        self._said: set[str] = set()
        self._next_health = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def kubelet_socket(self) -> Path:
        return self.config.directory / KUBELET_SOCKET

    # -- what the servicers read ----------------------------------------------------------------------------
    def served(self) -> dict[str, Advertised]:
        with self.lock:
            return dict(self.resources)

    def devices(self, resource: str) -> tuple[tuple[str, str], ...]:
        with self.lock:
            have = self.resources.get(resource)
            return have.devices() if have is not None else ()

    # -- life cycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Read the GPUs, serve and register each resource, then keep them so on a thread. OSError when the
        directory or a socket cannot be made (the message says which)."""
        try:
            self.config.directory.mkdir(parents=True, exist_ok=True)
            self.step()
        except OSError:
            self.stop()  # the servers that did start, and their sockets
            raise
        self._thread = threading.Thread(target=self._loop, name="bubbles-device-plugin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        with self.changed:
            endpoints = list(self.endpoints.values())
            self.endpoints.clear()
            for ep in endpoints:
                ep.servicer.closed.set()
            self.changed.notify_all()
        for ep in endpoints:
            ep.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.check_interval_s):
            try:
                self.step()
            except Exception:  # a bug here must not end the plugin: the kubelet would keep stale resources
                log.exception("the device plugin's round failed; trying again in %gs", self.config.check_interval_s)

    def step(self) -> None:
        """One round: the GPUs (when their health is due), a server for each resource that lacks one, servers
        again after a kubelet restart, registrations still owed."""
        now = self.clock()
        if now >= self._next_health:
            self._next_health = now + self.config.health_interval_s
            self.refresh()
        kubelet = _file_identity(self.kubelet_socket)
        for name in sorted(self.served()):
            ep = self.endpoints.get(name)
            restarted = ep is not None and None not in (ep.registered_with, kubelet) and ep.registered_with != kubelet
            if ep is not None and (restarted or not ep.socket.is_socket()):
                why = "the kubelet restarted" if restarted else f"its socket {ep.socket} is gone"
                log.info("%s: serving again on a new socket (%s)", name, why)
                self.endpoints.pop(name)
                ep.close()
                ep = None
            if ep is None:
                ep = self._serve(name)
            if kubelet is not None and ep.registered_with != kubelet and self._register(ep):
                ep.registered_with = kubelet
        if kubelet is None and self.endpoints:
            self._say("kubelet", f"waiting for the kubelet's {self.kubelet_socket} to register the GPUs' resources")
        elif kubelet is not None:
            self._said.discard("kubelet")

    def refresh(self) -> None:
        """Read the node's GPUs again; a change reaches every ListAndWatch stream."""
        try:
            seen: Mapping[str, str] | None = self.read_gpus()
            problem = None if seen else "NVML lists no GPU"
        except Exception as exc:  # NVMLError, NvmlUnavailable
            seen, problem = None, str(exc)
        with self.changed:
            gpus = decide.track_gpus(self.gpus, seen)
            if problem is not None and problem != self._gpu_problem:
                if not gpus:
                    log.warning("device plugin: no GPU found (%s): no resource advertised; looking again every %gs",
                                problem, self.config.health_interval_s)
                else:
                    log.warning("device plugin: the GPUs cannot be read (%s): their slots are unhealthy", problem)
            elif problem is None and self._gpu_problem is not None:
                log.info("device plugin: the GPUs can be read again (%d)", len(seen or {}))
            self._gpu_problem = problem
            for g in gpus:
                if g not in self.gpus:
                    log.info("device plugin: GPU %d (%s) is %s", g.index, g.uuid,
                             "healthy" if g.healthy else "unhealthy")
            if gpus != self.gpus:
                self.gpus = gpus
                self.resources = decide.plan_resources(gpus, self.config.fill_slots)
                self.changed.notify_all()

    # -- one resource ---------------------------------------------------------------------------------------
    def _serve(self, resource: str) -> _Endpoint:
        have = self.resources[resource]
        path = self.config.directory / have.endpoint
        if len(os.fsencode(str(path))) > MAX_SOCKET_PATH_BYTES:
            raise OSError(f"device plugin socket {path} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix "
                          "socket allows: give a shorter --device-plugin-dir")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket of an earlier run: binding needs the path free
        # The kubelet holds one ListAndWatch stream; a few more threads for its calls and one restart's overlap.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"bubbles-{resource}"))
        servicer = DevicePluginServicer(self, resource)
        pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
        try:
            server.add_insecure_port(f"unix:{path}")
        except RuntimeError as exc:
            raise OSError(f"cannot serve {resource} on {path}: {exc}; is the agent allowed to write the kubelet's "
                          "device-plugins directory (the chart mounts it from the host)?") from None
        server.start()
        ep = _Endpoint(resource, path, server, servicer)
        self.endpoints[resource] = ep
        log.info("%s: serving on %s (%d fill slots, GPU strategy %s)", resource, path, have.fill_slots,
                 self.config.strategy.value)
        return ep

    def _register(self, ep: _Endpoint) -> bool:
        o = decide.OPTIONS
        request = pb.RegisterRequest(
            version=decide.API_VERSION, endpoint=ep.socket.name, resource_name=ep.resource,
            options=pb.DevicePluginOptions(pre_start_required=o.pre_start_required,
                                           get_preferred_allocation_available=o.get_preferred_allocation_available))
        try:
            with grpc.insecure_channel(f"unix:{self.kubelet_socket}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_S)
        except grpc.RpcError as exc:
            self._say(f"register {ep.resource}", f"{ep.resource}: the kubelet did not take the registration "
                                                 f"({exc.code().name}: {exc.details()}); trying again")
            return False
        self._said.discard(f"register {ep.resource}")
        log.info("%s: registered with the kubelet (%s)", ep.resource, self.kubelet_socket)
        return True

    def _say(self, key: str, message: str) -> None:
        """Log ``message`` once while the condition ``key`` lasts."""
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", message)


class PodResourcesGuard:
    """The agent's ``PreStartCheck``: asks the kubelet's PodResources API on ``socket`` who holds the devices (each
    call: nothing is cached that a Pod could slip through), and ``assigned`` which fill Pods the node agent holds
    assignments for; ``guard.check_pre_start`` decides. A kubelet that cannot be asked: refused (``guard.unreachable``).
    ``list_devices``: the PodResources client."""

    def __init__(self, socket: Path, assigned: Callable[[], Sequence[FillPodGpus]],
                 list_devices: Callable[[Path], Sequence[ContainerDevices]] = list_devices) -> None:
        self.socket = socket
        self.assigned = assigned
        self.list_devices = list_devices

    def __call__(self, served: Mapping[str, Advertised], resource: str, device_ids: Sequence[str]) -> Refusal | None:
        try:
            listing = self.list_devices(self.socket)
        except PodResourcesUnavailable as exc:
            return guard.unreachable(self.socket, str(exc), resource)
        return guard.check_pre_start(served, resource, device_ids, listing, self.assigned())
