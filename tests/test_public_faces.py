"""The names the README and the docs promise stay where users find them, whatever moves behind them."""

from __future__ import annotations

import subprocess
import sys

import bubbles.hook
import bubbles.sdk
import bubbles.training.hook
import bubbles.training.sdk


def test_the_one_line_in_a_training_imports_the_hooks_instrument() -> None:
    from bubbles.hook import instrument

    assert instrument is bubbles.training.hook.instrument
    assert bubbles.hook.Instrumentation is bubbles.training.hook.Instrumentation


def test_a_fill_job_imports_the_runtimes_own_classes() -> None:
    # A fill job subclasses these; the runtime checks instances against the same class objects.
    from bubbles.sdk import ImperativeFillJob, IterativeFillJob, StepResult, assigned_device

    assert IterativeFillJob is bubbles.training.sdk.IterativeFillJob
    assert ImperativeFillJob is bubbles.training.sdk.ImperativeFillJob
    assert StepResult is bubbles.training.sdk.StepResult
    assert assigned_device is bubbles.training.sdk.assigned_device


def test_each_face_exports_exactly_its_promised_names() -> None:
    assert sorted(bubbles.hook.__all__) == ["Instrumentation", "instrument"]
    assert sorted(bubbles.sdk.__all__) == ["ImperativeFillJob", "IterativeFillJob", "StepResult", "assigned_device"]


def test_python_dash_m_bubbles_sdk_is_the_fill_process_entry() -> None:
    # The agent and the operator's fill Pods start fill processes with this command line.
    proc = subprocess.run([sys.executable, "-m", "bubbles.sdk", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m bubbles.sdk")
    assert "--entry" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "bubbles.sdk", "--exec"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "--exec needs a command" in bad.stderr
