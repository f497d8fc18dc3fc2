"""The slowdown guard: the share of each bubble fill work may use, cut only when fill work measurably slows training.

The guard sees nothing but the training's iteration durations, and they are noisy: on a shared machine an
iteration's time moves by several percent from one second to the next, and the training drifts on its own (warm-up,
data, other tenants). A guard that compares a window of iterations with an old baseline reads that noise and drift as
harm and starves fill work for nothing. So this one separates *noticing* from *deciding*:

1. **Watch** (``HARVEST``): every ``window`` iterations, a sign test asks whether the window's iterations are
   consistently slower than ``baseline * (1 + budget)`` (so many of them above it that chance explains it with
   probability under ``watch_alpha``: 7 of 8 at 5%). Such a window starts a probe; so does every ``raise_every``-th
   window while the share is below its maximum (only a probe may raise it).
2. **Probe** (``PROBE``): a paired experiment. Blocks of iterations with fill work (``ON``) and without (``OFF``)
   alternate in ABBA order, each block's first iteration discarded (work still in flight when the arm switched), the
   rest measured. Each pair gives one relative difference ``on / off - 1``: the harm fill work causes at the current
   share, with whatever the machine did meanwhile hitting both arms alike (ABBA order cancels a linear drift too).
   After ``min_pairs`` pairs, and every ``look_every`` pairs after that, one-sided Wilcoxon signed-rank tests (exact)
   compare the pairs' differences with the budget:

   - harm over the budget at level ``look_alpha`` (2% per look, at most about 5% over a probe's looks): the share is
     cut (multiplicatively, AIMD's back-off);
   - harm under the budget at that level, or no sign of harm over it (the p-value for harm over ``futility``): the
     slowdown, if any, was not fill work's; the share rises one step if it is below its maximum;
   - still undecided after ``max_pairs`` pairs (the harm is about the budget): the share holds.

   Either way the ``OFF`` blocks' median becomes the new baseline, so drift that set off the probe stops setting it
   off.
3. **Refresh** (``REFRESH``): every ``refresh_every`` windows, ``refresh_window`` iterations without fill work
   re-measure the baseline even when nothing looked wrong (a training that got faster would hide harm from the watch).

What it costs: the probe's ``OFF`` blocks and the refreshes run no fill work; the ledger counts those bubbles as
withheld by the guard. Pure: no clocks, no randomness.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

HISTORY = 4096  # guard decisions kept (history, and the slowdowns slowdown_held takes the median of)


@dataclass(frozen=True)
class GuardConfig:
    """How much slowdown the training tolerates and how the guard tells it from noise."""

    budget: float = 0.01  # allowed training slowdown (1%)
    window: int = 8  # iterations per watch decision
    increase: float = 0.1  # additive share increase with headroom
    decrease: float = 0.5  # multiplicative share decrease over budget
    min_share: float = 0.0
    max_share: float = 1.0
    initial_share: float = 1.0
    refresh_every: int = 40  # windows between baseline refreshes; 0 never refreshes
    refresh_window: int = 6  # iterations without fill work to re-measure the baseline
    raise_every: int = 10  # windows between probes that may raise a share below max_share
    watch_alpha: float = 0.05  # a window starts a probe when its sign test is this unlikely without harm
    probe_block: int = 2  # measured iterations per arm of a probe pair (each block also discards one)
    min_pairs: int = 6  # pairs before the paired test first looks
    look_every: int = 3  # pairs between its later looks
    max_pairs: int = 15  # pairs after which an undecided probe holds the share
    look_alpha: float = 0.02  # each look's one-sided level: about 5% over a probe's four looks at most
    futility: float = 0.5  # a look whose p-value for harm is over this ends the probe: no sign of harm

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

        def level(name: str, high: float = 0.5) -> float:
            v = number(name)
            if not 0 < v < high:
                raise ValueError(f"GuardConfig.{name} must be in (0, {high}), e.g. 0.05, got {v!r}")
            return v

        # The watch's sign test must be able to reach its level: all of a window's iterations over the line happen
        # by chance with probability 2**-window.
        least = math.ceil(math.log2(1 / level("watch_alpha")))
        if integer("window", 1) < least:
            raise ValueError(f"GuardConfig.window must be >= {least} for watch_alpha {self.watch_alpha} (a window's "
                             f"sign test cannot be that sure with fewer iterations), got {self.window!r}")
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
        integer("raise_every", 1)
        integer("probe_block", 1)
        # The signed-rank test with n pairs cannot be surer than 1 - 2**-n.
        least_pairs = math.ceil(math.log2(1 / level("look_alpha")))
        if integer("min_pairs", 1) < least_pairs:
            raise ValueError(f"GuardConfig.min_pairs must be >= {least_pairs} for look_alpha {self.look_alpha}, "
                             f"got {self.min_pairs!r}")
        integer("look_every", 1)
        if integer("max_pairs", 1) < self.min_pairs:
            raise ValueError(f"GuardConfig.max_pairs must be >= min_pairs ({self.min_pairs}), got {self.max_pairs!r}")
        if not self.look_alpha < number("futility") <= 1:
            raise ValueError(f"GuardConfig.futility must be in (look_alpha, 1], e.g. 0.5, got {self.futility!r}")


@dataclass(frozen=True)
class GuardDecision:
    """What the agent should do for the next iterations."""

    share: float  # fraction of each bubble fill work may use
    fill_paused: bool  # True while the next iteration must run no fill work (a probe's OFF block, a refresh)
    slowdown: float | None  # measured when a window or a probe ended; None otherwise
    reason: str
    event: str | None = None  # a change worth an event: a probe started or decided, a refresh began or ended


class _Phase(enum.Enum):
    HARVEST = "harvest"
    PROBE = "probe"
    REFRESH = "refresh"


class SlowdownGuard:
    """Adjusts the fill share from observed iteration times so the training slowdown stays in budget."""

    def __init__(self, baseline_s: float, config: GuardConfig | None = None) -> None:
        self.baseline_s = _check_duration("baseline_s", baseline_s)
        self.config = config if config is not None else GuardConfig()
        self.share = self.config.initial_share
        # (iteration index, share after the event, slowdown measured; None for a baseline refresh). A watch window
        # records its median against the baseline; a probe the median of its pairs' differences.
        # The latest HISTORY of them (an agent runs for weeks: about 54,000 a day at 5 iterations a second).
        self.history: deque[tuple[int, float, float | None]] = deque(maxlen=HISTORY)
        self._measured: deque[float] = deque(maxlen=HISTORY)  # their slowdowns, after the first decision's
        self._decided = False
        self.probes = {"cut": 0, "clear": 0, "undecided": 0}
        self._iterations = 0
        self._windows = 0  # watch windows decided
        self._since_probe = 0  # watch windows since the last probe
        self._phase = _Phase.HARVEST
        self._window: list[float] = []
        self._refresh: list[float] = []  # iterations seen in the current refresh, transition included
        self._block: list[float] = []  # iterations of the current probe block, transition included
        self._arms: dict[bool, list[float]] = {}  # measured iterations of the current pair, by arm (True: ON)
        self._diffs: list[float] = []  # the probe's paired differences
        self._off: list[float] = []  # every measured OFF iteration of the probe
        self._unfilled: list[float] = []  # the latest iterations run with the fill mode off (observe_unfilled)

    @property
    def fill_paused(self) -> bool:
        return self._phase is _Phase.REFRESH or (self._phase is _Phase.PROBE and not self._block_on)

    @property
    def phase(self) -> str:
        """``harvest`` (watching), ``probe`` or ``refresh``."""
        return self._phase.value

    @property
    def iterations(self) -> int:
        """Iterations observed so far."""
        return self._iterations

    def retune(self, config: GuardConfig) -> None:
        """Take new limits (budget, shares) from now on; the baseline and history stay, the share is clamped."""
        self.config = config
        self.share = min(config.max_share, max(config.min_share, self.share))

    def observe(self, iteration_s: float) -> GuardDecision:
        """Take one training iteration's duration; return the share and pause state for what follows."""
        iteration_s = _check_duration("iteration_s", iteration_s)
        index = self._iterations
        self._iterations += 1
        if self._phase is _Phase.REFRESH:
            return self._observe_refresh(index, iteration_s)
        if self._phase is _Phase.PROBE:
            return self._observe_probe(index, iteration_s)
        return self._observe_harvest(index, iteration_s)

    def observe_unfilled(self, iteration_s: float) -> None:
        """An iteration that ran with no fill work at all for reasons of its own (the fill mode was off): while
        watching, the last ``refresh_window - 1`` of them are the baseline, as a refresh would measure it."""
        iteration_s = _check_duration("iteration_s", iteration_s)
        if self._phase is not _Phase.HARVEST:
            return
        self._unfilled.append(iteration_s)
        del self._unfilled[:-(self.config.refresh_window - 1)]
        self.baseline_s = statistics.median(self._unfilled)
        self._window.clear()  # a window must not straddle a stretch without fill work

    def slowdown_held(self) -> float | None:
        """Median slowdown over the measurements after the first decision, the latest HISTORY of them (None before
        any)."""
        return statistics.median(self._measured) if self._measured else None

    def _record(self, index: int, slowdown: float | None) -> None:
        """One decision in the history: the share after it and the slowdown it measured (None: a refresh)."""
        self.history.append((index, self.share, slowdown))
        if slowdown is not None:
            if self._decided:
                self._measured.append(slowdown)
            self._decided = True

    # -- watch ------------------------------------------------------------------------------------------------
    def _observe_harvest(self, index: int, iteration_s: float) -> GuardDecision:
        cfg = self.config
        self._window.append(iteration_s)
        if len(self._window) < cfg.window:
            return GuardDecision(
                self.share, False, None, f"collecting window ({len(self._window)}/{cfg.window})"
            )
        # The median, not the mean: one iteration slowed by a checkpoint or a GC pause is not fill's fault.
        window, self._window = self._window, []
        slowdown = statistics.median(window) / self.baseline_s - 1
        above = sum(t > self.baseline_s * (1 + cfg.budget) for t in window)
        p_slow = sign_test_p(above, len(window))
        self._windows += 1
        head = f"window {slowdown:+.2%} vs budget {cfg.budget:.2%} ({above}/{cfg.window} over it, p={p_slow:.3f})"
        suspicious = p_slow < cfg.watch_alpha
        if suspicious and self.share <= cfg.min_share:
            # Nothing left to cut (or no fill work to compare): only the baseline can be wrong.
            self._record(index, slowdown)
            self._phase = _Phase.REFRESH
            self._refresh.clear()
            return GuardDecision(self.share, True, slowdown, f"{head}: at the least share; re-measuring baseline",
                                 event="baseline refresh: fill paused")
        if suspicious:
            self._record(index, slowdown)
            self._start_probe()
            return GuardDecision(self.share, self.fill_paused, slowdown,
                                 f"{head}: probing with and without fill work before deciding",
                                 event=f"slowdown {slowdown:+.2%} over the {cfg.budget:.2%} budget: probing")
        self._record(index, slowdown)
        self._since_probe += 1
        if self.share < cfg.max_share and self._since_probe >= cfg.raise_every:
            # Only a paired probe raises the share: a window's median against a baseline measured minutes ago is as
            # likely to read noise as headroom.
            self._start_probe()
            return GuardDecision(self.share, self.fill_paused, slowdown,
                                 f"{head}: probing whether the share can rise above {self.share:.3f}",
                                 event=f"probing whether the share can rise above {self.share:.3f}")
        reason = f"{head}: holding share {self.share:.3f}"
        if cfg.refresh_every and self._windows % cfg.refresh_every == 0:
            self._phase = _Phase.REFRESH
            self._refresh.clear()
            return GuardDecision(self.share, True, slowdown, reason + "; pausing fill to re-measure baseline",
                                 event="baseline refresh: fill paused")
        return GuardDecision(self.share, False, slowdown, reason)

    # -- probe ------------------------------------------------------------------------------------------------
    @property
    def _block_on(self) -> bool:
        """The arm of the current block: ABBA order (pair 0 ON then OFF, pair 1 OFF then ON, ...)."""
        pair = len(self._diffs)
        first_on = pair % 2 == 0
        return first_on if not self._arms else not first_on

    def _start_probe(self) -> None:
        self._since_probe = 0
        self._phase = _Phase.PROBE
        self._block.clear()
        self._arms = {}
        self._diffs = []
        self._off = []

    def _observe_probe(self, index: int, iteration_s: float) -> GuardDecision:
        cfg = self.config
        self._block.append(iteration_s)
        if len(self._block) < 1 + cfg.probe_block:
            return GuardDecision(self.share, self.fill_paused, None,
                                 f"probe pair {len(self._diffs) + 1}: {'with' if self._block_on else 'without'} "
                                 f"fill work ({len(self._block)}/{1 + cfg.probe_block})")
        on = self._block_on
        measured = self._block[1:]  # the first iteration may hold work from the other arm
        self._block.clear()
        self._arms[on] = measured
        if not on:
            self._off.extend(measured)
        if len(self._arms) < 2:
            return GuardDecision(self.share, self.fill_paused, None, f"probe pair {len(self._diffs) + 1}: switching")
        self._diffs.append(statistics.fmean(self._arms[True]) / statistics.fmean(self._arms[False]) - 1)
        self._arms = {}
        n = len(self._diffs)
        if n < cfg.min_pairs or ((n - cfg.min_pairs) % cfg.look_every and n < cfg.max_pairs):
            return GuardDecision(self.share, self.fill_paused, None, f"probe: {n} pairs")
        excess = [d - cfg.budget for d in self._diffs]
        p_harm = signed_rank_p(excess, greater=True)
        p_fine = signed_rank_p(excess, greater=False)
        alpha = cfg.look_alpha
        harm = statistics.median(self._diffs)
        before = self.share
        if p_harm < alpha:
            # Rounded: steps of 0.1 back up from a cut would otherwise stop at 0.9999999999999999, not the full share.
            self.share = max(cfg.min_share, round(self.share * cfg.decrease, 9))
            verdict, outcome = f"harm over budget (p={p_harm:.3f})", "cut"
        elif p_fine < alpha or p_harm > cfg.futility:
            # No harm over the budget at this share: what looked slow was drift or noise. One step up if allowed.
            self.share = min(cfg.max_share, round(self.share + cfg.increase, 9))
            verdict = (f"harm under budget (p={p_fine:.3f})" if p_fine < alpha
                       else f"no sign of harm over budget (p={p_harm:.3f})")
            outcome = "clear"
        elif n >= cfg.max_pairs:
            verdict, outcome = f"undecided after {n} pairs (p={p_harm:.3f} over, {p_fine:.3f} under)", "undecided"
        else:
            return GuardDecision(self.share, self.fill_paused, None,
                                 f"probe: {n} pairs, harm {harm:+.2%}, undecided (p={p_harm:.3f} over, "
                                 f"{p_fine:.3f} under)")
        self.probes[outcome] += 1
        old = self.baseline_s
        self.baseline_s = statistics.median(self._off)
        self._phase = _Phase.HARVEST
        self._window.clear()
        self._record(index, harm)
        reason = (f"probe of {n} pairs: harm {harm:+.2%} vs budget {cfg.budget:.2%}, {verdict}: share "
                  f"{before:.3f} -> {self.share:.3f}; baseline {old * 1e3:.1f} -> {self.baseline_s * 1e3:.1f} ms")
        return GuardDecision(self.share, False, harm, reason, event=f"probe {outcome}: {reason}")

    # -- refresh ----------------------------------------------------------------------------------------------
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
        self._record(index, None)
        reason = f"baseline refreshed: {old * 1e3:.1f} ms -> {self.baseline_s * 1e3:.1f} ms"
        return GuardDecision(self.share, False, None, reason, event=f"{reason}: fill resumed")


