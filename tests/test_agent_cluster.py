"""The agent in cluster mode on one node, for real: hook cards, bubble datagrams, fill processes that attach over the
node-local socket (``python -m bubbles.sdk`` as a fill Pod runs it), assignments and cancellations as the gRPC
service passes them on. Only Kubernetes is absent: the test plays the operator and the training's hook.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.agent import TRAINING, Hook, cycle, gpu, short_tmp, wait_for
from helpers.agent_cluster import ENTRY, NAMESPACE, NODE, TR, assignment, legacy_card_path, write_card
from prometheus_client import generate_latest

from bubbles.agent.cluster import FORGET_AFTER_S, ClusterConfig, NodeAgent
from bubbles.agent.config import AgentConfig
from bubbles.agent.core import TrainingMembership
from bubbles.agent.isolation import IsolationConfig
from bubbles.agent.node import NodeBook, Outcome, StaleAssignment
from bubbles.core import control, paths, wire
from bubbles.core.agentapi import AssignmentMessage
from bubbles.core.api import FillState, IsolationMode, parse_spec
from bubbles.core.card import Card, card_is_stale, read_cards
from bubbles.core.resources import JobProgress

__all__ = ["short_tmp"]  # the fixture, from helpers.agent


@pytest.fixture
def node(short_tmp: Path) -> Iterator[NodeAgent]:
    run_dir = short_tmp / "run"  # short: a fill socket's path must fit a Unix socket's 107 bytes
    template = AgentConfig(run_dir=run_dir, training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=0.05))
    n.start()
    yield n
    n.stop()


def fill_process(run_dir: Path, uid: str, attempt: int = 0, **env: str) -> subprocess.Popen[str]:
    """What the operator's fill Pod runs: the SDK, told its FillJob by environment, attaching to the agent."""
    full = {**os.environ, paths.RUN_DIR_ENV: str(run_dir), control.UID_ENV: uid, control.ATTEMPT_ENV: str(attempt),
            control.ARGS_ENV: json.dumps({"step_us": 200}), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "bubbles.sdk", "--entry", ENTRY], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def job(node: NodeAgent, uid: str) -> JobProgress | None:
    return next((j for j in node.report().jobs if j.uid == uid), None)


# -- the pure bookkeeping ------------------------------------------------------------------------------------
def test_assignments_are_idempotent_by_uid_attempt_and_generation() -> None:
    book = NodeBook(lambda: 0)
    assert book.assign(assignment()).outcome is Outcome.ACCEPTED
    assert book.assign(assignment()).outcome is Outcome.ALREADY_ASSIGNED  # a retried call changes nothing
    newer = book.assign(assignment(attempt=1))
    assert newer.outcome is Outcome.SUPERSEDED and newer.stop is not None and newer.stop.message.attempt == 0
    with pytest.raises(StaleAssignment, match="older than attempt 1"):
        book.assign(assignment(attempt=0, generation=5))
    assert book.cancel("uid-1", "deleted") is not None and book.cancel("uid-1", "again") is None
    with pytest.raises(StaleAssignment, match="cancelled"):
        book.assign(assignment(attempt=1))  # a late retry of a cancelled run does not bring it back
    assert book.assign(assignment(attempt=2)).outcome is Outcome.ACCEPTED


def test_attach_admits_only_the_assigned_process_on_its_gpu() -> None:
    book = NodeBook(lambda: 0)
    with pytest.raises(ValueError, match="no fill job with uid nope is assigned"):
        book.attach("nope", 100, None)
    book.assign(assignment(gpu_uuid="GPU-aaaa"))
    with pytest.raises(ValueError, match="sees GPU-bbbb"):
        book.attach("uid-1", 100, "GPU-bbbb")
    with pytest.raises(ValueError, match="hostPID"):
        book.attach("uid-1", 0, "GPU-aaaa")
    assert book.attach("uid-1", 100, "GPU-aaaa").attached_pid == 100
    with pytest.raises(ValueError, match="already has a process attached"):
        book.attach("uid-1", 101, "GPU-aaaa")


