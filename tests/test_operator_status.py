"""A FillJob's phase moves only along the transition table (bubbles.operator.decide.status), and what the reconcile
remembers between rounds is in the cache its caller owns (bubbles.operator.decide.cache)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools

import pytest
from helpers.operator import NOW, fill_job, stage, training

from bubbles.core.api import FillState
from bubbles.core.resources import FillJobPhase, JobProgress
from bubbles.operator import decide
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.decide import (
    PHASE_TRANSITIONS,
    Assigned,
    ClusterView,
    DecideCache,
    Decisions,
    FillJobStatus,
    InvalidTransition,
    check_transition,
    reconcile,
)
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig

P = FillJobPhase
ACTIVE = {P.PLACED, P.RUNNING, P.PAUSED}


def test_the_table_allows_exactly_the_transitions_the_operator_makes() -> None:
    assert {
        None: {P.QUEUED, P.FAILED},
        P.PENDING: {P.QUEUED, P.FAILED},
        P.QUEUED: {P.QUEUED, P.PLACED, P.FAILED},
        P.PLACED: ACTIVE | {P.QUEUED, P.SUCCEEDED, P.FAILED},
        P.RUNNING: ACTIVE | {P.QUEUED, P.SUCCEEDED, P.FAILED},
        P.PAUSED: ACTIVE | {P.QUEUED, P.SUCCEEDED, P.FAILED},
        P.SUCCEEDED: set(),
        P.FAILED: set(),
    } == PHASE_TRANSITIONS
    for old, allowed in PHASE_TRANSITIONS.items():
        for new in allowed:
            check_transition(old, new)  # each allowed one passes


@pytest.mark.parametrize(("old", "new"), [
    (old, new) for old, new in itertools.product([None, *P], P) if new not in PHASE_TRANSITIONS[old]])
def test_an_invalid_transition_raises(old: FillJobPhase | None, new: FillJobPhase) -> None:
    with pytest.raises(InvalidTransition, match=f"to {new.value}"):
        check_transition(old, new)


def test_a_status_refuses_to_leave_a_final_phase_and_writes_nothing() -> None:
    out = Decisions()
    done = {**fill_job(), "status": {"phase": "Succeeded", "message": "finished"}}
    st = FillJobStatus(done, NOW, out)
    with pytest.raises(InvalidTransition, match="from Succeeded to Queued"):
        st.phase(FillJobPhase.QUEUED, "again")
    assert st.status == done["status"] and out.events == []
    queued = FillJobStatus({**fill_job(), "status": {"phase": "Queued"}}, NOW, out)
    with pytest.raises(InvalidTransition, match="from Queued to Running"):
        queued.phase(FillJobPhase.RUNNING, "never placed")


def test_every_transition_a_job_makes_on_its_way_is_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[FillJobPhase | None, FillJobPhase]] = []

    def spy(old: FillJobPhase | None, new: FillJobPhase) -> None:
        seen.append((old, new))
        check_transition(old, new)

    monkeypatch.setattr(decide.status, "check_transition", spy)
    job = fill_job()
    rounds = [  # (its stages, what its agent reports)
        ([stage()], {}),  # admitted and placed
        ([stage()], {"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 10)}),
        ([stage(hook_reporting=False)], {"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 20)}),
        ([], {}),  # its training Pod is gone: requeued
        ([stage()], {}),  # placed again
        ([stage()], {"uid-fj": JobProgress("uid-fj", FillState.STOPPED, 1000, reason="finished", attempt=1)}),
    ]
    for stages, progress in rounds:
        d = reconcile(ClusterView(NOW, [job], [training()], stages, progress))
        job["status"] = d.fill_job_status.get("ml/fj", job.get("status"))
    assert job["status"]["phase"] == "Succeeded"
    assert seen == [(None, P.QUEUED), (P.QUEUED, P.PLACED), (P.PLACED, P.RUNNING), (P.RUNNING, P.PAUSED),
                    (P.PAUSED, P.QUEUED), (P.QUEUED, P.PLACED), (P.PLACED, P.SUCCEEDED)]
    assert all(new in PHASE_TRANSITIONS[old] for old, new in seen)


def test_the_cache_is_the_callers_and_remembers_across_its_rounds_only() -> None:
    view = ClusterView(NOW, [fill_job("a"), fill_job("b")], [training()], [stage()])
    mine = DecideCache()
    first = reconcile(view, mine)
    assert len(mine.parsed) == 2 and len(mine.profiles) == 1 and list(mine.classes) == [stage().key]
    parsed = dict(mine.parsed)
    second = reconcile(view, mine)
    assert all(mine.parsed[k] is v for k, v in parsed.items())  # the same objects: remembered, not parsed again
    assert second.fill_job_status == first.fill_job_status and second.create_pods == first.create_pods
    other = DecideCache()
    assert reconcile(view).create_pods == first.create_pods  # a fresh cache by default: the same decisions
    assert other.parsed == {} and other.profiles == {} and other.classes == {}  # nothing shared between caches
    # No memo of the package's own: nothing at module level holds what a round saw.
    for module in (decide.view, decide.status, decide.cache, decide.filljobs, decide.placement, decide.pods,
                   decide.trainings):
        assert not [n for n, v in vars(module).items() if isinstance(v, dict) and not n.startswith("__")], module


def test_a_remembered_spec_is_parsed_again_when_its_generation_or_labels_change() -> None:
    cache = DecideCache()
    job = fill_job()
    first = cache.fill_job(job)
    assert cache.fill_job({**job, "status": {"phase": "Queued"}}) is first  # its status is not what is parsed
    bumped = cache.fill_job({**job, "metadata": {**job["metadata"], "generation": 2}})
    relabelled = cache.fill_job({**job, "metadata": {**job["metadata"], "labels": {"team": "b"}}})
    assert bumped.generation == 2 and relabelled.labels == {"team": "b"} and first.generation == 1


def test_the_shell_owns_one_cache_and_hands_it_to_every_round(monkeypatch: pytest.MonkeyPatch) -> None:
    op = Operator(OperatorConfig(), Connection("http://127.0.0.1:9", insecure=True), InMemoryAgents())
    assert isinstance(op.cache, DecideCache)
    given: list[DecideCache | None] = []

    def spy(view: ClusterView, cache: DecideCache | None = None, full_pass_s: float = 0.0) -> Decisions:
        given.append(cache)
        assert full_pass_s == op.config.full_pass_s  # the safety net's interval is the configured one
        return Decisions()

    async def nothing_to_see() -> ClusterView:
        return ClusterView(NOW, [], [], [])

    async def nothing_to_do(d: Decisions, now: object) -> None:
        return None

    monkeypatch.setattr("bubbles.operator.shell.reconcile_round", spy)
    monkeypatch.setattr(op, "view", nothing_to_see)
    monkeypatch.setattr(op, "apply", nothing_to_do)
    import asyncio

    for _ in range(2):
        asyncio.run(op.reconcile_once())
    assert given == [op.cache, op.cache] and given[0] is given[1] is op.cache


def test_decisions_are_grouped_by_fill_job_and_listed_in_the_order_taken() -> None:
    view = ClusterView(NOW, [fill_job("a"), fill_job("b")], [training()],
                       [stage(), dataclasses.replace(stage(1, pod="llama-1"))])
    d = reconcile(view)
    assert sorted(d.fill_jobs) == ["ml/a", "ml/b"]
    for key, job in d.fill_jobs.items():
        assert job.create_pod is not None and job.assignment is not None and job.status is not None
        assert job.create_pod["metadata"]["ownerReferences"][0]["name"] == key.split("/")[1]
        assert (job.assignment.namespace, job.assignment.name) == tuple(key.split("/"))
        assert job.add_finalizer and job.writes
    assert d.create_pods == [d.fill_jobs[k].create_pod for k in ("ml/a", "ml/b")]
    assert d.assign == [d.fill_jobs[k].assignment for k in ("ml/a", "ml/b")]
    assert d.add_finalizer == ["ml/a", "ml/b"]


def test_a_status_assignment_is_read_once_as_a_typed_record() -> None:
    raw = {"training": "llama", "stage": 2, "node": "n1", "device": "cuda:0", "pod": "fj-a1", "trainingPod": "llama-2",
           "trainingPodUid": "u-2", "placedAt": "2026-01-01T00:00:00Z"}
    a = Assigned.read(raw)
    assert (a.training, a.stage, a.node, a.device) == ("llama", 2, "n1", "cuda:0")
    assert (a.pod, a.training_pod, a.training_pod_uid, a.placed_at) == ("fj-a1", "llama-2", "u-2", raw["placedAt"])
    # Not placed (no assignment, or an empty one): every field None, as the raw dict's .get gave before.
    assert Assigned.read(None) == Assigned() == Assigned.read({})
    assert Assigned.read({"pod": "p"}).node is None


def test_the_status_counts_and_progress_read_as_numbers_with_zero_before_any() -> None:
    out = Decisions()
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    fresh = FillJobStatus({"metadata": {"name": "a", "namespace": "ml", "uid": "u"}}, now, out)
    assert (fresh.steps_done, fresh.recovered_flops, fresh.counter("evictions")) == (0, 0.0, 0)
    seen = FillJobStatus({"metadata": {"name": "a", "namespace": "ml", "uid": "u"},
                          "status": {"progress": {"stepsDone": 40}, "recoveredFlops": 2.5e9,
                                     "counters": {"evictions": 3}}}, now, out)
    assert (seen.steps_done, seen.recovered_flops, seen.counter("evictions")) == (40, 2.5e9, 3)
    seen.count("evictions")
    assert seen.counter("evictions") == 4
