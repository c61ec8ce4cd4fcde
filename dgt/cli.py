"""``dgt`` command line. Each area adds its own subcommand through an ``add_parser(subparsers)`` function."""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, help) for each subcommand; a module provides add_parser(subparsers) that sets func=callable(args)->int
SUBCOMMANDS: list[tuple[str, str]] = [
    ("dgt.experiment.cli", "demo / experiment: reproduce the DGT paper's Table 1 in emulation"),
    ("dgt.bench.cli", "bench: benchmarks against their anchors (codec, transport, allreduce, codecs, ddp, lgc)"),
    ("dgt.netem.cli", "netem: network emulation with namespaces, shaped links and DSCP priority queues"),
    ("dgt.inspect.cli", "inspect / capture: dissect DGT traffic from pcap files or live interfaces"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgt",
        description="Differential Gradient Transmission: important gradient blocks over reliable TCP with high DSCP, "
        "the rest over best-effort UDP with low DSCP, dropped at a deadline.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, _help in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # that area is not built yet
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
