"""The one-GPU harvesting benchmark (gpubench): the stage emulator on this CPU-only machine.

Instrumented by the real hook (``bubbles.hook.instrument``): profiled bubbles where the model put them, losses
bit-identical with and without the hook; the CUDA path through a stand-in for ``torch.cuda`` (waits and sends are
device-side spins, the host never synchronizes); the waits' jitter and its pairing; bad arguments.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.gpubench import ds_streams, one_thread, passes

import gpubench.emulator as emulator_mod
from bubbles.core import paths
from bubbles.training.hook import instrument
from bubbles.training.probes import StaticMemoryProbe
from gpubench.emulator import CudaOps, DeviceOps, StageEmulator, StageShape
from gpubench.pipeline_model import simulate_pipeline

__all__ = ["one_thread"]  # the autouse fixture, from helpers.gpubench

TINY = StageShape(hidden=32, heads=4, ffn_mult=2, seq=16, micro_batch=1, blocks=1)


# ---------------------------------------------------------------------------------------------------
# the stage emulator under the real hook (CPU)


def test_emulator_under_the_real_hook_profiles_the_modelled_bubbles(tmp_path: Path) -> None:
    # Stage 1 of 4 has both kinds of receive (activations and gradients). Fixed pass times (not calibrated)
    # make the modelled waits a few milliseconds each, well above the hook's 0.5 ms threshold.
    emu = StageEmulator(stage_id=1, num_stages=4, micro_batches=4, shape=TINY)
    model = emu.model_waits(forward_s=0.002, backward_s=0.004).stage(1)
    modelled = {pos: s for pos, s in model.waits_s.items() if s >= 0.0005}
    assert {model.stream[pos] for pos in modelled} == {"RecvActivation", "RecvGrad"}
    inst = instrument(emu, training="gpubench-test", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1 << 30),
                      warmup_iterations=1, profile_iterations=3, min_bubble_s=0.0005, timing="auto")
    try:
        for _ in range(5):
            emu.train_batch()
        cycle = inst.cycle
        assert cycle is not None
        slots = {s.position: s for s in cycle.slots}
        assert set(slots) == set(modelled)
        for pos, length in modelled.items():
            measured = slots[pos].duration_s
            # A wait never ends early (its last part is spun); a busy shared machine can make it end late.
            assert length - 0.0001 <= measured <= length + max(0.003, 0.5 * length), (pos, length, measured)
            assert slots[pos].instruction == model.stream[pos]
        assert inst.stats["iterations"] == 5
    finally:
        inst.detach()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_the_hook_s_device_events_see_the_modelled_bubbles(tmp_path: Path) -> None:
    # The GPU path end to end, at a size where a pass takes about a millisecond: bf16 compute, pass times from
    # CUDA events, waits spun on the device (no host sync), the hook timing the waits with device events.
    shape = StageShape(hidden=1024, heads=8, ffn_mult=4, seq=512, micro_batch=1, blocks=2)
    emu = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=shape, device="cuda")
    assert emu.dtype == torch.bfloat16
    forward_s, backward_s = emu.calibrate(steps=5)
    assert 0 < forward_s < backward_s < 1
    model = emu.model_waits(max(forward_s, 0.002), max(backward_s, 0.004)).stage(0)
    modelled = {pos: s for pos, s in model.waits_s.items() if s >= 0.0005}
    inst = instrument(emu, training="gpubench-gpu", run_dir=tmp_path, warmup_iterations=2, profile_iterations=3,
                      min_bubble_s=0.0005, timing="auto")
    try:
        for _ in range(6):
            emu.train_batch().item()
        cycle = inst.cycle
        assert cycle is not None
        assert getattr(inst, "timing", "cuda") == "cuda"
        slots = {s.position: s for s in cycle.slots}
        assert set(slots) == set(modelled)
        for pos, length in modelled.items():
            assert length - 0.0002 <= slots[pos].duration_s <= length + max(0.002, 0.3 * length), pos
    finally:
        inst.detach()


def _losses(emu: StageEmulator, n: int) -> list[str]:
    return [float(emu.train_batch().item()).hex() for _ in range(n)]


@pytest.mark.parametrize("stage", [0, 3])
def test_the_hook_leaves_the_emulator_s_losses_bit_identical(tmp_path: Path, stage: int) -> None:
    def build() -> StageEmulator:
        emu = StageEmulator(stage_id=stage, num_stages=4, micro_batches=4, shape=TINY, seed=7)
        emu.model_waits(forward_s=0.0005, backward_s=0.001)
        return emu

    plain = _losses(build(), 6)
    hooked = build()
    # A listener in the GPU's directory, so the hook really signals every bubble while the losses are compared (a short
    # run directory: pytest's tmp_path may be too long for a Unix socket's path).
    run_dir = Path(tempfile.mkdtemp(prefix="bbemu-", dir="/tmp"))
    gpu_dir = paths.gpu_dir(run_dir, paths.GpuKey(paths.LOCAL_NAMESPACE, "lossy", stage))
    gpu_dir.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(gpu_dir / "fill-probe.sock"))
    listener.setblocking(False)
    inst = instrument(hooked, training="lossy", run_dir=run_dir, memory_probe=StaticMemoryProbe(1 << 30),
                      warmup_iterations=1, profile_iterations=2, min_bubble_s=0.0002)
    try:
        assert _losses(hooked, 6) == plain
        assert inst.stats["bubbles_signalled"] > 0  # the hook was not idle while the losses were compared
    finally:
        inst.detach()
        listener.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    assert len(set(plain)) > 1  # the optimizer works: the losses move from batch to batch


def test_calibration_times_both_passes_and_leaves_no_gradient() -> None:
    emu = StageEmulator(stage_id=0, num_stages=2, micro_batches=2, shape=TINY)
    forward_s, backward_s = emu.calibrate(steps=3, warmup=1)
    assert 0 < forward_s < 1
    assert 0 < backward_s < 1
    assert all(p.grad is None for p in emu.module.parameters())
    with pytest.raises(ValueError, match="steps >= 1"):
        emu.calibrate(steps=0)


class FakeCudaEvent:
    def __init__(self, log: list[tuple[str, float]], enable_timing: bool = False) -> None:
        self.log = log
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()
        self.log.append(("record", self.t))

    def synchronize(self) -> None:
        self.log.append(("event-sync", time.perf_counter()))

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event


FAKE_GPU_HZ = 1e9


class FakeCuda:
    """Stands in for ``torch.cuda``: logs stream synchronizes, events and spin kernels (the compute itself runs on
    CPU)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float]] = []
        self.streams: list[Any] = []

    def current_stream(self, device: Any = None) -> Any:
        self.streams.append(device)
        log = self.log

        class Stream:
            def synchronize(self) -> None:
                log.append(("stream-sync", time.perf_counter()))

        return Stream()

    def Event(self, enable_timing: bool = False) -> FakeCudaEvent:  # torch.cuda's name
        return FakeCudaEvent(self.log, enable_timing)

    def _sleep(self, cycles: int) -> None:  # torch.cuda._sleep: a kernel that spins this many GPU cycles
        self.log.append(("spin", float(cycles)))
        time.sleep(cycles / FAKE_GPU_HZ)  # the stand-in "kernel" runs at once, on a 1 GHz clock


