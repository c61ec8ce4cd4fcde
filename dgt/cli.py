"""``dgt`` command line. Each area adds its own subcommand through an ``add_parser(subparsers)`` function."""

from __future__ import annotations

import argparse
import importlib
import sys

from dgt.cliargs import BadOption
from dgt.extras import missing_extra_message

# module -> the subcommands it adds; a module provides add_parser(subparsers) that sets func=callable(args)->int
SUBCOMMANDS: dict[str, tuple[str, ...]] = {
    "dgt.experiment.cli": ("demo", "experiment"),
    "dgt.bench.cli": ("bench",),
    "dgt.netem.cli": ("netem",),
    "dgt.inspect.cli": ("inspect", "capture"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """All subcommands for --help; only the named one's module otherwise (so `dgt netem` never imports torch)."""
    parser = argparse.ArgumentParser(
        prog="dgt",
        description="Differential Gradient Transmission: important gradient blocks over reliable TCP with high DSCP, "
        "the rest over best-effort UDP with low DSCP, dropped at a deadline.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    first = next((a for a in (argv or []) if not a.startswith("-")), None)
    wanted = [m for m, cmds in SUBCOMMANDS.items() if first in cmds] or list(SUBCOMMANDS)
    for module in wanted:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # that area is not built yet
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except BadOption as exc:  # a value the command cannot run, found before it started: its usage error
        getattr(args, "parser", parser).error(str(exc))
        return 2  # not reached: error() exits
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc, args.command)
        if message is None:
            raise
        print(f"dgt: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
