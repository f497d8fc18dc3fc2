"""Scheduling policies (PipeFill section 4.4) and their registry.

A policy is a function of (job, state of all executors, index of the executor to fill) returning a
score; when an executor frees up, the queued job with the highest score runs on it. A policy may
also score the whole queue at once (``scores``): the scheduler calls that, and the built-ins
implement it with numpy so that a decision over 10,000 queued jobs stays in the millisecond range.
A plain function ``f(job, state, i) -> float`` is a valid policy too; it is wrapped in
``FunctionPolicy`` and called once per queued job.

Decisions that do not scan the queue. Scoring every queued job at each decision costs time in proportion to the
queue; a policy may instead let the scheduler keep each executor class's queued jobs in its order (an index,
``bubbles.operator.scheduler.index``), so that a decision costs O(log n) and chooses exactly what the scan would,
ties included. How a policy opts in:

- ``static = True`` (a class attribute): its ``scores`` and ``tie_break`` for a job depend only on that job and the
  executor's class: not on the clock, the executors' state or the other queued jobs. Each job is then scored once
  per class, by the same ``scores`` and ``tie_break`` (so with the same numbers), when it is queued, and kept sorted.
  FIFO and SJF declare it; a weighted mix is static when all its parts are.
- ``index(class_index)`` returning a ``QueueIndex`` of its own: for scores that move with time or state, where the
  policy knows which order the time cannot change (``MakespanPolicy`` and ``DeadlinePolicy`` do this).

Everything else is served by the scan, as before: a plain function, a policy that declares neither, a weighted mix
with a time-dependent part. A declaration counts only where it is made by the class that defines the policy's
``scores`` and ``tie_break`` or by a subclass of it: a subclass of ``ShortestJobFirstPolicy`` that overrides
``scores`` is scanned until it says ``static = True`` itself (``queue_index``). ``Scheduler(..., index=False)``
scans whatever the policy.

Policies are found through the entry-point group ``bubbles.policies`` (name -> ``module:attribute``,
the attribute being a ``Policy`` subclass, a ``Policy`` instance or a plain function). The built-ins
are declared there too; a built-in whose entry point is missing (the package's metadata predates
it, or the source tree runs without being installed) is taken from ``BUILTIN_POLICIES`` instead.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from bubbles.operator.scheduler.index import DeadlineIndex, MakespanIndex, QueueIndex, StaticIndex

ENTRY_POINT_GROUP = "bubbles.policies"
_FLOAT_MAX = float(np.finfo(float).max)

# name -> "module:attribute": the same values as pyproject.toml's [project.entry-points."bubbles.policies"]
BUILTIN_POLICIES: dict[str, str] = {
    "fifo": "bubbles.operator.scheduler.policies:FifoPolicy",
    "sjf": "bubbles.operator.scheduler.policies:ShortestJobFirstPolicy",
    "makespan": "bubbles.operator.scheduler.policies:MakespanPolicy",
    "deadline": "bubbles.operator.scheduler.policies:DeadlinePolicy",
}


@dataclass(frozen=True)
class JobInfo:
    """What a policy knows of one job: PipeFill's (arrival time, processing times, deadline)."""

    job_id: str
    arrival_s: float
    deadline_s: float | None
    # Processing time on each executor class (executors with the same bubble cycle share it);
    # math.inf where the job fits none of the class's bubbles. Use ``proc_time_s(state, i)``.
    proc_times_s: tuple[float, ...]

    def proc_time_s(self, state: SchedulerState, executor: int) -> float:
        """Processing time of this job on executor ``executor``."""
        return self.proc_times_s[int(state.executor_class[executor])]


@dataclass(frozen=True)
class QueueView:
    """The queued jobs as columns (row k is one job); views into the scheduler's arrays, do not modify."""

    job_ids: Sequence[str]
    arrival_s: np.ndarray  # (n,)
    deadline_s: np.ndarray  # (n,), NaN where a job has no deadline
    proc_s: np.ndarray  # (n, classes), inf where the job does not fit the class
    min_proc_s: np.ndarray  # (n,), the row minimum of proc_s
    seq: np.ndarray  # (n,), submission order

    def __len__(self) -> int:
        return len(self.arrival_s)

    def job(self, k: int) -> JobInfo:
        d = float(self.deadline_s[k])
        return JobInfo(
            job_id=self.job_ids[k],
            arrival_s=float(self.arrival_s[k]),
            deadline_s=None if math.isnan(d) else d,
            proc_times_s=tuple(float(x) for x in self.proc_s[k]),
        )


