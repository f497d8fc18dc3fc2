"""What a fill job imports: ``from bubbles.sdk import IterativeFillJob, StepResult, assigned_device``.

This module is the SDK's public face and holds no code of its own: the interfaces live in ``bubbles.training.sdk.jobs``
and the runtime in the rest of ``bubbles.training.sdk``. ``python -m bubbles.sdk --entry module:Class`` (or
``--exec -- PROGRAM ARGS...``) runs one fill job; the agent and the operator's fill Pods start fill processes that way.
"""

from bubbles.training.sdk.jobs import ImperativeFillJob, IterativeFillJob, StepResult, assigned_device

__all__ = ["ImperativeFillJob", "IterativeFillJob", "StepResult", "assigned_device"]

if __name__ == "__main__":
    import sys

    from bubbles.training.sdk.process import run_fill_process

    sys.exit(run_fill_process())
