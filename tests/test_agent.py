"""The agent end to end: real sockets, real fill subprocesses, datagrams encoded by bubbles.core.wire.

The test plays the training's hook: it sends each signal to every ``*.sock`` in the stage
directory, as ``bubbles.hook`` does, so armed fill jobs hear bubbles directly. Waits poll with
deadlines; nothing sleeps for a fixed time to "let things settle".
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.agent import (
    MIB,
    TRAINING,
    Harness,
    Hook,
    StartAgent,
    cycle,
    environ,
    gpu,
    spec,
    start_agent,
    wait_for,
)

from bubbles.agent.core import within_factor
from bubbles.agent.guard import GuardConfig
from bubbles.agent.metrics import names
from bubbles.core import paths, wire
from bubbles.core.api import parse_spec
from bubbles.core.lifecycle import FillState, InvalidTransition, transition

__all__ = ["start_agent"]  # the fixture, from helpers.agent


def test_lifecycle_transitions_and_invalid_transition_raises() -> None:
    s = FillState.SUBMITTED
    path = (FillState.CREATED, FillState.PAUSED, FillState.RUNNING, FillState.PAUSED, FillState.STOPPED)
    for target in path:
        s = transition(s, target)
    assert s is FillState.STOPPED
    with pytest.raises(InvalidTransition):
        transition(FillState.SUBMITTED, FillState.RUNNING)
    with pytest.raises(InvalidTransition):
        transition(FillState.STOPPED, FillState.PAUSED)


def test_steps_run_only_inside_bubbles_and_end_before_the_predicted_end(start_agent: StartAgent) -> None:
    # 1 ms busy steps gated with a 1.5 ms step time; 6 ms bubbles: at most 5 steps (at 0..4 ms) each.
    # A long grace: this test is about the gate; a preempted step must not trip the watchdog here. The tail off:
    # on a loaded machine the bubbles' sleeps overshoot their predictions by milliseconds, and TailRisk may then
    # start steps past the prediction (its own test is test_the_agents_tail_risk_reaches_the_fill_process...).
    h = start_agent([spec("busy", "test_agent_jobs:BusyJob", args={"step_ms": 1.0}, step_time="1.5ms")],
                    grace_s=0.5, tail_risk=0.0)
    assert h.job("busy")["state"] == "SUBMITTED"  # no cycle yet: not planned, no process
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle(slots=((0.006, 1 << 30),))))
    h.wait_state("busy", "PAUSED")
    wait_for(lambda: hook.fill_armed("busy"), what="fill socket bound")
    for _ in range(40):
        hook.bubble(0.006)
        time.sleep(0.003)  # the training computes between bubbles
    wait_for(lambda: len(h.agent.stats()["bubbles"]) == 40, what="40 bubbles accounted")
    steps = wait_for(lambda: h.agent.stats()["steps"], what="steps reported")
    bubbles = {seq: (start, predicted, end) for seq, start, predicted, end in hook.sent}
    # The gate itself is exact: a step starts only if start + step_time (1.5 ms) <= predicted end.
    # Its actual end can slip when the OS preempts the fill process (this 2-core machine is shared
    # with the test and the agent): most steps must end in time, and none run far past (a step the gate did not
    # stop would run into the next bubble, 3 ms on; a preempted one slips by a scheduler's slice or a few).
    tolerance_ns = 50_000_000
    late = 0
    for st in steps:
        start, predicted, end = bubbles[st["bubble_seq"]]
        assert st["signal_ns"] == start and not st["tail"]
        assert start <= st["start_ns"] < end, "a step started outside its bubble"
        assert st["start_ns"] + 1_500_000 <= predicted, "a step started that could not finish in time"
        assert st["end_ns"] <= predicted + tolerance_ns, "a step ran far past its bubble's predicted end"
        late += st["end_ns"] > predicted
    assert late <= len(steps) // 4, f"{late} of {len(steps)} steps ended after the predicted end"
    assert len(steps) >= 40, "expected most bubbles to run steps"
    assert max(sum(1 for s in steps if s["bubble_seq"] == q) for q in bubbles) <= 5
    stats = h.agent.stats()
    harvest = stats["modes"]["harvest"]
    assert harvest["fill_steps"] == len(steps) and harvest["fill_flops"] == pytest.approx(1e6 * len(steps))
    assert harvest["filled_s"] > 0.5 * 1e-3 * len(steps)
    assert h.job("busy")["state"] in ("PAUSED", "RUNNING")
    states = [e["message"] for e in stats["events"] if e["job"] == "busy" and e["kind"] == "state"]
    assert states[0] == "CREATED"
    # The plan (docs/agent.md#the-plan-fill-steps-per-iteration): stated from the spec's step time once the job was
    # admitted, then compared with what ran: within the stated factor, or a reason given.
    plans = [e["message"] for e in stats["events"] if e["job"] == "busy" and e["kind"] == "plan"]
    assert plans[0].startswith("planned: ") and plans[0].endswith("(step time from the spec)"), plans
    job = h.job("busy")
    planned, ran = job["plan_steps_per_iteration"], job["ran_steps_per_iteration"]
    assert ran is not None and planned is not None, job
    assert within_factor(planned, ran) or job["plan_reason"], job


def test_job_that_ignores_pause_is_killed_after_the_grace_period(start_agent: StartAgent) -> None:
    h = start_agent([spec("sleepy", "test_agent_jobs:SleepyJob")], grace_s=0.05)
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle()))
    h.wait_state("sleepy", "PAUSED")
    wait_for(lambda: hook.fill_armed("sleepy"), what="fill socket bound")
    # Unknown step time: the runtime self-profiles with one step at the start of this bubble (it sleeps 1 s).
    _seq, _start, end = hook.bubble(0.005)
    job = h.wait_state("sleepy", "STOPPED", timeout_s=5)
    assert job["reason"] == "killed: did not pause within 50 ms of bubble end"
    kill = next(e for e in h.agent.stats()["events"] if e["kind"] == "kill")
    late_ms = (kill["t_ns"] - end) / 1e6
    # At the grace's end, not at the step's (1 s): the agent's loop may be late by a loaded machine's wake-up.
    assert 50 <= late_ms <= 50 + 450, f"killed {late_ms:.1f} ms after the bubble ended"
    assert h.agent.kills == 1
    proc = h.agent.process(h.agent.jobs[0])
    assert proc is None or proc.poll() is not None or wait_for(lambda: proc.poll() is not None)
    assert not hook.fill_armed("sleepy") or wait_for(lambda: not hook.fill_armed("sleepy"))


def test_job_too_big_for_every_bubble_is_rejected_naming_the_bubble(start_agent: StartAgent) -> None:
    h = start_agent([spec("huge", "test_agent_jobs:BusyJob", memory="2Gi", step_time="1ms")])
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle(slots=((0.005, 64 * MIB), (0.004, 128 * MIB)))))
    job = h.wait_state("huge", "STOPPED")
    assert job["reason"].startswith("rejected: ")
    assert "stage 0 slot 1 (RecvGrad, steady)" in job["reason"]  # the roomiest bubble limits it
    assert h.agent.rejected_jobs == 1
    assert h.agent.process(h.agent.jobs[0]) is None  # never started


def test_only_the_process_holding_the_stages_lock_speaks_for_the_training(start_agent: StartAgent) -> None:
    """Fill processes share the stage directory: a PROFILE one sent claiming 8 GiB free had a 2 GiB job planned into
    a stage whose bubbles have 64 MiB. The training's hook holds the stage's hook.lock for its process's life; the
    agent takes datagrams only from that process."""
    h = start_agent([spec("big", "test_agent_jobs:BusyJob", memory="2Gi", step_time="1ms")])
    lock = paths.hook_lock(h.run_dir, gpu(0))
    script = ("import fcntl, os, socket, sys\n"
              f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "print('locked', flush=True)\n"
              "data = bytes.fromhex(sys.stdin.readline())\n"
              f"socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(data, {str(h.run_dir)!r} + "
              f"'/_local/{TRAINING}/stage-0/rank-0/agent.sock')\n"
              "print('sent', flush=True)\n"
              "sys.stdin.read()\n")
    training = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    try:
        assert training.stdout is not None and training.stdin is not None
        assert training.stdout.readline().strip() == "locked"
        forger = Hook(h.run_dir)  # this test's process: not the lock's holder
        forger.send(wire.encode_profile(0, cycle(slots=((0.005, 8 << 30),))), agent_only=True)
        wait_for(lambda: h.agent.stats()["rejected_messages"] >= 1, what="the forged profile refused")
        assert h.job("big")["state"] == "SUBMITTED"  # nothing planned against it
        for i in range(300):  # a flood from the same sender: refused, and no reason to stop hearing the training
            forger.send(wire.encode_bubble_end(0, 0, i, 1), agent_only=True)
        training.stdin.write(wire.encode_profile(0, cycle(slots=((0.005, 64 * MIB),))).hex() + "\n")
        training.stdin.flush()
        assert training.stdout.readline().strip() == "sent"
        job = h.wait_state("big", "STOPPED")
        assert job["reason"].startswith("rejected: ")  # planned against the training's own bubbles
        # The training's process goes: its lock with it, and the stage takes datagrams from whoever sends again.
        training.stdin.close()
        training.wait(10)
        before = h.agent.stats()["rejected_messages"]
        forger.send(wire.encode_bubble_start(0, 0, 1, 10, 20), agent_only=True)
        forger.send(wire.encode_bubble_end(0, 0, 1, 30), agent_only=True)
        time.sleep(0.3)
        assert h.agent.stats()["rejected_messages"] == before
        forger.close()
    finally:
        training.kill()
        training.wait(10)


def test_lock_holder_names_the_process_holding_the_lock_and_no_other(tmp_path: Path) -> None:
    """/proc/locks as the agent reads it: the holder by the file's device and inode, a waiter's line ("->") not taken
    for it, no answer for a file not there, not locked, not regular, or reached through a link."""
    from bubbles.agent.server import lock_holder

    path = tmp_path / "hook.lock"
    assert lock_holder(path) is None
    path.touch()
    assert lock_holder(path) is None
    hold = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    waiter = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert lock_holder(path) == holder.pid
        waiter = subprocess.Popen([sys.executable, "-c", hold, str(path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)  # blocks in flock: a "->" line
        inode = f":{path.stat().st_ino} "
        wait_for(lambda: any(" -> " in line and inode in line for line in Path("/proc/locks").read_text().splitlines()),
                 what="the waiter's line")
        assert lock_holder(path) == holder.pid
        os.symlink(path, tmp_path / "link.lock")
        assert lock_holder(tmp_path / "link.lock") is None
    finally:
        for proc in (holder, waiter):
            if proc is not None:
                proc.kill()
                proc.wait(10)
    os.mkfifo(tmp_path / "fifo.lock")
    assert lock_holder(tmp_path / "fifo.lock") is None


def test_malformed_input_is_dropped_and_the_agent_keeps_serving(start_agent: StartAgent) -> None:
    h = start_agent([spec("garbage", "test_agent_jobs:GarbageControlJob", args={"step_ms": 0.5},
                          step_time="1ms")])
    hook = Hook(h.run_dir)
    valid = wire.encode_bubble_start(0, 0, 1, 10, 20)
    bad = [
        b"definitely not a datagram",
        valid[:10],  # truncated
        b"BB" + bytes([1, 2, 0, 0]) + b"\x00" * (wire.MAX_DATAGRAM_BYTES + 10),  # oversized
        wire.encode_profile(0, {"training": TRAINING}),  # not a valid cycle
        wire.encode_bubble_start(3, 0, 1, 10, 20),  # another stage's signal on stage 0's socket
    ]
    for data in bad:
        hook.send(data, agent_only=True)
    hook.send(wire.encode_profile(0, cycle(slots=((0.008, 1 << 30),))))
    h.wait_state("garbage", "PAUSED")
    wait_for(lambda: hook.fill_armed("garbage"), what="fill socket bound")
    for data in bad[:3]:
        hook.send(data)  # the fill job's socket gets garbage too
    for _ in range(3):
        hook.bubble(0.008)
    wait_for(lambda: h.agent.stats()["modes"]["harvest"]["fill_steps"] > 0, what="a step after the garbage")
    assert h.agent.rejected_messages >= len(bad) + 1  # + the job's garbage control line
    assert h.job("garbage")["state"] in ("PAUSED", "RUNNING")


def test_fill_modes_switch_naive_off_harvest(start_agent: StartAgent) -> None:
    h = start_agent([spec("busy", "test_agent_jobs:BusyJob", args={"step_ms": 0.5}, step_time="1ms")],
                    mode=wire.FillMode.OFF)
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle()))
    h.wait_state("busy", "PAUSED")
    hook.bubble(0.005)
    hook.send(wire.encode_fill_mode(0, wire.FillMode.NAIVE))
    h.wait_state("busy", "RUNNING")
    wait_for(lambda: h.agent.stats()["modes"]["naive"]["fill_steps"] >= 20, what="naive steps")
    hook.send(wire.encode_fill_mode(0, wire.FillMode.OFF))
    h.wait_state("busy", "PAUSED")
    stats = h.agent.stats()
    assert stats["modes"]["off"]["fill_steps"] == 0 and stats["modes"]["off"]["bubble_s"] > 0
    assert all(s["bubble_seq"] == -1 for s in stats["steps"] if s["mode"] == "naive")
    hook.send(wire.encode_fill_mode(0, wire.FillMode.HARVEST))
    wait_for(lambda: hook.fill_armed("busy"), what="fill socket bound")
    for _ in range(3):
        hook.bubble(0.005)
    wait_for(lambda: h.agent.stats()["modes"]["harvest"]["fill_steps"] > 0, what="harvest steps")


def test_slowdown_guard_cuts_the_share_sent_to_jobs(start_agent: StartAgent) -> None:
    guard = GuardConfig(budget=0.01, refresh_every=0)
    h = start_agent([spec("busy", "test_agent_jobs:BusyJob", step_time="1ms")], guard=guard)
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle(iteration_s=0.05)))
    h.wait_state("busy", "PAUSED")
    for i in range(8 + 6 * 6):  # 20% slower than the profiled 50 ms while fill work runs: a slow window, a probe
        with h.agent.lock:
            paused = h.agent.core.fill_paused
        hook.send(wire.encode_iteration(0, i, time.monotonic_ns(), 50_000_000 if paused else 60_000_000))
        wait_for(lambda n=i + 1: (g := h.agent.core.guard) is not None and g.iterations == n,
                 what=f"iteration {i} at the guard")
    stats = wait_for(lambda: (s := h.agent.stats())["guard"]["share"] < 1 and s, what="share cut")
    assert stats["guard"]["share"] == 0.5 and stats["guard"]["baseline_s"] == pytest.approx(0.05)
    assert [round(x[1], 3) for x in stats["guard"]["history"]] == [1.0, 0.5]
    assert stats["guard"]["slowdown_held"] == pytest.approx(0.2)


@pytest.mark.parametrize("limit", [None, 0.0])
def test_the_agents_tail_risk_reaches_the_fill_process_and_0_keeps_steps_inside_the_prediction(
        start_agent: StartAgent, limit: float | None) -> None:
    """Bubbles predicted to end after 8 ms last 20: with no limit the fill process's own risk (0.1) fills their tails
    once it has seen 8 end; ``--tail-risk 0`` (a PipelineTraining's ``tailRisk: 0``) keeps every step inside the
    prediction, in a real fill process."""
    h = start_agent([spec("busy", "test_agent_jobs:BusyJob", args={"step_ms": 1.0}, step_time="1.2ms")],
                    grace_s=0.5, tail_risk=limit)
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle(slots=((0.008, 1 << 30),))))
    h.wait_state("busy", "PAUSED")
    wait_for(lambda: hook.fill_armed("busy"), what="fill socket bound")
    for _ in range(16):
        hook.bubble(0.008, end_late_s=0.012)
        time.sleep(0.004)
    wait_for(lambda: len(h.agent.stats()["bubbles"]) == 16, what="16 bubbles accounted")
    steps = wait_for(lambda: (s := h.agent.stats()["steps"]) and s[-1]["bubble_seq"] >= 12 and s,
                     what="steps of the last bubbles reported")
    tails = [st for st in steps if st["tail"]]
    predicted = {seq: p for seq, _, p, _ in hook.sent}
    assert all(st["start_ns"] + 1_200_000 <= predicted[st["bubble_seq"]] for st in steps if not st["tail"])
    with h.agent.lock:
        (stage,) = [s for s in h.agent.core.snapshot().stages if s.mode == "harvest"]  # what Prometheus exports
    if limit is None:
        assert tails and all(st["bubble_seq"] >= 9 for st in tails)
        assert 0 < stage.tail_filled_s <= stage.filled_s and stage.tail_overrun_s <= stage.overrun_s
    else:
        assert not tails and stage.tail_filled_s == stage.tail_overrun_s == 0


def frozen_imperative_job(start_agent: StartAgent, **agent_kw: Any) -> tuple[Harness, Hook, Callable[[], str]]:
    """An imperative job launched on a profiled stage and frozen until its first bubble: the agent, the hook, and
    its process's state letter (``/proc/<pid>/stat``: T when stopped)."""
    h = start_agent([parse_spec({"name": "imp", "interface": "imperative",
                                 "entry": "test_agent_jobs:CountingImperativeJob"})], **agent_kw)
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle()))
    h.wait_state("imp", "PAUSED")
    proc = h.agent.process(h.agent.jobs[0])
    assert proc is not None

    def proc_state() -> str:
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    wait_for(lambda: proc_state() == "T", what="process stopped")
    return h, hook, proc_state


