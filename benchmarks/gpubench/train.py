"""The benchmark's training process: one emulated pipeline stage, instrumented by the real hook.

Started by ``gpubench.run`` as::

    python -m gpubench.train --device cuda:0 --stage 0 --stages 4 --microbatches 8 ... --out FILE

It builds a ``StageEmulator``, calibrates its forward and backward pass on the device, models the pipeline's
waits from them (``pipeline_model``), instruments the emulator with ``bubbles.hook.instrument`` (the same
call a DeepSpeed user makes), runs the hook's warm-up and profiling iterations, waits for ``--start-file``
(the orchestrator creates it once the fill job is initialized), then runs each ``--phases`` entry
``mode:iterations``, switching the listeners' fill mode at each boundary. It writes one JSON record to
``--out``: per-iteration times, losses (``float.hex``) and phase, each phase's start and end
(``time.monotonic_ns``, the clock the agent's ledger uses), the calibration, the modelled waits, the
profiled bubble cycle and the hook's counters. Progress lines start with ``[gpubench]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bubbles.core.api import FillMode
from bubbles.demo.orchestrate.phases import PROFILE_PHASE
from bubbles.demo.orchestrate.processes import wait_for_file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpubench.train",
                                description="One emulated pipeline stage of the one-GPU harvesting benchmark.")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--stage", type=int, default=0, help="which stage of the pipeline this process is (default 0)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per batch (default 8)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--blocks", type=int, default=4, help="transformer blocks of this stage (default 4)")
    p.add_argument("--p2p-latency-ms", type=float, default=0.1,
                   help="modelled time from a neighbour's send to the data's arrival (default 0.1)")
    p.add_argument("--wait-jitter", type=float, default=0.1,
                   help="coefficient of variation of each modelled wait (lognormal, mean 1; default 0.1, 0: fixed)")
    p.add_argument("--paired-waits", action=argparse.BooleanOptionalAction, default=True,
                   help="the i-th iteration of every mode's k-th phase draws the same wait jitter (common random "
                        "numbers: a round's comparison of modes is not blurred by the modelled jitter; default on)")
    p.add_argument("--link-gb-per-s", type=float, default=200.0,
                   help="the link a send crosses: a send occupies the device for the activation's bytes over this "
                        "bandwidth (default 200 GB/s, NVLink-class; 0: sends cost nothing)")
    p.add_argument("--stage-memory-gb", type=float, default=0.0,
                   help="GPU only: hold this much device memory in all (model, optimizer, activations, and a ballast "
                        "for the rest), as a real stage of a large model does, so the fill job and the memory probe "
                        "see the free memory such a stage leaves (default 0: no ballast)")
    p.add_argument("--calibration-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--phases", default="off:10,harvest:10",
                   help="comma list of mode:iterations run after profiling (modes: "
                        f"{', '.join(FillMode.labels())})")
    p.add_argument("--warmup-iterations", type=int, default=2)
    p.add_argument("--profile-iterations", type=int, default=5)
    p.add_argument("--min-bubble-ms", type=float, default=0.5)
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument("--training", default=None)
    p.add_argument("--free-bytes", type=int, default=4 << 30,
                   help="free memory the hook reports per bubble on CPU (CUDA asks the allocator)")
    p.add_argument("--pin-core", type=int, default=None,
                   help="CPU only: pin to this core (the fill jobs of this stage's executor share it)")
    p.add_argument("--agent-ready-file", type=Path, default=None,
                   help="before calibrating and profiling, wait until this file exists (the agent's --ready-file): "
                        "the agent must be listening when the hook sends the profiled cycle")
    p.add_argument("--start-file", type=Path, default=None)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, required=True, help="JSON record written here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from bubbles.demo.orchestrate.phases import parse_phases

    try:
        phases = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))
    if args.p2p_latency_ms < 0 or args.calibration_steps < 1 or args.min_bubble_ms < 0:
        parser.error("--p2p-latency-ms and --min-bubble-ms must be >= 0, --calibration-steps >= 1")
    if not args.stage_memory_gb >= 0:
        parser.error(f"--stage-memory-gb {args.stage_memory_gb}: give the GiB the stage holds, >= 0 (0: no ballast)")
    if not 0 <= args.wait_jitter <= 2 or not args.link_gb_per_s >= 0:
        parser.error(f"--wait-jitter {args.wait_jitter} must be a coefficient of variation from 0 to 2 and "
                     f"--link-gb-per-s {args.link_gb_per_s} a bandwidth >= 0 (0: sends cost nothing)")
    if args.warmup_iterations < 0 or args.profile_iterations < 1 or args.free_bytes < 0 or args.start_timeout_s <= 0:
        parser.error("--warmup-iterations and --free-bytes must be >= 0, --profile-iterations >= 1, "
                     "--start-timeout-s > 0")
    if args.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", args.device):
        parser.error(f"--device {args.device}: give cpu, cuda or cuda:N")
    if args.pin_core is not None:
        os.sched_setaffinity(0, {args.pin_core % (os.cpu_count() or 1)})

    import torch

    from bubbles.hook import instrument
    from bubbles.training.probes import CudaAllocatorProbe, MemoryProbe, StaticMemoryProbe
    from gpubench.emulator import StageEmulator, StageShape, modelled_summary

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core stands in for the stage's GPU
    shape = StageShape(hidden=args.hidden, heads=args.heads, ffn_mult=args.ffn_mult, seq=args.seq,
                       micro_batch=args.micro_batch, blocks=args.blocks)
    dtype_bytes = 2 if device.type == "cuda" else 4  # bf16 on GPUs, fp32 on CPUs (the emulator's dtypes)
    activation_bytes = shape.micro_batch * shape.seq * shape.hidden * dtype_bytes
    send_s = activation_bytes / (args.link_gb_per_s * 1e9) if args.link_gb_per_s > 0 else 0.0
    try:
        emulator = StageEmulator(stage_id=args.stage, num_stages=args.stages, micro_batches=args.microbatches,
                                 shape=shape, device=device, seed=args.seed, wait_jitter=args.wait_jitter,
                                 send_s=send_s)
    except ValueError as exc:
        parser.error(str(exc))
    if args.agent_ready_file is not None:  # started alongside the agent: its start-up overlaps ours
        _hold_until(args.agent_ready_file, args.start_timeout_s)
    forward_s, backward_s = emulator.calibrate(steps=args.calibration_steps)
    waits = emulator.model_waits(forward_s, backward_s, p2p_latency_s=args.p2p_latency_ms / 1e3)
    model = modelled_summary(waits, args.stage, forward_s, backward_s)
    _say(f"calibrated on {device}: forward {forward_s * 1e3:.2f} ms, backward {backward_s * 1e3:.2f} ms per "
         f"micro-batch; modelled stage {args.stage}: iteration {model['iteration_s'] * 1e3:.1f} ms, "
         f"bubbles {model['bubble_share'] * 100:.1f}% ({len(model['waits_s'])} waits), waits jittered by "
         f"{args.wait_jitter:.0%} (lognormal), sends {send_s * 1e6:.1f} us")

    ballast = None
    if device.type == "cuda" and args.stage_memory_gb > 0:
        total = torch.cuda.mem_get_info(device)[1]
        try:
            size = ballast_bytes(int(args.stage_memory_gb * 2**30), torch.cuda.memory_reserved(device), total)
        except ValueError as exc:
            parser.error(str(exc))
        ballast = torch.empty(size, dtype=torch.uint8, device=device)  # held until the process ends
        _say(f"holding {args.stage_memory_gb:g} GiB of {total / 2**30:.1f} GiB as a real stage would "
             f"({size / 2**30:.1f} GiB of it ballast)")
    probe: MemoryProbe = CudaAllocatorProbe(device=device) if device.type == "cuda" \
        else StaticMemoryProbe(args.free_bytes)
    inst = instrument(emulator, training=args.training, run_dir=args.run_dir, memory_probe=probe,
                      warmup_iterations=args.warmup_iterations, profile_iterations=args.profile_iterations,
                      min_bubble_s=args.min_bubble_ms / 1e3, timing="auto")

    losses: list[str] = []
    iteration_s: list[float] = []
    phase_of: list[str] = []
    phase_records: list[dict[str, Any]] = []

    def step(phase: str) -> None:
        t0 = time.perf_counter()
        loss = emulator.train_batch()
        value = float(loss.item())  # the host waits for the batch's last kernels here
        iteration_s.append(time.perf_counter() - t0)
        losses.append(value.hex())
        phase_of.append(phase)

    for _ in range(args.warmup_iterations + args.profile_iterations):
        step(PROFILE_PHASE)
    cycle = inst.cycle
    deadline = time.monotonic() + 30
    while cycle is None and not inst.stats["disabled"] and time.monotonic() < deadline:
        time.sleep(0.01)  # with device timing the event thread builds the cycle once the device has run the work
        cycle = inst.cycle
    _say(f"profiled: {len(cycle.slots) if cycle else 0} bubbles, "
         f"{(cycle.bubble_ratio * 100 if cycle else 0):.1f}% of {(cycle.iteration_s if cycle else 0) * 1e3:.1f} ms "
         f"(host: {statistics.median(iteration_s) * 1e3:.1f} ms per iteration)")
    if args.start_file is not None:
        _hold_until(args.start_file, args.start_timeout_s)
    rounds: dict[FillMode, int] = {}  # phases of each mode so far: the round a phase belongs to
    for mode, n in phases:
        inst.set_fill_mode(mode)
        start_ns = time.monotonic_ns()
        k = rounds[mode] = rounds.get(mode, -1) + 1
        for i in range(n):
            if args.paired_waits:
                emulator.pair_waits(k, i)
            step(mode.label)
        phase_records.append({"mode": mode.label, "iterations": n, "start_ns": start_ns, "end_ns": time.monotonic_ns()})
        if n:
            _say(f"phase {mode.label}: {n} iterations, median {statistics.median(iteration_s[-n:]) * 1e3:.2f} ms")
    inst.set_fill_mode(FillMode.OFF)  # the fill job is idle while the record is written and the run ends

    record: dict[str, Any] = {
        "device": str(device),
        "dtype": str(emulator.dtype).removeprefix("torch."),
        "stage": args.stage,
        "stages": args.stages,
        "microbatches": args.microbatches,
        "shape": dataclasses.asdict(shape),
        "forward_flops_per_microbatch": shape.forward_flops(),
        "model": {**model, "wait_jitter": args.wait_jitter, "send_s": send_s, "paired_waits": args.paired_waits},
        "losses": losses,
        "iteration_s": iteration_s,
        "phase": phase_of,
        "phases": phase_records,
        "cycle": inst.cycle.to_dict() if inst.cycle is not None else None,
        "hook": inst.stats,
        "ballast_bytes": 0 if ballast is None else int(ballast.numel()),
        "timing": getattr(inst, "timing", "host"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    inst.detach()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(args.out)
    _say(f"done: {len(losses)} iterations, record in {args.out}")
    return 0


def ballast_bytes(target_bytes: int, held_bytes: int, total_bytes: int) -> int:
    """Bytes to allocate so that a stage holding ``held_bytes`` holds ``target_bytes`` of a ``total_bytes`` device;
    ValueError, saying what to give, when the target leaves less than 2 GiB of the device (for the fill job, the
    margin and the contexts)."""
    if target_bytes > total_bytes - (2 << 30):
        raise ValueError(f"--stage-memory-gb {target_bytes / 2**30:g}: the device has {total_bytes / 2**30:.1f} GiB; "
                         "leave at least 2 GiB for the fill job and the contexts")
    return max(0, target_bytes - held_bytes)


def _say(message: str) -> None:
    print(f"[gpubench] {message}", flush=True)


def _hold_until(path: Path, timeout_s: float) -> None:
    """Hold the phases until ``path`` exists, so that fill processes starting up land in no measured phase."""
    if not wait_for_file(path, None, timeout_s, poll_s=0.02):
        _say(f"warning: {path} did not appear within {timeout_s:.0f} s; starting anyway")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: unloading torch and deepspeed takes seconds on a busy machine, after
    # everything this process had to say is written and flushed (the record file was replaced atomically).
    os._exit(code)
