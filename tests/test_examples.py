"""Every example fill-job spec in examples/ parses, and its arguments build the job (no training run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbles.core.api import load_spec
from bubbles.training.sdk import load_entry

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


def _operator_reasons() -> set[str]:
    """Every condition reason the operator writes: the literal third argument of ``st.condition(...)`` and of
    ``Condition(...)``, both branches where it is chosen by a conditional expression."""
    import re

    decide = Path(__file__).resolve().parent.parent / "operator" / "bubbles" / "operator" / "decide"
    source = "\n".join(p.read_text() for p in sorted(decide.glob("*.py")))
    found = set(re.findall(r'\.condition\(ConditionType\.\w+, [^,]+, "(\w+)"', source))
    call = r'Condition\(\s*(?:ConditionType\.\w+\.value|"\w+"),\s*(.*?),\s*("\w+"(?: if [^,]+ else "\w+")?)'
    for _status, reason in re.findall(call, source, flags=re.S):
        found |= set(re.findall(r'"(\w+)"', reason))
    return found


def test_the_troubleshooting_page_names_every_reason_the_operator_writes() -> None:
    reasons = _operator_reasons()
    assert {"NoHook", "PodNotStarting", "RestartLimit", "Profiling", "WithinBudget", "Differs"} <= reasons  # found
    page = (Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md").read_text()
    missing = sorted(r for r in reasons if f"`{r}`" not in page)
    assert not missing, f"docs/troubleshooting.md does not say what these reasons mean: {missing}"
