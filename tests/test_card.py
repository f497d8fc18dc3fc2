"""The hook card and its lock (``bubbles.core.card``): one module both sides use, the hook writing, the agent reading;
then the card as ``instrument`` leaves it (a FIFO or link planted in the stage directory, a forked child). The agent's
own handling of cards (reported, not fatal; a stale card removed) is in test_agent_cluster.py."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers.hook import StandInEngine

from bubbles.core import card as card_module
from bubbles.core import paths
from bubbles.core.card import (
    MAX_CARD_BYTES,
    Card,
    card_is_stale,
    hold_lock,
    read_card,
    read_cards,
    release_lock,
    write_card,
)
from bubbles.core.identity import LOCAL_NAMESPACE as LOCAL
from bubbles.core.identity import GpuKey
from bubbles.training.hook import instrument


def a_card(**changes: object) -> Card:
    fields: dict[str, object] = {"training": "llama", "stage": 1, "stages": 4, "namespace": "ml", "pod": "llama-3",
                                 "device": "cuda:0", "gpu_uuid": "GPU-aaaa", "pid": 4242, "started_ns": 17,
                                 "lock": True}
    fields.update(changes)
    return Card(**fields)  # type: ignore[arg-type]


def test_a_card_round_trips_and_says_which_process_wrote_it() -> None:
    card = a_card()
    assert Card.parse(json.loads(json.dumps(card.to_dict())), "x") == card
    assert card.instance == "4242@17"
    assert list(card.to_dict()) == ["training", "stage", "stages", "namespace", "pod", "device", "gpu_uuid", "pid",
                                    "started_ns", "lock", "fills", "version", "rank", "ranks"]
    assert card.to_dict()["version"] == card_module.VERSION
    assert card.to_dict()["fills"] is True  # for readers that predate the version field
    # A restarted process under the same Pod name is another card; the pid and start time are compared as one.
    assert a_card(started_ns=18) != card
    assert a_card(pid="4242") == card


def test_a_card_the_writer_wrote_is_what_the_reader_reads(tmp_path: Path) -> None:
    card = a_card()
    path = paths.hook_card(tmp_path, card.key)
    paths.make_private_dir(path.parent)
    write_card(path, card)
    assert read_card(path) == card
    assert not [p for p in path.parent.iterdir() if p.name != paths.HOOK_CARD_NAME]  # no temporary file left
    write_card(path, a_card(pid=99))  # replaced in one rename
    assert read_card(path).instance == "99@17"
    assert read_cards(tmp_path) == ([a_card(pid=99)], [])
    # An old hook's card (no pid, no lock, no fills) is read as one.
    path.write_text(json.dumps({"training": "llama", "stage": 1, "stages": 4, "pod": "p"}))
    old = read_card(path)
    assert (old.namespace, old.device, old.gpu_uuid, old.instance, old.lock, old.fills) == ("", "cpu", None, "@",
                                                                                            False, False)


@pytest.mark.parametrize(("doc", "message"), [
    ([], "x: a card must be a JSON object"),
    ({"stage": 0, "stages": 1, "pod": "p"}, "x: the card has no 'training'"),
    ({"training": "t", "stages": 1, "pod": "p"}, "x: the card has no 'stage'"),
    ({"training": "Bad_Name", "stage": 0, "stages": 1, "pod": "p"}, "x: training name 'Bad_Name' is not valid"),
    ({"training": "t", "stage": 3, "stages": 2, "pod": "p"}, "x: stage 3 of 2 stages is not a stage index"),
    ({"training": "t", "stage": 0, "stages": 4097, "pod": "p"}, "x: stage 0 of 4097 stages is not a stage index"),
    ({"training": "t", "stage": 0, "stages": 1, "pod": ""},
     "x: pod (non-empty), namespace and device must be strings"),
    ({"training": "t", "stage": 0, "stages": 1, "pod": "p", "device": 0},
     "x: pod (non-empty), namespace and device must be strings"),
    ({"training": "t", "stage": 0, "stages": 1, "pod": "p", "gpu_uuid": 7}, "x: gpu_uuid must be a string or null"),
])
def test_a_card_that_cannot_be_used_is_refused_saying_why(doc: object, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        Card.parse(doc, "x")
    assert str(exc.value).startswith(message), str(exc.value)


def test_the_reader_refuses_what_is_no_card_with_the_agents_words(tmp_path: Path) -> None:
    deep, big, fifo = tmp_path / "deep.json", tmp_path / "big.json", tmp_path / "fifo.json"
    deep.write_text("[" * 30_000)
    big.write_text(json.dumps({"training": "big", "stage": 0, "stages": 1, "pod": "p", "pad": "x" * MAX_CARD_BYTES}))
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"deep\.json: nested too deeply, not a card$"):
        read_card(deep)
    with pytest.raises(ValueError, match=rf"big\.json: larger than {MAX_CARD_BYTES} bytes, not a card$"):
        read_card(big)
    with pytest.raises(ValueError, match=r"fifo\.json: not a regular file$"):
        read_card(fifo)
    link = tmp_path / "link.json"
    os.symlink(big, link)
    with pytest.raises(OSError):
        read_card(link)  # never through a link


def test_a_card_whose_lock_is_held_is_live_and_one_whose_lock_is_free_is_stale_and_removed(tmp_path: Path) -> None:
    card = a_card()
    path = paths.hook_card(tmp_path, card.key)
    paths.make_private_dir(path.parent)
    fd = hold_lock(paths.hook_lock(tmp_path, card.key))
    assert fd is not None
    write_card(path, card)
    assert hold_lock(paths.hook_lock(tmp_path, card.key), wait_s=0.01) is None  # a live twin
    assert not card_is_stale(tmp_path, card) and path.exists()
    release_lock(fd)
    assert not card_is_stale(tmp_path, a_card(pid=1))  # a new process's card stays
    assert card_is_stale(tmp_path, card) and not path.exists()


# -- the hook writes it: instrument() on a stand-in engine ----------------------------------------------------


def test_the_hook_leaves_a_card_for_the_node_agent_and_fails_open_without_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("POD_NAME", "llama-3")
    monkeypatch.setenv("POD_NAMESPACE", "ml")
    eng = StandInEngine(stage=1, stages=4, micro_batches=2, wait_s=0.001)
    inst = instrument(eng, training="t7", run_dir=tmp_path, warmup_iterations=0, profile_iterations=1)
    key = GpuKey("ml", "t7", 1, 0)
    card_path = paths.hook_card(tmp_path, key)
    card = json.loads(card_path.read_text())
    assert {k: card[k] for k in ("training", "stage", "stages", "namespace", "pod", "device", "gpu_uuid")} == \
        {"training": "t7", "stage": 1, "stages": 4, "namespace": "ml", "pod": "llama-3", "device": "cpu",
         "gpu_uuid": None}
    assert (card["rank"], card["ranks"], card["version"]) == (0, 1, card_module.VERSION)  # no grid: one rank
    assert card["pid"] == os.getpid() and card["started_ns"] > 0
    assert card["fills"] is True and paths.fills_dir(tmp_path, key).is_dir()  # it signals fill sockets there
    # The hook holds the stage's lock while it lives: a node agent takes its card for live.
    from bubbles.core.card import Card, card_is_stale

    assert card["lock"] is True and not card_is_stale(tmp_path, Card.parse(card, "card"))
    # A second hook of the same stage (a twin) waits at most 0.5 s for the lock, then stands down: the first's card
    # stays.
    twin = instrument(StandInEngine(stage=1, stages=4, micro_batches=2, wait_s=0.001), training="t7",
                      run_dir=tmp_path, warmup_iterations=0, profile_iterations=1)
    assert json.loads(card_path.read_text()) == card and twin.stats["disabled"]
    twin.detach()
    inst.detach()
    assert not card_path.exists()  # a training that is gone leaves no card behind
    fd = os.open(paths.hook_lock(tmp_path, key), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with it
    os.close(fd)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    eng2 = StandInEngine(stage=0, stages=2, micro_batches=2, wait_s=0.001)
    with caplog.at_level("WARNING", logger="bubbles.hook"):
        inst2 = instrument(eng2, training="t8", run_dir=blocker, warmup_iterations=0, profile_iterations=1)
        assert eng2.train_batch() == 1.5  # the training goes on
    assert "could not write its card" in caplog.text
    inst2.detach()


def test_what_a_fill_job_plants_in_the_stage_directory_neither_holds_the_training_nor_gets_written(
        tmp_path: Path) -> None:
    """Fill jobs can write in the stage directory. A FIFO under the card's temporary name (.hook.json.<pid>: pids
    in a container are small and easy to guess) held the training in instrument(), an open for writing that waits
    for a reader; a link there or under the card's name had the training write where it pointed; and a FIFO under
    the lock's name was taken for the lock."""
    victim = tmp_path / "checkpoint.pt"
    victim.write_bytes(b"weights")
    for training, plant in (("t10", "fifo"), ("t11", "link")):
        key = GpuKey(LOCAL, training, 0)
        stage = paths.gpu_dir(tmp_path, key)
        paths.make_private_dir(stage)
        os.mkfifo(paths.hook_lock(tmp_path, key))
        os.symlink(victim, paths.hook_card(tmp_path, key))
        tmp = stage / f".{paths.HOOK_CARD_NAME}.{os.getpid()}"
        os.mkfifo(tmp) if plant == "fifo" else os.symlink(victim, tmp)
        eng = StandInEngine(stage=0, stages=2, micro_batches=2, wait_s=0.001)
        done: list[Any] = []
        t = threading.Thread(target=lambda e=eng, n=training, d=done: d.append(
            instrument(e, training=n, run_dir=tmp_path, warmup_iterations=0, profile_iterations=1)), daemon=True)
        t.start()
        t.join(5)
        assert done, f"{plant}: instrument() did not return, the training would be held"
        assert eng.train_batch() == 1.5  # the training goes on
        assert victim.read_bytes() == b"weights", plant
        card = paths.hook_card(tmp_path, key)
        assert not card.is_symlink() and json.loads(card.read_text())["lock"] is False  # a FIFO is no lock
        done[0].detach()