def test_cards_that_cannot_be_used_are_reported_not_fatal(tmp_path: Path) -> None:
    write_card(tmp_path, stage=0)
    bad = legacy_card_path(tmp_path, "other", 0)
    bad.write_text("{not json")
    wrong = legacy_card_path(tmp_path, "third", 1)
    wrong.write_text(json.dumps({"training": "third", "stage": 0, "stages": 2, "pod": "p"}))
    cards, problems = read_cards(tmp_path)
    assert [c.training for c in cards] == [TRAINING]
    assert len(problems) == 2 and any("not its directory" in p for p in problems)
    with pytest.raises(ValueError, match="stage 3 of 2 stages"):
        Card.parse({"training": "t", "stage": 3, "stages": 2, "pod": "p"}, "x")
    # "lock" other than true: the card is taken for one whose process holds no lock, never judged stale.
    for lock in ("yes", 1, None):
        card = Card.parse({"training": "t", "stage": 0, "stages": 1, "pod": "p", "lock": lock}, "x")
        assert card.lock is False and not card_is_stale(tmp_path, card)
    template = AgentConfig(run_dir=tmp_path, training="placeholder")
    with pytest.raises(ValueError, match="the retirement grace >= 0"):
        ClusterConfig(NODE, template, retire_after_s=-1.0)


def test_cards_a_fill_job_planted_are_reported_without_holding_the_agent(tmp_path: Path) -> None:
    """Fill Pods can write in the stage directories: a FIFO under a card's name held the agent's read for good, a
    link had it read where it pointed, and a card nested past the JSON parser's stack raised RecursionError."""
    import threading

    write_card(tmp_path, stage=0)
    fifo = legacy_card_path(tmp_path, "fifo", 0)
    os.mkfifo(fifo)
    link = paths.hook_card(tmp_path, gpu(0, namespace=NAMESPACE, training="link"))
    paths.make_private_dir(link.parent)
    os.symlink(paths.hook_card(tmp_path, gpu(0, namespace=NAMESPACE)), link)  # a valid card, elsewhere
    deep = legacy_card_path(tmp_path, "deep", 0)
    deep.write_text("[" * 30_000)
    big = legacy_card_path(tmp_path, "big", 0)
    big.write_text(json.dumps({"training": "big", "stage": 0, "stages": 1, "pod": "p", "pad": "x" * 100_000}))
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(read_cards(tmp_path)), daemon=True)
    t.start()
    t.join(5)
    assert out, "read_cards did not return: a FIFO held the agent"
    cards, problems = out[0]
    assert [c.training for c in cards] == [TRAINING]
    assert len(problems) == 4, problems
    assert any("not a regular file" in p for p in problems) and any("nested too deeply" in p for p in problems)
    assert any("larger than" in p for p in problems)


