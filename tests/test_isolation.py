"""Isolation on the node: the modes, the MPS control daemon's management, and failing closed.

What cannot run here (a GPU, the NVIDIA driver, the MPS daemon) is replaced by the stand-ins in
tests/fakes, which have the real programs' command lines: the agent runs them exactly as it would run
``nvidia-cuda-mps-control`` and ``nvidia-smi`` on a GPU node. Everything else is real: the agent's
loop and supervisor thread, fill processes (whose environment is read from /proc), the daemon's
process (SIGKILLed to lose it). On the CPU build of torch the MPS variables are simply ignored.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.agent import TRAINING, Harness, Hook, StartAgent, cycle, environ, spec, start_agent, wait_for
from prometheus_client import generate_latest

from bubbles.agent import mps
from bubbles.agent.isolation import (
    READY,
    RECOVERING,
    UNAVAILABLE,
    UNISOLATED,
    ContextsIsolation,
    GpuModeCheck,
    IsolationConfig,
    IsolationStatus,
    MpsIsolation,
    NoIsolation,
    compute_mode_problem,
    effective_status,
    make_isolation,
    parse_compute_modes,
)
from bubbles.agent.launcher import (
    FillProcess,
    Launcher,
    LaunchRequest,
    ProcessLauncher,
    assign_device,
    default_device,
    parse_devices,
)
from bubbles.agent.server import MAX_ISOLATION_RESUBMISSIONS, Agent, AgentConfig
from bubbles.core import wire
from bubbles.core.api import FillState, parse_spec

__all__ = ["start_agent"]  # the fixture, from helpers.agent

FAKES = Path(__file__).parent / "fakes"
FAKE_MPS = str(FAKES / "nvidia-cuda-mps-control")
FAKE_SMI = str(FAKES / "nvidia-smi")
MIB = 2**20


# -- helpers -----------------------------------------------------------------------------------------
class MpsDirs:
    """A pipe and a log directory for one test's daemon; kills any daemon left in them at teardown."""

    def __init__(self, root: Path) -> None:
        self.pipe = root / "p"
        self.log = root / "l"

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)}

    def commands(self) -> list[str]:
        path = self.pipe / "commands.log"
        return path.read_text().splitlines() if path.exists() else []

    def pid(self) -> int | None:
        path = self.pipe / mps.PID_FILE
        return int(path.read_text()) if path.exists() else None

    def run(self, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        """Run the stand-in as an administrator would, on this pipe directory."""
        self.log.mkdir(parents=True, exist_ok=True)
        return subprocess.run([FAKE_MPS, *args], input=stdin, capture_output=True, text=True, timeout=10,
                              env={**os.environ, **self.env(), **env}, check=False)

    def server_pid(self) -> int:
        """The one MPS server the daemon lists."""
        out = self.run(stdin="get_server_list\n").stdout.split()
        assert len(out) == 1, f"expected one server, got {out}"
        return int(out[0])

    def alive(self) -> bool:
        return self.run(stdin="get_server_list\n").returncode == 0

    def kill(self) -> int:
        pid = self.pid()
        assert pid is not None, "no daemon pid file"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 5, "daemon killed")
        return pid

    def cleanup(self) -> None:
        pid = self.pid()
        cmdline = Path(f"/proc/{pid}/cmdline")
        if pid is not None and cmdline.exists() and b"nvidia-cuda-mps-control" in cmdline.read_bytes():
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def mps_dirs(tmp_path: Path) -> Iterator[MpsDirs]:
    dirs = MpsDirs(tmp_path)
    yield dirs
    dirs.cleanup()


def mps_config(dirs: MpsDirs, **kw: Any) -> IsolationConfig:
    fields: dict[str, Any] = {"mode": "mps", "mps_control": FAKE_MPS, "mps_pipe_dir": dirs.pipe,
                              "mps_log_dir": dirs.log, "check_interval_s": 0.05, "nvidia_smi": FAKE_SMI}
    fields.update(kw)
    return IsolationConfig(**fields)