class SchedulerState:
    """The state of all executors at ``now_s``, as PipeFill's policies see it."""

    def __init__(self, now_s: float, busy_until_s: np.ndarray, executor_class: np.ndarray) -> None:
        self.now_s = now_s
        self.busy_until_s = busy_until_s
        self.executor_class = executor_class
        self._rem: np.ndarray | None = None
        self._max_rem: float | None = None

    @property
    def rem_times_s(self) -> np.ndarray:
        """Remaining busy time of every executor (0 for an idle one): PipeFill's ``s.rem_times``."""
        if self._rem is None:
            self._rem = np.maximum(self.busy_until_s - self.now_s, 0.0)
        return self._rem

    @property
    def max_rem_time_s(self) -> float:
        if self._max_rem is None:
            self._max_rem = (
                max(0.0, float(self.busy_until_s.max()) - self.now_s) if len(self.busy_until_s) else 0.0
            )
        return self._max_rem

    def class_of(self, executor: int) -> int:
        return int(self.executor_class[executor])


class Policy:
    """Base of scheduling policies: override ``score`` (one job) and, for speed, ``scores`` (the queue)."""

    name = "policy"
    # True: scores and tie-break depend only on the job and the executor's class, and the scheduler may keep the
    # queue sorted by them (see the module's docstring).
    static: bool = False

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        raise NotImplementedError

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        """Scores of every queued job for ``executor``; higher runs first."""
        return np.array([self.score(queue.job(k), state, executor) for k in range(len(queue))], dtype=float)

    def tie_break(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray | None:
        """Among jobs of equal score, the higher value here wins; None: the earliest submitted wins."""
        return None

    def index(self, class_index: int) -> QueueIndex | None:
        """An index of class ``class_index``'s queued jobs in this policy's order, or None: every decision scans.

        The default serves ``static`` policies; override it for an order of your own (``QueueIndex``). The scheduler
        calls ``queue_index``, which honours this only where it is defined as low in the class tree as ``scores``.
        """
        return StaticIndex(self) if self.static else None

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


def _owner(policy: Policy, attr: str) -> type:
    """The class whose definition of ``attr`` the policy uses (its own type for an attribute set on the instance)."""
    if attr in getattr(policy, "__dict__", {}):
        return type(policy)
    return next(k for k in type(policy).__mro__ if attr in vars(k))


def _declared_by_scorer(policy: Policy, attr: str) -> bool:
    """Whether ``attr`` is defined by the class that defines the policy's scores and tie-break, or by a subclass."""
    mro = type(policy).__mro__
    where = mro.index(_owner(policy, attr))
    return where <= min(mro.index(_owner(policy, "scores")), mro.index(_owner(policy, "tie_break")))


def is_static(policy: Policy) -> bool:
    """Whether ``policy`` declares ``static`` where its scores are defined (see the module's docstring)."""
    return bool(policy.static) and _declared_by_scorer(policy, "static")


def queue_index(policy: Policy, class_index: int) -> QueueIndex | None:
    """The index ``policy`` offers for class ``class_index`` (None: decisions scan the queue).

    A declaration (``static``, or an ``index`` override) inherited from a class above the one that defines the
    policy's ``scores`` or ``tie_break`` is ignored: it described other scores.
    """
    if _owner(policy, "index") is Policy:
        return StaticIndex(policy) if is_static(policy) else None
    return policy.index(class_index) if _declared_by_scorer(policy, "index") else None


class FunctionPolicy(Policy):
    """A plain ``f(job, state, executor) -> float`` as a policy."""

    def __init__(self, name: str, fn: Callable[[JobInfo, SchedulerState, int], float]) -> None:
        self.name = name
        self.fn = fn

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        return float(self.fn(job, state, executor))


class FifoPolicy(Policy):
    """First in, first out: the earliest arrival first."""

    name = "fifo"
    static = True

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        return -job.arrival_s

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        return -queue.arrival_s


class ShortestJobFirstPolicy(Policy):
    """Shortest job first: f = 1 / min(job's processing times over all executors)."""

    name = "sjf"
    static = True

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        return 1.0 / min(job.proc_times_s)

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        return 1.0 / queue.min_proc_s


class MakespanPolicy(Policy):
    """Makespan minimizing: f = 1 / max(processing time on executor i, remaining busy times).

    Jobs that end before the busiest executor does all score alike; among them the longest goes
    first (it fills the time up to the current horizon best, as in longest-processing-time-first).
    """

    name = "makespan"

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        return 1.0 / max(job.proc_time_s(state, executor), state.max_rem_time_s)

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        col = queue.proc_s[:, state.class_of(executor)]
        return 1.0 / np.maximum(col, state.max_rem_time_s)

    def tie_break(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray | None:
        return queue.proc_s[:, state.class_of(executor)]

    def index(self, class_index: int) -> QueueIndex | None:
        return MakespanIndex(class_index)


class DeadlinePolicy(Policy):
    """Proximity to deadline first (earliest deadline), then shortest job first for jobs without one.

    Scores: a job with a deadline scores 2 + 1 / (1 + seconds to its deadline) (in (2, 3]); one
    without scores 1 / (1 + its shortest processing time) (in (0, 1), the same order as SJF).
    """

    name = "deadline"

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        if job.deadline_s is not None:
            return 2.0 + 1.0 / (1.0 + max(job.deadline_s - state.now_s, 0.0))
        return 1.0 / (1.0 + min(job.proc_times_s))

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        has = ~np.isnan(queue.deadline_s)
        to_deadline = np.maximum(np.nan_to_num(queue.deadline_s, nan=0.0) - state.now_s, 0.0)
        return np.where(has, 2.0 + 1.0 / (1.0 + to_deadline), 1.0 / (1.0 + queue.min_proc_s))

    @staticmethod
    def dated_score(deadline_s: float, now_s: float) -> float:
        """``scores``' value for one job with a deadline (the same float operations, so the same number; an infinite
        deadline becomes the largest float, as nan_to_num makes it there)."""
        d = min(max(deadline_s, -_FLOAT_MAX), _FLOAT_MAX)
        return 2.0 + 1.0 / (1.0 + max(d - now_s, 0.0))

    @staticmethod
    def undated_scores(min_proc_s: np.ndarray) -> np.ndarray:
        """``scores``' values for jobs without a deadline."""
        return 1.0 / (1.0 + min_proc_s)

    def index(self, class_index: int) -> QueueIndex | None:
        return DeadlineIndex(self)


class WeightedPolicy(Policy):
    """A weighted sum of policies' scores (PipeFill's hierarchical policies); the scales are the user's."""

    def __init__(self, parts: Sequence[tuple[float, Policy]]) -> None:
        if not parts:
            raise ValueError("a weighted policy needs at least one (weight, policy) part")
        self.parts = tuple(parts)
        self.name = "+".join(f"{w:g}*{p.name}" for w, p in self.parts)

    @property
    def static(self) -> bool:  # type: ignore[override]
        """A sum of static scores is static; one time-dependent part makes the sum need the scan."""
        return all(is_static(p) for _w, p in self.parts)

    def score(self, job: JobInfo, state: SchedulerState, executor: int) -> float:
        return sum(w * p.score(job, state, executor) for w, p in self.parts)

    def scores(self, queue: QueueView, state: SchedulerState, executor: int) -> np.ndarray:
        total = np.zeros(len(queue))
        for w, p in self.parts:
            total += w * p.scores(queue, state, executor)
        return total


class UnknownPolicyError(ValueError):
    """A policy name that no entry point and no built-in provides."""


def available_policies() -> dict[str, str]:
    """Every selectable policy: name -> ``module:attribute``, entry points first, built-ins filling gaps."""
    found: dict[str, str] = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name, target in BUILTIN_POLICIES.items():
        found.setdefault(name, target)  # only where the entry point is missing
    return dict(sorted(found.items()))


def get_policy(spec: str | Policy) -> Policy:
    """A policy by name (``sjf``) or weighted composition (``0.7*deadline+0.3*fifo``).

    Raises UnknownPolicyError listing the known names for a name nobody registered.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownPolicyError(f"a policy name is needed; known: {', '.join(available_policies())}")
    text = spec.replace(" ", "")
    if "+" in text or "*" in text:
        parts: list[tuple[float, Policy]] = []
        for term in text.split("+"):
            m = re.fullmatch(r"(?:([0-9.eE+-]+)\*)?([A-Za-z_][\w.-]*)", term)
            if not m:
                raise UnknownPolicyError(
                    f"cannot read policy term {term!r} in {spec!r}; write weighted policies as "
                    "'0.7*deadline+0.3*fifo'"
                )
            try:
                weight = float(m.group(1)) if m.group(1) else 1.0
            except ValueError:
                raise UnknownPolicyError(f"weight {m.group(1)!r} in {spec!r} is not a number") from None
            parts.append((weight, _load_one(m.group(2))))
        return WeightedPolicy(parts)
    return _load_one(text)


def _load_one(name: str) -> Policy:
    known = available_policies()
    if name not in known:
        raise UnknownPolicyError(
            f"unknown scheduling policy {name!r}; known policies: {', '.join(known)}. "
            f"Register your own under the {ENTRY_POINT_GROUP!r} entry-point group."
        )
    obj = _resolve(name, known[name])
    if isinstance(obj, type) and issubclass(obj, Policy):
        return obj()
    if isinstance(obj, Policy):
        return obj
    if callable(obj):
        return FunctionPolicy(name, obj)
    raise TypeError(
        f"entry point {name!r} ({known[name]}) is neither a Policy nor a function f(job, state, executor)"
    )


def _resolve(name: str, target: str) -> Any:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def builtin_policies() -> Mapping[str, str]:
    return dict(BUILTIN_POLICIES)
