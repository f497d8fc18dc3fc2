"""Memory probes: how much accelerator memory a fill job could use during a bubble.

The hook samples a probe at every candidate bubble while it profiles (never on the signalling hot
path). ``MemoryProbe`` is the do-nothing base: it answers 0, meaning "unknown", and the planner then
treats the bubble as having no memory to give. CPU runs and tests inject a value with
``StaticMemoryProbe``; CUDA runs ask the caching allocator (PipeFill section 4.2) through
``CudaAllocatorProbe``.

``torch.cuda`` is touched only by ``CudaAllocatorProbe``, and only through the ``torch.cuda``-like object
it holds (the real module after checking that CUDA exists, or one a test injects): on the CPU build
``memory_allocated`` silently returns 0 and ``mem_get_info`` raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

FREE_BYTES_ENV = "BUBBLES_FREE_BYTES"
DEFAULT_MARGIN_BYTES = 512 * 1024 * 1024  # headroom left to the training's allocator spikes


@dataclass(frozen=True)
class MemorySample:
    """Accelerator memory at one moment: what a fill job may take, and what the training holds."""

    free_bytes: int  # bytes a fill job may allocate now and keep until the end of the iteration; 0: unknown
    allocated_bytes: int  # bytes of live tensors the training holds now; 0: unknown or none


class MemoryProbe:
    """Base probe: free memory unknown (0). Probes never raise from ``sample`` or ``free_bytes``."""

    def free_bytes(self) -> int:
        """Bytes a fill job may allocate right now; 0 means unknown or none."""
        return 0

    def sample(self) -> MemorySample:
        """Free and allocated memory now; probes that cannot tell what is allocated report 0."""
        try:
            return MemorySample(int(self.free_bytes()), 0)
        except Exception:  # a subclass that breaks its promise still must not reach the training
            return MemorySample(0, 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class StaticMemoryProbe(MemoryProbe):
    """A fixed answer: for CPU runs, where no allocator can be asked, and for tests."""

    def __init__(self, free_bytes: int, allocated_bytes: int = 0) -> None:
        for name, value in (("free_bytes", free_bytes), ("allocated_bytes", allocated_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self._free_bytes = free_bytes
        self._allocated_bytes = allocated_bytes

    def free_bytes(self) -> int:
        return self._free_bytes

    def sample(self) -> MemorySample:
        return MemorySample(self._free_bytes, self._allocated_bytes)

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
        extra = f", allocated_bytes={self._allocated_bytes}" if self._allocated_bytes else ""
        return f"StaticMemoryProbe({self._free_bytes}{extra})"


class CudaAllocatorProbe(MemoryProbe):
    """Free memory for fill work on one CUDA device, read from the training process's caching allocator.

    ``sample()`` reads, and changes nothing (it never empties the training's cache: blocks the training cached are
    the ones it allocates again at its next peak, and emptying them on its thread would also stall it):

    - ``mem_get_info(device)``: the device's free bytes, seen by the driver (other processes' memory,
      fill jobs already resident included, counts as used);
    - ``memory_reserved(device)``: what the training's allocator holds now, its live tensors and its cache;
    - ``max_memory_reserved(device)``: the most it has held (the hook samples after warm-up iterations, so
      the peak of a whole iteration is in it);
    - ``memory_allocated(device)``: the training's live tensors now (reported, not used in the answer);

    (the allocator's three as ``memory_stats(device)`` has them, one snapshot, read before ``mem_get_info``) and
    answers::

        free_for_fill = max(0, device_free - (training_peak_reserved - training_reserved_now) - margin_bytes)

    A fill job's memory stays allocated after its bubble ends (its model and optimizer state live on the
    device between bubbles), so it must not take what the training's allocator will reserve again to reach its
    own peak later in the iteration; ``margin_bytes`` covers what the peak does not show (cuDNN/cuBLAS
    workspaces, a longer sequence in a later batch).

    Any failure of a reading answers 0 ("unknown": the planner gives that bubble no memory); the probe
    never raises into the training.

    ``cuda`` is a ``torch.cuda``-like object (``is_available``, ``device_count``, ``current_device``,
    ``mem_get_info``, ``memory_stats``); by default the
    real ``torch.cuda``. Tests inject a stand-in with readings they choose.
    """

    def __init__(self, device: Any = None, margin_bytes: int = DEFAULT_MARGIN_BYTES, cuda: Any = None) -> None:
        if not isinstance(margin_bytes, int) or isinstance(margin_bytes, bool) or margin_bytes < 0:
            raise ValueError(f"margin_bytes must be an int number of bytes >= 0, got {margin_bytes!r}; "
                             f"the default is {DEFAULT_MARGIN_BYTES} (512 MiB)")
        if cuda is None:
            import torch

            cuda = torch.cuda
        if not cuda.is_available():
            raise RuntimeError("CudaAllocatorProbe needs CUDA, which this process does not have; use "
                               "StaticMemoryProbe (or default_probe(), which reads $BUBBLES_FREE_BYTES) "
                               "on machines without a GPU")
        self._cuda = cuda
        self.index = _cuda_device_index(device, cuda)
        self.margin_bytes = margin_bytes

    def sample(self) -> MemorySample:
        cuda, index = self._cuda, self.index
        try:
            # The allocator's figures first, in one snapshot (memory_allocated, memory_reserved and
            # max_memory_reserved would each build the whole stats dictionary), then the device's free memory: an
            # allocation of the training's between the two readings then counts against the answer (it is gone from
            # device_free, not yet in reserved), never twice for it, as the other order would count it.
            stats = cuda.memory_stats(index)
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            peak = int(stats.get("reserved_bytes.all.peak", 0))
            device_free, _total = cuda.mem_get_info(index)
            device_free = int(device_free)
        except Exception:  # a probe never breaks the training: unknown is a safe answer
            return MemorySample(0, 0)
        allocated = max(0, allocated)
        headroom = max(0, peak - reserved)  # what the training's allocator will reserve again before its peak
        return MemorySample(max(0, device_free - headroom - self.margin_bytes), allocated)

    def free_bytes(self) -> int:
        return self.sample().free_bytes

    def __repr__(self) -> str:
        return f"CudaAllocatorProbe('cuda:{self.index}', margin_bytes={self.margin_bytes})"


def _cuda_device_index(device: Any, cuda: Any) -> int:
    """The device index of ``device``: None (the current device), an int, ``"cuda"``/``"cuda:N"`` or a
    ``torch.device`` of type cuda; ValueError saying what to pass otherwise."""
    if device is None:
        index = cuda.current_device()
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif isinstance(device, str):
        kind, sep, number = device.strip().partition(":")
        if kind != "cuda" or (sep and not number.isdigit()):
            raise ValueError(f"device {device!r} is not a CUDA device; pass 'cuda', 'cuda:N' or an index N")
        index = int(number) if sep else cuda.current_device()
    elif getattr(device, "type", None) == "cuda":  # a torch.device
        index = cuda.current_device() if device.index is None else device.index
    else:
        raise ValueError(f"device {device!r} is not a CUDA device; pass 'cuda', 'cuda:N' or an index N")
    count = int(cuda.device_count())
    if not 0 <= index < count:
        raise ValueError(f"CUDA device {index} does not exist: this process sees {count} device(s) "
                         "(check CUDA_VISIBLE_DEVICES)")
    return int(index)


def default_probe(device: Any = None) -> MemoryProbe:
    """CUDA present (and ``device``, the training's, a CUDA device or None for the current one): ask the allocator
    about that device; otherwise the value of ``$BUBBLES_FREE_BYTES`` (or 0)."""
    try:
        import torch

        if torch.cuda.is_available():
            return CudaAllocatorProbe(device)
    except Exception:  # no torch, a broken driver: fall back to the static answer
        pass
    return StaticMemoryProbe.from_env()


def gpu_uuid(device: Any) -> str | None:
    """The UUID of the CUDA device ``device`` names, as NVML and ``NVIDIA_VISIBLE_DEVICES`` write it
    (``GPU-<uuid>``); None on CPU or where torch cannot say. Never raises: callers fail open."""
    try:
        text = str(getattr(device, "type", device) or "")
        if not text.startswith("cuda"):
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        index = _cuda_device_index(device, torch.cuda)
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    except Exception:
        return None
