"""The kubelet's PodResources API as the agent asks it: the committed stubs are what tools/gen-proto.sh makes of
proto/podresources/, the names and numbers on the wire are the kubelet's (v1, Kubernetes 1.20), and the client, over a
real Unix socket to a stand-in kubelet, lists every container's devices or says why it cannot."""

from __future__ import annotations

import filecmp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.podresources import StandInPodResources

from bubbles.agent import podresources
from bubbles.agent.podresources import ContainerDevices, mount_problem, socket_beside, socket_problem
from bubbles.agent.podresources.client import PodResourcesUnavailable, list_devices
from bubbles.agent.podresources.pb.podresources.v1 import api_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "agent" / "bubbles" / "agent" / "podresources" / "pb" / "podresources" / "v1"
A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"


@pytest.fixture
def root() -> Iterator[Path]:
    # Short: a Unix socket's path must fit in 108 bytes, which pytest's tmp_path may not.
    d = Path(tempfile.mkdtemp(prefix="bubbles-pr-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(root: Path) -> Iterator[StandInPodResources]:
    k = StandInPodResources(root / "pod-resources" / "kubelet.sock")
    k.start()
    yield k
    k.stop()


def test_the_committed_stubs_are_generated_from_the_proto(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "tools" / "gen-proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=120)
    fresh = tmp_path / "bubbles" / "agent" / "podresources" / "pb" / "podresources" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names == ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"]
    stale = [n for n in names if not filecmp.cmp(fresh / n, STUBS / n, shallow=False)]
    assert not stale, f"{stale} differ from the .proto: run tools/gen-proto.sh and commit the result"


def test_the_wire_names_and_numbers_are_the_kubelets() -> None:
    file = pb.DESCRIPTOR
    assert file.package == "v1"
    assert [m.name for m in file.services_by_name["PodResourcesLister"].methods] == ["List"]

    def numbers(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(pb.ListPodResourcesResponse) == {"pod_resources": 1}
    assert numbers(pb.PodResources) == {"name": 1, "namespace": 2, "containers": 3}
    assert numbers(pb.ContainerResources) == {"name": 1, "devices": 2}
    assert numbers(pb.ContainerDevices) == {"resource_name": 1, "device_ids": 2}
    # A newer kubelet's container with its CPUs (field 3: cpu_ids 2 and 3) and a device's topology (field 3: NUMA node
    # 1): read, and the fields this subset does not know kept.
    upstream = bytes.fromhex("0a0163" "120c0a01721201781a040a020801" "1a020203")
    c = pb.ContainerResources.FromString(upstream)
    assert (c.name, c.devices[0].resource_name, list(c.devices[0].device_ids)) == ("c", "r", ["x"])
    assert c.SerializeToString() == upstream


def test_the_client_lists_every_containers_devices_by_resource(kubelet: StandInPodResources) -> None:
    kubelet.hold("ml", "fill-a0", "main", {"bubbles.dev/gpu-0": [f"{A}::1"], "example.com/nic": ["n0", "n1"]})
    kubelet.hold("ml", "fill-a0", "side", {"bubbles.dev/gpu-0": [f"{A}::2"]})
    kubelet.hold("web", "nginx", "nginx", {})
    got = list_devices(kubelet.socket)
    assert got == (
        ContainerDevices("ml", "fill-a0", "main", "bubbles.dev/gpu-0", (f"{A}::1",)),
        ContainerDevices("ml", "fill-a0", "main", "example.com/nic", ("n0", "n1")),
        ContainerDevices("ml", "fill-a0", "side", "bubbles.dev/gpu-0", (f"{A}::2",)),
    )  # in the kubelet's order; a Pod without devices holds nothing to list
    assert kubelet.calls == 1


def test_a_kubelet_that_cannot_be_asked_is_said_why(root: Path, kubelet: StandInPodResources) -> None:
    with pytest.raises(PodResourcesUnavailable, match=r"/nowhere/kubelet\.sock does not exist"):
        list_devices(root / "nowhere" / "kubelet.sock")
    plain = root / "plain"
    plain.write_text("")
    with pytest.raises(PodResourcesUnavailable, match="is not a socket"):
        list_devices(plain)
    # A socket nobody listens on any more (a kubelet that died): refused at once, not after the timeout.
    dead = root / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()
    with pytest.raises(PodResourcesUnavailable, match="UNAVAILABLE"):
        list_devices(dead, timeout_s=2.0)
    kubelet.unimplemented = True
    with pytest.raises(PodResourcesUnavailable, match=r"does not serve PodResources v1 \(Kubernetes 1.20 or later"):
        list_devices(kubelet.socket)


def test_the_socket_flag_is_checked_saying_what_to_give(root: Path, kubelet: StandInPodResources) -> None:
    assert socket_beside(Path("/var/lib/kubelet/device-plugins")) == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    assert socket_problem(kubelet.socket) is None and mount_problem(kubelet.socket) is None
    assert socket_problem(root / "not-yet.sock") is None  # the kubelet may make it later
    plain = root / "plain"
    plain.write_text("")
    for path, needle in [
        (Path("pod-resources/kubelet.sock"), "must be an absolute path written plainly"),
        (Path("/var/lib/kubelet/../kubelet.sock"), "must be an absolute path written plainly"),
        (Path("/" + "d" * 120 + "/kubelet.sock"), "longer than the 107 a Unix socket allows"),
        (kubelet.socket.parent, f"is a directory: give the socket in it ({kubelet.socket})"),
        (plain, "is not a socket"),
    ]:
        problem = socket_problem(path)
        assert problem is not None and problem.startswith("--pod-resources-socket") and needle in problem, problem
    problem = mount_problem(root / "unmounted" / podresources.SOCKET_NAME)
    assert problem is not None and f"its directory {root / 'unmounted'} does not exist" in problem
    assert "mount the kubelet's pod-resources directory there" in problem
