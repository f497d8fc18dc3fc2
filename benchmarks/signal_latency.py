"""Bubble-start latency: from the hook sending BUBBLE_START to the fill job starting its step.

Real parts end to end: the agent (`bubbles agent`) starts a real fill process (the SDK runtime with a
SpinJob), and this script plays the training's side with the hook's own sender (`bubbles.training.hook.Listeners`),
signalling a bubble every ``--gap-ms``. The latency of a bubble is the first step's start (taken by
the runtime when it decides to run the step) minus the signal's timestamp (taken by the sender just
before `sendto`), both CLOCK_MONOTONIC. In the same run, a gRPC unary round trip on localhost is
measured as the reference.

    .venv/bin/python benchmarks/signal_latency.py --signals 3000 --json out/signal-latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bubbles.core import control, paths, wire
from bubbles.core.api import FillMode
from bubbles.core.cycle import BubbleCycle, BubbleSlot
from bubbles.core.stats import percentile
from bubbles.training.hook.listeners import Listeners
from grpc_reference import grpc_round_trips_us

TRAINING = "bench"
BUBBLE_MS = 2.0


def bubble_start_latencies_us(signals: int, gap_s: float, work: Path, spin_us: float = 0.0) -> list[float]:
    run_dir = work / "run"
    spec = work / "spin.json"
    spec.write_text(json.dumps({"name": "spin", "entry": "bubbles.fill_examples.spin:SpinJob",
                                "args": {"step_us": 50}, "memory": "1Mi", "step_time": "0.1ms", "stage": 0}))
    stats, ready = work / "stats.json", work / "ready"
    agent = subprocess.Popen(
        [sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(run_dir), "--training", TRAINING,
         "--executors", "1", "--fill-job", str(spec), "--mode", FillMode.HARVEST.label, "--stats", str(stats),
         "--ready-file", str(ready), "--no-pin-cores", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, control.SPIN_US_ENV: str(spin_us)})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"agent did not start: {agent.stderr.read() if agent.stderr else ''}")
            time.sleep(0.05)
        key = paths.GpuKey(paths.LOCAL_NAMESPACE, TRAINING, 0)  # rank 0 of stage 0, the local agent's first GPU
        stage_dir = paths.gpu_dir(run_dir, key)
        listeners = Listeners(stage_dir)
        cycle = BubbleCycle(training=TRAINING, stage=0, stages=2, microbatches=8, schedule="TrainSchedule",
                            iteration_s=0.05, samples=5,
                            slots=(BubbleSlot(0, 3, "RecvGrad", "fwd-bwd", BUBBLE_MS / 1e3, BUBBLE_MS / 1e3,
                                              BUBBLE_MS / 1e3, 1 << 30),))
        listeners.refresh()
        listeners.send(wire.encode_profile(0, cycle.to_dict()))
        fill_sock = paths.fill_socket(run_dir, key, "spin")
        deadline = time.monotonic() + 60
        while not fill_sock.exists():  # the job is created, initialized and armed
            if time.monotonic() > deadline:
                raise SystemExit("the fill job never armed")
            time.sleep(0.01)
        listeners.refresh()
        for seq in range(1, signals + 1):
            start = time.monotonic_ns()
            listeners.send(wire.encode_bubble_start(0, 0, seq, start, start + int(BUBBLE_MS * 1e6)))
            time.sleep(BUBBLE_MS / 1e3)
            listeners.send(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()))
            time.sleep(gap_s)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    steps = json.loads(stats.read_text())["steps"]
    first: dict[int, float] = {}
    for st in steps:
        seq = st["bubble_seq"]
        if seq not in first or st["start_ns"] < first[seq]:
            first[seq] = st["start_ns"]
    return [(first[s] - next(st["signal_ns"] for st in steps if st["bubble_seq"] == s)) / 1e3
            for s in sorted(first)]


def wakeup_floor_us(count: int, gap_s: float) -> list[float]:
    """The floor: a bare Python process blocked in ``selectors`` on a Unix datagram socket, woken by a
    datagram; latency from the send's timestamp to the receiver's first instruction after the wake-up."""
    import socket
    import struct

    with tempfile.TemporaryDirectory(prefix="bubbles-floor-") as tmp:
        path = str(Path(tmp) / "floor.sock")
        rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        rx.bind(path)
        r_fd, w_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the receiver
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(rx, selectors.EVENT_READ)
            out = []
            while len(out) < count:
                sel.select()
                now = time.monotonic_ns()
                out.append((now - struct.unpack("q", rx.recv(64))[0]) / 1e3)
            os.write(w_fd, json.dumps(out).encode())
            os._exit(0)
        tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        time.sleep(0.2)
        for _ in range(count):
            tx.sendto(struct.pack("q", time.monotonic_ns()), path)
            time.sleep(gap_s)
        os.close(w_fd)
        chunks = []
        while chunk := os.read(r_fd, 1 << 16):
            chunks.append(chunk)
        os.waitpid(pid, 0)
        return [float(x) for x in json.loads(b"".join(chunks))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--signals", type=int, default=3000, help="bubbles to signal (default 3000)")
    p.add_argument("--gap-ms", type=float, default=1.0, help="time between a bubble's end and the next start")
    p.add_argument("--spin-us", type=float, default=500.0,
                   help="also measure with the fill runtime busy-polling this long either side of the predicted "
                        "bubble start ($BUBBLES_SPIN_US; default 500; 0 skips it)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    if args.signals < 100 or args.gap_ms < 0:
        p.error("--signals must be >= 100 and --gap-ms >= 0")
    if not 0 <= args.spin_us <= 10_000:
        p.error("--spin-us must be in [0, 10000]")
    with tempfile.TemporaryDirectory(prefix="bubbles-bench-") as tmp:
        lat = bubble_start_latencies_us(args.signals, args.gap_ms / 1e3, Path(tmp))
    spun: list[float] = []
    if args.spin_us:
        with tempfile.TemporaryDirectory(prefix="bubbles-bench-") as tmp:
            spun = bubble_start_latencies_us(args.signals, args.gap_ms / 1e3, Path(tmp), args.spin_us)
    ref = grpc_round_trips_us(count=min(args.signals, 2000))
    floor = wakeup_floor_us(min(args.signals, 2000), (BUBBLE_MS / 1e3) + args.gap_ms / 1e3)

    def summary(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "p99": percentile(xs, 99), "max": max(xs)}

    result = {
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}, Python {sys.version.split()[0]}",
        "date": time.strftime("%Y-%m-%d"),
        "signals": args.signals, "bubbles_with_a_step": len(lat),
        "bubble_start_us": summary(lat),
        "grpc_round_trip_us": {"median": statistics.median(ref), "p99": percentile(ref, 99)},
        "python_wakeup_floor_us": {"median": statistics.median(floor), "p99": percentile(floor, 99)},
    }
    result["ratio_median"] = result["grpc_round_trip_us"]["median"] / result["bubble_start_us"]["median"]
    result["ratio_p99"] = result["grpc_round_trip_us"]["p99"] / result["bubble_start_us"]["p99"]
    if spun:
        result["spin_us"] = args.spin_us
        result["bubble_start_spinning_us"] = summary(spun)
        result["bubbles_with_a_step_spinning"] = len(spun)
        result["ratio_p99_spinning"] = result["grpc_round_trip_us"]["p99"] / result["bubble_start_spinning_us"]["p99"]
    print("| path | median (us) | p99 (us) |\n| --- | ---: | ---: |")
    print(f"| bubble start: hook send -> fill step start, blocking wait | {result['bubble_start_us']['median']:.1f} | "
          f"{result['bubble_start_us']['p99']:.1f} |")
    if spun:
        sp = result["bubble_start_spinning_us"]
        print(f"| bubble start, busy-poll +-{args.spin_us:g} us around the predicted start | {sp['median']:.1f} | "
              f"{sp['p99']:.1f} |")
    print(f"| reference: gRPC unary round trip, localhost | {result['grpc_round_trip_us']['median']:.1f} | "
          f"{result['grpc_round_trip_us']['p99']:.1f} |")
    print(f"| floor: bare Python process woken by a Unix datagram | "
          f"{result['python_wakeup_floor_us']['median']:.1f} | {result['python_wakeup_floor_us']['p99']:.1f} |")
    print(f"\n{len(lat)} of {args.signals} bubbles started a step; gRPC is {result['ratio_median']:.0f}x slower "
          f"at the median, {result['ratio_p99']:.0f}x at p99" + (
              f"; busy-polling: {len(spun)} bubbles, gRPC {result['ratio_p99_spinning']:.0f}x slower at p99"
              if spun else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
