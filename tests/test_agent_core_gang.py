"""The core with a gang job (gpus: 2) on two stages of two ranks: placed on both ranks of one stage, launched,
armed, paused and stopped together; one member failing stops the other; one progress (the fewest steps, all FLOPs)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers.agent_core import MS, cycle, gpu, job_spec, line, make_core

from bubbles.agent.core import AgentCore, JobRecord, Launch, Send, Signal
from bubbles.core import paths, wire
from bubbles.core.api import FillState, IsolationMode, IsolationState, IsolationStatus

BUBBLE_MS = {gpu(0, 0): 5.0, gpu(0, 1): 8.0, gpu(1, 0): 6.0, gpu(1, 1): 7.0}


def two_by_two() -> AgentCore:
    core, _, _ = make_core(executors=2)
    for stage in (0, 1):
        key = gpu(stage, 1)
        core.add_executor(key, paths.gpu_dir(Path("/run/x"), key), "cpu", why="discovered from its card")
    return core


def profile_all(core: AgentCore, bubble_ms: dict = BUBBLE_MS) -> None:  # type: ignore[type-arg]
    for key, ms in bubble_ms.items():
        core.on_datagram(key, wire.encode_profile(key.stage, cycle(key.stage, slots=((ms / 1e3, 1 << 30),))))


def launched_gang(core: AgentCore, **fields: object) -> list[JobRecord]:
    """Submit a gang of two, profile every GPU, launch its members: CREATED, init sent."""
    lead = core.submit(job_spec("g", gpus=2, **fields))
    profile_all(core)
    launches = [a for a in core.take_actions() if isinstance(a, Launch)]
    assert lead.gang is not None and [a.job for a in launches] == lead.gang.members
    for a in launches:
        core.launched(a.job, has_control=True)
    return lead.gang.members


def sends(core: AgentCore, type_: str) -> list[Send]:
    return [a for a in core.take_actions() if isinstance(a, Send) and a.type == type_]


def test_a_gang_goes_to_both_ranks_of_the_stage_with_the_most_shared_bubble_time() -> None:
    core = two_by_two()
    lead = core.submit(job_spec("g", gpus=2))
    profile_all(core)
    launches = [a for a in core.take_actions() if isinstance(a, Launch)]
    # Stage 0 shares 5 ms (min of 5, 8), stage 1 shares 6 ms (min of 6, 7).
    assert [a.job.key for a in launches] == [gpu(1, 0), gpu(1, 1)]
    assert [a.job.gang_rank for a in launches] == [0, 1] and launches[0].job is lead
    root = Path("/run/x/_local/t")
    assert launches[0].sockets == (root / "stage-1/rank-0/fills/fill-g.sock", root / "stage-1/rank-1/fills/fill-g.sock")
    assert launches[1].sockets == (root / "stage-1/rank-1/fills/fill-g.sock", root / "stage-1/rank-0/fills/fill-g.sock")
    placed = [e for e in core.events if e["kind"] == "placed"]
    assert "on stage 1 ranks 0, 1, the most bubble time the 2 share: 6.0 ms" in placed[0]["message"]
    stats = {(j["stage"], j["rank"]): j for j in core.stats()["jobs"]}
    assert stats[(1, 1)]["gang"] == {"rank": 1, "size": 2, "steps": 0, "flops": 0.0,
                                     "gpus": ["_local/t/stage-1/rank-0", "_local/t/stage-1/rank-1"]}


def test_a_gang_that_names_a_stage_goes_there() -> None:
    core = two_by_two()
    members = launched_gang(core, stage=0)
    assert [m.key for m in members] == [gpu(0, 0), gpu(0, 1)]


def test_no_stage_with_enough_gpus_rejects_the_gang_with_the_reason() -> None:
    core = two_by_two()
    job = core.submit(job_spec("g", gpus=3))
    profile_all(core)
    assert job.state is FillState.STOPPED and not any(isinstance(a, Launch) for a in core.take_actions())
    assert "asks for 3 GPUs of one stage (gpus: 3), but any stage has fewer profiled GPUs here (stage 0: 2, " \
           "stage 1: 2)" in job.reason
    assert core.rejected_jobs == 1


def test_only_sdk_jobs_run_as_gangs() -> None:
    core = two_by_two()
    with pytest.raises(ValueError, match="only an SDK job"):
        core.submit(job_spec("g", gpus=2, entry=None, interface="imperative", command=["sleep", "9"]))


def test_the_members_are_armed_together_once_both_have_finished_their_init() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    core.take_actions()
    core.on_control_line(a, line("state", state="PAUSED"))
    assert sends(core, "arm") == []  # b is still in its init: a alone would step into collectives b never joins
    core.on_control_line(b, line("state", state="PAUSED"))
    arms = sends(core, "arm")
    assert [s.job for s in arms] == [a, b]
    assert arms[0].fields["sockets"] == [str(p) for p in core._gang_sockets(a)]
    assert arms[1].fields["socket"] == arms[1].fields["sockets"][0] == str(core._fill_socket(b))
    # The guard's pause reaches both.
    core.fill_paused = True
    core._apply_mode(core.executor(a.key), a)
    assert [s.job for s in sends(core, "disarm")] == [a, b]


def test_one_member_failing_stops_the_other_with_its_reason() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    for m in (a, b):
        core.on_control_line(m, line("state", state="PAUSED"))
    core.take_actions()
    core.on_control_line(b, line("error", message="RuntimeError: boom"))
    core.on_exit(b, 1)
    assert b.state is FillState.STOPPED and b.reason == "failed: exited with code 1: RuntimeError: boom"
    assert a.state is FillState.STOPPED
    assert a.reason == "failed: exited with code 1: RuntimeError: boom (gang rank 1: stage 1 rank 1)"
    assert [s.job for s in sends(core, "stop")] == [a]  # asked to stop: its collectives would wait for b forever


def test_a_member_that_exits_early_fails_the_gang() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    core.on_exit(a, 0)
    assert a.reason.startswith("failed: its process exited (code 0) before the gang had finished")
    assert b.state is FillState.STOPPED


def test_a_watchdog_kill_on_one_gpu_stops_the_whole_gang() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    for m in (a, b):
        core.on_control_line(m, line("state", state="PAUSED"))
    core.take_actions()
    t = core.clock()
    core.on_datagram(b.key, wire.encode_bubble_start(1, 0, 1, t, t + 5 * MS))
    core.on_control_line(b, line("step_begin", t_ns=t + MS, bubble_seq=1))
    core.on_datagram(b.key, wire.encode_bubble_end(1, 0, 1, t + 5 * MS))
    core.tick(t + 5 * MS + int(core.config.grace_s * 1e9) + 1)
    acts = core.take_actions()
    assert any(isinstance(x, Signal) and x.job is b and x.sig == signal.SIGKILL for x in acts)
    assert a.state is FillState.STOPPED and "killed" in a.reason and "gang rank 1" in a.reason


def test_progress_is_the_fewest_steps_and_all_the_flops_and_each_gpus_ledger_counts_its_own() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    t = core.clock()
    for m, n in ((a, 3), (b, 2)):
        for i in range(n):
            core.on_control_line(m, line("step", start_ns=t + i * MS, end_ns=t + i * MS + MS // 2, flops=1e6,
                                         bubble_seq=-1, mode="naive"))
    assert a.gang is not None and a.gang.steps == 2 and a.gang.flops == pytest.approx(5e6)
    totals = {(j.stage, j.rank): j.steps for j in core.snapshot().jobs}
    assert totals == {(1, 0): 3, (1, 1): 2}


def test_cancel_stops_every_member_and_frees_both_gpus() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    assert core.cancel("g", "cancelled by the user")
    assert a.reason == b.reason == "cancelled by the user"
    for m in (a, b):
        core.on_exit(m, 0)
    assert core.executor(a.key).active is None and core.executor(b.key).active is None


def test_a_gang_waits_until_both_its_gpus_are_free() -> None:
    core = two_by_two()
    profile_all(core)
    single = core.submit(job_spec("single", stage=1))
    assert single.key == gpu(1, 1)
    core.launched(single, has_control=True)
    core.take_actions()
    lead = core.submit(job_spec("g", gpus=2, stage=1))
    assert not [a for a in core.take_actions() if isinstance(a, Launch)]  # rank 1 is busy
    assert lead.gang is not None and [m.key for m in lead.gang.members] == [gpu(1, 0), gpu(1, 1)]
    core.on_exit(single, 0)
    launches = [a for a in core.take_actions() if isinstance(a, Launch)]
    assert [a.job for a in launches] == lead.gang.members


def test_placed_by_the_operator_on_two_ranks_and_refused_on_a_bad_set() -> None:
    core = two_by_two()
    profile_all(core)
    lead = core.submit(job_spec("g", gpus=2), on=(gpu(0, 1), gpu(0, 0)))
    assert lead.gang is not None and [m.key for m in lead.gang.members] == [gpu(0, 1), gpu(0, 0)]
    assert [a.job.key for a in core.take_actions() if isinstance(a, Launch)] == [gpu(0, 1), gpu(0, 0)]
    for on, match in (((gpu(1, 0),), "distinct ranks of one stage"), ((gpu(1, 0), gpu(0, 1)), "one stage"),
                      ((gpu(1, 0), gpu(1, 0)), "distinct")):
        with pytest.raises(ValueError, match=match):
            core.submit(job_spec("h", gpus=2), on=on)


def test_an_isolation_loss_resubmits_the_whole_gang_on_its_gpus() -> None:
    core = two_by_two()
    a, b = launched_gang(core)
    core.on_isolation(IsolationStatus(IsolationMode.CONTEXTS, IsolationState.UNAVAILABLE, "gone", epoch=1))
    assert a.state is FillState.STOPPED and b.state is FillState.STOPPED
    again = [j for j in core.jobs if j.resubmission == 1]
    assert [(j.key, j.gang_rank) for j in again] == [(a.key, 0), (b.key, 1)]
    assert again[0].gang is again[1].gang is not None and again[0].gang is not a.gang
