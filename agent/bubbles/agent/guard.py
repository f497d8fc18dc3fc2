"""The slowdown guard: AIMD on the share of each bubble given to fill work, against a training budget.

Harvesting is only worth it if the training barely notices. The guard sees nothing but the
training's iteration durations: every ``window`` iterations it compares their median with a
baseline measured without fill work, cuts the share multiplicatively when the slowdown is over
budget and raises it additively when there is clear headroom (TCP's AIMD: quick to back off,
careful to come back). Because the training itself drifts (data, thermals, other tenants), it
pauses fill work every ``refresh_every`` windows to re-measure the baseline. Pure: no clocks.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardConfig:
    """How much slowdown the training tolerates and how the guard reacts to it."""

    budget: float = 0.01  # allowed training slowdown (1%)
    window: int = 8  # iterations per decision
    increase: float = 0.1  # additive share increase with headroom
    decrease: float = 0.5  # multiplicative share decrease over budget
    min_share: float = 0.0
    max_share: float = 1.0
    initial_share: float = 1.0
    refresh_every: int = 20  # windows between baseline refreshes; 0 never refreshes
    refresh_window: int = 6  # iterations without fill work to re-measure the baseline

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"GuardConfig.{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name: str, low: int) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"GuardConfig.{name} must be an integer >= {low}, got {v!r}")
            return v

        if not 0 < number("budget") < 1:
            raise ValueError(f"GuardConfig.budget must be in (0, 1), e.g. 0.01 for 1%, got {self.budget!r}")
        integer("window", 1)
        if not 0 < number("increase") <= 1:
            raise ValueError(f"GuardConfig.increase must be in (0, 1], got {self.increase!r}")
        if not 0 < number("decrease") < 1:
            raise ValueError(
                "GuardConfig.decrease must be in (0, 1): the share is multiplied by it, "
                f"got {self.decrease!r}"
            )
        lo, hi, init = number("min_share"), number("max_share"), number("initial_share")
        if not 0 <= lo <= init <= hi <= 1:  # max_share 0: no fill work at all (a training's maxFillShare: 0)
            raise ValueError(
                "GuardConfig needs 0 <= min_share <= initial_share <= max_share <= 1, "
                f"got min_share={lo}, initial_share={init}, max_share={hi}"
            )
        integer("refresh_every", 0)
        # The first paused iteration is discarded, so at least one more must be measured.
        integer("refresh_window", 2)


@dataclass(frozen=True)
class GuardDecision:
    """What the agent should do for the next iterations."""

    share: float  # fraction of each bubble fill work may use
    fill_paused: bool  # True while the baseline is being re-measured: run no fill work at all
    slowdown: float | None  # measured at the window that just ended; None if no window ended
    reason: str


class _Phase(enum.Enum):
    HARVEST = "harvest"
    REFRESH = "refresh"


class SlowdownGuard:
    """Adjusts the fill share from observed iteration times so the training slowdown stays in budget."""

    def __init__(self, baseline_s: float, config: GuardConfig | None = None) -> None:
        self.baseline_s = _check_duration("baseline_s", baseline_s)
        self.config = config if config is not None else GuardConfig()
        self.share = self.config.initial_share
        # (iteration index, share after the event, slowdown measured or None for a baseline refresh)
        self.history: list[tuple[int, float, float | None]] = []
        self._iterations = 0
        self._windows = 0  # harvesting windows decided
        self._phase = _Phase.HARVEST
        self._window: list[float] = []
        self._refresh: list[float] = []  # iterations seen in the current refresh, transition included

    def retune(self, config: GuardConfig) -> None:
        """Take new limits (budget, shares) from now on; the baseline and history stay, the share is clamped."""
        self.config = config
        self.share = min(config.max_share, max(config.min_share, self.share))

    @property
    def fill_paused(self) -> bool:
        return self._phase is _Phase.REFRESH

    def observe(self, iteration_s: float) -> GuardDecision:
        """Take one training iteration's duration; return the share and pause state for what follows."""
        iteration_s = _check_duration("iteration_s", iteration_s)
        index = self._iterations
        self._iterations += 1
        if self._phase is _Phase.REFRESH:
            return self._observe_refresh(index, iteration_s)
        return self._observe_harvest(index, iteration_s)

    def slowdown_held(self) -> float | None:
        """Median slowdown over the harvesting windows after the first decision (None before any)."""
        measured = [s for _, _, s in self.history if s is not None][1:]
        return statistics.median(measured) if measured else None

    def _observe_harvest(self, index: int, iteration_s: float) -> GuardDecision:
        cfg = self.config
        self._window.append(iteration_s)
        if len(self._window) < cfg.window:
            return GuardDecision(
                self.share, False, None, f"collecting window ({len(self._window)}/{cfg.window})"
            )
        # The median, not the mean: one iteration slowed by a checkpoint or a GC pause is not fill's fault.
        slowdown = statistics.median(self._window) / self.baseline_s - 1
        self._window.clear()
        before = self.share
        if slowdown > cfg.budget:
            self.share = max(cfg.min_share, self.share * cfg.decrease)
            verdict = "over budget"
        elif slowdown < cfg.budget / 2:
            self.share = min(cfg.max_share, self.share + cfg.increase)
            verdict = "headroom"
        else:
            # Between half the budget and the budget: close enough, and holding avoids oscillating.
            verdict = "within budget"
        self.history.append((index, self.share, slowdown))
        self._windows += 1
        reason = (
            f"slowdown {slowdown:.2%} vs budget {cfg.budget:.2%} ({verdict}): "
            f"share {before:.3f} -> {self.share:.3f}"
        )
        if cfg.refresh_every and self._windows % cfg.refresh_every == 0:
            self._phase = _Phase.REFRESH
            self._refresh.clear()
            return GuardDecision(self.share, True, slowdown, reason + "; pausing fill to re-measure baseline")
        return GuardDecision(self.share, False, slowdown, reason)

    def _observe_refresh(self, index: int, iteration_s: float) -> GuardDecision:
        cfg = self.config
        self._refresh.append(iteration_s)
        if len(self._refresh) < cfg.refresh_window:
            return GuardDecision(
                self.share, True, None, f"baseline refresh ({len(self._refresh)}/{cfg.refresh_window})"
            )
        # The first paused iteration may still hold fill work that was in flight when the pause began.
        measured = self._refresh[1:]
        old = self.baseline_s
        # The new median replaces the old baseline outright, even if higher: a training that got slower
        # on its own must not be blamed on fill work, or the share would collapse to zero for good.
        self.baseline_s = statistics.median(measured)
        self._refresh.clear()
        self._phase = _Phase.HARVEST
        self.history.append((index, self.share, None))
        reason = f"baseline refreshed: {old * 1e3:.1f} ms -> {self.baseline_s * 1e3:.1f} ms"
        return GuardDecision(self.share, False, None, reason)


def _check_duration(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
    return float(v)
