"""The ``bubbles`` command line. Each subcommand lives in its own module and is imported lazily, so
``bubbles --help`` stays fast and a subcommand's heavy imports (torch, deepspeed) load only when used."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help, the extra that installs it)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("bubbles.demo.cli", "run the one-machine harvesting demo on CPU (no GPU, no cluster)", "demo"),
    "agent": ("bubbles.agent.cli", "run the node agent that drives fill jobs in the bubbles", "agent"),
    "simulate": (
        "bubbles.operator.simulator.cli",
        "estimate what harvesting would recover on a cluster (event-driven simulator)",
        "simulate",
    ),
    "operator": (
        "bubbles.operator.cli", "run the Kubernetes operator that places FillJobs in the bubbles of PipelineTrainings",
        "operator",
    ),
    "template": (
        "bubbles.operator.template", "print the Pod the operator would create for a FillJob placed on a node's stage",
        "operator",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: the subcommands by name and help only (none of their modules is imported, so it works
    on every install, whichever extras it has)."""
    parser = argparse.ArgumentParser(
        prog="bubbles",
        description="Harvest pipeline-parallel training bubbles: run fill jobs while pipeline stages idle.",
        epilog="bubbles COMMAND --help: that command's options",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (_module, help_text, _extra) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def _missing_extra(command: str, exc: ModuleNotFoundError) -> int:
    extra = SUBCOMMANDS[command][2]
    print(f"bubbles {command}: this installation lacks {exc.name or 'a module'} ({exc}); install the part with its "
          f"extra: pip install -c constraints.txt 'bubbles[{extra}]' (from a checkout: '.[{extra}]')", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the parser that is needed: importing every subcommand would load torch for `--help`, and fail
    # where a part is not installed.
    parser = argparse.ArgumentParser(prog="bubbles", add_help=False)
    parser.add_argument("command", nargs="?")
    known, _ = parser.parse_known_args(argv[:1])
    if not argv:
        build_parser().print_help(sys.stderr)  # what there is to run
        return 2
    if known.command not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints usage or the error for an unknown command, and exits
        return 2
    full = argparse.ArgumentParser(prog="bubbles")
    sub = full.add_subparsers(dest="command")
    module_name, help_text, _extra = SUBCOMMANDS[known.command]
    try:
        module = importlib.import_module(module_name)
        p = sub.add_parser(known.command, help=help_text, description=help_text)
        module.add_arguments(p)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "bubbles":
            raise  # a module of this project missing is a broken install, not a missing extra
        return _missing_extra(known.command, exc)
    args = full.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
