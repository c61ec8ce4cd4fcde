"""``dgt demo`` and ``dgt experiment table1``: the command lines of the main job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
from typing import Any

from dgt.experiment.config import ExperimentConfig, NetworkConfig


def _common(p: argparse.ArgumentParser, defaults: ExperimentConfig) -> None:
    """Options both commands share; defaults shown are the command's own."""
    net = defaults.network
    g = p.add_argument_group("network")
    g.add_argument("--network", choices=["auto", "netem", "loopback"], default=net.mode,
                   help="netem (root: namespaces, shaped links, DSCP priority queues), loopback (paced sockets), "
                        "or auto: netem when it works (default: %(default)s)")
    g.add_argument("--rate", default=net.rate, help="link rate of every host, tc units (default: %(default)s)")
    g.add_argument("--queue-limit", type=int, default=net.queue_limit,
                   help="packets per priority-class queue (default: %(default)s)")
    g.add_argument("--no-priority", action="store_true",
                   help="netem: one FIFO queue per link, DSCP bleached (most cloud networks), instead of DSCP "
                        "priority classes")
    g.add_argument("--cross-traffic", default=net.cross_traffic, metavar="RATE",
                   help="netem: a flow paced to RATE ('unpaced': as fast as it goes) from an extra host into the "
                        "server's link through each whole run; its goodput beside the baseline and beside DGT is "
                        "reported")
    g.add_argument("--cross-proto", choices=["udp", "tcp"], default=net.cross_proto,
                   help="protocol of the cross flow (default: %(default)s)")
    g.add_argument("--cross-dscp", type=int, default=net.cross_dscp,
                   help="DSCP of the cross flow (default: %(default)s, best effort)")
    g = p.add_argument_group("training")
    g.add_argument("--workers", type=int, default=defaults.workers, help="K (default: %(default)s)")
    g.add_argument("--target", type=float, default=defaults.target, help="target test accuracy (default: %(default)s)")
    g.add_argument("--max-iters", type=int, default=defaults.max_iters, help="per run (default: %(default)s)")
    g.add_argument("--max-time", type=float, default=defaults.max_time,
                   help="training seconds per run, evaluation excluded (default: %(default)s)")
    g.add_argument("--eval-every", type=int, default=defaults.eval_every, help="iterations (default: %(default)s)")
    g.add_argument("--batch", type=int, default=defaults.batch, help="per worker (default: %(default)s)")
    g.add_argument("--lr", type=float, default=defaults.lr, help="SGD learning rate (default: %(default)s)")
    g.add_argument("--momentum", type=float, default=defaults.momentum, help="(default: %(default)s)")
    g.add_argument("--seed", type=int, default=defaults.seed, help="(default: %(default)s)")
    g = p.add_argument_group("protocol")
    g.add_argument("--server", default=defaults.server,
                   help="parameter server rank or 'sharded' (default: %(default)s)")
    g.add_argument("--lossy-pull", action=argparse.BooleanOptionalAction, default=defaults.lossy_pull,
                   help="DGT on the server's pull too, not only on the workers' push (default: %(default)s)")
    g.add_argument("--deadline", default=defaults.deadline,
                   help="how long a receiver waits for unimportant blocks after the last important one "
                        "(default: %(default)s)")
    g.add_argument("--cc", action=argparse.BooleanOptionalAction, default=defaults.congestion_control,
                   help="congestion control of the UDP lanes (LEDBAT-like rate + send budget; --no-cc: every "
                        "unimportant block is sent, unpaced, as before) (default: %(default)s)")
    g.add_argument("--dgt-codec", default=defaults.codecs["dgt"], help="the DGT codec spec (default: %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=defaults.out_dir, help="directory for results.json, report.md, PNGs, logs "
                                                          "(default: %(default)s)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--json", action="store_true", help="print results.json's comparison on stdout at the end")


def _config(args: argparse.Namespace, base: ExperimentConfig, **extra: Any) -> ExperimentConfig:
    net = NetworkConfig(mode=args.network, rate=args.rate, queue_limit=args.queue_limit,
                        cross_traffic=args.cross_traffic, priority=not args.no_priority,
                        cross_proto=args.cross_proto, cross_dscp=args.cross_dscp)
    codecs = dict(base.codecs, dgt=args.dgt_codec)
    return dataclasses.replace(
        base, network=net, workers=args.workers, target=args.target, max_iters=args.max_iters,
        max_time=args.max_time, eval_every=args.eval_every, batch=args.batch, lr=args.lr, momentum=args.momentum,
        seed=args.seed, server=args.server, lossy_pull=args.lossy_pull, deadline=args.deadline, codecs=codecs,
        out_dir=args.out, plots=not args.no_plots, congestion_control=args.cc, **extra,
    )


