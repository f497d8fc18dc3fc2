"""How the hook times a stage's waits: host stamps (``HostTiming``) or device events (``DeviceTiming``), one interface.

On CPU (gloo) the host blocks in each wait: two ``time.monotonic_ns()`` stamps measure it, the training's thread
signals the bubble and reads the memory probe. On GPUs host stamps do not see the waits (with NCCL a ``recv`` returns
to the host before the data arrives): each candidate wait is bracketed by device events, and a helper thread
(``bubbles.training.gpu_timing.EventTimer``) signals the bubble when the device reaches it, measures its length as the
device saw it, and reads the memory probe once a profiled wait has ended there. The training's thread only records
the events.

A strategy builds the per-instruction wrappers of the waits itself, so the wrapped instruction path has no extra call
layer; everything else it does runs once per iteration.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from bubbles.core import wire
from bubbles.core.stats import percentile
from bubbles.training.gpu_timing import (
    SWITCH_INTERVAL,
    DeviceEvent,
    EventTimer,
    cuda_event_factory,
    event_wait_from_env,
    switch_interval_from_env,
)

from .profile import SEND_INSTRUCTIONS, WAIT_INSTRUCTIONS
from .state import ScheduleProfile

if TYPE_CHECKING:
    from .instrumentation import Instrumentation

log = logging.getLogger("bubbles.hook")

Signal = tuple[int, int]  # (slot, predicted length ns)
# eval_batch's tail: (host start, seq, signal, device start event or None)
EvalTail = tuple[int, int, Signal | None, DeviceEvent | None]

# What an iteration's entry on the event thread is for (device timing): a profiled sample, the ITERATION message,
# or nothing (its events go back to the pool in order).
_PROFILED, _SEND, _NOTHING = object(), object(), object()


class Timing(Protocol):
    """What ``Instrumentation`` asks of a timing strategy."""

    name: str  # "host" or "cuda"
    wait_instructions: frozenset[str]  # instruction names wrapped as candidate waits
    profiles_sends: bool  # sends are candidate bubbles
    event_wait: str | None  # device timing on CUDA: how the helper thread waits (block or spin)
    switch_interval_s: float | None  # device timing, while attached

    def wait_wrapper(self, fn: Callable[..., Any], code: int) -> Callable[..., Any]:
        """The wrapper of a candidate wait's handler (``code``: its instruction code in the records)."""
        ...

    def started(self) -> None:
        """The engine is wrapped: take what is held while attached."""
        ...

    def open_eval_tail(self, pos: int, sig: Signal | None, t0: int) -> EvalTail:
        """eval_batch's end-of-batch wait starts at ``t0``, position ``pos``."""
        ...

    def close_eval_tail(self, tail: EvalTail, pos: int, t1: int) -> None:
        """eval_batch's end-of-batch wait is over on the host (its record already appended)."""
        ...

    def mark(self) -> DeviceEvent | None:
        """An iteration starts: what marks its start on the device (None with host timing). Never raises."""
        ...

    def abandon_iteration(self, start: DeviceEvent | None) -> None:
        """An iteration that is not measured (signalling off, or the training's call raised). Never raises."""
        ...

    def warmup_iteration(self, start: DeviceEvent | None) -> None:
        """A warm-up iteration ended on the host: nothing of it is kept."""
        ...

    def profiled_iteration(self, prof: ScheduleProfile, records: list[tuple[int, int, int]], host_s: float,
                           start: DeviceEvent | None) -> None:
        """A profiling iteration ended on the host (``host_s`` long there): it becomes a sample."""
        ...

    def measured_iteration(self, prof: ScheduleProfile, records: list[tuple[int, int, int]], it: int, t0: int,
                           t1: int, start: DeviceEvent | None) -> None:
        """An iteration after profiling ended on the host: the agent is told its length, the predictions follow."""
        ...

    def post(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` after the signals of everything queued so far; False if the caller must run it now."""
        ...

    def stats(self) -> dict[str, Any]:
        """The device-timing entries of ``Instrumentation.stats``."""
        ...

    def close(self) -> None:
        """Stop, and let go of what ``started`` took."""
        ...


class HostTiming:
    """CPU/gloo: the host blocks in each wait; two stamps time it and the training's thread signals it."""

    name = "host"
    wait_instructions = WAIT_INSTRUCTIONS | SEND_INSTRUCTIONS  # a gloo send blocks until its receiver is there
    profiles_sends = True
    event_wait: str | None = None
    switch_interval_s: float | None = None

    def __init__(self, inst: Instrumentation) -> None:
        self.inst = inst

    def wait_wrapper(self, fn: Callable[..., Any], code: int) -> Callable[..., Any]:
        """Time a candidate wait; signal it when it is a profiled bubble and listeners exist.

        Used for the receives' and sends' handlers (called with the engine as first argument), for the bound
        ``_aggregate_total_loss`` and for the communication backend's collectives inside ``OptimizerStep``,
        ``ReduceGrads`` and ``ReduceTiedGrads`` (``collectives``).
        """
        inst = self.inst
        hot = inst._hot
        mono = time.monotonic_ns

        def wait(*args: Any, **kwargs: Any) -> Any:
            records = hot.records
            pos = len(records)
            sig = hot.signal_map.get(pos)
            if sig is None:
                t0 = mono()
                result = fn(*args, **kwargs)
                records.append((code, t0, mono()))
                if hot.sampling:
                    inst._sample_memory(pos)
                return result
            t0 = mono()
            seq = inst._bubble_start(sig, t0)
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = mono()
                records.append((code, t0, t1))
                inst._bubble_end(sig, seq, t1)

        return wait

    def started(self) -> None:
        pass

    def open_eval_tail(self, pos: int, sig: Signal | None, t0: int) -> EvalTail:
        seq = self.inst._bubble_start(sig, t0) if sig is not None else 0
        return (t0, seq, sig, None)

    def close_eval_tail(self, tail: EvalTail, pos: int, t1: int) -> None:
        _, seq, sig, _ = tail
        if sig is not None:
            self.inst._bubble_end(sig, seq, t1)
        if self.inst._hot.sampling and sig is None:
            self.inst._sample_memory(pos)

    def mark(self) -> DeviceEvent | None:
        return None

    def abandon_iteration(self, start: DeviceEvent | None) -> None:
        pass

    def warmup_iteration(self, start: DeviceEvent | None) -> None:
        pass

    def profiled_iteration(self, prof: ScheduleProfile, records: list[tuple[int, int, int]], host_s: float,
                           start: DeviceEvent | None) -> None:
        self.inst._add_sample(prof, records, host_s)

    def measured_iteration(self, prof: ScheduleProfile, records: list[tuple[int, int, int]], it: int, t0: int,
                           t1: int, start: DeviceEvent | None) -> None:
        inst = self.inst
        inst._listeners.send(wire.encode_iteration(inst.stage, it, t0, t1 - t0))
        if (prof.recent is not None and inst.fill_mode is not wire.FillMode.NAIVE
                and inst.lines_up(prof, records)):
            n = len(records)
            inst._follow_lengths(prof, {pos: records[pos][2] - records[pos][1]
                                        for pos in prof.signal_map if pos < n}, prof.seen)

    def post(self, fn: Callable[[], None]) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {"device_waits_timed": 0, "device_waits_untimed": 0, "signal_wake_lag_us_p50": None,
                "signal_wake_lag_us_p90": None, "event_wait": None, "switch_interval_us": None}

    def close(self) -> None:
        pass


class DeviceTiming:
    """GPUs: device events around the waits (sends too), resolved, signalled and measured on a helper thread.

    Construction starts the helper thread; a problem with the environment's settings is logged and the default used.
    """

    name = "cuda"
    wait_instructions = WAIT_INSTRUCTIONS | SEND_INSTRUCTIONS  # with NCCL a send holds the GPU: see profile.py
    profiles_sends = True

    def __init__(self, inst: Instrumentation, event_factory: Callable[[], DeviceEvent] | None, device: Any) -> None:
        self.inst = inst
        self.event_wait: str | None = None
        self.switch_interval_s: float | None = None  # set while attached (see started)
        self._holds_switch_interval = False
        if event_factory is None:
            self.event_wait, problem = event_wait_from_env(os.environ)
            if problem:
                log.warning("%s", problem)
            event_factory = cuda_event_factory(self.event_wait, device)
        self._interval, problem = switch_interval_from_env(os.environ)
        if problem:
            log.warning("%s", problem)
        self.timer = EventTimer(event_factory, on_start=inst._send_bubble_start, on_end=inst._bubble_end,
                                on_iteration=self._on_device_iteration, on_error=inst._fail,
                                on_resolved=self._sample_on_helper)

    def wait_wrapper(self, fn: Callable[..., Any], code: int) -> Callable[..., Any]:
        """Events around the wait; the event thread signals and measures it.

        Waits that are neither signalled nor profiled get only the host stamps, like any instruction.
        """
        inst = self.inst
        timer = self.timer
        hot = inst._hot
        mono = time.monotonic_ns

        def wait(*args: Any, **kwargs: Any) -> Any:
            records = hot.records
            pos = len(records)
            sig = hot.signal_map.get(pos)
            if sig is None and not hot.sampling:
                t0 = mono()
                result = fn(*args, **kwargs)
                records.append((code, t0, mono()))
                return result
            seq = 0
            if sig is not None:
                inst._seq += 1
                seq = inst._seq
            try:
                start = timer.begin(pos, sig, seq)
            except Exception as exc:  # a CUDA error recording the event: signalling stops, the training goes on
                inst._fail(exc)
                start = None
            t0 = mono()
            try:
                result = fn(*args, **kwargs)
            finally:
                records.append((code, t0, mono()))
                if start is not None:
                    # A profiled wait's memory is read on the helper thread once the wait has ended on the
                    # device (_sample_on_helper): the training's thread records events and nothing else.
                    try:
                        timer.end(pos, start, sig, seq, inst._current if hot.sampling else None)
                    except Exception as exc:
                        inst._fail(exc)
            return result

        return wait

    def started(self) -> None:
        # the helper thread gets the GIL this soon after an event completes (gpu_timing's docstring); shared
        # by every instrumented engine of the process, restored when the last detaches
        self.switch_interval_s = SWITCH_INTERVAL.acquire(self._interval)
        self._holds_switch_interval = True

    def open_eval_tail(self, pos: int, sig: Signal | None, t0: int) -> EvalTail:
        """Timed like any wait: events around it, its signals sent by the event thread when the device gets there
        (the host reaches the tail long before the device does)."""
        inst = self.inst
        if sig is None and not inst._hot.sampling:
            return (t0, 0, sig, None)
        seq = 0
        if sig is not None:
            inst._seq += 1
            seq = inst._seq
        try:
            return (t0, seq, sig, self.timer.begin(pos, sig, seq))
        except Exception as exc:
            inst._fail(exc)
            return (t0, seq, sig, None)

    def close_eval_tail(self, tail: EvalTail, pos: int, t1: int) -> None:
        _, seq, sig, start = tail
        if start is not None:
            inst = self.inst
            try:
                self.timer.end(pos, start, sig, seq, inst._current if inst._hot.sampling else None)
            except Exception as exc:
                inst._fail(exc)

    def mark(self) -> DeviceEvent | None:
        """An event at the iteration's start, so its length is the device's (see ``Instrumentation._end_iteration``)."""
        if self.inst._disabled:
            return None
        try:
            return self.timer.mark()
        except Exception as exc:
            self.inst._fail(exc)
            return None

    def abandon_iteration(self, start: DeviceEvent | None) -> None:
        """Its events go back to the pool and the waits timed in it are dropped, in order."""
        if start is None:
            return
        try:
            self.timer.iteration((_NOTHING,), start)
        except Exception as exc:
            self.inst._fail(exc)

    def warmup_iteration(self, start: DeviceEvent | None) -> None:
        self.timer.iteration((_NOTHING,), start)  # its events go back to the pool, in order

    def profiled_iteration(self, prof: ScheduleProfile, records: list[tuple[int, int, int]], host_s: float,
                           start: DeviceEvent | None) -> None:
        # the waits' device-side lengths are not known yet: the event thread makes the sample
        self.timer.iteration((_PROFILED, prof, list(records), host_s), start)

    def measured_iteration(self, prof: ScheduleProfile, records: list[tuple[int, int, int]], it: int, t0: int,
                           t1: int, start: DeviceEvent | None) -> None:
        if start is not None:  # None: the event thread has stopped, and signalling with it
            # the waits' lengths come from the device: the event thread follows them (None: not these)
            follow = (prof if self.inst.fill_mode is not wire.FillMode.NAIVE and self.inst.lines_up(prof, records)
                      else None)
            self.timer.iteration((_SEND, it, t0, t1 - t0, follow), start)

    def post(self, fn: Callable[[], None]) -> bool:
        return self.timer.post(fn)

    def stats(self) -> dict[str, Any]:
        lags = list(self.timer.wake_lag_ns)
        return {
            "device_waits_timed": self.timer.resolved,
            "device_waits_untimed": self.timer.overflowed,
            # how late the helper thread woke after each signalled event (taken out of the stamps)
            "signal_wake_lag_us_p50": percentile(lags, 50) / 1e3 if lags else None,
            "signal_wake_lag_us_p90": percentile(lags, 90) / 1e3 if lags else None,
            "event_wait": self.event_wait,
            "switch_interval_us": (self.switch_interval_s * 1e6 if self.switch_interval_s else None),
        }

    def close(self) -> None:
        self.timer.close()
        if self._holds_switch_interval:
            SWITCH_INTERVAL.release()
            self._holds_switch_interval = False

    # -- the event thread ---------------------------------------------------------------------------------

    def _on_device_iteration(self, payload: tuple[Any, ...], lengths_ns: dict[int, int],
                             span: tuple[int, int] | None) -> None:
        """An iteration is over on the device. A profiled one becomes a sample (its waits and its length as the
        device saw them); after profiling the agent is told its length (the guard's input)."""
        inst = self.inst
        if inst._disabled:
            return
        try:
            if payload[0] is _PROFILED:
                _, prof, records, host_s = payload
                inst._add_sample(prof, records, span[1] / 1e9 if span else host_s, lengths_ns)
            elif payload[0] is _SEND:
                _, it, t0, took, follow = payload
                if span is not None:
                    inst.device_iteration_times_s.append(span[1] / 1e9)
                    t0, took = span
                inst._listeners.send(wire.encode_iteration(inst.stage, it, t0, took))
                if follow is not None and follow.recent is not None:
                    inst._follow_lengths(follow, lengths_ns, it)
        except Exception as exc:
            inst._fail(exc)

    def _sample_on_helper(self, pos: int, prof: ScheduleProfile | None) -> None:
        """A profiled wait has ended on the device; read the memory probe here, on the helper thread, not on the
        training's."""
        if prof is None:
            return
        inst = self.inst
        with inst._profile_lock:
            if prof.cycle is None:
                inst._sample_memory(pos, prof)


def make_timing(timing: str, inst: Instrumentation, event_factory: Callable[[], DeviceEvent] | None,
                device: Any) -> Timing:
    """The strategy for ``timing`` (``"host"`` or ``"cuda"``)."""
    if timing == "cuda":
        return DeviceTiming(inst, event_factory, device)
    return HostTiming(inst)


__all__ = ["DeviceTiming", "EvalTail", "HostTiming", "Signal", "Timing", "make_timing"]
