"""The one-GPU harvesting benchmark (gpubench): the training process (``gpubench.train``): its flags, the waits
paired by round and iteration, and the ballast that brings a stage to a real stage's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.gpubench import one_thread

from gpubench.emulator import StageEmulator

__all__ = ["one_thread"]  # the autouse fixture, from helpers.gpubench


def test_training_process_rejects_a_stage_outside_the_pipeline(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from gpubench.train import main as train_main

    with pytest.raises(SystemExit) as exc:
        train_main(["--stage", "7", "--stages", "4", "--hidden", "32", "--heads", "4", "--seq", "8",
                    "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "stage 7 is not one of the pipeline's 4 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        train_main(["--phases", "off:x", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2


@pytest.mark.parametrize("paired", [True, False])
def test_the_training_pairs_each_rounds_waits_by_iteration_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  paired: bool) -> None:
    from gpubench.train import main as train_main

    keys: list[tuple[int, ...]] = []
    real = StageEmulator.pair_waits
    monkeypatch.setattr(StageEmulator, "pair_waits", lambda self, *key: (keys.append(key), real(self, *key))[1])
    out = tmp_path / "train.json"
    assert train_main(["--device", "cpu", "--stages", "2", "--microbatches", "2", "--hidden", "32", "--heads", "4",
                       "--seq", "8", "--blocks", "1", "--calibration-steps", "1", "--warmup-iterations", "0",
                       "--profile-iterations", "1", "--phases", "off:2,harvest:2,off:2,harvest:2",
                       "--paired-waits" if paired else "--no-paired-waits", "--out", str(out)]) == 0
    if paired:  # round 0's baseline and harvest iterations, then round 1's, keyed alike
        assert keys == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (1, 0), (1, 1)]
    else:
        assert keys == []
    assert json.loads(out.read_text())["model"]["paired_waits"] is paired


@pytest.mark.parametrize("flags,reason", [
    (["--device", "gpu"], "give cpu, cuda or cuda:N"),
    (["--free-bytes", "-1"], "--free-bytes must be >= 0"),
    (["--profile-iterations", "0"], "--profile-iterations >= 1"),
    (["--warmup-iterations", "-2"], "--warmup-iterations and --free-bytes must be >= 0"),
    (["--start-timeout-s", "0"], "--start-timeout-s > 0"),
    (["--calibration-steps", "0"], "--calibration-steps >= 1"),
    (["--p2p-latency-ms", "-0.5"], "--p2p-latency-ms and --min-bubble-ms must be >= 0"),
    (["--wait-jitter", "3"], "--wait-jitter 3.0 must be a coefficient of variation from 0 to 2"),
    (["--link-gb-per-s", "-1"], "a bandwidth >= 0"),
    (["--stage-memory-gb", "-2"], "--stage-memory-gb -2.0: give the GiB the stage holds"),
])
def test_training_process_refuses_bad_flags_before_any_work(tmp_path: Path, flags: list[str], reason: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from gpubench.train import main as train_main

    with pytest.raises(SystemExit) as exc:
        train_main([*flags, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_ballast_brings_the_stage_to_a_real_stage_s_memory_and_leaves_room_for_a_fill_job() -> None:
    from gpubench.train import ballast_bytes

    gib = 1 << 30
    assert ballast_bytes(60 * gib, 5 * gib, 80 * gib) == 55 * gib  # the model holds 5: 55 more
    assert ballast_bytes(4 * gib, 5 * gib, 80 * gib) == 0  # already holds more than the target
    with pytest.raises(ValueError, match="leave at least 2 GiB"):
        ballast_bytes(79 * gib, 0, 80 * gib)
