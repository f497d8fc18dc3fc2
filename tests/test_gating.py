"""When a fill step may start past its bubble's predicted end (gating.TailRisk), pure and in the runtime."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

import pytest
from helpers.sdk import BusyJob, init_and_arm, serving
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbles.core import control, wire
from bubbles.core.api import DEFAULT_TAIL_RISK
from bubbles.core.stats import percentile
from bubbles.training.gating import StepGates, TailRisk
from bubbles.training.sdk.env import tail_risk
from bubbles.training.sdk.process import run_fill_process

MS = 1_000_000


def brute_risk(lengths: list[int], elapsed: int, since: int, lag: int, durations: list[int]) -> float | None:
    """The definition, pair by pair: of the bubbles that outlasted ``since - lag``, how many end before a step of
    each duration started at ``elapsed`` does."""
    survivors = [n for n in lengths if n > min(since, elapsed) - lag]
    if len(survivors) < 8:
        return None
    short = sum(1 for n in survivors for d in durations if n < elapsed + d)
    return short / (len(survivors) * len(durations))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(-2, 60), min_size=0, max_size=90),
       elapsed=st.integers(0, 60), back=st.none() | st.integers(0, 30),
       durations=st.lists(st.integers(1, 20), min_size=1, max_size=6), lags=st.lists(st.integers(0, 5), max_size=5))
def test_the_risk_is_the_share_of_survivor_and_duration_pairs_that_overrun(
        lengths: list[int], elapsed: int, back: int | None, durations: list[int], lags: list[int]) -> None:
    t = TailRisk(0.05, window=64, min_survivors=8)
    for n in lengths:
        t.ended(3, n)
    for lag in lags:
        t.end_lag(lag)
    kept = [n for n in lengths if n > 0][-64:]  # the window: the last 64 lengths
    assert t.lag_ns == (int(percentile(lags, 90)) if lags else 0)
    since = None if back is None else elapsed - back  # when the bubble entered its tail (None: now)
    got = t.risk(3, elapsed, durations, since_ns=since)
    want = brute_risk(kept, elapsed, elapsed if since is None else since, t.lag_ns, durations)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(want)
    assert t.risk(4, elapsed, durations) is None  # another slot has no lengths


def test_past_the_prediction_a_step_may_start_while_the_bubbles_that_lasted_this_long_mostly_outlast_it() -> None:
    t = TailRisk(0.05, min_survivors=8)
    for n in range(36, 46):  # ten bubbles of 36, 37, ... 45 ms; predicted (p10) about 37 ms
        t.ended(0, n * MS)
    gates = StepGates([(1, 0.001), (4, 0.004)], min_samples=1)
    # At 30 ms every bubble is still going, and none is shorter than 34 ms: both sizes fit.
    assert t.fitting(0, 30 * MS, gates, first=False) == [1, 4]
    # At 36.5 ms: nine survivors (37-45); a 1 ms step overruns one of them (37), a 4 ms step four.
    assert t.risk(0, 36_500_000, [MS]) == pytest.approx(1 / 9)
    assert t.fitting(0, 36_500_000, gates, first=False) == []  # 11% > 5%
    loose = TailRisk(0.2)
    for n in range(36, 46):
        loose.ended(0, n * MS)
    assert loose.fitting(0, 36_500_000, gates, first=False) == [1]  # at 20% the small size (11%), not the large (44%)
    assert t.risk(0, 40 * MS, [MS]) is None  # five survivors: too few to tell
    assert TailRisk(0.0).fitting(0, 0, gates, first=False) == []  # off
    # Steps that were seen running long make the same point riskier (durations follow StepGates' window).
    gates.observe(1, False, 3 * MS)
    assert t.risk(0, 30 * MS, gates.durations_ns(1, False)) == 0.0
    assert t.risk(0, 33_500_000, gates.durations_ns(1, False)) == pytest.approx(1 / 10)  # 36 < 33.5 + 3


def test_the_bound_is_per_bubble_later_tail_steps_count_from_when_the_bubble_entered_its_tail() -> None:
    t = TailRisk(0.25, window=64)
    for n in range(30, 70):  # forty bubbles of 30 to 69 ms
        t.ended(0, n * MS)
    gates = StepGates([(None, 0.002)], min_samples=1)
    # Entered its tail at 35 ms (34 survivors: 36-69). A 2 ms step at 35 ms ends after one of them (36): 3%.
    assert t.risk(0, 35 * MS, [2 * MS], since_ns=35 * MS) == pytest.approx(1 / 34)
    # Later steps of the same bubble: the bubbles that end before the step would, counted among all 34 that lasted
    # past 35 ms (not among those that lasted to the step's start): a bound on the share of the tail-filled bubbles
    # that end while a tail step runs, however many steps each takes.
    assert t.risk(0, 42 * MS, [2 * MS], since_ns=35 * MS) == pytest.approx(8 / 34)  # 36-43
    assert t.risk(0, 42 * MS, [2 * MS]) == pytest.approx(1 / 27)  # per step it would look safe: 43 of 43-69
    assert t.fitting(0, 42 * MS, gates, first=False, since_ns=35 * MS) == [None]  # 8 of 34: 24%
    assert t.fitting(0, 43 * MS, gates, first=False, since_ns=35 * MS) == []  # 9 of 34: 26%
    assert t.fitting(0, 43 * MS, gates, first=False) == [None]  # 1 of 26


def test_a_later_steps_gate_inflated_at_init_gives_way_to_what_first_steps_showed_in_bubbles() -> None:
    # The profile caught an outlier (50 ms for a 5 ms step): later steps, gated on it, would never fit and never
    # learn. Once first steps (the slower kind) have a gate from bubbles, it bounds the later steps' gate.
    g = StepGates([(None, 0.050)], min_samples=4)
    assert g.gate_ns(None, False) == 50 * MS
    for _ in range(4):
        g.observe(None, True, 6 * MS)
    assert g.gate_ns(None, True) == 6 * MS and g.gate_ns(None, False) == 6 * MS
    for _ in range(4):
        g.observe(None, False, 4 * MS)
    assert g.gate_ns(None, False) == 4 * MS  # their own, once they have one
    low = StepGates([(None, 0.003)], min_samples=1)
    low.observe(None, True, 8 * MS)
    assert low.gate_ns(None, False) == 3 * MS  # never above the profile's


def test_a_measured_gate_that_refuses_places_its_median_fits_forgets_its_slower_half() -> None:
    """A busy spell's slow steps lift a measured gate past every bubble, and a gate learns only from steps it lets
    run: after ``stale_after`` refusals (no step of that size and place run meanwhile) where the median would have
    fitted, it forgets its slower half. Places too short even for the median neither count nor reset."""
    g = StepGates([(1, 0.001), (4, 0.015)], min_samples=4, stale_after=3, floors={4: 0.0035})
    for d in (1, 1, 1, 1, 1, 1, 20, 20):  # 90th percentile 20 ms, median 1 ms
        g.observe(1, True, d * MS)
    assert g.gate_ns(1, True) == 20 * MS and g.fitting(10 * MS, first=True) == []
    assert g.refused(10 * MS, first=True) == [] and g.refused(10 * MS, first=True) == []
    assert g.refused(MS // 2, first=True) == []  # too short for the median: not counted, the count kept
    assert g.refused(10 * MS, first=False) == []  # later steps are another place (none measured: the profile's)
    assert g.refused(10 * MS, first=True) == [1] and g.forgotten == 1  # the third in a row
    assert g.gate_ns(1, True) == MS and g.fitting(10 * MS, first=True) == [1]
    assert g.durations_ns(1, True) == [MS] * 6  # the slower half gone; enough left to stand for the gate
    g.observe(1, True, 20 * MS)  # the gate re-measures from the steps that run now
    assert g.gate_ns(1, True) > MS
    # A step run resets the count: refusals must come in a row.
    for d in (1, 1, 1, 1, 20, 20, 20):
        g.observe(1, True, d * MS)
    assert g.fitting(10 * MS, first=True) == []
    g.refused(10 * MS, first=True)
    g.refused(10 * MS, first=True)
    g.observe(1, True, 20 * MS)
    assert g.refused(10 * MS, first=True) == [] and g.forgotten == 1
    # Never below a floor the spec states.
    for d in (1, 1, 1, 1, 20):
        g.observe(4, True, d * MS)
    for _ in range(3):
        forgot = g.refused(8 * MS, first=True)
    assert 4 in forgot and g.gate_ns(4, True) == 3_500_000
    with pytest.raises(ValueError, match="stale_after"):
        StepGates([(None, 0.001)], stale_after=0)


def test_an_end_not_read_yet_may_have_happened_the_lag_of_end_signals_widens_the_survivors() -> None:
    t = TailRisk(0.05)
    for n in range(36, 46):
        t.ended(0, n * MS)
    before = t.risk(0, 37 * MS, [MS])
    for _ in range(10):
        t.end_lag(2 * MS)  # END signals arrive 2 ms after their bubble ended
    after = t.risk(0, 37 * MS, [MS])
    assert before is not None and after is not None
    assert t.lag_ns == 2 * MS
    assert after > before  # the 36 ms bubble may have ended unseen: it counts, as an overrun


def test_the_window_forgets_old_lengths_and_bad_lengths_are_ignored() -> None:
    t = TailRisk(0.05, window=10, min_survivors=8)
    for _ in range(10):
        t.ended(0, 5 * MS)
    for _ in range(10):
        t.ended(0, 50 * MS)  # the training changed: the bubble is longer now
    t.ended(0, 0)
    t.ended(0, -3)
    assert t.risk(0, 10 * MS, [MS]) == 0.0  # every kept length is 50 ms


@pytest.mark.parametrize("kwargs", [{"max_risk": 1.0}, {"max_risk": -0.1}, {"max_risk": float("nan")},
                                    {"max_risk": 0.1, "window": 0}, {"max_risk": 0.1, "min_survivors": 0},
                                    {"max_risk": 0.1, "window": 4, "min_survivors": 5},
                                    {"max_risk": 0.1, "lag_window": 0}])
def test_bad_tail_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="TailRisk"):
        TailRisk(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "risk"), [("", DEFAULT_TAIL_RISK), ("0", 0.0), (" 0.1 ", 0.1), ("0.5", 0.5)])
def test_the_tail_risk_comes_from_the_environment(text: str, risk: float) -> None:
    assert tail_risk(text) == risk


@pytest.mark.parametrize("text", ["often", "-0.01", "0.6", "1", "nan", "inf"])
def test_a_bad_tail_risk_says_what_to_give(text: str) -> None:
    with pytest.raises(ValueError, match=r"BUBBLES_TAIL_RISK.*from 0 \(never start one\) to 0.5"):
        tail_risk(text)


def test_the_fill_process_refuses_a_bad_tail_risk_before_it_starts(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(control.TAIL_RISK_ENV, "lots")
    monkeypatch.setenv(control.CONTROL_FD_ENV, "99999")  # never reached: the setting is checked first
    assert run_fill_process(["--entry", "test_agent_jobs:BusyJob"]) == 2
    assert "BUBBLES_TAIL_RISK='lots'" in capsys.readouterr().err


def test_relaxing_lowers_only_the_profiled_gates_and_never_raises_them() -> None:
    g = StepGates([(1, 0.014), (4, 0.020)], min_samples=2)
    for _ in range(2):
        g.observe(4, True, 9 * MS)  # size 4's first steps have a gate of their own: 9 ms
    g.relax([(1, 0.002), (4, 0.030), (8, 0.001)])  # 30 ms is more than size 4's profile; size 8 is none of its sizes
    assert g.gate_ns(1, True) == 2 * MS and g.gate_ns(1, False) == 2 * MS
    assert g.gate_ns(4, True) == 9 * MS  # what was seen in bubbles stands
    assert g.gate_ns(4, False) == 9 * MS  # bounded by the first steps' gate, the profile's 20 ms kept
    assert g.fitting(3 * MS, True) == [1]


def test_a_step_record_with_a_gate_other_than_tail_is_rejected() -> None:
    line = control.encode("step", start_ns=1, end_ns=2, flops=0.0, gate="tail")
    assert control.parse_event(line)["gate"] == "tail"
    with pytest.raises(control.ControlError, match=r"step\.gate must be 'tail'"):
        control.parse_event(control.encode("step", start_ns=1, end_ns=2, flops=0.0, gate="predicted"))
    with pytest.raises(control.ControlError, match="gate must be str"):
        control.parse_event(control.encode("step", start_ns=1, end_ns=2, flops=0.0, gate=1))


def _bubbles(path: Path, count: int, length_s: float, predicted_s: float) -> dict[int, int]:
    """``count`` bubbles of slot 0, each ``length_s`` long and predicted to end after ``predicted_s``; returns each
    one's END stamp by its sequence number."""
    sig = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ends = {}
    for seq in range(1, count + 1):
        start = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_start(0, 0, seq, start, start + int(predicted_s * 1e9)), str(path))
        time.sleep(length_s)
        ends[seq] = time.monotonic_ns()
        sig.sendto(wire.encode_bubble_end(0, 0, seq, ends[seq]), str(path))
        time.sleep(0.004)
    sig.close()
    return ends


