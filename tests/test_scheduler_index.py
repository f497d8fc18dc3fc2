"""The scheduler's queue indexes against the scanning scheduler as the oracle: the same choices, every policy.

Two schedulers take the same random operations side by side, one with its indexes (``Scheduler(...)``), one scanning
the queue at every decision as it always did (``Scheduler(..., index=False)``: the old code path, not a copy of it):
every placement, every refusal, every ETA and deadline answer must be equal, float for float.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

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
    JobInfo,
    Policy,
    QueueView,
    Scheduler,
    SchedulerState,
    ShortestJobFirstPolicy,
    get_policy,
)
from bubbles.operator.scheduler import core as core_mod
from bubbles.operator.scheduler.index import SortedItems, key2, ordered, ordered_many, seq_of, unordered
from bubbles.operator.scheduler.policies import queue_index

GIB = 2**30


def profile(name: str, step_s: float, mem_gib: float, nodes: int = 4, batch: int = 4) -> FillProfile:
    node = FillNode(step_s / nodes, int(mem_gib * GIB))
    return FillProfile(name, WorkloadKind.TRAINING, 1e9, 100.0, (FillConfig(f"bs{batch}", batch, (node,) * nodes),))


PROFILES = [profile("small", 0.05, 1.0), profile("big", 0.2, 3.0), profile("mid", 0.1, 1.5, nodes=2)]
CLASSES = [
    ExecutorClass("a", (Bubble(0.5, 4 * GIB), Bubble(0.2, 4 * GIB)), 2.0, 2),
    ExecutorClass("b", (Bubble(0.3, 2 * GIB),), 1.5, 1),
    ExecutorClass("c", (Bubble(0.5, 4 * GIB),), 1.0, 2),
]


class ClassShortestFirst(Policy):
    """A plugin that opts in: static, its score depends on the class (its processing time there, in coarse steps so
    that many jobs tie), and its tie-break is not the submission order (the longest first)."""

    name = "class-shortest"
    static = True

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        return -float(np.ceil(job.proc_time_s(state, executor) / 50.0))  # -inf where it does not fit

    def tie_break(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray | None:
        return queue.proc_s[:, state.class_of(executor)]


def latest_deadline_first(job: JobInfo, state: SchedulerState, executor: int) -> float:
    """A plugin that cannot be indexed (a plain function; this one also looks at the clock)."""
    return (job.deadline_s or 0.0) - state.now_s + 0.0 * state.max_rem_time_s


class SjfOverridden(ShortestJobFirstPolicy):
    """Inherits SJF's ``static`` but scores otherwise: it must be scanned."""

    name = "sjf-overridden"

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        return queue.arrival_s - state.now_s


INDEXED = ["fifo", "sjf", "makespan", "deadline", "0.5*sjf+0.5*fifo", "class-shortest"]
SCANNED = ["0.7*deadline+0.3*fifo", "latest-deadline", "sjf-overridden"]


def make_policy(name: str) -> Policy:
    if name == "class-shortest":
        return ClassShortestFirst()
    if name == "latest-deadline":
        from bubbles.operator.scheduler import FunctionPolicy

        return FunctionPolicy("latest-deadline", latest_deadline_first)
    if name == "sjf-overridden":
        return SjfOverridden()
    return get_policy(name)


# Deadlines a few floats apart, and near the clock, to make rounded scores tie.
DEADLINE_OFFSETS = [0.0, -3.0, 5.0, 5.0 + 1e-12, 100.0, 100.0 + 1e-7, 86_400.0, 86_400.0 + 1e-6, 1e-17, math.inf]

submit_st = st.tuples(
    st.just("submit"),
    st.integers(0, len(PROFILES) - 1),
    st.sampled_from([4, 8, 40, 41, 400]),
    st.one_of(st.none(), st.sampled_from(DEADLINE_OFFSETS), st.sampled_from([7.0, 50.0])),  # offset / absolute
    st.one_of(st.none(), st.sets(st.sampled_from(["a", "b", "c"]), min_size=1).map(frozenset)),
    st.sampled_from([0.0, 0.0, 1.5]),
    st.booleans(),  # place at once
    st.booleans(),  # deadline relative to now (else absolute)
)
ops_st = st.lists(
    st.one_of(
        submit_st,
        st.tuples(st.just("release"), st.integers(0, 10)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("reprofile"), st.integers(0, 30), st.integers(0, len(PROFILES) - 1)),
        st.tuples(st.just("advance"), st.sampled_from([0.0, 1e-9, 0.5, 1.0, 7.0, 60.0, 5000.0, -2.0])),
        st.tuples(st.just("occupy"), st.integers(0, 4), st.sampled_from([3.0, 200.0, 1e6, math.inf])),
        st.tuples(st.just("dispatch")),
        st.tuples(st.just("eta")),
        st.tuples(st.just("can_meet"), st.integers(0, len(PROFILES) - 1), st.sampled_from([4, 40, 400])),
        st.tuples(st.just("policy"), st.sampled_from(INDEXED + SCANNED)),
    ),
    min_size=1,
    max_size=60,
)


