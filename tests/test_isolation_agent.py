"""Isolation on the node: the real agent on MPS, with real fill processes (whose environment is read from /proc)
and the stand-in for ``nvidia-cuda-mps-control`` in tests/fakes (its daemon SIGKILLed to lose it).

Fail closed (no control program, a daemon that will not start), the MPS clients' environment, a fill job armed only
once the daemon lists it as a client, recovery after a lost daemon (jobs stopped and resubmitted, at most three
times), and health checks that never stall the agent's loop. On the CPU build of torch the MPS variables are
simply ignored.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.agent import (
    TRAINING,
    Harness,
    Hook,
    StartAgent,
    cycle,
    environ,
    short_tmp,
    spec,
    start_agent,
    wait_for,
)
from helpers.isolation import FAKE_MPS, MpsDirs, fill_pid, mps_config, mps_dirs, sleeper, zombie
from prometheus_client import generate_latest

from bubbles.agent.launcher import FillProcess, Launcher, LaunchRequest, ProcessLauncher
from bubbles.agent.server import MAX_ISOLATION_RESUBMISSIONS, Agent, AgentConfig
from bubbles.core import wire
from bubbles.core.api import FillState

__all__ = ["mps_dirs", "short_tmp", "start_agent"]  # the fixtures, from helpers.isolation and helpers.agent


def metrics_text(agent: Agent) -> str:
    return generate_latest(agent.metrics.registry).decode()


def busy(**fields: Any) -> Any:
    """A fill job with a declared step time (no self-profiling, which a loaded machine can stretch)."""
    return spec("busy", "test_agent_jobs:BusyJob", step_time="1ms", **fields)


MPS_VARS = {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"}


# -- the agent: fail closed, recovery, environments (real agent, real fill processes) -------------------
def test_mps_clients_get_the_mps_environment_and_an_owned_daemon_is_quit(
        mps_dirs: MpsDirs, start_agent: StartAgent) -> None:
    command_job = sleeper("gpu-cmd", memory="512Mi", stage=1)
    h = start_agent([sleeper("cpu-cmd", stage=0), command_job],
                    executors=2, devices=("cpu", "cuda:0"), isolation=mps_config(mps_dirs))
    iso = h.agent.stats()["isolation"]
    assert iso["mode"] == "mps", iso
    assert iso["state"] == "ready", iso
    assert iso["daemon"]["owned"]
    assert iso["daemon"]["pipe_dir"] == str(mps_dirs.pipe)
    for stage in (0, 1):
        Hook(h.run_dir, stage).send(wire.encode_profile(stage, cycle(stage)))
    h.wait_state("cpu-cmd", "PAUSED")
    h.wait_state("gpu-cmd", "PAUSED")
    cpu_env = environ(fill_pid(h, name="cpu-cmd"))
    assert {k: cpu_env[k] for k in MPS_VARS if k in cpu_env} == {
        "CUDA_MPS_PIPE_DIRECTORY": str(mps_dirs.pipe), "CUDA_MPS_LOG_DIRECTORY": str(mps_dirs.log),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_CLIENT_PRIORITY": "1"}
    gpu_env = environ(fill_pid(h, name="gpu-cmd"))
    assert gpu_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=512M"
    assert gpu_env["BUBBLES_DEVICE"] == "cuda:0"
    assert "BUBBLES_CPU_CORE" not in gpu_env  # a GPU stage's fill job is not pinned to a core
    assert [j["isolation"] for j in h.agent.stats()["jobs"]] == ["mps", "mps"]
    daemon_pid = mps_dirs.pid()
    h.agent.request_stop()
    h.thread.join(10)
    assert mps_dirs.commands()[-1] == "quit"
    assert not mps_dirs.alive()
    assert daemon_pid is not None
    assert not Path(f"/proc/{daemon_pid}").exists() or zombie(daemon_pid)


class CpuStandIn(Launcher):
    """This machine has no GPU: the fill process runs on the CPU while the agent's executor is ``cuda:0``; the rest
    (the agent's shell, its check through the control program) is the real path. ``joins=False`` launches it without
    the isolation's variables, as a fill Pod made without the operator's --fill-mps-pipe-dir runs."""

    def __init__(self, joins: bool) -> None:
        self.joins = joins

    def launch(self, request: LaunchRequest) -> FillProcess:
        env = request.env if self.joins else {}
        return ProcessLauncher().launch(dataclasses.replace(request, device="cpu", env=env))


@pytest.mark.parametrize("joins", [True, False], ids=["joined", "not-joined"])
def test_an_mps_fill_job_on_a_gpu_is_armed_only_once_the_daemon_lists_it_as_a_client(
        joins: bool, mps_dirs: MpsDirs, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_CLIENTS_FROM_ENV", "1")  # the stand-in lists the processes on its pipe directory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cfg = AgentConfig(run_dir=short_tmp / "run", training=TRAINING, pin_cores=False, devices=("cuda:0",),
                      isolation=mps_config(mps_dirs))
    h = Harness(Agent(cfg, [busy(memory="64Mi")], launcher=CpuStandIn(joins)), short_tmp / "run")
    h.agent.start()
    h.thread.start()
    try:
        Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
        job = h.agent.jobs[0]
        if joins:
            wait_for(lambda: job.armed is not None, what="the verified job armed")
            assert job.verification == "verified"
            assert job.state is not FillState.STOPPED
            assert any(e["kind"] == "isolation" and "verified" in e["message"] for e in h.agent.core.events)
        else:
            stopped = h.wait_state("busy", "STOPPED")
            assert stopped["reason"].startswith("isolation not verified: process ")
            assert "is not a client of the MPS server" in stopped["reason"]
            assert job.armed is None
    finally:
        h.agent.request_stop()
        h.thread.join(10)


def test_losing_the_daemon_stops_its_clients_and_resubmits_them_after_the_restart(
        mps_dirs: MpsDirs, start_agent: StartAgent) -> None:
    h = start_agent([busy()], isolation=mps_config(mps_dirs))
    hook = Hook(h.run_dir)
    hook.send(wire.encode_profile(0, cycle()))
    h.wait_state("busy", "PAUSED")
    first = h.agent.jobs[0]
    assert h.agent.process(first) is not None
    old = mps_dirs.kill()
    wait_for(lambda: first.state == "STOPPED", 10, "the MPS client stopped")
    assert first.reason.startswith(f"isolation lost: MPS control daemon in {mps_dirs.pipe} (pid {old}) stopped")
    first_proc = h.agent.process(first)
    assert first_proc is not None
    wait_for(lambda: first_proc.poll() is not None, 10, "its process exited")
    wait_for(lambda: len(h.agent.jobs) == 2 and h.agent.jobs[1].state == "PAUSED", 15, "resubmitted job runs")
    again = h.agent.jobs[1]
    assert again.name == "busy"
    assert again.resubmission == 1
    assert again.isolation == "mps"
    stats = h.agent.stats()
    assert stats["isolation"]["state"] == "ready"
    assert stats["isolation_losses"] == 1
    daemon = stats["isolation"]["daemon"]
    assert daemon["owned"]
    assert daemon["restarts"] == 1
    assert daemon["pid"] == mps_dirs.pid() != old
    kinds = [(e["kind"], e["message"].split(":")[0]) for e in stats["events"] if e["kind"] in ("isolation", "resubmit")]
    assert kinds == [("isolation", "ready"), ("isolation", "recovering"), ("resubmit", "resubmitted after isolation "
                                                                                       "loss (1/3)"),
                     ("isolation", "ready")]
    text = metrics_text(h.agent)
    assert 'bubbles_mps_daemon_restarts_total{namespace="_local",training="t"} 1.0' in text
    assert 'bubbles_isolation_losses_total{mode="mps",namespace="_local",training="t"} 1.0' in text
    assert 'bubbles_isolation_ready{mode="mps",namespace="_local",training="t"} 1.0' in text
    # The armed job works again: its steps run in the bubbles.
    wait_for(lambda: hook.fill_armed("busy"), what="fill socket bound")
    for _ in range(3):
        hook.bubble(0.005)
    wait_for(lambda: again.steps > 0, 10, "steps after the resubmission")


def test_a_job_is_resubmitted_at_most_three_times(mps_dirs: MpsDirs, start_agent: StartAgent) -> None:
    h = start_agent([sleeper()], isolation=mps_config(mps_dirs))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    for n in range(MAX_ISOLATION_RESUBMISSIONS + 1):
        wait_for(lambda n=n: len(h.agent.jobs) == n + 1 and h.agent.process(h.agent.jobs[n]) is not None, 15,
                 f"run {n} started")
        job = h.agent.jobs[n]
        mps_dirs.kill()
        wait_for(lambda job=job: job.state == "STOPPED", 10, f"run {n} stopped")
    wait_for(lambda: h.agent.stats()["isolation"]["daemon"]["restarts"] == MAX_ISOLATION_RESUBMISSIONS + 1, 10,
             "daemon restarted after the last loss")
    jobs = h.agent.stats()["jobs"]
    assert len(jobs) == MAX_ISOLATION_RESUBMISSIONS + 1
    assert all(j["state"] == "STOPPED" for j in jobs)
    assert [j["resubmission"] for j in jobs] == [0, 1, 2, 3]
    assert jobs[-1]["reason"].endswith("(not resubmitted: already restarted 3 times after isolation losses)")


def test_without_the_control_program_no_fill_process_starts(mps_dirs: MpsDirs, start_agent: StartAgent,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(Path(shutil.which("sleep") or "/bin/sleep").parent))
    h = start_agent([busy()], isolation=mps_config(mps_dirs, mps_control=None))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    waiting = wait_for(lambda: (j := h.job("busy"))["reason"].startswith("waiting for isolation") and j,
                       what="job held back")
    assert waiting["state"] == "SUBMITTED"
    assert "nvidia-cuda-mps-control not found on PATH" in waiting["reason"]
    assert "--mps-control" in waiting["reason"]
    time.sleep(0.3)  # several supervisor checks later: still nothing launched
    assert h.agent.process(h.agent.jobs[0]) is None
    assert h.job("busy")["state"] == "SUBMITTED"
    iso = h.agent.stats()["isolation"]
    assert iso["state"] == "unavailable"
    assert iso["daemon"] is None
    assert 'bubbles_isolation_ready{mode="mps",namespace="_local",training="t"} 0.0' in metrics_text(h.agent)
    assert 'bubbles_isolation_state{mode="mps",namespace="_local",state="unavailable",training="t"} 1.0' \
        in metrics_text(h.agent)


@pytest.mark.parametrize("allow_unisolated", [False, True])
def test_a_daemon_that_will_not_start_holds_jobs_back_unless_unisolated_is_allowed(
        mps_dirs: MpsDirs, start_agent: StartAgent, monkeypatch: pytest.MonkeyPatch, allow_unisolated: bool) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL_START", "no CUDA-capable device is detected")
    h = start_agent([busy()],
                    isolation=mps_config(mps_dirs, allow_unisolated=allow_unisolated))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    if not allow_unisolated:
        job = wait_for(lambda: (j := h.job("busy"))["reason"].startswith("waiting for isolation") and j)
        assert "no CUDA-capable device is detected" in job["reason"]
        assert job["state"] == "SUBMITTED"
        assert h.agent.stats()["isolation"]["state"] == "unavailable"
        time.sleep(0.3)
        assert h.agent.process(h.agent.jobs[0]) is None
        return
    h.wait_state("busy", "PAUSED")
    iso = h.agent.stats()["isolation"]
    assert iso["state"] == "unisolated"
    assert "WITHOUT isolation" in iso["detail"]
    assert "no CUDA-capable device is detected" in iso["detail"]
    assert h.job("busy")["isolation"] == "unisolated"
    env = environ(fill_pid(h))
    assert not {"CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"} & set(env)
    assert 'bubbles_isolation_state{mode="mps",namespace="_local",state="unisolated",training="t"} 1.0' \
        in metrics_text(h.agent)


def test_slow_health_checks_never_stall_the_agents_loop(mps_dirs: MpsDirs, start_agent: StartAgent,
                                                        tmp_path: Path) -> None:
    # A control program that takes 1 s per call: the supervisor is almost always inside one. A loop that waited for
    # it would take up to 1 s to account a bubble (0.5 s on average); one that does not, milliseconds.
    slow = tmp_path / "slow-mps-control"
    slow.write_text(f"#!/bin/sh\nsleep 1\nexec {FAKE_MPS} \"$@\"\n")
    slow.chmod(0o755)
    h = start_agent([], isolation=mps_config(mps_dirs, mps_control=str(slow), command_timeout_s=3))
    hook = Hook(h.run_dir)
    latencies = []
    deadline = time.monotonic() + 30
    while mps_dirs.commands().count("get_server_list") < 3:  # the start's probe + two health checks
        assert time.monotonic() < deadline, "no health checks reached the daemon"
        accounted = len(latencies) + 1
        hook.bubble(0.002)
        t0 = time.monotonic()
        wait_for(lambda n=accounted: len(h.agent.stats()["bubbles"]) == n, 5, "bubble accounted")
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)
    assert len(latencies) >= 10
    assert max(latencies) < 0.6, f"the loop stalled: {max(latencies) * 1e3:.0f} ms to account a bubble"
