"""The agent's pure core (bubbles.agent.core): messages and ticks in, actions out, with a fake clock: bubbles, steps and
the watchdog, plain commands, planning, deadlines, the job records. Isolation and the guard have files of their own
(test_agent_core_isolation.py, test_agent_core_guard.py); the set-ups are in helpers/agent_core.py.

No sockets, no processes, no sleeps: each test plays the training's hook (datagrams from bubbles.core.wire),
the fill process (control lines from bubbles.core.control) and the shell (launch results, exits), and checks
the actions the core decides.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers.agent_core import MS, Clock, armed, cycle, gpu, job_spec, line, make_core

from bubbles.agent.core import (
    AgentCore,
    CoreConfig,
    JobRecord,
    Launch,
    Release,
    Send,
    Signal,
)
from bubbles.core import wire
from bubbles.core.api import FillMode, FillState, parse_spec


def test_a_profiled_stage_launches_its_queued_job_and_arms_it_for_harvest() -> None:
    core, _, _ = make_core()
    job = core.submit(job_spec())
    assert core.take_actions() == [] and job.state is FillState.SUBMITTED  # no cycle yet: nothing to plan against
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    (launch,) = core.take_actions()
    assert isinstance(launch, Launch) and launch.device == "cpu" and launch.socket_path.name == "fill-j.sock"
    core.launched(job, has_control=True)
    assert core.take_actions() == [Send(job, "init")] and job.state is FillState.CREATED
    core.on_control_line(job, line("state", state="PAUSED"))
    (arm,) = core.take_actions()
    assert isinstance(arm, Send) and arm.type == "arm" and arm.fields["mode"] == "harvest"
    assert arm.fields["socket"] == str(launch.socket_path) and job.armed is FillMode.HARVEST


def test_a_job_still_in_a_step_after_the_grace_period_is_killed_at_the_tick() -> None:
    core, clock, sink = make_core(grace_s=0.05)
    job = armed(core)
    core.take_actions()
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 7, clock.now, clock.now + 5 * MS))
    core.on_control_line(job, line("step_begin", t_ns=clock.now + MS, bubble_seq=7))
    end = clock.now + 5 * MS
    core.on_datagram(gpu(0), wire.encode_bubble_end(0, 0, 7, end))
    assert core.next_deadline_ns() == end + 50 * MS
    clock.now = end + 49 * MS
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is not FillState.STOPPED  # not due yet
    clock.now = end + 51 * MS
    assert core.due_watchdogs(clock.now) == [job]
    core.tick(clock.now)
    assert core.take_actions() == [Signal(job, signal.SIGKILL)]
    assert job.state is FillState.STOPPED and job.reason.startswith("killed: did not pause within 50 ms")
    assert core.kills == 1 and ("kill", gpu(0), "cpu", "j") in sink.calls
    assert any(e["kind"] == "kill" and "51.0 ms after bubble 7" in e["message"] for e in core.events)


def test_a_step_that_ended_in_time_disarms_the_watchdog() -> None:
    core, clock, _ = make_core()
    job = armed(core)
    core.take_actions()
    t0 = clock.now
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))
    core.on_control_line(job, line("step_begin", t_ns=t0, bubble_seq=1))
    core.on_control_line(job, line("step", start_ns=t0, end_ns=t0 + MS, flops=10.0, bubble_seq=1))
    core.on_datagram(gpu(0), wire.encode_bubble_end(0, 0, 1, t0 + 5 * MS))
    clock.now = t0 + 500 * MS
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is FillState.PAUSED and core.kills == 0
    assert job.steps == 1 and core.stats()["modes"]["harvest"]["filled_s"] == pytest.approx(1e-3)


def test_a_step_that_reports_no_flops_counts_what_the_spec_says_one_step_does() -> None:
    """A FillJob's profile.flopsPerStep reaches the agent as flops_per_step: a step reporting 0 FLOPs counts it, in
    the job's totals (the operator's recoveredFlops), its per-mode totals and the ledger (the node's metrics)."""
    core, clock, _ = make_core()
    job = armed(core, flops_per_step=4e9)
    core.take_actions()
    t0 = clock.now
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))
    core.on_control_line(job, line("step", start_ns=t0, end_ns=t0 + MS, flops=0, bubble_seq=1))
    core.on_control_line(job, line("step", start_ns=t0 + MS, end_ns=t0 + 2 * MS, flops=1e3, bubble_seq=1))
    assert job.flops == 4e9 + 1e3  # a step that reports its own FLOPs keeps them
    assert job.job_totals == {"harvest": [2, 4e9 + 1e3]}
    assert core.stats()["modes"]["harvest"]["fill_flops"] == pytest.approx(4e9 + 1e3)


