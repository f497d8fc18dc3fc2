"""Every GPU of every node (issue 35): the operator's unit is one harvested GPU, a rank of a stage
(``identity.GpuKey``). Pure decisions over ``GpuView``s, and the shell's view of agent reports (a Pod that runs
several stages or ranks is several GPUs; none collapses)."""

from __future__ import annotations

import asyncio
from typing import Any

from helpers.operator import HOST_PATH, MIB, cond, cycle, fill_job, stage, step, training

from bubbles.core.agentapi import assignment_from_pb, assignment_to_pb
from bubbles.core.identity import GpuKey
from bubbles.core.resources import NodeReport, StageReport
from bubbles.operator.agents import InMemoryAgents
from bubbles.operator.decide import GpuView, gpus_by_key
from bubbles.operator.grpc_agents import assignment_message
from bubbles.operator.kube import Connection
from bubbles.operator.shell import Operator, OperatorConfig


def tp2(**kw: Any) -> list[GpuView]:
    """Stage 0 of ml/llama on two GPUs of one Pod (tensor-parallel ranks 0 and 1), each with its own UUID."""
    return [stage(0, rank=r, ranks=2, gpu_uuid=f"GPU-{r}", **kw) for r in (0, 1)]


def test_two_ranks_of_one_stage_take_two_jobs_one_per_gpu() -> None:
    a, b = fill_job("a"), fill_job("b")
    d = step([a, b], tp2())
    placed = {j["metadata"]["name"]: j["status"]["assignment"] for j in (a, b)}
    assert sorted((p["stage"], p["ranks"], p["gpuUUIDs"]) for p in placed.values()) == \
        [(0, [0], ["GPU-0"]), (0, [1], ["GPU-1"])]
    assert {p["trainingPod"] for p in placed.values()} == {"llama-0"}
    # What each agent is told and what each Pod gets: its own GPU.
    assert sorted(x.ranks for x in d.assign) == [(0,), (1,)]
    for pod in d.create_pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        rank = env["BUBBLES_RANKS"]
        assert env["CUDA_VISIBLE_DEVICES"] == f"GPU-{rank}" and "NVIDIA_VISIBLE_DEVICES" not in env
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {f"bubbles.dev/gpu-{rank}": "1"}
    # The same with the hostPath layout: each Pod mounts its own GPU's fills/ and names its GPU by UUID.
    for pod in step([fill_job("ha"), fill_job("hb")], tp2(), fill_pods=HOST_PATH).create_pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        fills = next(v for v in pod["spec"]["volumes"] if v["name"] == "bubbles-fills")["hostPath"]["path"]
        assert fills == f"/run/bubbles/ml/llama/stage-0/rank-{env['BUBBLES_RANKS']}/fills"
        assert env["NVIDIA_VISIBLE_DEVICES"] == f"GPU-{env['BUBBLES_RANKS']}"
    # A third job waits: both GPUs are busy.
    c = fill_job("c")
    step([a, b, c], tp2())
    assert c["status"]["phase"] == "Queued" and cond(c, "Placed")["reason"] == "AllBubblesBusy"
    assert a["status"]["phase"] == b["status"]["phase"] == "Placed"


def test_the_training_status_lists_each_stage_with_its_gpus() -> None:
    t = training()
    a, b = fill_job("a"), fill_job("b")
    step([a, b], tp2(bubble_s=10.0, filled_s=2.5), [t])
    st = t["status"]
    assert st["pods"] == 1 and st["gpus"] == 2 and st["gpusHarvested"] == 2 and "unreportedPods" not in st
    (s0,) = st["stages"]
    assert s0["stage"] == 0 and s0["ranks"] == 2
    assert [(g["rank"], g["pod"], g["node"], g["device"], g["gpuUUID"], g["hookReporting"], g["fillJobs"])
            for g in s0["gpus"]] == [(0, "llama-0", "node-a", "cuda:0", "GPU-0", True, 1),
                                     (1, "llama-0", "node-a", "cuda:1", "GPU-1", True, 1)]
    assert all(g["bubbleRatio"] == 0.1 and g["shareFilled"] == 0.25 for g in s0["gpus"])
    assert cond(t, "HookReporting")["message"] == "all 2 GPU(s) report"
    from bubbles.core.resources import PIPELINE_TRAINING_STATUS, validate

    assert validate(PIPELINE_TRAINING_STATUS, st, "status") == []


