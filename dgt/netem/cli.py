"""`dgt netem up|status|run|exec|traffic|down|probe`: the emulator from the shell.

`up` leaves the namespaces running and saves the configuration (state.py) so the later commands find it by prefix.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from dgt.errors import DgtError, EmulationUnsupported, PrivilegeRequired

ENV_PREFIX = "DGT_NETEM_PREFIX"


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn dgt errors into one readable line and an exit code instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except PrivilegeRequired as exc:  # not the kernel's fault: say what the process lacks
            print(f"dgt netem {fn.__name__.removeprefix('cmd_')}: {exc}", file=sys.stderr)
            return 4
        except PermissionError as exc:
            print(f"dgt netem {fn.__name__.removeprefix('cmd_')}: needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): "
                  f"{exc}", file=sys.stderr)
            return 4
        except EmulationUnsupported as exc:
            print(f"dgt netem: unsupported on this kernel: {exc}", file=sys.stderr)
            return 3
        except DgtError as exc:
            print(f"dgt netem: error: {exc}", file=sys.stderr)
            return 2

    return wrapper


def _link_args(p: argparse.ArgumentParser, pre: str = "", what: str = "each host link") -> None:
    p.add_argument(f"--{pre}rate", default=None, help=f"rate of {what} per direction, e.g. 100mbit (HTB)")
    p.add_argument(f"--{pre}delay", default=None,
                   help="one-way delay per link direction, e.g. 5ms (netem, or the relay without it)")
    p.add_argument(f"--{pre}jitter", default=None, help="delay variation, uniform ±, e.g. 1ms")
    p.add_argument(f"--{pre}loss", default=None, help="random loss per link direction, e.g. 0.5%% (netem or nftables)")
    p.add_argument(f"--{pre}reorder", default=None, help="share of packets sent at once, e.g. 1%% (needs a delay)")
    p.add_argument(f"--{pre}limit", type=int, default=1000, help="queue limit per class in packets (default 1000)")
    p.add_argument(f"--{pre}no-priority", action="store_true",
                   help="one FIFO instead of DSCP priority classes EF > AF > BE > LE")


def _spec(args: argparse.Namespace, pre: str = "") -> Any:
    from dgt.netem.spec import LinkSpec

    g = lambda k: getattr(args, pre + k)
    return LinkSpec.make(rate=g("rate"), delay=g("delay"), jitter=g("jitter"), loss=g("loss"), reorder=g("reorder"),
                         limit=g("limit"), priority=not g("no_priority"))


def _attach(args: argparse.Namespace) -> Any:
    from dgt.netem.topology import Topology

    return Topology.attach(args.prefix)


@_guard
def cmd_up(args: argparse.Namespace) -> int:
    from dgt.netem.topology import Topology

    bottleneck = _spec(args, "bottleneck_") if args.dumbbell else None
    topo = Topology(hosts=args.hosts, link=_spec(args), dumbbell=args.dumbbell, bottleneck=bottleneck,
                    prefix=args.prefix, subnet=args.subnet, loss_backend=args.loss_backend, replace=args.force,
                    delay_backend=args.delay_backend)
    topo.up()
    if args.json:
        print(json.dumps(topo.to_state() | {"namespaces": topo.namespaces}, indent=2))
    else:
        print(f"up: {topo!r}")
        for h in topo.hosts:
            print(f"  {h.name}  {h.addr:<15} netns {h.ns}")
        print(f"run jobs with `dgt netem run --prefix {topo.prefix} -- CMD`, remove with "
              f"`dgt netem down --prefix {topo.prefix}`")
    return 0


@_guard
def cmd_status(args: argparse.Namespace) -> int:
    from dgt.netem import status

    stats = _attach(args).stats()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        status.render(stats, all_rows=args.all)
    return 0


@_guard
def cmd_down(args: argparse.Namespace) -> int:
    from dgt.netem.topology import teardown

    removed = teardown(args.prefix)
    print(f"down: removed {len(removed)} namespaces" + (f" ({', '.join(removed)})" if removed else ""))
    return 0


def _hosts(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DgtError(f"--hosts takes comma-separated host indices, not {text!r}") from None


def _command(rest: list[str]) -> list[str]:
    cmd = rest[1:] if rest and rest[0] == "--" else rest
    if not cmd:
        raise DgtError("give the command after --, e.g. dgt netem run -- python train.py")
    return cmd


@_guard
def cmd_run(args: argparse.Namespace) -> int:
    from dgt.netem import runner

    topo = _attach(args)
    results = runner.run(topo, _command(args.command), hosts=_hosts(args.hosts), logdir=args.logdir,
                         timeout=args.timeout, fail_fast=not args.no_fail_fast, master_port=args.port)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for r in results:
            code = "killed" if r.killed else f"exit {r.returncode}"
            print(f"== rank {r.rank} on {r.host} ({r.addr}): {code} after {r.seconds:.1f}s, log {r.log}")
            lines = r.output.splitlines()
            for line in lines[-args.tail:] if args.tail > 0 else []:
                print(f"   {line}")
    return runner.exit_code(results)


@_guard
def cmd_exec(args: argparse.Namespace) -> int:
    from dgt.netem import runner

    topo = _attach(args)
    if not 0 <= args.host < topo.n:
        raise DgtError(f"--host must be in 0..{topo.n - 1}")
    env = dict(os.environ) | runner.rank_env(topo, args.host, list(range(topo.n)))
    return topo.popen(args.host, _command(args.command), env=env).wait()


@_guard
def cmd_traffic(args: argparse.Namespace) -> int:
    from dgt.netem.crosstraffic import Flow

    topo = _attach(args)
    flow = Flow(topo, args.src, args.dst, proto=args.proto, dscp=args.dscp, rate=args.rate, duration=args.duration,
                port=args.port).start()
    try:
        res = flow.wait()
    finally:
        flow.kill()
    if args.json:
        print(json.dumps({"sent": res.sent, "received": res.received}, indent=2))
    else:
        print(f"{args.proto} h{args.src} -> h{args.dst} dscp {args.dscp}: sent {res.sent['rate_bps'] / 1e6:.1f} "
              f"Mbit/s, received {res.goodput_bps / 1e6:.1f} Mbit/s")
    return 0


@_guard
def cmd_probe(args: argparse.Namespace) -> int:
    from dgt.netem import probe

    found = probe.probe()
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        for name, ok in found.items():
            what, config, _ = probe.FEATURES[name]
            print(f"{'yes' if ok else 'NO ':<4} {name:<11} {what} ({config})")
    return 0


def _add_up(sub: Any, common: argparse.ArgumentParser, default_subnet: str) -> None:
    """`dgt netem up`."""
    up = sub.add_parser("up", parents=[common], help="create hosts, switch(es) and shaped links; leave them running")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    _link_args(up)
    up.add_argument("--dumbbell", action="store_true", help="two switches joined by a bottleneck link")
    _link_args(up, "bottleneck-", "the bottleneck")
    up.add_argument("--subnet", default=default_subnet, help=f"host addresses (default {default_subnet})")
    up.add_argument("--loss-backend", choices=("auto", "netem", "nft"), default="auto",
                    help="how random loss is made (auto: netem if the kernel has it, else nftables)")
    up.add_argument("--delay-backend", choices=("auto", "netem", "relay"), default="auto",
                    help="how delay/jitter/reordering are made (auto: netem if the kernel has it, else a relay "
                         "process per delayed link)")
    up.add_argument("--force", action="store_true", help="remove an existing topology with this prefix first")
    up.add_argument("--json", action="store_true", help="print the saved configuration as JSON")
    up.set_defaults(func=cmd_up)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `dgt netem` and its subcommands."""
    from dgt.netem.spec import DEFAULT_PREFIX, DEFAULT_SUBNET

    netem = subparsers.add_parser("netem", help="network emulation: namespaces, shaped links, DSCP priority queues",
                                  description="Emulated hosts in network namespaces on one box. Needs root.")
    prefix_default = os.environ.get(ENV_PREFIX, DEFAULT_PREFIX)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default=prefix_default,
                        help=f"name prefix of every namespace (default {prefix_default}; env {ENV_PREFIX})")
    sub = netem.add_subparsers(dest="netem_command", metavar="SUBCOMMAND")
    netem.set_defaults(func=lambda a: (netem.print_help(), 0)[1])

    _add_up(sub, common, DEFAULT_SUBNET)

    st = sub.add_parser("status", parents=[common], help="per-link, per-class packet/drop counters")
    st.add_argument("--json", action="store_true", help="machine-readable counters")
    st.add_argument("--all", action="store_true", help="also show classes that carried nothing")
    st.set_defaults(func=cmd_status)

    run = sub.add_parser("run", parents=[common], help="run a command on every host with RANK/WORLD_SIZE/MASTER_*")
    run.add_argument("--hosts", default=None, help="comma-separated host indices (default all); rank = position")
    run.add_argument("--logdir", default=None, help="where h<i>.log files go (default a new temp dir)")
    run.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    run.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    run.add_argument("--no-fail-fast", action="store_true", help="let other ranks run on when one fails")
    run.add_argument("--tail", type=int, default=5, help="log lines shown per rank (default 5)")
    run.add_argument("--json", action="store_true", help="results, with full logs, as JSON")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS ({rank} {world} {addr} filled in)")
    run.set_defaults(func=cmd_run)

    ex = sub.add_parser("exec", parents=[common], help="run one command in one host, attached to this terminal")
    ex.add_argument("--host", type=int, default=0, help="host index (default 0)")
    ex.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS")
    ex.set_defaults(func=cmd_exec)

    tr = sub.add_parser("traffic", parents=[common], help="bounded bulk flow between hosts (cross traffic)")
    tr.add_argument("--src", type=int, default=0)
    tr.add_argument("--dst", type=int, default=1)
    tr.add_argument("--proto", choices=("tcp", "udp"), default="udp")
    tr.add_argument("--dscp", type=int, default=1, help="DSCP mark (default 1 = LE)")
    tr.add_argument("--rate", default=None, help="paced rate, e.g. 150mbit (default: as fast as possible)")
    tr.add_argument("--duration", type=float, default=5.0, help="seconds (default 5)")
    tr.add_argument("--port", type=int, default=5301)
    tr.add_argument("--json", action="store_true")
    tr.set_defaults(func=cmd_traffic)

    dn = sub.add_parser("down", parents=[common], help="remove everything with the prefix (idempotent)")
    dn.set_defaults(func=cmd_down)

    pr = sub.add_parser("probe", help="which emulation features this kernel has")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)
    return netem


def main(argv: list[str] | None = None) -> int:
    """`python -m dgt.netem.cli ...` = `dgt netem ...` without loading the other dgt subcommands."""
    parser = argparse.ArgumentParser(prog="dgt")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["netem", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
