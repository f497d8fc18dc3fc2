"""The harvest ledger: hand-computed totals, order independence, conservation of step time."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bubbles.agent.ledger import BREAKDOWN, HarvestLedger, LedgerTotals, StepRecord, bubble_breakdown, filled_share
from bubbles.core.stats import percentile

MS = 1_000_000  # ns


def test_hand_computed_example() -> None:
    led = HarvestLedger()
    led.add_bubble(0, 0, 10 * MS)
    led.add_bubble(0, 20 * MS, 30 * MS)
    led.add_bubble(1, 40 * MS, 50 * MS)
    led.add_step(0, "a", 1 * MS, 4 * MS, 1e9)  # fully inside: 3 ms filled
    led.add_step(0, "a", 8 * MS, 12 * MS, 1e9)  # straddles the end: 2 ms filled, 2 ms over
    led.add_step(0, "a", 14 * MS, 15 * MS, 1e9)  # entirely outside: 1 ms over
    led.add_step(0, "b", 41 * MS, 45 * MS, 2e9)  # inside stage 1's bubble, but ran on stage 0: 4 ms over
    t = led.totals()
    assert t == LedgerTotals(
        bubble_s=0.030,
        filled_s=0.005,
        fill_steps=4,
        fill_flops=5e9,
        overruns=3,
        overrun_s=0.007,
        overrun_p99_ms=pytest.approx(percentile([2.0, 1.0, 4.0], 99)),  # type: ignore[arg-type]
        max_overrun_ms=4.0,
        step_s=0.012,
    )
    assert led.totals(stage=1).bubble_s == pytest.approx(0.010)
    assert led.totals(stage=1).fill_steps == 0
    assert led.totals(stage=0).overruns == 3


def test_step_spanning_two_bubbles_and_record_before_bubble() -> None:
    led = HarvestLedger()
    # The step's record arrives before the bubbles it ran in are closed.
    led.add_step(2, "a", 5 * MS, 25 * MS, 0.0)
    led.add_bubble(2, 20 * MS, 30 * MS)
    led.add_bubble(2, 0, 10 * MS)
    t = led.totals()
    assert t.filled_s == pytest.approx(0.010)
    assert t.overrun_s == pytest.approx(0.010)
    assert t.overruns == 1
    assert led.bubble_intervals(2) == ((0, 10 * MS), (20 * MS, 30 * MS))
    assert led.bubble_intervals(7) == ()
    assert led.step_records() == (StepRecord(2, "a", 5 * MS, 25 * MS, 0.0),)


def test_overlapping_bubbles_count_once_and_exact_fit_is_no_overrun() -> None:
    led = HarvestLedger()
    led.add_bubble(0, 0, 10 * MS)
    led.add_bubble(0, 5 * MS, 15 * MS)  # a duplicate signal must not double the bubble time
    led.add_step(0, "a", 0, 15 * MS, 1.0)
    t = led.totals()
    assert t.bubble_s == pytest.approx(0.015)
    assert t.filled_s == pytest.approx(0.015)
    assert t.overruns == 0 and t.overrun_p99_ms == 0.0 and t.max_overrun_ms == 0.0


def test_empty_ledger() -> None:
    t = HarvestLedger().totals()
    assert t == LedgerTotals(0.0, 0.0, 0, 0.0, 0, 0.0, 0.0, 0.0, 0.0)


def test_percentile() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([4.0, 1.0], 0) == 1.0
    assert percentile([4.0, 1.0], 100) == 4.0
    assert percentile(list(map(float, range(101))), 99) == 99.0
    assert percentile([0.0, 10.0], 25) == 2.5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 10, 5), "ends before it starts"),
        ((-1, 0, 5), "stage must be >= 0"),
        ((0, 0.5, 5), "start_ns must be an integer"),
    ],
)
def test_bad_intervals(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HarvestLedger().add_bubble(*args)
    with pytest.raises(ValueError, match=match):
        HarvestLedger().add_step(args[0], "a", args[1], args[2], 0.0)


def test_bad_flops() -> None:
    with pytest.raises(ValueError, match="flops"):
        HarvestLedger().add_step(0, "a", 0, 1, float("nan"))


@st.composite
def timelines(draw: st.DrawFn) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Per stage, disjoint bubbles and disjoint (sequential) steps placed anywhere."""
    bubbles: list[tuple[int, int, int]] = []
    steps: list[tuple[int, int, int]] = []
    for stage in range(draw(st.integers(1, 3))):
        for out in (bubbles, steps):
            t = 0
            for _ in range(draw(st.integers(0, 6))):
                t += draw(st.integers(0, 20))
                length = draw(st.integers(0, 20))
                out.append((stage, t, t + length))
                t += length
    return bubbles, steps