def test_on_a_gpu_every_modelled_wait_and_send_is_a_device_side_spin_and_the_host_never_synchronizes() -> None:
    cuda = FakeCuda()
    host_sleeps: list[float] = []
    emu = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY,
                        ops=CudaOps(torch.device("cpu"), cuda=cuda), sleep=host_sleeps.append, send_s=0.0002)
    emu.model_waits(forward_s=0.001, backward_s=0.002)
    nonzero = [s for s in emu.waits_s.values() if s > 0] + ([emu.loss_broadcast_s] if emu.loss_broadcast_s > 0 else [])
    sends = sum(1 for name in emu.stream() if name.startswith("Send"))
    emu.train_batch()
    assert not [what for what, _ in cuda.log if what == "stream-sync"]  # no host sync in the training loop
    assert not host_sleeps
    spins = [cycles for what, cycles in cuda.log if what == "spin"]
    rounds = emulator_mod.CLOCK_CALIBRATION_ROUNDS
    calibration, spins = spins[:rounds], spins[rounds:]  # the spin kernel's clock is measured once, in rounds
    assert calibration == [emulator_mod.CLOCK_CALIBRATION_CYCLES] * rounds
    assert emu.ops.cycles_per_s == pytest.approx(FAKE_GPU_HZ, rel=0.2)  # type: ignore[attr-defined]
    assert len(spins) == len(nonzero) + sends  # every wait and every send, none for zero-length waits
    total_s = sum(spins) / emu.ops.cycles_per_s  # type: ignore[attr-defined]
    assert total_s == pytest.approx(sum(nonzero) + sends * 0.0002, rel=0.01)  # no jitter asked: the model's


class RampingCuda(FakeCuda):
    """A GPU whose clock starts at a third of its speed under load (an idle H100: 345 of 1980 MHz) and ramps up."""

    def __init__(self) -> None:
        super().__init__()
        self.slow_spins = 1

    def _sleep(self, cycles: int) -> None:
        if self.slow_spins:
            self.slow_spins -= 1
            time.sleep(2 * cycles / FAKE_GPU_HZ)
        super()._sleep(cycles)


def test_the_spin_kernel_s_clock_is_the_clock_under_load_not_an_idle_gpu_s() -> None:
    ops = CudaOps(torch.device("cpu"), cuda=RampingCuda())
    ops.idle(0.001, sleep=lambda s: None, clock=time.perf_counter)
    assert ops.cycles_per_s == pytest.approx(FAKE_GPU_HZ, rel=0.2)  # one slow round would have made it 1/3


