"""The training-side hook: time a DeepSpeed ``PipelineEngine``'s instructions, profile each stage's bubble
cycle, and signal every bubble to the node's listeners (the agent and armed fill jobs).

``instrument(engine)`` wraps one engine instance, never DeepSpeed's classes or files: a copy of
``engine._INSTRUCTION_MAP`` with timed handlers, plus instance attributes shadowing ``_exec_schedule``,
``_aggregate_total_loss``, ``train_batch`` and ``eval_batch``. ``Instrumentation.detach()`` removes them.

Per instruction the hook takes two ``time.monotonic_ns()`` stamps and appends one tuple; everything
else (which positions are bubbles, their predicted lengths, the encoded datagrams' shapes) is decided
once per iteration or once per profile. Candidate bubbles are the waits that really block a stage:
``RecvActivation``, ``RecvGrad`` and the end-of-batch loss broadcast (reported as ``LossBroadcast`` at
position ``len(instruction stream)``). With device timing, ``SendActivation`` and ``SendGrad`` are timed and
profiled like receives (with NCCL a send can hold the GPU until the peer posts its receive); with host timing
sends are not signalled (see docs/design.md).

Fail open: listeners are reached with a non-blocking ``sendto`` on a datagram socket; a missing or
dead listener is dropped, a full one loses that datagram. Any exception in the hook's own bookkeeping
is logged once and switches signalling off; exceptions raised by DeepSpeed's handlers propagate
unchanged. The hook never touches tensors, so the training's losses are bit-identical with and without it.

On GPUs (``timing="cuda"``, chosen by ``"auto"`` when the engine's device is a CUDA device) host
timestamps do not see the waits: with NCCL a ``recv`` returns to the host before the data arrives. There
each candidate wait is bracketed by device events, and a helper thread (``bubbles.training.gpu_timing``) signals
the bubble when the device reaches it and measures its length as the device saw it. The training's thread
only records the events; the memory probe is read on the helper thread once a profiled wait has ended on the
device (``_sample_on_helper``). On CPU (gloo) the host blocks in the wait, host time is what is measured, and
the probe is read on the training's thread.

The classification of waits into bubble kinds and the aggregation of profiled samples are pure
functions over instruction streams (``candidate_slots``, ``build_cycle``), tested directly on the
streams of DeepSpeed's real schedule classes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubbles.core import paths, wire
from bubbles.core.cycle import BubbleCycle, BubbleSlot, RecentLengths, robust_stats
from bubbles.core.stats import percentile
from bubbles.training.gpu_timing import (
    SWITCH_INTERVAL,
    DeviceEvent,
    EventTimer,
    cuda_event_factory,
    event_wait_from_env,
    switch_interval_from_env,
)
from bubbles.training.probes import MemoryProbe, default_probe, gpu_uuid

log = logging.getLogger("bubbles.hook")

LOSS_BROADCAST = "LossBroadcast"
WAIT_INSTRUCTIONS = frozenset({"RecvActivation", "RecvGrad"})
# With NCCL a send can hold the GPU until the peer posts its receive: with device timing, sends are timed and
# profiled like receives, and one that stalls long enough is a bubble. (On CPU/gloo a send returns once its data
# is handed over: host timing leaves sends out.)
SEND_INSTRUCTIONS = frozenset({"SendActivation", "SendGrad"})
ITERATION_HISTORY = 4096  # iteration times kept per stage (host and device timing): bounded over a weeks-long training
TRACE_ITERATIONS = 256  # iterations of per-instruction trace kept when trace=True (a ring)
RECENT_ITERATIONS = 32  # host timing: predicted bubble lengths follow the last this many iterations' lengths ...
REPREDICT_EVERY = 4  # ... recomputed every this many iterations
TIMINGS = ("auto", "host", "cuda")
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.EPROTOTYPE,
                          errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR})
_FULL_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})
MAX_LISTENERS = 16  # sockets a stage's signals go to, the agent's among them (see Listeners._refresh)


_NO_SIGNALS: dict[int, tuple[int, int]] = {}
# What an iteration's entry on the event thread is for (device timing): a profiled sample, the ITERATION message,
# or nothing (its events go back to the pool in order).
_PROFILED, _SEND, _NOTHING = object(), object(), object()


# ----------------------------------------------------------------------------------------------------
# Pure part: instruction streams -> candidate slots -> bubble cycle


@dataclass(frozen=True)
class Candidate:
    """A wait in a stage's instruction stream that may be a bubble."""

    position: int  # index in the iteration's instruction stream; LossBroadcast: len(stream)
    instruction: str
    kind: str  # one of cycle.BUBBLE_KINDS


def instruction_stream(schedule: Iterable[Iterable[Any]]) -> list[str]:
    """The flat list of instruction class names a ``PipeSchedule`` makes a stage execute, in order."""
    return [type(cmd).__name__ for step in schedule for cmd in step]


def candidate_slots(stream: Sequence[str], *, loss_broadcast: bool = True, sends: bool = False) -> list[Candidate]:
    """Classify every wait of one iteration's instruction stream (with ``sends``, its sends too).

    - fill: before the stage's first ForwardPass (waiting for the first activation);
    - fwd-bwd: the last RecvGrad before the stage's first BackwardPass (end of 1F1B warm-up);
    - drain: after the stage's last ForwardPass or last BackwardPass (waiting for the remaining
      gradients), and the end-of-batch loss broadcast;
    - steady: every other wait.
    """
    def first(name: str) -> int | None:
        return next((i for i, n in enumerate(stream) if n == name), None)

    def last(name: str) -> int | None:
        return next((i for i in range(len(stream) - 1, -1, -1) if stream[i] == name), None)

    first_fwd, last_fwd = first("ForwardPass"), last("ForwardPass")
    first_bwd, last_bwd = first("BackwardPass"), last("BackwardPass")
    fwd_bwd = None
    if first_bwd is not None:
        fwd_bwd = next((i for i in range(first_bwd - 1, -1, -1) if stream[i] == "RecvGrad"), None)
    out = []
    for i, name in enumerate(stream):
        if name not in WAIT_INSTRUCTIONS and not (sends and name in SEND_INSTRUCTIONS):
            continue
        if i == fwd_bwd:
            kind = "fwd-bwd"
        elif first_fwd is not None and i < first_fwd:
            kind = "fill"
        elif (last_fwd is not None and i > last_fwd) or (last_bwd is not None and i > last_bwd):
            kind = "drain"
        else:
            kind = "steady"
        out.append(Candidate(i, name, kind))
    if loss_broadcast:
        out.append(Candidate(len(stream), LOSS_BROADCAST, "drain"))
    return out


