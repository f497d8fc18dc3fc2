"""Shared test set-up: the benchmarks folder (not installed) is importable, as ``python benchmarks/X.py`` sees it."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
