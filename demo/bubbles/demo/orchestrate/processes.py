"""Small helpers for the orchestrators that start an agent and a training as child processes
(``bubbles demo``, the one-GPU benchmark): bounded waits, a graceful stop, free ports, log tails, and
reading the agent's metrics to know when its fill jobs are ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, TextIO


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (all held until all are picked, so none is
    picked twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the agent's metrics endpoint, torchrun)."""
    return free_ports(1)[0]


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


class EchoedProcess:
    """A child process whose progress lines (those starting with ``prefix``) are echoed to ``stream`` (default
    stderr) as they come, while all its output goes to ``log_path``; with ``timeout_s``, killed with its process
    group once it runs past that. ``new_session=False`` keeps it in our process group, so Ctrl-C reaches it."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, *, prefix: str,
                 timeout_s: float | None = None, stream: TextIO | None = None, new_session: bool = True) -> None:
        self.timeout_s = timeout_s
        self.log_path = log_path
        self.prefix = prefix
        self.stream = stream
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=new_session)
        self._timer = threading.Timer(timeout_s, kill_group, args=(self.proc,)) if timeout_s is not None else None
        if self._timer is not None:
            self._timer.start()
        self._reader = threading.Thread(target=self._echo, daemon=True)
        self._reader.start()

    def _echo(self) -> None:
        assert self.proc.stdout is not None
        stream = self.stream or sys.stderr
        with self.log_path.open("w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(self.prefix):
                    print("  " + line.rstrip(), file=stream, flush=True)

    def wait(self) -> int:
        """The exit code; 124 if it was killed for running past ``timeout_s``."""
        rc = self.proc.wait()
        if self._timer is not None:
            self._timer.cancel()
        self._reader.join(timeout=5)
        if rc == -signal.SIGKILL and self.timeout_s is not None:
            with self.log_path.open("a") as log:
                log.write(f"\n(killed: it ran past {self.timeout_s:.0f} s or its run was abandoned)\n")
            return 124
        return rc

    def kill(self) -> None:
        kill_group(self.proc)
        self.wait()