def _settle(ch) -> None:  # type: ignore[no-untyped-def]
    """Read events until none has come for 0.2 s (at most 10 s)."""
    deadline = time.monotonic() + 10
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.2:
        before = len(ch.events)
        with contextlib.suppress(TimeoutError):
            ch.events += [control.parse_event(line) for line in ch.lines.feed(ch.sock.recv(65536))]
        if len(ch.events) > before:
            quiet_since = time.monotonic()


def _guard_share_back_up() -> float:
    """The share as the slowdown guard leaves it after one cut (x 0.5) and five steps back up (+ 0.1 each)."""
    share = 1.0 * 0.5
    for _ in range(5):
        share = min(1.0, share + 0.1)
    return share


@pytest.mark.parametrize(("risk", "share"), [(0.0, 1.0), (0.1, 1.0), (0.1, _guard_share_back_up())])
def test_the_runtime_starts_steps_past_the_prediction_only_on_the_tails_word(tmp_path: Path, risk: float,
                                                                             share: float) -> None:
    """Bubbles of 20 ms predicted at 8 ms (a prediction far too low, as a p10 is for most bubbles): once the
    runtime has seen 8 of them end, it fills their tails with 1 ms steps marked ``gate: tail``; with the tail off
    (risk 0) no step starts where the prediction does not allow it. A share the guard has raised back to within
    rounding of 1 (0.9999999999999999) is the full share."""
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=1.0), step_s=0.0012) as (ch, rt):
        rt.tail = TailRisk(risk)
        init_and_arm(ch, path, share=share)
        ends = _bubbles(path, 12, 0.020, 0.008)
        _settle(ch)
        steps = [e for e in ch.events if e.type == "step"]
        assert len({e["bubble_seq"] for e in steps}) >= 9, "most bubbles ran no step"
        tails = [e for e in steps if e.get("gate") == "tail"]
        # No gate exceeds the slowest step seen or the stated step time (1.2 ms, a floor): a step started later than
        # the predicted end less that could not have been allowed by the prediction.
        gate_max = max([1_200_000] + [e["end_ns"] - e["start_ns"] for e in steps])
        for e in steps:
            if e.get("gate") != "tail":  # the program-directed limit held for every other step
                assert e["start_ns"] + 1_200_000 <= e["signal_ns"] + 8 * MS + 1
        if risk == 0.0:
            assert not tails and rt.tail_steps == 0
        else:
            assert tails, "no step filled the bubbles' tails"
            assert {e["bubble_seq"] for e in tails} <= set(range(9, 13))  # only once 8 lengths were known
            assert rt.tail_steps == len(tails)
            for e in tails:
                assert e["start_ns"] + gate_max > e["signal_ns"] + 8 * MS  # past what the prediction allows
                assert e["start_ns"] < ends[e["bubble_seq"]] + MS  # ... and inside its bubble
        ch.send("stop")


