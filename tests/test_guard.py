"""The slowdown guard against synthetic trainings whose slowdown depends on the fill share."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from bubbles.agent.guard import GuardConfig, GuardDecision, SlowdownGuard


def drive(
    guard: SlowdownGuard,
    iterations: int,
    cost: Callable[[int, float], float],
    seed: int = 0,
    noise: float = 0.002,
) -> list[GuardDecision]:
    """Run a synthetic training: each iteration's time is cost(i, share in effect) plus noise."""
    rng = random.Random(seed)
    share, paused = guard.share, False
    decisions = []
    for i in range(iterations):
        effective = 0.0 if paused else share
        d = guard.observe(cost(i, effective) * (1 + rng.uniform(-noise, noise)))
        share, paused = d.share, d.fill_paused
        decisions.append(d)
    return decisions


def linear(per_share: float, base_s: float = 1.0) -> Callable[[int, float], float]:
    return lambda _i, share: base_s * (1 + per_share * share)


def test_headroom_keeps_full_share() -> None:
    guard = SlowdownGuard(1.0, GuardConfig(budget=0.01))
    drive(guard, 400, linear(0.005))  # 0.5% at full share: below half the budget
    assert guard.share == 1.0
    held = guard.slowdown_held()
    assert held is not None and held <= 0.01


def test_settles_within_budget_with_positive_share() -> None:
    guard = SlowdownGuard(1.0, GuardConfig(budget=0.01))
    drive(guard, 800, linear(0.05), seed=1)  # 5% at full share: about 20% share is affordable
    held = guard.slowdown_held()
    assert held is not None and held <= 0.01 + 0.003
    assert 0 < guard.share <= 0.3
    # After settling, no window goes far over budget.
    late = [s for _, _, s in guard.history[len(guard.history) // 2 :] if s is not None]
    assert max(late) <= 0.015


def test_over_budget_reduces_share_multiplicatively() -> None:
    guard = SlowdownGuard(1.0, GuardConfig(budget=0.01, window=4, refresh_every=0))
    decisions = drive(guard, 4, lambda _i, _s: 1.05, noise=0)
    assert decisions[-1].share == 0.5
    assert decisions[-1].slowdown == pytest.approx(0.05)
    assert "over budget" in decisions[-1].reason
    assert all(d.slowdown is None for d in decisions[:-1])
    drive(guard, 4, lambda _i, _s: 1.05, noise=0)
    assert guard.share == 0.25


def test_hold_between_half_budget_and_budget_then_increase() -> None:
    cfg = GuardConfig(budget=0.01, window=2, initial_share=0.5, refresh_every=0)
    guard = SlowdownGuard(1.0, cfg)
    drive(guard, 2, lambda _i, _s: 1.007, noise=0)
    assert guard.share == 0.5
    drive(guard, 2, lambda _i, _s: 1.001, noise=0)
    assert guard.share == pytest.approx(0.6)


def test_share_respects_bounds() -> None:
    cfg = GuardConfig(window=1, min_share=0.2, max_share=0.8, initial_share=0.5, refresh_every=0)
    guard = SlowdownGuard(1.0, cfg)
    drive(guard, 20, lambda _i, _s: 2.0, noise=0)
    assert guard.share == 0.2
    drive(guard, 20, lambda _i, _s: 1.0, noise=0)
    assert guard.share == 0.8


def test_refresh_pauses_for_exactly_refresh_window_iterations() -> None:
    cfg = GuardConfig(window=4, refresh_every=3, refresh_window=5)
    guard = SlowdownGuard(1.0, cfg)
    decisions = drive(guard, 4 * 3 + 5 + 4, lambda _i, _s: 1.0, noise=0)
    paused = [i for i, d in enumerate(decisions) if d.fill_paused]
    # The decision after the 3rd window pauses fill; the 5th paused iteration ends the refresh.
    assert paused == list(range(11, 16))
    assert not decisions[16].fill_paused and "baseline refreshed" in decisions[16].reason
    assert guard.history[3] == (16, guard.share, None)


def test_refresh_discards_transition_iteration_and_follows_drift() -> None:
    cfg = GuardConfig(window=2, refresh_every=1, refresh_window=3)
    guard = SlowdownGuard(1.0, cfg)
    drive(guard, 2, lambda _i, _s: 1.0, noise=0)
    assert guard.fill_paused
    guard.observe(5.0)  # fill work still draining: must not count
    guard.observe(1.2)
    d = guard.observe(1.2)
    assert not d.fill_paused and guard.baseline_s == pytest.approx(1.2)


def test_baseline_drift_is_not_blamed_on_fill() -> None:
    # Fill costs 0.5% at full share; at iteration 200 the training itself gets 4% slower.
    def cost(i: int, share: float) -> float:
        return (1.0 if i < 200 else 1.04) * (1 + 0.005 * share)

    cfg = GuardConfig(budget=0.01, window=8, refresh_every=10, refresh_window=6)
    guard = SlowdownGuard(1.0, cfg)
    drive(guard, 200, cost)
    assert guard.share == 1.0
    drive(guard, 600, cost, seed=2)
    # Right after the drift the share collapses; the next refresh re-bases and the share recovers.
    assert min(s for _, s, _ in guard.history) < 0.5
    assert guard.baseline_s == pytest.approx(1.04, rel=0.005)
    assert guard.share == 1.0


def test_without_refresh_drift_starves_fill() -> None:
    guard = SlowdownGuard(1.0, GuardConfig(refresh_every=0))
    drive(guard, 400, lambda _i, share: 1.04 * (1 + 0.005 * share))
    assert guard.share < 0.01
    assert not any(d.fill_paused for d in drive(guard, 50, lambda _i, _s: 1.04))


def test_slowdown_held_none_before_two_windows() -> None:
    guard = SlowdownGuard(1.0, GuardConfig(window=2))
    assert guard.slowdown_held() is None
    drive(guard, 2, lambda _i, _s: 1.0, noise=0)
    assert guard.slowdown_held() is None
    drive(guard, 2, lambda _i, _s: 1.02, noise=0)
    assert guard.slowdown_held() == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": 0.0}, r"budget must be in \(0, 1\)"),
        ({"budget": 1.5}, "budget"),
        ({"budget": float("nan")}, "budget must be a finite number"),
        ({"window": 0}, "window must be an integer >= 1"),
        ({"window": 2.5}, "window"),
        ({"increase": 0.0}, "increase"),
        ({"decrease": 1.0}, "decrease must be in"),
        ({"min_share": 0.5, "initial_share": 0.2}, "min_share <= initial_share"),
        ({"min_share": -0.1}, "0 <= min_share"),
        ({"max_share": 1.5}, "max_share"),
        ({"refresh_every": -1}, "refresh_every"),
        ({"refresh_window": 1}, "refresh_window must be an integer >= 2"),
    ],
)
def test_invalid_config(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GuardConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True])
def test_invalid_durations(bad: float) -> None:
    with pytest.raises(ValueError, match="baseline_s"):
        SlowdownGuard(bad)
    guard = SlowdownGuard(1.0)
    with pytest.raises(ValueError, match="iteration_s must be a finite number of seconds > 0"):
        guard.observe(bad)
