"""What current Kubernetes accepts, checked without one (this machine's newest API server is 1.20): the chart's
manifests, the CRDs, the examples and every Pod the operator makes, validated against the schemas of Kubernetes
1.29 to 1.35 (``kubernetes-validate``, strict: an unknown field fails), the custom resources against their own CRD
schema, and each Pod's Pod Security level (bubbles.operator.podsecurity)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.operator import fill_job, stage, step

from bubbles.core.nodeaccess import GpuAccess, NodeAccess
from bubbles.operator.decide import FillPodSettings
from bubbles.operator.podsecurity import check

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = [f"1.{m}.0" for m in range(29, 36)]
CUSTOM_KINDS = {"FillJob", "PipelineTraining", "Certificate", "Issuer", "ServiceMonitor"}  # not in Kubernetes' schemas
GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def crd_schemas() -> dict[str, dict[str, Any]]:
    """kind -> the openAPIV3Schema of its CRD (crds/), as the API server validates a custom resource."""
    out = {}
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        (crd,) = documents(path)
        (version,) = crd["spec"]["versions"]
        out[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return out


def command_job() -> dict[str, Any]:
    """A FillJob that runs a plain command (``spec.command``), not an SDK entry."""
    job = fill_job("cmd", command=["python", "serve.py"], interface="imperative")
    del job["spec"]["entry"]
    return job


def fill_pods() -> dict[str, dict[str, Any]]:
    """The Pods the operator makes, in each of its shapes: plain, with a claim and a checkpoint, with volumes of its
    own, on MPS, a gang, with the training Pod's and the chart's tolerations, with a RuntimeClass; each with
    nodeAccess csi and the GPU from the device plugin (the chart's defaults), and the first ones as before issue 36
    (hostPath, NVIDIA_VISIBLE_DEVICES, as the agent's UID)."""
    csi = FillPodSettings(fill_run_as_user=1000)
    csi_mps = replace(csi, mps_pipe_dir="/tmp/nvidia-mps", tolerations=({"key": "spot", "operator": "Exists"},))
    host = FillPodSettings(run_as_user=1000, run_as_group=1000, node_access=NodeAccess.HOST_PATH,
                           gpu_access=GpuAccess.ENVVAR)
    host_mps = replace(host, mps_pipe_dir="/tmp/nvidia-mps", tolerations=({"key": "spot", "operator": "Exists"},))
    claim = {"name": "data", "mountPath": "/data", "persistentVolumeClaim": {"claimName": "d"}}
    own = [{"name": "cfg", "mountPath": "/etc/job", "configMap": {"name": "job-config"}},
           {"name": "creds", "mountPath": "/var/run/creds", "secret": {"secretName": "s3"}},
           {"name": "scratch", "mountPath": "/scratch", "emptyDir": {"sizeLimit": "10Gi"}}]
    gpu = stage(gpu_uuid="GPU-1", tolerations=(GPU,))
    gang = [stage(0, rank=r, ranks=2, gpu_uuid=f"GPU-{r}") for r in (0, 1)]
    cases: dict[str, tuple[list[dict[str, Any]], list[Any], FillPodSettings]] = {}
    for mode, settings, mps in (("csi", csi, csi_mps), ("hostPath", host, host_mps)):
        cases |= {
            f"{mode} plain": ([fill_job("plain")], [stage()], settings),
            f"{mode} claims": ([fill_job("claims", volumes=[claim], checkpoint={"path": "/ckpt", "claimName": "c"})],
                               [stage()], settings),
            f"{mode} mps+tolerations": ([fill_job("mps")], [gpu], mps),
            f"{mode} command": ([command_job()], [stage()], settings),
            f"{mode} runtime class": ([fill_job("rc", runtimeClassName="nvidia")], [stage()], settings),
        }
    cases |= {
        "csi on a GPU": ([fill_job("gpu", resources={"requests": {"cpu": "1"}})], [gpu], csi),
        "csi gang": ([fill_job("gang", gpus=2)], gang, csi),
        "csi gang mps": ([fill_job("gang", gpus=2)], gang, csi_mps),
        "csi own volumes": ([fill_job("own", volumes=own)], [stage()], csi),
    }
    out = {}
    for name, (jobs, stages, s) in cases.items():
        (pod,) = step(jobs, stages, fill_pods=s).create_pods
        out[name] = pod
    return out


def doc_training_pods() -> dict[str, dict[str, Any]]:
    """Every YAML block of docs/training-pods.md, by kind (StatefulSet, JobSet, PyTorchJob)."""
    import re

    text = (ROOT / "docs" / "training-pods.md").read_text()
    out = {}
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        doc = yaml.safe_load(block)
        out[doc["kind"]] = doc
    assert set(out) == {"StatefulSet", "JobSet", "PyTorchJob"}, set(out)
    return out


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Pod template in a workload (wherever it nests: a JobSet's Jobs' templates, a PyTorchJob's replicas')."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            t = x.get("template")
            if isinstance(t, dict) and isinstance(t.get("spec"), dict) and "containers" in t["spec"]:
                found.append(t)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(obj)
    return found


def chart_documents() -> list[dict[str, Any]]:
    from helpers.helm import render  # Helm's own engine (skips where helm-python-sdk is missing)

    docs = []
    for values in ({}, {"agent": {"isolation": "mps"}, "grpc": {"token": True}},
                   {"operator": {"replicas": 2, "fillPodTolerations": [GPU]}}, {"agent": {"csi": {"enabled": True}}},
                   {"nodeAccess": "hostPath"}):  # the device plugin without the CSI plugin: capabilities, no privilege
        docs += render(values)
    return docs


@pytest.mark.parametrize("version", VERSIONS)
def test_the_chart_crds_examples_and_fill_pods_are_valid_kubernetes(version: str) -> None:
    items: list[tuple[str, dict[str, Any]]] = []
    items += [(f"chart {d['kind']}/{d['metadata']['name']}", d) for d in chart_documents()]
    items += [(f"crds/{p.name}", d) for p in sorted((ROOT / "crds").glob("*.yaml")) for d in documents(p)]
    items += [(f"examples/cluster/{p.name}", d) for p in sorted((ROOT / "examples" / "cluster").glob("*.yaml"))
              for d in documents(p)]
    items += [(f"fill Pod ({name})", pod) for name, pod in fill_pods().items()]
    for kind, doc in doc_training_pods().items():
        if kind == "StatefulSet":  # a core kind; the others' CRDs are not Kubernetes': their Pod templates, as Pods
            items.append((f"docs/training-pods.md {kind}", doc))
        for i, t in enumerate(pod_templates(doc)):
            items.append((f"docs/training-pods.md {kind} template {i}",
                          {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"t{i}", **t.get("metadata", {})},
                           "spec": t["spec"]}))
    checked = set()
    for what, doc in items:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{what} is not valid Kubernetes {version}: {exc.message} at "
                                 f"{'/'.join(map(str, exc.path))}") from None
        checked.add(doc["kind"])
    # What was checked: every kind the project ships apart from the custom ones.
    assert {"Pod", "Deployment", "DaemonSet", "ClusterRole", "CustomResourceDefinition", "Secret", "CSIDriver",
            "StatefulSet"} <= checked


