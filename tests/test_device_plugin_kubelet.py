"""The device plugin's gRPC shell against a stand-in kubelet: real gRPC servers on real Unix sockets, both ways.

The stand-in is the part of a kubelet the plugin meets: a ``Registration`` server on a temporary ``kubelet.sock``
that, on each ``Register``, dials the plugin's endpoint back, asks its options and keeps its ``ListAndWatch`` stream, as
the kubelet does; and on a restart removes its socket and every plugin's before it serves again. Its PodResources API
(``pod-resources/kubelet.sock`` beside the device-plugins directory, tests/helpers/podresources.py) lists the devices
it gave each container; starting a container, it calls ``Allocate``, records the devices, then ``PreStartContainer``
where the plugin asked for it, as the kubelet's device manager does. This machine has no GPU: the GPUs come from a
stand-in NVML behind the interface ``bubbles.agent.gpus`` calls.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from helpers.podresources import StandInPodResources

from bubbles.agent.deviceplugin.decide import GpuStrategy
from bubbles.agent.deviceplugin.guard import ONLY_FILL_PODS, FillPodGpus
from bubbles.agent.deviceplugin.pb.deviceplugin.v1beta1 import api_pb2 as pb
from bubbles.agent.deviceplugin.pb.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from bubbles.agent.deviceplugin.shell import DevicePlugins, PluginConfig, PodResourcesGuard, PreStartCheck
from bubbles.agent.gpus import read_gpus

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
FAST_S = 0.05  # the plugin looks at the GPUs and the kubelet this often here


def wait_for(what: str, predicate: Callable[[], object], deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class StandInNvml:
    """The pynvml functions ``read_gpus`` calls, over a list of UUIDs that a test changes; ``fail``: NVML's init
    fails (no driver). Counts its inits: how often the plugin looked."""

    def __init__(self, uuids: list[str], fail: bool = False) -> None:
        self.uuids = uuids
        self.fail = fail
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.uuids[handle]

    def nvmlShutdown(self) -> None:
        pass


class StandInKubelet(pb_grpc.RegistrationServicer):
    """See the module documentation. ``registrations``: every RegisterRequest taken; ``options`` and ``lists``: per
    resource, what its plugin answered (every list its stream sent, latest last)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pod_resources = StandInPodResources(directory.parent / "pod-resources" / "kubelet.sock")
        self.lock = threading.Lock()
        self.registrations: list[pb.RegisterRequest] = []
        self.options: dict[str, pb.DevicePluginOptions] = {}
        self.lists: dict[str, list[list[tuple[str, str]]]] = {}
        self.channels: dict[str, grpc.Channel] = {}
        self.server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.directory / "kubelet.sock"

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{self.socket}")
        self.server.start()
        if self.pod_resources.server is None:
            self.pod_resources.start()

    def restart(self) -> None:
        """As a kubelet starting again: its socket and every plugin's removed, then a new kubelet.sock."""
        self.stop()
        for sock in self.directory.glob("*.sock"):
            sock.unlink()
        self.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait()
        self.pod_resources.stop()
        with self.lock:
            channels = list(self.channels.values())
            self.channels.clear()
        for ch in channels:
            ch.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        with self.lock:
            self.registrations.append(request)
        threading.Thread(target=self._dial_back, args=(request,), daemon=True).start()
        return pb.Empty()

    def _dial_back(self, request: pb.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix:{self.directory / request.endpoint}")
        with self.lock:
            old = self.channels.pop(request.resource_name, None)
            self.channels[request.resource_name] = channel
        if old is not None:
            old.close()
        stub = pb_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
            with self.lock:
                self.options[request.resource_name] = options
            for response in stub.ListAndWatch(pb.Empty()):
                with self.lock:
                    self.lists.setdefault(request.resource_name, []).append(
                        [(d.ID, d.health) for d in response.devices])
        except grpc.RpcError:
            pass  # the plugin stopped, or this stand-in closed the channel (a restart)

    def latest(self, resource: str) -> list[tuple[str, str]] | None:
        with self.lock:
            got = self.lists.get(resource)
            return got[-1] if got else None

    def allocate(self, resource: str, *device_ids: str) -> pb.AllocateResponse:
        with self.lock:
            channel = self.channels[resource]
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(device_ids))])
        return pb_grpc.DevicePluginStub(channel).Allocate(request, timeout=5)

    def start_container(self, namespace: str, pod: str, devices: dict[str, list[str]],
                        container: str = "main") -> None:
        """As the kubelet starts a container holding ``devices`` ({resource: device IDs}): ``Allocate`` each
        resource (at admission), record what the container holds (what PodResources lists from then on), then
        ``PreStartContainer`` for each resource whose plugin asked for it. grpc.RpcError where a plugin refuses:
        the container does not start."""
        for resource, ids in devices.items():
            self.allocate(resource, *ids)
        self.pod_resources.hold(namespace, pod, container, devices)
        for resource, ids in devices.items():
            with self.lock:
                channel, options = self.channels[resource], self.options[resource]
            if options.pre_start_required:
                pb_grpc.DevicePluginStub(channel).PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids),
                                                                    timeout=30)


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """The kubelet's device-plugins directory, in a root of its own (the PodResources socket goes beside it)."""
    # Short: a Unix socket's path must fit in 108 bytes, which pytest's tmp_path may not.
    root = Path(tempfile.mkdtemp(prefix="bubbles-dp-", dir="/tmp"))
    (root / "device-plugins").mkdir()
    yield root / "device-plugins"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[StandInKubelet]:
    k = StandInKubelet(plugin_dir)
    k.start()
    yield k
    k.stop()


