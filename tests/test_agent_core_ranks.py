"""The core with several GPUs per stage (tensor- and data-parallel ranks): an executor per GPU, jobs placed on every
GPU, records, events and stats per GPU, and one slowdown guard for the training, fed by stage 0's rank 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.agent_core import MS, cycle, gpu, job_spec, line, make_core

from bubbles.agent.core import AgentCore, Launch, Send
from bubbles.core import paths, wire
from bubbles.core.identity import GpuKey

BUBBLE_MS = {gpu(0, 0): 5.0, gpu(0, 1): 8.0, gpu(1, 0): 6.0, gpu(1, 1): 7.0}


def two_by_two() -> AgentCore:
    """Two stages of two ranks each: ranks 0 served from the start (--executors 2), ranks 1 added (as discovered)."""
    core, _, _ = make_core(executors=2)
    for stage in (0, 1):
        key = gpu(stage, 1)
        core.add_executor(key, paths.gpu_dir(Path("/run/x"), key), "cpu", why="discovered from its card")
    return core


def profile_all(core: AgentCore) -> None:
    for key, ms in BUBBLE_MS.items():
        core.on_datagram(key, wire.encode_profile(key.stage, cycle(key.stage, slots=((ms / 1e3, 1 << 30),))))


def test_every_gpu_is_an_executor_of_its_own_in_key_order() -> None:
    core = two_by_two()
    assert [e.key for e in core.executors] == sorted(BUBBLE_MS)
    assert [(e.stage, e.rank) for e in core.executors] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert core.executor(gpu(1, 1)).directory == Path("/run/x/_local/t/stage-1/rank-1")
    with pytest.raises(ValueError, match="served already"):
        core.add_executor(gpu(0, 1), Path("/elsewhere"), "cpu")
    with pytest.raises(ValueError, match="not of training _local/t"):
        core.add_executor(GpuKey("_local", "other", 0, 2), Path("/elsewhere"), "cpu")
    added = [e["message"] for e in core.events if e["kind"] == "gpu"]
    assert added == ["served on cpu: discovered from its card"] * 2


def test_jobs_are_placed_on_every_gpu_and_their_sockets_are_in_their_gpus_fills() -> None:
    core = two_by_two()
    jobs = [core.submit(job_spec(f"j{i}")) for i in range(4)]  # none names a stage
    profile_all(core)
    launches = [a for a in core.take_actions() if isinstance(a, Launch)]
    assert sorted(a.job.key for a in launches) == sorted(BUBBLE_MS)  # one job on each GPU
    for a in launches:
        assert a.socket_path == paths.fill_socket(Path("/run/x"), a.job.key, a.job.name)
        assert a.job.stage == a.job.key.stage and a.job.rank == a.job.key.rank
    by_name = {j["name"]: j for j in core.stats()["jobs"]}
    assert {(j.name, by_name[j.name]["stage"], by_name[j.name]["rank"]) for j in jobs} == \
        {(j.name, j.stage, j.rank) for j in jobs}


def test_a_job_pinned_to_a_stage_goes_to_its_gpu_with_the_most_bubble_time_not_taken() -> None:
    core = two_by_two()
    profile_all(core)
    first = core.submit(job_spec("first", stage=1))
    assert first.key == gpu(1, 1)  # 7 ms of bubbles against rank 0's 6 ms
    second = core.submit(job_spec("second", stage=1))
    assert second.key == gpu(1, 0)  # rank 1's bubbles are taken by the first
    placed = [e for e in core.events if e["kind"] == "placed"]
    assert [(e["job"], e["stage"], e["rank"]) for e in placed] == [("first", 1, 1), ("second", 1, 0)]
    assert "on stage 1 rank 1, the most bubble time free: 7.0 ms" in placed[0]["message"]
    unpinned = core.submit(job_spec("any"))
    assert unpinned.key == gpu(0, 1)  # the most bubble time of all, free


def test_records_events_and_stats_are_per_gpu() -> None:
    core = two_by_two()
    job = core.submit(job_spec("j", stage=0))
    profile_all(core)
    core.take_actions()
    assert job.key == gpu(0, 1)
    core.launched(job, has_control=True)
    core.on_control_line(job, line("state", state="PAUSED"))
    t0 = core.clock()
    core.on_datagram(gpu(0, 1), wire.encode_bubble_start(0, 0, 1, t0, t0 + 8 * MS))
    core.on_control_line(job, line("step", start_ns=t0 + MS, end_ns=t0 + 3 * MS, flops=1e6, bubble_seq=1,
                                   signal_ns=t0))
    core.on_datagram(gpu(0, 1), wire.encode_bubble_end(0, 0, 1, t0 + 8 * MS))
    core.on_datagram(gpu(0, 0), wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))  # rank 0: same stage, own bubble
    core.on_datagram(gpu(0, 0), wire.encode_bubble_end(0, 0, 1, t0 + 5 * MS))
    stats = core.stats()
    assert [(b["stage"], b["rank"]) for b in stats["bubbles"]] == [(0, 1), (0, 0)]
    assert [(s["stage"], s["rank"]) for s in stats["steps"]] == [(0, 1)]
    assert [(e["stage"], e["rank"], e["namespace"], e["key"]) for e in stats["executors"]] == [
        (0, 0, "_local", "_local/t/stage-0/rank-0"), (0, 1, "_local", "_local/t/stage-0/rank-1"),
        (1, 0, "_local", "_local/t/stage-1/rank-0"), (1, 1, "_local", "_local/t/stage-1/rank-1")]
    profiles = [(e["stage"], e["rank"]) for e in stats["events"] if e["kind"] == "profile"]
    assert sorted(profiles) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Rank 1's step ran in rank 1's bubble: filled there, and rank 0's bubble is no one's to fill.
    totals = {(s.stage, s.rank): s for s in core.snapshot().stages if s.mode == "harvest"}
    assert totals[(0, 1)].filled_s == pytest.approx(0.002) and totals[(0, 1)].overrun_s == 0
    assert totals[(0, 0)].bubble_s == pytest.approx(0.005) and totals[(0, 0)].filled_s == 0
    assert "stage 0 rank 1 (cpu): 0.008 s of bubbles" in core.summary()


def test_one_guard_fed_by_stage_0_rank_0_its_share_sent_to_every_gpus_job() -> None:
    core = two_by_two()
    jobs = [core.submit(job_spec(f"j{i}")) for i in range(4)]
    profile_all(core)
    core.take_actions()
    for job in jobs:
        core.launched(job, has_control=True)
        core.on_control_line(job, line("state", state="PAUSED"))
    core.take_actions()
    t = core.clock()
    for key in (gpu(1, 1), gpu(0, 1), gpu(0, 0), gpu(1, 0)):  # the lowest heard takes over
        core.on_datagram(key, wire.encode_iteration(key.stage, 1, t, 50 * MS))
    assert core.guard_key == gpu(0, 0)
    for k in range(2, 8):  # only stage 0 rank 0's iterations reach it
        for key in BUBBLE_MS:
            core.on_datagram(key, wire.encode_iteration(key.stage, k, t + k * 50 * MS, 50 * MS))
    assert core.guard is not None and len(core.guard.history) <= 6
    stats = core.stats()
    assert (stats["guard"]["stage"], stats["guard"]["rank"]) == (0, 0)
    core.set_guard_limits(None, 0.5, "a test")  # the training's one share, to the fill job on every GPU
    shares = [a for a in core.take_actions() if isinstance(a, Send) and a.type == "share"]
    assert sorted(a.job.key for a in shares) == sorted(BUBBLE_MS) and {a.fields["share"] for a in shares} == {0.5}


def test_a_job_waiting_behind_another_moves_to_a_gpu_of_its_stage_that_profiles_later() -> None:
    """Rank 1 of stage 0 profiles after both of the stage's jobs were placed (its card came late, and its hook greets a
    new listener only at its next iteration): the job queued behind the other on rank 0 moves to it and launches,
    rather than wait for rank 0 while rank 1 idles."""
    core, _, _ = make_core(executors=2)
    first, second = core.submit(job_spec("first", stage=0)), core.submit(job_spec("second", stage=0))
    core.on_datagram(gpu(0, 0), wire.encode_profile(0, cycle(0, slots=((0.005, 1 << 30),))))
    assert [a.job.name for a in core.take_actions() if isinstance(a, Launch)] == ["first"]
    assert first.key == second.key == gpu(0, 0)  # only rank 0 exists yet: the second waits behind the first
    key = gpu(0, 1)
    core.add_executor(key, paths.gpu_dir(Path("/run/x"), key), "cpu", why="discovered from its card")
    assert not [a for a in core.take_actions() if isinstance(a, Launch)]  # not profiled: nothing moves yet
    core.on_datagram(key, wire.encode_profile(0, cycle(0, slots=((0.008, 1 << 30),))))
    assert [(a.job.name, a.job.key) for a in core.take_actions() if isinstance(a, Launch)] == [("second", key)]
    moved = [e for e in core.events if e["kind"] == "placed" and e["job"] == "second"]
    assert any("moved from _local/t/stage-0/rank-0, where it waited behind another job" in e["message"]
               for e in moved), moved


def test_a_job_of_another_stage_or_placed_by_the_operator_does_not_move() -> None:
    core, _, _ = make_core(executors=2)
    a, b = core.submit(job_spec("a", stage=1)), core.submit(job_spec("b", stage=1))
    assigned = core.submit(job_spec("assigned"), on=gpu(0, 0))
    behind = core.submit(job_spec("behind"), on=gpu(0, 0))
    for stage in (0, 1):
        core.on_datagram(gpu(stage, 0), wire.encode_profile(stage, cycle(stage, slots=((0.005, 1 << 30),))))
    core.take_actions()
    key = gpu(0, 1)  # a second GPU of stage 0 only
    core.add_executor(key, paths.gpu_dir(Path("/run/x"), key), "cpu")
    core.on_datagram(key, wire.encode_profile(0, cycle(0, slots=((0.008, 1 << 30),))))
    assert not [x for x in core.take_actions() if isinstance(x, Launch)]
    assert (a.key, b.key, assigned.key, behind.key) == (gpu(1, 0), gpu(1, 0), gpu(0, 0), gpu(0, 0))
