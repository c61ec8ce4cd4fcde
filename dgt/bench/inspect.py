"""``dgt bench inspect``: how fast ``dgt inspect`` summarises a capture, against scapy's bare read of the same file.

A synthetic capture (dgt.inspect.synth: ``--rounds`` rounds of one ``--size``-element tensor in ``--block``-element
blocks; the defaults give about 100 000 packets) is written once, untimed. Then, ``--repeat`` times in turn:

- bare read (the anchor): scapy's ``RawPcapReader`` walking every record and nothing else, the one per-packet loop
  that ``dgt inspect`` also runs;
- read_pcap: ``dgt.inspect.pcapio.read_pcap``, the packet table (that loop plus the vectorised header parse);
- summarize: ``dgt.inspect.summary.summarize``, everything ``dgt inspect`` prints.

Best and median wall seconds and CPU seconds of each, packets per second of the summary, and each ratio to the anchor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from dgt.cliargs import COUNT, NON_NEGATIVE, BadOption


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=COUNT, default=68,
                        help="rounds in the synthetic capture (default 68: with the default size and block about "
                        "100 000 packets)")
    parser.add_argument("--size", type=COUNT, default=131072, help="float32 elements of the one tensor per round")
    parser.add_argument("--block", type=COUNT, default=64, help="elements per block (one datagram each)")
    parser.add_argument("--seed", type=NON_NEGATIVE, default=1)
    parser.add_argument("--repeat", type=COUNT, default=3, help="timed passes of each reader, in turn")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def _bare_read(path: str) -> int:
    from scapy.utils import RawPcapReader

    n = 0
    with RawPcapReader(path) as reader:
        for _ in reader:
            n += 1
    return n


def run(args: argparse.Namespace) -> dict:
    from dgt.inspect.pcapio import read_pcap
    from dgt.inspect.summary import summarize
    from dgt.inspect.synth import synth_rounds
    from dgt.inspect.traffic import TrafficSpec

    if args.rounds < 1 or args.size < 1 or args.block < 1 or args.repeat < 1:  # run() called without the parser
        raise BadOption("--rounds, --size, --block and --repeat: at least 1")
    with tempfile.TemporaryDirectory(prefix="dgt-bench-inspect-") as tmp:
        path = os.path.join(tmp, "synth.pcap")
        spec = TrafficSpec(rounds=args.rounds, sizes=(args.size,), block=args.block, seed=args.seed)
        _, synth_s, _ = _timed(lambda: synth_rounds(path, spec, truth=False))
        size = os.path.getsize(path)
        readers: dict[str, Callable[[], Any]] = {"bare_read": lambda: _bare_read(path),
                                                  "read_pcap": lambda: read_pcap(path),
                                                  "summarize": lambda: summarize(path)}
        wall: dict[str, list[float]] = {k: [] for k in readers}
        cpu: dict[str, list[float]] = {k: [] for k in readers}
        last: dict[str, Any] = {}
        for _ in range(args.repeat):
            for name, fn in readers.items():
                last[name], w, c = _timed(fn)
                wall[name].append(w)
                cpu[name].append(c)
    summary = last["summarize"]
    packets = summary["packets"]
    if not packets == last["bare_read"] == len(last["read_pcap"]):  # the three read the same file
        raise RuntimeError(f"packet counts differ: bare read {last['bare_read']}, read_pcap "
                           f"{len(last['read_pcap'])}, summarize {packets}")
    best = {k: min(v) for k, v in wall.items()}
    return {
        "bench": "inspect", "rounds": args.rounds, "size": args.size, "block": args.block, "seed": args.seed,
        "repeat": args.repeat, "file_bytes": size, "synth_seconds": synth_s,
        "packets": packets, "dgt_packets": summary["dgt_packets"], "rounds_found": summary["totals"]["rounds"],
        "seconds": best, "median_seconds": {k: statistics.median(v) for k, v in wall.items()},
        "cpu_seconds_median": {k: statistics.median(v) for k, v in cpu.items()},
        "packets_per_s": {k: packets / v for k, v in best.items()},
        "vs_bare_read": {k: v / best["bare_read"] for k, v in best.items() if k != "bare_read"},
        "load_average": os.getloadavg(),
    }  # fmt: skip
