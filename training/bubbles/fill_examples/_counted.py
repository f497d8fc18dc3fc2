"""The part both example jobs share: the device and precision they run in, and counting the step's FLOPs once,
then reporting that count per step."""

from __future__ import annotations

from typing import Any

from bubbles.sdk import IterativeFillJob, StepResult, assigned_device

DTYPES = ("float32", "bfloat16")  # fp32 on CPU (today's default), bf16 for GPU runs


def check_dtype(dtype: Any) -> str:
    """``dtype`` if it is one the examples support; ValueError saying which are, otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(repr(d) for d in DTYPES)}, got {dtype!r}; "
                         "use 'bfloat16' on GPUs, 'float32' on CPUs")
    return str(dtype)


class FlopCountedJob(IterativeFillJob):
    """An iterative job whose ``_work()`` has fixed shapes, so one counted step gives every step's FLOPs.

    Subclasses set ``batch_size``, ``max_steps`` and ``dtype`` and implement ``_work()``; ``init()`` should
    move the job to ``self.target_device()`` and end with ``self._count_first_step()`` (outside the bubbles:
    see the package doc).
    """

    batch_size: int
    max_steps: int | None
    dtype: str = "float32"
    steps_done: int = 0
    step_flops: float | None = None

    def target_device(self) -> str:
        """The device the agent assigned this fill process (``$BUBBLES_DEVICE``; ``"cpu"`` when run alone).

        Not ``torch.cuda.is_available()``: on a node with several GPUs the agent decides which one a fill job
        shares with which stage, and a CPU executor's fill job must stay on its core even if a GPU exists.
        """
        return assigned_device()

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

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
