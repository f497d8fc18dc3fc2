"""What the bubbles hook costs per pipeline instruction, in microseconds.

The wrappers are built by ``bubbles.hook.instrument`` itself, on a stand-in engine that runs DeepSpeed's
own ``PipelineEngine._exec_schedule`` dispatch loop over DeepSpeed's real schedule classes, with handlers
that do nothing (so only dispatch and the hook are measured, not compute or communication).

Cases:
- ``compute``: a non-wait instruction (ForwardPass): two timestamps and an append;
- ``wait``: a candidate wait (RecvGrad) that is not a bubble or has no listener;
- ``holds collectives``: an instruction whose collectives the hook times one by one (OptimizerStep, which calls none
  here): the timestamps, the append and the thread-local switch of the backend's interposer (``collectives``);
- ``bubble``: a profiled bubble with one live listener: BUBBLE_START and BUBBLE_END datagrams;
- ``bubble (device events)``: the same with ``timing="cuda"``, as on a GPU: the training's thread records
  two events and queues them, and a helper thread waits on them and sends the datagrams. The events here
  complete when recorded (``HostEvent``): on a GPU add two ``cudaEventRecord`` calls (a few microseconds
  each, not measured here), and the helper thread's GIL time is counted as it falls on the training's;
- ``bubble (CUDA events)``: on a machine with a CUDA GPU (or ``--cuda``), the same with real ``torch.cuda.Event``s on
  the current stream, as the hook makes them: the training's thread pays the two ``cudaEventRecord`` calls; the
  stream is idle, so each event completes at once and the helper thread's wake-up and sends overlap the next call;
- ``schedule``: a whole 1F1B batch (4 stages, 8 micro-batches, stage 1), cost spread per instruction.

Usage: ``python benchmarks/hook_overhead.py [--calls N] [--json PATH] [--cuda | --no-cuda]`` (about 10-20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deepspeed.runtime.pipe import schedule as S
from deepspeed.runtime.pipe.engine import PipelineEngine

from bubbles.core import paths
from bubbles.training.gpu_timing import HostEvent
from bubbles.training.hook import instruction_stream, instrument


class StandInEngine:
    _exec_schedule = PipelineEngine._exec_schedule

    def __init__(self, stage: int, stages: int, micro_batches: int) -> None:
        self.stage_id, self.num_stages, self.micro_batches = stage, stages, micro_batches

        def noop(engine: Any, **kwargs: Any) -> None:
            return None

        self._INSTRUCTION_MAP = {cls: noop for cls in (
            S.OptimizerStep, S.ReduceGrads, S.ReduceTiedGrads, S.LoadMicroBatch, S.ForwardPass,
            S.BackwardPass, S.SendActivation, S.RecvActivation, S.SendGrad, S.RecvGrad)}

    def _reserve_pipe_buffers(self, n: int) -> None:
        pass

    def _aggregate_total_loss(self) -> float:
        return 0.0

    def train_batch(self) -> float:
        self._exec_schedule(S.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id))
        return self._aggregate_total_loss()

    def eval_batch(self) -> float:
        return 0.0


def time_calls(fn: Any, engine: Any, calls: int, reset: Any) -> list[float]:
    """Per-call durations in microseconds, each call timed on its own."""
    clock = time.perf_counter_ns
    out = []
    for i in range(calls):
        if i % 512 == 0:
            reset()
        t0 = clock()
        fn(engine, buffer_id=0)
        out.append((clock() - t0) / 1e3)
    return out


def summary(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100_000, help="timed calls per case (default 100000)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                    help="the case with real CUDA events (default: when a CUDA GPU is visible)")
    args = ap.parse_args(argv)
    if args.calls < 1000:
        ap.error(f"--calls {args.calls}: give at least 1000 (fewer say nothing about a p99)")
    cuda_ok = _cuda_available()
    if args.cuda and not cuda_ok:
        print("hook_overhead: --cuda: no CUDA device is visible here (torch.cuda.is_available() is False); leave "
              "--cuda out to measure the other cases", file=sys.stderr)
        return 2
    with_cuda = cuda_ok if args.cuda is None else args.cuda

    run_dir = Path(tempfile.mkdtemp(prefix="bbh-", dir="/tmp"))
    try:
        results = _measure(args.calls, with_cuda, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    print("| case | direct median (us) | hooked median (us) | overhead median (us) | hooked p99 (us) "
          "| overhead p99 (us) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case, r in results.items():
        print(f"| {case} | {r['direct_median_us']:.2f} | {r['hooked_median_us']:.2f} | "
              f"{r['overhead_median_us']:.2f} | {r['hooked_p99_us']:.2f} | {r['overhead_p99_us']:.2f} | "
              f"{r['ratio']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"unit": "us per instruction", "cpu_count": os.cpu_count(),
                                         "python": sys.version.split()[0], "results": results}, indent=2))
    return 0


class StandInBackend:
    """DeepSpeed's communication backend object as the hook sees it (``deepspeed.comm.comm.cdb``, None without
    ``init_distributed``): present, so that the hook interposes on it and wraps OptimizerStep as a real engine's."""

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None


