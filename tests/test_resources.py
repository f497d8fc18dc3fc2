"""The custom resources (bubbles.core.resources) and their CRDs (bubbles.operator.crd): one table, no drift."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml

from bubbles.core.api import FillInterface, WorkloadKind
from bubbles.core.resources import (
    FILL_JOB_SPEC,
    PIPELINE_TRAINING_SPEC,
    Condition,
    FillJobResource,
    PipelineTrainingResource,
    ResourceError,
    apply_defaults,
    selector_matches,
    set_condition,
    validate,
)
from bubbles.operator.crd import all_crds, render

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "cluster"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def test_committed_crds_are_what_the_code_generates() -> None:
    for name, crd in all_crds().items():
        committed = ROOT / "crds" / name
        assert committed.exists(), f"crds/{name} is missing: run python -m bubbles.operator.crd crds/"
        assert committed.read_text() == render(crd), (
            f"crds/{name} differs from bubbles.core.resources: run python -m bubbles.operator.crd crds/ and commit it")


def test_the_schema_carries_every_field_enum_and_default_of_the_table() -> None:
    fj = all_crds()["filljobs.yaml"]
    version = fj["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["properties"]) == {f.name for f in FILL_JOB_SPEC}
    assert spec["properties"]["kind"]["enum"] == [k.value for k in WorkloadKind]
    assert spec["properties"]["interface"]["enum"] == [i.value for i in FillInterface]
    assert spec["properties"]["restartLimit"]["default"] == 3
    assert set(spec["required"]) == {"image", "profile", "work"}
    assert version["subresources"] == {"status": {}}
    assert fj["spec"]["names"]["shortNames"] == ["fj"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:2] == ["Phase", "Training"] and "Progress" in columns and "ETA" in columns
    assert "Restarts" in columns
    for c in version["additionalPrinterColumns"]:  # each column reads a field the schema declares
        node = version["schema"]["openAPIV3Schema"]
        for part in c["jsonPath"].strip(".").split("."):
            node = (node.get("properties") or {}).get(part, {}) if part != "creationTimestamp" else {"type": "string"}
            assert node, f"column {c['name']} reads {c['jsonPath']}, which the schema does not declare"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for path in ("phase", "assignment", "progress", "eta", "deadlineFeasible", "restarts", "recoveredFlops",
                 "conditions", "observedGeneration", "counters"):
        assert path in status, f"status.{path} is not declared: the API server would prune it"
    pt = all_crds()["pipelinetrainings.yaml"]["spec"]
    assert pt["names"]["shortNames"] == ["pt"]


def test_examples_are_valid_and_map_onto_the_agents_spec() -> None:
    fj = FillJobResource.from_object({**load("filljob-image-classification.yaml"),
                                      "metadata": {"name": "image-classification", "namespace": "ml", "uid": "u1"}})
    assert fj.job.name == "image-classification" and fj.job.interface is FillInterface.ITERATIVE
    assert fj.job.kind is WorkloadKind.TRAINING and fj.job.memory_bytes == 64 * 2**20
    assert fj.job.step_time_s == pytest.approx(0.0015) and fj.steps == 2000 and fj.job.steps == 2000
    assert fj.restart_limit == 3 and fj.training_selector == {"matchLabels": {"bubbles.dev/harvest": "true"}}
    bi = FillJobResource.from_object(load("filljob-batch-inference.yaml"))
    assert bi.steps == 4000 and bi.samples_per_step == 16 and bi.priority == 10
    assert bi.deadline == dt.datetime(2030, 1, 1, tzinfo=dt.UTC) and bi.checkpoint_path is None  # nothing to save
    assert bi.job.init_timeout_s == 1200 and fj.job.init_timeout_s is None  # None: the agent's --init-timeout
    assert bi.init_s == 120 and fj.init_s == 0
    assert fj.job.flops_per_step is None and bi.job.flops_per_step is None  # both jobs count their own FLOPs
    counted = FillJobResource.from_object({**load("filljob-image-classification.yaml"), "spec": {
        **load("filljob-image-classification.yaml")["spec"],
        "profile": {**load("filljob-image-classification.yaml")["spec"]["profile"], "flopsPerStep": 3e9}}})
    assert counted.flops_per_step == 3e9 and counted.job.flops_per_step == 3e9  # the operator's and the agent's
    gang = FillJobResource.from_object({**load("filljob-gang.yaml"),
                                        "metadata": {"name": "image-classification-gang", "namespace": "ml"}})
    assert gang.gpus == 2 and gang.job.gpus == 2 and gang.steps == 2000 and fj.gpus == bi.gpus == 1
    from bubbles.training.sdk import load_entry

    assert gang.job.entry is not None and not load_entry(gang.job.entry)(**gang.job.args).is_finished()
    pt = PipelineTrainingResource.from_object(load("pipelinetraining.yaml"))
    assert pt.memory_reserve_bytes == 512 * 2**20 and pt.slowdown_budget == 0.01 and pt.stages == 2


GOOD: dict[str, Any] = {"image": "img:1", "entry": "m:C", "profile": {"memory": "1Gi"}, "work": {"steps": 10}}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"image": None}, "spec.image is required"),
        ({"image": "has space"}, "spec.image 'has space' is not valid"),
        ({"entry": "no-colon"}, "spec.entry 'no-colon' is not valid"),
        ({"kind": "finetune"}, "spec.kind must be one of training, batch-inference"),
        ({"interface": "sometimes"}, "spec.interface must be one of iterative, imperative"),
        ({"profile": {}}, "spec.profile.memory is required"),
        ({"profile": {"memory": "lots"}}, "spec.profile.memory must be bytes or a Kubernetes quantity"),
        ({"profile": {"memory": "0"}}, "spec.profile.memory must be more than 0, got '0'"),
        ({"profile": {"memory": "1Gi", "stepTime": "soon"}}, "spec.profile.stepTime must be a duration"),
        ({"work": {}}, "spec.work needs exactly one of steps, samples, got none"),
        ({"work": {"steps": 1, "samples": 5}}, "spec.work needs exactly one of steps, samples, got steps, samples"),
        ({"work": {"steps": 0}}, "spec.work.steps must be >= 1"),
        ({"work": {"steps": 1.5}}, "spec.work.steps must be an integer"),
        ({"priority": 5000}, "spec.priority must be <= 1000"),
        ({"deadline": "tomorrow"}, "spec.deadline 'tomorrow' is not valid"),
        ({"restartLimit": -1}, "spec.restartLimit must be >= 0"),
        ({"initTimeout": "soon"}, "spec.initTimeout must be a duration"),
        ({"initTimeout": "2d"}, "spec.initTimeout must be a duration like 30m, 1h, 90s or 600 (seconds)"),
        ({"profile": {"memory": "1Gi", "stepTime": "5m"}}, "spec.profile.stepTime must be a duration like 2ms"),
        ({"initTimeout": "25h"}, "spec.initTimeout must be more than 0 and at most a day"),
        ({"trainingSelector": {"matchLabels": {"a": 1}}}, "spec.trainingSelector.matchLabels must be a map"),
        ({"trainingSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
         "spec.trainingSelector.matchExpressions[0].operator must be one of In, NotIn, Exists, DoesNotExist"),
        ({"colour": "blue"}, "spec.colour is not a known field"),
        ({"runtimeClassName": "Nvidia"}, "spec.runtimeClassName 'Nvidia' is not valid"),
        ({"runtimeClassName": "n" * 254}, "spec.runtimeClassName"),
        ({"command": []}, "spec.command must have at least 1 item"),
        ({"resources": {"requests": {"cpu": "lots"}}}, "spec.resources.requests.cpu must be CPU cores or millicores"),
        ({"resources": {"requests": {"gpu": 1}}}, "spec.resources.requests.gpu is not a known field"),
        ({"resources": {"requests": {"cpu": 0.5}}}, "spec.resources.requests.cpu must be CPU cores"),  # quote it
        ({"resources": {"limits": {"cpu": 10**400}}}, "spec.resources.limits.cpu must be CPU cores"),
        ({"resources": {"limits": {"cpu": -1}}}, "spec.resources.limits.cpu must be CPU cores"),
        ({"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}},
         "spec.resources.requests.memory (8Gi) must not be more than spec.resources.limits.memory (4Gi)"),
        ({"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "500m"}}},
         "spec.resources.requests.cpu (2) must not be more than spec.resources.limits.cpu (500m)"),
    ],
)
def test_bad_fill_jobs_are_refused_naming_the_field(change: dict[str, Any], needle: str) -> None:
    spec = copy.deepcopy(GOOD)
    for k, v in change.items():
        if v is None:
            spec.pop(k)
        else:
            spec[k] = v
    with pytest.raises(ResourceError) as err:
        FillJobResource.from_object({"metadata": {"name": "j"}, "spec": spec})
    assert needle in str(err.value)


def test_rules_the_schema_cannot_say_are_checked_by_the_operator() -> None:
    with pytest.raises(ResourceError, match="needs entry"):
        FillJobResource.from_object({"metadata": {"name": "j"}, "spec": {**GOOD, "entry": None}})
    with pytest.raises(ResourceError, match="give either 'entry' or 'command'"):
        FillJobResource.from_object({"metadata": {"name": "j"},
                                     "spec": {**GOOD, "interface": "imperative", "command": ["x"]}})
    with pytest.raises(ResourceError, match=r"needs spec\.work\.samplesPerStep"):
        FillJobResource.from_object({"metadata": {"name": "j"}, "spec": {**GOOD, "work": {"samples": 10}}})
    with pytest.raises(ResourceError, match="field 'name'"):
        FillJobResource.from_object({"metadata": {"name": "Bad_Name"}, "spec": GOOD})
    with pytest.raises(ResourceError, match=r"spec\.selector is required"):
        PipelineTrainingResource.from_object({"metadata": {"name": "t"}, "spec": {}})
    with pytest.raises(ResourceError, match=r"spec\.selector must select the training's Pods"):
        PipelineTrainingResource.from_object({"metadata": {"name": "t"}, "spec": {"selector": {}}})
    assert validate(PIPELINE_TRAINING_SPEC, {"selector": {}, "slowdownBudget": 2}) == [
        "spec.slowdownBudget must be <= 0.5, got 2"]


def test_defaults_are_the_schemas() -> None:
    spec = apply_defaults(FILL_JOB_SPEC, GOOD)
    assert (spec["kind"], spec["interface"], spec["priority"], spec["restartLimit"]) == ("training", "iterative", 0, 3)
    assert apply_defaults(PIPELINE_TRAINING_SPEC, {})["memoryReserve"] == "0"


def test_conditions_move_their_transition_time_only_when_the_status_changes() -> None:
    t0 = dt.datetime(2026, 11, 23, 8, 0, tzinfo=dt.UTC)
    t1 = t0 + dt.timedelta(minutes=5)
    cs = set_condition([], Condition("Placed", "False", "NoBubble", "waiting", observed_generation=1), t0)
    assert cs[0]["lastTransitionTime"] == "2026-11-23T08:00:00Z"
    cs = set_condition(cs, Condition("Placed", "False", "NoBubble", "still waiting", observed_generation=2), t1)
    assert cs[0]["lastTransitionTime"] == "2026-11-23T08:00:00Z" and cs[0]["message"] == "still waiting"
    cs = set_condition(cs, Condition("Placed", "True", "Placed", "on node-a", observed_generation=2), t1)
    assert cs[0]["lastTransitionTime"] == "2026-11-23T08:05:00Z" and len(cs) == 1


def test_label_selectors() -> None:
    labels = {"app": "llama", "tier": "gold"}
    assert selector_matches(None, labels) and selector_matches({}, labels)
    assert selector_matches({"matchLabels": {"app": "llama"}}, labels)
    assert not selector_matches({"matchLabels": {"app": "other"}}, labels)
    assert selector_matches({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]},
                                labels)
    assert not selector_matches({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, labels)
    assert selector_matches({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, labels)
