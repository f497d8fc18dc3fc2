"""The node agent serves trainings whose hook writes into their Pod's own CSI volume (issue 36): the cards in each
training Pod's directory (``<run_dir>/_pods/<pod uid>/``), trusted only for the namespace the kubelet named; every path
of a GPU in the directory its card was found in; the agent's socket there reachable by a training of any UID; each
GPU's device-plugin resource in the report; a Pod that goes, and an agent that restarts.

The pure rule and the agent's bookkeeping run against a stand-in list of published volumes; the end-to-end test
publishes through a real ``CsiNodePlugin`` with real bind mounts, and runs a real hook (on a stand-in DeepSpeed engine)
in a process that drops to UID 1000, as a training Pod runs as any user. That one needs root (mount(2), setuid): it
fails, saying so, without it, rather than pass by skipping."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from helpers.agent import TESTS, TRAINING, Hook, cycle, gpu, wait_for
from helpers.agent_cluster import NODE, TR, write_card
from helpers.mounts import why_no_bind_mounts

from bubbles.agent.cli import gpu_resources
from bubbles.agent.cluster import ClusterConfig, NodeAgent, newest_cards, training_volumes
from bubbles.agent.config import AgentConfig
from bubbles.agent.csi.mounts import KernelMounter
from bubbles.agent.csi.plugin import CsiNodePlugin
from bubbles.agent.csi.publish import PodVolume, PublishRequest
from bubbles.agent.deviceplugin.decide import NodeGpu, gpus_from_devices
from bubbles.agent.isolation import IsolationConfig
from bubbles.agent.server import Agent
from bubbles.core import paths, wire
from bubbles.core.api import IsolationMode
from bubbles.core.card import Card, card_is_stale, pod_card_problem, read_cards, read_pod_cards
from bubbles.core.nodeaccess import Role

POD_UID = "0f6c3a4e-7b1d-4c2a-9e8f-1a2b3c4d5e6f"
TRAINING_UID = 1000  # not the agent's (root's): a training Pod runs as whatever user its image says


def volume(run: Path, uid: str = POD_UID, pod: str = "train-0", namespace: str = "ml",
           role: Role = Role.TRAINING, volume_id: str = "") -> PodVolume:
    """A published volume as ``CsiNodePlugin.published()`` lists it."""
    return PodVolume(volume_id or f"csi-{uid}", f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~csi/bubbles/mount",
                     namespace, pod, uid, role, "default", str(run / "_pods" / uid))


def a_card(namespace: str = "ml", pod: str = "whatever-the-hook-thinks", version: int = 4, **kw: object) -> Card:
    fields: dict[str, object] = {"training": TRAINING, "stage": 0, "stages": 2, "namespace": namespace, "pod": pod,
                                 "device": "cpu", "gpu_uuid": None, "version": version, "rank": 0, "ranks": 1, **kw}
    return Card.parse(fields, "card")


# -- the trust rule, pure -----------------------------------------------------------------------------------------
def test_a_pods_card_counts_only_for_the_namespace_the_kubelet_named() -> None:
    assert pod_card_problem(a_card(), "ml", "train-0") is None
    # The hook's Pod name is its hostname where $POD_NAME is unset: not judged (the kubelet's is taken instead).
    assert pod_card_problem(a_card(pod="train-0.short"), "ml", "train-0") is None
    other = pod_card_problem(a_card(namespace="prod"), "ml", "train-0")
    assert other is not None and "names namespace 'prod'" in other and "Pod train-0 in namespace 'ml'" in other
    assert "set POD_NAMESPACE from the downward API" in other and "metadata.namespace" in other
    # A training Pod that does not pass its namespace to the hook writes _local: not its namespace either.
    local = pod_card_problem(a_card(namespace="_local"), "ml", "train-0")
    assert local is not None and "names namespace '_local'" in local
    old = pod_card_problem(a_card(namespace="", version=3), "ml", "train-0")
    assert old is not None and "card v3, before a card per rank" in old
    assert "upgrade bubbles in the training's image (card v4 or later)" in old


def test_only_training_pods_volumes_are_read_once_per_pod(tmp_path: Path) -> None:
    a = volume(tmp_path, uid="aa", pod="a")
    a_again = volume(tmp_path, uid="aa", pod="a", volume_id="csi-aa-2")  # a second volume of the same Pod
    fill = volume(tmp_path, uid="ff", pod="fill-0", role=Role.FILL)
    b = volume(tmp_path, uid="bb", pod="b", namespace="lab")
    assert training_volumes([fill, b, a_again, a]) == [b, a]


def test_two_live_cards_of_one_gpu_count_once_and_the_other_is_said(tmp_path: Path) -> None:
    one, two = a_card(pod="p1"), a_card(pod="p2")
    chosen, problems = newest_cards([(one, tmp_path / "n"), (two, tmp_path / "pod")])
    assert chosen == {one.key: (one, tmp_path / "n")}
    assert len(problems) == 1 and "has a live card in" in problems[0] and "not from Pod p2's" in problems[0]
    v3 = a_card(version=3, namespace="ml")
    chosen, problems = newest_cards([(v3, tmp_path / "n"), (one, tmp_path / "pod")])  # a newer hook: no mistake
    assert chosen == {one.key: (one, tmp_path / "pod")} and problems == []


def test_a_pods_cards_are_read_with_its_kubelet_name_and_foreign_or_linked_ones_refused(tmp_path: Path) -> None:
    root = tmp_path / "_pods" / POD_UID
    write_card(root, pod="hostname-guess")
    write_card(root, namespace="prod", training="theirs")
    elsewhere = tmp_path / "elsewhere"
    write_card(elsewhere, training="linked")
    (root / "ml" / "linked").symlink_to(elsewhere / "ml" / "linked")
    cards, problems = read_pod_cards(root, "ml", "train-0")
    assert [(c.training, c.pod, c.namespace) for c in cards] == [(TRAINING, "train-0", "ml")]
    assert cards[0].instance == a_card(pid=1).instance  # the same process: only the name is the kubelet's
    assert len(problems) == 2, problems
    foreign = next(p for p in problems if "theirs" in p)
    assert f"{root}/prod/theirs/stage-0/rank-0/hook.json (the volume of Pod ml/train-0)" in foreign
    assert "names namespace 'prod'" in foreign
    linked = next(p for p in problems if "linked" in p)
    assert "outside the Pod's volume" in linked and "remove the link" in linked
    # The node's own scan never reads the Pods' directories as the node's tree, even a card planted at a Pod's top.
    (root / "stage-0" / "rank-0").mkdir(parents=True)
    (root / "stage-0" / "rank-0" / paths.HOOK_CARD_NAME).write_text((root / "ml" / TRAINING / "stage-0" / "rank-0" /
                                                                     paths.HOOK_CARD_NAME).read_text())
    assert read_cards(tmp_path) == ([], [])


# -- the node agent, with a stand-in list of published volumes --------------------------------------------------
@pytest.fixture
def run() -> Iterator[Path]:
    """A run directory under /tmp (a socket's path in a Pod's directory must fit 107 bytes)."""
    short = Path(tempfile.mkdtemp(prefix="bct-", dir="/tmp"))
    yield short / "run"
    shutil.rmtree(short, ignore_errors=True)


def node_agent(run: Path, volumes: list[PodVolume], retire_after_s: float = 30.0,
               gpu_resources: Callable[[], Mapping[str, str]] | None = None) -> NodeAgent:
    """A started node agent that scans when the test says (``scan()``), reading the Pods' directories ``volumes``
    lists at each scan."""
    template = AgentConfig(run_dir=run, training="placeholder", isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=3600.0, retire_after_s=retire_after_s),
                  pods=lambda: tuple(volumes), gpu_resources=gpu_resources)
    n.start()
    return n


def test_a_training_in_two_pods_is_one_training_served_in_two_directories(run: Path) -> None:
    a, b = volume(run, uid="aaaa", pod="llama-0"), volume(run, uid="bbbb", pod="llama-1")
    fill = volume(run, uid="ffff", pod="fj-0", role=Role.FILL)
    write_card(Path(a.directory), stage=0, stages=2, pod="x")
    write_card(Path(b.directory), stage=1, stages=2, pod="y")
    write_card(Path(fill.directory), stage=0, stages=2, training="from-a-fill-pod")  # never read
    n = node_agent(run, [a, b, fill])
    try:
        assert list(n.trainings) == [TR]
        stages = n.report().stages
        assert [(s.stage, s.pod) for s in stages] == [(0, "llama-0"), (1, "llama-1")]
        tr = n.trainings[TR]
        for v, stage in ((a, 0), (b, 1)):
            directory = paths.gpu_dir(v.directory, gpu(stage, namespace="ml"))
            assert tr.directory(gpu(stage, namespace="ml")) == directory
            assert tr.agent.core.executor(gpu(stage, namespace="ml")).directory == directory
            assert (directory / paths.AGENT_SOCKET_NAME).is_socket()
        assert not (run / "ml").exists()  # nothing of it in the node's tree
        hook = Hook(run, stage=1, directory=paths.gpu_dir(b.directory, gpu(1, namespace="ml")))
        try:
            hook.send(wire.encode_profile(1, cycle(stage=1)), agent_only=True)
            wait_for(lambda: n.report().stages[1].cycle is not None, what="stage 1's profile, from Pod llama-1")
            assert n.report().stages[0].cycle is None
        finally:
            hook.close()
    finally:
        n.stop()
    assert not (paths.gpu_dir(a.directory, gpu(0, namespace="ml")) / paths.AGENT_SOCKET_NAME).exists()


def test_a_card_naming_another_namespace_in_a_pods_directory_is_ignored_and_said_once(
        run: Path, caplog: pytest.LogCaptureFixture) -> None:
    v = volume(run)
    write_card(Path(v.directory), namespace="prod", training="theirs")
    with caplog.at_level(logging.WARNING, logger="bubbles.agent.cluster"):
        n = node_agent(run, [v])
        try:
            n.scan()
            n.scan()
            assert n.trainings == {} and n.report().stages == ()
            warned = [r.getMessage() for r in caplog.records if "names namespace 'prod'" in r.getMessage()]
            assert len(warned) == 1, warned
            assert "ignoring a hook card" in warned[0] and "the volume of Pod ml/train-0" in warned[0]
            assert not (paths.gpu_dir(v.directory, gpu(namespace="prod", training="theirs")) /
                        paths.AGENT_SOCKET_NAME).exists()
        finally:
            n.stop()


def test_a_removed_pod_directory_is_not_made_again_and_a_replacement_pod_takes_the_gpu(run: Path) -> None:
    old, new = volume(run, uid="aaaa", pod="llama-0"), volume(run, uid="bbbb", pod="llama-0-new")
    volumes = [old]
    write_card(Path(old.directory))
    n = node_agent(run, volumes, retire_after_s=3600.0)
    try:
        tr = n.trainings[TR]
        key = gpu(namespace="ml")
        shutil.rmtree(old.directory)  # unpublished: the plugin removed the Pod's directory
        volumes.clear()
        n.scan()
        assert n.report().stages == () and TR in n.trainings
        assert not Path(old.directory).exists()
        volumes.append(new)
        write_card(Path(new.directory), pod="whatever")
        n.scan()
        (stage,) = n.report().stages
        assert stage.pod == "llama-0-new"
        assert tr.agent.core.executor(key).directory == paths.gpu_dir(new.directory, key)
        assert (paths.gpu_dir(new.directory, key) / paths.AGENT_SOCKET_NAME).is_socket()
        assert not Path(old.directory).exists()  # the socket moved; nothing was made where the old Pod was
    finally:
        n.stop()


def test_a_link_a_pod_put_in_place_of_fills_is_not_followed(run: Path) -> None:
    """The agent is root on the node: a Pod's fills/ made a link to a node directory must not have the agent chmod
    (or chown, or bind in) that directory; the GPU is not served instead."""
    v = volume(run)
    write_card(Path(v.directory))
    victim = run.parent / "victim"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    fills = paths.fills_dir(v.directory, gpu(namespace="ml"))
    fills.symlink_to(victim)
    n = node_agent(run, [v])
    try:
        assert (os.stat(victim).st_mode & 0o777) == 0o755 and list(victim.iterdir()) == []
        assert n.report().stages == ()
    finally:
        n.stop()


def test_an_agent_whose_gpu_directory_is_gone_binds_nothing_and_makes_nothing(run: Path) -> None:
    template = AgentConfig(run_dir=run, training=TRAINING, namespace="ml",
                           isolation=IsolationConfig(mode=IsolationMode.NONE), metrics=False)
    here = paths.gpu_dir(run / "_pods" / "aaaa", gpu(0, namespace="ml"))
    gone = paths.gpu_dir(run / "_pods" / "bbbb", gpu(1, namespace="ml"))
    paths.make_private_dir(here)
    agent = Agent(template, gpus=[(gpu(0, namespace="ml"), here, "cpu"), (gpu(1, namespace="ml"), gone, "cpu")])
    with pytest.raises(FileNotFoundError):
        agent.start()
    assert not (run / "_pods" / "bbbb").exists()
    assert not (here / paths.AGENT_SOCKET_NAME).exists()  # the one bound before the failure was closed and removed


def test_each_gpu_reports_the_device_plugins_resource_for_its_uuid(run: Path) -> None:
    known = gpu_resources(gpus_from_devices({"GPU-5": "cuda:3", "GPU-6": "cuda:0"}))
    assert known == {"GPU-5": "bubbles.dev/gpu-3", "GPU-6": "bubbles.dev/gpu-0"}
    assert gpu_resources([NodeGpu(2, "GPU-7", healthy=False)]) == {"GPU-7": "bubbles.dev/gpu-2"}
    write_card(run, stage=0, stages=3, gpu_uuid="GPU-5")
    write_card(run, stage=1, stages=3, gpu_uuid="GPU-unknown")  # not one the device plugin serves
    write_card(run, stage=2, stages=3)  # a CPU stage: no UUID
    n = node_agent(run, [], gpu_resources=lambda: known)
    try:
        assert [(s.stage, s.gpu_resource) for s in n.report().stages] == [
            (0, "bubbles.dev/gpu-3"), (1, ""), (2, "")]
    finally:
        n.stop()
    plain = node_agent(run, [])  # no --device-plugin
    try:
        assert [s.gpu_resource for s in plain.report().stages] == ["", "", ""]
    finally:
        plain.stop()


# -- for real: the CSI node plugin publishes, a training of another UID hooks in, the agent serves it --------------
def _why_not_real() -> str | None:
    return why_no_bind_mounts("bind mounts (mount(2)) and a training process that drops to another UID")


TRAINING_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from helpers.hook import StandInEngine  # imported as root: the interpreter's files are root's alone here
    from bubbles.training.hook import instrument
    import fcntl, json, tempfile  # what the hook imports later
    os.setgroups([])
    os.setgid({uid})
    os.setuid({uid})
    eng = StandInEngine(stage=0, stages=2, micro_batches=2, wait_s=0.002)
    inst = instrument(eng, training={training!r}, run_dir={run_dir!r}, warmup_iterations=1, profile_iterations=3)
    print("uid", os.getuid(), flush=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        eng.train_batch()
""")


