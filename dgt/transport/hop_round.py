"""A lossy ring hop's DGT round with its frames and datagrams off the session link (part of
:class:`dgt.transport.endpoint.Endpoint`).

The sans-IO classes do what they do for any round, fed in bulk: the sender plans it
(:meth:`dgt.protocol.sender.RoundSender.plan_split`: the send budget, the split pass, the datagrams with their MAC
pads), its ROUND_BEGIN and ROUND_END travel in the hop's first stream message, its datagrams leave from the hop
socket in the stream exchange's worker thread (:mod:`dgt.channels.hop_datagrams`), and the receiver is fed the
frames and every read of datagrams with its arrival time after the exchange, then closed at the time the worker
stopped waiting (:meth:`HopRounds.land`). The drop report goes back on the session link as for any round, and folds
into error feedback and the congestion controller there (``_on_drop_report``), with the send calls' times the
worker recorded.

What this saves, against the round on the session link: the link reader's work on the round's frames, the UDP
ingress, the datagram scheduler and their wake-ups on the trio thread (issue 26).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import trio

from dgt import wire
from dgt.channels.hop_datagrams import NAME, SLOT, DatagramRecv, DatagramSend
from dgt.channels.udp import read_sizes
from dgt.channels.udp_scheduler import DatagramJob
from dgt.errors import RankMismatch, shape_mismatch
from dgt.layout import BucketLayout
from dgt.protocol.cpu_gate import CpuGate
from dgt.protocol.datagram_decode import decode_datagrams
from dgt.protocol.events import Event
from dgt.protocol.geometry import Geometry, fragment_elems
from dgt.protocol.sender import RoundPlan
from dgt.transport.inbound import Inbound
from dgt.transport.links import Links
from dgt.transport.outbound import Outbound
from dgt.transport.records import SendTrack
from dgt.transport.session import Session
from dgt.transport.stats import SendStats
from dgt.transport.streams import StreamHub

_END = wire.HEADER_SIZE + len(wire.encode_round_end(0, 0, 0, 0))


def control_bytes(layout: BucketLayout) -> int:
    """The length of a hop round's ROUND_BEGIN plus ROUND_END frames for a bucket of ``layout``."""
    return wire.HEADER_SIZE + len(wire.encode_round_begin(layout.numel, layout.block, 1, layout.sizes)) + _END


@dataclass
class HopRoundSend:
    """A planned hop round on its way: its frames (``control``), the important blocks (``packed``, a view valid
    until the bucket's next round), the datagrams for the worker (``datagrams``) and the stats."""

    peer: int
    key: tuple[int, int, int]
    control: bytes
    packed: torch.Tensor
    datagrams: DatagramSend | None
    stats: SendStats
    job: DatagramJob | None
    track: SendTrack | None