def build_cycle(*, training: str, stage: int, stages: int, microbatches: int, schedule: str,
                candidates: Sequence[Candidate], durations_s: Sequence[Sequence[float]],
                free_bytes: Sequence[int], iteration_s: Sequence[float], min_bubble_s: float,
                allocated_bytes: Sequence[int] | None = None, memory_margin_bytes: int = 0) -> BubbleCycle:
    """Aggregate profiled iterations into a cycle.

    ``durations_s[k][j]`` is the measured length of ``candidates[j]`` in profiled iteration ``k``;
    ``free_bytes[j]`` the lowest free memory seen at candidate ``j`` and ``allocated_bytes[j]`` the most
    the training held there. A candidate whose median is at least ``min_bubble_s`` becomes a bubble;
    slots are numbered in schedule order.
    """
    if not durations_s or not iteration_s:
        raise ValueError("no profiled iterations")
    if allocated_bytes is None:
        allocated_bytes = [0] * len(candidates)
    if (any(len(row) != len(candidates) for row in durations_s) or len(free_bytes) != len(candidates)
            or len(allocated_bytes) != len(candidates)):
        raise ValueError("durations and memory readings must have one entry per candidate")
    slots: list[BubbleSlot] = []
    wait_s = 0.0
    for j, cand in enumerate(candidates):
        med, p10, p90 = robust_stats([row[j] for row in durations_s])
        wait_s += med
        if med >= min_bubble_s:
            slots.append(BubbleSlot(slot=len(slots), position=cand.position, instruction=cand.instruction,
                                    kind=cand.kind, duration_s=med, p10_s=p10, p90_s=p90,
                                    free_bytes=max(0, int(free_bytes[j])),
                                    allocated_bytes=max(0, int(allocated_bytes[j]))))
    return BubbleCycle(training=training, stage=stage, stages=stages, microbatches=microbatches,
                       schedule=schedule, iteration_s=robust_stats(iteration_s)[0], slots=tuple(slots),
                       samples=len(durations_s), wait_s=wait_s, memory_margin_bytes=memory_margin_bytes)


# ----------------------------------------------------------------------------------------------------
# Edge part: listeners (non-blocking datagrams to every *.sock of the stage directory)


