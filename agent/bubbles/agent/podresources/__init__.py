"""The kubelet's PodResources API as the agent reads it (issue 36): which Pod's container holds which devices.

The kubelet serves ``v1.PodResourcesLister`` on ``<its --root-dir>/pod-resources/kubelet.sock`` (v1 since Kubernetes
1.20; v1alpha1 since 1.13): every Pod it runs, with each container's devices by resource name and device ID. The
device plugin asks it in ``PreStartContainer`` whose container it is about to let start
(``bubbles.agent.deviceplugin.guard``). This module is the plain data and the paths, without gRPC (the configuration
checks its paths with it); ``client`` asks the kubelet; ``pb``: stubs generated from ``proto/podresources/`` by
tools/gen-proto.sh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bubbles.core import paths
from bubbles.core.paths import MAX_SOCKET_PATH_BYTES

SOCKET_NAME = "kubelet.sock"
DIRECTORY_NAME = "pod-resources"  # under the kubelet's --root-dir, beside device-plugins/


def socket_beside(device_plugin_dir: Path) -> Path:
    """The PodResources socket of the kubelet whose device-plugins directory is ``device_plugin_dir`` (both are
    under the kubelet's --root-dir): the default of ``--pod-resources-socket``."""
    return device_plugin_dir.parent / DIRECTORY_NAME / SOCKET_NAME


def socket_problem(path: Path) -> str | None:
    """What is wrong with ``path`` as ``--pod-resources-socket`` (the settings' check), with what to do; else None."""
    text = str(path)
    if not paths.is_plain_absolute(text):
        return (f"--pod-resources-socket must be an absolute path written plainly (the kubelet's "
                f"<root-dir>/{DIRECTORY_NAME}/{SOCKET_NAME}), got {text!r}")
    n = len(os.fsencode(text))
    if n > MAX_SOCKET_PATH_BYTES:
        return (f"--pod-resources-socket {path} is {n} bytes, longer than the {MAX_SOCKET_PATH_BYTES} a Unix socket "
                "allows: mount the kubelet's pod-resources directory at a shorter path")
    if path.is_dir():
        return (f"--pod-resources-socket {path} is a directory: give the socket in it "
                f"({path / SOCKET_NAME})")
    if path.exists() and not path.is_socket():
        return f"--pod-resources-socket {path} is not a socket: give the kubelet's {DIRECTORY_NAME}/{SOCKET_NAME}"
    return None


def mount_problem(path: Path) -> str | None:
    """What is missing for the agent to reach the socket ``path`` (checked as the device plugin starts); else None.
    The socket itself may be missing (the kubelet makes it again when it restarts; every ``PreStartContainer`` is
    refused meanwhile), its directory may not: that is the mount the agent's container needs."""
    if not path.parent.is_dir():
        return (f"--pod-resources-socket: its directory {path.parent} does not exist in the agent's container: mount "
                f"the kubelet's {DIRECTORY_NAME} directory there (a hostPath of the directory, not of the socket, "
                "which the kubelet makes again when it restarts)")
    return None


@dataclass(frozen=True)
class ContainerDevices:
    """The devices of one resource that one container holds, as the kubelet lists them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
