"""Memory probes: the CUDA allocator probe's arithmetic, read through a stand-in ``torch.cuda``, and the
promise that no probe raises into the training.

``FakeCuda`` stands in only for what cannot run here (a GPU and its driver): it has the same functions,
arguments and return types as ``torch.cuda`` for what the probe calls, with readings the test sets.
"""

from __future__ import annotations

from typing import Any

import pytest

from bubbles.training.probes import (
    DEFAULT_MARGIN_BYTES,
    CudaAllocatorProbe,
    MemoryProbe,
    MemorySample,
    StaticMemoryProbe,
)

GIB = 1 << 30
MIB = 1 << 20


class FakeCuda:
    """The part of ``torch.cuda`` the probe uses, for one or more devices, logging every call in order.

    The training's allocator holds ``allocated`` bytes of live tensors and ``cached`` bytes of blocks it keeps for
    later (``memory_reserved`` is their sum; ``max_memory_reserved`` is ``peak_reserved``). ``empty_cache()``
    would hand the cached blocks back to the device, as the real one does: the probe must never call it.
    """

    def __init__(self, *, total: int = 80 * GIB, free: int = 40 * GIB, allocated: int = 20 * GIB,
                 peak: int = 30 * GIB, cached: int = 0, devices: int = 1, current: int = 0) -> None:
        self.total, self.free, self.allocated, self.cached = total, free, allocated, cached
        self.peak_reserved = peak
        self.devices, self.current = devices, current
        self.calls: list[tuple[str, Any]] = []
        self.fail: str | None = None  # name of a call that raises, like a driver error
        self.after_read: Any = None  # what the training's thread does while the probe reads (a concurrent allocation)

    def _call(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if self.fail == name:
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered ({name})")

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def empty_cache(self) -> None:
        self._call("empty_cache")
        self.free += self.cached
        self.cached = 0

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self._call("mem_get_info", device)
        free = self.free
        if self.after_read is not None:
            self.after_read()
        return free, self.total

    def allocate(self, size: int) -> None:
        """The training's allocator reserves a new segment of ``size`` (cudaMalloc): from the device to its cache."""
        self.free -= size
        self.cached += size

    def memory_stats(self, device: int) -> dict[str, Any]:
        """torch.cuda.memory_stats's keys for what the probe reads (memory_allocated, memory_reserved and
        max_memory_reserved are these three)."""
        self._call("memory_stats", device)
        stats = {"allocated_bytes.all.current": self.allocated,
                 "reserved_bytes.all.current": self.allocated + self.cached,
                 "reserved_bytes.all.peak": self.peak_reserved}
        if self.after_read is not None:
            self.after_read()
        return stats


def test_free_for_fill_is_device_free_minus_the_trainings_peak_headroom_minus_the_margin() -> None:
    cuda = FakeCuda(free=40 * GIB, allocated=20 * GIB, peak=30 * GIB)
    probe = CudaAllocatorProbe(margin_bytes=MIB, cuda=cuda)
    # The training's allocator will reserve peak - reserved = 10 GiB again later in the iteration: not for fill.
    assert probe.sample() == MemorySample(free_bytes=30 * GIB - MIB, allocated_bytes=20 * GIB)
    assert probe.free_bytes() == 30 * GIB - MIB
    cuda.allocated = 30 * GIB  # at the training's peak: all of the device's free memory minus the margin
    cuda.free = 30 * GIB
    assert probe.sample() == MemorySample(30 * GIB - MIB, 30 * GIB)


def test_the_trainings_cache_is_never_emptied_nor_given_to_fill_work() -> None:
    # 6 GiB the training cached but does not use right now: it allocates them again at its next peak.
    cuda = FakeCuda(free=10 * GIB, cached=6 * GIB, allocated=20 * GIB, peak=26 * GIB)
    probe = CudaAllocatorProbe(margin_bytes=0, cuda=cuda)
    assert probe.sample().free_bytes == 10 * GIB
    names = [name for name, _ in cuda.calls]
    assert "empty_cache" not in names and cuda.cached == 6 * GIB
    assert names == ["memory_stats", "mem_get_info"]
    # After its peak the allocator returned nothing, so reserved == peak: the headroom is 0, not peak - allocated.
    cuda.allocated, cuda.cached = 12 * GIB, 14 * GIB
    assert probe.sample() == MemorySample(10 * GIB, 12 * GIB)


def test_an_allocation_of_the_training_while_the_probe_reads_never_raises_the_answer() -> None:
    """The training's thread runs on while the helper thread samples: a segment it reserves between two readings
    must count against what fill work may take, never for it (counted free by the driver before, and not yet
    reserved by the allocator, it would be counted twice)."""
    cuda = FakeCuda(free=10 * GIB, allocated=20 * GIB, peak=26 * GIB)
    probe = CudaAllocatorProbe(margin_bytes=0, cuda=cuda)
    done: list[bool] = []

    def allocate_once() -> None:  # right after the probe's first reading, whichever it is
        if not done:
            done.append(True)
            cuda.allocate(2 * GIB)
    cuda.after_read = allocate_once
    got = probe.sample().free_bytes
    cuda.after_read = None
    assert done and got <= probe.sample().free_bytes == 4 * GIB  # at most what is true once the allocation is in


def test_free_memory_floors_at_zero_and_the_default_margin_applies() -> None:
    cuda = FakeCuda(free=2 * GIB, allocated=20 * GIB, peak=21 * GIB + 256 * MIB)
    assert CudaAllocatorProbe(margin_bytes=512 * MIB, cuda=cuda).sample() == MemorySample(256 * MIB, 20 * GIB)
    assert CudaAllocatorProbe(margin_bytes=2 * GIB, cuda=cuda).sample() == MemorySample(0, 20 * GIB)
    default = CudaAllocatorProbe(cuda=FakeCuda(free=4 * GIB, allocated=GIB, peak=GIB))
    assert default.margin_bytes == DEFAULT_MARGIN_BYTES
    assert default.free_bytes() == 4 * GIB - DEFAULT_MARGIN_BYTES


@pytest.mark.parametrize("failing", ["mem_get_info", "memory_stats"])
def test_a_failing_reading_answers_unknown_and_never_raises(failing: str) -> None:
    cuda = FakeCuda()
    probe = CudaAllocatorProbe(margin_bytes=0, cuda=cuda)
    cuda.fail = failing
    assert probe.sample() == MemorySample(0, 0)
    assert probe.free_bytes() == 0


def test_a_garbage_reading_answers_unknown() -> None:
    cuda = FakeCuda()
    probe = CudaAllocatorProbe(cuda=cuda)
    cuda.peak_reserved = None  # type: ignore[assignment]
    assert probe.sample() == MemorySample(0, 0)


@pytest.mark.parametrize(("device", "index"), [(None, 1), (0, 0), (1, 1), ("cuda", 1), ("cuda:0", 0)])
def test_the_device_is_read_from_an_index_a_string_or_the_current_device(device: Any, index: int) -> None:
    cuda = FakeCuda(devices=2, current=1)
    probe = CudaAllocatorProbe(device, cuda=cuda)
    probe.sample()
    assert probe.index == index
    assert {arg for _name, arg in cuda.calls} == {index}


def test_a_torch_device_is_accepted() -> None:
    import torch

    cuda = FakeCuda(devices=2, current=0)
    assert CudaAllocatorProbe(torch.device("cuda", 1), cuda=cuda).index == 1
    assert CudaAllocatorProbe(torch.device("cuda"), cuda=cuda).index == 0
    with pytest.raises(ValueError, match="not a CUDA device"):
        CudaAllocatorProbe(torch.device("cpu"), cuda=cuda)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"margin_bytes": -1}, "margin_bytes must be an int number of bytes >= 0"),
        ({"margin_bytes": 0.5}, "margin_bytes must be an int"),
        ({"margin_bytes": "512M"}, "margin_bytes must be an int"),
        ({"margin_bytes": True}, "margin_bytes must be an int"),
        ({"device": "cpu"}, "'cpu' is not a CUDA device; pass 'cuda', 'cuda:N'"),
        ({"device": "cuda:x"}, "not a CUDA device"),
        ({"device": "cuda:-1"}, "not a CUDA device"),
        ({"device": 2.0}, "not a CUDA device"),
        ({"device": 3}, "CUDA device 3 does not exist: this process sees 2 device"),
        ({"device": "cuda:2"}, "check CUDA_VISIBLE_DEVICES"),
        ({"device": -1}, "CUDA device -1 does not exist"),
    ],
)
def test_bad_constructor_arguments_say_what_to_pass(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        CudaAllocatorProbe(cuda=FakeCuda(devices=2), **kwargs)
    assert needle in str(err.value)


def test_the_real_probe_on_a_machine_without_cuda_says_to_use_the_static_probe() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real probe works here (see the gpu test)")
    with pytest.raises(RuntimeError, match="needs CUDA") as err:
        CudaAllocatorProbe()
    assert "StaticMemoryProbe" in str(err.value)


def test_base_and_static_probes_sample_and_a_broken_subclass_answers_unknown() -> None:
    assert MemoryProbe().sample() == MemorySample(0, 0)
    assert StaticMemoryProbe(7).sample() == MemorySample(7, 0)
    assert StaticMemoryProbe(7, allocated_bytes=3).sample() == MemorySample(7, 3)
    with pytest.raises(ValueError, match="allocated_bytes must be an int >= 0"):
        StaticMemoryProbe(7, allocated_bytes=-3)

    class Broken(MemoryProbe):
        def free_bytes(self) -> int:
            raise OSError("NVML went away")

    assert Broken().sample() == MemorySample(0, 0)


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
def test_real_cuda_probe_sees_the_trainings_tensors_and_its_peak() -> None:
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    probe = CudaAllocatorProbe(margin_bytes=0)
    before = probe.sample()
    live = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    after_alloc = probe.sample()
    assert after_alloc.allocated_bytes >= before.allocated_bytes + 256 * MIB
    spike = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    del spike  # the peak stays; the probe keeps its headroom back
    after_spike = probe.sample()
    assert after_spike.allocated_bytes == after_alloc.allocated_bytes
    assert after_spike.free_bytes <= after_alloc.free_bytes - 448 * MIB
    del live


def test_the_profile_states_the_margin_its_free_memory_is_net_of(tmp_path: Any) -> None:
    from helpers.hook import StandInEngine

    from bubbles.core.cycle import BubbleCycle
    from bubbles.training.hook import instrument

    cuda = FakeCuda(free=8 * GIB, allocated=GIB, peak=GIB, cached=0)
    eng = StandInEngine(stage=0, stages=2, micro_batches=2, wait_s=0.001)
    inst = instrument(eng, training="margin", run_dir=tmp_path, warmup_iterations=0, profile_iterations=2,
                      memory_probe=CudaAllocatorProbe(margin_bytes=256 * MIB, cuda=cuda))
    for _ in range(2):
        eng.train_batch()
    cycle = inst.cycle
    assert cycle is not None and cycle.slots
    assert cycle.memory_margin_bytes == 256 * MIB
    assert all(s.free_bytes == 8 * GIB - 256 * MIB for s in cycle.slots)  # free memory is already net of it
    assert BubbleCycle.from_dict(cycle.to_dict()) == cycle  # and it travels with the profile
    inst.detach()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
def test_a_fill_processes_cuda_context_fits_the_agents_default_allowance() -> None:
    """What a process takes on the GPU beside its allocator's reservations (its CUDA context, kernels' modules) is what
    the agent plans as --cuda-context-mib outside MPS (default 512 MiB, a guess until this runs): the device's used
    memory (NVML) before the process touches CUDA and after a matmul (cuBLAS loaded), as a fill job's first step,
    less what its allocator reserved. Device-wide, so it holds in a container too; CUDA_DEVICE_ORDER=PCI_BUS_ID makes
    CUDA's device 0 NVML's."""
    import json
    import os
    import subprocess
    import sys

    from bubbles.agent.core import CoreConfig

    code = ("import json, pynvml, torch\n"
            "pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
            "before = pynvml.nvmlDeviceGetMemoryInfo(h).used\n"
            "x = torch.randn(1024, 1024, device='cuda:0'); y = x @ x; torch.cuda.synchronize()\n"
            "after = pynvml.nvmlDeviceGetMemoryInfo(h).used\n"
            "print(json.dumps({'before': before, 'after': after, 'reserved': torch.cuda.memory_reserved(0)}))\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    beside = int(got["after"]) - int(got["before"]) - int(got["reserved"])
    print(f"CUDA context and modules beside the allocator: {beside / 2**20:.0f} MiB")
    assert 0 < beside <= CoreConfig.cuda_context_bytes, \
        f"{beside / 2**20:.0f} MiB beside the allocator: set agent.cudaContextMiB (--cuda-context-mib) to it"
