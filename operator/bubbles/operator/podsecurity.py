"""The Pod Security Standards' controls, as the standard writes them (kubernetes.io, "Pod Security Standards"), checked
on a Pod: which level it reaches (``restricted``, ``baseline`` or only ``privileged``) and which control each failure
is. What Pod Security admission of a current API server enforces in a namespace labelled
``pod-security.kubernetes.io/enforce``; the API servers these tests run (1.20) have none, so this is how the project
checks its Pods against it. Pure: a Pod (or its spec) in, a report out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")  # from none of the controls to all of them

BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                          "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
                          "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
                          "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                                "projected", "secret"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


@dataclass(frozen=True)
class Finding:
    """One control a Pod fails: its level, its name as the standard gives it, and what in the Pod breaks it."""

    level: str  # "baseline" or "restricted": the lowest level the control belongs to
    control: str
    where: str

    def __str__(self) -> str:
        return f"{self.control}: {self.where}"


@dataclass(frozen=True)
class Report:
    """Which level a Pod reaches, and every control it fails."""

    findings: tuple[Finding, ...] = field(default=())

    @property
    def level(self) -> str:
        """The highest level whose controls the Pod all meets."""
        if any(f.level == "baseline" for f in self.findings):
            return "privileged"
        return "baseline" if self.findings else "restricted"

    def meets(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def summary(self) -> str:
        """One line: the level, and each failed control (what a person reads before granting a namespace)."""
        if not self.findings:
            return "meets restricted (and baseline)"
        return f"meets {self.level} only; fails " + "; ".join(
            f"{f.level} {f}" for f in sorted(self.findings, key=lambda f: LEVELS.index(f.level)))


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(kind) or ()):
            yield f"spec.{kind}[{i}] ({c.get('name', '?')})", c


def _sc(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("securityContext") or {}


def _baseline(pod: Mapping[str, Any], spec: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    pod_sc = _sc(spec)
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        yield "HostProcess", "spec.securityContext.windowsOptions.hostProcess"
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(ns):
            yield "Host Namespaces", f"spec.{ns}"
    for i, v in enumerate(spec.get("volumes") or ()):
        if v.get("hostPath") is not None:
            yield "HostPath Volumes", f"spec.volumes[{i}] ({v.get('name', '?')})"
    for name in (pod_sc.get("sysctls") or ()):
        if name.get("name") not in SAFE_SYSCTLS:
            yield "Sysctls", f"spec.securityContext.sysctls {name.get('name')}"
    yield from _profiles(pod_sc, "spec.securityContext")
    for annotation, value in ((pod.get("metadata") or {}).get("annotations") or {}).items():
        if annotation.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" \
                and not str(value).startswith("localhost/"):
            yield "AppArmor", f"metadata.annotations[{annotation}] {value}"
    for where, c in _containers(spec):
        sc = _sc(c)
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            yield "HostProcess", f"{where}.securityContext.windowsOptions.hostProcess"
        if sc.get("privileged"):
            yield "Privileged Containers", f"{where}.securityContext.privileged"
        added = set((sc.get("capabilities") or {}).get("add") or ()) - BASELINE_CAPABILITIES
        if added:
            yield "Capabilities", f"{where} adds {', '.join(sorted(added))}"
        for port in c.get("ports") or ():
            if port.get("hostPort"):
                yield "Host Ports", f"{where} hostPort {port['hostPort']}"
        if sc.get("procMount") not in (None, "Default"):
            yield "/proc Mount Type", f"{where}.securityContext.procMount {sc['procMount']}"
        yield from _profiles(sc, f"{where}.securityContext")


def _profiles(sc: Mapping[str, Any], where: str) -> Iterator[tuple[str, str]]:
    """AppArmor, SELinux and seccomp in one security context (the Pod's or a container's)."""
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor not in (None, "RuntimeDefault", "Localhost"):
        yield "AppArmor", f"{where}.appArmorProfile.type {apparmor}"
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        yield "SELinux", f"{where}.seLinuxOptions.type {selinux['type']}"
    for key in ("user", "role"):
        if selinux.get(key):
            yield "SELinux", f"{where}.seLinuxOptions.{key}"
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield "Seccomp", f"{where}.seccompProfile.type Unconfined"


def _restricted(pod: Mapping[str, Any], spec: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    pod_sc = _sc(spec)
    for i, v in enumerate(spec.get("volumes") or ()):
        kinds = [k for k in v if k != "name"]
        if not set(kinds) <= RESTRICTED_VOLUMES:
            yield "Volume Types", f"spec.volumes[{i}] ({v.get('name', '?')}): {', '.join(sorted(kinds))}"
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if pod_sc.get("runAsUser") == 0:
        yield "Running as Non-root user", "spec.securityContext.runAsUser 0"
    for where, c in _containers(spec):
        sc = _sc(c)
        if sc.get("allowPrivilegeEscalation") is not False:
            yield "Privilege Escalation", f"{where}.securityContext.allowPrivilegeEscalation is not false"
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            yield "Running as Non-root", f"{where}: runAsNonRoot true neither there nor on the Pod"
        if sc.get("runAsUser") == 0:
            yield "Running as Non-root user", f"{where}.securityContext.runAsUser 0"
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost") and not (seccomp is None and pod_seccomp):
            yield "Seccomp", f"{where}: seccompProfile RuntimeDefault or Localhost neither there nor on the Pod"
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            yield "Capabilities", f"{where} does not drop ALL"
        added = set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}
        if added:
            yield "Capabilities", f"{where} adds {', '.join(sorted(added))} (restricted allows NET_BIND_SERVICE only)"


CHECKS: tuple[tuple[str, Callable[[Mapping[str, Any], Mapping[str, Any]], Iterator[tuple[str, str]]]], ...] = (
    ("baseline", _baseline), ("restricted", _restricted))


def check(pod: Mapping[str, Any]) -> Report:
    """The report on a Pod manifest (``kind: Pod``) or a Pod spec alone."""
    spec = pod.get("spec") if pod.get("kind") == "Pod" or "spec" in pod else pod
    spec = spec or {}
    return Report(tuple(Finding(level, control, where) for level, fn in CHECKS for control, where in fn(pod, spec)))
