"""Memory probes: how much accelerator memory a fill job could use during a bubble.

The hook samples a probe at every candidate bubble while it profiles (never on the signalling hot
path). ``MemoryProbe`` is the do-nothing base: it answers 0, meaning "unknown", and the planner then
treats the bubble as having no memory to give. CPU runs and tests inject a value with
``StaticMemoryProbe``; CUDA runs ask the caching allocator (PipeFill section 4.2).

``torch.cuda`` is touched only by ``CudaAllocatorProbe`` and only after ``default_probe`` has checked
that CUDA exists: on the CPU build ``memory_allocated`` silently returns 0 and ``mem_get_info`` raises.
"""

from __future__ import annotations

import os
from typing import Any

FREE_BYTES_ENV = "BUBBLES_FREE_BYTES"
DEFAULT_MARGIN_BYTES = 512 * 1024 * 1024  # headroom left to the training's allocator spikes


class MemoryProbe:
    """Base probe: free memory unknown (0). Subclasses never raise from ``free_bytes``."""

    def free_bytes(self) -> int:
        """Bytes a fill job may allocate right now; 0 means unknown or none."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class StaticMemoryProbe(MemoryProbe):
    """A fixed answer: for CPU runs, where no allocator can be asked, and for tests."""

    def __init__(self, free_bytes: int) -> None:
        if not isinstance(free_bytes, int) or isinstance(free_bytes, bool) or free_bytes < 0:
            raise ValueError(f"free_bytes must be an int >= 0, got {free_bytes!r}")
        self._free_bytes = free_bytes

    def free_bytes(self) -> int:
        return self._free_bytes

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StaticMemoryProbe:
        """Read ``$BUBBLES_FREE_BYTES`` (an integer number of bytes); 0 when unset."""
        env = os.environ if environ is None else environ
        raw = env.get(FREE_BYTES_ENV, "").strip()
        if not raw:
            return cls(0)
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"${FREE_BYTES_ENV}={raw!r} is not an integer number of bytes; "
                             "set it to e.g. 4294967296 for 4 GiB, or unset it") from None
        return cls(value)

    def __repr__(self) -> str:
        return f"StaticMemoryProbe({self._free_bytes})"


class CudaAllocatorProbe(MemoryProbe):
    """Free memory = device total - memory allocated by this (training) process - margin.

    Calls ``torch.cuda.empty_cache()`` first so the training's cached-but-unused blocks count as free
    (PipeFill 4.2). That costs time, which is why the hook calls it only while profiling.
    """

    def __init__(self, device: Any = None, margin_bytes: int = DEFAULT_MARGIN_BYTES) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaAllocatorProbe needs CUDA; use StaticMemoryProbe or default_probe() "
                               "on machines without a GPU")
        if margin_bytes < 0:
            raise ValueError(f"margin_bytes must be >= 0, got {margin_bytes}")
        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self.margin_bytes = margin_bytes
        self.total_bytes = int(torch.cuda.get_device_properties(self.device).total_memory)

    def free_bytes(self) -> int:
        cuda = self._torch.cuda
        try:
            cuda.empty_cache()
            allocated = int(cuda.memory_allocated(self.device))
        except Exception:  # a probe never breaks the training: unknown is a safe answer
            return 0
        return max(0, self.total_bytes - allocated - self.margin_bytes)

    def __repr__(self) -> str:
        return f"CudaAllocatorProbe({self.device}, margin_bytes={self.margin_bytes})"


def default_probe() -> MemoryProbe:
    """CUDA present: ask the allocator; otherwise the value of ``$BUBBLES_FREE_BYTES`` (or 0)."""
    try:
        import torch

        if torch.cuda.is_available():
            return CudaAllocatorProbe()
    except Exception:  # no torch, a broken driver: fall back to the static answer
        pass
    return StaticMemoryProbe.from_env()