@settings(max_examples=200, deadline=None)
@given(timelines(), st.randoms(use_true_random=False))
def test_order_independent_and_conserving(
    timeline: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]], rnd: random.Random
) -> None:
    bubbles, steps = timeline

    def build(order: list[tuple[str, tuple[int, int, int]]]) -> LedgerTotals:
        led = HarvestLedger()
        for kind, (stage, a, b) in order:
            if kind == "b":
                led.add_bubble(stage, a * MS, b * MS)
            else:
                led.add_step(stage, "j", a * MS, b * MS, 1.0)
        return led.totals()

    records = [("b", x) for x in bubbles] + [("s", x) for x in steps]
    first = build(records)
    rnd.shuffle(records)
    assert build(records) == first
    assert first.filled_s <= first.bubble_s + 1e-12
    assert first.filled_s + first.overrun_s == pytest.approx(first.step_s, abs=1e-12)
    assert first.step_s == pytest.approx(sum(b - a for _, a, b in steps) * MS / 1e9)
    assert first.fill_steps == len(steps)
    assert 0 <= first.overrun_p99_ms <= first.max_overrun_ms
    # Against a brute-force count, millisecond by millisecond.
    covered = {(s, t) for s, a, b in bubbles for t in range(a, b)}
    inside = sum(1 for s, a, b in steps for t in range(a, b) if (s, t) in covered)
    assert first.filled_s == pytest.approx(inside / 1000)
    assert first.overruns == sum(1 for s, a, b in steps if any((s, t) not in covered for t in range(a, b)))


# -- bounded memory: folding settled records ---------------------------------------------------------------------
def _same(a: LedgerTotals, b: LedgerTotals) -> None:
    for name in ("bubble_s", "filled_s", "fill_steps", "overruns", "overrun_s", "overrun_p99_ms", "max_overrun_ms",
                 "step_s", "tail_filled_s", "tail_overrun_s"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.fill_flops == pytest.approx(b.fill_flops)


@settings(max_examples=200, deadline=None)
@given(timelines(), st.integers(1, 4), st.randoms(use_true_random=False))
@example(([(0, 0, 0)], [(0, 0, 0), (0, 20, 40)]), 3, random.Random(0))  # a 0-length step at the cut: counted once
def test_folding_changes_no_total_while_records_arrive_within_the_settling_window(
    timeline: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]], fold_at: int, rnd: random.Random
) -> None:
    """Records arrive in order of their end, each up to 10 ms late (lengths up to 20 ms): a ledger folding all the
    time (every ``fold_at`` records, 40 ms settling) gives the totals of one that holds everything, steps and
    bubbles cut at the folds included."""
    bubbles, steps = timeline
    records = [("b", x) for x in bubbles] + [("s", x) for x in steps]
    records.sort(key=lambda r: r[1][2] + rnd.uniform(0, 10))
    held, folding = HarvestLedger(), HarvestLedger(settle_ns=40 * MS, fold_at=fold_at)
    for kind, (stage, a, b) in records:
        for led in (held, folding):
            if kind == "b":
                led.add_bubble(stage, a * MS, b * MS)
            else:
                led.add_step(stage, "j", a * MS, b * MS, 1.5, tail=a % 3 == 0)
    _same(folding.totals(), held.totals())
    for stage in held.stages():
        _same(folding.totals(stage), held.totals(stage))
    assert folding.late() == 0


