"""The whole product on a real node (``pytest -m cluster``): from ``helm install`` to a FillJob that ran in the
bubbles of a real DeepSpeed training, every part in its own Pod, started by a real kubelet.

The node is a single-node Kubernetes 1.20 cluster built from Debian's packages by tools/node-from-debian.sh; the
images are built from images/*/Dockerfile with buildah (no registry) and imported into the node's containerd; the
chart is installed with Helm's own engine (its Go SDK) with the values a CPU node needs; the training is the demo's
DeepSpeed pipeline (2 stages, gloo) in two Pods with the hook attached as the README tells users; the FillJob is
the one in examples/cluster/. On a failure the cluster's state and the relevant logs are printed.

Issue 36's way, as the chart installs by default: the trainings' namespace is labelled for Pod Security ``baseline``
(the 1.20 API server has no Pod Security admission: every Pod made there is checked against the standard as written,
``bubbles.operator.podsecurity``, at the end, the fill Pods against ``restricted``); no Pod there has a hostPath or
a host namespace: the trainings and the fill Pods reach the agent through its CSI volume, run as UIDs other than the
agent's (the trainings as TRAINING_UID, the fill Pods as the chart's fillRunAsUser), and the kubelet calls the agent's
device plugin, which serves the node's GPUs as a stand-in NVML library names them (tests/helpers/fake_nvml.c: the node
has no GPU).

Skipped, saying why, where the node cannot run (not root, no apt-get); everything else is a failure.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import fake_nvml
from helpers.helm import chart_for_1_20
from helpers.real_node import IMAGE_TAG, ROOT, ClusterUnavailable, RealNode, build_image, build_images, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

NS = "ml"
SYSTEM = "bubbles-system"
RELEASE = "bubbles"
UID = 1000  # the chart's agent.runAsUser
TRAINING_UID = 2000  # the trainings' Pods: any UID, not the agent's (the CSI volume is the Pod's own directory)
FILL_UID = 65532  # the chart's operator.fillRunAsUser default: the fill Pods'
# The node's GPUs as the agent's NVML sees them (a stand-in library: the node has none); the trainings run on CPU.
FAKE_GPUS = ("GPU-0b5e1d2c-0000-4000-8000-00000000b001", "GPU-0b5e1d2c-0000-4000-8000-00000000b002")
FILL_IMAGE = "docker.io/library/bubbles-fill-job:0.1.0"  # the name examples/cluster/ uses
TRAINING = "llama-pp"
HOSTPATH_NS = "ml-hostpath"  # the hostPath mode's Pods (Pod Security privileged), apart from the trainings' namespace
PSA_LABELS = {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/enforce-version": "latest",
              "pod-security.kubernetes.io/warn": "restricted", "pod-security.kubernetes.io/warn-version": "latest"}


class Cluster:
    def __init__(self, node: RealNode, images: dict[str, str], run_dir: Path, out_dir: Path) -> None:
        self.node, self.images, self.run_dir, self.out_dir = node, images, run_dir, out_dir
        self.timeline: dict[str, Any] = {}
        self.prometheus: Any = None  # a real Prometheus scraping the bubbles Pods, from helm install on
        self.scraped_from = 0.0


DISCOVERY_TIMEOUT_S = 10.0


def start_prometheus(node: RealNode, work: Path) -> Any:
    """Debian's Prometheus on the host, scraping every bubbles Pod's container port named `metrics`. Debian builds
    it without Kubernetes service discovery, so a thread here does discovery's part: every 2 s it lists the Pods
    from the API server into a file_sd file (Prometheus re-reads it), following replaced Pods (the fault tests
    delete the agent and the operator)."""
    import threading

    from helpers.prometheus import Prometheus, find_prometheus

    binary, why = find_prometheus()
    if binary is None:
        return why
    work.mkdir(parents=True, exist_ok=True)
    targets = work / "targets.json"

    def discover() -> None:
        # A short timeout: a call in flight when the node goes down must end before close_all's join gives up on it.
        pods = json.loads(node.kubectl("get", "pods", "-n", SYSTEM, "-l", "app.kubernetes.io/name=bubbles", "-o",
                                       "json", timeout=DISCOVERY_TIMEOUT_S).stdout)["items"]
        groups = []
        for pod in pods:
            ip, meta = pod["status"].get("podIP"), pod["metadata"]
            if not ip or pod["status"].get("phase") != "Running":
                continue
            for c in pod["spec"]["containers"]:
                for port in c.get("ports", []):
                    if port.get("name") == "metrics":
                        labels = meta.get("labels") or {}
                        groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                            "job": f"bubbles-{labels.get('app.kubernetes.io/component', 'unknown')}",
                            "node": pod["spec"].get("nodeName", ""), "pod": meta["name"]}})
        tmp = targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(targets)

    discover()
    prom = Prometheus(binary, work, {}, [{"job_name": "bubbles-pods", "file_sd_configs": [
        {"files": [str(targets)], "refresh_interval": "2s"}]}])
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(2.0):
            with contextlib.suppress(Exception):  # the API server busy for a moment: the next round
                discover()

    thread = threading.Thread(target=loop, name="bubbles-discovery", daemon=True)
    thread.start()
    close = prom.close

    def close_all() -> None:
        stop.set()
        thread.join(DISCOVERY_TIMEOUT_S + 5)
        close()

    prom.close = close_all
    return prom


@contextlib.contextmanager
def explained(cluster: Cluster) -> Iterator[None]:
    """On a failure, print what a person would look at first (CI's output is all there is)."""
    try:
        yield
    except BaseException:
        print(cluster.node.dump())
        raise


def chart_values(node: RealNode, run_dir: Path) -> dict[str, Any]:
    """What a user sets for this node: local images, its GPU label (faked: it has none), no MPS, the API
    server's address for Pods (no kube-proxy here, so Service IPs do not route), and the kubelet's --root-dir
    (tools/node-from-debian.sh runs it with ``<state>/kubelet``) for the CSI node plugin and the device plugin, which
    the chart turns on by default (nodeAccess csi; the device plugin's strategy auto: volume-mounts on 1.20). For this
    test alone: the stand-in NVML library (``fake_nvml``) mounted into the agent, naming FAKE_GPUS.

    And a grace of 500 ms, not the default 50: two cores run the node's control plane, both training ranks, the fill
    Pods and, in the fault tests, a new operator or agent Pod starting up. A fill process descheduled past its
    bubble's end was killed by the watchdog while the operator's new Pod started: 50 ms past it once (2026-11-25),
    and 200 ms past it once (2026-12-07), and the fault test counted the restart. The watchdog and the grace are
    tested apart (tests/test_agent.py); this tier tests the life cycle around them."""
    api = [{"name": "KUBERNETES_SERVICE_HOST", "value": node.api_host},
           {"name": "KUBERNETES_SERVICE_PORT", "value": str(node.api_port)}]
    return {
        "image": {"registry": "localhost", "tag": IMAGE_TAG, "pullPolicy": "Never"},
        "operator": {"interval": 1, "extraEnv": api, "agentDownAfter": 10},
        "agent": {"isolation": "contexts", "runDir": str(run_dir), "runAsUser": UID, "runAsGroup": UID,
                  "graceMs": 500, "csi": {"kubeletDir": str(node.state / "kubelet")},
                  "extraVolumes": [{"name": "fake-nvml", "hostPath": {"path": str(fake_nvml_dir(node)),
                                                                     "type": "Directory"}}],
                  "extraVolumeMounts": [{"name": "fake-nvml", "mountPath": "/opt/fake-nvml", "readOnly": True}],
                  "extraEnv": [{"name": "LD_LIBRARY_PATH", "value": "/opt/fake-nvml"},
                               {"name": fake_nvml.UUIDS_ENV, "value": ",".join(FAKE_GPUS)}]},
    }


def fake_nvml_dir(node: RealNode) -> Path:
    return node.state / "fake-nvml"


def training_pod(rank: int, master: str, iterations: int, hook: bool = True, name: str = TRAINING) -> dict[str, Any]:
    """One stage of the demo's DeepSpeed pipeline as a Pod: examples/cluster/training-pod.yaml (what the docs tell
    users a training Pod needs: the agent's CSI volume at /run/bubbles, the Pod's name and namespace) with the demo's
    command, rendezvous, a UID of its own (TRAINING_UID, not the agent's) and an output directory (an emptyDir, read
    from the node: ``out_dir``).

    Each layer sleeps 1 ms in its forward (2 in its backward) besides its CPU work: it stands in for GPU kernels, so
    the stages' times, and so their bubbles, do not depend on how 2 cores are shared. ``/out/stop`` ends the run
    early (every rank at the same iteration)."""
    pod = yaml.safe_load((ROOT / "examples" / "cluster" / "training-pod.yaml").read_text())
    pod["metadata"].update(name=f"{name}-{rank}", namespace=NS, labels={"app": name})
    spec = pod["spec"]
    spec["securityContext"].update(runAsUser=TRAINING_UID, runAsGroup=TRAINING_UID)
    (c,) = spec["containers"]
    c["image"], c["imagePullPolicy"] = FILL_IMAGE, "Never"
    c["command"] = ["python", "-m", "bubbles.demo.train", "--phases", f"harvest:{iterations}", "--out", "/out",
                    "--free-bytes", str(2**30), "--seed", "1234", "--sleep-compute-ms", "1", "--stop-file", "/out/stop",
                    *(["--no-hook"] if not hook else [])]
    c["env"] = [e if e["name"] != "BUBBLES_TRAINING" else {"name": "BUBBLES_TRAINING", "value": name}
                for e in c["env"]]
    master_addr: dict[str, Any] = ({"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} if rank == 0
                                   else {"value": master})
    c["env"] += [{"name": "RANK", "value": str(rank)}, {"name": "LOCAL_RANK", "value": "0"},
                 {"name": "WORLD_SIZE", "value": "2"}, {"name": "MASTER_PORT", "value": "29500"},
                 {"name": "MASTER_ADDR", **master_addr}, {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
                 {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "HOME", "value": "/tmp"}]
    c["volumeMounts"].append({"name": "out", "mountPath": "/out"})
    (run,) = spec["volumes"]
    assert run["csi"] == {"driver": CSI_DRIVER, "volumeAttributes": {"role": "training"}}
    spec["volumes"].append({"name": "out", "emptyDir": {}})
    return pod


def out_dir(node: RealNode, pod: str) -> Path:
    """The node directory of Pod ``pod``'s /out (its emptyDir, in the kubelet's directory): what the training wrote,
    and where a stop file reaches it."""
    uid = node.get("pod", "-n", NS, pod)["metadata"]["uid"]
    return node.state / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / "out"


def start_training(node: RealNode, iterations: int, hook: bool = True, name: str = TRAINING) -> None:
    """Rank 0 first (its Pod IP is the rendezvous address), then rank 1 pointed at it."""
    node.apply(training_pod(0, "", iterations, hook, name))
    ip = wait_for(f"{name}-0's Pod IP", lambda: node.get("pod", "-n", NS, f"{name}-0")["status"].get("podIP"), 120)
    node.apply(training_pod(1, ip, iterations, hook, name))


def node_and_images(state: Path) -> tuple[RealNode, dict[str, str], dict[str, float]]:
    """The node up, with the project's images in its containerd. The steps overlap where the 2 cores allow: the node
    comes up (about 25 s, most of it waiting: about 4 s of CPU) while the images build, and each image goes into the
    node while the next one builds, the fill-job's first (1.3 GB, about 30 s to import). Skips, saying why, where no
    node can run; the node is taken down again if a later step fails."""
    import os
    import queue
    import subprocess
    from concurrent.futures import ThreadPoolExecutor, wait

    try:
        RealNode.can_run_here()
    except ClusterUnavailable as exc:
        pytest.skip(f"CLUSTER TIER SKIPPED: {exc}")
    t0 = time.monotonic()
    timeline: dict[str, float] = {}
    built: queue.Queue[str | None] = queue.Queue()  # images to import, in the order they are built; None: no more

    with ThreadPoolExecutor(2, thread_name_prefix="cluster-setup") as pool:
        node_f = pool.submit(RealNode.up, state)

        def importer() -> None:
            node = node_f.result()
            while (image := built.get()) is not None:
                node.import_images(image)

        import_f = pool.submit(importer)
        try:
            fill_job = build_image("fill-job")
            subprocess.run(["buildah", "tag", fill_job, FILL_IMAGE], check=True, capture_output=True,
                           env={**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs")})
            built.put(FILL_IMAGE)
            for what in ("operator", "agent"):
                built.put(build_image(what))
            built.put(None)
            timeline["images built (the node coming up, and importing, beside them)"] = time.monotonic() - t0
            images = build_images()  # built above: the names
            node = node_f.result()
            import_f.result()
            timeline["the last image imported"] = time.monotonic() - t0
        except BaseException:
            built.put(None)
            wait([node_f, import_f])  # nothing left running into the node
            if isinstance(node_f.exception(), ClusterUnavailable):
                pytest.skip(f"CLUSTER TIER SKIPPED: {node_f.exception()}")
            if node_f.exception() is None:
                node_f.result().down()
            raise
    timeline["node up"] = node.up_s
    return node, images, timeline


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import os

    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) installs the chart")
    state = Path(os.environ.get("BUBBLES_NODE_DIR", "/tmp/bubbles-node"))
    c: Cluster | None = None
    node: RealNode | None = None
    try:
        node, images, timeline = node_and_images(state)
        # The node has no GPU; the label NVIDIA's feature discovery would set is what the agent DaemonSet selects.
        node.kubectl("label", "node", node.name, "nvidia.com/gpu.present=true", "--overwrite")
        # The trainings' namespace as a platform team sets it: Pod Security baseline enforced, restricted warned of.
        # 1.20 has no Pod Security admission: test_every_pod_in_the_trainings_namespace_meets_pod_security checks.
        node.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS, "labels": PSA_LABELS}})
        try:
            fake_nvml.build(fake_nvml_dir(node))
        except fake_nvml.NoCompiler as exc:
            pytest.skip(f"CLUSTER TIER SKIPPED: {exc}")
        run_dir = state / "run"
        c = Cluster(node, images, run_dir, state / "out")
        c.timeline.update(timeline)
        with explained(c):
            config = helm.Config(kubeconfig_path=str(node.kubeconfig), namespace=SYSTEM)
            t0 = time.monotonic()
            # The chart as a 1.20 API server takes it: its CRDs without the CEL rules 1.20 predates.
            chart = chart_for_1_20(Path(tempfile.mkdtemp(prefix="bubbles-chart-")) / "bubbles")
            config.install(helm.Chart.load(str(chart)), RELEASE, chart_values(node, run_dir),
                           namespace=SYSTEM, create_namespace=True, timeout=300, wait="watcher")
            c.timeline["helm install (wait for Ready)"] = time.monotonic() - t0
            c.scraped_from = time.time()
            c.prometheus = start_prometheus(node, state / "prometheus")
        yield c
    finally:
        if c is not None:
            print(json.dumps({"the cluster tier's timeline (s)": c.timeline}, indent=1))  # shown with -s
            if c.prometheus is not None and not isinstance(c.prometheus, str):
                c.prometheus.close()
        if node is None:
            pass
        elif os.environ.get("BUBBLES_NODE_KEEP") == "1":  # to look around after a run: tools/node-from-debian.sh down
            print(f"BUBBLES_NODE_KEEP=1: the node stays up (kubectl --kubeconfig {node.kubeconfig})")
        else:
            result = node.down()
            assert result.returncode == 0, result.stderr
            # The machine as it was: no mounts of the node's, no bridge, no state directory left behind.
            mounts = [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(state) in line]
            assert not mounts and not state.exists(), mounts
            assert not Path("/sys/class/net/bubbles-br0").exists(), "the node's bridge is still there"


def test_helm_install_brings_up_the_operator_and_an_agent_on_the_gpu_node(cluster: Cluster) -> None:
    node = cluster.node
    with explained(cluster):
        ds = node.get("daemonset", "-n", SYSTEM, f"{RELEASE}-agent")
        assert ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"] == 1
        dep = node.get("deployment", "-n", SYSTEM, f"{RELEASE}-operator")
        assert dep["status"].get("readyReplicas") == dep["spec"]["replicas"]
        # The agent made its run directory its own (the init container) and serves there.
        assert cluster.run_dir.stat().st_uid == UID


CSI_DRIVER = "csi.bubbles.dev"


def csi_pod(name: str, role: str, command: list[str]) -> dict[str, Any]:
    """A Pod with the agent's CSI inline volume at /run/bubbles (as a training Pod will have it), running as the
    agent's UID in the fill-job image."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"bubbles-test": "csi"}},
            "spec": {"restartPolicy": "Never", "securityContext": {"runAsUser": UID, "runAsGroup": UID},
                     "containers": [{"name": "c", "image": FILL_IMAGE, "imagePullPolicy": "Never",
                                     "command": command,
                                     "volumeMounts": [{"name": "bubbles", "mountPath": "/run/bubbles"}]}],
                     "volumes": [{"name": "bubbles", "csi": {"driver": CSI_DRIVER,
                                                             "volumeAttributes": {"role": role}}}]}}


def host_mounts() -> set[str]:
    """The mount points of this machine's mount namespace (the node's: the kubelet's view)."""
    return {line.split(" ")[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}


def test_the_kubelet_publishes_and_unpublishes_the_agents_csi_volume(cluster: Cluster) -> None:
    """The chart's CSIDriver and the agent's CSI node plugin under the real 1.20 kubelet (issue 36, step 2a): the
    kubelet registers the plugin, publishes a Pod's inline volume through it (the Pod writes into its own node
    directory, <run_dir>/_pods/<pod uid>/, and the bind mount is in the node's view of the kubelet's directory),
    and unpublishes it when the Pod is deleted; a volume with a wrong attribute keeps its Pod in ContainerCreating
    with the plugin's refusal in the Pod's events."""
    node = cluster.node
    kubelet = node.state / "kubelet"
    pods_dir = cluster.run_dir / "_pods"
    with explained(cluster):
        # The 1.20 API server kept the chart's fsGroupPolicy (beta there, on by default), not dropped it.
        driver = node.get("csidriver", CSI_DRIVER)["spec"]
        assert (driver["attachRequired"], driver["podInfoOnMount"], driver["volumeLifecycleModes"],
                driver.get("fsGroupPolicy")) == (False, True, ["Ephemeral"], "None"), driver
        wait_for("the kubelet to register csi.bubbles.dev (its CSINode)", lambda: CSI_DRIVER in {
            d["name"] for d in node.get("csinode", node.name)["spec"].get("drivers") or []}, 60)
        # The plugin's sockets are the agent's UID's (setpriv), as everything it makes in the run directory.
        assert (kubelet / "plugins" / CSI_DRIVER / "csi.sock").stat().st_uid == UID
        # Writes a file into the volume, then waits for the test to say so before it exits.
        pod = csi_pod("csi-writer", "training", [
            "python", "-c", "import os, time\nopen('/run/bubbles/hello', 'w').write('from the pod')\n"
            "while not os.path.exists('/run/bubbles/done'):\n    time.sleep(0.2)\n"
            "print('pod-sees', sorted(os.listdir('/run/bubbles')))"])
        node.apply(pod)
        uid = node.get("pod", "-n", NS, "csi-writer")["metadata"]["uid"]
        pod_dir = pods_dir / uid
        target = kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / "bubbles" / "mount"
        wait_for("the Pod's file in its node directory", lambda: (pod_dir / "hello").exists(), 180, 0.5)
        assert (pod_dir / "hello").read_text() == "from the pod"
        assert (pod_dir / "hello").stat().st_uid == UID
        assert str(target) in host_mounts(), f"{target} is not mounted in the node's view"
        book = json.loads((pods_dir / "csi-volumes.json").read_text())["volumes"]
        assert [(v["namespace"], v["pod"], v["uid"], v["role"], v["target_path"]) for v in book] == \
            [(NS, "csi-writer", uid, "training", str(target))], book
        (pod_dir / "done").touch()
        got = wait_for("csi-writer to end", lambda: (
            p if (p := node.get("pod", "-n", NS, "csi-writer"))["status"].get("phase") in ("Succeeded", "Failed")
            else None), 120)
        log = node.kubectl("logs", "-n", NS, "csi-writer").stdout
        assert got["status"]["phase"] == "Succeeded", (got["status"], log)
        assert "pod-sees ['done', 'hello']" in log, log
        node.kubectl("delete", "pod", "-n", NS, "csi-writer", "--timeout=120s")
        wait_for("the kubelet to unpublish csi-writer's volume", lambda: str(target) not in host_mounts()
                 and not pod_dir.exists(), 120)
        assert json.loads((pods_dir / "csi-volumes.json").read_text())["volumes"] == []

        # A wrong attribute: the plugin refuses, the kubelet says so on the Pod and keeps trying.
        node.apply(csi_pod("csi-wrong-role", "other", ["python", "-c", "print('never')"]))
        bad_uid = node.get("pod", "-n", NS, "csi-wrong-role")["metadata"]["uid"]

        def refused() -> str | None:
            events = node.get("events", "-n", NS, "--field-selector", "involvedObject.name=csi-wrong-role")["items"]
            return next((e["message"] for e in events if e["reason"] == "FailedMount"), None)

        message = wait_for("FailedMount on csi-wrong-role", refused, 120)
        assert "InvalidArgument" in message and "volumeAttributes.role must be training or fill, got 'other'" \
            in message, message
        def creating() -> dict[str, Any] | None:
            status = node.get("pod", "-n", NS, "csi-wrong-role")["status"]
            waiting = [c["state"].get("waiting", {}).get("reason") for c in status.get("containerStatuses", [])]
            return status if waiting == ["ContainerCreating"] else None

        assert wait_for("csi-wrong-role to show ContainerCreating", creating, 30)["phase"] == "Pending"
        assert not (pods_dir / bad_uid).exists()  # a refused publish leaves nothing behind
        node.kubectl("delete", "pod", "-n", NS, "csi-wrong-role", "--timeout=120s")

        # A Pod of no FillJob asking for a fill Pod's volume (to reach the agent as a fill job would): refused.
        node.apply(csi_pod("csi-not-a-fill-pod", "fill", ["python", "-c", "print('never')"]))

        def refused_fill() -> str | None:
            events = node.get("events", "-n", NS, "--field-selector", "involvedObject.name=csi-not-a-fill-pod")["items"]
            return next((e["message"] for e in events if e["reason"] == "FailedMount"), None)

        message = wait_for("FailedMount on csi-not-a-fill-pod", refused_fill, 120)
        assert f"Pod {NS}/csi-not-a-fill-pod is not a fill Pod" in message, message
        node.kubectl("delete", "pod", "-n", NS, "csi-not-a-fill-pod", "--timeout=120s")


def test_the_kubelet_calls_the_agents_device_plugin_and_it_refuses_a_pod_of_no_fill_job(cluster: Cluster) -> None:
    """The agent's device plugin under the real 1.20 kubelet: registered, each GPU of the node (the stand-in NVML's)
    advertised as its own resource with the chart's fill slots; a Pod that requests one without being a FillJob's
    fill Pod is admitted by the kubelet (Allocate is not told the Pod) but its container does not start: the
    plugin's PreStartContainer asks the kubelet's PodResources API whose Pod it is and refuses, with the reason."""
    node = cluster.node
    with explained(cluster):
        def advertised() -> dict[str, str] | None:
            allocatable = node.get("node", node.name)["status"].get("allocatable", {})
            mine = {k: v for k, v in allocatable.items() if k.startswith("bubbles.dev/")}
            return mine if len(mine) == len(FAKE_GPUS) else None

        assert wait_for("the kubelet to list the agent's GPU resources", advertised, 120) == {
            f"bubbles.dev/gpu-{i}": "4" for i in range(len(FAKE_GPUS))}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "gpu-squatter", "namespace": NS, "labels": {"bubbles-test": "device-plugin"}},
               "spec": {"restartPolicy": "Never", "nodeName": node.name,
                        "securityContext": {"runAsUser": TRAINING_UID, "runAsNonRoot": True,
                                            "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [{"name": "c", "image": FILL_IMAGE, "imagePullPolicy": "Never",
                                        "command": ["python", "-c", "print('ran on a training GPU')"],
                                        "securityContext": {"allowPrivilegeEscalation": False,
                                                            "capabilities": {"drop": ["ALL"]}},
                                        "resources": {"limits": {"bubbles.dev/gpu-0": "1"}}}]}}
        node.apply(pod)

        def refusal() -> str | None:
            events = node.get("events", "-n", NS, "--field-selector", "involvedObject.name=gpu-squatter")["items"]
            return next((e["message"] for e in events if "only FillJobs' Pods" in e.get("message", "")), None)

        message = wait_for("gpu-squatter's container refused", refusal, 120)
        assert f"Pod {NS}/gpu-squatter requests a bubbles.dev/gpu-* resource but is not a fill Pod" in message, message
        status = node.get("pod", "-n", NS, "gpu-squatter")["status"]
        assert status.get("phase") != "Succeeded", status
        assert "ran on a training GPU" not in node.kubectl("logs", "-n", NS, "gpu-squatter", check=False).stdout
        node.kubectl("delete", "pod", "-n", NS, "gpu-squatter", "--timeout=120s")


