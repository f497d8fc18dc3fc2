"""Set-ups the fill-job SDK's tests share: a CPU-busy fill job, a runtime serving one in a thread with the agent's
end of its channel, and a job whose state is a count.

No torch and no pytest here: ``helpers.sdk:BusyJob`` (and ``test_agent_jobs:BusyJob``, which imports it) is an entry
a fill process imports, and such a process then starts in about 0.1 s.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bubbles.core import control
from bubbles.training.sdk import FillRuntime, IterativeFillJob, StepResult


class BusyJob(IterativeFillJob):
    """Each step keeps the CPU busy for ``step_ms`` (like a kernel would keep a GPU busy)."""

    def __init__(self, step_ms: float = 1.0, flops: float = 1e6) -> None:
        self.step_ns = int(step_ms * 1e6)
        self.flops = flops
        self.created = self.initialized = False

    def create(self) -> None:
        self.created = True

    def init(self) -> None:
        self.initialized = True

    def step(self) -> StepResult:
        end = time.monotonic_ns() + self.step_ns
        while time.monotonic_ns() < end:
            pass
        return StepResult(flops=self.flops, samples=1)


class Counter(IterativeFillJob):
    """Counts its steps; its state is the count."""

    def __init__(self) -> None:
        self.count = 0

    def step(self) -> None:
        self.count += 1

    def checkpoint(self) -> bytes | None:
        return str(self.count).encode()

    def restore(self, state: bytes) -> None:
        self.count = int(state)


class Channel:
    """The agent's end of a runtime's control socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines = control.LineBuffer()
        self.events: list[control.ControlMessage] = []
        sock.settimeout(0.05)

    def send(self, type_: str, **fields: Any) -> None:
        self.sock.sendall(control.encode(type_, **fields))

    def wait(self, type_: str, timeout_s: float = 5.0, **match: Any) -> control.ControlMessage:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events:
                if ev.type == type_ and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.events += [control.parse_event(line) for line in self.lines.feed(data)]
        got = [e.type for e in self.events]
        raise AssertionError(f"no {type_} {match} event within {timeout_s} s; got {got}")

    def drain(self) -> None:
        """Read every event sent so far (until the socket has been quiet for its 50 ms timeout)."""
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return
            if not data:
                return
            self.events += [control.parse_event(line) for line in self.lines.feed(data)]

    def count(self, type_: str, **match: Any) -> int:
        return sum(1 for ev in self.events if ev.type == type_ and all(ev.get(k) == v for k, v in match.items()))

    def wait_count(self, n: int, type_: str, timeout_s: float = 5.0, **match: Any) -> None:
        """Wait until ``n`` events of this type (and fields) have arrived."""
        deadline = time.monotonic() + timeout_s
        while self.count(type_, **match) < n:
            assert time.monotonic() < deadline, f"fewer than {n} {type_} {match} events within {timeout_s} s"
            with contextlib.suppress(TimeoutError):
                self.events += [control.parse_event(line) for line in self.lines.feed(self.sock.recv(65536))]


@contextlib.contextmanager
def serving(path: Path, job: BusyJob, **kwargs: Any) -> Iterator[tuple[Channel, FillRuntime]]:
    """A FillRuntime serving ``job`` in a thread, its control channel, and a check that it cleans up."""
    ours, theirs = socket.socketpair()
    rt = FillRuntime(job, theirs, name="busy", socket_path=str(path), **{"step_s": None, **kwargs})
    thread = threading.Thread(target=rt.serve, daemon=True)
    thread.start()
    try:
        yield Channel(ours), rt
    finally:
        ours.close()
        thread.join(5)
    assert not thread.is_alive()
    assert not path.exists(), "the runtime left its socket behind"


def init_and_arm(ch: Channel, path: Path, share: float = 1.0) -> None:
    """Initialize the runtime, arm it in harvest mode at ``share`` and wait until it listens on ``path``."""
    ch.send("init")
    ch.wait("state", state="PAUSED")
    ch.send("arm", mode="harvest", share=share)
    wait_for_socket(path)


def wait_for_socket(path: Path) -> None:
    deadline = time.monotonic() + 5
    while not path.exists():
        assert time.monotonic() < deadline, "the runtime did not bind its signal socket"
        time.sleep(0.001)


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Put torch's thread count back afterwards: ``apply_process_limits`` pins torch to one thread, in the test
    process too."""
    import torch  # here, not at the top: a fill process that imports BusyJob starts without torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
