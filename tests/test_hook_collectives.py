"""The waits inside DeepSpeed's instructions (``bubbles.training.hook.collectives``): gradient clipping's norm
all-reduce inside OptimizerStep, timed through the communication backend object DeepSpeed routes every collective
through, on the stand-in engine. The real DeepSpeed trainings with clipping on are tests/test_usual_trainings.py's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deepspeed.comm import comm as ds_comm
from helpers.hook import StandInBackend, StandInEngine, bind, drain, gpu_dir

from bubbles.core import paths, wire
from bubbles.training.hook import instrument
from bubbles.training.hook.collectives import COLLECTIVES, OPS, Collectives, collective_name, is_collective
from bubbles.training.probes import StaticMemoryProbe

WAIT_S = 0.003


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInBackend]:
    b = StandInBackend(WAIT_S)
    monkeypatch.setattr(ds_comm, "cdb", b)
    yield b
    assert COLLECTIVES.users == 0, "an instrumentation left the backend interposed"
    assert not set(b.__dict__) & set(OPS), "the backend's methods were not restored"


def test_clippings_all_reduce_is_a_signalled_drain_bubble(tmp_path: Path, backend: StandInBackend) -> None:
    sdir = gpu_dir(tmp_path, "t", 1)
    eng = StandInEngine(stage=1, stages=2, micro_batches=2, backend=backend)
    inst = instrument(eng, training="t", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=0, profile_iterations=3, trace=True)
    try:
        assert inst.stats["collectives"] == "timed"
        for _ in range(3):
            eng.train_batch()
        cycle = inst.cycle
        assert cycle is not None
        inner = [s for s in cycle.slots if is_collective(s.instruction)]
        # the blocking norm all-reduce is a bubble; ReduceGrads' async all-reduce and the loss broadcast's inner
        # broadcast (inside a wait timed whole) are not waits of their own
        assert [(s.instruction, s.kind) for s in inner] == [("OptimizerStep.all_reduce", "drain")]
        assert inner[0].duration_s >= WAIT_S * 0.9
        names = [e[1] for e in inst.trace_events() if e[0] == 2]
        i = names.index("OptimizerStep.all_reduce")
        assert names[i + 1] == "OptimizerStep"  # recorded before its instruction, which contains it
        assert "ReduceGrads.all_reduce" not in names and "LossBroadcast" in names
        agent = bind(sdir / paths.AGENT_SOCKET_NAME)
        eng.train_batch()  # greeted
        drain(agent)
        eng.train_batch()
        msgs = drain(agent)
        starts = {m.slot: m for m in msgs if isinstance(m, wire.BubbleStart)}
        ends = {m.slot: m for m in msgs if isinstance(m, wire.BubbleEnd)}
        slot = inner[0].slot
        assert slot in starts and slot in ends and ends[slot].end_ns - starts[slot].start_ns >= WAIT_S * 0.9e9
        assert inst.stats["iterations_off_profile"] == 0
        agent.close()
    finally:
        inst.detach()
    assert ("all_reduce", True, threading.current_thread().name) in backend.calls  # the async one went through


def test_collectives_outside_the_instructions_or_on_other_threads_pass_through(tmp_path: Path,
                                                                                 backend: StandInBackend) -> None:
    eng = StandInEngine(stage=0, stages=2, micro_batches=2, backend=backend)
    seen: list[int] = []

    def other_thread_all_reduce() -> None:
        backend.all_reduce([0.0])  # a data loader's or a monitor's thread, while OptimizerStep runs

    original = eng._INSTRUCTION_MAP
    for cls, fn in list(original.items()):
        if cls.__name__ == "OptimizerStep":
            def optimizer_step(engine: StandInEngine, _fn=fn, **kwargs: object) -> None:
                t = threading.Thread(target=other_thread_all_reduce)
                t.start()
                t.join()
                seen.append(1)
                _fn(engine, **kwargs)
            original[cls] = optimizer_step
    inst = instrument(eng, training="t", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=0, profile_iterations=2, trace=True)
    try:
        backend.all_reduce([0.0])  # outside any instruction: not timed, no record
        for _ in range(2):
            eng.train_batch()
        names = [e[1] for e in inst.trace_events()]
        assert names.count("OptimizerStep.all_reduce") == 2  # one per iteration: the training's thread's only
        assert seen == [1, 1]
    finally:
        inst.detach()


def test_a_collective_made_inside_another_is_one_wait(tmp_path: Path, backend: StandInBackend) -> None:
    eng = StandInEngine(stage=0, stages=2, micro_batches=1, backend=backend)
    for cls in list(eng._INSTRUCTION_MAP):
        if cls.__name__ == "OptimizerStep":
            eng._INSTRUCTION_MAP[cls] = lambda engine, **kw: engine.backend.all_reduce_coalesced([[1.0], [2.0]])
    inst = instrument(eng, training="t", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=0, profile_iterations=1, trace=True)
    try:
        eng.train_batch()
        names = [e[1] for e in inst.trace_events()]
        assert names.count(collective_name("OptimizerStep", "all_reduce_coalesced")) == 1
        assert collective_name("OptimizerStep", "all_reduce") not in names
        cycle = inst.cycle
        assert cycle is not None
        assert next(c for c in cycle.slots if c.instruction.startswith("OptimizerStep")).duration_s >= 2 * WAIT_S * 0.9
    finally:
        inst.detach()


def test_an_iteration_with_a_collective_fewer_is_not_followed_and_training_goes_on(
        tmp_path: Path, backend: StandInBackend) -> None:
    # An fp16 overflow skips the step's norm all-reduce: the iteration's waits are not where the profile has them.
    eng = StandInEngine(stage=0, stages=2, micro_batches=2, backend=backend)
    inst = instrument(eng, training="t", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1),
                      warmup_iterations=0, profile_iterations=2)
    try:
        for _ in range(2):
            eng.train_batch()
        assert inst.cycle is not None
        eng.norm_all_reduces = 0
        assert eng.train_batch() == 1.5
        eng.norm_all_reduces = 1
        assert eng.train_batch() == 1.5
        assert inst.stats["iterations_off_profile"] == 1 and not inst.stats["disabled"]
    finally:
        inst.detach()


def test_two_engines_share_the_interposer_and_the_last_detach_restores_it(tmp_path: Path,
                                                                          backend: StandInBackend) -> None:
    a = instrument(StandInEngine(0, 2, 1, backend=backend), training="a", run_dir=tmp_path,
                   memory_probe=StaticMemoryProbe(1))
    b = instrument(StandInEngine(1, 2, 1, backend=backend), training="b", run_dir=tmp_path,
                   memory_probe=StaticMemoryProbe(1))
    assert COLLECTIVES.users == 2 and set(OPS) & set(backend.__dict__) == {"all_reduce", "all_reduce_coalesced",
                                                                          "broadcast", "barrier"}
    a.detach()
    a.detach()  # twice is fine, and counts once
    assert COLLECTIVES.users == 1 and "all_reduce" in backend.__dict__
    b.detach()


def test_without_deepspeeds_backend_the_hook_says_so_and_times_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ds_comm, "cdb", None)
    eng = StandInEngine(stage=1, stages=2, micro_batches=2)
    with caplog.at_level(logging.WARNING, logger="bubbles.hook"):
        inst = instrument(eng, training="t", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1),
                          warmup_iterations=0, profile_iterations=2)
    try:
        assert inst.stats["collectives"].startswith("not timed: ")
        assert "OptimizerStep" in caplog.text and "not seen" in caplog.text
        for _ in range(2):
            eng.train_batch()
        assert inst.cycle is not None and [s.instruction for s in inst.cycle.slots][-1] == "LossBroadcast"
    finally:
        inst.detach()
    assert COLLECTIVES.users == 0


def test_the_interposer_refuses_what_it_cannot_shadow() -> None:
    c = Collectives()
    with pytest.raises(RuntimeError, match="not initialised"):
        c.acquire(None)
    with pytest.raises(RuntimeError, match="has none of the collectives"):
        c.acquire(object())
    first = StandInBackend()
    c.acquire(first)
    with pytest.raises(RuntimeError, match="another DeepSpeed communication backend"):
        c.acquire(StandInBackend())
    c.release()
    c.release()  # one too many: nothing happens
    assert c.users == 0 and not set(first.__dict__) & set(OPS)


def test_device_timing_brackets_the_collectives_with_events(tmp_path: Path, backend: StandInBackend) -> None:
    # The CUDA path (events read on the helper thread) with events that complete when recorded: NCCL's collectives
    # return to the host at once, so on a GPU only the events see the wait.
    from bubbles.training.gpu_timing import HostEvent

    eng = StandInEngine(stage=1, stages=2, micro_batches=2, backend=backend)
    inst = instrument(eng, training="t", run_dir=tmp_path, memory_probe=StaticMemoryProbe(1), warmup_iterations=0,
                      profile_iterations=3, timing="cuda", event_factory=HostEvent)
    try:
        for _ in range(4):
            eng.train_batch()
        deadline = time.monotonic() + 10
        while inst.cycle is None and time.monotonic() < deadline:
            time.sleep(0.01)
        cycle = inst.cycle
        assert cycle is not None
        inner = [s for s in cycle.slots if s.instruction == "OptimizerStep.all_reduce"]
        assert len(inner) == 1 and inner[0].kind == "drain" and inner[0].duration_s >= WAIT_S * 0.9
    finally:
        inst.detach()