def _run_to_end(node: RealNode, pod: dict[str, Any]) -> str:
    """Create ``pod``, wait for it to end, delete it; its log (it must have succeeded)."""
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    node.apply(pod)
    try:
        got = wait_for(f"Pod {ns}/{name} to end", lambda: (
            p if (p := node.get("pod", "-n", ns, name))["status"].get("phase") in ("Succeeded", "Failed") else None),
            180)
        log = node.kubectl("logs", "-n", ns, name, "--all-containers").stdout
        assert got["status"]["phase"] == "Succeeded", f"{name}: {got['status']}\n{log}"
        return log
    finally:
        node.kubectl("delete", "pod", "-n", ns, name, "--wait=false", check=False)


def test_mps_pods_share_the_agents_shm_directory_and_no_other_pod_sees_it(cluster: Cluster) -> None:
    """With agent.isolation=mps the MPS server keeps its shared state with its clients in /dev/shm: the agent's Pod
    (the chart's DaemonSet spec) and a fill Pod (the operator's ``fill_pod``) must see the same /dev/shm, without
    host IPC, and a Pod without the mount must not. The Pods are the chart's and the operator's own specs, with
    only the command replaced (this node has no GPU, so no MPS daemon: what is checked is what the kubelet mounts).

    The fill Pod is the hostPath mode's (nodeAccess hostPath, in a namespace of its own that allows privileged Pods):
    in csi mode the agent bind-mounts the same directories into the Pod's CSI volume, which tests/test_csi_mps.py
    checks with real mounts (this node's agent runs the contexts isolation, not MPS)."""
    from helpers.helm import render
    from helpers.operator import fill_job, stage, step

    from bubbles.core.nodeaccess import GpuAccess, NodeAccess
    from bubbles.operator.decide import FillPodSettings

    node, base = cluster.node, cluster.run_dir.parent
    pipe, shm = base / "mps-pipe", base / "mps-shm"
    values = chart_values(node, cluster.run_dir)
    values["agent"].update(isolation="mps", mps={"pipeDir": str(pipe), "shmDir": str(shm)})
    docs = render(values, namespace=SYSTEM, name=RELEASE)
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-agent")]
    (daemon_ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-mps-daemon")]
    spec = ds["spec"]["template"]["spec"]
    assert "hostIPC" not in spec and "hostIPC" not in ds["spec"]["template"]
    (agent,) = spec["containers"]
    agent.pop("ports"), agent.pop("livenessProbe"), agent.pop("readinessProbe")
    # With CSI the chart's command is setpriv (to the agent's UID) and then the bubbles command: keep the first.
    wrapper = agent.get("command", [])[:-1]
    agent["command"] = [*wrapper, "/opt/bubbles/bin/python", "-c",
                        "import os; open('/dev/shm/from-agent', 'w').write('agent'); st = os.stat('/dev/shm'); "
                        "print('agent-shm', st.st_uid, oct(st.st_mode & 0o777))"]
    agent["args"] = []
    spec["restartPolicy"] = "Never"
    probe = {"apiVersion": "v1", "kind": "Pod", "spec": spec,
             "metadata": {"name": "mps-agent-probe", "namespace": SYSTEM, "labels": {"bubbles-test": "mps-shm"}}}
    # The MPS daemon's own Pod (no GPU here: its command replaced): it shares both directories with the agent.
    daemon_spec = daemon_ds["spec"]["template"]["spec"]
    daemon_spec["restartPolicy"] = "Never"
    (mps_control,) = daemon_spec["containers"]
    mps_control["command"] = ["/opt/bubbles/bin/python", "-c",
                              f"import os; open('/dev/shm/from-daemon', 'w').write('daemon'); "
                              f"open('{pipe}/control-stand-in', 'w').write('x'); "
                              "print('daemon-saw', open('/dev/shm/from-agent').read())"]
    daemon_probe = {"apiVersion": "v1", "kind": "Pod", "spec": daemon_spec, "metadata": {
        "name": "mps-daemon-probe", "namespace": SYSTEM, "labels": {"bubbles-test": "mps-shm"}}}
    settings = FillPodSettings(str(cluster.run_dir), UID, UID, str(pipe), mps_shm_dir=str(shm),
                               node_access=NodeAccess.HOST_PATH, gpu_access=GpuAccess.ENVVAR)
    (fill,) = step([fill_job("mps-probe", image=FILL_IMAGE)], [stage(node=node.name, gpu_uuid="GPU-probe")],
                   fill_pods=settings).create_pods
    fill["metadata"].pop("ownerReferences")  # no FillJob here: the garbage collector would delete the Pod
    fill["metadata"]["namespace"] = HOSTPATH_NS
    node.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": HOSTPATH_NS, "labels": {
        "pod-security.kubernetes.io/enforce": "privileged"}}})
    fill_spec = fill["spec"]
    assert "hostIPC" not in fill_spec
    (c,) = fill_spec["containers"]
    # The GPU the fill Pod is placed on (training llama, stage 0, rank 0: not one the other tests run): its directory
    # under the node's run directory, as the Pod's fills volume names it.
    (fills_volume,) = [v for v in fill_spec["volumes"] if v["name"] == "bubbles-fills"]
    gpu = Path(fills_volume["hostPath"]["path"]).parent.relative_to(cluster.run_dir)
    assert gpu.parts[1:] == ("llama", "stage-0", "rank-0"), gpu
    c["command"] = ["python", "-c", "import os; print('fill-saw', open('/dev/shm/from-agent').read(), "
                    "open('/dev/shm/from-daemon').read()); "
                    "open('/dev/shm/from-fill', 'w').write('fill'); "
                    "print('fill-env', os.environ['CUDA_MPS_PIPE_DIRECTORY']); "
                    f"open('/run/bubbles/{gpu}/fills/from-fill', 'w').write('fill'); "
                    "print('fill-sees', sorted(os.path.relpath(os.path.join(r, n), '/run/bubbles') "
                    "for r, ds, fs in os.walk('/run/bubbles') for n in ds + fs))"]
    # A stand-in for the training's lock beside the GPU's fills/: the Pod must see fills/ and the attach directory of
    # the node's run directory, and nothing else of it (not the lock, not the other trainings' GPUs).
    stage_dir = cluster.run_dir / gpu
    made = [cluster.run_dir / "_attach"] + [cluster.run_dir.joinpath(*gpu.parts[:n]) for n in range(1, 5)]
    for d in (*made, stage_dir / "fills"):
        d.mkdir(mode=0o700, exist_ok=True)
        os.chown(d, UID, UID)
    (stage_dir / "hook.lock").touch()
    os.chown(stage_dir / "hook.lock", UID, UID)
    with explained(cluster):
        agent_log = _run_to_end(node, probe)
        # The init container gave the directory to the agent's UID, private to it (the training's shared memory).
        assert shm.stat().st_uid == UID and shm.stat().st_mode & 0o777 == 0o700
        assert f"agent-shm {UID} 0o700" in agent_log, agent_log
        daemon_log = _run_to_end(node, daemon_probe)
        assert "daemon-saw agent" in daemon_log and (pipe / "control-stand-in").stat().st_uid == UID, daemon_log
        fill_log = _run_to_end(node, fill)
        assert "fill-saw agent daemon" in fill_log and f"fill-env {pipe}" in fill_log, fill_log
        (seen,) = [ast.literal_eval(line.split(" ", 1)[1]) for line in fill_log.splitlines()
                   if line.startswith("fill-sees ")]
        assert f"{gpu}/fills/from-fill" in seen and "_attach" in seen, seen
        above = {str(Path(*gpu.parts[:n])) for n in range(1, 5)}  # the directories the mount point lies in
        assert not [p for p in seen if p not in above and not p.startswith(
            ("_attach", f"{gpu}/fills"))], seen  # no lock, no card, no agent socket, no other GPU or training
        assert (stage_dir / "fills" / "from-fill").stat().st_uid == UID
        shutil.rmtree(cluster.run_dir / gpu.parts[0] / "llama")
        assert (shm / "from-fill").read_text() == "fill" and (shm / "from-fill").stat().st_uid == UID
        # A Pod without the mount (and without host IPC) has a /dev/shm of its own.
        other = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "shm-outsider", "namespace": NS, "labels": {"bubbles-test": "mps-shm"}},
                 "spec": {"nodeName": node.name, "restartPolicy": "Never",
                          "securityContext": {"runAsUser": UID, "runAsGroup": UID},
                          "containers": [{"name": "c", "image": FILL_IMAGE, "imagePullPolicy": "Never",
                                          "command": ["python", "-c", "import os; print('outsider-sees', "
                                                      "sorted(os.listdir('/dev/shm')))"]}]}}
        assert "outsider-sees []" in _run_to_end(node, other)


