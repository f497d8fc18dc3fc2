"""Fill Pods the CSI way (issue 36): a fill volume published only for an assigned fill Pod, the Pod's own attach socket
in its directory, and fill sockets the agent binds in the training's ``fills/`` and passes to the fill process
(control v5). Real parts throughout: the node agent, the CSI plugin with real bind mounts (root), fill processes and a
hook-side ``Listeners`` running as other UIDs than the agent's and each other's (children that setuid), as fill Pods
and trainings of any UID do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.agent import TRAINING, Hook, cycle, short_tmp, wait_for
from helpers.agent_cluster import ENTRY, NAMESPACE, NODE, assignment, write_card
from helpers.mounts import why_no_bind_mounts
from helpers.sdk import BusyJob, Channel

from bubbles.agent.cluster import ClusterConfig, NodeAgent
from bubbles.agent.config import AgentConfig
from bubbles.agent.csi.plugin import CsiNodePlugin
from bubbles.agent.csi.publish import (
    EPHEMERAL_KEY,
    POD_NAME_KEY,
    POD_NAMESPACE_KEY,
    POD_UID_KEY,
    PublishRequest,
    Refused,
    Status,
)
from bubbles.agent.fillsockets import PARKED_SUFFIX
from bubbles.agent.isolation import IsolationConfig
from bubbles.agent.launcher import free_port
from bubbles.core import control, paths, wire
from bubbles.core.api import IsolationMode
from bubbles.core.identity import GpuKey
from bubbles.core.resources import JobProgress
from bubbles.training.sdk.attach import attach
from bubbles.training.sdk.runtime import FillRuntime

__all__ = ["short_tmp"]

FILL_UID = 65534  # the fill Pod's processes (nobody)
TRAINING_UID = 65533  # the training's hook, another UID again
FILL_POD = "fj-fj-a0"  # helpers.agent_cluster.assignment()'s fill_pod
POD_UID = "f111"  # short: the attach socket's path through the kubelet's target must fit a Unix socket
SRC = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join(str(SRC / d) for d in ("core", "training", "agent", "operator", "demo", "benchmarks"))


_PROBLEM = why_no_bind_mounts("bind mounts (mount(2)) and children of other UIDs (setuid)")
needs_root = pytest.mark.skipif(_PROBLEM is not None, reason=str(_PROBLEM))


@dataclass
class Node:
    root: Path
    agent: NodeAgent
    plugin: CsiNodePlugin

    @property
    def kubelet(self) -> Path:
        return self.root / "k"

    def target(self, pod_uid: str = POD_UID, volume: str = "b") -> Path:
        return self.kubelet / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / volume / "mount"

    def request(self, pod: str = FILL_POD, namespace: str = NAMESPACE, pod_uid: str = POD_UID, role: str = "fill",
                volume_id: str = "csi-1") -> PublishRequest:
        context = {POD_NAME_KEY: pod, POD_NAMESPACE_KEY: namespace, POD_UID_KEY: pod_uid, EPHEMERAL_KEY: "true",
                   "role": role}
        return PublishRequest(volume_id, str(self.target(pod_uid)), context)

    def publish(self, **kwargs: str) -> PublishRequest:
        req = self.request(**kwargs)
        self.plugin.publish(req)
        return req


def _start(root: Path) -> tuple[NodeAgent, CsiNodePlugin]:
    template = AgentConfig(run_dir=root / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    agent = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=0.05))
    agent.start()
    plugin = CsiNodePlugin(NODE, root / "run", root / "k", fill_pods=agent)
    plugin.start()
    return agent, plugin


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    os.chmod(short_tmp, 0o755)  # the other UIDs' children walk through it (mkdtemp makes it 0700)
    agent, plugin = _start(short_tmp)
    n = Node(short_tmp, agent, plugin)
    try:
        yield n
    finally:
        for volume in n.plugin.published():
            n.plugin.unpublish(volume.volume_id, volume.target_path)
        n.agent.stop()


def _training_owns(run_dir: Path, key: GpuKey) -> None:
    """The training's tree as its hook leaves it when it runs as ``TRAINING_UID`` (its own, 0700: the test wrote the
    card as root), and the run directory passable, as the training's own mount of it is."""
    os.chmod(run_dir, 0o755)
    top = run_dir / key.namespace
    for d, _dirs, files in os.walk(top):
        for name in (d, *(os.path.join(d, f) for f in files)):
            os.chown(name, TRAINING_UID, TRAINING_UID, follow_symlinks=False)


