"""Set-ups of the agent's end-to-end tests (tests/test_agent.py and the modules that drive a real agent): the
training's hook played from the test, a started agent on a thread, waits with deadlines."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bubbles.agent.server import Agent, AgentConfig
from bubbles.core import paths, wire
from bubbles.core.api import FillJobSpec, parse_spec
from bubbles.core.identity import LOCAL_NAMESPACE, GpuKey

TESTS = str(Path(__file__).parent.parent)  # tests/: fill processes import its modules
TRAINING = "t"
MIB = 2**20


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def environ(pid: int, timeout_s: float = 5.0) -> dict[str, str]:
    """The environment a (fill) process was started with.

    Right after ``Popen`` returns, the child can still be inside ``execve``: the kernel has switched it to the new
    address space but not yet written its environment there, and ``/proc/PID/environ`` reads empty. Wait (bounded)
    until it is readable; a process that never shows an environment fails the test."""
    path = Path(f"/proc/{pid}/environ")
    raw = wait_for(path.read_bytes, timeout_s, f"/proc/{pid}/environ to be readable")
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def cycle(stage: int = 0, slots: tuple[tuple[float, int], ...] = ((0.005, 1 << 30),),
          iteration_s: float = 0.05) -> dict[str, Any]:
    """A BubbleCycle.to_dict() with the given (duration_s, free_bytes) slots."""
    return {
        "training": TRAINING, "stage": stage, "stages": 2, "microbatches": 4, "schedule": "TrainSchedule",
        "iteration_s": iteration_s, "samples": 5,
        "slots": [{"slot": i, "position": i, "instruction": "RecvGrad", "kind": "steady", "duration_s": d,
                   "p10_s": d, "p90_s": d, "free_bytes": free} for i, (d, free) in enumerate(slots)],
    }


def gpu(stage: int = 0, rank: int = 0, namespace: str = LOCAL_NAMESPACE, training: str = TRAINING) -> GpuKey:
    """A GPU of the tests' training (outside Kubernetes unless ``namespace`` says otherwise)."""
    return GpuKey(namespace, training, stage, rank)


class Hook:
    """Sends datagrams the way bubbles.hook does: to the agent's socket and every *.sock in its GPU's fills/ (rank
    ``rank`` of stage ``stage``; ``directory``: a GPU directory elsewhere, such as a card before v4's)."""

    def __init__(self, run_dir: Path, stage: int = 0, rank: int = 0, namespace: str = LOCAL_NAMESPACE,
                 directory: Path | None = None) -> None:
        self.dir = directory or paths.gpu_dir(run_dir, gpu(stage, rank, namespace))
        self.stage = stage
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.seq = 0
        self.sent: list[tuple[int, int, int, int]] = []  # (seq, start_ns, predicted_end_ns, end_ns)

    def send(self, data: bytes, agent_only: bool = False) -> None:
        targets = [self.dir / "agent.sock"]
        if not agent_only:
            targets += sorted((self.dir / paths.FILLS_DIR_NAME).glob("*.sock"))
        for p in targets:
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                self.sock.sendto(data, str(p))

    def fill_armed(self, job: str) -> bool:
        return (self.dir / paths.FILLS_DIR_NAME / f"{paths.FILL_SOCKET_PREFIX}{job}{paths.SOCKET_SUFFIX}").exists()

    def bubble(self, duration_s: float, slot: int = 0, end_late_s: float = 0.0) -> tuple[int, int, int]:
        """START now, busy-wait, END at the predicted end (plus ``end_late_s``)."""
        self.seq += 1
        start = time.monotonic_ns()
        predicted = start + int(duration_s * 1e9)
        self.send(wire.encode_bubble_start(self.stage, slot, self.seq, start, predicted))
        end_at = predicted + int(end_late_s * 1e9)
        while time.monotonic_ns() < end_at:
            time.sleep(0.0002)
        end = time.monotonic_ns()
        self.send(wire.encode_bubble_end(self.stage, slot, self.seq, end))
        self.sent.append((self.seq, start, predicted, end))
        return self.seq, start, end

    def close(self) -> None:
        self.sock.close()


class Harness:
    def __init__(self, agent: Agent, run_dir: Path) -> None:
        self.agent = agent
        self.run_dir = run_dir
        self.thread = threading.Thread(target=agent.run, daemon=True)

    def job(self, name: str) -> dict[str, Any]:
        return next(j for j in self.agent.stats()["jobs"] if j["name"] == name)

    def wait_state(self, name: str, *states: str, timeout_s: float = 15.0) -> dict[str, Any]:
        try:
            return wait_for(lambda: (j := self.job(name))["state"] in states and j, timeout_s)
        except AssertionError:
            j = self.job(name)
            raise AssertionError(f"job {name} not in {states} after {timeout_s} s: "
                                 f"{j['state']} {j['reason']}") from None


StartAgent = Callable[..., Harness]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory under /tmp, not pytest's tmp_path: a GPU's socket paths under it (``<run>/_local/t/stage-0/rank-0/
    fills/fill-<job>.sock``) must fit the 107 bytes a Unix socket allows."""
    short = Path(tempfile.mkdtemp(prefix="bba-", dir="/tmp"))
    yield short
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def start_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Harness]]:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    harnesses: list[Harness] = []

    # Not under pytest's tmp_path: a fill socket's path there (<run>/_local/t/stage-0/rank-0/fills/fill-<job>.sock)
    # can be longer than a Unix socket allows.
    short = Path(tempfile.mkdtemp(prefix="bba-", dir="/tmp"))

    def start(specs: list[FillJobSpec], **kw: Any) -> Harness:
        run_dir = short / "run"
        cfg = AgentConfig(run_dir=run_dir, training=TRAINING, pin_cores=False, **kw)
        h = Harness(Agent(cfg, specs), run_dir)
        h.agent.start()
        h.thread.start()
        harnesses.append(h)
        return h

    yield start
    try:
        for h in harnesses:
            h.agent.request_stop()
            h.thread.join(10)
            assert not h.thread.is_alive(), "agent did not stop"
    finally:
        shutil.rmtree(short, ignore_errors=True)


def spec(name: str, entry: str, **fields: Any) -> FillJobSpec:
    return parse_spec({"name": name, "entry": entry, "memory": "16Mi", **fields})
