"""What the hook keeps per schedule (its profiling window, then its cycle) and what its instruction wrappers read."""

from __future__ import annotations

from bubbles.core.cycle import BubbleCycle, RecentLengths

from .profile import Candidate

NO_SIGNALS: dict[int, tuple[int, int]] = {}


class ScheduleProfile:
    """Per (schedule class, micro-batches): the profiling window, then the cycle and the signal map."""

    def __init__(self, name: str, microbatches: int) -> None:
        self.name = name
        self.microbatches = microbatches
        self.seen = 0
        self.stream: tuple[str, ...] | None = None
        self.candidates: list[Candidate] = []
        self.records_len = 0  # records per iteration (instructions, collectives inside them, the loss broadcast)
        self.durations: list[list[float]] = []
        self.iter_s: list[float] = []
        self.free: dict[int, int] = {}  # position -> min free bytes sampled there
        self.allocated: dict[int, int] = {}  # position -> max bytes the training held there
        self.cycle: BubbleCycle | None = None
        self.signal_map: dict[int, tuple[int, int]] = {}  # position -> (slot, predicted length ns)
        self.recent: RecentLengths | None = None  # each signalled bubble's recent lengths


class Hot:
    """State the per-instruction wrappers read: kept in one small object so lookups stay cheap."""

    __slots__ = ("records", "sampling", "signal_map")

    def __init__(self) -> None:
        self.records: list[tuple[int, int, int]] = []  # (instruction code, start_ns, end_ns)
        self.signal_map: dict[int, tuple[int, int]] = NO_SIGNALS
        self.sampling = False
