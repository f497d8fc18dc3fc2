"""Every rank of a stage signals its own bubbles (issue 35), on real DeepSpeed pipelines on CPU (gloo, torchrun):
2 stages x 2 model-parallel ranks, and 2 stages x 2 data-parallel replicas, 4 processes each
(``tests/fixtures/trainings/ranks_pipeline.py``).

Each of the 4 ranks must write its own card in its own directory (``<run_dir>/<namespace>/<training>/stage-<k>/
rank-<r>/``) with the rank DeepSpeed's grid gives it, profile a cycle with bubbles, and send its bubbles to the
datagram socket bound as ``agent.sock`` there, and to no other; and its losses must be bit-identical with and without
the hook. One launch per layout (module-scoped, shared by the tests) runs each rank without the hook, then, rebuilt
from the same seed, with it: two launches in all, each 4 processes on the machine's cores.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.hook import bind, drain, gpu_dir

from bubbles.core import paths, wire
from bubbles.core.cycle import BubbleCycle
from bubbles.demo.orchestrate.processes import free_port

pytestmark = pytest.mark.deepspeed

TRAININGS = Path(__file__).resolve().parent / "fixtures" / "trainings"
LAUNCH_TIMEOUT_S = 120
STAGES, RANKS = 2, 2  # 2 ranks per stage: 4 processes
LAYOUTS = {"model-parallel": ("--mp", "2", "--dp", "1"), "data-parallel": ("--mp", "1", "--dp", "2")}
WARMUP, PROFILE, STEPS = 1, 2, 5  # two iterations signalled after the profile
FREE_BYTES = 3 << 20
TRAINING = "ranks"


@pytest.fixture(scope="module")
def short_run_dir() -> Iterator[Path]:
    # AF_UNIX socket paths are limited to 107 bytes; pytest's tmp paths can be longer.
    d = Path(tempfile.mkdtemp(prefix="bbrk-", dir="/tmp"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False, timeout=60)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def launch(request: pytest.FixtureRequest, short_run_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of the layout: each global rank's record (by global rank) and what the socket bound as
    ``agent.sock`` in each GPU directory received (by ``(stage, rank)``)."""
    layout = str(request.param)
    run_dir = short_run_dir / layout[:2]
    out = tmp_path_factory.mktemp(layout)
    sockets = {(k, r): bind(gpu_dir(run_dir, TRAINING, k, r) / paths.AGENT_SOCKET_NAME)
               for k in range(STAGES) for r in range(RANKS)}
    received: dict[tuple[int, int], list[wire.Message]] = {place: [] for place in sockets}
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(STAGES * RANKS),
               "--master_port", str(free_port()), str(TRAININGS / "ranks_pipeline.py"), "--out", str(out),
               "--stages", str(STAGES), *LAYOUTS[layout], "--steps", str(STEPS), "--warmup-iterations", str(WARMUP),
               "--profile-iterations", str(PROFILE), "--run-dir", str(run_dir), "--training", TRAINING,
               "--free-bytes", str(FREE_BYTES)]
        # Read as the training runs, as an agent does: a socket queues only net.unix.max_dgram_qlen datagrams
        # (10 by default), and a rank signals more than that per iteration. Its log goes to a file, read at the end.
        log_path = out / "launch.log"
        with log_path.open("w") as log, selectors.DefaultSelector() as sel:
            proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                                    stdout=log, stderr=subprocess.STDOUT)
            try:
                for place, s in sockets.items():
                    sel.register(s, selectors.EVENT_READ, place)
                deadline = time.monotonic() + LAUNCH_TIMEOUT_S
                while proc.poll() is None:
                    assert time.monotonic() < deadline, f"the {layout} launch did not end in {LAUNCH_TIMEOUT_S} s"
                    for key, _ in sel.select(0.05):
                        received[key.data] += drain(key.fileobj)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        for place, s in sockets.items():
            received[place] += drain(s)
        text = log_path.read_text()
        assert proc.returncode == 0, text[-6000:]
    finally:
        for s in sockets.values():
            s.close()
    records = {g: json.loads((out / f"rank-{g}.json").read_text()) for g in range(STAGES * RANKS)}
    return {"layout": layout, "run_dir": run_dir, "records": records, "received": received, "log": text}


def where(global_rank: int) -> tuple[int, int]:
    """(stage, rank within the stage) of a global rank: DeepSpeed's grid orders its axes pipe, data, model, so a
    stage's ranks are consecutive, whether model-parallel or data-parallel."""
    return divmod(global_rank, RANKS)


