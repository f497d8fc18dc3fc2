"""The whole operator process (kopf watches, store, reconcile loop, writes) against KMock, kopf's API emulator.

Fast end-to-end scenarios; the node agents are ``InMemoryAgents`` whose reports each test sets (the agents'
gRPC service has tests of its own, and the real-API-server tier runs a real node agent). What KMock cannot do
(uids, resourceVersions, schema validation, pruning) is the real-API-server tier's (tests/test_kube_api.py,
tests/test_operator_kube.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from helpers.operator_thread import OperatorThread

from bubbles.core.resources import FillState, JobProgress, NodeReport, StageReport
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.decide import fill_pod_node
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig

pytestmark = pytest.mark.asyncio
MIB = 2**20
CYCLE = {"training": "llama", "stage": 0, "stages": 2, "microbatches": 8, "schedule": "TrainSchedule",
         "iteration_s": 0.1, "samples": 5,
         "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": 0.01,
                    "p10_s": 0.01, "p90_s": 0.01, "free_bytes": 1024 * MIB}]}


class Cluster:
    def __init__(self, kmock: Any, session: aiohttp.ClientSession) -> None:
        self.kmock = kmock
        self.http = session
        self.base = str(kmock.url).rstrip("/")

    async def post(self, path: str, obj: dict[str, Any]) -> None:
        async with self.http.post(self.base + path, json=obj) as resp:
            assert resp.status < 300, await resp.text()

    async def delete(self, path: str) -> None:
        async with self.http.delete(self.base + path) as resp:
            assert resp.status < 300, await resp.text()

    def get(self, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        try:
            obj = self.kmock.objects[resource, ns, name]
        except KeyError:
            return None
        if obj.deleted:
            return None
        return json.loads(json.dumps(dict(obj.raw)))

    async def until(self, what: str, fn: Callable[[], Any], timeout_s: float = 15.0) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            value = fn()
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            await asyncio.sleep(0.05)


def fill_job(name: str = "fj", **spec: Any) -> dict[str, Any]:
    body = {"image": "fill:1", "entry": "pkg.mod:Job", "profile": {"memory": "64Mi", "stepTime": "2ms"},
            "work": {"steps": 1000}, **spec}
    return {"apiVersion": "bubbles.dev/v1alpha1", "kind": "FillJob",
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": "2026-11-23T07:00:00Z"}, "spec": body}


TRAINING = {"apiVersion": "bubbles.dev/v1alpha1", "kind": "PipelineTraining",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-llama", "generation": 1},
            "spec": {"selector": {"matchLabels": {"app": "llama"}}}}


def training_pod(name: str = "llama-0", node: str = "node-a") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "labels": {"app": "llama"}},
            "spec": {"nodeName": node, "containers": [{"name": "train", "image": "train:1"}]},
            "status": {"phase": "Running"}}


@pytest_asyncio.fixture()
async def cluster(kmock: Any) -> AsyncIterator[Cluster]:
    kmock.resources.load_bundled()
    for plural, kind in (("filljobs", "FillJob"), ("pipelinetrainings", "PipelineTraining")):
        kmock.resources[f"bubbles.dev/v1alpha1/{plural}"] = dict(
            kind=kind, singular=kind.lower(), namespaced=True, subresources={"status"},
            verbs={"list", "watch", "get", "create", "patch", "update", "delete"})
    async with aiohttp.ClientSession() as session:
        yield Cluster(kmock, session)


@pytest_asyncio.fixture()
async def operator(cluster: Cluster) -> AsyncIterator[tuple[OperatorThread, InMemoryAgents]]:
    agents = InMemoryAgents()
    op = OperatorThread(Operator(OperatorConfig(interval_s=0.2), Connection(cluster.base, insecure=True), agents))
    yield op, agents
    await asyncio.to_thread(op.close)


FJ = "bubbles.dev/v1alpha1/filljobs"
PODS = "v1/pods"


def phase(cluster: Cluster, name: str) -> str | None:
    obj = cluster.get(FJ, "ml", name)
    return ((obj or {}).get("status") or {}).get("phase")


async def test_apply_queue_place_run_succeed(cluster: Cluster, operator: tuple[OperatorThread, InMemoryAgents]) -> None:
    op, agents = operator
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job())
    await cluster.until("Queued (no bubbles reported yet)", lambda: phase(cluster, "fj") == "Queued")
    assert "no PipelineTraining has reported" in cluster.get(FJ, "ml", "fj")["status"]["message"]
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    op.wake()
    await cluster.until("Placed", lambda: phase(cluster, "fj") == "Placed")
    pod = await cluster.until("the fill Pod", lambda: cluster.get(PODS, "ml", "fj-fj-a0"))
    assert fill_pod_node(pod["spec"]) == "node-a"
    assert "nodeName" not in pod["spec"]  # pinned by affinity: the scheduler places it (gates, claims, taints)
    assert pod["metadata"]["labels"]["bubbles.dev/fill-job"] == "fj"
    st = cluster.get(FJ, "ml", "fj")
    assert st["status"]["assignment"]["node"] == "node-a" and "bubbles.dev/fill-job-cleanup" in \
        st["metadata"]["finalizers"]
    assert [a.fill_pod for a in agents.assigned] == ["fj-fj-a0"]
    agents.reports["node-a"] = NodeReport("node-a", agents.reports["node-a"].stages,
                                          (JobProgress("uid-fj", FillState.RUNNING, 250, 1e12),))
    op.wake()
    await cluster.until("Running 25%", lambda: (cluster.get(FJ, "ml", "fj")["status"].get("progressText")
                                                == "25% (250/1000)"))
    assert phase(cluster, "fj") == "Running"
    silent = (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, False),)  # the training evaluates
    agents.reports["node-a"] = NodeReport("node-a", silent, agents.reports["node-a"].jobs)
    op.wake()
    await cluster.until("Paused (its training silent)", lambda: phase(cluster, "fj") == "Paused")
    assert "no bubble signals" in cluster.get(FJ, "ml", "fj")["status"]["message"]
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),),
                                          agents.reports["node-a"].jobs)
    op.wake()
    await cluster.until("Running again", lambda: phase(cluster, "fj") == "Running")
    agents.reports["node-a"] = NodeReport("node-a", agents.reports["node-a"].stages,
                                          (JobProgress("uid-fj", FillState.STOPPED, 1000, 4e12, "finished"),))
    op.wake()
    await cluster.until("Succeeded", lambda: phase(cluster, "fj") == "Succeeded")
    pt = cluster.get("bubbles.dev/v1alpha1/pipelinetrainings", "ml", "llama")
    assert pt["status"]["pods"] == 1 and pt["status"]["bubbleRatio"] == 0.1
    assert op.op.writes_total["pod"] == 1  # placed once
    # The agent still reports the finished run: once the final status is stored, it is told to let go of it (a round
    # with nothing else to write for the job carries the cancellation too).
    op.wake()
    await cluster.until("the agent told to let go of the finished run",
                        lambda: ("node-a", "uid-fj") in agents.cancelled)


async def test_a_refused_fill_pod_is_said_on_its_job_and_the_job_placed_once_admitted(cluster: Cluster) -> None:
    agents = InMemoryAgents()
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    # The API server's admission refuses the first fill Pod (as a quota or Pod Security would), then admits.
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
              "message": 'pods "fj-fj-a0" is forbidden: exceeded quota: compute, requested: pods=1, used: pods=4, '
                         "limited: pods=4"}
    fill_pod = cluster.kmock.body(re.compile(r'.*"name": ?"fj-fj-a0".*', re.DOTALL))  # the count is per match
    cluster.kmock["post /api/v1/namespaces/ml/pods", fill_pod][:1] << 403 << status
    op = OperatorThread(Operator(OperatorConfig(interval_s=0.2, pod_retry_s=1.0), Connection(cluster.base,
                                                                                              insecure=True), agents))
    try:
        await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job())
        st = await cluster.until("the refusal said", lambda: "refused its Pod" in
                                 ((cluster.get(FJ, "ml", "fj") or {}).get("status") or {}).get("message", "") and
                                 cluster.get(FJ, "ml", "fj")["status"])
        assert st["phase"] == "Queued" and "exceeded quota: compute" in st["message"] and agents.assigned == []
        await cluster.until("Placed once admitted", lambda: phase(cluster, "fj") == "Placed")
        assert [a.fill_pod for a in agents.assigned] == ["fj-fj-a0"] and cluster.get(PODS, "ml", "fj-fj-a0")
    finally:
        await asyncio.to_thread(op.close)


async def test_a_fill_pod_that_cannot_pull_its_image_is_said_then_given_up_and_a_bad_training_says_why(
        cluster: Cluster) -> None:
    agents = InMemoryAgents()
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    bad = {**TRAINING, "metadata": {**TRAINING["metadata"], "name": "bad", "uid": "uid-bad"}, "spec": {}}
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", bad)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    # KMock's Pods have no creation time: the operator counts from when it first sees one failing to start.
    op = OperatorThread(Operator(OperatorConfig(interval_s=0.2, pod_start_timeout_s=2.0),
                                 Connection(cluster.base, insecure=True), agents))
    try:
        said = await cluster.until("the bad training's status", lambda: next((
            c for c in ((cluster.get("bubbles.dev/v1alpha1/pipelinetrainings", "ml", "bad") or {}).get("status") or
                        {}).get("conditions", ()) if c["type"] == "Admitted"), None))
        assert said["status"] == "False" and said["reason"] == "InvalidSpec" and "spec.selector" in said["message"]
        await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job())
        await cluster.until("the fill Pod", lambda: cluster.get(PODS, "ml", "fj-fj-a0"))
        status = {"phase": "Pending", "containerStatuses": [{"name": "fill", "ready": False, "state": {
            "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "fill:1"'}}}]}
        async with cluster.http.patch(cluster.base + "/api/v1/namespaces/ml/pods/fj-fj-a0", json={"status": status},
                                      headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status < 300, await resp.text()
        st = await cluster.until("the failure said", lambda: "has not started" in (
            (cluster.get(FJ, "ml", "fj") or {}).get("status") or {}).get("message", "") and
            cluster.get(FJ, "ml", "fj")["status"])
        assert st["phase"] == "Placed" and "its image cannot be pulled" in st["message"]
        st = await cluster.until("given up and placed again", lambda: (
            s if (s := cluster.get(FJ, "ml", "fj")["status"]).get("restarts") == 1 and s.get("phase") == "Placed"
            else None))
        assert st["assignment"]["pod"] == "fj-fj-a1" and cluster.get(PODS, "ml", "fj-fj-a0") is None
        assert [a.fill_pod for a in agents.assigned][:2] == ["fj-fj-a0", "fj-fj-a1"]
    finally:
        await asyncio.to_thread(op.close)


async def test_invalid_jobs_fail_and_the_rest_of_the_queue_is_untouched(
        cluster: Cluster, operator: tuple[OperatorThread, InMemoryAgents]) -> None:
    _op, agents = operator
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("bad", work={"steps": 0}))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("good"))
    await cluster.until("bad Failed", lambda: phase(cluster, "bad") == "Failed")
    await cluster.until("good Placed", lambda: phase(cluster, "good") == "Placed")
    assert "spec.work.steps must be >= 1" in cluster.get(FJ, "ml", "bad")["status"]["message"]
    assert cluster.get(PODS, "ml", "fj-bad-a0") is None


async def test_deleting_a_running_job_stops_it_and_frees_its_slot(
        cluster: Cluster, operator: tuple[OperatorThread, InMemoryAgents]) -> None:
    _op, agents = operator
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("first"))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("second"))
    await cluster.until("first Placed", lambda: phase(cluster, "first") == "Placed")
    await cluster.until("second Queued", lambda: phase(cluster, "second") == "Queued")
    await cluster.delete("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs/first")
    await cluster.until("first gone", lambda: cluster.get(FJ, "ml", "first") is None)
    assert cluster.get(PODS, "ml", "fj-first-a0") is None and ("node-a", "uid-first") in agents.cancelled
    await cluster.until("second Placed in the freed slot", lambda: phase(cluster, "second") == "Placed")


async def test_a_restarted_operator_places_nothing_twice(cluster: Cluster) -> None:
    agents = InMemoryAgents()
    agents.reports["node-a"] = NodeReport("node-a", (StageReport("ml", "llama", "llama-0", 0, "cuda:0", CYCLE, True),))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job())
    for round_ in range(2):
        op = Operator(OperatorConfig(interval_s=0.2), Connection(cluster.base, insecure=True), agents)
        thread = OperatorThread(op)
        await cluster.until("Placed", lambda: phase(cluster, "fj") == "Placed")
        await cluster.until("a few rounds", lambda op=op: op.rounds >= 3)
        await asyncio.to_thread(thread.close)
        assert op.writes_total["pod"] == (1 if round_ == 0 else 0), op.writes_total
    assert len(agents.assigned) == 1


async def test_one_pod_with_two_ranks_of_a_stage_takes_a_fill_job_on_each_gpu(
        cluster: Cluster, operator: tuple[OperatorThread, InMemoryAgents]) -> None:
    _op, agents = operator
    agents.reports["node-a"] = NodeReport("node-a", tuple(
        StageReport("ml", "llama", "llama-0", 0, f"cuda:{r}", CYCLE, True, gpu_uuid=f"GPU-{r}", rank=r, ranks=2,
                    gpu_resource=f"bubbles.dev/gpu-{r}")
        for r in (0, 1)))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    for name in ("a", "b"):
        await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job(name))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("nowhere", stage=7))
    await cluster.until("both Placed", lambda: phase(cluster, "a") == phase(cluster, "b") == "Placed")
    ranks = sorted(cluster.get(FJ, "ml", n)["status"]["assignment"]["ranks"][0] for n in ("a", "b"))
    assert ranks == [0, 1] and sorted(a.ranks for a in agents.assigned) == [(0,), (1,)]
    pods = [await cluster.until(f"{n}'s Pod", lambda n=n: cluster.get(PODS, "ml", f"fj-{n}-a0")) for n in ("a", "b")]
    # Each Pod requests its own GPU's resource from the kubelet, as the agent reports it.
    assert sorted(json.dumps(p["spec"]["containers"][0]["resources"]["limits"]) for p in pods) == [
        json.dumps({f"bubbles.dev/gpu-{r}": "1"}) for r in (0, 1)]
    pt = await cluster.until("the training's GPUs both harvested", lambda: (
        p := cluster.get("bubbles.dev/v1alpha1/pipelinetrainings", "ml", "llama")) and
        (p.get("status") or {}).get("gpusHarvested") == 2 and p)
    (s0,) = pt["status"]["stages"]
    assert [(g["rank"], g["gpuUUID"], g["fillJobs"]) for g in s0["gpus"]] == [(0, "GPU-0", 1), (1, "GPU-1", 1)]
    nowhere = cluster.get(FJ, "ml", "nowhere")["status"]
    assert nowhere["phase"] == "Queued" and "spec.stage 7 is no stage" in nowhere["message"]


async def test_a_gang_is_placed_on_both_ranks_of_a_stage_and_requeued_whole_when_one_goes(
        cluster: Cluster, operator: tuple[OperatorThread, InMemoryAgents]) -> None:
    op, agents = operator
    both = tuple(StageReport("ml", "llama", "llama-0", 0, f"cuda:{r}", CYCLE, True, gpu_uuid=f"GPU-{r}", rank=r,
                             ranks=2, gpu_resource=f"bubbles.dev/gpu-{r}") for r in (0, 1))
    agents.reports["node-a"] = NodeReport("node-a", both)
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/pipelinetrainings", TRAINING)
    await cluster.post("/api/v1/namespaces/ml/pods", training_pod())
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("big", gpus=3))
    await cluster.post("/apis/bubbles.dev/v1alpha1/namespaces/ml/filljobs", fill_job("gang", gpus=2))
    await cluster.until("the gang Placed", lambda: phase(cluster, "gang") == "Placed")
    a = cluster.get(FJ, "ml", "gang")["status"]["assignment"]
    assert a["ranks"] == [0, 1] and a["gpuUUIDs"] == ["GPU-0", "GPU-1"]
    pod = await cluster.until("the gang's one Pod", lambda: cluster.get(PODS, "ml", "fj-gang-a0"))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1" and env["BUBBLES_GANG_SIZE"] == "2"
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"bubbles.dev/gpu-0": "1", "bubbles.dev/gpu-1": "1"}
    assert [x.ranks for x in agents.assigned] == [(0, 1)]
    big = await cluster.until("the 3-GPU job refused a place", lambda: phase(cluster, "big") == "Queued" and (
        cluster.get(FJ, "ml", "big")["status"]))
    assert "the most any stage has there is 2" in big["message"]
    pt = await cluster.until("both GPUs harvested", lambda: (cluster.get("bubbles.dev/v1alpha1/pipelinetrainings",
                                                                         "ml", "llama") or {}).get("status", {})
                             .get("gpusHarvested") == 2)
    assert pt
    agents.reports["node-a"] = NodeReport("node-a", both[:1])  # rank 1 no longer reported
    op.wake()
    await cluster.until("the gang requeued", lambda: phase(cluster, "gang") == "Queued")
    evicted = next(c for c in cluster.get(FJ, "ml", "gang")["status"]["conditions"] if c["type"] == "Evicted")
    assert "no longer reports stage 0 rank 1" in evicted["message"]
    await cluster.until("its Pod deleted", lambda: cluster.get(PODS, "ml", "fj-gang-a0") is None)