def test_a_long_run_holds_a_bounded_number_of_records_and_totals_stay_exact() -> None:
    """An hour of 10 ms iterations: a 4 ms bubble with two 1.5 ms steps in it, the second overrunning by 0.5 ms at
    every tenth; with 2 s settling the ledger holds about 2 s of records, not an hour's."""
    led = HarvestLedger(settle_ns=2_000 * MS, fold_at=1_000)
    most = 0
    for i in range(360_000):
        t = i * 10 * MS
        led.add_bubble(0, t, t + 4 * MS)
        led.add_step(0, "j", t + MS // 2, t + 2 * MS, 1.0)
        led.add_step(0, "j", t + 2 * MS + MS // 2, t + 4 * MS + (MS // 2 if i % 10 == 0 else 0), 1.0)
        most = max(most, led.held())
    assert most <= 2_000, f"held {most} records"
    t = led.totals()
    assert t.bubble_s == pytest.approx(360_000 * 0.004)
    assert t.fill_steps == 720_000 and t.fill_flops == 720_000.0
    assert t.overruns == 36_000 and t.overrun_s == pytest.approx(36_000 * 0.0005)
    assert t.filled_s + t.overrun_s == pytest.approx(t.step_s)
    assert t.max_overrun_ms == pytest.approx(0.5) and t.overrun_p99_ms == pytest.approx(0.5)


def test_a_record_that_comes_after_its_time_was_folded_errs_against_fill_work_and_is_counted() -> None:
    led = HarvestLedger(settle_ns=10 * MS, fold_at=1)
    led.add_bubble(0, 0, 5 * MS)
    led.add_bubble(0, 100 * MS, 105 * MS)  # folds up to 95 ms
    led.add_step(0, "j", MS, 2 * MS, 7.0)  # it ran inside the first bubble, but reports 98 ms late
    led.add_bubble(0, 50 * MS, 60 * MS)  # a bubble as late: its time counts
    t = led.totals()
    assert (t.fill_steps, t.fill_flops, t.filled_s, t.overruns) == (1, 7.0, 0.0, 1)
    assert t.overrun_s == pytest.approx(0.001) and t.bubble_s == pytest.approx(0.020)
    assert led.late() == 2


def test_the_tail_steps_filled_time_and_overrun_are_told_apart_from_the_rest() -> None:
    led = HarvestLedger()
    led.add_bubble(0, 0, 10 * MS)
    led.add_step(0, "j", MS, 4 * MS, 1.0)  # allowed by the prediction: inside
    led.add_step(0, "j", 8 * MS, 12 * MS, 1.0, tail=True)  # started past the predicted end: 2 ms in, 2 ms over
    led.add_step(0, "j", 20 * MS, 21 * MS, 1.0)  # outside any bubble, not a tail step
    t = led.totals()
    assert (t.filled_s, t.overrun_s) == (pytest.approx(0.005), pytest.approx(0.003))
    assert (t.tail_filled_s, t.tail_overrun_s) == (pytest.approx(0.002), pytest.approx(0.002))


def test_bad_folding_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="settle_ns >= 0 and fold_at >= 1"):
        HarvestLedger(settle_ns=-1)
    with pytest.raises(ValueError, match="settle_ns >= 0 and fold_at >= 1"):
        HarvestLedger(fold_at=0)


# -- where the bubble time went ---------------------------------------------------------------------------------
MS_NS = 1_000_000


def bubble(start_ms: float = 0, end_ms: float = 10, predicted_ms: float = 8, share: float = 1.0,
           paused: bool = False, job: str = "fj", step_ms: float = 2.0, stage: int = 0) -> dict[str, object]:
    return {"stage": stage, "start_ns": int(start_ms * MS_NS), "end_ns": int(end_ms * MS_NS),
            "predicted_end_ns": int(predicted_ms * MS_NS), "share": share, "guard_paused": paused, "job": job,
            "step_s": step_ms / 1e3}


def steps(*spans: tuple[float, float], stage: int = 0) -> list[dict[str, object]]:
    return [{"stage": stage, "start_ns": int(a * MS_NS), "end_ns": int(b * MS_NS)} for a, b in spans]


def ms(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1e3, 6) for k, v in d.items() if v}


