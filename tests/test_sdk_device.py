"""The fill process's device: CUDA device strings, waiting for a step's GPU work, memory caps, and the check that
create() left CUDA alone (stand-ins for torch.cuda; the real driver only in the gpu tier)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.sdk import BusyJob, torch_threads_kept

from bubbles.core import control
from bubbles.core.control import cuda_device_index
from bubbles.training.sdk.device import (
    CudaDeviceSync,
    DeviceSync,
    apply_process_limits,
    check_create_left_cuda_alone,
    cuda_contexts,
    device_sync_for,
    fill_wait,
)
from bubbles.training.sdk.runtime import FillRuntime


class FakeCuda:
    """The part of ``torch.cuda`` the SDK uses, for devices of ``total`` bytes; logs the calls."""

    def __init__(self, *, total: int = 80 << 30, devices: int = 2, available: bool = True,
                 visible: int | None = None) -> None:
        self.total, self.devices, self.available = total, devices, available
        self.visible = total if visible is None else visible  # what cudaMemGetInfo reports (an MPS limit: less)
        self.calls: list[tuple[Any, ...]] = []

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self.calls.append(("mem_get_info", index))
        return self.visible // 2, self.visible

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.devices

    def get_device_properties(self, index: int) -> Any:
        self.calls.append(("get_device_properties", index))
        return type("Props", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.calls.append(("set_per_process_memory_fraction", fraction, device))

    def synchronize(self, device: int) -> None:
        self.calls.append(("synchronize", device))

    def current_stream(self, device: int) -> str:
        return f"stream of {device}"

    def Event(self, *, enable_timing: bool = False, blocking: bool = False) -> Any:  # torch.cuda's name
        calls = self.calls
        calls.append(("Event", blocking))

        class Event:
            def record(self, stream: Any = None) -> None:
                calls.append(("record", stream))

            def synchronize(self) -> None:
                calls.append(("event.synchronize",))

        return Event()


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """apply_process_limits pins torch to one thread, in the test process too: put it back."""
    with torch_threads_kept():
        yield


@pytest.mark.parametrize(("device", "index"), [("cpu", None), ("cpu:3", None), ("cuda", 0), ("cuda:1", 1),
                                               (" cuda:12 ", 12)])
def test_device_strings_name_a_cuda_index_or_none(device: str, index: int | None) -> None:
    assert cuda_device_index(device) == index


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1:2", "cpu:k", "", "CUDA:0"])
def test_bad_device_strings_say_what_a_device_looks_like(device: str) -> None:
    with pytest.raises(ValueError, match=r"neither 'cpu', 'cpu:K' nor 'cuda:N'; check \$BUBBLES_DEVICE"):
        cuda_device_index(device)
    with pytest.raises(ValueError, match="neither"):
        device_sync_for(device)


def test_device_sync_is_a_no_op_on_cpus_and_on_cuda_sleeps_on_a_blocking_event_before_a_device_synchronize() -> None:
    cuda = FakeCuda()
    assert type(device_sync_for("cpu:1", cuda)) is DeviceSync
    device_sync_for("cpu", cuda).synchronize()
    sync = device_sync_for("cuda:1", cuda)
    assert isinstance(sync, CudaDeviceSync)
    assert sync.wait == "block"
    sync.synchronize()
    sync.synchronize()
    # One event, made with cudaEventBlockingSync at the first wait, recorded behind the step's work on the device's
    # current stream each time: the thread sleeps in the driver, and the device-wide synchronize after it finds
    # only what other streams still hold.
    wait = [("record", "stream of 1"), ("event.synchronize",), ("synchronize", 1)]
    assert cuda.calls == [("Event", True), *wait, *wait]
    spin = FakeCuda()
    device_sync_for("cuda:0", spin, wait="spin").synchronize()
    assert spin.calls == [("synchronize", 0)]  # the driver's own schedule: a host core polls
    with pytest.raises(ValueError, match="wait must be one of block, spin, got 'sleep'"):
        device_sync_for("cuda:0", spin, wait="sleep")
    with pytest.raises(RuntimeError, match="CUDA is not available in this fill process"):
        device_sync_for("cuda:0", FakeCuda(available=False))
    with pytest.raises(RuntimeError, match="'cuda:2' does not exist: this fill process sees 2 CUDA device"):
        device_sync_for("cuda:2", FakeCuda(devices=2))


@pytest.mark.parametrize(("text", "wait"), [("", "block"), (" block ", "block"), ("spin", "spin")])
def test_the_fill_wait_comes_from_the_environment(text: str, wait: str) -> None:
    assert fill_wait(text) == wait


@pytest.mark.parametrize("text", ["sleep", "BLOCK", "1"])
def test_a_bad_fill_wait_says_what_to_give(text: str) -> None:
    with pytest.raises(ValueError, match=r"\$BUBBLES_FILL_WAIT=.*give 'block' \(the default"):
        fill_wait(text)


def test_the_real_cuda_sync_on_this_cpu_machine_fails_at_init_with_a_reason(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ours, theirs = socket.socketpair()
    job = BusyJob()
    rt = FillRuntime(job, theirs, name="busy", socket_path=None, step_s=0.001, device="cuda:0")
    with pytest.raises(RuntimeError, match="'cuda:0' was assigned, but CUDA is not available"):
        rt._handle(control.parse_command(control.encode("init")))
    assert not job.initialized
    ours.close()
    theirs.close()
    with pytest.raises(ValueError, match="neither"):
        FillRuntime(BusyJob(), socket.socket(), name="x", socket_path=None, step_s=None, device="gpu0")


@pytest.mark.usefixtures("keep_torch_threads")
def test_memory_limit_becomes_the_devices_fraction_on_its_index() -> None:
    cuda = FakeCuda(total=80 << 30)
    assert apply_process_limits("cuda:1", 20 << 30, cuda=cuda) == 0.25
    assert cuda.calls == [("set_device", 1), ("mem_get_info", 1), ("set_per_process_memory_fraction", 0.25, 1)]
    import torch

    assert torch.get_num_threads() == 1


@pytest.mark.usefixtures("keep_torch_threads")
def test_under_an_mps_memory_limit_the_fraction_is_of_what_the_process_sees() -> None:
    # An 80 GiB device, an MPS pinned limit of 8 GiB for this client: torch multiplies the fraction by the 8 GiB
    # cudaMemGetInfo reports, so a 4 GiB cap is 0.5 of it (0.05 of the physical 80 GiB would cap at 0.4 GiB).
    cuda = FakeCuda(total=80 << 30, visible=8 << 30)
    assert apply_process_limits("cuda:0", 4 << 30, cuda=cuda) == 0.5
    assert cuda.calls[-1] == ("set_per_process_memory_fraction", 0.5, 0)
    assert ("get_device_properties", 0) not in cuda.calls


@pytest.mark.usefixtures("keep_torch_threads")
def test_a_limit_above_the_device_caps_at_the_whole_device_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    cuda = FakeCuda(total=80 << 30)
    assert apply_process_limits("cuda:0", 100 << 30, cuda=cuda) == 1.0
    assert cuda.calls[-1] == ("set_per_process_memory_fraction", 1.0, 0)
    err = capsys.readouterr().err
    assert "exceeds cuda:0's 85899345920 bytes" in err
    assert "Lower the fill job's spec.memory" in err


@pytest.mark.usefixtures("keep_torch_threads")
@pytest.mark.parametrize(("device", "memory"), [("cuda:0", 0), ("cuda:0", None), ("cpu", 1 << 30), ("cpu:1", None)])
def test_no_limit_or_a_cpu_device_caps_nothing(device: str, memory: int | None) -> None:
    cuda = FakeCuda()
    assert apply_process_limits(device, memory, cuda=cuda) is None
    # A GPU fill process still makes its device the current one, so nothing lands on device 0 by default.
    assert cuda.calls == ([("set_device", 0)] if device.startswith("cuda") else [])


@pytest.mark.usefixtures("keep_torch_threads")
@pytest.mark.parametrize(
    ("device", "memory", "cuda", "error", "needle"),
    [
        ("cuda:0", -1, FakeCuda(), ValueError, "memory limit must be an int number of bytes >= 0, got -1"),
        ("cuda:0", 1.5, FakeCuda(), ValueError, "check $BUBBLES_MEMORY_BYTES or the fill job's spec.memory"),
        ("cuda:0", True, FakeCuda(), ValueError, "memory limit must be an int"),
        ("gpu:0", 1 << 30, FakeCuda(), ValueError, "neither 'cpu', 'cpu:K' nor 'cuda:N'"),
        ("cuda:2", 1 << 30, FakeCuda(devices=2), RuntimeError, "sees 2 CUDA device(s) (check CUDA_VISIBLE_DEVICES"),
        ("cuda:0", 1 << 30, FakeCuda(available=False), RuntimeError, "CUDA is not available in this fill process"),
    ],
)
def test_bad_limits_and_devices_are_refused_with_a_reason(device: str, memory: Any, cuda: FakeCuda,
                                                          error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as err:
        apply_process_limits(device, memory, cuda=cuda)
    assert needle in str(err.value)
    assert not [c for c in cuda.calls if c[0] == "set_per_process_memory_fraction"]


@pytest.mark.usefixtures("keep_torch_threads")
def test_the_real_torch_cuda_on_this_cpu_machine_is_refused_with_a_reason() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        apply_process_limits("cuda:0", 1 << 30)


class _CudaState:
    """Stands in for what ``cuda_contexts`` asks torch: whether CUDA was initialised, how many devices, and on which
    the process holds a (primary) context."""

    def __init__(self, initialized: bool, contexts: set[int], count: int = 2) -> None:
        self.initialized, self.contexts, self.count = initialized, contexts, count

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.count

    def has_primary_context(self, index: int) -> bool:
        return index in self.contexts


def test_contexts_are_the_devices_holding_one_and_none_before_cuda_is_initialised() -> None:
    assert cuda_contexts(_CudaState(True, {1})) == {1}
    assert cuda_contexts(_CudaState(True, set())) == set()  # initialised by a query (device properties): no context
    assert cuda_contexts(_CudaState(False, {0})) == set()
    assert cuda_contexts() == set()  # this CPU build of torch: it cannot say, so nothing is refused


def test_a_create_that_made_a_cuda_context_is_refused_on_a_gpu_executor_only() -> None:
    with pytest.raises(RuntimeError, match=r"create\(\) made a CUDA context \(on device 0\) .*cuda:1.* into init\(\)"):
        check_create_left_cuda_alone("cuda:1", frozenset(), frozenset({0}))
    check_create_left_cuda_alone("cuda:1", frozenset({0}), frozenset({0}))  # there before create(): not the job's
    check_create_left_cuda_alone("cuda:1", frozenset(), frozenset())
    check_create_left_cuda_alone("cpu:0", frozenset(), frozenset({0}))  # a CPU executor has no device to land on


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_a_query_makes_no_context_and_an_allocation_does() -> None:
    """What the create() check rests on, with the real driver, in a fresh process: attaching's device query (as
    bubbles.training.probes.gpu_uuid makes it) leaves no context, a tensor on the device makes one there."""
    script = textwrap.dedent("""
        import torch
        from bubbles.training.probes import gpu_uuid
        from bubbles.training.sdk import cuda_contexts
        print("start", sorted(cuda_contexts()))
        gpu_uuid("cuda:0")
        print("queried", torch.cuda.is_initialized(), sorted(cuda_contexts()))
        torch.zeros(1, device="cuda:0")
        print("allocated", sorted(cuda_contexts()))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["start []", "queried True []", "allocated [0]"], done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_a_blocking_fill_wait_sleeps_and_a_spinning_one_holds_a_core() -> None:
    """``CudaDeviceSync`` with the real driver, in a fresh process (so the context's schedule is the default): while
    a 300 ms kernel drains, the blocking wait uses a small part of a host core and the spinning one most of it; both
    return only after the kernel."""
    script = textwrap.dedent("""
        import time, torch
        from bubbles.training.sdk import device_sync_for
        torch.cuda.set_device(0)
        torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(); torch.cuda._sleep(50_000_000); end.record(); end.synchronize()
        cycles_per_ms = 50_000_000 / start.elapsed_time(end)
        for wait in ("block", "spin"):
            sync = device_sync_for("cuda:0", wait=wait)
            sync.synchronize()
            torch.cuda._sleep(int(300 * cycles_per_ms))
            wall, cpu = time.perf_counter(), time.process_time()
            sync.synchronize()
            print(wait, round(time.perf_counter() - wall, 3), round(time.process_time() - cpu, 3))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    waits = {line.split()[0]: (float(line.split()[1]), float(line.split()[2])) for line in done.stdout.splitlines()}
    for wall, _cpu in waits.values():
        assert wall >= 0.2, done.stdout  # the wait lasted until the kernel had run
    assert waits["block"][1] < 0.25 * waits["block"][0], done.stdout
    assert waits["spin"][1] > 0.5 * waits["spin"][0], done.stdout
