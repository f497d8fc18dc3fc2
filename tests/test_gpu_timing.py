"""Bubble timing with device events (``timing="cuda"``), exercised without a GPU.

A GPU runs ahead of nothing: the host runs ahead of it. ``FakeStream`` reproduces exactly that: kernels
and waits are *enqueued* (the host returns at once) and complete later on the stream's own clock, and
``FakeEvent`` has ``torch.cuda.Event``'s interface on that clock. Host timestamps around a wait then
measure nothing (like NCCL's ``recv``), while the events see the device-side bubble. Everything else
(DeepSpeed's dispatch loop and schedules, the hook, the sockets) is the real thing.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed.runtime.pipe import schedule as S
from deepspeed.runtime.pipe.engine import PipelineEngine
from helpers.gpu_timing import COMPUTE_S, WAIT_S, FakeEvent, FakeStream, cuda_available
from helpers.hook import gpu_dir

from bubbles.core import paths, wire
from bubbles.training.gpu_timing import (
    DEFAULT_EVENT_WAIT,
    DEFAULT_SWITCH_INTERVAL_US,
    HostEvent,
    SwitchInterval,
    cuda_event_factory,
    event_wait_from_env,
    switch_interval_from_env,
)
from bubbles.training.hook import instrument, resolve_timing
from bubbles.training.probes import StaticMemoryProbe


class AsyncEngine:
    """DeepSpeed's dispatch loop over handlers that only enqueue work, as CUDA kernels and NCCL do."""

    _exec_schedule = PipelineEngine._exec_schedule

    def __init__(self, stream: FakeStream, stage: int = 0, stages: int = 2, micro_batches: int = 3) -> None:
        self.stage_id, self.num_stages, self.micro_batches = stage, stages, micro_batches
        self.stream = stream
        self.host_waits_s: list[float] = []
        self.send_stall_s = 0.0  # how long each send holds the stream (NCCL: until the peer posts its receive)
        self._INSTRUCTION_MAP = {cls: self._handler(cls.__name__) for cls in (
            S.OptimizerStep, S.ReduceGrads, S.ReduceTiedGrads, S.LoadMicroBatch, S.ForwardPass,
            S.BackwardPass, S.SendActivation, S.RecvActivation, S.SendGrad, S.RecvGrad)}

    def _handler(self, name: str) -> Any:
        def handler(engine: AsyncEngine, **kwargs: Any) -> None:
            if name in ("ForwardPass", "BackwardPass"):
                engine.stream.enqueue(COMPUTE_S)
            elif name.startswith("Recv"):
                engine.stream.enqueue(WAIT_S)  # the stream waits for the data; the host does not
            elif name.startswith("Send") and engine.send_stall_s:
                engine.stream.enqueue(engine.send_stall_s)
        return handler

    def _reserve_pipe_buffers(self, n: int) -> None:
        pass

    def _aggregate_total_loss(self) -> float:
        self.stream.enqueue(WAIT_S)
        return 1.5

    def train_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
        loss = self._aggregate_total_loss()
        # loss.item(): the host waits for the device once per batch, as a real training does
        done = FakeEvent(self.stream)
        done.record()
        done.synchronize()
        return loss

    def eval_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.InferenceSchedule(self.micro_batches, self.num_stages, self.stage_id))
        self.stream.enqueue(WAIT_S)  # the output reduction and loss broadcast: queued, the host goes on
        return 2.5


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(f"/tmp/bbg-{time.monotonic_ns() % 10**9}")
    paths.make_private_dir(d)
    yield d
    shutil.rmtree(d)


