"""The leader-election rule, pure: who creates, renews, takes over or waits (expiry by this replica's own clock)."""

from __future__ import annotations

from bubbles.operator.leader import decide_lease

HELD = {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "2000-01-01T00:00:00.000000Z"}


def test_no_lease_is_created_and_our_own_is_renewed() -> None:
    assert decide_lease(None, "b", 0.0) == "create"
    assert decide_lease(HELD, "a", 100.0) == "renew"


def test_another_holders_lease_is_taken_only_after_it_stood_still_for_its_duration_by_our_clock() -> None:
    # The renewTime is years old by this machine's wall clock: a skewed clock on either side must not matter.
    assert decide_lease(HELD, "b", 0.0) == "wait"
    assert decide_lease(HELD, "b", 15.0) == "wait"
    assert decide_lease(HELD, "b", 15.1) == "take"


def test_a_released_lease_is_taken_at_once() -> None:
    assert decide_lease({**HELD, "holderIdentity": None}, "b", 0.0) == "take"
    assert decide_lease({**HELD, "holderIdentity": ""}, "b", 0.0) == "take"
