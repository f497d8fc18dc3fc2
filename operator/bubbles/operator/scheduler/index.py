"""Queue indexes: one executor class's queued jobs kept in a policy's order, so that a decision need not score them all.

Without an index, each time an executor frees up the scheduler scores every queued job for it (``Policy.scores``) and
takes the highest score, ties to the higher ``tie_break``, then to the earliest submitted (``core._choose``): a
decision costs time in proportion to the queue. An index (``QueueIndex``, one per executor class, made by
``Policy.index``) keeps the jobs that fit its class ordered so that the same choice, ties included, is found in
O(log n): the scheduler adds the jobs submitted since its last decision on that class, removes each job that leaves
the queue (started, cancelled), and asks it for the choice.

Three kinds, by how a policy's score depends on time and on the executors' state:

- ``StaticIndex``: the score and tie-break depend only on the job and the class (FIFO, SJF, weighted mixes of such):
  each job is scored once, with the policy's own ``scores``, when the index takes it in, and kept sorted by
  (-score, -tie_break, submission order), exactly the scan's order.
- ``MakespanIndex``: 1 / max(p, R), p the job's processing time on the class, R the longest remaining busy time of
  any executor (it changes with every decision). The score is monotone in p for any R, so the jobs are kept sorted by
  (p, submission order); a decision finds the best score's jobs as a prefix of that order (every p <= R scores 1/R,
  then the next p's whose rounded 1 / p still equals the best) and takes the longest of them, the earliest
  submitted among equals.
- ``DeadlineIndex``: 2 + 1 / (1 + max(deadline - now, 0)) for jobs with a deadline, monotone in the deadline for any
  now, so those are kept sorted by (deadline, submission order); every job whose deadline has passed scores exactly
  3, and the scan then takes the earliest submitted of them, so those are also kept by submission order (re-keyed
  only as the clock passes their deadlines, in either direction). Jobs without a deadline score 1 / (1 + shortest
  processing time), static.

The last two walk, beyond the first job, only over distinct keys whose rounded scores equal the best one (a few
floats apart in practice: two deadlines a day away tie only within microseconds of each other); each step is a
search, so jobs sharing one key cost one step.
"""

from __future__ import annotations

import math
import struct
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bubbles.operator.scheduler.policies import DeadlinePolicy, Policy, QueueView, SchedulerState

# Keys are Python ints, not tuples: (a, seq) is ``ordered(a) << 64 | seq`` and (a, b, seq) is
# ``ordered(a) << 128 | ordered(b) << 64 | seq``, where ``ordered`` maps a float to 64 bits whose order as unsigned
# integers is the floats' (-0.0 taken as 0.0, which it equals). They sort as the tuples do, compare in one step (a
# tuple compares its items for equality first, then for order), and the garbage collector does not track them:
# at 100,000 GPUs x 100,000 queued, tuple keys made a decision's index upkeep (each of the 16 classes' indexes loses
# the started job and takes in the next one) most of its time. Submission numbers stay below 2**64.
SEQ_BITS = 64
SEQ_MASK = (1 << SEQ_BITS) - 1
AFTER = SEQ_MASK  # above every submission number: (a, AFTER) searches past every item of key a
_SIGN = 1 << 63
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")


def ordered(x: float) -> int:
    """64 bits whose unsigned order is the floats' (not NaN; -0.0 as 0.0)."""
    (b,) = _U64.unpack(_F64.pack(x + 0.0))
    return b ^ SEQ_MASK if b & _SIGN else b | _SIGN


def unordered(b: int) -> float:
    """The float ``ordered`` mapped to ``b``."""
    (x,) = _F64.unpack(_U64.pack(b ^ _SIGN if b & _SIGN else b ^ SEQ_MASK))
    return float(x)


def ordered_many(x: np.ndarray) -> list[int]:
    """``ordered`` of each of ``x``."""
    b = (np.asarray(x, dtype=np.float64) + 0.0).view(np.uint64)
    out: list[int] = np.where(b >> np.uint64(63) != 0, ~b, b | np.uint64(_SIGN)).tolist()  # Python ints
    return out


def key2(a: float, seq: int) -> int:
    return ordered(a) << SEQ_BITS | seq


def key_first(key: int) -> float:
    """The float a two-part key was made from."""
    return unordered(key >> SEQ_BITS)


def seq_of(key: int) -> int:
    return key & SEQ_MASK


