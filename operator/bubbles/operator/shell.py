"""The operator process: kopf watches, a store of what it saw, one reconcile loop, the writes.

kopf streams every FillJob, PipelineTraining and Pod event into ``Store`` (``on.event`` handlers only: kopf
keeps no progress of its own on our objects, so it writes nothing to them). The loop then gathers the
agents' reports, calls the pure ``bubbles.operator.decide.reconcile_round`` and carries out its decisions with
``KubeWriter`` in a task of their own, beside the next rounds: a FillJob with writes in flight is shown in the store
as they will leave it (``Store.assume``), and the store takes each write's answer when they end, so a decision taken
is seen at once by the next round (a placement is never repeated while its writes or its watch event are on their
way; docs/design.md, "The operator's writes beside its rounds"). It runs every ``interval_s`` or as soon as a
watched object changes. With leader election on, only the Lease holder
writes; a replica that loses the Lease stops before its next write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import gc
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bubbles.core.api import DEFAULT_CUDA_CONTEXT_MIB
from bubbles.core.cycle import BubbleCycle
from bubbles.core.identity import GpuKey
from bubbles.core.resources import (
    FINALIZER,
    GROUP,
    VERSION,
    JobProgress,
    NodeReport,
    PipelineTrainingResource,
    ResourceError,
    StageReport,
    selector_matches,
)

from .agents import AgentDirectory
from .decide import (
    ClusterView,
    DecideCache,
    Decisions,
    FillJobDecisions,
    FillPodSettings,
    GpuView,
    key_of,
    pod_not_starting,
    reconcile_round,
)
from .kube import TOKEN_LIFETIME_S, Connection, FinalizerConflict, KubeWriter, PodConflict, PodRefused
from .leader import LeaseElector
from .metrics import OperatorMetrics

log = logging.getLogger("bubbles.operator")
NO_REPORTS: tuple[StageReport, ...] = ()  # a Pod no agent reports a GPU of (one object: views are kept by identity)


GC_FULL_S = 300.0  # the operator command's full collections (OperatorConfig.gc_full_s): one every 5 minutes
GC_YOUNG = 10_000  # and its young generation's threshold (Python's: 700): fewer collections of the round's objects
ROUNDS_IN_FLIGHT = 8  # rounds whose writes go on at once (their writes together: write_concurrency at most)


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # () with clusterwide: every namespace
    clusterwide: bool = True
    policy: str = "fifo"
    interval_s: float = 2.0
    leader_election: bool = False
    lease_name: str = "bubbles-operator"
    lease_namespace: str = "default"
    identity: str = "bubbles-operator"
    lease_s: int = 15  # a Lease not renewed for this long may be taken over
    renew_s: float = 5.0
    write_concurrency: int = 16  # API writes in flight at once
    pod_retry_s: float = 30.0  # a FillJob whose Pod the API server refused is placed again after this long
    # A fill Pod the kubelet cannot start (its image cannot be pulled, ...) is given up this long after its creation
    pod_start_timeout_s: float = 600.0
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_MIB << 20  # the agents' --cuda-context-mib: ClusterView's
    training_status_interval_s: float = 5.0  # figures in a PipelineTraining's status are rewritten at most this often
    # The rounds look again only at what changed (decide.reconcile_round); at least this often at everything, a safety
    # net that costs one round as long as a round that looks at everything (--full-pass-interval).
    full_pass_s: float = 30.0
    metrics_interval_s: float = 1.0  # the per-job gauges are recomputed at most this often (scrapes are far rarer)
    # The operator process's garbage collector (see Operator._collect): 0 leaves Python's as it is (tests, where the
    # operator runs in the test's process); the command sets it. Every round ends with gc.freeze(), and at most this
    # often the frozen objects are let go and collected whole.
    gc_full_s: float = 0.0
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    agent_selector: tuple[tuple[str, str], ...] = (("app.kubernetes.io/component", "agent"),
                                                   ("app.kubernetes.io/name", "bubbles"))
    agent_port: int = 7070
    fill_pods: FillPodSettings = field(default_factory=FillPodSettings)


@dataclass
class Store:
    """The latest body of every watched object, by kind and "namespace/name".

    A FillJob with writes in flight (``assume``) shows what those writes will make of it (its new status and
    finalizers) until they end (``settle``): the rounds decided meanwhile see its placement, so they neither place it
    again nor give its GPU to another job, as the kube-scheduler assumes a Pod bound while its binding is written.
    Meanwhile its watch events and the writes' answers are kept aside (``held``); ``settle`` shows the latest of
    them."""

    fill_jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    trainings: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods_version: int = 0  # bumped on every Pod event (indexes over the Pods rebuild when it moves)
    held: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # assumed FillJob -> its latest real body

    def put(self, kind: str, obj: Mapping[str, Any], deleted: bool = False) -> None:
        table = getattr(self, kind)
        key = key_of(obj)
        if kind == "pods":
            self.pods_version += 1
        if kind == "fill_jobs" and key in self.held:
            self.held[key] = _newer(self.held[key], obj, deleted)
        elif deleted:
            table.pop(key, None)
        else:
            new = _newer(table.get(key), obj, deleted)
            if new is not None:
                table[key] = new

    def real(self, key: str) -> dict[str, Any] | None:
        """FillJob ``key``'s latest body from the API server (not what writes in flight will make of it)."""
        return self.held[key] if key in self.held else self.fill_jobs.get(key)

    def assume(self, key: str, obj: dict[str, Any]) -> None:
        """Show ``obj`` for FillJob ``key`` until ``settle(key)``: what the writes in flight will make of it."""
        if key not in self.held:
            self.held[key] = self.fill_jobs.get(key)
        self.fill_jobs[key] = obj

    def settle(self, key: str) -> None:
        """The writes for ``key`` ended (done or not): show its latest real body again (none if it is gone)."""
        if key not in self.held:
            return
        real = self.held.pop(key)
        if real is None:
            self.fill_jobs.pop(key, None)
        else:
            self.fill_jobs[key] = real


