"""What a fill job imports: ``from bubbles.sdk import IterativeFillJob, StepResult, assigned_device``.

This module is the SDK's public face and holds no code of its own: the runtime lives in ``bubbles.training.sdk``.
``python -m bubbles.sdk --entry module:Class`` (or ``--exec -- PROGRAM ARGS...``) runs one fill job; the agent and
the operator's fill Pods start fill processes that way.
"""

import sys

from bubbles.training.sdk import ImperativeFillJob, IterativeFillJob, StepResult, assigned_device, run_fill_process

__all__ = ["ImperativeFillJob", "IterativeFillJob", "StepResult", "assigned_device"]

if __name__ == "__main__":
    sys.exit(run_fill_process())
