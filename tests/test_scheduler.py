"""The fill-job scheduler: policies, registry, placement invariants, ETA and deadline queries."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbles.core.api import WorkloadKind
from bubbles.core.plan import Bubble, FillNode
from bubbles.operator.scheduler import (
    ExecutorClass,
    FillConfig,
    FillJobRequest,
    FillProfile,
    Scheduler,
    UnknownPolicyError,
    WeightedPolicy,
    available_policies,
    get_policy,
)
from bubbles.operator.scheduler import policies as pol_mod

GIB = 2**30


def profile(name: str, step_s: float, mem_gib: float, nodes: int = 4, batch: int = 4) -> FillProfile:
    node = FillNode(step_s / nodes, int(mem_gib * GIB))
    return FillProfile(name, WorkloadKind.TRAINING, 1e9, 100.0, (FillConfig(f"bs{batch}", batch, (node,) * nodes),))


def two_classes(n0: int = 2, n1: int = 2) -> list[ExecutorClass]:
    return [
        ExecutorClass("a", (Bubble(0.5, 4 * GIB), Bubble(0.2, 4 * GIB)), 2.0, n0),
        ExecutorClass("b", (Bubble(0.3, 2 * GIB),), 1.5, n1),
    ]


SMALL = profile("small", 0.05, 1.0)
BIG = profile("big", 0.2, 3.0)  # fits class a only (memory)


def test_builtins_are_registered_and_unknown_names_list_them() -> None:
    names = available_policies()
    assert {"fifo", "sjf", "makespan", "deadline"} <= set(names)
    with pytest.raises(UnknownPolicyError, match=r"known policies: .*fifo.*sjf"):
        get_policy("shortest")
    with pytest.raises(UnknownPolicyError, match=r"0.7\*deadline"):
        get_policy("0.7*deadline+oops!")
    w = get_policy("0.7*deadline+0.3*fifo")
    assert isinstance(w, WeightedPolicy) and [p.name for _, p in w.parts] == ["deadline", "fifo"]


def test_entry_points_win_and_builtins_fill_only_the_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    class EP:
        def __init__(self, name: str, value: str, obj: object) -> None:
            self.name, self.value, self._obj = name, value, obj

        def load(self) -> object:
            return self._obj

    def longest(job, state, i):  # a plain function is a policy
        return max(job.proc_times_s)

    eps = [EP("longest", "thirdparty:longest", longest), EP("fifo", "thirdparty:fifo", pol_mod.FifoPolicy)]
    monkeypatch.setattr(pol_mod, "entry_points", lambda group: eps if group == "bubbles.policies" else [])
    names = available_policies()
    assert names["longest"] == "thirdparty:longest" and names["fifo"] == "thirdparty:fifo"
    assert names["sjf"] == pol_mod.BUILTIN_POLICIES["sjf"]  # missing entry point: built-in fallback
    s = Scheduler(two_classes(1, 0 + 1), "longest")
    s.submit(FillJobRequest("s", SMALL, 40), 0.0, place=False)
    s.submit(FillJobRequest("b", BIG, 40), 0.0, place=False)
    assert s.dispatch(0.0)[0].job.job_id == "b"


def test_processing_time_comes_from_the_plan_and_per_class() -> None:
    s = Scheduler(two_classes(), "fifo")
    # class a: 0.7 s of bubbles per 2 s iteration; SMALL's 0.05 s step in 4 nodes -> 14 steps per cycle
    proc = s.processing_times_s(FillJobRequest("x", SMALL, 4 * 28))
    assert proc[0] == pytest.approx(28 / 14 * 2.0)
    assert proc[1] == pytest.approx(28 / 6 * 1.5)
    assert math.isinf(s.processing_times_s(FillJobRequest("y", BIG, 4))[1])


def test_fastest_fitting_configuration_is_chosen() -> None:
    fast_big = FillConfig("bs32", 32, (FillNode(0.01, 8 * GIB),) * 4)  # fits no bubble
    slow = FillConfig("bs8", 8, (FillNode(0.01, 1 * GIB),) * 4)
    slower = FillConfig("bs2", 2, (FillNode(0.01, 1 * GIB),) * 4)
    prof = FillProfile("m", WorkloadKind.BATCH_INFERENCE, 1e9, 10.0, (fast_big, slower, slow))
    s = Scheduler(two_classes(), "fifo")
    rate = s.rate(0, prof)
    assert rate is not None and rate.config.name == "bs8"


def test_job_fitting_no_bubble_is_refused_with_advice() -> None:
    s = Scheduler(two_classes(), "fifo")
    huge = profile("huge", 0.1, 9.0)
    with pytest.raises(ValueError, match=r"fits the bubbles of no executor.*offload"):
        s.submit(FillJobRequest("h", huge, 10), 0.0)
    s.submit(FillJobRequest("a", SMALL, 10), 0.0)
    with pytest.raises(ValueError, match="unique id"):
        s.submit(FillJobRequest("a", SMALL, 10), 0.0)


def test_a_jobs_setup_time_holds_its_executor_before_its_steps() -> None:
    s = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "fifo")
    p = s.submit(FillJobRequest("slow-start", SMALL, 40, setup_s=2.5), 0.0)  # 1 s of steps after 2.5 s of setup
    assert p is not None and p.end_s == pytest.approx(3.5)
    s.submit(FillJobRequest("next", SMALL, 40), 0.0)
    assert s.expected_completions(0.0) == pytest.approx({"slow-start": 3.5, "next": 4.5})
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="setup time must be a finite number of seconds >= 0"):
            FillJobRequest("bad", SMALL, 40, setup_s=bad)


def test_eta_and_deadline_queries() -> None:
    s = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "fifo")
    # 0.05 s step -> 10 steps per 1 s cycle: 40 samples (10 steps) take 1 s
    p = s.submit(FillJobRequest("j1", SMALL, 40), 0.0)
    assert p is not None and p.end_s == pytest.approx(1.0)
    s.submit(FillJobRequest("j2", SMALL, 80), 0.0)
    s.submit(FillJobRequest("j3", SMALL, 40), 0.0)
    etas = s.expected_completions(0.0)
    assert etas == pytest.approx({"j1": 1.0, "j2": 3.0, "j3": 4.0})
    assert s.can_meet_deadline("j3", 4.0, 0.0).feasible
    assert not s.can_meet_deadline("j3", 3.5, 0.0).feasible
    new = FillJobRequest("j4", SMALL, 40)
    ans = s.can_meet_deadline(new, 4.5, 0.0)
    assert not ans.feasible and ans.expected_completion_s == pytest.approx(5.0)
    assert s.queued == 2  # the query did not submit j4
    # Under SJF the short new job jumps the queue.
    s.policy = get_policy("sjf")
    assert s.can_meet_deadline(new, 3.0, 0.0) == (True, pytest.approx(3.0))


def test_deadline_policy_prefers_the_nearest_deadline_then_sjf() -> None:
    s = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "deadline")
    s.submit(FillJobRequest("run", SMALL, 400), 0.0)
    s.submit(FillJobRequest("short", SMALL, 4), 0.0)
    s.submit(FillJobRequest("late", SMALL, 400, deadline_s=500.0), 0.0)
    s.submit(FillJobRequest("soon", SMALL, 400, deadline_s=200.0), 0.0)
    order = []
    for _ in range(3):
        p = s.release(0, 10.0)
        assert p is not None
        order.append(p.job.job_id)
    assert order == ["soon", "late", "short"]


# ---- properties ------------------------------------------------------------------------------

job_st = st.tuples(
    st.sampled_from([SMALL, BIG, profile("mid", 0.1, 1.5, nodes=2)]),
    st.integers(1, 400),
    st.integers(0, 20),
    st.one_of(st.none(), st.integers(0, 200)),
)
ops_st = st.lists(st.one_of(job_st, st.just("release")), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None)
@given(ops=ops_st, policy=st.sampled_from(["fifo", "sjf", "makespan", "deadline"]), n0=st.integers(1, 3))
def test_placements_never_double_book_and_follow_the_policy(ops: list, policy: str, n0: int) -> None:
    classes = two_classes(n0, 2)
    s = Scheduler(classes, policy)
    now = 0.0
    busy: dict[int, float] = {}
    for k, op in enumerate(ops):
        now += 1.0
        if op == "release":
            if not busy:
                continue
            e = min(busy, key=lambda x: (busy[x], x))
            now = max(now, busy.pop(e))
            before = s._queue.view()
            expected = _expected_choice(policy, before, s, e, now)
            p = s.release(e, now)
            assert (p is None) == (expected is None)
            if p is not None:
                assert p.job.job_id in expected  # one of the jobs the policy's definition ranks first
        else:
            prof, samples, _arrive, dl = op
            p = s.submit(FillJobRequest(f"j{k}", prof, samples, now, None if dl is None else now + dl), now)
        for q in [p] if p is not None else []:
            assert q.executor not in busy, "executor double-booked"
            busy[q.executor] = q.end_s
            # every placed job fits its executor's bubbles
            cls = classes[q.class_index]
            assert all(
                any(n.duration_s <= b.duration_s and n.memory_bytes <= b.free_bytes for b in cls.bubbles)
                for n in q.config.nodes
            )
        assert set(s.running) == set(busy)
        assert s.idle_executors() + len(busy) == sum(c.executors for c in classes)


def _expected_choice(policy: str, q, s: Scheduler, e: int, now: float) -> set[str] | None:
    """The jobs the policy's definition ranks first for executor e, computed directly."""
    c = int(s.executor_class[e])
    rows = [k for k in range(len(q)) if math.isfinite(q.proc_s[k, c])]
    if not rows:
        return None
    rem = (
        max(0.0, max(float(t) for t in s.busy_until_s if t > 0) - now) if (s.busy_until_s > 0).any() else 0.0
    )

    def key(k: int) -> tuple:
        if policy == "fifo":
            return (q.arrival_s[k],)
        if policy == "sjf":
            return (q.min_proc_s[k],)
        if policy == "makespan":
            return (max(q.proc_s[k, c], rem), -q.proc_s[k, c])
        d = q.deadline_s[k]
        return (0, d) if not np.isnan(d) else (1, q.min_proc_s[k])

    best = min(key(k) for k in rows)
    return {q.job_ids[k] for k in rows if np.allclose(key(k), best, rtol=1e-12, atol=0)}


