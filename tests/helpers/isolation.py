"""Set-ups of the isolation tests (tests/test_isolation_*.py): the stand-ins for NVIDIA's programs in tests/fakes,
one test's MPS pipe and log directories (the ``mps_dirs`` fixture), an MPS configuration and isolation on them,
a fill process's pid, and a command fill job."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bubbles.agent import mps
from bubbles.agent.isolation import GpuModeCheck, IsolationConfig, MpsIsolation
from bubbles.core.api import parse_spec
from helpers.agent import Harness, wait_for

FAKES = Path(__file__).resolve().parent.parent / "fakes"
FAKE_MPS = str(FAKES / "nvidia-cuda-mps-control")
FAKE_SMI = str(FAKES / "nvidia-smi")


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
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or zombie(pid), 5, "daemon killed")
        return pid

    def cleanup(self) -> None:
        pid = self.pid()
        cmdline = Path(f"/proc/{pid}/cmdline")
        if pid is not None and cmdline.exists() and b"nvidia-cuda-mps-control" in cmdline.read_bytes():
            os.kill(pid, signal.SIGKILL)


def zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but is not yet reaped (or is gone: no stat to read)."""
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


def sleeper(name: str = "cmd", **fields: Any) -> Any:
    """An imperative command job: starts at once (no torch import), paused and resumed from outside."""
    return parse_spec({"name": name, "interface": "imperative", "command": ["sleep", "30"], "memory": "64Mi", **fields})