def _measure(calls: int, with_cuda: bool, run_dir: Path) -> dict[str, dict[str, float]]:
    """Every case, in microseconds per instruction (see the module doc); the sockets live in ``run_dir``."""
    from deepspeed.comm import comm as ds_comm

    saved_backend, ds_comm.cdb = ds_comm.cdb, StandInBackend()
    try:
        return _measure_cases(calls, with_cuda, run_dir)
    finally:
        ds_comm.cdb = saved_backend


def _measure_cases(calls: int, with_cuda: bool, run_dir: Path) -> dict[str, dict[str, float]]:
    engine = StandInEngine(stage=1, stages=4, micro_batches=8)
    direct = dict(engine._INSTRUCTION_MAP)
    inst = instrument(engine, training="bench", run_dir=run_dir, warmup_iterations=0, profile_iterations=1,
                      min_bubble_s=0.0)
    engine.train_batch()  # profiles: with min_bubble_s=0 every wait is a bubble
    assert inst.cycle is not None
    hooked = engine._INSTRUCTION_MAP
    hot = inst._hot

    def reset_plain() -> None:
        hot.records.clear()
        hot.signal_map = {}

    results: dict[str, dict[str, float]] = {}
    interleave = 4
    per = max(1000, calls // interleave)
    assert inst.stats["collectives"] == "timed", inst.stats["collectives"]
    for case, cls in (("compute", S.ForwardPass), ("wait", S.RecvGrad), ("holds collectives", S.OptimizerStep)):
        d_all: list[float] = []
        h_all: list[float] = []
        for _ in range(interleave):  # interleaved so that drift of the machine hits both alike
            d_all += time_calls(direct[cls], engine, per, lambda: None)
            h_all += time_calls(hooked[cls], engine, per, reset_plain)
        results[case] = _row(d_all, h_all)

    # a signalled bubble with one live listener, the hook sending the datagrams itself
    results["bubble"] = _bubble_case(inst, engine, direct, per, interleave, run_dir, "bench")

    # the same bubble, timed with device events resolved on the helper thread
    dev_engine = StandInEngine(stage=1, stages=4, micro_batches=8)
    dev = instrument(dev_engine, training="bench-dev", run_dir=run_dir, warmup_iterations=0, profile_iterations=1,
                     min_bubble_s=0.0, timing="cuda", event_factory=HostEvent)
    dev_engine.train_batch()
    deadline = time.monotonic() + 10
    while dev.cycle is None and time.monotonic() < deadline:  # built on the helper thread
        time.sleep(0.001)
    results["bubble (device events)"] = _bubble_case(dev, dev_engine, direct, per, interleave, run_dir, "bench-dev")
    dev.detach()

    if with_cuda:  # real CUDA events, made the way the hook makes them on a GPU (event_factory left to it)
        cuda_engine = StandInEngine(stage=1, stages=4, micro_batches=8)
        real = instrument(cuda_engine, training="bench-cuda", run_dir=run_dir, warmup_iterations=0,
                          profile_iterations=1, min_bubble_s=0.0, timing="cuda")
        cuda_engine.train_batch()
        deadline = time.monotonic() + 10
        while real.cycle is None and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            if real.cycle is None:
                raise SystemExit("hook_overhead: with real CUDA events the hook built no profile within 10 s "
                                 f"(hook stats: {real.stats})")
            results["bubble (CUDA events)"] = _bubble_case(real, cuda_engine, direct, per, interleave, run_dir,
                                                            "bench-cuda")
        finally:
            real.detach()

    # a whole batch through DeepSpeed's dispatch loop
    n_instr = len(instruction_stream(S.TrainSchedule(8, 4, 1))) + 1
    plain = StandInEngine(stage=1, stages=4, micro_batches=8)
    d_b: list[float] = []
    h_b: list[float] = []
    inst._listeners.close()  # no listener: the plain cost of timing every instruction
    for _ in range(interleave):
        for eng, acc in ((plain, d_b), (engine, h_b)):
            for _ in range(max(50, per // 200)):
                t0 = time.perf_counter_ns()
                eng.train_batch()
                acc.append((time.perf_counter_ns() - t0) / 1e3 / n_instr)
    results["schedule"] = _row(d_b, h_b)
    inst.detach()
    return results


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _bubble_case(inst: Any, engine: Any, direct: dict[Any, Any], per: int, interleave: int, run_dir: Path,
                 training: str) -> dict[str, float]:
    """The wrapper of the cycle's first bubble, signalled to one live listener (drained so that its queue
    never fills), against the bare handler."""
    assert inst.cycle is not None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(paths.make_private_dir(paths.gpu_dir(run_dir, inst.key)) / paths.AGENT_SOCKET_NAME))
    listener.setblocking(False)
    inst._listeners.refresh()
    hot = inst._hot
    bubble_pos = inst.cycle.slots[0].position
    smap = {s.position: (s.slot, int(s.duration_s * 1e9)) for s in inst.cycle.slots}

    def reset_bubble() -> None:
        hot.records.clear()
        hot.records.extend([(0, 0, 0)] * bubble_pos)  # the next call sits at the bubble's position
        hot.signal_map = smap
        try:
            while True:
                listener.recv(64)
        except BlockingIOError:
            pass

    cls = S.RecvGrad if inst.cycle.slots[0].instruction == "RecvGrad" else S.RecvActivation
    hooked = engine._INSTRUCTION_MAP
    d_all: list[float] = []
    h_all: list[float] = []
    for _ in range(interleave):
        d_all += time_calls(direct[cls], engine, per // 4, lambda: None)
        h_all += [_timed_one(hooked[cls], engine, reset_bubble) for _ in range(per // 4)]
    hot.signal_map = {}
    listener.close()
    return _row(d_all, h_all)


def _timed_one(fn: Any, engine: Any, reset: Any) -> float:
    reset()
    t0 = time.perf_counter_ns()
    fn(engine, buffer_id=0)
    return (time.perf_counter_ns() - t0) / 1e3


def _row(direct: list[float], hooked: list[float]) -> dict[str, float]:
    dm, dp = summary(direct)
    hm, hp = summary(hooked)
    return {"direct_median_us": dm, "direct_p99_us": dp, "hooked_median_us": hm, "hooked_p99_us": hp,
            "overhead_median_us": hm - dm, "overhead_p99_us": hp - dp,
            "ratio": hm / dm if dm else float("nan")}


if __name__ == "__main__":
    sys.exit(main())
