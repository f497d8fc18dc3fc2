"""Interleaved fill-mode phases: an orchestrator runs the same training as ``off:10,naive:10,harvest:10``,
several rounds, so every mode sees the same machine; these pure helpers parse that plan and group the
training's iteration times by the phase they ran in.

Modes are ``bubbles.core.api.FillMode`` members in code and their labels in text: the ``--phases`` flag and the
training's record, whose per-iteration ``phase`` is a mode label or ``"profile"``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bubbles.core.api import FillMode

PROFILE_PHASE = "profile"  # the record's phase of the iterations before the measured ones (hook profiling)
# The modes an orchestrator compares, in the order each round runs them: baseline, naive co-location, harvesting.
COMPARED_MODES = (FillMode.OFF, FillMode.NAIVE, FillMode.HARVEST)


def format_phases(iterations: int, repeats: int, modes: Sequence[FillMode] = COMPARED_MODES) -> str:
    """The ``--phases`` text of ``repeats`` rounds of ``modes``, ``iterations`` each: ``off:12,naive:12,...``."""
    return ",".join(f"{m.label}:{iterations}" for _ in range(repeats) for m in modes)


def parse_phases(text: str) -> list[tuple[FillMode, int]]:
    """``off:10,harvest:10`` -> [(FillMode.OFF, 10), (FillMode.HARVEST, 10)]; modes are FillMode labels."""
    phases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        label, sep, count = part.partition(":")
        try:
            mode: FillMode | None = FillMode.parse(label, "mode")
        except ValueError:
            mode = None
        if not sep or mode is None:
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


def iteration_times_by_mode(rank: Mapping[str, Any], settle: int) -> dict[FillMode, list[float]]:
    """Iteration times of one rank grouped by fill mode, dropping the first ``settle`` iterations of each
    phase: a mode switch reaches the agent and the fill processes asynchronously. ValueError for a phase
    that is neither ``"profile"`` nor a fill mode's label."""
    times: dict[FillMode, list[float]] = {}
    phases: Sequence[str] = rank["phase"]
    run_start = 0
    for i, (phase, t) in enumerate(zip(phases, rank["iteration_s"], strict=True)):
        if i == 0 or phases[i - 1] != phase:
            run_start = i
        if phase == PROFILE_PHASE or i - run_start < settle:
            continue
        mode = FillMode.parse(phase, f"phase of iteration {i} (other than {PROFILE_PHASE!r})")
        times.setdefault(mode, []).append(float(t))
    return times


def iterations_by_round(rank: Mapping[str, Any], settle: int) -> list[dict[FillMode, list[int]]]:
    """The indices of one rank's measured iterations, by round and mode: a round is one pass over the modes (a mode
    seen again starts the next round), each phase's first ``settle`` iterations dropped as in
    ``iteration_times_by_mode``."""
    rounds: list[dict[FillMode, list[int]]] = []
    phases: Sequence[str] = rank["phase"]
    run_start = 0
    current: dict[FillMode, list[int]] = {}
    for i, phase in enumerate(phases):
        if i == 0 or phases[i - 1] != phase:
            run_start = i
            if phase != PROFILE_PHASE:
                mode = FillMode.parse(phase, f"phase of iteration {i} (other than {PROFILE_PHASE!r})")
                if mode in current:
                    rounds.append(current)
                    current = {}
                current[mode] = []
        if phase == PROFILE_PHASE or i - run_start < settle:
            continue
        current[FillMode.parse(phase, f"phase of iteration {i}")].append(i)
    if current:
        rounds.append(current)
    return rounds