def test_a_plain_command_is_thawed_for_each_bubble_and_frozen_after_it() -> None:
    core, clock, _ = make_core()
    job = core.submit(parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"]}))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(job, has_control=False)
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and job.state is FillState.PAUSED
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGCONT)] and job.state is FillState.RUNNING
    core.on_datagram(gpu(0), wire.encode_bubble_end(0, 0, 1, clock.now + 5 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and job.state is FillState.PAUSED


def launched_plain_command(core: AgentCore) -> JobRecord:
    """A plain command, its stage profiled, launched and frozen until its first bubble (actions taken)."""
    job = core.submit(parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"]}))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(job, has_control=False)
    core.take_actions()
    return job


def test_a_plain_command_whose_bubble_end_is_lost_is_frozen_at_twice_the_predicted_length() -> None:
    core, clock, sink = make_core()  # grace 50 ms
    job = launched_plain_command(core)
    t0 = clock.now
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))  # predicted: 5 ms
    assert core.take_actions() == [Signal(job, signal.SIGCONT)]
    assert core.next_deadline_ns() == t0 + 60 * MS  # 2 x 5 ms + 50 ms
    clock.now = t0 + 60 * MS - 1
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is FillState.RUNNING  # not yet
    clock.now = t0 + 60 * MS
    core.tick(clock.now)  # its END never came
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and job.state is FillState.PAUSED
    assert core.missed_ends == 1 and ("missed_end", gpu(0)) in sink.calls
    # The lost END's bubble still counts nowhere; the next bubble thaws and freezes the job as usual.
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 2, clock.now, clock.now + 5 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGCONT)]
    core.on_datagram(gpu(0), wire.encode_bubble_end(0, 0, 2, clock.now + 4 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)]
    clock.now += 60 * MS
    core.tick(clock.now)  # that END came: its deadline does nothing
    assert core.take_actions() == [] and core.missed_ends == 1


def test_a_lost_ends_deadline_leaves_a_later_bubble_and_a_job_no_longer_running_alone() -> None:
    core, clock, _ = make_core()
    job = launched_plain_command(core)
    t0 = clock.now
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))  # its END is lost...
    # ...and a long bubble opens
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 2, t0 + 8 * MS, t0 + 100 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGCONT)]  # thawed once: it was already running
    clock.now = t0 + 60 * MS
    core.tick(clock.now)  # bubble 1's deadline: bubble 2 is open, and its own deadline (t0 + 242 ms) covers it
    assert core.take_actions() == [] and job.state is FillState.RUNNING
    clock.now = t0 + 242 * MS
    core.tick(clock.now)
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and core.missed_ends == 1
    # Naive mode: the command runs freely, and a lost END's deadline must not freeze it.
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 3, clock.now, clock.now + 5 * MS))
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.NAIVE))
    core.take_actions()
    assert job.state is FillState.RUNNING
    clock.now += 60 * MS
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is FillState.RUNNING and core.missed_ends == 1


def test_a_job_that_fits_no_bubble_is_rejected_without_a_launch_and_the_next_one_runs() -> None:
    core, _, _ = make_core()
    big = core.submit(job_spec("big", memory="2Gi"))
    small = core.submit(job_spec("small"))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle(slots=((0.005, 1 << 30),))))
    (launch,) = core.take_actions()
    assert launch.job is small  # type: ignore[union-attr]
    assert big.state is FillState.STOPPED and big.reason.startswith("rejected: ") and core.rejected_jobs == 1


def test_a_failed_launch_or_a_crash_frees_the_executor_for_the_next_job() -> None:
    core, _, _ = make_core()
    first = core.submit(job_spec("first"))
    second = core.submit(job_spec("second"))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    assert [a.job for a in core.take_actions()] == [first]  # type: ignore[union-attr]
    core.launch_failed(first, "no such file")
    assert first.state is FillState.STOPPED and first.reason == "failed to start: no such file"
    assert [a.job for a in core.take_actions()] == [second]  # type: ignore[union-attr]
    core.launched(second, has_control=True)
    core.on_control_line(second, line("error", message="CUDA out of memory"))
    core.take_actions()
    core.on_exit(second, 1)
    assert second.state is FillState.STOPPED and second.reason == "failed: exited with code 1: CUDA out of memory"
    (release,) = core.take_actions()
    assert isinstance(release, Release) and release.job is second and not second.launched


