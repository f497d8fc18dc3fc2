"""The agent in cluster mode: one process per node (a DaemonSet) serving every training on it.

What it does, as thin shells around pure code:

- **Discovers the node's trainings and their GPUs** from the cards their hooks write, one per rank of a stage
  (``<namespace>/<training>/stage-<k>/rank-<r>/hook.json``: the training Pod, the stage and rank, its GPU; read with
  ``bubbles.core.card``, which the hook writes with), in two places: the node's run directory (training Pods that
  mount it by hostPath, as the agent's UID), and the directory of each training Pod whose ``csi.bubbles.dev`` volume
  this agent published (``<run_dir>/_pods/<pod uid>/``, the ``pods`` it is given: the CSI node plugin's book). A
  card in a Pod's directory counts only for the namespace the kubelet named for that Pod, and carries the Pod's name
  as the kubelet gave it (``card.read_pod_cards``); a fill Pod's directory is never read for cards. Every path the
  agent uses for a GPU (its socket, its ``fills/``, its card and lock) is in the directory its card was found in:
  two Pods of one training on the node (a stage each, say) are two directories of one training. A training is its
  namespace and name: two trainings
  of one name in two namespaces are two. Each gets the same agent as local mode (``server.Agent`` around the pure
  ``AgentCore``: bubble signals, planning, watchdog, slowdown guard, isolation), running on its own thread, with an
  executor per card; a rank or stage whose card appears later is added to it as it appears. A card whose Pod changed
  means the training restarted: the GPU's bubbles are forgotten and re-measured before anything runs there again. A
  card before v4 (``<run_dir>/<training>/stage-<k>/``, one rank per stage) is served as rank 0 of 1, but no fill Pod
  is placed there: its fill sockets are not in the GPU directory a fill Pod mounts.
- **Keeps the operator's assignments** (``bubbles.agent.node.NodeBook``: idempotent by uid, attempt and generation).
- **Admits attaching fill processes**: the operator's fill Pod runs ``python -m bubbles.sdk``, which connects to
  ``<run_dir>/_attach/attach.sock`` and says which FillJob it is and which GPU it sees. Only an assigned job, seeing
  its assigned GPU, visible to the agent (so the watchdog can SIGKILL it), is admitted; the connection then becomes the
  job's control channel, exactly as a locally started process's socketpair. A gang job (its spec's ``gpus`` N > 1)
  attaches N processes of one uid, one per GPU of its assignment's ``ranks``, each saying its gang rank in ``hello``;
  they are welcomed (each with its GPU's fill socket and the gang's ``sockets``) and the job queued once all N are in.
  Until then each waits for its welcome; a gang still short ``node.GANG_ATTACH_S`` after its first process came is
  given up: the ones that came are refused with the reason, which the assignment's report carries.
- **Serves fill Pods' own attach sockets** where the node runs the CSI driver (``bubbles.agent.csi``, issue 36): a
  ``role: fill`` volume is published only for the fill Pod of a live assignment (``admit_fill_volume``), and its
  directory gets the Pod's own ``_attach/attach.sock`` (any UID of the Pod may connect; only that Pod mounts it). A
  process that connects there is that Pod's: its hello must name the Pod's fill job, and speak control v5, because the
  agent binds its fill sockets itself and passes them with the welcome (``bubbles.agent.fillsockets``).
- **Reports** every GPU (one ``StageReport`` per rank, with the device plugin's resource for its GPU where the agent
  serves one: ``gpu_resources``) and every assigned job (``report()``, served over gRPC by ``bubbles.agent.rpc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bubbles.core import card as cards
from bubbles.core import control, paths, versions
from bubbles.core.agentapi import AssignmentMessage
from bubbles.core.api import FillState, known_membership
from bubbles.core.card import Card, card_is_stale, read_cards, read_pod_cards
from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey
from bubbles.core.nodeaccess import CSI_DRIVER, Role
from bubbles.core.resources import HOOK_SILENCE_S, JobProgress, NodeReport, StageReport

from .config import AgentConfig
from .csi.publish import PodVolume
from .deviceplugin.guard import FillPodGpus
from .fillsockets import PassedFillSockets
from .launcher import FillProcess, Launcher, LaunchRequest
from .metrics import NodeMetrics
from .node import GANG_ATTACH_S, AssignedJob, AttachRefused, Decision, NodeBook
from .server import Agent

log = logging.getLogger("bubbles.agent.cluster")

HELLO_TIMEOUT_S = 5.0  # an attaching process must say who it is within this
FORGET_AFTER_S = 3600.0  # cancelled assignments are remembered this long (a late retry is then refused)


_CAP_KILL_HINT = ("the agent signals fill processes that run as other users (a fill Pod's runAsUser): it needs "
                  "CAP_KILL, which the chart's agent keeps (an agent run outside the chart: add it)")


def signal_problem(pid: int) -> str | None:
    """Why the agent could not signal process ``pid`` (pause, resume or SIGKILL it: the watchdog must be able to),
    in words; None where it can. Signal 0 checks the permission and sends nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"the process (pid {pid}) is gone"
    except PermissionError:
        return (f"the agent may not signal this process (pid {pid}, uid {_uid_of(pid)}), so its watchdog could not "
                f"stop it: {_CAP_KILL_HINT}")
    return None


def _uid_of(pid: int) -> str:
    try:
        return str(os.stat(f"/proc/{pid}").st_uid)
    except OSError:
        return "unknown"


