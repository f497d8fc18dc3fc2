"""Which GPUs this node has, by UUID: NVML where present (``nvidia-ml-py``), else the ``--gpus`` setting.

The training's hook names its stage's GPU by UUID (the index inside its container means nothing here); the agent
maps that UUID to its own view (``cuda:N`` in NVML's order, the order ``nvidia-smi -i N`` and MPS use).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("bubbles.agent")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be loaded or initialized on this machine (no bindings, no driver, no device); the text says why."""


def read_gpus(nvml: Any = None) -> dict[str, str]:
    """{UUID: "cuda:N"} from NVML; NvmlUnavailable where it cannot be loaded or initialized, NVML's own error where a
    device cannot be read. For callers that ask again and say a failure once (the device plugin's health checks)."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError:
            raise NvmlUnavailable("NVML (nvidia-ml-py) is not installed") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError: no driver, no device
        raise NvmlUnavailable(f"NVML is not usable here ({exc})") from None
    try:
        out = {}
        for i in range(int(nvml.nvmlDeviceGetCount())):
            uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
            out[uuid.decode() if isinstance(uuid, bytes) else str(uuid)] = f"cuda:{i}"
        return out
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)


def discover_gpus(nvml: Any = None) -> dict[str, str]:
    """{UUID: "cuda:N"} from NVML; {} (logged) where NVML cannot be loaded or initialized. ``nvml``: the
    ``pynvml`` module or a stand-in with its interface (tests)."""
    try:
        return read_gpus(nvml)
    except NvmlUnavailable as exc:
        log.info("%s: GPUs come from --gpus only", exc)
        return {}
