"""FillJob tracking (bubbles.operator.decide.filljobs): admission, progress, pauses, evictions, restarts and clean-up.

Each test builds what the operator would see, calls ``reconcile`` (``helpers.operator.step``) and writes the decided
statuses back, as the API server would, before the next round.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
from typing import Any

import pytest
from helpers.operator import (
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
    GpuView,
    JobProgress,
)


def test_an_invalid_fill_job_fails_with_the_reason_and_one_event() -> None:
    bad = fill_job(work={"steps": 0})
    d = step([bad], [stage()])
    assert bad["status"]["phase"] == "Failed" and "spec.work.steps must be >= 1" in bad["status"]["message"]
    assert cond(bad, "Admitted")["status"] == "False" and cond(bad, "Admitted")["reason"] == "InvalidSpec"
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "InvalidSpec")]
    again = step([bad], [stage()])
    assert again.events == [] and again.fill_job_status == {}  # nothing changes, nothing is written


def test_progress_of_an_earlier_attempt_is_not_this_runs() -> None:
    job = fill_job()
    step([job], [stage()])
    job["status"]["restarts"] = 1  # as after an eviction and a new placement
    d = step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.STOPPED, 1000, 1e13, "finished")})
    assert job["status"]["phase"] != "Succeeded" and d.assign and d.assign[0].attempt == 1


def test_progress_from_the_agent_becomes_running_then_succeeded() -> None:
    job = fill_job()
    step([job], [stage()])
    d = step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 400, 4e12)})
    st = job["status"]
    assert st["phase"] == "Running" and st["progressText"] == "40% (400/1000)" and st["recoveredFlops"] == 4e12
    # 600 steps left at 50 steps/s is 08:00:12, within 30 s of the ETA written at placement: kept, not rewritten
    assert st["eta"] == "2026-11-23T08:00:20Z" and [e.reason for e in d.events] == ["Running"]
    later = NOW + dt.timedelta(minutes=5)
    step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 500, 5e12)}, now=later)
    assert job["status"]["eta"] == "2026-11-23T08:05:10Z"  # far from the old one: moved
    d = step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.STOPPED, 1000, 1e13, "finished")})
    assert job["status"]["phase"] == "Succeeded" and cond(job, "Finished")["status"] == "True"
    assert "eta" not in job["status"] and [e.reason for e in d.events] == ["Succeeded"]
    # Once the final status is stored, the agent is told to let go of the run (it would hold and report it until the
    # FillJob is deleted), each round while it still reports it: a lost call, or a status write that failed (the job
    # is then still Running to the next round, and the agent still reports it), costs a round, never a rerun.
    assert d.cancel == [] and d.delete_pods == []
    node = job["status"]["assignment"]["node"]
    finished = {"uid-fj": JobProgress("uid-fj", FillState.STOPPED, 1000, 1e13, "finished")}
    assert step([job], [stage()], progress=finished).cancel == [(node, "uid-fj")]
    assert step([job], [stage()], progress=finished).cancel == [(node, "uid-fj")]  # the call was lost: again
    assert step([job], [stage()]).cancel == []  # the agent let go of it
    # Final: an edit of its spec, even into an invalid one, changes nothing (it is not even parsed again).
    job["spec"]["profile"] = {"memory": "lots"}
    before = copy.deepcopy(job["status"])
    d = step([job], [stage()])
    assert job["status"] == before and (d.cancel, d.delete_pods, d.events) == ([], [], [])


def test_a_running_job_whose_training_falls_silent_is_paused_keeps_its_stage_and_runs_again() -> None:
    job, other = fill_job(), fill_job("other", created="2026-11-23T07:30:00Z")
    step([job, other], [stage()])
    running = {"uid-fj": JobProgress("uid-fj", FillState.PAUSED, 400, 4e12)}  # between two bubbles: still Running
    step([job, other], [stage()], progress=running)
    assert job["status"]["phase"] == "Running" and other["status"]["phase"] == "Queued"
    t = training()
    d = step([job, other], [stage(hook_reporting=False)], [t], progress=running)  # evaluating, checkpointing, hung
    hooks = cond(t, "HookReporting")  # heard before: not a hook to set up
    assert hooks["reason"] == "Silent" and "llama-0" in hooks["message"] and "attach" not in hooks["message"]
    st = job["status"]
    assert st["phase"] == "Paused" and "no bubble signals for 30 s" in st["message"] and "llama-0" in st["message"]
    assert cond(job, "Running")["status"] == "False" and cond(job, "Running")["reason"] == "TrainingSilent"
    assert [e.reason for e in d.events] == ["Paused"] and d.assign == [] and d.cancel == [] and d.delete_pods == []
    assert other["status"]["phase"] == "Queued"  # the stage stays the paused job's
    assert st["progressText"] == "40% (400/1000)" and st["assignment"]["stage"] == 0
    d = step([job, other], [stage(hook_reporting=False)], progress=running)
    assert d.events == [] and "fj" not in {k.split("/")[1] for k in d.fill_job_status}  # said once, not rewritten
    d = step([job, other], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 450, 4.5e12)})
    assert job["status"]["phase"] == "Running" and cond(job, "Running")["reason"] == "Running"
    assert [e.reason for e in d.events] == ["Running"] and job["status"]["progressText"] == "45% (450/1000)"
    # Placed but not started yet: a silent training leaves it Placed (it has nothing to pause).
    late = fill_job("late")
    step([late], [stage(1, pod="llama-1")])
    step([late], [stage(1, pod="llama-1", hook_reporting=False)])
    assert late["status"]["phase"] == "Placed"


def test_a_lost_training_pod_requeues_the_job_uncounted_and_its_own_losses_reach_the_restart_limit() -> None:
    job = fill_job(restartLimit=1, checkpoint={"path": "/ckpt"})
    step([job], [stage()])
    d = step([job], [stage(1, pod="llama-1")])  # llama-0 is gone: the training's doing, not the job's
    st = job["status"]
    assert st["restarts"] == 1 and st["phase"] == "Queued" and "assignment" not in st  # requeued
    assert st["counters"]["trainingDisruptions"] == 1 and st["counters"]["evictions"] == 1
    assert "not counted against spec.restartLimit, the training's doing; 0/1 used" in st["message"], st["message"]
    assert d.delete_pods == [("ml", "fj-fj-a0")] and d.cancel == [("node-a", "uid-fj")]
    assert [e.reason for e in d.events] == ["Evicted"] and d.create_pods == []  # the eviction is written first
    assert cond(job, "Evicted")["reason"] == "Requeued"
    d = step([job], [stage(1, pod="llama-1")])  # the next round places it again, as a new attempt
    assert job["status"]["phase"] == "Placed" and job["status"]["assignment"]["trainingPod"] == "llama-1"
    assert [e.reason for e in d.events] == ["Placed"] and d.create_pods[0]["metadata"]["name"] == "fj-fj-a1"
    step([job], [stage(), stage(1, pod="llama-1", agent_up=False)])  # its agent stops answering: counted
    assert job["status"]["phase"] == "Queued" and "(1/1 restarts used" in job["status"]["message"]
    assert job["status"]["restarts"] == 2 and job["status"]["counters"]["trainingDisruptions"] == 1
    step([job], [stage()])
    assert job["status"]["assignment"]["pod"] == "fj-fj-a2"
    d = step([job], [stage(agent_up=False)])  # again: past the limit
    assert job["status"]["phase"] == "Failed" and "spec.restartLimit" in job["status"]["message"]
    assert "stopped answering" in job["status"]["message"] and d.create_pods == []


def test_a_training_that_keeps_restarting_never_fails_its_fill_jobs() -> None:
    """Restarted, replaced or edited into an invalid spec and back, any number of times: the job's restart limit is
    for losses of its own."""
    def pod(uid: str, **kw: Any) -> GpuView:
        return dataclasses.replace(stage(**kw), pod_uid=uid)

    job = fill_job(restartLimit=0)
    for attempt in range(4):
        step([job], [pod(f"uid-{attempt}")])
        assert job["status"]["phase"] == "Placed", job["status"]
        step([job], [pod(f"uid-{attempt + 1}")])  # the training Pod replaced under the same name
        assert job["status"]["phase"] == "Queued" and job["status"]["restarts"] == attempt + 1, job["status"]
    step([job], [pod("uid-4")])
    step([job], [pod("uid-4", cycle=None)])  # its training Pod restarted
    assert job["status"]["phase"] == "Queued"
    step([job], [pod("uid-4")])
    step([job], [], [training(slowdownBudget=7)])  # the training's spec turned invalid
    assert job["status"]["phase"] == "Queued" and job["status"]["counters"]["trainingDisruptions"] == 6


@pytest.mark.parametrize("state", [FillState.RUNNING, FillState.PAUSED, FillState.STOPPED])
def test_a_training_pod_lost_while_the_job_was_on_its_gpu_counts_against_the_limit(state: FillState) -> None:
    """A fatal fault of one MPS client reaches every client of the server, the training among them: once the job's
    process is on the training's GPU, the training Pod's restart may be the job's doing, and counts."""
    job = fill_job(restartLimit=0)
    step([job], [stage()])
    on_gpu = {"uid-fj": JobProgress("uid-fj", state, 10, 1e9, "killed" if state is FillState.STOPPED else "")}
    step([job], [stage(cycle=None)], progress=on_gpu)  # its training Pod restarted
    assert job["status"]["phase"] == "Failed" and "spec.restartLimit" in job["status"]["message"]
    assert "trainingDisruptions" not in job["status"]["counters"]
    cpu = fill_job("on-cpu", restartLimit=0)
    step([cpu], [dataclasses.replace(stage(), device="cpu")])
    progress = {"uid-on-cpu": JobProgress("uid-on-cpu", state, 10, 1e9)}
    # a CPU process cannot fault the training's
    step([cpu], [dataclasses.replace(stage(cycle=None), device="cpu")], progress=progress)
    assert cpu["status"]["phase"] == "Queued"


