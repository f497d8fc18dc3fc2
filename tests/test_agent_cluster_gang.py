"""The cluster agent with a gang job (gpus: 2) on two ranks of one stage: its fill Pod's one process starts one per
GPU, each attaching with its gang rank; a third process, a duplicate rank or one without a rank is refused; both are
welcomed with the gang's sockets once both are in, and step together in the bubbles both GPUs share."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.agent import TRAINING, Hook, cycle, short_tmp, wait_for
from helpers.agent_cluster import ENTRY, NAMESPACE, NODE, TR, assignment, write_card

from bubbles.agent.cluster import ClusterConfig, NodeAgent
from bubbles.agent.config import AgentConfig
from bubbles.agent.isolation import IsolationConfig
from bubbles.core import control, paths, wire
from bubbles.core.api import FillState, IsolationMode
from bubbles.core.identity import GpuKey
from bubbles.core.resources import JobProgress

__all__ = ["short_tmp"]


@pytest.fixture
def node(short_tmp: Path) -> Iterator[NodeAgent]:
    template = AgentConfig(run_dir=short_tmp / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=0.05))
    n.start()
    yield n
    n.stop()


def gang_assignment(uid: str = "uid-g") -> object:
    a = assignment(uid=uid, name="gj", ranks=(0, 1))
    return dataclasses.replace(a, spec=dataclasses.replace(a.spec, gpus=2))


def job(node: NodeAgent, uid: str) -> JobProgress | None:
    return next((j for j in node.report().jobs if j.uid == uid), None)


def hello(run_dir: Path, uid: str, **fields: object) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(paths.attach_socket(run_dir)))
    s.sendall(control.encode("hello", uid=uid, attempt=0, protocol=control.VERSION, **fields))
    return s


def reply(s: socket.socket) -> control.ControlMessage:
    return control.parse_reply(s.makefile("rb").readline())


def two_ranks(node: NodeAgent) -> None:
    for rank in (0, 1):
        write_card(node.run_dir, rank=rank, ranks=2)
    node.scan()


def test_a_gang_admits_one_process_per_rank_and_refuses_a_third_a_duplicate_and_an_old_sdk(node: NodeAgent) -> None:
    two_ranks(node)
    node.assign(gang_assignment())  # type: ignore[arg-type]
    old = hello(node.run_dir, "uid-g")  # no gang rank: an SDK before gangs
    assert "predates gang jobs" in reply(old)["reason"]
    first = hello(node.run_dir, "uid-g", gang_rank=0)
    wait_for(lambda: (j := job(node, "uid-g")) is not None and "1 of 2 processes" in j.reason, what="rank 0 in")
    twice = hello(node.run_dir, "uid-g", gang_rank=0)
    assert "already has gang rank 0's process attached" in reply(twice)["reason"]
    beyond = hello(node.run_dir, "uid-g", gang_rank=2)
    assert "gang ranks 0 to 1" in reply(beyond)["reason"]
    second = hello(node.run_dir, "uid-g", gang_rank=1)
    w0, w1 = reply(first), reply(second)
    s0 = str(paths.fill_socket(node.run_dir, paths_key(0), "gj-a0"))
    s1 = str(paths.fill_socket(node.run_dir, paths_key(1), "gj-a0"))
    assert (w0.type, w0["socket"], w0["sockets"]) == ("welcome", s0, [s0, s1])
    assert (w1.type, w1["socket"], w1["sockets"]) == ("welcome", s1, [s1, s0])
    third = hello(node.run_dir, "uid-g", gang_rank=1)
    assert "already has gang rank 1's process attached" in reply(third)["reason"]
    with node.trainings[TR].agent.lock:
        members = [j for j in node.trainings[TR].agent.jobs if j.name == "gj-a0"]
    assert [(m.gang_rank, m.rank) for m in members] == [(0, 0), (1, 1)]
    for s in (old, first, twice, beyond, second, third):
        s.close()


def paths_key(rank: int) -> GpuKey:
    return GpuKey(NAMESPACE, TRAINING, 0, rank)


def test_a_gang_short_of_processes_is_given_up_with_the_reason(node: NodeAgent, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    two_ranks(node)
    node.assign(gang_assignment())  # type: ignore[arg-type]
    first = hello(node.run_dir, "uid-g", gang_rank=1)
    wait_for(lambda: (j := job(node, "uid-g")) is not None and "1 of 2" in j.reason, what="rank 1 in")
    monkeypatch.setattr(node, "clock", lambda: time.monotonic_ns() + 60 * 10**9)
    node.book.clock = node.clock
    node.expire_gangs()
    answer = reply(first)
    assert answer.type == "refused" and "only 1 of the 2 processes of its gang attached" in answer["reason"]
    assert "gang ranks 0 did not" in answer["reason"]
    progress = job(node, "uid-g")
    assert progress is not None and progress.state is FillState.STOPPED and "only 1 of the 2" in progress.reason
    first.close()


def test_a_fill_pods_gang_attaches_both_processes_and_steps_in_shared_bubbles(node: NodeAgent) -> None:
    two_ranks(node)
    hooks = [Hook(node.run_dir, rank=r, namespace=NAMESPACE) for r in (0, 1)]
    try:
        for h in hooks:
            h.send(wire.encode_profile(0, cycle(slots=((0.02, 1 << 30),))), agent_only=True)
        wait_for(lambda: all(s.cycle is not None for s in node.report().stages), what="both profiles")
        node.assign(gang_assignment())  # type: ignore[arg-type]
        env = {**os.environ, paths.RUN_DIR_ENV: str(node.run_dir), control.UID_ENV: "uid-g",
               control.ATTEMPT_ENV: "0", control.ARGS_ENV: json.dumps({"step_us": 200}), "OMP_NUM_THREADS": "1",
               control.GANG_SIZE_ENV: "2"}
        proc = subprocess.Popen([sys.executable, "-m", "bubbles.sdk", "--entry", ENTRY], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            # The leader binds a fill socket on both GPUs.
            wait_for(lambda: all(h.fill_armed("gj-a0") for h in hooks), timeout_s=30, what="the gang to arm")
            for k in range(30):
                start = time.monotonic_ns()
                for h in hooks:
                    h.send(wire.encode_bubble_start(0, 0, k + 1, start, start + 20_000_000))
                time.sleep(0.02)
                end = time.monotonic_ns()
                for h in hooks:
                    h.send(wire.encode_bubble_end(0, 0, k + 1, end))
            progress = wait_for(lambda: (j := job(node, "uid-g")) and j.steps_done > 0 and j, what="gang steps")
            with node.trainings[TR].agent.lock:
                members = [j for j in node.trainings[TR].agent.jobs if j.name == "gj-a0"]
                assert len(members) == 2 and all(m.steps > 0 for m in members)
                assert progress.steps_done <= min(m.steps for m in members) + 1
            assert node.cancel("uid-g", "the FillJob was deleted")
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            proc.communicate()
    finally:
        for h in hooks:
            h.close()