def line_starting(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    """The first line ``proc`` prints that starts with ``prefix`` (DeepSpeed prints its own before), waited for at most
    ``timeout_s``; AssertionError with its stderr otherwise."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line
            if not line:
                break
    proc.kill()
    raise AssertionError(f"the training did not print {prefix!r} in {timeout_s:g} s: "
                         f"{proc.communicate()[1][-3000:]}")


@contextlib.contextmanager
def published_training_pod(root: Path) -> Iterator[tuple[CsiNodePlugin, PublishRequest, Path]]:
    """A CSI node plugin under ``root`` and a training Pod's volume published by it, as the kubelet asks: the target
    in the Pod's kubelet directory, the Pod named in volume_context; and the target mounted again where the Pod's
    container sees it (``<root>/c``, its /run/bubbles: as short, where the target's path is too long for a socket's).
    Whatever stays mounted is undone after."""
    kubelet, run = root / "kubelet", root / "run"
    plugin = CsiNodePlugin(NODE, run, kubelet)
    plugin.start()
    target = kubelet / "pods" / POD_UID / "volumes" / "kubernetes.io~csi" / "bubbles" / "mount"
    target.parent.mkdir(parents=True)
    request = PublishRequest("csi-" + hashlib.sha256((POD_UID + "bubbles").encode()).hexdigest(), str(target), {
        "role": "training", "csi.storage.k8s.io/pod.name": "train-0", "csi.storage.k8s.io/pod.namespace": "ml",
        "csi.storage.k8s.io/pod.uid": POD_UID, "csi.storage.k8s.io/serviceAccount.name": "default",
        "csi.storage.k8s.io/ephemeral": "true"})
    plugin.publish(request)
    container = root / "c"
    container.mkdir()
    KernelMounter().bind(str(target), str(container))  # what the container runtime does with the volume's target
    try:
        yield plugin, request, container
    finally:
        for mount in (container, target):
            with contextlib.suppress(OSError):
                KernelMounter().unmount(str(mount))


def test_a_training_of_another_uid_in_its_pods_volume_is_served_found_again_after_a_restart_and_let_go(
        tmp_path: Path) -> None:
    why = _why_not_real()
    assert why is None, f"this test needs what this machine lacks: {why}"
    root = Path(tempfile.mkdtemp(prefix="bct-", dir="/tmp"))
    os.chmod(root, 0o755)  # the training's user reaches its volume's target through here, as through /var/lib/kubelet
    proc: subprocess.Popen[str] | None = None
    nodes: list[NodeAgent] = []
    try:
        with published_training_pod(root) as (plugin, request, container):
            run = plugin.run_dir
            (pod_volume,) = plugin.published()
            key = gpu(namespace="ml")
            directory = paths.gpu_dir(pod_volume.directory, key)

            def start_node(p: CsiNodePlugin) -> NodeAgent:
                template = AgentConfig(run_dir=run, training="placeholder",
                                       isolation=IsolationConfig(mode=IsolationMode.NONE))
                n = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=0.05, retire_after_s=0.5),
                              pods=p.published)
                n.start()
                nodes.append(n)
                return n

            node = start_node(plugin)
            env = {k: v for k, v in os.environ.items() if k != "POD_NAME"}  # the hook names its Pod by hostname
            env |= {"POD_NAMESPACE": "ml", "OMP_NUM_THREADS": "1", "HOME": str(root)}
            script = TRAINING_SCRIPT.format(tests=TESTS, uid=TRAINING_UID, training=TRAINING,
                                            run_dir=str(container))  # /run/bubbles, in the Pod
            proc = subprocess.Popen([sys.executable, "-c", script], env=env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
            assert line_starting(proc, "uid ", 120).split() == ["uid", str(TRAINING_UID)]

            # The hook wrote its tree in the Pod's volume, as the training's user; the agent found it there.
            assert os.stat(directory).st_uid == TRAINING_UID
            profiled = wait_for(lambda: (s := node.report().stages) and s[0].cycle is not None and s[0], 60,
                                "the agent to hear the profile of the training's hook (UID 1000)")
            assert (profiled.namespace, profiled.training, profiled.stage) == ("ml", TRAINING, 0)
            assert profiled.pod == "train-0"  # the kubelet's name, not the hostname the hook wrote
            assert profiled.hook_reporting
            tr = node.trainings[TR]
            assert tr.agent.core.executor(key).directory == directory
            assert tr.agent.core.executor(key).training_pid == proc.pid  # the kernel named the sender
            sock = directory / paths.AGENT_SOCKET_NAME
            assert os.stat(sock).st_uid == TRAINING_UID  # the training's user may send to it, as it did
            assert not (run / "ml").exists()  # nothing of the training in the node's own tree

            # The agent restarts (a new DaemonSet Pod): a new plugin reads the book, a new agent finds the training.
            node.stop()
            assert not sock.exists()
            again = CsiNodePlugin(NODE, run, plugin.kubelet_dir)
            again.start()
            assert again.published() == (pod_volume,)
            node = start_node(again)
            assert node.trainings[TR].agent is not tr.agent
            wait_for(lambda: (s := node.report().stages) and s[0].cycle is not None, 60,
                     "the restarted agent to hear the hook's profile again")
            assert os.stat(sock).st_uid == TRAINING_UID

            # The Pod goes: its containers are stopped (their mounts with them), then the kubelet unpublishes its
            # volume.
            tr = node.trainings[TR]
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            KernelMounter().unmount(str(container))
            again.unpublish(request.volume_id, request.target_path)
            assert not Path(pod_volume.directory).exists()
            wait_for(lambda: node.report().stages == () and TR not in node.trainings, 30,
                     "the training's card to vanish and its agent to retire")
            tr.thread.join(10)
            assert not tr.thread.is_alive() and tr.agent._socks == {}
            assert not Path(pod_volume.directory).exists()  # not made again by the agent
            assert sorted(p.name for p in (run / "_pods").iterdir()) == ["csi-volumes.json"]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.communicate()
        for n in nodes:
            n.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_stale_card_in_a_pods_directory_is_judged_and_removed_there(run: Path) -> None:
    """``card_is_stale`` takes the card root the card was found under: the Pod's directory, not the node's."""
    root = Path(volume(run).directory)
    path = write_card(root, lock=True)
    (card,), _ = read_pod_cards(root, "ml", "train-0")
    (path.parent / paths.HOOK_LOCK_NAME).write_text("")  # nobody holds it: the process is gone
    assert card_is_stale(root, card) and not path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the child drops to another UID, without CAP_CHOWN")
def test_without_cap_chown_the_trainings_socket_is_opened_to_the_pods_users_instead() -> None:
    """An agent without CAP_CHOWN (run outside the chart, which keeps it) cannot give a training Pod's socket to the
    Pod's UID: it makes the socket writable by every user instead (the directory is that Pod's alone) and says so
    once; the training is served either way. A link the Pod put in the socket's place is not followed."""
    root = Path(tempfile.mkdtemp(prefix="bubbles-chown-"))  # not under pytest's 0700 directories: UID 1000 enters
    request_cleanup = contextlib.ExitStack()
    request_cleanup.callback(shutil.rmtree, root, True)
    os.chmod(root, 0o755)
    base = root / "pod"
    base.mkdir()
    os.chown(base, 1000, 1000)
    other = root / "training-dir"
    other.mkdir()
    os.chown(other, 2000, 2000)
    os.chmod(other, 0o777)
    os.utime(other, ns=(0, 0))
    victim = root / "node-file"
    victim.write_text("x")
    os.chmod(victim, 0o600)
    script = textwrap.dedent(f"""
        import os, socket, stat
        from bubbles.agent.server import _give
        os.setgid(1000); os.setuid(1000)   # no capabilities left: chown to another UID is refused
        base = {str(base)!r}
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(os.path.join(base, "agent.sock"))
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        owner = os.stat_result((0o40700, 0, 0, 0, 2000, 2000, 0, 0, 0, 0))  # the training's UID, not this one's
        _give("agent.sock", fd, owner)
        print(oct(stat.S_IMODE(os.stat(os.path.join(base, "agent.sock")).st_mode)))
        from bubbles.agent.server import _mark_changed
        other = os.open({str(other)!r}, os.O_RDONLY | os.O_DIRECTORY)  # another UID's, writable: no CAP_FOWNER
        before = os.fstat(other).st_mtime_ns
        _mark_changed(other)
        print("marked", os.fstat(other).st_mtime_ns != before)
        os.symlink({str(victim)!r}, os.path.join(base, "planted"))
        try:
            _give("planted", fd, owner)
        except OSError as exc:
            print("refused", type(exc).__name__)
    """)
    with request_cleanup:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        mode = victim.stat().st_mode & 0o777
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] == "0o666", r.stdout
    assert "refused" in r.stdout and "marked True" in r.stdout, r.stdout
    assert "no CAP_CHOWN" in r.stderr, r.stderr
    assert oct(mode) == "0o600"  # the link's target untouched
