"""What fill jobs import: the two programming interfaces and the runtime that gates them by bubbles.

Write a fill job as an ``IterativeFillJob`` (preferred, and the only safe choice on a GPU: the runtime
starts a step only when it can finish inside the bubble, FreeRide's program-directed limit, and waits
for the step's queued GPU work before counting it done) or an ``ImperativeFillJob`` (any code; the agent
pauses the whole process with SIGSTOP at bubble end and resumes it with SIGCONT at bubble start, so
kernels already queued on a GPU still overlap the training).

The agent runs a fill job as ``python -m bubbles.sdk --entry module:Class [--args JSON]`` with its
end of a socketpair in ``$BUBBLES_CONTROL_FD`` (protocol: ``bubbles.core.control``). While armed in
harvest mode the runtime binds ``fill-<job>.sock`` in the stage directory, so the training's hook
sends each BUBBLE_START/BUBBLE_END straight to it (one hop), and unlinks it when disarmed.

Depends only on the pure core; torch is imported lazily (and only if installed) to pin the fill
process to one thread, to cap CUDA memory and to wait for queued GPU work. Those CUDA calls go through
a ``torch.cuda``-like object that tests replace (``apply_process_limits(cuda=...)``, ``DeviceSync``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubbles.core import control, paths, wire
from bubbles.core.api import DEFAULT_TAIL_RISK, MAX_TAIL_RISK, FillMode
from bubbles.core.control import cuda_device_index
from bubbles.core.cycle import robust_stats
from bubbles.training.gating import StartPredictor, StepGates, TailRisk
from bubbles.training.probes import gpu_uuid

INIT_PROFILE_STEPS = 10  # steps timed during init when the spec gives no step time
INIT_PROFILE_WARMUP = 2  # of those, the first pay one-time costs (allocations, lazy initialization)
PROFILE_MARGIN = 1.2  # step time used for gating = p90 of the samples * this margin
# Bubbles with no step run, before any step ran, that the profile's median (times the margin) would have fitted: then
# the gates fall back to the medians, once (see FillRuntime._starving).
STARVED_BUBBLES = 32
_NAIVE_FLUSH_STEPS = 64  # naive mode batches step reports: they are only for accounting
_NAIVE_FLUSH_NS = 20_000_000


@dataclass(frozen=True)
class StepResult:
    """What one step did: its floating-point operations and the samples it processed."""

    flops: float = 0.0
    samples: int = 0


class IterativeFillJob:
    """A fill job made of short steps; the runtime runs ``step()`` only where it fits in a bubble.

    Life cycle: ``create()`` when the process starts (data and model in host memory), ``init()``
    once the agent says so (move to the accelerator), then ``step()`` repeatedly inside bubbles
    until ``is_finished()``. ``checkpoint()``/``restore()`` are optional.

    Steps of several sizes (PipeFill's per-bubble choice of fill-job configuration): a job that sets
    ``step_sizes`` (after ``init()`` at the latest) to the sizes its step can take, in its own units (samples,
    tokens), is called as ``step(size)``. The runtime times every size during initialization and, in each
    bubble, runs the largest size that fits what is left of it: big steps where a bubble is long, small ones
    in short bubbles and in a long one's tail. Without ``step_sizes`` the runtime calls ``step()``.
    """

    step_sizes: Sequence[int] = ()

    def create(self) -> None:
        """Load the context into host memory. Leave the GPU alone here: on a ``cuda`` executor the runtime fails a
        job whose ``create()`` made a CUDA context (it has no device or memory cap yet); do that in ``init()``."""

    def init(self) -> None:
        """Move the context to the accelerator."""

    def step(self) -> StepResult | float | None:
        """Run one step; return a StepResult, or a float (its FLOPs), or None. With ``step_sizes``, the runtime
        calls ``step(size)`` instead, ``size`` one of them."""
        raise NotImplementedError

    def is_finished(self) -> bool:
        return False

    def checkpoint(self) -> bytes | None:
        return None

    def restore(self, state: bytes) -> None:
        """Restore from ``checkpoint()``'s bytes."""


class ImperativeFillJob:
    """A fill job that is arbitrary code; the agent pauses it from outside (SIGSTOP/SIGCONT).

    The agent sends SIGCONT at each BUBBLE_START and SIGSTOP at each BUBBLE_END (harvest mode),
    leaves it running in naive mode and stopped in off mode. Nothing in ``run()`` needs to cooperate,
    which is why it costs the training more than an iterative job: the process is stopped only after
    the bubble has ended.

    On a GPU, SIGSTOP does not stop the GPU: it stops the host thread that launches kernels, and every
    kernel that thread already queued (a CUDA launch returns long before the kernel finishes; the queue
    can hold many milliseconds of work) runs on after the bubble has ended, competing with the training.
    Nothing outside the process can drain or cancel that queue. Use an ``IterativeFillJob`` on GPUs: its
    runtime starts a step only if it fits the bubble and waits for the step's GPU work inside the step.
    """

    def create(self) -> None:
        """Load the context into host memory (runs before the first SIGSTOP). Leave the GPU alone here, as for
        ``IterativeFillJob.create``."""

    def init(self) -> None:
        """Move the context to the accelerator."""

    def run(self) -> None:
        raise NotImplementedError


def load_entry(entry: str) -> type:
    """Import ``module:Class``; raise ValueError saying what is wrong."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"entry {entry!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"entry {entry!r}: cannot import {module_name!r}: {exc}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"entry {entry!r}: {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, type) or not issubclass(obj, IterativeFillJob | ImperativeFillJob):
        raise ValueError(f"entry {entry!r} is not a subclass of IterativeFillJob or ImperativeFillJob")
    return obj


def assigned_device() -> str:
    """The device the agent gave this fill process: ``"cpu"`` or ``"cuda:N"`` (``$BUBBLES_DEVICE``).

    Fill jobs move their model here in ``init()``. A CPU executor's device is ``"cpu:K"`` (core K stands in
    for a stage's accelerator); torch only knows ``"cpu"``, so the core index is dropped.
    """
    device = os.environ.get(control.DEVICE_ENV, "cpu").strip() or "cpu"
    return "cpu" if device.startswith("cpu") else device




def _cuda_module(cuda: Any, device: str, index: int) -> Any:
    """``cuda`` if given, else the real ``torch.cuda``, checked to work and to have device ``index``:
    a RuntimeError saying what to do otherwise."""
    if cuda is None:
        try:
            import torch
        except ImportError:
            raise RuntimeError(f"device {device!r} needs torch with CUDA in the fill process; "
                               "install it, or run the job on a CPU executor") from None
        cuda = torch.cuda
    if not cuda.is_available():
        raise RuntimeError(f"device {device!r} was assigned, but CUDA is not available in this fill process "
                           "(a CPU build of torch, or no GPU visible: check CUDA_VISIBLE_DEVICES)")
    count = int(cuda.device_count())
    if index >= count:
        raise RuntimeError(f"device {device!r} does not exist: this fill process sees {count} CUDA device(s) "
                           "(check CUDA_VISIBLE_DEVICES and the agent's --devices)")
    return cuda


class DeviceSync:
    """Waits until the fill job's queued device work has finished. The base is for CPUs: a step's work
    is done when ``step()`` returns, so there is nothing to wait for."""

    def synchronize(self) -> None:
        """Return once every operation this process queued on the device has finished."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


FILL_WAITS = ("block", "spin")
DEFAULT_FILL_WAIT = "block"


class CudaDeviceSync(DeviceSync):
    """Waits for the fill process's queued work on CUDA device ``index``: a kernel launch returns to the host long
    before the kernel has run, so without this a step that "returned" may keep the GPU busy after its bubble has
    ended.

    ``wait="block"`` (the default): the thread sleeps in the driver on an event recorded with
    ``cudaEventBlockingSync`` behind the step's work on the device's current stream, then
    ``torch.cuda.synchronize(index)`` catches work the job queued on other streams (usually none: it returns at
    once). ``wait="spin"``: only ``torch.cuda.synchronize(index)``, which under the context's default schedule
    polls on a host core for the whole wait, taking CPU from the training's host threads on the same node, for a
    wake-up some tens of microseconds sooner."""

    def __init__(self, index: int, cuda: Any = None, wait: str = DEFAULT_FILL_WAIT) -> None:
        if wait not in FILL_WAITS:
            raise ValueError(f"wait must be one of {', '.join(FILL_WAITS)}, got {wait!r}")
        self.index = index
        self.wait = wait
        self._cuda = _cuda_module(cuda, f"cuda:{index}", index)
        self._event: Any = None  # made at the first wait, after init has set the device

    def synchronize(self) -> None:
        cuda = self._cuda
        if self.wait == "block":
            if self._event is None:
                self._event = cuda.Event(blocking=True)
            self._event.record(cuda.current_stream(self.index))
            self._event.synchronize()
        cuda.synchronize(self.index)

    def __repr__(self) -> str:
        return f"CudaDeviceSync({self.index}, wait={self.wait!r})"


def device_sync_for(device: str, cuda: Any = None, wait: str = DEFAULT_FILL_WAIT) -> DeviceSync:
    """The ``DeviceSync`` for an agent device string: a no-op for CPUs, ``CudaDeviceSync`` for ``cuda:N``."""
    index = cuda_device_index(device)
    return DeviceSync() if index is None else CudaDeviceSync(index, cuda, wait)


def fill_wait(text: str) -> str:
    """``$BUBBLES_FILL_WAIT``: how the fill process waits for a step's GPU work, ``block`` (empty means it) or
    ``spin``."""
    value = text.strip() or DEFAULT_FILL_WAIT
    if value not in FILL_WAITS:
        raise ValueError(f"${control.FILL_WAIT_ENV}={text!r}: give 'block' (the default: the process sleeps while its "
                         "step's GPU work drains) or 'spin' (a host core polls the GPU, for a wake-up tens of "
                         "microseconds sooner)")
    return value


def apply_process_limits(device: str, memory_bytes: int | None, cuda: Any = None) -> float | None:
    """One thread per fill process; on ``cuda:N`` make N the current device and cap the CUDA caching allocator at
    the agent's memory limit.

    Returns the fraction of the device's memory given to ``set_per_process_memory_fraction``, or None
    when nothing was capped: a CPU device (host memory has no per-process cap short of cgroups, which the
    agent does not manage on one machine, and the OS already isolates processes' memory) or no limit
    (``memory_bytes`` 0 or None). The fraction is of the memory the process sees (``mem_get_info``'s total: under
    MPS with a pinned memory limit, that limit), the total torch applies it to. A limit above it caps at the whole
    of it (1.0) with a warning on stderr. The cap covers the caching allocator only, not the CUDA context (about
    0.5 GiB); hard limits are the isolation's job (MPS, see docs/gpu.md). ``cuda`` replaces ``torch.cuda`` in tests.
    """
    index = cuda_device_index(device)
    if memory_bytes is not None and (not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool)
                                     or memory_bytes < 0):
        raise ValueError(f"memory limit must be an int number of bytes >= 0, got {memory_bytes!r}; "
                         f"check ${control.MEMORY_ENV} or the fill job's spec.memory")
    with contextlib.suppress(ImportError):
        import torch

        # A fill job shares its core with a pipeline stage: more threads would only contend for it.
        torch.set_num_threads(1)
    if index is None:
        return None
    cuda = _cuda_module(cuda, device, index)
    # The job's own tensors name their device, but anything that uses the current one (a default-device tensor, a
    # library's handles, the context torch creates on first use) would otherwise land on device 0: the training's.
    cuda.set_device(index)
    if not memory_bytes:
        return None
    # torch applies the fraction to the total the process sees (cudaMemGetInfo), which under an MPS pinned memory
    # limit is that limit, not the device's physical memory: compute it against the same total.
    total = int(cuda.mem_get_info(index)[1])
    fraction = memory_bytes / total
    if fraction > 1.0:
        print(f"bubbles.sdk: memory limit {memory_bytes} bytes exceeds {device}'s {total} bytes; capping at "
              "the whole device (fraction 1.0). Lower the fill job's spec.memory to what it needs.",
              file=sys.stderr)
        fraction = 1.0
    cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def cuda_contexts(cuda: Any = None) -> frozenset[int]:
    """The CUDA devices on which this process holds a context, asked without making one (the driver's primary
    context state, ``torch._C._cuda_hasPrimaryContext``). Empty when torch never initialised CUDA, and when torch
    cannot say (a build without that call): the check it serves then lets the job run. ``torch.cuda.is_initialized``
    alone would not do: querying a device's properties (as attaching to the agent does, for the GPU's UUID)
    initialises torch's CUDA state but makes no context. ``cuda`` replaces torch in tests: an object with
    ``is_initialized()``, ``device_count()`` and ``has_primary_context(index)``."""
    if cuda is None:
        torch = sys.modules.get("torch")  # never imported: nothing reached CUDA through torch
        ask = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
        if ask is None:
            return frozenset()
        cuda = types.SimpleNamespace(is_initialized=torch.cuda.is_initialized,  # type: ignore[union-attr]
                                     device_count=torch.cuda.device_count,  # type: ignore[union-attr]
                                     has_primary_context=ask)
    if not cuda.is_initialized():
        return frozenset()
    try:
        return frozenset(i for i in range(int(cuda.device_count())) if cuda.has_primary_context(i))
    except Exception:  # the driver would not say: as if none, so that a job is never refused on a failed question
        return frozenset()


