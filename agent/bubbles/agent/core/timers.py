"""The core's timers: typed entries of one heap, earliest deadline first.

Each has a kind instead of a bubble sequence number that doubles as a flag; entries are ordered by
``(deadline_ns, tie)`` alone, the tie unique, as the 5-tuples they replace were.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import NamedTuple

from .records import JobRecord


class TimerKind(enum.Enum):
    """What a timer does when it is due."""

    WATCHDOG = "watchdog"  # a job still in a step of an ended bubble once its grace is over is killed
    INIT_DEADLINE = "init deadline"  # a job whose init has not finished is killed
    STOP_DEADLINE = "stop deadline"  # a process asked to stop that has not exited is killed
    END_OVERDUE = "end overdue"  # a plain command whose bubble's END never came is frozen


class Timer(NamedTuple):
    """One timer: due at ``deadline_ns``; ``bubble_seq`` and ``bubble_end_ns`` for the kinds about a bubble (the
    watchdog: both; END overdue: its seq)."""

    deadline_ns: int
    tie: int  # unique, in push order: equal deadlines fire in that order and never compare what follows
    job: JobRecord
    kind: TimerKind
    bubble_seq: int = -1
    bubble_end_ns: int = 0


class Timers:
    """The heap of pending timers."""

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._tie = itertools.count()

    def push(self, deadline_ns: int, job: JobRecord, kind: TimerKind, bubble_seq: int = -1,
             bubble_end_ns: int = 0) -> None:
        heapq.heappush(self._heap, Timer(deadline_ns, next(self._tie), job, kind, bubble_seq, bubble_end_ns))

    def next_deadline_ns(self) -> int | None:
        return self._heap[0].deadline_ns if self._heap else None

    def due_jobs(self, now_ns: int) -> list[JobRecord]:
        """The jobs of every timer due at ``now_ns``, in heap order, without taking them."""
        return [t.job for t in self._heap if t.deadline_ns <= now_ns]

    def pop_due(self, now_ns: int) -> Timer | None:
        """The earliest timer if it is due at ``now_ns`` (taken off the heap), else None."""
        if self._heap and self._heap[0].deadline_ns <= now_ns:
            return heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return len(self._heap)