def bind(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(5.0)
    return s


def receive(s: socket.socket, n: int) -> list[tuple[int, wire.Message]]:
    """``n`` messages with the host time each arrived (bounded wait)."""
    out = []
    for _ in range(n):
        data = s.recv(wire.MAX_DATAGRAM_BYTES)
        out.append((time.monotonic_ns(), wire.decode(data)))
    return out


def built_cycle(inst: Any, schedule: str = "TrainSchedule") -> Any:
    """The schedule's bubble cycle once the event thread has built it (bounded wait); None if it was not."""
    deadline = time.monotonic() + 5
    while schedule not in inst.cycles and time.monotonic() < deadline:
        time.sleep(0.005)
    return inst.cycles.get(schedule)


def profiled_on_device(eng: Any, sockdir: Path, training: str) -> tuple[Any, Any, Path]:
    """``eng`` instrumented with events on its fake stream (no warm-up, two profiled iterations) and run until the
    event thread has built its cycle: the instrumentation, the cycle and the stage's socket directory."""
    sdir = gpu_dir(sockdir, training, 0)
    inst = instrument(eng, training=training, run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=0, profile_iterations=2, timing="cuda",
                      event_factory=lambda: FakeEvent(eng.stream))
    eng.train_batch()
    eng.train_batch()
    return inst, built_cycle(inst), sdir  # built on the event thread


def test_device_events_see_the_bubbles_that_host_stamps_miss(sockdir: Path) -> None:
    stream = FakeStream()
    host_eng = AsyncEngine(stream)
    host = instrument(host_eng, training="h", run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=1, profile_iterations=3, timing="host")
    for _ in range(4):
        host_eng.train_batch()
    assert host.cycle is not None
    # The host never blocks in a receive: at the default 0.5 ms threshold there is no bubble to see.
    assert host.cycle.slots == ()
    host.detach()

    dev_eng = AsyncEngine(FakeStream())
    dev = instrument(dev_eng, training="d", run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                     warmup_iterations=1, profile_iterations=3, timing="cuda",
                     event_factory=lambda: FakeEvent(dev_eng.stream))
    for _ in range(4):
        dev_eng.train_batch()
    built_cycle(dev)  # built on the event thread
    cycle = dev.cycle
    assert cycle is not None
    assert [s.instruction for s in cycle.slots] == ["RecvGrad", "RecvGrad", "RecvGrad", "LossBroadcast"]
    for s in cycle.slots:
        assert s.duration_s == pytest.approx(WAIT_S, abs=0.002), s
    assert dev.stats["timing"] == "cuda" and dev.stats["device_waits_timed"] >= 12
    assert dev.stats["signal_wake_lag_us_p50"] is None  # nothing signalled yet (no listener)
    dev.detach()


def test_bubble_signals_follow_the_device_not_the_host(sockdir: Path) -> None:
    eng = AsyncEngine(FakeStream())
    inst, _cycle, sdir = profiled_on_device(eng, sockdir, "s")
    assert inst.cycle is not None and len(inst.cycle.slots) == 4
    listener = bind(sdir / "fill-x.sock")
    eng.train_batch()  # the listener is discovered at the end of this batch; the profile is sent then
    assert isinstance(receive(listener, 1)[0][1], wire.Profile)
    t_host0 = time.monotonic_ns()
    eng.train_batch()
    # 4 x (start, end) from the event thread; the training's thread sends its ITERATION messages (this batch's,
    # and possibly the previous one's, sent after the profile) in between, in any order: read until the four
    # bubbles are in (a bounded number of messages, each read with a timeout).
    msgs: list[tuple[int, wire.Message]] = []
    while sum(isinstance(m, wire.BubbleEnd) for _, m in msgs) < 4 and len(msgs) < 12:
        msgs += receive(listener, 1)
    starts = [(t, m) for t, m in msgs if isinstance(m, wire.BubbleStart)]
    ends = [(t, m) for t, m in msgs if isinstance(m, wire.BubbleEnd)]
    assert len(starts) == len(ends) == 4, [type(m).__name__ for _, m in msgs]
    for (_, st), (_, en) in zip(starts, ends, strict=True):
        assert st.seq == en.seq
        # Each bubble lasts as long as the device waits, although the host enqueued it in microseconds.
        assert (en.end_ns - st.start_ns) / 1e9 == pytest.approx(WAIT_S, abs=0.002)
    # The first bubble (RecvGrad after 2 forwards) starts when the device finishes those forwards, which
    # is well after the host got there.
    first_start = starts[0][1].start_ns
    assert (first_start - t_host0) / 1e9 >= 2 * COMPUTE_S - 0.001
    inst.detach()
    listener.close()


def test_a_failing_event_disables_signalling_and_training_goes_on(sockdir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    class Broken(HostEvent):
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng = AsyncEngine(FakeStream())
    inst = instrument(eng, training="b", run_dir=sockdir, warmup_iterations=0, profile_iterations=1,
                      timing="cuda", event_factory=Broken)
    gpu_dir(sockdir, "b", 0)
    losses = [eng.train_batch() for _ in range(3)]
    deadline = time.monotonic() + 5
    while not inst.stats["disabled"] and time.monotonic() < deadline:
        eng.train_batch()
    assert losses == [1.5, 1.5, 1.5] and eng.train_batch() == 1.5
    assert inst.stats["disabled"]
    assert "training continues without bubble signals" in caplog.text
    inst.detach()


class RunAheadEngine(AsyncEngine):
    """A batch that returns before its device work is done (no ``loss.item()``): the host is a batch ahead."""

    def train_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(S.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
        return self._aggregate_total_loss()


def test_with_device_timing_the_iteration_length_is_the_device_s_not_the_host_s(sockdir: Path) -> None:
    # The guard and the profile read iteration lengths. The host only queues the work (here in microseconds), and
    # the device runs it later: 6 passes and 4 waits, about 48 ms. The ITERATION messages must say the latter.
    eng = RunAheadEngine(FakeStream())
    device_s = 2 * eng.micro_batches * COMPUTE_S + 4 * WAIT_S  # the passes and the waits (3 RecvGrad, the loss)
    inst, cycle, sdir = profiled_on_device(eng, sockdir, "it")
    assert cycle.iteration_s == pytest.approx(device_s, rel=0.15)  # the profile's iteration: the device's
    listener = bind(sdir / "fill-x.sock")
    eng.train_batch()  # the listener is found at the end of this batch
    for _ in range(3):
        eng.train_batch()
    assert max(list(inst.iteration_times_s)[-3:]) < device_s / 4  # the host ran ahead
    iterations: list[wire.Iteration] = []
    while len(iterations) < 3:
        _, m = receive(listener, 1)[0]
        if isinstance(m, wire.Iteration):
            iterations.append(m)
    for m in iterations:
        assert m.duration_ns / 1e9 == pytest.approx(device_s, rel=0.15), m
    a, b = iterations[0], iterations[1]  # back to back on the device: one starts where the previous ended
    assert b.start_ns - (a.start_ns + a.duration_ns) == pytest.approx(0, abs=3e6)
    inst.detach()


def drain_signals(inst: Any, listener: socket.socket) -> None:
    """Once the device has run what was queued: wait (bounded) until the event thread has taken every event off its
    queue, then drop what the listener got until 50 ms pass without a datagram (the last event's signal)."""
    timer = getattr(inst._timing, "timer", None)  # device timing's EventTimer
    deadline = time.monotonic() + 10
    while timer is not None and not timer._queue.empty():
        assert time.monotonic() < deadline, "the event thread never caught up"
        time.sleep(0.005)
    listener.settimeout(0.05)
    with contextlib.suppress(TimeoutError):
        while True:
            listener.recv(wire.MAX_DATAGRAM_BYTES)
    listener.settimeout(5.0)


def test_with_device_timing_predicted_lengths_follow_the_waits_the_device_measured(sockdir: Path) -> None:
    """As with host timing, a signalled bubble's predicted length follows its recent lengths after profiling; here
    the lengths are the device's, and the event thread recomputes the prediction (until 2026-11-24 device timing
    kept the profile's for good)."""
    from bubbles.training.hook import RECENT_ITERATIONS, REPREDICT_EVERY

    class Waits(RunAheadEngine):
        wait_s = 0.002

        def _handler(self, name: str) -> Any:
            def handler(engine: Waits, **kwargs: Any) -> None:
                if name in ("ForwardPass", "BackwardPass"):
                    engine.stream.enqueue(0.0005)
                elif name.startswith("Recv"):
                    engine.stream.enqueue(engine.wait_s)
            return handler

    eng = Waits(FakeStream())
    inst, cycle, sdir = profiled_on_device(eng, sockdir, "fol")
    assert cycle is not None
    listener = bind(sdir / "fill-x.sock")

    def settle() -> None:  # the device has run what was queued, the event thread has sent its signals
        done = FakeEvent(eng.stream)
        done.record()
        done.synchronize()
        drain_signals(inst, listener)

    def predicted_ms(batches: int) -> list[float]:
        for _ in range(batches):
            eng.train_batch()
        settle()  # the prediction reaches the batches queued after it: read the next one's
        eng.train_batch()
        starts: list[wire.BubbleStart] = []
        while len(starts) < 3:  # the three receives of the last batch queued (the loss broadcast: none here)
            m = receive(listener, 1)[0][1]
            if isinstance(m, wire.BubbleStart):
                starts.append(m)
        return [(m.predicted_end_ns - m.start_ns) / 1e6 for m in starts]

    assert max(predicted_ms(2)) < 3  # profiled at 2 ms
    eng.wait_s = 0.008
    inst.set_fill_mode(wire.FillMode.NAIVE)  # naive co-location's bubbles are not the training's: not followed
    assert max(predicted_ms(RECENT_ITERATIONS)) < 3, "naive co-location's bubbles moved the prediction"
    inst.set_fill_mode(wire.FillMode.HARVEST)
    later = predicted_ms(RECENT_ITERATIONS + 2 * REPREDICT_EVERY)
    assert min(later) >= 7, later  # every receive now waits 8 ms on the device, and the prediction says so
    inst.detach()
    listener.close()


def test_how_the_helper_thread_waits_comes_from_the_environment_and_a_bad_value_falls_back_with_a_warning() -> None:
    assert event_wait_from_env({}) == (DEFAULT_EVENT_WAIT, None)
    assert event_wait_from_env({"BUBBLES_EVENT_WAIT": "spin"}) == ("spin", None)
    assert event_wait_from_env({"BUBBLES_EVENT_WAIT": " block "}) == ("block", None)
    wait, problem = event_wait_from_env({"BUBBLES_EVENT_WAIT": "busy"})
    assert wait == DEFAULT_EVENT_WAIT and problem is not None
    assert "BUBBLES_EVENT_WAIT='busy'" in problem and "block, spin" in problem
    with pytest.raises(ValueError, match="wait must be one of block, spin"):
        cuda_event_factory("busy")


class RecordingCuda:
    """The part of ``torch.cuda`` that ``cuda_event_factory`` uses: events that log the stream they record on."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        records = self.records

        class Event:
            def __init__(self, *, enable_timing: bool = False, blocking: bool = False) -> None:
                self.flags = (enable_timing, blocking)

            def record(self, stream: Any = None) -> None:  # torch.cuda.Event's: None means the current device's
                records.append(stream if stream is not None else "the current device's stream")

        self.Event = Event

    def is_available(self) -> bool:
        return True

    def current_stream(self, device: Any = None) -> str:
        return f"current stream of {device}"


def test_cuda_events_record_on_the_engines_device_not_the_current_one() -> None:
    cuda = RecordingCuda()
    make = cuda_event_factory("block", device="cuda:1", cuda=cuda)
    ev = make()
    assert ev.flags == (True, True)  # type: ignore[attr-defined]  # timing, cudaEventBlockingSync
    ev.record()
    ev.record("a stream given")
    assert cuda.records == ["current stream of cuda:1", "a stream given"]
    assert cuda_event_factory("spin", device=None, cuda=cuda)().flags == (True, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="use timing='host'"):
        cuda_event_factory(cuda=type("NoGpu", (RecordingCuda,), {"is_available": lambda self: False})())


def test_the_hook_times_the_engines_device(sockdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bubbles.training.hook.timing as hook_timing

    eng = AsyncEngine(FakeStream())
    eng.device = torch.device("cuda", 1)  # type: ignore[attr-defined]
    asked: list[tuple[str, Any]] = []

    def factory(wait: str, device: Any = None) -> Any:
        asked.append((wait, device))
        return lambda: FakeEvent(eng.stream)

    monkeypatch.setattr(hook_timing, "cuda_event_factory", factory)
    inst = instrument(eng, training="dev", run_dir=sockdir, memory_probe=StaticMemoryProbe(1))
    try:
        assert inst.timing == "cuda"
        assert asked == [(DEFAULT_EVENT_WAIT, torch.device("cuda", 1))]
    finally:
        inst.detach()


def test_the_switch_interval_comes_from_the_environment_and_a_bad_value_falls_back_with_a_warning() -> None:
    assert switch_interval_from_env({}) == (DEFAULT_SWITCH_INTERVAL_US / 1e6, None)
    assert switch_interval_from_env({"BUBBLES_SWITCH_INTERVAL_US": "500"}) == (0.0005, None)
    assert switch_interval_from_env({"BUBBLES_SWITCH_INTERVAL_US": "0"}) == (None, None)  # leave Python's
    for bad in ("fast", "-1", "1.5", "9000"):
        interval, problem = switch_interval_from_env({"BUBBLES_SWITCH_INTERVAL_US": bad})
        assert interval == DEFAULT_SWITCH_INTERVAL_US / 1e6 and problem is not None
        assert f"BUBBLES_SWITCH_INTERVAL_US={bad!r}" in problem and "0 to 5000" in problem


def test_device_timing_shortens_the_switch_interval_while_attached_and_restores_it(
        sockdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = sys.getswitchinterval()
    try:
        eng = AsyncEngine(FakeStream())
        inst = instrument(eng, training="sw", run_dir=sockdir, memory_probe=StaticMemoryProbe(1), timing="cuda",
                          event_factory=lambda: FakeEvent(eng.stream))
        assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_US / 1e6)
        assert inst.stats["switch_interval_us"] == pytest.approx(DEFAULT_SWITCH_INTERVAL_US)
        # a second engine in the process shares it; the first to detach leaves it for the second
        eng2 = AsyncEngine(FakeStream())
        inst2 = instrument(eng2, training="sw-b", run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                           timing="cuda", event_factory=lambda: FakeEvent(eng2.stream))
        assert inst2.stats["switch_interval_us"] == pytest.approx(DEFAULT_SWITCH_INTERVAL_US)
        inst.detach()
        assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_US / 1e6)
        # instrumenting an engine twice fails, and the failed attempt holds nothing
        with pytest.raises(RuntimeError, match="already instrumented"):
            instrument(eng2, training="sw-c", run_dir=sockdir, memory_probe=StaticMemoryProbe(1), timing="cuda",
                       event_factory=lambda: FakeEvent(eng2.stream))
        inst2.detach()
        assert sys.getswitchinterval() == before  # the last one out restored it
        monkeypatch.setenv("BUBBLES_SWITCH_INTERVAL_US", "0")
        host = instrument(AsyncEngine(FakeStream()), training="sw2", run_dir=sockdir, timing="host")
        assert sys.getswitchinterval() == before and host.stats["switch_interval_us"] is None  # host timing
        host.detach()
        inst = instrument(eng, training="sw3", run_dir=sockdir, memory_probe=StaticMemoryProbe(1), timing="cuda",
                          event_factory=lambda: FakeEvent(eng.stream))
        assert sys.getswitchinterval() == before  # 0: Python's own is kept
        inst.detach()
    finally:
        sys.setswitchinterval(before)


def test_the_shared_switch_interval_is_restored_by_the_last_holder_unless_someone_else_changed_it() -> None:
    current = [0.005]
    si = SwitchInterval(getter=lambda: current[0], setter=lambda v: current.__setitem__(0, v))
    assert si.acquire(0.0002) == 0.0002 and current[0] == 0.0002
    assert si.acquire(0.0001) == 0.0002 and current[0] == 0.0002  # shared: the first holder's stays
    si.release()
    assert current[0] == 0.0002
    si.release()
    assert current[0] == 0.005
    si.release()  # one release too many: nothing happens
    assert current[0] == 0.005
    assert si.acquire(0.0002) == 0.0002
    current[0] = 0.001  # the training changed it meanwhile: its value is left alone
    si.release()
    assert current[0] == 0.001
    assert si.acquire(0.01) is None and current[0] == 0.001  # never lengthened
    si.release()
    assert current[0] == 0.001


def test_timing_choice_and_bad_values(sockdir: Path) -> None:
    class Dev:
        def __init__(self, type_: str) -> None:
            self.type = type_

    class E:
        pass

    e = E()
    assert resolve_timing("auto", e) == "host"
    e.device = Dev("cuda")  # type: ignore[attr-defined]
    assert resolve_timing("auto", e) == "cuda"
    e.device = Dev("cpu")  # type: ignore[attr-defined]
    assert resolve_timing("auto", e) == "host"
    assert resolve_timing("cuda", e) == "cuda"
    with pytest.raises(ValueError, match="timing must be one of auto, host, cuda"):
        resolve_timing("gpu", e)
    with pytest.raises(ValueError, match="timing must be one of"):
        instrument(AsyncEngine(FakeStream()), training="x", run_dir=sockdir, timing="events")
    # This machine has no GPU: asking for CUDA events without a stand-in says what to do instead.
    with pytest.raises(RuntimeError, match="timing='host'"):
        instrument(AsyncEngine(FakeStream()), training="x", run_dir=sockdir, timing="cuda")


# ---------------------------------------------------------------------------------------------------
# The same on a real GPU (skipped on machines without one; run on the device machine when one is lent)




@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs an NVIDIA GPU (this machine has none)")
@pytest.mark.parametrize("wait", ["block", "spin"])
def test_real_cuda_events_time_device_side_waits(sockdir: Path, wait: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("BUBBLES_EVENT_WAIT", wait)

    stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    # cycles per millisecond of torch.cuda._sleep, measured here: the "neighbour's data" arrives after a
    # side stream has slept that long, and the main stream waits for it (like NCCL's recv on its stream).
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(10_000_000)
    t1.record()
    t1.synchronize()
    cycles_per_ms = 10_000_000 / t0.elapsed_time(t1)

    class CudaEngine(AsyncEngine):
        device = torch.device("cuda")

        def _handler(self, name: str) -> Any:
            def handler(engine: CudaEngine, **kwargs: Any) -> None:
                if name in ("ForwardPass", "BackwardPass"):
                    for _ in range(4):
                        a @ a
                elif name.startswith("Recv"):
                    side.wait_stream(stream)
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(int(WAIT_S * 1e3 * cycles_per_ms))
                    stream.wait_stream(side)
            return handler

        def _aggregate_total_loss(self) -> float:
            return 1.5

        def train_batch(self, data_iter: Any = None) -> float:
            self._exec_schedule(S.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
            return self._aggregate_total_loss()

    eng = CudaEngine(FakeStream())
    inst = instrument(eng, training="g", run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=1, profile_iterations=3, timing="auto")
    assert inst.timing == "cuda" and inst.event_wait == wait
    for _ in range(4):
        eng.train_batch()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10
    while inst.cycle is None and time.monotonic() < deadline:
        time.sleep(0.005)
    cycle = inst.cycle
    assert cycle is not None
    assert [s.instruction for s in cycle.slots][:3] == ["RecvGrad", "RecvGrad", "RecvGrad"]
    for s in cycle.slots[:3]:
        assert s.duration_s == pytest.approx(WAIT_S, rel=0.25), s
    inst.detach()


def test_the_end_of_evaluation_is_timed_on_the_device_too(sockdir: Path) -> None:
    """eval_batch's tail (output reduction, loss broadcast) is a wait like the receives: the host reaches it at
    once, the device waits there. Host stamps would see no bubble; device events see WAIT_S."""
    eng = AsyncEngine(FakeStream())
    sdir = gpu_dir(sockdir, "e", 0)
    inst = instrument(eng, training="e", run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=1, profile_iterations=3, timing="cuda",
                      event_factory=lambda: FakeEvent(eng.stream))
    for _ in range(4):
        assert eng.eval_batch() == 2.5
    cycle = built_cycle(inst, "InferenceSchedule")
    assert cycle is not None
    assert [s.instruction for s in cycle.slots] == ["LossBroadcast"]
    assert cycle.slots[0].duration_s == pytest.approx(WAIT_S, abs=0.002)
    listener = bind(sdir / "fill-e.sock")
    eng.eval_batch()  # the listener is discovered at the end of this batch
    eng.eval_batch()
    msgs: list[tuple[int, wire.Message]] = []
    while not any(isinstance(m, wire.BubbleEnd) for _, m in msgs) and len(msgs) < 12:
        msgs += receive(listener, 1)
    start = next(m for _, m in msgs if isinstance(m, wire.BubbleStart))
    end = next(m for _, m in msgs if isinstance(m, wire.BubbleEnd))
    assert start.seq == end.seq and (end.end_ns - start.start_ns) / 1e9 == pytest.approx(WAIT_S, abs=0.002)
    inst.detach()
    listener.close()


def test_a_send_that_stalls_the_device_is_profiled_as_a_bubble(sockdir: Path) -> None:
    """With NCCL a send can hold the GPU until the peer posts its receive: device timing brackets sends too,
    and a send that stalls is a bubble (one that does not stays out: the test above)."""
    eng = AsyncEngine(FakeStream(), stage=1)  # the last stage: sends its gradients back
    eng.send_stall_s = WAIT_S
    inst = instrument(eng, training="snd", run_dir=sockdir, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=1, profile_iterations=3, timing="cuda",
                      event_factory=lambda: FakeEvent(eng.stream))
    for _ in range(4):
        eng.train_batch()
    built_cycle(inst)  # built on the event thread
    cycle = inst.cycle
    assert cycle is not None
    sends = [s for s in cycle.slots if s.instruction == "SendGrad"]
    assert len(sends) == eng.micro_batches  # one per micro-batch, each WAIT_S long on the device
    assert all(s.duration_s == pytest.approx(WAIT_S, abs=0.002) for s in sends)
    inst.detach()


def test_with_device_timing_the_training_thread_never_reads_the_memory_probe(sockdir: Path) -> None:
    """Reading the allocator (cudaMemGetInfo) on the training's thread while it is profiled perturbs what is
    being measured: with device timing the probe is read on the helper thread once each profiled wait has ended
    on the device, and the profile still gets the lowest free memory seen per bubble."""

    class ThreadRecordingProbe(StaticMemoryProbe):
        def __init__(self) -> None:
            super().__init__(1 << 30)
            self.threads: list[str] = []
            self.readings = iter(range(100))

        def sample(self) -> Any:
            self.threads.append(threading.current_thread().name)
            k = next(self.readings)
            return type(super().sample())((1 << 30) - k, 0)  # less free at each reading

    eng = AsyncEngine(FakeStream())
    probe = ThreadRecordingProbe()
    inst = instrument(eng, training="mem", run_dir=sockdir, memory_probe=probe, warmup_iterations=1,
                      profile_iterations=3, timing="cuda", event_factory=lambda: FakeEvent(eng.stream))
    for _ in range(5):
        eng.train_batch()
    built_cycle(inst)  # built on the event thread
    assert inst.cycle is not None and probe.threads
    assert set(probe.threads) == {"bubbles-event-timer"}, set(probe.threads)
    lowest = (1 << 30) - (len(probe.threads) - 1)
    assert min(s.free_bytes for s in inst.cycle.slots) >= lowest  # each slot its own lowest reading
    assert all(s.free_bytes < 1 << 30 for s in inst.cycle.slots)  # every slot was read (more than once)
    inst.detach()


def test_a_fill_mode_switch_reaches_listeners_after_the_bubbles_the_device_has_yet_to_signal(sockdir: Path) -> None:
    """The device runs behind the host: a switch sent at once would arrive before the previous phase's last
    bubbles, and the agent would count them in the new phase."""
    eng = RunAheadEngine(FakeStream())
    inst, _cycle, sdir = profiled_on_device(eng, sockdir, "m")
    assert inst.cycle is not None and len(inst.cycle.slots) == 4
    listener = bind(sdir / "fill-m.sock")
    eng.train_batch()  # the listener is discovered at the end of this batch
    done = FakeEvent(eng.stream)
    done.record()
    done.synchronize()  # its device work is done
    drain_signals(inst, listener)  # and its signals sent: drop them
    eng.train_batch()  # returns while the device still has about 50 ms of this batch to run
    inst.set_fill_mode(wire.FillMode.HARVEST)
    kinds = []
    while not kinds or kinds[-1] != "FillModeChange":
        kinds.append(type(receive(listener, 1)[0][1]).__name__)
        assert len(kinds) < 20, kinds
    assert kinds.count("BubbleEnd") == 4, kinds  # every bubble of the batch before the switch, then the switch
    inst.detach()
    listener.close()
