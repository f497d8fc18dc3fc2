"""The operator process's garbage collector (``Operator._collect``): each round ends with what is alive frozen, and
at most every ``gc_full_s`` the frozen objects are let go and collected whole; off (Python's collector as it is) where
``gc_full_s`` is 0, as in every test that runs an operator inside pytest's process."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from bubbles.operator import shell
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.kube import Connection
from bubbles.operator.shell import GC_YOUNG, Operator, OperatorConfig


@pytest.fixture
def collector() -> Iterator[None]:
    """What this process's collector was, restored after the test (a frozen pytest process would keep its cycles)."""
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def operator(gc_full_s: float) -> Operator:
    return Operator(OperatorConfig(gc_full_s=gc_full_s), Connection("http://127.0.0.1:9", insecure=True),
                    InMemoryAgents())


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_off_leaves_the_collector_as_it_is(collector: None) -> None:
    gc.unfreeze()
    op = operator(0.0)
    before = gc.get_threshold()
    op._collect()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_a_round_freezes_what_is_alive_and_a_full_collection_comes_at_its_interval(
        collector: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    clock = [1000.0]
    monkeypatch.setattr(shell.time, "monotonic", lambda: clock[0])
    op = operator(300.0)
    op._gc_full_at = clock[0]
    garbage = Cycle()
    op._collect()  # a round ends
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GC_YOUNG
    seen = {id(o) for o in gc.get_objects()}
    assert id(garbage) not in seen  # frozen: the young generations no longer hold it
    del garbage
    clock[0] += 299.0
    op._collect()
    assert gc.get_freeze_count() > 0
    clock[0] += 1.0  # the interval is over: unfrozen, collected whole (the cycle goes), frozen again
    collected: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            collected.append(info["collected"])

    gc.callbacks.append(count)
    try:
        op._collect()
    finally:
        gc.callbacks.remove(count)
    assert collected and collected[0] >= 1, collected
    assert op._gc_full_at == clock[0] and gc.get_freeze_count() > 0