def test_a_guard_that_cut_the_share_turns_the_tail_off(tmp_path: Path) -> None:
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=1.0), step_s=0.0012) as (ch, rt):
        init_and_arm(ch, path, share=0.9)
        _bubbles(path, 12, 0.020, 0.008)
        _settle(ch)
        assert [e for e in ch.events if e.type == "step"], "no step ran at all"
        assert not [e for e in ch.events if e.type == "step" and e.get("gate") == "tail"]
        assert rt.tail.risk(0, 5 * MS, [MS]) == 0.0  # it did learn the lengths: only the share held it back
        ch.send("stop")


def test_the_trainings_limit_caps_the_processs_own_tail_risk_and_turns_the_tail_off_at_0(tmp_path: Path) -> None:
    """The agent's ``limits`` command (a PipelineTraining's spec.tailRisk): the lower of it and the process's own
    risk applies, so a training can turn the tail off for a fill job whose image asks for it, never on."""
    path = tmp_path / "fill-busy.sock"
    with serving(path, BusyJob(step_ms=1.0), step_s=0.0012) as (ch, rt):
        rt.own_tail_risk = 0.1
        rt.tail = TailRisk(0.1)
        ch.send("limits", tail_risk=0.3)
        ch.send("limits", tail_risk=0.7)  # refused: the last good limit stays
        assert "limits.tail_risk must be the accepted chance" in ch.wait("error")["message"]
        assert (rt.tail_risk_limit, rt.tail.max_risk) == (0.3, 0.1)  # a higher limit does not raise the own risk
        ch.send("limits", tail_risk=0.0)
        init_and_arm(ch, path)
        _bubbles(path, 12, 0.020, 0.008)
        _settle(ch)
        assert rt.tail.max_risk == 0.0
        assert [e for e in ch.events if e.type == "step"], "no step ran at all"
        assert not [e for e in ch.events if e.type == "step" and e.get("gate") == "tail"]
        assert rt.tail.risk(0, 5 * MS, [MS]) == 0.0  # it learned the lengths: only the limit held it back
        ch.send("stop")


