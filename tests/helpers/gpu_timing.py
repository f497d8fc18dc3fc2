"""Fakes of a CUDA stream and event for the device-timing tests (the real interface: record, query, synchronize,
elapsed_time), and whether a real GPU is here."""

from __future__ import annotations

import threading
import time

import torch

COMPUTE_S = 0.004  # per forward/backward pass, on the fake device
WAIT_S = 0.006  # how long each receive waits for its data, on the fake device


class FakeStream:
    """A device queue: work is enqueued by the host and finishes later, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy_until = time.monotonic()

    def enqueue(self, seconds: float) -> None:
        with self.lock:
            self.busy_until = max(self.busy_until, time.monotonic()) + seconds

    def tail(self) -> float:
        with self.lock:
            return max(self.busy_until, time.monotonic())


class FakeEvent:
    """``torch.cuda.Event``'s interface on a ``FakeStream``: complete when the work before it is."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.stream.tail()

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize() before record()"
        delay = self.at - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


def cuda_available() -> bool:

    return bool(torch.cuda.is_available())