REFERENCE = "llama-ref"  # the same training without the hook: the loss to compare with
REFERENCE_ITERATIONS = 60


@dataclass
class Trainings:
    """Where rank 0 of each training writes (its /out): each rank's record is in its own Pod's emptyDir."""

    harvest_out: Path
    reference_out: Path

    @staticmethod
    def record(node: RealNode, name: str, rank: int) -> dict[str, Any]:
        return dict(json.loads((out_dir(node, f"{name}-{rank}") / f"rank-{rank}.json").read_text()))


@pytest.fixture(scope="module")
def trainings(cluster: Cluster) -> Trainings:
    """The training with the hook (runs until told to stop) and its PipelineTraining, profiled; beside it the same
    training without the hook, for the loss comparison (its own Pods, nothing selects them)."""
    node = cluster.node
    with explained(cluster):
        start_training(node, 100_000)
        start_training(node, REFERENCE_ITERATIONS, hook=False, name=REFERENCE)
        t = Trainings(out_dir(node, f"{TRAINING}-0"), out_dir(node, f"{REFERENCE}-0"))
        pt = yaml.safe_load((ROOT / "examples" / "cluster" / "pipelinetraining.yaml").read_text())
        pt["metadata"]["namespace"] = NS
        # The training's slowdown budget, which reaches the agent's guard with each assignment: the demo training's
        # iteration time on this shared 2-core VM moves by +-5% from one second to the next, so the example's 1%
        # throttles fill work on noise alone (the guard then spends minutes at a share near 0). The guard that
        # tells noise from harm is the harvesting issue's (docs/benchmarks.md).
        pt["spec"]["slowdownBudget"] = 0.25
        node.apply(pt)
        t0 = time.monotonic()
        wait_for("the PipelineTraining's stages to be profiled", lambda: condition(node, "pt", TRAINING, "Profiled"),
                 600, 2)
        cluster.timeline["training Pods to Profiled"] = time.monotonic() - t0
    return t


