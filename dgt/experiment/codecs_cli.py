"""``dgt experiment codecs``: the command line (options, progress on the console, the final table)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from typing import Any

from dgt.cliargs import COUNT, NON_NEGATIVE, POSITIVE, BadOption, number
from dgt.errors import DgtError


def add_parser(esub: argparse._SubParsersAction) -> None:
    from dgt.experiment.codecs_run import CODECS, OPT_IN, CodecsConfig
    from dgt.experiment.ddp_config import PROFILES

    base = CodecsConfig()
    c = esub.add_parser(
        "codecs", help="every codec (dense, DGT, Slim-DP, QSGD, Oland-Raj, DCD, ECD, LGC-PS, LGC-ring) trained over "
                       "the real transport, with each paper's headline measure beside the paper's figure",
        description="Train the same model on digits once per codec, each run in K worker processes talking through "
        "the DGT transport on the network profile of `dgt experiment ddp` (netem namespaces as root, else paced "
        "loopback), and report accuracy, bytes per step, time to the target accuracy "
        "and each paper's own headline measure beside the paper's figure (results.json, report.md, codecs.png).",
    )
    c.add_argument("--codecs", default=",".join(base.codecs),
                   help=f"comma-separated, from {', '.join(CODECS)} (dense is always run) (default: all of these) "
                        f"and, only when named, {', '.join(OPT_IN)}")
    c.add_argument("--model", default=base.model, choices=["alexnet", "vgg11"], help="(default: %(default)s)")
    c.add_argument("--workers", type=int, default=base.workers, help="K processes (default: %(default)s)")
    c.add_argument("--iters", type=int, default=base.iters, help="training steps per codec (default: %(default)s)")
    c.add_argument("--batch", type=int, default=base.batch, help="per worker (default: %(default)s)")
    c.add_argument("--lr", type=POSITIVE, default=base.lr, help="SGD learning rate (default: %(default)s)")
    c.add_argument("--seed", type=NON_NEGATIVE, default=base.seed, help="(default: %(default)s)")
    c.add_argument("--target", type=float, default=base.target, help="target test accuracy (default: %(default)s)")
    c.add_argument("--eval-every", type=int, default=base.eval_every, help="steps (default: %(default)s)")
    c.add_argument("--deadline", default=base.deadline,
                   help="how long a receiver waits for droppable blocks (default: %(default)s)")
    c.add_argument("--lgc-topk", type=number(0.0, 1.0, above=True), default=base.lgc_topk,
                   help="LGC top-k ratio (default: %(default)s)")
    c.add_argument("--profile", choices=list(PROFILES), default=base.profile,
                   help="; ".join(f"{k}: {v}" for k, v in PROFILES.items()).replace("%", "%%")
                   + " (netem only; default: %(default)s)")
    c.add_argument("--network", choices=["auto", "netem", "loopback"], default=base.network.mode,
                   help="netem (root), loopback (no shared queue; UDP lanes paced by the transport, TCP asked to "
                        "pace with SO_MAX_PACING_RATE, which the report checks), auto: netem when it works "
                        "(default: %(default)s)")
    c.add_argument("--rate", default=base.network.rate,
                   help="link rate of every host, tc units; on loopback each connection is paced to rate / (K - 1) "
                        "(default: %(default)s)")
    c.add_argument("--queue-limit", type=COUNT, default=base.network.queue_limit,
                   help="netem: packets per queue (default: %(default)s)")
    c.add_argument("--timeout", type=POSITIVE, default=base.timeout,
                   help="seconds per codec run (default: %(default)s)")
    c.add_argument("--out", default=base.out_dir, help="directory for results.json, report.md, codecs.png "
                                                      "(default: %(default)s)")
    c.add_argument("--no-plots", action="store_true", help="skip the PNG")
    c.add_argument("--shared-processes", action="store_true",
                   help="train every codec in one set of K processes (one spawn; a failing codec fails the rest) "
                        "instead of fresh processes per codec")
    c.set_defaults(func=run, parser=c)


def config_from_args(args: argparse.Namespace) -> Any:
    from dgt.experiment.codecs_run import CodecsConfig

    base = CodecsConfig()
    names = [n.strip() for n in args.codecs.split(",") if n.strip()]
    if "dense" not in names:
        names.insert(0, "dense")
    try:
        return _config(args, base, names)
    except (ValueError, DgtError) as exc:  # a value no codec run can take: the usage error, before anything starts
        raise BadOption(str(exc)) from None


def _config(args: argparse.Namespace, base: Any, names: list[str]) -> Any:
    from dgt.experiment.codecs_run import CodecsConfig
    from dgt.experiment.config import NetworkConfig
    from dgt.netem.spec import parse_rate
    from dgt.protocol.deadline import make_deadline

    parse_rate(args.rate)
    make_deadline(args.deadline)
    return CodecsConfig(codecs=names, model=args.model, workers=args.workers, iters=args.iters, batch=args.batch,
                        lr=args.lr, seed=args.seed, target=args.target, eval_every=args.eval_every,
                        deadline=args.deadline, lgc_topk=args.lgc_topk,
                        profile=args.profile, out_dir=args.out,
                        network=NetworkConfig(mode=args.network, rate=args.rate, queue_limit=args.queue_limit,
                                              prefix=base.network.prefix),
                        plots=not args.no_plots, timeout=args.timeout,
                        isolate=not args.shared_processes)


def progress_line(rec: dict[str, Any]) -> str:
    return (f"  {rec['codec']:<9} step {rec['it']:>4}/{rec['iters']}  acc {rec['acc']:.3f}  loss {rec['loss']:.3f}  "
            f"trained {rec['train_time']:.1f} s  sent {rec['sent']:,} B this step (rank 0)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dgt.experiment.codecs_report import console_table
    from dgt.experiment.codecs_run import run_codecs

    cfg = config_from_args(args)
    console = Console(width=None if sys.stdout.isatty() else 170)
    via_dgt = os.path.basename(sys.argv[0]) in ("dgt", "__main__.py")
    command = shlex.join(["dgt", *sys.argv[1:]]) if via_dgt else None

    def done(name: str, entry: dict[str, Any]) -> None:
        if "error" in entry:
            console.print(f"[red]{name} failed:[/red] {entry['error'][-1500:]}")
        else:
            console.print(f"[bold]{name}[/bold]: accuracy {100 * entry['final_accuracy']:.2f} %, "
                          f"{entry['bytes_per_step']:,.0f} B/step, rank 0 wall {entry['rank0_wall_time']:.0f} s")

    console.print(f"[bold]codecs:[/bold] {', '.join(cfg.codecs)}; {cfg.workers} processes each, {cfg.iters} steps")
    me = os.getpid()  # SIGTERM unwinds like Ctrl-C so rank processes and namespaces are removed (see ddp_cli)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143) if os.getpid() == me else os._exit(143))
    try:
        results = run_codecs(cfg, progress_line, command, done)
    except RuntimeError as exc:  # the network cannot be built (--network netem without root)
        console.print(f"[red]error:[/red] {exc}")
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    net = results["network"]
    console.print(f"[bold]network ({net['mode']}, profile {results['profile']}):[/bold] {net['description']}")
    if results.get("skipped"):
        console.print(f"[yellow]skipped:[/yellow] {results['skipped']}")
        return 0
    console.print(console_table(results))
    console.print(f"results: {cfg.out_dir}/results.json, report: {cfg.out_dir}/report.md"
                  + (f", plot: {cfg.out_dir}/{results['plot']}" if results.get("plot") else ""))
    return 1 if any("error" in r for r in results["runs"].values()) else 0