def test_imperative_job_is_stopped_and_continued_around_bubbles(start_agent: StartAgent) -> None:
    h, hook, proc_state = frozen_imperative_job(start_agent)
    seq = hook.seq + 1
    hook.send(wire.encode_bubble_start(0, 0, seq, time.monotonic_ns(), time.monotonic_ns() + 10**9))
    h.wait_state("imp", "RUNNING")
    wait_for(lambda: proc_state() in "RS", what="process continued")
    hook.send(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()))
    h.wait_state("imp", "PAUSED")
    wait_for(lambda: proc_state() == "T", what="process stopped again")


def test_an_imperative_job_whose_bubble_end_is_lost_is_stopped_by_the_agent_itself(start_agent: StartAgent) -> None:
    h, hook, proc_state = frozen_imperative_job(start_agent, metrics=True, metrics_port=0)
    start = time.monotonic_ns()
    hook.send(wire.encode_bubble_start(0, 0, hook.seq + 1, start, start + 100_000_000))  # and no END, ever
    h.wait_state("imp", "RUNNING")
    h.wait_state("imp", "PAUSED")  # at 2 x 100 ms + the 50 ms grace
    assert time.monotonic_ns() - start >= 250_000_000
    wait_for(lambda: proc_state() == "T", what="process stopped again")
    body = urllib.request.urlopen(f"http://127.0.0.1:{h.agent.metrics_port}/metrics", timeout=5).read().decode()
    assert 'bubbles_missed_bubble_ends_total{namespace="_local",rank="0",stage="0",training="t"} 1.0' in body


