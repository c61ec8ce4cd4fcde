"""``dgt bench NAME``: each benchmark module provides add_arguments(parser) and run(args) -> dict."""

from __future__ import annotations

import argparse
import importlib
import json

BENCHES: dict[str, str] = {
    "codec": "DGT estimator + classification + frame packing vs a plain abs().sum() pass",
    "transport": "one large round between two processes: DGT lossless / p=30% vs TCP-only and raw sockets",
    "allreduce": "DGT ring / parameter-server all-reduce vs torch.distributed Gloo",
    "codecs": "encode+decode throughput and compression ratio of every payload codec vs a memory pass",
    "ddp": "DDP training step time: Gloo vs the DGT communication hook (lossless, lossy)",
    "lgc": "learned gradient compression: accuracy and compression ratio, PS and ring variants",
    "hop": "CPU of one lossy ring hop (a DGT round of a chunk), sans-IO on one thread, stage by stage, vs a copy",
    "inspect": "dgt inspect's summary of a synthetic ~100k-packet capture vs scapy's bare read of the file",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks, each against its anchor in the same run (ratios reported)",
                       description="Run a benchmark. Every benchmark measures its anchor in the same run and reports "
                       "the ratio; --json prints one JSON object for scripts.")
    bsub = p.add_subparsers(dest="bench", metavar="NAME")
    for name, help_ in BENCHES.items():
        try:
            mod = importlib.import_module(f"dgt.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dgt.bench.{name}":
                continue
            raise
        bp = bsub.add_parser(name, help=help_.replace("%", "%%"), description=help_)  # argparse %-formats help
        bp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        mod.add_arguments(bp)
        bp.set_defaults(func=lambda args, mod=mod: _run(mod, args), parser=bp)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def _run(mod, args: argparse.Namespace) -> int:
    result = mod.run(args)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        _print_table(result)
    return 0


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=result.get("bench", "benchmark"))
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(v: object) -> str:  # escaped: a key such as ring[dense] is text, not rich markup
        return escape(f"{v:.4g}" if isinstance(v, float) else str(v))

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):  # rows: one line each
            for i, row in enumerate(obj):
                table.add_row(escape(f"{prefix}[{i}]"), "  ".join(f"{escape(str(k))} {fmt(v)}" for k, v in row.items()))
        else:
            table.add_row(escape(prefix), fmt(obj))

    walk("", result)
    Console().print(table)