def check_create_left_cuda_alone(device: str, before: frozenset[int], after: frozenset[int]) -> None:
    """RuntimeError if the job's ``create()`` (or ``restore()``) made a CUDA context on a ``cuda:N`` executor:
    ``after`` holds a device ``before`` did not (``cuda_contexts`` either side of them).

    ``create()`` runs before the agent's ``init``, so before the process is given its device (``set_device``) and its
    memory cap: a context made there lands on the current device, device 0 (on a machine whose agent runs several
    GPUs, that can be another stage's training GPU), and its memory (about 0.5 GiB, plus any tensors) was never
    checked against the bubble's free memory. Failing the job says what to move where; running on would risk the
    training's memory.
    """
    if cuda_device_index(device) is None:
        return
    made = sorted(after - before)
    if made:
        raise RuntimeError(f"create() made a CUDA context (on device {', '.join(map(str, made))}) before the agent "
                           f"gave this job its device ({device}) and its memory cap: move whatever touches the GPU "
                           "(.cuda(), .to('cuda'), torch.load of GPU tensors without map_location='cpu') from create() "
                           "or restore() into init(), which runs once the device is set")


def check_step_sizes(sizes: Any) -> tuple[int, ...]:
    """A job's ``step_sizes``, smallest first; ValueError saying what they must be."""
    try:
        values = list(sizes)
    except TypeError:
        values = None
    if values is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"step_sizes must be a list of positive integers (the sizes step(size) accepts), got "
                         f"{sizes!r}; leave it empty for a job whose step() takes no size")
    if len(set(values)) != len(values):
        raise ValueError(f"step_sizes must not repeat a size, got {values}")
    return tuple(sorted(values))


