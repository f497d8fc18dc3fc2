"""The fill process's device: waiting for a step's queued GPU work, the per-process limits, and the check that
``create()`` left CUDA alone.

torch is imported lazily (and only if installed) to pin the fill process to one thread, to cap CUDA memory and to
wait for queued GPU work. Those CUDA calls go through a ``torch.cuda``-like object that tests replace
(``apply_process_limits(cuda=...)``, ``DeviceSync``).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

from bubbles.core import control
from bubbles.core.control import cuda_device_index


def _cuda_module(cuda: Any, device: str, index: int) -> Any:
    """``cuda`` if given, else the real ``torch.cuda``, checked to work and to have device ``index``:
    a RuntimeError saying what to do otherwise."""
    if cuda is None:
        try:
            import torch
        except ImportError:
            raise RuntimeError(f"device {device!r} needs torch with CUDA in the fill process; "
                               "install it, or run the job on a CPU executor") from None
        cuda = torch.cuda
    if not cuda.is_available():
        raise RuntimeError(f"device {device!r} was assigned, but CUDA is not available in this fill process "
                           "(a CPU build of torch, or no GPU visible: check CUDA_VISIBLE_DEVICES)")
    count = int(cuda.device_count())
    if index >= count:
        raise RuntimeError(f"device {device!r} does not exist: this fill process sees {count} CUDA device(s) "
                           "(check CUDA_VISIBLE_DEVICES and the agent's --devices)")
    return cuda


class DeviceSync:
    """Waits until the fill job's queued device work has finished. The base is for CPUs: a step's work
    is done when ``step()`` returns, so there is nothing to wait for."""

    def synchronize(self) -> None:
        """Return once every operation this process queued on the device has finished."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


FILL_WAITS = ("block", "spin")
DEFAULT_FILL_WAIT = "block"


class CudaDeviceSync(DeviceSync):
    """Waits for the fill process's queued work on CUDA device ``index``: a kernel launch returns to the host long
    before the kernel has run, so without this a step that "returned" may keep the GPU busy after its bubble has
    ended.

    ``wait="block"`` (the default): the thread sleeps in the driver on an event recorded with
    ``cudaEventBlockingSync`` behind the step's work on the device's current stream, then
    ``torch.cuda.synchronize(index)`` catches work the job queued on other streams (usually none: it returns at
    once). ``wait="spin"``: only ``torch.cuda.synchronize(index)``, which under the context's default schedule
    polls on a host core for the whole wait, taking CPU from the training's host threads on the same node, for a
    wake-up some tens of microseconds sooner."""

    def __init__(self, index: int, cuda: Any = None, wait: str = DEFAULT_FILL_WAIT) -> None:
        if wait not in FILL_WAITS:
            raise ValueError(f"wait must be one of {', '.join(FILL_WAITS)}, got {wait!r}")
        self.index = index
        self.wait = wait
        self._cuda = _cuda_module(cuda, f"cuda:{index}", index)
        self._event: Any = None  # made at the first wait, after init has set the device

    def synchronize(self) -> None:
        cuda = self._cuda
        if self.wait == "block":
            if self._event is None:
                self._event = cuda.Event(blocking=True)
            self._event.record(cuda.current_stream(self.index))
            self._event.synchronize()
        cuda.synchronize(self.index)

    def __repr__(self) -> str:
        return f"CudaDeviceSync({self.index}, wait={self.wait!r})"


def device_sync_for(device: str, cuda: Any = None, wait: str = DEFAULT_FILL_WAIT) -> DeviceSync:
    """The ``DeviceSync`` for an agent device string: a no-op for CPUs, ``CudaDeviceSync`` for ``cuda:N``."""
    index = cuda_device_index(device)
    return DeviceSync() if index is None else CudaDeviceSync(index, cuda, wait)


def fill_wait(text: str) -> str:
    """``$BUBBLES_FILL_WAIT``: how the fill process waits for a step's GPU work, ``block`` (empty means it) or
    ``spin``."""
    value = text.strip() or DEFAULT_FILL_WAIT
    if value not in FILL_WAITS:
        raise ValueError(f"${control.FILL_WAIT_ENV}={text!r}: give 'block' (the default: the process sleeps while its "
                         "step's GPU work drains) or 'spin' (a host core polls the GPU, for a wake-up tens of "
                         "microseconds sooner)")
    return value


