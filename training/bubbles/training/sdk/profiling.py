"""Timing a job's steps during initialization (FreeRide's side-task profiler), and checking its step sizes.

The steps timed here run once, outside bubbles, like process start-up and ``init()``; they are not counted as fill
work. Each timed step includes waiting for its device work: on a GPU the host-side time of a step is only its launch
cost, and gating on it would start steps that outlive bubbles.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bubbles.core.cycle import robust_stats
from bubbles.training.sdk.jobs import IterativeFillJob

INIT_PROFILE_STEPS = 10  # steps timed during init when the spec gives no step time
INIT_PROFILE_WARMUP = 2  # of those, the first pay one-time costs (allocations, lazy initialization)
PROFILE_MARGIN = 1.2  # step time used for gating = p90 of the samples * this margin

# A size's gating time and its fallback, by size (None: a job whose step() takes no size).
SizedTimes = list[tuple[int, float]]
FallbackTimes = list[tuple[int | None, float]]


def check_step_sizes(sizes: Any) -> tuple[int, ...]:
    """A job's ``step_sizes``, smallest first; ValueError saying what they must be."""
    try:
        values = list(sizes)
    except TypeError:
        values = None
    if values is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"step_sizes must be a list of positive integers (the sizes step(size) accepts), got "
                         f"{sizes!r}; leave it empty for a job whose step() takes no size")
    if len(set(values)) != len(values):
        raise ValueError(f"step_sizes must not repeat a size, got {values}")
    return tuple(sorted(values))


def profile_step_time(job: IterativeFillJob, synchronize: Callable[[], None],
                      size: int | None = None) -> tuple[float, float] | None:
    """Time a few of ``job``'s steps, each until ``synchronize`` says its device work is done, so the
    program-directed limit holds from the first bubble on.

    Returns the gate (the 90th percentile, with a margin) and the fallback (the median, with the margin: see
    ``FillRuntime._starving``); None when the job finished before any step past the warm-up was timed."""
    samples = []
    for _ in range(INIT_PROFILE_STEPS):
        if job.is_finished():
            break
        t0 = time.monotonic_ns()
        if size is None:
            job.step()
        else:
            job.step(size)  # type: ignore[call-arg]
        synchronize()
        samples.append((time.monotonic_ns() - t0) / 1e9)
    samples = samples[INIT_PROFILE_WARMUP:]
    if not samples:
        return None
    median, _p10, p90 = robust_stats(samples)
    return p90 * PROFILE_MARGIN, median * PROFILE_MARGIN


def profile_sizes(job: IterativeFillJob, synchronize: Callable[[], None], sizes: tuple[int, ...],
                  step_s: float | None) -> tuple[SizedTimes, FallbackTimes]:
    """Time every step size: the gates and the fallbacks, smallest size first, up to the size at which the job
    finished while being profiled.

    A gate never shrinks with the size (a larger step is not gated as shorter than a smaller one: timing noise); a
    given step time ``step_s`` is the largest size's floor (what the job's author said a full step takes is respected
    where it is more than was measured)."""
    sized: SizedTimes = []
    fallback: FallbackTimes = []
    for size in sizes:
        timed = profile_step_time(job, synchronize, size)
        if timed is None:  # finished while being profiled
            break
        t, median = timed
        if size == sizes[-1] and step_s is not None:
            t, median = max(t, step_s), max(median, step_s)
        sized.append((size, max(t, sized[-1][1]) if sized else t))
        fallback.append((size, max(median, fallback[-1][1]) if fallback else median))
    return sized, fallback