class SortedItems:
    """Distinct comparable items in ascending order, held in blocks of a few hundred: a search costs two bisections,
    an insertion or removal moves at most one block's items (sortedcontainers' layout, which the project does not
    depend on at run time)."""

    def __init__(self, items: Iterable[Any] = (), *, load: int = 256) -> None:
        self._load = load
        self._set(sorted(items))

    def _set(self, ordered: list[Any]) -> None:
        load = self._load
        self._lists = [ordered[i : i + load] for i in range(0, len(ordered), load)]
        self._maxes = [b[-1] for b in self._lists]
        self._len = len(ordered)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        for b in self._lists:
            yield from b

    def update(self, items: list[Any]) -> None:
        """Add ``items`` (none already held): one by one, or by re-sorting everything when they are many."""
        if len(items) * 8 > self._len:
            self._set(sorted([*self, *items]))
        else:
            for x in items:
                self.add(x)

    def add(self, x: Any) -> None:
        maxes, lists = self._maxes, self._lists
        if not maxes:
            lists.append([x])
            maxes.append(x)
            self._len = 1
            return
        i = bisect_left(maxes, x)
        if i == len(maxes):
            i -= 1
            b = lists[i]
            b.append(x)
            maxes[i] = x
        else:
            b = lists[i]
            insort(b, x)
        self._len += 1
        if len(b) > 2 * self._load:
            half = len(b) // 2
            lists[i : i + 1] = [b[:half], b[half:]]
            maxes[i : i + 1] = [b[half - 1], b[-1]]

    def remove(self, x: Any) -> None:
        """Remove ``x``; KeyError if it is not held."""
        maxes, lists = self._maxes, self._lists
        i = bisect_left(maxes, x)
        if i == len(maxes):
            raise KeyError(x)
        b = lists[i]
        j = bisect_left(b, x)
        if b[j] != x:
            raise KeyError(x)
        del b[j]
        self._len -= 1
        if not b:
            del lists[i]
            del maxes[i]
        elif j == len(b):
            maxes[i] = b[-1]

    def first(self) -> Any | None:
        return self._lists[0][0] if self._lists else None

    def first_above(self, x: Any) -> Any | None:
        """The smallest item > ``x`` (None if none)."""
        i = bisect_right(self._maxes, x)
        if i == len(self._maxes):
            return None
        b = self._lists[i]
        return b[bisect_right(b, x)]

    def first_at_least(self, x: Any) -> Any | None:
        """The smallest item >= ``x`` (None if none)."""
        i = bisect_left(self._maxes, x)
        if i == len(self._maxes):
            return None
        b = self._lists[i]
        return b[bisect_left(b, x)]

    def last_at_most(self, x: Any) -> Any | None:
        """The largest item <= ``x`` (None if none)."""
        i = bisect_right(self._maxes, x)
        if i < len(self._maxes):
            b = self._lists[i]
            j = bisect_right(b, x)
            if j:
                return b[j - 1]
        return self._lists[i - 1][-1] if i else None

    def between(self, lo: Any, hi: Any) -> list[Any]:
        """The items > ``lo`` and <= ``hi``, ascending."""
        out: list[Any] = []
        i = bisect_right(self._maxes, lo)
        if i == len(self._maxes):
            return out
        j = bisect_right(self._lists[i], lo)
        for b in self._lists[i:]:
            for x in b[j:]:
                if x > hi:
                    return out
                out.append(x)
            j = 0
        return out