def test_malformed_input_is_counted_and_dropped_and_nothing_else_changes() -> None:
    core, _, sink = make_core()
    job = armed(core)
    core.take_actions()
    core.on_datagram(gpu(0), b"not a datagram")
    core.on_datagram(gpu(0), wire.encode_bubble_start(1, 0, 1, 0, 1))  # stage 1's message on stage 0's socket
    core.on_control_line(job, b'{"type": "step", "start_ns": 5, "end_ns": 1, "flops": 1}')
    core.on_control_line(job, line("state", state="CREATED"))  # ignored: a job does not go back
    assert core.rejected_messages == 3 and sink.calls.count(("rejected", gpu(0), "datagram")) == 2
    assert core.take_actions() == [] and job.state is FillState.PAUSED and job.steps == 0


def test_a_newer_hooks_messages_are_read_where_known_and_said_once_where_not(caplog: pytest.LogCaptureFixture) -> None:
    core, clock, sink = make_core()
    armed(core)
    core.take_actions()
    v2 = bytes([wire.VERSION + 1])
    start = wire.encode_bubble_start(0, 0, 7, clock.now, clock.now + 5 * MS)
    core.on_datagram(gpu(0), start[:2] + v2 + start[3:] + b"appended field")
    assert 7 in core.executors[0].open_bubbles  # the fields this agent knows are read
    unknown = b"BB" + v2 + bytes([42]) + bytes(40)
    for _ in range(3):
        core.on_datagram(gpu(0), unknown)
    said = [e for e in core.events if e["kind"] == "datagram"]
    assert len(said) == 1 and "newer hook" in said[0]["message"] and "kind 42" in said[0]["message"]
    assert caplog.text.count("newer than this agent") == 1
    assert core.rejected_messages == 0 and ("rejected", gpu(0), "datagram") not in sink.calls
    # Not malformed, but counted: an operator sees the agents that need upgrading.
    from prometheus_client import generate_latest

    from bubbles.agent.metrics import AgentMetrics

    assert core.snapshot().newer_messages == 3
    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert 'bubbles_newer_messages_total{namespace="_local",training="t"} 3.0' in text \
        and 'bubbles_late_records_total{namespace="_local",training="t"} 0.0' \
        in text


def test_a_job_whose_init_never_finishes_is_killed_at_its_deadline_and_the_next_one_runs() -> None:
    core, clock, sink = make_core(init_timeout_s=30.0)
    stuck = core.submit(job_spec("stuck"))
    core.submit(job_spec("next"))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(stuck, has_control=True)
    assert core.take_actions() == [Send(stuck, "init")]
    assert core.next_deadline_ns() == clock.now + 30 * 10**9
    clock.now += 29 * 10**9
    core.tick(clock.now)
    assert stuck.state is FillState.CREATED and core.take_actions() == []  # not yet
    clock.now += 2 * 10**9
    assert core.due_watchdogs(clock.now) == [stuck]  # the shell reads a late PAUSED first, if there is one
    core.tick(clock.now)
    assert stuck.state is FillState.STOPPED and "its init did not finish within 30 s" in stuck.reason
    assert "the agent's --init-timeout; a job that needs longer sets FillJob spec.initTimeout" in stuck.reason
    assert Signal(stuck, signal.SIGKILL) in core.take_actions()
    assert core.kills == 1 and ("kill", gpu(0), "cpu", "stuck") in sink.calls
    core.on_exit(stuck, -9)
    assert [a.job.name for a in core.take_actions() if isinstance(a, Launch)] == ["next"]  # type: ignore[attr-defined]
    # A job whose init did finish is left alone at its deadline.
    done = next(j for j in core.jobs if j.name == "next")
    core.launched(done, has_control=True)
    core.on_control_line(done, line("state", state="PAUSED"))
    clock.now += 31 * 10**9
    core.tick(clock.now)
    assert done.state is not FillState.STOPPED


