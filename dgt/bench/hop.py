"""``dgt bench hop``: the CPU of one lossy ring hop, sans-IO, on one thread, stage by stage.

A reduce-scatter hop of the lossy ring (``dgt bench allreduce --codec dgt:p=0.3``) is a whole DGT round per chunk: the
codec's block scores and classification, the sender's private copy with the residual added (``prepare``), the plan
(important blocks packed for the reliable lane, the send budget's kept-back blocks written into the residual,
datagram headers), the receiver's batched landing of the reliable frames and of the datagrams (MAC check, scatter,
zero-fill of what did not come), the ring's add, and the drop report folded back. This bench runs exactly that with
the protocol classes (no sockets, no trio), so the figures are the protocol's own CPU floor per hop, apart from the
event loop, system calls and the other ranks. The anchor is one plain copy of the chunk (a memory pass).

``--split`` runs the hop as the lossy ring now does (dgt.collectives.ring_lossy): the important blocks packed for the
stream lane by ``RoundSender.plan_split`` (one pass: residual, pack, private copy), the rest a DGT round, and
``combine_blocks`` for the sum and the next hop's block scores, which the codec reads instead of its own pass.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from dgt.cliargs import COUNT, FRACTION, POSITIVE, integer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=POSITIVE, default=6.25, help="chunk size in MB of fp32 (25 MB over 4 ranks: 6.25)")
    p.add_argument("--p", type=FRACTION, default=0.3, help="fraction of blocks on the reliable lane")
    p.add_argument("--budget", type=integer(-1), default=300_000,
                   help="datagram bytes the send budget allows per round (the rest is kept back); -1: no limit")
    p.add_argument("--rounds", type=COUNT, default=20, help="timed rounds (after 2 warm-up rounds)")
    p.add_argument("--no-mac", action="store_true", help="datagrams without the MAC trailer")
    p.add_argument("--batch", type=COUNT, default=61,
                   help="datagrams per receive call (61: one GSO send; a GRO drain of a busy socket holds more)")
    p.add_argument("--split", action="store_true",
                   help="the hop split by lane as the lossy ring runs it: important blocks packed for the stream "
                        "lane (plan_split), the rest a DGT round, combine_blocks for the sum and the next scores")


def run(args: argparse.Namespace) -> dict:
    import torch

    from dgt.codecs.base import BucketState
    from dgt.codecs.dgt import DGTCodec
    from dgt.layout import BucketLayout
    from dgt.protocol.datagram_mac import DatagramMac
    from dgt.protocol.deadline import FixedGrace
    from dgt.protocol.receiver import RoundReceiver
    from dgt.protocol.sender import RoundSender

    torch.set_num_threads(1)
    token, n = 0xB0B, max(1024, int(args.mb * 1e6 / 4))
    g = torch.Generator().manual_seed(0)
    x, inp, out, scratch = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.empty(n), torch.empty(n)
    mac = None if args.no_mac else DatagramMac(b"\x07" * 32)
    h = _Hop(args, token, DGTCodec(p=args.p), BucketState(n, torch.float32), BucketLayout.flat(n, 1024),
             RoundSender(token, rank=1, datagram_payload=1400, mac=mac, peer=0),
             RoundReceiver(token, rank=0, deadline=FixedGrace(0.001), allocator=lambda *_: scratch, mac=mac),
             None if args.budget < 0 else args.budget)
    for rnd in range(args.rounds + 2):
        if rnd == 2:
            h.cpu.clear()
            h.counts.clear()
        if args.split:
            x, out = _split_hop(h, rnd, x, inp, out), x  # the next hop sends the chunk this one summed
        else:
            _round_hop(h, rnd, x, inp, out)
    t = time.process_time()
    for _ in range(args.rounds):
        out.copy_(inp)
    anchor = (time.process_time() - t) / args.rounds * 1e3
    per = {k: v / args.rounds * 1e3 for k, v in h.cpu.items()}
    total = sum(per.values())
    return {"bench": "hop", "split": bool(args.split), "mb": n * 4 / 1e6, "p": args.p, "budget": h.budget,
            "batch": args.batch, "rounds": args.rounds, "blocks": h.layout.nblocks, "cpu_ms_per_hop": per,
            "cpu_ms_total": total, "anchor_copy_ms": anchor, "total_vs_copy": total / anchor if anchor > 0 else None,
            "per_round": {k: v / args.rounds for k, v in h.counts.items()}}  # fmt: skip


class _Hop:
    """What every hop of the bench shares: the codec, the sans-IO pair, the budget and the CPU tally per stage."""

    def __init__(self, args: argparse.Namespace, token: int, codec, state, layout, tx, rx, budget: int | None) -> None:
        self.args, self.token, self.codec, self.state, self.layout = args, token, codec, state, layout
        self.tx, self.rx, self.budget = tx, rx, budget
        self.cpu: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.means = None  # --split: the block scores of the chunk the next hop sends (combine_blocks made them)

    def stage(self, name: str, t0: float) -> float:
        t = time.process_time()
        self.cpu[name] += t - t0
        return t

    def receive(self, plan, rnd: int, t: float) -> tuple[list, float]:
        """The round's reliable frames, then its datagrams a GSO batch at a time (packed from the plan's rows as
        the channel packs a send, then decoded and landed as a GRO read is) and its odd-size ones, then its
        deadline."""
        from dgt import wire
        from dgt.protocol.datagram_decode import decode_datagrams
        from dgt.protocol.receiver import RoundDone

        stream, cuts = _stream(plan, wire)  # what the TCP reader would have read (not timed: the kernel's copy)
        t = time.process_time()
        events = _reliable(self.rx, stream, cuts, wire, self.token)
        t = self.stage("receive reliable", t)
        k = self.args.batch
        for lane, rows in plan.datagrams.items():
            stg = np.empty((k, rows.seg), np.uint8)  # a staging buffer, as the channel packs a GSO send
            for i in range(0, len(rows), k):
                batch = rows[i : i + k].pack(stg)
                t = self.stage("pack datagrams", t)
                events += self.rx.receive_datagrams(
                    decode_datagrams(batch.tobytes(), [rows.seg] * len(batch), token=self.token), lane, 0.0005)
                t = self.stage("receive datagrams", t)
        for lane, odd in plan.odd.items():  # the odd-size ones (a partial tail block), one read
            if odd:
                events += self.rx.receive_datagrams(
                    decode_datagrams(b"".join(odd), [len(d) for d in odd], token=self.token), lane, 0.0005)
        t = self.stage("receive datagrams", t)
        events += self.rx.on_time(1.0)
        (done,) = [e for e in events if isinstance(e, RoundDone)]
        return done, self.stage("finalise", t)

    def report(self, plan, done, t: float) -> None:
        from dgt import wire

        self.tx.on_drop_report(wire.decode_frames(done.report)[0])
        self.stage("drop report", t)
        self.counts["unsent"] += plan.unsent_blocks
        self.counts["datagrams"] += plan.unreliable_frames()
        self.counts["odd datagrams"] += sum(len(o) for o in plan.odd.values())
        self.counts["received"] += int(done.mask.sum())


def _round_hop(h: _Hop, rnd: int, x, inp, out) -> None:
    """A hop as one whole DGT round: the important blocks are DATA frames of the round on the reliable lane."""
    import torch

    t = time.process_time()
    part = h.codec.encode(x, h.state)[0]
    t = h.stage("encode", t)
    data = h.tx.prepare(0, x)
    t = h.stage("prepare", t)
    plan = h.tx.plan(0, rnd, data, h.layout, part.lane_class, part.order, budget=h.budget)
    t = h.stage("plan", t)
    done, t = h.receive(plan, rnd, t)
    torch.add(inp, done.data, out=out)
    t = h.stage("ring add", t)
    h.report(plan, done, t)


def _split_hop(h: _Hop, rnd: int, x, inp, out):
    """A hop split by lane as dgt.collectives.ring_lossy runs it: the codec reads the block scores the previous hop
    left (``BLOCK_MEANS_HINT``), ``plan_split`` packs the important blocks for the stream lane (their transfer is
    not timed: the kernel's copy) and plans the rest as a DGT round whose lost blocks the receiver leaves as they
    were, and ``combine_blocks`` adds the packed blocks and the round's received ones to this rank's chunk, making
    the next hop's block scores. Returns the sum (the next hop's chunk)."""
    from dgt.codecs.base import BLOCK_MEANS_HINT
    from dgt.protocol.block_ops import combine_blocks, packed_offsets

    t = time.process_time()
    if h.means is not None:
        h.state.values[BLOCK_MEANS_HINT] = h.means
    part = h.codec.encode(x, h.state)[0]
    t = h.stage("encode", t)
    staged: list = []
    plan, _ = h.tx.plan_split(0, rnd, x, h.layout, part.lane_class, part.order, True, h.budget, None,
                              staged.append)
    t = h.stage("plan_split", t)
    imp = plan.cls == 0
    landed = staged[0].clone()  # the stream lane's message as the next rank's reader lands it (not timed)
    h.rx.leave_lost((1, 0, rnd))
    done, t = h.receive(plan, rnd, time.process_time())
    received = done.mask.numpy() & ~imp
    h.means = combine_blocks(inp, done.data, landed, out, h.layout, received, packed_offsets(h.layout, imp))
    t = h.stage("combine", t)
    h.report(plan, done, t)
    h.counts["important"] += int(imp.sum())
    return out


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