def pod_resources_socket(plugin_dir: Path) -> Path:
    return plugin_dir.parent / "pod-resources" / "kubelet.sock"


def guard_of(plugin_dir: Path, *assigned: FillPodGpus) -> PodResourcesGuard:
    """The agent's check, asking the stand-in kubelet, with ``assigned`` as the node agent's fill Pods."""
    return PodResourcesGuard(pod_resources_socket(plugin_dir), lambda: assigned)


@contextlib.contextmanager
def serving(plugin_dir: Path, nvml: StandInNvml, strategy: GpuStrategy = GpuStrategy.CDI,
            fill_slots: int = 4, pre_start: PreStartCheck | None = None) -> Iterator[DevicePlugins]:
    plugins = DevicePlugins(PluginConfig(strategy, fill_slots, plugin_dir, FAST_S, FAST_S), lambda: read_gpus(nvml),
                            pre_start or guard_of(plugin_dir))
    plugins.start()
    try:
        yield plugins
    finally:
        plugins.stop()


def _slots(uuid: str, k: int, health: str = "Healthy") -> list[tuple[str, str]]:
    return [(f"{uuid}::{i}", health) for i in range(k)]


@pytest.mark.parametrize(("strategy", "expect"), [
    (GpuStrategy.CDI, pb.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": "void"},
                                                   cdi_devices=[pb.CDIDevice(name=f"nvidia.com/gpu={B}")])),
    (GpuStrategy.CDI_ANNOTATIONS, pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": "void"}, annotations={"cdi.k8s.io/bubbles.dev_gpu-1": f"nvidia.com/gpu={B}"})),
    (GpuStrategy.VOLUME_MOUNTS, pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
        mounts=[pb.Mount(container_path=f"/var/run/nvidia-container-devices/{B}", host_path="/dev/null")])),
    (GpuStrategy.ENVVAR, pb.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": B})),
])
def test_each_gpu_registers_its_resource_and_the_kubelet_gets_its_slots_and_its_uuid(
        plugin_dir: Path, kubelet: StandInKubelet, strategy: GpuStrategy, expect: pb.ContainerAllocateResponse) -> None:
    with serving(plugin_dir, StandInNvml([A, B]), strategy, fill_slots=3):
        wait_for("both resources' device lists", lambda: kubelet.latest("bubbles.dev/gpu-0")
                 and kubelet.latest("bubbles.dev/gpu-1"))
        got = sorted((r.version, r.endpoint, r.resource_name, r.options.pre_start_required,
                      r.options.get_preferred_allocation_available) for r in kubelet.registrations)
        assert got == [("v1beta1", "bubbles-gpu-0.sock", "bubbles.dev/gpu-0", True, False),
                       ("v1beta1", "bubbles-gpu-1.sock", "bubbles.dev/gpu-1", True, False)]
        assert kubelet.options["bubbles.dev/gpu-1"] == pb.DevicePluginOptions(pre_start_required=True)
        assert kubelet.latest("bubbles.dev/gpu-0") == _slots(A, 3)
        assert kubelet.latest("bubbles.dev/gpu-1") == _slots(B, 3)
        answer = kubelet.allocate("bubbles.dev/gpu-1", f"{B}::2")
        assert list(answer.container_responses) == [expect]
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate("bubbles.dev/gpu-1", f"{A}::0")  # GPU 0's slot asked of GPU 1's plugin
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"bubbles.dev/gpu-1 has no device {A}::0" in (err.value.details() or "")
    assert not list(plugin_dir.glob("bubbles-gpu-*.sock"))  # stopped: its sockets removed


