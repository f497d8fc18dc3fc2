"""The execution plan (PipeFill Algorithm 1): constraints, coverage, optimality, errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbles.core.cycle import BubbleCycle, BubbleSlot
from bubbles.core.plan import (
    Bubble,
    FillNode,
    PlanError,
    bubbles_of,
    min_bubbles_bruteforce,
    plan_partitions,
    plan_wall_time_s,
    replicas_for,
)

GIB = 2**30

bubble_st = st.builds(
    Bubble,
    duration_s=st.integers(0, 10).map(lambda t: t / 10),
    free_bytes=st.integers(0, 4),
)
node_st = st.builds(
    FillNode,
    duration_s=st.integers(1, 6).map(lambda t: t / 10),
    memory_bytes=st.integers(0, 4),
)


def _fits_somewhere(bubbles: list[Bubble], nodes: list[FillNode]) -> bool:
    return all(
        any(n.duration_s <= b.duration_s and n.memory_bytes <= b.free_bytes for b in bubbles) for n in nodes
    )


@settings(max_examples=300, deadline=None)
@given(
    bubbles=st.lists(bubble_st, min_size=1, max_size=4),
    nodes=st.lists(node_st, min_size=1, max_size=5),
    steps=st.integers(1, 3),
)
def test_plan_respects_bubbles_covers_chain_and_is_optimal(
    bubbles: list[Bubble], nodes: list[FillNode], steps: int
) -> None:
    if not _fits_somewhere(bubbles, nodes):
        with pytest.raises(PlanError):
            plan_partitions(bubbles, nodes, steps)
        return
    plan = plan_partitions(bubbles, nodes, steps)
    assert plan.steps == steps and plan.nodes_per_step == len(nodes)
    expected_next = 0
    prev_index = -1
    for p in plan.partitions:
        b = bubbles[p.bubble]
        chain = [nodes[i % len(nodes)] for i in range(p.first_node, p.last_node + 1)]
        assert p.duration_s <= b.duration_s * (1 + 1e-9)
        assert p.memory_bytes <= b.free_bytes
        assert p.memory_bytes == max(n.memory_bytes for n in chain)
        assert math.isclose(p.duration_s, sum(n.duration_s for n in chain))
        # In order, each node exactly once, one partition per bubble at most.
        assert p.first_node == expected_next
        expected_next = p.last_node + 1
        index = p.cycle * len(bubbles) + p.bubble
        assert index > prev_index
        prev_index = index
        assert p.bubble in plan.usable_bubbles()
    assert expected_next == steps * len(nodes)
    assert plan.cycles == math.ceil(plan.bubbles_consumed / len(bubbles))
    assert plan.bubbles_consumed == min_bubbles_bruteforce(bubbles, nodes, steps)


def test_hand_example() -> None:
    bubbles = [Bubble(0.3, 10, "a"), Bubble(0.1, 1, "b"), Bubble(0.5, 10, "c")]
    nodes = [FillNode(0.2, 5), FillNode(0.1, 1)]
    plan = plan_partitions(bubbles, nodes, steps=2)
    assert [(p.cycle, p.bubble, p.first_node, p.last_node) for p in plan.partitions] == [
        (0, 0, 0, 1),  # 0.2 + 0.1 fills "a" exactly: <= not <
        (0, 2, 2, 3),  # "b" lacks memory for node 2: skipped, consumed
    ]
    assert plan.bubbles_used == 2
    assert plan.bubbles_consumed == 3
    assert plan.cycles == 1
    assert plan.steps_per_cycle() == 2.0
    assert plan.usable_bubbles() == frozenset({0, 1, 2})
    assert plan_wall_time_s(plan, 2.0) == 2.0


def test_plan_wraps_around_cycles() -> None:
    plan = plan_partitions([Bubble(0.1, 1)], [FillNode(0.1, 1)], steps=3)
    assert [(p.cycle, p.bubble) for p in plan.partitions] == [(0, 0), (1, 0), (2, 0)]
    assert plan.cycles == 3 and plan.bubbles_consumed == 3
    assert plan.steps_per_cycle() == 1.0
    assert plan_wall_time_s(plan, 1.5) == pytest.approx(4.5)


def test_algorithm1_replication_when_steps_is_none() -> None:
    bubbles = [Bubble(0.2, 1), Bubble(0.1, 1)]
    nodes = [FillNode(0.05, 1), FillNode(0.05, 1)]
    # 0.3 s of bubble per cycle, 0.1 s per step: three whole steps (float rounding must not cost one).
    assert replicas_for(bubbles, nodes) == 3
    plan = plan_partitions(bubbles, nodes)
    assert plan.steps == 3
    assert plan.cycles == 1
    # A step longer than all bubble time together still plans one step.
    assert plan_partitions([Bubble(0.1, 1)], [FillNode(0.1, 1)] * 3).steps == 1


def test_bubbles_of_cycle_labels() -> None:
    slot = BubbleSlot(3, 17, "RecvGrad", "fwd-bwd", 0.0081, 0.007, 0.009, 2 * GIB)
    cycle = BubbleCycle("t", 0, 2, 4, "TrainSchedule", 0.1, (slot,), 5)
    assert bubbles_of(cycle) == (Bubble(0.0081, 2 * GIB, "stage 0 slot 3 (RecvGrad, fwd-bwd)"),)


CYCLE = [
    Bubble(0.0081, 3 * GIB, "stage 0 slot 3 (RecvGrad, fwd-bwd)"),
    Bubble(0.020, 2 * GIB, "stage 0 slot 5 (LossBroadcast, drain)"),
]


def test_plan_error_neither_both() -> None:
    with pytest.raises(PlanError) as e:
        plan_partitions(CYCLE, [FillNode(0.012, 3 * GIB)], job="resnet")
    msg = str(e.value)
    assert "fill job 'resnet' needs 12.0 ms and 3.00 GiB for node 0" in msg
    assert "longest bubble with enough memory is stage 0 slot 3 (RecvGrad, fwd-bwd) at 8.1 ms" in msg
    assert "stage 0 slot 5 (LossBroadcast, drain)) has 2.00 GiB free" in msg
    assert "Lower the batch size" in msg
    assert e.value.job == "resnet" and e.value.node == 0


def test_plan_error_too_long() -> None:
    longest = r"node 1 .*no bubble is long enough: the longest is stage 0 slot 5 .* at 20\.0 ms"
    with pytest.raises(PlanError, match=longest):
        plan_partitions(CYCLE, [FillNode(0.001, 1), FillNode(0.5, 1)], job="bert")


def test_plan_error_too_big() -> None:
    roomiest = r"node 0 .*no bubble has enough memory: the roomiest is stage 0 slot 3"
    with pytest.raises(PlanError, match=roomiest):
        plan_partitions(CYCLE, [FillNode(0.001, 8 * GIB)])


def test_plan_error_too_long_and_too_big() -> None:
    with pytest.raises(PlanError, match="too short and too small"):
        plan_partitions(CYCLE, [FillNode(1.0, 8 * GIB)], job="x")


@pytest.mark.parametrize(
    ("bubbles", "nodes", "steps", "match"),
    [
        ([], [FillNode(0.1, 1)], 1, "no bubbles"),
        ([Bubble(0.1, 1)], [], 1, "no nodes"),
        ([Bubble(-0.1, 1)], [FillNode(0.1, 1)], 1, "bubble 0"),
        ([Bubble(float("nan"), 1)], [FillNode(0.1, 1)], 1, "bubble 0"),
        ([Bubble(0.1, -1)], [FillNode(0.1, 1)], 1, "free_bytes"),
        ([Bubble(0.1, 1)], [FillNode(0.0, 1)], 1, "node 0 needs a finite duration_s > 0"),
        ([Bubble(0.1, 1)], [FillNode(float("inf"), 1)], 1, "node 0"),
        ([Bubble(0.1, 1)], [FillNode(0.1, -5)], 1, "memory_bytes"),
        ([Bubble(0.1, 1)], [FillNode(0.1, 1)], 0, "steps must be an integer >= 1"),
    ],
)
def test_bad_inputs_rejected(bubbles: list[Bubble], nodes: list[FillNode], steps: int, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        plan_partitions(bubbles, nodes, steps)
    assert not isinstance(e.value, PlanError)


def test_wall_time_rejects_bad_iteration() -> None:
    plan = plan_partitions([Bubble(0.1, 1)], [FillNode(0.1, 1)], steps=1)
    with pytest.raises(ValueError, match="cycle_iteration_s"):
        plan_wall_time_s(plan, 0.0)
