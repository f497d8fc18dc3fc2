"""``bubbles template``: the Pod the operator would create, printed before anything runs, is the Pod it creates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.operator import fill_job, stage, step

from bubbles.cli import main
from bubbles.core import mps_client
from bubbles.core.nodeaccess import GpuAccess, NodeAccess
from bubbles.operator.decide import FillPodSettings
from bubbles.operator.template import PLACEHOLDER_UID

ROOT = Path(__file__).resolve().parent.parent
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}


def manifest(tmp_path: Path, obj: dict[str, Any], name: str = "fj.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"apiVersion": "bubbles.dev/v1alpha1", "kind": "FillJob", **obj}))
    return path


def template(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    code = main(["template", *args])
    out, err = capsys.readouterr()
    return code, yaml.safe_load(out) if code == 0 else None, err


def test_the_template_is_the_pod_the_operator_creates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claim = {"name": "data", "mountPath": "/data", "persistentVolumeClaim": {"claimName": "d"}}
    job = fill_job("resnet", volumes=[claim])
    spot = {"key": "spot", "operator": "Exists"}
    the_stage = stage(rank=1, gpu_uuid="GPU-1", tolerations=(GPU_TAINT,))  # the stage's second GPU
    common = ["--node", "node-a", "--stage", "0", "--rank", "1", "--device", "cuda:1", "--gpu-uuid", "GPU-1",
              "--training", "llama", "--training-pod", "llama-0", "--training-pod-tolerations", json.dumps([GPU_TAINT]),
              "--fill-pod-tolerations", json.dumps([{"key": "spot", "operator": "Exists"}])]
    path = str(manifest(tmp_path, {k: v for k, v in job.items() if k != "status"}))
    # hostPath and envvar: today's Pod, as the agents' UID.
    settings = FillPodSettings(run_as_user=1000, run_as_group=2000, tolerations=(spot,),
                               node_access=NodeAccess.HOST_PATH, gpu_access=GpuAccess.ENVVAR)
    (made,) = step([fill_job("resnet", volumes=job["spec"]["volumes"])], [the_stage], fill_pods=settings).create_pods
    code, printed, err = template(capsys, path, *common, "--node-access", "hostPath", "--fill-gpu-access", "envvar",
                                  "--fill-uid", "1000", "--fill-gid", "2000")
    assert code == 0, err
    assert printed == made
    # csi and devicePlugin (the defaults): the GPU's resource as its agent reports it, a UID of the operator's.
    settings = FillPodSettings(tolerations=(spot,), fill_run_as_user=4000)
    (made,) = step([fill_job("resnet", volumes=job["spec"]["volumes"])], [the_stage], fill_pods=settings).create_pods
    code, printed, err = template(capsys, path, *common, "--gpu-resource", "bubbles.dev/gpu-1",
                                  "--fill-run-as-user", "4000")
    assert code == 0, err
    assert printed == made
    assert printed["spec"]["securityContext"]["runAsUser"] == 4000
    assert "restricted" in err  # the level a namespace must allow, said on stderr


def test_the_charts_values_give_the_fill_pods_settings_and_a_flag_wins(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """With the values as Helm has them (here the chart's defaults, MPS turned on), the Pod joins the node's MPS
    server as the operator the chart configures would make it; a flag given as well overrides its value."""
    values = yaml.safe_load((ROOT / "helm" / "bubbles" / "values.yaml").read_text())
    values["agent"]["isolation"] = "mps"
    values["operator"]["fillPodTolerations"] = [GPU_TAINT]
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    mps = values["agent"]["mps"]
    # The chart's defaults: csi, devicePlugin; under MPS the fill Pods run as the agents' UID (the trainings').
    settings = FillPodSettings(values["agent"]["runDir"], None, None, mps["pipeDir"], mps["threadPercentage"],
                               mps["shmDir"], (GPU_TAINT,), fill_run_as_user=values["agent"]["runAsUser"])
    (made,) = step([fill_job("resnet")], [stage(gpu_uuid="GPU-1")], fill_pods=settings).create_pods
    path = str(manifest(tmp_path, {"metadata": fill_job("resnet")["metadata"], "spec": fill_job("resnet")["spec"]}))
    common = ["--node", "node-a", "--stage", "0", "--training", "llama", "--training-pod", "llama-0", "--gpu-uuid",
              "GPU-1", "--gpu-resource", "bubbles.dev/gpu-0", "--values", str(tmp_path / "values.yaml")]
    code, printed, err = template(capsys, path, *common)
    assert code == 0, err
    assert printed == made
    env = {e["name"]: e.get("value") for e in printed["spec"]["containers"][0]["env"]}
    assert env[mps_client.PIPE_ENV] == "/run/bubbles/mps/pipe"  # an MPS client, through its own volume
    assert mps_client.SHM_MOUNT in [m["mountPath"] for m in printed["spec"]["containers"][0]["volumeMounts"]]
    # hostPath in the values: the agents' run directory and UID, their pipe directory; a flag given as well wins.
    values["nodeAccess"] = "hostPath"
    values["operator"]["fillGpuAccess"] = "envvar"
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    settings = FillPodSettings(values["agent"]["runDir"], values["agent"]["runAsUser"], 4242, mps["pipeDir"],
                               mps["threadPercentage"], mps["shmDir"], (GPU_TAINT,),
                               node_access=NodeAccess.HOST_PATH, gpu_access=GpuAccess.ENVVAR)
    (made,) = step([fill_job("resnet")], [stage(gpu_uuid="GPU-1")], fill_pods=settings).create_pods
    code, printed, err = template(capsys, path, *common, "--fill-gid", "4242")
    assert code == 0, err
    assert printed == made
    env = {e["name"]: e.get("value") for e in printed["spec"]["containers"][0]["env"]}
    assert env[mps_client.PIPE_ENV] == mps["pipeDir"]


def test_a_manifest_not_yet_applied_gets_a_placeholder_uid_and_the_default_namespace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, printed, err = template(capsys, str(manifest(tmp_path, {"metadata": {"name": "fresh"},
                                                                  "spec": fill_job()["spec"]})),
                                  "--node", "n1", "--stage", "2")
    assert code == 0, err
    assert printed["metadata"]["namespace"] == "default"
    assert printed["metadata"]["ownerReferences"][0]["uid"] == PLACEHOLDER_UID
    assert printed["metadata"]["labels"]["bubbles.dev/training"] == "training"
    assert "nodeName" not in printed["spec"]


@pytest.mark.parametrize(("content", "flags", "needle"), [
    ({"kind": "Pod", "metadata": {"name": "x"}}, [], "is not a FillJob manifest (kind: FillJob)"),
    ({"kind": "FillJob", "metadata": {"name": "x"}, "spec": {"image": "i"}}, [], "is not a valid FillJob"),
    (None, ["--stage", "-1"], "--stage, --rank and --attempt must be >= 0"),
    (None, ["--rank", "-1"], "--stage, --rank and --attempt must be >= 0"),
    (None, ["--training-pod-tolerations", "{}"], "--training-pod-tolerations must be a JSON list"),
    (None, ["--training-pod-tolerations", '[{"operator": "Sometimes"}]'], "operator must be Exists or Equal"),
    (None, ["--training", "Llama_70B"], "training name 'Llama_70B' is not valid"),
    (None, ["--node", "GPU node 7"], "is not a node name"),
    (None, ["--fill-pod-tolerations", '[{"key": "a", "operator": "Maybe"}]'], "operator must be Exists or Equal"),
    (None, ["--values", "/no/such/values.yaml"], "--values /no/such/values.yaml: cannot read values file"),
    (None, ["--node-access", "hostpath"], "--node-access must be one of csi, hostPath, got 'hostpath'"),
    (None, ["--fill-gpu-access", "cdi"], "--fill-gpu-access must be one of devicePlugin, envvar, got 'cdi'"),
    (None, ["--fill-run-as-user", "0"], "must be a whole number of 1 or more, got 0: Pod Security restricted"),
    (None, ["--node-access", "hostPath", "--fill-run-as-user", "5"], "--fill-run-as-user applies with --node-access "
                                                                       "csi"),
    (None, ["--gpu-uuid", "GPU-1"], "give each --gpu-uuid's --gpu-resource"),
    (None, ["--gpu-uuid", "GPU-1", "--gpu-resource", "nvidia.com/gpu"], "is not a GPU's resource"),
    (None, ["--gpu-uuid", "GPU-1", "--gpu-resource", "bubbles.dev/gpu-0", "--gpu-resource", "bubbles.dev/gpu-1"],
     "2 --gpu-resource for 1 rank(s)"),
])
def test_bad_input_exits_2_saying_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                content: dict[str, Any] | None, flags: list[str], needle: str) -> None:
    if content is None:
        path = manifest(tmp_path, {"metadata": {"name": "ok"}, "spec": fill_job()["spec"]})
    else:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"apiVersion": "bubbles.dev/v1alpha1", **content}))
    stage_flags = [] if "--stage" in flags else ["--stage", "0"]
    node_flags = [] if "--node" in flags else ["--node", "n1"]
    code, _, err = template(capsys, str(path), *node_flags, *stage_flags, *flags)
    assert code == 2
    assert needle in err


def test_a_values_file_that_is_no_mapping_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "values.yaml").write_text("- a\n- b\n")
    path = manifest(tmp_path, {"metadata": {"name": "ok"}, "spec": fill_job()["spec"]})
    code, _, err = template(capsys, str(path), "--node", "n1", "--stage", "0",
                            "--values", str(tmp_path / "values.yaml"))
    assert code == 2
    assert "is not a mapping of chart values" in err


def test_a_gangs_template_is_the_pod_the_operator_creates_for_its_ranks(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    job = fill_job("gang", gpus=2)
    gpus = [stage(rank=r, ranks=2, gpu_uuid=f"GPU-{r}") for r in (0, 1)]
    (made,) = step([fill_job("gang", gpus=2)], gpus).create_pods
    path = manifest(tmp_path, {k: v for k, v in job.items() if k != "status"})
    common = ["--node", "node-a", "--stage", "0", "--device", "cuda:0", "--training", "llama", "--training-pod",
              "llama-0"]
    for ranks in (["--rank", "0", "--rank", "1"], ["--ranks", "0,1"]):
        code, printed, err = template(capsys, str(path), *common, *ranks, "--gpu-uuid", "GPU-0", "--gpu-uuid",
                                      "GPU-1", "--gpu-resource", "bubbles.dev/gpu-0", "--gpu-resource",
                                      "bubbles.dev/gpu-1")
        assert code == 0, err
        assert printed == made
    for flags, needle in ((["--rank", "0"], "asks for 2 GPU(s) (spec.gpus) and is placed on 1 rank(s)"),
                          (["--ranks", "0,0"], "name a rank twice"),
                          (["--ranks", "0,x"], "--ranks '0,x' must be ranks separated by commas"),
                          (["--rank", "0", "--ranks", "0,1"], "give --rank (once per rank) or --ranks, not both"),
                          (["--ranks", "0,1", "--gpu-uuid", "GPU-0"], "1 --gpu-uuid for 2 rank(s)")):
        code, _, err = template(capsys, str(path), *common, *flags)
        assert code == 2 and needle in err, err
