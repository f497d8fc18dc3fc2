"""Small helpers for the orchestrators that start an agent and a training as child processes
(``bubbles demo``, the one-GPU benchmark): bounded waits, a graceful stop, free ports, log tails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the agent's metrics endpoint, torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_file(path: Path, proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    """Wait until ``path`` exists; False if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


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