def condition(node: RealNode, kind: str, name: str, type_: str) -> bool:
    conds = node.get(kind, "-n", NS, name).get("status", {}).get("conditions", [])
    return any(c["type"] == type_ and c["status"] == "True" for c in conds)


def fill_job(name: str, steps: int) -> dict[str, Any]:
    """The example FillJob under another name, with its amount of work cut or stretched for the scenario."""
    fj = yaml.safe_load((ROOT / "examples" / "cluster" / "filljob-image-classification.yaml").read_text())
    fj["metadata"].update(name=name, namespace=NS)
    fj["spec"]["work"]["steps"] = steps
    return fj


def fill_job_obj(node: RealNode, name: str) -> dict[str, Any]:
    return node.get("fj", "-n", NS, name)


def wait_phase(node: RealNode, name: str, phases: set[str], timeout: float, seen: list[str] | None = None,
               also: Any = None) -> dict[str, Any]:
    """Poll the FillJob until its phase is one of ``phases``; record every phase seen on the way."""
    def probe() -> dict[str, Any] | None:
        obj = fill_job_obj(node, name)
        phase = obj.get("status", {}).get("phase")
        if seen is not None and phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        if also is not None:
            also(obj)
        return obj if phase in phases else None
    return wait_for(f"FillJob {name} to be {' or '.join(sorted(phases))}", probe, timeout, 0.5)


