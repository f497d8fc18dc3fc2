"""The Helm chart, rendered by the real Helm engine (Helm's Go SDK, ``helm-python-sdk``; a dev dependency only):
lint, renders for the main combinations of values, bad values refused with the chart's message, the chart's
flags accepted by the real command-line parsers, its generated credentials working on a real gRPC channel, and its
manifests created on a real kube-apiserver where its operator is granted exactly bubbles.operator.rbac.RULES.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart")

from helpers.helm import CHART, NS, RELEASE, ROOT, container, helm, notes, one, render

from bubbles.operator.rbac import RULES


def test_the_chart_lints_clean_and_its_crds_are_the_generated_ones() -> None:
    result = helm.lint(str(CHART), {}, namespace=NS, strict=True)
    assert result["errors"] == [] and all(m["severity"] <= 1 for m in result["messages"]), result
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart_crds == sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    drifted = [n for n in chart_crds if not filecmp.cmp(CHART / "crds" / n, ROOT / "crds" / n, shallow=False)]
    assert not drifted, f"helm/bubbles/crds/{drifted} differ from crds/: copy crds/*.yaml into the chart"


def test_the_default_install_renders_what_a_cluster_needs_and_grants_exactly_the_operators_rules() -> None:
    docs = render()
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["CSIDriver", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Deployment",
                     "PriorityClass", "Role", "RoleBinding", "Secret", "Service", "ServiceAccount"]
    for d in docs:
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding", "PriorityClass", "CSIDriver"):
            assert d["metadata"]["namespace"] == NS, d["metadata"]
    granted = {(g, r, v) for d in docs if d["kind"] in ("ClusterRole", "Role") for rule in d["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    wanted = {(g, r, v) for rule in RULES for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == wanted
    assert one(docs, "Role")["metadata"]["namespace"] == NS  # Leases only in the release namespace
    agent = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert agent["hostPID"] is True and "hostIPC" not in agent and agent["automountServiceAccountToken"] is False
    assert agent["securityContext"]["runAsNonRoot"] is True
    # nodeAccess csi and the device plugin (the defaults): the agent is a CSI node plugin, privileged as they all are.
    assert agent["containers"][0]["securityContext"]["privileged"] is True
    # Neither: unprivileged, no capabilities, as before issue 36.
    old = render({"nodeAccess": "hostPath", "agent": {"devicePlugin": {"enabled": False}},
                  "operator": {"fillGpuAccess": "envvar"}})
    assert not [d for d in old if d["kind"] == "CSIDriver"]
    c = container(old, "DaemonSet")
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert "command" not in c
    terms = agent["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["key"] for t in terms] == ["nvidia.com/gpu.present",
                                                                 "feature.node.kubernetes.io/pci-10de.present"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in agent["tolerations"]
    labels = one(docs, "DaemonSet", "-agent")["spec"]["template"]["metadata"]["labels"]
    op_args = container(docs, "Deployment")["args"]
    selector = next(a for a in op_args if a.startswith("--agent-selector=")).split("=", 1)[1]
    for pair in selector.split(","):  # the operator finds the agents by exactly the labels their Pods carry
        key, value = pair.split("=")
        assert labels[key] == value
    assert "--all-namespaces" in op_args and "--leader-election" in op_args


def parse_operator(args: list[str]) -> argparse.Namespace:
    from bubbles.operator.cli import add_arguments

    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    assert args[0] == "operator"
    return p.parse_args([a.replace("$(POD_NAME)", "pod-0") for a in args[1:]])


def parse_agent(args: list[str]) -> argparse.Namespace:
    from bubbles.agent.cli import add_arguments

    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    assert args[0] == "agent"
    return p.parse_args(args[1:])


@pytest.mark.parametrize("values", [{}, {"agent": {"isolation": "mps", "initTimeoutSeconds": 1800},
                                               "grpc": {"token": True}},
                                    {"operator": {"replicas": 3, "watchNamespaces": ["ml", "research"],
                                                  "fillPodTolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                                          "effect": "NoExecute"}],
                                                  "fillRuntimeClassName": "nvidia"}}])
def test_every_flag_the_chart_passes_is_one_the_commands_accept(values: dict[str, Any], tmp_path: Path) -> None:
    from bubbles.agent.config import load_settings

    docs = render(values)
    op = parse_operator(container(docs, "Deployment")["args"])
    # The mounted files and the kubelet's directory, here: the agent checks that they exist before it starts.
    args = []
    for a in container(docs, "DaemonSet")["args"]:
        if "=/etc/bubbles/" in a:
            flag, path = a.split("=", 1)
            local = tmp_path / Path(path).name
            local.write_text("x")
            a = f"{flag}={local}"
        args.append(a.replace("=/var/lib/kubelet", f"={tmp_path}"))
    ag = parse_agent(args)
    settings = load_settings(vars(ag) | {"node": "node-1"}, environ={})
    assert settings.cluster is not None and settings.config.metrics
    assert settings.config.isolation.mode == values.get("agent", {}).get("isolation", "contexts")
    assert settings.config.init_timeout_s == values.get("agent", {}).get("initTimeoutSeconds", 600)
    assert (settings.cluster.token_file is not None) == bool(values.get("grpc", {}).get("token"))
    if values.get("operator", {}).get("watchNamespaces"):
        assert op.namespace == ["ml", "research", NS]  # the agents' namespace is watched too
    assert str(op.agent_port) == settings.cluster.listen.rsplit(":", 1)[1]
    assert op.fill_cuda_context_mib == settings.config.cuda_context_mib == 512  # one value for both sides
    assert json.loads(op.fill_pod_tolerations) == values.get("operator", {}).get("fillPodTolerations", [])
    assert op.fill_runtime_class == (values.get("operator", {}).get("fillRuntimeClassName") or None)
    # The fill Pods' settings, as the operator builds them from those flags; the agents serve what they ask for.
    from bubbles.operator.fillpod_flags import fill_pod_settings

    fill = fill_pod_settings(op)
    assert not isinstance(fill, str), fill
    assert (fill.node_access, fill.gpu_access) == ("csi", "devicePlugin")
    assert settings.cluster.csi is not None and settings.cluster.device_plugin is not None
    assert settings.cluster.device_plugin.directory == tmp_path / "device-plugins"


def test_mps_gives_the_agent_and_the_fill_pods_one_shm_directory_and_the_pipe_directory_without_host_ipc() -> None:
    """MPS keeps its shared state in /dev/shm: the agent (its daemon) and every client mount one node directory there
    (host IPC would share the whole node's IPC instead). The operator is told both paths, so its fill Pods join."""
    docs = render({"agent": {"isolation": "mps", "mps": {"pipeDir": "/run/nvidia-mps", "shmDir": "/run/mps-shm",
                                                         "threadPercentage": 30}}})
    spec = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert "hostIPC" not in spec
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = [m["name"] for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm == ["mps-shm"] and volumes["mps-shm"]["hostPath"]["path"] == "/run/mps-shm"
    assert {"--mps-pipe-dir=/run/nvidia-mps", "--mps-thread-percentage=30"} <= set(spec["containers"][0]["args"])
    # The init container gives the agent's UID both directories; the /dev/shm one private to it.
    (init,) = spec["initContainers"]
    assert {"755:/run/nvidia-mps", "700:/dev/shm"} <= set(init["command"])
    assert {m["name"] for m in init["volumeMounts"]} >= {"mps-pipe", "mps-shm"}
    op = parse_operator(container(docs, "Deployment")["args"])
    assert (op.fill_mps_pipe_dir, op.fill_mps_shm_dir, op.fill_mps_thread_percentage) == \
        ("/run/nvidia-mps", "/run/mps-shm", 30)
    assert parse_operator(container(render({"agent": {"isolation": "mps"}}), "Deployment")["args"]) \
        .fill_mps_shm_dir == "/dev/shm/bubbles-mps"  # the chart's default, also the operator's
    plain = parse_operator(container(render(), "Deployment")["args"])  # contexts: fill Pods are not MPS clients
    plain_spec = one(render(), "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert plain.fill_mps_pipe_dir is None and plain.fill_mps_shm_dir is None
    assert "mps-shm" not in {v["name"] for v in plain_spec["volumes"]}


def test_service_monitors_follow_the_switch_and_a_custom_namespace_is_used_throughout() -> None:
    assert not [d for d in render() if d["kind"] == "ServiceMonitor"]  # auto, and no Prometheus Operator API here
    docs = render({"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}, namespace="obs")
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2 and all(m["metadata"]["labels"]["release"] == "prom" for m in monitors)
    assert all(m["metadata"]["namespace"] == "obs" for m in monitors)
    assert "ServiceMonitors created" in notes({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert "no ServiceMonitor" in notes()


def test_cert_manager_mode_issues_certificates_instead_of_generating_them() -> None:
    docs = render({"grpc": {"tls": "certManager", "certManager": {"skipApiCheck": True}}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    assert set(certs) == {"chart-bubbles-grpc-ca", "chart-bubbles-agent-tls", "chart-bubbles-operator-tls"}
    assert certs["chart-bubbles-agent-tls"]["spec"]["dnsNames"] == ["bubbles-agent"]


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"replicas": 2, "leaderElection": False}}, "Set operator.leaderElection=true"),
    ({"agent": {"isolation": "mps", "runAsUser": 0}}, "Set agent.runAsUser"),
    ({"agent": {"isolation": "none", "allowUnisolated": True}}, "choose isolation contexts or mps"),
    ({"agent": {"healthPort": 7070}}, "must differ"),
    ({"grpc": {"tls": "certManager"}}, "install cert-manager, or use grpc.tls=generate"),
    ({"agent": {"isolation": "magic"}}, "/agent/isolation"),
    ({"agent": {"port": 0}}, "/agent/port"),
    ({"operator": {"replicas": "two"}}, "/operator/replicas"),
    ({"agent": {"slowdownBudget": 5}}, "/agent/slowdownBudget"),
    ({"agnet": {}}, "agnet"),
    ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0"),
    ({"agent": {"extraEnv": {"A": "b"}}}, "/agent/extraEnv"),
    ({"agent": {"runDir": "run/bubbles"}}, "/agent/runDir"),
    ({"agent": {"mps": {"threadPercentage": 0}}}, "/agent/mps/threadPercentage"),
    ({"agent": {"initTimeoutSeconds": 0}}, "/agent/initTimeoutSeconds"),
    ({"agent": {"cudaContextMiB": -1}}, "/agent/cudaContextMiB"),
    ({"agent": {"mps": {"daemonResources": "lots"}}}, "/agent/mps/daemonResources"),
    ({"operator": {"fillPodStartTimeoutSeconds": 0}}, "/operator/fillPodStartTimeoutSeconds"),
    ({"operator": {"fullPassInterval": 0}}, "/operator/fullPassInterval"),
    ({"operator": {"fullPassInterval": "30s"}}, "/operator/fullPassInterval"),
    ({"operator": {"fillPodStartTimeoutSeconds": 90000}}, "/operator/fillPodStartTimeoutSeconds"),
    ({"operator": {"fillPodTolerations": [{"key": "a", "operator": "Maybe"}]}}, "/operator/fillPodTolerations/0"),
    ({"operator": {"fillPodTolerations": [{"key": "a", "effects": "NoExecute"}]}}, "/operator/fillPodTolerations/0"),
    ({"operator": {"fillRuntimeClassName": "NVIDIA"}}, "/operator/fillRuntimeClassName"),
    ({"agent": {"mps": {"shmSize": "1Gi"}}}, "shmSize"),  # gone: the Pods share agent.mps.shmDir
    ({"agent": {"mps": {"shmDir": "/"}}}, "/agent/mps/shmDir"),
    ({"agent": {"mps": {"shmDir": "dev/shm"}}}, "/agent/mps/shmDir"),
    ({"agent": {"isolation": "mps", "mps": {"shmDir": "/dev/shm"}}}, "the node's own /dev/shm or system files"),
    ({"agent": {"isolation": "mps", "mps": {"shmDir": "/sys/x"}}}, "the node's own /dev/shm or system files"),
    ({"agent": {"isolation": "mps", "mps": {"shmDir": "/run/x/../y"}}}, "without '.' or '..' parts"),
    ({"agent": {"isolation": "mps", "mps": {"shmDir": "/mps"}}}, "at least two levels deep"),
    ({"agent": {"isolation": "mps", "mps": {"shmDir": "/tmp/nvidia-mps/shm"}}}, "apart from agent.mps.pipeDir"),
    ({"agent": {"isolation": "mps", "runDir": "/run/b", "mps": {"shmDir": "/run/b"}}}, "apart from agent.runDir"),
    ({"agent": {"csi": {"enabled": "yes"}}}, "/agent/csi/enabled"),
    ({"agent": {"csi": {"enable": True}}}, "enable"),
    ({"agent": {"csi": {"kubeletDir": "var/lib/kubelet"}}}, "/agent/csi/kubeletDir"),
    ({"agent": {"csi": {"kubeletDir": "/var/lib/kubelet/"}}}, "/agent/csi/kubeletDir"),
    ({"agent": {"csi": {"kubeletDir": "/var/lib/../kubelet"}}}, "/agent/csi/kubeletDir"),
    ({"agent": {"csi": {"kubeletDir": "/var//lib/kubelet"}}}, "/agent/csi/kubeletDir"),
    ({"agent": {"csi": {"kubeletDir": "/" + "k" * 65}}}, "/agent/csi/kubeletDir"),  # the sockets would not fit
    ({"nodeAccess": "CSI"}, "/nodeAccess"),
    ({"nodeAccess": "hostpath"}, "/nodeAccess"),
    ({"operator": {"fillGpuAccess": "cdi"}}, "/operator/fillGpuAccess"),
    ({"operator": {"fillRunAsUser": 0}}, "/operator/fillRunAsUser"),
    ({"operator": {"fillRunAsUser": "nobody"}}, "/operator/fillRunAsUser"),
    ({"agent": {"devicePlugin": {"strategy": "nvidia"}}}, "/agent/devicePlugin/strategy"),
    ({"agent": {"devicePlugin": {"fillSlots": 0}}}, "/agent/devicePlugin/fillSlots"),
    ({"agent": {"devicePlugin": {"fillSlots": 65}}}, "/agent/devicePlugin/fillSlots"),
    ({"agent": {"devicePlugin": {"enabled": "yes"}}}, "/agent/devicePlugin/enabled"),
    ({"agent": {"devicePlugin": {"slots": 2}}}, "slots"),
    ({"agent": {"devicePlugin": {"enabled": False}}}, "Set agent.devicePlugin.enabled=true, or "
                                                       "operator.fillGpuAccess=envvar"),
    ({"nodeAccess": "hostPath", "operator": {"fillRunAsUser": 2000}}, "Leave operator.fillRunAsUser empty, or set "
                                                                      "nodeAccess=csi"),
    ({"agent": {"isolation": "mps"}, "operator": {"fillRunAsUser": 2000}}, "an MPS server serves one UID"),
])
def test_contradictory_or_malformed_values_are_refused_with_what_to_change(values: dict[str, Any],
                                                                          message: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        render(values)
    assert message in str(info.value)


def test_node_access_gpu_access_and_the_fill_uid_reach_the_operator() -> None:
    """nodeAccess, operator.fillGpuAccess and operator.fillRunAsUser become the operator's flags: csi gives fill
    Pods a UID of their own (65532, or under MPS the agents', the trainings' UID, which one MPS server serves) and no
    hostPath settings; hostPath gives them the agents' run directory and UID, as before."""
    def op_args(values: dict[str, Any]) -> argparse.Namespace:
        return parse_operator(container(render(values), "Deployment")["args"])

    csi = op_args({})
    assert (csi.node_access, csi.fill_gpu_access, csi.fill_run_as_user, csi.fill_uid) == (
        "csi", "devicePlugin", 65532, None)
    assert op_args({"operator": {"fillRunAsUser": 4000}}).fill_run_as_user == 4000
    mps = op_args({"agent": {"isolation": "mps", "runAsUser": 1234, "runAsGroup": 1234}})
    assert mps.fill_run_as_user == 1234 and mps.fill_mps_pipe_dir == "/tmp/nvidia-mps"
    assert op_args({"agent": {"isolation": "mps", "runAsUser": 1234}, "operator": {"fillRunAsUser": 1234}}) \
        .fill_run_as_user == 1234
    assert csi.full_pass_interval == 30 and op_args({"operator": {"fullPassInterval": 5}}).full_pass_interval == 5
    host = op_args({"nodeAccess": "hostPath", "operator": {"fillGpuAccess": "envvar"}})
    assert (host.node_access, host.fill_gpu_access, host.fill_run_as_user, host.fill_uid, host.fill_gid) == (
        "hostPath", "envvar", None, 1000, 1000)


def test_the_device_plugin_is_on_by_default_with_the_kubelets_directory_and_a_strategy_by_kubernetes_version(
        tmp_path: Path) -> None:
    """agent.devicePlugin: the agent serves bubbles.dev/gpu-<index> through <kubeletDir>/device-plugins (inside the
    kubelet's directory the CSI plugin mounts already; mounted by itself where the CSI plugin is off, with
    CAP_DAC_OVERRIDE kept by setpriv to make its sockets there), fillSlots devices each, in the strategy asked
    for; auto is cdi from Kubernetes 1.29 (the kubelet passes CDI devices by default), else volume-mounts."""
    from bubbles.agent.config import load_settings

    c = container(render({"agent": {"devicePlugin": {"strategy": "cdi-annotations", "fillSlots": 7},
                                    "csi": {"kubeletDir": CSI_KUBELET_DIR}}}), "DaemonSet")
    assert {"--device-plugin", "--gpu-strategy=cdi-annotations", "--fill-slots=7",
            "--device-plugin-dir=/var/lib/kubelet/device-plugins",
            f"--pod-resources-socket={CSI_KUBELET_DIR}/pod-resources/kubelet.sock"} <= set(c["args"])
    # The kubelet fixes its device-plugins directory whatever its --root-dir: mounted by itself where the kubelet's
    # directory (mounted for CSI) does not hold it; pod-resources is under --root-dir, in that mount.
    assert {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"} in c["volumeMounts"]
    assert "pod-resources" not in {m["name"] for m in c["volumeMounts"]}
    inside = container(render({}), "DaemonSet")  # the default kubelet directory holds both
    assert not {"device-plugins", "pod-resources"} & {m["name"] for m in inside["volumeMounts"]}
    args = []
    for a in c["args"]:
        if "=/etc/bubbles/" in a:  # the mounted files, here: the agent checks that they exist
            flag, path = a.split("=", 1)
            (tmp_path / Path(path).name).write_text("x")
            a = f"{flag}={tmp_path / Path(path).name}"
        args.append(a.replace(f"={CSI_KUBELET_DIR}", f"={tmp_path}").replace(
            "=/var/lib/kubelet/device-plugins", f"={tmp_path}/device-plugins"))
    (tmp_path / "pod-resources").mkdir()
    dp = load_settings(vars(parse_agent(args)) | {"node": "n"}, environ={}).cluster.device_plugin  # type: ignore
    assert dp is not None and (dp.strategy, dp.fill_slots, dp.directory, dp.pod_resources_socket) == (
        "cdi-annotations", 7, tmp_path / "device-plugins", tmp_path / "pod-resources" / "kubelet.sock")
    # Without the CSI plugin: the device-plugins directory alone, and CAP_DAC_OVERRIDE alone kept.
    docs = render({"nodeAccess": "hostPath"})
    spec = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"} in c["volumeMounts"]
    assert {"name": "device-plugins", "hostPath": {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}} \
        in spec["volumes"]
    # The kubelet's PodResources socket, read-only: the device plugin's PreStartContainer check asks it.
    assert {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True} \
        in c["volumeMounts"]
    assert {"name": "pod-resources", "hostPath": {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}} \
        in spec["volumes"]
    assert c["securityContext"] == {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID", "SETPCAP",
                                                                              "DAC_OVERRIDE"]}}
    assert "--ambient-caps=-all,+dac_override" in c["command"] and "--reuid=1000" in c["command"]
    assert "privileged" not in c["securityContext"]
    # Off: no flags, no mount.
    off = container(render({"agent": {"devicePlugin": {"enabled": False}}, "operator": {"fillGpuAccess": "envvar"}}),
                    "DaemonSet")
    assert not [a for a in off["args"] if "device-plugin" in a or "gpu-strategy" in a]


def test_the_agent_takes_extra_volumes_and_mounts_and_refuses_a_mount_without_a_path() -> None:
    """agent.extraVolumes and agent.extraVolumeMounts go into the agent's Pod as given (a driver library the node
    keeps apart, say); a mount without an absolute mountPath is refused by the chart's schema, naming the field."""
    lib = {"name": "nvml", "hostPath": {"path": "/opt/nvml", "type": "Directory"}}
    mount = {"name": "nvml", "mountPath": "/opt/nvml", "readOnly": True}
    spec = one(render({"agent": {"extraVolumes": [lib], "extraVolumeMounts": [mount]}}), "DaemonSet",
               "-agent")["spec"]["template"]["spec"]
    assert lib in spec["volumes"] and mount in spec["containers"][0]["volumeMounts"]
    for bad in ({"extraVolumeMounts": [{"name": "nvml", "mountPath": "opt/nvml"}]},
                {"extraVolumeMounts": [{"name": "nvml"}]}, {"extraVolumes": [{"hostPath": {"path": "/x"}}]}):
        with pytest.raises(Exception, match="extraVolume"):
            render({"agent": bad})


@pytest.mark.parametrize(("version", "strategy"), [("v1.28.9", "volume-mounts"), ("v1.29.0", "cdi"),
                                                    ("v1.33.1-eks-1", "cdi"), ("v1.25.0", "volume-mounts")])
def test_the_auto_strategy_follows_the_clusters_kubernetes_version(tmp_path: Path, version: str,
                                                                   strategy: str) -> None:
    """The chart's own helper, asked with the version a cluster reports (helm render has one version of its own)."""
    chart = tmp_path / "bubbles"
    shutil.copytree(ROOT / "helm" / "bubbles", chart)
    (chart / "templates" / "zz-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\ndata:\n"
        "  strategy: {{ include \"bubbles.gpuStrategy\" (dict \"Values\" .Values \"Capabilities\" "
        f"(dict \"KubeVersion\" (dict \"Version\" \"{version}\"))) }}}}\n")
    out = helm.Chart.load(str(chart)).render({}, name="r", namespace="ns", is_install=True)
    probe = yaml.safe_load(next(v for k, v in out.items() if k.endswith("zz-probe.yaml")))
    assert probe["data"]["strategy"] == strategy
    out = helm.Chart.load(str(chart)).render({"agent": {"devicePlugin": {"strategy": "envvar"}}}, name="r",
                                             namespace="ns", is_install=True)
    assert yaml.safe_load(next(v for k, v in out.items() if k.endswith("zz-probe.yaml")))["data"]["strategy"] == \
        "envvar"


CSI_KUBELET_DIR = "/var/lib/k0s/kubelet"
# CAP_SYS_ADMIN, CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_FOWNER, CAP_KILL
CSI_CAPS = (1 << 21) | (1 << 1) | (1 << 0) | (1 << 3) | (1 << 5)


def test_csi_follows_node_access_and_on_makes_the_driver_and_a_privileged_plugin_as_the_agents_uid(
        tmp_path: Path) -> None:
    """nodeAccess csi (or agent.csi.enabled under hostPath): the CSIDriver object the plugin needs, and an agent
    container that can be a CSI node plugin: privileged (Bidirectional propagation needs it), the kubelet's directory
    at the same path with Bidirectional propagation, and its process dropped to agent.runAsUser by setpriv (the files
    it makes in the run directory stay the agent's UID's). Its flags are accepted by the agent's own parser and
    checks."""
    from bubbles.agent.config import load_settings

    off = render({"nodeAccess": "hostPath", "agent": {"devicePlugin": {"enabled": False}},
                  "operator": {"fillGpuAccess": "envvar"}})
    assert not [d for d in off if d["kind"] == "CSIDriver"]
    plain = container(off, "DaemonSet")
    assert "command" not in plain and not [a for a in plain["args"] if a.startswith(("--csi", "--kubelet-dir"))]
    assert "kubelet-dir" not in {m["name"] for m in plain["volumeMounts"]}

    assert one(render({"nodeAccess": "hostPath", "agent": {"csi": {"enabled": True}}}), "CSIDriver")
    docs = render({"agent": {"csi": {"kubeletDir": CSI_KUBELET_DIR}}})  # nodeAccess csi turns it on
    driver = one(docs, "CSIDriver")
    assert (driver["apiVersion"], driver["metadata"]["name"]) == ("storage.k8s.io/v1", "csi.bubbles.dev")
    assert "namespace" not in driver["metadata"]  # cluster-scoped
    assert driver["spec"] == {"attachRequired": False, "podInfoOnMount": True, "volumeLifecycleModes": ["Ephemeral"],
                              "fsGroupPolicy": "None"}
    spec = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsNonRoot": False,
                                    "readOnlyRootFilesystem": True}
    assert {"name": "kubelet-dir", "mountPath": CSI_KUBELET_DIR, "mountPropagation": "Bidirectional"} \
        in c["volumeMounts"]
    assert {"name": "kubelet-dir", "hostPath": {"path": CSI_KUBELET_DIR, "type": "Directory"}} in spec["volumes"]
    assert spec["initContainers"][0]["name"] == "own-dirs"  # the run directory is still given to the agent's UID
    # setpriv to the agent's UID, then the image's own entrypoint.
    entrypoint = next(line for line in (ROOT / "images" / "agent" / "Dockerfile").read_text().splitlines()
                      if line.startswith("ENTRYPOINT"))
    assert c["command"][0] == "setpriv" and c["command"][-2:] == ["--", *json.loads(entrypoint.split(" ", 1)[1])]
    assert {"--reuid=1000", "--regid=1000", "--clear-groups", "--no-new-privs"} <= set(c["command"])
    # The flags, as the agent parses and checks them (the kubelet's directory must exist: here, a local one).
    args = []
    for a in c["args"]:
        if "=/etc/bubbles/" in a:
            flag, path = a.split("=", 1)
            (tmp_path / Path(path).name).write_text("x")
            a = f"{flag}={tmp_path / Path(path).name}"
        args.append(a.replace(f"={CSI_KUBELET_DIR}", f"={tmp_path}"))
    assert "--csi" in args
    settings = load_settings(vars(parse_agent(args)) | {"node": "node-1"}, environ={})
    assert settings.cluster is not None and settings.cluster.csi is not None
    assert settings.cluster.csi.kubelet_dir == tmp_path
    # agent.runAsUser=0: root throughout, no setpriv.
    root = container(render({"agent": {"csi": {"enabled": True}, "runAsUser": 0, "runAsGroup": 0}}), "DaemonSet")
    assert "command" not in root and root["securityContext"]["privileged"] is True
    assert "--kubelet-dir=/var/lib/kubelet" in root["args"]


@pytest.mark.skipif(not shutil.which("setpriv") or os.geteuid() != 0, reason="needs root and util-linux's setpriv")
def test_the_csi_agents_setpriv_leaves_it_the_agents_uid_able_to_mount_in_the_kubelets_directory(
        tmp_path: Path) -> None:
    """The chart's setpriv command, run here as the privileged container starts it (as root): the process is
    agent.runAsUser with no supplementary groups and CAP_SYS_ADMIN and CAP_DAC_OVERRIDE only (effective, ambient:
    they survive the exec of the agent's Python); it makes a target in a root-owned 0750 directory (the kubelet's),
    bind-mounts a directory there and undoes it, and what it creates in the run directory is the agent's UID's."""
    c = container(render({"agent": {"csi": {"enabled": True}}}), "DaemonSet")
    wrapper = c["command"][:-1]
    pods = tmp_path / "kubelet" / "pods" / "uid-1"
    pods.mkdir(parents=True)
    for d in (pods, pods.parent, pods.parent.parent):
        d.chmod(0o750)
    run = tmp_path / "run"
    (run / "_pods" / "uid-1").mkdir(parents=True)
    for d in (run, run / "_pods", run / "_pods" / "uid-1"):
        os.chown(d, 1000, 1000)
    target = pods / "mount"
    script = (
        "import ctypes, json, os, signal, sys\n"
        "run, target = sys.argv[1], sys.argv[2]\n"
        "caps = {k: int(v, 16) for k, v in (l.split(':') for l in open('/proc/self/status') if l.startswith('Cap'))}\n"
        "open(os.path.join(run, 'made'), 'w').close()\n"
        "open(os.path.join(run, 'given'), 'w').close()\n"
        "os.chown(os.path.join(run, 'given'), 2000, 2000)\n"
        "os.utime(os.path.join(run, 'given'), ns=(1, 1))\n"
        "os.mkdir(target)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "rc = libc.mount(os.path.join(run, '_pods', 'uid-1').encode(), target.encode(), None, 0x1000, None)\n"
        "mounted = any(l.split(' ')[4] == target for l in open('/proc/self/mountinfo'))\n"
        "unmounted = libc.umount2(target.encode(), 8)\n"
        "os.rmdir(target)\n"
        "os.kill(int(sys.argv[3]), signal.SIGSTOP)\n"
        "os.kill(int(sys.argv[3]), signal.SIGCONT)\n"
        "print(json.dumps([os.getuid(), os.getgid(), os.getgroups(), caps, rc, mounted, unmounted]))\n")
    # A fill Pod's process runs as operator.fillRunAsUser, not the agent's UID: the watchdog must still stop it.
    fill = subprocess.Popen(["sleep", "60"], user=65532, group=65532)
    try:
        r = subprocess.run([*wrapper, sys.executable, "-I", "-c", script, str(run), str(target), str(fill.pid)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        uid, gid, groups, caps, rc, mounted, unmounted = json.loads(r.stdout)
    finally:
        fill.kill()
        fill.wait()
        if any(line.split(" ")[4] == str(target) for line in Path("/proc/self/mountinfo").read_text().splitlines()):
            subprocess.run(["umount", "-l", str(target)], check=False)
    assert (uid, gid, groups) == (1000, 1000, [])
    assert {k: v for k, v in caps.items() if k != "CapInh"} == {
        "CapPrm": CSI_CAPS, "CapEff": CSI_CAPS, "CapBnd": CSI_CAPS, "CapAmb": CSI_CAPS}, caps
    assert (rc, mounted, unmounted) == (0, True, 0)
    st = (run / "made").stat()
    assert (st.st_uid, st.st_gid) == (1000, 1000)
    given = (run / "given").stat()  # CAP_CHOWN: a socket given to a training Pod's UID
    assert (given.st_uid, given.st_gid) == (2000, 2000)
    assert given.st_mtime_ns == 1  # CAP_FOWNER: a time set on another UID's file (the hook's directory's mtime)
    assert not target.exists()


@pytest.mark.skipif(not shutil.which("setpriv") or os.geteuid() != 0, reason="needs root and util-linux's setpriv")
def test_the_device_plugin_agents_capabilities_suffice_to_make_its_socket_in_the_kubelets_directory(
        tmp_path: Path) -> None:
    """Without the CSI plugin the agent's container is not privileged: it starts as root with the capabilities its
    securityContext adds (SETUID, SETGID, SETPCAP, DAC_OVERRIDE: emulated here by a bounding set and no_new_privs, as
    the runtime sets them), and the chart's setpriv leaves it agent.runAsUser with CAP_DAC_OVERRIDE alone, which
    binds a socket in a root-owned 0755 directory (the kubelet's device-plugins/)."""
    c = container(render({"nodeAccess": "hostPath"}), "DaemonSet")
    added = ",".join(f"+{cap.lower()}" for cap in c["securityContext"]["capabilities"]["add"])
    runtime = ["setpriv", f"--bounding-set=-all,{added}", "--no-new-privs", "--"]
    plugins = tmp_path / "device-plugins"
    plugins.mkdir(mode=0o755)
    script = (
        "import json, os, socket, sys\n"
        "caps = {k: int(v, 16) for k, v in (l.split(':') for l in open('/proc/self/status') if l.startswith('Cap'))}\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.bind(os.path.join(sys.argv[1], 'bubbles-gpu-0.sock'))\n"
        "print(json.dumps([os.getuid(), os.getgid(), caps]))\n")
    r = subprocess.run([*runtime, *c["command"][:-1], sys.executable, "-I", "-c", script, str(plugins)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    uid, gid, caps = json.loads(r.stdout)
    assert (uid, gid) == (1000, 1000)
    dac = 1 << 1  # CAP_DAC_OVERRIDE
    assert {k: v for k, v in caps.items() if k != "CapInh"} == {"CapPrm": dac, "CapEff": dac, "CapBnd": dac,
                                                                 "CapAmb": dac}, caps
    st = (plugins / "bubbles-gpu-0.sock").stat()
    assert st.st_uid == 1000
    # Without DAC_OVERRIDE among the added capabilities the socket cannot be made: the capability is what it takes.
    runtime = ["setpriv", "--bounding-set=-all,+setuid,+setgid,+setpcap", "--no-new-privs", "--"]
    wrapper = [a.replace("+dac_override", "+setuid") for a in c["command"][:-1]]
    r = subprocess.run([*runtime, *wrapper, sys.executable, "-I", "-c", script, str(tmp_path / "device-plugins")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr


def secret_files(docs: list[dict[str, Any]], suffix: str, d: Path) -> dict[str, Path]:
    data = one(docs, "Secret", suffix)["data"]
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, value in data.items():
        (d / key).write_bytes(base64.b64decode(value))
        out[key] = d / key
    return out


def test_the_generated_credentials_work_on_a_real_grpc_channel(tmp_path: Path) -> None:
    from bubbles.agent.cluster import ClusterConfig, NodeAgent
    from bubbles.agent.config import AgentConfig
    from bubbles.agent.rpc import ServerSecurity, serve
    from bubbles.operator.grpc_agents import ClientSecurity, GrpcAgents

    docs = render({"grpc": {"token": True}})
    agent = secret_files(docs, "-agent-tls", tmp_path / "agent")
    operator = secret_files(docs, "-operator-tls", tmp_path / "operator")
    assert agent["ca.crt"].read_bytes() == operator["ca.crt"].read_bytes()
    node = NodeAgent(ClusterConfig("n1", AgentConfig(run_dir=tmp_path / "run", training="x")))
    node.start()
    server = serve(node, "127.0.0.1:0", ServerSecurity(agent["tls.crt"], agent["tls.key"], agent["ca.crt"],
                                                        agent["token"]))

    async def call() -> Any:
        agents = GrpcAgents({"n1": f"127.0.0.1:{server.port}"}.get,
                            ClientSecurity(operator["ca.crt"], operator["tls.crt"], operator["tls.key"],
                                           agent["token"], server_name="bubbles-agent"))
        try:
            return await agents.report("n1")
        finally:
            await agents.close()

    try:
        report = asyncio.run(call())
        assert report is not None and report.node == "n1"
    finally:
        server.stop()
        node.stop()


@pytest.mark.kube
def test_the_rendered_chart_installs_on_a_real_api_server_with_exactly_its_rbac(kube: Any) -> None:
    docs = render({"operator": {"replicas": 2}})
    kube.kubectl("create", "namespace", NS, check=False)
    manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    kube.kubectl("apply", "--dry-run=server", "-f", "-", input_text=manifest)
    kube.kubectl("create", "-f", "-", input_text=manifest)
    who = f"--as=system:serviceaccount:{NS}:{RELEASE}-bubbles-operator"

    def can(verb: str, resource: str, namespace: str = "ml") -> bool:
        resource, _, sub = resource.partition("/")
        extra = [f"--subresource={sub}"] if sub else []
        proc = kube.kubectl("auth", "can-i", verb, resource, *extra, "-n", namespace, who, check=False)
        return proc.stdout.strip() == "yes"

    for rule in RULES:
        group = rule["apiGroups"][0]
        for resource in rule["resources"]:
            base, _, sub = resource.partition("/")
            full = (f"{base}.{group}" if group else base) + (f"/{sub}" if sub else "")
            ns = NS if base == "leases" else "ml"
            for verb in rule["verbs"]:
                assert can(verb, full, ns), f"{verb} {full} in {ns} should be allowed"
    for verb, resource, ns in (("get", "leases.coordination.k8s.io", "ml"), ("get", "secrets", NS),
                               ("list", "secrets", "ml"), ("delete", "filljobs.bubbles.dev", "ml"),
                               ("patch", "pods", "ml"), ("create", "deployments.apps", NS),
                               ("patch", "pipelinetrainings.bubbles.dev", "ml")):
        assert not can(verb, resource, ns), f"{verb} {resource} in {ns} must not be granted"
    agent_sa = f"--as=system:serviceaccount:{NS}:{RELEASE}-bubbles-agent"
    for verb, resource in (("get", "pods"), ("list", "filljobs.bubbles.dev"), ("get", "secrets")):
        proc = kube.kubectl("auth", "can-i", verb, resource, "-n", NS, agent_sa, check=False)
        assert proc.stdout.strip() == "no"  # the agent needs no API access at all
    got = json.loads(kube.kubectl("get", "deploy,ds", "-n", NS, "-o", "json").stdout)["items"]
    assert sorted(d["kind"] for d in got) == ["DaemonSet", "Deployment"]


def test_every_port_names_its_protocol_for_server_side_apply_on_kubernetes_1_20() -> None:
    """Helm 4 installs with server-side apply; a 1.20 API server refuses ports without `protocol` (a list keyed on
    it, with no default there). Found by the cluster tier's `helm install`."""
    missing = []
    for doc in render({"metrics": {"serviceMonitor": {"enabled": True}}}):
        spec = doc.get("spec") or {}
        pod = ((spec.get("template") or {}).get("spec")) or {}
        for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            missing += [f"{doc['kind']} {c['name']} {p}" for p in c.get("ports", []) if "protocol" not in p]
        if doc["kind"] == "Service":
            missing += [f"Service {doc['metadata']['name']} {p}" for p in spec.get("ports", []) if "protocol" not in p]
    assert not missing, missing


def test_the_node_run_directory_is_at_run_bubbles_in_every_pod_and_the_operator_mounts_the_host_path() -> None:
    """The agent hands fill processes absolute socket paths: they must mean the same file in the agent's Pod as in
    the fill Pod (and the training's), so every Pod mounts agent.runDir at /run/bubbles. Found by the cluster tier:
    with the agent mounting it at agent.runDir, a fill Pod failed with FileNotFoundError binding its socket."""
    docs = render({"nodeAccess": "hostPath",
                   "agent": {"runDir": "/var/lib/bubbles/run", "runAsUser": 1000, "runAsGroup": 1000}})
    ds = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    (run,) = [v for v in ds["volumes"] if v["name"] == "run"]
    assert run["hostPath"]["path"] == "/var/lib/bubbles/run"
    for c in [*ds["initContainers"], *ds["containers"]]:
        assert {"name": "run", "mountPath": "/run/bubbles"} in c["volumeMounts"], c["name"]
    assert parse_agent(container(docs, "DaemonSet")["args"]).run_dir == Path("/run/bubbles")
    op = parse_operator(container(docs, "Deployment")["args"])
    assert (op.node_run_dir, op.fill_uid, op.fill_gid) == ("/var/lib/bubbles/run", 1000, 1000)


@pytest.mark.skipif(not shutil.which("setpriv") or os.geteuid() != 0, reason="needs root and util-linux's setpriv")
def test_the_run_dir_init_container_works_with_only_its_capability_and_again_after_a_restart(tmp_path: Path) -> None:
    """The init container's own command, as root with CAP_CHOWN only (its securityContext): it gives the kubelet's
    root-owned directory to the agent's user, and succeeds again when the agent Pod is replaced (the directory is
    the agent's by then: the cluster tier found the second start failing with EPERM)."""
    docs = render({"agent": {"runAsUser": 1000, "runAsGroup": 1000, "isolation": "mps"}})
    (init,) = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/run/bubbles", "/tmp/nvidia-mps", "/dev/shm"}
    # With MPS the daemon's pipe directory too, and its /dev/shm directory (private: the training's shared memory).
    d, pipe, shm = tmp_path / "run", tmp_path / "nvidia-mps", tmp_path / "shm"
    for made in (d, pipe, shm):
        made.mkdir(mode=0o755)
    argv = [sys.executable, *init["command"][1:]]
    argv[argv.index("755:/run/bubbles")] = f"755:{d}"
    argv[argv.index("755:/tmp/nvidia-mps")] = f"755:{pipe}"
    argv[argv.index("700:/dev/shm")] = f"700:{shm}"
    only_chown = ["setpriv", "--inh-caps=-all", "--bounding-set=-all,+chown", "--"]
    r = subprocess.run([*only_chown, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for owned, mode in ((d, 0o755), (pipe, 0o755), (shm, 0o700)):
        st = owned.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, mode), owned
    d.chmod(0o700)  # what the agent does once it runs: the directory is private to it
    r = subprocess.run([*only_chown, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"a replaced agent Pod's init container failed: {r.stderr}"
    st = d.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, 0o700)
    # contexts: the run dir only
    (plain,) = one(render(), "DaemonSet", "-agent")["spec"]["template"]["spec"]["initContainers"]
    assert plain["command"][-1] == "755:/run/bubbles" and len(plain["volumeMounts"]) == 1


def test_with_mps_the_daemon_runs_in_a_pod_of_its_own_that_upgrades_never_restart() -> None:
    """The MPS servers are the control daemon's children, and a training whose server goes must be restarted: a
    daemon in the agent's container would die with it on every `helm upgrade`. So the chart runs it in its own
    DaemonSet, updated OnDelete and without a liveness probe, on the same directories, and the agent only uses it."""
    docs = render({"agent": {"isolation": "mps", "runAsUser": 1000, "runAsGroup": 1000,
                             "mps": {"pipeDir": "/run/nvidia-mps", "shmDir": "/run/mps-shm"}}})
    ds = one(docs, "DaemonSet", "-mps-daemon")
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    spec = ds["spec"]["template"]["spec"]
    agent_spec = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and agent_spec["hostPID"] is True  # the client PIDs it lists are the agent's
    assert "hostIPC" not in spec and spec["automountServiceAccountToken"] is False
    assert spec["affinity"] == agent_spec["affinity"]  # on every node the agent runs on
    (daemon,) = spec["containers"]
    assert daemon["command"] == ["nvidia-cuda-mps-control", "-f"]
    assert "livenessProbe" not in daemon and "readinessProbe" not in daemon
    assert "limits" not in daemon["resources"]  # its servers live in it: no OOM kill under the trainings
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    hostpaths = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    agent_paths = {v["name"]: v.get("hostPath", {}).get("path") for v in agent_spec["volumes"]}
    assert hostpaths[mounts["/run/nvidia-mps"]] == agent_paths["mps-pipe"] == "/run/nvidia-mps"
    assert hostpaths[mounts["/dev/shm"]] == agent_paths["mps-shm"] == "/run/mps-shm"
    assert "/run/bubbles" not in mounts and "run" not in hostpaths  # it needs no run directory
    assert daemon["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                         "capabilities": {"drop": ["ALL"]}}
    (init,) = spec["initContainers"]
    assert "755:/run/bubbles" not in init["command"] and {"755:/run/nvidia-mps", "700:/dev/shm"} <= set(init["command"])
    agent = parse_agent(container(docs, "DaemonSet")["args"])
    assert agent.mps_daemon == "external" and str(agent.mps_pipe_dir) == "/run/nvidia-mps"
    assert not [d for d in render() if d["metadata"]["name"].endswith("-mps-daemon")]  # contexts: none


def test_the_notes_say_which_image_the_example_fill_job_needs() -> None:
    """The example FillJob names an image without a registry: the notes say to set the one images/build.sh made."""
    text = notes({"image": {"registry": "registry.example.com/ml"}})
    step = text[text.index("3. Submit"):]
    assert "set its spec.image" in step and "registry.example.com/ml/bubbles-fill-job:0.1.0" in step


def test_the_notes_say_what_a_training_pod_needs_and_the_agent_never_preempts_one() -> None:
    text = notes()
    assert "{csi: {driver: csi.bubbles.dev, volumeAttributes: {role: training}}} mounted at /run/bubbles" in text
    assert "BUBBLES_TRAINING" in text and "runAsUser" not in text  # where the hook looks; any UID
    text = notes({"nodeAccess": "hostPath", "agent": {"runDir": "/var/lib/bubbles"}})
    assert "/var/lib/bubbles mounted at /run/bubbles and runAsUser 1000" in text and "BUBBLES_TRAINING" in text
    assert "Before upgrading the chart, apply the new CRDs" in text and "mps-daemon" not in text
    mps = notes({"agent": {"isolation": "mps"}})
    assert "/dev/shm/bubbles-mps at /dev/shm" in mps and "mps-daemon Pods, which upgrades do not restart" in mps
    pc = one(render(), "PriorityClass")  # a new name: a preemptionPolicy cannot be changed on an existing class
    assert pc["preemptionPolicy"] == "Never" and pc["metadata"]["name"] == "bubbles-agent-nonpreempting"
