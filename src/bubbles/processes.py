"""Small helpers for the orchestrators that start an agent and a training as child processes
(``bubbles demo``, the one-GPU benchmark): bounded waits, a graceful stop, free ports, log tails, and
reading the agent's metrics to know when its fill jobs are ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the agent's metrics endpoint, torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_file(path: Path, proc: subprocess.Popen[Any] | None, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until ``path`` exists; False if ``proc`` (when given) exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(poll_s)
    return path.exists()


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session=True``): its children too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_gracefully(proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> None:
    """SIGTERM (the agent then stops its fill jobs, quits an MPS daemon it owns and writes its stats);
    SIGKILL the whole group if it has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait()


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, for an error message; "(no log)" if it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def fill_jobs_in(metrics_text: str, *states: str) -> int:
    """How many fill jobs the agent's Prometheus text shows in any of ``states`` (``bubbles_fill_jobs``)."""
    wanted = tuple(f'state="{st}"' for st in states)
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics_text.splitlines()
               if line.startswith("bubbles_fill_jobs{") and any(w in line for w in wanted))


def fill_jobs_ready(metrics_text: str) -> int:
    """How many fill jobs the agent's metrics show initialized (PAUSED or RUNNING)."""
    return fill_jobs_in(metrics_text, "PAUSED", "RUNNING")


def wait_for_fill_jobs(port: int, jobs: int, agent: subprocess.Popen[Any], timeout_s: float,
                       poll_s: float = 0.1) -> str:
    """Poll the agent's /metrics until ``jobs`` fill jobs are initialized: ``"ready"``; ``"stopped"`` as soon
    as one is STOPPED first (rejected because it fits no bubble, or crashed: waiting longer changes nothing);
    ``"agent exited"``; or ``"timeout"``. Orchestrators hold their measured phases until then, so that fill
    processes starting up (importing torch, first steps) are charged to no mode."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            return "agent exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        if fill_jobs_ready(text) >= jobs:
            return "ready"
        if fill_jobs_in(text, "STOPPED"):
            return "stopped"
        time.sleep(poll_s)
    return "timeout"
