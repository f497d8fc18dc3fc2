"""What a fill step takes, as the runtime measures and gates it: its queued device work, the profile at init, the
gates that follow in-bubble steps, the fallback for a profile no bubble fits, and steps of several sizes."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.sdk import BusyJob, serving, wait_for_socket

from bubbles.agent.ledger import HarvestLedger
from bubbles.core import wire
from bubbles.training.gating import StepGates
from bubbles.training.sdk.device import DeviceSync
from bubbles.training.sdk.jobs import StepResult
from bubbles.training.sdk.profiling import INIT_PROFILE_STEPS, PROFILE_MARGIN, check_step_sizes
from bubbles.training.sdk.runtime import STARVED_BUBBLES

# ---------------------------------------------------------------------------------------------------
# GPU work a step queued: it must finish inside the step (stand-ins for torch.cuda, no GPU here)


class SlowDeviceSync(DeviceSync):
    """Stands in for ``torch.cuda.synchronize()`` while the GPU still runs ``queued_s`` of kernels the step
    launched: the host thread blocks, idle, until they finish (a sleep is exactly that)."""

    def __init__(self, queued_s: float) -> None:
        self.queued_s = queued_s
        self.calls = 0

    def synchronize(self) -> None:
        self.calls += 1
        time.sleep(self.queued_s)


class HookedBusyJob(BusyJob):
    """BusyJob that runs ``during_next_step`` (once) inside its next step: to make something happen while
    the step's GPU work is still queued."""

    during_next_step: Callable[[], None] | None = None

    def step(self) -> StepResult:
        hook, self.during_next_step = self.during_next_step, None
        if hook is not None:
            hook()
        return super().step()


def test_queued_gpu_work_counts_in_the_step_time_the_gate_and_the_overrun(tmp_path: Path) -> None:
    queued_s = 0.030
    sync = SlowDeviceSync(queued_s)
    job = HookedBusyJob(step_ms=1.0)
    path = tmp_path / "fill-busy.sock"
    with serving(path, job, device_sync=sync) as (ch, _rt):
        ch.send("init")  # imports torch (apply_process_limits): seconds on a loaded machine
        # The init-time profiler waits for the GPU too: the gating step time is GPU time, not launch time.
        step_s = ch.wait("profile", timeout_s=60)["step_s"]
        assert sync.calls == INIT_PROFILE_STEPS
        assert (0.001 + queued_s) * PROFILE_MARGIN <= step_s < 0.5
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

        def start_bubble(seq: int, predicted_s: float) -> tuple[int, int]:
            start = time.monotonic_ns()
            sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(predicted_s * 1e9)), str(path))
            return start, start + int(predicted_s * 1e9)

        def end_bubble(seq: int) -> int:
            end = time.monotonic_ns()
            sig.sendto(wire.encode_bubble_end(0, 0, seq, end), str(path))
            return end

        # (b) The gate: a 25 ms bubble would hold 20 host-side steps of 1 ms, but not one 31 ms GPU step.
        start_bubble(1, 0.025)
        time.sleep(0.025)
        end_bubble(1)
        # A 150 ms bubble runs steps; each starts only if its profiled time fits before the predicted end.
        _, predicted_end = start_bubble(2, 0.150)
        time.sleep(0.150)
        end_bubble(2)
        ch.wait_count(2, "state", state="PAUSED")  # init's, then the end of bubble 2's pass
        steps = [e for e in ch.events if e.type == "step"]
        assert {e["bubble_seq"] for e in steps} == {2}
        # Each step lasts at least its GPU time, and the last one started no later than end - step_s.
        assert 1 <= len(steps) <= 1 + int((0.150 - step_s) / (queued_s + 0.001))
        for e in steps:
            assert e["start_ns"] + step_s * 1e9 <= predicted_end + 1
            # (a) The reported end is after the GPU finished: the step's time includes the synchronize.
            assert e["sync_ns"] >= queued_s * 1e9
            assert e["end_ns"] - e["start_ns"] >= e["sync_ns"] + job.step_ns

        # The training comes back while the step's kernels are still queued (the bubble was shorter than
        # predicted): the agent's overrun (step end - bubble end) is the time the GPU stayed busy after it.
        # The hook is set before the bubble starts: set after, a loaded machine could run the bubble's first step
        # before it (found by a clean-clone run), and the end would come in a second step instead.
        ended: list[int] = []
        job.during_next_step = lambda: ended.append(end_bubble(3))
        bubble_start, _ = start_bubble(3, 0.150)
        step = ch.wait("step", bubble_seq=3)
        ledger = HarvestLedger()
        ledger.add_bubble(0, bubble_start, ended[0])
        ledger.add_step(0, "busy", step["start_ns"], step["end_ns"], step["flops"])
        totals = ledger.totals()
        assert totals.overruns == 1
        assert totals.overrun_s * 1e9 == pytest.approx(step["end_ns"] - ended[0], abs=1)
        assert totals.overrun_s * 1e9 >= step["sync_ns"]
        assert step["sync_ns"] >= queued_s * 1e9
        ch.wait_count(3, "state", state="PAUSED")
        assert ch.count("step", bubble_seq=3) == 1  # the bubble had ended: no second step
        assert sync.calls == INIT_PROFILE_STEPS + ch.count("step")
        sig.close()
        ch.send("stop")