def test_a_just_started_operator_does_not_evict_a_job_whose_training_pod_it_has_not_listed_yet() -> None:
    # A restarted operator's watches list the FillJobs and the Pods in their own time: in its first seconds a
    # placed job's training Pod may not be in its store yet. That is not a Pod that is gone (seen in CI, 2026-11-24:
    # the restarted operator deleted the running fill Pod and placed the job again).
    from bubbles.operator.decide import STARTUP_GRACE_S

    job = fill_job()
    step([job], [stage()])
    placed = json.loads(json.dumps(job["status"]))
    d = step([job], [], acting_s=0.5)  # the training Pod not listed yet
    assert job["status"] == placed and d.delete_pods == [] and d.cancel == [] and d.events == []
    d = step([job], [], acting_s=STARTUP_GRACE_S + 1)  # still not there after the grace: gone
    assert "is gone" in cond(job, "Evicted")["message"] and d.delete_pods == [("ml", "fj-fj-a0")]


def test_a_stage_its_restarted_agent_does_not_report_says_so_not_that_the_pod_is_gone() -> None:
    job = fill_job()
    step([job], [stage()])
    # A restarted agent: the training Pod is there (stage -1: no card read yet), the job's stage is not reported.
    step([job], [stage(-1, cycle=None, hook_reporting=False)])
    msg = cond(job, "Evicted")["message"]
    assert "no longer reports stage 0 rank 0 of llama" in msg and "llama-0 still runs" in msg and "is gone" not in msg
    assert job["status"]["restarts"] == 1


