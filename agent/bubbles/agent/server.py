"""The node agent's shell: sockets, fill processes, the isolation supervisor and metrics around ``AgentCore``.

Every decision is the core's (``bubbles.agent.core``); this module only moves bytes and carries out the
core's actions. One thread runs a ``selectors`` loop over the executors' datagram sockets (one per harvested GPU, in
its directory: ``<run_dir>/<namespace>/<training>/stage-<k>/rank-<r>/agent.sock``, or in cluster mode the same tree
in a training Pod's own directory, ``<run_dir>/_pods/<pod uid>/``), the fill jobs' control channels and exit
descriptors, and the core's watchdog deadlines. Nothing in it waits on a fill job: control lines are read when they
arrive, and writes that would block are queued.

In local mode the loop also discovers the training's other GPUs (``discover``, every ``DISCOVER_INTERVAL_S``): each
card of a (stage, rank) not served yet gets an executor and its socket. The hook lists its directory's listeners
every iteration and greets a new one with its profile, so a rank found late is harvested from its next iteration.

Isolation's health check may block on subprocesses (bounded by timeouts), so a supervisor thread runs
it and hands the result to the loop through the wake-up socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core import control, paths, wire
from bubbles.core.api import FillJobSpec, FillState, IsolationState, IsolationStatus
from bubbles.core.card import hook_lock_held, read_card
from bubbles.core.identity import GpuKey

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
from .launcher import FillProcess, Launcher, LaunchRequest, ProcessLauncher, free_port
from .metrics import AgentMetrics
from .mps import MpsError

__all__ = ["MAX_ISOLATION_RESUBMISSIONS", "Agent", "AgentConfig"]

log = logging.getLogger("bubbles.agent")

_STOP_WAIT_S = 2.0
_VERDICT_TTL_S = 1.0  # how long an answer of _from_training other than "the lock's holder" stands
_MAX_VERDICTS = 256  # senders remembered per GPU
# Local mode: how often the training's directories are looked at for ranks not served yet (a glob of a few
# directories; only a new one's card is read). Short: a hook that profiles in a few fast iterations and then
# blocks (a start barrier, an evaluation) greets a listener only at its next iteration, so one bound late waits.
DISCOVER_INTERVAL_S = 0.1
_CREDENTIALS_SPACE = socket.CMSG_SPACE(struct.calcsize("3i"))  # struct ucred: pid, uid, gid
# Where a GPU's socket is bound before it is renamed to agent.sock (no longer than that name: a path that fits one
# fits the other; not *.sock: the hook never lists it).
_BINDING_NAME = ".agent.new"


def recv_with_pid(sock: socket.socket, bufsize: int) -> tuple[bytes, int | None]:
    """One datagram from ``sock`` (with ``SO_PASSCRED`` set) and its sender's PID as the kernel names it in this
    process's PID namespace; None where there is none (0: the sender's namespace is not below this one)."""
    data, ancillary, _flags, _addr = sock.recvmsg(bufsize, _CREDENTIALS_SPACE)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 4:
            pid = struct.unpack_from("i", payload)[0]
            return data, pid if pid > 0 else None
    return data, None


def _served_by_name(directory: Path) -> tuple[int, int] | None:
    """(stage, rank) a GPU directory's names say (``stage-<k>/rank-<r>``), or None where they are not such names."""
    stage, rank = directory.parent.name, directory.name
    if stage.startswith("stage-") and rank.startswith("rank-") and stage[6:].isdigit() and rank[5:].isdigit():
        return int(stage[6:]), int(rank[5:])
    return None


def _give(name: str, dir_fd: int, owner: os.stat_result) -> None:
    """Chown ``name`` in the directory ``dir_fd`` (not followed) to the owner of ``owner``'s file where that is not
    this process's user. Without CAP_CHOWN (an agent run outside the chart, which keeps it) the socket is made
    writable by every user instead, with a warning once: the directory is that one Pod's (its volume is mounted into
    that Pod alone), so any UID of the Pod reaching it is what the chown would have given; the training is served
    either way."""
    if owner.st_uid == os.geteuid():
        return
    try:
        os.chown(name, owner.st_uid, owner.st_gid, dir_fd=dir_fd, follow_symlinks=False)
    except PermissionError:
        global _CHOWN_WARNED
        if not _CHOWN_WARNED:
            _CHOWN_WARNED = True
            log.warning("cannot give the agent's sockets to the trainings' UIDs (no CAP_CHOWN: the chart keeps it); "
                        "they are made writable by every user of the Pod that mounts them instead")
        # Through an O_PATH descriptor of the name itself (Linux has no lchmod): a link the Pod put there instead
        # is not followed, and only a socket is opened up.
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise OSError(f"{name} is not the agent's socket any more (replaced in the Pod's directory)") from None
            os.chmod(f"/proc/self/fd/{fd}", 0o666)
        finally:
            os.close(fd)


