"""What makes a process a client of a node's MPS server: the variables and their values, defined once for the agent
(the fill processes it starts) and the operator (the fill Pods it makes).

A CUDA process joins MPS when it initializes CUDA with a control daemon answering in ``$CUDA_MPS_PIPE_DIRECTORY``
(the same directory for the daemon, its servers and every client), under the same UID as the server, and, across
containers, with the same ``/dev/shm``. NVIDIA, *Multi-Process Service*, "Environment variables".

In a cluster the daemon's Pod (the agent's) and every client's Pod mount one node directory at ``/dev/shm`` (NVIDIA's
device plugin does the same with a tmpfs of its own): the MPS participants share it, and nothing else on the node
does (no host IPC).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from bubbles.core import paths

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
DEFAULT_PIPE_DIR = Path("/tmp/nvidia-mps")
# The node directory the agent's Pod and its MPS clients' Pods mount at /dev/shm (the chart's agent.mps.shmDir): a
# directory in the node's /dev/shm, so it is memory with the node's /dev/shm's size, and only it is shared.
DEFAULT_SHM_DIR = "/dev/shm/bubbles-mps"
SHM_MOUNT = "/dev/shm"
CONTROL_SOCKET = "control"
FILL_PRIORITY = 1  # the training runs at the default priority 0; fill clients below it
DEFAULT_FILL_THREAD_PERCENTAGE = 50
# AF_UNIX paths hold at most 107 bytes on Linux; with a longer pipe directory the daemon cannot bind its
# control socket, and the only symptom is "Cannot find MPS control daemon process".
SUN_PATH_MAX = 107


def check_pipe_dir(pipe_dir: PurePath) -> None:
    """ValueError if the daemon could not bind its control socket in ``pipe_dir`` (a path too long)."""
    socket_path = pipe_dir / CONTROL_SOCKET
    if len(os.fsencode(socket_path)) > SUN_PATH_MAX:
        raise ValueError(f"MPS pipe directory {pipe_dir} is too long: its control socket path would be "
                         f"{len(os.fsencode(socket_path))} bytes, over the {SUN_PATH_MAX}-byte limit of a Unix "
                         "socket path; choose a shorter --mps-pipe-dir")


def check_shm_dir(path: str) -> str:
    """ValueError unless ``path`` can be the MPS participants' /dev/shm directory on a node: absolute, written plainly
    (the API server refuses ``..`` in a hostPath), at least two levels deep, and not the node's /dev/shm itself nor
    a system tree (the agent's init container takes the directory over: owner and mode)."""
    if not paths.is_plain_absolute(path):
        raise ValueError(f"the MPS /dev/shm directory must be an absolute path written without '.' or '..' parts or "
                         f"repeated or trailing slashes, got {path!r}")
    if path.count("/") < 2:
        raise ValueError(f"the MPS /dev/shm directory must be a directory of its own, at least two levels deep (for "
                         f"example {DEFAULT_SHM_DIR}), got {path!r}")
    if path == SHM_MOUNT or (path.startswith("/dev/") and not path.startswith(SHM_MOUNT + "/")) \
            or path.startswith(("/proc/", "/sys/")):
        raise ValueError(f"the MPS /dev/shm directory {path} would share (and give the agent's UID) the node's own "
                         f"{'/dev/shm' if path == SHM_MOUNT else 'system files'}: use a directory of its own, for "
                         f"example {DEFAULT_SHM_DIR}")
    return path


def check_thread_percentage(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ValueError(f"an MPS active thread percentage is a whole number from 1 to 100, got {value!r}")
    return value


def pinned_limit(device_index: int, memory_bytes: int) -> str:
    """The value of ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for one device: ``"<index>=<MiB>M"``.

    Rounded down to whole MiB so the limit never exceeds what the spec declared; at least 1M.
    """
    if device_index < 0:
        raise ValueError(f"device index must be >= 0, got {device_index}")
    if memory_bytes <= 0:
        raise ValueError(f"a pinned memory limit needs memory > 0 bytes, got {memory_bytes}")
    return f"{device_index}={max(1, memory_bytes // 2**20)}M"


def fill_client_env(pipe_dir: PurePath, thread_percentage: int, device_index: int | None,
                    memory_bytes: int) -> dict[str, str]:
    """A fill process's MPS variables: the node's pipe directory, a share of the SMs, priority below the training's
    and, on a CUDA device, its memory pinned to ``memory_bytes`` (``device_index`` as the process numbers it)."""
    env = {PIPE_ENV: str(pipe_dir), THREAD_PERCENTAGE_ENV: str(check_thread_percentage(thread_percentage)),
           PRIORITY_ENV: str(FILL_PRIORITY)}
    if device_index is not None:
        env[PINNED_LIMIT_ENV] = pinned_limit(device_index, memory_bytes)
    return env
