"""The fill-job runtime (bubbles.sdk) in-process, and the example fill jobs."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_agent_jobs import BusyJob

from bubbles import control, wire
from bubbles.sdk import FillRuntime, StepResult, load_entry


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


@pytest.fixture
def runtime(tmp_path: Path):  # type: ignore[no-untyped-def]
    ours, theirs = socket.socketpair()
    job = BusyJob(step_ms=1.0)
    path = tmp_path / "fill-busy.sock"
    rt = FillRuntime(job, theirs, name="busy", socket_path=str(path), step_s=None)
    thread = threading.Thread(target=rt.serve, daemon=True)
    thread.start()
    yield Channel(ours), rt, path
    ours.close()
    thread.join(5)
    assert not thread.is_alive()
    assert not path.exists(), "the runtime left its socket behind"


def test_runtime_profiles_at_init_then_gates_steps_by_the_program_directed_limit(runtime) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init")
    ch.wait("state", state="PAUSED")
    assert rt.job.initialized
    # No step time in the spec: the runtime timed steps during init (not reported as fill work).
    step_s = ch.wait("profile")["step_s"]
    assert 1e-3 * 1.2 <= step_s < 0.010
    assert not [e for e in ch.events if e.type == "step"]
    ch.sock.sendall(b"not a command\n")
    assert "rejected command" in ch.wait("error")["message"]
    ch.send("arm", mode="harvest", share=1.0)
    deadline = time.monotonic() + 5
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    seq = 0

    def bubble(duration_s: float) -> None:
        nonlocal seq
        seq += 1
        start = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(duration_s * 1e9)), str(path))
        time.sleep(duration_s)
        sig.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(path))

    # Gated: a bubble shorter than the step time runs nothing; a long one runs several steps.
    bubble(step_s / 2)
    bubble(0.012)
    ch.wait("step", bubble_seq=2)
    time.sleep(0.02)
    ch.wait("state", state="PAUSED")
    gated = [e for e in ch.events if e.type == "step"]
    assert {e["bubble_seq"] for e in gated} == {2}
    assert 2 <= len(gated) <= 12
    for e in gated:
        assert e["signal_ns"] <= e["start_ns"] and e["flops"] == 1e6 and e["mode"] == "harvest"
        # The program-directed limit: a step starts only if it fits before the predicted end.
        assert e["start_ns"] + step_s * 1e9 <= e["signal_ns"] + 0.012 * 1e9 + 1
    ch.send("stop")


def test_runtime_naive_mode_runs_back_to_back_and_disarm_pauses(runtime) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init")
    ch.wait("state", state="PAUSED")
    ch.send("arm", mode="naive")
    ch.wait("state", state="RUNNING")
    deadline = time.monotonic() + 5
    while rt.steps < 20:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not path.exists()  # naive mode listens to no bubbles
    ch.send("disarm")
    ch.wait("state", state="PAUSED")
    ch.wait("step", mode="naive", bubble_seq=-1)
    ch.send("stop")


def test_load_entry_rejects_what_is_not_a_fill_job() -> None:
    with pytest.raises(ValueError, match="must look like"):
        load_entry("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_entry("no.such.module:Job")
    with pytest.raises(ValueError, match="not a subclass"):
        load_entry("json:JSONDecoder")
    assert load_entry("bubbles.fill_examples.image_classification:ImageClassification").__name__ == \
        "ImageClassification"


@pytest.mark.parametrize(
    ("entry", "kwargs"),
    [
        ("bubbles.fill_examples.image_classification:ImageClassification", {"batch_size": 2}),
        ("bubbles.fill_examples.batch_inference:BatchInference", {"batch_size": 4}),
    ],
)
def test_example_fill_jobs_run_steps_and_report_flops(entry: str, kwargs: dict[str, Any]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = load_entry(entry)(**kwargs, steps=3)
        job.create()
        job.init()
        results = []
        while not job.is_finished():
            results.append(job.step())
        assert len(results) == 2  # the first of the 3 steps ran in init(), counting FLOPs
        assert all(isinstance(r, StepResult) and r.flops > 0 and r.samples > 0 for r in results)
        assert {r.flops for r in results} == {job.step_flops}  # counted once, reused
    finally:
        torch.set_num_threads(threads)


def test_example_spec_files_parse() -> None:
    from bubbles.agent.spec import load_spec

    root = Path(__file__).parent.parent / "examples" / "fill-jobs"
    specs = {p.name: load_spec(p) for p in root.glob("*.yaml")}
    assert set(specs) == {"image-classification.yaml", "batch-inference.yaml"}
    for s in specs.values():
        load_entry(s.entry or "")
        json.dumps(s.args)