# -- the tests, exact and pure ------------------------------------------------------------------------------------
def sign_test_p(above: int, n: int) -> float:
    """P(at least ``above`` of ``n`` fair coin flips come up heads): how surprising it is that so many iterations
    lie over a line their median would sit on."""
    if not 0 <= above <= n:
        raise ValueError(f"above must be in [0, {n}], got {above}")
    return sum(math.comb(n, k) for k in range(above, n + 1)) / 2**n


def signed_rank_p(diffs: Sequence[float], *, greater: bool) -> float:
    """One-sided exact p-value of the Wilcoxon signed-rank test that the differences' median is above 0
    (``greater``) or below it. Zeros are dropped (Wilcoxon's convention); tied magnitudes get their average rank.
    With no non-zero difference the p-value is 1."""
    xs = [d for d in diffs if d != 0]
    n = len(xs)
    if n == 0:
        return 1.0
    order = sorted(range(n), key=lambda i: abs(xs[i]))
    twice_rank = [0] * n  # ranks doubled, so averaged ties stay integers
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(xs[order[j + 1]]) == abs(xs[order[i]]):
            j += 1
        for k in range(i, j + 1):
            twice_rank[order[k]] = i + j + 2  # 2 * average of ranks i+1 .. j+1
        i = j + 1
    observed = sum(r for r, x in zip(twice_rank, xs, strict=True) if (x > 0) == greater)
    # The null distribution of the sum of (doubled) ranks given a random sign each: by dynamic programming.
    counts = {0: 1}
    for r in twice_rank:
        nxt = dict(counts)
        for total, c in counts.items():
            nxt[total + r] = nxt.get(total + r, 0) + c
        counts = nxt
    return sum(c for total, c in counts.items() if total >= observed) / 2**n


def _check_duration(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
    return float(v)
