"""The part both example jobs share: count the step's FLOPs once, then report that count per step."""

from __future__ import annotations

from bubbles.sdk import IterativeFillJob, StepResult


class FlopCountedJob(IterativeFillJob):
    """An iterative job whose ``_work()`` has fixed shapes, so one counted step gives every step's FLOPs.

    Subclasses set ``batch_size`` and ``max_steps`` and implement ``_work()``; ``init()`` should end with
    ``self._count_first_step()`` (outside the bubbles: see the package doc).
    """

    batch_size: int
    max_steps: int | None
    steps_done: int = 0
    step_flops: float | None = None

    def _work(self) -> None:
        raise NotImplementedError

    def _count_first_step(self) -> None:
        """Run the first step under FlopCounterMode (warm-up and FLOP count in one)."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            self._work()
        self.step_flops = float(counter.get_total_flops())
        self.steps_done += 1

    def step(self) -> StepResult:
        if self.step_flops is None:  # init() was skipped (e.g. a direct call): count now
            self._count_first_step()
        else:
            self._work()
            self.steps_done += 1
        assert self.step_flops is not None
        return StepResult(flops=self.step_flops, samples=self.batch_size)

    def is_finished(self) -> bool:
        return self.max_steps is not None and self.steps_done >= self.max_steps