def test_a_gpu_nvml_loses_turns_its_slots_unhealthy_in_the_stream_and_back(plugin_dir: Path,
                                                                          kubelet: StandInKubelet) -> None:
    nvml = StandInNvml([A, B])
    with serving(plugin_dir, nvml, fill_slots=2):
        wait_for("GPU 1's slots", lambda: kubelet.latest("bubbles.dev/gpu-1") == _slots(B, 2))
        nvml.uuids = [A]
        wait_for("GPU 1's slots unhealthy", lambda: kubelet.latest("bubbles.dev/gpu-1") == _slots(B, 2, "Unhealthy"))
        assert kubelet.latest("bubbles.dev/gpu-0") == _slots(A, 2)
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate("bubbles.dev/gpu-1", f"{B}::0")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "is unhealthy" in (err.value.details() or "")
        nvml.uuids = [A, B]
        wait_for("GPU 1's slots healthy again", lambda: kubelet.latest("bubbles.dev/gpu-1") == _slots(B, 2))
        assert kubelet.allocate("bubbles.dev/gpu-1", f"{B}::1").container_responses[0].cdi_devices[0].name == (
            f"nvidia.com/gpu={B}")
        assert len(kubelet.registrations) == 2  # health travels on the stream: no registration again


def test_a_kubelet_restart_makes_every_resource_serve_and_register_again(plugin_dir: Path,
                                                                        kubelet: StandInKubelet) -> None:
    nvml = StandInNvml([A, B])
    with serving(plugin_dir, nvml, GpuStrategy.ENVVAR):
        wait_for("both lists", lambda: kubelet.latest("bubbles.dev/gpu-0") and kubelet.latest("bubbles.dev/gpu-1"))
        first = {r: kubelet.latest(r) for r in ("bubbles.dev/gpu-0", "bubbles.dev/gpu-1")}
        kubelet.lists.clear()
        kubelet.restart()
        wait_for("two registrations again", lambda: len(kubelet.registrations) == 4)
        wait_for("both lists again",
                 lambda: kubelet.latest("bubbles.dev/gpu-0") and kubelet.latest("bubbles.dev/gpu-1"))
        assert {r: kubelet.latest(r) for r in first} == first
        assert sorted(r.resource_name for r in kubelet.registrations[2:]) == ["bubbles.dev/gpu-0", "bubbles.dev/gpu-1"]
        assert kubelet.allocate("bubbles.dev/gpu-0", f"{A}::0").container_responses[0].envs == {
            "NVIDIA_VISIBLE_DEVICES": A}
        looked = nvml.inits
        wait_for("three more rounds", lambda: nvml.inits >= looked + 3)
        assert len(kubelet.registrations) == 4  # a kubelet that did not restart again is not registered with again


def test_no_kubelet_yet_then_one_registration_per_resource_when_it_comes(plugin_dir: Path) -> None:
    nvml = StandInNvml([A])
    with serving(plugin_dir, nvml) as plugins:
        assert (plugin_dir / "bubbles-gpu-0.sock").is_socket()  # served at once; registered once the kubelet is up
        kubelet = StandInKubelet(plugin_dir)
        kubelet.start()
        try:
            wait_for("the registration", lambda: kubelet.latest("bubbles.dev/gpu-0") == _slots(A, 4))
            looked = nvml.inits
            wait_for("three more rounds", lambda: nvml.inits >= looked + 3)
            assert len(kubelet.registrations) == 1 and plugins.served().keys() == {"bubbles.dev/gpu-0"}
        finally:
            kubelet.stop()


