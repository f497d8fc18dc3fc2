"""The demo's training worker: a small DeepSpeed pipeline on CPU (gloo), ``--tp`` processes per stage (default 1).

Launched by the demo, the tests and the benchmarks with::

    python -m torch.distributed.run --nproc_per_node P --master_port PORT -m bubbles.demo.train --out DIR ...

for ``P`` stages, or with ``--nproc_per_node S*T ... --tp T`` for ``S`` stages of ``T`` model-parallel ranks each
(DeepSpeed's pipe x model topology; global ranks ``k*T .. k*T+T-1`` are stage ``k``). The layers are plain, the same
on every model-parallel rank of a stage (nothing is sliced: a CPU demo has no tensor-parallel kernels), so every rank
of a stage computes what the others do, while DeepSpeed still builds its grid, model groups and partitioned
activations across them; each rank's hook signals its own bubbles (``rank-<r>/`` of the stage's directory).

Everything is deterministic (seeds, synthetic data generated identically on every rank, one intra-op
thread), so two runs with the same flags produce bit-identical losses; ``--no-hook`` runs without the
bubbles hook at all, for that comparison. The run is: the hook's warm-up and profiling iterations
(phase "profile"), then each ``--phases`` entry ``mode:iterations`` in order; at each phase boundary all
ranks meet in a barrier and switch the listeners' fill mode.

Each rank writes ``DIR/rank-<global rank>.json``: stage, stages, microbatches, rank, stage_rank and stage_ranks (its
index among its stage's ranks, and how many there are), gpu (the hook's key, or null), schedule, losses
(``float.hex`` per iteration), iteration_s, iteration_end_ns (``time.monotonic_ns()`` at each iteration's end), phase
(per iteration), cycle (``BubbleCycle.to_dict`` of the
schedule in use, or null), cycles (by schedule name), trace (with ``--trace``: ``[iteration,
instruction, start_ns, end_ns, slot or -1]``), stats (the hook's counters) and the flags.

``--sleep-compute-ms X`` adds a sleep of X ms to every layer's forward and 2X ms to its backward: it
stands in for accelerator kernels (the stage is busy, the core is not), so a 4-stage pipeline on a
2-core machine has stage times that do not depend on how the OS shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bubbles.core.api import FillMode
from bubbles.demo.orchestrate.phases import PROFILE_PHASE, parse_phases
from bubbles.demo.orchestrate.processes import wait_for_file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bubbles.demo.train",
                                description="DeepSpeed pipeline training worker of the bubbles demo (CPU).")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per batch (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch (default 8)")
    p.add_argument("--hidden", type=int, default=256, help="width of the layers (default 256)")
    p.add_argument("--layers", type=int, default=8, help="layers, split evenly over the stages (default 8)")
    p.add_argument("--tp", type=int, default=1,
                   help="model-parallel (tensor-parallel) ranks per stage (default 1): launch stages x tp processes; "
                        "each rank of a stage signals its own bubbles")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--phases", default="off:10,harvest:10",
                   help="comma list of mode:iterations run after profiling (modes: "
                        f"{', '.join(FillMode.labels())})")
    p.add_argument("--warmup-iterations", type=int, default=2)
    p.add_argument("--profile-iterations", type=int, default=5)
    p.add_argument("--min-bubble-ms", type=float, default=0.5)
    p.add_argument("--run-dir", type=Path, default=None, help="bubbles run directory (default: paths)")
    p.add_argument("--training", default=None, help="training name (default: $BUBBLES_TRAINING or 'default')")
    p.add_argument("--out", type=Path, required=True, help="directory for rank-<rank>.json")
    p.add_argument("--no-hook", action="store_true", help="do not instrument the engine at all")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin this rank to core rank %% cpu_count (a core stands in for a stage's GPU)")
    p.add_argument("--free-bytes", type=int, default=None, help="free memory the hook reports per bubble")
    p.add_argument("--start-file", type=Path, default=None,
                   help="after profiling, wait until this file exists before the first phase")
    p.add_argument("--start-timeout-s", type=float, default=120.0, help="how long to wait for --start-file")
    p.add_argument("--stop-file", type=Path, default=None,
                   help="end the run early, after the iteration in which rank 0 sees this file (every rank stops "
                        "at the same iteration); the record holds the iterations run")
    p.add_argument("--trace", action="store_true", help="record per-instruction timings (Gantt chart)")
    p.add_argument("--schedule", choices=("train", "inference"), default="train")
    p.add_argument("--timing", choices=("auto", "host", "cuda", "host-events"), default="auto",
                   help="how the hook times waits: host stamps, CUDA events, or 'host-events' (the CUDA "
                        "event path with events that complete when recorded: for testing it on CPU)")
    p.add_argument("--gradient-clipping", type=float, default=1.0,
                   help="DeepSpeed gradient clipping (default 1.0, the usual setting: the pipeline's drain then "
                        "sits in OptimizerStep's gradient-norm all-reduce, which the hook times; 0 turns it off)")
    p.add_argument("--sleep-compute-ms", type=float, default=0.0,
                   help="sleep this long in each layer's forward (2x in backward) to emulate slower compute")
    return p


class _SleepCompute(torch.autograd.Function):
    """Identity whose forward and backward sleep: busy stage, idle core."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class Block(nn.Module):
    def __init__(self, hidden: int, sleep_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.linear(x))
        if self.sleep_s > 0:
            y = _SleepCompute.apply(y, self.sleep_s)
        return y


