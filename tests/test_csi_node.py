"""The CSI node plugin over real gRPC on Unix sockets, with real bind mounts (bubbles.agent.csi.server and .plugin).

Called as the kubelet 1.20 calls it for a Pod's inline ephemeral volume (the same volume id, target path and
volume_context), into a temporary "kubelet directory"; and its registration with the kubelet's plugin watcher. Needs
root (mount(2)); skipped, saying so, without it. No kubelet is started here: that is the real-node tier's."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from bubbles.agent.csi import csi_socket, registration_socket
from bubbles.agent.csi.mounts import KernelMounter, Mounter
from bubbles.agent.csi.pb.csi.v1 import csi_pb2 as csi
from bubbles.agent.csi.pb.csi.v1 import csi_pb2_grpc as csi_grpc
from bubbles.agent.csi.pb.pluginregistration.v1 import api_pb2 as reg
from bubbles.agent.csi.pb.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from bubbles.agent.csi.plugin import CsiNodePlugin
from bubbles.agent.csi.publish import PodVolume, Role
from bubbles.agent.csi.server import CsiServer, serve
from bubbles.core import versions

UID = "0f6c3a4e-7b1d-4c2a-9e8f-1a2b3c4d5e6f"


def _can_mount() -> str | None:
    """Why bind mounts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root: the plugin bind-mounts (mount(2))"
    with tempfile.TemporaryDirectory(prefix="bcsi-probe-") as d:
        src, dst = Path(d, "a"), Path(d, "b")
        src.mkdir()
        dst.mkdir()
        m = KernelMounter()
        try:
            m.bind(str(src), str(dst))
        except OSError as exc:
            return f"cannot bind-mount here: {exc}"
        m.unmount(str(dst))
    return None


_MOUNT_PROBLEM = _can_mount()
needs_mount = pytest.mark.skipif(_MOUNT_PROBLEM is not None, reason=str(_MOUNT_PROBLEM))


@dataclass
class Node:
    root: Path
    kubelet: Path
    run: Path
    plugin: CsiNodePlugin
    server: CsiServer
    channel: grpc.Channel

    @property
    def identity(self) -> csi_grpc.IdentityStub:
        return csi_grpc.IdentityStub(self.channel)

    @property
    def node(self) -> csi_grpc.NodeStub:
        return csi_grpc.NodeStub(self.channel)


@pytest.fixture
def node() -> Iterator[Node]:
    with _node(None) as n:
        yield n


@contextlib.contextmanager
def _node(mounter: Mounter | None) -> Iterator[Node]:
    # Under /tmp, not pytest's tmp_path: a Unix socket's path is at most 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="bcsi-", dir="/tmp"))
    kubelet, run = root / "kubelet", root / "run"
    (kubelet / "pods").mkdir(parents=True)
    plugin = CsiNodePlugin("node-a", run, kubelet, mounter)
    plugin.start()
    server = serve(plugin, csi_socket(kubelet), registration_socket(kubelet))
    channel = grpc.insecure_channel(f"unix://{csi_socket(kubelet)}")
    try:
        yield Node(root, kubelet, run, plugin, server, channel)
    finally:
        channel.close()
        server.stop(0)
        if mounter is None:
            m = KernelMounter()
            for mount in sorted(root.rglob("mount"), reverse=True):  # whatever a failed test left mounted
                with contextlib.suppress(OSError):
                    m.unmount(str(mount))
        shutil.rmtree(root)


def kubelet_publish(kubelet: Path, uid: str = UID, volume: str = "bubbles", role: str = "training",
                    pod_info: bool = True, **kw: object) -> csi.NodePublishVolumeRequest:
    """NodePublishVolume as the kubelet 1.20 sends it for an inline volume (csi_mounter.go): the volume handle
    "csi-" + sha256(pod uid + volume name), the target under the Pod's directory (whose parent the kubelet made), a
    mount capability, and with podInfoOnMount the Pod's name, namespace, uid, service account and ephemeral."""
    target = kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / volume / "mount"
    target.parent.mkdir(parents=True, exist_ok=True)
    context = {"role": role}
    if pod_info:
        context |= {"csi.storage.k8s.io/pod.name": "train-0", "csi.storage.k8s.io/pod.namespace": "ml",
                    "csi.storage.k8s.io/pod.uid": uid, "csi.storage.k8s.io/serviceAccount.name": "default",
                    "csi.storage.k8s.io/ephemeral": "true"}
    fields: dict[str, object] = {
        "volume_id": "csi-" + hashlib.sha256((uid + volume).encode()).hexdigest(),
        "target_path": str(target),
        "volume_capability": csi.VolumeCapability(
            mount=csi.VolumeCapability.MountVolume(),
            access_mode=csi.VolumeCapability.AccessMode(mode=csi.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)),
        "readonly": False,
        "volume_context": context,
    }
    fields.update(kw)
    return csi.NodePublishVolumeRequest(**fields)  # type: ignore[arg-type]


