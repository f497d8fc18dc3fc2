"""The agent as a CSI node plugin (issue 36, step 1): ``csi.bubbles.dev`` inline ephemeral volumes, one directory per
Pod (``<run_dir>/_pods/<pod uid>/``), named by the kubelet rather than by the Pod, so no hostPath and no shared UID.

Modules: ``publish`` (pure: what a publish or unpublish means, refusals with what to set), ``plugin`` (the shell:
directories, bind mounts, the state file, ``published()``), ``podfs`` (inside a Pod's directory without following
its links: the MPS directories' mounts, removal only once nothing is mounted below), ``mounts`` (mount(2) by ctypes),
``server`` (the CSI Identity and Node services and the kubelet's plugin registration, on Unix sockets), ``pb`` (stubs
generated from ``proto/csi/`` and ``proto/pluginregistration/`` by tools/gen-proto.sh). This module itself imports
no gRPC: the configuration checks its paths with it.
"""

from __future__ import annotations

import os
from pathlib import Path

from bubbles.core.paths import MAX_SOCKET_PATH_BYTES

from .publish import DRIVER_NAME

DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")  # the kubelet's --root-dir


def csi_socket(kubelet_dir: Path) -> Path:
    """Where the CSI services listen (the kubelet's convention: ``plugins/<driver>/csi.sock``)."""
    return kubelet_dir / "plugins" / DRIVER_NAME / "csi.sock"


def registration_socket(kubelet_dir: Path) -> Path:
    """Where the kubelet's plugin watcher finds the registration socket."""
    return kubelet_dir / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"


def socket_problem(path: Path) -> str | None:
    """Why ``path`` cannot be bound as a Unix socket, with what to do; else None."""
    n = len(os.fsencode(str(path)))
    if n <= MAX_SOCKET_PATH_BYTES:
        return None
    return (f"socket path {path} is {n} bytes, longer than the {MAX_SOCKET_PATH_BYTES} a Unix socket allows: give a "
            "shorter --kubelet-dir")