def _as(uid: int, code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A Python child running ``code`` as ``uid``: it starts as root (the interpreter here lies under /root, which
    other users cannot read) and calls setuid() where ``code`` says ``SETUID``, once it has imported what it needs."""
    full = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    code = textwrap.dedent(code).replace("SETUID", f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})")
    return subprocess.Popen([sys.executable, "-c", code], env=full, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


_HELLO = """
    import json, os, socket, sys
    SETUID
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sys.argv[1])
    s.sendall(json.dumps(json.loads(sys.argv[2])).encode() + b"\\n")
    print(s.makefile("rb").readline().decode(), end="")
"""


def _hello_as(user: int, socket_path: Path, **hello: object) -> control.ControlMessage:
    code = _HELLO.replace("sys.argv[1]", repr(str(socket_path))).replace("sys.argv[2]",
                                                                           repr(json.dumps({"type": "hello", **hello})))
    child = _as(user, code)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    return control.parse_reply(out)


# -- the publish is the fill Pod's alone -------------------------------------------------------------------------
@needs_root
def test_a_fill_volume_is_published_only_for_the_assigned_fill_pod_and_carries_its_attach_socket(node: Node) -> None:
    with pytest.raises(Refused) as refused:
        node.publish()
    assert refused.value.status is Status.FAILED_PRECONDITION  # the kubelet retries: an assignment may be on its way
    assert f"Pod {NAMESPACE}/{FILL_POD} is not a fill Pod" in str(refused.value)
    assert "only the operator's fill Pods may use role fill" in str(refused.value)
    assert not node.target().is_mount() and not node.plugin.published()
    node.agent.assign(assignment())
    with pytest.raises(Refused, match=f"Pod other/{FILL_POD} is not a fill Pod"):
        node.publish(namespace="other")  # the same name in another namespace is another Pod
    node.plugin.publish(node.request(pod="trainer-0", pod_uid="e222", role="training", volume_id="csi-t"))  # unasked
    node.publish()
    sock = node.target() / paths.ATTACH_DIR_NAME / paths.ATTACH_SOCKET_NAME
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
    assert node.agent.pod_attach_socket(POD_UID) == node.root / "run" / "_pods" / POD_UID / "_attach" / "attach.sock"
    assert node.agent.pod_attach_socket("e222") is None  # a training's volume has none
    node.publish()  # the kubelet's retry: the same socket goes on listening
    assert os.stat(sock).st_ino == st.st_ino
    node.plugin.unpublish("csi-1", str(node.target()))
    assert node.agent.pod_attach_socket(POD_UID) is None
    assert not (node.root / "run" / "_pods" / POD_UID).exists()
    node.agent.cancel("uid-1", "the FillJob was deleted")
    with pytest.raises(Refused, match="not a fill Pod"):
        node.publish()  # a cancelled assignment admits no volume


@needs_root
def test_an_agent_started_again_listens_again_on_the_fill_pods_it_published(node: Node) -> None:
    node.agent.assign(assignment())
    node.publish()
    node.agent.stop()
    path = node.root / "run" / "_pods" / POD_UID / "_attach" / "attach.sock"
    assert not path.exists()  # stopped: removed
    node.agent, node.plugin = _start(node.root)
    assert node.agent.pod_attach_socket(POD_UID) == path and stat.S_ISSOCK(os.stat(path).st_mode)
    node.agent.assign(assignment())
    old = _hello_as(FILL_UID, node.target() / "_attach" / "attach.sock", uid="uid-1", attempt=0, protocol=4)
    assert old.type == "refused"  # it answers (and here refuses a v4 SDK, below)


# -- who may attach through it ------------------------------------------------------------------------------------
@needs_root
def test_a_process_of_the_pod_naming_another_job_or_speaking_v4_is_refused_with_the_reason(node: Node) -> None:
    write_card(node.agent.run_dir)
    node.agent.scan()
    node.agent.assign(assignment())
    node.agent.assign(assignment(uid="uid-2", name="other"))
    node.publish()
    sock = node.target() / "_attach" / "attach.sock"
    theirs = _hello_as(FILL_UID, sock, uid="uid-2", attempt=0, protocol=control.VERSION)
    assert theirs.type == "refused"
    assert (f"this process of Pod {NAMESPACE}/{FILL_POD} says it is fill job uid uid-2, but the Pod runs fill job fj "
            "(uid uid-1)") in theirs["reason"]
    old = _hello_as(FILL_UID, sock, uid="uid-1", attempt=0, protocol=4)
    assert old.type == "refused"
    assert "speaks control v4; this side needs v5: upgrade bubbles in the fill job's image" in old["reason"]
    assert f"Pod {NAMESPACE}/{FILL_POD} attaches through its own csi.bubbles.dev volume" in old["reason"]
    unversioned = _hello_as(FILL_UID, sock, uid="uid-1", attempt=0)
    assert "speaks control v2; this side needs v5" in unversioned["reason"]
    assert node.agent.book.jobs["uid-1"].attached_pid is None  # none of them got in
    node.agent.cancel("uid-1", "deleted")
    gone = _hello_as(FILL_UID, sock, uid="uid-1", attempt=0, protocol=control.VERSION)
    assert "is not the fill Pod of any live assignment" in gone["reason"]


# -- the fill sockets, passed ---------------------------------------------------------------------------------------
_HOOK = """
    import os, sys, time
    from pathlib import Path
    from bubbles.core import wire
    from bubbles.training.hook.listeners import Listeners
    SETUID
    listeners = Listeners(Path(sys.argv[1]))
    seq = 0
    while not os.path.exists(sys.argv[2]):
        listeners.refresh()
        seq += 1
        start = time.monotonic_ns()
        listeners.send(wire.encode_bubble_start(0, 0, seq, start, start + 20_000_000))
        time.sleep(0.02)
        listeners.send(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()))
        time.sleep(0.005)
    print(listeners.sent, listeners.removed)