def scrape(ip: str, port: int) -> dict[str, float]:
    """A Pod's /metrics from the host (Pod IPs route here), summed by metric name."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def pod_of(node: RealNode, component: str) -> dict[str, Any]:
    pods = node.get("pods", "-n", SYSTEM, "-l", f"app.kubernetes.io/component={component}")["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    assert len(running) == 1, [(p["metadata"]["name"], p["status"].get("phase")) for p in pods]
    return running[0]


def training_untouched(node: RealNode, name: str = TRAINING) -> None:
    """Both of the training's Pods still run, never restarted: nothing a fill job or a fault did reached them."""
    for rank in (0, 1):
        pod = node.get("pod", "-n", NS, f"{name}-{rank}")
        assert pod["status"]["phase"] == "Running", (pod["metadata"]["name"], pod["status"])
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def test_a_fill_job_from_the_examples_runs_in_a_real_trainings_bubbles_to_succeeded(cluster: Cluster,
                                                                                  trainings: Trainings) -> None:
    node = cluster.node
    with explained(cluster):
        fj = fill_job("image-classification", 300)  # the example's 2,000 steps, cut for CI's time on 2 cores
        # Volumes of the job's own, as the kubelet mounts them: a ConfigMap (the Pod would not start without it, it
        # is not optional), scratch space, and its checkpoint on a claim of a WaitForFirstConsumer StorageClass (as
        # most clouds' default is: bound only once the scheduler has seen the Pod, which nodeName would skip) whose
        # volume is a directory of the node's, owned by root: the job writes there as the agent's group (fsGroup).
        pv_dir = cluster.out_dir.parent / "pv-checkpoints"
        pv_dir.mkdir(parents=True, exist_ok=True)
        node.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "job-config", "namespace": NS},
                    "data": {"labels.txt": "cat\ndog\n"}},
                   {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "node-local"},
                    "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"},
                   {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "checkpoints"},
                    "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                             "storageClassName": "node-local", "persistentVolumeReclaimPolicy": "Retain",
                             "local": {"path": str(pv_dir)}, "nodeAffinity": {"required": {"nodeSelectorTerms": [
                                 {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                        "values": [node.name]}]}]}}}},
                   {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": {"name": "checkpoints", "namespace": NS},
                    "spec": {"storageClassName": "node-local", "accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": "1Gi"}}}})
        fj["spec"]["volumes"] = [
            {"name": "config", "mountPath": "/etc/job", "readOnly": True, "configMap": {"name": "job-config"}},
            {"name": "scratch", "mountPath": "/scratch", "emptyDir": {"sizeLimit": "64Mi"}}]
        fj["spec"]["checkpoint"] = {"path": "/checkpoints/image-classification", "claimName": "checkpoints"}
        node.apply(fj)
        seen: list[str] = []
        shown: list[str] = []

        def show(obj: dict[str, Any]) -> None:
            if obj.get("status", {}).get("phase") == "Running" and not shown:
                shown.append(node.kubectl("get", "fj", "-n", NS).stdout)

        t0 = time.monotonic()
        obj = wait_phase(node, "image-classification", {"Succeeded", "Failed"}, 600, seen, show)
        cluster.timeline["FillJob applied to Succeeded (300 steps)"] = time.monotonic() - t0
        assert obj["status"]["phase"] == "Succeeded", obj["status"]
        assert seen[0] in ("Queued", "Placed") and "Running" in seen, seen
        a = obj["status"]["assignment"]
        assert a["node"] == node.name and a["training"] == TRAINING
        assert obj["status"]["progress"]["stepsDone"] == 300
        assert obj["status"]["recoveredFlops"] > 0
        # The process exits once its last step is reported: its Pod ends a moment after the FillJob.
        pod = wait_for(f"the fill Pod {a['pod']} to end", lambda: (
            p if (p := node.get("pod", "-n", NS, a["pod"]))["status"]["phase"] in ("Succeeded", "Failed") else None),
            120)
        assert pod["spec"]["nodeName"] == node.name and pod["status"]["phase"] == "Succeeded", pod["status"]
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["config"] == "/etc/job" and mounts["scratch"] == "/scratch", mounts
        assert node.get("pvc", "-n", NS, "checkpoints")["status"]["phase"] == "Bound"
        assert (pv_dir / "state.bin").stat().st_size > 0  # the job's checkpoint, written as it stopped
        if shown:  # progress and ETA as `kubectl get fj` prints them while it runs
            header = shown[0].splitlines()[0]
            assert "PROGRESS" in header and "ETA" in header, shown[0]
        reasons = {e["reason"] for e in node.get("events", "-n", NS)["items"]
                   if e["involvedObject"].get("name") == "image-classification"}
        assert {"Placed", "Succeeded"} <= reasons or {"Placed", "Finished"} <= reasons, reasons
        # Recovered FLOPs where the dashboard reads them: the operator's and the agent's metrics.
        op, agent = pod_of(node, "operator"), pod_of(node, "agent")
        op_metrics = wait_for("the operator's recovered FLOPs", lambda: (
            m if (m := scrape(op["status"]["podIP"], 8080)).get("bubbles_operator_recovered_flops", 0) > 0 else None),
            60)
        agent_metrics = scrape(agent["status"]["podIP"], 9400)
        # The chart leaves the agent's own budget at 1%: the PipelineTraining's 25% came with the assignment.
        assert agent_metrics["bubbles_slowdown_budget"] == 0.25, agent_metrics
        assert agent_metrics.get("bubbles_recovered_flops_total", agent_metrics.get("bubbles_recovered_flops", 0)) > 0
        assert op_metrics["bubbles_operator_recovered_flops"] > 0
        training_untouched(node)
        print(json.dumps({"phases": seen, "timeline": cluster.timeline}, indent=1))


