"""``dgt inspect FILE`` and ``dgt capture``: the command-line face of the inspection tool."""

from __future__ import annotations

import argparse
import json
import sys

from dgt.cliargs import COUNT, NON_NEGATIVE, POSITIVE, integer

EXIT_OK, EXIT_WARN, EXIT_ERROR = 0, 1, 2
PORT = integer(1, 65535)


def _dscp_arg(text: str) -> tuple[int, tuple[int, ...]]:
    """``LANE=VALUE[,VALUE]``; values are numbers or names (EF, LE, CS1, AF41...)."""
    from dgt.inspect.summary import DSCP_NAMES

    names = {v: k for k, v in DSCP_NAMES.items()}
    lane, _, vals = text.partition("=")
    try:
        out = []
        for v in vals.split(","):
            v = v.strip().upper()
            out.append(names[v] if v in names else int(v, 0))
        return int(lane), tuple(out)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected LANE=DSCP[,DSCP] (e.g. 1=CS1), got {text!r}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tcp-port",
        type=PORT,
        action="append",
        default=[],
        metavar="PORT",
        help="a reliable-lane (TCP) port of the session (repeatable); DGT streams are also auto-detected",
    )
    p.add_argument(
        "--udp-port",
        type=PORT,
        action="append",
        default=[],
        metavar="PORT",
        help="an unreliable-lane (UDP) port (repeatable); DGT datagrams are also auto-detected",
    )
    p.add_argument("--no-auto", action="store_true", help="only the given ports: no detection by magic/version")
    p.add_argument(
        "--dscp",
        type=_dscp_arg,
        action="append",
        default=[],
        metavar="LANE=DSCP",
        help="DSCP the session configured for a lane (default 0=EF, others LE or CS1); repeatable",
    )
    p.add_argument("--bin", type=POSITIVE, default=None, metavar="SECONDS",
                   help="timeline bin width (default: ~60 bins)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a timeline of bytes per lane and drops")
    p.add_argument("--rounds", type=NON_NEGATIVE, default=20, metavar="N",
                   help="rounds shown in the table (default 20)")
    p.add_argument("--strict", action="store_true", help="exit 1 when there are warnings or malformed packets")


def _options(args: argparse.Namespace):
    from dgt.inspect.options import Options

    return Options(
        tcp_ports=tuple(args.tcp_port),
        udp_ports=tuple(args.udp_port),
        auto=not args.no_auto,
        expect_dscp=dict(args.dscp),
        bin_s=args.bin,
    )


def _report(args: argparse.Namespace, path: str, extra: dict | None = None) -> int:
    from dgt.inspect.pcapio import PcapError
    from dgt.inspect.summary import summarize

    try:
        s = summarize(path, _options(args))
    except PcapError as exc:
        print(f"dgt inspect: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"dgt inspect: {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    if extra:
        s["capture"].update(extra)
    if args.plot:
        from dgt.inspect.plot import plot_timeline

        plot_timeline(s, args.plot)
    if args.json:
        json.dump(s, sys.stdout, indent=1)
        print()
    else:
        from dgt.inspect.render import render

        if extra:
            print(
                f"captured {extra['packets']} packets on {extra['iface']}"
                + (f" in netns {extra['netns']}" if extra.get("netns") else "")
                + f" to {path} ({extra['seconds']} s, kernel drops {extra['kernel_drops']})"
            )
        render(s, max_rounds=args.rounds)
        if getattr(args, "dissect", 0):
            _dissect(path, args.dissect, s["flows"])
    if args.strict and (s["warnings"] or s["malformed"]["total"]):
        return EXIT_WARN
    return EXIT_OK


def _dissect(path: str, n: int, flows: list[dict]) -> None:
    """Print the first ``n`` DGT frames through the scapy dissectors (streams reassembled by scapy's TCPSession)."""
    from scapy.layers.inet import TCP, UDP
    from scapy.sessions import TCPSession
    from scapy.utils import PcapReader

    from dgt.inspect import dissect

    dissect.bind_ports(
        udp=[f["dport"] for f in flows if f["proto"] == "udp"],
        tcp=[p for f in flows if f["proto"] == "tcp" for p in (f["sport"], f["dport"])],
    )
    shown = 0
    session = TCPSession()
    with PcapReader(path) as rd:
        for pkt in rd:
            if shown >= n:
                break
            if UDP in pkt and dissect.DGT in pkt:
                print(pkt[dissect.DGT].summary())
                shown += 1
            elif TCP in pkt and len(pkt[TCP].payload):
                out = session.process(pkt)
                if out is not None and dissect.DGTStream in out:
                    for f in out[dissect.DGTStream].frames[: n - shown]:
                        print(f.summary())
                        shown += 1


def cmd_inspect(args: argparse.Namespace) -> int:
    return _report(args, args.file)


def cmd_capture(args: argparse.Namespace) -> int:
    from dgt.inspect.capture import LiveCapture

    if args.duration is None and args.count is None:
        print("dgt capture: give --duration and/or --count so the capture ends by itself", file=sys.stderr)
        return EXIT_ERROR
    cap = LiveCapture(
        args.write,
        args.interface,
        tcp_ports=args.tcp_port,
        udp_ports=args.udp_port,
        netns=args.netns,
        duration=args.duration,
        count=args.count,
    )
    try:
        cap.start()
        res = cap.wait()
    except KeyboardInterrupt:
        res = cap.stop()
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"dgt capture: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return _report(args, args.write, res.to_dict())


def add_parser(subparsers) -> None:
    """Register ``inspect`` and ``capture`` with the ``dgt`` command."""
    p = subparsers.add_parser(
        "inspect",
        help="summarise DGT traffic in a pcap/pcapng file",
        description="Per-round and per-lane summary of DGT traffic in a capture file.",
    )
    p.add_argument("file", help="pcap or pcapng file")
    p.add_argument("--dissect", type=NON_NEGATIVE, default=0, metavar="N",
                   help="also print the first N frames dissected")
    _common(p)
    p.set_defaults(func=cmd_inspect)

    c = subparsers.add_parser(
        "capture",
        help="capture DGT traffic live to a pcap, then summarise it",
        description="Live capture (scapy AsyncSniffer) filtered to DGT ports, bounded by time "
        "and/or packets, written to a pcap and summarised like `dgt inspect`.",
    )
    c.add_argument("-i", "--interface", default="lo", help="interface to sniff (default lo)")
    c.add_argument("--netns", metavar="NAME", help="sniff inside this network namespace (ip netns name)")
    c.add_argument("-w", "--write", default="dgt-capture.pcap", metavar="FILE", help="pcap to write")
    c.add_argument("--duration", type=POSITIVE, metavar="SECONDS", help="stop after this long")
    c.add_argument("--count", type=COUNT, metavar="PACKETS", help="stop after this many packets")
    _common(c)
    c.set_defaults(func=cmd_capture)
