"""The agent's pure core and the training's limits: the slowdown guard's share, the training's own budget and
tail risk, and what reaches each fill process."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.agent_core import MS, armed, gpu, line, make_core, started

from bubbles.agent.core import (
    Send,
)
from bubbles.agent.guard import GuardConfig
from bubbles.core import wire
from bubbles.core.api import FillMode


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
        core.on_datagram(gpu(0), wire.encode_iteration(0, 1, clock.now, int(50 * MS * (1 + 0.2 * fill))))
        sent += core.take_actions()
    shares = [a.fields["share"] for a in sent if isinstance(a, Send) and a.type == "share" and a.job is job]
    assert shares == [0.5] and core.share == 0.5 and pauses == 18  # three OFF iterations per pair
    assert Send(job, "disarm") in sent  # the probe's OFF blocks run no fill work
    assert ("share", 0.5) in sink.calls and ("iteration", gpu(0), pytest.approx(0.06)) in sink.calls
    assert [e["message"].split(":")[0] for e in core.events if e["kind"] == "guard"] == [
        "slowdown +20.00% over the 1.00% budget", "probe cut"]


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
        core.on_datagram(gpu(0), wire.encode_iteration(0, 1, clock.now, 60 * MS))
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
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.OFF))
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.HARVEST))
    assert [a.type for a in core.take_actions()] == ["disarm", "arm"]  # re-armed: the process has it already
    # A PipelineTraining's spec.tailRisk replaces it, and goes to the armed process at once; told again: nothing.
    assert core.set_guard_limits(None, None, "PipelineTraining ml/t", tail_risk=0.0) is True
    assert core.take_actions() == [Send(job, "limits", {"tail_risk": 0.0})]
    assert core.set_guard_limits(None, None, "PipelineTraining ml/t", tail_risk=0.0) is False
    assert core.take_actions() == []
    assert any(e["kind"] == "guard" and "tail risk from PipelineTraining ml/t: 0" in e["message"] for e in core.events)


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
        core.on_datagram(gpu(0), wire.encode_iteration(0, 1, clock.now, int(ms * MS)))

    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.OFF))
    for ms in (500, 500, 40, 42, 41):  # the first two after the switch may still hold fill work: not measured
        iteration(ms)
    assert core.guard is not None and core.guard.baseline_s == pytest.approx(0.0415)  # median of the last 2
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.NAIVE))
    for _ in range(10):
        iteration(400)  # naive co-location is not the guard's to judge
    core.on_datagram(gpu(0), wire.encode_fill_mode(0, FillMode.HARVEST))
    iteration(400)
    iteration(400)  # naive work still draining after the switch: unseen
    assert core.guard.iterations == 0
    for _ in range(8):
        iteration(41)
    assert core.guard.iterations == 8 and core.guard.phase == "harvest" and core.share == 1.0


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