def test_deleting_the_agent_pod_mid_fill_requeues_or_resumes_and_the_training_goes_on(cluster: Cluster,
                                                                                      trainings: Trainings) -> None:
    node = cluster.node
    with explained(cluster):
        obj = run_through_a_replaced_pod(cluster, "agent-fault", "agent", STEPS_THROUGH_AN_AGENT_FAULT)
        assert obj["status"]["phase"] == "Succeeded", obj["status"]
        assert obj["status"]["progress"]["stepsDone"] == STEPS_THROUGH_AN_AGENT_FAULT
        training_untouched(node)


def pod_of_or_none(node: RealNode, component: str) -> dict[str, Any] | None:
    try:
        return pod_of(node, component)
    except AssertionError:
        return None


# Steps of the FillJobs that live through a replaced agent or operator Pod: enough to outlast the replacement. On the
# 2-core VM (2026-11-24) the example job did 30-40 steps/s, and a new operator Pod was Ready 11 s after the old one's
# deletion, its status saying 423 steps; a new agent Pod took 22 s (the job, whose process went with it, at 117).
STEPS_THROUGH_A_FAULT = 1500
# The job's process goes with the agent Pod, deleted as soon as the job runs (a few dozen steps in), so it cannot end
# before the fault: fewer steps suffice, and the rest run after the new agent is Ready.
STEPS_THROUGH_AN_AGENT_FAULT = 600


