"""The fill-job runtime (bubbles.sdk) in-process, and the example fill jobs."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_agent_jobs import BusyJob

from bubbles.agent.ledger import HarvestLedger
from bubbles.core import control, wire
from bubbles.core.api import FillMode
from bubbles.training.gating import StartPredictor, StepGates
from bubbles.training.sdk import (
    INIT_PROFILE_STEPS,
    PROFILE_MARGIN,
    CudaDeviceSync,
    DeviceSync,
    FillRuntime,
    IterativeFillJob,
    StepResult,
    apply_process_limits,
    check_step_sizes,
    cuda_device_index,
    device_sync_for,
    fill_wait,
    load_entry,
    run_fill_process,
    spin_window_ns,
)


class Channel:
    """The agent's end of a runtime's control socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines = control.LineBuffer()
        self.events: list[control.ControlMessage] = []
        sock.settimeout(0.05)

    def send(self, type_: str, **fields: Any) -> None:
        self.sock.sendall(control.encode(type_, **fields))

    def wait(self, type_: str, timeout_s: float = 5.0, **match: Any) -> control.ControlMessage:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events:
                if ev.type == type_ and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.events += [control.parse_event(line) for line in self.lines.feed(data)]
        got = [e.type for e in self.events]
        raise AssertionError(f"no {type_} {match} event within {timeout_s} s; got {got}")


    def count(self, type_: str, **match: Any) -> int:
        return sum(1 for ev in self.events if ev.type == type_ and all(ev.get(k) == v for k, v in match.items()))

    def wait_count(self, n: int, type_: str, timeout_s: float = 5.0, **match: Any) -> None:
        """Wait until ``n`` events of this type (and fields) have arrived."""
        deadline = time.monotonic() + timeout_s
        while self.count(type_, **match) < n:
            assert time.monotonic() < deadline, f"fewer than {n} {type_} {match} events within {timeout_s} s"
            with contextlib.suppress(TimeoutError):
                self.events += [control.parse_event(line) for line in self.lines.feed(self.sock.recv(65536))]


@contextlib.contextmanager
def serving(path: Path, job: BusyJob, **kwargs: Any) -> Iterator[tuple[Channel, FillRuntime]]:
    """A FillRuntime serving ``job`` in a thread, its control channel, and a check that it cleans up."""
    ours, theirs = socket.socketpair()
    rt = FillRuntime(job, theirs, name="busy", socket_path=str(path), **{"step_s": None, **kwargs})
    thread = threading.Thread(target=rt.serve, daemon=True)
    thread.start()
    try:
        yield Channel(ours), rt
    finally:
        ours.close()
        thread.join(5)
    assert not thread.is_alive()
    assert not path.exists(), "the runtime left its socket behind"


@pytest.fixture
def runtime(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=1.0)) as (ch, rt):
        yield ch, rt, path


def init_and_arm(ch: Channel, path: Path, share: float = 1.0) -> None:
    """Initialize the runtime, arm it in harvest mode at ``share`` and wait until it listens on ``path``."""
    ch.send("init")
    ch.wait("state", state="PAUSED")
    ch.send("arm", mode="harvest", share=share)
    wait_for_socket(path)


def wait_for_socket(path: Path) -> None:
    deadline = time.monotonic() + 5
    while not path.exists():
        assert time.monotonic() < deadline, "the runtime did not bind its signal socket"
        time.sleep(0.001)


def test_runtime_profiles_at_init_then_gates_steps_by_the_program_directed_limit(runtime) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init")
    ch.wait("state", state="PAUSED")
    assert rt.job.initialized
    # No step time in the spec: the runtime timed steps during init (not reported as fill work).
    step_s = ch.wait("profile")["step_s"]
    assert 1e-3 * 1.2 <= step_s < 0.010
    assert not [e for e in ch.events if e.type == "step"]
    # This test checks the profiled gate: no learning from in-bubble steps (fewer than min_samples run here).
    rt.gates = StepGates([(None, step_s)], window=32, min_samples=32)
    ch.sock.sendall(b"not a command\n")
    assert "rejected command" in ch.wait("error")["message"]
    ch.send("arm", mode="harvest", share=1.0)
    deadline = time.monotonic() + 5
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    seq = 0

    def bubble(duration_s: float) -> None:
        nonlocal seq
        seq += 1
        start = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(duration_s * 1e9)), str(path))
        time.sleep(duration_s)
        sig.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(path))

    # Gated: a bubble shorter than the step time runs nothing; a long one runs several steps.
    bubble(step_s / 2)
    bubble(0.012)
    ch.wait("step", bubble_seq=2)
    time.sleep(0.02)
    ch.wait("state", state="PAUSED")
    gated = [e for e in ch.events if e.type == "step"]
    assert {e["bubble_seq"] for e in gated} == {2}
    assert 2 <= len(gated) <= 12
    for e in gated:
        assert e["signal_ns"] <= e["start_ns"] and e["flops"] == 1e6 and e["mode"] == "harvest"
        # The program-directed limit: a step starts only if it fits before the predicted end.
        assert e["start_ns"] + step_s * 1e9 <= e["signal_ns"] + 0.012 * 1e9 + 1
    ch.send("stop")