def test_decisions_are_shared_per_class_at_cluster_scale() -> None:
    classes = [ExecutorClass(f"stage-{k}", (Bubble(0.1 + 0.01 * k, 4 * GIB),), 2.0, 512) for k in range(16)]
    s = Scheduler(classes, "sjf")
    assert len(s.busy_until_s) == 8192
    for k in range(200):
        s.submit(FillJobRequest(f"j{k}", SMALL, 4 + k), 0.0, place=False)
    placed = s.dispatch(0.0)
    assert len(placed) == 200 and len({p.executor for p in placed}) == 200
    assert len(s._tables) == 1  # one plan table for the shared profile, not one per executor


def test_a_job_runs_only_on_the_classes_it_is_eligible_for() -> None:
    s = Scheduler(two_classes(1, 1), "fifo")
    only_b = FillJobRequest("j", SMALL, 40, eligible=frozenset({"b"}))
    assert math.isinf(s.processing_times_s(only_b)[0]) and math.isfinite(s.processing_times_s(only_b)[1])
    p = s.submit(only_b, 0.0)
    assert p is not None and p.class_index == 1  # class a is faster for SMALL, but not allowed
    nowhere = FillJobRequest("k", SMALL, 40, eligible=frozenset())
    with pytest.raises(ValueError, match="fits the bubbles of no executor"):
        s.submit(nowhere, 0.0)


def test_an_occupied_executor_takes_no_job_until_it_frees_up() -> None:
    s = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "fifo")
    s.occupy(0, "placed-before", until_s=3.0)
    assert s.submit(FillJobRequest("j", SMALL, 40), 0.0) is None  # nothing idle
    assert s.expected_completions(0.0) == pytest.approx({"placed-before": 3.0, "j": 4.0})
    with pytest.raises(ValueError, match="busy already"):
        s.occupy(0, "again", 5.0)
