"""``bubbles agent``: run the node agent for one training on this machine.

Starts one executor per local pipeline stage, binds ``<run_dir>/<training>/stage-<k>/agent.sock``,
writes ``--ready-file`` once every socket is bound, and serves until SIGTERM/SIGINT; then it stops
the fill jobs, writes ``--stats`` and exits 0. Bad input (no such spec file, an invalid spec,
``--executors 0``) exits 2 with a message saying what to fix.
"""

from __future__ import annotations

import argparse
import logging
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


def _fail(message: str) -> int:
    print(f"bubbles agent: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bubbles import wire

    from .server import Agent, AgentConfig
    from .spec import SpecError, load_spec

    if args.executors < 1:
        return _fail(f"--executors must be >= 1 (one per local pipeline stage), got {args.executors}")
    if not args.grace_ms > 0:
        return _fail(f"--grace-ms must be > 0, got {args.grace_ms}")
    if args.metrics_port < 0 or args.metrics_port > 65535:
        return _fail(f"--metrics-port must be 0 (off) or a TCP port, got {args.metrics_port}")
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
            ready_file=args.ready_file,
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
