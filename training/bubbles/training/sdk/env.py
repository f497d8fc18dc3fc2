"""The fill process's settings from its environment (what the agent or the operator sets): each parser returns the
value or raises ValueError naming the variable and what to give."""

from __future__ import annotations

import os
from dataclasses import dataclass

from bubbles.core import control
from bubbles.core.api import DEFAULT_TAIL_RISK, MAX_TAIL_RISK
from bubbles.core.control import cuda_device_index
from bubbles.training.sdk.device import fill_wait


def spin_window_ns(text: str) -> int:
    """``$BUBBLES_SPIN_US``: microseconds, 0 to 10,000; empty means 0 (no busy-polling)."""
    try:
        us = float(text.strip() or 0)
    except ValueError:
        us = -1.0
    if not 0 <= us <= 10_000:
        raise ValueError(f"${control.SPIN_US_ENV}={text!r}: give microseconds from 0 (off) to 10000, e.g. 150")
    return int(us * 1000)


def tail_risk(text: str) -> float:
    """``$BUBBLES_TAIL_RISK``: a probability from 0 (no steps past a bubble's predicted end) to ``MAX_TAIL_RISK``;
    empty means ``DEFAULT_TAIL_RISK``."""
    try:
        risk = float(text.strip()) if text.strip() else DEFAULT_TAIL_RISK
    except ValueError:
        risk = -1.0
    if not 0.0 <= risk <= MAX_TAIL_RISK:  # NaN fails this too
        raise ValueError(f"${control.TAIL_RISK_ENV}={text!r}: give the accepted chance that a step started past its "
                         f"bubble's predicted end outlives the bubble, from 0 (never start one) to {MAX_TAIL_RISK}, "
                         f"e.g. {DEFAULT_TAIL_RISK}")
    return risk


def _memory_limit(text: str) -> int | None:
    """``$BUBBLES_MEMORY_BYTES``: an integer number of bytes; empty or 0 means no limit."""
    try:
        value = int(text.strip() or 0)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"${control.MEMORY_ENV}={text!r} is not an integer number of bytes >= 0; the agent "
                         "sets it from the fill job's spec.memory")
    return value or None


@dataclass(frozen=True)
class FillSettings:
    """What the environment tells a fill process about how to run, checked before the job is created."""

    device: str  # "cpu", "cpu:K" or "cuda:N" ($BUBBLES_DEVICE)
    memory_bytes: int | None  # the CUDA caching allocator's cap; None: no limit
    spin_ns: int  # busy-poll window either side of a predicted bubble start; 0: off
    tail_risk: float  # this process's own accepted chance that a tail step outlives its bubble
    fill_wait: str  # how a step's GPU work is waited for: "block" or "spin"

    @classmethod
    def from_environment(cls) -> FillSettings:
        """The settings in ``os.environ``; ValueError naming the first bad one (the device first)."""
        device = os.environ.get(control.DEVICE_ENV, "cpu")
        cuda_device_index(device)
        return cls(device=device,
                   memory_bytes=_memory_limit(os.environ.get(control.MEMORY_ENV, "")),
                   spin_ns=spin_window_ns(os.environ.get(control.SPIN_US_ENV, "")),
                   tail_risk=tail_risk(os.environ.get(control.TAIL_RISK_ENV, "")),
                   fill_wait=fill_wait(os.environ.get(control.FILL_WAIT_ENV, "")))