def apply_process_limits(device: str, memory_bytes: int | None, cuda: Any = None) -> float | None:
    """One thread per fill process; on ``cuda:N`` make N the current device and cap the CUDA caching allocator at
    the agent's memory limit.

    Returns the fraction of the device's memory given to ``set_per_process_memory_fraction``, or None
    when nothing was capped: a CPU device (host memory has no per-process cap short of cgroups, which the
    agent does not manage on one machine, and the OS already isolates processes' memory) or no limit
    (``memory_bytes`` 0 or None). The fraction is of the memory the process sees (``mem_get_info``'s total: under
    MPS with a pinned memory limit, that limit), the total torch applies it to. A limit above it caps at the whole
    of it (1.0) with a warning on stderr. The cap covers the caching allocator only, not the CUDA context (about
    0.5 GiB); hard limits are the isolation's job (MPS, see docs/gpu.md). ``cuda`` replaces ``torch.cuda`` in tests.
    """
    index = cuda_device_index(device)
    if memory_bytes is not None and (not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool)
                                     or memory_bytes < 0):
        raise ValueError(f"memory limit must be an int number of bytes >= 0, got {memory_bytes!r}; "
                         f"check ${control.MEMORY_ENV} or the fill job's spec.memory")
    with contextlib.suppress(ImportError):
        import torch

        # A fill job shares its core with a pipeline stage: more threads would only contend for it.
        torch.set_num_threads(1)
    if index is None:
        return None
    cuda = _cuda_module(cuda, device, index)
    # The job's own tensors name their device, but anything that uses the current one (a default-device tensor, a
    # library's handles, the context torch creates on first use) would otherwise land on device 0: the training's.
    cuda.set_device(index)
    if not memory_bytes:
        return None
    # torch applies the fraction to the total the process sees (cudaMemGetInfo), which under an MPS pinned memory
    # limit is that limit, not the device's physical memory: compute it against the same total.
    total = int(cuda.mem_get_info(index)[1])
    fraction = memory_bytes / total
    if fraction > 1.0:
        print(f"bubbles.sdk: memory limit {memory_bytes} bytes exceeds {device}'s {total} bytes; capping at "
              "the whole device (fraction 1.0). Lower the fill job's spec.memory to what it needs.",
              file=sys.stderr)
        fraction = 1.0
    cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def cuda_contexts(cuda: Any = None) -> frozenset[int]:
    """The CUDA devices on which this process holds a context, asked without making one (the driver's primary
    context state, ``torch._C._cuda_hasPrimaryContext``). Empty when torch never initialised CUDA, and when torch
    cannot say (a build without that call): the check it serves then lets the job run. ``torch.cuda.is_initialized``
    alone would not do: querying a device's properties (as attaching to the agent does, for the GPU's UUID)
    initialises torch's CUDA state but makes no context. ``cuda`` replaces torch in tests: an object with
    ``is_initialized()``, ``device_count()`` and ``has_primary_context(index)``."""
    if cuda is None:
        torch = sys.modules.get("torch")  # never imported: nothing reached CUDA through torch
        ask = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
        if ask is None:
            return frozenset()
        cuda = types.SimpleNamespace(is_initialized=torch.cuda.is_initialized,  # type: ignore[union-attr]
                                     device_count=torch.cuda.device_count,  # type: ignore[union-attr]
                                     has_primary_context=ask)
    if not cuda.is_initialized():
        return frozenset()
    try:
        return frozenset(i for i in range(int(cuda.device_count())) if cuda.has_primary_context(i))
    except Exception:  # the driver would not say: as if none, so that a job is never refused on a failed question
        return frozenset()


def check_create_left_cuda_alone(device: str, before: frozenset[int], after: frozenset[int]) -> None:
    """RuntimeError if the job's ``create()`` (or ``restore()``) made a CUDA context on a ``cuda:N`` executor:
    ``after`` holds a device ``before`` did not (``cuda_contexts`` either side of them).

    ``create()`` runs before the agent's ``init``, so before the process is given its device (``set_device``) and its
    memory cap: a context made there lands on the current device, device 0 (on a machine whose agent runs several
    GPUs, that can be another stage's training GPU), and its memory (about 0.5 GiB, plus any tensors) was never
    checked against the bubble's free memory. Failing the job says what to move where; running on would risk the
    training's memory.
    """
    if cuda_device_index(device) is None:
        return
    made = sorted(after - before)
    if made:
        raise RuntimeError(f"create() made a CUDA context (on device {', '.join(map(str, made))}) before the agent "
                           f"gave this job its device ({device}) and its memory cap: move whatever touches the GPU "
                           "(.cuda(), .to('cuda'), torch.load of GPU tensors without map_location='cpu') from create() "
                           "or restore() into init(), which runs once the device is set")
