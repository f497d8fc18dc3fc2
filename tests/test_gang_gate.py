"""The bubbles a gang's GPUs share (gating.GangGate), pure; the runtime's leader and follower gating on them; the gang's
settings from the environment and the control lines that carry it."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from helpers.sdk import BusyJob, Channel, wait_for_socket
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbles.core import control, wire
from bubbles.training.gating import GangGate, SharedBubble
from bubbles.training.sdk import FillRuntime
from bubbles.training.sdk.gang import (
    GangSettings,
    child_environments,
    decode_command,
    encode_command,
    gang_settings,
)

MS = 1_000_000


# -- the pure gate ---------------------------------------------------------------------------------------------
def test_the_gangs_bubble_opens_at_the_last_start_and_closes_at_the_first_end() -> None:
    gate = GangGate(2)
    assert gate.start(0, slot=3, seq=7, start_ns=100, predicted_end_ns=900) is None  # the other GPU still computes
    opened = gate.start(1, slot=3, seq=5, start_ns=140, predicted_end_ns=800)
    assert opened == SharedBubble(slot=3, seq=7, start_ns=140, predicted_end_ns=800)  # own seq, last start, first end
    assert gate.end(0, seq=6) is None  # a stale END: not the open bubble's
    assert gate.end(1, seq=5) == opened  # the first END closes it
    assert gate.shared is None
    assert gate.end(0, seq=7) is None  # the other GPU's END: already closed


def test_a_gpu_that_never_signals_keeps_the_gate_shut() -> None:
    gate = GangGate(3)
    for k in range(20):
        assert gate.start(0, 0, k, k * 1000, k * 1000 + 500) is None
        assert gate.start(1, 0, k, k * 1000, k * 1000 + 500) is None
        assert gate.end(0, k) is None and gate.end(1, k) is None
    assert gate.shared is None


def test_bubbles_of_different_slots_are_not_shared_and_a_spent_bubble_joins_no_later_one() -> None:
    gate = GangGate(2)
    gate.start(0, slot=0, seq=1, start_ns=0, predicted_end_ns=100)
    assert gate.start(1, slot=1, seq=1, start_ns=0, predicted_end_ns=100) is None
    assert gate.start(1, slot=0, seq=2, start_ns=10, predicted_end_ns=90) is not None
    assert gate.end(0, 1) is not None
    # GPU 1's END was lost: its bubble is spent with the gang's, so GPU 0's next bubble alone opens nothing.
    assert gate.start(0, slot=0, seq=2, start_ns=200, predicted_end_ns=300) is None
    assert gate.start(1, slot=0, seq=3, start_ns=210, predicted_end_ns=290) is not None


def test_a_start_supersedes_the_open_gangs_bubble() -> None:
    gate = GangGate(2)
    gate.start(0, 0, 1, 0, 100)
    assert gate.start(1, 0, 1, 0, 100) is not None
    assert gate.start(0, 1, 2, 150, 250) is None  # GPU 0's END was lost; its next bubble is another slot's
    assert gate.shared is None
    assert gate.end(1, 1) is None  # nothing open to close


def test_a_gang_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        GangGate(0)


def single_gpu_rule(events: list[tuple[str, int, int]]) -> list[tuple[int, bool] | None]:
    """The single-GPU runtime's rule (FillRuntime._drain_signals), transcribed: the newest START is the bubble, an END
    of its number ends it. After each signal: (seq, ended) of the bubble, or None."""
    bubble: list[int | bool] | None = None
    out: list[tuple[int, bool] | None] = []
    for kind, _slot, seq in events:
        if kind == "start":
            bubble = [seq, False]
        elif bubble is not None and bubble[0] == seq:
            bubble[1] = True
        out.append(None if bubble is None else (int(bubble[0]), bool(bubble[1])))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "end"]), st.integers(0, 2), st.integers(0, 4)), max_size=40))
def test_a_gang_of_one_gpu_is_the_single_gpu_rule(events: list[tuple[str, int, int]]) -> None:
    gate = GangGate(1)
    open_seq: int | None = None
    ended = False
    for (kind, slot, seq), want in zip(events, single_gpu_rule(events), strict=True):
        if kind == "start":
            shared = gate.start(0, slot, seq, 10, 20)
            assert shared is not None and shared.seq == seq  # one GPU: its every START opens the gang's bubble
            open_seq, ended = seq, False
        elif gate.end(0, seq) is not None:
            assert open_seq == seq and not ended
            ended = True
        got = None if open_seq is None else (open_seq, ended)
        assert got == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["start", "end"]), st.integers(0, 1),
                          st.integers(0, 3)), max_size=60))
def test_the_gate_is_open_only_while_every_gpu_is_in_a_bubble_of_one_slot(
        events: list[tuple[int, str, int, int]]) -> None:
    gate = GangGate(3)
    current: dict[int, tuple[int, int] | None] = {0: None, 1: None, 2: None}  # stream -> (slot, seq) open
    for t, (stream, kind, slot, seq) in enumerate(events):
        if kind == "start":
            gate.start(stream, slot, seq, t, t + 10)
            current[stream] = (slot, seq)
        else:
            closed = gate.end(stream, seq)
            if current[stream] is not None and current[stream][1] == seq:  # type: ignore[index]
                current[stream] = None
                if closed is not None:
                    current = {0: None, 1: None, 2: None}
        if gate.shared is not None:
            assert all(c is not None and c[0] == gate.shared.slot for c in current.values())
            assert gate.shared.seq == current[0][1]  # type: ignore[index]


# -- settings and commands ----------------------------------------------------------------------------------------
def test_gang_settings_from_the_environment() -> None:
    env = {control.GANG_SIZE_ENV: "2", control.GANG_RANK_ENV: "1", control.GANG_PORT_ENV: "29500"}
    assert gang_settings(env) == GangSettings(1, 2, 29500)
    assert gang_settings({}) is None
    assert gang_settings({control.GANG_SIZE_ENV: "1"}) is None


@pytest.mark.parametrize(("env", "match"), [
    ({control.GANG_SIZE_ENV: "0", control.GANG_RANK_ENV: "0", control.GANG_PORT_ENV: "1"}, "from 1 to 16"),
    ({control.GANG_SIZE_ENV: "two", control.GANG_RANK_ENV: "0", control.GANG_PORT_ENV: "1"}, "GANG_SIZE"),
    ({control.GANG_SIZE_ENV: "2", control.GANG_RANK_ENV: "2", control.GANG_PORT_ENV: "1"}, "from 0 to 1"),
    ({control.GANG_SIZE_ENV: "2", control.GANG_RANK_ENV: "-1", control.GANG_PORT_ENV: "1"}, "from 0 to 1"),
    ({control.GANG_SIZE_ENV: "2", control.GANG_RANK_ENV: "0", control.GANG_PORT_ENV: "70000"}, "1 to 65535"),
    ({control.GANG_SIZE_ENV: "2", control.GANG_RANK_ENV: "0"}, "GANG_PORT"),
    ({control.GANG_RANK_ENV: "0"}, "GANG_SIZE.* is not"),
    ({control.GANG_SIZE_ENV: "2"}, "without"),
])
def test_bad_gang_settings_say_which_variable_and_what_to_give(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gang_settings(env)


def test_a_fill_pods_gang_gives_each_process_its_rank_port_and_gpu() -> None:
    envs = child_environments({control.DEVICE_ENV: "cuda:0", control.GANG_PORT_ENV: "29400",
                               "CUDA_VISIBLE_DEVICES": "3,5"}, 2)
    assert [(e[control.GANG_RANK_ENV], e[control.GANG_SIZE_ENV], e[control.GANG_PORT_ENV], e["CUDA_VISIBLE_DEVICES"],
             e[control.DEVICE_ENV]) for e in envs] == [("0", "2", "29400", "3", "cuda:0"),
                                                       ("1", "2", "29400", "5", "cuda:0")]
    cpu = child_environments({control.DEVICE_ENV: "cpu"}, 2)
    assert cpu[0][control.GANG_PORT_ENV] == cpu[1][control.GANG_PORT_ENV] and "CUDA_VISIBLE_DEVICES" not in cpu[0]
    with pytest.raises(ValueError, match="sees 1 GPU"):
        child_environments({control.DEVICE_ENV: "cuda:0", "CUDA_VISIBLE_DEVICES": "3"}, 2)
    with pytest.raises(ValueError, match="GANG_PORT"):
        child_environments({control.GANG_PORT_ENV: "x"}, 2)


def test_leader_commands_round_trip_and_garbage_is_none() -> None:
    assert decode_command(encode_command(1, 7, 99, None, 3)) == (1, 3, 7, 99, None)
    assert decode_command(encode_command(2, 7, 99, 4)) == (2, 0, 7, 99, 4)
    assert decode_command(b"nonsense") is None
    assert decode_command(encode_command(9, 0, 0, None)) is None


# -- the runtime: a leader on two GPUs' sockets, a follower running its steps -----------------------------------
def test_the_leader_steps_in_the_shared_bubbles_and_the_follower_takes_the_same_steps(tmp_path: Path) -> None:
    port = 20000 + (threading.get_native_id() % 20000)
    paths = [tmp_path / "gpu0-fill.sock", tmp_path / "gpu1-fill.sock"]
    runtimes, channels, threads = [], [], []
    for rank in (0, 1):
        ours, theirs = socket.socketpair()
        rt = FillRuntime(BusyJob(step_ms=0.5), theirs, name="gang", socket_path=str(paths[rank]), step_s=0.001,
                         gang=GangSettings(rank, 2, port))
        runtimes.append(rt)
        channels.append(Channel(ours))
        threads.append(threading.Thread(target=rt.serve, daemon=True))
    for t in threads:
        t.start()
    try:
        for ch in channels:
            ch.send("init")
            ch.wait("state", state="PAUSED")
        sockets = [str(p) for p in paths]
        channels[1].send("arm", mode="harvest", share=1.0, socket=sockets[1], sockets=[sockets[1], sockets[0]])
        channels[0].send("arm", mode="harvest", share=1.0, socket=sockets[0], sockets=sockets)
        for p in paths:
            wait_for_socket(p)
        hook = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        now = time.monotonic_ns()
        # GPU 0's bubble alone opens nothing: the leader runs no step.
        hook.sendto(wire.encode_bubble_start(0, 0, 1, now, now + 30 * MS), str(paths[0]))
        hook.sendto(wire.encode_bubble_end(0, 0, 1, now + MS), str(paths[0]))
        # Both GPUs in a bubble of slot 0: the leader steps, and its follower with it.
        now = time.monotonic_ns()
        hook.sendto(wire.encode_bubble_start(0, 0, 2, now, now + 40 * MS), str(paths[0]))
        hook.sendto(wire.encode_bubble_start(0, 0, 9, now, now + 40 * MS), str(paths[1]))
        channels[0].wait("state", state="PAUSED", timeout_s=10)  # the init's PAUSED came first: wait for steps
        channels[0].wait("step", timeout_s=10)
        channels[1].wait("step", timeout_s=10)
        hook.sendto(wire.encode_bubble_end(0, 0, 9, time.monotonic_ns()), str(paths[1]))
        channels[0].wait_count(2, "state", state="PAUSED", timeout_s=10)
        channels[1].wait_count(2, "state", state="PAUSED", timeout_s=10)
        leader = [e for e in channels[0].events if e.type == "step"]
        follower = [e for e in channels[1].events if e.type == "step"]
        assert leader and len(follower) == len(leader)
        assert {e["bubble_seq"] for e in leader} == {2} == {e["bubble_seq"] for e in follower}  # the leader's GPU's
        assert all(e["mode"] == "harvest" for e in follower)
        assert channels[1].count("step_begin") == 1  # the follower announces its bubble's first step to the agent
        hook.close()
    finally:
        for ch in channels:
            ch.sock.close()
        for t in threads:
            t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert not any(p.exists() for p in paths), "the leader left a fill socket behind"


def test_the_leader_stops_with_an_error_when_a_follower_is_gone(tmp_path: Path) -> None:
    port = 40000 + (threading.get_native_id() % 20000)
    ours, theirs = socket.socketpair()
    paths = [tmp_path / "a.sock", tmp_path / "b.sock"]
    rt = FillRuntime(BusyJob(step_ms=0.2), theirs, name="gang", socket_path=str(paths[0]), step_s=0.001,
                     gang=GangSettings(0, 2, port))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            rt.serve()
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ch = Channel(ours)
    try:
        ch.send("init")
        ch.wait("state", state="PAUSED")
        ch.send("arm", mode="naive", sockets=[str(p) for p in paths])
        thread.join(5)
    finally:
        ours.close()
        thread.join(5)
    assert errors and "gang rank 1 is gone" in str(errors[0])