def _placement(p: Any) -> Any:
    return None if p is None else (p.job.job_id, p.executor, p.class_index, p.config.name, p.steps, p.start_s, p.end_s)


def _both(fn: Callable[[Scheduler], Any], a: Scheduler, b: Scheduler) -> Any:
    """Run ``fn`` on both schedulers; their results (or errors) must be equal."""
    out = []
    for s in (a, b):
        try:
            out.append(("ok", fn(s)))
        except (KeyError, ValueError) as e:
            out.append(("error", type(e).__name__, str(e)))
    assert out[0] == out[1]
    return out[0]


def replay(policy_name: str, ops: list, scans_by_index: list[int]) -> None:
    indexed = Scheduler(CLASSES, make_policy(policy_name))
    scanning = Scheduler(CLASSES, make_policy(policy_name), index=False)
    assert indexed.indexed == (policy_name in INDEXED) and not scanning.indexed
    now = 0.0
    k = 0
    current = policy_name

    real_choose = core_mod._choose

    def counting(*args: Any) -> Any:
        scans_by_index[0] += 1
        return real_choose(*args)

    def on_indexed(fn: Callable[[Scheduler], Any]) -> Callable[[Scheduler], Any]:
        """``fn``, counting the scans the indexed scheduler makes while it runs."""

        def run(s: Scheduler) -> Any:
            if s is not indexed or current not in INDEXED or not math.isfinite(now):
                return fn(s)
            core_mod._choose = counting
            try:
                return fn(s)
            finally:
                core_mod._choose = real_choose

        return run

    def check(fn: Callable[[Scheduler], Any]) -> Any:
        return _both(on_indexed(fn), indexed, scanning)

    for op in ops:
        kind = op[0]
        k += 1
        if kind == "submit":
            _, prof, samples, dl, eligible, setup, place, relative = op
            deadline = None if dl is None else (now + dl if relative else dl)
            job = FillJobRequest(f"j{k}", PROFILES[prof], samples, now, deadline, eligible, setup)
            check(lambda s, job=job, place=place, now=now: _placement(s.submit(job, now, place=place)))
        elif kind == "release":
            running = sorted(set(indexed.running) | set(indexed._occupied))
            if not running:
                continue
            e = running[op[1] % len(running)]
            check(lambda s, e=e, now=now: _placement(s.release(e, now)))
        elif kind == "cancel" or kind == "reprofile":
            queued = [j.job_id for j in indexed.queued_jobs()]
            jid = queued[op[1] % len(queued)] if queued else "nobody"
            res = _both(lambda s, jid=jid: s.cancel(jid).job_id, indexed, scanning)
            if kind == "reprofile" and res[0] == "ok":
                job = FillJobRequest(jid, PROFILES[op[2]], 40, now, None)
                check(lambda s, job=job, now=now: _placement(s.submit(job, now, place=False)))
        elif kind == "advance":
            now += op[1]
        elif kind == "occupy":
            idle = [e for e in range(len(indexed.busy_until_s)) if indexed.idle(e)]
            if not idle:
                continue
            e, until = idle[op[1] % len(idle)], now + op[2]
            _both(lambda s, e=e, until=until, k=k: s.occupy(e, f"gang{k}", until), indexed, scanning)
        elif kind == "dispatch":
            check(lambda s, now=now: [_placement(p) for p in s.dispatch(now)])
        elif kind == "eta":
            check(lambda s, now=now: s.expected_completions(now))
        elif kind == "can_meet":
            job = FillJobRequest(f"probe{k}", PROFILES[op[1]], op[2], now)
            check(lambda s, job=job, now=now: tuple(s.can_meet_deadline(job, now + 100.0, now)))
        elif kind == "policy":
            current = op[1]
            indexed.policy = make_policy(current)
            scanning.policy = make_policy(current)
        # The queues stay the same, in the same order.
        assert [j.job_id for j in indexed.queued_jobs()] == [j.job_id for j in scanning.queued_jobs()]
        assert indexed.running.keys() == scanning.running.keys()
    _both(lambda s: s.expected_completions(now), indexed, scanning)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(INDEXED + SCANNED), ops=ops_st)
