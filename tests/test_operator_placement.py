"""Placement (bubbles.operator.decide.placement): queued FillJobs onto profiled stages, by priority and policy, with
their queue positions, ETAs and the reasons they wait."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any

import pytest
from helpers.operator import (
    HOST_PATH,
    MIB,
    NOW,
    cond,
    cycle,
    fill_job,
    stage,
    step,
    training,
)

from bubbles.core.api import FillState
from bubbles.operator.decide import (
    ClusterView,
    FillPodSettings,
    GpuView,
    JobProgress,
    fill_pod_node,
    reconcile,
)


def test_a_valid_job_is_placed_on_a_profiled_stage_with_its_pod_on_that_node() -> None:
    job = fill_job()
    d = step([job], [stage()])
    st = job["status"]
    assert st["phase"] == "Placed" and st["observedGeneration"] == 1
    assert st["assignment"] == {"training": "llama", "stage": 0, "ranks": [0], "node": "node-a", "device": "cuda:0",
                                "pod": "fj-fj-a0", "trainingPod": "llama-0", "trainingPodUid": "uid-llama-0",
                                "placedAt": "2026-11-23T08:00:00Z"}
    assert st["progressText"] == "0% (0/1000)" and st["counters"]["placements"] == 1
    # 10 ms bubble per 100 ms iteration, 2 ms steps: 5 steps per iteration -> 1000 steps in 20 s
    assert st["eta"] == "2026-11-23T08:00:20Z"
    (pod,) = d.create_pods
    assert fill_pod_node(pod["spec"]) == "node-a"
    assert pod["metadata"]["name"] == "fj-fj-a0"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-fj"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["BUBBLES_TRAINING"] == "llama" and env["BUBBLES_STAGE"] == "0" and env["BUBBLES_DEVICE"] == "cuda:0"
    assert env["BUBBLES_MEMORY_BYTES"] == str(64 * MIB) and env["BUBBLES_MAX_STEPS"] == "1000"
    assert pod["spec"]["automountServiceAccountToken"] is False and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    (a,) = d.assign
    assert (a.uid, a.node, a.stage, a.fill_pod) == ("uid-fj", "node-a", 0, "fj-fj-a0")
    assert [e.reason for e in d.events] == ["Placed"]  # queued and placed in one round: one Event
    d = step([fill_job("on-gpu")], [stage(1, pod="llama-1", gpu_uuid="GPU-1234")], fill_pods=HOST_PATH)
    env = {e["name"]: e["value"] for e in d.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1234" and env["BUBBLES_DEVICE"] == "cuda:0"


def test_a_job_whose_pod_the_api_server_refused_says_why_and_is_placed_again_later() -> None:
    job = fill_job()
    refused_at = NOW.timestamp() - 10
    msg = "403 pods \"fj-fj-a0\" is forbidden: maximum memory usage per Container is 1Mi, but limit is 2Mi"
    view = dict(refused_pods={"uid-fj": (msg, refused_at)}, pod_retry_s=30.0)
    d = reconcile(ClusterView(NOW, [job], [training()], [stage()], **view))  # type: ignore[arg-type]
    st = d.fill_job_status["ml/fj"]
    assert st["phase"] == "Queued" and d.create_pods == [] and d.assign == []
    assert "the API server refused its Pod: 403 pods" in st["message"] and "LimitRange" in st["message"]
    assert next(c for c in st["conditions"] if c["type"] == "Placed")["reason"] == "PodRefused"
    # Admitted (its status was never written: the round that placed it had its Pod refused), then why it waits.
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "Queued"), ("Warning", "PodRefused")]
    job["status"] = st
    again = reconcile(ClusterView(NOW, [job], [training()], [stage()], **view))  # type: ignore[arg-type]
    assert again.events == [] and again.create_pods == []  # said once; still waiting
    # Refused again in other words (a quota's counts change): the message follows, the Event is not repeated.
    other = dict(refused_pods={"uid-fj": ("403 exceeded quota: compute, used: pods=5", refused_at)}, pod_retry_s=30.0)
    again = reconcile(ClusterView(NOW, [job], [training()], [stage()], **other))  # type: ignore[arg-type]
    assert again.events == [] and "used: pods=5" in again.fill_job_status["ml/fj"]["message"]
    # A spec the cluster finds invalid (422) is not a quota's doing: the hint says so.
    invalid = dict(refused_pods={"uid-fj": ("422 Pod is invalid: spec.volumes", refused_at)}, pod_retry_s=30.0)
    d422 = reconcile(ClusterView(NOW, [fill_job("other")], [training()], [stage()],  # type: ignore[arg-type]
                                 **{**invalid, "refused_pods": {"uid-other": invalid["refused_pods"]["uid-fj"]}}))
    assert "finds the Pod's spec invalid" in d422.fill_job_status["ml/other"]["message"]
    later = NOW + dt.timedelta(seconds=21)  # 31 s after the refusal: tried again
    d = reconcile(ClusterView(later, [job], [training()], [stage()], **view))  # type: ignore[arg-type]
    assert [p["metadata"]["name"] for p in d.create_pods] == ["fj-fj-a0"] and d.fill_job_status["ml/fj"]["phase"] == \
        "Placed"


def test_a_placed_job_is_never_placed_twice_even_by_a_restarted_operator() -> None:
    job = fill_job()
    (first,) = step([job], [stage()]).assign
    for _ in range(3):  # every later round sees the assignment in the status: nothing is created again
        d = step([job], [stage(), stage(1, pod="llama-1")])
        # Until the agent reports the run, the same assignment is told again (the agent keeps it once: same key).
        assert d.create_pods == [] and d.assign == [first]
    d = step([job], [stage(), stage(1, pod="llama-1")],
             progress={"uid-fj": JobProgress("uid-fj", FillState.SUBMITTED, attempt=0)})
    assert d.create_pods == [] and d.assign == []


def test_every_assignment_carries_its_trainings_slowdown_budget_and_largest_share() -> None:
    job = fill_job()
    trainings = [training(slowdownBudget=0.05, maxFillShare=0.5, tailRisk=0.02)]
    (placed,) = step([job], [stage()], trainings).assign
    (told_again,) = step([job], [stage()], trainings).assign  # until the agent reports the run
    assert (placed.slowdown_budget, placed.max_fill_share, placed.tail_risk) == (
        told_again.slowdown_budget, told_again.max_fill_share, told_again.tail_risk) == (0.05, 0.5, 0.02)
    (default,) = step([fill_job("other")], [stage()]).assign
    assert (default.slowdown_budget, default.max_fill_share, default.tail_risk) == (0.01, 1.0, 0.1)  # the defaults


def test_jobs_wait_with_a_reason_people_can_act_on() -> None:
    big = fill_job("big", profile={"memory": "4Gi", "stepTime": "2ms"})
    elsewhere = fill_job("other", trainingSelector={"matchLabels": {"team": "b"}})
    step([big, elsewhere], [stage()])
    assert big["status"]["phase"] == "Queued" and cond(big, "Placed")["reason"] == "NoBubbleFits"
    assert "lower spec.profile.memory" in big["status"]["message"]
    assert cond(elsewhere, "Placed")["reason"] == "NoMatchingTraining"
    lone = fill_job("lone")
    step([lone], [stage(hook_reporting=False, cycle=None)])
    assert "no PipelineTraining has reported its bubbles yet" in lone["status"]["message"]


def test_priority_then_policy_and_the_queue_gets_positions_and_etas() -> None:
    first = fill_job("first", created="2026-11-23T06:00:00Z")
    urgent = fill_job("urgent", created="2026-11-23T07:30:00Z", priority=10)
    step([first, urgent], [stage()])
    assert urgent["status"]["phase"] == "Placed" and first["status"]["phase"] == "Queued"
    assert first["status"]["queuePosition"] == 1
    assert first["status"]["eta"] == "2026-11-23T08:00:40Z"  # after urgent's 20 s, then its own 20 s
    late = fill_job("late", deadline="2026-11-23T08:00:30Z")
    step([first, urgent, late], [stage()])
    assert late["status"]["deadlineFeasible"] is False and first["status"]["queuePosition"] == 1


def test_the_eta_counts_the_jobs_init_time_until_it_has_initialized() -> None:
    """A batch-inference job loading its model for 3 minutes holds its stage meanwhile: its ETA, and the ETAs of the
    jobs queued behind it, count that time, and what is left of it once placed, until the agent says it is ready."""
    loads = fill_job("loads", created="2026-11-23T06:00:00Z", profile={"memory": "64Mi", "stepTime": "2ms",
                                                                          "initTime": "3m"})
    behind = fill_job("behind", created="2026-11-23T07:00:00Z")
    step([loads, behind], [stage()])
    assert loads["status"]["phase"] == "Placed" and loads["status"]["eta"] == "2026-11-23T08:03:20Z"  # 180 + 20 s
    assert behind["status"]["eta"] == "2026-11-23T08:03:40Z"
    # Two minutes on, its process still loading (CREATED): 60 s of init left, then its 20 s of steps.
    two = NOW + dt.timedelta(minutes=2)
    step([loads], [stage()], now=two, progress={"uid-loads": JobProgress("uid-loads", FillState.CREATED, 0, 0.0)})
    assert loads["status"]["eta"] == "2026-11-23T08:03:20Z"
    # Initialized early (PAUSED: on its device, waiting for a bubble): the rest of the init is not counted.
    step([loads], [stage()], now=two, progress={"uid-loads": JobProgress("uid-loads", FillState.PAUSED, 0, 0.0)})
    assert loads["status"]["eta"] == "2026-11-23T08:02:20Z"
    # Slower than said: no init left to count, never a negative one.
    late = NOW + dt.timedelta(minutes=10)
    step([loads], [stage()], now=late, progress={"uid-loads": JobProgress("uid-loads", FillState.CREATED, 0, 0.0)})
    assert loads["status"]["eta"] == "2026-11-23T08:10:20Z"


def test_a_placement_time_that_cannot_be_read_counts_no_init_and_stops_nothing() -> None:
    """status.assignment.placedAt is the operator's own, but a status edited by hand (or an older operator's, without
    it) must not stop the round: the ETA then counts the steps alone."""
    job = fill_job(profile={"memory": "64Mi", "stepTime": "2ms", "initTime": "3m"})
    step([job], [stage()])
    for placed in ("yesterday", None):
        if placed is None:
            job["status"]["assignment"].pop("placedAt")
        else:
            job["status"]["assignment"]["placedAt"] = placed
        job["status"].pop("eta")
        step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.CREATED, 0, 0.0)})
        assert job["status"]["phase"] == "Placed" and job["status"]["eta"] == "2026-11-23T08:00:20Z"


@pytest.mark.parametrize(("profile", "needle"), [
    ({"initTime": "soon"}, "spec.profile.initTime must be a duration like 30m"),
    ({"initTime": "25h"}, "spec.profile.initTime must be at most a day"),
    ({"initTime": "0"}, "spec.profile.initTime must be a duration > 0"),
])
def test_a_bad_init_time_fails_the_job_saying_so(profile: dict[str, Any], needle: str) -> None:
    job = fill_job(profile={"memory": "64Mi", **profile})
    step([job], [stage()])
    assert job["status"]["phase"] == "Failed" and needle in job["status"]["message"], job["status"]["message"]


def test_an_init_time_past_the_init_timeout_fails_the_job_saying_which_to_change() -> None:
    job = fill_job(profile={"memory": "64Mi", "initTime": "20m"}, initTimeout="10m")
    step([job], [stage()])
    assert job["status"]["phase"] == "Failed"
    assert ("spec.profile.initTime (20m) is more than spec.initTimeout (10m): the node agent would kill the job "
            "before its init is expected to end") in job["status"]["message"]


def test_the_stage_an_eviction_frees_is_held_for_the_evicted_job_not_given_to_a_lower_priority_one() -> None:
    hi, lo = fill_job("hi", priority=10), fill_job("lo")
    step([hi, lo], [stage()])
    assert hi["status"]["phase"] == "Placed" and lo["status"]["phase"] == "Queued"
    d = step([hi, lo], [stage()], failed_pods={"ml/fj-hi-a0": "OOMKilled (exit code 137)"})
    assert d.create_pods == [] and hi["status"]["phase"] == "Queued" and lo["status"]["phase"] == "Queued"
    d = step([hi, lo], [stage()], failed_pods={"ml/fj-hi-a0": "OOMKilled (exit code 137)"})
    assert [p["metadata"]["name"] for p in d.create_pods] == ["fj-hi-a1"]  # by priority, a round later


def test_a_stages_scheduler_class_follows_its_cycle_and_its_trainings_share_and_reserve() -> None:
    """The class is memoized per stage; an edited share or reserve, or a newly reported cycle, must show at once."""
    from bubbles.core.resources import PipelineTrainingResource
    from bubbles.operator.decide import DecideCache

    executor_class = DecideCache().executor_class  # one cache, as the shell keeps one
    s = stage(0)
    half = PipelineTrainingResource.from_object(training(maxFillShare=0.5))
    quarter = PipelineTrainingResource.from_object(training(maxFillShare=0.25, memoryReserve="512Mi"))
    a = executor_class(s, half)
    assert a.bubbles[0].duration_s == 0.005 and a.bubbles[0].free_bytes == 1024 * MIB
    assert executor_class(s, half) is a  # unchanged: the same class
    b = executor_class(s, quarter)
    assert b.bubbles[0].duration_s == 0.0025 and b.bubbles[0].free_bytes == 512 * MIB
    longer = replace(s, cycle=cycle(0, bubble_s=0.040))  # the agent reported a new cycle for the same stage
    assert executor_class(longer, quarter).bubbles[0].duration_s == 0.010


def test_outside_mps_a_gpu_stage_is_offered_only_what_a_job_and_its_cuda_context_fit() -> None:
    """The agent plans a GPU job's memory plus its CUDA context outside MPS: the operator must not place a job the
    agent would refuse (it would be placed, refused and failed after its restarts)."""
    ctx = 512 * MIB
    tight = [stage(cycle=cycle(free=1024 * MIB))]
    job = fill_job(profile={"memory": "768Mi", "stepTime": "2ms"})  # fits 1 GiB alone, not with 512 MiB beside it
    step([job], tight, cuda_context_bytes=ctx)
    assert job["status"]["phase"] == "Queued"
    roomy = fill_job("roomy", profile={"memory": "256Mi", "stepTime": "2ms"})
    step([roomy], tight, cuda_context_bytes=ctx)
    assert roomy["status"]["phase"] == "Placed"
    mps = fill_job("mps", profile={"memory": "768Mi", "stepTime": "2ms"})  # an MPS client's context is the server's
    step([mps], tight, cuda_context_bytes=ctx, fill_pods=FillPodSettings(mps_pipe_dir="/tmp/nvidia-mps"))
    assert mps["status"]["phase"] == "Placed"
    cpu = fill_job("cpu", profile={"memory": "768Mi", "stepTime": "2ms"})
    step([cpu], [GpuView("ml/llama", 0, "llama-0", "uid-llama-0", "node-a", "cpu", cycle(free=1024 * MIB),
                           hook_reporting=True)], cuda_context_bytes=ctx)
    assert cpu["status"]["phase"] == "Placed"
