"""The training worker's flags: refused with a message before anything is launched."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbles.core.api import FillMode
from bubbles.demo.orchestrate.phases import format_phases, iteration_times_by_mode, parse_phases
from bubbles.demo.train import main, pipe_topology, stages_of


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
    (["--tp", "0"], "--tp 0: give the model-parallel ranks per stage, 1 or more"),
    (["--tp", "-2"], "--tp -2: give the model-parallel ranks per stage, 1 or more"),
    (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
])
def test_bad_flags_exit_2_with_the_reason(tmp_path, flags: list[str], reason: str,  # type: ignore[no-untyped-def]
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), *flags])
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err


def test_a_launch_is_stages_of_tp_ranks_each() -> None:
    assert stages_of(4, 1) == 4 and stages_of(4, 2) == 2 and stages_of(6, 3) == 2 and stages_of(2, 2) == 1
    with pytest.raises(ValueError, match=r"--tp 3 does not divide the 4 processes launched: launch stages x tp "
                                         r"processes \(torchrun --nproc_per_node\), e\.g\. 6 for 2 stages of 3 ranks"):
        stages_of(4, 3)
    with pytest.raises(ValueError, match="--tp 0: give the model-parallel ranks per stage"):
        stages_of(4, 0)


def test_tp_ranks_are_deepspeeds_model_axis_and_one_rank_per_stage_keeps_its_topology() -> None:
    assert pipe_topology(4, 1) is None  # PipelineModule(num_stages=...) builds the one it always has
    topo = pipe_topology(2, 2)
    assert [topo.get_dim(a) for a in ("pipe", "data", "model")] == [2, 1, 2]
    # torchrun's global ranks 0, 1 are stage 0's model-parallel ranks 0, 1; ranks 2, 3 stage 1's
    assert [(c.pipe, c.model) for c in (topo.get_coord(r) for r in range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_tp_that_does_not_divide_the_launch_is_refused_by_every_rank(tmp_path: Path) -> None:
    """Checked once the world is known (after init_distributed): one process launched with --tp 2."""
    import os
    import subprocess
    import sys

    from bubbles.demo.orchestrate.processes import free_port

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "bubbles.demo.train", "--out", str(tmp_path), "--tp", "2"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "--tp 2 does not divide the 1 processes launched: launch stages x tp processes" in out.stderr