def test_every_bubble_millisecond_is_accounted_for_once() -> None:
    # Steps from 1 to 7 ms of a 10 ms bubble predicted to end at 8: 1 ms before the first step, a 1 ms tail too short
    # for a 2 ms step, 2 ms past the prediction.
    d = bubble_breakdown([bubble()], steps((1, 3), (3, 5), (5, 7)))
    assert ms(d) == {"filled": 6, "latency": 1, "too_short": 1, "past_prediction": 2, "bubble_s": 10}
    # The guard's share of 0.5 leaves steps the first 4 ms of the predicted 8: 4 ms withheld.
    d = bubble_breakdown([bubble(share=0.5)], steps((1, 3)))
    assert ms(d) == {"filled": 2, "latency": 1, "too_short": 1, "guard": 4, "past_prediction": 2, "bubble_s": 10}
    # A gap between steps is latency too; a tail that could have held another step is not "too short".
    d = bubble_breakdown([bubble(predicted_ms=10)], steps((0.5, 2.5), (3, 5)))
    assert ms(d) == {"filled": 4, "latency": 6, "bubble_s": 10}


def test_paused_unarmed_short_and_missed_bubbles_and_overruns() -> None:
    records = [bubble(0, 10, paused=True), bubble(20, 30, job=""), bubble(40, 41, predicted_ms=41),
               bubble(50, 60, predicted_ms=60), bubble(70, 80, predicted_ms=80)]
    d = bubble_breakdown(records, steps((75, 83), (85, 86)))  # the last step is in no bubble: not counted here
    assert ms(d) == {"guard": 10, "no_job": 10, "too_short": 1, "latency": 10 + 5, "filled": 5, "overrun_s": 3,
                     "bubble_s": 41}
    parts = sum(d[k] for k, _ in BREAKDOWN)
    assert parts == pytest.approx(d["bubble_s"])
    assert [k for k, _ in BREAKDOWN] == ["filled", "guard", "no_job", "latency", "too_short", "past_prediction"]


def test_what_steps_started_past_the_prediction_filled_and_overran_is_told_apart() -> None:
    # A 10 ms bubble predicted at 6: steps 1-5 (predicted), 6-8 and 8-11 (past the prediction, on the tail's word).
    records = steps((1, 5), (6, 8), (8, 11))
    for r in records[1:]:
        r["tail"] = True
    d = bubble_breakdown([bubble(predicted_ms=6)], records)
    assert ms(d) == {"filled": 8, "latency": 2, "bubble_s": 10, "overrun_s": 1, "tail_s": 4, "tail_overrun_s": 1}
    assert sum(d[k] for k, _ in BREAKDOWN) == pytest.approx(d["bubble_s"])
    untold = bubble_breakdown([bubble(predicted_ms=6)], steps((1, 5), (6, 8), (8, 11)))
    assert untold["tail_s"] == 0 and untold["filled"] == d["filled"]  # records without the flag: no tail steps


def test_steps_count_only_in_their_own_stages_bubbles() -> None:
    d = bubble_breakdown([bubble(stage=0), bubble(stage=1, predicted_ms=10)], steps((1, 3), stage=1))
    assert d["filled"] == pytest.approx(0.002) and d["bubble_s"] == pytest.approx(0.020)


def test_the_filled_share_of_a_window_counts_only_what_starts_in_it() -> None:
    bubble = {"stage": 0, "start_ns": 1_000, "end_ns": 11_000, "predicted_end_ns": 11_000, "job": "j",
              "share": 1.0, "step_s": 0.0, "guard_paused": False}
    steps = [{"stage": 0, "start_ns": 1_000, "end_ns": 5_000}]
    assert filled_share([bubble], steps, 0, 20_000) == pytest.approx(0.4)
    assert filled_share([bubble], steps, 2_000, 20_000) is None  # the bubble started before the window


