"""The PipelineTrainings' statuses (bubbles.operator.decide.trainings): whether the hooks report, what harvesting
costs, and why a spec is not read."""

from __future__ import annotations

from helpers.operator import (
    MIB,
    cond,
    fill_job,
    stage,
    step,
    training,
)

from bubbles.operator.decide import (
    GpuView,
)


def test_training_status_says_whether_the_hook_reports_and_what_harvesting_costs() -> None:
    t = training(slowdownBudget=0.01)
    step([], [stage(hook_reporting=False, cycle=None)], [t])
    hook = cond(t, "HookReporting")
    assert hook["status"] == "False" and "attach the hook" in hook["message"] and t["status"]["pods"] == 1
    assert "at /run/bubbles" in hook["message"]  # the other half of what a silent Pod usually lacks
    step([], [stage(iteration_s=0.103, baseline_iteration_s=0.100, bubble_s=10.0, filled_s=7.0)], [t])
    st = t["status"]
    assert st["bubbleRatio"] == 0.1 and st["slowdown"] == 0.03 and st["shareFilled"] == 0.7
    assert st["slowdownText"] == "+3.00% of 1.00%" and cond(t, "BudgetExceeded")["status"] == "True"
    assert st["stages"][0]["gpus"][0]["bubbles"] == [{"slot": 0, "durationSeconds": 0.01, "freeBytes": 1024 * MIB}]
    assert st["stages"][0]["gpus"][0]["shareFilled"] == 0.7 and st["gpus"] == 1 and st["gpusHarvested"] == 0


def test_a_pod_whose_hook_never_reported_gets_a_status_the_server_accepts() -> None:
    from bubbles.core.resources import PIPELINE_TRAINING_STATUS, validate

    t = training()
    silent = GpuView("ml/llama", -1, "llama-0", "uid-llama-0", "node-a", "", None)
    step([], [silent], [t])
    assert t["status"]["stages"] == [] and t["status"]["unreportedPods"] == ["llama-0"] and t["status"]["gpus"] == 0
    assert validate(PIPELINE_TRAINING_STATUS, t["status"], "status") == []


def test_an_invalid_pipeline_training_says_why_in_its_status_with_one_event_until_fixed() -> None:
    t = training()
    del t["spec"]["selector"]
    job = fill_job(trainingSelector={"matchLabels": {"team": "a"}})
    d = step([job], [stage()], [t])
    admitted = cond(t, "Admitted")
    assert admitted["status"] == "False" and admitted["reason"] == "InvalidSpec"
    assert "spec.selector" in admitted["message"] and "kubectl edit pt llama -n ml" in admitted["message"]
    assert [(e.kind, e.type, e.reason) for e in d.events if e.kind == "PipelineTraining"] == \
        [("PipelineTraining", "Warning", "InvalidSpec")]
    assert job["status"]["phase"] == "Queued"  # nothing is placed through a training the operator cannot read
    d = step([job], [stage()], [t])
    assert [e for e in d.events if e.kind == "PipelineTraining"] == [] and "ml/llama" not in d.training_status
    t["spec"]["selector"] = {"matchLabels": {"app": "llama"}}
    t["metadata"]["generation"] = 2
    step([job], [stage()], [t])
    assert cond(t, "Admitted")["status"] == "True" and job["status"]["phase"] == "Placed"


def test_a_stage_no_agent_answers_for_is_blamed_on_the_agent_not_the_hook() -> None:
    t = training()
    step([], [stage(agent_up=False, hook_reporting=False, cycle=None)], [t])
    hook = cond(t, "HookReporting")
    assert hook["reason"] == "NoAgent" and "node-a" in hook["message"] and "agent.gpuNodeLabels" in hook["message"]
    step([], [stage(hook_reporting=False, cycle=None)], [t])
    assert cond(t, "HookReporting")["reason"] == "NoHook" and "stood down" not in cond(t, "HookReporting")["message"]
    # A Pod reporting no GPU beside a Pod of the training that reports on the same node: maybe a twin of a rank (a
    # second training of this name, or the rank started twice), stood down; one reporting a silent GPU is named so.
    step([], [stage(), stage(-1, pod="llama-r1", hook_reporting=False, cycle=None),
              stage(1, pod="llama-elsewhere", node="node-b", hook_reporting=False, cycle=None)], [t])
    said = cond(t, "HookReporting")
    assert said["reason"] == "NoHook" and "llama-elsewhere (stage 1 rank 0), llama-r1:" in said["message"]
    assert "llama-r1 share a node with Pods of this training that report" in said["message"]
    assert "its hook stood down, as one process per rank and node is harvested" in said["message"]
    step([], [stage(node="", agent_up=False, hook_reporting=False, cycle=None)], [t])  # not scheduled yet
    said = cond(t, "HookReporting")
    assert said["reason"] == "NotScheduled" and "llama-0 not on a node yet" in said["message"]


