"""The fill-job runtime in-process: the agent's commands, harvesting bubbles, naive mode, busy-polling."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from helpers.sdk import BusyJob, init_and_arm, serving, wait_for_socket

from bubbles.core import wire
from bubbles.core.api import FillMode
from bubbles.training.gating import StartPredictor, StepGates
from bubbles.training.sdk import StepResult


@pytest.fixture
def runtime(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=1.0)) as (ch, rt):
        yield ch, rt, path


def test_runtime_profiles_at_init_then_gates_steps_by_the_program_directed_limit(runtime) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init")
    ch.wait("state", state="PAUSED")
    assert rt.job.initialized
    # No step time in the spec: the runtime timed steps during init (not reported as fill work).
    step_s = ch.wait("profile")["step_s"]
    assert 1e-3 * 1.2 <= step_s < 0.010
    assert not [e for e in ch.events if e.type == "step"]
    # This test checks the profiled gate: no learning from in-bubble steps (fewer than min_samples run here).
    rt.gates = StepGates([(None, step_s)], window=32, min_samples=32)
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
        assert e["signal_ns"] <= e["start_ns"]
        assert e["flops"] == 1e6
        assert e["mode"] == "harvest"
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


# -- busy-polling around the predicted bubble start ------------------------------------------------------------
def test_the_next_start_is_each_slots_last_start_plus_its_period() -> None:
    p = StartPredictor()
    assert p.next_start(0, 0) is None
    p.started(0, 1_000)
    assert p.next_start(1_000, 0) is None  # one start of a slot: no period yet
    p.started(0, 4_000)
    p.started(1, 2_500)
    p.started(1, 5_500)
    assert p.next_start(5_600, 100) == 7_000  # slot 0: 4,000 + 3,000; slot 1: 8,500
    assert p.next_start(7_050, 100) == 7_000  # within the slack after it: still that start
    assert p.next_start(7_200, 100) == 8_500
    assert p.next_start(13_200, 100) == 14_500  # slot 1 missed 8,500 and 11,500: projected forward
    p.started(0, 3_000)  # out of order (an old datagram): no negative period, the last period stays
    assert p.next_start(3_100, 0) == 6_000


def test_the_fast_signal_decoder_agrees_with_decode_on_every_input() -> None:
    good = [wire.encode_bubble_start(1, 2, 3, 10, 20), wire.encode_bubble_end(1, 2, 3, 30)]
    for data in good:
        fast, msg = wire.decode_signal(data), wire.decode(data)
        assert fast is not None
        assert fast[2] == msg.seq
        assert fast[3] == (msg.start_ns if isinstance(msg, wire.BubbleStart) else msg.end_ns)
    start_before_end = bytearray(wire.encode_bubble_start(1, 2, 3, 10, 20))
    start_before_end[20:28] = (5).to_bytes(8, "little")  # predicted end before the start
    others = [wire.encode_iteration(0, 1, 2, 3), wire.encode_fill_mode(0, FillMode.OFF), b"BB" + bytes(26), b"x" * 28,
              bytes(start_before_end)]
    for data in others:
        assert wire.decode_signal(data) is None  # decode handles (or rejects) these
    with pytest.raises(wire.WireError):
        wire.decode(bytes(start_before_end))


def test_a_spinning_runtime_catches_a_predicted_bubble_and_still_obeys_commands(tmp_path: Path) -> None:
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=0.2), step_s=0.0005) as (ch, rt):
        rt.spin_ns = 2_000_000  # 2 ms either side: the test's sleeps are not precise
        init_and_arm(ch, path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        period = 0.010
        t0 = time.monotonic_ns()
        bubbles = 16
        for seq in range(1, bubbles + 1):  # a bubble every 10 ms on slot 0
            start = t0 + int(seq * period * 1e9)
            while time.monotonic_ns() < start:
                time.sleep(0.0002)
            sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + 3_000_000), str(path))
            time.sleep(0.003)
            sig.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(path))
        # A last, long bubble: once it has a step, every datagram before it (same socket, in order) was handled.
        last = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 0, bubbles + 1, last, last + 50_000_000), str(path))
        ch.wait("step", bubble_seq=bubbles + 1)
        sig.sendto(wire.encode_bubble_end(0, 0, bubbles + 1, time.monotonic_ns()), str(path))
        steps = [e for e in ch.events if e.type == "step"]
        # Once a period is known, (nearly) every bubble is harvested: a START the test's thread sends late on this
        # loaded machine (its sleeps overshoot) may leave no room for a step, hence a share, not all of them.
        known = set(range(3, bubbles + 1))
        harvested = known & {e["bubble_seq"] for e in steps}
        assert len(harvested) >= 0.8 * len(known), sorted(harvested)
        assert rt.predictor.next_start(time.monotonic_ns(), 2_000_000) is not None
        # Most of those starts were read while spinning, not woken from poll.
        assert rt.spin_caught >= len(harvested) // 2, (rt.spin_caught, len(harvested))
        ch.send("disarm")  # commands still reach a runtime that spins
        ch.wait("state", state="PAUSED")
        ch.send("stop")


class SleepStepJob(BusyJob):
    """Steps that sleep (release the GIL), so the test's thread keeps its timing while the runtime's runs."""

    def step(self) -> StepResult:
        time.sleep(self.step_ns / 1e9)
        return StepResult(flops=self.flops, samples=1)


class HeldStepJob(SleepStepJob):
    """A SleepStepJob whose first step after ``hold`` is set up lasts until the test releases it."""

    hold: threading.Event | None = None

    def step(self) -> StepResult:
        if self.hold is not None:
            held, self.hold = self.hold, None
            held.wait(10)
        return super().step()


def test_a_bubble_that_opens_while_the_last_step_of_the_previous_one_runs_is_harvested(tmp_path: Path) -> None:
    """Back-to-back bubbles (a stage's last bubble of one iteration, then its first of the next): the previous
    bubble's last step outlives it, and the next one's START is read together with the END. The runtime must
    harvest the bubble already open, not go back to sleep until that bubble's END arrives."""
    path = tmp_path / "fill-busy.sock"
    job = HeldStepJob(step_ms=6.0)
    with serving(path, job, step_s=0.006) as (ch, _rt):
        init_and_arm(ch, path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        release = job.hold = threading.Event()  # the first bubble's step lasts until both datagrams are sent
        t0 = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 1, 1, t0, t0 + 30_000_000), str(path))
        ch.wait("step_begin", bubble_seq=1)
        t1 = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_end(0, 1, 1, t1), str(path))
        sig.sendto(wire.encode_bubble_start(0, 0, 2, t1, t1 + 40_000_000), str(path))
        release.set()
        time.sleep(0.040)
        sig.sendto(wire.encode_bubble_end(0, 0, 2, time.monotonic_ns()), str(path))
        ch.wait_count(2, "state", state="PAUSED", timeout_s=5)
        by_bubble = [e["bubble_seq"] for e in ch.events if e.type == "step"]
        assert by_bubble.count(1) == 1  # the first bubble's one step, cut short by its END
        assert by_bubble.count(2) >= 2, f"the bubble opened mid-step was slept through: steps {by_bubble}"
        ch.send("stop")


def test_a_field_a_newer_agent_adds_is_ignored_and_named_once_on_stderr(runtime, capfd) -> None:  # type: ignore[no-untyped-def]
    ch, rt, path = runtime
    ch.send("init", trace=True)
    ch.wait("state", state="PAUSED")
    ch.send("arm", mode="harvest", share=1.0, trace=True)
    wait_for_socket(path)  # armed: the command was not refused for its extra field
    ch.send("share", share=0.5, trace=False)
    deadline = time.monotonic() + 5
    while rt.share != 0.5:
        assert time.monotonic() < deadline, "the share command was not applied"
        time.sleep(0.001)
    assert not [e for e in ch.events if e.type == "error"]
    err = capfd.readouterr().err
    assert err.count("bubbles.sdk: ignored field(s)") == 3  # init.trace, arm.trace, share.trace: each once
    assert "arm.trace" in err
    assert "upgrade the fill job's image" in err
    ch.send("arm", mode="harvest", share=1.0, trace=True)  # again: already said
    ch.send("stop")