def test_a_pod_that_runs_two_stages_is_two_gpus_and_both_are_placed_on() -> None:
    gpus = [stage(0, pod="llama-0"), stage(1, pod="llama-0", device="cuda:1")]
    assert len(gpus_by_key(gpus)) == 2
    a, b = fill_job("a"), fill_job("b")
    step([a, b], gpus)
    assert sorted(j["status"]["assignment"]["stage"] for j in (a, b)) == [0, 1]


def test_a_job_pinned_to_a_stage_lands_on_a_gpu_of_that_stage() -> None:
    # Stage 1's bubbles are shorter: an unpinned job goes to stage 0's faster ones, the pinned one to stage 1.
    gpus = [stage(0, pod="llama-0"), *(stage(1, pod="llama-1", rank=r, ranks=2, cycle=cycle(1, bubble_s=0.004))
                                       for r in (0, 1))]
    free = fill_job("free")
    step([free], gpus)
    assert free["status"]["assignment"]["stage"] == 0
    pinned = fill_job("pinned", stage=1)
    step([free, pinned], gpus)
    got = pinned["status"]["assignment"]
    assert got["stage"] == 1 and got["ranks"][0] in (0, 1) and got["trainingPod"] == "llama-1"
    # Pinned to a stage whose GPUs are all busy: it waits, though stage 0 would do.
    again = fill_job("again", stage=1)
    other = fill_job("other", stage=1)
    step([free, pinned, again, other], gpus)
    assert again["status"]["phase"] == "Placed" and again["status"]["assignment"]["stage"] == 1
    assert other["status"]["phase"] == "Queued" and cond(other, "Placed")["reason"] == "AllBubblesBusy"


def test_a_stage_the_training_does_not_have_keeps_the_job_queued_saying_so() -> None:
    job = fill_job(stage=5)
    d = step([job], [stage(0), stage(1, pod="llama-1")])  # the hooks report 2 stages
    said = cond(job, "Placed")
    assert job["status"]["phase"] == "Queued" and said["reason"] == "NoSuchStage"
    assert "spec.stage 5 is no stage of the PipelineTrainings it may use: ml/llama has 2 (0-1)" in said["message"]
    assert ("Warning", "NoSuchStage") in [(e.type, e.reason) for e in d.events if e.kind == "FillJob"]
    # spec.stages says so too before anything is profiled there; within it, the job waits for that stage's GPUs.
    t = training(stages=4)
    job = fill_job("early", stage=3)
    step([job], [stage(0)], [t])
    assert cond(job, "Placed")["reason"] == "StageNotProfiled" and "stage 3 of ml/llama" in cond(job, "Placed")[
        "message"]
    job = fill_job("late", stage=4)
    step([job], [stage(0)], [t])
    assert cond(job, "Placed")["reason"] == "NoSuchStage" and "ml/llama has 4 (0-3)" in cond(job, "Placed")["message"]


def test_a_job_loses_its_gpu_alone_when_its_rank_is_no_longer_reported() -> None:
    a, b = fill_job("a"), fill_job("b")
    step([a, b], tp2())
    on_1 = a if a["status"]["assignment"]["ranks"] == [1] else b
    on_0 = b if on_1 is a else a
    step([a, b], tp2()[:1])  # the Pod still runs; its agent no longer reports rank 1
    assert on_0["status"]["phase"] == "Placed"
    assert on_1["status"]["phase"] == "Queued"
    assert "no longer reports stage 0 rank 1 of llama" in cond(on_1, "Evicted")["message"]


def test_a_rank_that_moved_to_another_pod_is_a_gone_pod_for_the_job_on_it() -> None:
    job = fill_job()
    step([job], [stage(0, pod="llama-0")])
    step([job], [stage(0, pod="llama-0b")], acting_s=1e9)
    assert job["status"]["phase"] == "Queued" and "llama-0" in cond(job, "Evicted")["message"]