def test_metrics_endpoint_serves_the_documented_names(start_agent: StartAgent) -> None:
    h = start_agent([spec("busy", "test_agent_jobs:BusyJob", step_time="1ms")], metrics=True, metrics_port=0)
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle()))
    h.wait_state("busy", "PAUSED")
    wait_for(lambda: hook.fill_armed("busy"), what="fill socket bound")
    for _ in range(3):
        hook.bubble(0.005)
    hook.send(wire.encode_iteration(0, 0, time.monotonic_ns(), 50_000_000))
    hook.send(b"junk")
    wait_for(lambda: h.agent.stats()["modes"]["harvest"]["fill_steps"] > 0, what="steps")
    # The junk datagram was sent last on the agent's socket: once it is counted, the ITERATION before it
    # has been handled too.
    wait_for(lambda: h.agent.stats()["rejected_messages"] > 0, what="junk counted")
    url = f"http://127.0.0.1:{h.agent.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    found = names(body.splitlines())
    for name in ("bubbles_bubble_seconds_total", "bubbles_filled_bubble_seconds_total",
                 "bubbles_fill_steps_total", "bubbles_recovered_flops_total", "bubbles_overrun_seconds_total",
                 "bubbles_main_iteration_seconds", "bubbles_fill_jobs", "bubbles_fill_share",
                 "bubbles_rejected_messages_total", "bubbles_isolation_ready", "bubbles_isolation_state",
                 "bubbles_isolation_losses_total"):
        assert name in found, f"{name} missing from /metrics"
    assert "# HELP bubbles_fill_kills_total" in body
    assert 'fill_job="busy"' in body and 'device="cpu:0"' in body
    assert 'bubbles_isolation_ready{mode="contexts",namespace="_local",training="t"} 1.0' in body