def run_through_a_replaced_pod(cluster: Cluster, job: str, component: str, steps: int) -> dict[str, Any]:
    """A FillJob of ``steps``, and once it runs the bubbles Pod of ``component`` deleted: wait for its controller's
    replacement to be Ready, then for the job to end. Returns the FillJob; the timeline gets how long each part took
    and how far the job was when the new Pod was Ready."""
    node = cluster.node
    node.apply(fill_job(job, steps))
    t0 = time.monotonic()
    wait_phase(node, job, {"Running"}, 300)
    old = pod_of(node, component)["metadata"]["name"]
    node.kubectl("delete", "pod", "-n", SYSTEM, old, "--wait=false")
    t1 = time.monotonic()
    if component == "operator":
        # The kubelet's SIGTERM ends the operator within seconds (not the grace period's SIGKILL, 30 s on): a rollout
        # does not wait for it, nor the next replica for its Lease to expire. Timed to its container's end (or the
        # Pod gone, when that is seen first), not to the Pod gone alone: after the container, the 1.20 kubelet
        # deletes the Pod at its status manager's next 10 s sync once the volumes are down (15.5 s once, 2026-11-29,
        # of which the operator's stop was 6).
        def stopped() -> dict[str, Any] | None:
            r = node.kubectl("get", "pod", "-n", SYSTEM, old, "-o", "json", check=False)
            if r.returncode != 0:
                return {"gone": True}
            ended = [c["state"]["terminated"] for c in json.loads(r.stdout)["status"].get("containerStatuses", [])
                     if "terminated" in c.get("state", {})]
            return ended[0] if ended else None

        end = wait_for(f"the old {component} Pod's container to end", stopped, 60, 0.5)
        took = time.monotonic() - t1
        cluster.timeline["operator Pod deleted to its container's end (s)"] = round(took, 1)
        assert took < 15, f"the operator took {took:.1f} s to stop on SIGTERM"
        assert end.get("exitCode") != 137, f"the operator was SIGKILLed: {end}"
        wait_for(f"the old {component} Pod gone", lambda: node.kubectl(
            "get", "pod", "-n", SYSTEM, old, check=False).returncode != 0, 60)
        cluster.timeline["operator Pod deleted to gone (s)"] = round(time.monotonic() - t1, 1)
    wait_for(f"a new {component} Pod", lambda: (
        p if (p := pod_of_or_none(node, component)) and p["metadata"]["name"] != old
        and all(c.get("ready") for c in p["status"].get("containerStatuses", [])) else None), 180)
    t2 = time.monotonic()
    # As the FillJob's status says (written by the operator: stale while no operator runs). Recorded, not asserted:
    # the job going on to the end while the operator is away is a pass too, the agent drives it.
    done_then = (fill_job_obj(node, job).get("status", {}).get("progress") or {}).get("stepsDone", 0)
    obj = wait_phase(node, job, {"Succeeded", "Failed"}, 600)
    cluster.timeline[f"{component} Pod replaced: applied to Running, deleted to new Ready, then to the end "
                     f"({steps} steps; done when Ready)"] = [round(t1 - t0, 1), round(t2 - t1, 1),
                                                              round(time.monotonic() - t2, 1), done_then]
    return obj


def test_a_new_operator_pod_picks_up_without_running_anything_twice(cluster: Cluster, trainings: Trainings) -> None:
    node = cluster.node
    with explained(cluster):
        obj = run_through_a_replaced_pod(cluster, "operator-fault", "operator", STEPS_THROUGH_A_FAULT)
        assert obj["status"]["phase"] == "Succeeded", obj["status"]
        assert obj["status"]["counters"]["placements"] == 1 and obj["status"]["restarts"] == 0, obj["status"]
        fill_pods = [p["metadata"]["name"] for p in node.get("pods", "-n", NS)["items"]
                     if p["metadata"]["name"].startswith("fj-operator-fault-")]
        assert fill_pods == ["fj-operator-fault-a0"], fill_pods
        training_untouched(node)


def test_deleting_a_running_fill_job_removes_its_pod(cluster: Cluster, trainings: Trainings) -> None:
    node = cluster.node
    with explained(cluster):
        node.apply(fill_job("deleted-mid-run", 1_000_000))
        obj = wait_phase(node, "deleted-mid-run", {"Running"}, 300)
        pod = obj["status"]["assignment"]["pod"]
        t0 = time.monotonic()
        node.kubectl("delete", "fj", "-n", NS, "deleted-mid-run", "--timeout=120s")
        wait_for(f"the fill Pod {pod} to be gone", lambda: pod not in {
            p["metadata"]["name"] for p in node.get("pods", "-n", NS)["items"]}, 120)
        cluster.timeline["FillJob deleted to its Pod gone"] = time.monotonic() - t0
        training_untouched(node)


def test_the_trainings_loss_is_bit_identical_to_a_run_without_bubbles_and_its_slowdown_is_reported(
        cluster: Cluster, trainings: Trainings) -> None:
    node = cluster.node
    with explained(cluster):
        status = node.get("pt", "-n", NS, TRAINING)["status"]
        assert status.get("iterationSeconds", 0) > 0 and "slowdown" in status and "slowdownText" in status, status
        (trainings.harvest_out / "stop").touch()
        for name in (TRAINING, REFERENCE):
            wait_for(f"{name}'s Pods to complete", lambda name=name: all(
                node.get("pod", "-n", NS, f"{name}-{r}")["status"]["phase"] == "Succeeded" for r in (0, 1)), 600, 2)
        for rank in (0, 1):
            harvest = trainings.record(node, TRAINING, rank)
            reference = trainings.record(node, REFERENCE, rank)
            assert harvest["hook"] and not reference["hook"]
            n = len(reference["losses"])
            assert n == REFERENCE_ITERATIONS + 7 and len(harvest["losses"]) > n, (n, len(harvest["losses"]))
            assert harvest["losses"][:n] == reference["losses"], f"rank {rank}: the losses differ"
            assert harvest["stats"]["bubbles_signalled"] > 0 and not harvest["stats"]["disabled"]
        print(json.dumps({"timeline": cluster.timeline, "harvest_iterations": len(harvest["losses"])}, indent=1))