"""


def _hook_as(uid: int, directory: Path, stop_file: Path) -> subprocess.Popen[str]:
    code = _HOOK.replace("sys.argv[1]", repr(str(directory))).replace("sys.argv[2]", repr(str(stop_file)))
    return _as(uid, code)


def _fill_pod_process(node: Node, uid: str = "uid-1", **env: str) -> subprocess.Popen[str]:
    """What a fill Pod runs, as another UID, its run directory the volume's mount (the Pod sees /run/bubbles)."""
    full = {paths.RUN_DIR_ENV: str(node.target()), control.UID_ENV: uid, control.ATTEMPT_ENV: "0",
            control.ARGS_ENV: json.dumps({"step_us": 200}), "OMP_NUM_THREADS": "1", **env}
    module = ENTRY.split(":")[0]
    return _as(FILL_UID, f"""
        import os, sys, importlib, json, socket, select, traceback, argparse
        import {module}
        from bubbles.training.sdk.process import run_fill_process
        SETUID
        sys.exit(run_fill_process(['--entry', {ENTRY!r}]))
    """, env=full)


def _fill_names(run_dir: Path, key: GpuKey) -> list[str]:
    return sorted(p.name for p in paths.fills_dir(run_dir, key).iterdir())


@needs_root
def test_a_fill_pod_of_another_uid_steps_in_the_bubbles_a_hook_of_a_third_uid_sends_through_the_passed_socket(
        node: Node) -> None:
    run_dir = node.agent.run_dir
    key = GpuKey(NAMESPACE, TRAINING, 0, 0)
    write_card(run_dir)
    node.agent.scan()
    _training_owns(run_dir, key)
    profile = Hook(run_dir, namespace=NAMESPACE)  # the profile to the agent (as root: the agent's socket is private)
    profile.send(wire.encode_profile(0, cycle(slots=((0.02, 1 << 30),))), agent_only=True)
    profile.close()
    wait_for(lambda: node.agent.report().stages[0].cycle is not None, what="the stage's profile")
    node.agent.assign(assignment())
    node.publish()
    stop = node.root / "stop-hook"
    hook = _hook_as(TRAINING_UID, paths.gpu_dir(run_dir, key), stop)
    fill = _fill_pod_process(node)
    try:
        fill_sock = paths.fill_socket(run_dir, key, "fj-a0")
        wait_for(lambda: fill_sock.exists(), timeout_s=30, what="the fill socket linked at the arm")
        st = os.stat(fill_sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
        assert st.st_uid == os.getuid()  # the agent's, not the fill process's: the fill Pod cannot reach fills/
        assert os.stat(str(fill_sock) + PARKED_SUFFIX).st_ino == st.st_ino  # a second name of the socket bound once
        progress = wait_for(lambda: (j := _job(node, "uid-1")) and j.steps_done >= 5 and j, timeout_s=30,
                            what="steps in the hook's bubbles")
        assert progress.attempt == 0
        with node.agent.trainings[(NAMESPACE, TRAINING)].agent.lock:
            (record,) = node.agent.trainings[(NAMESPACE, TRAINING)].agent.jobs
            steps = list(node.agent.trainings[(NAMESPACE, TRAINING)].agent.core.steps)
        assert record.name == "fj-a0" and steps and all(s["bubble_seq"] > 0 for s in steps if s["job"] == "fj-a0")
        assert node.agent.cancel("uid-1", "the FillJob was deleted")
        assert fill.wait(timeout=30) == 0
        wait_for(lambda: _fill_names(run_dir, key) == [], what="both names of the fill socket removed")
    finally:
        stop.touch()
        for child in (fill, hook):
            with_timeout_kill(child)
    assert hook.returncode == 0


def with_timeout_kill(child: subprocess.Popen[str]) -> None:
    """End a child the test left running, and show what it said (pytest prints it where the test failed)."""
    try:
        out, err = child.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    print(f"child {child.args[-1][:60]!r}: exit {child.returncode}\nstdout: {out}\nstderr: {err}")


def _job(node: Node, uid: str) -> JobProgress | None:
    return next((j for j in node.agent.report().jobs if j.uid == uid), None)


@needs_root
def test_a_gang_in_one_fill_pod_gets_every_gpus_socket_passed_to_its_leader_and_steps(node: Node) -> None:
    run_dir = node.agent.run_dir
    keys = [GpuKey(NAMESPACE, TRAINING, 0, r) for r in (0, 1)]
    for rank in (0, 1):
        write_card(run_dir, rank=rank, ranks=2)
    node.agent.scan()
    _training_owns(run_dir, keys[0])
    for rank in (0, 1):
        hook = Hook(run_dir, rank=rank, namespace=NAMESPACE)
        hook.send(wire.encode_profile(0, cycle(slots=((0.02, 1 << 30),))), agent_only=True)
        hook.close()
    wait_for(lambda: all(s.cycle is not None for s in node.agent.report().stages), what="both ranks' profiles")
    a = assignment(uid="uid-g", name="gj", ranks=(0, 1))
    a = dataclasses.replace(a, spec=dataclasses.replace(a.spec, gpus=2), fill_pod=FILL_POD)
    node.agent.assign(a)
    node.publish()
    stops = [node.root / f"stop-{r}" for r in (0, 1)]
    hooks = [_hook_as(TRAINING_UID, paths.gpu_dir(run_dir, k), s) for k, s in zip(keys, stops, strict=True)]
    # What the Pod's process does for a gang (gang.run_gang: a process per GPU, each with its rank), done here because
    # its children exec this interpreter, which the fill Pod's UID cannot reach on this machine.
    port = str(free_port())
    gang = [_fill_pod_process(node, uid="uid-g", **{control.GANG_SIZE_ENV: "2", control.GANG_RANK_ENV: str(rank),
                                                    control.GANG_PORT_ENV: port}) for rank in (0, 1)]
    try:
        for k in keys:
            wait_for(lambda k=k: paths.fill_socket(run_dir, k, "gj-a0").exists(), timeout_s=40,  # type: ignore[misc]
                     what=f"the gang's fill socket on {k}")
        wait_for(lambda: (j := _job(node, "uid-g")) and j.steps_done >= 3, timeout_s=40,
                 what="the gang's steps")
        with node.agent.lock:
            (leader, follower) = sorted(node.agent.trainings[(NAMESPACE, TRAINING)].agent._started.items(),
                                        key=lambda item: item[0].gang_rank)
        assert leader[1].fill_sockets is not None and [str(p) for p in leader[1].fill_sockets.paths] == [
            str(paths.fill_socket(run_dir, k, "gj-a0")) for k in keys]  # every GPU's, its own first
        assert follower[1].fill_sockets is None  # a follower listens on none
        node.agent.cancel("uid-g", "deleted")
        assert [p.wait(timeout=40) for p in gang] == [0, 0]
        for k in keys:
            wait_for(lambda k=k: _fill_names(run_dir, k) == [], what=f"{k}'s names removed")  # type: ignore[misc]
    finally:
        for s in stops:
            s.touch()
        for child in (*gang, *hooks):
            with_timeout_kill(child)


# -- the protocol's new parts, fed what they must refuse ----------------------------------------------------------
def test_a_welcome_says_how_many_sockets_it_passes_and_a_wrong_count_is_refused() -> None:
    one = control.parse_reply(control.encode("welcome", job="j", socket="/r/a.sock", stage=0, protocol=5, fds=1))
    assert control.passed_sockets(one) == ["/r/a.sock"]
    gang = control.parse_reply(control.encode("welcome", job="j", socket="/r/a.sock", stage=0, protocol=5, fds=2,
                                              sockets=["/r/a.sock", "/r/b.sock"]))
    assert control.passed_sockets(gang) == ["/r/a.sock", "/r/b.sock"]
    follower = control.parse_reply(control.encode("welcome", job="j", socket="/r/b.sock", stage=0, protocol=5, fds=0,
                                                  sockets=["/r/b.sock", "/r/a.sock"]))
    assert control.passed_sockets(follower) == []  # binds none, listens on none
    plain = control.parse_reply(control.encode("welcome", job="j", socket="/r/a.sock", stage=0, protocol=4))
    assert control.passed_sockets(plain) is None  # the hostPath layout: the process binds its own
    for bad, match in ((2, "must be 0 or the number of sockets the welcome lists \\(1\\)"), (-1, "must be 0 or"),
                       ("1", "fds must be int"), (True, "fds must be int")):
        with pytest.raises(control.ControlError, match=match):
            control.parse_reply(control.encode("welcome", job="j", socket="/r/a.sock", stage=0, fds=bad))


def _agent_passing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fds: int, passes: list[socket.socket]) -> None:
    """An agent at the attach socket that welcomes saying ``fds`` and passing ``passes``."""
    monkeypatch.setenv(paths.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(control.UID_ENV, "uid-1")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    paths.make_private_dir(paths.attach_dir(tmp_path))
    server.bind(str(paths.attach_socket(tmp_path)))
    server.listen(1)

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            line = control.encode("welcome", job="j-a0", socket="/r/f.sock", stage=0, protocol=5, fds=fds)
            socket.send_fds(conn, [line], [s.fileno() for s in passes]) if passes else conn.sendall(line)
            conn.recv(1)
        server.close()

    threading.Thread(target=agent, daemon=True).start()


def test_the_sdk_takes_the_passed_socket_and_refuses_a_welcome_whose_count_is_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(str(tmp_path / "f.parked"))
    _agent_passing(tmp_path, monkeypatch, 1, [dgram])
    attached = attach("cpu", timeout_s=10)
    assert attached.passed is not None and list(attached.passed) == ["/r/f.sock"]
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"x", str(tmp_path / "f.parked"))
    wait_for(lambda: _recv(attached.passed["/r/f.sock"]) == b"x", what="the datagram on the passed socket")
    attached.close()
    tmp = tmp_path / "second"
    tmp.mkdir()
    _agent_passing(tmp, monkeypatch, 1, [])
    with pytest.raises(ValueError, match="said it passed 1 fill socket\\(s\\) with its welcome, but 0 came"):
        attach("cpu", timeout_s=10)
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    third = tmp_path / "third"
    third.mkdir()
    _agent_passing(third, monkeypatch, 1, [stream])
    with pytest.raises(ValueError, match="not a Unix datagram socket"):
        attach("cpu", timeout_s=10)
    dgram.close()
    stream.close()


