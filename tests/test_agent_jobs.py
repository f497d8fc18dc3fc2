"""Fill jobs for the agent and SDK tests (no torch: a fill process then starts in ~0.1 s).

The tests put this directory on PYTHONPATH so that ``test_agent_jobs:BusyJob`` is an entry the
fill process can import. It holds no tests itself.
"""

from __future__ import annotations

import os
import time

from helpers.sdk import BusyJob

from bubbles.core import control
from bubbles.training.sdk import ImperativeFillJob, IterativeFillJob


class SleepyJob(IterativeFillJob):
    """A job that stops pausing: its steps take 1 ms while the runtime profiles them at init, then every
    step sleeps ``step_s`` (1 s), far longer than any bubble (an input-dependent step that blew up)."""

    def __init__(self, step_s: float = 1.0, honest_steps: int = 10) -> None:
        self.step_s = step_s
        self.honest_steps = honest_steps
        self.steps = 0

    def step(self) -> float:
        self.steps += 1
        time.sleep(0.001 if self.steps <= self.honest_steps else self.step_s)
        return 1.0


class GarbageControlJob(BusyJob):
    """Writes a garbage line into its control channel before behaving like BusyJob."""

    def create(self) -> None:
        os.write(int(os.environ[control.CONTROL_FD_ENV]), b"this is not json\n")


class CountingImperativeJob(ImperativeFillJob):
    """Counts forever; the agent stops and continues the whole process."""

    def run(self) -> None:
        n = 0
        while True:
            n += 1


def test_fill_processes_are_the_oom_killers_first_choice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """When the node runs out of memory, the kernel's OOM killer must take a fill process, not the training: the
    agent raises the score of what it starts (a plain command too), and the SDK raises its own (a fill Pod's)."""
    import subprocess
    import sys
    from pathlib import Path

    from bubbles.agent.launcher import LaunchRequest, ProcessLauncher
    from bubbles.core.api import FillInterface, FillJobSpec

    spec = FillJobSpec(name="oom", interface=FillInterface.IMPERATIVE, entry=None,
                       command=(sys.executable, "-c", "import time; time.sleep(30)"))
    proc = ProcessLauncher().launch(LaunchRequest(spec=spec, socket_path=tmp_path / "fill-oom.sock"))
    try:
        assert Path(f"/proc/{proc.pid}/oom_score_adj").read_text().strip() == str(control.FILL_OOM_SCORE_ADJ)
    finally:
        proc.send_signal(9)
        while proc.poll() is None:
            time.sleep(0.01)
    # The SDK's own, before anything else it does (here it then refuses a bad --entry): inherited by a child.
    probe = ("import subprocess, sys; from bubbles.training.sdk import run_fill_process as r\n"
             "try:\n    r(['--entry', 'no-colon'])\nexcept SystemExit:\n    pass\n"
             "print(open('/proc/self/oom_score_adj').read().strip())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip().splitlines()[-1] == str(control.FILL_OOM_SCORE_ADJ), out.stderr


def _group(pgid: int) -> dict[int, str]:
    """PID -> state of every live process in process group ``pgid``."""
    from pathlib import Path

    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out[int(stat.parent.name)] = fields[0]
    return out


def test_a_wrapped_commands_children_are_paused_resumed_and_ended_with_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A plain command is often a wrapper (sh -c, torchrun) whose children do the work: signalling its process alone
    paused only the wrapper, and the children ran on through the training's compute; the ones a wrapper left behind
    when it exited ran on with the executor taken by the next job."""
    import signal

    from bubbles.agent.launcher import LaunchRequest, ProcessLauncher
    from bubbles.core.api import FillInterface, FillJobSpec

    def launch(script: str):  # type: ignore[no-untyped-def]
        spec = FillJobSpec(name="wrapped", interface=FillInterface.IMPERATIVE, entry=None, command=("sh", "-c", script))
        return ProcessLauncher().launch(LaunchRequest(spec=spec, socket_path=tmp_path / "fill-wrapped.sock"))

    def until(what, probe) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 10
        while not probe():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    proc = launch("sleep 300 & sleep 300 & wait")
    try:
        until("the wrapper's two children", lambda: len(_group(proc.pid)) == 3)
        proc.send_signal(signal.SIGSTOP)
        until("every member stopped", lambda: set(_group(proc.pid).values()) == {"T"})
        proc.send_signal(signal.SIGCONT)
        until("every member running again", lambda: "T" not in _group(proc.pid).values())
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) is not None
        until("no member left", lambda: not _group(proc.pid))
    finally:
        proc.close()
    left = launch("sleep 300 & exit 0")  # the wrapper exits at once, its child lives on
    try:
        assert left.wait(10) == 0
        until("the child it left behind ended", lambda: not _group(left.pid))
    finally:
        left.close()
    polled = launch("sleep 300 & sleep 0.2")  # the same, seen by poll()
    try:
        until("the wrapper's exit", lambda: polled.poll() is not None)
        until("the child it left behind ended", lambda: not _group(polled.pid))
    finally:
        polled.close()
