"""A round's writes go on beside the next rounds (shell.Operator._loop): the store shows a FillJob with writes in
flight as they will leave it (``Store.assume``), so a round decided meanwhile neither places that job again nor
gives its GPU to another; what it decided for the job is dropped; and when the writes end, done or failed, the
store shows what the API server said (``Store.settle``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from helpers.operator import fill_job

from bubbles.core.resources import FINALIZER, NodeReport, StageReport
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.decide import Decisions, Event, FillJobDecisions
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig, Store, _hold_back, assumed

MIB = 2**20
CYCLE = {"training": "llama", "stage": 0, "stages": 2, "microbatches": 8, "schedule": "TrainSchedule",
         "iteration_s": 0.1, "samples": 5,
         "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": 0.01,
                    "p10_s": 0.01, "p90_s": 0.01, "free_bytes": 1024 * MIB}]}

TRAINING = {"metadata": {"name": "llama", "namespace": "ml", "uid": "t", "generation": 1, "resourceVersion": "1"},
            "spec": {"selector": {"matchLabels": {"app": "llama"}}}}


def job(name: str, rv: int, **extra: Any) -> dict[str, Any]:
    obj = fill_job(name)
    obj["metadata"]["resourceVersion"] = str(rv)
    obj.update(extra)
    return obj


# -- the store ---------------------------------------------------------------------------------------------------
def test_an_assumed_job_shows_its_writes_outcome_and_keeps_what_the_api_server_says_aside() -> None:
    store = Store()
    store.put("fill_jobs", job("a", 5))
    mine = {**job("a", 5), "status": {"phase": "Placed"}}
    store.assume("ml/a", mine)
    assert store.fill_jobs["ml/a"] is mine
    assert store.real("ml/a")["metadata"]["resourceVersion"] == "5"
    # The finalizer patch's watch event (newer) and a stale event (older): kept aside, the newest wins.
    store.put("fill_jobs", job("a", 7, metadata={**job("a", 7)["metadata"], "finalizers": [FINALIZER]}))
    store.put("fill_jobs", job("a", 6))
    assert store.fill_jobs["ml/a"] is mine
    assert store.real("ml/a")["metadata"]["resourceVersion"] == "7"
    store.put("fill_jobs", {**job("a", 9), "status": {"phase": "Placed", "x": 1}})  # the status patch's answer
    store.settle("ml/a")
    assert store.fill_jobs["ml/a"]["status"] == {"phase": "Placed", "x": 1}
    assert not store.held
    store.settle("ml/a")  # nothing held: nothing changes
    assert store.fill_jobs["ml/a"]["metadata"]["resourceVersion"] == "9"


def test_a_job_deleted_while_its_writes_were_in_flight_is_gone_when_they_end() -> None:
    store = Store()
    store.put("fill_jobs", job("a", 5))
    store.assume("ml/a", {**job("a", 5), "status": {"phase": "Placed"}})
    store.put("fill_jobs", job("a", 6), deleted=True)
    assert "ml/a" in store.fill_jobs  # still shown as the writes will leave it
    store.settle("ml/a")
    assert "ml/a" not in store.fill_jobs


def test_an_older_watch_event_never_undoes_a_write_and_keeps_the_same_object() -> None:
    store = Store()
    store.put("fill_jobs", job("a", 8))
    kept = store.fill_jobs["ml/a"]
    store.put("fill_jobs", job("a", 7))
    assert store.fill_jobs["ml/a"] is kept  # the same object: the rounds' memos know it by identity


def test_what_a_jobs_writes_make_of_it() -> None:
    obj = job("a", 5, metadata={**job("a", 5)["metadata"], "finalizers": ["other.dev/keep"]})
    placed = assumed(obj, FillJobDecisions("uid-a", status={"phase": "Placed"}, add_finalizer=True))
    assert placed is not None and placed["status"] == {"phase": "Placed"}
    assert placed["metadata"]["finalizers"] == ["other.dev/keep", FINALIZER]
    assert obj["metadata"]["finalizers"] == ["other.dev/keep"] and "status" not in obj  # the object is not changed
    released = assumed(placed, FillJobDecisions("uid-a", remove_finalizer=True))
    assert released is not None and released["metadata"]["finalizers"] == ["other.dev/keep"]
    assert assumed(obj, FillJobDecisions("uid-a", delete_pods=[("ml", "p")])) is None  # neither status nor finalizer


def test_a_round_drops_what_it_decided_for_what_is_still_being_written_and_its_events() -> None:
    d = Decisions()
    d.fill_jobs["ml/a"] = FillJobDecisions("uid-a", status={"phase": "Placed"})
    d.fill_jobs["ml/b"] = FillJobDecisions("uid-b", status={"phase": "Placed"})
    d.training_status["ml/llama"] = {"phase": "Harvesting"}
    d.training_status["ml/other"] = {"phase": "Harvesting"}
    d.events.extend([Event("FillJob", "ml", "a", "uid-a", "Normal", "Placed", "."),
                     Event("FillJob", "ml", "b", "uid-b", "Normal", "Placed", "."),
                     Event("PipelineTraining", "ml", "llama", "t", "Normal", "X", ".")])
    _hold_back(d, {"ml/a"}, {"ml/llama"})
    assert list(d.fill_jobs) == ["ml/b"] and list(d.training_status) == ["ml/other"]
    assert [e.name for e in d.events] == ["b"]


# -- the operator: a round decided while another's writes are in flight -------------------------------------------
class GatedWriter:
    """The operator's writes, answered as the API server would (resourceVersion moves on), with the status patch of
    one job held until ``gate`` is set, or failing when ``fail`` is set."""

    def __init__(self, held: str) -> None:
        self.held = held
        self.gate = threading.Event()
        self.fail = False
        self.rv = 100
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def _next(self) -> str:
        with self.lock:
            self.rv += 1
            return str(self.rv)

    def set_finalizer(self, plural: str, ns: str, name: str, present: bool, finalizers: list[str],
                      rv: str | None = None) -> dict[str, Any]:
        self.calls.append(("finalizer", name))
        obj = job(name, int(self._next()))
        obj["metadata"]["finalizers"] = [FINALIZER] if present else []
        return obj

    def create_pod(self, manifest: dict[str, Any]) -> bool:
        self.calls.append(("pod", manifest["metadata"]["name"]))
        return True

    def patch_status(self, plural: str, ns: str, name: str, before: Any, after: dict[str, Any],
                     kind: str = "status") -> dict[str, Any] | None:
        if name == self.held:
            assert self.gate.wait(10)
            if self.fail:
                raise RuntimeError("the API server went away")
        self.calls.append((kind, name))
        if plural == "pipelinetrainings":
            return {**TRAINING, "metadata": {**TRAINING["metadata"], "resourceVersion": self._next()},
                    "status": dict(after)}
        obj = job(name, int(self._next()))
        obj["metadata"]["finalizers"] = [FINALIZER]
        obj["status"] = dict(after)
        return obj

    def delete_pod(self, ns: str, name: str) -> None:
        self.calls.append(("pod_delete", name))

    def post_event(self, event: Any, now: Any) -> None:
        self.calls.append(("event", event.name))

    def take_counts(self, only: str | None = None, exclude: str | None = None) -> dict[str, int]:
        return {}


def _operator(writer: GatedWriter) -> Operator:
    agents = InMemoryAgents()
    op = Operator(OperatorConfig(), Connection("http://127.0.0.1:9", insecure=True), agents)
    op.writer = writer  # type: ignore[assignment]
    op.store.put("trainings", TRAINING)
    op.store.put("pods", {"metadata": {"name": "llama-0", "namespace": "ml", "uid": "uid-llama-0",
                                       "labels": {"app": "llama"}, "resourceVersion": "1"},
                          "spec": {"nodeName": "node-a"}, "status": {"phase": "Running"}})
    # One GPU: one job at a time.
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE,
                                                                 True),))
    op.store.put("fill_jobs", job("a", 10))
    b = job("b", 11)
    b["metadata"]["creationTimestamp"] = "2026-11-23T07:00:01Z"  # after a: a goes first
    op.store.put("fill_jobs", b)
    return op


@pytest.mark.parametrize("fails", [False, True], ids=["written", "failed"])
def test_a_round_decided_while_a_placement_is_written_neither_repeats_it_nor_gives_its_gpu_away(fails: bool) -> None:
    writer = GatedWriter(held="a")
    writer.fail = fails
    op = _operator(writer)

    async def scenario() -> None:
        d1, now, see_s, decide_s = await op._decide()
        assert d1.fill_jobs["ml/a"].create_pod is not None  # a placed on the one GPU
        assert "ml/b" not in d1.fill_jobs or d1.fill_jobs["ml/b"].create_pod is None
        act = asyncio.create_task(op._act(d1, now, see_s, decide_s))
        for _ in range(200):  # until a's status write is on its way (its finalizer and Pod written)
            if ("pod", d1.fill_jobs["ml/a"].create_pod["metadata"]["name"]) in writer.calls:
                break
            await asyncio.sleep(0.01)
        assert op.store.fill_jobs["ml/a"]["status"]["phase"] == "Placed"  # assumed
        assert op.store.real("ml/a").get("status") is None
        d2, *_ = await op._decide()
        assert "ml/a" not in d2.fill_jobs  # held back: its writes are in flight
        b = d2.fill_jobs.get("ml/b")
        assert b is None or (b.create_pod is None and (b.status or {}).get("phase") != "Placed")  # its GPU is a's
        writer.gate.set()
        if fails:
            with pytest.raises(RuntimeError, match="went away"):
                await act
        else:
            await act
        assert not op.store.held and not op._writing
        if fails:
            # What the API server said: a has its finalizer, no status; the next round places a job again.
            assert op.store.fill_jobs["ml/a"].get("status") is None
            assert op.store.fill_jobs["ml/a"]["metadata"]["finalizers"] == [FINALIZER]
            d3, *_ = await op._decide()
            assert any(j.create_pod is not None for j in d3.fill_jobs.values())
        else:
            assert op.store.fill_jobs["ml/a"]["status"]["phase"] == "Placed"
            assert op.store.fill_jobs["ml/a"]["metadata"]["resourceVersion"] == str(writer.rv)
            d3, *_ = await op._decide()
            assert not any(j.create_pod is not None for j in d3.fill_jobs.values())  # one GPU, taken
        pods = [c for c in writer.calls if c[0] == "pod"]
        assert len(pods) == 1  # a's Pod once: the round meanwhile created none

    asyncio.run(scenario())


def test_every_write_is_timed_for_the_histogram_even_one_that_fails() -> None:
    """KubeWriter tells ``observe`` each write's kind and duration (the operator's
    bubbles_operator_api_write_seconds), whether the API server answered or not."""
    from bubbles.operator.kube import KubeWriter

    seen: list[tuple[str, float]] = []
    w = KubeWriter(Connection("http://127.0.0.1:9", insecure=True), request_timeout_s=2,
                   observe=lambda kind, s: seen.append((kind, s)))
    from urllib3.exceptions import HTTPError

    with pytest.raises(HTTPError):  # nothing listens on port 9
        w.patch_status("filljobs", "ml", "a", {}, {"phase": "Placed"})
    with pytest.raises(HTTPError):
        w.set_finalizer("filljobs", "ml", "a", True, [])
    assert [k for k, _ in seen] == ["status", "finalizer"] and all(s >= 0 for _, s in seen)
    assert w.take_counts() == {"status": 1, "finalizer": 1}
    op = Operator(OperatorConfig(), Connection("http://127.0.0.1:9", insecure=True), InMemoryAgents())
    assert op.writer.observe is not None
    op.writer.observe("pod", 0.02)  # what its writer tells, its histogram counts
    text = __import__("prometheus_client").generate_latest(op.metrics.registry).decode()
    assert 'bubbles_operator_api_write_seconds_count{kind="pod"} 1.0' in text
