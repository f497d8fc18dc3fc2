"""The example fill jobs (bubbles.fill_examples): steps, FLOPs, and the step sizes they accept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers.sdk import torch_threads_kept

from bubbles.sdk import StepResult
from bubbles.training.sdk.jobs import load_entry


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """apply_process_limits pins torch to one thread, in the test process too: put it back."""
    with torch_threads_kept():
        yield


@pytest.mark.parametrize(
    ("entry", "kwargs"),
    [
        ("bubbles.fill_examples.image_classification:ImageClassification", {"batch_size": 2}),
        ("bubbles.fill_examples.batch_inference:BatchInference", {"batch_size": 4}),
        ("bubbles.fill_examples.gang_inference:GangInference", {"batch": 4, "width": 32}),  # a gang of one here
    ],
)
def test_example_fill_jobs_run_steps_and_report_flops(entry: str, kwargs: dict[str, Any]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = load_entry(entry)(**kwargs, steps=3)
        job.create()
        job.init()
        results = []
        while not job.is_finished():
            results.append(job.step())
        assert len(results) == 2  # the first of the 3 steps ran in init(), counting FLOPs
        assert all(isinstance(r, StepResult) for r in results)
        assert all(r.flops > 0 for r in results)
        assert all(r.samples > 0 for r in results)
        assert {r.flops for r in results} == {job.step_flops}  # counted once, reused
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kwargs", [{"step_sizes": [0]}, {"step_sizes": [5]}, {"step_sizes": "all"}])
def test_the_example_jobs_refuse_step_sizes_outside_their_batch(kwargs: dict[str, Any]) -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    with pytest.raises(ValueError, match="from 1 to batch_size"):
        ImageClassification(batch_size=4, **kwargs)
    assert ImageClassification(batch_size=4).step_sizes == (1, 2, 4)
    assert ImageClassification(batch_size=4, step_sizes=[]).step_sizes == ()


def test_example_part_batches_count_their_own_flops_and_their_share_of_the_work(keep_torch_threads: None) -> None:
    import torch

    from bubbles.fill_examples.batch_inference import BatchInference

    torch.set_num_threads(1)
    job = BatchInference(batch_size=8, steps=2)  # two whole batches of work
    job.create()
    job.init()  # counts sizes 2, 4 and 8: 14 samples, more than one batch
    assert job.step_sizes == (2, 4, 8)
    flops = job.flops_by_size
    assert flops[2] < flops[4] < flops[8]
    assert flops[8] == pytest.approx(4 * flops[2], rel=0.05)
    assert not job.is_finished()
    r = job.step(2)
    assert r.samples == 2
    assert r.flops == flops[2]
    assert job.is_finished()  # 16 samples = 2 batches
    with pytest.raises(ValueError, match="between 1 and the batch size"):
        job.step(9)


def test_the_gang_example_refuses_a_width_its_gang_cannot_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.core import control
    from bubbles.fill_examples.gang_inference import GangInference

    monkeypatch.setenv(control.GANG_SIZE_ENV, "3")
    monkeypatch.setenv(control.GANG_RANK_ENV, "0")
    monkeypatch.setenv(control.GANG_PORT_ENV, "29999")
    with pytest.raises(ValueError, match="split into the gang's 3 shards"):
        GangInference(width=32)
    monkeypatch.delenv(control.GANG_PORT_ENV)
    with pytest.raises(ValueError, match="GANG_PORT"):
        GangInference(width=33)
