"""The benchmark's SM clock record (``gpubench.clocks``): NVML read through its interface, samples put into the phases
they were taken in, and the report pointing out a regime whose clock fell."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from bubbles.core.api import FillMode
from gpubench.clocks import (
    ClockSampler,
    NvmlClockReader,
    clock_drops,
    clocks_by_mode,
    describe,
)
from gpubench.run import _start_clock_sampler

UUID = "GPU-5a1b7c9e-0000-1111-2222-333344445555"


class FakeNvml:
    """The part of ``pynvml`` the reader uses: one GPU, whose clock and reasons the test sets."""

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, *, init_error: Exception | None = None, new_name: bool = True,
                 reasons_error: dict[str, Exception] | None = None) -> None:
        self.init_error = init_error
        self.reasons_error = reasons_error or {}  # by function name: what the driver answers
        self.mhz, self.reasons = 1980, 0
        self.calls: list[Any] = []
        if not new_name:  # bindings from before NVML 12.2 name it "throttle reasons" only
            self.nvmlDeviceGetCurrentClocksEventReasons = None  # type: ignore[assignment]

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != UUID:
            raise RuntimeError("Not Found")
        return "handle"

    def nvmlDeviceGetClockInfo(self, handle: str, kind: int) -> int:
        self.calls.append(("clock", handle, kind))
        return self.mhz if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: str) -> int:
        self.calls.append(("event reasons", handle))
        if "event" in self.reasons_error:
            raise self.reasons_error["event"]
        return self.reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        self.calls.append(("throttle reasons", handle))
        if "throttle" in self.reasons_error:
            raise self.reasons_error["throttle"]
        return self.reasons


def test_the_reader_asks_nvml_for_the_sm_clock_of_the_gpu_by_its_uuid() -> None:
    nvml = FakeNvml()
    nvml.mhz, nvml.reasons = 1755, 0x4
    reader = NvmlClockReader(UUID, nvml)
    assert reader.read() == (1755, 0x4) and reader.reasons_problem is None
    assert nvml.calls == ["init", ("event reasons", "handle"),  # asked once at the start: is it there?
                          ("clock", "handle", FakeNvml.NVML_CLOCK_SM), ("event reasons", "handle")]
    reader.close()
    assert nvml.calls[-1] == "shutdown"
    old = FakeNvml(new_name=False)
    old.reasons = 0x20
    assert NvmlClockReader(UUID, old).read() == (1980, 0x20)
    assert old.calls[-1] == ("throttle reasons", "handle")


def test_a_driver_without_the_new_reasons_query_gets_the_old_one_and_one_without_either_gets_the_clock() -> None:
    older = FakeNvml(reasons_error={"event": RuntimeError("Function Not Found")})  # new bindings, driver < R535
    older.reasons = 0x4
    reader = NvmlClockReader(UUID, older)
    assert reader.read() == (1980, 0x4) and older.calls[-1] == ("throttle reasons", "handle")
    unsupported = RuntimeError("Not Supported")
    neither = FakeNvml(reasons_error={"event": unsupported, "throttle": unsupported})
    reader = NvmlClockReader(UUID, neither)
    assert reader.read() == (1980, 0)
    assert reader.reasons_problem == "nvmlDeviceGetCurrentClocksThrottleReasons: Not Supported"


def test_without_nvml_or_the_gpu_the_reader_says_why() -> None:
    with pytest.raises(RuntimeError, match=r"NVML cannot be initialized \(Driver Not Loaded\)"):
        NvmlClockReader(UUID, FakeNvml(init_error=RuntimeError("Driver Not Loaded")))
    nvml = FakeNvml()
    with pytest.raises(RuntimeError, match="NVML has no GPU GPU-other"):
        NvmlClockReader("GPU-other", nvml)
    assert nvml.calls == ["init", "shutdown"]


class ScriptedReader:
    """Reads the given (mhz, reasons) in turn, then fails; counts closes."""

    def __init__(self, values: list[tuple[int, int]]) -> None:
        self.values = list(values)
        self.closed = 0
        self.exhausted = threading.Event()

    def read(self) -> tuple[int, int]:
        if not self.values:
            self.exhausted.set()
            raise RuntimeError("GPU is lost")
        return self.values.pop(0)

    def close(self) -> None:
        self.closed += 1


def test_the_sampler_stamps_each_reading_and_stops_saying_why_when_a_read_fails() -> None:
    reader = ScriptedReader([(1980, 0), (1900, 0x4), (1800, 0x20)])
    ticks = iter(range(1000, 10**6, 1000))
    sampler = ClockSampler(reader, interval_s=0.001, now=lambda: next(ticks)).start()
    assert reader.exhausted.wait(5)
    samples = sampler.stop()
    assert samples == [[1000, 1980, 0], [2000, 1900, 0x4], [3000, 1800, 0x20]]
    assert sampler.error == "reading the SM clock failed (GPU is lost); sampling stopped"
    assert reader.closed == 1
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        ClockSampler(reader, interval_s=0)


def test_a_sampler_that_is_stopped_reads_no_more() -> None:
    reader = ScriptedReader([(1980, 0)] * 10_000)
    sampler = ClockSampler(reader, interval_s=0.001).start()
    samples = sampler.stop()
    n = len(samples)
    assert n < 10_000 and sampler.error is None
    assert len(reader.values) == 10_000 - n  # nothing read after stop() returned


PHASES = [{"mode": "off", "start_ns": 100, "end_ns": 200}, {"mode": "harvest", "start_ns": 200, "end_ns": 300},
          {"mode": "naive", "start_ns": 300, "end_ns": 400}, {"mode": "off", "start_ns": 500, "end_ns": 600}]


def test_samples_count_in_the_phase_they_were_taken_in() -> None:
    samples = [[50, 1000, 0],  # before the phases (calibration): in none
               [100, 1980, 0], [199, 1970, 0x1],  # off; idle is not a limiting reason
               [200, 1960, 0], [250, 1950, 0x4],  # harvest: half the samples under the power cap
               [300, 1700, 0x4 | 0x20], [399, 1600, 0x40],  # naive
               [450, 500, 0],  # between phases: in none
               [500, 1990, 0], [600, 100, 0]]  # the second off phase; 600 is its end, not in it
    by_mode = clocks_by_mode(samples, PHASES)
    assert by_mode["off"] == {"median_mhz": 1980, "min_mhz": 1970, "samples": 3, "limited_share": 0.0,
                              "limited_by": []}
    assert by_mode["harvest"]["median_mhz"] == 1955 and by_mode["harvest"]["limited_share"] == 0.5
    assert by_mode["harvest"]["limited_by"] == ["power cap"]
    assert by_mode["naive"] == {"median_mhz": 1650, "min_mhz": 1600, "samples": 2, "limited_share": 1.0,
                                "limited_by": ["power cap", "thermal (hardware)", "thermal (software)"]}
    assert clocks_by_mode([], PHASES) == {}


def test_samples_in_a_phases_settle_iterations_do_not_count() -> None:
    """The clock lags a switch of mode: what the first iterations of a phase saw belongs to the mode before."""
    phases = [{"mode": "naive", "start_ns": 0, "end_ns": 1000, "iterations": 10},
              {"mode": "off", "start_ns": 1000, "end_ns": 2000, "iterations": 10}]
    samples = [[500, 1500, 0x4], [1100, 1500, 0x4], [1150, 1600, 0], [1300, 1990, 0], [1700, 1980, 0]]
    assert clocks_by_mode(samples, phases)["off"]["median_mhz"] == 1790  # the naive phase's low clock carried over
    settled = clocks_by_mode(samples, phases, settle=2)  # the first 2 of 10 iterations: 200 ns of each phase
    assert settled["off"] == {"median_mhz": 1985, "min_mhz": 1980, "samples": 2, "limited_share": 0.0,
                              "limited_by": []}
    assert settled["naive"]["samples"] == 1
    assert clocks_by_mode(samples, [{**p, "iterations": 0} for p in phases], settle=2)["off"]["samples"] == 4


def test_a_regime_whose_clock_fell_is_pointed_out_and_one_within_a_percent_is_not() -> None:
    by_mode = clocks_by_mode([[100, 2000, 0], [250, 1985, 0], [350, 1700, 0x4]], PHASES)
    drops = clock_drops(by_mode)
    assert set(drops) == {FillMode.NAIVE.label} and drops["naive"] == pytest.approx(0.15)
    line = describe(by_mode)
    assert line.startswith("SM clock (NVML, median of the phases' samples): off 2000 MHz (min 2000); "
                           "naive 1700 MHz (min 1700), 100% of samples limited by power cap; harvest 1985 MHz")
    assert "naive's is 15.0% below the baseline's: the modelled waits spin in SM cycles" in line
    assert "harvest's is" not in line
    assert clock_drops({"harvest": by_mode["harvest"]}) == {}  # no baseline, nothing to compare with


def test_the_report_carries_each_runs_clocks_and_says_why_one_has_none() -> None:
    from gpubench.report import build_report, format_table

    record = {"phase": ["off", "harvest"], "iteration_s": [1.0, 1.0], "phases": PHASES[:2],
              "model": {"bubble_share": 0.3, "iteration_s": 1.0, "forward_s": 0.1, "backward_s": 0.2}}
    run = {"job": "j", "isolation": "contexts", "training": record, "agent_stats": {}, "samples_per_step": 1,
           "sm_clock_samples": [[150, 1980, 0], [250, 1900, 0x4]]}
    cpu = {**run, "isolation": "mps", "sm_clock_samples": None, "sm_clock_error": "a CPU run has no SM clock"}
    report = build_report(config={"device": "cuda:0"}, solo={}, runs=[run, cpu], settle=0, price_training=1.0,
                          price_fill=1.0)
    assert report["runs"][0]["sm_clock"]["harvest"]["median_mhz"] == 1900
    assert report["runs"][1]["sm_clock"] == {}
    table = format_table(report)
    assert "  - SM clock (NVML, median of the phases' samples): off 1980 MHz" in table
    assert "harvest's is 4.0% below the baseline's" in table
    assert "  - SM clock not recorded: a CPU run has no SM clock" in table
    stopped = {**run, "sm_clock_error": "reading the SM clock failed (GPU is lost); sampling stopped"}
    table = format_table(build_report(config={"device": "cuda:0"}, solo={}, runs=[stopped], settle=0,
                                      price_training=1.0, price_fill=1.0))
    assert "(sampling stopped early: reading the SM clock failed (GPU is lost); sampling stopped)" in table


def test_the_orchestrator_samples_a_gpu_and_says_why_not_on_a_cpu() -> None:
    assert _start_clock_sampler("cpu") == "a CPU run has no SM clock"
    reader = ScriptedReader([(1980, 0)] * 100)
    sampler = _start_clock_sampler("cuda:0", reader)
    assert isinstance(sampler, ClockSampler)
    sampler.stop()
    assert reader.closed == 1
    import torch

    if not torch.cuda.is_available():
        assert _start_clock_sampler("cuda:0") == "torch cannot say the UUID of cuda:0, which NVML needs"


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_nvml_gives_the_sm_clock_of_the_benchmarks_device() -> None:
    sampler = _start_clock_sampler("cuda:0")
    assert isinstance(sampler, ClockSampler), sampler
    import time

    time.sleep(0.3)
    samples = sampler.stop()
    assert sampler.error is None and len(samples) >= 3, (sampler.error, samples)
    assert all(100 <= mhz <= 5000 for _t, mhz, _r in samples), samples