def test_the_indexed_scheduler_chooses_what_the_scanning_one_does(policy: str, ops: list) -> None:
    scans = [0]
    replay(policy, ops, scans)
    assert scans[0] == 0, "an indexed policy's decisions at a finite clock must not scan the queue"


@pytest.mark.parametrize("policy", INDEXED + SCANNED)
def test_a_long_run_with_many_ties_chooses_alike(policy: str) -> None:
    """A few hundred operations per policy from a fixed seed: deeper queues than the property test reaches."""
    rng = np.random.default_rng(7)
    ops: list = []
    for _ in range(400):
        r = rng.random()
        if r < 0.45:
            dl = None if rng.random() < 0.4 else float(rng.choice(DEADLINE_OFFSETS[:-1]))
            ops.append(("submit", int(rng.integers(3)), int(rng.choice([4, 40, 41, 400])), dl, None, 0.0,
                        bool(rng.random() < 0.5), True))
        elif r < 0.75:
            ops.append(("release", int(rng.integers(10))))
        elif r < 0.8:
            ops.append(("cancel", int(rng.integers(30))))
        elif r < 0.95:
            ops.append(("advance", float(rng.choice([0.0, 0.5, 7.0, 60.0]))))
        else:
            ops.append(("eta",))
    scans = [0]
    replay(policy, ops, scans)
    if policy in INDEXED:
        assert scans[0] == 0


def test_which_policies_are_indexed_and_why() -> None:
    for name in ["fifo", "sjf", "makespan", "deadline", "0.5*sjf+0.5*fifo"]:
        assert queue_index(get_policy(name), 0) is not None, name
    assert queue_index(ClassShortestFirst(), 0) is not None  # a plugin opting in with static = True
    # Not indexed: a time-dependent part in a mix, a plain function, a subclass that changes an indexed policy's
    # scores without declaring anything itself.
    assert queue_index(get_policy("0.7*deadline+0.3*fifo"), 0) is None
    assert queue_index(make_policy("latest-deadline"), 0) is None
    assert queue_index(SjfOverridden(), 0) is None

    class SjfReDeclared(SjfOverridden):
        static = True  # the subclass says so itself: trusted

    assert queue_index(SjfReDeclared(), 0) is not None
    # index=False scans whatever the policy.
    assert not Scheduler(CLASSES, "sjf", index=False).indexed and Scheduler(CLASSES, "sjf").indexed


def test_a_decision_consults_only_the_index_of_its_class() -> None:
    classes = [ExecutorClass(f"stage-{k}", (Bubble(0.1 + 0.01 * k, 4 * GIB),), 2.0, 4) for k in range(4)]
    s = Scheduler(classes, "sjf")
    for j in range(16 + 50):
        s.submit(FillJobRequest(f"j{j}", PROFILES[0], 4 + j), 0.0)
    assert s.queued == 50 and s._indexes is not None
    p = s.release(0, 1.0)
    assert p is not None and p.job.job_id == "j16"  # the shortest queued
    assert set(s._indexes.by_class) == {0}  # the other classes' indexes are not made until they decide
    assert len(s._indexes.by_class[0].index or ()) == 49
    s.cancel("j17")
    assert len(s._indexes.by_class[0].index or ()) == 48  # a cancelled job leaves the index at once
    s.index_all(1.0)
    assert set(s._indexes.by_class) == {0, 1, 2, 3}


def test_cancel_takes_only_queued_jobs_and_says_what_to_do_otherwise() -> None:
    s = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "deadline")
    s.submit(FillJobRequest("run", PROFILES[0], 40), 0.0)
    s.submit(FillJobRequest("wait", PROFILES[0], 40, deadline_s=5.0), 0.0)
    s.submit(FillJobRequest("later", PROFILES[0], 40, deadline_s=9.0), 0.0)
    with pytest.raises(KeyError, match="running, not queued; release its executor"):
        s.cancel("run")
    with pytest.raises(KeyError, match="not queued; cancel only jobs submitted and not yet started"):
        s.cancel("ghost")
    assert s.cancel("wait").job_id == "wait" and s.queued == 1
    p = s.release(0, 1.0)
    assert p is not None and p.job.job_id == "later"