def test_a_job_asked_to_stop_that_is_still_there_after_the_grace_is_killed() -> None:
    """A fill process that ignores the request (SIGTERM trapped, a stop command ignored) ran on, never paused again,
    through the training's compute. One that exits in time is left alone, and the kill is timed once."""
    from bubbles.agent.core import STOP_GRACE_S

    core, clock, sink = make_core()
    deaf = armed(core)
    core.take_actions()
    assert core.cancel(deaf.name, "cancelled: by the test")
    assert core.take_actions() == [Send(deaf, "stop"), Signal(deaf, signal.SIGCONT)]
    core.begin_shutdown()  # asked again: still one deadline
    core.take_actions()
    clock.now += int((STOP_GRACE_S - 1) * 1e9)
    core.tick(clock.now)
    assert core.take_actions() == []  # not yet
    clock.now += 2 * 10**9
    core.tick(clock.now)
    assert core.take_actions() == [Signal(deaf, signal.SIGCONT), Signal(deaf, signal.SIGKILL)]
    assert core.kills == 1 and ("kill", gpu(0), "cpu", deaf.name) in sink.calls
    core.on_exit(deaf, -9)
    core.take_actions()
    # One that exits within the grace is not signalled again.
    polite = armed(core, name="polite")
    core.take_actions()
    core.cancel(polite.name, "cancelled: by the test")
    core.on_exit(polite, 0)
    core.take_actions()
    clock.now += int((STOP_GRACE_S + 1) * 1e9)
    core.tick(clock.now)
    assert not any(isinstance(a, Signal) for a in core.take_actions())


def test_a_jobs_own_init_timeout_takes_the_place_of_the_agents() -> None:
    """A job that loads a large model says so in its spec (FillJob spec.initTimeout): its deadline is its own, the
    agent's applies to the others, and the reason says whose limit it was."""
    core, clock, _sink = make_core(init_timeout_s=30.0)
    slow = core.submit(job_spec("slow", init_timeout="20m"))
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(slow, has_control=True)
    assert core.next_deadline_ns() == clock.now + 1200 * 10**9
    clock.now += 600 * 10**9  # well past the agent's 30 s
    core.tick(clock.now)
    assert slow.state is FillState.CREATED
    clock.now += 601 * 10**9
    core.tick(clock.now)
    assert slow.state is FillState.STOPPED
    assert "its init did not finish within 1200 s of its start (its own limit, FillJob spec.initTimeout" in slow.reason


def test_fill_mode_switches_disarm_and_rearm_the_job() -> None:
    core, _, _ = make_core()
    job = armed(core)
    core.take_actions()
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.OFF))
    assert core.take_actions() == [Send(job, "disarm")] and job.armed is None
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.NAIVE))
    (arm,) = core.take_actions()
    assert isinstance(arm, Send) and arm.fields["mode"] == "naive" and job.armed is FillMode.NAIVE


def test_shutdown_cancels_queued_jobs_and_stops_running_ones() -> None:
    core, _, _ = make_core(executors=1)
    running = armed(core)
    queued = core.submit(job_spec("queued"))
    core.take_actions()
    assert core.begin_shutdown() == [running]
    assert queued.state is FillState.STOPPED and queued.reason == "cancelled: agent shut down"
    assert core.take_actions() == [Send(running, "stop"), Signal(running, signal.SIGCONT)]
    core.reaped_at_shutdown(running)
    assert running.state is FillState.STOPPED and running.reason == "stopped: agent shut down"


def test_submissions_that_cannot_run_are_refused_with_the_fix() -> None:
    core, _, _ = make_core()
    core.submit(job_spec("a"))
    with pytest.raises(ValueError, match="already running; names must be unique"):
        core.submit(job_spec("a"))
    with pytest.raises(ValueError, match=r"asks for stage 3, but the agent serves no GPU of it \(it serves stage\(s\) "
                                         r"0\)"):
        core.submit(job_spec("b", stage=3))
    on_gpu = AgentCore(CoreConfig(run_dir=Path("/r"), training="t", executors=(("cuda:0", None),)), Clock())
    with pytest.raises(ValueError, match="declares no memory limit"):
        on_gpu.submit(parse_spec({"name": "g", "entry": "a:B"}))