# -- the node, for real ----------------------------------------------------------------------------------------
def test_a_fill_pod_attaches_runs_in_the_bubbles_reports_progress_and_is_cancelled(node: NodeAgent) -> None:
    run_dir = node.run_dir
    write_card(run_dir)
    node.scan()
    (stage,) = node.report().stages
    assert (stage.namespace, stage.training, stage.pod, stage.stage, stage.cycle) == ("ml", TRAINING, "llama-0", 0,
                                                                                       None)
    assert stage.hook_reporting is False
    hook = Hook(run_dir, namespace=NAMESPACE)
    try:
        hook.send(wire.encode_profile(0, cycle(slots=((0.02, 1 << 30),))), agent_only=True)
        wait_for(lambda: node.report().stages[0].cycle is not None, what="the stage's profile")
        assert node.report().stages[0].hook_reporting is True
        assert node.report().stages[0].training_membership == ""  # a CPU stage: no MPS server to be a client of
        with node.trainings[TR].agent.lock:
            executor = node.trainings[TR].agent.core.executors[0]
            assert executor.training_pid == os.getpid()  # the kernel named the hook's process (this test's)
            executor.training_membership = TrainingMembership.PENDING  # a check under way: not reported, not known yet
        assert node.report().stages[0].training_membership == ""
        with node.trainings[TR].agent.lock:
            executor.training_membership = TrainingMembership.from_wire(
                "not a client: the training's process is not listed")
        assert node.report().stages[0].training_membership == "not a client: the training's process is not listed"
        with node.trainings[TR].agent.lock:
            executor.training_membership = TrainingMembership.NOT_ASKED
        assert node.assign(assignment()).outcome is Outcome.ACCEPTED
        assert job(node, "uid-1") == JobProgress("uid-1", FillState.SUBMITTED,
                                                 reason="waiting for Pod fj-fj-a0 to attach")
        proc = fill_process(run_dir, "uid-1")
        try:
            wait_for(lambda: hook.fill_armed("fj-a0"), timeout_s=30, what="the attached fill job to arm")
            for _ in range(20):
                hook.bubble(0.02)
            progress = wait_for(lambda: (j := job(node, "uid-1")) and j.steps_done > 0 and j, what="steps")
            assert progress.state in (FillState.PAUSED, FillState.RUNNING) and progress.attempt == 0
            assert node.report().stages[0].filled_s > 0
            assert node.cancel("uid-1", "the FillJob was deleted") is True
            assert proc.wait(timeout=15) is not None
            assert job(node, "uid-1") is None  # cancelled: no longer reported
            with node.trainings[TR].agent.lock:
                (record,) = node.trainings[TR].agent.jobs
            assert record.state is FillState.STOPPED and "the FillJob was deleted" in record.reason
        finally:
            proc.kill()
            proc.communicate()
    finally:
        hook.close()


def test_the_trainings_limits_from_an_assignment_reach_its_guard_before_and_after_it_starts(
        node: NodeAgent) -> None:
    limited = dataclasses.replace(assignment(), slowdown_budget=0.2, max_fill_share=0.5, tail_risk=0.05)
    node.assign(limited)  # before the training's hook has written its card
    write_card(node.run_dir)
    node.scan()
    core = node.trainings[TR].agent.core
    assert (core.config.guard.budget, core.config.guard.max_share, core.share) == (0.2, 0.5, 0.5)
    assert core.config.tail_risk == 0.05
    node.assign(dataclasses.replace(limited, uid="uid-2", slowdown_budget=0.05, max_fill_share=None, tail_risk=0.0))
    assert (core.config.guard.budget, core.config.guard.max_share) == (0.05, 0.5)  # None: unchanged
    assert core.config.tail_risk == 0.0
    text = generate_latest(node.trainings[TR].agent.metrics.registry).decode()
    assert f'bubbles_slowdown_budget{{namespace="ml",training="{TRAINING}"}} 0.05' in text


def test_what_the_node_keeps_for_a_job_or_a_training_goes_with_them(tmp_path: Path) -> None:
    """Assignments come and go for weeks: a forgotten job's failure and a gone training's limits are not kept."""
    now = [0]
    template = AgentConfig(run_dir=tmp_path / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template, scan_interval_s=0.05), clock=lambda: now[0])
    n.assign(dataclasses.replace(assignment(), slowdown_budget=0.2))  # its training has no card here (yet)
    n.failures["uid-1"] = "not admitted: a reason"
    n.scan()
    assert TR in n.limits and "uid-1" in n.failures  # kept while the job is assigned
    n.cancel("uid-1", "the FillJob was deleted")
    now[0] = int((FORGET_AFTER_S + 1) * 1e9)
    n.scan()  # the cancelled record is forgotten, and with it what was kept for it and its training
    assert "uid-1" not in n.book.jobs and n.failures == {} and n.limits == {}