def test_the_filled_share_counts_steps_that_run_through_a_bubble_they_did_not_start_in() -> None:
    # Naive co-location: fill steps run back to back, ignoring bubbles; the one that covers the bubble started
    # before it. The round's share must agree with the ledger's totals (the run's figure), not count it as empty.
    bubble = {"stage": 0, "start_ns": 10_000, "end_ns": 20_000}
    naive = [{"stage": 0, "job": "j", "start_ns": 2_000, "end_ns": 16_000},
             {"stage": 0, "job": "j", "start_ns": 16_000, "end_ns": 30_000}]
    assert filled_share([bubble], naive, 0, 40_000) == pytest.approx(1.0)
    ledger = HarvestLedger()
    ledger.add_bubble(0, 10_000, 20_000)
    for record in naive:
        ledger.add_step(0, "j", record["start_ns"], record["end_ns"], 0.0)
    assert ledger.totals().filled_s / ledger.totals().bubble_s == pytest.approx(1.0)


# -- benchmarks/ledger_scale.py ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "needle"), [
    (["--hours", "0"], "--hours must be in (0, 48]"),
    (["--bubble-ms", "300"], "--bubble-ms must be > 0 and below --iteration-ms"),
    (["--step-ms", "50"], "--step-ms must be > 0 and at most --bubble-ms"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_ledger_scale_refuses_bad_flags_saying_which(flags: list[str], needle: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import ledger_scale  # benchmarks/ (on the path through conftest)

    with pytest.raises(SystemExit) as exit_:
        ledger_scale.main(flags)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_ledger_scale_finds_the_same_totals_holding_fewer_records(tmp_path: Path) -> None:
    import ledger_scale

    out = tmp_path / "scale.json"
    assert ledger_scale.main(["--hours", "0.02", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    last = result["rows"][-1]
    assert result["totals_identical"] and last["held_all"] == last["records"] > 3 * last["held_folding"]


def test_the_filled_share_of_a_long_run_read_back_in_any_order_folds_nothing() -> None:
    """A finished run's records, every bubble first and then every step (the stats file's order): 60 s and 12,000
    records, past what a live ledger holds before folding, and still half of each bubble filled."""
    bubbles = [{"stage": 0, "start_ns": i * 10 * MS, "end_ns": i * 10 * MS + 4 * MS} for i in range(6000)]
    steps_ = [{"stage": 0, "start_ns": i * 10 * MS + MS, "end_ns": i * 10 * MS + 3 * MS} for i in range(6000)]
    assert filled_share(bubbles, steps_, 0, 61_000 * MS) == pytest.approx(0.5)


def test_no_fold_cuts_past_the_oldest_bubble_still_open() -> None:
    """A 60 s bubble (a peer's checkpoint) is recorded at its END; meanwhile naive steps report every 20 ms. Held
    back by the open bubble's start, the fold leaves the steps inside it to meet it: they count as filled, not
    overrun, as in a ledger holding every record."""
    opened: dict[int, int | None] = {0: 0}
    folding = HarvestLedger(settle_ns=10 * MS * 1000, fold_at=10, floor=opened.get)
    held = HarvestLedger.holding_all()
    for i in range(3000):  # 20 ms steps for 60 s
        for led in (folding, held):
            led.add_step(0, "j", i * 20 * MS, i * 20 * MS + 10 * MS, 1.0)
    opened[0] = None
    for led in (folding, held):
        led.add_bubble(0, 0, 60_000 * MS)
    _same(folding.totals(), held.totals())
    assert folding.totals().overrun_s == 0.0 and folding.late() == 0


def test_the_overrun_p99_is_left_out_where_it_is_not_asked_for() -> None:
    led = HarvestLedger()
    led.add_bubble(0, 0, MS)
    led.add_step(0, "j", 0, 3 * MS, 1.0)
    assert led.totals().overrun_p99_ms == pytest.approx(2.0)
    assert led.totals(0, percentiles=False).overrun_p99_ms == 0.0 and led.totals(0, percentiles=False).overruns == 1