@needs_mount
def test_identity_and_node_info_answer_as_a_node_plugin(node: Node) -> None:
    info = node.identity.GetPluginInfo(csi.GetPluginInfoRequest(), timeout=10)
    assert (info.name, info.vendor_version) == ("csi.bubbles.dev", versions.release())
    assert node.identity.Probe(csi.ProbeRequest(), timeout=10).ready.value is True
    assert list(node.identity.GetPluginCapabilities(csi.GetPluginCapabilitiesRequest(), timeout=10).capabilities) == []
    # No STAGE_UNSTAGE_VOLUME: the kubelet publishes directly, never calls NodeStageVolume.
    assert list(node.node.NodeGetCapabilities(csi.NodeGetCapabilitiesRequest(), timeout=10).capabilities) == []
    assert node.node.NodeGetInfo(csi.NodeGetInfoRequest(), timeout=10).node_id == "node-a"
    with pytest.raises(grpc.RpcError) as err:  # left out of the subset: answered as not implemented
        node.channel.unary_unary("/csi.v1.Node/NodeStageVolume")(b"", timeout=10)
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED


@needs_mount
def test_publish_bind_mounts_the_pods_own_directory_and_unpublish_removes_it(node: Node) -> None:
    request = kubelet_publish(node.kubelet)
    target = Path(request.target_path)
    node.node.NodePublishVolume(request, timeout=10)
    pod_dir = node.run / "_pods" / UID
    assert KernelMounter().is_mounted(str(target))
    (target / "hook.json").write_text("{}")  # as the Pod writes through its mount
    assert (pod_dir / "hook.json").read_text() == "{}"
    assert stat.S_IMODE(pod_dir.stat().st_mode) == 0o777  # whatever UID the Pod runs as
    assert stat.S_IMODE((node.run / "_pods").stat().st_mode) == 0o700  # and no one else on the node
    expected = PodVolume(request.volume_id, str(target), "ml", "train-0", UID, Role.TRAINING, "default", str(pod_dir))
    assert node.plugin.published() == (expected,)

    node.node.NodePublishVolume(request, timeout=10)  # the kubelet retries: OK, one mount
    mounts = Path("/proc/self/mountinfo").read_text().split("\n")
    assert sum(line.split(" ")[4] == str(target) for line in mounts if line) == 1

    # A restarted agent knows what it published (the state file), and unpublishes it.
    state = json.loads((node.run / "_pods" / "csi-volumes.json").read_text())
    assert [v["uid"] for v in state["volumes"]] == [UID]
    restarted = CsiNodePlugin("node-a", node.run, node.kubelet)
    restarted.start()
    assert restarted.published() == (expected,)

    node.node.NodeUnpublishVolume(csi.NodeUnpublishVolumeRequest(volume_id=request.volume_id,
                                                                 target_path=str(target)), timeout=10)
    assert not KernelMounter().is_mounted(str(target))
    assert not target.exists() and not pod_dir.exists()
    assert node.plugin.published() == ()
    # Again, and for a volume never published: OK (CSI).
    node.node.NodeUnpublishVolume(csi.NodeUnpublishVolumeRequest(volume_id=request.volume_id,
                                                                 target_path=str(target)), timeout=10)
    node.node.NodeUnpublishVolume(csi.NodeUnpublishVolumeRequest(volume_id="csi-never",
                                                                 target_path="/nowhere/mount"), timeout=10)


@needs_mount
def test_an_agent_that_lost_its_state_still_undoes_the_kubelets_mount(node: Node) -> None:
    request = kubelet_publish(node.kubelet)
    node.node.NodePublishVolume(request, timeout=10)
    (node.run / "_pods" / "csi-volumes.json").write_text("{not json")
    amnesiac = CsiNodePlugin("node-a", node.run, node.kubelet)
    amnesiac.start()
    assert amnesiac.published() == ()
    assert (node.run / "_pods" / "csi-volumes.json.unreadable").exists()
    amnesiac.unpublish(request.volume_id, request.target_path)
    assert not KernelMounter().is_mounted(request.target_path)
    assert not Path(request.target_path).exists()