def test_the_examples_custom_resources_are_valid_by_their_crds() -> None:
    schemas = crd_schemas()
    seen = set()
    for path in sorted((ROOT / "examples" / "cluster").glob("*.yaml")):
        for doc in documents(path):
            if doc["kind"] in schemas:
                jsonschema.validate(doc["spec"], schemas[doc["kind"]]["properties"]["spec"])
                seen.add(doc["kind"])
    assert seen == {"FillJob", "PipelineTraining"}
    with pytest.raises(jsonschema.ValidationError):  # the schema can fail: an example with a wrong type
        jsonschema.validate({"work": {"steps": "many"}}, schemas["FillJob"]["properties"]["spec"])


def test_a_pod_current_kubernetes_refuses_is_refused_here_too() -> None:
    pod = fill_pods()["csi plain"]
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": "eighty"}]  # a wrong type
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, VERSIONS[-1], strict=True)
    pod = fill_pods()["csi plain"]
    pod["spec"]["nodeSelectorTerms"] = []  # an unknown field: strict
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, VERSIONS[-1], strict=True)


# The Pod Security level each Pod reaches (docs/cluster.md, "Pod Security Standards"): with nodeAccess csi every fill
# Pod is restricted and so are the documented training Pods; with hostPath (as before issue 36) the node's run
# directory reaches them as hostPath volumes, which baseline refuses.
EXPECTED_LEVELS = {
    **{f"fill Pod (csi {k})": "restricted" for k in ("plain", "claims", "mps+tolerations", "command", "runtime class",
                                                     "on a GPU", "gang", "gang mps", "own volumes")},
    **{f"fill Pod (hostPath {k})": "privileged" for k in ("plain", "claims", "mps+tolerations", "command",
                                                          "runtime class")},
    "examples/cluster/training-pod.yaml": "restricted",
    "docs/training-pods.md StatefulSet": "restricted",
    "docs/training-pods.md JobSet": "restricted",
    "docs/training-pods.md PyTorchJob Master": "restricted",
    "docs/training-pods.md PyTorchJob Worker": "restricted",
}