class QueueIndex:
    """The queued jobs that fit one executor class, in a policy's order: what ``Policy.index`` returns.

    The scheduler calls ``add`` with the jobs queued since the index last saw the queue (all of them fit the class),
    ``discard`` for each of them that leaves the queue, and ``choose`` for a decision: it must return the submission
    number (``QueueView.seq``) of the job that scanning the queue would choose at that state, or None where the scan
    chooses none. Jobs are told apart by submission number, unique for the scheduler's life.
    """

    def add(self, jobs: QueueView, state: SchedulerState, executor: int) -> None:
        raise NotImplementedError

    def discard(self, jobs: QueueView, k: int) -> None:
        raise NotImplementedError

    def choose(self, state: SchedulerState, executor: int) -> int | None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class StaticIndex(QueueIndex):
    """For a policy whose score and tie-break depend only on the job and the class: each job scored once with the
    policy's own ``scores`` and ``tie_break``, kept sorted by (-score, -tie_break, submission number). Jobs scoring
    NaN or -inf are left out: the scan never chooses them either."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.items = SortedItems()
        self.key_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def add(self, jobs: QueueView, state: SchedulerState, executor: int) -> None:
        scores = np.asarray(self.policy.scores(jobs, state, executor), dtype=float)
        tb = self.policy.tie_break(jobs, state, executor)
        ok = ~np.isnan(scores) & (scores != -math.inf)
        seqs = jobs.seq[ok].tolist()
        neg = ordered_many(-scores[ok])
        keys: list[int]
        if tb is None:
            keys = [a << SEQ_BITS | s for a, s in zip(neg, seqs, strict=True)]
        else:
            ties = ordered_many(-np.asarray(tb, dtype=float)[ok])
            keys = [a << 2 * SEQ_BITS | b << SEQ_BITS | s for a, b, s in zip(neg, ties, seqs, strict=True)]
        key_of = self.key_of
        for key, s in zip(keys, seqs, strict=True):
            key_of[s] = key
        self.items.update(keys)

    def discard(self, jobs: QueueView, k: int) -> None:
        key = self.key_of.pop(int(jobs.seq[k]), None)
        if key is not None:
            self.items.remove(key)

    def choose(self, state: SchedulerState, executor: int) -> int | None:
        first = self.items.first()
        return None if first is None else first & SEQ_MASK


def _inverse(x: float) -> float:
    return 1.0 / x if x != 0.0 else math.inf  # numpy's 1.0 / 0.0, which the scan computes


class MakespanIndex(QueueIndex):
    """``MakespanPolicy`` on one class: jobs sorted by (processing time on the class, submission number)."""

    def __init__(self, class_index: int) -> None:
        self.c = class_index
        self.items = SortedItems()

    def __len__(self) -> int:
        return len(self.items)

    def add(self, jobs: QueueView, state: SchedulerState, executor: int) -> None:
        procs = ordered_many(jobs.proc_s[:, self.c])
        self.items.update([p << SEQ_BITS | s for p, s in zip(procs, jobs.seq.tolist(), strict=True)])

    def discard(self, jobs: QueueView, k: int) -> None:
        self.items.remove(key2(float(jobs.proc_s[k, self.c]), int(jobs.seq[k])))

    def choose(self, state: SchedulerState, executor: int) -> int | None:
        items = self.items
        first = items.first()
        if first is None:
            return None
        rem = state.max_rem_time_s
        cur = first >> SEQ_BITS  # p's bits: the search is on them, the score on p
        best = _inverse(max(unordered(cur), rem))
        # The jobs scoring `best` are a prefix of the order (the score never rises with p); the scan breaks their tie
        # to the longest (MakespanPolicy.tie_break), then to the earliest submitted.
        if unordered(cur) <= rem:
            under = items.last_at_most(key2(rem, AFTER))  # every p <= rem scores exactly 1 / rem
            assert under is not None  # the first one is
            cur = under >> SEQ_BITS
        nxt = items.first_above(cur << SEQ_BITS | AFTER)
        while nxt is not None and _inverse(max(unordered(nxt >> SEQ_BITS), rem)) == best:
            cur = nxt >> SEQ_BITS
            nxt = items.first_above(cur << SEQ_BITS | AFTER)
        winner = items.first_at_least(cur << SEQ_BITS)  # the earliest submitted of the longest
        assert winner is not None
        return winner & SEQ_MASK


class DeadlineIndex(QueueIndex):
    """``DeadlinePolicy``: jobs with a deadline sorted by (deadline, submission number), those whose deadline is at
    or before the last decision's clock also by submission number (they all score exactly 3); jobs without one by
    (-score, submission number)."""

    def __init__(self, policy: DeadlinePolicy) -> None:
        self.policy = policy
        self.dated = SortedItems()  # (deadline_s, seq) keys
        self.overdue = SortedItems()  # seq of the dated jobs with deadline_s <= self.split
        self.split = -math.inf
        self.undated = SortedItems()  # (-score, seq) keys

    def __len__(self) -> int:
        return len(self.dated) + len(self.undated)

    def add(self, jobs: QueueView, state: SchedulerState, executor: int) -> None:
        has = ~np.isnan(jobs.deadline_s)
        undated_scores = self.policy.undated_scores(jobs.min_proc_s[~has])
        self.undated.update([a << SEQ_BITS | s for a, s in zip(ordered_many(-undated_scores),
                                                                 jobs.seq[~has].tolist(), strict=True)])
        deadlines = jobs.deadline_s[has]
        seqs = jobs.seq[has].tolist()
        self.dated.update([d << SEQ_BITS | s for d, s in zip(ordered_many(deadlines), seqs, strict=True)])
        self.overdue.update([s for d, s in zip(deadlines.tolist(), seqs, strict=True) if d <= self.split])

    def discard(self, jobs: QueueView, k: int) -> None:
        d, s = float(jobs.deadline_s[k]), int(jobs.seq[k])
        if math.isnan(d):
            self.undated.remove(key2(-float(self.policy.undated_scores(jobs.min_proc_s[k : k + 1])[0]), s))
            return
        self.dated.remove(key2(d, s))
        if d <= self.split:
            self.overdue.remove(s)

    def _move_split(self, now_s: float) -> None:
        """Re-key the jobs whose deadlines the clock passed since the last decision (or un-passed, going back)."""
        if now_s > self.split:
            self.overdue.update([k & SEQ_MASK for k in self.dated.between(key2(self.split, AFTER),
                                                                           key2(now_s, AFTER))])
        elif now_s < self.split:
            for k in self.dated.between(key2(now_s, AFTER), key2(self.split, AFTER)):
                self.overdue.remove(k & SEQ_MASK)
        self.split = now_s

    def choose(self, state: SchedulerState, executor: int) -> int | None:
        now = state.now_s
        self._move_split(now)
        first = self.dated.first()
        if first is None:
            u = self.undated.first()
            return None if u is None else u & SEQ_MASK
        score = self.policy.dated_score
        best = score(key_first(first), now)
        # The best score's jobs are a prefix of the deadline order; the scan takes the earliest submitted of them.
        passed = self.overdue.first()
        if passed is not None:
            cand, cur = int(passed), ordered(now)
        else:
            cand, cur = first & SEQ_MASK, first >> SEQ_BITS
        nxt = self.dated.first_above(cur << SEQ_BITS | AFTER)
        while nxt is not None and score(key_first(nxt), now) == best:
            cand = min(cand, nxt & SEQ_MASK)
            nxt = self.dated.first_above((nxt >> SEQ_BITS) << SEQ_BITS | AFTER)
        return cand
