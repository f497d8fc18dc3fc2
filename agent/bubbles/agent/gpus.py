"""Which GPUs this node has, by UUID: NVML where present (``nvidia-ml-py``), else the ``--gpus`` setting.

The training's hook names its stage's GPU by UUID (the index inside its container means nothing here); the agent
maps that UUID to its own view (``cuda:N`` in NVML's order, the order ``nvidia-smi -i N`` and MPS use).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("bubbles.agent")


def discover_gpus(nvml: Any = None) -> dict[str, str]:
    """{UUID: "cuda:N"} from NVML; {} (logged) where NVML cannot be loaded or initialized. ``nvml``: the
    ``pynvml`` module or a stand-in with its interface (tests)."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError:
            log.info("NVML (nvidia-ml-py) is not installed: GPUs come from --gpus only")
            return {}
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError: no driver, no device
        log.info("NVML is not usable here (%s): GPUs come from --gpus only", exc)
        return {}
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