class _Bubble:
    __slots__ = ("ended", "predicted_end_ns", "seq", "slot", "start_ns")

    def __init__(self, seq: int, start_ns: int, predicted_end_ns: int, slot: int = 0) -> None:
        self.seq = seq
        self.slot = slot
        self.start_ns = start_ns
        self.predicted_end_ns = predicted_end_ns
        self.ended = False


class _Stop(Exception):
    pass


class FillRuntime:
    """Runs one iterative fill job in this process under the agent's commands (see module doc)."""

    def __init__(self, job: IterativeFillJob, control_sock: socket.socket, *, name: str,
                 socket_path: str | None, step_s: float | None, max_steps: int | None = None,
                 device: str = "cpu", memory_bytes: int | None = None,
                 device_sync: DeviceSync | None = None) -> None:
        self.job = job
        self.ctrl = control_sock
        self.name = name
        self.socket_path = socket_path
        self.step_s = step_s
        self.given_step_s = step_s  # the spec's step time, if any: a floor for the gates
        self.max_steps = max_steps
        self.device = device
        self.memory_bytes = memory_bytes
        cuda_device_index(device)  # a bad device string fails here, before the agent is told CREATED
        # Every step waits for its device work before it counts as done (see _run_step). Unless injected,
        # it is made at init, where the job first touches its accelerator and a failure is reported.
        self.device_sync: DeviceSync | None = device_sync
        self.fill_wait = DEFAULT_FILL_WAIT  # how a CUDA device_sync waits ($BUBBLES_FILL_WAIT)
        self.mode: FillMode = FillMode.OFF  # OFF: disarmed; armed in HARVEST or NAIVE
        # Sized steps (the job's step_sizes, read at init): (size, gating seconds), smallest first; the gate
        # of the smallest is step_s, the step time the agent plans with. Empty: step() takes no size.
        self.sized: list[tuple[int, float]] = []
        self.gates: StepGates | None = None  # from the profile (or the given step time), then from bubbles
        self._reported_s: float | None = None  # the step time the agent was last told (``profile``)
        self.share = 1.0
        self.steps = 0
        self._lines = control.LineBuffer()
        self._out: list[bytes] = []
        self._sig: socket.socket | None = None
        self._bound_path: str | None = None
        self._bubble: _Bubble | None = None
        self._initialized = False
        # Busy-poll window either side of a predicted bubble start ($BUBBLES_SPIN_US): a wake-up from a blocking
        # poll costs tens of microseconds at the tail; spinning costs a CPU core for the window. Off by default:
        # worth it only where the fill process has a core of its own (a GPU node), never where it shares the
        # training's (the CPU demo).
        self.spin_ns = 0
        self.predictor = StartPredictor()
        self.spin_caught = 0  # bubble starts read while busy-polling, not woken from the blocking poll
        # Steps past a bubble's predicted end, at a risk of outliving it of at most $BUBBLES_TAIL_RISK (see
        # bubbles.training.gating.TailRisk); fed every bubble's length and the END signals' lag.
        self.tail = TailRisk(DEFAULT_TAIL_RISK)
        self.tail_steps = 0
        # This process's own risk ($BUBBLES_TAIL_RISK) and the training's limit (the agent's ``limits`` command: a
        # PipelineTraining's spec.tailRisk, the agent's --tail-risk; None until one comes): the lower one applies.
        self.own_tail_risk = DEFAULT_TAIL_RISK
        self.tail_risk_limit: float | None = None
        self.unknown_fields: set[str] = set()  # "type.field" the agent sent that this SDK does not know
        self._started: _Bubble | None = None  # the last START read, until its END (``_bubble`` is dropped after a pass)
        # The profile's medians (with the margin), by size, and the bubbles before the first step that ran none though
        # they would have fitted them (``_starving``); the fallback is used at most once.
        self._fallback: list[tuple[int | None, float]] = []
        self._starved = 0
        self.relaxed = False

    # -- channel ---------------------------------------------------------------------------------
    def _emit(self, type_: str, **fields: Any) -> None:
        self._out.append(control.encode(type_, **fields))

    def _flush(self) -> None:
        if self._out:
            data = b"".join(self._out)
            self._out.clear()
            self.ctrl.setblocking(True)
            try:
                self.ctrl.sendall(data)
            except OSError:
                raise _Stop() from None  # the agent is gone
            finally:
                self.ctrl.setblocking(False)

    def _poll_control(self) -> None:
        """Handle every command that has arrived (non-blocking)."""
        while True:
            try:
                data = self.ctrl.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                raise _Stop() from None
            if not data:
                raise _Stop()  # the agent closed the channel
            for line in self._lines.feed(data):
                try:
                    cmd = control.parse_command(line)
                except control.ControlError as exc:
                    self._emit("error", message=f"rejected command: {exc}")
                    self._flush()
                    continue
                if cmd.unknown:
                    self._note_unknown(cmd)
                self._handle(cmd)

    def _note_unknown(self, cmd: control.ControlMessage) -> None:
        """Say once per field, on stderr (the fill Pod's log), that the agent sent a field this SDK ignores."""
        new = {f"{cmd.type}.{name}" for name in cmd.unknown} - self.unknown_fields
        if new:
            self.unknown_fields |= new
            print(f"bubbles.sdk: ignored field(s) {', '.join(sorted(new))} from the agent, which is newer than this "
                  "SDK: upgrade the fill job's image to use them", file=sys.stderr, flush=True)

    def _handle(self, cmd: control.ControlMessage) -> None:
        if cmd.type == "stop":
            raise _Stop()
        if cmd.type == "init":
            if not self._initialized:
                apply_process_limits(self.device, self.memory_bytes)
                if self.device_sync is None:
                    self.device_sync = device_sync_for(self.device, wait=self.fill_wait)
                self.job.init()
                self._initialized = True
                sizes = check_step_sizes(self.job.step_sizes)
                if sizes:
                    self._profile_sizes(sizes)
                elif self.step_s is None:
                    timed = self._profile_step_time()
                    if timed is not None:
                        self.step_s = timed[0]
                        self._fallback = [(None, timed[1])]
                given = self.given_step_s
                if self.sized:
                    self.gates = StepGates(self.sized, floors={self.sized[-1][0]: given} if given else None)
                elif self.step_s is not None:
                    self.gates = StepGates([(None, self.step_s)], floors={None: given} if given else None)
            self._emit("state", state="PAUSED")
            if self.step_s is not None:
                self._report_step_time(self.step_s, self.sized)
            self._flush()
            self._check_finished()  # a job that finished while it was being profiled
        elif cmd.type == "arm":
            if not self._initialized:
                self._emit("error", message="arm before init ignored")
                self._flush()
                return
            self.share = float(cmd.get("share", self.share))
            if cmd.get("socket"):
                self.socket_path = cmd["socket"]
            self._disarm()
            self.mode = control.parse_mode(cmd["mode"], "arm.mode")
            if self.mode is FillMode.HARVEST:
                self._bind()
            else:
                self._emit("state", state="RUNNING")
                self._flush()
        elif cmd.type == "disarm":
            was_naive = self.mode is FillMode.NAIVE
            self._disarm()
            if was_naive:
                self._emit("state", state="PAUSED")
                self._flush()
        elif cmd.type == "share":
            self.share = float(cmd["share"])
        elif cmd.type == "limits" and "tail_risk" in cmd.fields:
            self.tail_risk_limit = float(cmd["tail_risk"])
            self.tail.max_risk = self.tail_risk()

    def tail_risk(self) -> float:
        """The risk the tail takes: this process's own, capped by the training's limit when the agent sent one."""
        if self.tail_risk_limit is None:
            return self.own_tail_risk
        return min(self.own_tail_risk, self.tail_risk_limit)

    def _report_step_time(self, step_s: float, sized: Sequence[tuple[int | None, float]]) -> None:
        self._reported_s = step_s
        self._emit("profile", step_s=step_s, **({"sizes": [[n, t] for n, t in sized]} if self.sized else {}))

    def _bind(self) -> None:
        if not self.socket_path:
            self._emit("error", message="armed in harvest mode without a socket path")
            self._flush()
            return
        path = self.socket_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(path)
        s.setblocking(False)
        self._sig = s
        self._bound_path = path
        self._bubble = None

    def _disarm(self) -> None:
        if self._sig is not None:
            self._sig.close()
            self._sig = None
            if self._bound_path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._bound_path)
            self._bound_path = None
        self.mode = FillMode.OFF
        self._bubble = None

    def _drain_signals(self, fresh: bool = False) -> None:
        """Read every pending bubble signal; the newest START opens a bubble, its END closes it. ``fresh``: the
        socket was just found readable (not read after a step), so an END's lag is the signal's own."""
        sig = self._sig
        while sig is not None:
            try:
                data = sig.recv(wire.MAX_DATAGRAM_BYTES + 1)
            except BlockingIOError:
                return
            # The wake-up path: no message object, no exception. Anything else on this socket (a profile, an
            # iteration, garbage) is not the runtime's business: decode_signal gives None for it.
            fast = wire.decode_signal(data)
            if fast is None:
                continue
            kind, slot, seq, t1, t2 = fast
            if kind == wire.Kind.BUBBLE_START:
                self._bubble = self._started = _Bubble(seq, t1, t2, slot)
                if self.spin_ns:  # only busy-polling needs the prediction: nothing more on the default path
                    self.predictor.started(slot, t1)
                continue
            started = self._started
            if started is not None and started.seq == seq:
                self._started = None
                self.tail.ended(started.slot, t1 - started.start_ns)
                if fresh:
                    self.tail.end_lag(time.monotonic_ns() - t1)
            if self._bubble is not None and self._bubble.seq == seq:
                self._bubble.ended = True

    def _open_bubble(self) -> bool:
        return self._bubble is not None and not self._bubble.ended

    def _spin_for_start(self) -> bool:
        """Busy-poll the signal socket from ``spin_ns`` before the predicted next start to ``spin_ns`` after it;
        True once a bubble is open. Returns at once (False) when no start is predicted within the window."""
        sig = self._sig
        if not self.spin_ns or sig is None:
            return False
        now = time.monotonic_ns()
        nxt = self.predictor.next_start(now, self.spin_ns)
        if nxt is None or nxt - self.spin_ns > now:
            return False
        until = nxt + self.spin_ns
        while time.monotonic_ns() < until:
            self._drain_signals(fresh=True)
            if self._open_bubble():
                self.spin_caught += 1
                return True
        return False

    def _poll_timeout_ms(self) -> int:
        """How long the blocking poll may sleep: until the spin window of the predicted next start, or forever."""
        if not self.spin_ns or self._sig is None:
            return -1
        now = time.monotonic_ns()
        nxt = self.predictor.next_start(now, self.spin_ns)
        if nxt is None:
            return -1
        return max(0, (nxt - self.spin_ns - now) // 1_000_000)

    # -- stepping --------------------------------------------------------------------------------
    def _run_step(self, bubble_seq: int, signal_ns: int, announce: bool, start: int | None = None,
                  size: int | None = None, tail: bool = False) -> float:
        """Run one step and wait for its device work, report it; return its duration in seconds.

        ``start`` is when the gate decided to run it (reported as the step's start, so the record
        shows exactly the program-directed check: ``start + step_s <= usable end``). The reported end
        is after the device synchronize: on a GPU that is when the fill job stops occupying it, so the
        agent's overrun (step end - bubble end) measures how long fill work outlived the bubble.
        ``sync_ns`` is the part of the step spent waiting for queued device work. ``size``: the step's size
        for a job with ``step_sizes`` (None: ``step()`` without one). ``tail``: not allowed by the bubble's predicted
        end on ``TailRisk``'s word (the record says ``gate: tail``).
        """
        if start is None:
            start = time.monotonic_ns()
        if announce:
            self._emit("step_begin", t_ns=start, bubble_seq=bubble_seq)
            self._flush()
        result = self.job.step() if size is None else self.job.step(size)  # type: ignore[call-arg]
        sync_start = time.monotonic_ns()
        self._synchronize()
        end = time.monotonic_ns()
        if isinstance(result, StepResult):
            flops, samples = float(result.flops), int(result.samples)
        elif isinstance(result, int | float) and not isinstance(result, bool):
            flops, samples = float(result), 0
        else:
            flops, samples = 0.0, 0
        self.steps += 1
        self._emit("step", start_ns=start, end_ns=end, flops=flops, samples=samples,
                   bubble_seq=bubble_seq, signal_ns=signal_ns,
                   mode=(FillMode.HARVEST if self.mode is FillMode.OFF else self.mode).label,
                   sync_ns=end - sync_start, **({} if size is None else {"size": size}),
                   **({"gate": "tail"} if tail else {}))
        return (end - start) / 1e9

    def _synchronize(self) -> None:
        if self.device_sync is None:  # steps run only after init, which sets it
            raise RuntimeError("a step ran before init(): no device to synchronize")
        self.device_sync.synchronize()

    def _profile_step_time(self, size: int | None = None) -> tuple[float, float] | None:
        """FreeRide's side-task profiler: time a few steps during initialization, before the job is offered
        any bubble, so the program-directed limit holds from the first bubble on. These steps run once,
        outside bubbles, like process start-up and ``init()``; they are not counted as fill work. Each
        timed step includes waiting for its device work, as in ``_run_step``: on a GPU the host-side
        time of a step is only its launch cost, and gating on it would start steps that outlive bubbles.

        Returns the gate (the 90th percentile, with a margin) and the fallback (the median, with the margin): see
        ``_starving``."""
        samples = []
        for _ in range(INIT_PROFILE_STEPS):
            if self.job.is_finished():
                break
            t0 = time.monotonic_ns()
            if size is None:
                self.job.step()
            else:
                self.job.step(size)  # type: ignore[call-arg]
            self._synchronize()
            samples.append((time.monotonic_ns() - t0) / 1e9)
        samples = samples[INIT_PROFILE_WARMUP:]
        if not samples:
            return None
        median, _p10, p90 = robust_stats(samples)
        return p90 * PROFILE_MARGIN, median * PROFILE_MARGIN

    def _profile_sizes(self, sizes: tuple[int, ...]) -> None:
        """Time every step size. A gate never shrinks with the size (a larger step is not gated as shorter
        than a smaller one: timing noise); a given step time is the largest size's floor (what the job's
        author said a full step takes is respected where it is more than was measured)."""
        sized: list[tuple[int, float]] = []
        fallback: list[tuple[int | None, float]] = []
        for size in sizes:
            timed = self._profile_step_time(size)
            if timed is None:  # finished while being profiled
                break
            t, median = timed
            if size == sizes[-1] and self.step_s is not None:
                t, median = max(t, self.step_s), max(median, self.step_s)
            sized.append((size, max(t, sized[-1][1]) if sized else t))
            fallback.append((size, max(median, fallback[-1][1]) if fallback else median))
        self.sized = sized
        self._fallback = fallback
        self.step_s = sized[0][1] if sized else self.step_s

    def _check_finished(self) -> None:
        if self.job.is_finished() or (self.max_steps is not None and self.steps >= self.max_steps):
            self._emit("finished")
            self._flush()
            raise _Stop()

    def _harvest_bubble(self) -> None:
        """Run steps inside the open bubble while they fit (program-directed limit) and it has not ended."""
        b = self._bubble
        assert b is not None
        gates = self.gates
        if gates is None:  # without a step time (none given, none measured) nothing is run
            self._bubble = None
            return
        usable_end = b.start_ns + int(self.share * (b.predicted_end_ns - b.start_ns))
        # The tail is used only at the full share: the guard's cut turns it off. A share within rounding of 1 is the
        # full share (an agent before the guard rounded its steps sent 0.9999999999999999 after one cut).
        tail_ok = self.share >= 1.0 - 1e-6
        tail_since: int | None = None  # when this bubble entered its tail: TailRisk's bound is per bubble
        ran = 0
        while self.mode is FillMode.HARVEST and self._bubble is b and not b.ended:
            now = time.monotonic_ns()
            fits = gates.fitting(usable_end - now, ran == 0)  # the program-directed limit
            tail = False
            if not fits and tail_ok:
                # Past what the prediction allows, while the slowdown guard has not cut the share: steps while the
                # chance that this bubble, given how long it has lasted, ends during one is small enough.
                if tail_since is None:
                    tail_since = now - b.start_ns
                fits = self.tail.fitting(b.slot, now - b.start_ns, gates, ran == 0, since_ns=tail_since)
                tail = bool(fits)
            if not fits:
                break
            size = fits[-1]
            if ran == 0:
                self._emit("state", state="RUNNING")
            # Only a bubble's first step is announced (flushed with RUNNING): the agent's watchdog needs to
            # know a step of this bubble began; later step records travel together at the pass's end, so
            # the agent is not woken once per step while the training may need the core back.
            took_s = self._run_step(b.seq, b.start_ns, announce=ran == 0, start=now, size=size, tail=tail)
            self.tail_steps += tail
            gates.observe(size, ran == 0, int(took_s * 1e9))
            ran += 1
            self._check_finished()
            self._drain_signals()
            self._poll_control()
        if not ran:
            self._starving(b, gates)
        else:
            self._emit("state", state="PAUSED")
            first = gates.first_steps_s()
            # The agent plans, and accounts bubbles too short to use, with the smallest step's time: tell it
            # when what a bubble's first step takes has moved away from what it was told (by more than 20%).
            if self._reported_s and abs(first[0][1] - self._reported_s) > 0.2 * self._reported_s:
                self._report_step_time(first[0][1], first)
            self._flush()
        if self._bubble is b:
            self._bubble = None  # one pass per bubble: a bubble too short now stays too short

    def _starving(self, b: _Bubble, gates: StepGates) -> None:
        """A bubble ran no step. The gates come from init's profile until steps have run in bubbles, and init's steps
        compete with the training's compute: a few slowed ones can lift the profile's 90th percentile past every
        bubble, and a gate no bubble fits lets no step run, so it never learns (the cluster tier's example job:
        14.5 ms for a step whose author says 1.5 ms, ten minutes at 0 steps, 2026-11-25). After STARVED_BUBBLES such
        bubbles, before any step ran, that the profile's median would have fitted, the gates fall back to the medians,
        once: at worst some of the next steps outlive their bubbles, until the steps' own times take over the gates."""
        if self.relaxed or not self._fallback or self.steps:
            return
        if not any(t * 1e9 <= b.predicted_end_ns - b.start_ns for _, t in self._fallback):
            return  # the median would not have fitted either: the bubbles are too short for this job
        self._starved += 1
        if self._starved < STARVED_BUBBLES:
            return
        self.relaxed = True
        gates.relax(self._fallback)
        first = gates.first_steps_s()
        print(f"bubbles.sdk: no step fitted {STARVED_BUBBLES} bubbles with the step time profiled at init "
              f"({first[0][1] * 1e3:.2f} ms now, from its median; it was the 90th percentile): init's "
              "steps ran beside the training's compute", file=sys.stderr, flush=True)
        self._report_step_time(first[0][1], first)
        self._flush()  # now: the agent plans with it, and the next step may be bubbles away

    def _naive_loop(self) -> None:
        """Steps back to back; each waits for its device work too (``_run_step``), so naive co-location
        does the same work per step as harvesting and the two compare fairly."""
        last_flush = time.monotonic_ns()
        largest = self.sized[-1][0] if self.sized else None
        while self.mode is FillMode.NAIVE:
            self._run_step(-1, 0, announce=False, size=largest)
            self._check_finished()
            now = time.monotonic_ns()
            if len(self._out) >= _NAIVE_FLUSH_STEPS or now - last_flush > _NAIVE_FLUSH_NS:
                self._flush()
                last_flush = now
            self._poll_control()
        self._flush()

    def serve(self) -> None:
        """Serve commands until stopped; return normally when the agent says stop or goes away."""
        self.ctrl.setblocking(False)
        # A poll object, not selectors: a bubble's start waits on this call, and the plain one costs less Python.
        poller = select.poll()
        ctrl_fd = self.ctrl.fileno()
        poller.register(ctrl_fd, select.POLLIN)
        registered: socket.socket | None = None
        registered_fd = -1
        try:
            while True:
                if self.mode is FillMode.NAIVE:
                    self._naive_loop()
                    continue
                if self._sig is not registered:
                    if registered is not None:
                        with contextlib.suppress(KeyError):
                            poller.unregister(registered_fd)  # by number: _disarm may have closed the socket
                    if self._sig is not None:
                        registered_fd = self._sig.fileno()
                        poller.register(registered_fd, select.POLLIN)
                    registered = self._sig
                if self.mode is FillMode.HARVEST and self._open_bubble():
                    # A bubble that opened while the last pass ran (its final step outlived its own bubble
                    # and the next one's START was read with the END): its signal is already drained, so
                    # polling now would sleep through it to its END.
                    self._harvest_bubble()
                    continue
                if self.mode is FillMode.HARVEST and self._spin_for_start():
                    self._harvest_bubble()
                    continue
                ready = poller.poll(self._poll_timeout_ms())
                # Most wake-ups are bubble signals: poll the control channel only when it has data.
                if any(fd == ctrl_fd for fd, _ in ready):
                    self._poll_control()
                self._drain_signals(fresh=True)
                if self._open_bubble() and self.mode is FillMode.HARVEST:
                    self._harvest_bubble()
        except _Stop:
            pass
        finally:
            self._disarm()
            with contextlib.suppress(_Stop):
                self._flush()


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


def spin_window_ns(text: str) -> int:
    """``$BUBBLES_SPIN_US``: microseconds, 0 to 10,000; empty means 0 (no busy-polling)."""
    try:
        us = float(text.strip() or 0)
    except ValueError:
        us = -1.0
    if not 0 <= us <= 10_000:
        raise ValueError(f"${control.SPIN_US_ENV}={text!r}: give microseconds from 0 (off) to 10000, e.g. 150")
    return int(us * 1000)


def tail_risk(text: str) -> float:
    """``$BUBBLES_TAIL_RISK``: a probability from 0 (no steps past a bubble's predicted end) to ``MAX_TAIL_RISK``;
    empty means ``DEFAULT_TAIL_RISK``."""
    try:
        risk = float(text.strip()) if text.strip() else DEFAULT_TAIL_RISK
    except ValueError:
        risk = -1.0
    if not 0.0 <= risk <= MAX_TAIL_RISK:  # NaN fails this too
        raise ValueError(f"${control.TAIL_RISK_ENV}={text!r}: give the accepted chance that a step started past its "
                         f"bubble's predicted end outlives the bubble, from 0 (never start one) to {MAX_TAIL_RISK}, "
                         f"e.g. {DEFAULT_TAIL_RISK}")
    return risk


def _memory_limit(text: str) -> int | None:
    """``$BUBBLES_MEMORY_BYTES``: an integer number of bytes; empty or 0 means no limit."""
    try:
        value = int(text.strip() or 0)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"${control.MEMORY_ENV}={text!r} is not an integer number of bytes >= 0; the agent "
                         "sets it from the fill job's spec.memory")
    return value or None


