"""The one-GPU harvesting benchmark (gpubench) on this CPU-only machine.

- the pipeline model on the instruction streams of DeepSpeed's real ``TrainSchedule``;
- the stage emulator instrumented by the real hook (``bubbles.hook.instrument``): profiled bubbles where the
  model put them, losses bit-identical with and without the hook; the CUDA path through a stand-in for
  ``torch.cuda`` (the device drains before every wait);
- the report's formulas (FreeRide's I and S);
- the fill examples' device, precision and GPU size presets;
- the smoke mode end to end (one shared run: the real agent, the real fill processes, the stand-in MPS control
  program of tests/fakes) and the CLI's bad flags.
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed.runtime.pipe.schedule import TrainSchedule

import gpubench.emulator as emulator_mod
from bubbles.agent.ledger import BREAKDOWN
from bubbles.core import paths
from bubbles.training.hook import candidate_slots, instruction_stream, instrument
from bubbles.training.probes import StaticMemoryProbe
from gpubench.emulator import CudaOps, DeviceOps, StageEmulator, StageShape
from gpubench.pipeline_model import simulate_pipeline
from gpubench.report import cost_savings, regimes_of_run
from gpubench.run import main as bench_main

ROOT = Path(__file__).resolve().parent.parent
TINY = StageShape(hidden=32, heads=4, ffn_mult=2, seq=16, micro_batch=1, blocks=1)


def ds_streams(p: int, m: int) -> list[list[str]]:
    return [instruction_stream(TrainSchedule(micro_batches=m, stages=p, stage_id=s)) for s in range(p)]


def passes(f: float, b: float, o: float = 0.0) -> dict[str, float]:
    return {"ForwardPass": f, "BackwardPass": b, "OptimizerStep": o}


# ---------------------------------------------------------------------------------------------------
# the pipeline model


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 16)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.003, 0.0075)])
def test_deepspeed_1f1b_iteration_and_wait_follow_the_textbook_relation(p: int, m: int, f: float, b: float) -> None:
    # The exact relation for DeepSpeed's TrainSchedule with zero latency and zero-length other instructions:
    # every stage's steady-state batch lasts (m + p - 1)(F + B) and waits (p - 1)(F + B) of it.
    waits = simulate_pipeline(ds_streams(p, m), microbatches=m, durations_s=passes(f, b))
    assert waits.converged
    for st in waits.stages:
        assert st.iteration_s == pytest.approx((m + p - 1) * (f + b), rel=1e-9)
        assert st.wait_s == pytest.approx((p - 1) * (f + b), rel=1e-9)
        assert st.busy_s == pytest.approx(m * (f + b), rel=1e-9)
        assert st.bubble_share == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)


def test_optimizer_step_lengthens_the_iteration_not_the_waits() -> None:
    plain = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 2))
    with_opt = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 2, 0.5))
    for a, b in zip(plain.stages, with_opt.stages, strict=True):
        assert b.iteration_s == pytest.approx(a.iteration_s + 0.5)
        assert b.waits_s == pytest.approx(a.waits_s)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 3), (4, 4), (4, 8)])
def test_waits_sit_where_the_hook_expects_bubbles(p: int, m: int) -> None:
    # Stage s of DeepSpeed's 1F1B (m >= p, no barrier between batches) waits s(F + B) for its first
    # activation (fill), (p - 1 - s)B for its first gradient (fwd-bwd) and F for each of its p - 1 - s last
    # gradients (drain): (p - 1)(F + B) in all.
    f, b = 1.0, 2.5
    waits = simulate_pipeline(ds_streams(p, m), microbatches=m, durations_s=passes(f, b))
    for st in waits.stages:
        s = st.stage
        cands = {c.position: c for c in candidate_slots(st.stream)}
        waiting = {pos: w for pos, w in st.waits_s.items() if w > 1e-12}
        assert set(waiting) <= set(cands), f"stage {s} waits where the hook sees no candidate"
        by_kind: dict[str, list[float]] = {}
        for pos, w in sorted(waiting.items()):
            by_kind.setdefault(cands[pos].kind, []).append(w)
        expected: dict[str, list[float]] = {}
        if s > 0:
            expected["fill"] = [s * (f + b)]
        if s < p - 1:
            expected["fwd-bwd"] = [(p - 1 - s) * b]
            expected["drain"] = [f] * (p - 1 - s)
        assert by_kind.keys() == expected.keys(), (s, by_kind)
        for kind, ws in expected.items():
            assert by_kind[kind] == pytest.approx(ws), (s, kind)


def test_p2p_latency_lengthens_every_stage_s_waits() -> None:
    base = simulate_pipeline(ds_streams(4, 8), microbatches=8, durations_s=passes(1, 2))
    slow = simulate_pipeline(ds_streams(4, 8), microbatches=8, durations_s=passes(1, 2), p2p_latency_s=0.1)
    for a, b in zip(base.stages, slow.stages, strict=True):
        assert b.wait_s > a.wait_s
        assert b.iteration_s > a.iteration_s
        assert b.busy_s == pytest.approx(a.busy_s)


def test_streams_can_be_given_as_a_callable() -> None:
    as_list = simulate_pipeline(ds_streams(3, 4), microbatches=4, durations_s=passes(1, 1))
    as_fn = simulate_pipeline(lambda s: ds_streams(3, 4)[s], stages=3, microbatches=4, durations_s=passes(1, 1))
    assert as_list == as_fn


@pytest.mark.parametrize("kwargs,message", [
    ({"streams": ds_streams(2, 4), "microbatches": 0}, "microbatches must be an integer >= 1"),
    ({"streams": ds_streams(2, 4)[:1], "microbatches": 4}, "at least 2 stages"),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "durations_s": {"ForwardPass": -1.0}},
     "duration of ForwardPass must be a finite number"),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "durations_s": {"BackwardPass": math.nan}},
     "duration of BackwardPass"),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "p2p_latency_s": -0.001}, "p2p_latency_s must be"),
    ({"streams": [ds_streams(2, 2)[0], ds_streams(2, 4)[1]], "microbatches": 4},
     "must be the same schedule's"),
    ({"streams": [ds_streams(2, 4)[1], ds_streams(2, 4)[0]], "microbatches": 4}, "no stage -1 to receive from"),
    ({"streams": [["RecvGrad", "SendActivation"], ["RecvActivation", "SendGrad"]], "microbatches": 1},
     "the streams deadlock"),
    ({"streams": lambda s: ds_streams(2, 4)[s], "microbatches": 4}, "give stages="),
    ({"streams": ds_streams(2, 4), "microbatches": 4, "stages": 3}, "give one per stage"),
])
def test_bad_model_inputs_raise_with_what_to_fix(kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("durations_s", passes(1, 1))
    streams = kwargs.pop("streams")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate_pipeline(streams, **kwargs)


def test_asking_for_a_stage_outside_the_pipeline_says_which_exist() -> None:
    waits = simulate_pipeline(ds_streams(4, 4), microbatches=4, durations_s=passes(1, 1))
    with pytest.raises(ValueError, match=r"stage 7 is outside the pipeline's 4 stages \(0..3\)"):
        waits.stage(7)


# ---------------------------------------------------------------------------------------------------
# the stage emulator under the real hook (CPU)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
        assert cycle is not None and getattr(inst, "timing", "cuda") == "cuda"
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
    # A listener in the stage directory, so the hook really signals every bubble while the losses are compared.
    stage_dir = paths.stage_dir(tmp_path, "lossy", stage)
    stage_dir.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(stage_dir / "fill-probe.sock"))
    listener.setblocking(False)
    inst = instrument(hooked, training="lossy", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1 << 30),
                      warmup_iterations=1, profile_iterations=2, min_bubble_s=0.0002)
    try:
        assert _losses(hooked, 6) == plain
        assert inst.stats["bubbles_signalled"] > 0  # the hook was not idle while the losses were compared
    finally:
        inst.detach()
        listener.close()
    assert len(set(plain)) > 1  # the optimizer works: the losses move from batch to batch


def test_calibration_times_both_passes_and_leaves_no_gradient() -> None:
    emu = StageEmulator(stage_id=0, num_stages=2, micro_batches=2, shape=TINY)
    forward_s, backward_s = emu.calibrate(steps=3, warmup=1)
    assert 0 < forward_s < 1 and 0 < backward_s < 1
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
    assert base[0] != base[1] and base[1] != base[2]  # still jittered from iteration to iteration
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
    assert 0.95 < mean < 1.05 and 0.15 < cv < 0.25  # lognormal, mean 1, coefficient of variation 0.2
    runs = []
    for _ in range(2):  # seeded: two emulators built alike wait alike
        naps: list[float] = []
        again = StageEmulator(stage_id=0, num_stages=4, micro_batches=4, shape=TINY, sleep=naps.append,
                              clock=_ticks(), wait_jitter=0.2)
        again.model_waits(forward_s=0.01, backward_s=0.02)
        again.train_batch()
        runs.append(naps)
    assert runs[0] == runs[1] and len(set(runs[0])) == len(runs[0])
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


def test_training_process_rejects_a_stage_outside_the_pipeline(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from gpubench.train import main as train_main

    with pytest.raises(SystemExit) as exc:
        train_main(["--stage", "7", "--stages", "4", "--hidden", "32", "--heads", "4", "--seq", "8",
                    "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "stage 7 is not one of the pipeline's 4 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        train_main(["--phases", "off:x", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2


@pytest.mark.parametrize("paired", [True, False])
def test_the_training_pairs_each_rounds_waits_by_iteration_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  paired: bool) -> None:
    from gpubench.train import main as train_main

    keys: list[tuple[int, ...]] = []
    real = StageEmulator.pair_waits
    monkeypatch.setattr(StageEmulator, "pair_waits", lambda self, *key: (keys.append(key), real(self, *key))[1])
    out = tmp_path / "train.json"
    assert train_main(["--device", "cpu", "--stages", "2", "--microbatches", "2", "--hidden", "32", "--heads", "4",
                       "--seq", "8", "--blocks", "1", "--calibration-steps", "1", "--warmup-iterations", "0",
                       "--profile-iterations", "1", "--phases", "off:2,harvest:2,off:2,harvest:2",
                       "--paired-waits" if paired else "--no-paired-waits", "--out", str(out)]) == 0
    if paired:  # round 0's baseline and harvest iterations, then round 1's, keyed alike
        assert keys == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (1, 0), (1, 1)]
    else:
        assert keys == []
    assert json.loads(out.read_text())["model"]["paired_waits"] is paired


@pytest.mark.parametrize("flags,reason", [
    (["--device", "gpu"], "give cpu, cuda or cuda:N"),
    (["--free-bytes", "-1"], "--free-bytes must be >= 0"),
    (["--profile-iterations", "0"], "--profile-iterations >= 1"),
    (["--warmup-iterations", "-2"], "--warmup-iterations and --free-bytes must be >= 0"),
    (["--start-timeout-s", "0"], "--start-timeout-s > 0"),
    (["--calibration-steps", "0"], "--calibration-steps >= 1"),
    (["--p2p-latency-ms", "-0.5"], "--p2p-latency-ms and --min-bubble-ms must be >= 0"),
    (["--wait-jitter", "3"], "--wait-jitter 3.0 must be a coefficient of variation from 0 to 2"),
    (["--link-gb-per-s", "-1"], "a bandwidth >= 0"),
    (["--stage-memory-gb", "-2"], "--stage-memory-gb -2.0: give the GiB the stage holds"),
])
def test_training_process_refuses_bad_flags_before_any_work(tmp_path: Path, flags: list[str], reason: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from gpubench.train import main as train_main

    with pytest.raises(SystemExit) as exc:
        train_main([*flags, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------------
# the report's formulas


def test_cost_savings_follow_freeride_s_definition() -> None:
    # No slowdown, fill work at the solo rate, same prices: the side task's whole dedicated-GPU cost is saved.
    assert cost_savings(t_no_s=1.0, t_with_s=1.0, fill_per_s=50, solo_per_s=50, price_training=2,
                        price_fill=2) == pytest.approx(1.0)
    # 10% slower and no fill work: a 10% cost increase.
    assert cost_savings(t_no_s=1.0, t_with_s=1.1, fill_per_s=0, solo_per_s=50, price_training=2,
                        price_fill=2) == pytest.approx(-0.1)
    # FreeRide's numbers: (P_II W / Th_II - P_I dT) / (P_I T_no)
    s = cost_savings(t_no_s=2.0, t_with_s=2.02, fill_per_s=10, solo_per_s=40, price_training=3.96, price_fill=0.18)
    assert s == pytest.approx((0.18 * 10 * 2.02 / 40 - 3.96 * 0.02) / (3.96 * 2.0))
    assert cost_savings(t_no_s=1.0, t_with_s=1.0, fill_per_s=1, solo_per_s=0, price_training=1,
                        price_fill=1) is None


def test_regimes_of_a_run_compare_each_mode_with_the_same_run_s_baseline() -> None:
    phases = ["profile"] * 2 + ["off"] * 4 + ["naive"] * 4 + ["harvest"] * 4
    times = [0.2, 0.2, *(0.9, 0.9, 1.0, 1.0), *(0.9, 0.9, 2.0, 2.0), *(0.9, 0.9, 1.005, 1.005)]
    record = {"phase": phases, "iteration_s": times, "phases": [
        {"mode": "off", "start_ns": 0, "end_ns": 4 * 10**9}, {"mode": "naive", "start_ns": 0, "end_ns": 8 * 10**9},
        {"mode": "harvest", "start_ns": 0, "end_ns": 4 * 10**9}]}
    stats = {"modes": {"naive": {"fill_steps": 80, "fill_flops": 8e12, "bubble_s": 1.0, "filled_s": 0.9},
                       "harvest": {"fill_steps": 40, "fill_flops": 4e12, "bubble_s": 1.0, "filled_s": 0.7,
                                   "overruns": 2, "overrun_p99_ms": 0.4}}}
    run = {"job": "j", "isolation": "contexts", "training": record, "agent_stats": stats, "samples_per_step": 5}
    got = {r["regime"]: r for r in regimes_of_run(run, {"j": {"samples_per_s": 100.0}}, settle=2,
                                                    price_training=1.0, price_fill=1.0)}
    assert set(got) == {"baseline", "naive co-location", "harvesting (contexts)"}
    assert got["naive co-location"]["slowdown"] == pytest.approx(1.0)
    assert got["naive co-location"]["recovered_tflops"] == pytest.approx(1.0)  # 8e12 FLOPs in 8 s
    assert got["naive co-location"]["fill_samples_per_s"] == pytest.approx(50.0)
    harvest = got["harvesting (contexts)"]
    assert harvest["slowdown"] == pytest.approx(0.005)
    assert harvest["fill_share"] == pytest.approx(0.7)
    # The work in the bubbles against the job alone in as much time: 200 samples, 100/s alone, 1 s of bubbles.
    assert harvest["fill_work_share"] == pytest.approx(200 / (100.0 * 1.0))
    assert got["naive co-location"]["fill_work_share"] is None  # naive steps are not bubble work
    assert harvest["goal_met"] is True
    assert harvest["overruns"] == 2
    assert harvest["cost_savings"] == pytest.approx((50 * 1.005 / 100 - 0.005) / 1.0)
    assert got["naive co-location"]["goal_met"] is False


def test_each_regime_has_its_slowdown_and_fill_share_per_round_with_an_interval_over_rounds() -> None:
    from gpubench.report import build_report, format_table

    phases: list[str] = []
    times: list[float] = []
    phase_records = []
    bubbles, steps = [], []
    harvest_slow = [0.01, -0.02, 0.03, 0.0, 0.02, 0.04]  # each round's harvest against that round's baseline
    t = 0
    for k, h in enumerate(harvest_slow):
        base = 1.0 + 0.1 * k  # the machine drifts from round to round: each round has its own baseline
        for mode, it in (("off", base), ("naive", 2 * base), ("harvest", base * (1 + h))):
            phases += [mode] * 3
            times += [it] * 3
            phase_records.append({"mode": mode, "start_ns": t, "end_ns": t + 10**9})
            if mode == "harvest":  # a bubble of 10 ms, half filled in round k ... plus k ms
                bubbles.append({"stage": 0, "mode": "harvest", "start_ns": t + 1000, "end_ns": t + 1000 + 10**7,
                                "predicted_end_ns": t + 1000 + 10**7, "job": "j", "share": 1.0, "step_s": 0.001,
                                "guard_paused": False})
                steps.append({"stage": 0, "mode": "harvest", "start_ns": t + 1000,
                              "end_ns": t + 1000 + (5 + k) * 10**6})
            t += 10**9
    record = {"phase": phases, "iteration_s": times, "phases": phase_records}
    stats = {"modes": {"harvest": {"bubble_s": 0.06, "filled_s": 0.045}}, "bubbles": bubbles, "steps": steps}
    run = {"job": "j", "isolation": "contexts", "training": record, "agent_stats": stats, "samples_per_step": 1}
    got = {r["regime"]: r for r in regimes_of_run(run, {}, settle=0, price_training=1.0, price_fill=1.0)}
    harvest = got["harvesting (contexts)"]
    assert harvest["slowdown_rounds"] == pytest.approx(harvest_slow)
    assert harvest["slowdown_interval"] == pytest.approx((-0.02, 0.04))  # 6 rounds: the extremes, 96.9%
    assert harvest["fill_share_rounds"] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert harvest["fill_share_interval"] == pytest.approx((0.5, 1.0))
    assert got["naive co-location"]["slowdown_rounds"] == pytest.approx([1.0] * 6)
    report = build_report(config={"device": "cpu", "repeats": 6}, solo={}, runs=[run], settle=0,
                          price_training=1.0, price_fill=1.0)
    assert "[-2.0%, +4.0%]" in format_table(report)
    few = regimes_of_run({**run, "training": {**record, "phase": phases[:9 * 3], "iteration_s": times[:9 * 3]}},
                         {}, settle=0, price_training=1.0, price_fill=1.0)
    table = format_table({**report, "regimes": few})
    assert "— (3 rounds; 6 needed: --repeats)" in table


def test_a_failed_run_is_reported_as_failed_with_its_reason() -> None:
    from gpubench.report import build_report, format_table

    failed = {"job": "batch-inference", "isolation": "mps", "isolation_label": "MPS",
              "error": "nvidia-cuda-mps-control is not on PATH"}
    report = build_report(config={"device": "cuda:0", "smoke": False}, solo={}, runs=[failed], settle=2,
                          price_training=3.5, price_fill=3.5)
    assert report["runs"] == [{"job": "batch-inference", "isolation": "mps", "isolation_label": "MPS",
                               "ok": False, "error": "nvidia-cuda-mps-control is not on PATH"}]
    assert report["regimes"] == []
    table = format_table(report)
    assert "run batch-inference / MPS: FAILED: nvidia-cuda-mps-control is not on PATH" in table
    assert "SMOKE" not in table


# ---------------------------------------------------------------------------------------------------
# the fill examples: assigned device, precision, GPU presets, FLOP counts


def test_fill_examples_validate_dtype_and_architecture() -> None:
    from bubbles.fill_examples.batch_inference import BatchInference
    from bubbles.fill_examples.image_classification import ImageClassification

    with pytest.raises(ValueError, match="dtype must be one of 'float32', 'bfloat16', got 'fp16'"):
        ImageClassification(dtype="fp16")
    with pytest.raises(ValueError, match="arch must be one of"):
        ImageClassification(arch="vgg")
    with pytest.raises(ValueError, match="dtype must be one of"):
        BatchInference(dtype="half")
    with pytest.raises(ValueError, match="multiple of heads"):
        BatchInference(width=770, heads=12)
    with pytest.raises(ValueError, match="ffn"):
        BatchInference(ffn=0)


def test_fill_examples_go_where_the_agent_assigned_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cpu:1")  # a CPU executor: core 1 stands in for the accelerator
    job = ImageClassification(steps=2)
    job.create()
    job.init()
    assert job.device == "cpu"
    # The agent's assignment is followed, not torch.cuda.is_available(): where this build of torch has no CUDA,
    # following it fails loudly instead of silently training on the CPU.
    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0")
    job = ImageClassification(steps=2)
    job.create()
    if torch.cuda.is_available():
        job.init()
        assert job.device == "cuda:0"
    else:
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            job.init()


def test_bert_shaped_inference_counts_the_flops_of_its_shape() -> None:
    from bubbles.fill_examples.batch_inference import BatchInference

    args = BatchInference.bert_base(batch_size=2, layers=2, seq_len=16, dtype="float32")
    job = BatchInference(**args, steps=2)
    job.create()
    job.init()
    b, s, w, f, n = 2, 16, 768, 3072, 2
    matmuls = 2 * b * s * n * (4 * w * w + 2 * w * f)
    attention = 2 * 2 * b * s * s * w * n
    head = 2 * b * w * 10
    assert job.step_flops == pytest.approx(matmuls + attention + head, rel=0.01)
    assert job.step().samples == 2


def test_cuda_graphs_are_refused_with_a_clear_error_where_there_is_no_cuda_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.batch_inference import BatchInference
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cpu:0")
    for cls in (BatchInference, ImageClassification):
        with pytest.raises(ValueError, match="cuda_graphs must be true or false, got 'yes'"):
            cls(cuda_graphs="yes")  # type: ignore[arg-type]
        job = cls(cuda_graphs=True, steps=1)
        job.create()
        with pytest.raises(RuntimeError, match=r"cuda_graphs needs a CUDA device.*'cpu'.*set cuda_graphs to false"):
            job.init()
        assert not job.graphs and job.steps_done == 0  # nothing captured, nothing run
    plain = BatchInference(steps=1)  # the default: eager steps, no graphs
    plain.create()
    plain.init()
    assert plain.step(plain.batch_size).samples == plain.batch_size and not plain.graphs


def test_a_replayed_step_copies_its_batch_into_the_graphs_inputs_and_reads_its_output() -> None:
    # The replay plumbing, with a stand-in for torch.cuda.CUDAGraph (no GPU here): the step's batch goes into the
    # captured size's static inputs, in order, before the replay, and the step reports the graph's output.
    from bubbles.fill_examples.image_classification import ImageClassification

    job = ImageClassification(batch_size=4, steps=4)
    job.create()
    job.init()  # eager on CPU: no graphs

    class StandInGraph:
        def __init__(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            self.inputs, self.output, self.seen = inputs, output, []

        def replay(self) -> None:
            images, labels = self.inputs
            self.seen.append((images.clone(), labels.clone()))
            self.output.fill_(float(labels.sum()))

    inputs = (torch.zeros_like(job.images[0][:2]), torch.zeros_like(job.labels[0][:2]))
    graph = StandInGraph(inputs, torch.zeros(()))
    job.graphs[2] = (graph, inputs, graph.output)
    weights = [p.detach().clone() for p in job.model.parameters()]
    i = job.steps_done % len(job.images)
    job.step(2)
    assert len(graph.seen) == 1
    assert torch.equal(graph.seen[0][0], job.images[i][:2]) and torch.equal(graph.seen[0][1], job.labels[i][:2])
    assert job.last_loss == float(job.labels[i][:2].sum())
    assert all(torch.equal(a, p) for a, p in zip(weights, job.model.parameters(), strict=True))  # no eager step
    job.step(4)  # no graph for a whole batch: the eager step
    assert len(graph.seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_graph_replayed_inference_steps_compute_what_eager_ones_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.batch_inference import BatchInference

    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0")
    args = BatchInference.bert_base(batch_size=8, layers=2, seq_len=32, dtype="float32")
    job = BatchInference(**args, cuda_graphs=True)
    job.create()
    job.init()
    assert set(job.graphs) == {2, 4, 8}  # a quarter, a half and the whole batch
    for size in (2, 4, 8):
        before = job.steps_done
        result = job.step(size)
        assert result.samples == size and result.flops == job.flops_by_size[size] > 0
        _graph, (static,), logits = job.graphs[size]
        with torch.no_grad():
            eager = job._forward(static.clone())
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
        assert job.steps_done == before + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_graph_replayed_training_steps_update_the_model_as_eager_ones_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0")
    graphed = ImageClassification(arch="resnet", batch_size=8, width=8, cuda_graphs=True)
    graphed.create()
    graphed.init()
    assert set(graphed.graphs) == {2, 4, 8}
    eager = ImageClassification(arch="resnet", batch_size=8, width=8)
    eager.create()
    eager.init()
    # the same state (capturing ran warm-up steps) and the same batch next, then one step of each size on both
    eager.restore(graphed.checkpoint())  # a copy (optimizer.load_state_dict alone would share the momentum tensors)
    eager.steps_done = graphed.steps_done
    for size in (2, 4, 8):
        g, e = graphed.step(size), eager.step(size)
        assert g.samples == e.samples == size and g.flops == e.flops > 0
        assert graphed.last_loss == pytest.approx(eager.last_loss, rel=1e-3)
    for (name, a), (_, b) in zip(graphed.model.state_dict().items(), eager.model.state_dict().items(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)


def test_a_checkpointed_image_job_restores_onto_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime restores a checkpoint after create(), before init() moves the job to its device: the optimizer's
    # momentum must follow the parameters there (on a GPU a CPU momentum buffer would stop the first step).
    from bubbles.fill_examples.image_classification import ImageClassification

    monkeypatch.setenv("BUBBLES_DEVICE", "cuda:0" if torch.cuda.is_available() else "cpu:0")
    first = ImageClassification(steps=4)
    first.create()
    first.init()
    first.step()
    state = first.checkpoint()
    assert state is not None
    again = ImageClassification(steps=4)
    again.create()
    again.restore(state)
    again.init()
    again.step()
    devices = {p.device for p in again.model.parameters()}
    momentum = {st["momentum_buffer"].device for st in again.optimizer.state.values()}
    assert momentum == devices and again.steps_done >= 2
    again.graphs[1] = (None, (), None)  # as after capturing: the graphs hold the momentum tensors
    with pytest.raises(RuntimeError, match=r"restore\(\) after the CUDA graphs.*restore before init"):
        again.restore(state)


def test_resnet_preset_trains_in_bf16_and_its_flops_scale_with_the_batch() -> None:
    from bubbles.fill_examples.image_classification import ImageClassification

    flops = {}
    for batch, dtype in ((2, "bfloat16"), (4, "bfloat16"), (2, "float32")):
        job = ImageClassification(arch="resnet", width=4, batch_size=batch, dtype=dtype, steps=2)
        job.create()
        job.init()
        result = job.step()
        assert result.samples == batch and math.isfinite(job.last_loss)
        # the GPU preset's layout (tensor-core convolutions), on every device
        assert all(img.is_contiguous(memory_format=torch.channels_last) for img in job.images)
        flops[(batch, dtype)] = result.flops
    assert flops[(4, "bfloat16")] == pytest.approx(2 * flops[(2, "bfloat16")], rel=0.01)
    assert flops[(2, "float32")] == flops[(2, "bfloat16")]  # FLOPs do not depend on the precision
    small = ImageClassification(batch_size=2, width=4)
    small.create()
    small.init()
    assert (small.step_flops or 0) < flops[(2, "float32")]


# ---------------------------------------------------------------------------------------------------
# the smoke mode end to end, and the CLI's bad flags


@pytest.mark.parametrize("flags,message", [
    (["--device", "gpu"], "--device gpu: use cuda (an NVIDIA GPU), cuda:N, or cpu"),
    (["--device", "cpu", "--hidden", "-8"], "--hidden -8: must be >= 1"),
    (["--device", "cpu", "--stage", "7", "--stages", "4"], "--stage 7: the pipeline has stages 0..3"),
    (["--device", "cpu", "--jobs", "image-classification,video-gen"], "unknown fill job(s) video-gen"),
    (["--device", "cpu", "--isolations", "vm"], "unknown isolation(s) vm"),
    (["--device", "cpu", "--jobs", "batch-inference-graphs"], "--jobs batch-inference-graphs: replays CUDA graphs"),
    (["--device", "cpu", "--settle", "9", "--iterations", "6"], "--settle 9: must be >= 0 and below"),
    (["--device", "cpu", "--price-training", "0"], "--price-training 0"),
    (["--device", "cpu", "--fill-args", "image-classification=[1]"], "write JOB=JSON-object"),
    (["--device", "cpu", "--mps-control", "/no/such/mps-control"], "not an executable file"),
    (["--device", "cpu", "--slowdown-budget", "5"], "a fraction in (0, 1)"),
    (["--device", "cpu", "--wait-jitter", "-0.1"], "--wait-jitter -0.1: a coefficient of variation"),
    (["--device", "cpu", "--link-gb-per-s", "-5"], "--link-gb-per-s -5.0: a bandwidth >= 0"),
    (["--device", "cpu", "--stage-memory-gb", "-1"], "--stage-memory-gb -1.0: the GiB the training's stage holds"),
    (["--device", "cpu", "--tail-risk", "0.9"], "--tail-risk: $BUBBLES_TAIL_RISK='0.9': give the accepted chance"),
    (["--device", "cpu", "--modes", "off,replay"], "--modes off,replay: unknown mode(s) replay"),
    (["--device", "cpu", "--modes", "harvest,off"], "--modes harvest,off: give off (the baseline"),
    (["--device", "cpu", "--modes", "off"], "--modes off: give off (the baseline"),
    (["--device", "cpu", "--modes", "off,harvest,harvest"], "each once"),
])
def test_bad_benchmark_flags_exit_2_saying_what_to_do(flags: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(flags) == 2
    assert message in capsys.readouterr().err


def test_the_tail_risk_reaches_the_agents_environment_and_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from bubbles.core import control
    from gpubench.run import _env, build_parser, resolve

    monkeypatch.setenv(control.TAIL_RISK_ENV, "0.2")
    args = build_parser().parse_args(["--device", "cpu"])
    assert resolve(args) == [] and args.tail_risk == 0.2  # the environment's, when the flag is not given
    args = build_parser().parse_args(["--device", "cpu", "--tail-risk", "0"])
    assert resolve(args) == []
    assert _env(args, None)[control.TAIL_RISK_ENV] == "0.0"  # the agent, and the fill processes it starts


def test_a_run_of_only_the_baseline_and_harvesting_reports_just_those(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_harvest.py"), "--device", "cpu",
                           "--modes", "off,harvest", "--jobs", "batch-inference", "--isolations", "contexts",
                           "--out", str(tmp_path / "report"), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["regime"] for r in report["regimes"]] == ["baseline", "harvesting (contexts)"]
    record = json.loads((tmp_path / "work" / "batch-inference-contexts" / "train.json").read_text())
    assert {p["mode"] for p in record["phases"]} == {"off", "harvest"}
    assert report["config"]["modes"] == "off,harvest"


def test_unparseable_benchmark_flag_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        bench_main(["--stages", "four"])
    assert exc.value.code == 2


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-harvest")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_harvest.py"), "--device", "cpu",
                           "--out", str(out / "report"), "--workdir", str(out / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"report": json.loads((out / "report" / "report.json").read_text()), "out": out / "report",
            "work": out / "work", "stdout": proc.stdout, "stderr": proc.stderr, "seconds": time.monotonic() - t0}


EXPECTED_REGIMES = {"baseline", "naive co-location", "MPS only", "harvesting (contexts)", "harvesting (MPS)"}
FIELDS = ("iteration_median_s", "iteration_p99_s", "slowdown", "slowdown_p99", "fill_samples_per_s",
          "recovered_tflops", "fill_share", "overruns", "overrun_p99_ms", "cost_savings", "goal_met")


def test_smoke_run_reports_every_regime_of_every_fill_job(smoke: dict[str, Any]) -> None:
    report = smoke["report"]
    assert report["config"]["smoke"] is True and report["config"]["device"] == "cpu"
    assert all(r["ok"] for r in report["runs"]), report["runs"]
    by_job: dict[str, set[str]] = {}
    for r in report["regimes"]:
        by_job.setdefault(r["job"], set()).add(r["regime"])
        for field in FIELDS:
            assert field in r, (r["regime"], field)
        for field in ("iteration_median_s", "iteration_p99_s", "fill_samples_per_s", "recovered_tflops",
                      "fill_share", "overrun_p99_ms"):
            assert math.isfinite(r[field]) and r[field] >= 0, (r["regime"], field, r[field])
        if r["regime"] != "baseline":
            for field in ("slowdown", "slowdown_p99", "cost_savings"):
                assert r[field] is not None and math.isfinite(r[field]), (r["regime"], field)
            assert isinstance(r["goal_met"], bool)
    assert by_job == {"image-classification": EXPECTED_REGIMES, "batch-inference": EXPECTED_REGIMES}
    assert report["prices"]["training_gpu_hour"] > 0 and report["prices"]["fill_gpu_hour"] > 0
    assert set(report["solo"]) == {"image-classification", "batch-inference"}
    assert all(s["samples_per_s"] > 0 for s in report["solo"].values())


def test_smoke_run_harvests_and_the_baseline_does_no_fill_work(smoke: dict[str, Any]) -> None:
    for r in smoke["report"]["regimes"]:
        if r["regime"] == "baseline":
            assert r["fill_steps"] == 0
        elif r["mode"] == "harvest":
            assert r["fill_steps"] > 0 and r["fill_share"] > 0, r
            # where the bubble time went: shares that add up to all of it, the filled one the run's own figure
            b = r["breakdown"]
            assert sum(b[k] for k, _ in BREAKDOWN) == pytest.approx(1.0, abs=1e-6) and min(b.values()) >= 0, b
            assert b["tail"] <= b["filled"] + 1e-9, b  # what steps past the predicted end filled is part of it
            assert b["filled"] == pytest.approx(r["fill_share"], abs=0.05), (b, r["fill_share"])
        else:  # naive co-location and MPS only: the fill job runs freely, so it always does work
            assert r["fill_steps"] > 0, r


def test_smoke_report_says_where_bubble_time_went_and_the_fill_jobs_step_times(smoke: dict[str, Any]) -> None:
    md = (smoke["out"] / "report.md").read_text()
    assert "Where the harvest phases' bubble time went" in md and "| past_prediction | tail |" in md
    assert smoke["report"]["config"]["tail_risk"] == 0.1 and ", tail risk 0.1;" in md
    assert all(r["fill_step_profile"] and r["fill_step_profile"].startswith("step time")
               for r in smoke["report"]["runs"]), smoke["report"]["runs"]
    assert "timed at init: step time" in md and "harvest steps by size: " in md
    assert "SM clock not recorded: a CPU run has no SM clock" in md
    for r in smoke["report"]["runs"]:  # every harvest step has one of its job's sizes (a quarter, a half, a whole)
        sizes = r["harvest_steps_by_size"]
        assert sizes and sum(sizes.values()) > 0 and set(sizes) <= {"1", "2", "4", "8", "16"}, sizes


def test_smoke_run_labels_mps_as_the_stand_in(smoke: dict[str, Any]) -> None:
    report = smoke["report"]
    for r in report["regimes"]:
        if r["isolation"] == "mps":
            assert r["isolation_label"] == "stand-in MPS (no GPU)"
    mps_runs = [r for r in report["runs"] if r["isolation"] == "mps"]
    assert mps_runs and all(r["agent_isolation"]["mode"] == "mps" and r["agent_isolation"]["state"] == "ready"
                            for r in mps_runs)
    # The training was an MPS client at priority 0 (the stand-in ignores it, a real daemon would not).
    assert "stand-in MPS (no GPU)" in smoke["stdout"]
    # Nothing joins the stand-in: the report says membership was not verified, not that it was.
    assert all(r["mps_membership"].startswith("not verifiable") for r in mps_runs)


def test_mps_membership_needs_the_training_and_the_fill_job_on_one_server() -> None:
    from gpubench.run import mps_membership_problem

    assert mps_membership_problem({7: [100, 200]}, 100) is None
    late = mps_membership_problem({7: [200]}, 100)  # the training initialized CUDA before the daemon ran
    assert late is not None and "training (pid 100) is not a client" in late and "not MPS" in late
    alone = mps_membership_problem({7: [100], 8: [200]}, 100)
    assert alone is not None and "fill job is not a client of the training's MPS server" in alone
    assert "no server" in (mps_membership_problem({}, 100) or "")


def test_smoke_run_prints_the_table_labelled_as_a_smoke_run(smoke: dict[str, Any]) -> None:
    out = smoke["stdout"]
    assert "SMOKE RUN on CPU" in out and "Not a performance measurement" in out
    assert "| fill job | regime |" in out and "cost savings S" in out
    assert "P_I $3.50/GPU-hour" in out
    assert (smoke["out"] / "report.md").read_text().strip() == out.strip()
    assert (smoke["out"] / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "estimated" in smoke["stderr"]  # the run time estimate comes up front


def test_smoke_run_losses_are_finite_and_the_modelled_bubbles_were_profiled(smoke: dict[str, Any]) -> None:
    for r in smoke["report"]["runs"]:
        assert r["losses_finite"]
        assert r["profiled_bubbles"] >= 1
        assert r["model"]["converged"] and 0 < r["model"]["bubble_share"] < 1
        assert r["profiled_bubble_share"] > 0


def test_a_run_that_cannot_be_measured_exits_1_and_the_report_says_why(tmp_path: Path) -> None:
    # An MPS control program that answers nothing: the agent fails closed (no fill job starts), so the run
    # measures nothing; the script still writes its report, with the reason, and exits 1.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_harvest.py"), "--device", "cpu",
                           "--jobs", "batch-inference", "--isolations", "mps", "--mps-control", "/bin/false",
                           "--solo-seconds", "0.2", "--run-timeout-s", "12", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (run,) = report["runs"]
    assert run["ok"] is False and run["error"]
    assert report["regimes"] == []
    assert "FAILED" in proc.stdout


def test_the_ballast_brings_the_stage_to_a_real_stage_s_memory_and_leaves_room_for_a_fill_job() -> None:
    from gpubench.train import ballast_bytes

    gib = 1 << 30
    assert ballast_bytes(60 * gib, 5 * gib, 80 * gib) == 55 * gib  # the model holds 5: 55 more
    assert ballast_bytes(4 * gib, 5 * gib, 80 * gib) == 0  # already holds more than the target
    with pytest.raises(ValueError, match="leave at least 2 GiB"):
        ballast_bytes(79 * gib, 0, 80 * gib)


def test_the_gpu_checks_script_says_what_is_missing_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    script = ROOT / "tools" / "gpu-checks.sh"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(script), str(tmp_path / "a")], capture_output=True, text=True, env=bare,
                          timeout=60)
    assert proc.returncode == 2 and "nvidia-smi not found" in proc.stderr
    # a driver but a torch without CUDA (this machine's): the script names the interpreter to change
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    (fake / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", str(script), str(tmp_path / "b")], capture_output=True, text=True, timeout=60,
                          env={**bare, "PATH": f"{fake}:/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 2 and "has no CUDA torch" in proc.stderr and "set PYTHON" in proc.stderr


def test_the_graphs_presets_are_the_eager_ones_with_cuda_graphs_on_a_gpu_and_not_run_by_default() -> None:
    from gpubench.run import DEFAULT_JOBS, JOBS

    assert set(DEFAULT_JOBS) == {"image-classification", "batch-inference"}
    for eager in DEFAULT_JOBS:
        graphs = JOBS[f"{eager}-graphs"]
        assert graphs.entry == JOBS[eager].entry
        assert graphs.args("cuda:0") == {**JOBS[eager].args("cuda:0"), "cuda_graphs": True}
        assert "cuda_graphs" not in JOBS[eager].args("cuda:0")
