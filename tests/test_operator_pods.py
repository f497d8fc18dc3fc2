"""The fill Pod (bubbles.operator.decide.pods): its manifest, mounts, environment and place, the settings it shares
with the node agents, and what keeps one from starting."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

import pytest
from helpers.operator import (
    CSI_VOLUMES,
    HOST_PATH,
    MIB,
    NOW,
    RUN_VOLUMES,
    cond,
    fill_job,
    stage,
    step,
    training,
    waiting_pod,
)

from bubbles.core import nodeaccess, paths
from bubbles.core.api import FillState
from bubbles.core.nodeaccess import GpuAccess, NodeAccess
from bubbles.operator.decide import (
    Assignment,
    FillPodSettings,
    JobProgress,
    fill_pod,
    fill_pod_node,
    pod_not_starting,
)
from bubbles.operator.podsecurity import check


def test_a_fill_pod_runs_with_its_jobs_runtime_class_else_the_charts_else_the_nodes_default() -> None:
    """Where the NVIDIA container runtime is installed beside the node's default one (GPU Operator with CDI, k3s), the
    fill Pod names its RuntimeClass, as the training Pod does: the FillJob's spec.runtimeClassName, else the chart's
    operator.fillRuntimeClassName; neither: none, the node's default runtime."""
    (pod,) = step([fill_job()], [stage()]).create_pods
    assert "runtimeClassName" not in pod["spec"]
    charts = FillPodSettings(runtime_class="nvidia")
    (pod,) = step([fill_job()], [stage()], fill_pods=charts).create_pods
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    (pod,) = step([fill_job(runtimeClassName="nvidia-cdi")], [stage()], fill_pods=charts).create_pods
    assert pod["spec"]["runtimeClassName"] == "nvidia-cdi"