TP_TRAINING = "llama-tp"  # one Pod: 2 stages x 2 model-parallel ranks (4 processes), every rank its own GPU key


def test_a_training_pod_with_two_ranks_of_a_stage_has_both_ranks_filled(cluster: Cluster) -> None:
    """After the main training has stopped (the cores are free): a training Pod that runs 2 stages x 2 model-parallel
    ranks under torchrun, as a node of a tensor-parallel training does. Every rank's hook reports its own GPU, the
    PipelineTraining's status lists the four, and two FillJobs pinned to stage 1 run one on each of its ranks."""
    node = cluster.node
    pod = training_pod(0, "", 100_000, name=TP_TRAINING)
    pod["metadata"]["name"] = TP_TRAINING
    (c,) = pod["spec"]["containers"]
    train = c["command"][3:]  # after "python -m bubbles.demo.train"
    c["command"] = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                    "-m", "bubbles.demo.train", "--tp", "2", *train]
    c["env"] = [e for e in c["env"] if e["name"] not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                          "MASTER_ADDR", "GLOO_SOCKET_IFNAME")]
    pt = yaml.safe_load((ROOT / "examples" / "cluster" / "pipelinetraining.yaml").read_text())
    pt["metadata"].update(name=TP_TRAINING, namespace=NS)
    pt["metadata"].setdefault("labels", {})["bubbles-test"] = "tp"
    pt["spec"]["selector"] = {"matchLabels": {"app": TP_TRAINING}}
    pt["spec"]["slowdownBudget"] = 0.25
    with explained(cluster):
        node.apply(pod, pt)
        t0 = time.monotonic()
        wait_for(f"{TP_TRAINING}'s four GPUs to be profiled", lambda: (
            st if (st := node.get("pt", "-n", NS, TP_TRAINING).get("status", {})).get("gpus") == 4
            and condition(node, "pt", TP_TRAINING, "Profiled") else None), 600, 2)
        cluster.timeline["a Pod of 2 stages x 2 ranks to Profiled"] = time.monotonic() - t0
        stages = node.get("pt", "-n", NS, TP_TRAINING)["status"]["stages"]
        assert [(st["stage"], sorted(g["rank"] for g in st["gpus"])) for st in stages] == [(0, [0, 1]), (1, [0, 1])]
        assert {g["pod"] for st in stages for g in st["gpus"]} == {TP_TRAINING}
        jobs = []
        for i in range(2):
            fj = fill_job(f"tp-rank-fill-{i}", 100)
            fj["spec"]["stage"] = 1
            fj["spec"]["trainingSelector"] = {"matchLabels": {"bubbles-test": "tp"}}
            jobs.append(fj)
        node.apply(*jobs)
        done = [wait_phase(node, f"tp-rank-fill-{i}", {"Succeeded", "Failed"}, 600) for i in range(2)]
        cluster.timeline["two FillJobs on the two ranks of stage 1 to Succeeded"] = time.monotonic() - t0
        for obj in done:
            assert obj["status"]["phase"] == "Succeeded", obj["status"]
            assert obj["status"]["progress"]["stepsDone"] == 100
        placed = sorted(tuple(obj["status"]["assignment"]["ranks"]) for obj in done)
        assert placed == [(0,), (1,)], placed  # one job on each GPU of the stage
        assert {obj["status"]["assignment"]["stage"] for obj in done} == {1}
        out = out_dir(node, TP_TRAINING)
        (out / "stop").touch()
        wait_for(f"{TP_TRAINING} to complete", lambda: node.get("pod", "-n", NS, TP_TRAINING)["status"]["phase"]
                 == "Succeeded", 600, 2)
        records = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
        assert sorted((r["stage"], r["stage_rank"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(r["stats"]["bubbles_signalled"] > 0 and not r["stats"]["disabled"] for r in records)
        assert len({tuple(r["losses"]) for r in records if r["stage"] == 1}) == 1  # the model-parallel ranks agree


def test_every_pod_in_the_trainings_namespace_meets_pod_security(cluster: Cluster) -> None:
    """The namespace is labelled for Pod Security baseline (enforced) and restricted (warned of); 1.20's API server
    has no Pod Security admission, so every Pod the run left there (the trainings', the fill Pods the operator
    made, the tests' own) is checked against the standard as written: every one meets baseline, and every fill Pod
    restricted. None mounts a hostPath, none runs as the agent's UID but the tests' own probes."""
    from bubbles.operator import podsecurity

    node = cluster.node
    pods = node.get("pods", "-n", NS)["items"]
    fill = [p for p in pods if p["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "fill-job"]
    trainings = [p for p in pods if p["metadata"]["name"].startswith((TRAINING, REFERENCE, TP_TRAINING))]
    assert fill and len(trainings) >= 4, [p["metadata"]["name"] for p in pods]
    below = {p["metadata"]["name"]: podsecurity.check(p).summary() for p in pods
             if not podsecurity.check(p).meets("baseline")}
    assert not below, below
    not_restricted = {p["metadata"]["name"]: podsecurity.check(p).summary() for p in fill
                      if not podsecurity.check(p).meets("restricted")}
    assert not not_restricted, not_restricted
    for p in (*fill, *trainings):
        assert not [v for v in p["spec"].get("volumes", []) if "hostPath" in v], p["metadata"]["name"]
        assert p["spec"]["securityContext"].get("runAsUser") != UID, p["metadata"]["name"]
    assert {p["spec"]["securityContext"]["runAsUser"] for p in fill} == {FILL_UID}


def test_a_real_prometheus_scrapes_the_pods_and_every_dashboard_query_has_data(cluster: Cluster) -> None:
    """Last: the whole run's metrics, from the Pods the chart made (replaced ones included), through every query of
    the committed dashboard."""
    import sys

    if isinstance(cluster.prometheus, str):
        pytest.skip(f"PROMETHEUS TIER SKIPPED: {cluster.prometheus}")
    sys.path.insert(0, str(ROOT / "tools"))
    import dashboard_preview
    from helpers.prometheus import RATE_INTERVAL, SCRAPE_S

    prom = cluster.prometheus
    with explained(cluster):
        def both_up() -> dict[str, str] | None:
            h: dict[str, str] = prom.targets_up()
            return h if sum(v == "up" for v in h.values()) >= 2 else None

        health = wait_for("Prometheus to scrape the operator and the agent", both_up, 60)
        dashboard = json.loads((ROOT / "helm" / "bubbles" / "dashboards" / "bubbles.json").read_text())
        end = time.time()
        empty = []
        for _panel, _target, expr in dashboard_preview.panel_queries(dashboard, RATE_INTERVAL):
            series = dashboard_preview.query_range(prom.url, expr, cluster.scraped_from, end, SCRAPE_S)
            if not any(s.points for s in series):
                empty.append(expr)
        assert not empty, f"dashboard queries with no data over the run: {empty} (targets: {health})"
        flops = dashboard_preview.query_range(
            prom.url, f'sum by (node) (rate(bubbles_recovered_flops_total{{mode="harvest"}}[{RATE_INTERVAL}]))',
            cluster.scraped_from, end, SCRAPE_S)
        assert any(v > 0 for s in flops for _, v in s.points), [(s.labels, s.points[-3:]) for s in flops]
        assert {s.labels.get("node") for s in flops} == {cluster.node.name}, [s.labels for s in flops]