def test_a_fill_pod_that_ended_while_its_restarted_agent_knows_no_run_is_requeued() -> None:
    """The node's agent restarted: the fill process left with the old agent's channel (exit 0), the new agent only
    has the operator's repeated assignment, waiting for a process that will never attach (seen on a real node)."""
    job = fill_job()
    step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 10, 1e9, attempt=0)})
    ended = {"ml/fj-fj-a0": "Completed (exit code 0)"}
    d = step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.SUBMITTED, attempt=0)},
             ended_pods=ended)
    assert job["status"]["restarts"] == 1 and "holds no run of the job" in cond(job, "Evicted")["message"]
    assert ("ml", "fj-fj-a0") not in d.delete_pods  # it ended by itself: kept for its logs
    # The normal end is not mistaken for it: the agent reports the run STOPPED (finished) before the Pod ends.
    done = fill_job("done")
    step([done], [stage()])
    step([done], [stage()], progress={"uid-done": JobProgress("uid-done", FillState.STOPPED, 1000, 1e13, "finished")},
         ended_pods={"ml/fj-done-a0": "Completed (exit code 0)"})
    assert done["status"]["phase"] == "Succeeded"
    # While the agent still runs the process, an ended Pod is not acted on either (the agent says what happened).
    run = fill_job("run")
    step([run], [stage()])
    step([run], [stage()], progress={"uid-run": JobProgress("uid-run", FillState.RUNNING, 5, 1e9)},
         ended_pods={"ml/fj-run-a0": "Completed (exit code 0)"})
    assert run["status"]["phase"] == "Running" and run["status"]["restarts"] == 0


def test_a_restarted_training_pod_is_re_profiled_before_it_gets_work_again() -> None:
    job = fill_job()
    step([job], [stage()])
    d = step([job], [stage(cycle=None)])  # same Pod name, restarted: no cycle until the hook profiles it again
    assert job["status"]["phase"] == "Queued" and "re-measured" in cond(job, "Evicted")["message"]
    assert d.create_pods == [] and cond(job, "Placed")["reason"] == "Evicted"
    assert [e.reason for e in d.events] == ["Evicted"] and "re-measured" in d.events[0].message
    d = step([job], [stage(cycle=None)])  # the next round: it waits for the profile
    assert d.create_pods == [] and cond(job, "Placed")["reason"] == "NoProfiledTraining"


