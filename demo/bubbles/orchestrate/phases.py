"""Interleaved fill-mode phases: an orchestrator runs the same training as ``off:10,naive:10,harvest:10``,
several rounds, so every mode sees the same machine; these pure helpers parse that plan and group the
training's iteration times by the phase they ran in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bubbles.api import FillMode


def parse_phases(text: str) -> list[tuple[str, int]]:
    """``off:10,harvest:10`` -> [("off", 10), ("harvest", 10)]; modes are FillMode labels."""
    phases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        mode, sep, count = part.partition(":")
        mode = mode.strip().lower()
        if not sep or mode.upper() not in FillMode.__members__:
            raise ValueError(f"phase {part!r}: write mode:iterations with mode one of "
                             f"{', '.join(FillMode.labels())}")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"phase {part!r}: iterations must be an integer") from None
        if n < 0:
            raise ValueError(f"phase {part!r}: iterations must be >= 0")
        phases.append((mode, n))
    return phases


def iteration_times_by_mode(rank: Mapping[str, Any], settle: int) -> dict[str, list[float]]:
    """Iteration times of one rank grouped by fill mode, dropping the first ``settle`` iterations of each
    phase: a mode switch reaches the agent and the fill processes asynchronously."""
    times: dict[str, list[float]] = {}
    phases: Sequence[str] = rank["phase"]
    run_start = 0
    for i, (phase, t) in enumerate(zip(phases, rank["iteration_s"], strict=True)):
        if i == 0 or phases[i - 1] != phase:
            run_start = i
        if phase == "profile" or i - run_start < settle:
            continue
        times.setdefault(phase, []).append(float(t))
    return times