def _recv(sock: socket.socket) -> bytes | None:
    try:
        return sock.recv(64)
    except BlockingIOError:
        return None


def test_the_runtime_listens_on_the_passed_socket_drops_what_came_before_the_arm_and_binds_nothing(
        tmp_path: Path) -> None:
    parked, path = tmp_path / "fill-busy.sock.parked", str(tmp_path / "fill-busy.sock")
    passed = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    passed.bind(str(parked))
    passed.setblocking(False)
    hook = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours, theirs = socket.socketpair()
    rt = FillRuntime(BusyJob(step_ms=0.2), theirs, name="busy", socket_path=path, step_s=0.001,
                     passed={path: passed})
    thread = threading.Thread(target=rt.serve, daemon=True)
    thread.start()
    ch = Channel(ours)
    try:
        start = time.monotonic_ns()
        hook.sendto(wire.encode_bubble_start(0, 0, 1, start, start + 10**10), str(parked))  # before the arm: stale
        ch.send("init")
        ch.wait("state", timeout_s=20.0, state="PAUSED")  # bounded: a loaded machine starts threads late
        ch.send("arm", mode="harvest", socket=path)
        wait_for(lambda: rt.stale_dropped == 1, what="the stale START dropped at the arm")
        assert not Path(path).exists()  # the runtime bound nothing: the name is the agent's to link
        for seq in (2, 3):
            start = time.monotonic_ns()
            hook.sendto(wire.encode_bubble_start(0, 0, seq, start, start + 30_000_000), str(parked))
            time.sleep(0.03)
            hook.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(parked))
        ch.wait_count(1, "step", bubble_seq=2)
        assert ch.count("step", bubble_seq=1) == 0  # the stale bubble ran no step
        ch.send("disarm")
        ch.send("arm", mode="harvest", socket="/elsewhere/fill-busy.sock")
        error = ch.wait("error")
        assert "armed on fill socket(s) /elsewhere/fill-busy.sock, which the agent did not pass" in error["message"]
        assert passed.fileno() >= 0  # a disarm leaves the passed socket open for the next arm
        ch.send("stop")
        thread.join(10)
        assert not thread.is_alive()
        assert passed.fileno() == -1  # closed when the runtime ends
    finally:
        ours.close()
        hook.close()
        thread.join(5)