def test_a_process_out_of_file_descriptors_trains_on_without_the_hook(tmp_path: Path) -> None:
    """instrument() opens sockets; in a process at its descriptor limit that raised into the training's script."""
    import subprocess
    import sys

    script = f"""
import os, resource, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers.hook import StandInEngine
from bubbles.training.hook import instrument
eng = StandInEngine(stage=0, stages=2, micro_batches=2, wait_s=0.001)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
inst = instrument(eng, training="t", run_dir={str(tmp_path)!r}, warmup_iterations=0, profile_iterations=1)
for fd in held:
    os.close(fd)
print(inst.stats["disabled"], eng.train_batch())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].split() == ["True", "1.5"], (out.stdout, out.stderr[-2000:])
    assert "could not open its sockets" in out.stderr


def test_a_child_forked_from_the_training_does_not_keep_its_lock(tmp_path: Path) -> None:
    """A DataLoader worker forked by the training shares the lock's open file; if it kept it, a dead training's card
    would be taken for live until the worker exited too. The child lets go of its copy at the fork."""
    inst = instrument(StandInEngine(stage=0, stages=2, micro_batches=2, wait_s=0.001), training="t9",
                      run_dir=tmp_path, warmup_iterations=0, profile_iterations=1)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:  # the "worker": outlives the training's hold on the lock, then leaves without cleanup
        os.write(ready_w, b"x")  # os.fork has returned here, so the fork handlers have run
        os.read(done_r, 1)  # lives until the parent has checked (EOF when the parent closes its end)
        os._exit(0)
    try:
        os.close(ready_w)
        os.close(done_r)
        assert os.read(ready_r, 1) == b"x"
        inst.detach()  # stands in for the training's process ending (its descriptor closes)
        fd = os.open(paths.hook_lock(tmp_path, GpuKey(LOCAL, "t9", 0)), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child still held it
        finally:
            os.close(fd)
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.mark.parametrize(("written", "version"), [({"fills": True, "lock": True}, 3), ({"fills": True}, 3),
                                                  ({"lock": True}, 2), ({}, 1)])
def test_a_card_written_before_the_version_field_gets_the_version_its_fields_show(
        written: dict[str, object], version: int) -> None:
    base = {"training": "t", "stage": 0, "stages": 2, "pod": "p"}
    card = Card.parse({**base, **written}, "x")
    assert card.version == version
    assert card.fills is (version >= card_module.FILLS_VERSION)


def test_a_newer_card_is_read_for_the_fields_this_side_knows() -> None:
    card = Card.parse({"training": "t", "stage": 0, "stages": 2, "pod": "p", "version": 9, "later": [1],
                       "namespace": "ml", "rank": 1, "ranks": 2}, "x")
    assert card.version == 9
    assert card.fills and (card.rank, card.ranks) == (1, 2)


@pytest.mark.parametrize("bad", [0, -1, "3", 2.5, True])
def test_a_card_version_that_is_no_version_is_refused_saying_so(bad: object) -> None:
    with pytest.raises(ValueError, match=r"x: version .* is not a card version \(an integer from 1\)"):
        Card.parse({"training": "t", "stage": 0, "stages": 2, "pod": "p", "version": bad}, "x")


# -- card v4: a card per rank, in the namespaced layout -------------------------------------------------------


def test_a_ranks_card_round_trips_and_is_found_in_its_own_directory(tmp_path: Path) -> None:
    card = a_card(rank=3, ranks=4)
    assert Card.parse(json.loads(json.dumps(card.to_dict())), "x") == card
    assert (card.to_dict()["rank"], card.to_dict()["ranks"]) == (3, 4)
    assert card.key == GpuKey("ml", "llama", 1, 3)
    assert card.directory(tmp_path) == tmp_path / "ml" / "llama" / "stage-1" / "rank-3" == paths.gpu_dir(tmp_path,
                                                                                                         card.key)
    others = [a_card(rank=r, ranks=4, pid=100 + r) for r in (0, 1, 2)]
    for c in (card, *others):
        paths.make_private_dir(c.directory(tmp_path))
        write_card(c.directory(tmp_path) / paths.HOOK_CARD_NAME, c)
    found, problems = read_cards(tmp_path)
    assert problems == [] and sorted(c.rank for c in found) == [0, 1, 2, 3]  # every rank of the stage, apart


@pytest.mark.parametrize(("fields", "message"), [
    ({"rank": 2, "ranks": 2}, "x: rank 2 of 2 ranks is not a rank of the stage"),
    ({"rank": -1, "ranks": 2}, "x: rank -1 of 2 ranks is not a rank of the stage"),
    ({"rank": True, "ranks": 2}, "x: rank True of 2 ranks is not a rank of the stage"),
    ({"rank": "0", "ranks": 1}, "x: rank '0' of 1 ranks is not a rank of the stage"),
    ({"rank": 0}, "x: rank 0 of None ranks is not a rank of the stage"),  # a v4 card must say both
    ({"rank": 0, "ranks": 4097}, "x: rank 0 of 4097 ranks is not a rank of the stage"),
    ({"rank": 0, "ranks": 1, "namespace": "Team_A"}, "x: namespace 'Team_A' is not valid"),
    ({"rank": 0, "ranks": 1, "namespace": ""}, "x: namespace '' is not valid"),  # v4 always names it
])
def test_a_ranks_card_with_a_rank_or_namespace_that_is_none_is_refused_saying_why(
        fields: dict[str, object], message: str) -> None:
    doc = {"training": "t", "stage": 0, "stages": 2, "pod": "p", "namespace": "ml", "version": 4, **fields}
    with pytest.raises(ValueError) as exc:
        Card.parse(doc, "x")
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_v3_card_in_the_old_stage_directory_is_read_as_rank_0_of_1_of_the_local_namespace(tmp_path: Path) -> None:
    """A hook before card v4 (an older training image beside a newer agent) wrote ``<training>/stage-<k>/hook.json``
    with no rank and, outside Kubernetes, no namespace."""
    legacy = paths.make_private_dir(paths.legacy_stage_dir(tmp_path, "old", 1))
    (legacy / paths.HOOK_CARD_NAME).write_text(json.dumps(
        {"training": "old", "stage": 1, "stages": 2, "namespace": "", "pod": "p", "device": "cpu", "gpu_uuid": None,
         "pid": 7, "started_ns": 1, "lock": True, "fills": True, "version": 3}))
    found, problems = read_cards(tmp_path)
    assert problems == [] and len(found) == 1
    card = found[0]
    assert (card.version, card.rank, card.ranks, card.fills) == (3, 0, 1, True)
    assert card.key == GpuKey(LOCAL, "old", 1, 0) and card.key.local
    assert card.directory(tmp_path) == legacy
    # Its lock is looked for beside it: nobody holds it, so it is stale and removed.
    (legacy / paths.HOOK_LOCK_NAME).touch()
    assert card_is_stale(tmp_path, card) and not (legacy / paths.HOOK_CARD_NAME).exists()


def test_a_card_in_a_directory_other_than_its_own_is_reported_not_used(tmp_path: Path) -> None:
    """A fill job can write in its GPU's directory: a card naming another rank (or a v4 card in the old layout) would
    have the agent place fill jobs on a GPU the card's process is not on."""
    wrong = a_card(rank=1, ranks=2)
    rank0 = paths.make_private_dir(paths.gpu_dir(tmp_path, GpuKey("ml", "llama", 1, 0)))
    write_card(rank0 / paths.HOOK_CARD_NAME, wrong)
    legacy = paths.make_private_dir(paths.legacy_stage_dir(tmp_path, "llama", 1))
    write_card(legacy / paths.HOOK_CARD_NAME, a_card())
    found, problems = read_cards(tmp_path)
    assert found == []
    assert problems == [f"{rank0 / paths.HOOK_CARD_NAME}: the card names ml/llama/stage-1/rank-1 (card v4), not its "
                        "directory",
                        f"{legacy / paths.HOOK_CARD_NAME}: the card names ml/llama/stage-1/rank-0 (card v4), not its "
                        "directory"], problems
