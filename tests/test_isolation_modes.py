"""Isolation on the node: the modes and what they decide before any daemon runs.

Devices and their assignment, the GPUs' compute modes, the MPS client environment, the configuration's bad values,
failing closed unless unisolated is allowed; then the real agent in contexts mode (an exclusive GPU refused, a fill
job kept off MPS), in mode none, and a GPU fill job without a memory limit. ``nvidia-smi`` is the stand-in in
tests/fakes (see tests/test_isolation_mps.py for the MPS daemon, tests/test_isolation_agent.py for the agent on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.agent import MIB, TRAINING, Hook, StartAgent, cycle, environ, start_agent, wait_for
from helpers.isolation import FAKE_MPS, FAKE_SMI, MpsDirs, fill_pid, mps_dirs, mps_isolation, sleeper

from bubbles.agent.isolation import (
    READY,
    UNAVAILABLE,
    UNISOLATED,
    ContextsIsolation,
    GpuModeCheck,
    IsolationConfig,
    IsolationStatus,
    NoIsolation,
    compute_mode_problem,
    effective_status,
    make_isolation,
    parse_compute_modes,
)
from bubbles.agent.launcher import assign_device, default_device, parse_devices
from bubbles.agent.server import Agent, AgentConfig
from bubbles.core import wire
from bubbles.core.api import parse_spec

__all__ = ["mps_dirs", "start_agent"]  # the fixtures, from helpers.isolation and helpers.agent


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
    assert exclusive is not None
    assert "GPU 1 is in EXCLUSIVE_PROCESS" in exclusive
    assert "--isolation mps" in exclusive
    assert compute_mode_problem(modes, [1], allow_exclusive=True) is None  # MPS is made for exclusive GPUs
    prohibited = compute_mode_problem(modes, [2], allow_exclusive=True)
    assert prohibited is not None
    assert "PROHIBITED" in prohibited
    assert "nvidia-smi -i 2 -c DEFAULT" in prohibited
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
    assert allowed.state == UNISOLATED
    assert allowed.usable
    assert "WITHOUT isolation" in allowed.detail
    ready = IsolationStatus("mps", READY, "ok")
    assert effective_status(ready, allow_unisolated=True) is ready


# -- the agent in contexts mode and mode none (real agent, real fill processes) ------------------------
def test_contexts_mode_refuses_an_exclusive_process_gpu(start_agent: StartAgent, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_SMI_GPUS", "0=Default,1=Exclusive_Process")
    h = start_agent([sleeper()], devices=("cuda:1",),
                    isolation=IsolationConfig(mode="contexts", nvidia_smi=FAKE_SMI, check_interval_s=0.05))
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    held = wait_for(lambda: (j := h.job("cmd"))["reason"].startswith("waiting for isolation") and j)
    assert "GPU 1 is in EXCLUSIVE_PROCESS compute mode" in held["reason"]
    assert "--isolation mps" in held["reason"]
    iso = h.agent.stats()["isolation"]
    assert iso["mode"] == "contexts"
    assert iso["state"] == "unavailable"
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
    assert private == h.run_dir / "_local" / TRAINING / "no-mps"
    assert private.is_dir()
    assert not list(private.iterdir())
    assert private.stat().st_mode & 0o777 == 0o700


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
    assert iso["mode"] == "none"
    assert iso["state"] == "unisolated"
    assert iso["daemon"] is None
    Hook(h.run_dir).send(wire.encode_profile(0, cycle()))
    h.wait_state("cmd", "PAUSED")
    assert h.job("cmd")["isolation"] == "unisolated"