def test_a_step_record_with_a_field_this_agent_does_not_know_is_counted_and_the_field_named_once() -> None:
    core, clock, _ = make_core()
    job = armed(core)
    core.take_actions()
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))
    for k in range(2):  # a newer SDK's records: a field it adds on every step
        t = clock.now + k * MS
        core.on_control_line(job, line("step", start_ns=t, end_ns=t + MS // 2, flops=1e6, bubble_seq=1,
                                       signal_ns=clock.now, joules=0.2))
    assert core.rejected_messages == 0 and sum(j.steps for j in core.snapshot().jobs) == 2
    notes = [e["message"] for e in core.events if e["kind"] == "control"]
    assert len(notes) == 1 and "step.joules" in notes[0] and "upgrade the agent" in notes[0]


def test_an_agent_serving_thousands_of_jobs_keeps_the_latest_finished_records_and_every_live_one() -> None:
    from bubbles.agent.core import MAX_STOPPED_JOBS

    core, _, _ = make_core()
    live = core.submit(job_spec("live"))
    for k in range(MAX_STOPPED_JOBS + 50):
        job = core.submit(job_spec(f"done-{k}"))
        core.cancel(job.name, "done")  # a queued job: STOPPED at once, never launched
    core.submit(job_spec("last"))  # records are let go of when one is added
    names = [j.name for j in core.jobs]
    assert len(names) == MAX_STOPPED_JOBS + 2 and names[0] == "live" and live.state is not FillState.STOPPED
    assert names[1] == "done-50" and names[-2:] == [f"done-{MAX_STOPPED_JOBS + 49}", "last"]  # the oldest went


def test_a_record_stamped_in_the_future_is_refused_before_it_reaches_the_ledger() -> None:
    """One step stamped with the wall clock (about 1.8e18 ns) would move the ledger's fold past every later record."""
    core, clock, _ = make_core()
    job = armed(core)
    core.take_actions()
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))
    wall = 1_800_000_000 * 10**9
    core.on_control_line(job, line("step", start_ns=wall, end_ns=wall + MS, flops=1.0, bubble_seq=1))
    core.on_datagram(gpu(0), wire.encode_bubble_end(0, 0, 1, wall))
    assert core.rejected_messages == 2
    assert core.ledgers["harvest"].totals().fill_steps == 0 and core.ledgers["harvest"].totals().bubble_s == 0


def test_a_job_that_names_no_stage_goes_to_the_stage_with_the_most_bubble_time() -> None:
    # A newcomer's spec need not know which stage waits: on a real training the last stage of two may wait 60% of
    # the iteration and the first 3%. The job waits for every stage's profile, then runs where the bubbles are.
    core, _, _ = make_core(executors=3)
    job = core.submit(job_spec())
    assert job.stage == 0
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle(0, ((0.002, 1 << 30),), stages=3)))
    assert core.take_actions() == [] and job.state is FillState.SUBMITTED  # stage 1 and 2 not profiled yet
    core.on_datagram(gpu(1), wire.encode_profile(1, cycle(1, ((0.020, 1 << 30), (0.010, 1 << 30)), stages=3)))
    assert core.take_actions() == []
    core.on_datagram(gpu(2), wire.encode_profile(2, cycle(2, ((0.004, 1 << 30),), stages=3)))
    (launch,) = core.take_actions()
    assert isinstance(launch, Launch) and launch.job is job and job.stage == 1
    placed = [e for e in core.events if e["kind"] == "placed"]
    assert len(placed) == 1 and placed[0]["stage"] == 1 and "30.0 ms of 50.0 ms" in placed[0]["message"]
    # a job that names its stage stays there, however few its bubbles
    pinned = core.submit(job_spec("k", stage=0))
    (launch,) = core.take_actions()
    assert launch.job is pinned and pinned.stage == 0


def test_a_job_that_names_no_stage_is_placed_when_an_executor_never_profiles() -> None:
    # --executors larger than the training's stages on this node: the third never hears a hook.
    core, clock, _ = make_core(executors=3)
    job = core.submit(job_spec())
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle(0, ((0.002, 1 << 30),))))
    core.on_datagram(gpu(1), wire.encode_profile(1, cycle(1, ((0.009, 1 << 30),))))
    clock.now += 4_900 * MS
    core.on_datagram(gpu(0), wire.encode_iteration(0, 9, clock.now, 50 * MS))
    assert core.take_actions() == []
    clock.now += 200 * MS
    core.on_datagram(gpu(0), wire.encode_iteration(0, 10, clock.now, 50 * MS))
    (launch,) = core.take_actions()
    assert launch.job is job and job.stage == 1
