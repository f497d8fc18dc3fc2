"""Fill job: a gang's tensor-parallel inference step, one process per GPU (a job with ``gpus: N``).

Each process holds a column shard of one linear layer's weight, multiplies its batch by it, and all-reduces a partial
result with the others, the pattern of tensor-parallel inference (Megatron's row-parallel layer). Its processes
join a ``torch.distributed`` group over gloo at ``127.0.0.1:$BUBBLES_GANG_PORT`` (rank and size from
``$BUBBLES_GANG_RANK``/``$BUBBLES_GANG_SIZE``; alone, a group of one), so a step of one process waits for the
others' in its all-reduce: a gang whose processes were not paused and resumed together would stall. The agent and the
SDK step them together (docs/writing-fill-jobs.md, "Gang jobs").
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from bubbles.core import control
from bubbles.sdk import IterativeFillJob, StepResult, assigned_device

JOIN_TIMEOUT_S = 60.0  # the others' init must reach the group within this (the agent starts them together)


class GangInference(IterativeFillJob):
    """Per step: ``batch`` rows times this process's ``width / size`` columns of a ``width x width`` weight, then an
    all-reduce of the ``batch x width`` partial product among the gang. ``steps`` (optional) finishes the job after
    that many steps, the first of which runs in ``init()`` (joining the group and torch's one-time costs, outside the
    bubbles)."""

    def __init__(self, batch: int = 8, width: int = 256, steps: int | None = None, seed: int = 0) -> None:
        if batch < 1 or width < 1:
            raise ValueError(f"batch and width must be >= 1, got batch {batch}, width {width}")
        self.batch = batch
        self.width = width
        self.max_steps = steps
        self.seed = seed
        self.rank = int(os.environ.get(control.GANG_RANK_ENV, "0"))
        self.size = int(os.environ.get(control.GANG_SIZE_ENV, "1"))
        self.port = os.environ.get(control.GANG_PORT_ENV)
        if self.size > 1 and not self.port:
            raise ValueError(f"a gang of {self.size} needs ${control.GANG_PORT_ENV} (the agent sets it)")
        if width % self.size:
            raise ValueError(f"width {width} must split into the gang's {self.size} shards")
        self.steps_done = 0
        self.step_flops: float | None = None
        self.group: Any = None

    def create(self) -> None:
        import torch

        self.device = assigned_device()
        gen = torch.Generator().manual_seed(self.seed + self.rank)
        cols = self.width // self.size
        self.x = torch.randn(self.batch, cols, generator=gen).to(self.device)
        self.w = torch.randn(cols, self.width, generator=gen).to(self.device)

    def init(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():  # a group this process made already (a test running several jobs in one process)
            self.group = dist.new_group(backend="gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port or _free_port()}",
                                    rank=self.rank, world_size=self.size, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
            self.group = dist.group.WORLD
        # 2 FLOPs per multiply-add of this process's shard; the all-reduce's additions are not counted.
        self.step_flops = 2.0 * self.batch * (self.width // self.size) * self.width
        self.step()

    def step(self) -> StepResult:
        import torch.distributed as dist

        partial = self.x @ self.w
        dist.all_reduce(partial, group=self.group)
        self.steps_done += 1
        return StepResult(flops=self.step_flops or 0.0, samples=self.batch)

    def is_finished(self) -> bool:
        return self.max_steps is not None and self.steps_done >= self.max_steps


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
