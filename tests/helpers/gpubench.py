"""Set-ups of the gpubench tests (tests/test_gpubench_*.py): DeepSpeed's instruction streams, pass times, and
torch kept to one thread in the test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from deepspeed.runtime.pipe.schedule import TrainSchedule

from bubbles.training.hook import instruction_stream


def ds_streams(p: int, m: int) -> list[list[str]]:
    return [instruction_stream(TrainSchedule(micro_batches=m, stages=p, stage_id=s)) for s in range(p)]


def passes(f: float, b: float, o: float = 0.0) -> dict[str, float]:
    return {"ForwardPass": f, "BackwardPass": b, "OptimizerStep": o}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Torch on one thread for each test, its thread count put back afterwards (autouse where imported)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
