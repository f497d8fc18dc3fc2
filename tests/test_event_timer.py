"""The helper thread of device timing (``bubbles.training.gpu_timing.EventTimer``) on its own: iterations' device-side
lengths in order, signals stamped with the device's time as its clock drifts from the host's, and the wake-up
benchmark's flags. ``FakeStream`` and ``FakeEvent`` (test_gpu_timing.py) play the device."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
from helpers.gpu_timing import FakeEvent, FakeStream, cuda_available

from bubbles.training.gpu_timing import (
    EventTimer,
)


def test_event_timer_reports_each_iterations_device_lengths_in_order() -> None:
    stream = FakeStream()
    got: list[tuple[str, dict[int, int]]] = []
    done = threading.Event()

    def on_iteration(payload: Any, lengths: dict[int, int], span: tuple[int, int] | None) -> None:
        assert span is None  # no start event given
        got.append((payload, dict(lengths)))
        if len(got) == 2:
            done.set()

    timer = EventTimer(lambda: FakeEvent(stream), on_start=lambda *a: None, on_end=lambda *a: None,
                       on_iteration=on_iteration, on_error=lambda exc: pytest.fail(repr(exc)))
    for it, wait in (("a", 0.003), ("b", 0.001)):
        start = timer.begin(7, None, 0)
        assert start is not None
        stream.enqueue(wait)
        timer.end(7, start, None, 0)
        timer.iteration(it)
    assert done.wait(5)
    assert [g[0] for g in got] == ["a", "b"]
    assert got[0][1][7] / 1e9 == pytest.approx(0.003, abs=5e-4)
    assert got[1][1][7] / 1e9 == pytest.approx(0.001, abs=5e-4)
    timer.close()


def test_signals_are_stamped_with_the_device_time_not_the_helper_thread_s_late_wake_up() -> None:
    """The helper thread wakes some time after an event completes; a START stamped with the wake-up would predict
    the bubble's end that much too late. Events whose wake-up lags by 0 or 15 ms, alternately: every stamp must be
    the device's time, within the luckiest wake-up's lag (a few ms allowed: a thread's wake-up on a loaded 2-core
    machine, which the lags are large against)."""
    stream = FakeStream()
    lags = itertools.cycle([0.0, 0.015])

    class LateWakeEvent(FakeEvent):
        def synchronize(self) -> None:
            super().synchronize()
            time.sleep(next(lags))

    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    timer = EventTimer(lambda: LateWakeEvent(stream), on_start=lambda sig, seq, t: starts.__setitem__(seq, t),
                       on_end=lambda sig, seq, t: ends.__setitem__(seq, t), on_iteration=lambda *a: None,
                       on_error=lambda exc: pytest.fail(repr(exc)))
    expected: dict[int, tuple[float, float]] = {}
    for seq in range(1, 13):
        stream.enqueue(0.020)  # the compute ahead of the wait
        start = timer.begin(0, ("slot", 0), seq)
        assert start is not None
        device_start = start.at  # type: ignore[attr-defined]
        stream.enqueue(0.010)  # the wait
        timer.end(0, start, ("slot", 0), seq)
        expected[seq] = (device_start, stream.tail())
    deadline = time.monotonic() + 10
    while len(ends) < 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(starts) == len(ends) == 12
    for seq, (t_start, t_end) in expected.items():
        assert abs(starts[seq] - t_start * 1e9) < 2_500_000, (seq, (starts[seq] - t_start * 1e9) / 1e6)
        assert abs(ends[seq] - t_end * 1e9) < 2_500_000, (seq, (ends[seq] - t_end * 1e9) / 1e6)
    assert max(timer.wake_lag_ns) > 12_500_000  # the late wake-ups happened, and were taken out
    timer.close()


def drifting_timer(offset_window_s: float) -> tuple[FakeStream, EventTimer, dict[int, int]]:
    """An EventTimer on events whose device clock runs 2% slow and whose wake-ups lag by 0 or 3 ms alternately, and
    the START stamps it sends (seq -> host ns)."""
    stream = FakeStream()
    lags = itertools.cycle([0.0, 0.003])

    class DriftingEvent(FakeEvent):
        def synchronize(self) -> None:
            super().synchronize()
            time.sleep(next(lags))

        def elapsed_time(self, end: FakeEvent) -> float:
            return super().elapsed_time(end) * 0.98  # the device's clock: 2% slow

    starts: dict[int, int] = {}
    timer = EventTimer(lambda: DriftingEvent(stream), on_start=lambda sig, seq, t: starts.__setitem__(seq, t),
                       on_end=lambda *a: None, on_iteration=lambda *a: None,
                       on_error=lambda exc: pytest.fail(repr(exc)), offset_window_s=offset_window_s)
    return stream, timer, starts


def stamp_errors_ms(timer: EventTimer, stream: FakeStream, starts: dict[int, int], waits: int,
                    compute_s: float, apart_s: float) -> list[float]:
    """Queue ``waits`` signalled 6 ms waits (``compute_s`` of work before each, ``apart_s`` of host time between
    them); each START stamp minus the device time it should say, in ms."""
    expected: dict[int, float] = {}
    for seq in range(1, waits + 1):
        if compute_s:
            stream.enqueue(compute_s)
        start = timer.begin(0, ("slot", 0), seq)
        assert start is not None
        expected[seq] = start.at  # type: ignore[attr-defined]
        stream.enqueue(0.006)
        timer.end(0, start, ("slot", 0), seq)
        if apart_s:
            time.sleep(apart_s)
    deadline = time.monotonic() + 10
    while len(starts) < waits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(starts) == waits
    timer.close()
    return [(starts[seq] - expected[seq] * 1e9) / 1e6 for seq in range(1, waits + 1)]


def test_stamps_keep_up_with_a_device_clock_that_drifts_from_the_host_s() -> None:
    """The device's timer and the host's clock drift apart (an H100's ran 25 us a second slow): an offset fixed at the
    luckiest wake-up ever seen leaves the stamps ever earlier. Here the device's clock runs 2% slow and the wake-ups
    lag by 0 or 3 ms alternately: after 60 waits (1.1 s, 22 ms of drift) every stamp must still be within 3 ms of
    the device time, on the host's clock."""
    stream, timer, starts = drifting_timer(offset_window_s=0.09)
    errors_ms = stamp_errors_ms(timer, stream, starts, 60, compute_s=0.012, apart_s=0.0)
    assert max(abs(e) for e in errors_ms) < 3.0, errors_ms


def test_sparse_wake_ups_do_not_keep_an_old_clock_offset() -> None:
    """Signals can be few (a checkpoint pause, no listener): the offset must come from recent wake-ups by time, not
    from the last N however old. Waits 0.36 s apart, a device clock 2% slow, wake-ups late by 0 or 3 ms: an offset
    kept from the first would leave the last stamps 36 ms early."""
    stream, timer, starts = drifting_timer(offset_window_s=0.15)
    errors_ms = stamp_errors_ms(timer, stream, starts, 6, compute_s=0.0, apart_s=0.36)
    assert max(abs(e) for e in errors_ms) < 4.8, errors_ms  # its own wake-up's lag at most (3 ms, and sleep's)


def test_the_wake_up_benchmark_refuses_bad_flags_and_a_machine_with_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_event_wake  # benchmarks/ (on the path through conftest)

    with pytest.raises(SystemExit) as exc:
        gpu_event_wake.main(["--waits", "5"])
    assert exc.value.code == 2 and "--waits must be >= 20" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        gpu_event_wake.main(["--rounds", "0"])
    assert exc.value.code == 2 and "--rounds >= 1" in capsys.readouterr().err
    if not cuda_available():
        assert gpu_event_wake.main(["--waits", "20", "--rounds", "1"]) == 2
        assert "needs an NVIDIA GPU" in capsys.readouterr().err