def test_runtime_naive_mode_runs_back_to_back_and_disarm_pauses(runtime) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init")
    ch.wait("state", state="PAUSED")
    ch.send("arm", mode="naive")
    ch.wait("state", state="RUNNING")
    deadline = time.monotonic() + 5
    while rt.steps < 20:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not path.exists()  # naive mode listens to no bubbles
    ch.send("disarm")
    ch.wait("state", state="PAUSED")
    ch.wait("step", mode="naive", bubble_seq=-1)
    ch.send("stop")


def test_load_entry_rejects_what_is_not_a_fill_job() -> None:
    with pytest.raises(ValueError, match="must look like"):
        load_entry("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_entry("no.such.module:Job")
    with pytest.raises(ValueError, match="not a subclass"):
        load_entry("json:JSONDecoder")
    assert load_entry("bubbles.fill_examples.image_classification:ImageClassification").__name__ == \
        "ImageClassification"


@pytest.mark.parametrize(
    ("entry", "kwargs"),
    [
        ("bubbles.fill_examples.image_classification:ImageClassification", {"batch_size": 2}),
        ("bubbles.fill_examples.batch_inference:BatchInference", {"batch_size": 4}),
    ],
)
def test_example_fill_jobs_run_steps_and_report_flops(entry: str, kwargs: dict[str, Any]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = load_entry(entry)(**kwargs, steps=3)
        job.create()
        job.init()
        results = []
        while not job.is_finished():
            results.append(job.step())
        assert len(results) == 2  # the first of the 3 steps ran in init(), counting FLOPs
        assert all(isinstance(r, StepResult) and r.flops > 0 and r.samples > 0 for r in results)
        assert {r.flops for r in results} == {job.step_flops}  # counted once, reused
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------
# GPU work a step queued: it must finish inside the step (stand-ins for torch.cuda, no GPU here)


class SlowDeviceSync(DeviceSync):
    """Stands in for ``torch.cuda.synchronize()`` while the GPU still runs ``queued_s`` of kernels the step
    launched: the host thread blocks, idle, until they finish (a sleep is exactly that)."""

    def __init__(self, queued_s: float) -> None:
        self.queued_s = queued_s
        self.calls = 0

    def synchronize(self) -> None:
        self.calls += 1
        time.sleep(self.queued_s)


class HookedBusyJob(BusyJob):
    """BusyJob that runs ``during_next_step`` (once) inside its next step: to make something happen while
    the step's GPU work is still queued."""

    during_next_step: Callable[[], None] | None = None

    def step(self) -> StepResult:
        hook, self.during_next_step = self.during_next_step, None
        if hook is not None:
            hook()
        return super().step()


def test_queued_gpu_work_counts_in_the_step_time_the_gate_and_the_overrun(tmp_path: Path) -> None:
    queued_s = 0.030
    sync = SlowDeviceSync(queued_s)
    job = HookedBusyJob(step_ms=1.0)
    path = tmp_path / "fill-busy.sock"
    with serving(path, job, device_sync=sync) as (ch, _rt):
        ch.send("init")  # imports torch (apply_process_limits): seconds on a loaded machine
        # The init-time profiler waits for the GPU too: the gating step time is GPU time, not launch time.
        step_s = ch.wait("profile", timeout_s=60)["step_s"]
        assert sync.calls == INIT_PROFILE_STEPS
        assert (0.001 + queued_s) * PROFILE_MARGIN <= step_s < 0.5
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

        def start_bubble(seq: int, predicted_s: float) -> tuple[int, int]:
            start = time.monotonic_ns()
            sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(predicted_s * 1e9)), str(path))
            return start, start + int(predicted_s * 1e9)

        def end_bubble(seq: int) -> int:
            end = time.monotonic_ns()
            sig.sendto(wire.encode_bubble_end(0, 0, seq, end), str(path))
            return end

        # (b) The gate: a 25 ms bubble would hold 20 host-side steps of 1 ms, but not one 31 ms GPU step.
        start_bubble(1, 0.025)
        time.sleep(0.025)
        end_bubble(1)
        # A 150 ms bubble runs steps; each starts only if its profiled time fits before the predicted end.
        _, predicted_end = start_bubble(2, 0.150)
        time.sleep(0.150)
        end_bubble(2)
        ch.wait_count(2, "state", state="PAUSED")  # init's, then the end of bubble 2's pass
        steps = [e for e in ch.events if e.type == "step"]
        assert {e["bubble_seq"] for e in steps} == {2}
        # Each step lasts at least its GPU time, and the last one started no later than end - step_s.
        assert 1 <= len(steps) <= 1 + int((0.150 - step_s) / (queued_s + 0.001))
        for e in steps:
            assert e["start_ns"] + step_s * 1e9 <= predicted_end + 1
            # (a) The reported end is after the GPU finished: the step's time includes the synchronize.
            assert e["sync_ns"] >= queued_s * 1e9
            assert e["end_ns"] - e["start_ns"] >= e["sync_ns"] + job.step_ns

        # The training comes back while the step's kernels are still queued (the bubble was shorter than
        # predicted): the agent's overrun (step end - bubble end) is the time the GPU stayed busy after it.
        # The hook is set before the bubble starts: set after, a loaded machine could run the bubble's first step
        # before it (found by a clean-clone run), and the end would come in a second step instead.
        ended: list[int] = []
        job.during_next_step = lambda: ended.append(end_bubble(3))
        bubble_start, _ = start_bubble(3, 0.150)
        step = ch.wait("step", bubble_seq=3)
        ledger = HarvestLedger()
        ledger.add_bubble(0, bubble_start, ended[0])
        ledger.add_step(0, "busy", step["start_ns"], step["end_ns"], step["flops"])
        totals = ledger.totals()
        assert totals.overruns == 1
        assert totals.overrun_s * 1e9 == pytest.approx(step["end_ns"] - ended[0], abs=1)
        assert totals.overrun_s * 1e9 >= step["sync_ns"] >= queued_s * 1e9
        ch.wait_count(3, "state", state="PAUSED")
        assert ch.count("step", bubble_seq=3) == 1  # the bubble had ended: no second step
        assert sync.calls == INIT_PROFILE_STEPS + ch.count("step")
        sig.close()
        ch.send("stop")


