"""The training worker's flags: refused with a message before anything is launched."""

from __future__ import annotations

import pytest

from bubbles.core.api import FillMode
from bubbles.demo.orchestrate.phases import format_phases, iteration_times_by_mode, parse_phases
from bubbles.demo.train import main


def test_phases_parse() -> None:
    assert parse_phases("off:10, Harvest:3,naive:0") == [(FillMode.OFF, 10), (FillMode.HARVEST, 3),
                                                         (FillMode.NAIVE, 0)]
    assert format_phases(5, 2) == "off:5,naive:5,harvest:5,off:5,naive:5,harvest:5"
    assert parse_phases(format_phases(5, 1)) == [(FillMode.OFF, 5), (FillMode.NAIVE, 5), (FillMode.HARVEST, 5)]


def test_iteration_times_are_grouped_by_fill_mode_and_an_unknown_phase_is_named() -> None:
    rank = {"phase": ["profile", "off", "off", "harvest", "harvest"], "iteration_s": [9.0, 1.0, 2.0, 3.0, 4.0]}
    assert iteration_times_by_mode(rank, settle=1) == {FillMode.OFF: [2.0], FillMode.HARVEST: [4.0]}
    with pytest.raises(ValueError, match=r"phase of iteration 1 \(other than 'profile'\) must be one of "
                                         r"off, naive, harvest, got 'lunch'"):
        iteration_times_by_mode({"phase": ["profile", "lunch"], "iteration_s": [1.0, 1.0]}, settle=0)


@pytest.mark.parametrize("text,reason", [
    ("lunch:3", "mode one of off, naive, harvest"),
    ("off", "write mode:iterations"),
    ("off:ten", "iterations must be an integer"),
    ("off:-1", "iterations must be >= 0"),
])
def test_bad_phases_are_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_phases(text)


@pytest.mark.parametrize("flags,reason", [
    (["--phases", "off:x"], "iterations must be an integer"),
    (["--microbatches", "0"], "--microbatches must be >= 1"),
    (["--min-bubble-ms", "-1"], "must be >= 0"),
    (["--start-timeout-s", "0"], "--start-timeout-s 0.0"),
    (["--timing", "gpu"], "invalid choice: 'gpu'"),
    (["--gradient-clipping", "-0.5"], "--gradient-clipping must be >= 0"),
])
def test_bad_flags_exit_2_with_the_reason(tmp_path, flags: list[str], reason: str,  # type: ignore[no-untyped-def]
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), *flags])
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err
