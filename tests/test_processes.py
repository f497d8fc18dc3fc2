"""The orchestrators' helpers: reading the agent's metrics, bounded waits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bubbles.demo.orchestrate.processes import fill_jobs_in, fill_jobs_ready, wait_for_file, wait_for_fill_jobs

METRICS = """# HELP bubbles_fill_jobs Fill jobs by state
bubbles_fill_jobs{training="demo",stage="0",device="cpu:0",state="PAUSED"} 1.0
bubbles_fill_jobs{training="demo",stage="1",device="cpu:1",state="RUNNING"} 2.0
bubbles_fill_jobs{training="demo",stage="1",device="cpu:1",state="STOPPED"} 1.0
bubbles_fill_steps_total{training="demo",stage="0",device="cpu:0",mode="harvest",job="x"} 7.0
"""


def test_fill_jobs_are_counted_by_state_from_the_agents_metrics() -> None:
    assert fill_jobs_ready(METRICS) == 3
    assert fill_jobs_in(METRICS, "STOPPED") == 1
    assert fill_jobs_in(METRICS, "CREATED") == 0
    assert fill_jobs_ready("") == 0


def test_waits_are_bounded_and_end_when_the_process_does(tmp_path: Path) -> None:
    assert not wait_for_file(tmp_path / "never", None, 0.1, poll_s=0.01)
    (tmp_path / "here").touch()
    assert wait_for_file(tmp_path / "here", None, 0.1)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not wait_for_file(tmp_path / "never", done, 30)  # returns at once: the process has exited
    assert wait_for_fill_jobs(1, 1, done, 30) == "agent exited"
