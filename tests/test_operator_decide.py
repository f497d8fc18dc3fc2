"""The operator's decisions (bubbles.operator.decide): cluster views in, statuses, Pods and Events out.

Each test builds what the operator would see (FillJob and PipelineTraining objects, training stages with the
bubble cycles their agents report, fill-job progress), calls ``reconcile`` and writes the decided statuses
back, as the API server would, before the next round.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
import math
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

import pytest

from bubbles.core import paths
from bubbles.core.api import FillState
from bubbles.core.cycle import BubbleCycle
from bubbles.operator.decide import (
    ClusterView,
    Decisions,
    FillPodSettings,
    JobProgress,
    StageView,
    fill_pod_node,
    pod_not_starting,
    reconcile,
)

NOW = dt.datetime(2026, 11, 23, 8, 0, tzinfo=dt.UTC)
RUN_VOLUMES = ["bubbles-attach", "bubbles-fills"]  # a fill Pod's two directories of the node's run directory
MIB = 2**20


def cycle(stage: int = 0, bubble_s: float = 0.010, free: int = 1024 * MIB, iteration_s: float = 0.100) -> BubbleCycle:
    return BubbleCycle.from_dict({
        "training": "llama", "stage": stage, "stages": 2, "microbatches": 8, "schedule": "TrainSchedule",
        "iteration_s": iteration_s, "samples": 5,
        "slots": [{"slot": 0, "position": 3, "instruction": "RecvGrad", "kind": "steady", "duration_s": bubble_s,
                   "p10_s": bubble_s, "p90_s": bubble_s, "free_bytes": free}]})


def stage(k: int = 0, pod: str = "llama-0", node: str = "node-a", **kw: Any) -> StageView:
    fields: dict[str, Any] = {"hook_reporting": True, **kw}
    if "cycle" not in fields:
        fields["cycle"] = cycle(k)
    return StageView("ml/llama", k, pod, f"uid-{pod}", node, "cuda:0", **fields)


def training(labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "llama", "namespace": "ml", "uid": "t-uid", "generation": 1,
                         "labels": labels or {"team": "a"}},
            "spec": {"selector": {"matchLabels": {"app": "llama"}}, **spec}}


def fill_job(name: str = "fj", created: str = "2026-11-23T07:00:00Z", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"image": "fill:1", "entry": "pkg.mod:Job", "profile": {"memory": "64Mi", "stepTime": "2ms"},
                            "work": {"steps": 1000}}
    body.update(spec)
    return {"metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created}, "spec": body}


def step(jobs: list[dict[str, Any]], stages: list[StageView], trainings: list[dict[str, Any]] | None = None,
         progress: dict[str, JobProgress] | None = None, now: dt.datetime = NOW,
         failed_pods: dict[str, str] | None = None, fill_pods: FillPodSettings | None = None,
         ended_pods: dict[str, str] | None = None, acting_s: float = math.inf,
         waiting_pods: dict[str, tuple[str, float]] | None = None, cuda_context_bytes: int = 0) -> Decisions:
    """One reconcile; the decided statuses are written into the objects (the API server's part)."""
    trainings = trainings if trainings is not None else [training()]
    d = reconcile(ClusterView(now, jobs, trainings, stages, progress or {}, failed_pods=failed_pods or {},
                              ended_pods=ended_pods or {}, fill_pods=fill_pods or FillPodSettings(),
                              acting_s=acting_s, waiting_pods=waiting_pods or {}, pod_start_timeout_s=600.0,
                              cuda_context_bytes=cuda_context_bytes))
    for obj in jobs:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if key in d.fill_job_status:
            obj["status"] = d.fill_job_status[key]
    for obj in trainings:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if key in d.training_status:
            obj["status"] = d.training_status[key]
    return d


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def test_an_invalid_fill_job_fails_with_the_reason_and_one_event() -> None:
    bad = fill_job(work={"steps": 0})
    d = step([bad], [stage()])
    assert bad["status"]["phase"] == "Failed" and "spec.work.steps must be >= 1" in bad["status"]["message"]
    assert cond(bad, "Admitted")["status"] == "False" and cond(bad, "Admitted")["reason"] == "InvalidSpec"
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "InvalidSpec")]
    again = step([bad], [stage()])
    assert again.events == [] and again.fill_job_status == {}  # nothing changes, nothing is written


