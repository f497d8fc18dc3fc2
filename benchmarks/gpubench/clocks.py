"""The GPU's SM clock during the benchmark's phases, from NVML, sampled in the orchestrator's process.

The emulated neighbour waits are device-side spins counted in SM clock cycles (``torch.cuda._sleep``), calibrated
once at the start. If fill work makes the GPU lower its clock (a power cap, heat), every spin and every kernel of
the training takes longer, and the regime's slowdown includes the clock's share. For the training's own kernels
that is a real cost of co-location; for the modelled waits, which on a real pipeline are the neighbours' time on
other GPUs, it is not. Recording the clock per phase lets a reader tell the two apart.

The sampler runs in the orchestrator (``gpubench.run``), not in the training's process: it shares no interpreter
lock with the training's thread. Samples are stamped with ``time.monotonic_ns``, the clock of the training
record's phase boundaries, so each falls into the phase it was taken in.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from bubbles.core.api import FillMode

SAMPLE_INTERVAL_S = 0.05
MAX_SAMPLES = 200_000  # about 2.8 hours at the interval: the sampler stops adding beyond it
# NVML's clocks event (throttle) reasons that lower the clock below what the application asked for
# (nvmlClocksEventReasons: idle, application settings, sync boost and display settings are left out).
LIMITING_REASONS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)",
                    0x40: "thermal (hardware)", 0x80: "power brake"}
LIMITING_MASK = sum(LIMITING_REASONS)
CLOCK_DROP_WARNING = 0.01  # a compared mode's median clock this far below the baseline's is pointed out


class ClockReader(Protocol):
    def read(self) -> tuple[int, int]:
        """(SM clock in MHz, NVML's clocks event reasons bitmask) now."""
        ...

    def close(self) -> None: ...


class NvmlClockReader:
    """The SM clock and clocks event reasons of the GPU with ``uuid`` (``GPU-...``), through NVML (``pynvml``, or a
    stand-in with its interface). Raises RuntimeError saying why when NVML cannot give them."""

    def __init__(self, uuid: str, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[no-redef]
            except ImportError as exc:
                raise RuntimeError(f"NVML bindings are not installed ({exc}): pip install nvidia-ml-py") from None
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise RuntimeError(f"NVML cannot be initialized ({exc})") from None
        try:
            self._handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception as exc:
            nvml.nvmlShutdown()
            raise RuntimeError(f"NVML has no GPU {uuid} ({exc})") from None
        # Renamed in NVML 12.2 (the old name is deprecated): new bindings have both, but a driver older than R535
        # lacks the new function, and a GPU may not support the query at all (then the clock alone is sampled).
        self._reasons: Callable[[Any], int] | None = None
        self.reasons_problem: str | None = None
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(nvml, name, None)
            if fn is None:
                continue
            try:
                fn(self._handle)
            except Exception as exc:
                self.reasons_problem = f"{name}: {exc}"
                continue
            self._reasons, self.reasons_problem = fn, None
            break

    def read(self) -> tuple[int, int]:
        nvml = self._nvml
        mhz = int(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
        return mhz, int(self._reasons(self._handle)) if self._reasons is not None else 0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


class ClockSampler:
    """Reads ``reader`` every ``interval_s`` on a thread until ``stop()``: ``samples`` holds ``[t_ns, mhz, reasons]``.
    A read that fails ends the sampling and says why in ``error`` (the benchmark goes on without clocks)."""

    def __init__(self, reader: ClockReader, interval_s: float = SAMPLE_INTERVAL_S,
                 now: Callable[[], int] = time.monotonic_ns) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._reader = reader
        self._interval_s = interval_s
        self._now = now
        self._stop = threading.Event()
        self.samples: list[list[int]] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="gpubench-clocks", daemon=True)

    def start(self) -> ClockSampler:
        self._thread.start()
        return self

    def stop(self) -> list[list[int]]:
        """Stop sampling; the samples so far (a copy: a read still in flight cannot add to it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._thread.is_alive():  # a read stuck in the driver keeps its reader open
            self._reader.close()
        return list(self.samples)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                mhz, reasons = self._reader.read()
            except Exception as exc:
                self.error = f"reading the SM clock failed ({exc}); sampling stopped"
                return
            if len(self.samples) < MAX_SAMPLES:
                self.samples.append([self._now(), mhz, reasons])
            self._stop.wait(self._interval_s)


def clocks_by_mode(samples: Sequence[Sequence[int]], phases: Sequence[Mapping[str, Any]], settle: int = 0
                   ) -> dict[str, dict[str, Any]]:
    """Per fill mode label, over the samples taken inside that mode's phases (``start_ns <= t < end_ns``), less
    those in the part of each phase its first ``settle`` iterations took (as the slowdown figures drop them: the
    clock lags a switch of mode), reckoned from the phase's length and ``iterations``: the median and lowest SM
    clock, how many samples, and the share whose clocks event reasons include a limiting one (``LIMITING_REASONS``)
    with the reasons seen. Modes without a sample are left out."""
    windows = []
    for p in phases:
        start, end, n = int(p["start_ns"]), int(p["end_ns"]), int(p.get("iterations") or 0)
        if n and settle:
            start += (end - start) * min(settle, n) // n
        windows.append((start, end, str(p["mode"])))
    windows.sort()
    by_mode: dict[str, list[tuple[int, int]]] = {}
    for t_ns, mhz, reasons in samples:
        for start, end, mode in windows:
            if start <= t_ns < end:
                by_mode.setdefault(mode, []).append((int(mhz), int(reasons)))
                break
    out: dict[str, dict[str, Any]] = {}
    for mode, seen in by_mode.items():
        limited = [r & LIMITING_MASK for _, r in seen if r & LIMITING_MASK]
        out[mode] = {
            "median_mhz": statistics.median(m for m, _ in seen),
            "min_mhz": min(m for m, _ in seen),
            "samples": len(seen),
            "limited_share": len(limited) / len(seen),
            "limited_by": sorted({name for bit, name in LIMITING_REASONS.items() for r in limited if r & bit}),
        }
    return out


def clock_drops(by_mode: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """For each compared mode whose median clock is more than ``CLOCK_DROP_WARNING`` below the baseline's: how far
    below, as a fraction of the baseline's (positive). Empty without a baseline."""
    base = by_mode.get(FillMode.OFF.label)
    if not base or not base["median_mhz"]:
        return {}
    out = {}
    for mode, c in by_mode.items():
        if mode == FillMode.OFF.label:
            continue
        drop = 1 - c["median_mhz"] / base["median_mhz"]
        if drop > CLOCK_DROP_WARNING:
            out[mode] = drop
    return out


def describe(by_mode: Mapping[str, Mapping[str, Any]]) -> str:
    """One line for the report: each mode's median SM clock, and what limited it where something did."""
    parts = []
    for mode in (m.label for m in FillMode):
        c = by_mode.get(mode)
        if c is None:
            continue
        text = f"{mode} {c['median_mhz']:.0f} MHz (min {c['min_mhz']:.0f})"
        if c["limited_share"]:
            text += f", {c['limited_share'] * 100:.0f}% of samples limited by {', '.join(c['limited_by'])}"
        parts.append(text)
    line = "SM clock (NVML, median of the phases' samples): " + "; ".join(parts)
    drops = clock_drops(by_mode)
    if drops:
        line += ". " + "; ".join(f"{mode}'s is {d * 100:.1f}% below the baseline's" for mode, d in drops.items()) + \
            ": the modelled waits spin in SM cycles, so part of that regime's slowdown is the clock's, which a real " \
            "pipeline's waits on its neighbours would not pay"
    return line