def _run(cfg: ExperimentConfig, print_json: bool = False) -> int:
    from dgt.experiment.console import Reporter
    from dgt.experiment.runner import run_experiment

    ui = Reporter()
    via_dgt = os.path.basename(sys.argv[0]) in ("dgt", "__main__.py")  # not when called as a library (tests)
    command = shlex.join(["dgt", *sys.argv[1:]]) if via_dgt else None
    # SIGTERM unwinds like Ctrl-C, so rank processes are killed and namespaces removed on the way out; a process
    # forked from this one (pyroute2 forks helpers to enter namespaces) just exits, as it would by default
    me = os.getpid()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143) if os.getpid() == me else os._exit(143))
    try:
        results = run_experiment(cfg, ui, command=command)
    finally:
        signal.signal(signal.SIGTERM, previous)
    ui.table(results)
    for r in results["runs"]:
        cf = (r.get("summary") or {}).get("cross_flow")
        if cf and cf.get("goodput_training_bps") is not None:
            ui.note(f"cross flow ({cf['proto'].upper()} {cf['rate']}) beside {r['model']} {r['protocol']}: "
                    f"{cf['goodput_training_bps'] / 1e6:.2f} Mbit/s during the training iterations"
                    + ("" if cf.get("spans_run") else " [red](did not span the whole run)[/red]"))
    ui.note(f"results: {cfg.out_dir}/results.json, report: {cfg.out_dir}/report.md"
            + (", plots: " + ", ".join(f"{cfg.out_dir}/{p}" for p in results.get("plots", {}).values())
               if results.get("plots") else ""))
    if print_json:
        print(json.dumps(results["comparisons"], indent=1))
    failed = [r for r in results["runs"] if "error" in r]
    for r in failed:
        ui.note(f"[red]{r['model']} {r['protocol']} failed:[/red] {r['error'][-1500:]}")
    return 1 if failed else 0


def _checked(args: argparse.Namespace, base: ExperimentConfig, **extra: Any) -> ExperimentConfig:
    """The configuration, or the parser's usage error (exit status 2) naming what is wrong: a value the options'
    types let through that the experiment cannot run (``--workers 1``, ``--target 2``, ``--server 9``, a rate
    tc does not read) is refused at the door, not by a traceback from inside the run."""
    from dgt.errors import DgtError
    from dgt.netem.spec import parse_rate

    try:
        cfg = _config(args, base, **extra)
        from dgt.experiment.models import MODELS

        unknown = [m for m in cfg.models if m not in MODELS]
        if unknown or not cfg.models:
            raise ValueError(f"models: choose from {', '.join(MODELS)}, got {', '.join(unknown) or 'none'}")
        parse_rate(cfg.network.rate)
        if cfg.network.cross_traffic not in (None, "unpaced"):
            parse_rate(cfg.network.cross_traffic)
    except (ValueError, DgtError) as exc:
        args.parser.error(str(exc))
    return cfg


def demo(args: argparse.Namespace) -> int:
    return _run(_checked(args, ExperimentConfig.demo()), args.json)


def table1(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    cfg = _checked(args, ExperimentConfig(), models=models, dataset=args.dataset, data_dir=args.data_dir,
                   width=args.width)
    return _run(cfg, args.json)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``demo`` and ``experiment`` (with ``experiment table1``) to the ``dgt`` command line."""
    d = subparsers.add_parser(
        "demo", help="the main job on a small built-in default: baseline vs DGT, AlexNet, 4 workers (< 5 min)",
        description="Train a scaled AlexNet on scikit-learn's digits with 4 workers through a parameter server, once "
        "with every gradient over TCP (baseline) and once with DGT, over an emulated bottleneck (netem namespaces "
        "when run as root, paced loopback otherwise), and print batch completion time and time to the target "
        "accuracy for both.",
    )
    _common(d, ExperimentConfig.demo())
    d.set_defaults(func=demo, parser=d)

    e = subparsers.add_parser("experiment", help="reproduce the DGT paper's experiments in emulation")
    esub = e.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    t = esub.add_parser(
        "table1", help="Table 1: BCT, iterations and time to target accuracy, baseline vs DGT, AlexNet and VGG-11",
        description="Reproduce Table 1 of the DGT paper: for each model, train with K workers under the same "
        "emulated network with the baseline and with DGT (n=1024, alpha=0.3, p0=1, p = p0*loss/loss0); report BCT, "
        "total iterations and total time to the target accuracy, bytes per lane and drops.",
    )
    base = ExperimentConfig()
    t.add_argument("--models", default=",".join(base.models), help="comma-separated: alexnet, vgg11 "
                                                                   "(default: %(default)s)")
    t.add_argument("--dataset", default=base.dataset, choices=["digits", "fashion-mnist"],
                   help="digits (built in) or fashion-mnist (IDX files in --data-dir) (default: %(default)s)")
    t.add_argument("--data-dir", default=None, help="directory of the Fashion-MNIST IDX files (.gz or plain)")
    t.add_argument("--width", type=int, default=base.width, help="model width multiplier (default: %(default)s)")
    _common(t, base)
    t.set_defaults(func=table1, parser=t)
    from dgt.experiment.ddp_cli import add_ddp_parser

    add_ddp_parser(esub)
    from dgt.experiment.codecs_cli import add_parser as add_codecs

    add_codecs(esub)
    e.set_defaults(func=lambda args: (e.print_help(), 2)[1])