def test_a_csi_fill_pod_has_one_volume_of_its_own_runs_as_no_one_in_particular_and_is_restricted() -> None:
    """nodeAccess csi (the default): one CSI inline volume of the agents' driver, role fill, at /run/bubbles (its
    attach socket is its own there; its fill sockets come as file descriptors: no fills/ of the training's); the Pod
    runs as the operator's --fill-run-as-user, non-root, RuntimeDefault seccomp, no capabilities: Pod Security
    restricted, whatever the agent's UID."""
    (pod,) = step([fill_job()], [stage(1, rank=3)]).create_pods
    spec, (c,) = pod["spec"], pod["spec"]["containers"]
    assert spec["volumes"] == [{"name": "bubbles-attach", "csi": {"driver": "csi.bubbles.dev",
                                                                   "volumeAttributes": {"role": "fill"}}}]
    assert spec["volumes"][0]["csi"]["driver"] == nodeaccess.CSI_DRIVER
    assert c["volumeMounts"] == [{"name": "bubbles-attach", "mountPath": "/run/bubbles"}]
    assert {"name": "BUBBLES_RUN_DIR", "value": "/run/bubbles"} in c["env"]
    assert spec["securityContext"] == {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True,
                                       "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert check(pod).level == "restricted", check(pod).summary()
    # The agent's UID is not the fill Pod's business any more: --fill-uid is for hostPath only.
    settings = FillPodSettings(run_as_user=1000, run_as_group=1000, fill_run_as_user=4321)
    (other,) = step([fill_job("other")], [stage()], fill_pods=settings).create_pods
    assert other["spec"]["securityContext"]["runAsUser"] == other["spec"]["securityContext"]["runAsGroup"] == 4321
    # A job with claims: their files are given to the Pod's group (fsGroup), as in hostPath mode.
    (claimed,) = step([fill_job("claimed", volumes=[_volume()])], [stage()], fill_pods=settings).create_pods
    assert claimed["spec"]["securityContext"]["fsGroup"] == 4321
    assert claimed["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert check(claimed).level == "restricted"


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"node_access": "hostpath"}, "--node-access must be one of csi, hostPath, got 'hostpath'"),
    ({"gpu_access": "nvidia"}, "--fill-gpu-access must be one of devicePlugin, envvar, got 'nvidia'"),
    ({"fill_run_as_user": 0}, "must be a whole number of 1 or more, got 0: Pod Security restricted refuses root"),
    ({"fill_run_as_user": -3}, "got -3"),
    ({"fill_run_as_user": True}, "got True"),
])
def test_node_and_gpu_access_settings_refuse_what_is_no_mode(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        FillPodSettings(**kwargs)
    assert FillPodSettings(node_access="hostPath", gpu_access="envvar").node_access is NodeAccess.HOST_PATH  # by name


def test_a_fill_pod_requests_its_gpu_from_the_kubelet_merged_with_its_own_resources() -> None:
    """gpu_access devicePlugin (the default): the container requests its GPU's resource as the agent reports it,
    requests and limits alike, beside the job's own CPU and memory; no NVIDIA_VISIBLE_DEVICES of the operator's
    (the device plugin's answer sets what the runtime needs); CUDA_VISIBLE_DEVICES names the GPU by UUID."""
    job = fill_job(resources={"requests": {"cpu": "500m"}, "limits": {"memory": "4Gi"}})
    (pod,) = step([job], [stage(0, rank=2, gpu_uuid="GPU-abc", gpu_resource="bubbles.dev/gpu-5")]).create_pods
    (c,) = pod["spec"]["containers"]
    assert c["resources"] == {"requests": {"cpu": "500m", "bubbles.dev/gpu-5": "1"},
                              "limits": {"memory": "4Gi", "bubbles.dev/gpu-5": "1"}}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc" and env["BUBBLES_DEVICE"] == "cuda:0"
    # envvar: today's way, the UUID in NVIDIA_VISIBLE_DEVICES, no resource requested.
    envvar = FillPodSettings(gpu_access=GpuAccess.ENVVAR)
    (pod,) = step([fill_job("env")], [stage(gpu_uuid="GPU-abc")], fill_pods=envvar).create_pods
    (c,) = pod["spec"]["containers"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-abc"} in c["env"] and "resources" not in c
    # A CPU training (no GPU UUID): no GPU at all, either way.
    for settings in (FillPodSettings(), envvar):
        (pod,) = step([fill_job("cpu")], [stage()], fill_pods=settings).create_pods
        (c,) = pod["spec"]["containers"]
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in c["env"] and "resources" not in c


def test_a_gpu_whose_agent_serves_no_device_plugin_gets_no_pod_and_its_jobs_say_what_to_do() -> None:
    """A fill Pod without its GPU's resource would run without the GPU (or, under the NVIDIA runtime with an image's
    NVIDIA_VISIBLE_DEVICES=all, with every GPU): none is made; the job waits saying to enable the agents' device
    plugin or choose envvar. A GPU of the same training that has its resource still takes jobs."""
    bare = stage(gpu_uuid="GPU-1", gpu_resource="")
    job = fill_job()
    d = step([job], [bare])
    assert d.create_pods == [] and d.assign == [] and job["status"]["phase"] == "Queued"
    said = cond(job, "Placed")
    assert said["reason"] == "NoGpuResource"
    for words in ("node-a reports no device-plugin resource for GPU GPU-1", "agent.devicePlugin.enabled",
                  "operator.fillGpuAccess: envvar"):
        assert words in said["message"], said["message"]
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "Queued"), ("Warning", "NoGpuResource")]
    # Pinned to its stage, or a gang: the same words, not "not profiled".
    pinned = fill_job("pinned", stage=0)
    served = stage(1, pod="llama-1", gpu_uuid="GPU-2")
    step([pinned], [bare, served])
    assert pinned["status"]["phase"] == "Queued" and cond(pinned, "Placed")["reason"] == "NoGpuResource"
    gang = fill_job("gang", gpus=2)
    step([gang], [stage(0, rank=r, ranks=2, gpu_uuid=f"GPU-{r}", gpu_resource="") for r in (0, 1)])
    assert cond(gang, "Placed")["reason"] == "NoGpuResource"
    # The training's other GPU, served: a job goes there.
    free = fill_job("free")
    (pod,) = step([free], [bare, served]).create_pods
    assert free["status"]["assignment"]["stage"] == 1 and pod["spec"]["containers"][0]["resources"]["limits"] == {
        "bubbles.dev/gpu-0": "1"}
    # envvar needs no resource: the same GPU takes the job.
    later = fill_job("later")
    step([later], [bare], fill_pods=FillPodSettings(gpu_access=GpuAccess.ENVVAR))
    assert later["status"]["phase"] == "Placed"
    # fill_pod itself refuses to make such a Pod (bubbles template, or a caller that did not ask placement).
    from bubbles.core.resources import FillJobResource

    fj = FillJobResource.from_object(fill_job("direct"))
    a = Assignment(fj.uid, 1, "ml", fj.name, "ml/llama", 0, "node-a", "llama-0", "cuda:0", "fj-direct-a0", 0,
                   "GPU-1", fj.job)
    with pytest.raises(ValueError, match="enable the agent's device plugin"):
        fill_pod(fj, a)
    assert fill_pod(fj, replace(a, gpu_resources=("bubbles.dev/gpu-0",)))["spec"]["containers"][0]["resources"]


def test_fill_pods_mount_only_the_attach_and_their_gpus_fill_directories_and_run_as_the_agents_user() -> None:
    """nodeAccess hostPath: today's Pod, exactly."""
    (pod,) = step([fill_job()], [stage(1, rank=3)], fill_pods=HOST_PATH).create_pods
    assert pod["spec"]["volumes"] == [
        {"name": "bubbles-attach", "hostPath": {"path": "/run/bubbles/_attach", "type": "Directory"}},
        {"name": "bubbles-fills", "hostPath": {"path": "/run/bubbles/ml/llama/stage-1/rank-3/fills",
                                               "type": "Directory"}}]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["BUBBLES_STAGE"] == "1" and env["BUBBLES_RANKS"] == "3"
    assert "securityContext" not in pod["spec"]
    # The chart's agent.runDir and agent.runAsUser: the sockets live there and are private to that user.
    settings = replace(HOST_PATH, node_run_dir="/var/lib/bubbles/run", run_as_user=1000, run_as_group=2000)
    (pod,) = step([fill_job("other")], [stage()], fill_pods=settings).create_pods
    assert [v["hostPath"]["path"] for v in pod["spec"]["volumes"]] == [
        "/var/lib/bubbles/run/_attach", "/var/lib/bubbles/run/ml/llama/stage-0/rank-0/fills"]
    # Where the SDK looks ($BUBBLES_RUN_DIR) and where the agent tells it to bind its socket: the node's paths, under
    # /run/bubbles. The stage's lock, card and agent socket, and the node's other trainings, are not in the Pod.
    assert [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]] == [
        str(paths.attach_dir("/run/bubbles")), str(paths.fills_dir("/run/bubbles", paths.GpuKey("ml", "llama", 0)))]
    assert {"name": "BUBBLES_RUN_DIR", "value": "/run/bubbles"} in pod["spec"]["containers"][0]["env"]
    assert pod["spec"]["securityContext"] == {"runAsUser": 1000, "runAsGroup": 2000}