def test_stages_and_microbatches_in_the_spec_are_checked_against_what_the_hook_reports() -> None:
    t = training(stages=2, microbatches=8)
    step([], [stage()], [t])  # the test cycles report 2 stages, 8 micro-batches
    assert cond(t, "SpecMatches")["status"] == "True"
    t["spec"]["microbatches"] = 16
    step([], [stage()], [t])
    said = cond(t, "SpecMatches")
    assert said["status"] == "False" and "spec.microbatches is 16, the hook reports 8" in said["message"]
    plain = training()
    step([], [stage()], [plain])
    assert not [c for c in plain["status"]["conditions"] if c["type"] == "SpecMatches"]  # nothing to check


def test_a_training_outside_its_nodes_mps_server_is_said_per_stage_and_never_acted_on() -> None:
    t = training()
    job = fill_job()
    step([job], [stage(), stage(1, pod="llama-1", node="node-b")], [t])
    assert not [c for c in t["status"]["conditions"] if c["type"] == "MpsClient"]  # nothing known: nothing said
    outside = "not a client: the training's process 4242 is not among the clients of the MPS server in /tmp/x"
    step([job], [stage(training_membership="client"),
                 stage(1, pod="llama-1", node="node-b", training_membership=outside)], [t])
    said = cond(t, "MpsClient")
    assert said["status"] == "False" and said["reason"] == "NotMpsClient"
    assert said["message"] == f"stage 1 rank 0 (llama-1 on node-b): {outside}"
    assert job["status"]["phase"] == "Placed"  # the job is placed and runs all the same
    # A stage restarted and not checked again yet: a partial view changes nothing (no flapping to True).
    step([job], [stage(training_membership="client"), stage(1, pod="llama-1", node="node-b")], [t])
    assert cond(t, "MpsClient")["reason"] == "NotMpsClient"
    step([job], [stage(training_membership="client"), stage(1, pod="llama-1", node="node-b",
                                                            training_membership="client")], [t])
    said = cond(t, "MpsClient")
    assert (said["status"], said["reason"]) == ("True", "MpsClient") and "every profiled GPU (2)" in said["message"]
    step([job], [stage(training_membership="client"), stage(1, pod="llama-1", node="node-b")], [t])
    assert cond(t, "MpsClient")["reason"] == "MpsClient"  # still: nothing new is known against it
    step([job], [stage(), stage(1, pod="llama-1", node="node-b")], [t])  # nothing known at all (mps switched off)
    said = cond(t, "MpsClient")
    assert (said["status"], said["reason"]) == ("Unknown", "NotChecked")
    # A training of many stages outside MPS: one stage's words, the others named, within the status's bound.
    many = [stage(k, pod=f"llama-{k}", node=f"node-{k}", cycle=None, training_membership=outside + " " + "x" * 2000)
            for k in range(64)]
    step([job], many, [t])
    said = cond(t, "MpsClient")
    assert said["message"].startswith(f"stage 0 rank 0 (llama-0 on node-0): {outside}")
    assert said["message"].count(outside) == 1
    assert "; likewise stage 1 rank 0 (llama-1 on node-1), stage 2 rank 0 (llama-2 on node-2)" in said["message"]
    assert said["message"].endswith("stage 20 rank 0 (llama-20 on node-20) and 43 more")
    assert len(said["message"]) < 32768