class HopRounds:
    """Lossy ring hops whose rounds travel on the stream lane and the hop socket: planned with the outbound part's
    sender and budget, landed in the inbound part's receiver."""

    def __init__(self, session: Session, links: Links, inbound: Inbound, outbound: Outbound, hub: StreamHub,
                 cpu_gate: CpuGate | None) -> None:
        self.session = session
        self.cfg = session.cfg
        self.rank = session.rank
        self.token = session.token
        self.receiver = session.receiver
        self.links = links
        self.inbound = inbound
        self.outbound = outbound
        self.hub = hub
        self.cpu_gate = cpu_gate

    def ready(self, peer: int) -> bool:
        """Whether rounds to and from ``peer`` can take this path: both ends have a hop socket."""
        link = self.links.table.get(peer)
        return self.hub.hop is not None and link is not None and link.address.hop_port > 0

    def _hop_addr(self, peer: int) -> tuple[str, int]:
        link = self.links.link(peer)
        return (link.udp_addrs[0][0], link.address.hop_port)

    def plan(self, peer: int, bucket: int, round: int, flat: torch.Tensor, layout: BucketLayout,
                       cls: torch.Tensor, order: torch.Tensor | None, op: int) -> HopRoundSend:
        """Plan round ``round`` of ``bucket`` to ``peer`` without sending anything (see the module docstring): the
        important blocks are the caller's to carry (``HopRoundSend.packed``, float32 only)."""
        link = self.links.link(peer)
        hop = self.hub.hop
        if hop is None:
            raise RuntimeError(f"rank {self.rank}: a hop round to rank {peer} needs the hop socket (none here)")
        key = (peer, bucket, round)
        if key in self.outbound.sending and not self.outbound.sending[key].detached:
            raise ValueError(f"round {round} of bucket {bucket} to rank {peer} is already in flight")
        now = trio.current_time()
        packed: list[torch.Tensor] = []
        plan, _ = self.outbound.plan_round(link, bucket, round, flat.detach().reshape(-1), layout, cls, order, False,
                                           True, op, packed.append, self.cpu_gate)
        stats = SendStats(peer, bucket, round, 0, plan.unimportant_blocks, 1, 0, copied=True,
                          unsent_blocks=plan.unsent_blocks, unsent_bytes=plan.unsent_bytes)
        for lane, n in plan.unsent_lanes.items():
            self.outbound.tx_unsent[lane] = self.outbound.tx_unsent.get(lane, 0) + n
        if plan.unsent_blocks and self.cfg.error_feedback:
            link.dirty.add(bucket)
        control = b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)
        rows, odd = _rows_of(plan)
        job = send = None
        if len(rows) or odd:
            addr, pacer, burst = self._hop_addr(peer), link.pacer, self.cfg.pacing.burst
            job = DatagramJob(peer, 1, bucket, round, rows, odd, addr)
            send = DatagramSend(rows, odd, addr, 1e12 if pacer is None else pacer.rate, burst,  # unpaced: 1 TB/s
                                float(burst) if pacer is None else pacer.tokens(now),
                                segments=hop.segments_per_send(rows.shape[1]), gso=hop.gso,
                                limit=self.cfg.timeouts.round or 10.0)
        track = None
        if plan.unimportant_blocks:  # a report will come: it finds its track (none without datagrams: NO_REPORT)
            track = self.outbound.sending[key] = SendTrack(t0=now, cls=plan.cls, detached=True)
        return HopRoundSend(peer, key, control, packed[0], send, stats, job, track)

    def sent(self, hs: HopRoundSend, failed: bool = False) -> SendStats:
        """After the exchange (or its failure: ``failed``, and no report will be waited for): what the worker sent,
        charged to the pacer and the stats, its send calls on trio's clock for the congestion feedback."""
        st, tx, job = hs.stats, hs.datagrams, hs.job
        self.session.stats.rounds_sent += 1
        if failed and hs.track is not None and self.outbound.sending.get(hs.key) is hs.track:
            del self.outbound.sending[hs.key]
        if tx is None or job is None:
            return st
        off = trio.current_time() - time.perf_counter()
        link = self.links.table.get(hs.peer)
        pacer = None if link is None else link.pacer
        if pacer is not None and tx.sends:  # one charge at the last call's time: the same debt, one refill
            pacer.consume(tx.sent_bytes, tx.sends[-1][0] + off)
        job.sends = [(t + off, n, b) for t, n, b in tx.sends]
        job.sent, job.sent_bytes = tx.sent, tx.sent_bytes
        job.abandoned = max(tx.total - tx.sent - tx.errors, 0)  # slowed past its limit, or the hop failed first
        job.pos, job.odd_pos = len(job.rows), len(job.odd)
        job.done.set(None)
        track = hs.track
        if track is not None:
            track.window = tx.window
            track.jobs.append(job)  # the congestion feedback reads the send calls from here
            info = track.report.peek()
            if info is not None and link is not None:  # the report came while the worker still ran: feed it now
                self.outbound.account_report(link, track, info)
        if self.hub.hop is not None:
            c = self.hub.hop.counters
            c.tx_datagrams += tx.sent
            c.tx_bytes += tx.sent_bytes
            c.tx_calls += len(tx.sends)
            c.tx_gso_calls += sum(1 for _, n, _ in tx.sends if n > 1)
            c.tx_errors += tx.errors
        st.datagrams[1] = tx.sent
        st.datagram_bytes[1] = tx.sent_bytes
        st.abandoned[1] = job.abandoned
        self.outbound.tx_abandoned[1] = self.outbound.tx_abandoned.get(1, 0) + job.abandoned
        return st

    def receipt(self, peer: int, bucket: int, round: int, layout: BucketLayout, itemsize: int,
                    control: Callable[[], memoryview], buf: Callable[[int], np.ndarray]) -> Callable[[], DatagramRecv]:
        """For the worker thread, once the hop's first message is in: where the round's datagrams from ``peer``
        land. ``control()``: the received ROUND_BEGIN + ROUND_END; ``buf(nbytes)``: a uint8 buffer of at least that
        size. The buffer is sized by this rank's view of the round (its fragments, whatever ROUND_END says)."""
        room = self._payload_room(peer)
        geom = Geometry.of(layout, fragment_elems(layout.block, itemsize, room))
        most = int(geom.frags_needed.sum())
        seg = wire.HEADER_SIZE + room
        # the receiver's policy belongs to this (the trio) thread: the worker evaluates a copy of it as it stands now
        # (it learns on this thread as rounds close, between hops), and gets its longest wait as a value
        peer_wait = self.receiver.deadline.longest_wait()
        policy = self.receiver.deadline.frozen()
        name = wire.headers(1)
        name["rank"], name["round"], name["bucket"] = peer, round, bucket
        addr = self._hop_addr(peer)

        def receipt() -> DatagramRecv:
            ctl = control()
            announced = wire.decode_round_end(ctl[len(ctl) - _END + wire.HEADER_SIZE :])[3] if len(ctl) >= _END else 0
            expect = min(int(announced), most)
            return DatagramRecv(buf(expect * seg + 2 * SLOT), addr, name.tobytes()[NAME], expect, policy.deadline,
                                peer_wait=peer_wait)

        return receipt

    def _payload_room(self, peer: int) -> int:
        """The datagram payload (MAC trailer included) rounds to ``peer`` use (RoundSender.geometry's)."""
        sender = self.links.link(peer).sender
        return int(sender.datagram_payload) - (0 if sender.mac is None else wire.MAC_TAG)

    def land(self, peer: int, bucket: int, round: int, control: memoryview, rx: DatagramRecv | None,
                       control_at: float) -> None:
        """Feed the round the exchange carried to the receiver (see the module docstring) and close it.
        ``control_at``: ``time.perf_counter()`` when its frames were in. RankMismatch when it did not open (another
        layout, a refused ROUND_BEGIN): every rank then fails the call, none waits for the round."""
        key = (peer, bucket, round)
        off = trio.current_time() - time.perf_counter()
        recv = self.receiver
        events: list[Event] = []
        try:
            head = wire.decode_header(control[: wire.HEADER_SIZE], self.cfg.limits, self.token)
        except wire.WireError:
            head = None
        if head is not None and int(head["rank"]) == peer:
            self.inbound.note_opened(key, control_at + off)
            events += recv.receive_bytes(control, 0, control_at + off)
        else:
            recv.counters.reject("rank-mismatch")
        if recv.is_open(key) and rx is not None:
            events += recv.important_in(key, rx.imp_at + off)
            events += self._land_reads(rx, off)
        elif recv.is_open(key):
            events += recv.important_in(key, control_at + off)
        if recv.is_open(key):
            events += recv.expire(key, (rx.closed_at or rx.imp_at) + off if rx is not None else control_at + off)
        if events:
            self.inbound.handle(events)
        if not recv.is_closed(key):
            raise RankMismatch(shape_mismatch(round), detail=f"rank {self.rank}: the round of bucket {bucket} from "
                               f"rank {peer} did not open (its opening frames were refused)")

    def _land_reads(self, rx: DatagramRecv, off: float) -> list[Event]:
        """Every pass of reads the worker made, as one batch each at its arrival time."""
        events: list[Event] = []
        first = 0
        udp = self.hub.hop
        if udp is not None:
            c = udp.counters
            c.rx_calls += len(rx.reads)
            c.rx_gro_reads += sum(1 for _, n, seg in rx.reads if n > seg)
            c.rx_unknown_source += rx.strangers
            c.rx_truncated += rx.truncated
        # the first pass of reads on its own (the report's first arrival), the rest as one batch at the last time
        drains = rx.drains if len(rx.drains) <= 2 else [rx.drains[0], rx.drains[-1]]
        for upto, t in drains:
            reads = rx.reads[first:upto]
            first = upto
            if not reads:
                continue
            start = reads[0][0]
            sizes = read_sizes([r[1] for r in reads], [r[2] for r in reads])  # the reads lie back to back
            end = start + int(sizes.sum())
            if udp is not None:
                udp.counters.rx_datagrams += len(sizes)
                udp.counters.rx_bytes += end - start
            batch = decode_datagrams(rx.buf[start:end].data, sizes, self.cfg.limits, self.token)
            if self.inbound.drop_rng is not None:  # injected loss (TransportConfig.drop_fraction), as UDP ingress does
                keep = self.inbound.drop_rng.random(len(sizes)) >= self.cfg.faults.drop_fraction
                self.inbound.rx_dropped_hook[1] = self.inbound.rx_dropped_hook.get(1, 0) + int((~keep).sum())
                batch = wire.Batch(batch.headers[keep], batch.payload_pos[keep], batch.reason[keep], batch.buf)
            events += self.receiver.receive_datagrams(batch, 1, t + off)
        return events


def _rows_of(plan: RoundPlan) -> tuple[np.ndarray, list[bytes]]:
    """Every datagram of ``plan`` packed into one ``[k, seg]`` array (the MAC tags made as they are packed), then the
    odd-size ones; all lanes together (a hop round has one socket)."""
    parts = [d for d in plan.datagrams.values() if len(d)]
    odd = [b for lane in sorted(plan.odd) for b in plan.odd[lane]]
    if not parts:
        return np.zeros((0, 1), np.uint8), odd
    seg = parts[0].seg
    out = np.empty((sum(len(d) for d in parts), seg), np.uint8)
    at = 0
    for d in parts:
        d.pack(out[at : at + len(d)])
        at += len(d)
    return out, odd
