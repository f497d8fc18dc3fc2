"""Every benchmark script under benchmarks/ starts: ``--help`` runs and exits 0. A script that no test imports can
rot unseen (operator_scale.py imported test helpers from where they used to be until 2026-12-07)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_the_benchmarks_are_found() -> None:
    assert {"scheduler_latency.py", "simulator_speed.py", "operator_scale.py", "round_cost.py"} <= {
        p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_a_benchmark_script_starts(script: Path) -> None:
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": path}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in r.stdout.lower(), r.stdout[:500]


@pytest.mark.parametrize("flag", ["--full-pass-interval", "--gc-full-interval"])
@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_operator_scale_refuses_a_bad_interval_before_starting_anything(flag: str, value: str) -> None:
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "operator_scale.py"), flag, value],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path}, cwd=ROOT)
    assert r.returncode == 2, (r.returncode, r.stderr[-1000:])
    assert flag in r.stderr and "API server" not in r.stderr, r.stderr[-1000:]


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_operator_scale_refuses_a_bad_write_concurrency_before_starting_anything(value: str) -> None:
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "operator_scale.py"), "--write-concurrency", value],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path}, cwd=ROOT)
    assert r.returncode == 2, (r.returncode, r.stderr[-1000:])
    assert "--write-concurrency" in r.stderr and "API server" not in r.stderr, r.stderr[-1000:]