def test_naive_steps_wait_for_their_device_work_too(tmp_path: Path) -> None:
    sync = SlowDeviceSync(0.0)
    with serving(tmp_path / "fill-busy.sock", BusyJob(step_ms=0.2), device_sync=sync, step_s=0.001) as (ch, rt):
        ch.send("init")
        ch.wait("state", state="PAUSED", timeout_s=60)
        assert sync.calls == 0  # a step time was given: nothing profiled
        ch.send("arm", mode="naive")
        deadline = time.monotonic() + 5
        while rt.steps < 10:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        ch.send("disarm")
        ch.wait_count(2, "state", state="PAUSED")
        ch.wait_count(rt.steps, "step", mode="naive")
        assert sync.calls == rt.steps
        assert rt.steps == ch.count("step")
        assert all(e["sync_ns"] >= 0 for e in ch.events if e.type == "step")
        ch.send("stop")


def test_step_gates_start_from_the_profile_then_follow_in_bubble_steps_first_steps_apart() -> None:
    g = StepGates([(1, 0.001), (4, 0.003)], window=10, min_samples=4)
    assert g.fitting(2_000_000, first=True) == [1]
    assert g.fitting(3_000_000, first=False) == [1, 4]
    assert g.fitting(999_999, first=False) == []
    for _ in range(3):
        g.observe(4, True, 5_000_000)  # first steps pay for cold caches
    assert g.gate_ns(4, True) == 3_000_000  # fewer than min_samples: still the profile's
    g.observe(4, True, 5_000_000)
    assert g.gate_ns(4, True) == 5_000_000
    assert g.gate_ns(4, False) == 3_000_000  # later steps kept apart
    assert g.fitting(4_000_000, first=True) == [1]
    assert g.fitting(4_000_000, first=False) == [1, 4]
    for _ in range(10):
        g.observe(4, True, 2_000_000)  # the window forgets
    assert g.gate_ns(4, True) == 2_000_000
    assert g.first_steps_s() == [(1, 0.001), (4, 0.002)]
    floored = StepGates([(None, 0.0015)], min_samples=1, floors={None: 0.0015})  # a step time the spec states
    floored.observe(None, False, 1_000_000)
    assert floored.gate_ns(None, False) == 1_500_000  # measured shorter: the stated time still holds
    for bad in ({"profiled": []}, {"profiled": [(None, 0.001)], "window": 0},
                {"profiled": [(None, 0.001)], "min_samples": 0}):
        with pytest.raises(ValueError, match="StepGates"):
            StepGates(**bad)  # type: ignore[arg-type]


class PreemptedJob(BusyJob):
    """Steps of 1 ms, a few of them stretched as by a training computing beside the profile (scripted)."""

    def __init__(self, slow_ms: tuple[float, ...]) -> None:
        super().__init__(step_ms=1.0)
        self.slow_ms = list(slow_ms)

    def step(self) -> StepResult:
        if self.slow_ms:
            time.sleep(self.slow_ms.pop(0) / 1e3)
        return super().step()