def test_every_rank_writes_its_own_card_in_its_own_directory(launch: dict[str, Any]) -> None:
    namespace = paths.default_namespace()
    cards = []
    for g, rec in launch["records"].items():
        stage, rank = where(g)
        key = paths.GpuKey(namespace, TRAINING, stage, rank)
        assert (rec["stage"], rec["stage_rank"], rec["stage_ranks"]) == (stage, rank, RANKS), (launch["layout"], g)
        assert rec["gpu"] == str(key)
        assert rec["card_path"] == str(paths.hook_card(launch["run_dir"], key))
        card = rec["card"]
        assert {k: card[k] for k in ("training", "stage", "stages", "namespace", "rank", "ranks", "device", "lock",
                                     "version")} == \
            {"training": TRAINING, "stage": stage, "stages": STAGES, "namespace": namespace, "rank": rank,
             "ranks": RANKS, "device": "cpu", "lock": True, "version": 4}
        cards.append(card)
        # The line the hook writes for each rank names it.
        assert (f"training {TRAINING} stage {stage} rank {rank} of {RANKS} ({STAGES} stages) signals in "
                f"{paths.gpu_dir(launch['run_dir'], key)}") in launch["log"]
    assert len({c["pid"] for c in cards}) == STAGES * RANKS  # four processes, four cards
    assert not list(launch["run_dir"].rglob(paths.HOOK_CARD_NAME))  # each removed its own when it detached


def test_every_rank_profiles_a_cycle_with_bubbles(launch: dict[str, Any]) -> None:
    for g, rec in launch["records"].items():
        stage, rank = where(g)
        cycle = BubbleCycle.from_dict(rec["cycle"])
        assert (cycle.stage, cycle.stages, cycle.schedule) == (stage, STAGES, "TrainSchedule")
        assert len(cycle.slots) >= 1 and cycle.bubble_ratio > 0, (launch["layout"], g, cycle)
        assert all(s.free_bytes == FREE_BYTES for s in cycle.slots)  # $BUBBLES_FREE_BYTES's stand-in, every rank
        assert not rec["stats"]["disabled"] and rec["stats"]["collectives"] == "timed"
        assert f"stage {stage} rank {rank} of {RANKS}: TrainSchedule profiled: {len(cycle.slots)} bubbles" in \
            launch["log"]


def test_every_rank_signals_its_bubbles_to_its_own_socket_and_no_other(launch: dict[str, Any]) -> None:
    for g, rec in launch["records"].items():
        stage, rank = where(g)
        msgs = launch["received"][(stage, rank)]
        profiles = [m for m in msgs if isinstance(m, wire.Profile)]
        starts = [m for m in msgs if isinstance(m, wire.BubbleStart)]
        ends = [m for m in msgs if isinstance(m, wire.BubbleEnd)]
        # One process signalled here: one profile, its own (two ranks sharing a socket would send two).
        assert len(profiles) == 1 and BubbleCycle.from_dict(profiles[0].cycle) == \
            BubbleCycle.from_dict(rec["cycle"]), (launch["layout"], g)
        assert {m.stage for m in msgs} == {stage}
        stats = rec["stats"]
        assert stats["listeners"] == 1 and stats["bubbles_signalled"] > 0, (launch["layout"], g, stats)
        # Every datagram the rank's hook got into a socket, this socket has, and nothing else. (One that found the
        # socket's queue full is dropped, counted apart: the reader here shares 2 cores with 4 ranks.)
        assert len(msgs) == stats["signals_sent"], (launch["layout"], g, stats, len(msgs))
        assert starts and ends, (launch["layout"], g, stats)
        seqs = [m.seq for m in starts]
        assert len(set(seqs)) == len(seqs) and max(seqs) <= stats["bubbles_signalled"]


def test_losses_are_bit_identical_with_and_without_the_hook_on_every_rank(launch: dict[str, Any]) -> None:
    records = launch["records"]
    for g, rec in records.items():
        assert len(rec["losses_with"]) == STEPS
        assert rec["losses_with"] == rec["losses_without"], (launch["layout"], g)
    # The pipeline's loss reaches every rank (broadcast from the last stage, averaged over the data-parallel
    # replicas, which see the same data here; the model-parallel ranks compute the same replicated layers).
    assert len({tuple(rec["losses_with"]) for rec in records.values()}) == 1
