"""Small order statistics shared by every side (the hook's profiles, the agent's ledger, reports)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between ranks, as numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100 or math.isnan(q):
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median: the order statistics (k-th smallest, k-th largest) for the
    largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is at least ``confidence``. None when there are too
    few values for that confidence (fewer than 6 for 95%)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    xs = sorted(values)
    n = len(xs)
    best = None
    below = 0.0  # P(B < k)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2**n
        if 1 - 2 * below >= confidence:
            best = k
        else:
            break
    return (xs[best - 1], xs[n - best]) if best is not None else None