def _newer(old: dict[str, Any] | None, obj: Mapping[str, Any], deleted: bool) -> dict[str, Any] | None:
    """What to keep of ``old`` and a newer sighting ``obj``: None if deleted; ``old`` if ``obj`` is older (an older
    watch event never undoes a write)."""
    if deleted:
        return None
    rv_old = int((old or {}).get("metadata", {}).get("resourceVersion") or 0) if old else -1
    rv_new = int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    if old is None or rv_new == 0 or rv_new >= rv_old:
        # A shallow copy: watch events and write answers are fresh objects, and nothing changes a stored object in
        # place (the reconcile copies what it changes). A deep copy of every event cost more of the operator's core
        # than all its decisions at 1,000 FillJobs (benchmarks/operator_scale.py).
        return dict(obj)
    return old


def assumed(obj: Mapping[str, Any], job: FillJobDecisions) -> dict[str, Any] | None:
    """What ``job``'s writes will make of FillJob ``obj`` (its status, its finalizers), or None if they change
    neither (a Pod deleted, a run cancelled)."""
    if job.status is None and not job.add_finalizer and not job.remove_finalizer:
        return None
    new = dict(obj)
    if job.add_finalizer or job.remove_finalizer:
        meta = dict(obj.get("metadata") or {})
        kept = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
        meta["finalizers"] = kept + ([FINALIZER] if job.add_finalizer else [])
        new["metadata"] = meta
    if job.status is not None:
        new["status"] = job.status
    return new


