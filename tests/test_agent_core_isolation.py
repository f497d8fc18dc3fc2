"""The agent's pure core and isolation: fail closed, the MPS client checks of fill jobs and of the training's
process, unisolated running on the user's word, and CUDA contexts in the memory plan."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.agent_core import MS, READY, Clock, Sink, armed, cycle, gpu, job_spec, line, make_core, started

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
from bubbles.core import wire
from bubbles.core.api import FillMode, FillState, IsolationMode, IsolationState, IsolationStatus, parse_spec

MPS_READY = IsolationStatus(IsolationMode.MPS, IsolationState.READY, "daemon answers", epoch=1)


def mps_gpu_core(relaunch: bool = True) -> tuple[AgentCore, JobRecord]:
    """An MPS node's GPU stage with one SDK job, launched and initialized (its PAUSED just reported); ``relaunch``
    False: cluster mode (the operator restarts a stopped job in a new Pod)."""
    core = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cuda:0", None),),
                                relaunch=relaunch), Clock(), Sink())
    core.on_isolation(MPS_READY)
    core.start_serving()
    job = core.submit(job_spec())
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    core.take_actions()
    core.launched(job, has_control=True)
    core.take_actions()
    core.on_control_line(job, line("state", state="PAUSED"))
    return core, job


def test_an_mps_fill_job_on_a_gpu_is_armed_only_once_its_membership_is_verified() -> None:
    core, job = mps_gpu_core()
    assert core.take_actions() == [VerifyIsolation(job, "cuda:0")] and job.armed is None
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.NAIVE))  # a mode switch meanwhile arms nothing either
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
    on_gpu = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cuda:0", None),)), Clock(), Sink())
    on_gpu.on_isolation(MPS_READY)
    on_gpu.start_serving()
    # A plain command: no init, so no moment by which it must have joined.
    plain = on_gpu.submit(parse_spec({"name": "cmd", "interface": "imperative", "command": ["sleep", "30"],
                                   "memory": "16Mi"}))
    on_gpu.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    on_gpu.take_actions()
    on_gpu.launched(plain, has_control=False)
    assert on_gpu.take_actions() == [Signal(plain, signal.SIGSTOP)] and plain.state is FillState.PAUSED


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
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    (launch,) = core.take_actions()
    assert isinstance(launch, Launch) and not launch.isolated
    core.launched(job, has_control=True)
    assert job.isolation == "unisolated"


def test_outside_mps_a_gpu_fill_job_is_planned_with_its_cuda_context_beside_its_memory() -> None:
    """The allocator cap (spec.memory) does not cover the process's CUDA context: in contexts mode a job that fits a
    bubble's free memory only without it must not be started, or the context eats the training's margin."""
    def gpu_core(mode: IsolationMode, free: int) -> tuple[AgentCore, JobRecord]:
        core = AgentCore(CoreConfig(run_dir=Path("/run/x"), training="t", executors=(("cuda:0", None),),
                                    isolation_mode=mode), Clock(), Sink())
        core.on_isolation(IsolationStatus(mode, IsolationState.READY, "ok", epoch=1))
        core.start_serving()
        job = core.submit(job_spec(memory="1Gi"))
        core.on_datagram(gpu(0), wire.encode_profile(0, cycle(slots=((0.005, free),))))
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
    core.on_datagram(gpu(0), wire.encode_iteration(0, 1, 900 * MS, 50 * MS), pid=4242)  # not profiled yet
    assert core.take_actions() == []
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()), pid=4242)
    assert core.take_actions() == [VerifyTraining(gpu(0), 4242, "cuda:0")]
    assert core.stats()["executors"][0]["training_membership"] == "pending"
    core.on_datagram(gpu(0), wire.encode_iteration(0, 2, 900 * MS, 50 * MS), pid=4242)
    assert core.take_actions() == []  # asked once
    core.training_membership(gpu(0), 4242, "not a client: the training's process 4242 is not a client")
    ex = core.stats()["executors"][0]
    assert ex["training_pid"] == 4242 and ex["training_membership"].startswith("not a client: the training's")
    assert [e["message"] for e in core.stats()["events"] if e["kind"] == "training"] == \
        ["not a client: the training's process 4242 is not a client"]
    core.on_datagram(gpu(0), wire.encode_iteration(0, 3, 900 * MS, 50 * MS), pid=5151)  # the training restarted ...
    assert core.take_actions() == []  # ... within the rate: asked later (two senders cannot make a check each)
    assert core.stats()["executors"][0]["training_membership"] == ""
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_datagram(gpu(0), wire.encode_iteration(0, 4, 900 * MS, 50 * MS), pid=5151)
    assert core.take_actions() == [VerifyTraining(gpu(0), 5151, "cuda:0")]
    core.on_datagram(gpu(0), wire.encode_iteration(0, 5, 900 * MS, 50 * MS), pid=6161)  # another, while one is pending
    assert core.take_actions() == []  # one check at a time
    core.training_membership(gpu(0), 5151, "client")  # about a process the stage no longer has: dropped, and ...
    assert core.stats()["executors"][0]["training_membership"] == ""
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_datagram(gpu(0), wire.encode_iteration(0, 6, 900 * MS, 50 * MS), pid=6161)
    assert core.take_actions() == [VerifyTraining(gpu(0), 6161, "cuda:0")]  # ... the current one asked about
    core.training_membership(gpu(0), 6161, "client")
    assert core.stats()["executors"][0]["training_membership"] == "client"
    assert core.stats()["events"][-1]["message"] == "the training's process 6161 is a client of the node's MPS server"
    # A datagram the kernel named no sender for:
    core.on_datagram(gpu(0), wire.encode_iteration(0, 7, 900 * MS, 50 * MS))
    assert core.take_actions() == [] and core.stats()["executors"][0]["training_pid"] == 6161
    core.on_datagram(gpu(0), b"not a bubbles datagram", pid=999)  # refused: its sender is not taken for the training
    core.on_datagram(gpu(0), wire.encode_iteration(1, 8, 900 * MS, 50 * MS), pid=999)  # another stage's: refused too
    assert core.take_actions() == [] and core.stats()["executors"][0]["training_pid"] == 6161
    from prometheus_client import generate_latest

    from bubbles.agent.metrics import AgentMetrics

    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert 'bubbles_training_mps_client{device="cuda:0",namespace="_local",rank="0",stage="0",training="t"} 1.0' in text
    core.executors[0].training_membership = TrainingMembership.from_wire("not a client: ...")
    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert 'bubbles_training_mps_client{device="cuda:0",namespace="_local",rank="0",stage="0",training="t"} 0.0' in text
    core.executors[0].training_membership = TrainingMembership.from_wire("client")
    core.reset_gpu(gpu(0), "the training's Pod was replaced")  # the old process's answer goes with it
    text = generate_latest(AgentMetrics("t", core.snapshot).registry).decode()
    assert "bubbles_training_mps_client" not in text  # not known: absent, not 0
    assert core.stats()["executors"][0]["training_pid"] is None
    assert core.stats()["executors"][0]["training_membership"] == ""


def test_a_training_check_that_could_not_be_made_or_told_nothing_is_asked_again_later() -> None:
    from bubbles.agent.core import TRAINING_RECHECK_S, VerifyTraining

    core, clock = mps_stage()
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()), pid=77)
    assert core.take_actions() == [VerifyTraining(gpu(0), 77, "cuda:0")]
    core.training_membership(gpu(0), 77, "the MPS control program timed out", transient=True)
    assert core.stats()["executors"][0]["training_membership"] == ""
    core.on_datagram(gpu(0), wire.encode_iteration(0, 1, 900 * MS, 50 * MS), pid=77)
    assert core.take_actions() == []  # not before the recheck interval
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_datagram(gpu(0), wire.encode_iteration(0, 2, 900 * MS, 50 * MS), pid=77)
    assert core.take_actions() == [VerifyTraining(gpu(0), 77, "cuda:0")]
    core.training_membership(gpu(0), 77, None)  # the daemon's PIDs are another namespace's (now): nothing can be told
    assert core.stats()["executors"][0]["training_membership"] == "unknown"
    core.on_datagram(gpu(0), wire.encode_iteration(0, 3, 900 * MS, 50 * MS), pid=77)
    assert core.take_actions() == []
    assert not [e for e in core.stats()["events"] if e["kind"] == "training"]
    clock.now += int(TRAINING_RECHECK_S * 1e9)
    core.on_isolation(IsolationStatus(IsolationMode.MPS, IsolationState.UNAVAILABLE, "the daemon is gone", epoch=1))
    core.on_datagram(gpu(0), wire.encode_iteration(0, 4, 900 * MS, 50 * MS), pid=77)
    assert not [a for a in core.take_actions() if isinstance(a, VerifyTraining)]  # not while MPS is unavailable
    core.on_isolation(IsolationStatus(IsolationMode.MPS, IsolationState.READY, "the daemon answers", epoch=2))
    core.on_datagram(gpu(0), wire.encode_iteration(0, 5, 900 * MS, 50 * MS), pid=77)
    assert [a for a in core.take_actions() if isinstance(a, VerifyTraining)] == [VerifyTraining(gpu(0), 77, "cuda:0")]


@pytest.mark.parametrize(("device", "isolation"), [
    ("cpu", MPS_READY), ("cuda:0", READY),
    ("cuda:0", IsolationStatus(IsolationMode.NONE, IsolationState.UNISOLATED, "none", epoch=1))])
def test_the_training_is_not_checked_without_an_mps_server_on_a_gpu(device: str, isolation: IsolationStatus) -> None:
    core, _clock = mps_stage(device, isolation)
    core.on_datagram(gpu(0), wire.encode_profile(0, cycle()), pid=4242)
    assert not [a for a in core.take_actions() if type(a).__name__ == "VerifyTraining"]
    assert core.stats()["executors"][0]["training_membership"] == ""
