"""The node agent's shell: sockets, fill processes, the isolation supervisor and metrics around ``AgentCore``.

Every decision is the core's (``bubbles.agent.core``); this module only moves bytes and carries out the
core's actions. One thread runs a ``selectors`` loop over the executors' datagram sockets, the fill jobs'
control channels and exit descriptors, and the core's watchdog deadlines. Nothing in it waits on a fill
job: control lines are read when they arrive, and writes that would block are queued.

Isolation's health check may block on subprocesses (bounded by timeouts), so a supervisor thread runs
it and hands the result to the loop through the wake-up socket.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core import control, paths, wire
from bubbles.core.api import FillJobSpec, IsolationState, IsolationStatus
from bubbles.core.card import hook_lock_held, read_card

from .config import AgentConfig
from .core import (
    MAX_ISOLATION_RESUBMISSIONS,
    WATCH_INTERVAL_S,
    Action,
    AgentCore,
    Ending,
    ExecutorState,
    HookFacts,
    JobRecord,
    Launch,
    Release,
    Send,
    Signal,
    Snapshot,
    VerifyIsolation,
    VerifyTraining,
    sent_by_the_training,
)
from .isolation import Isolation, make_isolation
from .launcher import FillProcess, Launcher, LaunchRequest, ProcessLauncher
from .metrics import AgentMetrics
from .mps import MpsError

__all__ = ["MAX_ISOLATION_RESUBMISSIONS", "Agent", "AgentConfig"]

log = logging.getLogger("bubbles.agent")

_STOP_WAIT_S = 2.0
_VERDICT_TTL_S = 1.0  # how long an answer of _from_training other than "the lock's holder" stands
_MAX_VERDICTS = 256  # senders remembered per stage
_CREDENTIALS_SPACE = socket.CMSG_SPACE(struct.calcsize("3i"))  # struct ucred: pid, uid, gid


def recv_with_pid(sock: socket.socket, bufsize: int) -> tuple[bytes, int | None]:
    """One datagram from ``sock`` (with ``SO_PASSCRED`` set) and its sender's PID as the kernel names it in this
    process's PID namespace; None where there is none (0: the sender's namespace is not below this one)."""
    data, ancillary, _flags, _addr = sock.recvmsg(bufsize, _CREDENTIALS_SPACE)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 4:
            pid = struct.unpack_from("i", payload)[0]
            return data, pid if pid > 0 else None
    return data, None


def process_alive(pid: int) -> bool | None:
    """Whether process ``pid`` (in this PID namespace) runs: False once it has exited (a zombie counts as exited),
    None where it cannot be told."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return None
    return state not in ("Z", "X")


