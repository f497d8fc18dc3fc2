"""The runtime that serves one iterative fill job under the agent's commands and runs its steps inside bubbles.

The agent runs a fill job as ``python -m bubbles.sdk --entry module:Class [--args JSON]`` with its end of a
socketpair in ``$BUBBLES_CONTROL_FD`` (protocol: ``bubbles.core.control``). While armed in harvest mode the runtime
binds ``fills/fill-<job>.sock`` in the stage directory (the ``fills/`` folder beside the training's hook socket), so
the training's hook sends each BUBBLE_START/BUBBLE_END straight to it (one hop), and unlinks it when disarmed. The
gates that decide which step fits are ``bubbles.training.gating``'s; this module feeds them and runs what they allow.

A gang (a fill job over N GPUs of one stage, one process each; ``bubbles.training.sdk.gang``): its leader binds a fill
socket on every GPU of the gang (``arm``'s ``sockets``) and gates on the bubbles they share
(``bubbles.training.gating.GangGate``), telling the other processes, its followers, each step it takes; a follower
binds no fill socket and runs the steps it is told. A single-GPU job runs the same code as before gangs, with one
attribute test more per drain and per step.

A fill Pod's process that attached through its Pod's own attach socket (control v5) binds nothing: the agent bound its
fill socket(s) in the training's directory, which the Pod does not mount, and passed them with its welcome
(``passed``, by path). An ``arm`` in harvest mode then listens on the passed socket(s) the arm names, first dropping
what is queued there (datagrams from before the arm: the agent links the path into ``fills/`` just before it sends the
arm, and a process that bound at the arm heard nothing earlier either); a disarm stops listening and leaves the
sockets open for the next arm (the agent takes their paths away). They are closed when the runtime ends.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bubbles.core import control, wire
from bubbles.core.api import DEFAULT_TAIL_RISK, FillMode
from bubbles.core.control import cuda_device_index
from bubbles.training.gating import GangGate, StartPredictor, StepGates, TailRisk
from bubbles.training.sdk.device import DEFAULT_FILL_WAIT, DeviceSync, apply_process_limits, device_sync_for
from bubbles.training.sdk.gang import (
    CREDENTIALS_BYTES,
    FLAG_NAIVE,
    FLAG_TAIL,
    PASS_END,
    STEP,
    GangBroken,
    GangSettings,
    decode_command,
    encode_command,
    follower_address,
    sender_uid,
)
from bubbles.training.sdk.jobs import IterativeFillJob, StepResult
from bubbles.training.sdk.profiling import check_step_sizes, profile_sizes, profile_step_time

# Bubbles with no step run, before any step ran, that the profile's median (times the margin) would have fitted: then
# the gates fall back to the medians, once (see FillRuntime._starving).
STARVED_BUBBLES = 32
_NAIVE_FLUSH_STEPS = 64  # naive mode batches step reports: they are only for accounting
_NAIVE_FLUSH_NS = 20_000_000


class _Bubble:
    """A bubble as its START signal announced it; ``ended`` once its END has been read."""

    __slots__ = ("ended", "predicted_end_ns", "seq", "slot", "start_ns")

    def __init__(self, seq: int, start_ns: int, predicted_end_ns: int, slot: int = 0) -> None:
        self.seq = seq
        self.slot = slot
        self.start_ns = start_ns
        self.predicted_end_ns = predicted_end_ns
        self.ended = False


class FillStopped(Exception):
    """The runtime stops serving: the agent said stop, closed the channel or went away, or SIGTERM came."""


class FillRuntime:
    """Runs one iterative fill job in this process under the agent's commands (see module doc)."""

    def __init__(self, job: IterativeFillJob, control_sock: socket.socket, *, name: str,
                 socket_path: str | None, step_s: float | None, max_steps: int | None = None,
                 device: str = "cpu", memory_bytes: int | None = None,
                 device_sync: DeviceSync | None = None, spin_ns: int = 0, fill_wait: str = DEFAULT_FILL_WAIT,
                 own_tail_risk: float = DEFAULT_TAIL_RISK, sockets: Sequence[str] | None = None,
                 gang: GangSettings | None = None, passed: Mapping[str, socket.socket] | None = None) -> None:
        self.job = job
        self.ctrl = control_sock
        self.name = name
        self.socket_path = socket_path
        # A gang's fill sockets, one per GPU, its own GPU's first (``arm.sockets``; the welcome's, attached); empty
        # until an arm names them: then only ``socket_path``, its own GPU's.
        self.sockets: list[str] = list(sockets or ())
        self.gang = gang
        # The fill sockets the agent bound and passed (control v5), by path; None: this runtime binds its own.
        self.passed: dict[str, socket.socket] | None = dict(passed) if passed is not None else None
        self.stale_dropped = 0  # datagrams found queued on a passed socket at an arm, dropped
        self._gang_gate: GangGate | None = None  # the leader's, while armed in harvest mode for a gang
        self._sigs: list[socket.socket] = []  # the leader's bound fill sockets, one per GPU of the gang
        self._bound_paths: list[str] = []
        # The leader's line to its followers, and a follower's to its leader (bubbles.training.sdk.gang).
        self._to_followers: socket.socket | None = None
        self._from_leader: socket.socket | None = None
        if gang is not None and gang.size > 1:
            if gang.leader:
                self._to_followers = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            else:
                self._from_leader = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                # An abstract socket has no file permissions: the kernel names each sender (SO_PASSCRED), and only
                # a process of this user (the leader, started beside this one) is obeyed.
                self._from_leader.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
                self._from_leader.bind(follower_address(gang.port, gang.rank))
                self._from_leader.setblocking(False)
        self.foreign_commands = 0  # a follower: datagrams from another user's process on the leader's line, dropped
        self.step_s = step_s
        self.given_step_s = step_s  # the spec's step time, if any: a floor for the gates
        self.max_steps = max_steps
        self.device = device
        self.memory_bytes = memory_bytes
        cuda_device_index(device)  # a bad device string fails here, before the agent is told CREATED
        # Every step waits for its device work before it counts as done (see _run_step). Unless injected,
        # it is made at init, where the job first touches its accelerator and a failure is reported.
        self.device_sync: DeviceSync | None = device_sync
        self.fill_wait = fill_wait  # how a CUDA device_sync waits ($BUBBLES_FILL_WAIT)
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
        self.spin_ns = spin_ns
        self.predictor = StartPredictor()
        self.spin_caught = 0  # bubble starts read while busy-polling, not woken from the blocking poll
        # Steps past a bubble's predicted end, at a risk of outliving it of at most $BUBBLES_TAIL_RISK (see
        # bubbles.training.gating.TailRisk); fed every bubble's length and the END signals' lag.
        self.tail = TailRisk(own_tail_risk)
        self.tail_steps = 0
        # This process's own risk ($BUBBLES_TAIL_RISK) and the training's limit (the agent's ``limits`` command: a
        # PipelineTraining's spec.tailRisk, the agent's --tail-risk; None until one comes): the lower one applies.
        self.own_tail_risk = own_tail_risk
        self.tail_risk_limit: float | None = None
        self.unknown_fields: set[str] = set()  # "type.field" the agent sent that this SDK does not know
        self._started: _Bubble | None = None  # the last START read, until its END (``_bubble`` is dropped after a pass)
        # The profile's medians (with the margin), by size, and the bubbles before the first step that ran none though
        # they would have fitted them (``_starving``); the fallback is used at most once.
        self._fallback: list[tuple[int | None, float]] = []
        self._starved = 0
        self.relaxed = False
        self._follow_seq: int | None = None  # a follower: the bubble of the leader's pass under way

    # -- what the fill process tells the agent --------------------------------------------------
    def report_created(self) -> None:
        """Tell the agent the job is created (it may send ``init`` now); FillStopped if the agent is gone."""
        self._emit("state", state="CREATED")
        self._flush()

    def report_error(self, message: str) -> None:
        """Tell the agent what failed (it logs it, the operator makes it an Event); FillStopped if the agent is gone."""
        self._emit("error", message=message)
        self._flush()

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
                raise FillStopped() from None  # the agent is gone
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
                raise FillStopped() from None
            if not data:
                raise FillStopped()  # the agent closed the channel
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
            raise FillStopped()
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
                    timed = profile_step_time(self.job, self._synchronize)
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
            if cmd.get("sockets"):
                self.sockets = list(cmd["sockets"])
                self.socket_path = self.sockets[0]
            self.disarm()
            self.mode = control.parse_mode(cmd["mode"], "arm.mode")
            if self._from_leader is not None:
                # A follower binds no fill socket: it runs the steps its leader tells it (``_follow``).
                if self.mode is FillMode.NAIVE:
                    self._emit("state", state="RUNNING")
                    self._flush()
                return
            if self.mode is FillMode.HARVEST:
                self._bind()
            else:
                self._emit("state", state="RUNNING")
                self._flush()
        elif cmd.type == "disarm":
            was_naive = self.mode is FillMode.NAIVE
            self.disarm()
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
        if self.passed is not None:
            self._listen_passed()
            return
        if len(self.sockets) > 1:
            self._bind_gang()
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

    def _bind_gang(self) -> None:
        """The leader of a gang: a fill socket on every GPU of the gang, read as one stream each by the gang gate.
        ``_sig`` is the first (its own GPU's), the one the poll loop's single-GPU paths know."""
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                s.bind(path)
            except OSError:
                s.close()
                self.disarm()
                raise
            s.setblocking(False)
            self._sigs.append(s)
            self._bound_paths.append(path)
        self._sig = self._sigs[0]
        self._gang_gate = GangGate(len(self._sigs))
        self._bubble = None

    def _listen_passed(self) -> None:
        """Harvest on the passed sockets the arm names (``sockets``, else ``socket_path``), what is queued on them
        dropped; armed with none, and the agent told, where the arm names a socket it did not pass."""
        assert self.passed is not None and self.socket_path is not None
        names = self.sockets if len(self.sockets) > 1 else [self.socket_path]
        missing = [n for n in names if n not in self.passed]
        if missing:
            self._emit("error", message=f"armed on fill socket(s) {', '.join(missing)}, which the agent did not pass "
                                        f"with its welcome (it passed {', '.join(self.passed) or 'none'}): not "
                                        "listening for bubbles")
            self._flush()
            return
        socks = [self.passed[n] for n in names]
        for sig in socks:
            while True:
                try:
                    sig.recv(wire.MAX_DATAGRAM_BYTES + 1)
                except BlockingIOError:
                    break
                self.stale_dropped += 1
        if len(socks) > 1:
            self._sigs = socks
            self._gang_gate = GangGate(len(socks))
        self._sig = socks[0]
        self._bubble = None

    def disarm(self) -> None:
        """Stop listening for bubbles: close the signal socket and unlink its path (a passed socket stays open,
        its path the agent's); the mode is OFF until the next ``arm``."""
        if self.passed is not None:
            self._sigs, self._sig, self._gang_gate = [], None, None
            self.mode = FillMode.OFF
            self._bubble = None
            return
        if self._sigs:
            for s in self._sigs:
                s.close()
            for path in self._bound_paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self._sigs, self._bound_paths, self._sig, self._gang_gate = [], [], None, None
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
        if self._gang_gate is not None:
            self._drain_gang(self._gang_gate, fresh)
            return
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

    def _drain_gang(self, gate: GangGate, fresh: bool) -> None:
        """The leader's ``_drain_signals``: every pending signal of every GPU of the gang into the gang gate; the
        gang's bubble is open from the last START of a slot to the first END (``GangGate``)."""
        for stream, sig in enumerate(self._sigs):
            while True:
                try:
                    data = sig.recv(wire.MAX_DATAGRAM_BYTES + 1)
                except BlockingIOError:
                    break
                fast = wire.decode_signal(data)
                if fast is None:
                    continue
                kind, slot, seq, t1, t2 = fast
                if kind == wire.Kind.BUBBLE_START:
                    had = gate.shared
                    opened = gate.start(stream, slot, seq, t1, t2)
                    if opened is not None:
                        self._bubble = self._started = _Bubble(opened.seq, opened.start_ns, opened.predicted_end_ns,
                                                               slot)
                        if self.spin_ns:
                            self.predictor.started(slot, opened.start_ns)
                    elif had is not None:  # a START superseded the gang's open bubble (an END was lost)
                        self._bubble = self._started = None
                    continue
                closed = gate.end(stream, seq)
                started = self._started
                if closed is None or started is None:
                    continue
                self._started = None
                self.tail.ended(started.slot, t1 - started.start_ns)
                if fresh:
                    self.tail.end_lag(time.monotonic_ns() - t1)
                if self._bubble is started:
                    started.ended = True

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
                  size: int | None = None, tail: bool = False, mode: FillMode | None = None) -> float:
        """Run one step and wait for its device work, report it; return its duration in seconds.

        ``start`` is when the gate decided to run it (reported as the step's start, so the record
        shows exactly the program-directed check: ``start + step_s <= usable end``). The reported end
        is after the device synchronize: on a GPU that is when the fill job stops occupying it, so the
        agent's overrun (step end - bubble end) measures how long fill work outlived the bubble.
        ``sync_ns`` is the part of the step spent waiting for queued device work. ``size``: the step's size
        for a job with ``step_sizes`` (None: ``step()`` without one). ``tail``: not allowed by the bubble's predicted
        end on ``TailRisk``'s word (the record says ``gate: tail``). ``mode``: the mode it runs in, where that is not
        the runtime's own (a gang follower's step, in its leader's mode). A gang's leader tells its followers first.
        """
        if self._to_followers is not None:
            naive = self.mode is FillMode.NAIVE
            self._command_followers(STEP, bubble_seq, signal_ns, size, (FLAG_TAIL if tail else 0)
                                    | (FLAG_NAIVE if naive else 0))
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
                   mode=(mode or (FillMode.HARVEST if self.mode is FillMode.OFF else self.mode)).label,
                   sync_ns=end - sync_start, **({} if size is None else {"size": size}),
                   **({"gate": "tail"} if tail else {}))
        return (end - start) / 1e9

    def _command_followers(self, kind: int, bubble_seq: int, signal_ns: int, size: int | None, flags: int) -> None:
        """Tell every follower of the gang to run this step too (or that the pass is over); GangBroken if one is gone:
        the gang's collectives cannot complete without it."""
        sock, gang = self._to_followers, self.gang
        assert sock is not None and gang is not None
        data = encode_command(kind, bubble_seq, signal_ns, size, flags)
        for rank in range(1, gang.size):
            try:
                sock.sendto(data, follower_address(gang.port, rank))
            except OSError as exc:
                raise GangBroken(f"gang rank {rank} is gone ({exc.strerror or exc}): a gang steps with all of its "
                                 "processes or not at all") from None

    def _follow(self) -> None:
        """A follower: run every step the leader commands, in the leader's mode and bubble, whatever this process's
        own arm (the leader is inside the step's collective already); report them as the leader's pass ends."""
        sock = self._from_leader
        assert sock is not None
        while True:
            try:
                data, ancdata, _flags, _addr = sock.recvmsg(64, socket.CMSG_SPACE(CREDENTIALS_BYTES))
            except BlockingIOError:
                return
            if sender_uid(ancdata) != os.getuid():
                self.foreign_commands += 1
                if self.foreign_commands == 1:
                    self._emit("error", message="a process of another user sent a step command on the gang's "
                                                "leader line; dropped (this and any more)")
                continue
            cmd = decode_command(data)
            if cmd is None:
                continue
            kind, flags, seq, signal_ns, size = cmd
            if kind == PASS_END:
                self._emit("state", state="PAUSED")
                self._flush()
                self._follow_seq = None
                continue
            naive = bool(flags & FLAG_NAIVE)
            first = not naive and self._follow_seq != seq
            if first:
                self._follow_seq = seq
                self._emit("state", state="RUNNING")
            self._run_step(seq, signal_ns, announce=first, size=size, tail=bool(flags & FLAG_TAIL),
                           mode=FillMode.NAIVE if naive else FillMode.HARVEST)
            self.tail_steps += bool(flags & FLAG_TAIL)
            if naive and len(self._out) >= _NAIVE_FLUSH_STEPS:
                self._flush()
            self._check_finished()

    def _synchronize(self) -> None:
        if self.device_sync is None:  # steps run only after init, which sets it
            raise RuntimeError("a step ran before init(): no device to synchronize")
        self.device_sync.synchronize()

    def _profile_sizes(self, sizes: tuple[int, ...]) -> None:
        """Time every step size (``profile_sizes``); the smallest size's gate becomes the step time."""
        self.sized, self._fallback = profile_sizes(self.job, self._synchronize, sizes, self.step_s)
        self.step_s = self.sized[0][1] if self.sized else self.step_s

    def _check_finished(self) -> None:
        if self.job.is_finished() or (self.max_steps is not None and self.steps >= self.max_steps):
            self._emit("finished")
            self._flush()
            raise FillStopped()

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
            left = usable_end - now
            fits = gates.fitting(left, ran == 0)  # the program-directed limit
            gated = not fits
            tail = False
            if not fits and tail_ok:
                # Past what the prediction allows, while the slowdown guard has not cut the share: steps while the
                # chance that this bubble, given how long it has lasted, ends during one is small enough.
                if tail_since is None:
                    tail_since = now - b.start_ns
                fits = self.tail.fitting(b.slot, now - b.start_ns, gates, ran == 0, since_ns=tail_since)
                tail = bool(fits)
            if not fits:
                if gated:
                    self._stale_gates(gates, left, ran == 0)
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
            if self._to_followers is not None:
                self._command_followers(PASS_END, b.seq, b.start_ns, None, 0)
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
        bubble, and a gate no bubble fits lets no step run, so it never learns (docs/design.md: the cluster tier's
        example job sat at 0 steps that way). After STARVED_BUBBLES such
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

    def _stale_gates(self, gates: StepGates, left_ns: int, first: bool) -> None:
        """No gate fitted what was left of the bubble: where a measured gate has refused places its median would
        have fitted long enough, it forgets its slower half (``StepGates.refused``); say so, and tell the agent when a
        first step's gate moved."""
        forgot = gates.refused(left_ns, first)
        if not forgot:
            return
        where = "a bubble's first step" if first else "a bubble's later steps"
        print(f"bubbles.sdk: the step time measured for {where} refused {gates.stale_after} bubbles in a row that "
              f"its median would have fitted (sizes {forgot}): its slower half is forgotten, so steps run and "
              "re-measure it (slow steps in a busy spell had lifted it past the bubbles)", file=sys.stderr,
              flush=True)
        if first:
            sizes = gates.first_steps_s()
            self._report_step_time(sizes[0][1], sizes)
            self._flush()

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
        if self._to_followers is not None:
            self._command_followers(PASS_END, -1, 0, None, FLAG_NAIVE)
        self._flush()

    def serve(self) -> None:
        """Serve commands until stopped; return normally when the agent says stop or goes away."""
        self.ctrl.setblocking(False)
        # A poll object, not selectors: a bubble's start waits on this call, and the plain one costs less Python.
        poller = select.poll()
        ctrl_fd = self.ctrl.fileno()
        poller.register(ctrl_fd, select.POLLIN)
        registered: socket.socket | None = None
        registered_fds: list[int] = []
        if self._from_leader is not None:
            poller.register(self._from_leader.fileno(), select.POLLIN)
        try:
            while self._from_leader is not None:  # a gang's follower: steps come from its leader, not from bubbles
                ready = poller.poll(-1)
                if any(fd == ctrl_fd for fd, _ in ready):
                    self._poll_control()
                self._follow()
            while True:
                if self.mode is FillMode.NAIVE:
                    self._naive_loop()
                    continue
                if self._sig is not registered:
                    for fd in registered_fds:
                        with contextlib.suppress(KeyError):
                            poller.unregister(fd)  # by number: disarm may have closed the socket
                    # A gang's leader listens on every GPU of the gang (``_sigs``, ``_sig`` the first of them).
                    registered_fds = [s.fileno() for s in self._sigs or ([self._sig] if self._sig else [])]
                    for fd in registered_fds:
                        poller.register(fd, select.POLLIN)
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
        except FillStopped:
            pass
        finally:
            self.disarm()
            with contextlib.suppress(FillStopped):
                self._flush()
            for sock in (self._from_leader, self._to_followers, *(self.passed or {}).values()):
                if sock is not None:
                    sock.close()
