"""The local agent finds the training's other GPUs (ranks of a stage, stages beyond --executors) from their hooks'
cards, binds their sockets and harvests them: the test plays the hooks of two ranks of one stage."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.agent import Hook, StartAgent, cycle, gpu, spec, start_agent, wait_for

from bubbles.core import paths, wire
from bubbles.core.identity import GpuKey

__all__ = ["start_agent"]  # the fixture, from helpers.agent


def write_card(run_dir: Path, key: GpuKey, ranks: int = 2, stages: int = 2) -> Path:
    """rank ``key.rank`` of stage ``key.stage``'s card, as its hook writes it (v4, no lock held here)."""
    path = paths.hook_card(run_dir, key)
    paths.make_private_dir(path.parent)
    path.write_text(json.dumps({"training": key.training, "stage": key.stage, "stages": stages,
                                "namespace": key.namespace, "pod": "host", "device": "cpu", "gpu_uuid": None,
                                "pid": 1, "fills": True, "version": 4, "rank": key.rank, "ranks": ranks}))
    return path


def test_a_rank_found_from_its_card_gets_its_socket_and_its_own_fill_job(start_agent: StartAgent,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "bubbles.agent")
    # Pinned to stage 0: it goes to the stage's GPU with the most bubble time, once both have profiled.
    h = start_agent([spec("j", "test_agent_jobs:BusyJob", stage=0, step_time="1ms")], executors=1)
    assert [e["rank"] for e in h.agent.stats()["executors"]] == [0]
    write_card(h.run_dir, gpu(0, 1))
    # On demand; the agent's loop reads the cards every second too, so either may have found it.
    assert h.agent.discover() in ([gpu(0, 1)], [])
    assert h.agent.discover() == []  # served already
    sock = paths.agent_socket(h.run_dir, gpu(0, 1))
    assert sock.is_socket() and paths.fills_dir(h.run_dir, gpu(0, 1)).is_dir()
    assert [(e["stage"], e["rank"]) for e in h.agent.stats()["executors"]] == [(0, 0), (0, 1)]
    rank0, rank1 = Hook(h.run_dir, 0, 0), Hook(h.run_dir, 0, 1)
    try:
        rank0.send(wire.encode_profile(0, cycle(slots=((0.005, 1 << 30),))))
        rank1.send(wire.encode_profile(0, cycle(slots=((0.020, 1 << 30),))))
        wait_for(lambda: rank1.fill_armed("j"), 30, "the job armed on rank 1, the roomier GPU")
        assert not rank0.fill_armed("j")
        job = h.job("j")
        assert (job["stage"], job["rank"], job["key"]) == (0, 1, "_local/t/stage-0/rank-1")
        for _ in range(10):
            rank1.bubble(0.02)
        wait_for(lambda: any(s["rank"] == 1 for s in h.agent.stats()["steps"]), 15, "a step on rank 1")
        assert {(s["stage"], s["rank"]) for s in h.agent.stats()["steps"]} == {(0, 1)}
        assert {(b["stage"], b["rank"]) for b in h.agent.stats()["bubbles"]} == {(0, 1)}
    finally:
        rank0.close()
        rank1.close()
    # A stage beyond --executors is served too, and said so.
    write_card(h.run_dir, gpu(2, 0), ranks=1, stages=3)
    wait_for(lambda: any(e["stage"] == 2 for e in h.agent.stats()["executors"]), 10, "stage 2 found by the loop")
    assert paths.agent_socket(h.run_dir, gpu(2, 0)).is_socket()
    assert "_local/t/stage-2/rank-0: served on cpu (discovered from its card; its stage is beyond the --executors 1" \
        in caplog.text


def test_a_card_nobody_holds_or_nobody_can_read_is_no_gpu_to_serve(start_agent: StartAgent,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    h = start_agent([], executors=1)
    stale = write_card(h.run_dir, gpu(0, 1))
    (stale.parent / paths.HOOK_LOCK_NAME).write_text("")  # a lock file nobody holds: its process is gone
    planted = write_card(h.run_dir, gpu(0, 2))
    planted.write_text("{not json")
    assert h.agent.discover() == []
    assert h.agent.discover() == []
    assert caplog.text.count("ignoring a hook card") == 1  # said once