# -- attached fill processes --------------------------------------------------------------------------------
class AttachedProcess(FillProcess):
    """A fill Pod's process, admitted over the attach socket: signalled through a pidfd (the agent sees its PID:
    hostPID), its exit seen on that pidfd. Its exit code is not the agent's to collect (not a child): -1."""

    def __init__(self, pid: int, conn: socket.socket, speaks_control: bool,
                 fill_sockets: PassedFillSockets | None = None) -> None:
        self.pid = pid
        self.exit_fd = os.pidfd_open(pid)
        self.conn = conn
        self.control = conn if speaks_control else None
        # Attached through its Pod's own socket (control v5): the fill sockets the agent bound and passed to it, whose
        # names the agent links at each arm and unlinks at each disarm; None: the process binds its own.
        self.fill_sockets = fill_sockets
        conn.setblocking(False)

    def before_command(self, type_: str, fields: dict[str, Any]) -> None:
        if self.fill_sockets is not None:
            self.fill_sockets.apply(type_, fields)

    def send_signal(self, sig: int) -> None:
        if self.exit_fd >= 0:
            try:
                signal.pidfd_send_signal(self.exit_fd, sig)
            except ProcessLookupError:
                pass
            except PermissionError as exc:  # admission checked it (signal_problem); the process changed its user since
                log.error("cannot send signal %d to fill process %d: %s; %s", sig, self.pid, exc, _CAP_KILL_HINT)

    def poll(self) -> int | None:
        return self.wait(0.0)

    def wait(self, timeout_s: float) -> int | None:
        if self.exit_fd < 0:
            return -1
        ready, _, _ = select.select([self.exit_fd], [], [], max(0.0, timeout_s))
        return -1 if ready else None

    def close(self) -> None:
        self.conn.close()
        if self.fill_sockets is not None:
            self.fill_sockets.remove()  # no stale name in the training's fills/, armed or not
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
            self.exit_fd = -1


TrainingKey = tuple[str, str]  # (namespace, training): a training, namespace-qualified (GpuKey.training_key)


class AttachLauncher:
    """Processes that attached and wait for their job's ``Launch``; ``for_training`` is the launcher a training's agent
    uses: its ``launch`` hands over the process that attached (already running) instead of starting one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (namespace, training, job name, gang rank) -> process
        self.pending: dict[tuple[str, str, str, int], AttachedProcess] = {}

    def offer(self, training: TrainingKey, job: str, proc: AttachedProcess, gang_rank: int = 0) -> None:
        with self.lock:
            self.pending[(*training, job, gang_rank)] = proc

    def withdraw(self, training: TrainingKey, job: str, gang_rank: int = 0) -> AttachedProcess | None:
        with self.lock:
            return self.pending.pop((*training, job, gang_rank), None)

    def for_training(self, training: TrainingKey) -> Launcher:
        launcher = self

        class _One(Launcher):
            def launch(self, request: LaunchRequest) -> FillProcess:
                proc = launcher.withdraw(training, request.spec.name, request.gang_rank or 0)
                if proc is None:
                    raise OSError(f"fill job {request.spec.name!r} has no attached process (its Pod has not "
                                  "connected, or it exited)")
                return proc

        return _One()


def peer_pid(conn: socket.socket) -> int:
    """The connecting process's PID as this process sees it (0 when it is in a PID namespace we do not see)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


# -- the node --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterConfig:
    """How ``bubbles agent --cluster`` runs on a node."""

    node: str
    template: AgentConfig  # per-training settings (mode, grace, budget, isolation); training/executors are set here
    gpus: Mapping[str, str] = field(default_factory=dict)  # GPU UUID -> this process's device ("cuda:N")
    scan_interval_s: float = 1.0
    hook_silence_s: float = HOOK_SILENCE_S  # a stage whose hook has been silent this long does not report a hook
    retire_after_s: float = 30.0  # a training with no card for this long is stopped (a restart writes a new one)

    def __post_init__(self) -> None:
        if not self.node:
            raise ValueError("the node's name is required (--node, or $NODE_NAME from the downward API)")
        if not self.scan_interval_s > 0 or not self.hook_silence_s > 0 or self.retire_after_s < 0:
            raise ValueError("scan interval and hook silence must be > 0 seconds, the retirement grace >= 0")


@dataclass(eq=False)
class _Training:
    namespace: str
    name: str
    agent: Agent
    thread: threading.Thread
    cards: dict[GpuKey, Card] = field(default_factory=dict)  # one per GPU whose hook runs here
    # GPU -> the card root its card was found under: the node's run directory, or its training Pod's directory
    roots: dict[GpuKey, Path] = field(default_factory=dict)

    @property
    def key(self) -> TrainingKey:
        return (self.namespace, self.name)

    def directory(self, key: GpuKey) -> Path:
        """GPU ``key``'s directory: where its card was found, its agent socket and ``fills/`` are."""
        return self.cards[key].directory(self.roots[key])


FoundCard = tuple[Card, Path]  # a card and the card root it was found under (the node's run dir or a Pod's dir)


def training_of(msg: AssignmentMessage) -> TrainingKey:
    """The training an assignment names (an operator before namespaces may name none: ``_local``, as its keys)."""
    return (msg.namespace or LOCAL_NAMESPACE, msg.training)


def newest_cards(found: Sequence[FoundCard]) -> tuple[dict[GpuKey, FoundCard], list[str]]:
    """One card per GPU, and what is wrong with the others: where a training's Pod was replaced by one with a newer
    hook, its old card (a stage directory before v4) and its new one name the same GPU until the old one is found
    stale; the newer counts. Two live cards of one version naming one GPU in two directories (two Pods, or a Pod and
    the node's run directory, each saying it is that rank) are a mistake in the training's set-up: the first found
    counts (the node's run directory first, then the Pods by namespace, name and uid), and the other is said."""
    out: dict[GpuKey, FoundCard] = {}
    problems = []
    for card, root in found:
        have = out.get(card.key)
        if have is None or card.version > have[0].version:
            out[card.key] = (card, root)
        elif card.version == have[0].version:
            problems.append(f"{card.directory(root)}: {card.key} has a live card in {have[0].directory(have[1])} too "
                            f"(Pod {have[0].pod}); served from there, not from Pod {card.pod}'s: give each process of "
                            "the training its own stage and rank")
    return out, problems


def training_volumes(volumes: Sequence[PodVolume]) -> list[PodVolume]:
    """The published volumes whose directories are read for cards: training Pods' only (a fill Pod's never), one per
    Pod (a Pod's volumes share its directory), in a fixed order (namespace, Pod, uid)."""
    seen: dict[str, PodVolume] = {}
    for v in sorted(volumes, key=lambda v: (v.namespace, v.pod, v.uid, v.volume_id)):
        if v.role is Role.TRAINING:
            seen.setdefault(v.uid, v)
    return list(seen.values())


