"""Bubble timing on a GPU: device events around the waits, read by a helper thread.

With NCCL a ``recv`` returns to the host before the data has arrived: the host runs ahead and only
the device waits (the NCCL backend's documented behaviour). Host timestamps around ``RecvActivation`` therefore see
nothing, and ``torch.cuda.synchronize()`` on the training's thread would remove the very overlap that
makes the training fast. Instead the hook records a device event on the current stream of the engine's
device (where its kernels go, whatever the current device is) just before a wait is enqueued (it completes
when the device has finished the work queued ahead of the wait: the bubble starts) and one just after (it
completes when the awaited data has arrived: the bubble ends). ``EventTimer`` hands both to a helper thread
that blocks on them in order and

- sends BUBBLE_START / BUBBLE_END the moment each completes, stamped with when it completed on the device, not
  when the thread woke (below),
- measures the wait's length as the device saw it (``start.elapsed_time(end)``),
- and passes each profiled iteration, with those device-side lengths, back to the hook (and reads the memory
  probe for it: ``on_resolved``).

The training's thread only records events (their cost on a GPU has not been measured yet) and appends to a
queue, while profiling too. Events are created with ``blocking=True`` (``cudaEventBlockingSync``): the helper
thread sleeps in the driver while it waits instead of spinning a host core per stage; torch releases the GIL
around the wait.

**Stamps on the device's timeline.** The thread wakes some time after an event completes (the driver, then
Python: its wake-up lag), and a bubble stamped with the wake-up time would be predicted to end that much too late.
One event is kept as a reference: every event's time on the device's clock is the reference's plus
``elapsed_time`` between them, and the offset from the device's clock to the host's is the smallest
``wake - device time`` among the wake-ups of the last ``OFFSET_WINDOW_S`` seconds (the newest always counts), so
the lag of the luckiest recent wake-up is the only error left (and every stamp is at most its wake-up time).
Recent, because the two clocks drift apart: on an H100 the device's timer ran about 25 us a second slower than
the host's ``CLOCK_MONOTONIC``, and the smallest offset ever seen (an earlier estimate) left the stamps
2.5 ms early after 75 s, and further every second. The reference moves forward every ``REANCHOR_S``
(``elapsed_time`` is a float of milliseconds: precision falls with the span). ``wake_lag_ns`` keeps each
signal's wake-up minus its stamp.

The event type is injected (``event_factory``): ``cuda_event_factory()`` on a GPU, ``HostEvent`` (an
event that completes when it is recorded, like a blocking gloo wait) where there is none. Tests inject
events that complete later than they are recorded, which is what a GPU does.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

log = logging.getLogger("bubbles.hook")

MAX_PENDING = 4096  # queued event pairs; more means the device is hopelessly behind: stop signalling
REANCHOR_S = 10.0  # the reference event moves forward after this long (float32 ms keep microseconds over it)
OFFSET_WINDOW_S = 2.0  # the clock offset is the smallest of the wake-ups in this much host time (drift: 50 us)


class DeviceEvent(Protocol):
    """What the timer needs of an event: ``torch.cuda.Event``'s interface (times in milliseconds)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class HostEvent:
    """An event that completes when it is recorded: the device is the host (CPU, gloo)."""

    __slots__ = ("t_ns",)

    def __init__(self) -> None:
        self.t_ns = 0

    def record(self) -> None:
        self.t_ns = time.monotonic_ns()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: HostEvent) -> float:
        return (end_event.t_ns - self.t_ns) / 1e6


EVENT_WAITS = ("block", "spin")
DEFAULT_EVENT_WAIT = "block"