def test_trainings_of_one_name_in_two_namespaces_never_mix() -> None:
    ml, other = training(), training()
    other["metadata"].update(namespace="other", uid="t-other")
    theirs = GpuView("other/llama", 0, "llama-0", "uid-other", "node-b", "cuda:0", cycle(0), hook_reporting=True)
    mine = stage(0)
    assert theirs.key == GpuKey("other", "llama", 0, 0) != mine.key
    jobs = [fill_job("a"), fill_job("b")]  # both in ml: only ml/llama's one GPU is theirs
    step(jobs, [theirs, mine], [ml, other])
    assert sorted(j["status"]["phase"] for j in jobs) == ["Placed", "Queued"]
    placed = next(j for j in jobs if j["status"]["phase"] == "Placed")
    assert placed["status"]["assignment"]["node"] == "node-a"
    assert ml["status"]["gpus"] == other["status"]["gpus"] == 1
    assert ml["status"]["gpusHarvested"] == 1 and other["status"]["gpusHarvested"] == 0
    assert ml["status"]["fillJobs"] == 1 and other["status"]["fillJobs"] == 0


def test_the_agent_is_told_the_ranks_over_the_wire() -> None:
    job = fill_job()
    (a,) = step([job], tp2()[1:]).assign
    back = assignment_from_pb(assignment_to_pb(assignment_message(a)))
    assert back.ranks == (1,) and back.gpu_uuid == "GPU-1" and back.training == "llama" and back.namespace == "ml"
    assert back.gpu_keys == (GpuKey("ml", "llama", 0, 1),)


CYCLE = {**cycle(0).to_dict(), "training": "llama"}


def test_the_shells_view_has_one_gpu_per_report_of_a_pod_none_collapsed() -> None:
    agents = InMemoryAgents()
    op = Operator(OperatorConfig(), Connection("http://127.0.0.1:9", insecure=True), agents)
    op.store.put("trainings", {"metadata": {"name": "llama", "namespace": "ml", "uid": "t", "generation": 1,
                                            "resourceVersion": "1"},
                               "spec": {"selector": {"matchLabels": {"app": "llama"}}}})
    for name, ns in (("llama-0", "ml"), ("llama-1", "ml")):
        op.store.put("pods", {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                                           "labels": {"app": "llama"}, "resourceVersion": "1"},
                              "spec": {"nodeName": "node-a"}, "status": {"phase": "Running"}})
    reports = [StageReport("ml", "llama", "llama-0", k, f"cuda:{2 * k + r}", {**CYCLE, "stage": k}, True,
                           gpu_uuid=f"GPU-{k}{r}", rank=r, ranks=2) for k in (0, 1) for r in (0, 1)]
    # The same Pod name and training in another namespace: not ml/llama's.
    reports.append(StageReport("other", "llama", "llama-0", 0, "cuda:7", CYCLE, True, rank=0, ranks=1))
    agents.reports["node-a"] = NodeReport("node-a", tuple(reports))
    view = asyncio.run(op.view())
    got = sorted((g.training, g.pod, g.stage, g.rank, g.gpu_uuid, g.cycle is not None) for g in view.gpus)
    assert got == [("ml/llama", "llama-0", 0, 0, "GPU-00", True), ("ml/llama", "llama-0", 0, 1, "GPU-01", True),
                   ("ml/llama", "llama-0", 1, 0, "GPU-10", True), ("ml/llama", "llama-0", 1, 1, "GPU-11", True),
                   ("ml/llama", "llama-1", -1, 0, None, False)]  # llama-1 reports no GPU (yet)
    assert len(gpus_by_key(view.gpus)) == 4
    assert max(s.free_bytes for g in view.gpus if g.cycle for s in g.cycle.slots) == 1024 * MIB


def test_the_per_job_gauges_say_the_stage_and_ranks_a_job_runs_on() -> None:
    from prometheus_client import generate_latest

    from bubbles.operator.metrics import OperatorMetrics

    m = OperatorMetrics()
    job = fill_job()
    step([job], tp2()[1:])
    m.observe([job])
    body = generate_latest(m.registry).decode()
    assert ('bubbles_operator_fill_job_progress_ratio{fill_job="fj",namespace="ml",node="node-a",ranks="1",stage="0",'
            'training="llama"} 0.0') in body
    assert 'bubbles_operator_fill_job_eta_timestamp_seconds{fill_job="fj",namespace="ml",node="node-a",ranks="1"' \
        in body