def test_naive_steps_wait_for_their_device_work_too(tmp_path: Path) -> None:
    sync = SlowDeviceSync(0.0)
    with serving(tmp_path / "fill-busy.sock", BusyJob(step_ms=0.2), device_sync=sync, step_s=0.001) as (ch, rt):
        ch.send("init")
        ch.wait("state", state="PAUSED", timeout_s=60)
        assert sync.calls == 0  # a step time was given: nothing profiled
        ch.send("arm", mode="naive")
        deadline = time.monotonic() + 5
        while rt.steps < 10:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        ch.send("disarm")
        ch.wait_count(2, "state", state="PAUSED")
        ch.wait_count(rt.steps, "step", mode="naive")
        assert sync.calls == rt.steps == ch.count("step")
        assert all(e["sync_ns"] >= 0 for e in ch.events if e.type == "step")
        ch.send("stop")


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
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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
    assert isinstance(sync, CudaDeviceSync) and sync.wait == "block"
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
    assert "exceeds cuda:0's 85899345920 bytes" in err and "Lower the fill job's spec.memory" in err


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


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({control.DEVICE_ENV: "gpu"}, "device 'gpu' is neither"),
        ({control.MEMORY_ENV: "2Gi"}, "$BUBBLES_MEMORY_BYTES='2Gi' is not an integer number of bytes >= 0"),
        ({control.MEMORY_ENV: "-5"}, "$BUBBLES_MEMORY_BYTES='-5'"),
        ({control.FILL_WAIT_ENV: "poll"}, "$BUBBLES_FILL_WAIT='poll': give 'block'"),
    ],
)
def test_the_fill_process_refuses_a_bad_device_memory_limit_or_wait(env: dict[str, str], needle: str,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_fill_process(["--entry", "test_agent_jobs:BusyJob"]) == 2
    assert needle in capsys.readouterr().err


class Counter(IterativeFillJob):
    """Counts its steps; its state is the count."""

    def __init__(self) -> None:
        self.count = 0

    def step(self) -> None:
        self.count += 1

    def checkpoint(self) -> bytes | None:
        return str(self.count).encode()

    def restore(self, state: bytes) -> None:
        self.count = int(state)


def test_a_job_resumes_from_the_state_its_last_attempt_saved(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.training.sdk import CheckpointStore

    monkeypatch.delenv("BUBBLES_CHECKPOINT", raising=False)
    assert CheckpointStore.from_environment() is None
    monkeypatch.setenv("BUBBLES_CHECKPOINT", str(tmp_path / "ckpt"))
    store = CheckpointStore.from_environment()
    assert store is not None
    first = Counter()
    assert store.restore(first) is False  # nothing saved yet: start from the beginning
    for _ in range(7):
        first.step()
    assert store.save(first) is True
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["state.bin"]  # no temporary file left
    second = Counter()
    assert store.restore(second) is True and second.count == 7
    assert store.save(IterativeFillJob()) is False  # a job without state writes nothing


def test_an_unreadable_checkpoint_means_starting_over_with_a_warning(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from bubbles.training.sdk import CheckpointStore

    (tmp_path / "state.bin").mkdir()  # a directory where the state file should be
    assert CheckpointStore(tmp_path).restore(Counter()) is False
    assert "starting over" in capsys.readouterr().err


class BrokenAtCreate(IterativeFillJob):
    def create(self) -> None:
        open("/no/such/dataset.bin", "rb")  # noqa: SIM115

    def step(self) -> None:
        raise AssertionError("never reached")


def test_a_failing_job_tells_the_agent_what_failed_and_where(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent logs the message and the operator puts it in the FillJob's Events: by the time someone reads it, the
    fill Pod and its log may be gone, so the message says where the error was raised."""
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(control.CONTROL_FD_ENV, str(theirs.fileno()))
    monkeypatch.setenv(control.JOB_ENV, "broken")
    with pytest.raises(FileNotFoundError):
        run_fill_process(["--entry", "test_sdk:BrokenAtCreate"])
    ours.settimeout(5)
    events = [json.loads(line) for line in ours.recv(65536).decode().splitlines() if line]
    (err,) = [e for e in events if e.get("type") == "error"]
    assert err["message"].startswith("FileNotFoundError: [Errno 2] No such file or directory: '/no/such/dataset.bin'")
    assert f"(at {__file__}:" in err["message"] and "in create)" in err["message"]
    ours.close()


def test_attaching_reads_the_welcome_only_and_leaves_the_agents_next_commands_on_the_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent may send its first command (init) right behind the welcome, in the same segment: the SDK must not
    swallow it with the welcome (the cluster tier saw fill Pods fail with 'reply line is not JSON (Extra data)')."""
    import threading

    from bubbles.core import paths
    from bubbles.training.sdk import attach_to_agent

    monkeypatch.setenv(paths.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(control.UID_ENV, "uid-1")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    paths.make_private_dir(paths.attach_dir(tmp_path))
    server.bind(str(paths.attach_socket(tmp_path)))
    server.listen(1)

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)  # the hello
            conn.sendall(control.encode("welcome", job="j-a0", socket=str(tmp_path / "f.sock"), stage=0)
                         + control.encode("init"))
            conn.recv(1)  # until the client closes

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    sock, welcome = attach_to_agent("cpu", timeout_s=10)
    assert welcome.type == "welcome" and welcome["job"] == "j-a0"
    sock.settimeout(10)
    assert control.parse_command(sock.recv(4096)).type == "init"  # still there for the control channel
    sock.close()
    t.join(10)
    server.close()


# -- busy-polling around the predicted bubble start ------------------------------------------------------------
def test_the_next_start_is_each_slots_last_start_plus_its_period() -> None:
    p = StartPredictor()
    assert p.next_start(0, 0) is None
    p.started(0, 1_000)
    assert p.next_start(1_000, 0) is None  # one start of a slot: no period yet
    p.started(0, 4_000)
    p.started(1, 2_500)
    p.started(1, 5_500)
    assert p.next_start(5_600, 100) == 7_000  # slot 0: 4,000 + 3,000; slot 1: 8,500
    assert p.next_start(7_050, 100) == 7_000  # within the slack after it: still that start
    assert p.next_start(7_200, 100) == 8_500
    assert p.next_start(13_200, 100) == 14_500  # slot 1 missed 8,500 and 11,500: projected forward
    p.started(0, 3_000)  # out of order (an old datagram): no negative period, the last period stays
    assert p.next_start(3_100, 0) == 6_000


@pytest.mark.parametrize(("text", "ns"), [("", 0), ("0", 0), ("150", 150_000), (" 2.5 ", 2_500)])
def test_the_spin_window_comes_from_the_environment_in_microseconds(text: str, ns: int) -> None:
    assert spin_window_ns(text) == ns


@pytest.mark.parametrize("text", ["fast", "-1", "20000", "nan"])
def test_a_bad_spin_window_says_what_to_give(text: str) -> None:
    with pytest.raises(ValueError, match="give microseconds from 0"):
        spin_window_ns(text)


def test_the_fast_signal_decoder_agrees_with_decode_on_every_input() -> None:
    good = [wire.encode_bubble_start(1, 2, 3, 10, 20), wire.encode_bubble_end(1, 2, 3, 30)]
    for data in good:
        fast, msg = wire.decode_signal(data), wire.decode(data)
        assert fast is not None and fast[2] == msg.seq
        assert fast[3] == (msg.start_ns if isinstance(msg, wire.BubbleStart) else msg.end_ns)
    start_before_end = bytearray(wire.encode_bubble_start(1, 2, 3, 10, 20))
    start_before_end[20:28] = (5).to_bytes(8, "little")  # predicted end before the start
    others = [wire.encode_iteration(0, 1, 2, 3), wire.encode_fill_mode(0, FillMode.OFF), b"BB" + bytes(26), b"x" * 28,
              bytes(start_before_end)]
    for data in others:
        assert wire.decode_signal(data) is None  # decode handles (or rejects) these
    with pytest.raises(wire.WireError):
        wire.decode(bytes(start_before_end))


def test_a_spinning_runtime_catches_a_predicted_bubble_and_still_obeys_commands(tmp_path: Path) -> None:
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=0.2), step_s=0.0005) as (ch, rt):
        rt.spin_ns = 2_000_000  # 2 ms either side: the test's sleeps are not precise
        init_and_arm(ch, path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        period = 0.010
        t0 = time.monotonic_ns()
        bubbles = 16
        for seq in range(1, bubbles + 1):  # a bubble every 10 ms on slot 0
            start = t0 + int(seq * period * 1e9)
            while time.monotonic_ns() < start:
                time.sleep(0.0002)
            sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + 3_000_000), str(path))
            time.sleep(0.003)
            sig.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(path))
        # A last, long bubble: once it has a step, every datagram before it (same socket, in order) was handled.
        last = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 0, bubbles + 1, last, last + 50_000_000), str(path))
        ch.wait("step", bubble_seq=bubbles + 1)
        sig.sendto(wire.encode_bubble_end(0, 0, bubbles + 1, time.monotonic_ns()), str(path))
        steps = [e for e in ch.events if e.type == "step"]
        # Once a period is known, (nearly) every bubble is harvested: a START the test's thread sends late on this
        # loaded machine (its sleeps overshoot) may leave no room for a step, hence a share, not all of them.
        known = set(range(3, bubbles + 1))
        harvested = known & {e["bubble_seq"] for e in steps}
        assert len(harvested) >= 0.8 * len(known), sorted(harvested)
        assert rt.predictor.next_start(time.monotonic_ns(), 2_000_000) is not None
        # Most of those starts were read while spinning, not woken from poll.
        assert rt.spin_caught >= len(harvested) // 2, (rt.spin_caught, len(harvested))
        ch.send("disarm")  # commands still reach a runtime that spins
        ch.wait("state", state="PAUSED")
        ch.send("stop")


