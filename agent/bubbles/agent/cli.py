"""``bubbles agent``: run the node agent for one training on this machine.

Starts one executor per local pipeline stage, binds ``<run_dir>/<training>/stage-<k>/agent.sock``,
writes ``--ready-file`` once every socket is bound, and serves until SIGTERM/SIGINT; then it stops
the fill jobs, writes ``--stats`` and exits 0. Bad input (no such spec file, an invalid spec,
``--executors 0``, a bad ``--devices`` entry, an ``--mps-control`` that is not an executable) exits 2
with a message saying what to fix.

Isolation (``--isolation contexts|mps|none``, docs/gpu.md) fails closed: while the chosen mode does
not work, fill jobs wait and the status says why, unless ``--allow-unisolated`` is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from bubbles import paths

_MODES = {"off": 0, "naive": 1, "harvest": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="directory of the node-local sockets (default: $BUBBLES_RUN_DIR, "
                             "/run/bubbles or /tmp/bubbles-<uid>)")
    parser.add_argument("--training", default=None,
                        help="training name (default: $BUBBLES_TRAINING or 'default')")
    parser.add_argument("--executors", type=int, default=1,
                        help="executors, one per local pipeline stage (CPU: executor k uses core k %% cores)")
    parser.add_argument("--fill-job", action="append", default=[], metavar="FILE",
                        help="fill-job spec (YAML or JSON); repeatable")
    parser.add_argument("--mode", choices=list(_MODES), default="harvest",
                        help="initial fill mode; the training's FILL_MODE messages switch it per stage")
    parser.add_argument("--grace-ms", type=float, default=50.0,
                        help="SIGKILL a fill job still in a step this long after its bubble ended")
    parser.add_argument("--slowdown-budget", type=float, default=0.01,
                        help="training slowdown the guard tolerates (0.01 = 1%%)")
    parser.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                        help="pin executor k's fill processes to CPU core k %% cores")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = no endpoint)")
    parser.add_argument("--metrics-addr", default="127.0.0.1", help="Prometheus bind address")
    parser.add_argument("--stats", type=Path, default=None, help="write the stats JSON here on exit")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="written once every socket is bound (wait for it before starting the training)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    gpu = parser.add_argument_group("devices and isolation (see docs/gpu.md)")
    gpu.add_argument("--devices", default=None, metavar="LIST",
                     help="comma-separated cpu or cuda:N, one per executor (executor k gets entry k %% len); "
                          "default: CPU core k stands in for stage k's accelerator")
    gpu.add_argument("--isolation", choices=["contexts", "mps", "none"], default="contexts",
                     help="contexts (default): separate CUDA contexts, a fault in a fill job stays in that job; "
                          "mps: MPS clients with enforced memory limits and concurrent kernels, but one fault "
                          "domain with the training; none: unisolated sharing")
    gpu.add_argument("--allow-unisolated", action="store_true",
                     help="run fill jobs even while the chosen isolation does not work (status says "
                          "'unisolated'); default: fail closed, fill jobs wait")
    gpu.add_argument("--mps-control", default=None, metavar="PATH",
                     help="the MPS control program (default: nvidia-cuda-mps-control on PATH)")
    gpu.add_argument("--mps-pipe-dir", type=Path, default=None, metavar="DIR",
                     help="MPS pipe directory, shared with the training (default: $CUDA_MPS_PIPE_DIRECTORY or "
                          "/tmp/nvidia-mps)")
    gpu.add_argument("--mps-log-dir", type=Path, default=None, metavar="DIR",
                     help="MPS log directory (default: $CUDA_MPS_LOG_DIRECTORY or /var/log/nvidia-mps; a "
                          "directory under the run dir if that is not writable)")
    gpu.add_argument("--mps-thread-percentage", type=int, default=50, metavar="P",
                     help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of each fill client, 1..100 (default 50)")
    gpu.add_argument("--mps-check-interval", type=float, default=1.0, metavar="SECONDS",
                     help="seconds between MPS daemon health checks (default 1)")


def _fail(message: str) -> int:
    print(f"bubbles agent: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bubbles.api import SpecError, load_spec

    from bubbles import wire

    from .isolation import IsolationConfig
    from .launcher import parse_devices
    from .server import Agent, AgentConfig

    if args.executors < 1:
        return _fail(f"--executors must be >= 1 (one per local pipeline stage), got {args.executors}")
    if not args.grace_ms > 0:
        return _fail(f"--grace-ms must be > 0, got {args.grace_ms}")
    if args.metrics_port < 0 or args.metrics_port > 65535:
        return _fail(f"--metrics-port must be 0 (off) or a TCP port, got {args.metrics_port}")
    devices: tuple[str, ...] = ()
    if args.devices is not None:
        try:
            devices = parse_devices(args.devices)
        except ValueError as exc:
            return _fail(str(exc))
    if not 1 <= args.mps_thread_percentage <= 100:
        return _fail(f"--mps-thread-percentage must be 1..100 (a share of the GPU's threads), "
                     f"got {args.mps_thread_percentage}")
    if not args.mps_check_interval > 0:
        return _fail(f"--mps-check-interval must be > 0 seconds, got {args.mps_check_interval}")
    if args.mps_control is not None:
        control = Path(args.mps_control)
        if not control.is_file():
            return _fail(f"--mps-control {control} does not exist; give the path of nvidia-cuda-mps-control "
                         "(or leave it out to find it on PATH)")
        if not os.access(control, os.X_OK):
            return _fail(f"--mps-control {control} is not executable; chmod +x it or give the right path")
    for flag, d in (("--mps-pipe-dir", args.mps_pipe_dir), ("--mps-log-dir", args.mps_log_dir)):
        if d is not None and d.exists() and not d.is_dir():
            return _fail(f"{flag} {d} is a file, not a directory; give a directory")
    training = args.training or paths.default_training()
    try:
        paths.check_name("training", training)
    except ValueError as exc:
        return _fail(str(exc))
    specs = []
    for f in args.fill_job:
        try:
            specs.append(load_spec(f))
        except SpecError as exc:
            return _fail(str(exc))
    try:
        config = AgentConfig(
            run_dir=args.run_dir or paths.default_run_dir(), training=training, executors=args.executors,
            mode=wire.FillMode(_MODES[args.mode]), grace_s=args.grace_ms / 1e3, budget=args.slowdown_budget,
            pin_cores=args.pin_cores, metrics_port=args.metrics_port or None, metrics_addr=args.metrics_addr,
            ready_file=args.ready_file, devices=devices,
            isolation=IsolationConfig(
                mode=args.isolation, allow_unisolated=args.allow_unisolated, mps_control=args.mps_control,
                mps_pipe_dir=args.mps_pipe_dir, mps_log_dir=args.mps_log_dir,
                mps_thread_percentage=args.mps_thread_percentage, check_interval_s=args.mps_check_interval),
        )
        agent = Agent(config, specs)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        agent.start()
    except OSError as exc:
        return _fail(f"cannot bind the agent's sockets under {config.run_dir}: {exc}")

    def on_signal(signum: int, _frame: object) -> None:
        agent.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run()
    finally:
        if args.stats is not None:
            agent.write_stats(args.stats)
            logging.getLogger("bubbles.agent").info("stats written to %s", args.stats)
    return 0