def test_processes_the_operator_did_not_assign_are_refused_with_the_reason(node: NodeAgent) -> None:
    write_card(node.run_dir)
    node.scan()
    stray = fill_process(node.run_dir, "uid-unknown")
    _, err = stray.communicate(timeout=60)
    assert stray.returncode == 3 and "no fill job with uid uid-unknown is assigned to this node" in err
    node.assign(assignment(attempt=1))
    old = fill_process(node.run_dir, "uid-1", attempt=0)  # the Pod of an earlier attempt, still around
    _, err = old.communicate(timeout=60)
    assert old.returncode == 3 and "attempt 0" in err and "attempt 1 is the one assigned" in err
    # A process that claims a GPU other than the one assigned (the runtime did not expose the right one):
    node.assign(assignment(uid="uid-gpu", gpu_uuid="GPU-1111", name="gpu-job"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(paths.attach_socket(node.run_dir)))
        s.sendall(control.encode("hello", uid="uid-gpu", attempt=0, gpu="GPU-2222"))
        reply = control.parse_reply(s.makefile("rb").readline())
    assert reply.type == "refused" and "sees GPU-2222" in reply["reason"]
    # Garbage instead of a hello costs one connection, nothing else.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(paths.attach_socket(node.run_dir)))
        s.sendall(b'{"type": "hello", "uid": 7}\n')
        reply = control.parse_reply(s.makefile("rb").readline())
    assert reply.type == "refused" and "bad hello" in reply["reason"]
    # An SDK older than the control protocol this agent needs is told which versions, and what to upgrade.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(paths.attach_socket(node.run_dir)))
        s.sendall(control.encode("hello", uid="uid-1", attempt=0, protocol=control.MIN_VERSION - 1))
        reply = control.parse_reply(s.makefile("rb").readline())
    assert reply.type == "refused"
    assert f"speaks control v{control.MIN_VERSION - 1}; this side needs v{control.MIN_VERSION}" in reply["reason"]
    assert "upgrade bubbles in the fill job's image" in reply["reason"]
    assert job(node, "uid-1") is not None and job(node, "uid-gpu") is not None  # the assignments are untouched


def test_a_hook_before_ranks_is_served_as_rank_0_but_a_fill_pod_there_is_refused_saying_to_upgrade(
        node: NodeAgent) -> None:
    """A hook of card v3 writes its card, socket and fills/ in the stage directory of the old layout
    (<run>/<training>/stage-<k>/), not in the GPU directory a fill Pod mounts: its bubbles are measured and reported
    (rank 0 of 1), but a fill job admitted there would sit at 0 steps without a word."""
    card = write_card(node.run_dir, version=3)
    node.scan()
    (stage,) = node.report().stages
    assert (stage.namespace, stage.stage, stage.rank, stage.ranks) == ("ml", 0, 0, 1)
    hook = Hook(node.run_dir, directory=card.parent)  # the old hook: its agent socket in the stage directory
    try:
        hook.send(wire.encode_profile(0, cycle()), agent_only=True)
        wait_for(lambda: node.report().stages[0].cycle is not None, what="the old hook's profile")
    finally:
        hook.close()
    node.assign(assignment())
    proc = fill_process(node.run_dir, "uid-1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert "speaks card v3; this side needs v4" in err
    assert "upgrade bubbles in the training's image to release" in err
    assert f"{card.parent}/fills, not in ml/{TRAINING}/stage-0/rank-0/fills" in err


def test_a_replaced_training_pod_invalidates_the_stage_until_it_is_profiled_again(node: NodeAgent) -> None:
    write_card(node.run_dir)
    node.scan()
    hook = Hook(node.run_dir, namespace=NAMESPACE)
    try:
        hook.send(wire.encode_profile(0, cycle()), agent_only=True)
        wait_for(lambda: node.report().stages[0].cycle is not None, what="the profile")
        write_card(node.run_dir, pod="llama-0-new")
        node.scan()
        (stage,) = node.report().stages
        assert stage.pod == "llama-0-new" and stage.cycle is None and not stage.hook_reporting
        hook.send(wire.encode_profile(0, cycle()), agent_only=True)
        wait_for(lambda: node.report().stages[0].cycle is not None, what="the new profile")
        # The same Pod name, a new process (a container restart, or a StatefulSet's replacement): measured again.
        write_card(node.run_dir, pod="llama-0-new", pid=2, started_ns=5)
        node.scan()
        assert node.report().stages[0].cycle is None
        node.scan()  # an unchanged card changes nothing
        hook.send(wire.encode_profile(0, cycle()), agent_only=True)
        wait_for(lambda: node.report().stages[0].cycle is not None, what="the profile of the new process")
    finally:
        hook.close()


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("State:"))


def test_a_plain_command_attaches_through_the_sdk_and_is_frozen_outside_bubbles(node: NodeAgent) -> None:
    run_dir = node.run_dir
    write_card(run_dir)
    node.scan()
    hook = Hook(run_dir, namespace=NAMESPACE)
    program = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"]
    spec = parse_spec({"name": "plain", "interface": "imperative", "command": program, "memory": "16Mi",
                       "step_time": "1ms"})
    node.assign(AssignmentMessage("uid-plain", 1, 0, "ml", "plain", TRAINING, 0, "llama-0", "cpu", "fj-plain-a0",
                                  spec))
    env = {**os.environ, paths.RUN_DIR_ENV: str(run_dir), control.UID_ENV: "uid-plain", control.ATTEMPT_ENV: "0"}
    proc = subprocess.Popen([sys.executable, "-m", "bubbles.sdk", "--exec", "--", *program], env=env, text=True,
                            stderr=subprocess.PIPE)
    try:
        hook.send(wire.encode_profile(0, cycle(slots=((0.02, 1 << 30),))), agent_only=True)
        # Launched (the same PID, now the command) and frozen until its stage's first bubble.
        wait_for(lambda: (j := job(node, "uid-plain")) and j.state is FillState.PAUSED, timeout_s=30,
                 what="the plain command to be paused")
        assert node.book.jobs["uid-plain"].attached_pid == proc.pid
        wait_for(lambda: proc_state(proc.pid) == "T", what="SIGSTOP")
        hook.send(wire.encode_bubble_start(0, 0, 1, time.monotonic_ns(), time.monotonic_ns() + 50_000_000))
        wait_for(lambda: proc_state(proc.pid) != "T", what="SIGCONT at the bubble's start")
        hook.send(wire.encode_bubble_end(0, 0, 1, time.monotonic_ns()))
        wait_for(lambda: proc_state(proc.pid) == "T", what="SIGSTOP at the bubble's end")
        assert node.cancel("uid-plain", "deleted")
        assert proc.wait(timeout=15) is not None  # SIGCONT then SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        hook.close()


def test_exec_without_a_command_or_outside_a_fill_pod_says_what_is_missing(tmp_path: Path) -> None:
    for args, env, message in ((["--exec"], {control.UID_ENV: "u"}, "--exec needs a command"),
                               (["--exec", "--", "true"], {}, control.UID_ENV)):
        clean = {k: v for k, v in os.environ.items() if k != control.UID_ENV}
        result = subprocess.run([sys.executable, "-m", "bubbles.sdk", *args], env={**clean, **env},
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr


def test_one_metrics_endpoint_for_the_node_merges_every_training(node: NodeAgent) -> None:
    write_card(node.run_dir)
    write_card(node.run_dir, training="other", pod="o-0")
    node.scan()
    assert sorted(node.trainings) == [("ml", "other"), TR]
    node.assign(assignment())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # one refused attach
        s.connect(str(paths.attach_socket(node.run_dir)))
        s.sendall(control.encode("hello", uid="nobody", attempt=0))
        assert control.parse_reply(s.makefile("rb").readline()).type == "refused"
    port = node.serve_metrics(0, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))  # each family once, as the exposition format requires
    for training in ("other", TRAINING):
        assert f'bubbles_fill_share{{namespace="ml",training="{training}"}} 1.0' in text
    assert 'bubbles_fill_assignments{state="waiting"} 1.0' in text
    assert "bubbles_attach_refused_total 1.0" in text


class StandInNvml:
    """The pynvml functions discover_gpus calls, over a list of UUIDs (NVML answers bytes in older bindings)."""

    def __init__(self, uuids: list[str | bytes], fail_init: bool = False) -> None:
        self.uuids = uuids
        self.fail_init = fail_init
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return self.uuids[handle]

    def nvmlShutdown(self) -> None:
        self.shut = True


def test_gpus_are_found_by_uuid_through_nvml_and_none_without_it() -> None:
    from bubbles.agent.gpus import discover_gpus

    nvml = StandInNvml(["GPU-aaaa", b"GPU-bbbb"])
    assert discover_gpus(nvml) == {"GPU-aaaa": "cuda:0", "GPU-bbbb": "cuda:1"} and nvml.shut
    assert discover_gpus(StandInNvml([], fail_init=True)) == {}
    # The real bindings on this machine: no driver, so nothing found, and no error.
    assert discover_gpus() == {} or all(d.startswith("cuda:") for d in discover_gpus().values())


def test_a_card_naming_a_known_gpu_gets_the_agents_own_device_for_it(tmp_path: Path) -> None:
    template = AgentConfig(run_dir=tmp_path / "run", training="placeholder",
                           isolation=IsolationConfig(mode=IsolationMode.NONE))
    n = NodeAgent(ClusterConfig(NODE, template, gpus={"GPU-5": "cuda:3"}))
    n.start()
    try:
        # The training sees its GPU as cuda:0 in its container; on the node, NVML's index 3 is that GPU.
        write_card(n.run_dir, device="cuda:0", gpu_uuid="GPU-5")
        n.scan()
        (stage,) = n.report().stages
        assert (stage.device, stage.gpu_uuid) == ("cuda:3", "GPU-5")
    finally:
        n.stop()


def test_a_training_whose_processes_are_gone_loses_its_cards_and_its_agent(node: NodeAgent) -> None:
    """A training Pod deleted or crashed leaves its hook's card on the node. The hook holds its stage's hook.lock
    while it lives (the lock, across PID namespaces, is how the agent tells): once nothing holds it, the card is
    removed and the training's agent stops, rather than serve it (and check its isolation every second) for good."""
    node.config = dataclasses.replace(node.config, retire_after_s=0.5)
    lock = paths.hook_lock(node.run_dir, gpu(0, namespace=NAMESPACE))
    paths.make_private_dir(lock.parent)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        card = write_card(node.run_dir, stages=2, lock=True)
        legacy = write_card(node.run_dir, stage=1, stages=2, lock=False)  # a hook before the lock: always live
        node.scan()
        tr = node.trainings[TR]
        node.scan()
        assert node.trainings.get(TR) is tr and card.exists()  # the process lives: nothing changes
    finally:
        holder.kill()
        holder.wait()
    node.scan()
    assert not card.exists() and legacy.exists() and node.trainings.get(TR) is tr  # stage 1 still there
    assert [s.stage for s in node.report().stages] == [1]  # the gone stage is no longer reported
    legacy.unlink()  # the old hook detached
    node.scan()
    assert node.trainings.get(TR) is tr  # not at once: a restarting process writes a new card within the grace
    wait_for(lambda: TR not in node.trainings, 10, "the training without cards to be retired")
    tr.thread.join(10)
    assert not tr.thread.is_alive()
    write_card(node.run_dir)  # it comes back: served afresh
    node.scan()
    assert node.trainings[TR] is not tr


# -- several GPUs per stage, several namespaces ---------------------------------------------------------------------
def test_two_ranks_of_one_stage_are_two_gpus_and_a_job_assigned_to_rank_1_binds_in_its_fills(node: NodeAgent) -> None:
    write_card(node.run_dir, rank=0, ranks=2, gpu_uuid="GPU-r0")
    node.scan()
    assert [(s.stage, s.rank, s.ranks) for s in node.report().stages] == [(0, 0, 2)]
    write_card(node.run_dir, rank=1, ranks=2, pod="llama-1", gpu_uuid="GPU-r1")  # a rank found later: no restart
    node.scan()
    stages = node.report().stages
    assert [(s.stage, s.rank, s.ranks, s.pod, s.gpu_uuid) for s in stages] == [
        (0, 0, 2, "llama-0", "GPU-r0"), (0, 1, 2, "llama-1", "GPU-r1")]
    assert paths.agent_socket(node.run_dir, gpu(0, 1, namespace=NAMESPACE)).is_socket()
    rank0, rank1 = Hook(node.run_dir, 0, 0, namespace=NAMESPACE), Hook(node.run_dir, 0, 1, namespace=NAMESPACE)
    try:
        rank1.send(wire.encode_profile(0, cycle(slots=((0.02, 1 << 30),))), agent_only=True)
        wait_for(lambda: node.report().stages[1].cycle is not None, what="rank 1's profile")
        assert node.report().stages[0].cycle is None  # rank 0's GPU has its own bubbles, not measured yet
        node.assign(assignment(ranks=(1,)))
        proc = fill_process(node.run_dir, "uid-1")
        try:
            wait_for(lambda: rank1.fill_armed("fj-a0"), timeout_s=30, what="the job armed in rank 1's fills/")
            assert not rank0.fill_armed("fj-a0")
            for _ in range(10):
                rank1.bubble(0.02)
            wait_for(lambda: (j := job(node, "uid-1")) and j.steps_done > 0, what="steps on rank 1")
            assert node.report().stages[1].filled_s > 0 and node.report().stages[0].filled_s == 0
            with node.trainings[TR].agent.lock:
                (record,) = node.trainings[TR].agent.jobs
            assert record.key == gpu(0, 1, namespace=NAMESPACE)
        finally:
            proc.kill()
            proc.communicate()
    finally:
        rank0.close()
        rank1.close()


def test_trainings_of_one_name_in_two_namespaces_are_two_trainings(node: NodeAgent) -> None:
    write_card(node.run_dir, namespace="a", pod="llama-a")
    write_card(node.run_dir, namespace="b", pod="llama-b")
    node.scan()
    a, b = node.trainings[("a", TRAINING)], node.trainings[("b", TRAINING)]
    assert a.agent is not b.agent and len(node.trainings) == 2
    assert [(s.namespace, s.pod) for s in node.report().stages] == [("a", "llama-a"), ("b", "llama-b")]
    hook = Hook(node.run_dir, namespace="a")
    try:
        hook.send(wire.encode_profile(0, cycle()), agent_only=True)
        wait_for(lambda: node.report().stages[0].cycle is not None, what="a's profile")
        assert node.report().stages[1].cycle is None  # b's stage heard nothing
    finally:
        hook.close()
    node.assign(dataclasses.replace(assignment(namespace="a"), slowdown_budget=0.2))
    assert a.agent.core.config.guard.budget == 0.2 and b.agent.core.config.guard.budget != 0.2  # its own guard
    assert paths.fills_dir(node.run_dir, gpu(0, namespace="a")).is_dir()
    assert paths.fills_dir(node.run_dir, gpu(0, namespace="b")).is_dir()


def test_an_assignment_naming_a_rank_without_a_hook_here_is_refused_naming_the_gpu(node: NodeAgent) -> None:
    write_card(node.run_dir, rank=0, ranks=4)
    node.scan()
    node.assign(assignment(ranks=(2,)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(paths.attach_socket(node.run_dir)))
        s.sendall(control.encode("hello", uid="uid-1", attempt=0))
        reply = control.parse_reply(s.makefile("rb").readline())
    assert reply.type == "refused"
    assert f"ml/{TRAINING}/stage-0/rank-2 (stage 0 rank 2 of training {TRAINING}) has no hook on this node" \
        in reply["reason"]
    assert node.book.jobs["uid-1"].attached_pid is None  # refused: the next attempt may attach
