"""A fill job's checkpoint: saved when the process stops, restored by the next attempt."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.sdk import Counter

from bubbles.training.sdk.checkpoint import CheckpointStore
from bubbles.training.sdk.jobs import IterativeFillJob


def test_a_job_resumes_from_the_state_its_last_attempt_saved(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BUBBLES_CHECKPOINT", raising=False)
    assert CheckpointStore.from_environment() is None
    monkeypatch.setenv("BUBBLES_CHECKPOINT", str(tmp_path / "ckpt"))
    store = CheckpointStore.from_environment()
    assert store is not None
    first = Counter()
    assert store.restore(first) is False  # nothing saved yet: start from the beginning
    for _ in range(7):
        first.step()
    assert store.save(first) is True
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["state.bin"]  # no temporary file left
    second = Counter()
    assert store.restore(second) is True
    assert second.count == 7
    assert store.save(IterativeFillJob()) is False  # a job without state writes nothing


def test_an_unreadable_checkpoint_means_starting_over_with_a_warning(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "state.bin").mkdir()  # a directory where the state file should be
    assert CheckpointStore(tmp_path).restore(Counter()) is False
    assert "starting over" in capsys.readouterr().err