class SleepStepJob(BusyJob):
    """Steps that sleep (release the GIL), so the test's thread keeps its timing while the runtime's runs."""

    def step(self) -> StepResult:
        time.sleep(self.step_ns / 1e9)
        return StepResult(flops=self.flops, samples=1)


class HeldStepJob(SleepStepJob):
    """A SleepStepJob whose first step after ``hold`` is set up lasts until the test releases it."""

    hold: threading.Event | None = None

    def step(self) -> StepResult:
        if self.hold is not None:
            held, self.hold = self.hold, None
            held.wait(10)
        return super().step()


def test_a_bubble_that_opens_while_the_last_step_of_the_previous_one_runs_is_harvested(tmp_path: Path) -> None:
    """Back-to-back bubbles (a stage's last bubble of one iteration, then its first of the next): the previous
    bubble's last step outlives it, and the next one's START is read together with the END. The runtime must
    harvest the bubble already open, not go back to sleep until that bubble's END arrives."""
    path = tmp_path / "fill-busy.sock"
    job = HeldStepJob(step_ms=6.0)
    with serving(path, job, step_s=0.006) as (ch, _rt):
        init_and_arm(ch, path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        release = job.hold = threading.Event()  # the first bubble's step lasts until both datagrams are sent
        t0 = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 1, 1, t0, t0 + 30_000_000), str(path))
        ch.wait("step_begin", bubble_seq=1)
        t1 = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_end(0, 1, 1, t1), str(path))
        sig.sendto(wire.encode_bubble_start(0, 0, 2, t1, t1 + 40_000_000), str(path))
        release.set()
        time.sleep(0.040)
        sig.sendto(wire.encode_bubble_end(0, 0, 2, time.monotonic_ns()), str(path))
        ch.wait_count(2, "state", state="PAUSED", timeout_s=5)
        by_bubble = [e["bubble_seq"] for e in ch.events if e.type == "step"]
        assert by_bubble.count(1) == 1  # the first bubble's one step, cut short by its END
        assert by_bubble.count(2) >= 2, f"the bubble opened mid-step was slept through: steps {by_bubble}"
        ch.send("stop")


