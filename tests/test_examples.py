"""Every example fill-job spec in examples/ parses, and its arguments build the job (no training run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbles.api import load_spec
from bubbles.sdk import load_entry

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples" / "fill-jobs").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_spec_parses_and_builds_its_job(path: Path) -> None:
    spec = load_spec(path)
    assert spec.entry is not None
    job = load_entry(spec.entry)(**spec.args)
    assert not job.is_finished()
    if path.name.startswith("gpu-"):
        # GPU executors reject a job without a hard memory limit; the GPU examples must declare one.
        assert spec.memory_bytes >= 1 << 30
        assert spec.args.get("dtype") == "bfloat16"