@needs_mount
@pytest.mark.parametrize(("change", "code", "needle"), [
    ({"target_path": "/tmp/bcsi-outside/mount"}, grpc.StatusCode.INVALID_ARGUMENT,
     "is not in the kubelet's directory of Pod"),
    ({"pod_info": False}, grpc.StatusCode.FAILED_PRECONDITION,
     "set podInfoOnMount: true in the CSIDriver csi.bubbles.dev (the chart does)"),
    ({"role": "painter"}, grpc.StatusCode.INVALID_ARGUMENT, "volumeAttributes.role must be training or fill"),
    ({"readonly": True}, grpc.StatusCode.INVALID_ARGUMENT, "set readOnly: false"),
    ({"volume_capability": csi.VolumeCapability(block=csi.VolumeCapability.BlockVolume())},
     grpc.StatusCode.INVALID_ARGUMENT, "mount volume_capability"),
])
def test_a_refused_publish_mounts_nothing_and_says_what_to_set(node: Node, change: dict[str, Any],
                                                               code: grpc.StatusCode, needle: str) -> None:
    request = kubelet_publish(node.kubelet, **change)
    with pytest.raises(grpc.RpcError) as err:
        node.node.NodePublishVolume(request, timeout=10)
    assert err.value.code() is code
    assert needle in (err.value.details() or "")
    assert not Path(request.target_path).exists()
    assert not Path("/tmp/bcsi-outside").exists()
    assert node.plugin.published() == ()
    assert list((node.run / "_pods").iterdir()) == []


@needs_mount
def test_registration_tells_the_kubelet_where_the_csi_socket_is(node: Node) -> None:
    path = registration_socket(node.kubelet)
    assert stat.S_ISSOCK(path.lstat().st_mode) and stat.S_IMODE(path.lstat().st_mode) == 0o600
    assert stat.S_IMODE(csi_socket(node.kubelet).lstat().st_mode) == 0o600
    with grpc.insecure_channel(f"unix://{path}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = stub.GetInfo(reg.InfoRequest(), timeout=10)
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
            ("CSIPlugin", "csi.bubbles.dev", str(csi_socket(node.kubelet)), ["1.0.0"])
        registration = node.server.registration
        assert registration is not None and registration.registered is None
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error="no CSINode"), timeout=10)
        assert (registration.registered, registration.error) == (False, "no CSINode")
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=10)
        assert (registration.registered, registration.error) == (True, "")
    node.server.stop(0)
    assert not path.exists() and not csi_socket(node.kubelet).exists()  # the kubelet then unregisters the plugin


@needs_mount
def test_a_socket_left_by_an_earlier_agent_is_replaced_and_anything_else_refused(node: Node) -> None:
    node.server.stop(0)
    sock = csi_socket(node.kubelet)
    import socket

    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(sock))  # an agent killed before it could remove its socket
    again = serve(node.plugin, sock, None)
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            assert csi_grpc.NodeStub(channel).NodeGetInfo(csi.NodeGetInfoRequest(), timeout=10).node_id == "node-a"
    finally:
        again.stop(0)
    sock.write_text("not a socket")
    with pytest.raises(OSError, match="exists and is not a socket; remove it"):
        serve(node.plugin, sock, None)
    with pytest.raises(OSError, match="give a shorter --kubelet-dir"):
        serve(node.plugin, node.root / ("x" * 100) / "csi.sock", None)


class RefusingKernel:
    """A kernel that refuses every mount, as in a container without CAP_SYS_ADMIN."""

    def bind(self, source: str, target: str) -> None:
        raise OSError(errno.EPERM, f"cannot bind-mount {source} at {target}: Operation not permitted (the agent "
                      "needs CAP_SYS_ADMIN: run it privileged)")

    def unmount(self, target: str) -> None:
        raise AssertionError("nothing was mounted")

    def is_mounted(self, target: str) -> bool:
        return False


def test_a_mount_the_kernel_refuses_is_internal_and_leaves_nothing_behind() -> None:
    with _node(RefusingKernel()) as node:
        request = kubelet_publish(node.kubelet)
        with pytest.raises(grpc.RpcError) as err:
            node.node.NodePublishVolume(request, timeout=10)
        assert err.value.code() is grpc.StatusCode.INTERNAL
        assert "needs CAP_SYS_ADMIN: run it privileged" in (err.value.details() or "")
        assert not Path(request.target_path).exists()
        assert list((node.run / "_pods").iterdir()) == []
        assert node.plugin.published() == ()