def test_step_gates_start_from_the_profile_then_follow_in_bubble_steps_first_steps_apart() -> None:
    g = StepGates([(1, 0.001), (4, 0.003)], window=10, min_samples=4)
    assert g.fitting(2_000_000, first=True) == [1] and g.fitting(3_000_000, first=False) == [1, 4]
    assert g.fitting(999_999, first=False) == []
    for _ in range(3):
        g.observe(4, True, 5_000_000)  # first steps pay for cold caches
    assert g.gate_ns(4, True) == 3_000_000  # fewer than min_samples: still the profile's
    g.observe(4, True, 5_000_000)
    assert g.gate_ns(4, True) == 5_000_000 and g.gate_ns(4, False) == 3_000_000  # later steps kept apart
    assert g.fitting(4_000_000, first=True) == [1] and g.fitting(4_000_000, first=False) == [1, 4]
    for _ in range(10):
        g.observe(4, True, 2_000_000)  # the window forgets
    assert g.gate_ns(4, True) == 2_000_000
    assert g.first_steps_s() == [(1, 0.001), (4, 0.002)]
    floored = StepGates([(None, 0.0015)], min_samples=1, floors={None: 0.0015})  # a step time the spec states
    floored.observe(None, False, 1_000_000)
    assert floored.gate_ns(None, False) == 1_500_000  # measured shorter: the stated time still holds
    for bad in ({"profiled": []}, {"profiled": [(None, 0.001)], "window": 0},
                {"profiled": [(None, 0.001)], "min_samples": 0}):
        with pytest.raises(ValueError, match="StepGates"):
            StepGates(**bad)  # type: ignore[arg-type]


