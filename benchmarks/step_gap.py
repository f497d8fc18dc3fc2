"""The fill runtime's time between two steps of one bubble: bubble time no step uses, however short the steps are.

Real parts end to end, as in ``signal_latency.py``: the agent (``bubbles agent``) starts a real fill process (the SDK
runtime with a ``SpinJob``), and this script plays the training's side with the hook's sender, signalling bubbles of
``--bubble-ms`` predicted to their full length. Within a bubble the runtime runs steps back to back; the gap after
a step is the next step's start minus the step's end (taken when its work is done), both CLOCK_MONOTONIC, read from
the agent's step records. What falls in it: the step's record, the gate's update, and the checks for a finished
job, for signals and for commands (the start is stamped just before the gate's decision, which so counts in the next
step).

    .venv/bin/python benchmarks/step_gap.py [--rounds 6] [--bubbles 40] [--step-us 200] [--json PATH]
    python benchmarks/step_gap.py --device cuda:0 --entry bubbles.fill_examples.batch_inference:BatchInference \
        --args '{"cuda_graphs": true}'     # on a GPU: the gap around real device steps

Per round: the gaps' median and 90th percentile; over rounds: the median of each, with a distribution-free 95%
interval for it (6 rounds or more), and the share of the steps' time the gaps add (median gap / step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bubbles.core import paths, wire
from bubbles.core.api import FillMode
from bubbles.core.cycle import BubbleCycle, BubbleSlot
from bubbles.core.stats import median_interval, percentile
from bubbles.training.hook import Listeners

TRAINING = "gap"
SPIN = "bubbles.fill_examples.spin:SpinJob"


def gaps_us(bubbles: int, bubble_ms: float, step_us: float, work: Path, entry: str = SPIN,
            job_args: dict[str, object] | None = None, device: str = "cpu") -> tuple[list[float], list[float]]:
    """One round: a fresh agent and fill process, ``bubbles`` bubbles; every in-bubble gap and every step's
    duration, in microseconds.
    ``entry``/``job_args``: the fill job (default a SpinJob of ``step_us``); ``device``: cpu or cuda:N (the agent
    then gives the job that GPU, in a context of its own)."""
    run_dir = work / "run"
    spec = work / "spin.json"
    spinning = entry == SPIN
    spec.write_text(json.dumps({"name": "spin", "entry": entry,
                                "args": {"step_us": step_us} if spinning else (job_args or {}),
                                "memory": "1Mi" if spinning else "2Gi", "stage": 0,
                                **({"step_time": f"{step_us * 1.5 / 1000:g}ms"} if spinning else {})}))
    stats, ready = work / "stats.json", work / "ready"
    extra = ["--devices", device, "--isolation", "contexts"] if device != "cpu" else ["--no-pin-cores"]
    log = work / "agent.log"  # a file, not a pipe: nobody reads while a round runs, and a full pipe blocks the agent
    with log.open("w") as log_file:
        agent = subprocess.Popen(
            [sys.executable, "-m", "bubbles.cli", "agent", "--run-dir", str(run_dir), "--training", TRAINING,
             "--executors", "1", "--fill-job", str(spec), "--mode", FillMode.HARVEST.label, "--stats", str(stats),
             "--ready-file", str(ready), "--log-level", "WARNING", *extra],
            stdout=subprocess.DEVNULL, stderr=log_file, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("step_gap: the agent did not start: " + _agent_said(agent, stats, log))
            time.sleep(0.05)
        key = paths.GpuKey(paths.LOCAL_NAMESPACE, TRAINING, 0)  # rank 0 of stage 0, the local agent's first GPU
        listeners = Listeners(paths.gpu_dir(run_dir, key))
        length_s = bubble_ms / 1e3
        cycle = BubbleCycle(training=TRAINING, stage=0, stages=2, microbatches=8, schedule="TrainSchedule",
                            iteration_s=length_s * 2, samples=5,
                            slots=(BubbleSlot(0, 3, "RecvGrad", "fwd-bwd", length_s, length_s, length_s, 16 << 30),))
        listeners.refresh()
        listeners.send(wire.encode_profile(0, cycle.to_dict()))
        fill_sock = paths.fill_socket(run_dir, key, "spin")
        deadline = time.monotonic() + float(os.environ.get("STEP_GAP_ARM_TIMEOUT_S", "300"))
        while not fill_sock.exists():  # created, initialized (a GPU job profiles its steps) and armed
            if time.monotonic() > deadline or agent.poll() is not None:
                raise SystemExit("step_gap: the fill job never armed; the agent said: "
                                 + _agent_said(agent, stats, log))
            time.sleep(0.01)
        listeners.refresh()
        for seq in range(1, bubbles + 1):
            start = time.monotonic_ns()
            listeners.send(wire.encode_bubble_start(0, 0, seq, start, start + int(length_s * 1e9)))
            time.sleep(length_s)
            listeners.send(wire.encode_bubble_end(0, 0, seq, time.monotonic_ns()))
            time.sleep(length_s / 2)
    finally:
        _stop(agent)
    steps = sorted(json.loads(stats.read_text())["steps"], key=lambda s: s["start_ns"])
    out = []
    for a, b in itertools.pairwise(steps):
        if a["bubble_seq"] == b["bubble_seq"]:
            out.append((b["start_ns"] - a["end_ns"]) / 1e3)
    return out, [(st["end_ns"] - st["start_ns"]) / 1e3 for st in steps]


def _stop(agent: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the agent stops its fill process and writes its stats), SIGKILL after 30 s."""
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def _agent_said(agent: subprocess.Popen[bytes], stats: Path, log: Path) -> str:
    """The agent's last words on the job, once it has stopped: its stats' job record (state, reason, last error)
    and the end of its log."""
    _stop(agent)
    try:
        jobs = json.loads(stats.read_text()).get("jobs", []) if stats.exists() else []
    except ValueError:
        jobs = []
    err = log.read_text(errors="replace").strip() if log.exists() else ""
    return json.dumps([{k: j.get(k) for k in ("name", "state", "reason", "last_error")} for j in jobs]) + \
        (f"; its log: {err[-1500:]}" if err else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="step_gap.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="fresh agent and fill process per round (default 6)")
    p.add_argument("--bubbles", type=int, default=40, help="bubbles per round (default 40)")
    p.add_argument("--bubble-ms", type=float, default=20.0, help="each bubble's length (default 20)")
    p.add_argument("--step-us", type=float, default=200.0, help="each step's spin (default 200)")
    p.add_argument("--entry", default=SPIN, help=f"the fill job (default {SPIN}, spinning --step-us on the host)")
    p.add_argument("--args", default="{}", help="its keyword arguments, a JSON object (not for the default)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N: the GPU the agent gives the job")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.bubbles < 1 or not args.bubble_ms > 0 or not 0 < args.step_us < args.bubble_ms * 500:
        p.error("--rounds and --bubbles must be >= 1, --bubble-ms > 0 and --step-us > 0 and under half a bubble")
    try:
        job_args = json.loads(args.args)
    except json.JSONDecodeError:
        job_args = None
    if not isinstance(job_args, dict):
        p.error(f"--args {args.args!r}: give a JSON object, e.g. '{{\"batch_size\": 8}}'")
    if args.device != "cpu" and not (args.device.startswith("cuda:") and args.device[5:].isdigit()):
        p.error(f"--device {args.device}: give cpu or cuda:N")
    medians, p90s, counts, step_medians = [], [], [], []
    for k in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bubbles-gap-") as tmp:
            g, durations = gaps_us(args.bubbles, args.bubble_ms, args.step_us, Path(tmp), args.entry, job_args,
                                   args.device)
        step_medians.append(statistics.median(durations) if durations else float("nan"))
        if len(g) < 10:
            raise SystemExit(f"step_gap: round {k + 1} ran only {len(durations)} steps in {args.bubbles} bubbles, "
                             f"{len(g)} of them after another of the same bubble: lengthen --bubble-ms")
        medians.append(statistics.median(g))
        p90s.append(percentile(g, 90))
        counts.append(len(g))
        print(f"round {k + 1}: {len(g)} gaps, median {medians[-1]:.1f} us, p90 {p90s[-1]:.1f} us", file=sys.stderr)
    med, p90 = statistics.median(medians), statistics.median(p90s)
    iv, iv90 = median_interval(medians), median_interval(p90s)

    def fmt(v: float, i: tuple[float, float] | None) -> str:
        return f"{v:.1f}" + (f" [{i[0]:.1f}, {i[1]:.1f}]" if i else "")

    step = statistics.median(step_medians)
    print("| gaps per round | step median (us) | gap median (us) | gap p90 (us) | median gap / step |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    print(f"| {statistics.median(counts):.0f} | {step:.1f} | {fmt(med, iv)} | {fmt(p90, iv90)} | {med / step:.1%} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "bubbles": args.bubbles, "bubble_ms": args.bubble_ms,
                                         "step_us": args.step_us, "entry": args.entry, "args": job_args,
                                         "device": args.device, "step_median_us": step, "round_medians_us": medians,
                                         "round_p90s_us": p90s, "median_us": med, "p90_us": p90,
                                         "median_interval_us": iv, "p90_interval_us": iv90}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
