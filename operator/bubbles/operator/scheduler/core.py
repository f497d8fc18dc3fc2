"""The fill-job scheduler (PipeFill section 4.4) as plain data and functions: no Kubernetes, no sockets.

Executors with the same bubble cycle form an ``ExecutorClass``; everything that depends on the
cycle (the execution plan, a job's processing time) is computed once per class and cached, so a
cluster of 8,192 GPUs in 16-stage pipelines costs 16 plans per job profile, not 8,192.

A job's processing time on a class comes from the execution plan (PipeFill Algorithm 1,
``bubbles.core.plan.plan_partitions``) over the class's bubbles: one plan with ``steps=None`` (Algorithm
1's replication, one cycle's worth of steps) gives the steps the job completes per bubble cycle, and
    processing time = steps needed / steps per cycle * iteration time
(fractional cycles: the last cycle counts only for the part used, an expectation rather than
``plan_wall_time_s``'s upper bound). Of a job's configurations (batch sizes, offloading) the one
with the highest sample throughput that fits the class's bubbles is used.

A decision (an executor frees up and takes a queued job) asks the class's index (``scheduler.index``) where the
policy offers one, O(log n) in the queue, and scans the queue with the policy's scores where it does not; both choose
the same job (tests/test_scheduler_index.py holds them to it). ``Scheduler(..., index=False)`` always scans.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from bubbles.core.api import WorkloadKind
from bubbles.core.cycle import BubbleCycle
from bubbles.core.plan import Bubble, FillNode, PlanError, bubbles_of, plan_partitions
from bubbles.operator.scheduler.index import QueueIndex
from bubbles.operator.scheduler.policies import Policy, QueueView, SchedulerState, get_policy, queue_index


@dataclass(frozen=True)
class FillConfig:
    """One way to run a fill job: its batch size and the node chain of one step (from its profile)."""

    name: str
    batch_size: int  # samples per step
    nodes: tuple[FillNode, ...]
    offload: bool = False

    # Cached (the nodes never change): the simulator asks every finished job's configuration for its step.
    @functools.cached_property
    def step_s(self) -> float:
        return sum(n.duration_s for n in self.nodes)

    @functools.cached_property
    def memory_bytes(self) -> int:
        return max((n.memory_bytes for n in self.nodes), default=0)


@dataclass(frozen=True)
class FillProfile:
    """What the scheduler knows of a kind of fill job: its configurations and its work per sample."""

    model: str
    kind: WorkloadKind
    flops_per_sample: float
    isolated_samples_per_s: float  # best throughput alone on one whole GPU (for GPU-equivalents)
    configs: tuple[FillConfig, ...]

    @property
    def key(self) -> str:
        return f"{self.model}/{self.kind.label}"


@dataclass(frozen=True)
class FillJobRequest:
    """A fill job submitted to the scheduler: its profile, how many samples it needs, when it arrived, its deadline."""

    job_id: str
    profile: FillProfile
    samples: int
    arrival_s: float = 0.0
    deadline_s: float | None = None
    # Names of the executor classes the job may use (e.g. the trainings its selector admits); None: any.
    eligible: frozenset[str] | None = None
    # How long the job holds its executor before its first step (its process starting, its model loading): part of
    # its processing time on every class it fits.
    setup_s: float = 0.0
    # Executors it runs on together, one process each (a gang, ``scheduler.gang``): ``profile`` is one process's, each
    # step of the gang is a step of every process, and ``samples`` are the gang's (each gang step does gpus x batch).
    gpus: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.setup_s) and self.setup_s >= 0):
            raise ValueError(f"a fill job's setup time must be a finite number of seconds >= 0, got {self.setup_s!r}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"fill job {self.job_id!r}: gpus must be a whole number >= 1, got {self.gpus!r}")


@dataclass(frozen=True)
class ExecutorClass:
    """Executors (GPUs) that share one bubble cycle, e.g. stage k of every data-parallel replica."""

    name: str
    bubbles: tuple[Bubble, ...]
    iteration_s: float
    executors: int

    @classmethod
    def from_cycle(cls, cycle: BubbleCycle, executors: int, name: str = "") -> ExecutorClass:
        return cls(
            name=name or f"{cycle.training}/stage-{cycle.stage}",
            bubbles=bubbles_of(cycle),
            iteration_s=cycle.iteration_s,
            executors=executors,
        )


@dataclass(frozen=True)
class Rate:
    """How fast a profile runs on a class: the chosen configuration and its steps per bubble cycle."""

    config: FillConfig
    steps_per_cycle: float
    samples_per_s: float


@dataclass(frozen=True)
class Placement:
    """A decision: ``job`` runs on ``executor`` (of class ``class_index``) from ``start_s`` to ``end_s``."""

    job: FillJobRequest
    executor: int
    class_index: int
    config: FillConfig
    steps: int
    start_s: float
    end_s: float

    @property
    def processing_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def filled_s(self) -> float:
        """Bubble time the job's work occupies: its steps times the step's duration."""
        return self.steps * self.config.step_s


class DeadlineAnswer(NamedTuple):
    """Whether a deadline can be met, and when the job is expected to finish."""

    feasible: bool
    expected_completion_s: float


class _Queue:
    """The queued jobs as growable numpy columns; removal swaps the last row in (O(1))."""

    def __init__(self, classes: int) -> None:
        self.n = 0
        cap = 64
        self.jobs: list[FillJobRequest] = []
        self.ids: list[str] = []
        self.arrival_s = np.empty(cap)
        self.deadline_s = np.empty(cap)
        self.proc_s = np.empty((cap, classes))
        self.min_proc_s = np.empty(cap)
        self.seq = np.empty(cap, dtype=np.int64)
        self.index: dict[str, int] = {}
        self.row_of_seq: dict[int, int] = {}
        self.next_seq = 0  # above every submission number added so far
        # Per class, how many queued jobs fit it (a finite processing time): a decision on a class none fits is
        # answered without scoring the queue.
        self.fits = np.zeros(classes, dtype=np.int64)

    def add(self, job: FillJobRequest, proc: np.ndarray, seq: int) -> None:
        if self.n == len(self.arrival_s):
            cap = max(64, 2 * self.n)
            self.arrival_s = np.resize(self.arrival_s, cap)
            self.deadline_s = np.resize(self.deadline_s, cap)
            self.min_proc_s = np.resize(self.min_proc_s, cap)
            self.seq = np.resize(self.seq, cap)
            grown = np.empty((cap, self.proc_s.shape[1]))
            grown[: self.n] = self.proc_s[: self.n]
            self.proc_s = grown
        k = self.n
        self.jobs.append(job)
        self.ids.append(job.job_id)
        self.arrival_s[k] = job.arrival_s
        self.deadline_s[k] = math.nan if job.deadline_s is None else job.deadline_s
        self.proc_s[k] = proc
        self.fits += np.isfinite(proc)
        self.min_proc_s[k] = proc.min()
        self.seq[k] = seq
        self.index[job.job_id] = k
        self.row_of_seq[seq] = k
        self.next_seq = max(self.next_seq, seq + 1)
        self.n += 1

    def remove(self, k: int) -> FillJobRequest:
        job = self.jobs[k]
        del self.row_of_seq[int(self.seq[k])]
        self.fits -= np.isfinite(self.proc_s[k])
        last = self.n - 1
        if k != last:
            self.jobs[k] = self.jobs[last]
            self.ids[k] = self.ids[last]
            for col in (self.arrival_s, self.deadline_s, self.min_proc_s, self.seq, self.proc_s):
                col[k] = col[last]
            self.index[self.ids[k]] = k
            self.row_of_seq[int(self.seq[k])] = k
        self.jobs.pop()
        self.ids.pop()
        del self.index[job.job_id]
        self.n -= 1
        return job

    def copy(self) -> _Queue:
        """An independent copy (the ETA replay takes jobs out of it)."""
        n = self.n
        out = _Queue(self.proc_s.shape[1])
        out.n, out.next_seq = n, self.next_seq
        out.jobs, out.ids = list(self.jobs), list(self.ids)
        out.arrival_s, out.deadline_s = self.arrival_s[:n].copy(), self.deadline_s[:n].copy()
        out.proc_s, out.min_proc_s, out.seq = self.proc_s[:n].copy(), self.min_proc_s[:n].copy(), self.seq[:n].copy()
        out.index, out.row_of_seq = dict(self.index), dict(self.row_of_seq)
        out.fits = self.fits.copy()
        return out

    def view_rows(self, rows: np.ndarray) -> QueueView:
        """The rows ``rows`` as a queue of their own (copies)."""
        return QueueView(
            job_ids=[self.ids[r] for r in rows.tolist()],
            arrival_s=self.arrival_s[rows],
            deadline_s=self.deadline_s[rows],
            proc_s=self.proc_s[rows],
            min_proc_s=self.min_proc_s[rows],
            seq=self.seq[rows],
        )

    def view(self) -> QueueView:
        n = self.n
        return QueueView(
            job_ids=self.ids,
            arrival_s=self.arrival_s[:n],
            deadline_s=self.deadline_s[:n],
            proc_s=self.proc_s[:n],
            min_proc_s=self.min_proc_s[:n],
            seq=self.seq[:n],
        )


# What _Indexes.choose answers where the class has no index (or the clock is not finite): scan the queue.
_SCAN = -1


@dataclass
class _ClassEntry:
    index: QueueIndex | None  # None: the policy offers none for this class
    seen: int = 0  # submission numbers below this were offered to the index (those that fit the class)


class _Indexes:
    """The per-class indexes of one queue (``scheduler.index``).

    A class's index is made at its first decision from the jobs then queued that fit it; at each later decision it
    takes in the jobs queued since; a job leaving the queue leaves every index that took it in (``discard``, called
    before the queue drops the row). Classes nobody decides on cost nothing.
    """

    def __init__(self, policy: Policy, queue: _Queue) -> None:
        self.policy = policy
        self.queue = queue
        self.by_class: dict[int, _ClassEntry] = {}

    def sync(self, c: int, state: SchedulerState, executor: int) -> QueueIndex | None:
        """Class ``c``'s index, made or brought up to the queue (None: the policy offers none)."""
        q = self.queue
        entry = self.by_class.get(c)
        if entry is None:
            entry = self.by_class[c] = _ClassEntry(queue_index(self.policy, c))
        index = entry.index
        if index is None or entry.seen == q.next_seq:
            return index
        n = q.n
        if q.next_seq - entry.seen > n:  # made now, or long without a decision: look at the whole queue at once
            fits = np.isfinite(q.proc_s[:n, c])
            if entry.seen:
                fits &= q.seq[:n] >= entry.seen
            rows = np.flatnonzero(fits)
        else:
            got = (q.row_of_seq.get(s) for s in range(entry.seen, q.next_seq))
            rows = np.array([r for r in got if r is not None and math.isfinite(q.proc_s[r, c])], dtype=np.int64)
        if len(rows):
            index.add(q.view_rows(rows), state, executor)
        entry.seen = q.next_seq
        return index

    def choose(self, executor: int, state: SchedulerState) -> int | None:
        """The queue row the policy puts on ``executor`` (None: no queued job fits), or _SCAN where no index serves."""
        if not math.isfinite(state.now_s):
            return _SCAN
        index = self.sync(state.class_of(executor), state, executor)
        if index is None:
            return _SCAN
        seq = index.choose(state, executor)
        return None if seq is None else self.queue.row_of_seq[seq]

    def discard(self, k: int) -> None:
        """Row ``k`` is about to leave the queue."""
        q = self.queue
        seq = int(q.seq[k])
        proc = q.proc_s[k].tolist()  # read once: a numpy scalar per class costs more than the list
        view: QueueView | None = None
        for c, entry in self.by_class.items():
            if entry.index is not None and seq < entry.seen and math.isfinite(proc[c]):
                view = view or q.view()
                entry.index.discard(view, k)