def test_a_fill_pod_carries_the_jobs_own_environment_and_pull_secrets() -> None:
    """Where a batch-inference job's data and credentials are: its env (values, or keys of Secrets and ConfigMaps,
    which the kubelet reads: the operator needs no access to them) and the Secrets its image is pulled with."""
    secret = {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    job = fill_job(env=[{"name": "DATASET", "value": "s3://bucket/prompts"}, {"name": "HF_TOKEN", "valueFrom": secret},
                        {"name": "EMPTY"}],  # an empty variable, as a container may have
                   imagePullSecrets=[{"name": "registry-creds"}])
    (pod,) = step([job], [stage()]).create_pods
    env = pod["spec"]["containers"][0]["env"]
    assert {"name": "DATASET", "value": "s3://bucket/prompts"} in env and {"name": "HF_TOKEN", "valueFrom": secret} \
        in env and {"name": "BUBBLES_FILL_JOB", "value": "fj"} in env  # the runtime's own are still there
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
    plain = step([fill_job("plain")], [stage()]).create_pods[0]
    assert "imagePullSecrets" not in plain["spec"]
    # No GPU of the training's known (gpu_uuid None): no GPU at all, whatever the image's ENV would show.
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in plain["spec"]["containers"][0]["env"]


@pytest.mark.parametrize(("env", "needle"), [
    ([{"name": "BUBBLES_DEVICE", "value": "cuda:3"}], "names starting with BUBBLES_, CUDA_, NVIDIA_ are the fill "
                                                       "runtime's"),
    ([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=80G"}], "are the fill runtime's"),
    ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "spec.env[1].name 'A' is given twice"),
    ([{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
     "spec.env[0] (A) has both value and valueFrom"),
    ([{"name": "A", "valueFrom": {}}], "spec.env[0].valueFrom needs exactly one of secretKeyRef, configMapKeyRef"),
    ([{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}], "spec.env[0].valueFrom.secretKeyRef.key is "
                                                                     "required"),
    ([{"name": "1 A", "value": "x"}], "spec.env[0].name '1 A' is not valid"),
])
def test_a_bad_environment_fails_the_job_saying_which_variable(env: list[dict[str, Any]], needle: str) -> None:
    job = fill_job(env=env)
    d = step([job], [stage()])
    assert job["status"]["phase"] == "Failed" and d.create_pods == []
    assert needle in job["status"]["message"], job["status"]["message"]


def test_a_fill_pod_mounts_the_jobs_own_volumes_beside_the_runtimes() -> None:
    """Where a batch-inference job reads its prompts and writes its answers: its own volumes, mounted as the spec says,
    with the runtime's (the agent's run directory, the checkpoint claim) still there."""
    vols = [{"name": "prompts", "mountPath": "/data/prompts", "readOnly": True,
             "persistentVolumeClaim": {"claimName": "prompts", "readOnly": True}},
            {"name": "answers", "mountPath": "/data/answers", "subPath": "run-7",
             "persistentVolumeClaim": {"claimName": "answers"}},
            {"name": "config", "mountPath": "/etc/job", "configMap": {"name": "job-config"}},
            {"name": "creds", "mountPath": "/var/run/creds", "secret": {"secretName": "s3", "optional": True}},
            {"name": "scratch", "mountPath": "/scratch", "emptyDir": {"sizeLimit": "10Gi"}},
            # the checkpoint without a claim of its own, in one of the job's volumes
            ]
    job = fill_job(volumes=vols, checkpoint={"path": "/data/answers/state"})
    (pod,) = step([job], [stage()]).create_pods
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["prompts"] == {"name": "prompts", "mountPath": "/data/prompts", "readOnly": True}
    assert mounts["answers"] == {"name": "answers", "mountPath": "/data/answers", "subPath": "run-7"}
    assert volumes["prompts"] == {"name": "prompts",
                                  "persistentVolumeClaim": {"claimName": "prompts", "readOnly": True}}
    assert volumes["config"] == {"name": "config", "configMap": {"name": "job-config"}}
    assert volumes["creds"] == {"name": "creds", "secret": {"secretName": "s3", "optional": True}}
    assert volumes["scratch"] == {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}
    assert mounts["bubbles-attach"]["mountPath"] == "/run/bubbles" and "csi" in volumes["bubbles-attach"]
    assert "checkpoint" not in volumes  # no claim: the path is in the job's answers volume
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BUBBLES_CHECKPOINT"] == "/data/answers/state"


def test_every_fill_pod_is_pinned_by_affinity_for_the_scheduler_to_place_it() -> None:
    """nodeName skips the scheduler: a WaitForFirstConsumer claim (most clouds' default StorageClass) is then never
    bound, and current API servers refuse it beside scheduling gates (Kueue's Pod integration adds them). Every fill
    Pod is pinned to the training's node by a required affinity, its NoSchedule taints tolerated as nodeName would;
    and the claims' files are given to the agent's group, the job's."""
    settings = replace(HOST_PATH, run_as_user=1000, run_as_group=2000)
    (plain,) = step([fill_job("plain")], [stage()], fill_pods=settings).create_pods
    assert "nodeName" not in plain["spec"]
    assert fill_pod_node(plain["spec"]) == "node-a"
    assert plain["spec"]["securityContext"] == {"runAsUser": 1000, "runAsGroup": 2000}
    scratch = fill_job("scratch", volumes=[{"name": "s", "mountPath": "/s", "emptyDir": {}}])
    assert fill_pod_node(step([scratch], [stage()], fill_pods=settings).create_pods[0]["spec"]) == "node-a"
    for job in (fill_job("vol", volumes=[_volume()]), fill_job("ckpt", checkpoint={"path": "/c", "claimName": "c"})):
        (pod,) = step([job], [stage()], fill_pods=settings).create_pods
        spec = pod["spec"]
        assert "nodeName" not in spec and fill_pod_node(spec) == "node-a"
        required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (term,) = required["nodeSelectorTerms"]
        assert term == {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
        assert spec["tolerations"] == [{"operator": "Exists", "effect": "NoSchedule"}]
        assert spec["securityContext"] == {"runAsUser": 1000, "runAsGroup": 2000, "fsGroup": 2000,
                                           "fsGroupChangePolicy": "OnRootMismatch"}
    assert fill_pod_node({"nodeName": "n"}) == "n" and fill_pod_node({}) is None


def test_paths_written_plainly_before_the_checks_stay_valid_and_a_pipe_dir_is_compared_plainly() -> None:
    job = fill_job(checkpoint={"path": "/ckpt/"})
    (pod,) = step([job], [stage()]).create_pods
    assert {"name": "BUBBLES_CHECKPOINT", "value": "/ckpt"} in pod["spec"]["containers"][0]["env"]
    mps = replace(HOST_PATH, mps_pipe_dir="/tmp/nvidia-mps/")
    bad = fill_job("bad", volumes=[_volume(mountPath="/tmp/nvidia-mps")])
    step([bad], [stage(gpu_uuid="GPU-1")], fill_pods=mps)
    assert bad["status"]["phase"] == "Failed" and "lies in /tmp/nvidia-mps" in bad["status"]["message"]


def test_a_placed_job_is_not_failed_by_a_changed_mps_pipe_dir() -> None:
    """The Pod it has mounts what it mounts: a setting changed under it (a new --fill-mps-pipe-dir) is checked at the
    next placement, not against a running job."""
    job = fill_job(volumes=[_volume(mountPath="/srv/mps/data")])
    step([job], [stage(gpu_uuid="GPU-1")])
    assert job["status"]["phase"] == "Placed"
    step([job], [stage(gpu_uuid="GPU-1")], fill_pods=replace(HOST_PATH, mps_pipe_dir="/srv/mps"))
    assert job["status"]["phase"] == "Placed"


def _volume(**kw: Any) -> dict[str, Any]:
    return {"name": "data", "mountPath": "/data", "persistentVolumeClaim": {"claimName": "data"}, **kw}


@pytest.mark.parametrize(("volumes", "checkpoint", "needle"), [
    ([_volume(name="bubbles-fills")], None, "spec.volumes[0].name 'bubbles-fills' is the name of a volume the fill "
                                            "runtime mounts itself"),
    ([_volume(), _volume(mountPath="/other")], None, "spec.volumes[1].name 'data' is given twice"),
    ([_volume(), _volume(name="more")], None, "spec.volumes[1].mountPath '/data' is also spec.volumes[0].mountPath"),
    ([_volume(mountPath="/data")], {"path": "/data", "claimName": "ckpt"},
     "spec.volumes[0].mountPath '/data' is also spec.checkpoint.path"),
    ([_volume(mountPath="/run/bubbles")], None, "lies in /run/bubbles, which the fill runtime uses itself"),
    ([_volume(mountPath="/run/bubbles/x")], None, "lies in /run/bubbles"),
    ([_volume(mountPath="/dev/shm")], None, "lies in /dev"),
    ([_volume(mountPath="/proc/x")], None, "lies in /proc"),
    ([_volume(mountPath="/")], None, "cannot be the container's root"),
    ([_volume(mountPath="/data/../run/bubbles")], None, "without '.' or '..' parts"),
    ([_volume(mountPath="/data/")], None, "trailing slashes"),
    ([_volume(mountPath="data")], None, "spec.volumes[0].mountPath 'data' is not valid"),
    ([_volume(subPath="../etc")], None, "spec.volumes[0].subPath '../etc' must be a path inside the volume"),
    ([_volume(subPath="/etc")], None, "spec.volumes[0].subPath '/etc' is not valid"),
    ([_volume(configMap={"name": "c"})], None, "spec.volumes[0] needs exactly one of persistentVolumeClaim, "
                                                "configMap, secret, emptyDir, got persistentVolumeClaim, configMap"),
    ([{"name": "data", "mountPath": "/data"}], None, "needs exactly one of persistentVolumeClaim"),
    ([_volume(persistentVolumeClaim={})], None, "spec.volumes[0].persistentVolumeClaim.claimName is required"),
    ([_volume(name="Data")], None, "spec.volumes[0].name 'Data' is not valid"),
    ([_volume(hostPath={"path": "/"})], None, "spec.volumes[0].hostPath is not a known field"),
    ([_volume(name=f"v{i}", mountPath=f"/v{i}") for i in range(17)], None, "at most 16"),
    ([], {"path": "/run/bubbles/ckpt"}, "spec.checkpoint.path '/run/bubbles/ckpt' lies in /run/bubbles"),
])
def test_bad_volumes_fail_the_job_saying_which(volumes: list[dict[str, Any]], checkpoint: dict[str, Any] | None,
                                               needle: str) -> None:
    job = fill_job(volumes=volumes, **({"checkpoint": checkpoint} if checkpoint else {}))
    d = step([job], [stage()])
    assert job["status"]["phase"] == "Failed" and d.create_pods == [], job["status"]
    assert needle in job["status"]["message"], job["status"]["message"]


def test_a_volume_in_the_mps_pipe_directory_fails_the_job_on_an_mps_cluster_only() -> None:
    """The pipe directory is the operator's setting (--fill-mps-pipe-dir), not the spec's: checked against it where
    the Pod mounts it at its node path (hostPath); a csi Pod finds it in its own volume under /run/bubbles."""
    in_csi = fill_job("in-csi", volumes=[_volume(mountPath="/tmp/nvidia-mps/data")])
    step([in_csi], [stage(gpu_uuid="GPU-1")], fill_pods=FillPodSettings(mps_pipe_dir="/tmp/nvidia-mps"))
    assert in_csi["status"]["phase"] == "Placed"
    mps = replace(HOST_PATH, mps_pipe_dir="/tmp/nvidia-mps")
    job = fill_job(volumes=[_volume(mountPath="/tmp/nvidia-mps/data")])
    d = step([job], [stage(gpu_uuid="GPU-1")], fill_pods=mps)
    assert job["status"]["phase"] == "Failed" and d.create_pods == []
    assert "spec.volumes[0].mountPath '/tmp/nvidia-mps/data' lies in /tmp/nvidia-mps, the MPS pipe directory" in \
        job["status"]["message"]
    ckpt = fill_job("ckpt", checkpoint={"path": "/tmp/nvidia-mps"})
    step([ckpt], [stage(gpu_uuid="GPU-1")], fill_pods=mps)
    assert "spec.checkpoint.path '/tmp/nvidia-mps' lies in /tmp/nvidia-mps" in ckpt["status"]["message"]
    plain = fill_job("plain", volumes=[_volume(mountPath="/tmp/nvidia-mps/data")])
    (pod,) = step([plain], [stage()]).create_pods  # no MPS: the path is the job's to use
    assert "/tmp/nvidia-mps/data" in {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}


def test_a_fill_pod_carries_the_jobs_own_cpu_and_memory_where_given() -> None:
    """A namespace whose ResourceQuota counts CPU and memory refuses Pods that name none: spec.resources is the
    fill Pod's container's (the accelerator memory stays profile.memory, the agent's to enforce)."""
    job = fill_job(resources={"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": 4 * 2**30}})
    (pod,) = step([job], [stage()]).create_pods
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"},
                                                         "limits": {"memory": str(4 * 2**30)}}
    (plain,) = step([fill_job("plain")], [stage()]).create_pods
    assert "resources" not in plain["spec"]["containers"][0]  # BestEffort, as before


def test_fill_pods_on_an_mps_node_join_its_server_and_others_do_not() -> None:
    """The agents run --isolation mps: a fill Pod on a GPU gets what makes it a client of the node's MPS server (the
    pipe directory, the agent's /dev/shm directory at /dev/shm, the CUDA_MPS_* variables; no host IPC); on a CPU
    stage nothing of it."""
    settings = replace(HOST_PATH, mps_pipe_dir="/run/nvidia-mps", mps_thread_percentage=40,
                       mps_shm_dir="/run/mps-shm")
    (pod,) = step([fill_job()], [stage(gpu_uuid="GPU-1234")], fill_pods=settings).create_pods
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")} == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=64M"}  # the job's 64Mi, on cuda:0
    assert "hostIPC" not in spec
    assert {"name": "mps-pipe", "mountPath": "/run/nvidia-mps"} in container["volumeMounts"]
    assert {"name": "mps-pipe", "hostPath": {"path": "/run/nvidia-mps", "type": "Directory"}} in spec["volumes"]
    assert {"name": "mps-shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "mps-shm", "hostPath": {"path": "/run/mps-shm", "type": "Directory"}} in spec["volumes"]
    # The same variables the agent gives the fill processes it starts itself, for the device they see.
    from bubbles.core.mps_client import fill_client_env

    assert fill_client_env(PurePosixPath("/run/nvidia-mps"), 40, 0, 64 * MIB) == \
        {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}
    # A job with no memory to pin fails validation with the reason; the round goes on (before, the pinned limit's
    # ValueError escaped reconcile and stopped every round, for every job).
    zero = fill_job("zero", profile={"memory": "0", "stepTime": "2ms"})
    d = step([zero, fill_job("next")], [stage(gpu_uuid="GPU-1234")], fill_pods=settings)
    assert zero["status"]["phase"] == "Failed"
    assert "spec.profile.memory must be more than 0" in zero["status"]["message"]
    assert [p["metadata"]["name"] for p in d.create_pods] == ["fj-next-a0"]
    (cpu_pod,) = step([fill_job("on-cpu")], [stage()], fill_pods=settings).create_pods
    cpu_env = {e["name"] for e in cpu_pod["spec"]["containers"][0]["env"]}
    assert "hostIPC" not in cpu_pod["spec"] and not any(n.startswith("CUDA_MPS_") for n in cpu_env)
    assert [v["name"] for v in cpu_pod["spec"]["volumes"]] == RUN_VOLUMES
    (plain,) = step([fill_job("no-mps")], [stage(gpu_uuid="GPU-1234")], fill_pods=HOST_PATH).create_pods  # contexts
    assert [v["name"] for v in plain["spec"]["volumes"]] == RUN_VOLUMES
    assert not any(e["name"].startswith("CUDA_MPS_") for e in plain["spec"]["containers"][0]["env"])


def test_csi_fill_pods_on_an_mps_node_find_its_server_in_their_own_volume() -> None:
    """nodeAccess csi under MPS: the agent bind-mounts the node's pipe and /dev/shm directories into the Pod's own
    volume when it publishes it; the Pod points CUDA_MPS_PIPE_DIRECTORY there and mounts the shm part of the same
    volume at /dev/shm (a subPath): no hostPath, no host IPC, still restricted. The other MPS variables as the agent
    gives its own fill processes."""
    settings = FillPodSettings(mps_pipe_dir="/run/nvidia-mps", mps_thread_percentage=40, mps_shm_dir="/run/mps-shm",
                               fill_run_as_user=1000)
    (pod,) = step([fill_job()], [stage(gpu_uuid="GPU-1234")], fill_pods=settings).create_pods
    spec, (c,) = pod["spec"], pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    from bubbles.core.mps_client import fill_client_env

    assert {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")} == fill_client_env(
        PurePosixPath("/run/bubbles/mps/pipe"), 40, 0, 64 * MIB)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"/run/bubbles/{nodeaccess.POD_MPS_PIPE_SUBDIR}"
    assert c["volumeMounts"] == [{"name": "bubbles-attach", "mountPath": "/run/bubbles"},
                                 {"name": "bubbles-attach", "mountPath": "/dev/shm",
                                  "subPath": nodeaccess.POD_MPS_SHM_SUBDIR}]
    assert [v["name"] for v in spec["volumes"]] == CSI_VOLUMES and "hostIPC" not in spec
    assert spec["securityContext"]["runAsUser"] == 1000  # the trainings' UID: an MPS server serves one
    assert check(pod).level == "restricted", check(pod).summary()
    # A gang: the limit on each of its GPUs, as before.
    (gang,) = step([fill_job("gang", gpus=2)], [stage(0, rank=r, ranks=2, gpu_uuid=f"GPU-{r}") for r in (0, 1)],
                   fill_pods=settings).create_pods
    genv = {e["name"]: e["value"] for e in gang["spec"]["containers"][0]["env"]}
    assert genv["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=64M,1=64M" and genv["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"
    # A CPU stage: nothing of MPS.
    (cpu,) = step([fill_job("cpu")], [stage(1, pod="llama-1")], fill_pods=settings).create_pods
    assert not any(e["name"].startswith("CUDA_MPS_") for e in cpu["spec"]["containers"][0]["env"])
    assert len(cpu["spec"]["containers"][0]["volumeMounts"]) == 1


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"node_run_dir": "run/bubbles"}, "must be an absolute path"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "shm"}, "/dev/shm directory must be an absolute path"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/"}, "at least two levels deep"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/shm"}, "at least two levels deep"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/run/x/../bubbles"}, "without '.' or '..' parts"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "//run/mps-shm"}, "repeated or trailing slashes"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/run/mps-shm/"}, "repeated or trailing slashes"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/dev/shm"}, "the node's own /dev/shm"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/dev/mps"}, "the node's own system files"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/proc/mps"}, "the node's own system files"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/tmp/nvidia-mps"}, "apart from the MPS pipe directory"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_shm_dir": "/run/bubbles/shm"}, "apart from the node's run directory"),
    ({"mps_pipe_dir": "/run/m/pipe", "mps_shm_dir": "/run/m"}, "apart from the MPS pipe directory"),
    ({"run_as_user": -1}, "user id must be >= 0"),
    ({"run_as_group": -5}, "group id must be >= 0"),
    ({"mps_pipe_dir": "tmp/nvidia-mps"}, "MPS pipe directory must be an absolute path"),
    ({"mps_pipe_dir": "/" + "d" * 120}, "over the 107-byte limit of a Unix socket path"),
    ({"mps_pipe_dir": "/tmp/nvidia-mps", "mps_thread_percentage": 0}, "whole number from 1 to 100, got 0"),
    ({"mps_thread_percentage": 101}, "whole number from 1 to 100, got 101"),
    ({"runtime_class": "NVIDIA"}, "is not a RuntimeClass name"),
    ({"runtime_class": "nvidia/cdi"}, "is not a RuntimeClass name"),
    ({"runtime_class": "n" * 254}, "is not a RuntimeClass name"),
])
def test_fill_pod_settings_refuse_what_no_node_has(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        FillPodSettings(**kwargs)


def test_long_names_are_refused_or_kept_valid_in_labels() -> None:
    long_job = fill_job("x" * 70)  # a valid Kubernetes name, but fill-job names are DNS labels (socket paths)
    step([long_job], [stage()])
    assert long_job["status"]["phase"] == "Failed" and "1-63 lower-case letters" in long_job["status"]["message"]
    # A PipelineTraining's name is its hooks' $BUBBLES_TRAINING and a directory on its nodes: a longer one than a
    # DNS label is refused in its status, and nothing is placed through it.
    name = "t" * 200
    t = training()
    t["metadata"]["name"] = name
    job = fill_job()
    d = step([job], [replace(stage(), training=f"ml/{name}")], [t])
    said = cond(t, "Admitted")
    assert said["reason"] == "InvalidSpec" and "1-63 lower-case letters" in said["message"]
    assert "re-create it under a shorter name" in said["message"]
    assert job["status"]["phase"] == "Queued" and not d.create_pods
    # A long fill-job name within a label's bound keeps its label valid (labels hash what is longer).
    job = fill_job("j" * 63)
    d = step([job], [stage()])
    labels = d.create_pods[0]["metadata"]["labels"]
    assert all(len(v) <= 63 for v in labels.values()) and labels["bubbles.dev/fill-job"] == "j" * 63


def test_a_checkpoint_claim_is_mounted_at_the_checkpoint_path_of_every_attempt() -> None:
    job = fill_job(checkpoint={"path": "/state", "claimName": "fj-state"})
    d = step([job], [stage()])
    (pod,) = d.create_pods
    (c,) = pod["spec"]["containers"]
    assert {"name": "checkpoint", "mountPath": "/state"} in c["volumeMounts"]
    assert {"name": "checkpoint", "persistentVolumeClaim": {"claimName": "fj-state"}} in pod["spec"]["volumes"]
    assert {"name": "BUBBLES_CHECKPOINT", "value": "/state"} in c["env"]
    plain = fill_job("plain", checkpoint={"path": "/state"})  # no claim: nothing mounted, the path is the image's
    (pod,) = step([plain], [stage(1, pod="llama-1")]).create_pods
    assert [v["name"] for v in pod["spec"]["volumes"]] == CSI_VOLUMES
    bad = fill_job("bad", checkpoint={"path": "state", "claimName": "Not_A_Name"})
    step([bad], [stage(1, pod="llama-1")])
    assert bad["status"]["phase"] == "Failed" and "checkpoint" in cond(bad, "Admitted")["message"]


def test_what_keeps_a_fill_pod_from_starting_is_read_from_its_containers_and_starting_is_not_a_failure() -> None:
    assert pod_not_starting(waiting_pod(("ContainerCreating", ""))) is None
    assert pod_not_starting({"status": {"phase": "Pending"}}) is None  # not yet on the kubelet's books
    assert pod_not_starting(waiting_pod(("ContainerCreating", ""), ("ImagePullBackOff", 'Back-off pulling "x"'))) \
        == 'ImagePullBackOff: Back-off pulling "x"'
    init = {"status": {"phase": "Pending", "initContainerStatuses": [
        {"name": "i", "state": {"waiting": {"reason": "CreateContainerConfigError"}}}]}}
    assert pod_not_starting(init) == "CreateContainerConfigError"
    # A Pod with a claim goes through the scheduler, which may not place it: its words, at once.
    unplaced = {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 1 node(s) had volume node affinity conflict"}]}}
    assert pod_not_starting(unplaced) == ("Unschedulable: 0/3 nodes are available: 1 node(s) had volume node "
                                          "affinity conflict")
    scheduling = {"status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}}
    assert pod_not_starting(scheduling) is None


def test_a_fill_pod_the_scheduler_cannot_place_says_so_on_its_job() -> None:
    job = fill_job(checkpoint={"path": "/state", "claimName": "far-away"})
    step([job], [stage()])
    why = "Unschedulable: 0/3 nodes are available: 1 node(s) had volume node affinity conflict"
    step([job], [stage()], waiting_pods={"ml/fj-fj-a0": (why, NOW.timestamp())})
    assert cond(job, "Running")["reason"] == "PodNotStarting" and "volume node affinity" in cond(job, "Running")[
        "message"]
    assert "the scheduler cannot place it on its training's node" in job["status"]["message"]
    assert "another zone or node" in job["status"]["message"]


def test_a_fill_pod_that_cannot_start_is_said_at_once_and_given_up_after_the_timeout() -> None:
    job = fill_job()
    step([job], [stage()])
    created = NOW.timestamp()
    pull = {"ml/fj-fj-a0": ('ErrImagePull: rpc error: "fill:1" not found', created)}
    d = step([job], [stage()], waiting_pods=pull)
    assert job["status"]["phase"] == "Placed" and d.delete_pods == [] and d.cancel == []
    assert "its image cannot be pulled" in job["status"]["message"] and "spec.image" in job["status"]["message"]
    assert cond(job, "Running")["reason"] == "PodNotStarting" and "not found" in cond(job, "Running")["message"]
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "PodNotStarting")]
    # The kubelet alternates the failed pull's words with its back-off's: the pull's, which say why, are kept (no
    # status write, no new Event).
    said = dict(cond(job, "Running"))
    backoff = {"ml/fj-fj-a0": ('ImagePullBackOff: Back-off pulling "fill:1"', created)}
    d = step([job], [stage()], waiting_pods=backoff, now=NOW + dt.timedelta(seconds=30))
    assert d.events == [] and cond(job, "Running") == said and "ml/fj" not in d.fill_job_status
    # Ten minutes after the Pod's creation, in a back-off: off the stage, its Pod deleted, back in the queue, and the
    # pull's words said.
    d = step([job], [stage()], waiting_pods=backoff, now=NOW + dt.timedelta(seconds=600))
    assert job["status"]["phase"] == "Queued" and job["status"]["restarts"] == 1
    assert d.delete_pods == [("ml", "fj-fj-a0")] and d.cancel == [("node-a", "uid-fj")]
    assert "did not start within 600 s" in cond(job, "Evicted")["message"] and "not found" in job["status"]["message"]


def test_a_back_off_with_no_failed_pull_said_before_is_said_as_it_is() -> None:
    job = fill_job()
    step([job], [stage()])
    backoff = {"ml/fj-fj-a0": ('ImagePullBackOff: Back-off pulling "fill:1"', NOW.timestamp())}
    step([job], [stage()], waiting_pods=backoff)
    assert cond(job, "Running")["message"] == 'fill Pod fj-fj-a0: ImagePullBackOff: Back-off pulling "fill:1"'
    # Another reason after a failed pull is said as it is.
    step([job], [stage()], waiting_pods={"ml/fj-fj-a0": ('ErrImagePull: denied', NOW.timestamp())})
    step([job], [stage()], waiting_pods={"ml/fj-fj-a0": ("CreateContainerConfigError: secret x", NOW.timestamp())})
    assert cond(job, "Running")["message"] == "fill Pod fj-fj-a0: CreateContainerConfigError: secret x"


def test_a_fill_pod_that_never_leaves_container_creating_is_given_up_too() -> None:
    """A volume that never mounts (a checkpoint claim that does not exist) is said in Events only: the container just
    waits in ContainerCreating. Nothing is said early, and the job is not held for good."""
    job = fill_job()
    step([job], [stage()])
    creating = {"ml/fj-fj-a0": ("", NOW.timestamp())}
    d = step([job], [stage()], waiting_pods=creating, now=NOW + dt.timedelta(seconds=60))
    assert job["status"]["phase"] == "Placed" and d.events == [] and d.delete_pods == []
    d = step([job], [stage()], waiting_pods=creating, now=NOW + dt.timedelta(seconds=600))
    assert job["status"]["phase"] == "Queued" and d.delete_pods == [("ml", "fj-fj-a0")]
    assert "still being created (a volume that does not mount?" in cond(job, "Evicted")["message"]


def test_a_fill_pod_that_starts_after_all_goes_back_to_its_placed_message() -> None:
    job = fill_job()
    step([job], [stage()])
    placed = job["status"]["message"]
    step([job], [stage()], waiting_pods={"ml/fj-fj-a0": ("CreateContainerConfigError: secret x", NOW.timestamp())})
    assert "Secret or ConfigMap" in job["status"]["message"]
    d = step([job], [stage()])
    assert job["status"]["message"] == placed and cond(job, "Running")["reason"] == "Starting" and d.delete_pods == []
    # A running fill process is never judged by its Pod's waiting state (it would not have one).
    run = {"uid-fj": JobProgress("uid-fj", FillState.RUNNING, 5, 0.0)}
    step([job], [stage()], progress=run, waiting_pods={"ml/fj-fj-a0": ("ErrImagePull", NOW.timestamp() - 9999)})
    assert job["status"]["phase"] == "Running"


def test_a_fill_pod_tolerates_what_its_training_pod_does_and_what_the_chart_adds() -> None:
    """A GPU node's NoExecute taints evict a Pod that does not tolerate them, nodeName or not: the fill Pod takes its
    training Pod's tolerations (that Pod runs on the node), and the chart's operator.fillPodTolerations."""
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}
    spot = {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    settings = FillPodSettings(tolerations=(spot,))
    (pod,) = step([fill_job()], [replace(stage(), tolerations=(gpu, spot))], fill_pods=settings).create_pods
    assert pod["spec"]["tolerations"] == [{"operator": "Exists", "effect": "NoSchedule"}, gpu, spot]  # each once


@pytest.mark.parametrize(("bad", "needle"), [
    ({"key": "a", "operator": "Sometimes"}, "operator must be Exists or Equal"),
    ({"key": "a", "operator": "Exists", "value": "x"}, "Exists takes no value"),
    ({"operator": "Equal", "value": "x"}, "without a key must have operator Exists"),
    ({"key": "a", "effect": "NoRun"}, "effect must be one of NoSchedule, PreferNoSchedule, NoExecute"),
    ({"key": "a", "effect": "NoSchedule", "tolerationSeconds": 30}, "with effect NoExecute"),
    ({"key": "a", "tolerationsSeconds": 30}, "has field(s) tolerationsSeconds"),
    ("nvidia.com/gpu", "must be an object"),
])
def test_a_toleration_the_api_server_would_refuse_is_refused_at_start_saying_why(bad: object, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        FillPodSettings(tolerations=(bad,))  # type: ignore[arg-type]