class Listeners:
    """The ``*.sock`` endpoints of one stage directory and of its ``fills/`` (``paths``); ``send`` never blocks
    and never raises OSError. Fill sockets in the stage directory itself (where agents before 2026-11-25 had fill jobs
    bind them) are listeners too."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fills = directory / paths.FILLS_DIR_NAME
        self._agent_path = str(directory / paths.AGENT_SOCKET_NAME)  # the agent's: a name in fills/ is a fill's
        # Two sending sockets: datagrams queued at a receiver count against the sender's buffer until read, so fill
        # processes that stopped reading (26 of them were enough) would otherwise leave no room for the agent's.
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        try:
            self._agent_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            self._sock.close()
            raise
        self._agent_sock.setblocking(False)
        # With device timing the event thread sends BUBBLE_START/END while the training's thread sends the
        # rest; uncontended, the lock costs a fraction of a microsecond.
        self._lock = threading.Lock()
        self._mtime: tuple[tuple[int, int], tuple[int, int] | None] | None = None
        self._targets: tuple[str, ...] = ()
        # path -> identity (inode, ctime) of a dropped listener's file, so a dead listener's leftover
        # socket file is not taken back on every re-listing while a re-bound one is
        self._gone: dict[str, tuple[int, int]] = {}
        self.sent = 0
        self.dropped = 0  # datagrams lost to a full queue
        self.removed = 0  # listeners dropped as gone
        self.ignored = 0  # fill sockets left out past MAX_LISTENERS

    @property
    def targets(self) -> tuple[str, ...]:
        return self._targets

    def refresh(self, greeting: Callable[[], Sequence[bytes]] | None = None) -> list[str]:
        """Re-list the directory if its mtime changed; return listeners that appeared since last time. Each of them
        gets ``greeting()``'s datagrams first: they go out under the lock every other send takes, so nothing the event
        thread sends (an ITERATION, a BUBBLE_START) reaches a new listener before its bubble profile."""
        with self._lock:
            new = self._refresh()
            if new and greeting is not None:
                for data in greeting():
                    self._send(data, new)
            return new

    def _is_agent(self, path: str) -> bool:
        return path == self._agent_path

    def _refresh(self) -> list[str]:
        try:
            st = os.stat(self.directory)
        except OSError:
            self._mtime = None
            return []
        try:
            # Not followed: fills/ replaced by a link would have the training list (and send into) another directory.
            fst = os.stat(self.fills, follow_symlinks=False)
            fills = (fst.st_mtime_ns, fst.st_ino) if stat.S_ISDIR(fst.st_mode) else None
        except OSError:
            fills = None
        stamp = ((st.st_mtime_ns, st.st_ino), fills)
        if stamp == self._mtime:
            return []
        self._mtime = stamp
        found: dict[str, tuple[int, int]] = {}
        try:
            for directory in (self.directory, self.fills) if fills is not None else (self.directory,):
                with os.scandir(directory) as it:
                    for entry in it:
                        if entry.name.endswith(paths.SOCKET_SUFFIX):
                            est = entry.stat(follow_symlinks=False)
                            # Sockets only: a link would have sendto resolve its target in the training's file system.
                            if stat.S_ISSOCK(est.st_mode):
                                found[entry.path] = (est.st_ino, est.st_ctime_ns)
        except OSError:
            self._mtime = None  # listed again at the next refresh, not only when the directory changes again
            return []
        self._gone = {p: ino for p, ino in self._gone.items() if found.get(p) == ino}
        known = set(self._targets)
        new = sorted(p for p in found if p not in known and p not in self._gone)
        # Every listener costs each signal a sendto on the training's path: the agent always, fill sockets up to
        # MAX_LISTENERS in all (a stage runs one fill job at a time: more are leftovers, or a fill job's mischief).
        kept = [p for p in self._targets if p in found]
        room = max(0, MAX_LISTENERS - 1 - sum(not self._is_agent(p) for p in kept))
        fresh = [p for p in new if not self._is_agent(p)]
        if len(fresh) > room:
            self.ignored += len(fresh) - room
            left_out = set(fresh[room:])
            new = [p for p in new if p not in left_out]
        # Fill jobs first: they start work on a BUBBLE_START, while the agent only keeps accounts and its
        # watchdog; the agent's sendto must not delay the fill job's wake-up.
        self._targets = tuple(sorted((*kept, *new), key=self._is_agent))
        return new

    def send(self, data: bytes, targets: Sequence[str] | None = None) -> None:
        with self._lock:
            self._send(data, self._targets if targets is None else targets)

    def _send(self, data: bytes, targets: Sequence[str]) -> None:
        for path in targets:
            try:
                (self._agent_sock if self._is_agent(path) else self._sock).sendto(data, path)
                self.sent += 1
            except OSError as exc:
                if exc.errno in _FULL_ERRNOS:
                    self.dropped += 1
                else:  # gone (ENOENT, ECONNREFUSED) or not ours to write to: stop trying
                    self._drop(path)

    def _drop(self, path: str) -> None:
        if path not in self._targets:
            return
        self._targets = tuple(p for p in self._targets if p != path)
        self.removed += 1
        if self.ignored:
            self._mtime = None  # sockets left out past MAX_LISTENERS: listed again, one may have room now
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            self._gone[path] = (st.st_ino, st.st_ctime_ns)

    def close(self) -> None:
        with self._lock:
            self._sock.close()
            self._agent_sock.close()
            self._targets = ()


# ----------------------------------------------------------------------------------------------------
# The instrumentation of one engine


class _ScheduleProfile:
    """Per (schedule class, micro-batches): the profiling window, then the cycle and the signal map."""

    def __init__(self, name: str, microbatches: int) -> None:
        self.name = name
        self.microbatches = microbatches
        self.seen = 0
        self.stream: tuple[str, ...] | None = None
        self.candidates: list[Candidate] = []
        self.durations: list[list[float]] = []
        self.iter_s: list[float] = []
        self.free: dict[int, int] = {}  # position -> min free bytes sampled there
        self.allocated: dict[int, int] = {}  # position -> max bytes the training held there
        self.cycle: BubbleCycle | None = None
        self.signal_map: dict[int, tuple[int, int]] = {}  # position -> (slot, predicted length ns)
        self.recent: RecentLengths | None = None  # each signalled bubble's recent lengths


class _Hot:
    """State the per-instruction wrappers read: kept in one small object so lookups stay cheap."""

    __slots__ = ("records", "sampling", "signal_map")

    def __init__(self) -> None:
        self.records: list[tuple[int, int, int]] = []  # (instruction code, start_ns, end_ns)
        self.signal_map: dict[int, tuple[int, int]] = _NO_SIGNALS
        self.sampling = False


_ENGINE_ATTRS = ("_INSTRUCTION_MAP", "_exec_schedule", "_aggregate_total_loss", "train_batch", "eval_batch")
_MARK = "_bubbles_instrumentation"

# The hook.lock descriptors this process holds. A child forked from the training (a DataLoader worker) shares each
# lock's open file and would keep the lock, and so the card, alive after the training died. Children close their
# copies right after the fork: the lock lives exactly as long as the training's own process. (A child that carries
# on as the training after its parent exits has no lock then: its card is taken for stale, which stops fill work for
# that stage and never the training.)
_HELD_LOCKS: set[int] = set()


def _drop_locks_in_child() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_locks_in_child)


class Instrumentation:
    """What ``instrument`` returns: the profiled cycles, timings, statistics and ``detach()``."""

    def __init__(self, engine: Any, *, training: str, run_dir: Path, memory_probe: MemoryProbe,
                 warmup_iterations: int, profile_iterations: int, min_bubble_s: float, trace: bool,
                 timing: str = "host", event_factory: Callable[[], DeviceEvent] | None = None) -> None:
        if warmup_iterations < 0 or profile_iterations < 1:
            raise ValueError("warmup_iterations must be >= 0 and profile_iterations >= 1")
        if min_bubble_s < 0:
            raise ValueError(f"min_bubble_s must be >= 0, got {min_bubble_s}")
        if timing not in ("host", "cuda"):
            raise ValueError(f"timing must be 'host' or 'cuda' here, got {timing!r}")
        self.engine = engine
        self.training = training
        self.stage = int(engine.stage_id)
        self.stages = int(engine.num_stages)
        self.microbatches = int(engine.micro_batches)
        self.run_dir = Path(run_dir)
        self.stage_dir = paths.stage_dir(self.run_dir, training, self.stage)
        self.memory_probe = memory_probe
        self.warmup_iterations = warmup_iterations
        self.profile_iterations = profile_iterations
        self.min_bubble_s = min_bubble_s
        self.trace = trace
        # On the host: from train_batch's call to its return; the latest ITERATION_HISTORY (a training runs for weeks).
        self.iteration_times_s: deque[float] = deque(maxlen=ITERATION_HISTORY)
        self.device_iteration_times_s: deque[float] = deque(maxlen=ITERATION_HISTORY)  # device timing: as it ran them
        self.cycles: dict[str, BubbleCycle] = {}
        self.fill_mode: wire.FillMode | None = None
        self._profiles: dict[tuple[str, int], _ScheduleProfile] = {}
        self._current: _ScheduleProfile | None = None
        self._hot = _Hot()
        self._names: list[str] = []
        self._codes: dict[str, int] = {}
        self._wait_codes: set[int] = set()
        self._lb_code = self._code(LOSS_BROADCAST)
        self._iteration = 0
        self._seq = 0
        self._disabled = False
        self._warned: set[str] = set()
        self._in_eval = False
        # eval_batch's tail: (host start, seq, signal, device start event or None)
        self._eval_tail: tuple[int, int, tuple[int, int] | None, DeviceEvent | None] | None = None
        self._trace_ring: deque[tuple[int, list[tuple[int, int, int]], dict[int, tuple[int, int]]]] = \
            deque(maxlen=TRACE_ITERATIONS)
        self._listeners = Listeners(self.stage_dir)
        self._profile_lock = threading.Lock()  # _add_sample runs on the event thread with device timing
        self.timing = timing
        self._timer: EventTimer | None = None
        self.event_wait: str | None = None
        self.switch_interval_s: float | None = None  # set while attached, with device timing (see below)
        self._holds_switch_interval = False
        interval: float | None = None
        if timing == "cuda":
            if event_factory is None:
                self.event_wait, problem = event_wait_from_env(os.environ)
                if problem:
                    log.warning("%s", problem)
                event_factory = cuda_event_factory(self.event_wait, getattr(engine, "device", None))
            interval, problem = switch_interval_from_env(os.environ)
            if problem:
                log.warning("%s", problem)
            self._timer = EventTimer(event_factory, on_start=self._send_bubble_start,
                                     on_end=self._bubble_end, on_iteration=self._on_device_iteration,
                                     on_error=self._fail, on_resolved=self._sample_on_helper)
        self._saved: dict[str, Any] = {}
        self._attached = False
        try:
            self._attach()
        except BaseException:
            if self._timer is not None:
                self._timer.close()
            raise
        if self._timer is not None:
            # the helper thread gets the GIL this soon after an event completes (gpu_timing's docstring); shared
            # by every instrumented engine of the process, restored when the last detaches
            self.switch_interval_s = SWITCH_INTERVAL.acquire(interval)
            self._holds_switch_interval = True
        self._card: Path | None = None
        self._lock_fd: int | None = None
        self._write_card()

    # -- public ----------------------------------------------------------------------------------------

    @property
    def cycle(self) -> BubbleCycle | None:
        """The TrainSchedule cycle, or None while it is being profiled."""
        return self.cycles.get("TrainSchedule")

    @property
    def stats(self) -> dict[str, Any]:
        lags = list(self._timer.wake_lag_ns) if self._timer else []
        return {
            "signals_sent": self._listeners.sent,
            "signals_dropped": self._listeners.dropped,
            "listeners": len(self._listeners.targets),
            "listeners_removed": self._listeners.removed,
            "bubbles_signalled": self._seq,
            "iterations": self._iteration,
            "disabled": self._disabled,
            "timing": self.timing,
            "device_waits_timed": self._timer.resolved if self._timer else 0,
            "device_waits_untimed": self._timer.overflowed if self._timer else 0,
            # device timing: how late the helper thread woke after each signalled event (taken out of the stamps)
            "signal_wake_lag_us_p50": percentile(lags, 50) / 1e3 if lags else None,
            "signal_wake_lag_us_p90": percentile(lags, 90) / 1e3 if lags else None,
            "event_wait": self.event_wait,  # device timing on CUDA: how the helper thread waits (block or spin)
            "switch_interval_us": (self.switch_interval_s * 1e6 if self.switch_interval_s else None),
            "device_iteration_s_p50": (percentile(list(self.device_iteration_times_s), 50)
                                       if self.device_iteration_times_s else None),
        }

    def set_fill_mode(self, mode: wire.FillMode) -> None:
        """Tell every listener to switch fill mode (the demo's A/B switch); never raises into training.

        With device timing the bubbles of the iterations before the switch may not have been signalled yet (the
        device runs behind the host): the switch goes through the helper thread, after their signals, so that no
        bubble of the old phase is counted in the new one."""
        mode = wire.FillMode(mode)
        self.fill_mode = mode
        if self._disabled:
            return
        try:
            self._refresh_listeners()
            data = wire.encode_fill_mode(self.stage, mode)
            if self._timer is None or not self._timer.post(lambda: self._send_quietly(data)):
                self._listeners.send(data)
        except Exception as exc:
            self._fail(exc)

    def _send_quietly(self, data: bytes) -> None:
        try:
            self._listeners.send(data)
        except Exception as exc:
            self._fail(exc)

    def trace_events(self) -> list[tuple[int, str, int, int, int]]:
        """(iteration, instruction, start_ns, end_ns, slot or -1) of the last traced iterations."""
        if not self.trace:
            raise RuntimeError("trace_events() needs instrument(..., trace=True)")
        names = self._names
        out = []
        for it, records, smap in self._trace_ring:
            for pos, (code, t0, t1) in enumerate(records):
                sig = smap.get(pos)
                out.append((it, names[code], t0, t1, sig[0] if sig is not None else -1))
        return out

    def detach(self) -> None:
        """Restore the engine exactly as it was and close the socket. Safe to call twice."""
        if not self._attached:
            return
        d = self.engine.__dict__
        for attr in (*_ENGINE_ATTRS, _MARK):
            if attr in self._saved:
                d[attr] = self._saved[attr]
            else:
                d.pop(attr, None)
        self._attached = False
        if self._timer is not None:
            self._timer.close()
        if self._holds_switch_interval:
            SWITCH_INTERVAL.release()
            self._holds_switch_interval = False
        self._listeners.close()
        if self._card is not None:
            with contextlib.suppress(OSError):
                self._card.unlink()
            self._card = None
        if self._lock_fd is not None:
            if self._lock_fd in _HELD_LOCKS:  # not in a forked child, which closed its copy (and may reuse the number)
                _HELD_LOCKS.discard(self._lock_fd)
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
            self._lock_fd = None

    def _take_lock(self, path: Path) -> int | None:
        """Hold ``hook.lock`` for this process's life (``paths.HOOK_LOCK_NAME``); None if it cannot be had within
        0.5 s (another live process of this stage holds it): the card then says so and is never taken for stale."""
        import fcntl

        # Never through a link, never waiting to open (a FIFO planted under the name would hold the training here),
        # and only a regular file: the stage directory is writable by the fill jobs too.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        _HELD_LOCKS.add(fd)  # from the open on: a fork while it waits must not leave the child sharing the lock
        deadline = time.monotonic() + 0.5
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:  # the agent checks it for microseconds; a live twin holds it for good
                if time.monotonic() > deadline:
                    _HELD_LOCKS.discard(fd)
                    os.close(fd)
                    return None
                time.sleep(0.005)
            except OSError:  # a file system without flock: no lock, and no leaked descriptor
                _HELD_LOCKS.discard(fd)
                os.close(fd)
                raise

    def _write_card(self) -> None:
        """Tell the node's agent (cluster mode) which Pod and GPU this stage runs on: ``hook.json`` in the stage's
        directory. The Pod's name and namespace come from ``$POD_NAME``/``$POD_NAMESPACE`` (the downward API),
        else the hostname. Fails open: without the card a local agent still works, a cluster agent waits."""
        try:
            device = getattr(self.engine, "device", "cpu")
            card = {
                "training": self.training, "stage": self.stage, "stages": self.stages,
                "namespace": os.environ.get("POD_NAMESPACE", ""),
                "pod": os.environ.get("POD_NAME") or socket.gethostname(),
                "device": str(device), "gpu_uuid": gpu_uuid(device), "pid": os.getpid(),
                "started_ns": time.time_ns(),  # with the pid: a restarted process under the same Pod name differs
            }
            path = paths.hook_card(self.run_dir, self.training, self.stage)
            paths.make_private_dir(path.parent)
            paths.make_private_dir(paths.fills_dir(self.run_dir, self.training, self.stage))  # a fill Pod mounts it
            # The lock before the card: a card is never on disk, new, with its lock not yet held.
            try:
                self._lock_fd = self._take_lock(paths.hook_lock(self.run_dir, self.training, self.stage))
            except OSError:
                self._lock_fd = None  # a file system without flock: the card says so
            else:
                if self._lock_fd is None:
                    self._stand_down()
                    return
            card["lock"] = self._lock_fd is not None
            card["fills"] = True  # this hook signals the fill sockets in the stage's fills/ (a cluster agent checks)
            # A new file of a name no one could plant beforehand (mkstemp: O_EXCL, no link followed), then renamed
            # over the card: nothing in the directory can make this write block or land elsewhere.
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(card) + "\n")
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._card = path
        except Exception as exc:
            self._warn_once("card", f"bubbles hook on stage {self.stage} could not write its card for the node "
                                    f"agent ({exc!r}); training continues")

    # -- wiring ----------------------------------------------------------------------------------------

    def _code(self, name: str) -> int:
        code = self._codes.get(name)
        if code is None:
            code = self._codes[name] = len(self._names)
            self._names.append(name)
        return code

    def _attach(self) -> None:
        engine = self.engine
        d = engine.__dict__
        if d.get(_MARK) is not None:
            raise RuntimeError("this engine is already instrumented; detach() the first Instrumentation")
        for attr in (*_ENGINE_ATTRS, _MARK):
            if attr in d:
                self._saved[attr] = d[attr]
        timed_map = {}
        for cls, fn in engine._INSTRUCTION_MAP.items():
            code = self._code(cls.__name__)
            if cls.__name__ in WAIT_INSTRUCTIONS or (self._timer is not None and cls.__name__ in SEND_INSTRUCTIONS):
                self._wait_codes.add(code)
                timed_map[cls] = self._wait_wrapper(fn, code)
            else:
                timed_map[cls] = self._timed(fn, code)
        orig_exec = engine._exec_schedule
        orig_agg = engine._aggregate_total_loss
        orig_train = engine.train_batch
        orig_eval = engine.eval_batch

        def _exec_schedule(pipe_schedule: Any) -> Any:
            self._begin_schedule(pipe_schedule)
            result = orig_exec(pipe_schedule)
            if self._in_eval:
                self._open_eval_tail()
            return result

        def train_batch(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic_ns()
            start = self._mark()
            try:
                result = orig_train(*args, **kwargs)
            except BaseException:
                self._abandon_iteration(start)
                raise
            self._end_iteration(t0, time.monotonic_ns(), start)
            return result

        def eval_batch(*args: Any, **kwargs: Any) -> Any:
            self._in_eval = True
            self._eval_tail = None
            t0 = time.monotonic_ns()
            start = self._mark()
            try:
                result = orig_eval(*args, **kwargs)
            except BaseException:
                self._abandon_iteration(start)
                raise
            finally:
                self._in_eval = False
                self._close_eval_tail()
            self._end_iteration(t0, time.monotonic_ns(), start)
            return result

        d["_INSTRUCTION_MAP"] = timed_map
        d["_exec_schedule"] = _exec_schedule
        d["_aggregate_total_loss"] = self._wait_wrapper(orig_agg, self._lb_code)
        d["train_batch"] = train_batch
        d["eval_batch"] = eval_batch
        d[_MARK] = self
        self._attached = True
        try:
            self._refresh_listeners()
        except Exception as exc:
            self._fail(exc)

    def _timed(self, fn: Callable[..., Any], code: int) -> Callable[..., Any]:
        """Wrapper for instructions that are never bubbles: two stamps and an append."""
        hot = self._hot
        mono = time.monotonic_ns

        def timed(engine: Any, **kwargs: Any) -> Any:
            t0 = mono()
            result = fn(engine, **kwargs)
            hot.records.append((code, t0, mono()))
            return result

        timed.__name__ = getattr(fn, "__name__", "timed")
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def _wait_wrapper(self, fn: Callable[..., Any], code: int) -> Callable[..., Any]:
        if self._timer is not None:
            return self._device_timed_wait_call(fn, code, self._timer)
        return self._timed_wait_call(fn, code)

    def _device_timed_wait_call(self, fn: Callable[..., Any], code: int, timer: EventTimer
                                ) -> Callable[..., Any]:
        """Device timing: events around the wait; the event thread signals and measures it.

        Waits that are neither signalled nor profiled get only the host stamps, like any instruction.
        """
        hot = self._hot
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
                self._seq += 1
                seq = self._seq
            try:
                start = timer.begin(pos, sig, seq)
            except Exception as exc:  # a CUDA error recording the event: signalling stops, the training goes on
                self._fail(exc)
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
                        timer.end(pos, start, sig, seq, self._current if hot.sampling else None)
                    except Exception as exc:
                        self._fail(exc)
            return result

        return wait

    def _timed_wait_call(self, fn: Callable[..., Any], code: int) -> Callable[..., Any]:
        """Time a candidate wait; signal it when it is a profiled bubble and listeners exist.

        Used for RecvActivation/RecvGrad handlers (called with the engine as first argument) and for the
        bound ``_aggregate_total_loss``.
        """
        hot = self._hot
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
                    self._sample_memory(pos)
                return result
            t0 = mono()
            seq = self._bubble_start(sig, t0)
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = mono()
                records.append((code, t0, t1))
                self._bubble_end(sig, seq, t1)

        return wait

    # -- per iteration (off the per-instruction path) --------------------------------------------------

    def _begin_schedule(self, pipe_schedule: Any) -> None:
        hot = self._hot
        hot.records.clear()
        hot.signal_map = _NO_SIGNALS
        hot.sampling = False
        if self._disabled:
            self._current = None
            return
        try:
            name = type(pipe_schedule).__name__
            mb = int(getattr(pipe_schedule, "micro_batches", self.microbatches))
            prof = self._profiles.get((name, mb))
            if prof is None:
                prof = self._profiles[(name, mb)] = _ScheduleProfile(name, mb)
            self._current = prof
            if prof.cycle is None:
                hot.sampling = prof.seen >= self.warmup_iterations
            elif self._listeners.targets:
                hot.signal_map = prof.signal_map
        except Exception as exc:
            self._fail(exc)

    def _open_eval_tail(self) -> None:
        """eval_batch's end-of-batch wait (output reduction and loss broadcast) starts now.

        With device timing it is timed like any wait: events around it, its signals sent by the event thread
        when the device gets there (the host reaches the tail long before the device does)."""
        hot = self._hot
        pos = len(hot.records)
        sig = hot.signal_map.get(pos)
        t0 = time.monotonic_ns()
        timer = self._timer
        if timer is not None and (sig is not None or hot.sampling):
            seq = 0
            if sig is not None:
                self._seq += 1
                seq = self._seq
            try:
                self._eval_tail = (t0, seq, sig, timer.begin(pos, sig, seq))
            except Exception as exc:
                self._fail(exc)
                self._eval_tail = (t0, seq, sig, None)
            return
        seq = self._bubble_start(sig, t0) if sig is not None and timer is None else 0
        self._eval_tail = (t0, seq, sig, None)

    def _close_eval_tail(self) -> None:
        tail, self._eval_tail = self._eval_tail, None
        if tail is None:
            return
        t0, seq, sig, start = tail
        t1 = time.monotonic_ns()
        hot = self._hot
        pos = len(hot.records)
        hot.records.append((self._lb_code, t0, t1))
        if start is not None:
            assert self._timer is not None
            try:
                self._timer.end(pos, start, sig, seq, self._current if hot.sampling else None)
            except Exception as exc:
                self._fail(exc)
        elif sig is not None and self._timer is None:
            self._bubble_end(sig, seq, t1)
        if hot.sampling and sig is None and self._timer is None:
            self._sample_memory(pos)

    def _sample_on_helper(self, pos: int, prof: _ScheduleProfile | None) -> None:
        """Device timing: a profiled wait has ended on the device; read the memory probe here, on the helper
        thread, not on the training's."""
        if prof is None:
            return
        with self._profile_lock:
            if prof.cycle is None:
                self._sample_memory(pos, prof)

    def _sample_memory(self, pos: int, prof: _ScheduleProfile | None = None) -> None:
        prof = prof if prof is not None else self._current
        if prof is None:
            return
        try:
            sample = self.memory_probe.sample()
            free, allocated = int(sample.free_bytes), int(sample.allocated_bytes)
        except Exception as exc:  # a broken probe means "unknown", not a broken training
            self._warn_once("probe", f"memory probe {self.memory_probe!r} failed ({exc!r}); using 0 bytes")
            free, allocated = 0, 0
        old = prof.free.get(pos)
        prof.free[pos] = free if old is None else min(old, free)
        prof.allocated[pos] = max(allocated, prof.allocated.get(pos, 0))

    def _bubble_start(self, sig: tuple[int, int], t0: int) -> int:
        self._seq += 1
        seq = self._seq
        self._send_bubble_start(sig, seq, t0)
        return seq

    def _send_bubble_start(self, sig: tuple[int, int], seq: int, t0: int) -> None:
        if self._disabled:
            return
        try:
            self._listeners.send(wire.encode_bubble_start(self.stage, sig[0], seq, t0, t0 + sig[1]))
        except Exception as exc:
            self._fail(exc)

    def _bubble_end(self, sig: tuple[int, int], seq: int, t1: int) -> None:
        if self._disabled:
            return
        try:
            self._listeners.send(wire.encode_bubble_end(self.stage, sig[0], seq, t1))
        except Exception as exc:
            self._fail(exc)

    def _mark(self) -> DeviceEvent | None:
        """Device timing: an event at the iteration's start, so its length is the device's (see ``_end_iteration``)."""
        timer = self._timer
        if timer is None or self._disabled:
            return None
        try:
            return timer.mark()
        except Exception as exc:
            self._fail(exc)
            return None

    def _abandon_iteration(self, start: DeviceEvent | None) -> None:
        """Device timing: an iteration that is not measured (signalling off, or the training's call raised): its
        events go back to the pool and the waits timed in it are dropped, in order. Never raises."""
        if start is None or self._timer is None:
            return
        try:
            self._timer.iteration((_NOTHING,), start)
        except Exception as exc:
            self._fail(exc)

    def _end_iteration(self, t0: int, t1: int, start: DeviceEvent | None = None) -> None:
        """An iteration is over on the host. With device timing (``start`` given) its length is measured on the
        device, by the event thread, and what uses it (the profile, the ITERATION message the guard reads) waits
        for that: the host only queued the work, and with NCCL it runs ahead by up to an iteration."""
        it = self._iteration
        self._iteration += 1
        self.iteration_times_s.append((t1 - t0) / 1e9)
        prof, self._current = self._current, None
        hot = self._hot
        hot.signal_map = _NO_SIGNALS
        if self._disabled or prof is None:
            self._abandon_iteration(start)
            return
        try:
            records = hot.records
            if self.trace:
                self._trace_ring.append((it, list(records), prof.signal_map if prof.cycle else {}))
            prof.seen += 1
            timer = self._timer
            if prof.cycle is None:
                if prof.seen > self.warmup_iterations:
                    if timer is not None:  # the waits' device-side lengths are not known yet
                        timer.iteration((_PROFILED, prof, list(records), (t1 - t0) / 1e9), start)
                    else:
                        self._add_sample(prof, records, (t1 - t0) / 1e9)
                elif timer is not None:
                    timer.iteration((_NOTHING,), start)  # its events go back to the pool, in order
            elif timer is not None:
                if start is not None:  # None: the event thread has stopped, and signalling with it
                    # the waits' lengths come from the device: the event thread follows them (None: not these)
                    follow = prof if self.fill_mode is not wire.FillMode.NAIVE else None
                    timer.iteration((_SEND, it, t0, t1 - t0, follow), start)
            else:
                self._listeners.send(wire.encode_iteration(self.stage, it, t0, t1 - t0))
                if prof.recent is not None and self.fill_mode is not wire.FillMode.NAIVE:
                    n = len(records)
                    self._follow_lengths(prof, {pos: records[pos][2] - records[pos][1]
                                                for pos in prof.signal_map if pos < n}, prof.seen)
            self._refresh_listeners()  # a new listener is greeted with the profiles and the fill mode
        except Exception as exc:
            self._fail(exc)

    def _on_device_iteration(self, payload: tuple[Any, ...], lengths_ns: dict[int, int],
                             span: tuple[int, int] | None) -> None:
        """Event thread: an iteration is over on the device. A profiled one becomes a sample (its waits and its
        length as the device saw them); after profiling the agent is told its length (the guard's input)."""
        if self._disabled:
            return
        try:
            if payload[0] is _PROFILED:
                _, prof, records, host_s = payload
                self._add_sample(prof, records, span[1] / 1e9 if span else host_s, lengths_ns)
            elif payload[0] is _SEND:
                _, it, t0, took, follow = payload
                if span is not None:
                    self.device_iteration_times_s.append(span[1] / 1e9)
                    t0, took = span
                self._listeners.send(wire.encode_iteration(self.stage, it, t0, took))
                if follow is not None and follow.recent is not None:
                    self._follow_lengths(follow, lengths_ns, it)
        except Exception as exc:
            self._fail(exc)

    def _add_sample(self, prof: _ScheduleProfile, records: Sequence[tuple[int, int, int]],
                    iteration_s: float, device_lengths_ns: dict[int, int] | None = None) -> None:
        """One profiled iteration; ``device_lengths_ns`` (position -> ns) overrides the host stamps."""
        with self._profile_lock:
            if prof.cycle is None:  # with device timing, samples queued before the cycle was built
                self._add_sample_locked(prof, records, iteration_s, device_lengths_ns or {})

    def _add_sample_locked(self, prof: _ScheduleProfile, records: Sequence[tuple[int, int, int]],
                           iteration_s: float, device_lengths_ns: dict[int, int]) -> None:
        names = self._names
        lb = self._lb_code
        stream = tuple(names[c] for c, _, _ in records if c != lb)
        has_lb = any(c == lb for c, _, _ in records)
        if stream != prof.stream:  # first sample, or the schedule changed shape: start over
            prof.stream = stream
            prof.candidates = candidate_slots(stream, loss_broadcast=has_lb, sends=self._timer is not None)
            prof.durations, prof.iter_s, prof.free, prof.allocated = [], [], {}, {}
            if len(records) != len(stream) + has_lb:
                raise RuntimeError("loss broadcast recorded twice in one iteration")
        prof.durations.append([device_lengths_ns.get(c.position, records[c.position][2] - records[c.position][1])
                               / 1e9 for c in prof.candidates])
        prof.iter_s.append(iteration_s)
        if len(prof.durations) < self.profile_iterations:
            return
        cycle = build_cycle(training=self.training, stage=self.stage, stages=self.stages,
                            microbatches=prof.microbatches, schedule=prof.name, candidates=prof.candidates,
                            durations_s=prof.durations,
                            free_bytes=[prof.free.get(c.position, 0) for c in prof.candidates],
                            allocated_bytes=[prof.allocated.get(c.position, 0) for c in prof.candidates],
                            iteration_s=prof.iter_s, min_bubble_s=self.min_bubble_s,
                            memory_margin_bytes=int(getattr(self.memory_probe, "margin_bytes", 0) or 0))
        prof.cycle = cycle
        # The predicted end: see predicted_length (the slot's p10 and median are the profile's).
        prof.signal_map = {s.position: (s.slot, int(min(s.p10_s, s.duration_s) * 1e9)) for s in cycle.slots}
        # After profiling the prediction follows the bubbles' lengths: host stamps or the device's events time them
        column = {c.position: j for j, c in enumerate(prof.candidates)}
        prof.recent = RecentLengths({s.position: [int(row[column[s.position]] * 1e9) for row in prof.durations]
                                     for s in cycle.slots}, window=RECENT_ITERATIONS)
        self.cycles[prof.name] = cycle
        log.info("stage %d: %s profiled: %d bubbles, %.1f%% of %.2f ms", self.stage, prof.name,
                 len(cycle.slots), 100 * cycle.bubble_ratio, 1e3 * cycle.iteration_s)
        new = set(self._refresh_listeners())  # greeted with every cycle, this one among them
        self._send_profile(cycle, [t for t in self._listeners.targets if t not in new])

    @staticmethod
    def _follow_lengths(prof: _ScheduleProfile, lengths_ns: Mapping[int, int], count: int) -> None:
        """After profiling: add this iteration's bubble lengths (position -> ns); every REPREDICT_EVERY iterations
        (``count``), predict from them. Naive co-location's iterations (the demo's A/B mode) are not the training's
        bubbles and are left out by the callers. Host timing: a few microseconds per iteration on the training's
        thread; device timing: on the event thread, with the lengths the device measured, and the new prediction
        reaches the iterations the host queues next (it runs up to an iteration ahead)."""
        recent = prof.recent
        assert recent is not None
        for pos in prof.signal_map:
            ns = lengths_ns.get(pos)
            if ns is not None:
                recent.add(pos, ns)
        if count % REPREDICT_EVERY == 0:
            prof.signal_map = {pos: (slot, recent.predicted_ns(pos)) for pos, (slot, _) in prof.signal_map.items()}

    def _refresh_listeners(self) -> list[str]:
        """Listeners that appeared; each was told the cycles and the fill mode before anything else reached it."""
        return self._listeners.refresh(self._greeting)

    def _greeting(self) -> list[bytes]:
        """What a new listener is told first: the cycles (the one in use last) and the current fill mode."""
        out = [data for cycle in self._profiles_in_use_last() if (data := self._encoded_profile(cycle)) is not None]
        if self.fill_mode is not None:
            out.append(wire.encode_fill_mode(self.stage, self.fill_mode))
        return out

    def _profiles_in_use_last(self) -> list[BubbleCycle]:
        cycles = list(self.cycles.values())
        train = self.cycles.get("TrainSchedule")
        if train is not None:  # the training's cycle is the one a listener should end up holding
            cycles = [c for c in cycles if c is not train] + [train]
        return cycles

    def _encoded_profile(self, cycle: BubbleCycle) -> bytes | None:
        try:
            return wire.encode_profile(self.stage, cycle.to_dict())
        except wire.WireError as exc:
            self._warn_once("profile", f"stage {self.stage}: bubble profile not sent: {exc}")
            return None

    def _send_profile(self, cycle: BubbleCycle, targets: Sequence[str] | None = None) -> None:
        data = self._encoded_profile(cycle)
        if data is not None:
            self._listeners.send(data, targets)

    # -- failure -----------------------------------------------------------------------------------------

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _disable(self) -> None:
        """No more signals or samples from this process; the training goes on."""
        self._disabled = True
        self._hot.signal_map = _NO_SIGNALS
        self._hot.sampling = False

    def _stand_down(self) -> None:
        """Another live process of this training's stage on this node holds its card: tensor-parallel ranks of one
        stage, or data-parallel replicas of it, on one node. They would share one directory, one agent and one card,
        and their bubble signals would merge into one stream: only the first signals; this one trains on, unhooked
        in effect."""
        self._disable()
        self._warn_once("twin", f"bubbles hook: another live process of training {self.training} stage {self.stage} "
                                f"on this node already signals its bubbles (tensor-parallel ranks or data-parallel "
                                f"replicas of one stage on one node): this one (pid {os.getpid()}) does not; "
                                "training continues. One process per stage and node is harvested")

    def _fail(self, exc: BaseException) -> None:
        """The hook's own bug or environment problem: stop signalling, keep the training going."""
        self._disable()
        self._warn_once("fail", f"bubbles hook disabled on stage {self.stage} after an internal error "
                                f"({exc!r}); training continues without bubble signals")


def resolve_timing(timing: str, engine: Any) -> str:
    """``"auto"``: device events when the engine computes on a CUDA device, host stamps otherwise."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    if timing != "auto":
        return timing
    device = getattr(engine, "device", None)
    return "cuda" if getattr(device, "type", str(device or "")).startswith("cuda") else "host"


def instrument(engine: Any, *, training: str | None = None, run_dir: Path | str | None = None,
               memory_probe: MemoryProbe | None = None, warmup_iterations: int = 2,
               profile_iterations: int = 5, min_bubble_s: float = 0.0005, trace: bool = False,
               timing: str = "auto", event_factory: Callable[[], DeviceEvent] | None = None
               ) -> Instrumentation:
    """Hook one DeepSpeed ``PipelineEngine`` (see the module docstring); undo with ``detach()``.

    ``timing``: ``"host"`` (CPU/gloo: the host blocks in each wait), ``"cuda"`` (device events around the
    waits, read on a helper thread) or ``"auto"`` (``"cuda"`` when ``engine.device`` is a CUDA device).
    ``event_factory`` replaces ``torch.cuda.Event`` (tests; other devices with the same interface).
    """
    missing = [a for a in ("stage_id", "num_stages", "micro_batches", "train_batch") if not hasattr(engine, a)]
    if missing:
        raise TypeError(f"instrument() needs a DeepSpeed PipelineEngine (deepspeed.initialize with a PipelineModule); "
                        f"got a {type(engine).__name__} without {', '.join(missing)}")
    # What comes from outside the training's code fails open: the training runs on, without bubbles, and says why.
    internals = [a for a in _ENGINE_ATTRS if not hasattr(engine, a)]
    if internals:
        return _unattached(engine, f"this DeepSpeed ({_deepspeed_version()}) has no PipelineEngine."
                                   f"{', .'.join(internals)}, which the hook wraps; bubbles is tested with DeepSpeed "
                                   "0.19.x")
    if training is None:
        try:
            training = paths.check_name("training", paths.default_training())
        except ValueError as exc:
            return _unattached(engine, f"${paths.TRAINING_ENV}: {exc}; set it to the PipelineTraining's name")
    if memory_probe is None:
        try:
            memory_probe = default_probe(getattr(engine, "device", None))  # the engine's, not the current one
        except Exception as exc:
            log.warning("no memory probe (%s); bubbles report 0 free bytes", exc)
            memory_probe = MemoryProbe()
    if run_dir is None:
        run_dir = paths.default_run_dir()
        mounted = paths.MOUNTED_RUN_DIR
        if not os.environ.get(paths.RUN_DIR_ENV) and Path(run_dir) != mounted and mounted.exists():
            # The node's run directory is mounted but not this user's: no agent will hear this training.
            try:
                owner = mounted.stat().st_uid
            except OSError:
                owner = -1
            log.warning("bubbles hook: %s exists but this process (uid %d) cannot write it (owner uid %d): signalling "
                        "in %s, where no agent listens; run the training as the agent's UID (the chart's "
                        "agent.runAsUser)", mounted, os.getuid(), owner, run_dir)
    training = paths.check_name("training", training)
    try:
        inst = Instrumentation(
            engine,
            training=training,
            run_dir=Path(run_dir),
            memory_probe=memory_probe,
            warmup_iterations=warmup_iterations,
            profile_iterations=profile_iterations,
            min_bubble_s=min_bubble_s,
            trace=trace,
            timing=resolve_timing(timing, engine),
            event_factory=event_factory,
        )
    except OSError as exc:  # the process's environment (out of descriptors, say): nothing is attached yet
        return _unattached(engine, f"the hook could not open its sockets ({exc})")
    if not inst._disabled:  # one that stood down has said why
        log.info("bubbles hook: training %s stage %d of %d signals in %s (%s timing)", inst.training, inst.stage,
                 inst.stages, inst.stage_dir, inst.timing)
    return inst


class _Unattached(Instrumentation):
    """What ``instrument`` returns when the hook cannot attach for a reason outside the training's code (its
    environment, the DeepSpeed version): nothing of the engine is touched, nothing is signalled, ``stats`` says
    ``disabled`` and ``reason`` says why. The training runs exactly as without the hook."""

    def __init__(self, engine: Any, reason: str) -> None:  # Instrumentation's set-up is what it skips
        self.engine = engine
        self.reason = reason
        self.training = ""
        self.stage = -1
        self.cycles = {}
        self.fill_mode = None
        self.iteration_times_s = deque(maxlen=1)
        self.device_iteration_times_s = deque(maxlen=1)
        self.timing = "off"
        self._attached = False  # Instrumentation.detach() has nothing to undo
        self._disabled = True  # and set_fill_mode() nothing to send

    @property
    def stats(self) -> dict[str, Any]:
        return {"disabled": True, "reason": self.reason, "signals_sent": 0, "bubbles_signalled": 0, "iterations": 0,
                "timing": self.timing}

    def trace_events(self) -> list[tuple[int, str, int, int, int]]:
        return []


def _unattached(engine: Any, reason: str) -> Instrumentation:
    log.error("bubbles hook not attached: %s. The training runs without bubble harvesting", reason)
    return _Unattached(engine, reason)


def _deepspeed_version() -> str:
    try:
        import deepspeed

        return f"version {deepspeed.__version__}"
    except Exception:
        return "version unknown"