@dataclass
class _Projection:
    """Expected completion times, cached until the queue or the executors change."""

    at_s: float
    version: int
    completion_s: dict[str, float] = field(default_factory=dict)


class Scheduler:
    """Chooses which queued fill job runs on which executor, by a policy; answers ETA and deadline queries.

    Executors are numbered 0..N-1, class by class. ``submit`` queues a job and places it at once if
    an idle executor fits it; ``release`` frees an executor and fills it with the best queued job.
    """

    def __init__(self, classes: Sequence[ExecutorClass], policy: str | Policy = "fifo", *, index: bool = True,
                 tables: dict[int, tuple[FillProfile, tuple[np.ndarray, np.ndarray, tuple[Rate | None, ...]]]]
                 | None = None) -> None:
        """``tables``: where to keep each profile's processing times over ``classes``, to share them between
        schedulers over the same classes (the operator makes one per round over the same GPUs); its own by default."""
        if not classes:
            raise ValueError(
                "the scheduler needs at least one executor class (one per distinct bubble cycle)"
            )
        for c in classes:
            if c.executors < 1:
                raise ValueError(f"executor class {c.name!r} has {c.executors} executors; give it at least 1")
            if not math.isfinite(c.iteration_s) or c.iteration_s <= 0:
                raise ValueError(f"executor class {c.name!r} needs an iteration_s > 0, got {c.iteration_s!r}")
        self.classes = tuple(classes)
        self._use_index = index
        self.executor_class = np.repeat(np.arange(len(classes)), [c.executors for c in classes])
        self._class_of: list[int] = self.executor_class.tolist()  # the same, read one at a time without numpy
        self.busy_until_s = np.zeros(len(self.executor_class))
        self.running: dict[int, Placement] = {}
        self._occupied: dict[int, tuple[str, float]] = {}  # executor -> (job id, busy until), see occupy()
        self._eligible_masks: dict[frozenset[str], np.ndarray] = {}
        self._running_by_job: dict[str, Placement] = {}
        # Idle executors per class, as stacks (the lowest index is used first).
        self._idle: list[list[int]] = []
        start = 0
        for c in classes:
            self._idle.append(list(range(start + c.executors - 1, start - 1, -1)))
            start += c.executors
        self._queue = _Queue(len(classes))
        self._tables: dict[
            int, tuple[FillProfile, tuple[np.ndarray, np.ndarray, tuple[Rate | None, ...]]]
        ] = tables if tables is not None else {}
        self._seq = 0
        self._version = 0
        self._projection: _Projection | None = None
        self.policy = policy  # last: the setter makes the queue's indexes

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, policy: str | Policy) -> None:
        """A new policy orders the queue anew: its indexes are made from scratch at the next decisions."""
        self._policy = get_policy(policy)
        self._indexes = _Indexes(self._policy, self._queue) if self._use_index else None
        self._version += 1

    @property
    def indexed(self) -> bool:
        """Whether decisions use an index (the policy offers one and ``index`` was not turned off) or scan."""
        return self._indexes is not None and queue_index(self._policy, 0) is not None

    def index_all(self, now_s: float) -> None:
        """Make every class's index now rather than at its first decision (a benchmark's set-up does this)."""
        if self._indexes is None:
            return
        first = 0
        for c, cls in enumerate(self.classes):
            self._indexes.sync(c, self.state(now_s), first)
            first += cls.executors

    # ---- processing times -------------------------------------------------------------------------

    def rate(self, class_index: int, profile: FillProfile) -> Rate | None:
        """The fastest configuration of ``profile`` that fits the class's bubbles, or None if none fits."""
        return self._table(profile)[2][class_index]

    def processing_times_s(self, job: FillJobRequest) -> np.ndarray:
        """The job's processing time on each class (inf where no configuration fits)."""
        batch, s_per_step, _ = self._table(job.profile)
        with np.errstate(invalid="ignore"):
            proc = np.ceil(job.samples / batch) * s_per_step
        if job.setup_s:
            proc = proc + job.setup_s  # inf (fits no configuration) stays inf
        if job.eligible is not None:
            proc = np.where(self._eligible_mask(job.eligible), proc, math.inf)
        return proc

    def processing_times_many(self, jobs: Sequence[FillJobRequest]) -> np.ndarray:
        """``processing_times_s`` of each of ``jobs`` (one row each), computed a profile at a time: the same numbers
        by the same operations, for a caller that submits many jobs (the simulator)."""
        out = np.empty((len(jobs), len(self.classes)))
        by_profile: dict[int, list[int]] = {}
        setup: list[int] = []
        eligible: list[tuple[int, frozenset[str]]] = []
        for k, job in enumerate(jobs):
            by_profile.setdefault(id(job.profile), []).append(k)
            if job.setup_s:
                setup.append(k)
            if job.eligible is not None:
                eligible.append((k, job.eligible))
        for rows in by_profile.values():
            batch, s_per_step, _ = self._table(jobs[rows[0]].profile)
            samples = np.array([jobs[k].samples for k in rows], dtype=float)
            with np.errstate(invalid="ignore"):
                out[rows] = np.ceil(samples[:, None] / batch) * s_per_step
        if setup:
            out[setup] += np.array([jobs[k].setup_s for k in setup])[:, None]
        for k, names in eligible:
            out[k] = np.where(self._eligible_mask(names), out[k], math.inf)
        return out

    def _eligible_mask(self, eligible: frozenset[str]) -> np.ndarray:
        mask = self._eligible_masks.get(eligible)
        if mask is None:
            mask = self._eligible_masks[eligible] = np.array([c.name in eligible for c in self.classes])
        return mask

    def _table(self, profile: FillProfile) -> tuple[np.ndarray, np.ndarray, tuple[Rate | None, ...]]:
        # Keyed by identity: hashing a profile walks every node of every configuration, and the
        # simulator submits tens of thousands of jobs sharing a handful of profile objects.
        hit = self._tables.get(id(profile))
        if hit is not None and hit[0] is profile:
            return hit[1]
        rates = tuple(_best_rate(c.bubbles, c.iteration_s, profile) for c in self.classes)
        batch = np.array([r.config.batch_size if r else 1 for r in rates], dtype=float)
        s_per_step = np.array(
            [
                c.iteration_s / r.steps_per_cycle if r else math.inf
                for c, r in zip(self.classes, rates, strict=True)
            ]
        )
        table = (batch, s_per_step, rates)
        self._tables[id(profile)] = (profile, table)
        return table

    # ---- decisions ---------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._queue.n

    def queued_jobs(self) -> list[FillJobRequest]:
        return list(self._queue.jobs)

    def idle_executors(self) -> int:
        return sum(len(s) for s in self._idle)

    def submit(self, job: FillJobRequest, now_s: float, *, place: bool = True,
               proc_s: np.ndarray | None = None) -> Placement | None:
        """Queue ``job``; with ``place``, start it at once on the idle class where it runs fastest.

        ``proc_s``: the job's processing times as ``processing_times_s`` (or ``processing_times_many``) gives them,
        where the caller computed them already. Raises ValueError if the job fits no executor's bubbles (saying what
        limits it) or its id is taken.
        """
        if job.job_id in self._queue.index or job.job_id in self._running_by_job:
            raise ValueError(
                f"fill job {job.job_id!r} is already queued or running; give each job a unique id"
            )
        if job.samples < 1:
            raise ValueError(f"fill job {job.job_id!r} has {job.samples} samples; give it at least 1")
        if job.gpus != 1:
            raise ValueError(f"fill job {job.job_id!r} runs on {job.gpus} executors at once: place it with "
                             "bubbles.operator.scheduler.gang.place_gang, which reserves them here (occupy)")
        proc = self.processing_times_s(job) if proc_s is None else proc_s
        times = proc.tolist()
        if len(times) != len(self.classes):
            raise ValueError(f"fill job {job.job_id!r}: proc_s has {len(times)} processing times for "
                             f"{len(self.classes)} executor classes; pass processing_times_s(job) or leave it out")
        if not any(map(math.isfinite, times)):
            raise ValueError(self._no_fit_message(job))
        seq = self._seq
        self._seq += 1
        self._version += 1
        if place:
            # Idle executors only coexist with queued jobs that do not fit them, so this job is the only
            # candidate for any idle executor: it goes where it runs fastest (the first such class of equals).
            best_s = min(times)  # NaN, if ever one came first, would stay the minimum: then the loop below decides
            best_c = times.index(best_s)
            if not (best_s < math.inf and self._idle[best_c]):  # the fastest class anywhere is busy: the fastest idle
                best_c, best_s = -1, math.inf
                for c, idle in enumerate(self._idle):
                    if idle and times[c] < best_s:  # finite times only: none is -inf (samples >= 1, times > 0)
                        best_c, best_s = c, times[c]
            if best_c >= 0:
                # Started without passing through the queue: queued and taken out at once, it would leave the queue
                # and its indexes as they were (no index can have seen it), so it is not queued at all.
                return self._run(job, self._idle[best_c].pop(), best_c, best_s, now_s)
        self._queue.add(job, proc, seq)
        return None

    def occupy(self, executor: int, job_id: str, until_s: float) -> None:
        """Mark the idle ``executor`` busy with a job placed elsewhere (say, before a restart) until ``until_s``:
        no job is placed on it, and projections count it free from then on."""
        c = int(self.executor_class[executor])
        if executor not in self._idle[c]:
            raise ValueError(f"executor {executor} is busy already; occupy each executor once")
        self._idle[c].remove(executor)
        self.busy_until_s[executor] = until_s
        self._occupied[executor] = (job_id, until_s)
        self._version += 1

    def idle(self, executor: int) -> bool:
        """Whether ``executor`` runs nothing and is not occupied."""
        return executor in self._idle[self._class_of[executor]]

    def release(self, executor: int, now_s: float, *, fill: bool = True) -> Placement | None:
        """Mark ``executor``'s job done (one a placement started, or one ``occupy`` marked: a gang's); with ``fill``,
        start the best queued job on it (or None)."""
        if self._occupied.pop(executor, None) is not None:
            self.busy_until_s[executor] = 0.0
            self._idle[int(self.executor_class[executor])].append(executor)
            self._version += 1
            return self.fill(executor, now_s) if fill else None
        done = self.running.pop(executor, None)
        if done is None:
            raise ValueError(f"executor {executor} runs no job; release only executors a placement started")
        del self._running_by_job[done.job.job_id]
        self.busy_until_s[executor] = 0.0
        self._idle[self._class_of[executor]].append(executor)
        self._version += 1
        return self.fill(executor, now_s) if fill else None

    def fill(self, executor: int, now_s: float) -> Placement | None:
        """Start the queued job with the highest score on the idle ``executor``."""
        idle = self._idle[self._class_of[executor]]
        if executor not in idle[-1:] and executor not in idle:
            raise ValueError(f"executor {executor} is busy; release it before filling it")
        if not self._queue.n:
            return None  # nothing to choose from (the indexes take in what is queued meanwhile at their next decision)
        k = self.choose(executor, now_s)
        if k is None:
            return None
        idle.remove(executor)
        return self._start(k, executor, now_s)

    def choose(self, executor: int, now_s: float) -> int | None:
        """Index in the queue of the job the policy puts on ``executor`` (None if no queued job fits it)."""
        if not self._queue.fits[self._class_of[executor]]:
            return None
        state = self.state(now_s)
        if self._indexes is not None:
            k = self._indexes.choose(executor, state)
            if k != _SCAN:
                return k
        return _choose(self.policy, self._queue.view(), state, executor)

    def cancel(self, job_id: str) -> FillJobRequest:
        """Take the queued job ``job_id`` out of the queue (its FillJob deleted, or queued again with a new profile).

        Raises KeyError for a job that is not queued, saying what to do instead.
        """
        k = self._queue.index.get(job_id)
        if k is None:
            if job_id in self._running_by_job:
                raise KeyError(f"fill job {job_id!r} is running, not queued; release its executor to stop it")
            raise KeyError(f"fill job {job_id!r} is not queued; cancel only jobs submitted and not yet started")
        self._version += 1
        return self._remove(k)

    def _remove(self, k: int) -> FillJobRequest:
        """Take queue row ``k`` out of the queue and its indexes."""
        if self._indexes is not None:
            self._indexes.discard(k)
        return self._queue.remove(k)

    def dispatch(self, now_s: float) -> list[Placement]:
        """Fill every idle executor that some queued job fits (after ``submit(..., place=False)``)."""
        out: list[Placement] = []
        for c in range(len(self.classes)):
            while self._idle[c] and self._queue.n:
                p = self.fill(self._idle[c][-1], now_s)
                if p is None:
                    break
                out.append(p)
        return out

    def state(self, now_s: float) -> SchedulerState:
        return SchedulerState(now_s, self.busy_until_s, self.executor_class)

    def _start(self, k: int, executor: int, now_s: float) -> Placement:
        """Start queue row ``k`` on the idle ``executor`` (already taken off the idle stack)."""
        c = self._class_of[executor]
        proc_s = float(self._queue.proc_s[k, c])
        return self._run(self._remove(k), executor, c, proc_s, now_s)

    def _run(self, job: FillJobRequest, executor: int, c: int, proc_s: float, now_s: float) -> Placement:
        """Run ``job`` (no longer queued) on ``executor`` of class ``c`` for ``proc_s``."""
        rate = self._table(job.profile)[2][c]
        assert rate is not None  # proc_s is finite only where a rate exists
        p = Placement(
            job=job,
            executor=executor,
            class_index=c,
            config=rate.config,
            steps=math.ceil(job.samples / rate.config.batch_size),
            start_s=now_s,
            end_s=now_s + proc_s,
        )
        self.running[executor] = p
        self._running_by_job[job.job_id] = p
        self.busy_until_s[executor] = p.end_s
        self._version += 1
        return p

    # ---- queries -----------------------------------------------------------------------------------

    def expected_completions(self, now_s: float) -> dict[str, float]:
        """Expected completion time of every running and queued job, with no further arrivals.

        Replays the policy over the queue: each time an executor frees up (earliest first) it takes
        the job the policy would choose then. O(queue x decision); cached until the state changes.
        """
        pr = self._projection
        if pr is not None and pr.version == self._version and pr.at_s == now_s:
            return dict(pr.completion_s)
        out = {p.job.job_id: p.end_s for p in self.running.values()}
        out.update(dict(self._occupied.values()))
        busy = self.busy_until_s.copy()
        heap = [(max(float(t), now_s), e) for e, t in enumerate(busy)]
        heapq.heapify(heap)
        q = self._queue
        n = q.n
        if n and self._indexes is not None:
            self._replay_indexed(heap, busy, out)
        elif n:
            ids = list(q.ids)
            view = QueueView(
                job_ids=ids,
                arrival_s=q.arrival_s[:n].copy(),
                deadline_s=q.deadline_s[:n].copy(),
                proc_s=q.proc_s[:n].copy(),
                min_proc_s=q.min_proc_s[:n].copy(),
                seq=q.seq[:n].copy(),
            )
            left = n
            fits = q.fits.copy()  # per class, the jobs not projected yet that fit it
            # Jobs already projected get +inf processing time everywhere, which _choose skips.
            while left and heap:
                t, e = heapq.heappop(heap)
                busy[e] = t
                c = int(self.executor_class[e])
                if not fits[c]:
                    continue  # no remaining job fits this executor's class (what _choose answers): it stays idle
                k = _choose(self.policy, view, SchedulerState(t, busy, self.executor_class), e)
                if k is None:
                    continue  # no remaining job fits this executor's class: it stays idle
                end = t + float(view.proc_s[k, c])
                out[ids[k]] = end
                fits -= np.isfinite(view.proc_s[k])
                view.proc_s[k] = math.inf
                view.min_proc_s[k] = math.inf
                busy[e] = end
                heapq.heappush(heap, (end, e))
                left -= 1
        self._projection = _Projection(at_s=now_s, version=self._version, completion_s=dict(out))
        return out

    def _replay_indexed(self, heap: list[tuple[float, int]], busy: np.ndarray, out: dict[str, float]) -> None:
        """``expected_completions``' replay over a copy of the queue with indexes of its own: the same decisions at the
        same times as the scanning replay, each O(log n) where the policy offers an index."""
        q = self._queue.copy()
        indexes = _Indexes(self.policy, q)
        while q.n and heap:
            t, e = heapq.heappop(heap)
            busy[e] = t
            state = SchedulerState(t, busy, self.executor_class)
            k = indexes.choose(e, state)
            if k == _SCAN:
                k = _choose(self.policy, q.view(), state, e)
            if k is None:
                continue  # no remaining job fits this executor's class: it stays idle
            end = t + float(q.proc_s[k, int(self.executor_class[e])])
            out[q.ids[k]] = end
            indexes.discard(k)
            q.remove(k)
            busy[e] = end
            heapq.heappush(heap, (end, e))

    def expected_completion_s(self, job_id: str, now_s: float) -> float:
        """When the running or queued job ``job_id`` is expected to finish (inf if never)."""
        etas = self.expected_completions(now_s)
        if job_id not in etas:
            if job_id in self._queue.index:
                return math.inf
            raise KeyError(f"fill job {job_id!r} is neither queued nor running")
        return etas[job_id]

    def can_meet_deadline(self, job: FillJobRequest | str, deadline_s: float, now_s: float) -> DeadlineAnswer:
        """Whether ``job`` (queued, running, or not yet submitted) would finish by ``deadline_s``."""
        if isinstance(job, str):
            eta = self.expected_completion_s(job, now_s)
            return DeadlineAnswer(eta <= deadline_s, eta)
        if job.job_id in self._queue.index or job.job_id in self._running_by_job:
            eta = self.expected_completion_s(job.job_id, now_s)
            return DeadlineAnswer(eta <= deadline_s, eta)
        self.submit(job, now_s, place=False)
        try:
            eta = self.expected_completions(now_s).get(job.job_id, math.inf)
        finally:
            self._remove(self._queue.index[job.job_id])
            self._version += 1
        return DeadlineAnswer(eta <= deadline_s, eta)

    def _no_fit_message(self, job: FillJobRequest) -> str:
        cls = self.classes[0]
        reason = ""
        for cfg in job.profile.configs:
            try:
                plan_partitions(cls.bubbles, cfg.nodes, 1, job=job.profile.key)
            except PlanError as e:
                reason = str(e)
                break
        return (
            f"fill job {job.job_id!r} ({job.profile.key}) fits the bubbles of no executor with any of its "
            f"{len(job.profile.configs)} configurations. {reason}"
        ).strip()


