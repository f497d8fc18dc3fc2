"""The Pod Security Standards' checker: every control, as the standard writes it, with a Pod that breaks it; and the
level each Pod the project ships or makes reaches."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bubbles.operator.podsecurity import LEVELS, check

RESTRICTED_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ok"},
    "spec": {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
             "containers": [{"name": "c", "image": "i", "securityContext": {
                 "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
             "volumes": [{"name": "v", "emptyDir": {}}, {"name": "s", "secret": {"secretName": "s"}}]}}


def breaking(path: str, value: Any) -> dict[str, Any]:
    """RESTRICTED_POD with ``value`` set at ``path`` (dots; a list index as a number)."""
    pod = copy.deepcopy(RESTRICTED_POD)
    *parents, last = path.split(".")
    node: Any = pod
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return pod


def test_a_pod_that_meets_every_control_is_restricted() -> None:
    report = check(RESTRICTED_POD)
    assert report.findings == ()
    assert report.level == "restricted"
    assert report.meets("baseline")
    assert check(RESTRICTED_POD["spec"]).level == "restricted"  # a spec alone is checked the same


BASELINE_BREAKS = [
    ("HostProcess", "spec.securityContext.windowsOptions", {"hostProcess": True}),
    ("HostProcess", "spec.containers.0.securityContext.windowsOptions", {"hostProcess": True}),
    ("Host Namespaces", "spec.hostNetwork", True),
    ("Host Namespaces", "spec.hostPID", True),
    ("Host Namespaces", "spec.hostIPC", True),
    ("Privileged Containers", "spec.containers.0.securityContext.privileged", True),
    ("Capabilities", "spec.containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
    ("HostPath Volumes", "spec.volumes.0", {"name": "h", "hostPath": {"path": "/run"}}),
    ("Host Ports", "spec.containers.0.ports", [{"containerPort": 80, "hostPort": 8080}]),
    ("AppArmor", "spec.securityContext.appArmorProfile", {"type": "Unconfined"}),
    ("AppArmor", "metadata.annotations", {"container.apparmor.security.beta.kubernetes.io/c": "unconfined"}),
    ("SELinux", "spec.securityContext.seLinuxOptions", {"type": "spc_t"}),
    ("SELinux", "spec.containers.0.securityContext.seLinuxOptions", {"user": "system_u"}),
    ("/proc Mount Type", "spec.containers.0.securityContext.procMount", "Unmasked"),
    ("Seccomp", "spec.securityContext.seccompProfile", {"type": "Unconfined"}),
    ("Sysctls", "spec.securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
]
RESTRICTED_BREAKS = [
    ("Volume Types", "spec.volumes.0", {"name": "n", "nfs": {"server": "s", "path": "/"}}),
    ("Privilege Escalation", "spec.containers.0.securityContext.allowPrivilegeEscalation", True),
    ("Running as Non-root", "spec.securityContext.runAsNonRoot", False),
    ("Running as Non-root user", "spec.securityContext.runAsUser", 0),
    ("Seccomp", "spec.securityContext.seccompProfile", {}),
    ("Capabilities", "spec.containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
    ("Capabilities", "spec.containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["CHOWN"]}),
]


@pytest.mark.parametrize(("control", "path", "value"), BASELINE_BREAKS)
def test_each_baseline_control_refuses_a_pod_that_breaks_it(control: str, path: str, value: Any) -> None:
    report = check(breaking(path, value))
    assert report.level == "privileged", report.summary()
    assert control in {f.control for f in report.findings if f.level == "baseline"}


@pytest.mark.parametrize(("control", "path", "value"), RESTRICTED_BREAKS)
def test_each_restricted_control_refuses_a_pod_that_breaks_it_and_baseline_still_holds(
        control: str, path: str, value: Any) -> None:
    report = check(breaking(path, value))
    assert report.level == "baseline", report.summary()
    assert [f.control for f in report.findings] == [control]


def test_every_control_of_the_standard_has_a_pod_that_breaks_it() -> None:
    """The standard's controls, by name (kubernetes.io, Pod Security Standards): none without a case above."""
    baseline = {"HostProcess", "Host Namespaces", "Privileged Containers", "Capabilities", "HostPath Volumes",
                "Host Ports", "AppArmor", "SELinux", "/proc Mount Type", "Seccomp", "Sysctls"}
    restricted = {"Volume Types", "Privilege Escalation", "Running as Non-root", "Running as Non-root user",
                  "Seccomp", "Capabilities"}
    assert {c for c, _, _ in BASELINE_BREAKS} == baseline
    assert {c for c, _, _ in RESTRICTED_BREAKS} == restricted


def test_a_containers_own_setting_counts_where_the_pod_has_none() -> None:
    pod = breaking("spec.securityContext", {})
    assert {f.control for f in check(pod).findings} == {"Running as Non-root", "Seccomp"}
    pod["spec"]["containers"][0]["securityContext"].update(runAsNonRoot=True, seccompProfile={"type": "Localhost"})
    assert check(pod).level == "restricted"


def test_the_summary_names_each_failure_with_its_level() -> None:
    report = check(breaking("spec.volumes.0", {"name": "h", "hostPath": {"path": "/run"}}))
    assert report.summary().startswith("meets privileged only; fails baseline HostPath Volumes: spec.volumes[0] (h)")
    assert "restricted Volume Types" in report.summary()
    assert check(RESTRICTED_POD).summary() == "meets restricted (and baseline)"
    assert LEVELS == ("privileged", "baseline", "restricted")
