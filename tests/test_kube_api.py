"""The CRDs on a real kube-apiserver (1.20, RBAC on): what the API server enforces is what bubbles.core.resources says.

One API server for the whole module (tests/helpers/kubeapi.py). Skipped, loudly, where its binaries cannot be had.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.kubeapi import ApiServer

from bubbles.core.resources import (
    API_VERSION,
    FILL_JOB_SPEC,
    FILL_JOB_STATUS,
    PIPELINE_TRAINING_SPEC,
    Field,
    FillJobPhase,
    apply_defaults,
    validate,
)

pytestmark = pytest.mark.kube
ROOT = Path(__file__).resolve().parent.parent


def fill_job(name: str, spec: dict[str, Any]) -> str:
    return json.dumps({"apiVersion": API_VERSION, "kind": "FillJob", "metadata": {"name": name}, "spec": spec})


GOOD: dict[str, Any] = {"image": "img:1", "entry": "m:C", "profile": {"memory": "1Gi"}, "work": {"steps": 10}}


def test_examples_apply_and_the_servers_defaults_are_the_tables(kube: ApiServer) -> None:
    examples = ROOT / "examples" / "cluster"
    kube.kubectl("apply", *(a for f in sorted(examples.glob("*.yaml")) if f.name != "training-pod.yaml"
                            for a in ("-f", str(f))))
    # The training Pod example is a user's: valid as the API server sees it, but not created here (nothing runs it).
    # Admission wants the namespace's default ServiceAccount, which a controller-manager would have made.
    kube.kubectl("apply", "-f", "-", input_text=json.dumps(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": "default"}}))
    kube.kubectl("apply", "--dry-run=server", "-f", str(examples / "training-pod.yaml"))
    obj = json.loads(kube.kubectl("get", "fj", "image-classification", "-o", "json").stdout)
    sent = yaml.safe_load((ROOT / "examples/cluster/filljob-image-classification.yaml").read_text())["spec"]
    assert obj["spec"] == apply_defaults(FILL_JOB_SPEC, sent)
    bare = json.loads(kube.kubectl("create", "-o", "json", "-f", "-", input_text=fill_job("bare", GOOD)).stdout)
    assert bare["spec"] == apply_defaults(FILL_JOB_SPEC, GOOD) != GOOD  # kind, interface, priority, restartLimit
    header = kube.kubectl("get", "fj").stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "TRAINING", "NODE", "PROGRESS", "ETA", "AGE"]
    assert kube.kubectl("get", "pt").stdout.splitlines()[0].split()[:4] == ["NAME", "GPUS", "HARVESTED", "BUBBLE-RATIO"]
    assert kube.kubectl("get", "pt", "-o", "wide").stdout.splitlines()[0].split()[:4] == \
        ["NAME", "PODS", "GPUS", "HARVESTED"]


@pytest.mark.parametrize(
    ("change", "server_says"),
    [
        ({"kind": "finetune"}, 'spec.kind: Unsupported value: "finetune"'),
        ({"interface": "sometimes"}, 'spec.interface: Unsupported value: "sometimes"'),
        ({"profile": {}}, "spec.profile.memory: Required value"),
        ({"profile": {"memory": "lots"}}, "spec.profile.memory: Invalid value"),
        ({"profile": {"memory": "1Gi", "stepTime": "soon"}}, "spec.profile.stepTime: Invalid value"),
        ({"profile": {"memory": "1Gi", "stepTime": "5m"}}, "spec.profile.stepTime: Invalid value"),  # not minutes
        ({"initTimeout": "2d"}, "spec.initTimeout: Invalid value"),
        ({"profile": {"memory": "1Gi", "initTime": "soon"}}, "spec.profile.initTime: Invalid value"),
        ({"work": {"steps": 0}}, "spec.work.steps: Invalid value: 0"),
        ({"priority": 5000}, "spec.priority: Invalid value: 5000"),
        ({"deadline": "tomorrow"}, "spec.deadline: Invalid value"),
        ({"image": "has space"}, "spec.image: Invalid value"),
        ({"entry": "no-colon"}, "spec.entry: Invalid value"),
        ({"restartLimit": -1}, "spec.restartLimit: Invalid value: -1"),
        ({"command": []}, "spec.command: Invalid value: 0"),
        ({"trainingSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
         'spec.trainingSelector.matchExpressions.operator: Unsupported value: "Near"'),
        ({"resources": {"requests": {"cpu": "lots"}}}, "spec.resources.requests.cpu: Invalid value"),
        ({"resources": {"limits": {"memory": "much"}}}, "spec.resources.limits.memory: Invalid value"),
        ({"env": [{"name": "1 A", "value": "x"}]}, "spec.env.name: Invalid value"),
        ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]},
         "spec.env.valueFrom.secretKeyRef.key: Required value"),
        ({"env": [{"name": f"V{i}", "value": "x"} for i in range(129)]},
         "spec.env in body should have at most 128 items"),
        ({"imagePullSecrets": [{"name": "Bad_Name"}]}, "spec.imagePullSecrets.name: Invalid value"),
        ({"volumes": [{"name": "Data", "mountPath": "/data", "emptyDir": {}}]}, "spec.volumes.name: Invalid value"),
        ({"volumes": [{"name": "data", "mountPath": "data", "emptyDir": {}}]}, "spec.volumes.mountPath: Invalid value"),
        ({"volumes": [{"name": "data", "emptyDir": {}}]}, "spec.volumes.mountPath: Required value"),
        ({"volumes": [{"name": "data", "mountPath": "/d", "emptyDir": {"medium": "Disk"}}]},
         'spec.volumes.emptyDir.medium: Unsupported value: "Disk"'),
        ({"volumes": [{"name": "data", "mountPath": "/d", "persistentVolumeClaim": {}}]},
         "spec.volumes.persistentVolumeClaim.claimName: Required value"),
        ({"volumes": [{"name": f"v{i}", "mountPath": f"/v{i}", "emptyDir": {}} for i in range(17)]},
         "spec.volumes in body should have at most 16 items"),
    ],
)
def test_the_server_and_the_operator_refuse_the_same_bad_fill_jobs(kube: ApiServer, change: dict[str, Any],
                                                                    server_says: str) -> None:
    spec = {**copy.deepcopy(GOOD), **change}
    # --validate=false: the API server's own checks, not kubectl's copy of the schema
    proc = kube.kubectl("create", "--validate=false", "-f", "-", input_text=fill_job("bad", spec), check=False)
    assert proc.returncode != 0 and server_says in proc.stderr, proc.stderr
    assert validate(FILL_JOB_SPEC, spec), f"the operator's validation accepts what the server refuses: {spec}"
    assert kube.kubectl("get", "fj", "bad", check=False).returncode != 0  # nothing was stored


@pytest.mark.parametrize("risk", [0.9, -0.1])
def test_the_server_and_the_operator_refuse_a_tail_risk_out_of_range_and_default_it(kube: ApiServer,
                                                                                    risk: float) -> None:
    spec = {"selector": {"matchLabels": {"app": "t"}}, "tailRisk": risk}
    proc = kube.kubectl("create", "--validate=false", "-f", "-", check=False, input_text=json.dumps(
        {"apiVersion": API_VERSION, "kind": "PipelineTraining", "metadata": {"name": "risky"}, "spec": spec}))
    assert proc.returncode != 0 and f"spec.tailRisk: Invalid value: {risk}" in proc.stderr, proc.stderr
    assert validate(PIPELINE_TRAINING_SPEC, spec) == [
        f"spec.tailRisk must be {'<= 0.5' if risk > 0 else '>= 0'}, got {risk}"]
    del spec["tailRisk"]
    name = f"plain-{'a' if risk > 0 else 'b'}"
    made = json.loads(kube.kubectl("create", "-o", "json", "-f", "-", input_text=json.dumps(
        {"apiVersion": API_VERSION, "kind": "PipelineTraining", "metadata": {"name": name}, "spec": spec})).stdout)
    assert made["spec"]["tailRisk"] == 0.1 == apply_defaults(PIPELINE_TRAINING_SPEC, spec)["tailRisk"]


def test_the_server_keeps_a_fill_jobs_environment_pull_secrets_and_volumes(kube: ApiServer) -> None:
    """Not pruned: every field of spec.env, spec.imagePullSecrets and spec.volumes is in the schema."""
    spec = {**copy.deepcopy(GOOD), "env": [
        {"name": "DATASET", "value": "s3://b/p"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}}],
        "imagePullSecrets": [{"name": "registry-creds"}],
        "volumes": [
            {"name": "prompts", "mountPath": "/data/in", "subPath": "set-1", "readOnly": True,
             "persistentVolumeClaim": {"claimName": "prompts", "readOnly": True}},
            {"name": "config", "mountPath": "/etc/job", "configMap": {"name": "cfg", "optional": False}},
            {"name": "creds", "mountPath": "/creds", "secret": {"secretName": "hf", "optional": True}},
            {"name": "scratch", "mountPath": "/scratch", "emptyDir": {}},
            {"name": "fast", "mountPath": "/fast", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]}
    made = json.loads(kube.kubectl("create", "-o", "json", "-f", "-", input_text=fill_job("with-env", spec)).stdout)
    assert made["spec"]["env"] == spec["env"] and made["spec"]["imagePullSecrets"] == spec["imagePullSecrets"]
    assert made["spec"]["volumes"] == spec["volumes"]
    assert validate(FILL_JOB_SPEC, made["spec"]) == []


def test_a_spec_without_its_required_fields_is_refused(kube: ApiServer) -> None:
    proc = kube.kubectl("create", "--validate=false", "-f", "-", input_text=json.dumps(  # the server's check
        {"apiVersion": API_VERSION, "kind": "FillJob", "metadata": {"name": "nospec"}}), check=False)
    assert proc.returncode != 0 and "spec: Required value" in proc.stderr, proc.stderr
    proc = kube.kubectl("create", "--validate=false", "-f", "-", input_text=json.dumps(
        {"apiVersion": API_VERSION, "kind": "PipelineTraining", "metadata": {"name": "noselector"},
         "spec": {"slowdownBudget": 0.01}}), check=False)
    assert proc.returncode != 0 and "spec.selector: Required value" in proc.stderr, proc.stderr
    assert validate(PIPELINE_TRAINING_SPEC, {"slowdownBudget": 0.01})  # the operator refuses it too


def _sample(f: Field) -> Any:
    """A value for every declared status field (to see that the server keeps all of it)."""
    if f.enum:
        return f.enum[-1]
    return {"string": "x", "integer": 1, "number": 0.5, "boolean": True, "map": {"k": "v"},
            "array": [_sample(f.items)] if f.items else ["x"],
            "object": {c.name: _sample(c) for c in f.fields}}[f.type]


def test_every_status_field_the_operator_writes_survives_the_server(kube: ApiServer) -> None:
    kube.kubectl("create", "-f", "-", input_text=fill_job("status-probe", GOOD))
    status = {f.name: _sample(f) for f in FILL_JOB_STATUS}
    status["phase"] = FillJobPhase.RUNNING.value
    code, body = kube.request("PATCH", "/apis/bubbles.dev/v1alpha1/namespaces/default/filljobs/status-probe/status",
                              {"status": status}, content_type="application/merge-patch+json")
    assert code == 200, body
    stored = json.loads(kube.kubectl("get", "fj", "status-probe", "-o", "json").stdout)
    assert stored["status"] == status  # nothing pruned: every field is declared
    row = kube.kubectl("get", "fj", "status-probe", "--no-headers").stdout.split()
    assert row[1:6] == ["Running", "x", "x", "x", "x"]  # phase, training, node, progress, ETA columns