# -- the gates replayed on recorded bubbles (benchmarks/gate_replay.py) --------------------------------------------
def _recorded(lengths_ms: list[float], step_ms: float = 2.0, iteration_ms: float = 100.0):  # type: ignore[no-untyped-def]
    import gate_replay  # benchmarks/ (on the path through conftest)

    return gate_replay.Recorded("synthetic", tuple((0, int(n * MS)) for n in lengths_ms),
                                tuple(int(step_ms * MS) for _ in range(50)), int(iteration_ms * MS))


def test_the_replay_fills_what_the_gates_allow_and_the_tail_adds_to_it() -> None:
    import gate_replay

    # Steady 10 ms bubbles, 2 ms steps: 0.7 ms latency, then steps 2 ms + 0.17 ms apart while they fit the
    # prediction (10 ms): 4 steps, 8 ms of 10; nothing past the prediction, no overrun.
    steady = gate_replay.replay(_recorded([10.0] * 40), step_ms=2.0, risk=0.0, seed=1)
    assert steady.filled == pytest.approx(0.8) and steady.overruns == 0 and steady.tail == 0.0
    # Bubbles of 8 to 24 ms: predicted at their 10th percentile, the rest past it. The tail fills part of it.
    spread = [8.0 + (k * 7) % 17 for k in range(200)]
    off = gate_replay.replay(_recorded(spread), step_ms=2.0, risk=0.0, seed=1)
    on = gate_replay.replay(_recorded(spread), step_ms=2.0, risk=0.2, seed=1)
    assert off.tail == 0.0 and on.tail > 0.05
    assert on.filled > off.filled + 0.05
    assert on == gate_replay.replay(_recorded(spread), step_ms=2.0, risk=0.2, seed=1)  # seeded: repeatable


