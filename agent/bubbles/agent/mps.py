"""A client for NVIDIA's MPS control program (``nvidia-cuda-mps-control``), through its command line only.

Everything goes through the program itself, as an administrator would type it: ``-d`` starts the
control daemon, and commands (``get_server_list``, ``quit``, ...) are written to its stdin. Its
control socket and pid file live in the pipe directory (``$CUDA_MPS_PIPE_DIRECTORY``). Every call
is a subprocess with a timeout, so these functions block for up to that long: call them from a
supervisor thread or at start-up, never from the agent's event loop.

References: NVIDIA, *Multi-Process Service*, "Appendix: Tools and Interface Reference"
(https://docs.nvidia.com/deploy/mps/appendix-tools-and-interface-reference.html) and the
``nvidia-cuda-mps-control(1)`` manual page.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bubbles.core.mps_client import (  # noqa: F401 - the client's side, defined once in the core; re-exported here
    CONTROL_SOCKET,
    DEFAULT_PIPE_DIR,
    LOG_ENV,
    PINNED_LIMIT_ENV,
    PIPE_ENV,
    PRIORITY_ENV,
    THREAD_PERCENTAGE_ENV,
    check_pipe_dir,
    pinned_limit,
)

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
DEFAULT_LOG_DIR = Path("/var/log/nvidia-mps")


log = logging.getLogger("bubbles.agent.mps")
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"

class MpsError(Exception):
    """The control program failed, timed out or is missing; the message says which and what it printed."""


@dataclass(frozen=True)
class MpsControl:
    """One MPS control daemon, addressed by its pipe directory."""

    program: str  # path of nvidia-cuda-mps-control (or a stand-in with the same command line)
    pipe_dir: Path
    log_dir: Path
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        check_pipe_dir(self.pipe_dir)

    def env(self) -> dict[str, str]:
        """The variables that put the control program, the daemon and its clients on this pipe directory."""
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def run(self, *commands: str) -> str:
        """Send ``commands`` (one per line) to the daemon; its answer, or MpsError if none answered in time."""
        return self._invoke([], "".join(f"{c}\n" for c in commands), self.timeout_s,
                            " / ".join(commands) or "a probe")

    def _invoke(self, flags: list[str], stdin_text: str | None, timeout_s: float, what: str) -> str:
        """Run the control program with ``flags``; its stdout, or MpsError naming ``what`` and what it said."""
        env = dict(os.environ)
        env.update(self.env())
        name = " ".join([Path(self.program).name, *flags])
        try:
            done = subprocess.run([self.program, *flags], input=stdin_text,
                                  stdin=subprocess.DEVNULL if stdin_text is None else None, capture_output=True,
                                  text=True, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise MpsError(f"no answer to {what} within {timeout_s:g} s") from None
        except OSError as exc:
            raise MpsError(f"cannot run {self.program}: {exc.strerror or exc}") from None
        if done.returncode != 0:
            said = (done.stdout.strip() + " " + done.stderr.strip()).strip() or "no output"
            raise MpsError(f"{name} exited with code {done.returncode}: {said}")
        return done.stdout

    def server_list(self) -> list[int]:
        """PIDs of the MPS servers the daemon runs (``get_server_list``); MpsError if no daemon answers."""
        out = self.run("get_server_list")
        return [int(w) for w in out.split() if w.isdigit()]

    def default_thread_percentage(self) -> float | None:
        """``get_default_active_thread_percentage``; None if the answer is not a number."""
        out = self.run("get_default_active_thread_percentage").strip()
        try:
            return float(out)
        except ValueError:
            return None

    def daemon_pid(self) -> int | None:
        """The control daemon's PID from its pid file in the pipe directory, if the file is there."""
        try:
            text = (self.pipe_dir / PID_FILE).read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def start_daemon(self, ready_timeout_s: float = 5.0) -> int | None:
        """``nvidia-cuda-mps-control -d``, then wait until it answers; its PID. MpsError if it does not start.

        The pipe and log directories are created first: the daemon needs both.
        """
        for d in (self.pipe_dir, self.log_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise MpsError(f"cannot create {d}: {exc.strerror or exc}") from None
        self._start(max(self.timeout_s, ready_timeout_s))
        # -d returns once it has forked; the daemon may need a moment before it answers.
        deadline = time.monotonic() + ready_timeout_s
        last = ""
        while True:
            try:
                self.server_list()
                return self.daemon_pid()
            except MpsError as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise MpsError(f"the daemon started by {Path(self.program).name} -d did not answer within "
                               f"{ready_timeout_s:g} s ({last}); see {self.log_dir}/control.log")
            time.sleep(0.05)

    def _start(self, timeout_s: float) -> None:
        """Run ``-d`` with its output in a file, not a pipe: the daemon it forks may keep the output it inherited
        open, and reading a pipe to its end would then wait as long as the daemon lives (or, not read, block the
        daemon once the pipe is full)."""
        env = dict(os.environ)
        env.update(self.env())
        # The daemon sees every GPU, numbered as the node numbers them. Started under CUDA_VISIBLE_DEVICES, its server
        # would renumber the devices, and a client keeping the variable (the training, a fill process: it is inherited)
        # would apply it a second time, to the renumbered list, and fail at CUDA start-up (NVIDIA's MPS
        # documentation: clients must then not set it). Without it, a client's own CUDA_VISIBLE_DEVICES selects
        # from the node's GPUs as it does without MPS.
        if env.pop(VISIBLE_ENV, None) is not None:
            log.info("starting the MPS control daemon without %s=%s (the agent's): the daemon sees every GPU; its "
                     "clients keep their own", VISIBLE_ENV, os.environ[VISIBLE_ENV])
        with tempfile.TemporaryFile("w+") as out:
            try:
                done = subprocess.run([self.program, "-d"], stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                raise MpsError(f"no answer to {self.program} -d within {timeout_s:g} s") from None
            except OSError as exc:
                raise MpsError(f"cannot run {self.program}: {exc.strerror or exc}") from None
            if done.returncode != 0:
                out.seek(0)
                said = out.read(4096).strip() or "no output"
                raise MpsError(f"{Path(self.program).name} -d exited with code {done.returncode}: {said}")

    def clients(self) -> dict[int, list[int]]:
        """Each MPS server's client PIDs (``get_server_list``, then ``get_client_list`` per server): the CUDA
        processes that joined it. MpsError if no daemon answers."""
        return {server: [int(line) for line in self.run(f"get_client_list {server}").split("\n")
                         if line.strip().isdigit()]
                for server in self.server_list()}

    def quit(self) -> None:
        """``quit``: stop the control daemon (and with it its servers). MpsError if it did not answer."""
        self.run("quit")

    def servers_alive(self, pid: int) -> list[int]:
        """The live child processes of the control daemon ``pid``: its MPS servers (it spawns one per client user),
        found without asking the daemon, which may not answer."""
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # gone
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 1 and fields[1] == str(pid) and fields[0] != "Z":
                children.append(int(entry))
        return sorted(children)

    def kill_daemon(self, pid: int) -> bool:
        """SIGKILL a control daemon that no longer answers, if ``pid`` still is one; True if signalled.

        Only for a daemon this agent started: a hung daemon keeps its socket, and a new one will not start.
        """
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        if CONTROL_PROGRAM.encode() not in cmdline:
            return False  # the PID was reused by something else
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            return True
        return False


def resolve_program(path: str | None, search_path: str | None = None) -> str | None:
    """``path`` if given, else ``nvidia-cuda-mps-control`` found on PATH; None if not found."""
    import shutil

    if path is not None:
        return path
    return shutil.which(CONTROL_PROGRAM, path=search_path)
