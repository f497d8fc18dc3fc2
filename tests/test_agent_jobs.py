"""Fill jobs for the agent and SDK tests (no torch: a fill process then starts in ~0.1 s).

The tests put this directory on PYTHONPATH so that ``test_agent_jobs:BusyJob`` is an entry the
fill process can import. It holds no tests itself.
"""

from __future__ import annotations

import os
import time

from bubbles import control
from bubbles.sdk import ImperativeFillJob, IterativeFillJob, StepResult


class BusyJob(IterativeFillJob):
    """Each step keeps the CPU busy for ``step_ms`` (like a kernel would keep a GPU busy)."""

    def __init__(self, step_ms: float = 1.0, flops: float = 1e6) -> None:
        self.step_ns = int(step_ms * 1e6)
        self.flops = flops
        self.created = self.initialized = False

    def create(self) -> None:
        self.created = True

    def init(self) -> None:
        self.initialized = True

    def step(self) -> StepResult:
        end = time.monotonic_ns() + self.step_ns
        while time.monotonic_ns() < end:
            pass
        return StepResult(flops=self.flops, samples=1)


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