class CheckpointStore:
    """The job's state in a directory (``$BUBBLES_CHECKPOINT``, the FillJob's ``spec.checkpoint.path``): ``restore``
    after ``create()`` when a state is there, ``save`` when the process stops (finished, cancelled, evicted). A
    later attempt, on any node that mounts the same storage, resumes instead of starting over."""

    FILE = "state.bin"

    def __init__(self, directory: Path) -> None:
        self.path = directory / self.FILE

    @classmethod
    def from_environment(cls) -> CheckpointStore | None:
        text = os.environ.get(control.CHECKPOINT_ENV, "").strip()
        return cls(Path(text)) if text else None

    def restore(self, job: IterativeFillJob) -> bool:
        """Give the job its saved state; False (and a warning) when there is none or it cannot be read."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            print(f"bubbles.sdk: cannot read the checkpoint {self.path} ({exc}); starting over", file=sys.stderr)
            return False
        job.restore(data)
        return True

    def save(self, job: IterativeFillJob) -> bool:
        """Write ``job.checkpoint()`` atomically (never a half-written state); False when it has none to give."""
        data = job.checkpoint()
        if data is None:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.FILE}.{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(self.path)
        except OSError as exc:
            print(f"bubbles.sdk: cannot write the checkpoint {self.path} ({exc})", file=sys.stderr)
            return False
        return True


def attach_to_agent(device: str, timeout_s: float = 30.0) -> tuple[socket.socket, control.ControlMessage]:
    """Connect to the node agent's attach socket, say who this process is (``$BUBBLES_FILL_JOB_UID``,
    ``$BUBBLES_FILL_ATTEMPT``, the GPU it sees) and return the connection (now the control channel) and the agent's
    ``welcome``; OSError or ValueError saying why the agent refused or could not be reached."""
    path = paths.attach_socket(paths.default_run_dir())
    uid = os.environ.get(control.UID_ENV, "")
    try:
        attempt = int(os.environ.get(control.ATTEMPT_ENV, "0"))
    except ValueError:
        raise ValueError(f"${control.ATTEMPT_ENV} must be an integer (the operator sets it)") from None
    hello: dict[str, Any] = {"uid": uid, "attempt": attempt, "pid": os.getpid()}
    seen = gpu_uuid(device)
    if seen is not None:
        hello["gpu"] = seen
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise OSError(f"cannot reach the node's bubbles agent at {path} ({exc.strerror or exc}): is the agent "
                          f"running on this node, and is its run directory mounted at {path.parent}?") from None
        sock.sendall(control.encode("hello", **hello))
        # One line and not a byte more: the agent's first commands (init) may follow its welcome on the same stream
        # at once, and they are the control channel's to read. A byte at a time, once per process.
        reply = bytearray()
        while not reply.endswith(b"\n"):
            chunk = sock.recv(1)
            if not chunk:
                raise OSError("the node's bubbles agent closed the connection without answering")
            reply += chunk
            if len(reply) > control.MAX_LINE_BYTES:
                raise ValueError("the agent's reply is too long")
        msg = control.parse_reply(bytes(reply))
        if msg.type == "refused":
            raise ValueError(f"the node's bubbles agent refused this fill process: {msg['reason']}")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, msg


def exec_attached(command: Sequence[str]) -> int:
    """``python -m bubbles.sdk --exec -- ARGV...``: a plain command as a fill Pod runs it. Attach to the node's
    agent (which then pauses and resumes this process around bubbles with SIGSTOP/SIGCONT), then become ``ARGV``
    (same process, so the agent's handle on it stays valid). Returns only on an error."""
    argv = list(command[1:] if command[:1] == ["--"] else command)
    if not argv:
        print("bubbles.sdk: --exec needs a command: python -m bubbles.sdk --exec -- PROGRAM ARGS...", file=sys.stderr)
        return 2
    if not os.environ.get(control.UID_ENV):
        print(f"bubbles.sdk: --exec runs a fill Pod's command; ${control.UID_ENV} (set by the operator) is missing",
              file=sys.stderr)
        return 2
    device = os.environ.get(control.DEVICE_ENV, "cpu")
    try:
        sock, _welcome = attach_to_agent(device)
    except (OSError, ValueError) as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 3
    sock.close()  # the agent holds its end; this process is its handle now
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"bubbles.sdk: cannot run {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 0  # not reached


def run_fill_process(argv: Sequence[str] | None = None) -> int:
    """The fill process's main: load the job, create it, then serve the agent's commands."""
    args = list(sys.argv[1:] if argv is None else argv)
    # First in line for the kernel's OOM killer, before the training (inherited by what --exec runs).
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text(str(control.FILL_OOM_SCORE_ADJ))
    if args[:1] == ["--exec"]:
        return exec_attached(args[1:])
    parser = argparse.ArgumentParser(prog="python -m bubbles.sdk", description="Run one fill job.")
    parser.add_argument("--entry", required=True, help="module:Class of the fill job")
    parser.add_argument("--args", default=os.environ.get(control.ARGS_ENV) or "{}",
                        help=f"JSON object of keyword arguments for the class (default: ${control.ARGS_ENV} or {{}})")
    ns = parser.parse_args(args)
    core = os.environ.get(control.CORE_ENV)
    if core:
        # Before torch starts its threads: they inherit the affinity.
        os.sched_setaffinity(0, {int(core)})
    try:
        kwargs = json.loads(ns.args)
        if not isinstance(kwargs, dict):
            raise ValueError("--args must be a JSON object")
        cls = load_entry(ns.entry)
    except ValueError as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 2
    fd_text = os.environ.get(control.CONTROL_FD_ENV)
    device = os.environ.get(control.DEVICE_ENV, "cpu")
    try:
        cuda_device_index(device)
        memory = _memory_limit(os.environ.get(control.MEMORY_ENV, ""))
        spin_ns = spin_window_ns(os.environ.get(control.SPIN_US_ENV, ""))
        risk = tail_risk(os.environ.get(control.TAIL_RISK_ENV, ""))
        wait = fill_wait(os.environ.get(control.FILL_WAIT_ENV, ""))
    except ValueError as exc:
        print(f"bubbles.sdk: {exc}", file=sys.stderr)
        return 2
    attached: tuple[socket.socket, control.ControlMessage] | None = None
    if not fd_text and os.environ.get(control.UID_ENV):
        # In a fill Pod: the process attaches to the node's agent, which admits it or says why not.
        try:
            attached = attach_to_agent(device)
        except (OSError, ValueError) as exc:
            print(f"bubbles.sdk: {exc}", file=sys.stderr)
            return 3
    if issubclass(cls, ImperativeFillJob):
        job_i = cls(**kwargs)
        before = cuda_contexts()
        job_i.create()
        check_create_left_cuda_alone(device, before, cuda_contexts())
        apply_process_limits(device, memory)
        job_i.init()
        job_i.run()  # the agent stops and continues this process around bubbles
        return 0
    name = os.environ.get(control.JOB_ENV, "fill")
    socket_path = os.environ.get(control.SOCKET_ENV)
    if attached is not None:
        ctrl, welcome = attached
        name, socket_path = welcome["job"], welcome["socket"]
    elif not fd_text:
        print(f"bubbles.sdk: neither ${control.CONTROL_FD_ENV} (set by a local agent that starts this process) nor "
              f"${control.UID_ENV} (set by the operator in a fill Pod, to attach to the node's agent) is set",
              file=sys.stderr)
        return 2
    else:
        ctrl = socket.socket(fileno=int(fd_text))
    step_text = os.environ.get(control.STEP_S_ENV)
    max_steps_text = os.environ.get(control.MAX_STEPS_ENV)
    job = cls(**kwargs)
    assert isinstance(job, IterativeFillJob)
    runtime = FillRuntime(job, ctrl, name=name, socket_path=socket_path,
                          step_s=float(step_text) if step_text else None,
                          max_steps=int(max_steps_text) if max_steps_text else None,
                          device=device, memory_bytes=memory)
    runtime.spin_ns = spin_ns
    runtime.fill_wait = wait
    runtime.own_tail_risk = risk
    runtime.tail = TailRisk(risk)
    # SIGTERM from the agent ends the job cleanly (the socket is unlinked in serve's finally).
    signal.signal(signal.SIGTERM, _raise_stop)
    state = CheckpointStore.from_environment()
    try:
        before = cuda_contexts()
        job.create()
        if state is not None:
            state.restore(job)
        check_create_left_cuda_alone(device, before, cuda_contexts())
        runtime._emit("state", state="CREATED")
        runtime._flush()
        try:
            runtime.serve()
        finally:
            if state is not None:
                state.save(job)
    except _Stop:
        runtime._disarm()
    except Exception as exc:  # report the failure to the agent, then exit non-zero
        try:
            runtime._emit("error", message=_describe(exc))
            runtime._flush()
        except _Stop:
            pass
        raise
    return 0


def _describe(exc: BaseException) -> str:
    """What the agent logs and the FillJob's Events show: the error and where it was raised (the fill Pod, and its
    log, may be gone by the time someone reads it)."""
    text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        where = tb[-1]
        text += f" (at {where.filename}:{where.lineno} in {where.name})"
    return text