@functools.lru_cache(maxsize=4096)
def _best_rate(bubbles: tuple[Bubble, ...], iteration_s: float, profile: FillProfile) -> Rate | None:
    """The configuration with the most samples per second whose plan fits ``bubbles`` (None if none)."""
    best: Rate | None = None
    for cfg in profile.configs:
        try:
            plan = plan_partitions(bubbles, cfg.nodes, None, job=profile.key)
        except PlanError:
            continue
        spc = plan.steps_per_cycle()
        sps = spc * cfg.batch_size / iteration_s
        if best is None or sps > best.samples_per_s:
            best = Rate(config=cfg, steps_per_cycle=spc, samples_per_s=sps)
    return best


def best_rate(bubbles: tuple[Bubble, ...], iteration_s: float, profile: FillProfile) -> Rate | None:
    """The fastest configuration of ``profile`` that fits ``bubbles`` and its rate (None if none fits); cached."""
    return _best_rate(bubbles, iteration_s, profile)


def _choose(policy: Policy, queue: QueueView, state: SchedulerState, executor: int) -> int | None:
    if len(queue) == 0:
        return None
    col = queue.proc_s[:, state.class_of(executor)]
    fits = np.isfinite(col)
    scores = np.asarray(policy.scores(queue, state, executor), dtype=float)
    scores = np.where(fits & ~np.isnan(scores), scores, -math.inf)
    best = scores.max()
    if best == -math.inf:
        return None
    cand = np.flatnonzero(scores == best)
    if len(cand) == 1:
        return int(cand[0])
    tb = policy.tie_break(queue, state, executor)
    if tb is not None:
        sub = np.asarray(tb)[cand]
        cand = cand[sub == sub.max()]
    return int(cand[np.argmin(queue.seq[cand])])


def classes_from_cycles(cycles: Iterable[tuple[BubbleCycle, int]]) -> list[ExecutorClass]:
    """Executor classes from (cycle, executor count) pairs, merging cycles with identical bubbles."""
    merged: dict[tuple[tuple[Bubble, ...], float], ExecutorClass] = {}
    for cycle, count in cycles:
        cls = ExecutorClass.from_cycle(cycle, count)
        key = (tuple(Bubble(b.duration_s, b.free_bytes) for b in cls.bubbles), cls.iteration_s)
        if key in merged:
            old = merged[key]
            merged[key] = ExecutorClass(old.name, old.bubbles, old.iteration_s, old.executors + count)
        else:
            merged[key] = cls
    return list(merged.values())