def test_nvml_failing_means_no_resource_said_once_until_it_answers(plugin_dir: Path, kubelet: StandInKubelet,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bubbles.agent.deviceplugin")
    nvml = StandInNvml([A], fail=True)
    with serving(plugin_dir, nvml) as plugins:
        wait_for("several looks at NVML", lambda: nvml.inits >= 4)
        assert plugins.served() == {} and kubelet.registrations == []
        assert not list(plugin_dir.glob("bubbles-gpu-*.sock"))
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1 and "no GPU found (NVML is not usable here (NVML Shared Library Not Found))" in said[0]
        nvml.fail = False
        wait_for("GPU 0 registered", lambda: kubelet.latest("bubbles.dev/gpu-0") == _slots(A, 4))
        assert any("the GPUs can be read again" in r.getMessage() for r in caplog.records)


def test_the_agents_flags_serve_the_gpus_given_by_gpus_to_the_kubelet(plugin_dir: Path,
                                                                     kubelet: StandInKubelet) -> None:
    from bubbles.agent.cli import start_device_plugin
    from bubbles.agent.config import load_settings

    for name in ("tls.crt", "tls.key", "token"):
        (plugin_dir / name).write_text("x" * 32)
    settings = load_settings({"run_dir": plugin_dir / "run", "cluster": True, "node": "n",
                              "tls_cert": plugin_dir / "tls.crt", "tls_key": plugin_dir / "tls.key",
                              "token_file": plugin_dir / "token", "gpus": f"{B}=cuda:3", "device_plugin": True,
                              "gpu_strategy": "volume-mounts", "fill_slots": 2, "device_plugin_dir": plugin_dir}, {})
    assert settings.cluster is not None
    # The PodResources socket: the default, beside --device-plugin-dir, where the stand-in kubelet serves it.
    plugins = start_device_plugin(settings.cluster, lambda: (FillPodGpus("ml", "fj-a0", "a", "ml/llama", (B,)),))
    try:
        wait_for("GPU 3's slots", lambda: kubelet.latest("bubbles.dev/gpu-3") == _slots(B, 2))
        mounts = kubelet.allocate("bubbles.dev/gpu-3", f"{B}::1").container_responses[0].mounts
        assert [m.container_path for m in mounts] == [f"/var/run/nvidia-container-devices/{B}"]
        kubelet.start_container("ml", "fj-a0", {"bubbles.dev/gpu-3": [f"{B}::0"]})
        with pytest.raises(grpc.RpcError) as err:
            kubelet.start_container("ml", "squatter", {"bubbles.dev/gpu-3": [f"{B}::1"]})
        assert ONLY_FILL_PODS in (err.value.details() or "")
    finally:
        plugins.stop()


def test_the_agent_refuses_to_start_the_device_plugin_without_the_pod_resources_mount(plugin_dir: Path) -> None:
    from bubbles.agent.cli import start_device_plugin
    from bubbles.agent.config import load_settings

    for name in ("tls.crt", "tls.key", "token"):
        (plugin_dir / name).write_text("x" * 32)
    unmounted = plugin_dir.parent / "elsewhere" / "kubelet.sock"
    settings = load_settings({"run_dir": plugin_dir / "run", "cluster": True, "node": "n",
                              "tls_cert": plugin_dir / "tls.crt", "tls_key": plugin_dir / "tls.key",
                              "token_file": plugin_dir / "token", "gpus": f"{B}=cuda:3", "device_plugin": True,
                              "device_plugin_dir": plugin_dir, "pod_resources_socket": unmounted}, {})
    assert settings.cluster is not None
    with pytest.raises(OSError, match=f"its directory {unmounted.parent} does not exist in the agent's container"):
        start_device_plugin(settings.cluster, lambda: ())
    assert not list(plugin_dir.glob("bubbles-gpu-*.sock"))  # nothing served


def test_a_socket_path_too_long_is_refused_at_start_saying_what_to_do(plugin_dir: Path) -> None:
    deep = plugin_dir / ("d" * 100)
    config = PluginConfig(directory=deep, health_interval_s=FAST_S, check_interval_s=FAST_S)
    plugins = DevicePlugins(config, lambda: {A: "cuda:0"}, guard_of(plugin_dir))
    with pytest.raises(OSError, match="give a shorter --device-plugin-dir"):
        plugins.start()
    assert plugins.endpoints == {}


# -- PreStartContainer: only the fill Pods assigned a GPU start on it ----------------------------------------------
FILL_A = FillPodGpus("ml", "fj-infer-a0", "infer", "ml/llama", (A,))


def test_only_the_fill_pod_assigned_a_gpu_starts_on_it(plugin_dir: Path, kubelet: StandInKubelet) -> None:
    with serving(plugin_dir, StandInNvml([A, B]), pre_start=guard_of(plugin_dir, FILL_A)):
        wait_for("both lists", lambda: kubelet.latest("bubbles.dev/gpu-0") and kubelet.latest("bubbles.dev/gpu-1"))
        kubelet.start_container("ml", "fj-infer-a0", {"bubbles.dev/gpu-0": [f"{A}::0"]})
        with pytest.raises(grpc.RpcError) as err:
            kubelet.start_container("alice", "notebook", {"bubbles.dev/gpu-0": [f"{A}::1"]})
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == ("bubbles device plugin: Pod alice/notebook requests a bubbles.dev/gpu-* "
                                       "resource but is not a fill Pod the bubbles operator assigned to this node: "
                                       "only FillJobs' Pods may request bubbles.dev/gpu-*: create a FillJob")
        with pytest.raises(grpc.RpcError) as err:  # its own Pod, another container, on another training's GPU
            kubelet.start_container("ml", "fj-infer-a0", {"bubbles.dev/gpu-1": [f"{B}::0"]}, container="side")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (f"fill Pod ml/fj-infer-a0 (FillJob infer) is assigned GPU(s) {A} of training ml/llama; it requests "
                f"bubbles.dev/gpu-1 (GPU {B}) of another training") in (err.value.details() or "")
        assert kubelet.pod_resources.calls == 3  # asked at each start: nothing cached


def test_no_pod_resources_api_refuses_every_container_saying_where_it_looked(plugin_dir: Path,
                                                                             kubelet: StandInKubelet) -> None:
    with serving(plugin_dir, StandInNvml([A]), pre_start=guard_of(plugin_dir, FILL_A)):
        wait_for("GPU 0's list", lambda: kubelet.latest("bubbles.dev/gpu-0"))
        kubelet.pod_resources.stop()  # its socket removed, as when the directory is not mounted
        with pytest.raises(grpc.RpcError) as err:
            kubelet.start_container("ml", "fj-infer-a0", {"bubbles.dev/gpu-0": [f"{A}::0"]})
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        socket = pod_resources_socket(plugin_dir)
        assert (f"cannot tell which Pod holds bubbles.dev/gpu-0: the kubelet's PodResources API at {socket} did not "
                f"answer ({socket} does not exist); the container is refused") in (err.value.details() or "")
        assert "mounts the kubelet's pod-resources directory at that path (--pod-resources-socket)" in (
            err.value.details() or "")
        kubelet.pod_resources.start()  # back: the same Pod starts at the kubelet's next try
        kubelet.start_container("ml", "fj-infer-a0", {"bubbles.dev/gpu-0": [f"{A}::0"]}, container="again")


def test_a_check_that_fails_refuses_the_container(plugin_dir: Path, kubelet: StandInKubelet,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_: object) -> None:
        raise KeyError("a bug")

    with serving(plugin_dir, StandInNvml([A]), pre_start=broken):
        wait_for("GPU 0's list", lambda: kubelet.latest("bubbles.dev/gpu-0"))
        with pytest.raises(grpc.RpcError) as err:
            kubelet.start_container("ml", "fj-infer-a0", {"bubbles.dev/gpu-0": [f"{A}::0"]})
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "the check of the container's Pod failed ('a bug'); the container is refused" in (
            err.value.details() or "")
    assert any("the PreStartContainer check failed" in r.getMessage() for r in caplog.records)


def test_the_node_agents_assignments_decide_who_starts(plugin_dir: Path, kubelet: StandInKubelet) -> None:
    """The wiring as the agent runs it: the node agent's book (real cards, real assignments) behind the guard."""
    from helpers.agent_cluster import NODE, assignment, write_card

    from bubbles.agent.cluster import ClusterConfig, NodeAgent
    from bubbles.agent.config import AgentConfig
    from bubbles.agent.isolation import IsolationConfig
    from bubbles.core.api import IsolationMode

    template = AgentConfig(run_dir=plugin_dir.parent / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    node = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=60.0))
    try:
        write_card(node.run_dir, rank=0, ranks=2, gpu_uuid=A)
        write_card(node.run_dir, rank=1, ranks=2, gpu_uuid=B)
        node.scan()
        guard = PodResourcesGuard(pod_resources_socket(plugin_dir), node.fill_pod_gpus)
        with serving(plugin_dir, StandInNvml([A, B]), pre_start=guard):
            wait_for("both lists", lambda: kubelet.latest("bubbles.dev/gpu-0") and kubelet.latest("bubbles.dev/gpu-1"))
            with pytest.raises(grpc.RpcError) as err:  # created before its assignment came: refused, tried again
                kubelet.start_container("ml", "fj-fj-a0", {"bubbles.dev/gpu-1": [f"{B}::0"]})
            assert ONLY_FILL_PODS in (err.value.details() or "")
            node.assign(assignment(ranks=(1,)))
            kubelet.start_container("ml", "fj-fj-a0", {"bubbles.dev/gpu-1": [f"{B}::0"]}, container="again")
            node.cancel("uid-1", "the FillJob was deleted")
            with pytest.raises(grpc.RpcError) as err:
                kubelet.start_container("ml", "fj-fj-a0", {"bubbles.dev/gpu-1": [f"{B}::1"]}, container="restart")
            assert "was cancelled (the FillJob was deleted)" in (err.value.details() or "")
    finally:
        node.stop()