def test_the_recorded_h100_bubbles_load_and_a_bad_file_says_how_to_make_one(tmp_path: Path) -> None:
    import gate_replay

    runs = gate_replay.load(gate_replay.DATA)
    assert {r.name for r in runs} == {"image-classification-mps", "image-classification-contexts",
                                      "batch-inference-mps", "batch-inference-contexts"}
    assert all(len(r.bubbles) == 480 and r.iteration_ns > 0 for r in runs)
    bad = tmp_path / "bad.json"
    for text in ("not json", '{"runs": {"x": {"bubbles": [], "durations_ns": [1]}}}',
                 '{"runs": {"x": {"bubbles": [[0, -5]], "durations_ns": [1]}}}'):
        bad.write_text(text)
        with pytest.raises(SystemExit, match=r"gate_replay: .*bad\.json"):
            gate_replay.load(bad)
    with pytest.raises(SystemExit, match="--extract"):
        gate_replay.load(tmp_path / "missing.json")


@pytest.mark.parametrize("argv", [["--step-ms", "fast"], ["--step-ms", "0"], ["--risks", "0.7"],
                                  ["--risks", "nan"], ["--seeds", "0"], ["--extract", "somewhere"],
                                  ["--end-lag-ms", "-1"]])
def test_the_replay_refuses_bad_flags(argv: list[str]) -> None:
    import gate_replay

    with pytest.raises(SystemExit, match="gate_replay: "):
        gate_replay.main(argv)


