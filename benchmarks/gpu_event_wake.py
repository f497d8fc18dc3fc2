"""How late the hook's helper thread wakes after a device event completes, on a GPU (device timing's signal lag).

    python benchmarks/gpu_event_wake.py [--waits 200] [--out FILE.json]

The real ``EventTimer`` (``gpu_timing``) with the real CUDA events, as the hook uses them: the host queues
``--waits`` signalled waits at once (a 1 ms spin kernel, the wait's start event, a 2 ms spin, its end event), as a
training's host runs ahead of its GPU, then keeps its main thread busy until the helper thread has resolved them.
Each signal's lag is ``EventTimer.wake_lag_ns``: the helper's wake-up minus the event's completion on the device's
timeline (relative to the luckiest wake-up, so a lower bound). Every combination of

- how the helper waits (``block``: cudaEventBlockingSync; ``spin``: the driver polls),
- the interpreter's switch interval (Python's 5 ms; the hook's 200 us),
- what the main thread does meanwhile (``idle``: sleeps; ``python``: pure Python, holding the GIL between
  bytecodes; ``torch``: small CPU tensor ops, which release the GIL around each op, like a host queueing kernels)

is run in one process, interleaved ``--rounds`` times, and reported as median and p90 of the lags in microseconds.
Needs an NVIDIA GPU (exit 2 without one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bubbles.training.gpu_timing import EVENT_WAITS, EventTimer, cuda_event_factory

LOADS = ("idle", "python", "torch")
INTERVALS_S = (0.005, 0.0002)


def _busy(load: str, timer: EventTimer, n: int, torch: Any) -> None:
    deadline = time.monotonic() + 30
    x = torch.ones(64)
    while timer.resolved < n and time.monotonic() < deadline:
        if load == "idle":
            time.sleep(0.001)
        elif load == "python":
            s = 0
            for i in range(2000):
                s += i * i
        else:
            for _ in range(50):
                x = x * 1.0001 + 0.5


def one(wait: str, interval_s: float, load: str, waits: int, cycles_per_ms: float, torch: Any) -> list[float]:
    sys.setswitchinterval(interval_s)
    timer = EventTimer(cuda_event_factory(wait), on_start=lambda *a: None, on_end=lambda *a: None,
                       on_iteration=lambda *a: None, on_error=lambda exc: print(f"error: {exc!r}", file=sys.stderr))
    try:
        for seq in range(waits):
            torch.cuda._sleep(int(cycles_per_ms))
            start = timer.begin(0, (0, 0), seq)
            torch.cuda._sleep(int(2 * cycles_per_ms))
            if start is not None:
                timer.end(0, start, (0, 0), seq)
        _busy(load, timer, waits, torch)
        torch.cuda.synchronize()
        return [ns / 1e3 for ns in list(timer.wake_lag_ns)[waits // 10:]]  # the first tenth settles the reference
    finally:
        timer.close()
        sys.setswitchinterval(0.005)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waits", type=int, default=200, help="signalled waits per combination and round (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every combination (default 3)")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.waits < 20 or args.rounds < 1:
        p.error("--waits must be >= 20 and --rounds >= 1")
    import torch

    if not torch.cuda.is_available():
        print("gpu_event_wake: needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # the clock ramps up under load: keep the fastest
        t0.record()
        torch.cuda._sleep(20_000_000)
        t1.record()
        t1.synchronize()
    cycles_per_ms = 20_000_000 / t0.elapsed_time(t1)
    lags: dict[tuple[str, float, str], list[float]] = {}
    for _ in range(args.rounds):
        for wait, interval, load in itertools.product(EVENT_WAITS, INTERVALS_S, LOADS):
            lags.setdefault((wait, interval, load), []).extend(one(wait, interval, load, args.waits, cycles_per_ms,
                                                                   torch))
            print(f"gpu_event_wake: {wait} / {interval * 1e6:.0f} us / {load}: done", file=sys.stderr)
    rows = []
    print("| helper waits | switch interval | main thread | signals | lag p50 (us) | lag p90 (us) |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for (wait, interval, load), v in lags.items():
        q = statistics.quantiles(v, n=10)
        row = {"wait": wait, "switch_interval_us": interval * 1e6, "load": load, "n": len(v),
               "p50_us": statistics.median(v), "p90_us": q[8]}
        rows.append(row)
        print(f"| {wait} | {interval * 1e6:.0f} us | {load} | {len(v)} | {row['p50_us']:.0f} | {row['p90_us']:.0f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
