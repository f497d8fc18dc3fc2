"""A fill job whose step busy-waits a fixed time: for benchmarks and tests of the signal path, where the
step's content must not add noise of its own."""

from __future__ import annotations

import time

from bubbles.sdk import IterativeFillJob, StepResult


class SpinJob(IterativeFillJob):
    """Each step spins for ``step_us`` microseconds and reports ``flops_per_step``."""

    def __init__(self, step_us: float = 50.0, flops_per_step: float = 0.0) -> None:
        self.step_ns = int(step_us * 1000)
        self.flops_per_step = flops_per_step

    def step(self) -> StepResult:
        end = time.monotonic_ns() + self.step_ns
        while time.monotonic_ns() < end:
            pass
        return StepResult(flops=self.flops_per_step)