def mps_isolation(dirs: MpsDirs, clock: Any = time.monotonic, **kw: Any) -> MpsIsolation:
    config = mps_config(dirs, **kw)
    return MpsIsolation(config, GpuModeCheck([], None, allow_exclusive=True), dirs.pipe.parent / "fallback",
                        clock=clock)


def fill_pid(h: Harness, index: int = -1, name: str | None = None) -> int:
    jobs = [j for j in h.agent.jobs if name is None or j.name == name]
    proc = h.agent.process(jobs[index])
    assert proc is not None, "fill job has no process"
    return proc.pid


def metrics_text(agent: Agent) -> str:
    return generate_latest(agent.metrics.registry).decode()


def busy(**fields: Any) -> Any:
    """A fill job with a declared step time (no self-profiling, which a loaded machine can stretch)."""
    return spec("busy", "test_agent_jobs:BusyJob", step_time="1ms", **fields)


def sleeper(name: str = "cmd", **fields: Any) -> Any:
    """An imperative command job: starts at once (no torch import), paused and resumed from outside."""
    return parse_spec({"name": name, "interface": "imperative", "command": ["sleep", "30"], "memory": "64Mi", **fields})


MPS_VARS = {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"}


# -- devices -----------------------------------------------------------------------------------------
def test_devices_are_assigned_round_robin_and_cuda_devices_are_not_pinned() -> None:
    assert parse_devices("cuda:0,cuda:1") == ("cuda:0", "cuda:1")
    assert parse_devices(" cpu , cuda:3 ") == ("cpu", "cuda:3")
    devices = ("cuda:0", "cuda:1")
    assert [assign_device(k, devices, pin=True) for k in range(3)] == [("cuda:0", None), ("cuda:1", None),
                                                                       ("cuda:0", None)]
    # A cpu entry (and no list at all) keeps the CPU behaviour: core k stands in for stage k's accelerator.
    assert assign_device(1, ("cuda:0", "cpu"), pin=True) == default_device(1, True)
    assert assign_device(2, (), pin=False) == default_device(2, False)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "comma-separated list"),
        ("cuda:0,,cuda:1", "comma-separated list"),
        ("gpu", "write cuda:0"),
        ("cuda", "write cuda:0"),
        ("cuda:x", "'cuda:x' is neither cpu nor cuda:N"),
        ("cuda:-1", "'cuda:-1' is neither"),
        ("cuda:01", "'cuda:01' is neither"),
        ("tpu:0", "'tpu:0' is neither"),
    ],
)
def test_bad_device_lists_are_rejected_saying_what_to_write(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match="--devices") as err:
        parse_devices(text)
    assert needle in str(err.value)


# -- compute modes, client environments, configuration (pure) -------------------------------------------
def test_compute_modes_decide_which_modes_can_use_a_gpu() -> None:
    modes = parse_compute_modes("0, Default\n1, Exclusive_Process\n2, Prohibited\n")
    assert modes == {0: "DEFAULT", 1: "EXCLUSIVE_PROCESS", 2: "PROHIBITED"}
    assert compute_mode_problem(modes, [0], allow_exclusive=False) is None
    exclusive = compute_mode_problem(modes, [0, 1], allow_exclusive=False)
    assert exclusive is not None and "GPU 1 is in EXCLUSIVE_PROCESS" in exclusive and "--isolation mps" in exclusive
    assert compute_mode_problem(modes, [1], allow_exclusive=True) is None  # MPS is made for exclusive GPUs
    prohibited = compute_mode_problem(modes, [2], allow_exclusive=True)
    assert prohibited is not None and "PROHIBITED" in prohibited and "nvidia-smi -i 2 -c DEFAULT" in prohibited
    missing = compute_mode_problem(modes, [5], allow_exclusive=True)
    assert missing == "no GPU with index 5 (nvidia-smi lists 0, 1, 2); fix --devices"
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_compute_modes("0 Default\n")
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_compute_modes("zero, Default\n")