def test_a_fill_socket_whose_node_path_is_too_long_for_bind_is_bound_through_its_directory() -> None:
    """A fill socket in a training Pod's directory: on the node its path carries _pods/<pod uid>/ (122 bytes on the
    real node for the example job), more than a Unix socket's 107; the hook reaches it at /run/bubbles/... in its
    mount. The agent binds it through a descriptor of the directory, so the job is admitted; a datagram sent to it
    (through the directory, as the hook's mount gives it) arrives on the descriptor that would be passed."""
    from bubbles.agent.fillsockets import PassedFillSockets

    base = Path(tempfile.mkdtemp(prefix="bubbles-long-"))
    try:
        uid = "f3167451-05c2-4ef2-99ef-54b016717434"
        fills = base / "_pods" / uid / "ml" / "llama-pp" / "stage-0" / "rank-0" / "fills"
        fills.mkdir(parents=True)
        path = fills / "fill-image-classification-with-a-long-name-a1.sock"
        assert len(os.fsencode(str(path))) > paths.MAX_SOCKET_PATH_BYTES
        passed = PassedFillSockets([path])
        try:
            passed.link({str(path)})
            (fd,) = passed.fds()
            receiver = socket.socket(fileno=os.dup(fd))
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            dir_fd = os.open(fills, os.O_RDONLY | os.O_DIRECTORY)
            try:
                sender.sendto(b"BUBBLE", f"/proc/self/fd/{dir_fd}/{path.name}")
                receiver.settimeout(5)
                assert receiver.recv(64) == b"BUBBLE"
            finally:
                os.close(dir_fd)
                sender.close()
                receiver.close()
        finally:
            passed.remove()
        assert not path.exists() and not Path(str(path) + PARKED_SUFFIX).exists()
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