class NodeAgent:
    """Every training on this node, the operator's assignments, the attach socket; see the module documentation.

    ``pods``: the ``csi.bubbles.dev`` volumes published on this node (``CsiNodePlugin.published``), asked at every
    scan; without it (no ``--csi``) only the node's run directory is read. ``gpu_resources``: {GPU UUID: the device
    plugin's extended resource for it} (``--device-plugin``), asked at every report; without it every GPU reports
    ``gpu_resource`` "".
    """

    def __init__(self, config: ClusterConfig, clock: Callable[[], int] = time.monotonic_ns,
                 pods: Callable[[], Sequence[PodVolume]] | None = None,
                 gpu_resources: Callable[[], Mapping[str, str]] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.run_dir = config.template.run_dir
        self.pods = pods
        self.gpu_resources = gpu_resources
        self.lock = threading.RLock()
        self.book = NodeBook(clock)
        self.launcher = AttachLauncher()
        self.trainings: dict[TrainingKey, _Training] = {}
        self.failures: dict[str, str] = {}  # uid -> why its process could not be queued
        # training -> its guard's limits: slowdown budget, largest fill share, source, tail risk
        self.limits: dict[TrainingKey, tuple[float | None, float | None, str, float | None]] = {}
        self.changed = threading.Condition(self.lock)
        self.version = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._problems_seen: set[str] = set()
        self._cardless_since: dict[TrainingKey, int] = {}  # training -> when its last card went
        # A gang's processes attached so far, waiting for their welcome: uid -> gang rank -> (connection, pid, GPU).
        self._gangs: dict[str, dict[int, tuple[socket.socket, int, GpuKey]]] = {}
        self._gang_via_pod: dict[tuple[str, int], bool] = {}  # (uid, gang rank): came through its Pod's own socket
        # Fill Pods' own attach sockets (their CSI volumes'), by Pod uid; the accept loop is woken when they change.
        self._pod_attach: dict[str, _PodAttach] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.metrics = NodeMetrics(self._registries, self._assignment_counts)
        self.metrics_port: int | None = None

    def _registries(self) -> list[Any]:
        with self.lock:
            return [tr.agent.metrics.registry for tr in self.trainings.values()]

    def _assignment_counts(self) -> dict[str, int]:
        counts = {"waiting": 0, "attached": 0}
        with self.lock:
            for have in self.book.jobs.values():
                if have.cancelled is None:
                    counts["attached" if have.attached_pid is not None else "waiting"] += 1
        return counts

    def serve_metrics(self, port: int, addr: str) -> int:
        """The node's Prometheus endpoint (every training and the node's own metrics); the bound port."""
        self.metrics_port = self.metrics.serve(port, addr)
        log.info("metrics on http://%s:%d/metrics", addr, self.metrics_port)
        return self.metrics_port

    # -- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        paths.make_private_dir(self.run_dir)
        paths.make_private_dir(paths.attach_dir(self.run_dir))
        path = paths.attach_socket(self.run_dir)
        if (problem := paths.socket_path_problem(path)) is not None:
            raise OSError(problem)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)  # node-local, and only this user's processes (the fill Pods run as it)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self.scan()
        for target, name in ((self._accept_loop, "bubbles-attach"), (self._scan_loop, "bubbles-scan")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("node %s: cluster mode under %s (attach socket %s)", self.config.node, self.run_dir, path)

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        for t in self._threads:
            t.join(5.0)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                paths.attach_socket(self.run_dir).unlink()
        with self.lock:
            pods, self._pod_attach = list(self._pod_attach.values()), {}
        for pod in pods:  # an agent started again binds them anew (CsiNodePlugin.start)
            pod.close()
        with self.lock:
            trainings = list(self.trainings.values())
        for tr in trainings:
            tr.agent.request_stop()
        for tr in trainings:
            tr.thread.join(10.0)
        self.metrics.close()

    def _bump(self) -> None:
        with self.changed:
            self.version += 1
            self.changed.notify_all()

    # -- discovery ------------------------------------------------------------------------------------------
    def _scan_loop(self) -> None:
        while not self._stop.wait(self.config.scan_interval_s):
            try:
                self.scan()
                self.expire_gangs()
            except Exception:  # a bug here must not end discovery
                log.exception("scanning %s failed", self.run_dir)

    def scan(self) -> None:
        """Read the cards: start an agent for each new training, add the GPUs a training's agent does not serve yet,
        reset GPUs whose Pod or process changed."""
        found, problems = self._read_cards()
        live = []
        for card, root in found:
            if card_is_stale(root, card):
                log.info("%s: the process of Pod %s/%s is gone; its hook card is removed", card.key, card.namespace,
                         card.pod)
            else:
                live.append((card, root))
        by_key, twins = newest_cards(live)
        problems += twins
        for p in problems:
            if p not in self._problems_seen:
                log.warning("ignoring a hook card: %s", p)
        self._problems_seen = set(problems)  # said once while it lasts; again if it comes back
        changed = False
        retired: list[_Training] = []
        with self.lock:
            for key, (card, root) in sorted(by_key.items()):
                tr = self.trainings.get(key.training_key)
                if tr is None:
                    tr = self._start_training(key.training_key,
                                              [f for k, f in by_key.items() if k.training_key == key.training_key])
                    if tr is None:
                        continue
                    changed = True
                old = tr.cards.get(key)
                if old == card and tr.roots.get(key) == root:
                    continue
                if not self._serve(tr, card, root):
                    continue
                tr.cards[key] = card
                tr.roots[key] = root
                changed = True
                if old is not None and old.pod != card.pod:
                    tr.agent.reset_gpu(key, f"training Pod {old.pod} was replaced by {card.pod}: the GPU's bubbles "
                                            "are measured again")
                elif old is not None and old.instance != card.instance:
                    tr.agent.reset_gpu(key, f"the training process of {card.pod} restarted: the GPU's bubbles are "
                                            "measured again")
            # A GPU whose card went (its process is gone) is no longer reported. A training with no card left for
            # retire_after_s ended (its hooks detached, or their processes are gone; a restart writes a new card
            # within that): its agent stops, rather than serve (and check the isolation of) it for good.
            now = self.clock()
            for tkey, tr in list(self.trainings.items()):
                for key in [k for k in tr.cards if k not in by_key]:
                    # Its socket stays bound (a descriptor, its file gone with a removed Pod directory) until the
                    # GPU's card comes back, anywhere (the socket moves there), or its training retires.
                    del tr.cards[key]
                    del tr.roots[key]
                    changed = True
                if tr.cards:
                    self._cardless_since.pop(tkey, None)
                    continue
                since = self._cardless_since.setdefault(tkey, now)
                if now - since >= int(self.config.retire_after_s * 1e9):
                    retired.append(self.trainings.pop(tkey))
                    del self._cardless_since[tkey]
            for uid in self.book.forget_before(self.clock() - int(FORGET_AFTER_S * 1e9)):
                self.failures.pop(uid, None)
            # A training's limits are kept while it runs here or a job of it is assigned (it may start after).
            wanted = set(self.trainings) | {training_of(j.message) for j in self.book.jobs.values()}
            self.limits = {t: lim for t, lim in self.limits.items() if t in wanted}
        for tr in retired:  # outside the node's lock: the training's loop may be waiting for it
            log.info("training %s/%s: no GPU of it runs on this node any more; its agent stops", tr.namespace,
                     tr.name)
            tr.agent.request_stop()
            tr.thread.join(10.0)
        if changed or retired:
            self._bump()

    def _read_cards(self) -> tuple[list[FoundCard], list[str]]:
        """Every card in the node's run directory and in each training Pod's directory, with its card root, and what
        is wrong with the ones that do not count."""
        cards, problems = read_cards(self.run_dir)
        found = [(c, self.run_dir) for c in cards]
        for volume in training_volumes(self.pods() if self.pods is not None else ()):
            root = Path(volume.directory)
            cards, more = read_pod_cards(root, volume.namespace, volume.pod)
            found += [(c, root) for c in cards]
            problems += more
        return found, problems

    def _serve(self, tr: _Training, card: Card, root: Path) -> bool:
        """Make ``tr``'s agent serve ``card``'s GPU where its card was found (added, moved to its card's directory,
        its device updated); False, said, where its socket cannot be bound (tried again at the next scan)."""
        device = self._device(card)
        directory = card.directory(root)
        try:
            if not tr.agent.core.serves(card.key):
                tr.agent.add_gpu(card.key, directory, device, f"its card appeared (Pod {card.pod}, card "
                                                              f"v{card.version})")
            else:
                tr.agent.set_gpu(card.key, directory, device)
        except OSError as exc:
            log.error("%s: not served: %s", card.key, exc)
            return False
        if card.version < cards.RANKS_VERSION:
            log.warning("%s: its hook (Pod %s) writes card v%d, before a card per rank: served as rank 0 of 1, but no "
                        "fill Pod is placed there; upgrade bubbles in the training's image", card.key, card.pod,
                        card.version)
        return True

    def _device(self, card: Card) -> str:
        if card.gpu_uuid and card.gpu_uuid in self.config.gpus:
            return self.config.gpus[card.gpu_uuid]
        return card.device if card.device.startswith("cuda") else "cpu"

    def _start_training(self, tkey: TrainingKey, found: list[FoundCard]) -> _Training | None:
        """An agent for a training first seen here, serving the GPUs of ``found`` (the ones whose sockets cannot be
        bound are tried again at the next scan); None, said, where its agent cannot start (a GPU's socket cannot be
        bound: its directory went with its Pod between the read and the bind, say): tried again at the next scan."""
        namespace, name = tkey
        # relaunch=False: a fill Pod's process attached once; a job stopped here is restarted by the operator (a new
        # Pod, within the FillJob's restartLimit), not by this agent, which has no process to start.
        config = dataclasses.replace(self.config.template, training=name, namespace=namespace, devices=(),
                                     relaunch=False, metrics=False, ready_file=None)
        # The isolation checks the GPUs of the cards seen now (their compute mode); ranks added later on other GPUs
        # of the node are not checked again.
        agent = Agent(config, launcher=self.launcher.for_training(tkey), clock=self.clock,
                      gpus=[(c.key, c.directory(root), self._device(c)) for c, root in found])
        try:
            agent.start()
        except OSError as exc:
            log.error("training %s/%s: not served yet (tried again at the next scan): %s", namespace, name, exc)
            return None
        if tkey in self.limits:
            agent.set_guard_limits(*self.limits[tkey])
        thread = threading.Thread(target=agent.run, name=f"bubbles-{namespace}-{name}", daemon=True)
        thread.start()
        log.info("training %s/%s: serving %d GPU(s) on this node (%s)", namespace, name, len(found),
                 ", ".join(f"stage {c.stage} rank {c.rank} in Pod {c.pod}" for c, _ in found))
        tr = _Training(namespace, name, agent, thread)
        self.trainings[tkey] = tr
        return tr

    # -- the operator's side (served over gRPC) ---------------------------------------------------------------
    def assign(self, msg: AssignmentMessage) -> Decision:
        """Record an assignment (StaleAssignment if older than the one held); stop a superseded run."""
        with self.lock:
            decision = self.book.assign(msg)
            if decision.stop is not None:
                self._stop_run(decision.stop, f"superseded: {decision.message}")
            self.failures.pop(msg.uid, None)
            if msg.slowdown_budget is not None or msg.max_fill_share is not None or msg.tail_risk is not None:
                limits = (msg.slowdown_budget, msg.max_fill_share, f"PipelineTraining {msg.namespace}/{msg.training}",
                          msg.tail_risk)
                self.limits[training_of(msg)] = limits
                if (tr := self.trainings.get(training_of(msg))) is not None:
                    tr.agent.set_guard_limits(*limits)
        log.info("assign: %s", decision.message)
        self._bump()
        return decision

    def cancel(self, uid: str, reason: str) -> bool:
        with self.lock:
            have = self.book.cancel(uid, reason)
            if have is not None:
                self._stop_run(have, f"cancelled: {have.cancelled}")
        if have is not None:
            log.info("cancel: %s/%s (%s)", have.message.namespace, have.message.name, have.cancelled)
            self._bump()
        return have is not None

    def fill_pod_gpus(self) -> tuple[FillPodGpus, ...]:
        """Every fill Pod assigned to this node (cancelled ones with their reason) and the GPUs of its assignment,
        for the device plugin's PreStartContainer check (``deviceplugin.guard``). A GPU is the one its card names now
        (the training's hook writes where it runs); without a card, a one-GPU job's ``gpu_uuid``; a GPU known by
        neither is left out."""
        out = []
        with self.lock:
            for have in self.book.jobs.values():
                msg = have.message
                tr = self.trainings.get(training_of(msg))
                uuids = []
                for key in msg.gpu_keys:
                    card = tr.cards.get(key) if tr is not None else None
                    uuid = card.gpu_uuid if card is not None else None
                    if not uuid and len(msg.ranks) == 1:
                        uuid = msg.gpu_uuid
                    if uuid:
                        uuids.append(uuid)
                out.append(FillPodGpus(msg.namespace, msg.fill_pod, msg.name,
                                       "/".join(training_of(msg)), tuple(uuids), have.cancelled))
        return tuple(out)

    def _stop_run(self, have: AssignedJob, reason: str) -> None:
        tr = self.trainings.get(training_of(have.message))
        for rank in range(have.gang_size):
            pending = self.launcher.withdraw(training_of(have.message), have.job_name, rank)
            if pending is not None:
                pending.close()
        for conn, _pid, _key in self._gangs.pop(have.uid, {}).values():
            _refuse(conn, f"fill job {have.message.name} was stopped before its gang started: {reason}")
        if tr is not None:
            tr.agent.cancel(have.job_name, reason)

    def report(self) -> NodeReport:
        """Every GPU with a card (one StageReport per rank of a stage), every assignment held (cancelled ones
        excepted)."""
        now = self.clock()
        silence_ns = int(self.config.hook_silence_s * 1e9)
        resources = self.gpu_resources() if self.gpu_resources is not None else {}
        stages: list[StageReport] = []
        jobs: list[JobProgress] = []
        with self.lock:
            for tr in self.trainings.values():
                with tr.agent.lock:
                    core = tr.agent.core
                    ledger = core.ledgers["harvest"]
                    baseline = core.guard.baseline_s if core.guard is not None else None
                    held = ledger.stages()
                    for key, card in sorted(tr.cards.items()):
                        ex = core.executor(key)
                        heard = ex.last_message_ns is not None and now - ex.last_message_ns <= silence_ns
                        totals = ledger.totals(key, percentiles=False) if key in held else None
                        stages.append(StageReport(
                            card.namespace, tr.name, card.pod, key.stage, ex.device,
                            ex.cycle.to_dict() if ex.cycle is not None else None, heard, ex.last_iteration_s,
                            baseline, totals.bubble_s if totals else 0.0, totals.filled_s if totals else 0.0,
                            card.gpu_uuid, known_membership(ex.training_membership.wire), key.rank, card.ranks,
                            resources.get(card.gpu_uuid, "") if card.gpu_uuid else ""))
            for uid, have in self.book.jobs.items():
                if have.cancelled is not None:
                    continue
                jobs.append(self._progress(uid, have))
        return NodeReport(self.config.node, tuple(stages), tuple(jobs))

    def _progress(self, uid: str, have: AssignedJob) -> JobProgress:
        attempt = have.message.attempt
        if uid in self.failures:
            return JobProgress(uid, FillState.STOPPED, reason=self.failures[uid], attempt=attempt)
        tr = self.trainings.get(training_of(have.message))
        record = None
        if tr is not None:
            with tr.agent.lock:
                record = next((j for j in reversed(tr.agent.jobs) if j.name == have.job_name and j.gang_rank == 0),
                              None)
                if record is not None and record.gang is not None:  # one progress: its processes step together
                    killed = sum(m.reason.startswith("killed") for m in record.gang.members)
                    return JobProgress(uid, record.state, record.gang.steps, record.gang.flops, record.reason,
                                       killed, attempt)
                if record is not None:
                    return JobProgress(uid, record.state, record.steps, record.flops, record.reason,
                                       int(record.reason.startswith("killed")), attempt)
        if have.gang_pids:
            return JobProgress(uid, FillState.SUBMITTED, reason=f"{len(have.gang_pids)} of {have.gang_size} processes "
                               f"of Pod {have.message.fill_pod} attached; waiting for the others", attempt=attempt)
        return JobProgress(uid, FillState.SUBMITTED, reason=f"waiting for Pod {have.message.fill_pod} to attach",
                           attempt=attempt)

    # -- attaching fill processes --------------------------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    def _accept_loop(self) -> None:
        """Accept on the node's attach socket and on every fill Pod's own; each connection is welcomed on a thread of
        its own. Ends when the agent stops; a listener closed under it (its Pod's volume unpublished) is skipped."""
        assert self._listener is not None
        while not self._stop.is_set():
            with self.lock:
                listening: dict[socket.socket, PodVolume | None] = {self._listener: None}
                listening.update((p.listener, p.volume) for p in self._pod_attach.values())
            try:
                ready, _, _ = select.select([s for s in listening if s.fileno() >= 0] + [self._wake_r], [], [], 0.5)
            except (OSError, ValueError):  # a listener closed between the snapshot and the call: take another
                continue
            for sock in ready:
                if sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                try:
                    conn, _ = sock.accept()
                except OSError:  # taken by nobody else: closed meanwhile (EBADF), or the peer gave up
                    continue
                conn.setblocking(True)
                threading.Thread(target=self._welcome, args=(conn, listening[sock]), name="bubbles-hello",
                                 daemon=True).start()

    def _welcome(self, conn: socket.socket, pod: PodVolume | None = None) -> None:
        """Read one hello, admit or refuse; never raises (a bad client costs one connection)."""
        try:
            self.attach(conn, pod)
        except Exception:
            log.exception("attaching a fill process failed")
            conn.close()

    # -- fill Pods' own attach sockets (their CSI volumes: bubbles.agent.csi.plugin.FillPods) ----------------------
    def admit_fill_volume(self, volume: PodVolume) -> str | None:
        """Why ``volume``'s Pod may not have a ``role: fill`` volume: it is not the fill Pod of a live assignment here
        (the operator assigns before it creates the Pod; the kubelet retries a refused publish). None: it may."""
        with self.lock:
            if self.book.fill_pod_job(volume.namespace, volume.pod) is not None:
                return None
        return (f"Pod {volume.namespace}/{volume.pod} is not a fill Pod the operator assigned to this node (none of "
                "its live assignments names it): only the operator's fill Pods may use role fill; a training's Pod "
                "sets role: training")

    def fill_volume_published(self, volume: PodVolume) -> None:
        """Listen on the Pod's own attach socket, ``<its directory>/_attach/attach.sock`` (at ``_attach/attach.sock``
        in its volume: where the SDK looks), reachable by the Pod's processes whatever their UID (only that Pod mounts
        the directory). Idempotent; OSError where it cannot be bound."""
        with self.lock:
            have = self._pod_attach.get(volume.uid)
            if have is not None:
                have.volume_ids.add(volume.volume_id)
                return
            self._pod_attach[volume.uid] = _PodAttach.bind(volume)
        log.info("fill Pod %s/%s: its attach socket is %s", volume.namespace, volume.pod,
                 self._pod_attach[volume.uid].path)
        self._wake()

    def fill_volume_unpublished(self, volume: PodVolume) -> None:
        """The Pod's volume goes: with its last one, its attach socket is closed and removed (a process attached
        through it keeps its connection: it ends with the Pod)."""
        with self.lock:
            have = self._pod_attach.get(volume.uid)
            if have is None:
                return
            have.volume_ids.discard(volume.volume_id)
            if have.volume_ids:
                return
            del self._pod_attach[volume.uid]
        have.close()
        self._wake()

    def pod_attach_socket(self, pod_uid: str) -> Path | None:
        """Where the fill Pod ``pod_uid``'s own attach socket listens (node path), or None."""
        with self.lock:
            have = self._pod_attach.get(pod_uid)
            return have.path if have is not None else None

    def _pod_problem(self, pod: PodVolume, uid: str) -> str | None:
        """Why a process that connected on ``pod``'s own attach socket, saying it is fill job ``uid``, is not that
        Pod's process to admit; None where it is."""
        owner = self.book.fill_pod_job(pod.namespace, pod.pod)
        if owner is None:
            return (f"Pod {pod.namespace}/{pod.pod} is not the fill Pod of any live assignment on this node "
                    "(cancelled, or replaced by a new attempt): its attach socket admits no process")
        if owner.uid != uid:
            return (f"this process of Pod {pod.namespace}/{pod.pod} says it is fill job uid {uid}, but the Pod runs "
                    f"fill job {owner.message.name} (uid {owner.uid}): a fill Pod's attach socket admits its own fill "
                    f"job's processes only (check ${control.UID_ENV} in the Pod's spec)")
        return None

    def _fill_socket(self, tr: _Training, key: GpuKey, job: str) -> Path:
        """Where ``job``'s fill socket on GPU ``key`` is: in the GPU's ``fills/`` where the training's agent serves it
        (as the agent's ``arm`` names it)."""
        with tr.agent.lock:
            directory = tr.agent.core.executor(key).directory
        return directory / paths.FILLS_DIR_NAME / paths.fill_socket(self.run_dir, key, job).name

    def attach(self, conn: socket.socket, pod: PodVolume | None = None) -> AssignedJob | None:
        """Admit the process on ``conn`` (it is then the job's control channel) or refuse it with the reason.
        ``pod``: it connected on that fill Pod's own attach socket, so it is that Pod's (the kubelet named the Pod
        when it published the volume): its hello must name the Pod's fill job, and the agent binds its fill sockets
        and passes them with the welcome (control v5)."""
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            line = _read_line(conn)
            hello = control.parse_hello(line)
            pid = peer_pid(conn)
        except (OSError, control.ControlError) as exc:
            _refuse(conn, f"bad hello: {exc}")
            self.metrics.refused.inc()
            return None
        uid, attempt = hello["uid"], hello["attempt"]
        needed = control.MIN_VERSION if pod is None else control.FD_VERSION
        if control.peer_version(hello) < needed:
            why = versions.needs_newer(f"fill job {uid}'s SDK", "control", control.peer_version(hello), needed,
                                       "bubbles in the fill job's image")
            if pod is not None:
                why += (f" (Pod {pod.namespace}/{pod.pod} attaches through its own {CSI_DRIVER} volume, where the "
                        "agent binds its fill sockets and passes them to it)")
            _refuse(conn, why)
            self.metrics.refused.inc()
            return None
        if hello.unknown:
            log.info("fill job %s: its hello carries field(s) %s this agent does not know (a newer SDK): ignored",
                     uid, ", ".join(hello.unknown))
        if (problem := signal_problem(pid)) is not None:
            _refuse(conn, problem)
            self.metrics.refused.inc()
            log.error("refused a fill process (pid %d, fill job uid %s): %s", pid, uid, problem)
            return None
        with self.lock:
            if pod is not None and (problem := self._pod_problem(pod, uid)) is not None:
                _refuse(conn, problem)
                self.metrics.refused.inc()
                log.warning("refused a fill process (pid %d) of Pod %s/%s: %s", pid, pod.namespace, pod.pod, problem)
                return None
            have = self.book.jobs.get(uid)
            if have is not None and have.gang_size > 1:
                return self._attach_gang(conn, hello, pid, pod)
            fills: PassedFillSockets | None = None
            try:
                if have is not None and have.cancelled is None and have.message.attempt != attempt:
                    raise AttachRefused(f"this Pod runs attempt {attempt} of fill job {have.message.name}, but "
                                        f"attempt {have.message.attempt} is the one assigned")
                have = self.book.attach(uid, pid, hello.get("gpu"))
                msg = have.message
                tr = self.trainings.get(training_of(msg))
                key = self._gpu_for(tr, msg, hello.get("gpu"))
                assert tr is not None  # _gpu_for refuses otherwise
                card = tr.cards[key]
                if card.version < cards.RANKS_VERSION:
                    # Its bubble signals go to fill sockets in the stage directory of the old layout, not in the GPU
                    # directory a fill Pod mounts: admitted, the job would sit at 0 steps, saying nothing.
                    raise AttachRefused(versions.needs_newer(
                        f"the bubbles hook in training {msg.training}'s Pod {card.pod}", "card", card.version,
                        cards.RANKS_VERSION, "bubbles in the training's image") + " (before card "
                        f"v{cards.RANKS_VERSION} the hook signals fill jobs in {card.directory(self.run_dir)}/"
                        f"{paths.FILLS_DIR_NAME}, not in {paths.gpu_relpath(key)}/{paths.FILLS_DIR_NAME}, the "
                        f"directory a fill Pod placed on {key} mounts)")
                sock = self._fill_socket(tr, key, have.job_name)
                # The welcome goes first, on the blocking socket: the agent's commands (init) follow it on the
                # same stream once the job is launched, from the non-blocking socket AttachedProcess makes of it.
                welcome = control.encode("welcome", job=have.job_name, socket=str(sock), stage=msg.stage,
                                         protocol=control.VERSION)
                if pod is None:
                    conn.sendall(welcome)
                else:  # a plain command listens on no socket: it is paused and resumed from outside
                    fills = PassedFillSockets([sock]) if msg.spec.iterative else None
                    _send_welcome(conn, have.job_name, sock, msg.stage, [sock], fills)
                proc = AttachedProcess(pid, conn, speaks_control=msg.spec.iterative, fill_sockets=fills)
            except (AttachRefused, OSError) as exc:
                if fills is not None:
                    fills.remove()
                if have is not None and have.attached_pid == pid:
                    self.book.detached(uid)
                _refuse(conn, str(exc))
                self.metrics.refused.inc()
                log.warning("refused a fill process (pid %d, uid %s): %s", pid, uid, exc)
                return None
            spec = dataclasses.replace(msg.spec, name=have.job_name, stage=msg.stage)
            self.launcher.offer(tr.key, have.job_name, proc)
            try:
                tr.agent.submit_on(spec, key)
            except ValueError as exc:
                self.launcher.withdraw(tr.key, have.job_name)
                proc.close()
                self.failures[uid] = f"not admitted: {exc}"
                log.error("fill job %s/%s not admitted: %s", msg.namespace, msg.name, exc)
        log.info("fill job %s/%s attempt %d attached (pid %d) to %s", msg.namespace, msg.name, attempt, pid, key)
        self._bump()
        return have


    def _attach_gang(self, conn: socket.socket, hello: control.ControlMessage, pid: int,
                     pod: PodVolume | None = None) -> AssignedJob | None:
        """``attach`` for one process of a gang job (under the node's lock): admitted and parked until all N are
        in, then all welcomed and the job queued; or refused, the reason said. Through the Pod's own socket
        (``pod``), the leader (gang rank 0, which listens for the gang) is passed every GPU's fill socket, the
        followers none."""
        uid, attempt, rank = hello["uid"], hello["attempt"], hello.get("gang_rank")
        have = self.book.jobs[uid]
        msg = have.message
        try:
            if have.cancelled is None and msg.attempt != attempt:
                raise AttachRefused(f"this Pod runs attempt {attempt} of fill job {msg.name}, but attempt "
                                    f"{msg.attempt} is the one assigned")
            if len(msg.ranks) != have.gang_size:
                raise AttachRefused(f"fill job {msg.name} asks for {have.gang_size} GPUs but was assigned ranks "
                                    f"{list(msg.ranks)} of stage {msg.stage}: the operator places one rank per GPU")
            have = self.book.attach_gang(uid, pid, rank)
        except AttachRefused as exc:
            _refuse(conn, str(exc))
            self.metrics.refused.inc()
            log.warning("refused a fill process (pid %d, uid %s): %s", pid, uid, exc)
            return None
        assert rank is not None
        try:
            tr = self.trainings.get(training_of(msg))
            key = self._gang_gpu_for(tr, msg, hello.get("gpu"), rank, self._gangs.get(uid, {}))
            assert tr is not None
            card = tr.cards[key]
            if card.version < cards.RANKS_VERSION:
                raise AttachRefused(versions.needs_newer(
                    f"the bubbles hook in training {msg.training}'s Pod {card.pod}", "card", card.version,
                    cards.RANKS_VERSION, "bubbles in the training's image"))
        except AttachRefused as exc:
            self.book.left_gang(uid, rank)
            _refuse(conn, str(exc))
            self.metrics.refused.inc()
            log.warning("refused gang rank %d of fill job %s (pid %d): %s", rank, msg.name, pid, exc)
            return None
        if uid not in self._gangs:  # a gang's first: what an earlier, stopped one of it left goes
            self._gang_via_pod = {k: v for k, v in self._gang_via_pod.items() if k[0] != uid}
        waiting = self._gangs.setdefault(uid, {})
        waiting[rank] = (conn, pid, key)
        self._gang_via_pod[(uid, rank)] = pod is not None
        log.info("fill job %s/%s: gang rank %d attached (pid %d) on %s; %d of %d in", msg.namespace, msg.name, rank,
                 pid, key, len(waiting), have.gang_size)
        if len(waiting) < have.gang_size:
            self._bump()
            return have
        del self._gangs[uid]
        via_pod = {r: self._gang_via_pod.pop((uid, r), False) for r in range(have.gang_size)}
        keys = [waiting[r][2] for r in range(have.gang_size)]
        procs: list[AttachedProcess] = []
        fills: PassedFillSockets | None = None
        try:
            for r in range(have.gang_size):
                conn_r, pid_r, key_r = waiting[r]
                own = self._fill_socket(tr, key_r, have.job_name)
                socks = [own, *(self._fill_socket(tr, k, have.job_name) for k in keys if k != key_r)]
                sockets = [str(p) for p in socks]
                fills = None
                if not via_pod[r]:
                    conn_r.sendall(control.encode("welcome", job=have.job_name, socket=str(own), stage=msg.stage,
                                                  protocol=control.VERSION, sockets=sockets))
                else:  # the leader listens on the gang's every GPU; a follower on none
                    fills = PassedFillSockets(socks) if r == 0 else None
                    _send_welcome(conn_r, have.job_name, own, msg.stage, socks, fills)
                procs.append(AttachedProcess(pid_r, conn_r, speaks_control=True, fill_sockets=fills))
                fills = None
        except OSError as exc:
            if fills is not None:
                fills.remove()
            for proc in procs:
                proc.close()
            for conn_r, _, _ in waiting.values():
                conn_r.close()
            self.book.detached(uid)
            self.failures[uid] = f"not admitted: a process of its gang went away as it started ({exc})"
            log.error("fill job %s/%s: %s", msg.namespace, msg.name, self.failures[uid])
            return None
        spec = dataclasses.replace(msg.spec, name=have.job_name, stage=msg.stage)
        for r, proc in enumerate(procs):
            self.launcher.offer(tr.key, have.job_name, proc, r)
        try:
            tr.agent.submit_on(spec, keys)
        except ValueError as exc:
            for r, proc in enumerate(procs):
                self.launcher.withdraw(tr.key, have.job_name, r)
                proc.close()
            self.failures[uid] = f"not admitted: {exc}"
            log.error("fill job %s/%s not admitted: %s", msg.namespace, msg.name, exc)
        log.info("fill job %s/%s attempt %d: all %d processes of its gang attached (%s)", msg.namespace, msg.name,
                 attempt, have.gang_size, ", ".join(str(k) for k in keys))
        self._bump()
        return have

    def expire_gangs(self) -> None:
        """Give up gangs still short of processes ``node.GANG_ATTACH_S`` after their first attached: refuse the ones
        that came, and report why (the operator restarts the job in a new Pod, within its restartLimit)."""
        with self.lock:
            overdue = self.book.gangs_overdue(self.clock())
            for have in overdue:
                waiting = self._gangs.pop(have.uid, {})
                missing = sorted(set(range(have.gang_size)) - set(waiting))
                why = (f"only {len(waiting)} of the {have.gang_size} processes of its gang attached within "
                       f"{GANG_ATTACH_S:g} s (gang ranks {', '.join(map(str, missing))} did not: see Pod "
                       f"{have.message.fill_pod}'s log)")
                for r, (conn, _, _) in waiting.items():
                    self._gang_via_pod.pop((have.uid, r), None)
                    _refuse(conn, why)
                self.failures[have.uid] = f"not admitted: {why}"
                log.error("fill job %s/%s %s", have.message.namespace, have.message.name, self.failures[have.uid])
        if overdue:
            self._bump()

    def _gang_gpu_for(self, tr: _Training | None, msg: AssignmentMessage, seen_gpu: str | None, rank: int,
                      taken: Mapping[int, tuple[socket.socket, int, GpuKey]]) -> GpuKey:
        """The GPU of gang rank ``rank``'s process: of the assignment's GPUs, the one whose card names the GPU it sees,
        else the ``rank``-th (``_gpu_for``); AttachRefused where one has no hook here, or another rank's process runs
        on it."""
        key = self._gpu_for(tr, msg, seen_gpu, otherwise=rank)
        other = next((r for r, (_, _, k) in taken.items() if k == key), None)
        if other is not None:
            raise AttachRefused(f"gang rank {rank}'s process runs on {key}, where gang rank {other}'s does already: "
                                "each process of a gang needs a GPU of its own (CUDA_VISIBLE_DEVICES)")
        return key

    def _gpu_for(self, tr: _Training | None, msg: AssignmentMessage, seen_gpu: str | None,
                 otherwise: int = 0) -> GpuKey:
        """The GPU an attaching process of ``msg`` runs on: of the GPUs the assignment names (``msg.gpu_keys``), the
        one whose card names the GPU the process sees, else the ``otherwise``-th (the first: one process per fill
        job). AttachRefused, naming the GPU, where one of them has no hook here."""
        keys = msg.gpu_keys
        missing = [k for k in keys if tr is None or k not in tr.cards]
        if missing:
            raise AttachRefused(f"{missing[0]} (stage {missing[0].stage} rank {missing[0].rank} of training "
                                f"{msg.training}) has no hook on this node (no card): is the training Pod running "
                                "with the bubbles hook, and does the stage have that rank here?")
        assert tr is not None
        return next((k for k in keys if seen_gpu and tr.cards[k].gpu_uuid == seen_gpu), keys[otherwise])


@dataclass
class _PodAttach:
    """A fill Pod's own attach socket, listening in its CSI volume's directory for as long as a volume of it is
    published (``volume_ids``)."""

    volume: PodVolume
    listener: socket.socket
    path: Path
    volume_ids: set[str]

    @classmethod
    def bind(cls, volume: PodVolume) -> _PodAttach:
        """Listen at ``<volume.directory>/_attach/attach.sock``. The ``_attach`` directory is in the Pod's reach (its
        volume is writable by it): a link or file planted there is replaced, and the socket is bound through the
        directory's descriptor, so nothing the Pod renames meanwhile sends the bind elsewhere. OSError saying what."""
        directory = Path(volume.directory) / paths.ATTACH_DIR_NAME
        path = directory / paths.ATTACH_SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                directory.unlink()
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=POD_ATTACH_DIR_MODE)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.chmod(fd, POD_ATTACH_DIR_MODE)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(paths.ATTACH_SOCKET_NAME, dir_fd=fd)  # an earlier agent's
            listener.bind(f"/proc/self/fd/{fd}/{paths.ATTACH_SOCKET_NAME}")
            os.chmod(paths.ATTACH_SOCKET_NAME, POD_ATTACH_SOCKET_MODE, dir_fd=fd, follow_symlinks=False)
            listener.listen(16)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise OSError(exc.errno, f"cannot listen on fill Pod {volume.namespace}/{volume.pod}'s attach socket "
                                     f"{path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        return cls(volume, listener, path, {volume.volume_id})

    def close(self) -> None:
        self.listener.close()
        with contextlib.suppress(OSError):
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.unlink(paths.ATTACH_SOCKET_NAME, dir_fd=fd)
            finally:
                os.close(fd)


# The Pod's processes reach the socket whatever their UID: only that Pod mounts the directory.
POD_ATTACH_DIR_MODE = 0o755
POD_ATTACH_SOCKET_MODE = 0o666


def _send_welcome(conn: socket.socket, job: str, own: Path, stage: int, sockets: list[Path],
                  fills: PassedFillSockets | None) -> None:
    """The v5 welcome to a process attached through its Pod's socket: ``fills``' sockets passed with the line itself
    (SCM_RIGHTS, in its first sendmsg: they arrive with its first byte), ``fds`` saying how many (0: bind nothing)."""
    fds = fills.fds() if fills is not None else []
    extra: dict[str, Any] = {"sockets": [str(p) for p in sockets]} if len(sockets) > 1 else {}
    line = control.encode("welcome", job=job, socket=str(own), stage=stage, protocol=control.VERSION, fds=len(fds),
                          **extra)
    sent = socket.send_fds(conn, [line], fds) if fds else conn.send(line)
    if sent < len(line):
        conn.sendall(line[sent:])
    if fills is not None:
        fills.release()  # the process holds them now


def _read_line(conn: socket.socket) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("the process hung up before saying hello")
        buf += chunk
        if len(buf) > control.MAX_LINE_BYTES:
            raise OSError("hello is too long")
    return bytes(buf[: buf.index(b"\n")])


def _refuse(conn: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(control.encode("refused", reason=reason))
    conn.close()
