"""Gang jobs (``spec.gpus`` N > 1): N GPUs of one stage in one training Pod, placed, tracked and evicted together, in
the bubbles they share. Pure decisions over ``GpuView``s, the scheduler's gang step, and the gang's fill Pod."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers.operator import HOST_PATH, MIB, cond, cycle, fill_job, stage, step, training

from bubbles.core import control
from bubbles.core.api import FillState, WorkloadKind
from bubbles.core.plan import Bubble, FillNode
from bubbles.core.resources import FillJobResource, JobProgress, ResourceError
from bubbles.operator.decide import FillPodSettings, GpuView, fill_pod_mounts
from bubbles.operator.scheduler import (
    ExecutorClass,
    FillConfig,
    FillJobRequest,
    FillProfile,
    GangGroup,
    Scheduler,
    gang_eta_s,
    place_gang,
    shared_class,
)


def ranks(n: int, k: int = 0, pod: str = "llama-0", node: str = "node-a", **kw: Any) -> list[GpuView]:
    """Stage ``k`` of ml/llama on ``n`` GPUs of one Pod, each with its UUID."""
    return [stage(k, pod=pod, node=node, rank=r, ranks=n, gpu_uuid=f"GPU-{k}{r}", **kw) for r in range(n)]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_a_two_gpu_job_is_placed_on_both_ranks_of_one_stage() -> None:
    t = training()
    job = fill_job(gpus=2)
    d = step([job], ranks(2), [t])
    a = job["status"]["assignment"]
    assert job["status"]["phase"] == "Placed"
    assert (a["stage"], a["ranks"], a["gpuUUIDs"], a["trainingPod"]) == (0, [0, 1], ["GPU-00", "GPU-01"], "llama-0")
    assert "ml/llama stage 0 ranks 0,1" in cond(job, "Placed")["message"]
    (told,) = d.assign
    assert told.ranks == (0, 1) and told.job is not None and told.job.gpus == 2
    # Both GPUs count as harvested by it; a second single job finds none free.
    assert t["status"]["gpusHarvested"] == 2
    assert [g["fillJobs"] for g in t["status"]["stages"][0]["gpus"]] == [1, 1]
    other = fill_job("other")
    step([job, other], ranks(2), [t])
    assert other["status"]["phase"] == "Queued" and cond(other, "Placed")["reason"] == "AllBubblesBusy"


def test_the_gangs_pod_requests_every_gpu_and_sees_them_in_rank_order() -> None:
    """csi and devicePlugin (the defaults): one volume, each GPU's resource, CUDA_VISIBLE_DEVICES in ranks' order."""
    (pod,) = step([fill_job(gpus=2)], ranks(2)).create_pods
    env = env_of(pod)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-00,GPU-01" and "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["BUBBLES_RANKS"] == "0,1" and env[control.GANG_SIZE_ENV] == "2" and env["BUBBLES_DEVICE"] == "cuda:0"
    (c,) = pod["spec"]["containers"]
    assert c["resources"] == {kind: {"bubbles.dev/gpu-0": "1", "bubbles.dev/gpu-1": "1"}
                              for kind in ("requests", "limits")}
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["bubbles-attach"]  # no fills/ of the training's


def test_the_gangs_hostpath_pod_mounts_every_gpus_fills_and_sees_every_gpu_in_rank_order() -> None:
    job = fill_job(gpus=2)
    (pod,) = step([job], ranks(2), fill_pods=HOST_PATH).create_pods
    env = env_of(pod)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-00,GPU-01"
    assert env["BUBBLES_RANKS"] == "0,1" and env[control.GANG_SIZE_ENV] == "2"
    assert env["BUBBLES_DEVICE"] == "cuda:0"
    vols = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
    assert vols == {"bubbles-attach": "/run/bubbles/_attach",
                    "bubbles-fills": "/run/bubbles/ml/llama/stage-0/rank-0/fills",
                    "bubbles-fills-1": "/run/bubbles/ml/llama/stage-0/rank-1/fills"}
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["bubbles-fills-1"] == "/run/bubbles/ml/llama/stage-0/rank-1/fills"
    assert [m[0] for m in fill_pod_mounts("ml/llama", 0, "/run/bubbles", ranks=(0, 1))] == \
        ["bubbles-attach", "bubbles-fills", "bubbles-fills-1"]
    # A single-GPU job's Pod is as before: no gang size.
    (single,) = step([fill_job("one")], ranks(1), fill_pods=HOST_PATH).create_pods
    assert control.GANG_SIZE_ENV not in env_of(single) and env_of(single)["NVIDIA_VISIBLE_DEVICES"] == "GPU-00"


def test_under_mps_a_gang_pins_its_memory_on_each_of_its_gpus() -> None:
    job = fill_job(gpus=2)
    (pod,) = step([job], ranks(2), fill_pods=FillPodSettings(mps_pipe_dir="/tmp/nvidia-mps")).create_pods
    assert env_of(pod)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=64M,1=64M"


def test_a_gang_bigger_than_any_stage_on_a_node_stays_queued_saying_so() -> None:
    job = fill_job(gpus=3)
    gpus = [*ranks(2), *ranks(1, k=1, pod="llama-1", node="node-b", cycle=cycle(1))]
    d = step([job], gpus)
    said = cond(job, "Placed")
    assert job["status"]["phase"] == "Queued" and said["reason"] == "NotEnoughGPUs"
    assert ("asks for 3 GPUs of one stage in one Pod on one node (spec.gpus); the most any stage has there is 2 "
            "(training ml/llama stage 0 on node-a (Pod llama-0))") in said["message"]
    assert ("Warning", "NotEnoughGPUs") in [(e.type, e.reason) for e in d.events if e.kind == "FillJob"]
    # Two ranks of a stage in two Pods are no gang of 2 either: a gang runs in one Pod.
    split = [stage(0, pod="llama-0", rank=0, ranks=2), stage(0, pod="llama-1", rank=1, ranks=2)]
    two = fill_job("two", gpus=2)
    step([two], split)
    assert cond(two, "Placed")["reason"] == "NotEnoughGPUs"


def test_a_pinned_gang_goes_to_its_stage_and_says_when_that_stage_is_too_small() -> None:
    # Stage 0 has the longer bubbles, but the job is pinned to stage 1.
    gpus = [*ranks(2), *ranks(2, k=1, pod="llama-1", cycle=cycle(1, bubble_s=0.004))]
    free, pinned = fill_job("free", gpus=2), fill_job("pinned", gpus=2, stage=1)
    step([free, pinned], gpus)
    assert free["status"]["assignment"]["stage"] == 0 and pinned["status"]["assignment"]["stage"] == 1
    assert pinned["status"]["assignment"]["ranks"] == [0, 1]
    small = fill_job("small", gpus=2, stage=1)
    step([small], [*ranks(2), stage(1, pod="llama-1")])
    assert cond(small, "Placed")["reason"] == "NotEnoughGPUs" and "such stage has there is 1" in cond(
        small, "Placed")["message"]


def test_a_gang_chooses_the_gpus_with_the_most_shared_bubble_time() -> None:
    # Three ranks of stage 0: rank 1's bubbles are short; a gang of 2 takes ranks 0 and 2.
    gpus = [stage(0, rank=r, ranks=3, gpu_uuid=f"GPU-{r}", cycle=cycle(0, bubble_s=0.002 if r == 1 else 0.010))
            for r in range(3)]
    job = fill_job(gpus=2)
    step([job], gpus)
    assert job["status"]["assignment"]["ranks"] == [0, 2]


def test_no_gang_is_placed_partially_while_one_of_its_gpus_is_busy() -> None:
    single = fill_job("single", created="2026-11-23T06:00:00Z")
    step([single], [*ranks(2)[:1], stage(0, rank=1, ranks=2, gpu_uuid="GPU-01", cycle=None)])  # rank 1 not profiled
    assert single["status"]["assignment"]["ranks"] == [0]
    gang = fill_job("gang", gpus=2)
    d = step([single, gang], ranks(2))
    assert gang["status"]["phase"] == "Queued" and not d.create_pods
    said = cond(gang, "Placed")
    assert said["reason"] == "AllBubblesBusy" and "fewer than 2 GPUs" in said["message"]
    assert "eta" in gang["status"]  # once the single job's GPU frees up
    # The single job finishes: the gang takes both GPUs.
    done = {"uid-single": JobProgress("uid-single", FillState.STOPPED, 1000, reason="finished")}
    step([single, gang], ranks(2), progress=done)
    assert single["status"]["phase"] == "Succeeded"
    step([single, gang], ranks(2))
    assert gang["status"]["phase"] == "Placed" and gang["status"]["assignment"]["ranks"] == [0, 1]


def test_a_waiting_gang_of_a_tier_goes_before_single_jobs_of_that_tier() -> None:
    singles = [fill_job(f"s{i}", created="2026-11-23T06:00:00Z") for i in range(2)]
    gang = fill_job("gang", gpus=2)
    step([*singles, gang], ranks(2))
    assert gang["status"]["phase"] == "Placed"
    assert [s["status"]["phase"] for s in singles] == ["Queued", "Queued"]


def test_a_gang_is_evicted_whole_when_one_of_its_gpus_goes() -> None:
    job = fill_job(gpus=2)
    step([job], ranks(2))
    d = step([job], ranks(2)[:1])  # the agent no longer reports rank 1; the Pod still runs
    assert job["status"]["phase"] == "Queued" and "assignment" not in job["status"]
    assert "no longer reports stage 0 rank 1 of llama" in cond(job, "Evicted")["message"]
    assert d.delete_pods == [("ml", "fj-fj-a0")] and d.cancel == [("node-a", "uid-fj")]
    # While it waits, the GPU it still had is held for it: it is placed again once both are back.
    step([job], ranks(2))
    assert job["status"]["phase"] == "Placed" and job["status"]["assignment"]["ranks"] == [0, 1]


def test_a_gang_pauses_while_any_of_its_gpus_is_silent() -> None:
    job = fill_job(gpus=2)
    step([job], ranks(2))
    running = {"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 10)}
    step([job], ranks(2), progress=running)
    assert job["status"]["phase"] == "Running" and "ranks 0,1" in job["status"]["message"]
    quiet = [ranks(2)[0], stage(0, rank=1, ranks=2, gpu_uuid="GPU-01", hook_reporting=False)]
    step([job], quiet, progress=running)
    assert job["status"]["phase"] == "Paused" and "stage 0 rank 1" in job["status"]["message"]


def test_the_gangs_eta_comes_from_the_bubbles_its_gpus_share() -> None:
    short = [stage(0, rank=0, ranks=2, gpu_uuid="GPU-0"),
             stage(0, rank=1, ranks=2, gpu_uuid="GPU-1", cycle=cycle(0, bubble_s=0.004))]
    one, gang = fill_job("one", stage=0), fill_job("gang", gpus=2)
    step([one], short[:1])
    step([gang], short)

    def eta(j: dict[str, Any]) -> str:
        return str(j["status"]["eta"])

    assert eta(gang) > eta(one)  # its steps fit only the shorter bubble (4 ms: 2 steps of 2 ms, not 5)


def test_the_spec_takes_gpus_and_passes_them_to_the_agent() -> None:
    obj = fill_job(gpus=4)
    job = FillJobResource.from_object(obj)
    assert job.gpus == 4 and job.job.gpus == 4
    assert FillJobResource.from_object(fill_job()).gpus == 1
    for bad, said in ((0, "spec.gpus must be >= 1"), (65, "spec.gpus must be <= 64"), ("2", "must be an integer")):
        with pytest.raises(ResourceError, match=said):
            FillJobResource.from_object(fill_job(gpus=bad))
    with pytest.raises(ResourceError, match="bubbles-fills-<i>"):
        FillJobResource.from_object(fill_job(volumes=[{"name": "bubbles-fills-1", "mountPath": "/x",
                                                       "emptyDir": {}}]))


# -- the scheduler's gang step ---------------------------------------------------------------------------------
PROFILE = FillProfile("m", WorkloadKind.TRAINING, 1.0, 1.0, (FillConfig("c", 1, (FillNode(0.002, 64 * MIB),)),))


def _cls(name: str, bubble_s: float, free: int = 1024 * MIB) -> ExecutorClass:
    return ExecutorClass(name, (Bubble(bubble_s, free),), 0.1, 1)


def test_the_shared_class_is_the_shortest_bubble_and_least_memory_slot_by_slot() -> None:
    a = ExecutorClass("a", (Bubble(0.010, 100), Bubble(0.003, 50)), 0.1, 1)
    b = ExecutorClass("b", (Bubble(0.004, 200), Bubble(0.008, 10)), 0.12, 1)
    s = shared_class([a, b])
    assert [(x.duration_s, x.free_bytes) for x in s.bubbles] == [(0.004, 100), (0.003, 10)]
    assert s.iteration_s == 0.12 and s.executors == 2


def test_place_gang_reserves_its_executors_in_the_scheduler_and_never_places_part_of_it() -> None:
    sched = Scheduler([_cls("g0", 0.010), _cls("g1", 0.010), _cls("h0", 0.010)])
    groups = [GangGroup("g", (0, 1)), GangGroup("h", (2,))]
    gang = FillJobRequest("gang", PROFILE, 100, gpus=2)
    with pytest.raises(ValueError, match="place_gang"):
        sched.submit(gang, 0.0)
    sched.occupy(1, "other", 5.0)
    assert place_gang(sched, gang, groups, 0.0) is None  # one of g's two is busy; h has one
    assert gang_eta_s(sched, gang, groups, 0.0) > 5.0
    sched.release(1, 1.0, fill=False)
    p = place_gang(sched, gang, groups, 1.0)
    assert p is not None and p.executors == (0, 1) and p.group == "g"
    assert not sched.idle(0) and not sched.idle(1) and sched.idle(2)
    # 100 samples, 2 per gang step (one per process), 5 steps per 0.1 s cycle: 50 steps in 1 s.
    assert p.steps == 50 and math.isclose(p.processing_s, 1.0)
    # A single job now goes to the one free executor; its ETA counts the gang's as busy.
    single = sched.submit(FillJobRequest("single", PROFILE, 10), 1.0)
    assert single is not None and single.executor == 2
    assert sched.expected_completions(1.0)["gang"] == p.end_s