def batches(seed: int, micro_batch_size: int, hidden: int) -> Any:
    """Endless deterministic (inputs, labels) micro-batches; identical on every rank."""
    i = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        x = torch.randn(micro_batch_size, hidden, generator=g)
        y = torch.tanh(x.roll(1, dims=1)) + 0.1 * torch.randn(micro_batch_size, hidden, generator=g)
        yield x, y
        i += 1


def stages_of(world_size: int, tp: int) -> int:
    """How many pipeline stages a launch of ``world_size`` processes with ``tp`` model-parallel ranks per stage has;
    ValueError saying what to launch otherwise."""
    if tp < 1:
        raise ValueError(f"--tp {tp}: give the model-parallel ranks per stage, 1 or more")
    if world_size % tp:
        raise ValueError(f"--tp {tp} does not divide the {world_size} processes launched: launch stages x tp "
                         f"processes (torchrun --nproc_per_node), e.g. {2 * tp} for 2 stages of {tp} ranks")
    return world_size // tp


def pipe_topology(stages: int, tp: int) -> Any:
    """DeepSpeed's topology of ``stages`` pipeline stages of ``tp`` model-parallel ranks (one data-parallel replica);
    None for one rank per stage, where ``PipelineModule(num_stages=...)`` builds the topology it always has."""
    if tp == 1:
        return None
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=1)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        phases = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("microbatches", "micro_batch_size", "hidden", "layers", "profile_iterations"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if (args.warmup_iterations < 0 or args.min_bubble_ms < 0 or args.sleep_compute_ms < 0
            or not args.gradient_clipping >= 0):
        parser.error("--warmup-iterations, --min-bubble-ms, --sleep-compute-ms and --gradient-clipping must be >= 0")
    if args.start_timeout_s <= 0:
        parser.error(f"--start-timeout-s {args.start_timeout_s}: give a number of seconds > 0")
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: give the model-parallel ranks per stage, 1 or more")

    rank = int(os.environ.get("RANK", "0"))
    if args.pin_cores:
        # A core stands in for the stage's accelerator: the stage and its fill jobs share it (shared NOTES).
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)

    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from bubbles.demo.ds_ops import skip_unused_cpu_ops

    skip_unused_cpu_ops()  # before init_distributed would spend 30-60 s building an op this training never calls
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        stages = stages_of(dist.get_world_size(), args.tp)
    except ValueError as exc:
        parser.error(str(exc))
    if args.layers < stages:
        parser.error(f"--layers {args.layers} is fewer than the {stages} stages")
    torch.manual_seed(args.seed)
    layers = [Block(args.hidden, args.sleep_compute_ms / 1e3) for _ in range(args.layers)]
    net = PipelineModule(layers=layers, num_stages=stages, topology=pipe_topology(stages, args.tp),
                         loss_fn=nn.MSELoss(), partition_method="uniform")
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.microbatches,
        "steps_per_print": 10**9,  # quiet
        "wall_clock_breakdown": False,
        # Clipping at 1.0, as real trainings do: OptimizerStep starts with the gradient norm's all-reduce over the
        # whole pipeline, where a stage that finished early waits; the hook times that all-reduce on its own.
        "gradient_clipping": args.gradient_clipping,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)

    inst = None
    if not args.no_hook:
        from bubbles.hook import instrument
        from bubbles.training.probes import StaticMemoryProbe

        probe = StaticMemoryProbe(args.free_bytes) if args.free_bytes is not None else None
        timing, event_factory = args.timing, None
        if timing == "host-events":
            from bubbles.training.gpu_timing import HostEvent

            timing, event_factory = "cuda", HostEvent
        inst = instrument(engine, training=args.training, run_dir=args.run_dir, memory_probe=probe,
                          warmup_iterations=args.warmup_iterations,
                          profile_iterations=args.profile_iterations,
                          min_bubble_s=args.min_bubble_ms / 1e3, trace=args.trace, timing=timing,
                          event_factory=event_factory)

    data = batches(args.seed, args.micro_batch_size, args.hidden)
    losses: list[str] = []
    iteration_s: list[float] = []
    iteration_end_ns: list[int] = []
    phase_of: list[str] = []

    def step() -> None:
        t0 = time.perf_counter()
        loss = engine.train_batch(data) if args.schedule == "train" else engine.eval_batch(data)
        iteration_s.append(time.perf_counter() - t0)
        iteration_end_ns.append(time.monotonic_ns())  # the agent's clock: its records of the same time compare
        losses.append(float(loss.item()).hex())

    def report(phase: str, n: int) -> None:
        if rank == 0 and n:
            times = iteration_s[-n:]
            print(f"[bubbles] phase {phase}: {n} iterations, median {1e3 * statistics.median(times):.2f} ms, "
                  f"loss {float.fromhex(losses[-1]):.6f}", flush=True)

    n_profile = args.warmup_iterations + args.profile_iterations
    for _ in range(n_profile):
        step()
        phase_of.append(PROFILE_PHASE)
    report(PROFILE_PHASE, n_profile)
    # The demo creates the start file once every fill job is initialized, so that fill processes starting up
    # (importing torch, first steps) do not land in a measured phase.
    if (args.start_file is not None and rank == 0
            and not wait_for_file(args.start_file, None, args.start_timeout_s)):
        print(f"[bubbles] warning: {args.start_file} did not appear within {args.start_timeout_s:.0f} s; "
              "starting anyway", flush=True)
    stop = torch.zeros(1, dtype=torch.int32)

    def stopping() -> bool:
        """Whether rank 0 saw --stop-file: one tiny all-reduce between iterations, outside train_batch (the hook
        does not see it)."""
        if args.stop_file is None:
            return False
        stop[0] = 1 if rank == 0 and args.stop_file.exists() else 0
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        return bool(stop[0])

    stopped = False
    for mode, n in phases:
        if stopped:
            break
        dist.barrier()
        if inst is not None:
            inst.set_fill_mode(mode)
        done = 0
        while done < n and not stopped:
            step()
            phase_of.append(mode.label)
            done += 1
            stopped = stopping()
        report(mode.label, done)
    if stopped and rank == 0:
        print(f"[bubbles] {args.stop_file} seen: stopped after {len(losses)} iterations", flush=True)
    dist.barrier()

    schedule_name = "TrainSchedule" if args.schedule == "train" else "InferenceSchedule"
    from bubbles.training.hook import stage_rank_of

    stage_rank, stage_ranks = stage_rank_of(engine)
    key = getattr(inst, "key", None)  # None: unhooked, or an Unattached hook
    record: dict[str, Any] = {
        "rank": dist.get_rank(),
        "stage_rank": stage_rank,
        "stage_ranks": stage_ranks,
        "gpu": str(key) if key is not None else None,
        "stage": int(engine.stage_id),
        "stages": int(engine.num_stages),
        "microbatches": int(engine.micro_batches),
        "schedule": schedule_name,
        "losses": losses,
        "iteration_s": iteration_s,
        "iteration_end_ns": iteration_end_ns,
        "phase": phase_of,
        "cycle": None,
        "cycles": {},
        "trace": None,
        "stats": None,
        "hook": inst is not None,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    if inst is not None:
        cycle = inst.cycles.get(schedule_name)
        record["cycle"] = cycle.to_dict() if cycle is not None else None
        record["cycles"] = {k: c.to_dict() for k, c in inst.cycles.items()}
        record["trace"] = [list(ev) for ev in inst.trace_events()] if args.trace else None
        record["stats"] = inst.stats
        inst.detach()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank-{dist.get_rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    if rank == 0:
        print(f"[bubbles] done: {len(losses)} iterations, records in {args.out}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