class Operator:
    """One replica of the bubbles operator; ``run()`` until ``stop`` is set."""

    def __init__(self, config: OperatorConfig, connection: Connection, agents: AgentDirectory,
                 wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.config = config
        self.connection = connection
        self.agents = agents
        self.wall = wall
        self.store = Store()
        self.cache = DecideCache()  # what the reconcile remembers between rounds: this replica's, every round
        self.metrics = OperatorMetrics()
        self.writer = KubeWriter(connection, pool=config.write_concurrency,
                                 request_timeout_s=config.lease_s * 0.2 if config.leader_election else 30.0,
                                 observe=lambda kind, s: self.metrics.api_write_seconds.labels(kind).observe(s))
        self._pool = concurrent.futures.ThreadPoolExecutor(config.write_concurrency, "bubbles-writes")
        self.wake = asyncio.Event()
        self.rounds = 0
        self._started: float | None = None  # time.monotonic() of the first round (decide's acting_s)
        self._training_written: dict[str, float] = {}  # PipelineTraining key -> when its status was last written
        self.pod_refusals: dict[str, tuple[str, float]] = {}  # FillJob uid -> (the API server's refusal, when)
        self.round_s: list[tuple[float, float, float]] = []  # per round: (see, decide, act) seconds, the last 1000
        self.writes_total: Counter[str] = Counter()  # API writes by kind since start
        self.last: Decisions | None = None
        self._events: asyncio.Task[None] | None = None  # the Events of the last round, being posted
        # The rounds' writes in flight (the loop does not wait for them: see _loop), and what they write for.
        self._acts: set[asyncio.Task[None]] = set()
        self._writing: set[str] = set()  # FillJob keys
        self._writing_trainings: set[str] = set()  # PipelineTraining keys
        self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None  # writes in flight, all rounds
        self._trainings_parsed: dict[str, tuple[str, PipelineTrainingResource | None]] = {}  # key -> (rv, parsed)
        self._pod_matches: dict[str, tuple[str, tuple[Any, ...], tuple[str, ...]]] = {}  # Pod -> (rv, trainings, keys)
        self._generation: tuple[Any, ...] = ()
        self._agent_index: dict[str, str] = {}
        self._cycles: dict[GpuKey, tuple[Any, BubbleCycle | None]] = {}  # GPU -> (reported dict, parsed)
        # node -> (its report's GPUs, them by (namespace, training, Pod)): a Pod may run several GPUs
        self._report_index: dict[str, tuple[tuple[StageReport, ...],
                                            dict[tuple[str, str, str], list[StageReport]]]] = {}
        self._reports: dict[str, NodeReport] = {}  # node -> its agent's last report (see _same_report)
        self._progress: dict[str, JobProgress] = {}  # FillJob uid -> its run's progress as last handed to decide
        # (training, Pod) -> (the Pod, its GPUs' reports, whether its agent answers, their views, their parsed cycles):
        # the same views are handed to decide while nothing of them changed (decide compares them as themselves first).
        self._gpu_views: dict[tuple[str, str], tuple[Any, Any, bool, tuple[GpuView, ...],
                                                     tuple[tuple[GpuKey, tuple[Any, BubbleCycle | None]], ...]]] = {}
        # fill Pod -> (the Pod, what it says: ("waiting", (why, since)), ("failed", why), ("ended", why) or None)
        self._fill_pods: dict[str, tuple[Any, tuple[str, Any] | None]] = {}
        self._observed = -math.inf  # when the per-job gauges were last recomputed
        self._gc_full_at = time.monotonic()  # the last full collection (see _collect); the first after gc_full_s
        self._first_waiting: dict[str, float] = {}  # fill Pod key -> when it was first seen failing to start
        self._agents_version = -1
        self.leader: LeaseElector | None = None
        if config.leader_election:
            self.leader = LeaseElector(self.writer.api, config.lease_namespace, config.lease_name, config.identity,
                                       lease_s=config.lease_s, renew_s=config.renew_s)

    def _waiting_since(self, key: str, pod: Mapping[str, Any], now: dt.datetime) -> float:
        """When a fill Pod that fails to start was created (epoch seconds); when it was first seen so, if the object
        has no creation time."""
        created = (pod.get("metadata") or {}).get("creationTimestamp")
        if created:
            try:
                return dt.datetime.fromisoformat(str(created).replace("Z", "+00:00")).timestamp()
            except ValueError:
                pass
        return self._first_waiting.setdefault(key, now.timestamp())

    def agent_address(self, node: str) -> str | None:
        """``podIP:port`` of the running agent Pod (``agent_selector``) on ``node``, from the watched Pods."""
        if self._agents_version != self.store.pods_version:
            index: dict[str, str] = {}
            for pod in self.store.pods.values():
                meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
                labels = meta.get("labels") or {}
                if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
                    continue
                if all(labels.get(k) == v for k, v in self.config.agent_selector) and spec.get("nodeName"):
                    ip = str(status["podIP"])
                    index[str(spec["nodeName"])] = f"[{ip}]:{self.config.agent_port}" if ":" in ip \
                        else f"{ip}:{self.config.agent_port}"
            self._agent_index, self._agents_version = index, self.store.pods_version
        return self._agent_index.get(node)

    # -- kopf ------------------------------------------------------------------------------------------------
    def registry(self) -> Any:
        import kopf

        registry = kopf.OperatorRegistry()

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            # kopf logs in again when its credentials expire or are refused (401): a token from a file that rotates
            # is said to expire after a minute, so kopf reads the file's latest then.
            c = self.connection
            expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=TOKEN_LIFETIME_S) if c.token_file else None
            return kopf.ConnectionInfo(server=c.server, token=c.current_token(), ca_path=c.ca_path,
                                       insecure=c.insecure, certificate_path=c.cert_path, private_key_path=c.key_path,
                                       default_namespace=c.namespace, expiration=expires)

        for kind, group, version, plural in (("fill_jobs", GROUP, VERSION, "filljobs"),
                                             ("trainings", GROUP, VERSION, "pipelinetrainings"),
                                             ("pods", "", "v1", "pods")):
            # async: kopf runs it on the event loop, as the reconcile loop; a sync handler would run in a worker
            # thread and change the store while a round iterates over it.
            async def on_event(event: Mapping[str, Any], kind: str = kind, **_: Any) -> None:
                obj = event.get("object")
                if isinstance(obj, Mapping):
                    self.store.put(kind, obj, deleted=event.get("type") == "DELETED")
                    self.wake.set()
            kopf.on.event(group, version, plural, registry=registry)(on_event)
        return registry

    def settings(self) -> Any:
        import kopf

        s = kopf.OperatorSettings()
        s.posting.enabled = False  # Events are the reconcile's, with their own reasons
        s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.bubbles.dev")
        # kopf builds a diff base of every event's body (a deep copy) for change-detecting handlers, which this
        # operator has none of: at a burst of 1,000 FillJobs that was a sixth of its process's CPU (benchmarks.md).
        s.persistence.diffbase_storage = _no_diff_base()
        s.watching.server_timeout = 60
        # No watch on CRDs and namespaces: the operator needs no RBAC beyond its own resources (bubbles.operator.rbac).
        # The CRDs must therefore exist when it starts (Helm installs crds/ first).
        s.scanning.disabled = True
        return s

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """kopf's watches, the lease and the reconcile loop, until ``stop`` (or until kopf stops: on SIGTERM or
        SIGINT in the main thread). On the way out the Lease is released, the Events in flight are posted (at most
        10 s) and the writes' threads are let go."""
        if self.config.metrics_port is not None:
            port = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics_addr, port)
        tasks = [asyncio.create_task(self._watch(stop, ready)), asyncio.create_task(self._loop(stop))]
        if self.leader is not None:
            tasks.append(asyncio.create_task(self.leader.run(stop)))
        try:
            await asyncio.gather(*tasks)
        finally:
            stop.set()
            for t in [*tasks, *self._acts]:
                t.cancel()
            if self._events is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._events, 10)
            self.metrics.close()
            # A write in flight finishes on its thread (each call is bounded by the client's timeout); none starts.
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _watch(self, stop: asyncio.Event, ready: asyncio.Event | None) -> None:
        """kopf's watches until ``stop``. In the main thread kopf takes SIGTERM and SIGINT for itself as it starts,
        replacing any handler set before (the command's own); once it is up the signals go to ``stop`` again, which
        stops kopf too (it is kopf's stop flag). A signal kopf takes still stops everything here when kopf ends."""
        import kopf

        up = asyncio.Event()
        handover = asyncio.create_task(self._take_signals(up, stop, ready))
        try:
            await kopf.operator(
                registry=self.registry(), settings=self.settings(), standalone=True,
                clusterwide=self.config.clusterwide, namespaces=list(self.config.namespaces), stop_flag=stop,
                ready_flag=up)
        finally:
            handover.cancel()
            if not stop.is_set():
                log.info("kopf stopped (a signal): stopping the operator")
            stop.set()

    @staticmethod
    async def _take_signals(up: asyncio.Event, stop: asyncio.Event, ready: asyncio.Event | None) -> None:
        """Once kopf is up: SIGTERM and SIGINT set ``stop`` (where a loop can take signals: the main thread). Had kopf
        kept them, it would stop alone and then wait 5 s for this operator's own tasks before cancelling them."""
        import signal

        await up.wait()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()

    # -- the loop --------------------------------------------------------------------------------------------
    @property
    def acting(self) -> bool:
        return self.leader is None or self.leader.is_leader

    async def _loop(self, stop: asyncio.Event) -> None:
        """Rounds until ``stop``. A round's writes go on beside the next rounds (at most ``ROUNDS_IN_FLIGHT``, all
        rounds' writes together at most ``write_concurrency`` at a time): a job that arrives while a round writes is
        decided at once, not after that round's last write. The store shows each job with writes in flight as they
        will leave it (``Store.assume``), and a round leaves such a job, and a training with its status in flight, to
        a later round: what it decided for them is dropped, as a write that failed before it was sent would be."""
        while not stop.is_set():
            self.wake.clear()
            if self.acting:
                try:
                    while len(self._acts) >= ROUNDS_IN_FLIGHT:
                        await asyncio.wait(set(self._acts), return_when=asyncio.FIRST_COMPLETED)
                    d, now, see_s, decide_s = await self._decide()
                    if d.fill_jobs or d.training_status or d.events:
                        task = asyncio.create_task(self._act_logged(d, now, see_s, decide_s))
                        self._acts.add(task)
                        task.add_done_callback(self._acts.discard)
                    else:
                        self._round_done(see_s, decide_s, 0.0)
                except Exception:
                    self.metrics.reconcile_errors.inc()
                    log.exception("reconcile failed; retrying in %.1f s", self.config.interval_s)
            self.metrics.leader.set(1 if self.acting else 0)
            waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.wake.wait())]
            if self.leader is not None:
                waits.append(asyncio.create_task(self.leader.changed.wait()))
            _done, pending = await asyncio.wait(waits, timeout=self.config.interval_s,
                                                return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            if self.leader is not None:
                self.leader.changed.clear()
            self._collect()
            # Let a burst of watch events land before the next round; and as the writes of earlier rounds go on
            # beside, at most half the loop's time goes to seeing and deciding (a round looks at every FillJob's
            # object, if not at its decision: at 1,000 FillJobs tens of ms, and each write's watch event wakes it).
            see_s, decide_s, _ = self.round_s[-1] if self.round_s else (0.0, 0.0, 0.0)
            await asyncio.sleep(max(0.02, see_s + decide_s))

    async def _act_logged(self, d: Decisions, now: dt.datetime, see_s: float, decide_s: float) -> None:
        try:
            await self._act(d, now, see_s, decide_s)
        except (PodConflict, FinalizerConflict) as exc:  # expected under concurrency: retried next round
            self.metrics.reconcile_errors.inc()
            log.warning("%s", exc)
        except Exception:
            self.metrics.reconcile_errors.inc()
            log.exception("reconcile failed; retrying in %.1f s", self.config.interval_s)

    def _collect(self) -> None:
        """Keep Python's cyclic garbage collector off the objects that outlive a round. The store holds every
        watched object's latest body and each watch event replaces one, so long-lived objects churn: at 1,000
        FillJobs and 20 arriving a second the collector took 10.4 s of a 60 s run, 19 full collections of up to 0.74 s
        each, every one a pause of the event loop (benchmarks.md, 2026-12-07). So each round ends with everything then
        alive frozen (the collector's young generations then hold only what the next round makes; garbage without
        cycles is still freed at once by reference counting), and every ``gc_full_s`` the frozen objects are let go
        and collected whole, so cycles among them are not kept for longer than that."""
        if self.config.gc_full_s <= 0:
            return
        if gc.get_threshold()[0] < GC_YOUNG:
            gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
        now = time.monotonic()
        if now - self._gc_full_at >= self.config.gc_full_s:
            self._gc_full_at = now
            gc.unfreeze()
            gc.collect()
        gc.freeze()

    async def view(self) -> ClusterView:
        """What the operator sees now: the store joined with the agents' reports."""
        now = self.wall()
        trainings = list(self.store.trainings.values())
        selectors: list[tuple[str, PipelineTrainingResource]] = []
        parsed: dict[str, tuple[str, PipelineTrainingResource | None]] = {}
        for t in trainings:
            tmeta = t.get("metadata") or {}
            # What selection depends on: the spec (its generation) and the labels; not the status, written often.
            key = key_of(t)
            rv = f"{tmeta.get('uid')}/{tmeta.get('generation')}/{sorted((tmeta.get('labels') or {}).items())}"
            have = self._trainings_parsed.get(key)
            if have is None or have[0] != rv:
                try:
                    have = (rv, PipelineTrainingResource.from_object(t))
                except ResourceError:
                    have = (rv, None)
            parsed[key] = have
            if have[1] is not None:
                selectors.append((key, have[1]))
        self._trainings_parsed = parsed
        # Which trainings select which Pod, remembered per Pod version and trainings' versions: with a thousand Pods
        # and a hundred trainings, matching every pair every round would dominate the round.
        generation = tuple((k, v[0]) for k, v in sorted(parsed.items()))
        if generation == self._generation:
            generation = self._generation  # the same object: each Pod's cache entry is checked by identity below
        self._generation = generation
        by_ns: dict[str, list[tuple[str, PipelineTrainingResource]]] = {}
        for tkey, tr in selectors:
            by_ns.setdefault(tr.namespace, []).append((tkey, tr))
        pods_by_training: dict[str, list[dict[str, Any]]] = {}
        matches: dict[str, tuple[str, tuple[Any, ...], tuple[str, ...]]] = {}
        for pkey, pod in list(self.store.pods.items()):
            meta = pod.get("metadata") or {}
            rv = str(meta.get("resourceVersion"))
            cached = self._pod_matches.get(pkey)
            if cached is not None and cached[0] == rv and cached[1] is generation:
                tkeys = cached[2]
            elif meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") not in ("Running", "Pending") \
                    or (meta.get("labels") or {}).get("app.kubernetes.io/component") == "fill-job":
                tkeys = ()
            else:
                labels = meta.get("labels") or {}
                tkeys = tuple(tkey for tkey, tr in by_ns.get(str(meta.get("namespace")), ())
                              if selector_matches(tr.selector, labels))
            matches[pkey] = (rv, generation, tkeys)
            for tkey in tkeys:
                pods_by_training.setdefault(tkey, []).append(pod)
        self._pod_matches = matches
        nodes = sorted({str((p.get("spec") or {}).get("nodeName")) for ps in pods_by_training.values() for p in ps
                        if (p.get("spec") or {}).get("nodeName")})
        answers = await asyncio.gather(*(self.agents.report(n) for n in nodes))
        reports: dict[str, NodeReport | None] = {n: self._same_report(n, rep) for n, rep in zip(nodes, answers,
                                                                                                strict=True)}
        self._reports = {n: rep for n, rep in reports.items() if rep is not None}
        gpus: list[GpuView] = []
        progress: dict[str, JobProgress] = {}
        for rep in reports.values():
            for j in rep.jobs if rep else ():
                had = self._progress.get(j.uid)
                progress[j.uid] = had if had is not None and (had is j or had == j) else j
        self._progress = progress
        index: dict[str, tuple[tuple[StageReport, ...], dict[tuple[str, str, str], list[StageReport]]]] = {}
        for node, rep in reports.items():
            if rep is not None:
                ix = self._report_index.get(node)
                if ix is None or ix[0] is not rep.stages:
                    ix = (rep.stages, {})
                    for s in rep.stages:
                        if _named(s, node):
                            ix[1].setdefault((s.namespace, s.training, s.pod), []).append(s)
                index[node] = ix
        self._report_index = index
        cycles: dict[GpuKey, tuple[Any, BubbleCycle | None]] = {}
        views: dict[tuple[str, str], tuple[Any, Any, bool, tuple[GpuView, ...],
                                           tuple[tuple[GpuKey, tuple[Any, BubbleCycle | None]], ...]]] = {}
        for tkey, pods in pods_by_training.items():
            ns, name = tkey.split("/", 1)
            for pod in pods:
                meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
                node = str(spec.get("nodeName") or "")
                rep = reports.get(node)
                pod_name = str(meta.get("name"))
                reported = index[node][1].get((ns, name, pod_name), NO_REPORTS) if rep is not None else NO_REPORTS
                vkey = (tkey, pod_name)
                kept = self._gpu_views.get(vkey)
                if kept is None or kept[0] is not pod or kept[1] is not reported or kept[2] != (rep is not None):
                    made, pod_cycles = self._pod_gpus(tkey, pod, reported, rep is not None)
                    kept = (pod, reported, rep is not None, made, pod_cycles)
                views[vkey] = kept
                gpus.extend(kept[3])
                cycles.update(kept[4])
        self._gpu_views = views
        self._cycles = cycles
        failed: dict[str, str] = {}
        ended: dict[str, str] = {}
        waiting: dict[str, tuple[str, float]] = {}
        fill_pods: dict[str, tuple[Any, tuple[str, Any] | None]] = {}
        for key, pod in list(self.store.pods.items()):
            said = self._fill_pods.get(key)
            if said is None or said[0] is not pod:
                said = (pod, self._fill_pod_state(key, pod, now))
            fill_pods[key] = said
            if said[1] is not None:
                what, value = said[1]
                (waiting if what == "waiting" else failed if what == "failed" else ended)[key] = value
        self._fill_pods = fill_pods
        self._first_waiting = {k: v for k, v in self._first_waiting.items() if k in waiting}
        # Lists of the store's objects: the store replaces an object on every event and never changes one in place.
        if self._started is None:
            self._started = time.monotonic()
        self._training_written = {k: t for k, t in self._training_written.items() if k in self.store.trainings}
        if self.pod_refusals:
            live = {str((o.get("metadata") or {}).get("uid", "")) for o in self.store.fill_jobs.values()}
            self.pod_refusals = {uid: r for uid, r in self.pod_refusals.items() if uid in live}  # gone jobs: forgotten
        return ClusterView(now, list(self.store.fill_jobs.values()), trainings, gpus, progress, self.config.policy,
                           failed_pods=failed, ended_pods=ended, fill_pods=self.config.fill_pods,
                           refused_pods=dict(self.pod_refusals), pod_retry_s=self.config.pod_retry_s,
                           waiting_pods=waiting, pod_start_timeout_s=self.config.pod_start_timeout_s,
                           cuda_context_bytes=self.config.cuda_context_bytes,
                           acting_s=time.monotonic() - self._started)

    def _same_report(self, node: str, rep: NodeReport | None) -> NodeReport | None:
        """``rep``, with the GPUs' part of the node's last report where it is equal (an agent over gRPC answers a new
        object each time): the views made of it are then made once, and decide sees them unchanged."""
        had = self._reports.get(node)
        if rep is None or had is None or rep is had or rep.stages is had.stages:
            return rep
        if rep == had:
            return had
        return replace(rep, stages=had.stages) if rep.stages == had.stages else rep

    def _pod_gpus(self, tkey: str, pod: Mapping[str, Any], reported: Sequence[StageReport], agent_up: bool,
                  ) -> tuple[tuple[GpuView, ...], tuple[tuple[GpuKey, tuple[Any, BubbleCycle | None]], ...]]:
        """The views of the GPUs a training Pod runs, as its node's agent reports them, and their parsed cycles. One
        view per GPU (each stage, each rank: none collapses); a Pod no agent reports a GPU of is one view with stage
        -1, for its training's status to say why."""
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        node = str(spec.get("nodeName") or "")
        pod_name, pod_uid = str(meta.get("name")), str(meta.get("uid", ""))
        tolerations = tuple(spec.get("tolerations") or ())
        if not reported:
            return (GpuView(tkey, -1, pod_name, pod_uid, node, "", None, agent_up=agent_up,
                            tolerations=tolerations),), ()
        views: list[GpuView] = []
        cycles: list[tuple[GpuKey, tuple[Any, BubbleCycle | None]]] = []
        for sr in reported:
            gkey = sr.key
            cycle = None
            if sr.cycle is not None and node:
                # Parsed once per reported cycle: the same object each round lets decisions memoize per GPU.
                had = self._cycles.get(gkey)
                if had is not None and (had[0] is sr.cycle or had[0] == sr.cycle):
                    cycle = had[1]
                else:
                    try:
                        cycle = BubbleCycle.from_dict(sr.cycle)
                    except ValueError:
                        cycle = None
                cycles.append((gkey, (sr.cycle, cycle)))
            views.append(GpuView(
                tkey, sr.stage, pod_name, pod_uid, node, sr.device, cycle, agent_up=True,
                hook_reporting=sr.hook_reporting, iteration_s=sr.iteration_s,
                baseline_iteration_s=sr.baseline_iteration_s, bubble_s=sr.bubble_s, filled_s=sr.filled_s,
                gpu_uuid=sr.gpu_uuid, gpu_resource=sr.gpu_resource,
                training_membership=sr.training_membership, tolerations=tolerations,
                rank=sr.rank, ranks=sr.ranks))
        return tuple(views), tuple(cycles)

    def _fill_pod_state(self, key: str, pod: Mapping[str, Any], now: dt.datetime) -> tuple[str, Any] | None:
        """What a fill Pod says for decide: ("waiting", (the kubelet's reason or "", since when)) while Pending,
        ("failed", why) or ("ended", why) once done; None for a running fill Pod or any other Pod."""
        st = pod.get("status") or {}
        phase = st.get("phase")
        if ((pod.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component") != "fill-job":
            return None
        if phase == "Pending":
            # Every Pending fill Pod, with what the kubelet says keeps it (or "" while it is only starting: a
            # volume that never mounts is said in Events alone, and must time out too).
            return "waiting", (pod_not_starting(pod) or "", self._waiting_since(key, pod, now))
        if phase in ("Failed", "Succeeded"):
            states = [c.get("state") or {} for c in st.get("containerStatuses") or ()]
            why = next((f"{s['terminated'].get('reason', 'Error')} (exit code {s['terminated'].get('exitCode')})"
                        for s in states if "terminated" in s), st.get("reason") or f"the Pod {phase.lower()}")
            said = f"{why}{': ' + st['message'] if st.get('message') else ''}"
            return ("failed" if phase == "Failed" else "ended"), said
        return None

    async def reconcile_once(self) -> Decisions:
        """One round: see, decide, act, and wait for its writes. Returns the decisions (tests and the benchmark read
        them)."""
        d, now, see_s, decide_s = await self._decide()
        await self._act(d, now, see_s, decide_s)
        return d

    async def _decide(self) -> tuple[Decisions, dt.datetime, float, float]:
        """See and decide: the decisions, less those for what writes in flight still change (see ``_loop``)."""
        t0 = time.perf_counter()
        view = await self.view()
        t1 = time.perf_counter()
        d = reconcile_round(view, self.cache, self.config.full_pass_s)
        if self._writing or self._writing_trainings:
            _hold_back(d, self._writing, self._writing_trainings)
        t2 = time.perf_counter()
        self.rounds += 1
        self.last = d
        self.metrics.reconciles.inc()
        if time.monotonic() - self._observed >= self.config.metrics_interval_s:
            self._observed = time.monotonic()
            self.metrics.observe(list(self.store.fill_jobs.values()))
        return d, view.now, t1 - t0, t2 - t1

    async def _act(self, d: Decisions, now: dt.datetime, see_s: float, decide_s: float) -> None:
        """Carry out ``d``, showing each FillJob it writes for as the writes will leave it until they end."""
        t0 = time.perf_counter()
        keys = [k for k, j in d.fill_jobs.items() if j.writes or j.cancel_on is not None]
        trainings = list(d.training_status)
        self._writing.update(keys)
        self._writing_trainings.update(trainings)
        for k in keys:
            obj = self.store.fill_jobs.get(k)
            new = assumed(obj, d.fill_jobs[k]) if obj is not None else None
            if new is not None:
                self.store.assume(k, new)
        try:
            await self.apply(d, now)
        finally:
            for k in keys:
                self.store.settle(k)
            self._writing.difference_update(keys)
            self._writing_trainings.difference_update(trainings)
            self._round_done(see_s, decide_s, time.perf_counter() - t0)
            if keys or trainings:
                self.wake.set()  # what the writes left is for the next round to see
        if d.create_pods or d.fill_job_status:
            log.debug("round %d: %d status(es), %d Pod(s) in %.1f ms", self.rounds, len(d.fill_job_status),
                      len(d.create_pods), (see_s + decide_s + time.perf_counter() - t0) * 1e3)

    def _round_done(self, see_s: float, decide_s: float, act_s: float) -> None:
        self.round_s = [*self.round_s[-999:], (see_s, decide_s, act_s)]

    async def apply(self, d: Decisions, now: dt.datetime) -> None:
        """Carry out ``d``. Per FillJob in order (finalizer, Pod, assignment, status; clean-up before releasing
        the finalizer); FillJobs, trainings and Events concurrently, at most ``write_concurrency`` at a time."""
        w = self.writer
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:
            self._sem = (loop, asyncio.Semaphore(self.config.write_concurrency))
        sem = self._sem[1]

        async def write(fn: Callable[..., Any], *args: Any) -> Any:
            if not self.acting:
                raise LeadershipLost()
            return await loop.run_in_executor(self._pool, fn, *args)

        refused_now: set[str] = set()  # FillJob keys whose Pod the API server refused this round

        async def create_pod(key: str, uid: str, pod: dict[str, Any]) -> bool:
            """False if the API server refused the Pod: remembered, so that the next rounds say why on the FillJob."""
            try:
                await write(w.create_pod, pod)
            except PodRefused as exc:
                refused_now.add(key)
                self.pod_refusals[uid] = (str(exc), now.timestamp())
                log.warning("fill job %s: the API server refused its Pod %s: %s", key, pod["metadata"]["name"], exc)
                return False
            self.pod_refusals.pop(uid, None)
            return True

        async def fill_job(key: str, job: FillJobDecisions) -> None:
            async with sem:
                obj = self.store.real(key)
                if obj is None:
                    return
                meta = obj["metadata"]
                for ns, name in job.delete_pods:
                    await write(w.delete_pod, ns, name)
                uid = str(meta.get("uid", ""))
                if job.cancel_on is not None and job.uid == uid:
                    if not self.acting:
                        raise LeadershipLost()
                    await self.agents.cancel(job.cancel_on, uid)
                # The finalizer and the Pod at once (both before the status that says Placed): one round trip less.
                steps = []
                if job.add_finalizer:
                    steps.append(write(w.set_finalizer, "filljobs", meta["namespace"], meta["name"], True,
                                       list(meta.get("finalizers") or []), meta.get("resourceVersion")))
                if job.create_pod is not None:
                    steps.append(create_pod(key, uid, job.create_pod))
                if steps:
                    done = await asyncio.gather(*steps)
                    if job.add_finalizer:
                        if done[0] is None:
                            self.store.put("fill_jobs", obj, deleted=True)  # gone (a watch gap may hide it)
                            return
                        self.store.put("fill_jobs", done[0])
                    if job.create_pod is not None and done[-1] is False:
                        return  # not placed: no assignment, no status saying Placed; the next round says why
                if job.assignment is not None:
                    if not self.acting:
                        raise LeadershipLost()
                    await self.agents.assign(job.assignment)
                if job.status is not None:
                    status = job.status
                    before = (self.store.real(key) or obj).get("status") or {}
                    new = await write(w.patch_status, "filljobs", meta["namespace"], meta["name"], before, status)
                    if new is None:
                        self.store.put("fill_jobs", obj, deleted=True)
                        return
                    self.store.put("fill_jobs", new)
                    self._observe_placement(meta, before, status, now)
                if job.remove_finalizer:
                    current = self.store.real(key) or obj
                    new = await write(w.set_finalizer, "filljobs", meta["namespace"], meta["name"], False,
                                      list(current["metadata"].get("finalizers") or []),
                                      current["metadata"].get("resourceVersion"))
                    if new is not None:
                        self.store.put("fill_jobs", new)

        async def training(key: str, status: dict[str, Any]) -> None:
            async with sem:
                obj = self.store.trainings.get(key)
                if obj is None:
                    return
                before = obj.get("status") or {}
                last = self._training_written.get(key, -math.inf)
                if before.get("conditions") == status.get("conditions") and \
                        time.monotonic() - last < self.config.training_status_interval_s:
                    return  # only figures changed, and they were written moments ago: a later round writes them
                self._training_written[key] = time.monotonic()
                meta = obj["metadata"]
                new = await write(w.patch_status, "pipelinetrainings", meta["namespace"], meta["name"],
                                  obj.get("status") or {}, status, "training_status")
                self.store.put("trainings", new if new is not None else obj, deleted=new is None)


        # Jobs with something to write, or an agent to tell: a final job's run its agent still holds is cancelled in a
        # round that writes nothing else for it.
        jobs = [(k, j) for k, j in sorted(d.fill_jobs.items(), key=lambda kj: kj[0])
                if j.writes or j.cancel_on is not None]
        async def caught(step: Awaitable[None]) -> BaseException | None:
            # Each concurrent step ends normally, its exception returned as a value: kopf, on the operator's stop,
            # re-raises the exception of any task it finds done (gather's own tasks included), which made a step that
            # stopped on LeadershipLost during a SIGTERM end the operator with a traceback and exit code 1.
            try:
                await step
            except Exception as exc:
                return exc
            return None

        try:
            results = await asyncio.gather(*(caught(fill_job(k, j)) for k, j in jobs),
                                           *(caught(training(k, s)) for k, s in d.training_status.items()),
                                           return_exceptions=True)
            lost = [r for r in results if isinstance(r, LeadershipLost)]
            errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, LeadershipLost)]
            # A job whose Pod was refused was not placed: none of its Events of this round (Placed) tell the truth.
            events = [e for e in d.events if not (e.kind == "FillJob" and f"{e.namespace}/{e.name}" in refused_now)]
            if not lost and events:
                # Events are best effort and not on a job's path to Placed: posted beside the next round (at most
                # one batch in flight: the next round waits for this one before it posts its own).
                self._events = asyncio.create_task(self._post_events(events, now, after=self._events))
            if lost:
                log.warning("stopped mid-round: this replica no longer holds the lease")
            if errors:
                raise errors[0]
        finally:
            self._count_writes(exclude="event")  # the Events' task counts its own

    async def _post_events(self, events: list[Any], now: dt.datetime,
                           after: asyncio.Task[None] | None = None) -> None:
        if after is not None:  # the rounds' Events in their order, one batch at a time
            await asyncio.wait([after])  # however it ended; this task's own cancellation still stops it
        sem = asyncio.Semaphore(self.config.write_concurrency)
        loop = asyncio.get_running_loop()

        async def post(ev: Any) -> None:
            async with sem:
                if self.acting:
                    await loop.run_in_executor(self._pool, self.writer.post_event, ev, now)

        results = await asyncio.gather(*(post(ev) for ev in events), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("%d of %d Event(s) not posted: %s", len(failed), len(events), failed[0])
        self._count_writes(only="event")

    def _count_writes(self, *, only: str | None = None, exclude: str | None = None) -> None:
        for kind, n in self.writer.take_counts(only=only, exclude=exclude).items():
            self.metrics.api_writes.labels(kind).inc(n)
            self.writes_total[kind] += n

    def _observe_placement(self, meta: Mapping[str, Any], before: Mapping[str, Any], status: Mapping[str, Any],
                           now: dt.datetime) -> None:
        if status.get("phase") == "Succeeded" and before.get("phase") != "Succeeded" and meta.get("creationTimestamp"):
            began = dt.datetime.fromisoformat(str(meta["creationTimestamp"]).replace("Z", "+00:00"))
            self.metrics.completion.observe(max(0.0, (now - began).total_seconds()))
        if status.get("phase") == "Placed" and before.get("phase") != "Placed" \
                and int((status.get("counters") or {}).get("placements", 0)) == 1:
            created = meta.get("creationTimestamp")
            if created:
                t = dt.datetime.fromisoformat(str(created).replace("Z", "+00:00"))
                self.metrics.placement_latency.observe(max(0.0, (now - t).total_seconds()))


def _hold_back(d: Decisions, jobs: set[str], trainings: set[str]) -> None:
    """Drop from ``d`` what it decided for the FillJobs ``jobs`` and the trainings ``trainings``, which writes in
    flight still change, and their Events: a later round decides for them again from what those writes left."""
    for key in jobs & d.fill_jobs.keys():
        del d.fill_jobs[key]
    for key in trainings & d.training_status.keys():
        del d.training_status[key]
    d.events[:] = [e for e in d.events
                   if f"{e.namespace}/{e.name}" not in (jobs if e.kind == "FillJob" else trainings)]


def _no_diff_base() -> Any:
    """A kopf diff-base storage that keeps nothing: the operator registers ``on.event`` handlers only, which kopf
    calls with the event as it is; a diff base serves the change handlers (``on.create``, ``on.update``, ...). Were
    one added, it would see every event as a first sighting: ``tests/test_operator_kopf.py`` holds the registry to
    event handlers."""
    import kopf

    class NoDiffBase(kopf.DiffBaseStorage):
        def build(self, *, body: Any, extra_fields: Any = None) -> Any:
            return {}

        def fetch(self, *, body: Any) -> Any:
            return None

        def store(self, *, body: Any, patch: Any, essence: Any) -> None:
            return None

    return NoDiffBase()


def _named(report: StageReport, node: str) -> bool:
    """Whether a GPU's report names one (``StageReport.key``); one that does not is logged and left out: no GPU key,
    no placement or status can refer to it."""
    try:
        report.key  # noqa: B018 (its validation is the point)
    except ValueError as exc:
        log.warning("the agent on %s reports a GPU this operator cannot name, left out: %s", node, exc)
        return False
    return True


class LeadershipLost(Exception):
    """Raised before a write when this replica no longer holds the Lease."""