def test_a_valid_job_is_placed_on_a_profiled_stage_with_its_pod_on_that_node() -> None:
    job = fill_job()
    d = step([job], [stage()])
    st = job["status"]
    assert st["phase"] == "Placed" and st["observedGeneration"] == 1
    assert st["assignment"] == {"training": "llama", "stage": 0, "node": "node-a", "device": "cuda:0",
                                "pod": "fj-fj-a0", "trainingPod": "llama-0", "trainingPodUid": "uid-llama-0",
                                "placedAt": "2026-11-23T08:00:00Z"}
    assert st["progressText"] == "0% (0/1000)" and st["counters"]["placements"] == 1
    # 10 ms bubble per 100 ms iteration, 2 ms steps: 5 steps per iteration -> 1000 steps in 20 s
    assert st["eta"] == "2026-11-23T08:00:20Z"
    (pod,) = d.create_pods
    assert pod["spec"]["nodeName"] == "node-a" and pod["metadata"]["name"] == "fj-fj-a0"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-fj"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["BUBBLES_TRAINING"] == "llama" and env["BUBBLES_STAGE"] == "0" and env["BUBBLES_DEVICE"] == "cuda:0"
    assert env["BUBBLES_MEMORY_BYTES"] == str(64 * MIB) and env["BUBBLES_MAX_STEPS"] == "1000"
    assert pod["spec"]["automountServiceAccountToken"] is False and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    (a,) = d.assign
    assert (a.uid, a.node, a.stage, a.fill_pod) == ("uid-fj", "node-a", 0, "fj-fj-a0")
    assert [e.reason for e in d.events] == ["Placed"]  # queued and placed in one round: one Event
    d = step([fill_job("on-gpu")], [stage(1, pod="llama-1", gpu_uuid="GPU-1234")])
    env = {e["name"]: e["value"] for e in d.create_pods[0]["spec"]["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1234" and env["BUBBLES_DEVICE"] == "cuda:0"


def test_fill_pods_mount_only_the_attach_and_their_stages_fill_directories_and_run_as_the_agents_user() -> None:
    (pod,) = step([fill_job()], [stage(1)]).create_pods
    assert pod["spec"]["volumes"] == [
        {"name": "bubbles-attach", "hostPath": {"path": "/run/bubbles/_attach", "type": "Directory"}},
        {"name": "bubbles-fills", "hostPath": {"path": "/run/bubbles/llama/stage-1/fills", "type": "Directory"}}]
    assert "securityContext" not in pod["spec"]
    # The chart's agent.runDir and agent.runAsUser: the sockets live there and are private to that user.
    settings = FillPodSettings("/var/lib/bubbles/run", run_as_user=1000, run_as_group=2000)
    (pod,) = step([fill_job("other")], [stage()], fill_pods=settings).create_pods
    assert [v["hostPath"]["path"] for v in pod["spec"]["volumes"]] == [
        "/var/lib/bubbles/run/_attach", "/var/lib/bubbles/run/llama/stage-0/fills"]
    # Where the SDK looks ($BUBBLES_RUN_DIR) and where the agent tells it to bind its socket: the node's paths, under
    # /run/bubbles. The stage's lock, card and agent socket, and the node's other trainings, are not in the Pod.
    assert [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]] == [
        str(paths.attach_dir("/run/bubbles")), str(paths.fills_dir("/run/bubbles", "llama", 0))]
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
    assert mounts["bubbles-fills"]["mountPath"] == "/run/bubbles/llama/stage-0/fills" and "hostPath" in \
        volumes["bubbles-fills"]
    assert "checkpoint" not in volumes  # no claim: the path is in the job's answers volume
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["BUBBLES_CHECKPOINT"] == "/data/answers/state"


def test_a_fill_pod_with_a_claim_is_pinned_by_affinity_for_the_scheduler_to_bind_it() -> None:
    """nodeName skips the scheduler, and a WaitForFirstConsumer claim (most clouds' default StorageClass) is bound only
    by it: with a claim the Pod is pinned to the training's node by a required affinity, its NoSchedule taints
    tolerated as nodeName would; and the claims' files are given to the agent's group, the job's."""
    settings = FillPodSettings(run_as_user=1000, run_as_group=2000)
    (plain,) = step([fill_job("plain")], [stage()], fill_pods=settings).create_pods
    assert plain["spec"]["nodeName"] == "node-a" and "affinity" not in plain["spec"]
    assert plain["spec"]["securityContext"] == {"runAsUser": 1000, "runAsGroup": 2000}
    scratch = fill_job("scratch", volumes=[{"name": "s", "mountPath": "/s", "emptyDir": {}}])
    assert step([scratch], [stage()], fill_pods=settings).create_pods[0]["spec"]["nodeName"] == "node-a"
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
    mps = FillPodSettings(mps_pipe_dir="/tmp/nvidia-mps/")
    bad = fill_job("bad", volumes=[_volume(mountPath="/tmp/nvidia-mps")])
    step([bad], [stage(gpu_uuid="GPU-1")], fill_pods=mps)
    assert bad["status"]["phase"] == "Failed" and "lies in /tmp/nvidia-mps" in bad["status"]["message"]


def test_a_placed_job_is_not_failed_by_a_changed_mps_pipe_dir() -> None:
    """The Pod it has mounts what it mounts: a setting changed under it (a new --fill-mps-pipe-dir) is checked at the
    next placement, not against a running job."""
    job = fill_job(volumes=[_volume(mountPath="/srv/mps/data")])
    step([job], [stage(gpu_uuid="GPU-1")])
    assert job["status"]["phase"] == "Placed"
    step([job], [stage(gpu_uuid="GPU-1")], fill_pods=FillPodSettings(mps_pipe_dir="/srv/mps"))
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
    """The pipe directory is the operator's setting (--fill-mps-pipe-dir), not the spec's: checked against it."""
    mps = FillPodSettings(mps_pipe_dir="/tmp/nvidia-mps")
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
    settings = FillPodSettings(mps_pipe_dir="/run/nvidia-mps", mps_thread_percentage=40, mps_shm_dir="/run/mps-shm")
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
    (plain,) = step([fill_job("no-mps")], [stage(gpu_uuid="GPU-1234")]).create_pods  # agents on contexts
    assert [v["name"] for v in plain["spec"]["volumes"]] == RUN_VOLUMES
    assert not any(e["name"].startswith("CUDA_MPS_") for e in plain["spec"]["containers"][0]["env"])


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
])
def test_fill_pod_settings_refuse_what_no_node_has(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        FillPodSettings(**kwargs)


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
    def pod(uid: str, **kw: Any) -> StageView:
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
    assert "no longer reports stage 0 of llama" in msg and "llama-0 still runs" in msg and "is gone" not in msg
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
    assert st["stages"][0]["bubbles"] == [{"slot": 0, "durationSeconds": 0.01, "freeBytes": 1024 * MIB}]


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


def test_a_pod_whose_hook_never_reported_gets_a_status_the_server_accepts() -> None:
    from bubbles.core.resources import PIPELINE_TRAINING_STATUS, validate

    t = training()
    silent = StageView("ml/llama", -1, "llama-0", "uid-llama-0", "node-a", "", None)
    step([], [silent], [t])
    assert t["status"]["stages"] == [{"pod": "llama-0", "node": "node-a"}]
    assert validate(PIPELINE_TRAINING_STATUS, t["status"], "status") == []


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


def test_long_names_are_refused_or_kept_valid_in_labels() -> None:
    long_job = fill_job("x" * 70)  # a valid Kubernetes name, but fill-job names are DNS labels (socket paths)
    step([long_job], [stage()])
    assert long_job["status"]["phase"] == "Failed" and "1-63 lower-case letters" in long_job["status"]["message"]
    name = "t" * 200
    t = training()
    t["metadata"]["name"] = name
    job = fill_job()
    d = step([job], [replace(stage(), training=f"ml/{name}")], [t])
    labels = d.create_pods[0]["metadata"]["labels"]
    assert all(len(v) <= 63 for v in labels.values()) and labels["bubbles.dev/training"].startswith("t" * 50)
    assert job["status"]["assignment"]["training"] == name


def test_a_new_training_pod_under_the_same_name_evicts_what_ran_in_the_old_ones_bubbles() -> None:
    job = fill_job()
    step([job], [stage()])
    assert job["status"]["assignment"]["trainingPodUid"] == "uid-llama-0"
    replaced = StageView("ml/llama", 0, "llama-0", "uid-llama-0-again", "node-a", "cuda:0", cycle=cycle(0),
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


def test_the_stage_an_eviction_frees_is_held_for_the_evicted_job_not_given_to_a_lower_priority_one() -> None:
    hi, lo = fill_job("hi", priority=10), fill_job("lo")
    step([hi, lo], [stage()])
    assert hi["status"]["phase"] == "Placed" and lo["status"]["phase"] == "Queued"
    d = step([hi, lo], [stage()], failed_pods={"ml/fj-hi-a0": "OOMKilled (exit code 137)"})
    assert d.create_pods == [] and hi["status"]["phase"] == "Queued" and lo["status"]["phase"] == "Queued"
    d = step([hi, lo], [stage()], failed_pods={"ml/fj-hi-a0": "OOMKilled (exit code 137)"})
    assert [p["metadata"]["name"] for p in d.create_pods] == ["fj-hi-a1"]  # by priority, a round later


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
    assert [v["name"] for v in pod["spec"]["volumes"]] == RUN_VOLUMES
    bad = fill_job("bad", checkpoint={"path": "state", "claimName": "Not_A_Name"})
    step([bad], [stage(1, pod="llama-1")])
    assert bad["status"]["phase"] == "Failed" and "checkpoint" in cond(bad, "Admitted")["message"]


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


def waiting_pod(*states: tuple[str, str]) -> dict[str, Any]:
    return {"status": {"phase": "Pending", "containerStatuses": [
        {"name": f"c{i}", "state": {"waiting": {"reason": r, **({"message": m} if m else {})}}}
        for i, (r, m) in enumerate(states)]}}


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
    # Silent beside a Pod of the training that reports on the same node: maybe a twin of its stage, stood down.
    step([], [stage(), stage(0, pod="llama-r1", hook_reporting=False, cycle=None),
              stage(1, pod="llama-elsewhere", node="node-b", hook_reporting=False, cycle=None)], [t])
    said = cond(t, "HookReporting")
    assert said["reason"] == "NoHook" and "llama-elsewhere, llama-r1:" in said["message"]
    assert "llama-r1 share a node with Pods of this training that report" in said["message"]
    assert "its hook stood down, as one process per stage and node is harvested" in said["message"]
    step([], [stage(node="", agent_up=False, hook_reporting=False, cycle=None)], [t])  # not scheduled yet
    said = cond(t, "HookReporting")
    assert said["reason"] == "NotScheduled" and "llama-0 not on a node yet" in said["message"]


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
    step([cpu], [StageView("ml/llama", 0, "llama-0", "uid-llama-0", "node-a", "cpu", cycle(free=1024 * MIB),
                           hook_reporting=True)], cuda_context_bytes=ctx)
    assert cpu["status"]["phase"] == "Placed"


def test_a_training_edited_into_an_invalid_spec_says_so_on_the_jobs_it_had() -> None:
    t = training()
    job = fill_job()
    step([job], [stage()], [t])
    assert job["status"]["phase"] == "Placed"
    t["spec"]["selector"] = {}
    step([job], [], [t])  # the shell reports no stage for a training it cannot read
    assert job["status"]["phase"] == "Queued"
    assert "PipelineTraining llama's spec turned invalid (spec.selector must select" in cond(job, "Evicted")["message"]


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
    assert said["message"] == f"stage 1 (llama-1 on node-b): {outside}"
    assert job["status"]["phase"] == "Placed"  # the job is placed and runs all the same
    # A stage restarted and not checked again yet: a partial view changes nothing (no flapping to True).
    step([job], [stage(training_membership="client"), stage(1, pod="llama-1", node="node-b")], [t])
    assert cond(t, "MpsClient")["reason"] == "NotMpsClient"
    step([job], [stage(training_membership="client"), stage(1, pod="llama-1", node="node-b",
                                                            training_membership="client")], [t])
    said = cond(t, "MpsClient")
    assert (said["status"], said["reason"]) == ("True", "MpsClient") and "every profiled stage (2)" in said["message"]
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
    assert said["message"].startswith(f"stage 0 (llama-0 on node-0): {outside}") and said["message"].count(outside) == 1
    assert "; likewise stage(s) 1 (llama-1 on node-1), 2 (llama-2 on node-2)" in said["message"]
    assert said["message"].endswith("20 (llama-20 on node-20) and 43 more") and len(said["message"]) < 32768
