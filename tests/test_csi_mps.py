"""The node's MPS server through a Pod's ``csi.bubbles.dev`` volume (issue 36): where the agent runs MPS, each Pod's
directory carries the agent's MPS pipe and shared-memory directories at ``mps/pipe`` and ``mps/shm``
(bubbles.agent.csi.plugin, .podfs), with real bind mounts, as root.

Published as the kubelet publishes an inline volume (the target under ``<kubelet>/pods/<uid>/volumes/...``); the
container runtime's recursive bind of the target into a container and the kubelet's bind of a ``subPath`` are made
here by hand, as they would be. The "Pod" plants links in its directory the way a Pod can (it writes its directory
through its volume). Skipped, saying so, without root."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.mounts import why_no_bind_mounts
from tests.helpers.pki import Pki

from bubbles.agent.cli import csi_mps_dirs
from bubbles.agent.config import AgentConfig
from bubbles.agent.csi import podfs
from bubbles.agent.csi.mounts import KernelMounter
from bubbles.agent.csi.plugin import CsiNodePlugin
from bubbles.agent.csi.publish import (
    EPHEMERAL_KEY,
    POD_NAME_KEY,
    POD_NAMESPACE_KEY,
    POD_UID_KEY,
    MpsDirs,
    PodVolume,
    PublishRequest,
    mps_dirs_problem,
    plan_publish,
)
from bubbles.agent.isolation import IsolationConfig
from bubbles.core.api import IsolationMode
from bubbles.core.nodeaccess import POD_MPS_PIPE_SUBDIR, POD_MPS_SHM_SUBDIR

UID = "0f6c3a4e-7b1d-4c2a-9e8f-1a2b3c4d5e6f"


_MOUNT_PROBLEM = why_no_bind_mounts("the plugin bind-mounts (mount(2))")
needs_mount = pytest.mark.skipif(_MOUNT_PROBLEM is not None, reason=str(_MOUNT_PROBLEM))


class AdmitAll:
    """The node agent's side for fill volumes, admitting every Pod (admission is tests/test_csi_fills.py's)."""

    def admit_fill_volume(self, volume: PodVolume) -> str | None:
        return None

    def fill_volume_published(self, volume: PodVolume) -> None:
        pass

    def fill_volume_unpublished(self, volume: PodVolume) -> None:
        pass


class NoDetach(KernelMounter):
    """A kernel that will not detach anything (as if the Pod kept every mount point out of reach)."""

    def detach(self, target: str) -> None:
        raise OSError(errno.EBUSY, f"cannot detach the mount at {target}: refused by the test")


class FailingTargetBind(KernelMounter):
    """A kernel that refuses the recursive bind at the kubelet's target, after the MPS directories went in."""

    def bind(self, source: str, target: str, recursive: bool = False) -> None:
        if recursive:
            raise OSError(errno.EPERM, f"cannot bind-mount {source} at {target}: refused by the test")
        super().bind(source, target, recursive)