def lock_holder(path: Path) -> int | None:
    """The process (in this process's PID namespace) holding a ``flock`` on ``path``; None where none does, or
    where it cannot be told (no such regular file, no /proc/locks, a holder outside this PID namespace)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return None
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in text.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:56789 0 EOF"; a waiter's line has "->" after the number
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want:
            with contextlib.suppress(ValueError):
                return int(f[4]) or None
    return None


@dataclass(eq=False)
class _Channel:
    """A running fill process and the bytes in flight on its control channel."""

    proc: FillProcess
    lines: control.LineBuffer = field(default_factory=control.LineBuffer)
    out: bytearray = field(default_factory=bytearray)


class Agent:
    """Serves one training's stages on this node; ``run()`` until ``request_stop()`` (or a signal).

    ``clock`` is the monotonic clock in nanoseconds the core decides with (the hook's clock too).
    """

    def __init__(self, config: AgentConfig, specs: list[FillJobSpec] | None = None,
                 launcher: Launcher | None = None, isolation: Isolation | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.clock = clock
        self.launcher = launcher or ProcessLauncher()
        self.lock = threading.RLock()
        self.metrics = AgentMetrics(config.training, self._snapshot)
        self.core = AgentCore(config.core(), clock, self.metrics)
        agent_dir = paths.stage_dir(config.run_dir, config.training, 0).parent
        self.isolation = isolation or make_isolation(config.isolation, [ex.device for ex in self.core.executors],
                                                     agent_dir)
        self.metrics_port: int | None = None
        self._channels: dict[JobRecord, _Channel] = {}  # processes whose exit is not handled yet
        self._started: dict[JobRecord, FillProcess] = {}  # every process started, for callers and tests
        self._socks: dict[int, socket.socket] = {}
        self._speaker: dict[int, int] = {}  # stage -> the process last found holding its lock (_from_training)
        self._verdicts: dict[int, dict[int, tuple[bool, int, int | None]]] = {}  # stage -> pid -> (ok, until, holder)
        self._isolation_update: IsolationStatus | None = None  # from the supervisor thread, for the loop
        self._verified: list[tuple[JobRecord, str | None, bool]] = []  # VerifyIsolation answers, from threads
        self._training_answers: list[tuple[int, int, str | None, bool]] = []  # VerifyTraining answers, likewise
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        for spec in specs or []:
            self.submit(spec)

    # -- what the core knows, for callers and tests ------------------------------------------------------
    @property
    def jobs(self) -> list[JobRecord]:
        return self.core.jobs

    @property
    def executors(self) -> list[ExecutorState]:
        return self.core.executors

    @property
    def kills(self) -> int:
        return self.core.kills

    @property
    def rejected_jobs(self) -> int:
        return self.core.rejected_jobs

    @property
    def rejected_messages(self) -> int:
        return self.core.rejected_messages

    def process(self, job: JobRecord) -> FillProcess | None:
        """The process started for ``job`` (running or exited), or None if it never started."""
        return self._started.get(job)

    # -- setup and teardown ------------------------------------------------------------------------------
    def submit(self, spec: FillJobSpec) -> JobRecord:
        """Queue a fill job; ValueError saying why it cannot be queued."""
        with self.lock:
            job = self.core.submit(spec)
            self._execute()
            return job

    def cancel(self, name: str, reason: str) -> bool:
        """Stop the fill job ``name`` (queued or running); False if no such job is live."""
        with self.lock:
            found = self.core.cancel(name, reason)
            self._execute()
            return found

    def set_guard_limits(self, budget: float | None, max_share: float | None, source: str,
                         tail_risk: float | None = None) -> None:
        """The training's own slowdown budget, largest fill share and tail risk (``AgentCore.set_guard_limits``)."""
        with self.lock:
            self.core.set_guard_limits(budget, max_share, source, tail_risk)
            self._execute()

    def reset_stage(self, stage: int, reason: str) -> None:
        """The stage's training process changed: re-profile before admitting anything there."""
        with self.lock:
            self.core.reset_stage(stage, reason)
            self._execute()

    def start(self) -> None:
        """Set up isolation, bind every executor's socket, start the metrics endpoint, write the ready file.

        Isolation that does not work is not an error here: fill jobs then wait (fail closed) while the
        supervisor keeps checking, and the status says why.
        """
        status = self.isolation.start()  # may block (bounded): before the loop, so it stalls no bubble
        with self.lock:
            self.core.on_isolation(status)
            self._execute()
        try:
            self._bind()
        except BaseException:
            self.isolation.close()  # e.g. quit the MPS daemon just started: run() will not do it
            raise
        with self.lock:
            self.core.start_serving()

    def _bind(self) -> None:
        """Bind the executors' sockets, serve metrics, write the ready file."""
        for ex in self.core.executors:
            path = paths.agent_socket(self.config.run_dir, self.config.training, ex.index)
            if (problem := paths.socket_path_problem(path)) is not None:
                raise OSError(problem)
            paths.make_private_dir(path.parent)
            # Where the stage's fill jobs bind their sockets: made here too, for a training whose hook predates it
            # (a fill Pod's mount of it must find it there).
            paths.make_private_dir(paths.fills_dir(self.config.run_dir, self.config.training, ex.index))
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            # The kernel attaches each sender's credentials, its PID named in this agent's PID namespace (a training
            # in a Pod included: the node agent has the host's), with no change on the hook's side.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            s.bind(str(path))
            s.setblocking(False)
            self._socks[ex.index] = s
            self._sel.register(s, selectors.EVENT_READ, lambda _m, k=ex.index: self._on_datagrams(k))
        if self.config.metrics:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_addr, self.metrics_port)
        if self.config.ready_file is not None:
            tmp = Path(f"{self.config.ready_file}.tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "metrics_port": self.metrics_port}) + "\n")
            tmp.replace(self.config.ready_file)
        status = self.core.isolation_status
        log.info("agent for training %r serving %d executor(s) (%s) under %s in %s mode; isolation %s: %s",
                 self.config.training, len(self.core.executors), ", ".join(ex.device for ex in self.core.executors),
                 paths.stage_dir(self.config.run_dir, self.config.training, 0).parent, self.config.mode.label,
                 status.mode, status.state)

    def request_stop(self) -> None:
        """Ask ``run()`` to return (thread- and signal-safe)."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def wake_fd(self) -> int:
        """A descriptor for ``signal.set_wakeup_fd``: a signal then interrupts the select at once."""
        return self._wake_w.fileno()

    def run(self) -> None:
        """Serve until ``request_stop()``; then stop every fill job, close the sockets, undo isolation."""
        if not self._socks:
            self.start()
        self._supervisor_stop.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="bubbles-isolation", daemon=True)
        self._supervisor.start()
        # --exit-when-done: the stages' hooks are looked at every WATCH_INTERVAL_S; the core decides when it has ended.
        next_watch = self.clock() if self.config.exit_when_done else None
        try:
            while not self._stop:
                deadline = self.core.next_deadline_ns()
                if next_watch is not None:
                    deadline = next_watch if deadline is None else min(deadline, next_watch)
                timeout = None if deadline is None else min(3600.0, max(0.0, (deadline - self.clock()) / 1e9))
                events = self._sel.select(timeout)
                with self.lock:
                    for key, mask in events:
                        key.data(mask)
                    now = self.clock()
                    for job in self.core.due_watchdogs(now):
                        self._drain_control(job)  # a step report may be waiting
                    self.core.tick(now)
                    self._execute()
                    if next_watch is not None and now >= next_watch:
                        next_watch = now + int(WATCH_INTERVAL_S * 1e9)
                        if self.core.watch_hooks(self._hook_facts()) is not None:
                            self._stop = True  # then as on SIGTERM: the fill jobs stopped, the stats written
        finally:
            self._supervisor_stop.set()
            # A check in progress finishes within its command timeout (a daemon start within a few seconds).
            self._supervisor.join(self.config.isolation.command_timeout_s + 10.0)
            with self.lock:
                self._shutdown()
            # After the fill processes have exited: an MPS daemon this agent owns is quit only now.
            self.isolation.close()

    def _supervise(self) -> None:
        """Supervisor thread: run the isolation health check every interval and hand the result to the loop.

        The check may block on subprocesses (bounded by timeouts), which is why it runs here and not in
        the loop. An exception in the check counts as isolation not working (fail closed).
        """
        interval_s = self.config.isolation.check_interval_s
        while not self._supervisor_stop.wait(interval_s):
            try:
                status = self.isolation.check()
            except Exception as exc:  # a bug in a backend must not end supervision
                log.exception("isolation health check failed")
                raw = self.core.isolation_raw
                status = IsolationStatus(self.isolation.mode, IsolationState.UNAVAILABLE,
                                         f"health check failed: {exc!r}", raw.daemon, raw.epoch)
            with self.lock:
                if status == self.core.isolation_raw:  # nothing changed: leave the loop serving bubble signals
                    continue
                self._isolation_update = status
            with contextlib.suppress(OSError):
                self._wake_w.send(b"i")

    def _shutdown(self) -> None:
        reap = self.core.begin_shutdown()
        self._execute()
        deadline = time.monotonic() + _STOP_WAIT_S
        for job in reap:
            channel = self._channels.get(job)
            if channel is None:
                continue
            proc = channel.proc
            if proc.wait(max(0.0, deadline - time.monotonic())) is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(1.0)
            self._drain_control(job)
            self.core.reaped_at_shutdown(job)
            self._execute()
        for index, sock in self._socks.items():
            self._sel.unregister(sock)
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                paths.agent_socket(self.config.run_dir, self.config.training, index).unlink()
        self._socks.clear()
        self.metrics.close()

    def _on_wake(self, _mask: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        update, self._isolation_update = self._isolation_update, None
        if update is not None:
            self.core.on_isolation(update)
            self._execute()
        verified, self._verified = self._verified, []
        for job, problem, transient in verified:
            self.core.isolation_verified(job, problem, transient=transient)
            self._execute()
        answers, self._training_answers = self._training_answers, []
        for stage, pid, answer, transient in answers:
            self.core.training_membership(stage, pid, answer, transient=transient)

    # -- carrying out the core's actions -----------------------------------------------------------------
    def _execute(self) -> None:
        """Carry out what the core decided, including what it decides in answer (a failed launch, say)."""
        while actions := self.core.take_actions():
            for action in actions:
                self._do(action)

    def _do(self, action: Action) -> None:
        if isinstance(action, Send):
            channel = self._channels.get(action.job)
            if channel is not None and channel.proc.control is not None:
                channel.out += control.encode(action.type, **action.fields)
                self._flush(action.job, channel)
        elif isinstance(action, Signal):
            channel = self._channels.get(action.job)
            if channel is not None:
                channel.proc.send_signal(action.sig)
        elif isinstance(action, Launch):
            self._launch(action)
        elif isinstance(action, VerifyIsolation):
            channel = self._channels.get(action.job)
            if channel is None:
                self.core.isolation_verified(action.job, "its process is gone")
                return
            try:
                threading.Thread(target=self._verify, args=(action.job, channel.proc.pid, action.device),
                                 name="bubbles-verify", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: the check could not be made (the job is tried again)
                self.core.isolation_verified(action.job, f"the check could not be made: {exc}", transient=True)
        elif isinstance(action, VerifyTraining):
            try:
                threading.Thread(target=self._verify_training, args=(action,), name="bubbles-verify-training",
                                 daemon=True).start()
            except RuntimeError as exc:
                self.core.training_membership(action.stage, action.pid, str(exc), transient=True)
        elif isinstance(action, Release):
            self._close(action.job)
            # Leave no stale socket behind for the hook if the job died while armed.
            with contextlib.suppress(FileNotFoundError):
                action.socket_path.unlink()

    def _verify(self, job: JobRecord, pid: int, device: str) -> None:
        """A VerifyIsolation, on a thread of its own: the check may block on the MPS control program (bounded by
        its timeout). Any failure of the check itself counts as not verified (fail closed)."""
        transient = False
        try:
            problem = self.isolation.verify_client(pid, device)
        except MpsError as exc:  # the check could not be made (the daemon did not answer): the job is tried again
            log.warning("could not verify fill process %d's isolation: %s", pid, exc)
            problem, transient = f"the check could not be made: {exc}", True
        except Exception as exc:  # a bug: fail closed, and say where
            log.exception("verifying fill process %d's isolation failed", pid)
            problem = f"the check failed: {exc!r}"
        with self.lock:
            self._verified.append((job, problem, transient))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"v")

    def _verify_training(self, action: VerifyTraining) -> None:
        """A VerifyTraining, on a thread of its own (the check may block on the MPS control program)."""
        transient = False
        try:
            answer = self.isolation.training_membership(action.pid, action.device)
        except MpsError as exc:
            answer, transient = str(exc), True
        except Exception as exc:  # a bug: said, and nothing else changes (the answer is never acted on)
            log.exception("checking the training's MPS membership failed")
            answer, transient = repr(exc), True
        with self.lock:
            self._training_answers.append((action.stage, action.pid, answer, transient))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"t")

    def _launch(self, action: Launch) -> None:
        job = action.job
        try:
            # Isolated only while the backend works; otherwise (allowed unisolated) no client variables.
            env = self.isolation.client_env(action.device, job.spec.memory_bytes) if action.isolated else {}
            req = LaunchRequest(job.spec, action.socket_path, device=action.device, core=action.core, env=env)
            proc = self.launcher.launch(req)
        except (OSError, ValueError) as exc:
            self.core.launch_failed(job, str(exc))
            return
        self._channels[job] = _Channel(proc)
        if len(self._started) > len(self.core.jobs):  # the core let go of finished records: so does this
            kept = set(self.core.jobs)
            self._started = {j: p for j, p in self._started.items() if j in kept}
        self._started[job] = proc
        self._sel.register(proc.exit_fd, selectors.EVENT_READ, lambda _m: self._on_exit(job))
        if proc.control is not None:
            self._sel.register(proc.control, selectors.EVENT_READ, lambda m: self._on_control(job, m))
        self.core.launched(job, has_control=proc.control is not None)

    def _flush(self, job: JobRecord, channel: _Channel) -> None:
        ctrl = channel.proc.control
        if ctrl is None or not channel.out:
            return
        try:
            n = ctrl.send(channel.out)
            del channel.out[:n]
        except BlockingIOError:
            pass
        except OSError:
            channel.out.clear()  # the process is gone; its exit is handled by the pidfd
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if channel.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(ctrl, mask, lambda m: self._on_control(job, m))

    def _on_control(self, job: JobRecord, mask: int) -> None:
        channel = self._channels.get(job)
        if channel is None:
            return
        if mask & selectors.EVENT_WRITE:
            self._flush(job, channel)
        if mask & selectors.EVENT_READ:
            self._drain_control(job)
        self._execute()

    def _drain_control(self, job: JobRecord) -> None:
        """Feed every complete line waiting on ``job``'s control channel to the core."""
        channel = self._channels.get(job)
        ctrl = channel.proc.control if channel is not None else None
        if channel is None or ctrl is None or ctrl.fileno() < 0:
            return
        while True:
            try:
                data = ctrl.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(ctrl)
                return
            for line in channel.lines.feed(data):
                self.core.on_control_line(job, line)

    def _on_exit(self, job: JobRecord) -> None:
        channel = self._channels.get(job)
        if channel is None:
            return
        self._drain_control(job)
        self.core.on_exit(job, channel.proc.wait(1.0))
        self._execute()

    def _close(self, job: JobRecord) -> None:
        channel = self._channels.pop(job, None)
        if channel is None:
            return
        proc = channel.proc
        for fd in (proc.control, proc.exit_fd):
            if fd is None or (isinstance(fd, int) and fd < 0):
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(fd)
        proc.close()

    # -- bubble signals ----------------------------------------------------------------------------------
    def _on_datagrams(self, stage: int) -> None:
        sock = self._socks[stage]
        for _ in range(1024):  # bounded, so one flooding stage cannot starve the others
            try:
                data, pid = recv_with_pid(sock, wire.MAX_DATAGRAM_BYTES + 1)
            except BlockingIOError:
                return
            if pid is not None and not self._from_training(stage, pid):
                continue
            self.core.on_datagram(stage, data, pid)
            self._execute()

    def _from_training(self, stage: int, pid: int) -> bool:
        """Whether ``pid`` may speak for ``stage`` (``core.sent_by_the_training``), looked up at most once a second
        per sender: the process found to hold the stage's lock is remembered until another is, so the training's own
        datagrams cost a dictionary lookup; any other answer (refused, or taken because no process held the lock) is
        remembered for _VERDICT_TTL_S, so a sender flooding the socket costs one look at /proc/locks a second, and a
        restarted training that got a refused process's PID is heard within that second."""
        if self._speaker.get(stage) == pid:
            return True
        now = self.clock()
        verdicts = self._verdicts.setdefault(stage, {})
        known = verdicts.get(pid)
        if known is not None and known[1] > now:
            allowed, holder = known[0], known[2]
        else:
            if len(verdicts) >= _MAX_VERDICTS:
                verdicts.clear()  # a process per datagram: start over rather than grow
            holder = lock_holder(paths.hook_lock(self.config.run_dir, self.config.training, stage))
            allowed = sent_by_the_training(pid, holder)
            if allowed and holder == pid:
                self._speaker[stage] = pid
                verdicts.clear()
                return True
            verdicts[pid] = (allowed, now + int(_VERDICT_TTL_S * 1e9), holder)
        if not allowed:
            self.core.foreign_datagram(stage, pid, holder)
        return allowed

    def _hook_facts(self) -> list[HookFacts]:
        """What each stage's hook is found to be, for the core's ``watch_hooks``: its card, its lock, its process."""
        facts = []
        for ex in self.core.executors:
            lock = None
            try:
                card = read_card(paths.hook_card(self.config.run_dir, self.config.training, ex.index))
            except FileNotFoundError:
                present: bool | None = False
            except (OSError, ValueError):
                present = None  # there, but not to be read now (being replaced, or planted): neither live nor gone
            else:
                present = True
                if card.lock:
                    lock = hook_lock_held(self.config.run_dir, self.config.training, ex.index)
            alive = process_alive(ex.training_pid) if ex.training_pid is not None else None
            facts.append(HookFacts(present, lock, alive))
        return facts

    # -- reporting ---------------------------------------------------------------------------------------
    @property
    def ended(self) -> Ending | None:
        """Why the agent stopped by itself (``--exit-when-done``), or None."""
        with self.lock:
            return self.core.ended

    def summary(self) -> str:
        """What was harvested, per stage, for a person (``--exit-when-done`` prints it)."""
        with self.lock:
            return self.core.summary()

    def _snapshot(self) -> Snapshot:
        with self.lock:
            return self.core.snapshot()

    def stats(self) -> dict[str, Any]:
        """Everything the demo and the benchmarks read (see the agent's documentation for the format)."""
        with self.lock:
            return self.core.stats()

    def write_stats(self, path: Path) -> None:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(self.stats(), separators=(",", ":")) + "\n")
        tmp.replace(path)
