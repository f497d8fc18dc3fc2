"""What a fill-job author writes against: the two programming interfaces, what a step returns, and the device.

Write a fill job as an ``IterativeFillJob`` (preferred, and the only safe choice on a GPU: the runtime
starts a step only when it can finish inside the bubble, FreeRide's program-directed limit, and waits
for the step's queued GPU work before counting it done) or an ``ImperativeFillJob`` (any code; the agent
pauses the whole process with SIGSTOP at bubble end and resumes it with SIGCONT at bubble start, so
kernels already queued on a GPU still overlap the training). Fill jobs import these through ``bubbles.sdk``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from bubbles.core import control


@dataclass(frozen=True)
class StepResult:
    """What one step did: its floating-point operations and the samples it processed."""

    flops: float = 0.0
    samples: int = 0


class IterativeFillJob:
    """A fill job made of short steps; the runtime runs ``step()`` only where it fits in a bubble.

    Life cycle: ``create()`` when the process starts (data and model in host memory), ``init()``
    once the agent says so (move to the accelerator), then ``step()`` repeatedly inside bubbles
    until ``is_finished()``. ``checkpoint()``/``restore()`` are optional.

    Steps of several sizes (PipeFill's per-bubble choice of fill-job configuration): a job that sets
    ``step_sizes`` (after ``init()`` at the latest) to the sizes its step can take, in its own units (samples,
    tokens), is called as ``step(size)``. The runtime times every size during initialization and, in each
    bubble, runs the largest size that fits what is left of it: big steps where a bubble is long, small ones
    in short bubbles and in a long one's tail. Without ``step_sizes`` the runtime calls ``step()``.
    """

    step_sizes: Sequence[int] = ()

    def create(self) -> None:
        """Load the context into host memory. Leave the GPU alone here: on a ``cuda`` executor the runtime fails a
        job whose ``create()`` made a CUDA context (it has no device or memory cap yet); do that in ``init()``."""

    def init(self) -> None:
        """Move the context to the accelerator."""

    def step(self) -> StepResult | float | None:
        """Run one step; return a StepResult, or a float (its FLOPs), or None. With ``step_sizes``, the runtime
        calls ``step(size)`` instead, ``size`` one of them."""
        raise NotImplementedError

    def is_finished(self) -> bool:
        return False

    def checkpoint(self) -> bytes | None:
        return None

    def restore(self, state: bytes) -> None:
        """Restore from ``checkpoint()``'s bytes."""


class ImperativeFillJob:
    """A fill job that is arbitrary code; the agent pauses it from outside (SIGSTOP/SIGCONT).

    The agent sends SIGCONT at each BUBBLE_START and SIGSTOP at each BUBBLE_END (harvest mode),
    leaves it running in naive mode and stopped in off mode. Nothing in ``run()`` needs to cooperate,
    which is why it costs the training more than an iterative job: the process is stopped only after
    the bubble has ended.

    On a GPU, SIGSTOP does not stop the GPU: it stops the host thread that launches kernels, and every
    kernel that thread already queued (a CUDA launch returns long before the kernel finishes; the queue
    can hold many milliseconds of work) runs on after the bubble has ended, competing with the training.
    Nothing outside the process can drain or cancel that queue. Use an ``IterativeFillJob`` on GPUs: its
    runtime starts a step only if it fits the bubble and waits for the step's GPU work inside the step.
    """

    def create(self) -> None:
        """Load the context into host memory (runs before the first SIGSTOP). Leave the GPU alone here, as for
        ``IterativeFillJob.create``."""

    def init(self) -> None:
        """Move the context to the accelerator."""

    def run(self) -> None:
        raise NotImplementedError


def load_entry(entry: str) -> type:
    """Import ``module:Class``; raise ValueError saying what is wrong."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"entry {entry!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"entry {entry!r}: cannot import {module_name!r}: {exc}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"entry {entry!r}: {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, type) or not issubclass(obj, IterativeFillJob | ImperativeFillJob):
        raise ValueError(f"entry {entry!r} is not a subclass of IterativeFillJob or ImperativeFillJob")
    return obj


def assigned_device() -> str:
    """The device the agent gave this fill process: ``"cpu"`` or ``"cuda:N"`` (``$BUBBLES_DEVICE``).

    Fill jobs move their model here in ``init()``. A CPU executor's device is ``"cpu:K"`` (core K stands in
    for a stage's accelerator); torch only knows ``"cpu"``, so the core index is dropped.
    """
    device = os.environ.get(control.DEVICE_ENV, "cpu").strip() or "cpu"
    return "cpu" if device.startswith("cpu") else device
