"""The part both example jobs share: the device and precision they run in, and counting the step's FLOPs once,
then reporting that count per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bubbles.sdk import IterativeFillJob, StepResult, assigned_device

DTYPES = ("float32", "bfloat16")  # fp32 on CPU (today's default), bf16 for GPU runs


def check_dtype(dtype: Any) -> str:
    """``dtype`` if it is one the examples support; ValueError saying which are, otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(repr(d) for d in DTYPES)}, got {dtype!r}; "
                         "use 'bfloat16' on GPUs, 'float32' on CPUs")
    return str(dtype)


def check_cuda_graphs(value: Any) -> bool:
    """The examples' ``cuda_graphs`` argument; ValueError unless a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"cuda_graphs must be true or false, got {value!r}")
    return value


def default_step_sizes(batch_size: int) -> tuple[int, ...]:
    """A quarter, a half and the whole batch (fewer when the batch is small): the sizes the runtime chooses
    from in each bubble (see ``IterativeFillJob.step_sizes``)."""
    return tuple(sorted({max(1, batch_size // 4), max(1, batch_size // 2), batch_size}))


def parse_step_sizes(step_sizes: Any, batch_size: int) -> tuple[int, ...]:
    """The example jobs' ``step_sizes`` argument: None for ``default_step_sizes``, ``[]`` for whole batches only,
    or sizes from 1 to ``batch_size``; ValueError saying so otherwise."""
    if step_sizes is None:
        return default_step_sizes(batch_size)
    if not isinstance(step_sizes, list | tuple) or any(
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= batch_size for n in step_sizes):
        raise ValueError(f"step_sizes must be a list of sizes from 1 to batch_size ({batch_size}), got "
                         f"{step_sizes!r}; [] runs whole batches only, omit it for a quarter, a half and a whole")
    return tuple(sorted(set(step_sizes)))


class FlopCountedJob(IterativeFillJob):
    """An iterative job whose ``_work(size)`` has fixed shapes for each size, so one counted step of a size gives
    every later step's FLOPs of that size.

    Subclasses set ``batch_size``, ``max_steps``, ``dtype`` and ``step_sizes`` (``parse_step_sizes``) and
    implement ``_work(size)`` (``size`` rows of the batch); ``init()`` should move the job to
    ``self.target_device()`` and end with ``self._count_first_step()`` (outside the bubbles: see the package doc).
    ``max_steps`` counts whole batches of work: a step of half a batch is half of one.
    """

    batch_size: int
    max_steps: int | None
    dtype: str = "float32"
    steps_done: int = 0
    samples_done: int = 0
    step_flops: float | None = None  # a whole batch's
    flops_by_size: dict[int, float]
    cuda_graphs: bool = False  # each step size's step replayed as a CUDA graph (``_capture_graphs``)
    graphs: dict[int, tuple[Any, tuple[Any, ...], Any]]  # size -> (graph, static inputs, static output)

    def target_device(self) -> str:
        """The device the agent assigned this fill process (``$BUBBLES_DEVICE``; ``"cpu"`` when run alone).

        Not ``torch.cuda.is_available()``: on a node with several GPUs the agent decides which one a fill job
        shares with which stage, and a CPU executor's fill job must stay on its core even if a GPU exists.
        """
        return assigned_device()

    def _require_cuda_for_graphs(self, device: str) -> None:
        if self.cuda_graphs and not device.startswith("cuda"):
            raise RuntimeError(f"cuda_graphs needs a CUDA device, and this fill job was given {device!r}: "
                               "set cuda_graphs to false, or run it on a GPU executor (bubbles agent --devices)")

    def _capture_graphs(self, static_inputs: Callable[[int], tuple[Any, ...]], body: Callable[..., Any]) -> None:
        """One CUDA graph per step size of ``body(*static_inputs(size))``, as PyTorch's CUDA graphs notes capture a
        whole network: 3 warm-up calls on a side stream (which also create state a step creates lazily, such as
        SGD's momentum), then the capture, each graph in its own memory pool. ``_replay`` runs them. The warm-up
        calls are work outside the bubbles, not counted."""
        import torch

        if not hasattr(self, "graphs"):
            self.graphs = {}
        side = torch.cuda.Stream()
        for size in (*self.step_sizes, self.batch_size):
            if size in self.graphs:
                continue
            inputs = static_inputs(size)
            side.wait_stream(torch.cuda.current_stream())  # after the copies: the warm-up reads them
            with torch.cuda.stream(side):
                for _ in range(3):
                    body(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = body(*inputs)
            self.graphs[size] = (graph, inputs, output)
        torch.cuda.synchronize()

    def _replay(self, size: int, batch: tuple[Any, ...]) -> Any:
        """With a graph for ``size``: ``batch`` copied into its static inputs, the graph replayed, its static output;
        otherwise None (run the step eagerly)."""
        replay = getattr(self, "graphs", {}).get(size)
        if replay is None:
            return None
        graph, inputs, output = replay
        for static, value in zip(inputs, batch, strict=True):
            static.copy_(value)
        graph.replay()
        return output

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def _work(self, size: int) -> None:
        raise NotImplementedError

    def _count_first_step(self) -> None:
        """Run each size's first step under FlopCounterMode (warm-up and FLOP count in one)."""
        for size in (*self.step_sizes, self.batch_size):
            self._count(size)

    def _count(self, size: int) -> float:
        from torch.utils.flop_counter import FlopCounterMode

        if not hasattr(self, "flops_by_size"):
            self.flops_by_size = {}
        if size not in self.flops_by_size:
            with FlopCounterMode(display=False) as counter:
                self._work(size)
            self.flops_by_size[size] = float(counter.get_total_flops())
            self._done(size)
        if size == self.batch_size:
            self.step_flops = self.flops_by_size[size]
        return self.flops_by_size[size]

    def _done(self, size: int) -> None:
        self.steps_done += 1
        self.samples_done += size

    def step(self, size: int | None = None) -> StepResult:
        n = self.batch_size if size is None else size
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"step size {n} is not between 1 and the batch size {self.batch_size}")
        flops = self.flops_by_size.get(n) if hasattr(self, "flops_by_size") else None
        if flops is None:  # init() was skipped (e.g. a direct call), or a size not declared: count now
            flops = self._count(n)
        else:
            self._work(n)
            self._done(n)
        return StepResult(flops=flops, samples=n)

    def is_finished(self) -> bool:
        return self.max_steps is not None and self.samples_done >= self.max_steps * self.batch_size