class PreemptedJob(BusyJob):
    """Steps of 1 ms, a few of them stretched as by a training computing beside the profile (scripted)."""

    def __init__(self, slow_ms: tuple[float, ...]) -> None:
        super().__init__(step_ms=1.0)
        self.slow_ms = list(slow_ms)

    def step(self) -> StepResult:
        if self.slow_ms:
            time.sleep(self.slow_ms.pop(0) / 1e3)
        return super().step()


def send_bubbles(path: Path, count: int, *, length_s: float, gap_s: float, sleep_s: float | None = None) -> None:
    """Bubbles 1..count to the runtime's socket as the hook sends them: START (predicted ``length_s``), a sleep
    (``sleep_s``, default the length), END, then ``gap_s`` before the next."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sig:
        for seq in range(1, count + 1):
            start = time.monotonic_ns()
            sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(length_s * 1e9)), str(path))
            time.sleep(length_s if sleep_s is None else sleep_s)
            sig.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(path))
            time.sleep(gap_s)


def test_a_profile_that_fits_no_bubble_falls_back_to_its_median_after_32_starved_bubbles(tmp_path: Path) -> None:
    """Init's profile steps compete with the training, and a gate no bubble fits lets no step run, so never learns
    (the cluster tier's example job: 14.5 ms for a 1.5 ms step, ten minutes at 0 steps). The 90th percentile stays
    the gate (the demo fills more with it); after STARVED_BUBBLES bubbles in a row that the median would have fitted,
    the gates fall back to the median, once, and the agent is told."""
    from bubbles.training.sdk import STARVED_BUBBLES

    slow = (0, 0, 0, 0, 0, 30, 0, 0, 30, 0)  # after the 2 warm-up steps: 2 of 8 stretched by 30 ms
    assert len(slow) == INIT_PROFILE_STEPS
    path = tmp_path / "fill-busy.sock"
    with serving(path, PreemptedJob(slow)) as (ch, rt):
        ch.send("init")
        step_s = ch.wait("profile", timeout_s=60)["step_s"]
        assert step_s > 0.030 * PROFILE_MARGIN, step_s  # the 90th percentile: a stretched step
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        send_bubbles(path, STARVED_BUBBLES + 8, length_s=0.010, gap_s=0.002)
        ch.wait_count(2, "profile", timeout_s=5)
        relaxed = [e for e in ch.events if e.type == "profile"][1]["step_s"]
        assert relaxed < 0.005, relaxed  # the median: about 1.2 ms
        ch.wait("step", timeout_s=5)
        steps = [e for e in ch.events if e.type == "step"]
        assert rt.relaxed and min(e["bubble_seq"] for e in steps) >= STARVED_BUBBLES, [e["bubble_seq"] for e in steps]
        ch.send("stop")


def test_bubbles_too_short_even_for_the_median_do_not_relax_the_gates(tmp_path: Path) -> None:
    from bubbles.training.sdk import STARVED_BUBBLES

    path = tmp_path / "fill-busy.sock"
    with serving(path, PreemptedJob((0,) * INIT_PROFILE_STEPS)) as (ch, rt):  # 1 ms steps, gated at about 1.2 ms
        ch.send("init")
        ch.wait("profile", timeout_s=60)
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        send_bubbles(path, STARVED_BUBBLES + 4, length_s=0.0003, sleep_s=0.001, gap_s=0.0)  # 0.3 ms predicted
        time.sleep(0.1)
        assert not rt.relaxed and ch.count("step") == 0 and ch.count("profile") == 1
        ch.send("stop")


class SizedJob(BusyJob):
    """Steps of 1 or 4 units; a unit sleeps 1 ms (so the test's thread keeps its timing)."""

    step_sizes = (4, 1)  # any order: the runtime sorts them

    def __init__(self) -> None:
        super().__init__()
        self.sizes_run: list[int] = []

    def step(self, size: int) -> StepResult:  # type: ignore[override]
        time.sleep(size * 0.001)
        self.sizes_run.append(size)
        return StepResult(flops=size * 1e6, samples=size)


def test_a_job_with_step_sizes_runs_the_largest_that_fits_and_fills_the_tail_with_smaller_ones(
        tmp_path: Path) -> None:
    path = tmp_path / "fill-busy.sock"
    job = SizedJob()
    with serving(path, job) as (ch, _rt):
        ch.send("init")
        prof = ch.wait("profile")
        sizes = dict(prof["sizes"])
        assert set(sizes) == {1, 4} and 0.001 <= sizes[1] < sizes[4] and prof["step_s"] == sizes[1]
        assert set(job.sizes_run) == {1, 4}  # both were timed at init
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        job.sizes_run.clear()
        start = time.monotonic_ns()
        # Two whole steps, then room for a small step (2.5 small steps' time: slack for the steps' sleeps
        # overshooting on a loaded machine), not for a third big one.
        length_ns = int((sizes[4] * 2 + sizes[1] * 2.5) * 1e9)
        sig.sendto(wire.encode_bubble_start(0, 0, 1, start, start + length_ns), str(path))
        time.sleep(length_ns / 1e9 + 0.005)
        sig.sendto(wire.encode_bubble_end(0, 0, 1, time.monotonic_ns()), str(path))
        ch.wait_count(2, "state", state="PAUSED", timeout_s=5)
        steps = [e for e in ch.events if e.type == "step"]
        assert [e["size"] for e in steps] == job.sizes_run
        assert job.sizes_run[0] == 4, job.sizes_run  # big first
        for e in steps:  # every step was gated by its own size's time
            assert e["start_ns"] + sizes[e["size"]] * 1e9 <= start + length_ns + 1
        # The tail small: after the last big step, a small one ran whenever one still fit.
        last_big = max(i for i, e in enumerate(steps) if e["size"] == 4)
        room_ns = start + length_ns - steps[last_big]["end_ns"]
        small_after = [e["size"] for e in steps[last_big + 1:]]
        # Slack: the runtime's own work between steps (signals drained, the channel polled) comes out of the room,
        # and took more than 200 us once with the rest of the suite running beside it (room 1.533 ms, step 1.330 ms).
        assert 1 in small_after or room_ns < sizes[1] * 1e9 + 500_000, (job.sizes_run, room_ns / 1e6)
        ch.send("stop")


@pytest.mark.parametrize("sizes", [[0], [2, 2], ["4"], [True], 3, [1.5]])
def test_bad_step_sizes_stop_the_job_at_init_saying_what_they_must_be(sizes: Any) -> None:
    with pytest.raises(ValueError, match="step_sizes must"):
        check_step_sizes(sizes)
    assert check_step_sizes([8, 2]) == (2, 8) and check_step_sizes(()) == ()


@pytest.mark.parametrize("kwargs", [{"step_sizes": [0]}, {"step_sizes": [5]}, {"step_sizes": "all"}])
def test_the_example_jobs_refuse_step_sizes_outside_their_batch(kwargs: dict[str, Any]) -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    with pytest.raises(ValueError, match="from 1 to batch_size"):
        ImageClassification(batch_size=4, **kwargs)
    assert ImageClassification(batch_size=4).step_sizes == (1, 2, 4)
    assert ImageClassification(batch_size=4, step_sizes=[]).step_sizes == ()


def test_example_part_batches_count_their_own_flops_and_their_share_of_the_work(keep_torch_threads: None) -> None:
    import torch

    from bubbles.fill_examples.batch_inference import BatchInference

    torch.set_num_threads(1)
    job = BatchInference(batch_size=8, steps=2)  # two whole batches of work
    job.create()
    job.init()  # counts sizes 2, 4 and 8: 14 samples, more than one batch
    assert job.step_sizes == (2, 4, 8)
    flops = job.flops_by_size
    assert flops[2] < flops[4] < flops[8] and flops[8] == pytest.approx(4 * flops[2], rel=0.05)
    assert not job.is_finished()
    r = job.step(2)
    assert r.samples == 2 and r.flops == flops[2] and job.is_finished()  # 16 samples = 2 batches
    with pytest.raises(ValueError, match="between 1 and the batch size"):
        job.step(9)


def test_a_field_a_newer_agent_adds_is_ignored_and_named_once_on_stderr(runtime, capfd) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init", trace=True)
    ch.wait("state", state="PAUSED")
    ch.send("arm", mode="harvest", share=1.0, trace=True)
    wait_for_socket(path)  # armed: the command was not refused for its extra field
    ch.send("share", share=0.5, trace=False)
    deadline = time.monotonic() + 5
    while rt.share != 0.5:
        assert time.monotonic() < deadline, "the share command was not applied"
        time.sleep(0.001)
    assert not [e for e in ch.events if e.type == "error"]
    err = capfd.readouterr().err
    assert err.count("bubbles.sdk: ignored field(s)") == 3  # init.trace, arm.trace, share.trace: each once
    assert "arm.trace" in err and "upgrade the fill job's image" in err
    ch.send("arm", mode="harvest", share=1.0, trace=True)  # again: already said
    ch.send("stop")


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
    from bubbles.training.sdk import cuda_contexts

    assert cuda_contexts(_CudaState(True, {1})) == {1}
    assert cuda_contexts(_CudaState(True, set())) == set()  # initialised by a query (device properties): no context
    assert cuda_contexts(_CudaState(False, {0})) == set()
    assert cuda_contexts() == set()  # this CPU build of torch: it cannot say, so nothing is refused


def test_a_create_that_made_a_cuda_context_is_refused_on_a_gpu_executor_only() -> None:
    from bubbles.training.sdk import check_create_left_cuda_alone

    with pytest.raises(RuntimeError, match=r"create\(\) made a CUDA context \(on device 0\) .*cuda:1.* into init\(\)"):
        check_create_left_cuda_alone("cuda:1", frozenset(), frozenset({0}))
    check_create_left_cuda_alone("cuda:1", frozenset({0}), frozenset({0}))  # there before create(): not the job's
    check_create_left_cuda_alone("cuda:1", frozenset(), frozenset())
    check_create_left_cuda_alone("cpu:0", frozenset(), frozenset({0}))  # a CPU executor has no device to land on


class CudaAtCreate(IterativeFillJob):
    """A job whose create() makes a context on device 0, as a .cuda() there would (torch told so by the test)."""

    def create(self) -> None:
        import torch

        torch.cuda.is_initialized = lambda: True  # type: ignore[method-assign]
        torch._C._cuda_hasPrimaryContext = lambda index: index == 0  # type: ignore[attr-defined]

    def init(self) -> None:
        raise AssertionError("never reached: the job is refused before the agent's init")

    def step(self) -> None:
        raise AssertionError("never reached")


def test_a_job_whose_create_made_a_cuda_context_tells_the_agent_and_never_reports_created(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # What the job patches, restored after the test; before create() CUDA is initialised (attaching queried the
    # device, say) but no context exists.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: False, raising=False)
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(control.CONTROL_FD_ENV, str(theirs.fileno()))
    monkeypatch.setenv(control.JOB_ENV, "cuda-at-create")
    monkeypatch.setenv(control.DEVICE_ENV, "cuda:1")
    with pytest.raises(RuntimeError, match="into init"):
        run_fill_process(["--entry", "test_sdk:CudaAtCreate"])
    ours.settimeout(5)
    events = [json.loads(line) for line in ours.recv(65536).decode().splitlines() if line]
    assert [e["type"] for e in events] == ["error"], events  # never CREATED: the agent does not init it
    assert "create() made a CUDA context (on device 0) before the agent gave this job its device (cuda:1)" in \
        events[0]["message"]
    ours.close()


@pytest.mark.parametrize(("env", "wait"), [(None, "block"), ("spin", "spin")])
def test_the_fill_process_waits_for_its_steps_as_bubbles_fill_wait_says(env: str | None, wait: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import bubbles.training.sdk as sdk_mod

    made: list[tuple[str, str]] = []

    def device_sync(device: str, cuda: Any = None, wait: str = "") -> DeviceSync:
        made.append((device, wait))
        return DeviceSync()

    monkeypatch.setattr(sdk_mod, "device_sync_for", device_sync)
    monkeypatch.setattr(sdk_mod, "apply_process_limits", lambda device, memory: None)  # no GPU to cap here
    if env is None:
        monkeypatch.delenv(control.FILL_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(control.FILL_WAIT_ENV, env)
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(control.CONTROL_FD_ENV, str(theirs.fileno()))
    monkeypatch.setenv(control.JOB_ENV, "waits")
    monkeypatch.setenv(control.DEVICE_ENV, "cuda:1")
    ours.sendall(control.encode("init") + control.encode("stop"))
    assert run_fill_process(["--entry", "test_sdk:Counter"]) == 0
    assert made == [("cuda:1", wait)]
    ours.close()


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