_CHOWN_WARNED = False


def _mark_changed(dir_fd: int) -> None:
    """Move the directory ``dir_fd``'s mtime on by a nanosecond past what it is. The hook lists its directory again
    only when the mtime changed, and a file system may stamp it from a coarse clock (a tick of a few ms): a socket
    renamed in within the tick in which the hook last listed the directory would not be seen until something else
    changed there. Setting a time explicitly on a directory another user owns (a training Pod's) takes CAP_FOWNER,
    which the chart keeps; without it the time is set to now (write access suffices), and the hook then sees the
    socket at its next listing once the clock has ticked past."""
    st = os.fstat(dir_fd)
    try:
        os.utime(dir_fd, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    except PermissionError:
        os.utime(dir_fd)


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
    """Serves one training's GPUs on this node; ``run()`` until ``request_stop()`` (or a signal).

    ``clock`` is the monotonic clock in nanoseconds the core decides with (the hook's clock too). ``gpus`` (cluster
    mode): the GPUs to serve from the start, as (key, directory, device), instead of the configuration's local stages;
    the caller adds more with ``add_gpu`` and nothing is discovered here. Without it (local mode) rank 0 of each of
    ``config.executors`` stages is served from the start and the other ranks are discovered from their cards.
    """

    def __init__(self, config: AgentConfig, specs: list[FillJobSpec] | None = None,
                 launcher: Launcher | None = None, isolation: Isolation | None = None,
                 clock: Callable[[], int] = time.monotonic_ns,
                 gpus: Sequence[tuple[GpuKey, Path, str]] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.launcher = launcher or ProcessLauncher()
        self.lock = threading.RLock()
        self.metrics = AgentMetrics(config.training, self._snapshot, config.namespace)
        core_config = config.core()
        self.discovering = gpus is None
        if gpus is not None:
            core_config = dataclasses.replace(core_config, executors=())
        self.core = AgentCore(core_config, clock, self.metrics)
        for key, directory, device in gpus or ():
            self.core.add_executor(key, directory, device)
        self.training_dir = paths.training_dir(config.run_dir, config.namespace, config.training)
        self.isolation = isolation or make_isolation(config.isolation, [ex.device for ex in self.core.executors],
                                                     self.training_dir)
        self.metrics_port: int | None = None
        self._channels: dict[JobRecord, _Channel] = {}  # processes whose exit is not handled yet
        self._started: dict[JobRecord, FillProcess] = {}  # every process started, for callers and tests
        self._socks: dict[GpuKey, socket.socket] = {}
        self._gang_ports: dict[int, int] = {}  # gang id -> its rendezvous port, while its members are launched
        self._bound = False  # start() has bound the sockets: a GPU added later binds its own at once
        self._speaker: dict[GpuKey, int] = {}  # GPU -> the process last found holding its lock (_from_training)
        self._verdicts: dict[GpuKey, dict[int, tuple[bool, int, int | None]]] = {}  # GPU -> pid -> (ok, until, holder)
        self._unusable_cards: set[str] = set()  # discover: what was said about cards it could not use (said once)
        self._isolation_update: IsolationStatus | None = None  # from the supervisor thread, for the loop
        self._verified: list[tuple[JobRecord, str | None, bool]] = []  # VerifyIsolation answers, from threads
        self._training_answers: list[tuple[GpuKey, int, str | None, bool]] = []  # VerifyTraining answers, likewise
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

    def submit_on(self, spec: FillJobSpec, key: GpuKey | Sequence[GpuKey]) -> JobRecord:
        """Queue a fill job on GPU ``key``, where it was placed (cluster mode: the operator's assignment; a gang's
        GPUs, by gang rank); ValueError saying why it cannot be queued."""
        with self.lock:
            job = self.core.submit(spec, on=key)
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

    def reset_gpu(self, key: GpuKey, reason: str) -> None:
        """The GPU's training process changed: re-profile before admitting anything there."""
        with self.lock:
            self.core.reset_gpu(key, reason)
            self._execute()

    def add_gpu(self, key: GpuKey, directory: Path, device: str, why: str = "") -> ExecutorState:
        """Serve one more GPU of the training (``AgentCore.add_executor``), its socket bound at once if the others'
        are. OSError where the socket cannot be bound (the GPU is then not served); ValueError if it is served."""
        with self.lock:
            ex = self.core.add_executor(key, directory, device, why=why)
            if self._bound:
                try:
                    self._bind_gpu(ex)
                except OSError as exc:
                    self.core.remove_executor(key)
                    raise OSError(f"{key}: cannot bind its socket in {directory}: {exc}") from exc
            self._execute()
            return ex

    def set_gpu(self, key: GpuKey, directory: Path, device: str) -> None:
        """GPU ``key`` runs on ``device`` now, its files in ``directory`` (a training Pod replaced by one with a newer
        hook writes its card elsewhere): its socket moves there. OSError where it cannot be bound there."""
        with self.lock:
            ex = self.core.executor(key)
            ex.device = device
            if ex.directory == directory:
                return
            old = ex.directory
            sock = self._socks.pop(key, None)
            if sock is not None:
                self._sel.unregister(sock)
                sock.close()
                with contextlib.suppress(FileNotFoundError):
                    (old / paths.AGENT_SOCKET_NAME).unlink()
            ex.directory = directory
            self._speaker.pop(key, None)
            self._verdicts.pop(key, None)
            if self._bound:
                self._bind_gpu(ex)
            log.info("%s: its files are in %s now (were in %s)", key, directory, old)

    def discover(self) -> list[GpuKey]:
        """Local mode: serve every GPU of the training whose hook has written a card (``<training dir>/stage-<k>/
        rank-<r>/hook.json``) and that is not served yet; the keys added. A card nobody's process holds (left by an
        earlier run) is no GPU to serve; an unreadable one is said once and skipped."""
        with self.lock:
            return self._discover()

    def _discover(self) -> list[GpuKey]:
        added: list[GpuKey] = []
        for path in sorted(self.training_dir.glob(f"stage-*/rank-*/{paths.HOOK_CARD_NAME}")):
            served = _served_by_name(path.parent)
            if served is not None and self.core.serves(paths.GpuKey(self.config.namespace, self.config.training,
                                                                   *served)):
                continue  # served already: its card is not read again
            try:
                card = read_card(path)
                if card.key.training_key != (self.config.namespace, self.config.training) or \
                        card.directory(self.config.run_dir) != path.parent:
                    raise ValueError(f"{path}: the card names {card.key}, not its directory")
            except (OSError, ValueError) as exc:
                if str(exc) not in self._unusable_cards and not isinstance(exc, FileNotFoundError):
                    self._unusable_cards.add(str(exc))
                    log.warning("ignoring a hook card: %s", exc)
                continue
            if self.core.serves(card.key) or hook_lock_held(path.parent) is False:
                continue
            stages = self.config.executors
            why = "discovered from its card" + (f"; its stage is beyond the --executors {stages} stages served "
                                                "from the start" if card.stage >= stages else "")
            device = card.device if card.device.startswith("cuda") else "cpu"
            try:
                self.add_gpu(card.key, path.parent, device, why)
            except (OSError, ValueError) as exc:
                log.error("%s", exc)
                continue
            added.append(card.key)
        return added

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
            self._unbind()  # the sockets bound before the one that failed
            self.isolation.close()  # e.g. quit the MPS daemon just started: run() will not do it
            raise
        with self.lock:
            self.core.start_serving()

    def _bind_gpu(self, ex: ExecutorState) -> None:
        """Bind GPU ``ex``'s datagram socket in its directory; OSError where it cannot be.

        Local mode makes the directory (the agent may start before the training's hook). Cluster mode does not: the
        directory is where the GPU's card was read, and one gone since (a training Pod's, removed with its volume)
        is not made again, where nobody would remove it; the GPU is then not served.

        The socket, and ``fills/`` where this makes it, belong to whoever owns the GPU's directory: the hook made it,
        as the training's UID. In the node's run directory that is the agent's own UID (training Pods share it to
        reach the directory by hostPath): nothing changes. In a training Pod's own directory (its CSI volume) the
        training runs as any UID, in a directory of mode 0700 that only its Pod mounts, and must be able to send to
        the socket (write permission): chowning it to the directory's owner gives exactly that UID what the hostPath
        layout gives the shared one, where a mode of 0666 would open it to every UID in the Pod. The agent, root on
        the node in that mode, reads it whoever owns it.
        """
        path = ex.directory / paths.AGENT_SOCKET_NAME
        # The length that matters is the hook's: in a Pod's directory the agent binds through a descriptor of it.
        if (problem := paths.socket_path_problem(paths.as_the_pod_sees(path))) is not None:
            raise OSError(problem)
        if self.discovering:
            paths.make_private_dir(path.parent)
        # Everything below goes through a descriptor of the directory, not through its path again, and follows no
        # link put in the place of the directory or of fills/: a training Pod owns its directory, and the agent, root
        # on the node, must not chmod, chown or bind where such a link points (the cluster agent has checked, as it
        # read the card, that the directory's path resolves inside the Pod's volume).
        dir_fd = os.open(ex.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            os.fchmod(dir_fd, 0o700)  # as make_private_dir tightens a directory that exists
            owner = os.fstat(dir_fd)
            # Where the GPU's fill jobs bind their sockets: made here too, for a training whose hook predates it
            # (a fill Pod's mount of it must find it there).
            try:
                os.mkdir(paths.FILLS_DIR_NAME, 0o700, dir_fd=dir_fd)
                _give(paths.FILLS_DIR_NAME, dir_fd, owner)
            except FileExistsError:
                pass
            fills_fd = os.open(paths.FILLS_DIR_NAME, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=dir_fd)
            try:
                os.fchmod(fills_fd, 0o700)
            finally:
                os.close(fills_fd)
            # Bound under a name the hook does not list (not *.sock), given to its owner, then renamed into place:
            # the hook lists its directory when it changes and greets a socket it finds once; one it found still
            # root's would refuse the greeting (EACCES), be dropped, and a chown after changes nothing the hook looks
            # at. The rename also replaces an earlier agent's socket in one step.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_BINDING_NAME, dir_fd=dir_fd)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            # The kernel attaches each sender's credentials, its PID named in this agent's PID namespace (a training
            # in a Pod included: the node agent has the host's), with no change on the hook's side.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            s.bind(f"/proc/self/fd/{dir_fd}/{_BINDING_NAME}")  # in the directory opened, whatever its path is now
            try:
                _give(_BINDING_NAME, dir_fd, owner)
                os.replace(_BINDING_NAME, paths.AGENT_SOCKET_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(_BINDING_NAME, dir_fd=dir_fd)
                raise
            _mark_changed(dir_fd)
            s.setblocking(False)
        except OSError:
            s.close()
            raise
        finally:
            os.close(dir_fd)
        self._socks[ex.key] = s
        self._sel.register(s, selectors.EVENT_READ, lambda _m, k=ex.key: self._on_datagrams(k))

    def _unbind(self) -> None:
        """Close every GPU's socket and remove its file (what ``_bind`` and ``add_gpu`` bound)."""
        for key, sock in self._socks.items():
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                (self.core.executor(key).directory / paths.AGENT_SOCKET_NAME).unlink()
        self._socks.clear()
        self._bound = False

    def _bind(self) -> None:
        """Bind the executors' sockets, serve metrics, write the ready file."""
        with self.lock:
            for ex in self.core.executors:
                self._bind_gpu(ex)
            self._bound = True
        if self.config.metrics:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_addr, self.metrics_port)
        if self.config.ready_file is not None:
            tmp = Path(f"{self.config.ready_file}.tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "metrics_port": self.metrics_port}) + "\n")
            tmp.replace(self.config.ready_file)
        status = self.core.isolation_status
        log.info("agent for training %r serving %d GPU(s) (%s) under %s in %s mode; isolation %s: %s",
                 self.config.training, len(self.core.executors), ", ".join(ex.device for ex in self.core.executors),
                 self.training_dir, self.config.mode.label, status.mode, status.state)

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
        if not self._bound:  # not started yet (an agent may serve no GPU yet: its sockets are bound as they come)
            self.start()
        self._supervisor_stop.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="bubbles-isolation", daemon=True)
        self._supervisor.start()
        # --exit-when-done: the stages' hooks are looked at every WATCH_INTERVAL_S; the core decides when it has ended.
        next_watch = self.clock() if self.config.exit_when_done else None
        # Local mode: the training's cards are read for GPUs not served yet every DISCOVER_INTERVAL_S.
        next_discovery = self.clock() if self.discovering else None
        try:
            while not self._stop:
                deadline = self.core.next_deadline_ns()
                for due in (next_watch, next_discovery):
                    if due is not None:
                        deadline = due if deadline is None else min(deadline, due)
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
                    if next_discovery is not None and now >= next_discovery:
                        next_discovery = now + int(DISCOVER_INTERVAL_S * 1e9)
                        self.discover()
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
                try:
                    proc.send_signal(signal.SIGKILL)
                except OSError as exc:
                    log.error("job %s: not killed at shutdown: %s", job.name, exc)
                proc.wait(1.0)
            self._drain_control(job)
            self.core.reaped_at_shutdown(job)
            self._execute()
        self._unbind()
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
        for key, pid, answer, transient in answers:
            self.core.training_membership(key, pid, answer, transient=transient)

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
                channel.proc.before_command(action.type, action.fields)  # control v5: the agent's fill socket names
                channel.out += control.encode(action.type, **action.fields)
                self._flush(action.job, channel)
        elif isinstance(action, Signal):
            channel = self._channels.get(action.job)
            if channel is not None:
                try:
                    channel.proc.send_signal(action.sig)
                except OSError as exc:  # never the end of this thread: the training's bubble signals go on being served
                    log.error("job %s: signal %d not delivered: %s", action.job.name, action.sig, exc)
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
                self.core.training_membership(action.key, action.pid, str(exc), transient=True)
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
            self._training_answers.append((action.key, action.pid, answer, transient))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"t")

    def _launch(self, action: Launch) -> None:
        job = action.job
        if job.state is FillState.STOPPED:
            return  # a gang's member stopped with another that failed to start, before its own launch came up
        gang = job.gang
        port = None
        if gang is not None:
            port = self._gang_ports.setdefault(gang.id, free_port())
            if job.gang_rank == gang.size - 1:
                del self._gang_ports[gang.id]  # its last member: the port is the processes' now
        try:
            # Isolated only while the backend works; otherwise (allowed unisolated) no client variables.
            env = self.isolation.client_env(action.device, job.spec.memory_bytes) if action.isolated else {}
            req = LaunchRequest(job.spec, action.socket_path, device=action.device, core=action.core, env=env,
                                gang_rank=job.gang_rank if gang is not None else None,
                                gang_size=gang.size if gang is not None else 1, gang_port=port)
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
    def _on_datagrams(self, key: GpuKey) -> None:
        sock = self._socks[key]
        for _ in range(1024):  # bounded, so one flooding GPU cannot starve the others
            try:
                data, pid = recv_with_pid(sock, wire.MAX_DATAGRAM_BYTES + 1)
            except BlockingIOError:
                return
            if pid is not None and not self._from_training(key, pid):
                continue
            self.core.on_datagram(key, data, pid)
            self._execute()

    def _from_training(self, key: GpuKey, pid: int) -> bool:
        """Whether ``pid`` may speak for GPU ``key`` (``core.sent_by_the_training``), looked up at most once a second
        per sender: the process found to hold the GPU's lock is remembered until another is, so the training's own
        datagrams cost a dictionary lookup; any other answer (refused, or taken because no process held the lock) is
        remembered for _VERDICT_TTL_S, so a sender flooding the socket costs one look at /proc/locks a second, and a
        restarted training that got a refused process's PID is heard within that second."""
        if self._speaker.get(key) == pid:
            return True
        now = self.clock()
        verdicts = self._verdicts.setdefault(key, {})
        known = verdicts.get(pid)
        if known is not None and known[1] > now:
            allowed, holder = known[0], known[2]
        else:
            if len(verdicts) >= _MAX_VERDICTS:
                verdicts.clear()  # a process per datagram: start over rather than grow
            holder = lock_holder(self.core.executor(key).directory / paths.HOOK_LOCK_NAME)
            allowed = sent_by_the_training(pid, holder)
            if allowed and holder == pid:
                self._speaker[key] = pid
                verdicts.clear()
                return True
            verdicts[pid] = (allowed, now + int(_VERDICT_TTL_S * 1e9), holder)
        if not allowed:
            self.core.foreign_datagram(key, pid, holder)
        return allowed

    def _hook_facts(self) -> dict[GpuKey, HookFacts]:
        """What each GPU's hook is found to be, for the core's ``watch_hooks``: its card, its lock, its process."""
        facts = {}
        for ex in self.core.executors:
            lock = None
            try:
                card = read_card(ex.directory / paths.HOOK_CARD_NAME)
            except FileNotFoundError:
                present: bool | None = False
            except (OSError, ValueError):
                present = None  # there, but not to be read now (being replaced, or planted): neither live nor gone
            else:
                present = True
                if card.lock:
                    lock = hook_lock_held(ex.directory)
            alive = process_alive(ex.training_pid) if ex.training_pid is not None else None
            facts[ex.key] = HookFacts(present, lock, alive)
        return facts

    # -- reporting ---------------------------------------------------------------------------------------
    @property
    def ended(self) -> Ending | None:
        """Why the agent stopped by itself (``--exit-when-done``), or None."""
        with self.lock:
            return self.core.ended

    def summary(self) -> str:
        """What was harvested, per GPU, for a person (``--exit-when-done`` prints it)."""
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