def test_a_clock_that_is_not_finite_falls_back_to_the_scan() -> None:
    s = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "deadline")
    o = Scheduler([ExecutorClass("a", (Bubble(0.5, 4 * GIB),), 1.0, 1)], "deadline", index=False)
    for sched in (s, o):
        sched.submit(FillJobRequest("run", PROFILES[0], 40), 0.0)
        sched.submit(FillJobRequest("never", PROFILES[0], 40, deadline_s=math.inf), 0.0)
        sched.submit(FillJobRequest("plain", PROFILES[0], 4), 0.0)
    # At an infinite clock the deadlines' order is no longer the scores' (the scan's nan_to_num makes inf the largest
    # float, so inf - inf never happens there): the indexed scheduler scans, and chooses the same.
    a, b = s.release(0, math.inf), o.release(0, math.inf)
    assert a is not None and b is not None and a.job.job_id == b.job.job_id == "never"
    assert s._indexes is not None and not s._indexes.by_class  # no index was made for it


def _near(x: float, steps: int) -> float:
    for _ in range(abs(steps)):
        x = math.nextafter(x, math.inf if steps > 0 else -math.inf)
    return x


# Floats whose rounded scores tie: neighbours (1 / p equal for p a few ulps apart; deadlines far out tie over
# microseconds), exact repeats, and the clock's own values.
TIMES = [1.0, 3.0, 7.0, 100.0, 1000.0, 86_400.0]  # 1 / 7.0 == 1 / nextafter(7.0), and so on
near_st = st.builds(_near, st.sampled_from(TIMES), st.integers(-3, 3))
row_st = st.tuples(
    st.tuples(st.one_of(near_st, st.just(math.inf)), st.one_of(near_st, st.just(math.inf))),  # proc on 2 classes
    st.one_of(st.just(math.nan), near_st, st.builds(lambda x: x + 86_400.0, near_st), st.just(-math.inf)),
    st.sampled_from([0.0, 1.0, 2.0]),  # arrival
)
index_ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(row_st, min_size=1, max_size=8)),
        st.tuples(st.just("choose"), near_st, st.one_of(st.just(0.0), near_st), st.integers(0, 1)),  # now, R, class
        st.tuples(st.just("remove"), st.integers(0, 40)),
    ),
    min_size=1,
    max_size=40,
)


def _index_and_scan(policy: str, rows: list[tuple[tuple[float, float], float | None]]) -> tuple[Any, Any]:
    """A queue of ``rows`` ((proc on class 0, on class 1), deadline), its indexes, and a function comparing the
    index's choice with the scan's at (now, longest remaining busy time, class)."""
    pol = make_policy(policy)
    q = core_mod._Queue(2)
    for seq, (proc, deadline) in enumerate(rows):
        q.add(FillJobRequest(f"j{seq}", PROFILES[0], 1, 0.0, deadline), np.array(proc), seq)
    indexes = core_mod._Indexes(pol, q)

    def both(now: float, rem: float, e: int = 0) -> str:
        state = SchedulerState(now, np.array([now + rem, 0.0]), np.array([0, 1]))
        got, want = indexes.choose(e, state), core_mod._choose(pol, q.view(), state, e)
        assert got == want and got is not None
        return q.ids[got]

    return indexes, both


def test_makespan_breaks_a_tie_of_rounded_scores_to_the_longest_job() -> None:
    p = 7.0
    longer = math.nextafter(p, math.inf)
    assert 1.0 / p == 1.0 / longer and longer > p  # two processing times that score alike
    _, both = _index_and_scan("makespan", [((p, math.inf), None), ((longer, math.inf), None), ((9.0, 1.0), None)])
    assert both(now=0.0, rem=0.0) == "j1"  # the longer of the tie, though submitted after
    assert both(now=0.0, rem=8.0) == "j1"  # both under R: all score 1 / R, the longest under R wins
    assert both(now=0.0, rem=9.5) == "j2"


