"""``dgt bench hop``: the CPU of one lossy ring hop, sans-IO, on one thread, stage by stage.

A reduce-scatter hop of the lossy ring (``dgt bench allreduce --codec dgt:p=0.3``) is a whole DGT round per chunk: the
codec's block scores and classification, the sender's private copy with the residual added (``prepare``), the plan
(important blocks packed for the reliable lane, the send budget's kept-back blocks written into the residual,
datagram headers), the receiver's batched landing of the reliable frames and of the datagrams (MAC check, scatter,
zero-fill of what did not come), the ring's add, and the drop report folded back. This bench runs exactly that with
the protocol classes (no sockets, no trio), so the figures are the protocol's own CPU floor per hop, apart from the
event loop, system calls and the other ranks. The anchor is one plain copy of the chunk (a memory pass).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=float, default=6.25, help="chunk size in MB of fp32 (25 MB over 4 ranks: 6.25)")
    p.add_argument("--p", type=float, default=0.3, help="fraction of blocks on the reliable lane")
    p.add_argument("--budget", type=int, default=300_000,
                   help="datagram bytes the send budget allows per round (the rest is kept back); -1: no limit")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (after 2 warm-up rounds)")
    p.add_argument("--no-mac", action="store_true", help="datagrams without the MAC trailer")
    p.add_argument("--batch", type=int, default=61,
                   help="datagrams per receive call (61: one GSO send; a GRO drain of a busy socket holds more)")


def run(args: argparse.Namespace) -> dict:
    import torch

    from dgt import wire
    from dgt.codecs.base import BucketState
    from dgt.codecs.dgt import DGTCodec
    from dgt.layout import BucketLayout
    from dgt.protocol.datagram_decode import decode_datagrams
    from dgt.protocol.datagram_mac import DatagramMac
    from dgt.protocol.deadline import FixedGrace
    from dgt.protocol.receiver import RoundDone, RoundReceiver
    from dgt.protocol.sender import RoundSender

    torch.set_num_threads(1)
    token, n = 0xB0B, max(1024, int(args.mb * 1e6 / 4))
    g = torch.Generator().manual_seed(0)
    x, inp, out, scratch = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.empty(n), torch.empty(n)
    codec, state, layout = DGTCodec(p=args.p), BucketState(n, torch.float32), BucketLayout.flat(n, 1024)
    mac = None if args.no_mac else DatagramMac(b"\x07" * 32)
    tx = RoundSender(token, rank=1, block=1024, datagram_payload=1400, mac=mac, peer=0)
    rx = RoundReceiver(token, rank=0, deadline=FixedGrace(0.001), allocator=lambda *_: scratch, mac=mac)
    cpu: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    budget = None if args.budget < 0 else args.budget
    if args.batch < 1:
        raise SystemExit("--batch: at least 1 datagram per receive call")
    k = args.batch

    def stage(name: str, t0: float) -> float:
        t = time.process_time()
        cpu[name] += t - t0
        return t

    for rnd in range(args.rounds + 2):
        if rnd == 2:
            cpu.clear()
            counts.clear()
        t = time.process_time()
        part = codec.encode(x, state)[0]
        t = stage("encode", t)
        data = tx.prepare(0, x)
        t = stage("prepare", t)
        plan = tx.plan(0, rnd, data, layout, part.lane_class, part.order, budget=budget)
        t = stage("plan", t)
        stream, cuts = _stream(plan, wire)  # what the TCP reader would have read (not timed: the kernel's copy)
        t = time.process_time()
        events = _reliable(rx, stream, cuts, wire, token)
        t = stage("receive reliable", t)
        for lane, rows in plan.datagrams.items():
            stg = np.empty((k, rows.seg), np.uint8)  # a staging buffer, as the channel packs a GSO send
            for i in range(0, len(rows), k):
                batch = rows[i : i + k].pack(stg)
                t = stage("pack datagrams", t)
                events += rx.receive_datagrams(
                    decode_datagrams(batch.tobytes(), [rows.seg] * len(batch), token=token), lane, 0.0005)
                t = stage("receive datagrams", t)
        events += rx.on_time(1.0)
        (done,) = [e for e in events if isinstance(e, RoundDone)]
        t = stage("finalise", t)
        torch.add(inp, done.data, out=out)
        t = stage("ring add", t)
        tx.on_drop_report(wire.decode_frames(done.report)[0])
        stage("drop report", t)
        counts["unsent"] += plan.unsent_blocks
        counts["datagrams"] += plan.unreliable_frames()
        counts["received"] += int(done.mask.sum())
    t = time.process_time()
    for _ in range(args.rounds):
        out.copy_(inp)
    anchor = (time.process_time() - t) / args.rounds * 1e3
    per = {k: v / args.rounds * 1e3 for k, v in cpu.items()}
    total = sum(per.values())
    return {"bench": "hop", "mb": n * 4 / 1e6, "p": args.p, "budget": budget, "batch": k, "rounds": args.rounds,
            "blocks": layout.nblocks, "cpu_ms_per_hop": per, "cpu_ms_total": total, "anchor_copy_ms": anchor,
            "total_vs_copy": total / anchor if anchor > 0 else None,
            "per_round": {k: v / args.rounds for k, v in counts.items()}}  # fmt: skip


def _stream(plan, wire) -> tuple[bytes, list[int]]:
    """The reliable lane's byte stream and the length of each frame in it (from the headers' length fields)."""
    stream = b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)
    hs, pos, lengths = wire.HEADER_SIZE, 0, []
    while pos < len(stream):
        length = hs + int(np.frombuffer(stream, wire.HEADER_DTYPE, 1, pos)[0]["length"])
        lengths.append(length)
        pos += length
    return stream, lengths


def _reliable(rx, stream: bytes, lengths: list[int], wire, token: int) -> list:
    """The reliable lane as the link reader handles it: the opening and closing frames one by one, the DATA frames
    between them as one staged batch (``receive_runs``)."""
    first, last = lengths[0], lengths[-1]
    events = rx.receive_bytes(stream[:first], 0, 0.0)
    if len(lengths) > 2:
        body = memoryview(stream)[first : len(stream) - last]
        events += rx.receive_runs(wire.decode_datagrams(body, lengths[1:-1], token=token), 0, 0.0)
    return events + rx.receive_bytes(stream[len(stream) - last :], 0, 0.0)