def send_bubbles(path: Path, count: int, *, length_s: float, gap_s: float, sleep_s: float | None = None,
                 first: int = 1) -> None:
    """Bubbles first..first+count-1 to the runtime's socket as the hook sends them: START (predicted ``length_s``), a
    sleep (``sleep_s``, default the length), END, then ``gap_s`` before the next."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sig:
        for seq in range(first, first + count):
            start = time.monotonic_ns()
            sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(length_s * 1e9)), str(path))
            time.sleep(length_s if sleep_s is None else sleep_s)
            sig.sendto(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()), str(path))
            time.sleep(gap_s)


def test_a_profile_that_fits_no_bubble_falls_back_to_its_median_after_32_starved_bubbles(tmp_path: Path) -> None:
    """Init's profile steps compete with the training, and a gate no bubble fits lets no step run, so never learns
    (the cluster tier's example job: 14.5 ms for a 1.5 ms step, ten minutes at 0 steps). The 90th percentile stays
    the gate (the demo fills more with it); after STARVED_BUBBLES bubbles in a row that the median would have fitted,
    the gates fall back to the median, once, and the agent is told."""
    slow = (0, 0, 0, 0, 0, 30, 0, 0, 30, 0)  # after the 2 warm-up steps: 2 of 8 stretched by 30 ms
    assert len(slow) == INIT_PROFILE_STEPS
    path = tmp_path / "fill-busy.sock"
    with serving(path, PreemptedJob(slow)) as (ch, rt):
        ch.send("init")
        step_s = ch.wait("profile", timeout_s=60)["step_s"]
        assert step_s > 0.030 * PROFILE_MARGIN, step_s  # the 90th percentile: a stretched step
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        send_bubbles(path, STARVED_BUBBLES + 8, length_s=0.010, gap_s=0.002)
        ch.wait_count(2, "profile", timeout_s=5)
        relaxed = [e for e in ch.events if e.type == "profile"][1]["step_s"]
        assert relaxed < 0.005, relaxed  # the median: about 1.2 ms
        ch.wait("step", timeout_s=5)
        steps = [e for e in ch.events if e.type == "step"]
        assert rt.relaxed
        assert min(e["bubble_seq"] for e in steps) >= STARVED_BUBBLES, [e["bubble_seq"] for e in steps]
        ch.send("stop")


def test_bubbles_too_short_even_for_the_median_do_not_relax_the_gates(tmp_path: Path) -> None:
    path = tmp_path / "fill-busy.sock"
    with serving(path, PreemptedJob((0,) * INIT_PROFILE_STEPS)) as (ch, rt):  # 1 ms steps, gated at about 1.2 ms
        ch.send("init")
        ch.wait("profile", timeout_s=60)
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        send_bubbles(path, STARVED_BUBBLES + 4, length_s=0.0003, sleep_s=0.001, gap_s=0.0)  # 0.3 ms predicted
        time.sleep(0.1)
        assert not rt.relaxed
        assert ch.count("step") == 0
        assert ch.count("profile") == 1
        ch.send("stop")


class SpellJob(BusyJob):
    """Steps of 1 ms, each stretched by ``extra_ms`` while the test says so: a busy spell on the machine."""

    def __init__(self) -> None:
        super().__init__(step_ms=1.0)
        self.extra_ms = 0.0

    def step(self) -> StepResult:
        if self.extra_ms:
            time.sleep(self.extra_ms / 1e3)
        return super().step()


def test_a_measured_gate_lifted_past_every_bubble_by_a_busy_spell_forgets_its_slower_half(tmp_path: Path) -> None:
    """The cluster tier's stall (2026-12-07): steps had run, a busy spell stretched a few first steps, their 90th
    percentile crept past the longest bubble, and a gate that learns only from steps it lets run let none run again
    (629 of 1,500 steps, ten minutes). After STARVED_BUBBLES bubbles in a row that its median would have fitted, it
    forgets its slower half and the job runs again; the agent is told the new step time."""
    job = SpellJob()
    path = tmp_path / "fill-busy.sock"
    with serving(path, job) as (ch, rt):
        ch.send("init")
        ch.wait("profile", timeout_s=60)
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        send_bubbles(path, 12, length_s=0.010, gap_s=0.002)  # fast first steps: the gate is measured (8 of them)
        job.extra_ms = 20.0  # a 21 ms first step: none fits a 10 ms bubble, but the gate lets the first ones start
        send_bubbles(path, 5, length_s=0.010, gap_s=0.030, first=13)
        job.extra_ms = 0.0
        time.sleep(0.1)
        assert rt.gates is not None and rt.gates.gate_ns(None, True) > 10_000_000  # past every bubble now
        assert rt.gates.forgotten == 0
        after = 18 + STARVED_BUBBLES + 8
        send_bubbles(path, after - 18, length_s=0.010, gap_s=0.002, first=18)
        time.sleep(0.2)
        ch.drain()
        assert rt.gates.forgotten == 1 and rt.gates.gate_ns(None, True) < 10_000_000
        filled = {e["bubble_seq"] for e in ch.events if e.type == "step"}
        runs, run = [], 0
        for seq in range(13, after):
            run = 0 if seq in filled else run + 1
            runs.append(run)
        # The stall: from the gate's rise to its forgetting, STARVED_BUBBLES bubbles in a row ran nothing (a bubble
        # this loaded machine woke up for too late may add to them); then steps ran again.
        assert STARVED_BUBBLES <= max(runs) <= STARVED_BUBBLES + 4, (runs, sorted(filled))
        assert sum(seq in filled for seq in range(after - 8, after)) >= 6, sorted(filled)
        profiles = [e["step_s"] for e in ch.events if e.type == "profile"]
        assert profiles[-1] < 0.010 < max(profiles), profiles  # the agent was told the rise and the fall
        ch.send("stop")


class SizedJob(BusyJob):
    """Steps of 1 or 4 units; a unit sleeps 1 ms (so the test's thread keeps its timing)."""

    step_sizes = (4, 1)  # any order: the runtime sorts them

    def __init__(self) -> None:
        super().__init__()
        self.sizes_run: list[int] = []

    def step(self, size: int) -> StepResult:  # type: ignore[override]
        time.sleep(size * 0.001)
        self.sizes_run.append(size)
        return StepResult(flops=size * 1e6, samples=size)


def test_a_job_with_step_sizes_runs_the_largest_that_fits_and_fills_the_tail_with_smaller_ones(
        tmp_path: Path) -> None:
    path = tmp_path / "fill-busy.sock"
    job = SizedJob()
    with serving(path, job) as (ch, _rt):
        ch.send("init")
        prof = ch.wait("profile")
        sizes = dict(prof["sizes"])
        assert set(sizes) == {1, 4}
        assert 0.001 <= sizes[1] < sizes[4]
        assert prof["step_s"] == sizes[1]
        assert set(job.sizes_run) == {1, 4}  # both were timed at init
        ch.send("arm", mode="harvest", share=1.0)
        wait_for_socket(path)
        sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        job.sizes_run.clear()
        start = time.monotonic_ns()
        # Two whole steps, then room for a small step (2.5 small steps' time: slack for the steps' sleeps
        # overshooting on a loaded machine), not for a third big one.
        length_ns = int((sizes[4] * 2 + sizes[1] * 2.5) * 1e9)
        sig.sendto(wire.encode_bubble_start(0, 0, 1, start, start + length_ns), str(path))
        time.sleep(length_ns / 1e9 + 0.005)
        sig.sendto(wire.encode_bubble_end(0, 0, 1, time.monotonic_ns()), str(path))
        ch.wait_count(2, "state", state="PAUSED", timeout_s=5)
        steps = [e for e in ch.events if e.type == "step"]
        assert [e["size"] for e in steps] == job.sizes_run
        assert job.sizes_run[0] == 4, job.sizes_run  # big first
        for e in steps:  # every step was gated by its own size's time
            assert e["start_ns"] + sizes[e["size"]] * 1e9 <= start + length_ns + 1
        # The tail small: after the last big step, a small one ran whenever one still fit.
        last_big = max(i for i, e in enumerate(steps) if e["size"] == 4)
        room_ns = start + length_ns - steps[last_big]["end_ns"]
        small_after = [e["size"] for e in steps[last_big + 1:]]
        # Slack: the runtime's own work between steps (signals drained, the channel polled) comes out of the room,
        # and took more than 200 us once with the rest of the suite running beside it (room 1.533 ms, step 1.330 ms).
        assert 1 in small_after or room_ns < sizes[1] * 1e9 + 500_000, (job.sizes_run, room_ns / 1e6)
        ch.send("stop")


@pytest.mark.parametrize("sizes", [[0], [2, 2], ["4"], [True], 3, [1.5]])
def test_bad_step_sizes_stop_the_job_at_init_saying_what_they_must_be(sizes: Any) -> None:
    with pytest.raises(ValueError, match="step_sizes must"):
        check_step_sizes(sizes)
    assert check_step_sizes([8, 2]) == (2, 8)
    assert check_step_sizes(()) == ()