@dataclass
class Node:
    root: Path

    @property
    def kubelet(self) -> Path:
        return self.root / "k"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def mps(self) -> MpsDirs:
        return MpsDirs(str(self.root / "mps-pipe"), str(self.root / "agent-shm"))

    @property
    def pipe(self) -> Path:
        return Path(self.mps.pipe_dir)

    @property
    def shm(self) -> Path:
        return Path(self.mps.shm_dir)

    def pod_dir(self, uid: str = UID) -> Path:
        return self.run / "_pods" / uid

    def plugin(self, mps: bool = True, mounter: KernelMounter | None = None) -> CsiNodePlugin:
        plugin = CsiNodePlugin("node-a", self.run, self.kubelet, mounter, fill_pods=AdmitAll(),
                               mps=self.mps if mps else None)
        plugin.start()
        return plugin

    def request(self, uid: str = UID, volume: str = "bubbles", role: str = "training") -> PublishRequest:
        target = self.kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / volume / "mount"
        target.parent.mkdir(parents=True, exist_ok=True)  # the kubelet makes the parent, the plugin the target
        context = {POD_NAME_KEY: "train-0", POD_NAMESPACE_KEY: "ml", POD_UID_KEY: uid, EPHEMERAL_KEY: "true",
                   "role": role}
        return PublishRequest(f"csi-{uid[:8]}-{volume}", str(target), context)

    def mounts(self, below: Path | None = None) -> list[str]:
        return KernelMounter().mounts_below(str(below or self.root))

    def server_files(self) -> dict[str, str]:
        """What the "MPS server" keeps in its directories, by path relative to the root."""
        return {str(p.relative_to(self.root)): p.read_text() for d in (self.pipe, self.shm)
                for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def node() -> Iterator[Node]:
    # Under /tmp: short paths, and pytest's tmp_path is no place to leave a mount by mistake.
    root = Path(tempfile.mkdtemp(prefix="bmps-", dir="/tmp"))
    n = Node(root)
    (n.kubelet / "pods").mkdir(parents=True)
    n.pipe.mkdir()
    n.shm.mkdir()
    (n.pipe / "control").write_text("the control daemon's socket")
    (n.shm / "cuda.shm.0").write_text("the server's shared memory")
    try:
        yield n
    finally:
        m = KernelMounter()
        for _ in range(4):  # whatever a failed test left mounted, deepest first, by path: this is the test's tree
            for point in m.mounts_below(str(root)):
                with contextlib.suppress(OSError):
                    m.detach(point)
        if not m.mounts_below(str(root)):
            shutil.rmtree(root)


def _bind(source: Path, target: Path, recursive: bool = False) -> None:
    target.mkdir(parents=True, exist_ok=True)
    KernelMounter().bind(str(source), str(target), recursive)


@needs_mount
@pytest.mark.parametrize("role", ["training", "fill"])
def test_a_pods_volume_carries_the_mps_directories_into_its_containers_both_ways(node: Node, role: str) -> None:
    plugin = node.plugin()
    request = node.request(role=role)
    plugin.publish(request)
    target = Path(request.target_path)
    pod = node.pod_dir()
    assert node.mounts(pod) == [str(pod / POD_MPS_PIPE_SUBDIR), str(pod / POD_MPS_SHM_SUBDIR)]
    assert node.mounts(target.parent) == [str(target / POD_MPS_PIPE_SUBDIR), str(target / POD_MPS_SHM_SUBDIR),
                                          str(target)]
    # The container runtime binds the target recursively at /run/bubbles; the kubelet binds the subPath mps/shm at
    # /dev/shm (not recursively: the subPath is the mount itself).
    container = node.root / "container"
    _bind(target, container / "run" / "bubbles", recursive=True)
    _bind(target / POD_MPS_SHM_SUBDIR, container / "dev" / "shm")
    in_pipe = container / "run" / "bubbles" / POD_MPS_PIPE_SUBDIR
    in_shm = container / "dev" / "shm"
    assert (in_pipe / "control").read_text() == "the control daemon's socket"
    assert (in_shm / "cuda.shm.0").read_text() == "the server's shared memory"
    (in_shm / "cuda.shm.client").write_text("a client's")  # the other way round: the server sees the client's
    (in_pipe / "client.pipe").write_text("a client's pipe")
    assert (node.shm / "cuda.shm.client").read_text() == "a client's"
    assert (node.pipe / "client.pipe").read_text() == "a client's pipe"
    for point in (container / "dev" / "shm", container / "run" / "bubbles"):
        KernelMounter().detach(str(point))  # the runtime's, gone with the container


@needs_mount
def test_unpublish_detaches_everything_and_leaves_the_mps_servers_files(node: Node) -> None:
    plugin = node.plugin()
    request = node.request()
    plugin.publish(request)
    before = node.server_files()
    assert before
    plugin.unpublish(request.volume_id, request.target_path)
    assert node.mounts() == []
    assert not node.pod_dir().exists() and not Path(request.target_path).exists()
    assert node.server_files() == before


@needs_mount
def test_a_retried_publish_mounts_nothing_twice(node: Node) -> None:
    plugin = node.plugin()
    request = node.request()
    plugin.publish(request)
    once = node.mounts()
    plugin.publish(request)
    assert node.mounts() == once and len(once) == 5  # two in the Pod's directory, the target and its two
    # A second volume of the same Pod: its target carries them too; the Pod's directory keeps its two.
    second = node.request(volume="again")
    plugin.publish(second)
    pod = node.pod_dir()
    assert node.mounts(pod) == [str(pod / POD_MPS_PIPE_SUBDIR), str(pod / POD_MPS_SHM_SUBDIR)]
    assert len(node.mounts()) == 8
    plugin.unpublish(request.volume_id, request.target_path)
    assert len(node.mounts(node.pod_dir())) == 2  # the Pod's other volume still carries them
    plugin.unpublish(second.volume_id, second.target_path)
    assert node.mounts() == []


@needs_mount
def test_without_mps_a_pods_directory_has_no_mps(node: Node) -> None:
    plugin = node.plugin(mps=False)
    request = node.request()
    plugin.publish(request)
    assert list(node.pod_dir().iterdir()) == []
    assert node.mounts() == [request.target_path]
    plugin.unpublish(request.volume_id, request.target_path)
    assert node.mounts() == []


@needs_mount
def test_a_restarted_agent_whose_book_knows_the_volume_detaches_before_it_removes(node: Node) -> None:
    node.plugin().publish(request := node.request())
    before = node.server_files()
    again = node.plugin()  # a new agent, the same node: the book on disk, the mounts still there
    assert [v.volume_id for v in again.published()] == [request.volume_id]
    assert len(node.mounts(node.pod_dir())) == 2
    again.unpublish(request.volume_id, request.target_path)
    assert node.mounts() == [] and not node.pod_dir().exists()
    assert node.server_files() == before


@needs_mount
def test_a_pod_directory_left_by_a_crashed_agent_is_detached_so_no_removal_reaches_the_server(node: Node) -> None:
    node.plugin().publish(request := node.request())
    before = node.server_files()
    (node.run / "_pods" / "csi-volumes.json").unlink()  # it died before writing its book
    again = node.plugin()
    assert again.published() == ()
    assert node.mounts(node.pod_dir()) == []  # detached at start: its target keeps its own
    assert (Path(request.target_path) / POD_MPS_PIPE_SUBDIR / "control").exists()
    again.unpublish(request.volume_id, request.target_path)  # the kubelet's: the target's tree undone
    assert node.mounts() == []
    assert node.pod_dir().is_dir()  # whose it is the book cannot say: left, as before
    shutil.rmtree(node.pod_dir())  # an administrator's clean-up
    assert node.server_files() == before


@needs_mount
def test_a_pods_directory_is_not_removed_while_anything_stays_mounted_in_it(node: Node) -> None:
    node.plugin().publish(request := node.request())
    before = node.server_files()
    stuck = node.plugin(mounter=NoDetach())
    with pytest.raises(OSError, match="Device or resource busy"):  # the target's tree stays: the kubelet retries
        stuck.unpublish(request.volume_id, request.target_path)
    assert podfs.remove_tree(NoDetach(), node.pod_dir()) is False
    assert node.pod_dir().is_dir() and node.server_files() == before
    node.plugin().unpublish(request.volume_id, request.target_path)
    assert node.mounts() == [] and not node.pod_dir().exists() and node.server_files() == before


@needs_mount
def test_a_publish_that_fails_half_way_leaves_nothing_mounted(node: Node) -> None:
    plugin = node.plugin(mounter=FailingTargetBind())
    request = node.request()
    with pytest.raises(OSError, match="refused by the test"):
        plugin.publish(request)
    assert node.mounts() == []
    assert not node.pod_dir().exists() and not Path(request.target_path).exists()
    assert plugin.published() == ()
    assert node.server_files() != {}


@needs_mount
def test_a_missing_mps_directory_fails_the_publish_saying_so_and_mounts_nothing(node: Node) -> None:
    plugin = node.plugin()
    shutil.rmtree(node.shm)
    request = node.request()
    with pytest.raises(OSError, match=f"{node.shm} is not a directory, so Pods cannot be given it"):
        plugin.publish(request)
    assert node.mounts() == [] and not node.pod_dir().exists() and plugin.published() == ()


def _victim(node: Node) -> Path:
    """A directory of the node's that a Pod would like the agent to mount over or unmount, with a file in each of its
    ``pipe`` and ``shm``."""
    victim = node.root / "victim"
    for sub in ("pipe", "shm"):
        (victim / sub).mkdir(parents=True)
        (victim / sub / "keep").write_text("the node's")
    return victim


@needs_mount
def test_links_planted_for_a_republish_are_replaced_never_followed(node: Node) -> None:
    victim = _victim(node)
    plugin = node.plugin()
    first = node.request()
    plugin.publish(first)
    pod_side = Path(first.target_path)  # what the Pod writes
    os.rename(pod_side / "mps", pod_side / "moved")  # with the mounts in it
    os.symlink(victim, pod_side / "mps")
    second = node.request(volume="again")
    plugin.publish(second)
    assert node.mounts(victim) == []
    assert sorted(p.name for p in (victim / "pipe").iterdir()) == ["keep"]
    assert (node.pod_dir() / "mps").is_dir() and not (node.pod_dir() / "mps").is_symlink()
    assert (Path(second.target_path) / POD_MPS_PIPE_SUBDIR / "control").exists()
    before = node.server_files()
    plugin.unpublish(first.volume_id, first.target_path)
    plugin.unpublish(second.volume_id, second.target_path)
    assert node.mounts() == []  # the moved ones too
    assert not node.pod_dir().exists()
    assert node.server_files() == before
    assert (victim / "pipe" / "keep").exists() and (victim / "shm" / "keep").exists()


@needs_mount
def test_links_planted_before_an_agent_with_mps_starts_are_replaced_never_followed(node: Node) -> None:
    victim = _victim(node)
    node.plugin(mps=False).publish(request := node.request())
    pod_side = Path(request.target_path)
    (pod_side / "mps").mkdir()
    os.symlink(victim / "pipe", pod_side / "mps" / "pipe")
    (pod_side / "mps" / "shm").write_text("a file where a directory goes")
    with_mps = node.plugin()
    # The kubelet publishes again (a retry: the target is mounted already, without the MPS directories).
    with_mps.publish(request)
    pod = node.pod_dir()
    assert node.mounts(pod) == [str(pod / POD_MPS_PIPE_SUBDIR), str(pod / POD_MPS_SHM_SUBDIR)]
    assert not (pod / "mps" / "pipe").is_symlink() and (pod / POD_MPS_PIPE_SUBDIR / "control").exists()
    assert node.mounts(victim) == [] and sorted(p.name for p in (victim / "pipe").iterdir()) == ["keep"]
    with_mps.unpublish(request.volume_id, request.target_path)
    assert node.mounts() == [] and (victim / "pipe" / "keep").exists()


@needs_mount
def test_an_unpublish_never_unmounts_through_a_link_the_pod_planted(node: Node) -> None:
    victim = _victim(node)
    elsewhere = node.root / "elsewhere"
    elsewhere.mkdir()
    _bind(elsewhere, victim / "pipe")  # something of the node's mounted there
    plugin = node.plugin()
    plugin.publish(request := node.request())
    before = node.server_files()
    pod_side = Path(request.target_path)
    os.rename(pod_side / "mps", pod_side / "moved")
    os.symlink(victim, pod_side / "mps")
    plugin.unpublish(request.volume_id, request.target_path)
    assert node.mounts(victim) == [str(victim / "pipe")]  # still the node's
    assert node.mounts(node.run) == [] and node.mounts(node.kubelet) == []
    assert not node.pod_dir().exists() and victim.is_dir()
    assert node.server_files() == before


def test_mps_directories_that_cannot_be_carried_are_refused_saying_what_to_give() -> None:
    run = "/run/bubbles"
    assert mps_dirs_problem(MpsDirs("/tmp/nvidia-mps", "/dev/shm"), run) is None
    for mps, needle in [
        (MpsDirs("nvidia-mps", "/dev/shm"), "--mps-pipe-dir 'nvidia-mps' must be an absolute path"),
        (MpsDirs("/tmp/nvidia-mps/", "/dev/shm"), "must be an absolute path written without"),
        (MpsDirs("/tmp/nvidia-mps", "/dev/../dev/shm"), "the MPS shared-memory directory '/dev/../dev/shm' must be"),
        (MpsDirs("/run", "/dev/shm"), "must not contain one another (each Pod's directory carries /run): give a "
                                      "directory outside --run-dir"),
        (MpsDirs("/run/bubbles/_pods/x", "/dev/shm"), "give a directory outside --run-dir"),
        (MpsDirs("/dev/shm/mps", "/dev/shm"), "give the pipe directory a place of its own"),
    ]:
        problem = mps_dirs_problem(mps, run)
        assert problem is not None and needle in problem, (mps, problem)
        with pytest.raises(ValueError, match="give"):
            CsiNodePlugin("node-a", Path(run), Path("/var/lib/kubelet"), mps=mps)


def _config(mode: IsolationMode, **isolation: object) -> AgentConfig:
    return AgentConfig(Path("/run/bubbles"), "t", isolation=IsolationConfig(mode=mode, **isolation))  # type: ignore[arg-type]


def test_the_agent_passes_its_mps_directories_only_when_it_runs_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert csi_mps_dirs(_config(IsolationMode.CONTEXTS)) is None
    assert csi_mps_dirs(_config(IsolationMode.NONE)) is None
    assert csi_mps_dirs(_config(IsolationMode.MPS)) == MpsDirs("/tmp/nvidia-mps", "/dev/shm")
    assert csi_mps_dirs(_config(IsolationMode.MPS, mps_pipe_dir=Path("/var/run/mps"))) == \
        MpsDirs("/var/run/mps", "/dev/shm")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/mps-env")
    assert csi_mps_dirs(_config(IsolationMode.MPS)) == MpsDirs("/run/mps-env", "/dev/shm")


def test_the_plan_names_the_mps_directories_for_every_role_and_none_without_mps() -> None:
    mps = MpsDirs("/tmp/nvidia-mps", "/dev/shm")
    for role in ("training", "fill"):
        context = {POD_NAME_KEY: "p", POD_NAMESPACE_KEY: "ml", POD_UID_KEY: UID, EPHEMERAL_KEY: "true", "role": role}
        request = PublishRequest("v", f"/k/pods/{UID}/volumes/kubernetes.io~csi/b/mount", context)
        plan = plan_publish({}, request, run_dir="/run/bubbles", kubelet_pods_dir="/k/pods", mps=mps)
        assert [(s.source, s.subdir) for s in plan.submounts] == [("/tmp/nvidia-mps", "mps/pipe"),
                                                                  ("/dev/shm", "mps/shm")]
        again = plan_publish({"v": plan.volume}, request, run_dir="/run/bubbles", kubelet_pods_dir="/k/pods", mps=mps)
        assert again.already and again.submounts == plan.submounts
        assert plan_publish({}, request, run_dir="/run/bubbles", kubelet_pods_dir="/k/pods").submounts == ()


def test_the_command_line_exits_2_when_the_mps_directories_cannot_be_carried(tmp_path: Path, node: Node) -> None:
    pki = Pki.make(tmp_path / "pki")
    run = node.run
    r = subprocess.run(
        [sys.executable, "-m", "bubbles.cli", "agent", "--cluster", "--node", "node-x", "--csi", "--kubelet-dir",
         str(node.kubelet), "--run-dir", str(run), "--listen", "127.0.0.1:0", "--tls-cert",
         str(pki.server.cert), "--tls-key", str(pki.server.key), "--client-ca", str(pki.ca.cert), "--isolation", "mps",
         "--mps-daemon", "external", "--mps-pipe-dir", str(run / "_pods" / "mps")],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"cannot serve the CSI node plugin (--csi): --mps-pipe-dir {run}/_pods/mps and the Pods' directories " \
        f"{run}/_pods must not contain one another" in r.stderr
    assert "give a directory outside --run-dir" in r.stderr
