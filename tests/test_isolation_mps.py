"""Isolation on the node: the MPS control daemon's management, through the stand-in for ``nvidia-cuda-mps-control``
in tests/fakes (its real command line: the agent runs it exactly as it would run NVIDIA's program on a GPU node).

Started, owned and quit, or used and left running; lost and restarted, or waited for; external daemons never
touched; silent daemons with live servers not killed; retries with backoff; fill processes and the training
verified as clients of its server; hung daemons timed out. The real daemon, on a GPU node, is marked ``gpu``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.agent import wait_for
from helpers.isolation import MpsDirs, mps_dirs, mps_isolation, zombie

from bubbles.agent import mps
from bubbles.agent.isolation import (
    READY,
    RECOVERING,
    UNAVAILABLE,
    ContextsIsolation,
    GpuModeCheck,
    IsolationConfig,
    make_isolation,
)

__all__ = ["mps_dirs"]  # the fixture, from helpers.isolation


# -- the MPS control daemon (the stand-in, through its command line) ------------------------------------
def test_no_daemon_running_the_agent_starts_one_owns_it_and_quits_it(mps_dirs: MpsDirs) -> None:
    iso = mps_isolation(mps_dirs)
    status = iso.start()
    assert status.state == READY, status.detail
    assert status.daemon is not None
    assert status.daemon.owned
    assert status.daemon.restarts == 0
    pid = mps_dirs.pid()
    assert status.daemon.pid == pid
    assert pid is not None
    assert "Starting control daemon" in (mps_dirs.log / "control.log").read_text()
    # detect (no daemon: nothing received) -> start (-d, then polled until it answers) -> the daemon's defaults
    assert mps_dirs.commands() == ["get_server_list", "get_default_active_thread_percentage"]
    assert mps_dirs.alive()
    iso.close()
    assert mps_dirs.commands()[-1] == "quit"
    assert not mps_dirs.alive()
    assert mps_dirs.pid() is None


def test_a_running_daemon_is_used_and_left_running(mps_dirs: MpsDirs) -> None:
    assert mps_dirs.run("-d").returncode == 0  # e.g. the NVIDIA device plugin's daemon
    external = mps_dirs.pid()
    iso = mps_isolation(mps_dirs)
    status = iso.start()
    assert status.state == READY
    assert status.daemon is not None
    assert not status.daemon.owned
    assert status.daemon.pid == external
    assert "not started by this agent" in status.detail
    iso.close()
    assert mps_dirs.commands() == ["get_server_list", "get_default_active_thread_percentage"]  # no quit
    assert mps_dirs.alive()
    assert mps_dirs.pid() == external
    assert (mps_dirs.log / "control.log").read_text().count("Starting control daemon") == 1


def test_a_lost_daemon_is_restarted_and_counted(mps_dirs: MpsDirs) -> None:
    iso = mps_isolation(mps_dirs)
    first = iso.start()
    old = mps_dirs.kill()
    lost = iso.check()
    assert lost.state == RECOVERING
    assert f"(pid {old}) stopped answering" in lost.detail
    assert "Cannot find MPS control daemon process" in lost.detail
    back = iso.check()  # the agent has seen the loss: now restart
    assert back.state == READY
    assert back.daemon is not None
    assert back.daemon.owned
    assert back.daemon.restarts == 1
    assert back.daemon.pid not in (None, old)
    assert back.epoch == first.epoch + 1  # fill jobs launched before the loss belong to a lost epoch
    assert iso.check().epoch == back.epoch  # a healthy check changes nothing
    iso.close()


def test_a_lost_daemon_that_is_not_ours_is_waited_for(mps_dirs: MpsDirs) -> None:
    mps_dirs.run("-d")
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    mps_dirs.kill()
    assert iso.check().state == RECOVERING
    waiting = iso.check()
    assert waiting.state == RECOVERING
    assert "waiting for its owner" in waiting.detail
    assert mps_dirs.pid() is None or not mps_dirs.alive()  # the agent did not start one of its own
    mps_dirs.run("-d")  # its owner restarts it
    back = iso.check()
    assert back.state == READY
    assert back.daemon is not None
    assert not back.daemon.owned


def test_an_external_daemon_is_never_started_stopped_or_killed_by_the_agent(mps_dirs: MpsDirs) -> None:
    """--mps-daemon external (the chart's mps-daemon DaemonSet runs it): fill jobs wait while none answers, and the
    agent uses the one that comes, leaves it at close, and waits for it when it goes."""
    iso = mps_isolation(mps_dirs, mps_daemon="external")
    status = iso.start()
    assert status.state == UNAVAILABLE
    assert "--mps-daemon external" in status.detail
    assert "mps-daemon" in status.detail
    assert iso.check().state == UNAVAILABLE
    assert mps_dirs.pid() is None  # none started, however often it looks
    assert mps_dirs.run("-d").returncode == 0  # its own Pod starts it
    ready = iso.check()
    assert ready.state == READY
    assert ready.daemon is not None
    assert not ready.daemon.owned
    mps_dirs.kill()
    assert iso.check().state == RECOVERING
    assert "waiting for its owner" in iso.check().detail
    assert not mps_dirs.alive()
    mps_dirs.run("-d")
    assert iso.check().state == READY
    iso.close()
    assert "quit" not in mps_dirs.commands()
    assert mps_dirs.alive()
    assert (mps_dirs.log / "control.log").read_text().count("Starting control daemon") == 2  # both by its owner


def test_a_silent_owned_daemon_whose_servers_live_is_not_killed(mps_dirs: MpsDirs,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that does not answer may be slow rather than hung (a server starting for a new client): killing it
    would take its servers, and the training on them, down. With a server alive it is waited for; without one it is
    replaced as before."""
    monkeypatch.setenv("FAKE_MPS_REAL_SERVERS", "1")
    now = [100.0]
    iso = mps_isolation(mps_dirs, clock=lambda: now[0], command_timeout_s=5.0)
    assert iso.start().state == READY
    assert iso.owned
    iso.control.run("start_server -uid 0")
    daemon, server = mps_dirs.pid(), mps_dirs.server_pid()
    assert daemon is not None
    assert iso.control.servers_alive(daemon) == [server]
    # A timeout short only while the daemon cannot answer (6x the stand-in's start-up on a loaded 2-core machine).
    answering, short = iso.control, dataclasses.replace(iso.control, timeout_s=1.0)
    iso.control = short
    os.kill(daemon, signal.SIGSTOP)  # silent, not gone
    try:
        assert iso.check().state == RECOVERING
        held = iso.check()
        assert held.state == RECOVERING
        assert "is not killed" in held.detail
        assert str(server) in held.detail
        now[0] += 60
        assert iso.check().state == RECOVERING
        assert not zombie(daemon)
        assert Path(f"/proc/{server}").exists()
    finally:
        os.kill(daemon, signal.SIGCONT)
        iso.control = answering  # the calls queued while it was stopped are answered first: no race with them
    back = iso.check()
    assert back.state == READY
    assert back.daemon is not None
    assert back.daemon.pid == daemon
    assert back.daemon.restarts == 0
    # Without a live server, a silent daemon is replaced.
    os.kill(server, signal.SIGKILL)
    wait_for(lambda: iso.control.servers_alive(daemon) == [], 5, "the server gone")
    iso.control = short
    os.kill(daemon, signal.SIGSTOP)
    assert iso.check().state == RECOVERING
    now[0] += 60
    replaced = iso.check()
    assert replaced.state == READY
    assert replaced.daemon is not None
    assert replaced.daemon.restarts == 1
    assert replaced.daemon.pid != daemon
    iso.close()


def test_the_daemon_the_agent_starts_does_not_inherit_cuda_visible_devices(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA_VISIBLE_DEVICES the MPS server renumbers the GPUs, and a client keeping the variable applies it a
    second time: the daemon must see the node's numbering."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    pid = mps_dirs.pid()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(e.startswith(b"CUDA_VISIBLE_DEVICES=") for e in environ)
    assert f"CUDA_MPS_PIPE_DIRECTORY={mps_dirs.pipe}".encode() in environ
    iso.close()


def test_a_daemon_that_refuses_to_start_is_retried_with_backoff(mps_dirs: MpsDirs,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setenv("FAKE_MPS_FAIL_START", "MPS is not supported on this GPU")
    iso = mps_isolation(mps_dirs, clock=lambda: now[0])
    status = iso.start()
    assert status.state == UNAVAILABLE
    assert "MPS is not supported on this GPU" in status.detail
    assert "attempt 1" in status.detail
    assert "retrying in 0.5 s" in status.detail
    assert "attempt 1" in iso.check().detail  # before the backoff has passed: no new attempt
    now[0] += 0.5
    second = iso.check()
    assert "attempt 2" in second.detail
    assert "retrying in 1 s" in second.detail
    monkeypatch.delenv("FAKE_MPS_FAIL_START")
    now[0] += 1.0
    status = iso.check()
    assert status.state == READY
    assert status.daemon is not None
    assert status.daemon.owned
    assert status.daemon.restarts == 0  # its first start, not a restart
    iso.close()


def test_closing_leaves_an_owned_daemon_running_while_a_live_client_uses_it(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopping the agent must not take MPS away from a live training: ``quit`` would make the daemon refuse new
    clients, and killing a daemon that does not quit would take its servers down with it."""
    monkeypatch.setenv("FAKE_MPS_CLIENTS", str(os.getpid()))  # this process stands for the training
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    iso.control.run("start_server -uid 0")  # the server the training's CUDA context joined
    assert iso.control.clients() == {mps_dirs.server_pid(): [os.getpid()]}
    iso.close()
    assert "quit" not in mps_dirs.commands()
    assert mps_dirs.alive()
    status = iso.status()
    assert status.state == UNAVAILABLE
    assert f"left running for its clients (pids {os.getpid()})" in status.detail


def test_a_fill_process_is_verified_as_a_client_of_the_daemons_server_or_refused_with_what_to_fix(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    member = os.getpid()  # the fill process the server lists (the stand-in lists FAKE_MPS_CLIENTS)
    monkeypatch.setenv("FAKE_MPS_CLIENTS", str(member))
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    assert iso.owned
    iso.control.run("start_server -uid 0")
    assert iso.verify_client(member, "cuda:0") is None
    problem = iso.verify_client(member + 1, "cuda:0")
    assert problem is not None and f"process {member + 1} is not a client of the MPS server in {mps_dirs.pipe}" \
        in problem and f"{member}" in problem and "--fill-mps-pipe-dir" in problem
    assert iso.verify_client(member + 1, "cpu") is None  # nothing to join on a CPU device
    iso.close()  # leaves the daemon running: its "client" (this process) is alive
    mps_dirs.kill()  # and waits until it is gone
    with pytest.raises(mps.MpsError):  # no daemon answers: the check cannot be made (the agent tries the job again)
        iso.verify_client(member, "cuda:0")


def test_the_trainings_process_is_told_a_client_or_not_with_what_to_do(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    training = os.getpid()  # the stand-in's server lists FAKE_MPS_CLIENTS
    monkeypatch.setenv("FAKE_MPS_CLIENTS", str(training))
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    assert iso.owned
    iso.control.run("start_server -uid 0")
    assert iso.training_membership(training, "cuda:0") == "client"
    answer = iso.training_membership(training + 1, "cuda:0")
    assert answer is not None and answer.startswith(f"not a client: the training's process {training + 1} is not a "
                                                    f"client of the MPS server in {mps_dirs.pipe}")
    assert "time-slices" in answer
    assert "agent.mps.shmDir" in answer
    assert answer.endswith(f"The daemon lists: server {mps_dirs.server_pid()}: {training}")  # the list last
    assert iso.training_membership(training + 1, "cpu") is None  # nothing to join on a CPU device
    pid_file = mps_dirs.pipe / mps.PID_FILE
    daemon = mps_dirs.pid()
    other = subprocess.Popen(["sleep", "30"])
    try:  # a daemon of another PID namespace lists PIDs this agent cannot compare: nothing to tell, either way
        pid_file.write_text(f"{other.pid}\n")
        assert iso.training_membership(training + 1, "cuda:0") is None
        assert iso.training_membership(training, "cuda:0") is None  # a number it lists may be another process
    finally:
        other.kill()
        other.wait()
        pid_file.write_text(f"{daemon}\n")
    socket_path = mps_dirs.pipe / "control"
    socket_path.rename(mps_dirs.pipe / "control.away")
    try:  # the daemon is ours and alive but does not answer: the check cannot be made (the agent asks again later)
        with pytest.raises(mps.MpsError):
            iso.training_membership(training, "cuda:0")
    finally:
        (mps_dirs.pipe / "control.away").rename(socket_path)
    iso.close()
    mps_dirs.cleanup()
    assert daemon is not None
    deadline = time.monotonic() + 10
    while not zombie(daemon) and time.monotonic() < deadline:  # SIGKILL takes effect asynchronously
        time.sleep(0.01)
    assert iso.training_membership(training, "cuda:0") is None  # no daemon any more: nothing to tell
    contexts = ContextsIsolation(mps_dirs.pipe / "none", GpuModeCheck([], None, allow_exclusive=False))
    assert contexts.training_membership(training, "cuda:0") is None  # no shared server in contexts mode


def test_the_daemons_pid_namespace_not_its_owner_decides_whether_a_missing_pid_is_refused(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Several agents may share one daemon (with --mps-daemon own, only the first starts it; external: none): the others
    must refuse a non-member all the same. A daemon in another PID namespace (its pid file names no daemon of ours)
    lists PIDs this agent cannot compare: a missing one is said, not refused."""
    monkeypatch.setenv("FAKE_MPS_CLIENTS", "1")
    assert mps_dirs.run("-d").returncode == 0  # started by someone else (another training's agent)
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    assert not iso.owned
    iso.control.run("start_server -uid 0")
    problem = iso.verify_client(os.getpid(), "cuda:0")
    assert problem is not None
    assert "is not a client of the MPS server" in problem
    daemon = mps_dirs.pid()
    pid_file = mps_dirs.pipe / mps.PID_FILE
    other = subprocess.Popen(["sleep", "30"])  # the pid file's number names no MPS daemon here
    try:
        pid_file.write_text(f"{other.pid}\n")
        with caplog.at_level("WARNING", logger="bubbles.agent.isolation"):
            assert iso.verify_client(os.getpid(), "cuda:0") is None
        assert "does not run in this agent's PID namespace" in caplog.text
    finally:
        other.kill()
        other.wait()
        pid_file.write_text(f"{daemon}\n")


def test_closing_quits_an_owned_daemon_whose_clients_have_all_exited(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setenv("FAKE_MPS_CLIENTS", str(gone.pid))  # listed, but no longer running
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY
    iso.control.run("start_server -uid 0")
    assert iso.live_clients() == []
    iso.close()
    assert mps_dirs.commands()[-1] == "quit"
    assert not mps_dirs.alive()


def test_a_daemon_that_keeps_its_inherited_output_open_still_starts(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """``-d`` forks the daemon; if the daemon keeps the output it inherited, reading that output through a pipe
    to its end waits as long as the daemon lives: the start must not."""
    monkeypatch.setenv("FAKE_MPS_KEEP_STDIO", "1")
    iso = mps_isolation(mps_dirs, command_timeout_s=1.0)
    t0 = time.monotonic()
    status = iso.start()
    assert status.state == READY, status.detail
    assert time.monotonic() - t0 < 4  # not the 5 s start timeout
    iso.close()


def test_a_hung_daemon_times_out_instead_of_blocking(mps_dirs: MpsDirs) -> None:
    mps_dirs.run("-d", FAKE_MPS_REPLY_DELAY_S="5")
    iso = mps_isolation(mps_dirs, command_timeout_s=0.3)
    t0 = time.monotonic()
    status = iso.start()
    assert time.monotonic() - t0 < 4
    assert status.state == UNAVAILABLE
    assert "no answer to get_server_list within 0.3 s" in status.detail or "already running" in status.detail


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None or shutil.which("nvidia-smi") is None,
                    reason="needs an NVIDIA GPU node with the MPS control program")
def test_the_real_mps_control_daemon_is_started_checked_and_quit(tmp_path: Path) -> None:
    pipe = Path(f"/tmp/bubbles-mps-test-{os.getpid()}")
    config = IsolationConfig(mode="mps", mps_pipe_dir=pipe, mps_log_dir=tmp_path / "log")
    iso = make_isolation(config, ["cuda:0"], tmp_path)
    try:
        status = iso.start()
        assert status.state == READY, status.detail
        assert status.daemon is not None
        assert status.daemon.owned
        assert iso.check().state == READY
    finally:
        iso.close()
        shutil.rmtree(pipe, ignore_errors=True)
    assert not (pipe / "control").exists()