def test_a_finalizer_is_held_only_while_a_job_has_something_to_clean_up() -> None:
    job = fill_job()
    d = step([job], [])
    assert d.add_finalizer == []  # queued: nothing to clean up
    d = step([job], [stage()])
    assert d.add_finalizer == ["ml/fj"]
    job["metadata"]["finalizers"] = ["bubbles.dev/fill-job-cleanup"]
    job["metadata"]["deletionTimestamp"] = "2026-11-23T08:01:00Z"
    d = step([job], [stage()])
    assert d.delete_pods == [("ml", "fj-fj-a0")] and d.cancel == [("node-a", "uid-fj")]
    assert d.remove_finalizer == ["ml/fj"] and d.create_pods == [] and [e.reason for e in d.events] == ["Deleted"]


def test_one_bad_job_does_not_stop_the_round_for_the_others() -> None:
    bad_date = fill_job("bad-date", deadline="2026-02-30T08:00:00Z")  # passes the schema's pattern
    huge = fill_job("huge", work={"steps": 10**15})
    good = fill_job("good")
    step([bad_date, huge, good], [stage(), stage(1, pod="llama-1")])
    assert bad_date["status"]["phase"] == "Failed" and "is not a valid time" in bad_date["status"]["message"]
    assert huge["status"]["phase"] == "Placed" and "eta" not in huge["status"]  # beyond any calendar
    assert good["status"]["phase"] in ("Placed", "Queued")


def test_a_running_job_edited_into_an_invalid_spec_is_stopped_and_its_stage_freed() -> None:
    job = fill_job()
    step([job], [stage()])
    job["spec"].pop("entry")  # an edit the schema cannot refuse (entry or command is the operator's rule)
    job["metadata"]["generation"] = 2
    d = step([job], [stage()])
    assert job["status"]["phase"] == "Failed" and "assignment" not in job["status"]
    assert d.delete_pods == [("ml", "fj-fj-a0")] and d.cancel == [("node-a", "uid-fj")]
    other = fill_job("other")
    d = step([job, other], [stage()])
    assert other["status"]["phase"] == "Placed"  # the stage is free again


def test_a_new_training_pod_under_the_same_name_evicts_what_ran_in_the_old_ones_bubbles() -> None:
    job = fill_job()
    step([job], [stage()])
    assert job["status"]["assignment"]["trainingPodUid"] == "uid-llama-0"
    replaced = GpuView("ml/llama", 0, "llama-0", "uid-llama-0-again", "node-a", "cuda:0", cycle=cycle(0),
                         hook_reporting=True)
    d = step([job], [replaced])
    assert job["status"]["restarts"] == 1 and ("ml", "fj-fj-a0") in d.delete_pods
    assert "replaced by a new Pod of the same name" in cond(job, "Evicted")["message"]


def test_a_failed_fill_pod_evicts_its_job_with_the_kubelets_reason() -> None:
    job = fill_job()
    step([job], [stage()])
    d = step([job], [stage()], failed_pods={"ml/fj-fj-a0": "OOMKilled (exit code 137)"})
    assert job["status"]["restarts"] == 1 and d.delete_pods == []  # kept, like a Job's: `kubectl logs` works
    assert "fill Pod fj-fj-a0 failed: OOMKilled (exit code 137) (its Pod fj-fj-a0 is kept for its logs)" in \
        cond(job, "Evicted")["message"]
    assert d.events[0].reason == "Evicted" and d.create_pods == []  # the eviction is written first
    # The stage is free again: the next round places the next attempt, in a Pod of its own.
    step([job], [stage()], failed_pods={"ml/fj-fj-a0": "OOMKilled (exit code 137)"})
    assert job["status"]["assignment"]["pod"] == "fj-fj-a1" and job["status"]["restarts"] == 1


def test_a_job_that_reports_no_flops_is_counted_by_its_declared_flops_per_step() -> None:
    job = fill_job(profile={"memory": "64Mi", "stepTime": "2ms", "flopsPerStep": 1e9})
    step([job], [stage()])
    step([job], [stage()], progress={"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 250, 0.0)})
    assert job["status"]["recoveredFlops"] == 250 * 1e9
    reported = fill_job("own", profile={"memory": "64Mi", "stepTime": "2ms", "flopsPerStep": 1e9})
    step([reported], [stage(pod="llama-1", k=1)])
    step([reported], [stage(pod="llama-1", k=1)], progress={"uid-own": JobProgress("uid-own", FillState.RUNNING, 10,
                                                                                     5e6)})
    assert reported["status"]["recoveredFlops"] == 5e6  # its own count wins


def test_a_training_edited_into_an_invalid_spec_says_so_on_the_jobs_it_had() -> None:
    t = training()
    job = fill_job()
    step([job], [stage()], [t])
    assert job["status"]["phase"] == "Placed"
    t["spec"]["selector"] = {}
    step([job], [], [t])  # the shell reports no stage for a training it cannot read
    assert job["status"]["phase"] == "Queued"
    assert "PipelineTraining llama's spec turned invalid (spec.selector must select" in cond(job, "Evicted")["message"]
