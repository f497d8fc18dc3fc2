"""The instrumentation of one DeepSpeed ``PipelineEngine``: ``instrument(engine)`` and what it returns.

``instrument(engine)`` wraps one engine instance, never DeepSpeed's classes or files: a copy of
``engine._INSTRUCTION_MAP`` with timed handlers, plus instance attributes shadowing ``_exec_schedule``,
``_aggregate_total_loss``, ``train_batch`` and ``eval_batch``. ``Instrumentation.detach()`` removes them.

Per instruction the hook takes two ``time.monotonic_ns()`` stamps and appends one tuple (the instructions that hold
collectives, ``collectives.HOST_INSTRUCTIONS``, one thread-local write more, and a tuple per collective); everything
else (which positions are bubbles, their predicted lengths, the encoded datagrams' shapes) is decided
once per iteration or once per profile. How waits are timed (host stamps, or device events read on a helper thread)
is the timing strategy's (``timing``); which waits are bubbles is the pure profile's (``profile``).

Fail open: any exception in the hook's own bookkeeping is logged once and switches signalling off; exceptions raised
by DeepSpeed's handlers propagate unchanged. What the hook cannot help (its environment, the DeepSpeed version) leaves
the engine untouched: ``instrument`` returns an ``Unattached``. The hook never touches tensors, so the training's
losses are bit-identical with and without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bubbles.core import card as cards
from bubbles.core import identity, paths, wire
from bubbles.core.cycle import BubbleCycle, RecentLengths
from bubbles.core.stats import percentile
from bubbles.training.gpu_timing import DeviceEvent
from bubbles.training.probes import FREE_BYTES_ENV, MemoryProbe, StaticMemoryProbe, default_probe, gpu_uuid

from .collectives import ACTIVE, COLLECTIVES, HOST_INSTRUCTIONS, collective_name, deepspeed_backend, is_collective
from .listeners import Listeners
from .profile import LOSS_BROADCAST, build_cycle, candidate_slots
from .state import NO_SIGNALS, Hot, ScheduleProfile
from .timing import EvalTail, make_timing

log = logging.getLogger("bubbles.hook")


def say(message: str, *args: Any) -> None:
    """Log ``message`` at INFO, and where the process configured no logging at all (a DeepSpeed script, whose own
    logger has a handler of its own) write it to stderr too, once: what a user running a script needs to see (where
    the hook signals, what it profiled) must not depend on configuring ``logging``."""
    log.info(message, *args)
    if not log.hasHandlers():
        # one write: the stages of a pipeline share the terminal, and print()'s separate newline interleaves them
        sys.stderr.write("[bubbles] " + (message % args if args else message) + "\n")
        sys.stderr.flush()

ITERATION_HISTORY = 4096  # iteration times kept per stage (host and device timing): bounded over a weeks-long training
TRACE_ITERATIONS = 256  # iterations of per-instruction trace kept when trace=True (a ring)
RECENT_ITERATIONS = 32  # predicted bubble lengths follow the last this many iterations' lengths ...
REPREDICT_EVERY = 4  # ... recomputed every this many iterations
TIMINGS = ("auto", "host", "cuda")


_ENGINE_ATTRS = ("_INSTRUCTION_MAP", "_exec_schedule", "_aggregate_total_loss", "train_batch", "eval_batch")
_MARK = "_bubbles_instrumentation"


class Instrumentation:
    """What ``instrument`` returns: the profiled cycles, timings, statistics and ``detach()``."""

    def __init__(self, engine: Any, *, training: str, run_dir: Path, memory_probe: MemoryProbe,
                 warmup_iterations: int, profile_iterations: int, min_bubble_s: float, trace: bool,
                 timing: str = "host", event_factory: Callable[[], DeviceEvent] | None = None,
                 backend: Any = None, namespace: str | None = None) -> None:
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
        self.rank, self.ranks = stage_rank_of(engine)
        # The GPU this process harvests: every rank of a stage (tensor- and data-parallel) has its own directory, card,
        # lock and listeners, and signals its own bubbles.
        self.key = paths.GpuKey(namespace or paths.default_namespace(), training, self.stage, self.rank)
        self.stage_dir = paths.gpu_dir(self.run_dir, self.key)
        # How its messages name it: the ranks of a stage share a terminal and a log, each says which it is.
        self.where = f"stage {self.stage} rank {self.rank} of {self.ranks}"
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
        self._profiles: dict[tuple[str, int], ScheduleProfile] = {}
        self._current: ScheduleProfile | None = None
        self._hot = Hot()
        self._names: list[str] = []
        self._codes: dict[str, int] = {}
        self._wait_codes: set[int] = set()
        self._lb_code = self._code(LOSS_BROADCAST)
        self._iteration = 0
        self._off_profile = 0  # iterations after profiling whose waits did not line up with the profile's
        self._seq = 0
        self._disabled = False
        self._warned: set[str] = set()
        self._in_eval = False
        self._eval_tail: EvalTail | None = None
        self._trace_ring: deque[tuple[int, list[tuple[int, int, int]], dict[int, tuple[int, int]]]] = \
            deque(maxlen=TRACE_ITERATIONS)
        self._listeners = Listeners(self.stage_dir)
        self._profile_lock = threading.Lock()  # _add_sample runs on the event thread with device timing
        self.timing = timing
        self._timing = make_timing(timing, self, event_factory, getattr(engine, "device", None))
        self._saved: dict[str, Any] = {}
        self._attached = False
        # The collectives inside OptimizerStep, ReduceGrads and ReduceTiedGrads (see collectives): "timed", or why not
        self.collectives = "timed"
        self._holds_collectives = False
        try:
            COLLECTIVES.acquire(backend if backend is not None else deepspeed_backend())
        except Exception as exc:
            self.collectives = f"not timed: {exc}"
            log.warning("bubbles hook on %s: the waits inside OptimizerStep, ReduceGrads and ReduceTiedGrads "
                        "(gradient clipping's all-reduce, data-parallel all-reduces) are not seen (%s); the receives, "
                        "sends and the loss broadcast are", self.where, exc)
        else:
            self._holds_collectives = True
        try:
            self._attach()
        except BaseException:
            self._timing.close()
            self._release_collectives()
            raise
        self._timing.started()
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
        return {
            "signals_sent": self._listeners.sent,
            "signals_dropped": self._listeners.dropped,
            "listeners": len(self._listeners.targets),
            "listeners_removed": self._listeners.removed,
            "bubbles_signalled": self._seq,
            "iterations": self._iteration,
            "disabled": self._disabled,
            "timing": self.timing,
            "collectives": self.collectives,
            "iterations_off_profile": self._off_profile,
            # runs of bubbles far past their prediction, after which the prediction restarted from them
            "prediction_shifts": sum(p.recent.shifts for p in self._profiles.values() if p.recent is not None),
            **self._timing.stats(),
            "device_iteration_s_p50": (percentile(list(self.device_iteration_times_s), 50)
                                       if self.device_iteration_times_s else None),
        }

    @property
    def event_wait(self) -> str | None:
        """Device timing on CUDA: how the helper thread waits on an event (block or spin)."""
        return self._timing.event_wait

    @property
    def switch_interval_s(self) -> float | None:
        """Device timing: the process's thread switch interval while this engine is attached."""
        return self._timing.switch_interval_s

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
            if not self._timing.post(lambda: self._send_quietly(data)):
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
        self._timing.close()
        self._release_collectives()
        self._listeners.close()
        if self._card is not None:
            with contextlib.suppress(OSError):
                self._card.unlink()
            self._card = None
        if self._lock_fd is not None:
            cards.release_lock(self._lock_fd)
            self._lock_fd = None

    def _release_collectives(self) -> None:
        if self._holds_collectives:
            self._holds_collectives = False
            COLLECTIVES.release()

    def _write_card(self) -> None:
        """Tell the node's agent (cluster mode) which Pod and GPU this rank of its stage runs on: ``hook.json`` in its
        GPU's directory (``paths.gpu_dir``). The Pod's name comes from ``$POD_NAME`` (the downward API), else the
        hostname; the namespace is the key's (``$POD_NAMESPACE``, or ``_local``). Fails open: without the card a local
        agent still works, a cluster agent waits."""
        try:
            device = getattr(self.engine, "device", "cpu")
            pod = os.environ.get("POD_NAME") or socket.gethostname()
            uuid = gpu_uuid(device)
            started_ns = time.time_ns()  # with the pid: a restarted process under the same Pod name differs
            path = paths.hook_card(self.run_dir, self.key)
            paths.make_private_dir(path.parent)
            paths.make_private_dir(paths.fills_dir(self.run_dir, self.key))  # a fill Pod mounts it
            # The lock before the card: a card is never on disk, new, with its lock not yet held.
            try:
                self._lock_fd = cards.hold_lock(paths.hook_lock(self.run_dir, self.key))
            except OSError:
                self._lock_fd = None  # a file system without flock: the card says so
            else:
                if self._lock_fd is None:
                    self._stand_down()
                    return
            cards.write_card(path, cards.Card(
                training=self.training, stage=self.stage, stages=self.stages, namespace=self.key.namespace, pod=pod,
                device=str(device), gpu_uuid=uuid, rank=self.rank, ranks=self.ranks, pid=os.getpid(),
                started_ns=started_ns,
                lock=self._lock_fd is not None))
            self._card = path
        except Exception as exc:
            self._warn_once("card", f"bubbles hook on {self.where} could not write its card for the node "
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
        timing = self._timing
        for cls, fn in engine._INSTRUCTION_MAP.items():
            code = self._code(cls.__name__)
            if cls.__name__ in timing.wait_instructions:
                self._wait_codes.add(code)
                timed_map[cls] = timing.wait_wrapper(fn, code)
            elif cls.__name__ in HOST_INSTRUCTIONS and self._holds_collectives:
                timed_map[cls] = self._hosting(fn, code, cls.__name__)
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
            start = timing.mark()
            try:
                result = orig_train(*args, **kwargs)
            except BaseException:
                timing.abandon_iteration(start)
                raise
            self._end_iteration(t0, time.monotonic_ns(), start)
            return result

        def eval_batch(*args: Any, **kwargs: Any) -> Any:
            self._in_eval = True
            self._eval_tail = None
            t0 = time.monotonic_ns()
            start = timing.mark()
            try:
                result = orig_eval(*args, **kwargs)
            except BaseException:
                timing.abandon_iteration(start)
                raise
            finally:
                self._in_eval = False
                self._close_eval_tail()
            self._end_iteration(t0, time.monotonic_ns(), start)
            return result

        d["_INSTRUCTION_MAP"] = timed_map
        d["_exec_schedule"] = _exec_schedule
        d["_aggregate_total_loss"] = timing.wait_wrapper(orig_agg, self._lb_code)
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

    def _hosting(self, fn: Callable[..., Any], code: int, instruction: str) -> Callable[..., Any]:
        """Wrapper for an instruction whose collectives are waits (``collectives``): timed like any instruction, and
        while it runs the blocking collectives it calls on this thread go to wait wrappers of their own, recorded as
        ``<instruction>.<op>`` before the instruction's own record."""
        hot = self._hot
        mono = time.monotonic_ns
        active = ACTIVE
        timing = self._timing
        table = {op: timing.wait_wrapper(original, self._code(collective_name(instruction, op)))
                 for op, original in COLLECTIVES.originals.items()}

        def hosting(engine: Any, **kwargs: Any) -> Any:
            t0 = mono()
            outer, active.table = active.table, table
            try:
                result = fn(engine, **kwargs)
            finally:
                active.table = outer
            hot.records.append((code, t0, mono()))
            return result

        hosting.__name__ = getattr(fn, "__name__", "hosting")
        hosting.__wrapped__ = fn  # type: ignore[attr-defined]
        return hosting

    # -- per iteration (off the per-instruction path) --------------------------------------------------

    def _begin_schedule(self, pipe_schedule: Any) -> None:
        hot = self._hot
        hot.records.clear()
        hot.signal_map = NO_SIGNALS
        hot.sampling = False
        if self._disabled:
            self._current = None
            return
        try:
            name = type(pipe_schedule).__name__
            mb = int(getattr(pipe_schedule, "micro_batches", self.microbatches))
            prof = self._profiles.get((name, mb))
            if prof is None:
                prof = self._profiles[(name, mb)] = ScheduleProfile(name, mb)
            self._current = prof
            if prof.cycle is None:
                hot.sampling = prof.seen >= self.warmup_iterations
            elif self._listeners.targets:
                hot.signal_map = prof.signal_map
        except Exception as exc:
            self._fail(exc)

    def _open_eval_tail(self) -> None:
        """eval_batch's end-of-batch wait (output reduction and loss broadcast) starts now."""
        hot = self._hot
        pos = len(hot.records)
        self._eval_tail = self._timing.open_eval_tail(pos, hot.signal_map.get(pos), time.monotonic_ns())

    def _close_eval_tail(self) -> None:
        tail, self._eval_tail = self._eval_tail, None
        if tail is None:
            return
        t1 = time.monotonic_ns()
        hot = self._hot
        pos = len(hot.records)
        hot.records.append((self._lb_code, tail[0], t1))
        self._timing.close_eval_tail(tail, pos, t1)

    def _sample_memory(self, pos: int, prof: ScheduleProfile | None = None) -> None:
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

    def _end_iteration(self, t0: int, t1: int, start: DeviceEvent | None = None) -> None:
        """An iteration is over on the host. With device timing (``start`` given) its length is measured on the
        device, by the event thread, and what uses it (the profile, the ITERATION message the guard reads) waits
        for that: the host only queued the work, and with NCCL it runs ahead by up to an iteration."""
        it = self._iteration
        self._iteration += 1
        self.iteration_times_s.append((t1 - t0) / 1e9)
        prof, self._current = self._current, None
        hot = self._hot
        hot.signal_map = NO_SIGNALS
        if self._disabled or prof is None:
            self._timing.abandon_iteration(start)
            return
        try:
            records = hot.records
            if self.trace:
                self._trace_ring.append((it, list(records), prof.signal_map if prof.cycle else {}))
            prof.seen += 1
            if prof.cycle is None:
                if prof.seen > self.warmup_iterations:
                    self._timing.profiled_iteration(prof, records, (t1 - t0) / 1e9, start)
                else:
                    self._timing.warmup_iteration(start)
            else:
                self._timing.measured_iteration(prof, records, it, t0, t1, start)
            self._refresh_listeners()  # a new listener is greeted with the profiles and the fill mode
        except Exception as exc:
            self._fail(exc)

    def _add_sample(self, prof: ScheduleProfile, records: Sequence[tuple[int, int, int]],
                    iteration_s: float, device_lengths_ns: dict[int, int] | None = None) -> None:
        """One profiled iteration; ``device_lengths_ns`` (position -> ns) overrides the host stamps."""
        with self._profile_lock:
            if prof.cycle is None:  # with device timing, samples queued before the cycle was built
                self._add_sample_locked(prof, records, iteration_s, device_lengths_ns or {})

    def _add_sample_locked(self, prof: ScheduleProfile, records: Sequence[tuple[int, int, int]],
                           iteration_s: float, device_lengths_ns: dict[int, int]) -> None:
        names = self._names
        lb = self._lb_code
        stream = tuple(names[c] for c, _, _ in records if c != lb)
        has_lb = any(c == lb for c, _, _ in records)
        if stream != prof.stream:  # first sample, or the schedule changed shape: start over
            prof.stream = stream
            prof.candidates = candidate_slots(stream, loss_broadcast=has_lb, sends=self._timing.profiles_sends)
            prof.durations, prof.iter_s, prof.free, prof.allocated = [], [], {}, {}
            prof.records_len = len(records)
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
        say("%s: %s profiled: %d bubbles, %.1f%% of %.2f ms (%s; %s free in the largest)%s", self.where,
            prof.name, len(cycle.slots), 100 * cycle.bubble_ratio, 1e3 * cycle.iteration_s,
            _where(cycle), _mib(max((s.free_bytes for s in cycle.slots), default=0)),
            "; with NCCL a collective's or send's kernel holds a few SMs while it waits" if self.timing == "cuda"
            and any(s.instruction.startswith("Send") or is_collective(s.instruction) for s in cycle.slots) else "")
        new = set(self._refresh_listeners())  # greeted with every cycle, this one among them
        self._send_profile(cycle, [t for t in self._listeners.targets if t not in new])

    def lines_up(self, prof: ScheduleProfile, records: Sequence[tuple[int, int, int]]) -> bool:
        """Whether an iteration after profiling recorded its waits where the profile has them. One that did not (a
        collective more or fewer: an fp16 overflow skips the step's) is not followed, and counted."""
        if len(records) == prof.records_len:
            return True
        self._off_profile += 1
        return False

    @staticmethod
    def _follow_lengths(prof: ScheduleProfile, lengths_ns: Mapping[int, int], count: int) -> None:
        """After profiling: add this iteration's bubble lengths (position -> ns); every REPREDICT_EVERY iterations
        (``count``), predict from them. Naive co-location's iterations (the demo's A/B mode) are not the training's
        bubbles and are left out by the callers. Host timing: a few microseconds per iteration on the training's
        thread; device timing: on the event thread, with the lengths the device measured, and the new prediction
        reaches the iterations the host queues next (it runs up to an iteration ahead). A run of bubbles far past
        their prediction (``RecentLengths``) is predicted anew at once, not at the next multiple."""
        recent = prof.recent
        assert recent is not None
        shifted = False
        for pos in prof.signal_map:
            ns = lengths_ns.get(pos)
            if ns is not None:
                shifted |= recent.add(pos, ns)
        if shifted or count % REPREDICT_EVERY == 0:  # a bubble far past its prediction: the new one at once
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
            self._warn_once("profile", f"{self.where}: bubble profile not sent: {exc}")
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
        self._hot.signal_map = NO_SIGNALS
        self._hot.sampling = False

    def _stand_down(self) -> None:
        """Another live process on this node holds this rank's card: two trainings of one name in one namespace (or
        the same rank started twice). Their bubble signals would merge into one stream: only the first signals; this
        one trains on, unhooked in effect."""
        self._disable()
        self._warn_once("twin", f"bubbles hook: another live process on this node already signals the bubbles of "
                                f"{self.key} (a second training named {self.training} in namespace "
                                f"{self.key.namespace}, or this rank started twice): this one (pid {os.getpid()}) "
                                "does not; training continues. Give each training a name of its own "
                                f"(${paths.TRAINING_ENV})")

    def _fail(self, exc: BaseException) -> None:
        """The hook's own bug or environment problem: stop signalling, keep the training going."""
        self._disable()
        self._warn_once("fail", f"bubbles hook disabled on {self.where} after an internal error "
                                f"({exc!r}); training continues without bubble signals")


def stage_rank_of(engine: Any) -> tuple[int, int]:
    """This process's index among its stage's ranks, and how many the stage has, from DeepSpeed's process grid
    (``engine.grid``: data-parallel rank x model-parallel size + model-parallel rank); (0, 1) without a grid."""
    grid = getattr(engine, "grid", None)
    if grid is None:
        return 0, 1
    try:
        mp_size = int(grid.get_slice_parallel_world_size())
        mp_rank = int(grid.get_slice_parallel_rank())
        dp_size = int(grid.get_data_parallel_world_size())
        dp_rank = int(grid.get_data_parallel_rank())
    except AttributeError:
        return 0, 1
    return identity.stage_rank(dp_rank, mp_rank, mp_size), dp_size * mp_size


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
               ) -> Instrumentation | Unattached:
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
        else:
            if isinstance(memory_probe, StaticMemoryProbe) and not os.environ.get(FREE_BYTES_ENV, "").strip():
                # No GPU to ask: every bubble would offer 0 bytes, and the agent refuses every fill job for memory.
                log.warning("bubbles hook: no GPU to measure free memory and $%s is unset, so every bubble offers 0 "
                            "bytes and the node agent refuses every fill job; on CPU set %s to the bytes fill jobs "
                            "may use (e.g. %s=1073741824 for 1 GiB)", FREE_BYTES_ENV, FREE_BYTES_ENV, FREE_BYTES_ENV)
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
        namespace = paths.check_namespace(paths.default_namespace())
    except ValueError as exc:
        return _unattached(engine, f"${paths.NAMESPACE_ENV}: {exc}; it is the training Pod's namespace, from the "
                                   "downward API (metadata.namespace)")
    try:
        inst = Instrumentation(
            engine,
            training=training,
            namespace=namespace,
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
        say("bubbles hook: training %s %s (%d stages) signals in %s (%s timing)", inst.training, inst.where,
            inst.stages, inst.stage_dir, inst.timing)
    return inst


def _where(cycle: BubbleCycle) -> str:
    """Where a cycle's bubble time is, by kind of wait: ``receives 4.1%, sends 25.3%, ...`` of the iteration."""
    families: dict[str, float] = {}
    for slot in cycle.slots:
        name = slot.instruction
        family = ("receives" if name.startswith("Recv") else "sends" if name.startswith("Send")
                  else "loss broadcast" if name == LOSS_BROADCAST else name if is_collective(name) else "other")
        families[family] = families.get(family, 0.0) + slot.duration_s
    if not families or cycle.iteration_s <= 0:
        return "no waits"
    return ", ".join(f"{k} {100 * v / cycle.iteration_s:.1f}%" for k, v in families.items())


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class Unattached:
    """What ``instrument`` returns when the hook cannot attach for a reason outside the training's code (its
    environment, the DeepSpeed version): nothing of the engine is touched, nothing is signalled, ``stats`` says
    ``disabled`` and ``reason`` says why. The training runs exactly as without the hook. It answers what an
    ``Instrumentation`` answers."""

    cycle: BubbleCycle | None = None  # never profiled

    def __init__(self, engine: Any, reason: str) -> None:
        self.engine = engine
        self.reason = reason
        self.training = ""
        self.stage = -1
        self.cycles: dict[str, BubbleCycle] = {}
        self.fill_mode: wire.FillMode | None = None
        self.iteration_times_s: deque[float] = deque(maxlen=1)
        self.device_iteration_times_s: deque[float] = deque(maxlen=1)
        self.timing = "off"
        self.event_wait: str | None = None
        self.switch_interval_s: float | None = None

    @property
    def stats(self) -> dict[str, Any]:
        return {"disabled": True, "reason": self.reason, "signals_sent": 0, "bubbles_signalled": 0, "iterations": 0,
                "timing": self.timing}

    def set_fill_mode(self, mode: wire.FillMode) -> None:
        """Nothing to tell: kept, as an attached hook keeps it."""
        self.fill_mode = wire.FillMode(mode)

    def trace_events(self) -> list[tuple[int, str, int, int, int]]:
        return []

    def detach(self) -> None:
        """Nothing to undo."""


def _unattached(engine: Any, reason: str) -> Unattached:
    log.error("bubbles hook not attached: %s. The training runs without bubble harvesting", reason)
    return Unattached(engine, reason)


def _deepspeed_version() -> str:
    try:
        import deepspeed

        return f"version {deepspeed.__version__}"
    except Exception:
        return "version unknown"