def test_mps_client_environment_for_a_specs_memory(mps_dirs: MpsDirs) -> None:
    iso = mps_isolation(mps_dirs, mps_thread_percentage=30)
    gpu = iso.client_env("cuda:1", parse_spec({"name": "j", "entry": "a:B", "memory": "2Gi"}).memory_bytes)
    assert gpu == {"CUDA_MPS_PIPE_DIRECTORY": str(mps_dirs.pipe), "CUDA_MPS_LOG_DIRECTORY": str(mps_dirs.log),
                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_CLIENT_PRIORITY": "1",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=2048M"}
    # Rounded down to whole MiB (a hard limit never exceeds the spec), at least 1M; no GPU limit on a CPU device.
    assert iso.client_env("cuda:0", 3 * MIB // 2)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1M"
    assert iso.client_env("cuda:0", 100)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1M"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in iso.client_env("cpu:0", 0)
    with pytest.raises(ValueError, match="needs memory > 0"):
        iso.client_env("cuda:0", 0)
    contexts = ContextsIsolation(mps_dirs.pipe.parent / "private", GpuModeCheck([], None, allow_exclusive=False))
    assert contexts.client_env("cuda:0", 2**30) == {"CUDA_MPS_PIPE_DIRECTORY": str(mps_dirs.pipe.parent / "private")}
    assert NoIsolation().client_env("cuda:0", 2**30) == {}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"mode": "sometimes"}, "isolation mode must be one of contexts, mps, none"),
        ({"mps_thread_percentage": 0}, "must be 1..100"),
        ({"mps_thread_percentage": 101}, "must be 1..100"),
        ({"check_interval_s": 0}, "check interval must be > 0"),
        ({"command_timeout_s": -1}, "command timeout must be > 0"),
    ],
)
def test_isolation_config_rejects_bad_values(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        IsolationConfig(**fields)


def test_a_pipe_directory_too_long_for_a_unix_socket_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose a shorter --mps-pipe-dir"):
        make_isolation(IsolationConfig(mode="mps", mps_control=FAKE_MPS, mps_pipe_dir=tmp_path / ("x" * 120),
                                       mps_log_dir=tmp_path), ["cpu:0"], tmp_path)


def test_effective_status_fails_closed_unless_unisolated_is_allowed() -> None:
    broken = IsolationStatus("mps", UNAVAILABLE, "no daemon")
    assert effective_status(broken, allow_unisolated=False) is broken
    allowed = effective_status(broken, allow_unisolated=True)
    assert allowed.state == UNISOLATED and allowed.usable and "WITHOUT isolation" in allowed.detail
    ready = IsolationStatus("mps", READY, "ok")
    assert effective_status(ready, allow_unisolated=True) is ready


# -- the MPS control daemon (the stand-in, through its command line) ------------------------------------
def test_no_daemon_running_the_agent_starts_one_owns_it_and_quits_it(mps_dirs: MpsDirs) -> None:
    iso = mps_isolation(mps_dirs)
    status = iso.start()
    assert status.state == READY, status.detail
    assert status.daemon is not None and status.daemon.owned and status.daemon.restarts == 0
    pid = mps_dirs.pid()
    assert status.daemon.pid == pid and pid is not None
    assert "Starting control daemon" in (mps_dirs.log / "control.log").read_text()
    # detect (no daemon: nothing received) -> start (-d, then polled until it answers) -> the daemon's defaults
    assert mps_dirs.commands() == ["get_server_list", "get_default_active_thread_percentage"]
    assert mps_dirs.alive()
    iso.close()
    assert mps_dirs.commands()[-1] == "quit"
    assert not mps_dirs.alive() and mps_dirs.pid() is None


def test_a_running_daemon_is_used_and_left_running(mps_dirs: MpsDirs) -> None:
    assert mps_dirs.run("-d").returncode == 0  # e.g. the NVIDIA device plugin's daemon
    external = mps_dirs.pid()
    iso = mps_isolation(mps_dirs)
    status = iso.start()
    assert status.state == READY and status.daemon is not None
    assert not status.daemon.owned and status.daemon.pid == external
    assert "not started by this agent" in status.detail
    iso.close()
    assert mps_dirs.commands() == ["get_server_list", "get_default_active_thread_percentage"]  # no quit
    assert mps_dirs.alive() and mps_dirs.pid() == external
    assert (mps_dirs.log / "control.log").read_text().count("Starting control daemon") == 1


def test_a_lost_daemon_is_restarted_and_counted(mps_dirs: MpsDirs) -> None:
    iso = mps_isolation(mps_dirs)
    first = iso.start()
    old = mps_dirs.kill()
    lost = iso.check()
    assert lost.state == RECOVERING and f"(pid {old}) stopped answering" in lost.detail
    assert "Cannot find MPS control daemon process" in lost.detail
    back = iso.check()  # the agent has seen the loss: now restart
    assert back.state == READY and back.daemon is not None
    assert back.daemon.owned and back.daemon.restarts == 1 and back.daemon.pid not in (None, old)
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
    assert waiting.state == RECOVERING and "waiting for its owner" in waiting.detail
    assert mps_dirs.pid() is None or not mps_dirs.alive()  # the agent did not start one of its own
    mps_dirs.run("-d")  # its owner restarts it
    back = iso.check()
    assert back.state == READY and back.daemon is not None and not back.daemon.owned


def test_an_external_daemon_is_never_started_stopped_or_killed_by_the_agent(mps_dirs: MpsDirs) -> None:
    """--mps-daemon external (the chart's mps-daemon DaemonSet runs it): fill jobs wait while none answers, and the
    agent uses the one that comes, leaves it at close, and waits for it when it goes."""
    iso = mps_isolation(mps_dirs, mps_daemon="external")
    status = iso.start()
    assert status.state == UNAVAILABLE and "--mps-daemon external" in status.detail and "mps-daemon" in status.detail
    assert iso.check().state == UNAVAILABLE and mps_dirs.pid() is None  # none started, however often it looks
    assert mps_dirs.run("-d").returncode == 0  # its own Pod starts it
    ready = iso.check()
    assert ready.state == READY and ready.daemon is not None and not ready.daemon.owned
    mps_dirs.kill()
    assert iso.check().state == RECOVERING
    assert "waiting for its owner" in iso.check().detail and not mps_dirs.alive()
    mps_dirs.run("-d")
    assert iso.check().state == READY
    iso.close()
    assert "quit" not in mps_dirs.commands() and mps_dirs.alive()
    assert (mps_dirs.log / "control.log").read_text().count("Starting control daemon") == 2  # both by its owner


def test_a_silent_owned_daemon_whose_servers_live_is_not_killed(mps_dirs: MpsDirs,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that does not answer may be slow rather than hung (a server starting for a new client): killing it
    would take its servers, and the training on them, down. With a server alive it is waited for; without one it is
    replaced as before."""
    monkeypatch.setenv("FAKE_MPS_REAL_SERVERS", "1")
    now = [100.0]
    iso = mps_isolation(mps_dirs, clock=lambda: now[0], command_timeout_s=5.0)
    assert iso.start().state == READY and iso.owned
    iso.control.run("start_server -uid 0")
    daemon, server = mps_dirs.pid(), mps_dirs.server_pid()
    assert daemon is not None and iso.control.servers_alive(daemon) == [server]
    # A timeout short only while the daemon cannot answer (6x the stand-in's start-up on a loaded 2-core machine).
    answering, short = iso.control, dataclasses.replace(iso.control, timeout_s=1.0)
    iso.control = short
    os.kill(daemon, signal.SIGSTOP)  # silent, not gone
    try:
        assert iso.check().state == RECOVERING
        held = iso.check()
        assert held.state == RECOVERING and "is not killed" in held.detail and str(server) in held.detail
        now[0] += 60
        assert iso.check().state == RECOVERING and not _zombie(daemon) and Path(f"/proc/{server}").exists()
    finally:
        os.kill(daemon, signal.SIGCONT)
        iso.control = answering  # the calls queued while it was stopped are answered first: no race with them
    back = iso.check()
    assert back.state == READY and back.daemon is not None and back.daemon.pid == daemon and back.daemon.restarts == 0
    # Without a live server, a silent daemon is replaced.
    os.kill(server, signal.SIGKILL)
    wait_for(lambda: iso.control.servers_alive(daemon) == [], 5, "the server gone")
    iso.control = short
    os.kill(daemon, signal.SIGSTOP)
    assert iso.check().state == RECOVERING
    now[0] += 60
    replaced = iso.check()
    assert replaced.state == READY and replaced.daemon is not None and replaced.daemon.restarts == 1
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
    assert "MPS is not supported on this GPU" in status.detail and "attempt 1" in status.detail
    assert "retrying in 0.5 s" in status.detail
    assert "attempt 1" in iso.check().detail  # before the backoff has passed: no new attempt
    now[0] += 0.5
    second = iso.check()
    assert "attempt 2" in second.detail and "retrying in 1 s" in second.detail
    monkeypatch.delenv("FAKE_MPS_FAIL_START")
    now[0] += 1.0
    status = iso.check()
    assert status.state == READY and status.daemon is not None
    assert status.daemon.owned and status.daemon.restarts == 0  # its first start, not a restart
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
    assert status.state == UNAVAILABLE and f"left running for its clients (pids {os.getpid()})" in status.detail


def test_a_fill_process_is_verified_as_a_client_of_the_daemons_server_or_refused_with_what_to_fix(
        mps_dirs: MpsDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    member = os.getpid()  # the fill process the server lists (the stand-in lists FAKE_MPS_CLIENTS)
    monkeypatch.setenv("FAKE_MPS_CLIENTS", str(member))
    iso = mps_isolation(mps_dirs)
    assert iso.start().state == READY and iso.owned
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
    assert iso.start().state == READY and iso.owned
    iso.control.run("start_server -uid 0")
    assert iso.training_membership(training, "cuda:0") == "client"
    answer = iso.training_membership(training + 1, "cuda:0")
    assert answer is not None and answer.startswith(f"not a client: the training's process {training + 1} is not a "
                                                    f"client of the MPS server in {mps_dirs.pipe}")
    assert "time-slices" in answer and "agent.mps.shmDir" in answer
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
    while not _zombie(daemon) and time.monotonic() < deadline:  # SIGKILL takes effect asynchronously
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
    assert iso.start().state == READY and not iso.owned
    iso.control.run("start_server -uid 0")
    problem = iso.verify_client(os.getpid(), "cuda:0")
    assert problem is not None and "is not a client of the MPS server" in problem
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
    assert mps_dirs.commands()[-1] == "quit" and not mps_dirs.alive()


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


# -- the agent: fail closed, recovery, environments (real agent, real fill processes) -------------------
def test_mps_clients_get_the_mps_environment_and_an_owned_daemon_is_quit(
        mps_dirs: MpsDirs, start_agent: StartAgent) -> None:
    command_job = sleeper("gpu-cmd", memory="512Mi", stage=1)
    h = start_agent([sleeper("cpu-cmd", stage=0), command_job],
                    executors=2, devices=("cpu", "cuda:0"), isolation=mps_config(mps_dirs))
    iso = h.agent.stats()["isolation"]
    assert iso["mode"] == "mps" and iso["state"] == "ready", iso
    assert iso["daemon"]["owned"] and iso["daemon"]["pipe_dir"] == str(mps_dirs.pipe)
    for stage in (0, 1):
        Hook(h.run_dir, stage).send(wire.encode_profile(stage, cycle(stage)))
    h.wait_state("cpu-cmd", "PAUSED")
    h.wait_state("gpu-cmd", "PAUSED")
    cpu_env = environ(fill_pid(h, name="cpu-cmd"))
    assert {k: cpu_env[k] for k in MPS_VARS if k in cpu_env} == {
        "CUDA_MPS_PIPE_DIRECTORY": str(mps_dirs.pipe), "CUDA_MPS_LOG_DIRECTORY": str(mps_dirs.log),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_CLIENT_PRIORITY": "1"}
    gpu_env = environ(fill_pid(h, name="gpu-cmd"))
    assert gpu_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=512M" and gpu_env["BUBBLES_DEVICE"] == "cuda:0"
    assert "BUBBLES_CPU_CORE" not in gpu_env  # a GPU stage's fill job is not pinned to a core
    assert [j["isolation"] for j in h.agent.stats()["jobs"]] == ["mps", "mps"]
    daemon_pid = mps_dirs.pid()
    h.agent.request_stop()
    h.thread.join(10)
    assert mps_dirs.commands()[-1] == "quit" and not mps_dirs.alive()
    assert daemon_pid is not None and (not Path(f"/proc/{daemon_pid}").exists() or _zombie(daemon_pid))


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
        joins: bool, mps_dirs: MpsDirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_CLIENTS_FROM_ENV", "1")  # the stand-in lists the processes on its pipe directory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cfg = AgentConfig(run_dir=tmp_path / "run", training=TRAINING, pin_cores=False, devices=("cuda:0",),
                      isolation=mps_config(mps_dirs))
    h = Harness(Agent(cfg, [busy(memory="64Mi")], launcher=CpuStandIn(joins)), tmp_path / "run")
    h.agent.start()
    h.thread.start()
    try:
        Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
        job = h.agent.jobs[0]
        if joins:
            wait_for(lambda: job.armed is not None, what="the verified job armed")
            assert job.verification == "verified" and job.state is not FillState.STOPPED
            assert any(e["kind"] == "isolation" and "verified" in e["message"] for e in h.agent.core.events)
        else:
            stopped = h.wait_state("busy", "STOPPED")
            assert stopped["reason"].startswith("isolation not verified: process ")
            assert "is not a client of the MPS server" in stopped["reason"] and job.armed is None
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
    assert again.name == "busy" and again.resubmission == 1 and again.isolation == "mps"
    stats = h.agent.stats()
    assert stats["isolation"]["state"] == "ready" and stats["isolation_losses"] == 1
    daemon = stats["isolation"]["daemon"]
    assert daemon["owned"] and daemon["restarts"] == 1 and daemon["pid"] == mps_dirs.pid() != old
    kinds = [(e["kind"], e["message"].split(":")[0]) for e in stats["events"] if e["kind"] in ("isolation", "resubmit")]
    assert kinds == [("isolation", "ready"), ("isolation", "recovering"), ("resubmit", "resubmitted after isolation "
                                                                                       "loss (1/3)"),
                     ("isolation", "ready")]
    text = metrics_text(h.agent)
    assert 'bubbles_mps_daemon_restarts_total{training="t"} 1.0' in text
    assert 'bubbles_isolation_losses_total{mode="mps",training="t"} 1.0' in text
    assert 'bubbles_isolation_ready{mode="mps",training="t"} 1.0' in text
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
    assert len(jobs) == MAX_ISOLATION_RESUBMISSIONS + 1 and all(j["state"] == "STOPPED" for j in jobs)
    assert [j["resubmission"] for j in jobs] == [0, 1, 2, 3]
    assert jobs[-1]["reason"].endswith("(not resubmitted: already restarted 3 times after isolation losses)")


def test_without_the_control_program_no_fill_process_starts(mps_dirs: MpsDirs, start_agent: StartAgent,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(Path(shutil.which("sleep") or "/bin/sleep").parent))
    h = start_agent([busy()], isolation=mps_config(mps_dirs, mps_control=None))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    waiting = wait_for(lambda: (j := h.job("busy"))["reason"].startswith("waiting for isolation") and j,
                       what="job held back")
    assert waiting["state"] == "SUBMITTED" and "nvidia-cuda-mps-control not found on PATH" in waiting["reason"]
    assert "--mps-control" in waiting["reason"]
    time.sleep(0.3)  # several supervisor checks later: still nothing launched
    assert h.agent.process(h.agent.jobs[0]) is None and h.job("busy")["state"] == "SUBMITTED"
    iso = h.agent.stats()["isolation"]
    assert iso["state"] == "unavailable" and iso["daemon"] is None
    assert 'bubbles_isolation_ready{mode="mps",training="t"} 0.0' in metrics_text(h.agent)
    assert 'bubbles_isolation_state{mode="mps",state="unavailable",training="t"} 1.0' in metrics_text(h.agent)


@pytest.mark.parametrize("allow_unisolated", [False, True])
def test_a_daemon_that_will_not_start_holds_jobs_back_unless_unisolated_is_allowed(
        mps_dirs: MpsDirs, start_agent: StartAgent, monkeypatch: pytest.MonkeyPatch, allow_unisolated: bool) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL_START", "no CUDA-capable device is detected")
    h = start_agent([busy()],
                    isolation=mps_config(mps_dirs, allow_unisolated=allow_unisolated))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    if not allow_unisolated:
        job = wait_for(lambda: (j := h.job("busy"))["reason"].startswith("waiting for isolation") and j)
        assert "no CUDA-capable device is detected" in job["reason"] and job["state"] == "SUBMITTED"
        assert h.agent.stats()["isolation"]["state"] == "unavailable"
        time.sleep(0.3)
        assert h.agent.process(h.agent.jobs[0]) is None
        return
    h.wait_state("busy", "PAUSED")
    iso = h.agent.stats()["isolation"]
    assert iso["state"] == "unisolated" and "WITHOUT isolation" in iso["detail"]
    assert "no CUDA-capable device is detected" in iso["detail"]
    assert h.job("busy")["isolation"] == "unisolated"
    env = environ(fill_pid(h))
    assert not {"CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"} & set(env)
    assert 'bubbles_isolation_state{mode="mps",state="unisolated",training="t"} 1.0' in metrics_text(h.agent)


def test_contexts_mode_refuses_an_exclusive_process_gpu(start_agent: StartAgent, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_GPUS", "0=Default,1=Exclusive_Process")
    h = start_agent([sleeper()], devices=("cuda:1",),
                    isolation=IsolationConfig(mode="contexts", nvidia_smi=FAKE_SMI, check_interval_s=0.05))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    held = wait_for(lambda: (j := h.job("cmd"))["reason"].startswith("waiting for isolation") and j)
    assert "GPU 1 is in EXCLUSIVE_PROCESS compute mode" in held["reason"] and "--isolation mps" in held["reason"]
    iso = h.agent.stats()["isolation"]
    assert iso["mode"] == "contexts" and iso["state"] == "unavailable"
    assert h.agent.process(h.agent.jobs[0]) is None


def test_contexts_mode_keeps_a_gpu_fill_job_off_mps(start_agent: StartAgent, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "node-mps"))  # a daemon the node runs
    h = start_agent([sleeper()], devices=("cuda:0",), isolation=IsolationConfig(nvidia_smi=FAKE_SMI))
    iso = h.agent.stats()["isolation"]
    assert iso == {"mode": "contexts", "state": "ready", "daemon": None,
                   "detail": "separate CUDA contexts on cuda:0, kept off MPS (compute mode GPU 0: DEFAULT)"}
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    h.wait_state("cmd", "PAUSED")
    private = Path(environ(fill_pid(h))["CUDA_MPS_PIPE_DIRECTORY"])
    assert private == h.run_dir / TRAINING / "no-mps"
    assert private.is_dir() and not list(private.iterdir()) and private.stat().st_mode & 0o777 == 0o700


def test_a_gpu_fill_job_must_declare_memory(tmp_path: Path) -> None:
    config = AgentConfig(run_dir=tmp_path, training=TRAINING, devices=("cuda:0",),
                         isolation=IsolationConfig(mode="none"))
    no_memory = parse_spec({"name": "greedy", "entry": "test_agent_jobs:BusyJob"})
    with pytest.raises(ValueError, match=r"'greedy' would run on cuda:0 but declares no memory limit") as err:
        Agent(config, [no_memory])
    assert "memory: 2Gi" in str(err.value)
    # On a CPU device memory is optional (there is no accelerator memory to protect).
    cpu = Agent(AgentConfig(run_dir=tmp_path, training=TRAINING, isolation=IsolationConfig(mode="none")),
                [no_memory])
    assert cpu.jobs[0].state == "SUBMITTED"


def test_mode_none_runs_jobs_and_says_unisolated(start_agent: StartAgent) -> None:
    h = start_agent([sleeper()], isolation=IsolationConfig(mode="none"))
    iso = h.agent.stats()["isolation"]
    assert iso["mode"] == "none" and iso["state"] == "unisolated" and iso["daemon"] is None
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    h.wait_state("cmd", "PAUSED")
    assert h.job("cmd")["isolation"] == "unisolated"


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
        assert status.daemon is not None and status.daemon.owned
        assert iso.check().state == READY
    finally:
        iso.close()
        shutil.rmtree(pipe, ignore_errors=True)
    assert not (pipe / "control").exists()