def test_paired_waits_jitter_alike_under_the_same_key_and_differently_under_another() -> None:
    """Common random numbers: the training passes (round, iteration index) before each iteration, so a round's
    baseline and harvest iterations draw the same waits, and the comparison is not blurred by the jitter."""
    def waits(keys: list[tuple[int, int]]) -> list[list[float]]:
        sleeps: list[float] = []
        emu = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, sleep=sleeps.append,
                            clock=_ticks(), wait_jitter=0.2)
        emu.model_waits(forward_s=0.01, backward_s=0.02)
        out = []
        for key in keys:
            emu.pair_waits(*key)
            sleeps.clear()
            emu.train_batch()
            out.append(list(sleeps))
        return out

    # A baseline phase, then a harvest phase, of round 0: iteration i of each draws the same waits.
    base, harvest = waits([(0, 0), (0, 1), (0, 2)]), waits([(0, 0), (0, 1), (0, 2)])
    assert base == harvest
    assert base[0] != base[1]
    assert base[1] != base[2]  # still jittered from iteration to iteration
    assert waits([(1, 0)])[0] != base[0]  # another round, other waits
    # Without pairing (no key), the stream runs on: the same emulator's second pass differs from its first.
    sleeps: list[float] = []
    emu = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, sleep=sleeps.append,
                        clock=_ticks(), wait_jitter=0.2)
    emu.model_waits(forward_s=0.01, backward_s=0.02)
    emu.train_batch()
    first = list(sleeps)
    sleeps.clear()
    emu.train_batch()
    assert sleeps != first


def _ticks() -> Any:
    counter = itertools.count()
    return lambda: float(next(counter))


def test_on_a_cpu_the_host_idles_and_waits_are_jittered_around_the_model_with_the_stated_spread() -> None:
    sleeps: list[float] = []
    emu = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, sleep=sleeps.append,
                        clock=_ticks(), wait_jitter=0.2)  # a clock that jumps 1 s a reading: nothing spins
    emu.model_waits(forward_s=0.01, backward_s=0.02)
    modelled = [s for s in emu.waits_s.values() if s > 0] + ([emu.loss_broadcast_s] if emu.loss_broadcast_s > 0 else [])
    factors: list[float] = []
    for _ in range(60):
        sleeps.clear()
        emu.train_batch()
        got = [s + emulator_mod.SPIN_S for s in sleeps]
        assert len(got) == len(modelled)
        factors += [g / m for g, m in zip(got, modelled, strict=True)]
    mean = statistics.fmean(factors)
    cv = statistics.stdev(factors) / mean
    assert 0.95 < mean < 1.05
    assert 0.15 < cv < 0.25  # lognormal, mean 1, coefficient of variation 0.2
    runs = []
    for _ in range(2):  # seeded: two emulators built alike wait alike
        naps: list[float] = []
        again = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, sleep=naps.append,
                              clock=_ticks(), wait_jitter=0.2)
        again.model_waits(forward_s=0.01, backward_s=0.02)
        again.train_batch()
        runs.append(naps)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == len(runs[0])
    with pytest.raises(ValueError, match="wait jitter"):
        StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, wait_jitter=-0.1)
    with pytest.raises(ValueError, match="send time"):
        StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, send_s=float("nan"))


def test_cuda_timing_uses_events_around_the_work() -> None:
    cuda = FakeCuda()
    ops = CudaOps(torch.device("cpu"), cuda=cuda)
    assert 0.01 <= ops.time_s(lambda: time.sleep(0.01)) < 0.5
    assert [what for what, _ in cuda.log] == ["record", "record", "event-sync"]
    assert isinstance(DeviceOps().time_s(lambda: None), float)


@pytest.mark.parametrize("kwargs,message", [
    ({"stage_id": 7, "num_stages": 4}, r"stage 7 is not one of the pipeline's 4 stages \(0..3\)"),
    ({"num_stages": 1}, "at least 2 stages"),
    ({"micro_batches": 0}, "micro_batches 0"),
    ({"shape": StageShape(hidden=30, heads=4)}, "not divisible by --heads 4"),
    ({"shape": StageShape(seq=0)}, "--seq 0: must be an integer >= 1"),
])
def test_bad_emulator_arguments_say_what_to_fix(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"stage_id": 0, "num_stages": 4, "micro_batches": 4, "shape": TINY, **kwargs}
    with pytest.raises(ValueError, match=message):
        StageEmulator(**args)


def test_waits_of_another_schedule_are_refused() -> None:
    emu = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY)
    other = simulate_pipeline(ds_streams(4, 8), microbatches=8, durations_s=passes(1, 1)).stage(0)
    with pytest.raises(ValueError, match="model the same stage, stages and micro-batches"):
        emu.set_waits(other)
    same_length_other_stage = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 1)).stage(3)
    with pytest.raises(ValueError, match="not this stage's TrainSchedule"):
        emu.set_waits(same_length_other_stage)  # stage 3's stream has as many instructions as stage 0's
    with pytest.raises(NotImplementedError, match="training only"):
        emu.eval_batch()