def test_the_pod_security_level_of_every_pod_the_project_ships_or_makes() -> None:
    levels = {f"fill Pod ({name})": check(pod) for name, pod in fill_pods().items()}
    (training,) = [d for d in documents(ROOT / "examples" / "cluster" / "training-pod.yaml") if d["kind"] == "Pod"]
    levels["examples/cluster/training-pod.yaml"] = check(training)
    docs = doc_training_pods()
    levels["docs/training-pods.md StatefulSet"] = check(docs["StatefulSet"]["spec"]["template"])
    (jobset,) = pod_templates(docs["JobSet"])
    levels["docs/training-pods.md JobSet"] = check(jobset)
    for role, spec in docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].items():
        levels[f"docs/training-pods.md PyTorchJob {role}"] = check(spec["template"])
    assert {k: r.level for k, r in levels.items()} == EXPECTED_LEVELS, {k: r.summary() for k, r in levels.items()}
    for name, report in levels.items():
        if report.level == "privileged":  # hostPath: that one control, nothing else of baseline's
            assert {f.control for f in report.findings if f.level == "baseline"} == {"HostPath Volumes"}, \
                f"{name}: {report.summary()}"
    # Each documented training form has the bubbles volume at /run/bubbles and the hook's variables.
    for t in [training, docs["StatefulSet"]["spec"]["template"], jobset,
              *(r["template"] for r in docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].values())]:
        spec = t["spec"]
        (vol,) = [v for v in spec["volumes"] if "csi" in v]
        assert vol["csi"] == {"driver": "csi.bubbles.dev", "volumeAttributes": {"role": "training"}}
        (c,) = spec["containers"]
        assert {"name": vol["name"], "mountPath": "/run/bubbles"} in c["volumeMounts"]
        assert {"BUBBLES_TRAINING", "POD_NAME", "POD_NAMESPACE"} <= {e["name"] for e in c["env"]}


def test_the_pod_security_check_can_fail_a_training_pod() -> None:
    """The check is not a formality: the documented StatefulSet's template with a hostPath, or without its
    seccomp profile, drops a level."""
    t = doc_training_pods()["StatefulSet"]["spec"]["template"]
    t["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/run/bubbles"}})
    assert check(t).level == "privileged"
    t = doc_training_pods()["StatefulSet"]["spec"]["template"]
    del t["spec"]["securityContext"]["seccompProfile"]
    assert check(t).level == "baseline"
