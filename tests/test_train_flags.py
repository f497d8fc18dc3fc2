"""The training worker's flags: refused with a message before anything is launched."""

from __future__ import annotations

import pytest
from bubbles.demo.train import main
from bubbles.orchestrate.phases import parse_phases


def test_phases_parse() -> None:
    assert parse_phases("off:10, Harvest:3,naive:0") == [("off", 10), ("harvest", 3), ("naive", 0)]


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
])
def test_bad_flags_exit_2_with_the_reason(tmp_path, flags: list[str], reason: str,  # type: ignore[no-untyped-def]
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), *flags])
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err