def test_default_isolation_is_separate_processes_kept_off_mps(start_agent: StartAgent) -> None:
    # Contexts mode (the default) on CPU: every fill job is its own OS process, and its CUDA_MPS_PIPE_DIRECTORY
    # points at an empty private directory, so on a GPU node it could not join an MPS daemon by accident.
    h = start_agent([parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"]})])
    stats = h.agent.stats()
    assert stats["isolation"] == {"mode": "contexts", "state": "ready", "daemon": None,
                                  "detail": "CPU devices: every fill job is a separate OS process"}
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle()))
    h.wait_state("cmd", "PAUSED")
    proc = h.agent.process(h.agent.jobs[0])
    assert proc is not None
    env = environ(proc.pid)
    private = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert private == h.run_dir / "_local" / TRAINING / "no-mps" and private.is_dir() and not list(private.iterdir())
    assert h.job("cmd")["isolation"] == "contexts"
    assert any(e["kind"] == "isolation" and e["message"].startswith("ready: ") for e in stats["events"])
    # The kernel named the hook's process (this one) as the datagrams' sender; without MPS it is not checked.
    executor = h.agent.stats()["executors"][0]
    assert executor["training_pid"] == os.getpid() and executor["training_membership"] == ""


def test_a_datagrams_sender_is_named_in_the_receivers_pid_namespace(tmp_path: Path) -> None:
    """What the agent learns the training's process from (SCM_CREDENTIALS, with SO_PASSCRED on the agent's socket,
    nothing on the sender's): a sender in a PID namespace of its own, as a training in a Pod is, is named by the PID
    the receiver's namespace gives it, which the MPS daemon's client list uses too."""
    from bubbles.agent.server import recv_with_pid

    path = tmp_path / "agent.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(str(path))
    sock.settimeout(30)
    send = ("import os, socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
            f"s.sendto(b'hello', {str(path)!r}); print(os.getpid(), flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", send], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert recv_with_pid(sock, 64) == (b"hello", child.pid)
        assert child.stdout is not None and int(child.stdout.readline()) == child.pid
    finally:
        child.communicate(timeout=30)
    # As root, a PID namespace; otherwise inside a user namespace of its own, which an unprivileged user may make.
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    nested = subprocess.Popen(["unshare", *user, "--pid", "--fork", "--kill-child", sys.executable, "-c", send],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert nested.stdout is not None
        inner = nested.stdout.readline().strip()
        if not inner:
            err = nested.communicate(timeout=30)[1].strip()
            if "unshare failed" in err or "Operation not permitted" in err:  # the machine allows none: not our code
                pytest.skip(f"cannot make a PID namespace here: {err[:200]}")
            raise AssertionError(f"the sender in its own PID namespace failed (exit {nested.returncode}): "
                                 f"{err[-1000:]}")
        assert int(inner) == 1  # its own namespace's first process
        data, pid = recv_with_pid(sock, 64)
        assert data == b"hello" and pid is not None and pid != 1
        status = Path(f"/proc/{pid}/status").read_text()
        assert re.search(rf"^NSpid:\s+{pid}\s+1$", status, re.M), status  # that PID here, 1 in its own
    finally:
        nested.communicate(timeout=30)
        sock.close()


def test_a_fill_job_whose_socket_path_would_be_too_long_is_stopped_with_the_reason(start_agent: StartAgent) -> None:
    # The run directory fits the agent's own sockets, but this job's (fill-<name>.sock) would not fit sun_path:
    # the job is stopped before it starts, saying what to shorten, and the agent and its other jobs go on.
    long_name = "j" * 63
    h = start_agent([spec(long_name, "test_agent_jobs:BusyJob"), spec("ok", "test_agent_jobs:BusyJob")])
    assert paths.socket_path_problem(paths.fill_socket(h.run_dir, gpu(0), long_name)) is not None
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    j = h.wait_state(long_name, "STOPPED")
    assert "use a shorter run directory" in j["reason"] and "not started" in j["reason"]
    h.wait_state("ok", "PAUSED", "RUNNING")


def test_the_credentials_benchmark_times_both_sides_and_refuses_bad_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import datagram_credentials  # benchmarks/ (on the path through conftest)

    for bad in (["--rounds", "0"], ["--datagrams", "0"]):
        with pytest.raises(SystemExit) as exit_:
            datagram_credentials.main(bad)
        assert exit_.value.code == 2 and "--rounds and --datagrams must be >= 1" in capsys.readouterr().err
    out = tmp_path / "creds.json"
    assert datagram_credentials.main(["--rounds", "2", "--datagrams", "200", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for side in ("send", "receive"):
        assert len(result[side]["before_ns"]) == len(result[side]["now_ns"]) == 2
        assert all(t > 0 for t in result[side]["before_ns"] + result[side]["now_ns"])
    assert "the agent's receive:" in capsys.readouterr().out

