"""``dgt experiment ddp``: the command line of the DDP drop-in comparison."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys

from dgt.experiment.config import NetworkConfig
from dgt.experiment.ddp_config import ARMS, PROFILES, DDPConfig
from dgt.experiment.workloads import MODELS


def ddp(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from dgt.experiment.console import Reporter
    from dgt.experiment.ddp_report import table
    from dgt.experiment.ddp_runner import run_ddp

    cfg = checked(args)
    ui = Reporter()
    via_dgt = os.path.basename(sys.argv[0]) in ("dgt", "__main__.py")
    command = shlex.join(["dgt", *sys.argv[1:]]) if via_dgt else None
    me = os.getpid()  # SIGTERM unwinds like Ctrl-C so namespaces are removed (see cli._run)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143) if os.getpid() == me else os._exit(143))
    try:
        results = run_ddp(cfg, ui, command=command)
    except RuntimeError as exc:  # the network cannot be built (--network netem without root); arms fail on their own
        ui.note(f"[red]error:[/red] {exc}")
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    if results.get("skipped"):
        ui.note(results["skipped"])
        return 0
    if len(results["seeds"]) > 1:
        ui.note(escape(f"median [min–max] over seeds {', '.join(map(str, results['seeds']))}; ratios of medians"))
    for line in table(results["stats"], results["ratios"]):
        print(line)
    ui.note(f"results: {cfg.out_dir}/results.json, report: {cfg.out_dir}/report.md")
    if args.json:
        print(json.dumps(results["ratios"], indent=1))
    return 1 if any("error" in r for r in results["runs"]) else 0


def checked(args: argparse.Namespace) -> DDPConfig:
    """The configuration, or ``BadOption`` (the parser's usage error, exit status 2) naming what is wrong: a value
    the options' types let through that no arm can run (``--workers 1``, ``--batch 0``, ``--target 2`` for an
    accuracy, a rate tc does not read) is refused at the door, not by a traceback or by every arm failing in turn."""
    from dgt.cliargs import BadOption
    from dgt.errors import DgtError
    from dgt.netem.spec import parse_rate

    base = DDPConfig()
    try:
        net = NetworkConfig(mode=args.network, rate=args.rate, queue_limit=args.queue_limit,
                            prefix=base.network.prefix)
        parse_rate(net.rate)
        if net.queue_limit < 1:
            raise ValueError(f"queue-limit must be at least 1 packet, got {net.queue_limit}")
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        return DDPConfig(arms=arms, profile=args.profile, model=args.model, workers=args.workers, batch=args.batch,
                         lr=args.lr, seed=args.seed, seeds=args.seeds or [], target=args.target,
                         eval_every=args.eval_every, max_iters=args.max_iters, max_time=args.max_time, network=net,
                         out_dir=args.out, plots=not args.no_plots)
    except (ValueError, DgtError) as exc:
        raise BadOption(str(exc)) from None


def seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2``: distinct non-negative integers."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        seeds = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"need distinct non-negative seeds, got {text!r}")
    return seeds


def add_ddp_parser(esub: argparse._SubParsersAction) -> None:
    base = DDPConfig()
    p = esub.add_parser(
        "ddp", help="a plain DDP trainer: Gloo vs fp16 vs PowerSGD vs the DGT hook and backend, on one network profile",
        description="Train the same model, data and seed with torch DistributedDataParallel in K processes (each in "
        "its own emulated host, env:// rendezvous as under torchrun), once per arm: " + "; ".join(
            f"{a}: {d}" for a, d in ARMS.items()) + ". Report time to target, steps, step time (p50, p95), bytes, "
        "drops; with --seeds, every arm once per seed and the median [min-max] over the seeds.",
    )
    p.add_argument("--profile", choices=list(PROFILES), default=base.profile,
                   help="; ".join(f"{k}: {v}" for k, v in PROFILES.items()).replace("%", "%%")
                   + " (default: %(default)s)")
    p.add_argument("--arms", default=",".join(base.arms), help="comma-separated (default: %(default)s)")
    p.add_argument("--network", choices=["auto", "netem", "loopback"], default="auto",
                   help="netem (root), loopback (nothing shaped), auto: netem when it works (default: %(default)s)")
    p.add_argument("--rate", default=base.network.rate, help="every host link, tc units (default: %(default)s)")
    p.add_argument("--queue-limit", type=int, default=base.network.queue_limit, help="packets (default: %(default)s)")
    p.add_argument("--model", default=base.model, choices=list(MODELS),
                   help="alexnet/vgg11 (plain SGD), resnet[-s|-l] (momentum SGD + weight decay, digits at 16x16) or "
                   "gpt[-s|-l] (AdamW, byte-level stdlib source; the target is a validation loss); the family sets "
                   "the defaults of --lr, --batch, --target, --eval-every, --max-time (docs/experiment-ddp.md) "
                   "(default: %(default)s)"),
    p.add_argument("--workers", type=int, default=base.workers, help="K (default: %(default)s)")
    p.add_argument("--target", type=float, default=None,
                   help="test accuracy, or gpt's validation loss (default: the model family's; alexnet 0.97)")
    p.add_argument("--max-iters", type=int, default=base.max_iters, help="per arm (default: %(default)s)")
    p.add_argument("--max-time", type=float, default=None, help="training s per arm (default: the family's; alexnet "
                   "150)")
    p.add_argument("--eval-every", type=int, default=None, help="steps (default: the family's; alexnet 2)")
    p.add_argument("--batch", type=int, default=None, help="per worker (default: the family's; alexnet 32)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the family's; alexnet 0.1)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=base.seed, help="one run per arm (default: %(default)s)")
    seeds.add_argument("--seeds", type=seed_list, default=None, metavar="S,S,...",
                       help="every arm once per seed (e.g. 0,1,2); report the median [min-max] over the seeds")
    p.add_argument("--out", default=base.out_dir, help="output directory (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--json", action="store_true", help="print the ratios against Gloo as JSON at the end")
    p.set_defaults(func=ddp, parser=p)
