"""The CRDs' CEL rules (x-kubernetes-validations), evaluated as an API server with CEL (1.25 on; GA in 1.29) would:
at their place in the schema, on the object after defaulting. No API server here has CEL (1.20), so cel-python
evaluates them. Each rule refuses an object that breaks it, the operator's own validation refuses the same object
(for servers without CEL), and nothing valid is refused."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from helpers.operator import fill_job, training

from bubbles.core.resources import FillJobResource, PipelineTrainingResource, ResourceError

ROOT = Path(__file__).resolve().parent.parent
ENV = celpy.Environment()


def crd_spec_schema(kind: str) -> dict[str, Any]:
    for path in (ROOT / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = crd["spec"]["versions"]
            return dict(version["schema"]["openAPIV3Schema"]["properties"]["spec"])
    raise KeyError(kind)


def defaulted(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in, as the API server defaults before it validates."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = defaulted(sub, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [defaulted(schema["items"], v) for v in value]
    return value


def broken_rules(schema: dict[str, Any], value: Any, where: str = "spec") -> Iterator[str]:
    """The message of every rule ``value`` breaks, walking the schema as the API server does."""
    for rule in schema.get("x-kubernetes-validations", ()):
        program = ENV.program(ENV.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            yield f"{where}: {rule['message']}"
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from broken_rules(sub, value[name], f"{where}.{name}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from broken_rules(schema["items"], item, f"{where}[{i}]")


def refused_by_cel(kind: str, spec: dict[str, Any]) -> list[str]:
    schema = crd_spec_schema(kind)
    return list(broken_rules(schema, defaulted(schema, spec)))


def all_rules(schema: dict[str, Any]) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations", ()):
        yield rule["message"]
    for sub in (schema.get("properties") or {}).values():
        yield from all_rules(sub)
    if "items" in schema:
        yield from all_rules(schema["items"])


def test_every_rule_compiles_as_cel() -> None:
    for kind in ("FillJob", "PipelineTraining"):
        schema = crd_spec_schema(kind)
        for message in all_rules(schema):
            assert message  # every rule says what to do
    rules = [r for kind in ("FillJob", "PipelineTraining") for r in _rules(crd_spec_schema(kind))]
    assert len(rules) >= 10
    for rule in rules:
        ENV.compile(rule)  # a syntax error raises


def _rules(schema: dict[str, Any]) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations", ()):
        yield rule["rule"]
    for sub in (schema.get("properties") or {}).values():
        yield from _rules(sub)
    if "items" in schema:
        yield from _rules(schema["items"])


def valid_fill_jobs() -> list[dict[str, Any]]:
    examples = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples" / "cluster").glob("filljob-*.yaml"))]
    return [e["spec"] for e in examples] + [
        fill_job()["spec"],
        fill_job(work={"samples": 1000, "samplesPerStep": 8})["spec"],
        fill_job(interface="imperative", entry=None, command=["python", "x.py"])["spec"] | {"entry": None},
        fill_job(env=[{"name": "A", "value": "1"},
                      {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])["spec"],
        fill_job(volumes=[{"name": "a", "mountPath": "/a", "emptyDir": {}},
                          {"name": "b", "mountPath": "/b", "configMap": {"name": "c"}}])["spec"],
    ]


def test_nothing_valid_is_refused() -> None:
    for spec in valid_fill_jobs():
        spec = {k: v for k, v in spec.items() if v is not None}
        assert refused_by_cel("FillJob", spec) == [], spec
        FillJobResource.from_object({"metadata": {"name": "ok", "namespace": "ml", "uid": "u"}, "spec": spec})
    for spec in (training()["spec"], {"selector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}):
        assert refused_by_cel("PipelineTraining", spec) == []


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = fill_job()["spec"]
    for k, v in changes.items():
        if v is None:
            spec.pop(k, None)
        else:
            spec[k] = v
    return spec


BROKEN_FILL_JOBS = [
    ("give entry (module:Class of an IterativeFillJob) or command", spec_with(entry=None)),
    ("give entry (module:Class of an IterativeFillJob) or command",
     spec_with(interface="imperative", command=["python", "x.py"])),
    ("command is for imperative jobs", spec_with(entry=None, command=["python", "x.py"])),
    ("needs exactly one of steps, samples", spec_with(work={"steps": 10, "samples": 100, "samplesPerStep": 10})),
    ("needs exactly one of steps, samples", spec_with(work={"samplesPerStep": 10})),
    ("samples needs samplesPerStep", spec_with(work={"samples": 100})),
    ("give value or valueFrom, not both",
     spec_with(env=[{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])),
    ("needs exactly one of secretKeyRef, configMapKeyRef", spec_with(env=[{"name": "A", "valueFrom": {}}])),
    ("names starting with BUBBLES_, CUDA_ or NVIDIA_ are the runtime's",
     spec_with(env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "1"}])),
    ("give each variable once", spec_with(env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}])),
    ("needs exactly one of persistentVolumeClaim, configMap, secret, emptyDir",
     spec_with(volumes=[{"name": "a", "mountPath": "/a", "emptyDir": {}, "configMap": {"name": "c"}}])),
    ("give each volume a name of its own", spec_with(volumes=[{"name": "a", "mountPath": "/a", "emptyDir": {}},
                                                              {"name": "a", "mountPath": "/b", "emptyDir": {}}])),
    ("mount each volume at a path of its own", spec_with(volumes=[{"name": "a", "mountPath": "/a", "emptyDir": {}},
                                                                  {"name": "b", "mountPath": "/a", "emptyDir": {}}])),
]


@pytest.mark.parametrize(("message", "spec"), BROKEN_FILL_JOBS)
def test_each_fill_job_rule_refuses_what_the_operator_refuses(message: str, spec: dict[str, Any]) -> None:
    refused = refused_by_cel("FillJob", spec)
    assert any(message in r for r in refused), refused
    with pytest.raises(ResourceError):  # and the operator, for an API server without CEL
        FillJobResource.from_object({"metadata": {"name": "bad", "namespace": "ml", "uid": "u"}, "spec": spec})


def test_the_pipeline_training_selector_rule_refuses_an_empty_selector() -> None:
    for selector in ({}, {"matchLabels": {}}, {"matchExpressions": []}):
        refused = refused_by_cel("PipelineTraining", {"selector": selector})
        assert any("must select the training's Pods" in r for r in refused), refused
        with pytest.raises(ResourceError):
            PipelineTrainingResource.from_object({"metadata": {"name": "t", "namespace": "ml"},
                                                  "spec": {"selector": selector}})


def test_every_rule_has_an_object_that_breaks_it() -> None:
    fill_job_rules = set(all_rules(crd_spec_schema("FillJob")))
    exercised = {m for m in fill_job_rules for message, _ in BROKEN_FILL_JOBS if m.startswith(message)}
    assert exercised == fill_job_rules