def event_wait_from_env(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """How the helper thread waits for events, from ``BUBBLES_EVENT_WAIT`` (``block``: it sleeps in the driver until
    an interrupt wakes it; ``spin``: the driver polls, a host core busy while the stage trains, for an earlier
    wake-up), and a warning when the value is not one of them (the default is used: the hook never stops a
    training over its own settings)."""
    value = environ.get("BUBBLES_EVENT_WAIT", "").strip() or DEFAULT_EVENT_WAIT
    if value in EVENT_WAITS:
        return value, None
    return DEFAULT_EVENT_WAIT, (f"BUBBLES_EVENT_WAIT={value!r} is not one of {', '.join(EVENT_WAITS)}; "
                                f"using {DEFAULT_EVENT_WAIT!r}")


DEFAULT_SWITCH_INTERVAL_US = 200


def switch_interval_from_env(environ: Mapping[str, str]) -> tuple[float | None, str | None]:
    """The interpreter's thread switch interval, in seconds, to set while device timing runs, from
    ``BUBBLES_SWITCH_INTERVAL_US`` (default ``DEFAULT_SWITCH_INTERVAL_US``; ``0`` leaves Python's own, 5 ms), and a
    warning for a value that is not a whole number of microseconds from 0 to 5000 (the default is used).

    Why: the helper thread wakes when an event completes, but it needs the GIL to send the signal, and a training
    thread running Python keeps the GIL until the interpreter makes it switch, up to the interval later. On an
    H100 (benchmarks/gpu_event_wake.py; docs/benchmarks.md) a blocking helper's wake-up p90 under such a thread was
    2.3 ms with Python's 5 ms and 0.3 ms with 200 us. A shorter interval only matters while another thread waits for the
    GIL (the helper, briefly, per event)."""
    raw = environ.get("BUBBLES_SWITCH_INTERVAL_US", "").strip()
    if not raw:
        return DEFAULT_SWITCH_INTERVAL_US / 1e6, None
    try:
        us = int(raw)
    except ValueError:
        us = -1
    if not 0 <= us <= 5000:
        return DEFAULT_SWITCH_INTERVAL_US / 1e6, (
            f"BUBBLES_SWITCH_INTERVAL_US={raw!r} is not a whole number of microseconds from 0 to 5000; "
            f"using {DEFAULT_SWITCH_INTERVAL_US}")
    return (us / 1e6 if us else None), None


class SwitchInterval:
    """The interpreter's switch interval is one per process; instrumented engines share it. The first that asks
    sets it (when shorter than the current one), later ones share it, and the last to let go restores what was
    there, unless someone else changed it meanwhile. ``setter``/``getter`` default to ``sys``'s."""

    def __init__(self, getter: Callable[[], float] | None = None,
                 setter: Callable[[float], None] | None = None) -> None:
        self._get = getter or sys.getswitchinterval
        self._set = setter or sys.setswitchinterval
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: float | None = None  # what was there before the first holder set its own
        self._ours: float | None = None  # what the hook set

    def acquire(self, interval_s: float | None) -> float | None:
        """Hold the shortened interval (``interval_s``; None: only count the holder); the interval in effect that
        the hook set, or None when the hook set none."""
        with self._lock:
            self._holders += 1
            if self._holders == 1 and interval_s is not None and interval_s < self._get():
                self._saved = self._get()
                self._set(interval_s)
                self._ours = self._get()  # as the interpreter keeps it (whole microseconds: 200 us reads 1.99..e-4)
            return self._ours

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0:
                if self._saved is not None and self._ours is not None and self._get() == self._ours:
                    self._set(self._saved)
                self._saved = self._ours = None


SWITCH_INTERVAL = SwitchInterval()  # the process's


def cuda_event_factory(wait: str = DEFAULT_EVENT_WAIT, device: Any = None, cuda: Any = None
                       ) -> Callable[[], DeviceEvent]:
    """Timing events on CUDA ``device`` (the engine's: a ``torch.device``, an index, or None for the current one);
    ``wait`` (``EVENT_WAITS``) says how a thread waits for them. ``cuda`` replaces ``torch.cuda`` (tests).

    Each event records on ``device``'s current stream, where the engine's kernels go, not on the current device's
    (``torch.cuda.Event.record()``'s default): a training whose current device is not its engine's would otherwise
    time another device's queue. The cost on the training's thread is the same lookup the default makes."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    if wait not in EVENT_WAITS:
        raise ValueError(f"wait must be one of {', '.join(EVENT_WAITS)}, got {wait!r}")
    if not cuda.is_available():
        raise RuntimeError("CUDA event timing needs a GPU; use timing='host' on machines without one")
    blocking = wait == "block"  # cudaEventBlockingSync; without it the context's schedule: a spin on a free core
    current_stream = cuda.current_stream

    class EngineEvent(cuda.Event):
        def record(self, stream: Any = None) -> None:
            super().record(current_stream(device) if stream is None else stream)

    def make() -> DeviceEvent:
        return EngineEvent(enable_timing=True, blocking=blocking)

    return make


# Items on the queue: (kind, payload). Kept as tuples: the training's thread builds one per wait.
_START, _END, _ITERATION, _STOP, _CALL = 0, 1, 2, 3, 4


class EventTimer:
    """Device-side timing of waits, resolved on a helper thread (see the module docstring).

    ``on_start(sig, seq, t_ns)`` and ``on_end(sig, seq, t_ns)`` are called on the helper thread when a
    signalled wait's events complete; ``on_iteration(payload, lengths_ns, span)`` when every wait queued before
    ``iteration(payload, start)`` has been resolved, with the device-side length of each wait by position and,
    when ``start`` (an event from ``mark()`` at the iteration's start) was given, the iteration's span on the device
    as ``(start_ns, duration_ns)`` (host clock, like the signals' stamps), else None;
    ``on_resolved(position, tag)`` (optional) when a wait that is not signalled (a profiled one) has ended on the
    device, with the ``tag`` given to ``end``: work that must not run on the training's thread goes there.
    Any exception they raise goes to ``on_error`` and stops the thread (the hook then fails open).
    """

    def __init__(self, event_factory: Callable[[], DeviceEvent], *,
                 on_start: Callable[[Any, int, int], None], on_end: Callable[[Any, int, int], None],
                 on_iteration: Callable[[Any, dict[int, int], tuple[int, int] | None], None],
                 on_error: Callable[[BaseException], None],
                 on_resolved: Callable[[int, Any], None] | None = None,
                 offset_window_s: float = OFFSET_WINDOW_S) -> None:
        self._make = event_factory
        self._pool: deque[DeviceEvent] = deque()
        self._queue: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._on_start = on_start
        self._on_end = on_end
        self._on_iteration = on_iteration
        self._on_error = on_error
        self._on_resolved = on_resolved
        self.resolved = 0
        self.overflowed = 0
        self.lag_ns: deque[int] = deque(maxlen=4096)  # host enqueue -> device completion, per wait end
        self.wake_lag_ns: deque[int] = deque(maxlen=4096)  # per signal: the thread's wake-up - the device time
        self._ref: DeviceEvent | None = None  # the reference event (kept out of the pool) ...
        self._ref_device_ns = 0.0  # ... and its time on the device's clock (ns since the first event resolved)
        # recent wake-ups' (host time, host time - device time), offsets increasing: the window's minimum first
        self._offsets: deque[tuple[int, float]] = deque()
        self._offset_window_ns = int(offset_window_s * 1e9)
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="bubbles-event-timer", daemon=True)
        self._thread.start()

    # -- the training's thread ------------------------------------------------------------------------
    def begin(self, position: int, sig: Any, seq: int) -> DeviceEvent | None:
        """Record the event that completes when the device reaches this wait; None if overloaded."""
        if not self._alive or self._queue.qsize() >= MAX_PENDING:
            self.overflowed += 1
            return None
        ev = self._take()
        ev.record()
        self._queue.put((_START, (position, ev, sig, seq)))
        return ev

    def end(self, position: int, start: DeviceEvent, sig: Any, seq: int, tag: Any = None) -> None:
        """Record the event that completes when the wait is over on the device."""
        ev = self._take()
        ev.record()
        self._queue.put((_END, (position, start, ev, sig, seq, time.monotonic_ns(), tag)))

    def mark(self) -> DeviceEvent | None:
        """Record an event where the device's work now stands (an iteration's start); None once stopped."""
        if not self._alive:
            return None
        ev = self._take()
        ev.record()
        return ev

    def iteration(self, payload: Any, start: DeviceEvent | None = None) -> None:
        """Everything queued so far belongs to one iteration: hand its device-side lengths back, and its span on the
        device from ``start`` (``mark()``) to here: with the host running ahead of the device, the host's own time
        for an iteration is how long it took to queue the work, not to run it."""
        if self._alive:
            end = None
            if start is not None:
                end = self._take()
                end.record()
            self._queue.put((_ITERATION, (payload, start, end)))

    def post(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the helper thread after everything queued so far (in order with the signals of the waits
        queued before it); False, and nothing queued, once the thread has stopped."""
        if not self._alive:
            return False
        self._queue.put((_CALL, fn))
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the helper thread after it has resolved what is queued (bounded wait)."""
        if self._thread.is_alive():
            self._queue.put((_STOP, None))
            self._thread.join(timeout_s)
        self._alive = False

    # -- the helper thread ----------------------------------------------------------------------------
    def _device_ns(self, ev: DeviceEvent, wake_ns: int, recycled_next: DeviceEvent | None = None,
                   signal: bool = True) -> int:
        """When ``ev`` completed, on the host's clock, from the device's timeline (see the module doc).
        ``recycled_next``: an event the caller returns to the pool right after (not to be returned twice);
        ``signal``: the wake-up lag is kept (``wake_lag_ns``) for signals only."""
        ref = self._ref
        if ref is None:
            self._ref, self._ref_device_ns = ev, 0.0
            device_ns = 0.0
        else:
            device_ns = self._ref_device_ns + ref.elapsed_time(ev) * 1e6
            if device_ns - self._ref_device_ns > REANCHOR_S * 1e9:  # move the reference forward
                self._ref, self._ref_device_ns = ev, device_ns
                if ref is not recycled_next:  # an event handed out twice would be recorded twice
                    self._pool.append(ref)
        offset, offsets = wake_ns - device_ns, self._offsets
        while offsets and offsets[-1][1] >= offset:  # a sliding minimum: larger offsets before it can go
            offsets.pop()
        offsets.append((wake_ns, offset))
        while offsets[0][0] < wake_ns - self._offset_window_ns:  # too old (the newest, just added, stays)
            offsets.popleft()
        t = device_ns + offsets[0][1]  # the luckiest recent wake-up's offset
        if signal:
            self.wake_lag_ns.append(int(wake_ns - t))
        return int(t)

    def _recycle(self, ev: DeviceEvent) -> None:
        """Back to the pool, unless it is the reference (kept until the reference moves on)."""
        if ev is not self._ref:
            self._pool.append(ev)

    def _take(self) -> DeviceEvent:
        try:
            return self._pool.pop()
        except IndexError:
            return self._make()

    def _run(self) -> None:
        lengths: dict[int, int] = {}
        try:
            while True:
                kind, item = self._queue.get()
                if kind == _STOP:
                    return
                if kind == _START:
                    _pos, ev, sig, seq = item
                    if sig is not None:  # a profiled-only wait needs no start signal: its end event says all
                        ev.synchronize()  # the device has finished the work queued ahead of the wait
                        self._on_start(sig, seq, self._device_ns(ev, time.monotonic_ns()))
                elif kind == _END:
                    pos, start, ev, sig, seq, enqueued_ns, tag = item
                    ev.synchronize()  # the awaited data has arrived on the device
                    now = time.monotonic_ns()
                    self.lag_ns.append(now - enqueued_ns)
                    lengths[pos] = max(0, int(start.elapsed_time(ev) * 1e6))
                    if sig is not None:
                        self._on_end(sig, seq, self._device_ns(ev, now, recycled_next=start))
                    elif self._on_resolved is not None:
                        self._on_resolved(pos, tag)
                    self._recycle(start)
                    self._recycle(ev)
                    self.resolved += 1
                elif kind == _CALL:
                    item()
                else:
                    payload, start, end = item
                    span = None
                    if start is not None and end is not None:
                        end.synchronize()  # the iteration's work is done on the device
                        took_ns = max(0, int(start.elapsed_time(end) * 1e6))
                        t_end = self._device_ns(end, time.monotonic_ns(), recycled_next=start, signal=False)
                        span = (t_end - took_ns, took_ns)
                        self._recycle(start)
                        self._recycle(end)
                    self._on_iteration(payload, lengths, span)
                    lengths = {}
        except BaseException as exc:  # never into the training: the hook switches signalling off
            self._alive = False
            self._on_error(exc)