def test_a_fixture_extracted_from_run_directories_replays(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    import gate_replay

    run = tmp_path / "job-mps"
    run.mkdir()
    bubbles = [{"stage": 0, "slot": k % 2, "mode": "harvest", "start_ns": k * 20 * MS,
                "end_ns": k * 20 * MS + (12 if k % 2 else 6) * MS} for k in range(40)]
    bubbles.append({"stage": 0, "slot": 0, "mode": "naive", "start_ns": 0, "end_ns": 5 * MS})  # not harvest: left out
    steps = [{"mode": "harvest", "start_ns": 0, "end_ns": 2 * MS}] * 10
    (run / "agent-stats.json").write_text(json.dumps({"bubbles": bubbles, "steps": steps}))
    (run / "train.json").write_text(json.dumps({"iteration_s": [0.1, 0.05, 0.06], "phase": ["off", "harvest",
                                                                                              "harvest"]}))
    fixture = tmp_path / "fixture.json"
    assert gate_replay.main(["--extract", str(run), "--out", str(fixture)]) == 0
    (loaded,) = gate_replay.load(fixture)
    assert loaded.name == "job-mps" and len(loaded.bubbles) == 40 and loaded.iteration_ns == 55 * MS
    out = tmp_path / "results.json"
    assert gate_replay.main(["--data", str(fixture), "--step-ms", "2", "--risks", "0,0.1", "--seeds", "2",
                             "--out", str(out)]) == 0
    assert "| job-mps | 2 ms | 0.1 |" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["results"]) == 2


# -- the runtime's gap between steps (benchmarks/step_gap.py) --------------------------------------------------------
def test_the_step_gap_benchmark_measures_gaps_between_steps_of_real_fill_processes(tmp_path: Path) -> None:
    import json

    import step_gap  # benchmarks/

    out = tmp_path / "gap.json"
    assert step_gap.main(["--rounds", "1", "--bubbles", "5", "--bubble-ms", "10", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["median_us"] > 0 and result["p90_us"] >= result["median_us"]
    assert 150 < result["step_median_us"] < 2000  # 200 us spins, as the records time them


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--step-us", "0"], ["--args", "[1]"], ["--device", "gpu"],
                                  ["--bubble-ms", "0.1", "--step-us", "200"]])
def test_the_step_gap_benchmark_refuses_bad_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    import step_gap

    with pytest.raises(SystemExit) as exc:
        step_gap.main(argv)
    assert exc.value.code == 2 and "step_gap.py: error:" in capsys.readouterr().err


def test_on_the_h100s_recorded_bubbles_the_tail_adds_fill_and_keeps_its_overruns_near_its_bound() -> None:
    """The policy on real data: at risk 0.1 with 2 ms steps the tail fills more than the prediction alone, few of the
    bubbles whose tails got steps end during one, and the overrun per iteration grows little. A TailRisk that allowed
    everything, or nothing, fails this."""
    import gate_replay

    run = next(r for r in gate_replay.load(gate_replay.DATA) if r.name == "image-classification-mps")
    off = gate_replay.replay(run, step_ms=2.0, risk=0.0, seed=0)
    on = gate_replay.replay(run, step_ms=2.0, risk=0.1, seed=0)
    assert off.tail_bubbles == 0 and on.tail_bubbles > 100
    assert on.filled > off.filled + 0.01
    assert on.tail_overran / on.tail_bubbles < 0.2
    assert on.overrun_ms_per_iteration < off.overrun_ms_per_iteration + 0.3


@pytest.mark.parametrize("risks", ["0,lots", "0.7", "0,nan"])
def test_demo_runs_refuses_a_bad_tail_risk_before_any_run(risks: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import demo_runs  # benchmarks/

    with pytest.raises(SystemExit) as exc:
        demo_runs.main(["--runs", "2", "--tail-risks", risks, "--out", str(tmp_path / "runs")])
    assert exc.value.code == 2 and "--tail-risks: $BUBBLES_TAIL_RISK=" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.parametrize("clippings", ["1.0,lots", "-1", "1,nan"])
def test_demo_runs_refuses_a_bad_gradient_clipping_before_any_run(clippings: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import demo_runs  # benchmarks/

    with pytest.raises(SystemExit) as exc:
        demo_runs.main(["--runs", "2", "--gradient-clippings", clippings, "--out", str(tmp_path / "runs")])
    assert exc.value.code == 2 and "is not a max gradient norm >= 0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