def test_deadlines_passed_and_un_passed_as_the_clock_goes_back_and_forth() -> None:
    rows = [((1.0, 1.0), 100.0), ((1.0, 1.0), 50.0), ((1.0, 1.0), 3.5)]
    _, both = _index_and_scan("deadline", rows)
    assert both(now=200.0, rem=0.0) == "j0"  # all passed: all score 3, the earliest submitted wins
    assert both(now=2.0, rem=0.0) == "j2"  # back before them all: the earliest deadline
    assert both(now=60.0, rem=0.0) == "j1"  # j1 and j2 passed: the earlier submitted of them, not the earlier deadline
    assert both(now=4.0, rem=0.0) == "j2"  # only j2 passed


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(["fifo", "sjf", "makespan", "deadline", "class-shortest", "0.5*sjf+0.5*fifo"]),
       ops=index_ops_st)
def test_each_index_ties_as_the_scan_does_on_adversarial_floats(policy: str, ops: list) -> None:
    """The indexes against ``_choose`` (the scan) on hand-picked floats: scores equal after rounding, a clock that
    goes back and forth over deadlines, R equal to processing times."""
    pol = make_policy(policy)
    q = core_mod._Queue(2)
    indexes = core_mod._Indexes(pol, q)
    executor_class = np.array([0, 1])
    dummy = PROFILES[0]
    seq = 0
    for op in ops:
        if op[0] == "add":
            for proc, deadline, arrival in op[1]:
                if not any(math.isfinite(p) for p in proc):
                    continue  # the scheduler refuses a job that fits no class
                job = FillJobRequest(f"j{seq}", dummy, 1, arrival, None if math.isnan(deadline) else deadline)
                q.add(job, np.array(proc), seq)
                seq += 1
        elif op[0] == "remove":
            if q.n:
                k = op[1] % q.n
                indexes.discard(k)
                q.remove(k)
        else:
            _, now, rem, e = op
            state = SchedulerState(now, np.array([now + rem, 0.0]), executor_class)
            got = indexes.choose(e, state)
            want = core_mod._choose(pol, q.view(), state, e)
            assert got != core_mod._SCAN
            assert got == want, (q.view(), now, state.max_rem_time_s, e)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 60), st.integers(0, 3)), max_size=300),
       load=st.integers(1, 5))
def test_sorted_items_match_a_sorted_list(ops: list[tuple[bool, int, int]], load: int) -> None:
    items = SortedItems(load=load)
    model: list[tuple[int, int]] = []
    for add, a, b in ops:
        x = (a, b)
        if add and x not in model:
            items.add(x)
            model.append(x)
        elif not add and x in model:
            items.remove(x)
            model.remove(x)
        elif not add:
            with pytest.raises(KeyError):
                items.remove(x)
        model.sort()
        assert list(items) == model and len(items) == len(model)
        probe = (a, 1)
        assert items.first() == (model[0] if model else None)
        assert items.first_above(probe) == next((m for m in model if m > probe), None)
        assert items.first_at_least(probe) == next((m for m in model if m >= probe), None)
        assert items.last_at_most(probe) == next((m for m in reversed(model) if m <= probe), None)
        hi = (a + b * 7, 2)
        assert items.between(probe, hi) == [m for m in model if probe < m <= hi]
    bulk = [(i, 0) for i in range(50)]
    items.update([x for x in bulk if x not in model])
    assert list(items) == sorted(set(model) | set(bulk))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False), min_size=2, max_size=40),
       st.lists(st.integers(0, 2**64 - 2), min_size=2, max_size=40))
def test_int_keys_sort_as_the_float_tuples_they_stand_for(xs: list[float], seqs: list[int]) -> None:
    """The indexes' keys: (a, seq) as one int, ordered as the tuple is, -0.0 equal to 0.0 (as the scan's floats);
    each float comes back from its key, and numpy's encoding is the scalar one."""
    pairs = list(zip(xs, seqs, strict=False))
    by_tuple = sorted(pairs, key=lambda p: (p[0] + 0.0, p[1]))
    by_int = sorted(pairs, key=lambda p: key2(*p))
    assert [(a + 0.0, s) for a, s in by_tuple] == [(a + 0.0, s) for a, s in by_int]
    assert ordered_many(np.array(xs)) == [ordered(x) for x in xs]
    for a, s in pairs:
        k = key2(a, s)
        assert seq_of(k) == s and unordered(k >> 64) == a + 0.0
    assert ordered(-0.0) == ordered(0.0) and ordered(-math.inf) < ordered(-1e308) < ordered(0.0) < ordered(math.inf)
