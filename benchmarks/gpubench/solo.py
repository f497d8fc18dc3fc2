"""Each fill job alone on the device: the dedicated-GPU throughput FreeRide's cost savings S divide by.

    python -m gpubench.solo --device cuda:0 --jobs FILE.json --seconds 5 --out FILE

``--jobs`` holds a list of ``{"name", "entry", "args"}``. Every job runs as the fill runtime runs it: created,
initialized (its first, FLOP-counted step included) on the device the agent would assign, one thread, each
step followed by a device synchronize (a step is done when its GPU work is), then steps back to back for
``--seconds`` with nothing else on the device. Writes ``{name: {steps, samples, flops, seconds,
samples_per_s, flops_per_s, step_median_s}}`` to ``--out``.
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

WARMUP_STEPS = 3  # after init: allocator and kernel-selection warm-up, not counted


def measure(job: Any, sync: Any, seconds: float) -> dict[str, float]:
    """Run ``job`` alone for ``seconds`` (after warm-up); its throughput."""
    from bubbles.sdk import StepResult

    for _ in range(WARMUP_STEPS):
        job.step()
    sync.synchronize()
    steps, samples, flops = 0, 0, 0.0
    durations = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds and not job.is_finished():
        s0 = time.perf_counter()
        result = job.step()
        sync.synchronize()
        durations.append(time.perf_counter() - s0)
        steps += 1
        if isinstance(result, StepResult):
            samples += result.samples
            flops += result.flops
    elapsed = time.perf_counter() - t0
    return {"steps": steps, "samples": samples, "flops": flops, "seconds": elapsed,
            "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
            "flops_per_s": flops / elapsed if elapsed > 0 else 0.0,
            "step_median_s": statistics.median(durations) if durations else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpubench.solo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--jobs", type=Path, required=True, help="JSON list of {name, entry, args}")
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per job (default 5)")
    p.add_argument("--pin-core", type=int, default=None, help="CPU only: pin to this core")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not args.seconds > 0:
        p.error(f"--seconds {args.seconds}: give a duration > 0")
    if args.pin_core is not None:
        os.sched_setaffinity(0, {args.pin_core % (os.cpu_count() or 1)})
    from bubbles.core import control
    from bubbles.training.sdk.device import apply_process_limits, device_sync_for
    from bubbles.training.sdk.jobs import load_entry

    os.environ[control.DEVICE_ENV] = args.device  # what the agent gives a fill process: the job reads it
    apply_process_limits(args.device, None)
    sync = device_sync_for(args.device)
    results: dict[str, Any] = {}
    for spec in json.loads(args.jobs.read_text()):
        job = load_entry(spec["entry"])(**spec.get("args", {}))
        job.create()
        job.init()
        results[spec["name"]] = measure(job, sync, args.seconds)
        r = results[spec["name"]]
        print(f"[gpubench] solo {spec['name']}: {r['samples_per_s']:.1f} samples/s, "
              f"{r['flops_per_s'] / 1e12:.3f} TFLOPS, step {r['step_median_s'] * 1e3:.2f} ms", flush=True)
        del job
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: unloading torch and deepspeed takes seconds on a busy machine, after
    # everything this process had to say is written and flushed (the record file was replaced atomically).
    os._exit(code)
