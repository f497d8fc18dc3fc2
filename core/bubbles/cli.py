"""The ``bubbles`` command line. Each subcommand lives in its own module and is imported lazily, so
``bubbles --help`` stays fast and a subcommand's heavy imports (torch, deepspeed) load only when used."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("bubbles.demo.cli", "run the one-machine harvesting demo on CPU (no GPU, no cluster)"),
    "agent": ("bubbles.agent.cli", "run the node agent that drives fill jobs in the bubbles"),
    "simulate": (
        "bubbles.simulator.cli", "estimate what harvesting would recover on a cluster (event-driven simulator)"
    ),
    "operator": (
        "bubbles.operator.cli", "run the Kubernetes operator that places FillJobs in the bubbles of PipelineTrainings"
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bubbles",
        description="Harvest pipeline-parallel training bubbles: run fill jobs while pipeline stages idle.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the parser that is needed: importing every subcommand would load torch for `--help`.
    parser = argparse.ArgumentParser(prog="bubbles", add_help=False)
    parser.add_argument("command", nargs="?")
    known, _ = parser.parse_known_args(argv[:1])
    if known.command not in SUBCOMMANDS:
        full = build_parser()
        full.parse_args(argv)  # prints usage or the error for an unknown command, and exits
        return 2
    full = argparse.ArgumentParser(prog="bubbles")
    sub = full.add_subparsers(dest="command")
    module_name, help_text = SUBCOMMANDS[known.command]
    module = importlib.import_module(module_name)
    p = sub.add_parser(known.command, help=help_text, description=help_text)
    module.add_arguments(p)
    args = full.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
