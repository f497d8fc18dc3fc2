"""``bubbles agent --exit-when-done``: when the training has ended, decided by the pure core (bubbles.agent.core.ending)
from what the shell found of each stage's hook, with a fake clock. The shell's side (cards, locks, processes) runs
for real in tests/test_agent_cli.py and tests/test_agent_exit.py."""

from __future__ import annotations

import pytest
from helpers.agent_core import MS, armed, cycle, facts, gpu, make_core

from bubbles.agent.core import ENDED_AFTER_S, HookFacts, HookState, TrainingEnd, hook_state
from bubbles.core import wire
from bubbles.core.api import FillState

S = 1_000_000_000
HELD = HookFacts(card=True, lock_held=True)  # the hook's process lives (between iterations too)
DETACHED = HookFacts(card=False)  # detach() removed the card
KILLED = HookFacts(card=True, lock_held=False)  # SIGKILL: the card is left, nobody holds its lock
NOTHING = HookFacts(card=False)


@pytest.mark.parametrize(
    ("facts", "had_card", "state", "why"),
    [
        (HELD, False, HookState.LIVE, ""),
        (KILLED, True, HookState.GONE, "nothing holds the card's lock"),
        (HookFacts(card=True, lock_held=None, sender_alive=False), True, HookState.GONE, "has exited"),
        (HookFacts(card=True, lock_held=None, sender_alive=True), True, HookState.LIVE, ""),
        (HookFacts(card=True, lock_held=None), True, HookState.LIVE, ""),  # a card, nothing against it (no flock)
        (HookFacts(card=None), True, HookState.LIVE, ""),  # there, unreadable this once (being replaced)
        (DETACHED, True, HookState.GONE, "its hook detached"),
        (HookFacts(card=False, sender_alive=True), False, HookState.LIVE, ""),  # a hook that could write no card
        (HookFacts(card=False, sender_alive=False), False, HookState.GONE, "it left no card"),
        (NOTHING, False, HookState.UNSEEN, ""),
    ],
)
def test_a_stages_hook_state_from_its_card_its_lock_and_its_process(facts: HookFacts, had_card: bool,
                                                                    state: HookState, why: str) -> None:
    got, reason = hook_state(facts, had_card)
    assert got is state and why in reason and (reason == "") == (state is not HookState.GONE)


def test_the_training_ends_once_every_started_stage_is_gone_for_a_while_and_not_before() -> None:
    end = TrainingEnd("t", started_ns=0)
    # A card left by an earlier run that was killed: its lock is free. Not this training's start.
    end.observe(gpu(0), KILLED, 1 * S)
    end.observe(gpu(1), NOTHING, 1 * S)
    assert not end.started and end.verdict(100 * S) is None
    # Both stages start; between iterations their cards and locks stay: live, whatever the time.
    for t in (2, 30, 60):
        end.observe(gpu(0), HELD, t * S)
        end.observe(gpu(1), HELD, t * S)
        assert end.verdict(t * S) is None
    # Stage 0 detaches, stage 1 still runs: not ended.
    end.observe(gpu(0), DETACHED, 61 * S)
    end.observe(gpu(1), HELD, 61 * S)
    assert end.verdict(70 * S) is None
    # Stage 1 is SIGKILLed: its card stays, its lock is free. Ended ENDED_AFTER_S later, not sooner.
    end.observe(gpu(0), DETACHED, 71 * S)
    end.observe(gpu(1), KILLED, 71 * S)
    assert end.verdict(71 * S + int(ENDED_AFTER_S * S) - 1) is None
    ending = end.verdict(71 * S + int(ENDED_AFTER_S * S))
    assert ending is not None and ending.code == 0
    assert "stage 0 rank 0: its hook detached" in ending.reason
    assert "stage 1 rank 0: its process is gone" in ending.reason


def test_a_stage_back_within_the_wait_or_a_datagram_is_no_end() -> None:
    end = TrainingEnd("t", started_ns=0)
    end.observe(gpu(0), HELD, 1 * S)
    end.observe(gpu(0), DETACHED, 2 * S)
    end.observe(gpu(0), HELD, 3 * S)  # a restart wrote a new card
    end.observe(gpu(0), DETACHED, 4 * S)
    assert end.verdict(4 * S + int(ENDED_AFTER_S * S) - 1) is None  # counted from the second going
    end.heard(gpu(0), 6 * S)  # a datagram read late: the stage ran until then
    end.observe(gpu(0), DETACHED, 6 * S)
    assert end.verdict(8 * S) is None
    assert end.verdict(6 * S + int(ENDED_AFTER_S * S)) is not None


def test_a_training_that_never_starts_is_given_up_on_only_with_a_start_timeout() -> None:
    patient = TrainingEnd("t", started_ns=5 * S)
    assert patient.verdict(10_000 * S) is None
    end = TrainingEnd("t", started_ns=5 * S, start_timeout_s=30.0)
    assert end.verdict(34 * S) is None
    ending = end.verdict(35 * S)
    assert ending is not None and ending.code == 1
    assert "no stage of training 't' started within 30 s" in ending.reason and "--run-dir, --training" in ending.reason
    started = TrainingEnd("t", started_ns=5 * S, start_timeout_s=30.0)
    started.heard(gpu(1), 6 * S)  # a datagram is a start too (a hook that could write no card)
    assert started.started and started.verdict(100 * S) is None


def test_the_core_decides_the_end_only_with_exit_when_done_and_says_it_once() -> None:
    off, clock, _ = make_core(executors=2)
    off.on_datagram(gpu(0), wire.encode_profile(0, cycle()))
    clock.now += 100 * S
    assert off.watch_hooks(facts(DETACHED, DETACHED)) is None and off.ended is None
    core, clock, _ = make_core(executors=2, exit_when_done=True)
    job = armed(core)
    core.take_actions()
    core.on_datagram(gpu(0), wire.encode_bubble_start(0, 0, 1, clock.now, clock.now + 5 * MS))  # heard: stage 0 started
    assert core.watch_hooks(facts(HELD, NOTHING)) is None
    clock.now += S
    assert core.watch_hooks(facts(DETACHED, NOTHING)) is None
    clock.now += int(ENDED_AFTER_S * S)
    ending = core.watch_hooks(facts(DETACHED, NOTHING))
    assert ending is not None and ending.code == 0 and core.ended is ending
    assert core.watch_hooks(facts(HELD, NOTHING)) is ending  # decided once
    assert [e["message"] for e in core.events if e["kind"] == "ended"] == [ending.reason]
    assert core.stats()["ended"] == {"code": 0, "reason": ending.reason}
    # Then the shell stops as on SIGTERM; the jobs say why.
    reap = core.begin_shutdown()
    assert reap == [job]
    core.reaped_at_shutdown(job)
    assert job.state is FillState.STOPPED and job.reason == "stopped: agent shut down (the training ended)"
    assert "stage 0 (cpu)" in core.summary() and core.summary().startswith(f"bubbles agent: {ending.reason}")
