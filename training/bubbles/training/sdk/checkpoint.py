"""A fill job's state between attempts: saved where the FillJob's ``spec.checkpoint.path`` is mounted."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bubbles.core import control
from bubbles.training.sdk.jobs import IterativeFillJob


class CheckpointStore:
    """The job's state in a directory (``$BUBBLES_CHECKPOINT``, the FillJob's ``spec.checkpoint.path``): ``restore``
    after ``create()`` when a state is there, ``save`` when the process stops (finished, cancelled, evicted). A
    later attempt, on any node that mounts the same storage, resumes instead of starting over."""

    FILE = "state.bin"

    def __init__(self, directory: Path) -> None:
        self.path = directory / self.FILE

    @classmethod
    def from_environment(cls) -> CheckpointStore | None:
        text = os.environ.get(control.CHECKPOINT_ENV, "").strip()
        return cls(Path(text)) if text else None

    def restore(self, job: IterativeFillJob) -> bool:
        """Give the job its saved state; False (and a warning) when there is none or it cannot be read."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            print(f"bubbles.sdk: cannot read the checkpoint {self.path} ({exc}); starting over", file=sys.stderr)
            return False
        job.restore(data)
        return True

    def save(self, job: IterativeFillJob) -> bool:
        """Write ``job.checkpoint()`` atomically (never a half-written state); False when it has none to give."""
        data = job.checkpoint()
        if data is None:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.FILE}.{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(self.path)
        except OSError as exc:
            print(f"bubbles.sdk: cannot write the checkpoint {self.path} ({exc})", file=sys.stderr)
            return False
        return True
