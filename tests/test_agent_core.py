"""The agent's pure core (bubbles.agent.core): messages and ticks in, actions out, with a fake clock.

No sockets, no processes, no sleeps: each test plays the training's hook (datagrams from bubbles.core.wire),
the fill process (control lines from bubbles.core.control) and the shell (launch results, exits), and checks
the actions the core decides.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bubbles.agent.core import (
    AgentCore,
    CoreConfig,
    JobRecord,
    Launch,
    Release,
    Send,
    Signal,
    TrainingMembership,
    VerifyIsolation,
)
from bubbles.agent.guard import GuardConfig
from bubbles.core import control, wire
from bubbles.core.api import FillMode, FillState, IsolationMode, IsolationState, IsolationStatus, parse_spec

MS = 1_000_000
READY = IsolationStatus(IsolationMode.CONTEXTS, IsolationState.READY, "ready for tests", epoch=1)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * MS

    def __call__(self) -> int:
        return self.now


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def kill(self, stage: int, device: str, job: str) -> None:
        self.calls.append(("kill", stage, device, job))

    def rejected(self, stage: int, source: str) -> None:
        self.calls.append(("rejected", stage, source))

    def missed_end(self, stage: int) -> None:
        self.calls.append(("missed_end", stage))

    def iteration(self, stage: int, seconds: float) -> None:
        self.calls.append(("iteration", stage, seconds))

    def share(self, value: float) -> None:
        self.calls.append(("share", value))


def cycle(stage: int = 0, slots: tuple[tuple[float, int], ...] = ((0.005, 1 << 30),),
          iteration_s: float = 0.05) -> dict[str, Any]:
    return {
        "training": "t", "stage": stage, "stages": 2, "microbatches": 4, "schedule": "TrainSchedule",
        "iteration_s": iteration_s, "samples": 5,
        "slots": [{"slot": i, "position": i, "instruction": "RecvGrad", "kind": "steady", "duration_s": d,
                   "p10_s": d, "p90_s": d, "free_bytes": free} for i, (d, free) in enumerate(slots)],
    }


def make_core(executors: int = 1, **kw: Any) -> tuple[AgentCore, Clock, Sink]:
    clock, sink = Clock(), Sink()
    cfg = CoreConfig(run_dir=Path("/run/x"), training="t", executors=tuple(("cpu", None) for _ in range(executors)),
                     **kw)
    core = AgentCore(cfg, clock, sink)
    core.on_isolation(READY)
    core.start_serving()
    return core, clock, sink


def job_spec(name: str = "j", **fields: Any) -> Any:
    return parse_spec({"name": name, "entry": "pkg.mod:Job", "memory": "16Mi", "step_time": "1ms", **fields})


def started(core: AgentCore, name: str = "j", has_control: bool = True, **fields: Any) -> JobRecord:
    """Submit, profile stage 0, launch: the job is CREATED (SDK) or PAUSED (plain command)."""
    job = core.submit(job_spec(name, **fields))
    core.on_datagram(0, wire.encode_profile(0, cycle()))
    actions = core.take_actions()
    assert [type(a) for a in actions] == [Launch] and actions[0].job is job and actions[0].isolated
    core.launched(job, has_control=has_control)
    return job


def line(type_: str, **fields: Any) -> bytes:
    return control.encode(type_, **fields).rstrip(b"\n")


def armed(core: AgentCore, **fields: Any) -> JobRecord:
    job = started(core, **fields)
    core.on_control_line(job, line("state", state="PAUSED"))
    return job


def test_a_profiled_stage_launches_its_queued_job_and_arms_it_for_harvest() -> None:
    core, _, _ = make_core()
    job = core.submit(job_spec())
    assert core.take_actions() == [] and job.state is FillState.SUBMITTED  # no cycle yet: nothing to plan against
    core.on_datagram(0, wire.encode_profile(0, cycle()))
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
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 7, clock.now, clock.now + 5 * MS))
    core.on_control_line(job, line("step_begin", t_ns=clock.now + MS, bubble_seq=7))
    end = clock.now + 5 * MS
    core.on_datagram(0, wire.encode_bubble_end(0, 0, 7, end))
    assert core.next_deadline_ns() == end + 50 * MS
    clock.now = end + 49 * MS
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is not FillState.STOPPED  # not due yet
    clock.now = end + 51 * MS
    assert core.due_watchdogs(clock.now) == [job]
    core.tick(clock.now)
    assert core.take_actions() == [Signal(job, signal.SIGKILL)]
    assert job.state is FillState.STOPPED and job.reason.startswith("killed: did not pause within 50 ms")
    assert core.kills == 1 and ("kill", 0, "cpu", "j") in sink.calls
    assert any(e["kind"] == "kill" and "51.0 ms after bubble 7" in e["message"] for e in core.events)


def test_a_step_that_ended_in_time_disarms_the_watchdog() -> None:
    core, clock, _ = make_core()
    job = armed(core)
    core.take_actions()
    t0 = clock.now
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))
    core.on_control_line(job, line("step_begin", t_ns=t0, bubble_seq=1))
    core.on_control_line(job, line("step", start_ns=t0, end_ns=t0 + MS, flops=10.0, bubble_seq=1))
    core.on_datagram(0, wire.encode_bubble_end(0, 0, 1, t0 + 5 * MS))
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
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))
    core.on_control_line(job, line("step", start_ns=t0, end_ns=t0 + MS, flops=0, bubble_seq=1))
    core.on_control_line(job, line("step", start_ns=t0 + MS, end_ns=t0 + 2 * MS, flops=1e3, bubble_seq=1))
    assert job.flops == 4e9 + 1e3  # a step that reports its own FLOPs keeps them
    assert job.job_totals == {"harvest": [2, 4e9 + 1e3]}
    assert core.stats()["modes"]["harvest"]["fill_flops"] == pytest.approx(4e9 + 1e3)


def test_a_plain_command_is_thawed_for_each_bubble_and_frozen_after_it() -> None:
    core, clock, _ = make_core()
    job = core.submit(parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"]}))
    core.on_datagram(0, wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(job, has_control=False)
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and job.state is FillState.PAUSED
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGCONT)] and job.state is FillState.RUNNING
    core.on_datagram(0, wire.encode_bubble_end(0, 0, 1, clock.now + 5 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and job.state is FillState.PAUSED


def launched_plain_command(core: AgentCore) -> JobRecord:
    """A plain command, its stage profiled, launched and frozen until its first bubble (actions taken)."""
    job = core.submit(parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"]}))
    core.on_datagram(0, wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(job, has_control=False)
    core.take_actions()
    return job


def test_a_plain_command_whose_bubble_end_is_lost_is_frozen_at_twice_the_predicted_length() -> None:
    core, clock, sink = make_core()  # grace 50 ms
    job = launched_plain_command(core)
    t0 = clock.now
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))  # predicted: 5 ms
    assert core.take_actions() == [Signal(job, signal.SIGCONT)]
    assert core.next_deadline_ns() == t0 + 60 * MS  # 2 x 5 ms + 50 ms
    clock.now = t0 + 60 * MS - 1
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is FillState.RUNNING  # not yet
    clock.now = t0 + 60 * MS
    core.tick(clock.now)  # its END never came
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and job.state is FillState.PAUSED
    assert core.missed_ends == 1 and ("missed_end", 0) in sink.calls
    # The lost END's bubble still counts nowhere; the next bubble thaws and freezes the job as usual.
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 2, clock.now, clock.now + 5 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGCONT)]
    core.on_datagram(0, wire.encode_bubble_end(0, 0, 2, clock.now + 4 * MS))
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)]
    clock.now += 60 * MS
    core.tick(clock.now)  # that END came: its deadline does nothing
    assert core.take_actions() == [] and core.missed_ends == 1


def test_a_lost_ends_deadline_leaves_a_later_bubble_and_a_job_no_longer_running_alone() -> None:
    core, clock, _ = make_core()
    job = launched_plain_command(core)
    t0 = clock.now
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, t0, t0 + 5 * MS))  # its END is lost...
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 2, t0 + 8 * MS, t0 + 100 * MS))  # ...and a long bubble opens
    assert core.take_actions() == [Signal(job, signal.SIGCONT)]  # thawed once: it was already running
    clock.now = t0 + 60 * MS
    core.tick(clock.now)  # bubble 1's deadline: bubble 2 is open, and its own deadline (t0 + 242 ms) covers it
    assert core.take_actions() == [] and job.state is FillState.RUNNING
    clock.now = t0 + 242 * MS
    core.tick(clock.now)
    assert core.take_actions() == [Signal(job, signal.SIGSTOP)] and core.missed_ends == 1
    # Naive mode: the command runs freely, and a lost END's deadline must not freeze it.
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 3, clock.now, clock.now + 5 * MS))
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.NAIVE))
    core.take_actions()
    assert job.state is FillState.RUNNING
    clock.now += 60 * MS
    core.tick(clock.now)
    assert core.take_actions() == [] and job.state is FillState.RUNNING and core.missed_ends == 1


def test_a_job_that_fits_no_bubble_is_rejected_without_a_launch_and_the_next_one_runs() -> None:
    core, _, _ = make_core()
    big = core.submit(job_spec("big", memory="2Gi"))
    small = core.submit(job_spec("small"))
    core.on_datagram(0, wire.encode_profile(0, cycle(slots=((0.005, 1 << 30),))))
    (launch,) = core.take_actions()
    assert launch.job is small  # type: ignore[union-attr]
    assert big.state is FillState.STOPPED and big.reason.startswith("rejected: ") and core.rejected_jobs == 1


def test_a_failed_launch_or_a_crash_frees_the_executor_for_the_next_job() -> None:
    core, _, _ = make_core()
    first = core.submit(job_spec("first"))
    second = core.submit(job_spec("second"))
    core.on_datagram(0, wire.encode_profile(0, cycle()))
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
    core.on_datagram(0, b"not a datagram")
    core.on_datagram(0, wire.encode_bubble_start(1, 0, 1, 0, 1))  # stage 1's message on stage 0's socket
    core.on_control_line(job, b'{"type": "step", "start_ns": 5, "end_ns": 1, "flops": 1}')
    core.on_control_line(job, line("state", state="CREATED"))  # ignored: a job does not go back
    assert core.rejected_messages == 3 and sink.calls.count(("rejected", 0, "datagram")) == 2
    assert core.take_actions() == [] and job.state is FillState.PAUSED and job.steps == 0


def test_a_newer_hooks_messages_are_read_where_known_and_said_once_where_not(caplog: pytest.LogCaptureFixture) -> None:
    core, clock, sink = make_core()
    armed(core)
    core.take_actions()
    v2 = bytes([wire.VERSION + 1])
    start = wire.encode_bubble_start(0, 0, 7, clock.now, clock.now + 5 * MS)
    core.on_datagram(0, start[:2] + v2 + start[3:] + b"appended field")
    assert 7 in core.executors[0].open_bubbles  # the fields this agent knows are read
    unknown = b"BB" + v2 + bytes([42]) + bytes(40)
    for _ in range(3):
        core.on_datagram(0, unknown)
    said = [e for e in core.events if e["kind"] == "datagram"]
    assert len(said) == 1 and "newer hook" in said[0]["message"] and "kind 42" in said[0]["message"]
    assert caplog.text.count("newer than this agent") == 1
    assert core.rejected_messages == 0 and ("rejected", 0, "datagram") not in sink.calls
    # Not malformed, but counted: an operator sees the agents that need upgrading.
    from prometheus_client import generate_latest

    from bubbles.agent.metrics import AgentMetrics

    assert core.snapshot().newer_messages == 3
    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert 'bubbles_newer_messages_total{training="t"} 3.0' in text and 'bubbles_late_records_total{training="t"} 0.0' \
        in text


MPS_READY = IsolationStatus(IsolationMode.MPS, IsolationState.READY, "daemon answers", epoch=1)


def mps_gpu_core(relaunch: bool = True) -> tuple[AgentCore, JobRecord]:
    """An MPS node's GPU stage with one SDK job, launched and initialized (its PAUSED just reported); ``relaunch``
    False: cluster mode (the operator restarts a stopped job in a new Pod)."""
    core = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cuda:0", None),),
                                relaunch=relaunch), Clock(), Sink())
    core.on_isolation(MPS_READY)
    core.start_serving()
    job = core.submit(job_spec())
    core.on_datagram(0, wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(job, has_control=True)
    core.take_actions()
    core.on_control_line(job, line("state", state="PAUSED"))
    return core, job


def test_an_mps_fill_job_on_a_gpu_is_armed_only_once_its_membership_is_verified() -> None:
    core, job = mps_gpu_core()
    assert core.take_actions() == [VerifyIsolation(job, "cuda:0")] and job.armed is None
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.NAIVE))  # a mode switch meanwhile arms nothing either
    assert not [a for a in core.take_actions() if isinstance(a, Send) and a.type == "arm"]
    core.isolation_verified(job, None)
    arms = [a for a in core.take_actions() if isinstance(a, Send) and a.type == "arm"]
    assert len(arms) == 1 and arms[0].fields["mode"] == "naive" and job.armed is FillMode.NAIVE
    assert any(e["kind"] == "isolation" and "verified" in e["message"] for e in core.events)
    core.isolation_verified(job, "late answer")  # a second answer changes nothing
    assert job.state is not FillState.STOPPED


def test_an_mps_fill_job_that_did_not_join_the_server_is_stopped_not_armed() -> None:
    core, job = mps_gpu_core()
    core.take_actions()
    core.isolation_verified(job, "process 42 is not a client of the MPS server")
    actions = core.take_actions()
    assert job.state is FillState.STOPPED and job.armed is None
    assert job.reason == "isolation not verified: process 42 is not a client of the MPS server"
    assert Send(job, "stop") in actions and not [a for a in actions if isinstance(a, Send) and a.type == "arm"]
    assert core.jobs == [job]  # the job's own doing: not tried again here


def test_a_verification_answered_after_the_isolation_changed_resubmits_and_cluster_mode_leaves_it_to_the_operator(
        ) -> None:
    core, job = mps_gpu_core()
    core.take_actions()
    core.on_isolation(IsolationStatus(IsolationMode.MPS, IsolationState.READY, "daemon restarted", epoch=2))
    core.take_actions()
    # (on_isolation itself stopped and resubmitted the running job: the new epoch)
    assert job.state is FillState.STOPPED and len(core.jobs) == 2
    cluster, attached = mps_gpu_core(relaunch=False)
    cluster.take_actions()
    cluster.isolation_verified(attached, "the check could not be made: no answer", transient=True)
    assert attached.state is FillState.STOPPED and cluster.jobs == [attached]
    assert attached.reason.endswith("(the operator restarts it in a new Pod)")


def test_a_job_whose_init_never_finishes_is_killed_at_its_deadline_and_the_next_one_runs() -> None:
    core, clock, sink = make_core(init_timeout_s=30.0)
    stuck = core.submit(job_spec("stuck"))
    core.submit(job_spec("next"))
    core.on_datagram(0, wire.encode_profile(0, cycle()))
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
    assert core.kills == 1 and ("kill", 0, "cpu", "stuck") in sink.calls
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
    assert core.kills == 1 and ("kill", 0, "cpu", deaf.name) in sink.calls
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
    core.on_datagram(0, wire.encode_profile(0, cycle()))
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


def test_a_check_that_could_not_be_made_stops_and_resubmits_the_job() -> None:
    """The daemon did not answer (or the isolation changed since the launch): not the job's fault, so it is tried
    again as after an isolation loss, within the same limit."""
    core, job = mps_gpu_core()
    core.take_actions()
    core.isolation_verified(job, "the check could not be made: no answer", transient=True)
    assert job.state is FillState.STOPPED and job.reason.startswith("isolation not verified")
    again = [j for j in core.jobs if j is not job]
    assert len(again) == 1 and again[0].resubmission == 1 and again[0].state is FillState.SUBMITTED


def test_jobs_with_nothing_to_join_are_armed_at_once() -> None:
    """CPU devices, contexts isolation, plain commands: no verification, as before."""
    core, _, _ = make_core()  # contexts, cpu
    job = started(core)
    core.on_control_line(job, line("state", state="PAUSED"))
    assert [a.type for a in core.take_actions() if isinstance(a, Send)][-1] == "arm"
    cpu = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cpu", None),)), Clock(), Sink())
    cpu.on_isolation(MPS_READY)
    cpu.start_serving()
    job = started(cpu)
    cpu.on_control_line(job, line("state", state="PAUSED"))
    assert not [a for a in cpu.take_actions() if isinstance(a, VerifyIsolation)] and job.armed is FillMode.HARVEST
    gpu = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cuda:0", None),)), Clock(), Sink())
    gpu.on_isolation(MPS_READY)
    gpu.start_serving()
    # A plain command: no init, so no moment by which it must have joined.
    plain = gpu.submit(parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"],
                                   "memory": "16Mi"}))
    gpu.on_datagram(0, wire.encode_profile(0, cycle()))
    gpu.take_actions()
    gpu.launched(plain, has_control=False)
    assert gpu.take_actions() == [Signal(plain, signal.SIGSTOP)] and plain.state is FillState.PAUSED


def test_fill_mode_switches_disarm_and_rearm_the_job() -> None:
    core, _, _ = make_core()
    job = armed(core)
    core.take_actions()
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.OFF))
    assert core.take_actions() == [Send(job, "disarm")] and job.armed is None
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.NAIVE))
    (arm,) = core.take_actions()
    assert isinstance(arm, Send) and arm.fields["mode"] == "naive" and job.armed is FillMode.NAIVE


def test_isolation_fails_closed_and_a_lost_client_is_stopped_and_resubmitted() -> None:
    core, _, _ = make_core()
    job = armed(core)
    core.take_actions()
    lost = replace(READY, state=IsolationState.UNAVAILABLE, detail="daemon gone")
    core.on_isolation(lost)
    actions = core.take_actions()
    assert Send(job, "stop") in actions and job.state is FillState.STOPPED
    assert job.reason == "isolation lost: daemon gone" and core.isolation_losses == 1
    again = core.jobs[-1]
    assert again is not job and again.resubmission == 1 and again.state is FillState.SUBMITTED
    core.on_exit(job, -9)
    assert [type(a) for a in core.take_actions()] == [Release]  # held: no launch while isolation is down
    assert again.reason.startswith("waiting for isolation: daemon gone")
    core.on_isolation(replace(READY, epoch=2))
    assert [type(a) for a in core.take_actions()] == [Launch]


def test_unisolated_running_needs_the_users_consent() -> None:
    core, _, _ = make_core(allow_unisolated=True)
    broken = IsolationStatus(IsolationMode.MPS, IsolationState.UNAVAILABLE, "no daemon")
    core.on_isolation(broken)
    assert core.isolation_status.state is IsolationState.UNISOLATED and core.isolation_status.usable
    job = core.submit(job_spec())
    core.on_datagram(0, wire.encode_profile(0, cycle()))
    (launch,) = core.take_actions()
    assert isinstance(launch, Launch) and not launch.isolated
    core.launched(job, has_control=True)
    assert job.isolation == "unisolated"


def test_the_guard_lowers_the_share_of_armed_jobs_when_fill_work_slows_the_training() -> None:
    guard = GuardConfig(budget=0.01, refresh_every=0, min_share=0.1)
    core, clock, sink = make_core(guard=guard)
    job = armed(core)
    core.take_actions()
    sent: list[Any] = []
    pauses = 0
    for _ in range(8 + 6 * 6):  # a slow window, then the probe's six pairs with and without fill work
        fill = 0.0 if core.fill_paused else core.share
        pauses += core.fill_paused
        core.on_datagram(0, wire.encode_iteration(0, 1, clock.now, int(50 * MS * (1 + 0.2 * fill))))
        sent += core.take_actions()
    shares = [a.fields["share"] for a in sent if isinstance(a, Send) and a.type == "share" and a.job is job]
    assert shares == [0.5] and core.share == 0.5 and pauses == 18  # three OFF iterations per pair
    assert Send(job, "disarm") in sent  # the probe's OFF blocks run no fill work
    assert ("share", 0.5) in sink.calls and ("iteration", 0, pytest.approx(0.06)) in sink.calls
    assert [e["message"].split(":")[0] for e in core.events if e["kind"] == "guard"] == [
        "slowdown +20.00% over the 1.00% budget", "probe cut"]


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
    with pytest.raises(ValueError, match="asks for stage 3, but the agent has 1 executor"):
        core.submit(job_spec("b", stage=3))
    gpu = AgentCore(CoreConfig(run_dir=Path("/r"), training="t", executors=(("cuda:0", None),)), Clock())
    with pytest.raises(ValueError, match="declares no memory limit"):
        gpu.submit(parse_spec({"name": "g", "entry": "a:B"}))


def test_a_trainings_own_limits_cap_the_share_and_set_the_guards_budget() -> None:
    guard = GuardConfig(budget=0.01, refresh_every=0)
    core, clock, sink = make_core(guard=guard)
    job = armed(core)
    core.take_actions()
    assert core.set_guard_limits(0.25, 0.5, "PipelineTraining ml/t") is True
    assert core.share == 0.5 and ("share", 0.5) in sink.calls
    assert Send(job, "share", {"share": 0.5}) in core.take_actions()
    assert core.snapshot().budget == 0.25 and core.status().budget == 0.25
    assert core.set_guard_limits(0.25, 0.5, "PipelineTraining ml/t") is False  # told again each round: no change
    for _ in range(12):  # 20% slower than the profiled 50 ms: within a 25% budget, so the share stays
        core.on_datagram(0, wire.encode_iteration(0, 1, clock.now, 60 * MS))
    assert core.guard is not None and core.guard.config.budget == 0.25 and core.share == 0.5
    assert any(e["kind"] == "guard" and "slowdown budget 25.00%" in e["message"] for e in core.events)
    core.set_guard_limits(None, 0.0, "PipelineTraining ml/t")  # maxFillShare: 0 turns harvesting off
    assert core.share == 0.0 and Send(job, "share", {"share": 0.0}) in core.take_actions()


def test_the_trainings_tail_risk_reaches_each_fill_process_before_it_is_armed_and_again_when_it_changes() -> None:
    core, _, _ = make_core(tail_risk=0.05)  # the agent's --tail-risk
    job = started(core)
    assert core.take_actions() == [Send(job, "init")]
    core.on_control_line(job, line("state", state="PAUSED"))
    assert [(a.type, a.fields.get("tail_risk")) for a in core.take_actions()] == [("limits", 0.05), ("arm", None)]
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.OFF))
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.HARVEST))
    assert [a.type for a in core.take_actions()] == ["disarm", "arm"]  # re-armed: the process has it already
    # A PipelineTraining's spec.tailRisk replaces it, and goes to the armed process at once; told again: nothing.
    assert core.set_guard_limits(None, None, "PipelineTraining ml/t", tail_risk=0.0) is True
    assert core.take_actions() == [Send(job, "limits", {"tail_risk": 0.0})]
    assert core.set_guard_limits(None, None, "PipelineTraining ml/t", tail_risk=0.0) is False
    assert core.take_actions() == []
    assert any(e["kind"] == "guard" and "tail risk from PipelineTraining ml/t: 0" in e["message"] for e in core.events)


def test_a_step_record_with_a_field_this_agent_does_not_know_is_counted_and_the_field_named_once() -> None:
    core, clock, _ = make_core()
    job = armed(core)
    core.take_actions()
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))
    for k in range(2):  # a newer SDK's records: a field it adds on every step
        t = clock.now + k * MS
        core.on_control_line(job, line("step", start_ns=t, end_ns=t + MS // 2, flops=1e6, bubble_seq=1,
                                       signal_ns=clock.now, joules=0.2))
    assert core.rejected_messages == 0 and sum(j.steps for j in core.snapshot().jobs) == 2
    notes = [e["message"] for e in core.events if e["kind"] == "control"]
    assert len(notes) == 1 and "step.joules" in notes[0] and "upgrade the agent" in notes[0]


def test_without_a_trainings_tail_risk_nothing_is_sent_and_a_bad_one_changes_nothing() -> None:
    core, _, _ = make_core()
    job = armed(core)
    assert [a.type for a in core.take_actions()] == ["init", "arm"]  # no limits: the process keeps its own
    for bad in (0.6, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"from 0 \(never start one\) to 0\.5"):
            core.set_guard_limits(0.5, 0.5, "PipelineTraining ml/t", tail_risk=bad)
    assert core.config.tail_risk is None and core.config.guard.budget == 0.01 and core.share == 1.0
    assert core.take_actions() == [] and job.tail_risk_sent is None


def test_the_guard_skips_the_iterations_after_a_mode_switch_and_takes_its_baseline_from_off_mode() -> None:
    core, clock, _ = make_core(guard=GuardConfig(refresh_every=0, refresh_window=3))
    armed(core)
    core.take_actions()

    def iteration(ms: float) -> None:
        core.on_datagram(0, wire.encode_iteration(0, 1, clock.now, int(ms * MS)))

    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.OFF))
    for ms in (500, 500, 40, 42, 41):  # the first two after the switch may still hold fill work: not measured
        iteration(ms)
    assert core.guard is not None and core.guard.baseline_s == pytest.approx(0.0415)  # median of the last 2
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.NAIVE))
    for _ in range(10):
        iteration(400)  # naive co-location is not the guard's to judge
    core.on_datagram(0, wire.encode_fill_mode(0, FillMode.HARVEST))
    iteration(400)
    iteration(400)  # naive work still draining after the switch: unseen
    assert core.guard.iterations == 0
    for _ in range(8):
        iteration(41)
    assert core.guard.iterations == 8 and core.guard.phase == "harvest" and core.share == 1.0


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
    core.on_datagram(0, wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))
    wall = 1_800_000_000 * 10**9
    core.on_control_line(job, line("step", start_ns=wall, end_ns=wall + MS, flops=1.0, bubble_seq=1))
    core.on_datagram(0, wire.encode_bubble_end(0, 0, 1, wall))
    assert core.rejected_messages == 2
    assert core.ledgers["harvest"].totals().fill_steps == 0 and core.ledgers["harvest"].totals().bubble_s == 0


def test_an_sdk_older_than_the_limits_command_is_said_once_and_its_later_errors_stay_its_own() -> None:
    core, _, _ = make_core(tail_risk=0.0)
    job = armed(core)
    core.take_actions()
    old = "rejected command: unknown command type 'limits'; expected one of init, arm, disarm, share, stop"
    for _ in range(2):
        core.on_control_line(job, line("error", message=old))
    assert job.last_error == ""
    notes = [e["message"] for e in core.events if e["kind"] == "control"]
    assert len(notes) == 1 and "older than the limits command" in notes[0]
    core.on_control_line(job, line("error", message="CUDA out of memory"))
    assert job.last_error == "CUDA out of memory"


def test_outside_mps_a_gpu_fill_job_is_planned_with_its_cuda_context_beside_its_memory() -> None:
    """The allocator cap (spec.memory) does not cover the process's CUDA context: in contexts mode a job that fits a
    bubble's free memory only without it must not be started, or the context eats the training's margin."""
    def gpu_core(mode: IsolationMode, free: int) -> tuple[AgentCore, JobRecord]:
        core = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cuda:0", None),),
                                    isolation_mode=mode), Clock(), Sink())
        core.on_isolation(IsolationStatus(mode, IsolationState.READY, "ok", epoch=1))
        core.start_serving()
        job = core.submit(job_spec(memory="1Gi"))
        core.on_datagram(0, wire.encode_profile(0, cycle(slots=((0.005, free),))))
        return core, job

    core, job = gpu_core(IsolationMode.CONTEXTS, 1 << 30)
    assert job.state is FillState.STOPPED and "plus 512 MiB for its own CUDA context" in job.reason
    assert not [a for a in core.take_actions() if isinstance(a, Launch)]
    core, job = gpu_core(IsolationMode.CONTEXTS, (1 << 30) + (512 << 20))
    assert [type(a) for a in core.take_actions()] == [Launch] and job.state is FillState.SUBMITTED
    core, job = gpu_core(IsolationMode.MPS, 1 << 30)  # an MPS client's context is the server's
    assert [type(a) for a in core.take_actions()] == [Launch]


def mps_stage(device: str = "cuda:0", isolation: IsolationStatus = MPS_READY) -> tuple[AgentCore, Clock]:
    clock = Clock()
    core = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=((device, None),),
                                isolation_mode=isolation.mode), clock, Sink())
    core.on_isolation(isolation)
    core.start_serving()
    return core, clock


def test_under_mps_the_trainings_process_is_checked_once_its_stage_is_profiled_and_again_for_a_new_pid() -> None:
    from bubbles.agent.core import TRAINING_RECHECK_S, VerifyTraining

    core, clock = mps_stage()
    core.on_datagram(0, wire.encode_iteration(0, 1, 900 * MS, 50 * MS), pid=4242)  # not profiled yet
    assert core.take_actions() == []
    core.on_datagram(0, wire.encode_profile(0, cycle()), pid=4242)
    assert core.take_actions() == [VerifyTraining(0, 4242, "cuda:0")]
    assert core.stats()["executors"][0]["training_membership"] == "pending"
    core.on_datagram(0, wire.encode_iteration(0, 2, 900 * MS, 50 * MS), pid=4242)
    assert core.take_actions() == []  # asked once
    core.training_membership(0, 4242, "not a client: the training's process 4242 is not a client")
    ex = core.stats()["executors"][0]
    assert ex["training_pid"] == 4242 and ex["training_membership"].startswith("not a client: the training's")
    assert [e["message"] for e in core.stats()["events"] if e["kind"] == "training"] == \
        ["not a client: the training's process 4242 is not a client"]
    core.on_datagram(0, wire.encode_iteration(0, 3, 900 * MS, 50 * MS), pid=5151)  # the training restarted ...
    assert core.take_actions() == []  # ... within the rate: asked later (two senders cannot make a check each)
    assert core.stats()["executors"][0]["training_membership"] == ""
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_datagram(0, wire.encode_iteration(0, 4, 900 * MS, 50 * MS), pid=5151)
    assert core.take_actions() == [VerifyTraining(0, 5151, "cuda:0")]
    core.on_datagram(0, wire.encode_iteration(0, 5, 900 * MS, 50 * MS), pid=6161)  # another, while one is pending
    assert core.take_actions() == []  # one check at a time
    core.training_membership(0, 5151, "client")  # about a process the stage no longer has: dropped, and ...
    assert core.stats()["executors"][0]["training_membership"] == ""
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_datagram(0, wire.encode_iteration(0, 6, 900 * MS, 50 * MS), pid=6161)
    assert core.take_actions() == [VerifyTraining(0, 6161, "cuda:0")]  # ... the current one asked about
    core.training_membership(0, 6161, "client")
    assert core.stats()["executors"][0]["training_membership"] == "client"
    assert core.stats()["events"][-1]["message"] == "the training's process 6161 is a client of the node's MPS server"
    core.on_datagram(0, wire.encode_iteration(0, 7, 900 * MS, 50 * MS))  # a datagram the kernel named no sender for
    assert core.take_actions() == [] and core.stats()["executors"][0]["training_pid"] == 6161
    core.on_datagram(0, b"not a bubbles datagram", pid=999)  # refused: its sender is not taken for the training
    core.on_datagram(0, wire.encode_iteration(1, 8, 900 * MS, 50 * MS), pid=999)  # another stage's: refused too
    assert core.take_actions() == [] and core.stats()["executors"][0]["training_pid"] == 6161
    from prometheus_client import generate_latest

    from bubbles.agent.metrics import AgentMetrics

    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert 'bubbles_training_mps_client{device="cuda:0",stage="0",training="t"} 1.0' in text
    core.executors[0].training_membership = TrainingMembership.from_wire("not a client: ...")
    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert 'bubbles_training_mps_client{device="cuda:0",stage="0",training="t"} 0.0' in text
    core.executors[0].training_membership = TrainingMembership.from_wire("client")
    core.reset_stage(0, "the training's Pod was replaced")  # the old process's answer goes with it
    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert "bubbles_training_mps_client" not in text  # not known: absent, not 0
    assert core.stats()["executors"][0]["training_pid"] is None
    assert core.stats()["executors"][0]["training_membership"] == ""


def test_a_training_check_that_could_not_be_made_or_told_nothing_is_asked_again_later() -> None:
    from bubbles.agent.core import TRAINING_RECHECK_S, VerifyTraining

    core, clock = mps_stage()
    core.on_datagram(0, wire.encode_profile(0, cycle()), pid=77)
    assert core.take_actions() == [VerifyTraining(0, 77, "cuda:0")]
    core.training_membership(0, 77, "the MPS control program timed out", transient=True)
    assert core.stats()["executors"][0]["training_membership"] == ""
    core.on_datagram(0, wire.encode_iteration(0, 1, 900 * MS, 50 * MS), pid=77)
    assert core.take_actions() == []  # not before the recheck interval
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_datagram(0, wire.encode_iteration(0, 2, 900 * MS, 50 * MS), pid=77)
    assert core.take_actions() == [VerifyTraining(0, 77, "cuda:0")]
    core.training_membership(0, 77, None)  # the daemon's PIDs are another namespace's (now): nothing can be told
    assert core.stats()["executors"][0]["training_membership"] == "unknown"
    core.on_datagram(0, wire.encode_iteration(0, 3, 900 * MS, 50 * MS), pid=77)
    assert core.take_actions() == []
    assert not [e for e in core.stats()["events"] if e["kind"] == "training"]
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_isolation(IsolationStatus(IsolationMode.MPS, IsolationState.UNAVAILABLE, "the daemon is gone", epoch=1))
    core.on_datagram(0, wire.encode_iteration(0, 4, 900 * MS, 50 * MS), pid=77)
    assert not [a for a in core.take_actions() if isinstance(a, VerifyTraining)]  # not while MPS is unavailable
    core.on_isolation(IsolationStatus(IsolationMode.MPS, IsolationState.READY, "the daemon answers", epoch=2))
    core.on_datagram(0, wire.encode_iteration(0, 5, 900 * MS, 50 * MS), pid=77)
    assert [a for a in core.take_actions() if isinstance(a, VerifyTraining)] == [VerifyTraining(0, 77, "cuda:0")]


@pytest.mark.parametrize(("device", "isolation"), [
    ("cpu", MPS_READY), ("cuda:0", READY),
    ("cuda:0", IsolationStatus(IsolationMode.NONE, IsolationState.UNISOLATED, "none", epoch=1))])
def test_the_training_is_not_checked_without_an_mps_server_on_a_gpu(device: str, isolation: IsolationStatus) -> None:
    core, _clock = mps_stage(device, isolation)
    core.on_datagram(0, wire.encode_profile(0, cycle()), pid=4242)
    assert not [a for a in core.take_actions() if type(a).__name__ == "VerifyTraining"]
    assert core.stats()["executors"][0]["training_membership"] == ""
