"""The reduce-scatter hops of a lossy ring (DGT) with the important blocks on stream lanes.

A lossy hop as one DGT round on the session link costs about 16 copies of its chunk in protocol work, most of it the
important blocks: framed, written and read frame by frame by the link's trio tasks, landed and marked run by run
(docs/history/transport-journal.md, issue 26). Here a hop is split by lane, as the paper splits it:

- the **important blocks** (class 0) go as one packed message on the stream lane to the next rank (TCP, marked EF
  like lane 0), in the native hop loop off the trio thread, preceded by a mask message (a byte per block of the
  chunk) that tells the receiver which blocks they are (:mod:`dgt.protocol.packed_blocks`: no offsets on the wire);
- the **unimportant blocks** go as a DGT round on the session link as before (UDP, low priority, paced, the send
  budget, the deadline, the drop report and error feedback), planned with ``elsewhere``: the round announces no
  important block and carries none.

Both halves are taken from one copy of the chunk with the error-feedback residual added (``send_round``'s ``stage``),
so an important block carries what earlier rounds kept back, exactly as it did in the round. The receiver lands the
round (its lost and unsent blocks zeroed at the deadline), writes the packed important blocks over their blocks, and
adds the result to its own chunk.

Stream exchanges run in the order they were called on every rank: every hop's place is reserved when the call
starts, before its first await (as the lossless ring's one exchange takes its ticket).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import trio

from dgt.channels.hop_datagrams import DatagramRecv
from dgt.codecs.base import BLOCK_MEANS_HINT
from dgt.collectives.base import Collective
from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import FAMILY_MASK, check_op, host, state_key, transport_key, wire_layout
from dgt.collectives.stats import CollectiveStats
from dgt.errors import RankMismatch, shape_mismatch
from dgt.layout import BucketLayout
from dgt.protocol.block_ops import add_blocks, combine_blocks, packed_offsets
from dgt.protocol.packed_blocks import packed_numel
from dgt.transport.hop_round import control_bytes
from dgt.transport.streams import Hop, streamable

MASK_PART, PACKED_PART = 1, 2  # transport key parts of a hop's two stream messages (part 0: its session round)


@dataclass
class _HopBuffers:
    """Per step, reused across calls: the first messages sent and received (a byte per block, then the round's
    ROUND_BEGIN and ROUND_END), the packed blocks received (the sender's packed blocks live in its RoundSender), and
    where the round's datagrams are read (grown to the largest round seen)."""

    tx_msg: torch.Tensor
    rx_msg: torch.Tensor
    rx_pack: torch.Tensor
    rx_dgrams: np.ndarray

    def dgrams(self, nbytes: int) -> np.ndarray:
        """At least ``nbytes`` to read datagrams into (in the worker thread: nothing else uses it meanwhile)."""
        if len(self.rx_dgrams) < nbytes:
            self.rx_dgrams = np.empty(nbytes + nbytes // 4, np.uint8)
        return self.rx_dgrams


class _HopSum:
    """The receiving end of a hop: this rank's chunk plus the packed important blocks plus the round's blocks that
    came in time (``combine_blocks``). With idle cores (``overlap``: this rank may run more than one thread) it is
    made in two halves: the stream lane's part in the trio thread as soon as the worker has both messages
    (``post``; the C pass releases the GIL, so it runs beside the worker's reads of the round's datagrams, whose
    arrival times feed the congestion control), then once the round closed only the blocks that came as datagrams
    (``add_blocks``). Without, in one pass once the round closed (no second thread to run beside)."""

    def __init__(self, src: torch.Tensor, out: torch.Tensor, layout: BucketLayout, rx_pack: torch.Tensor,
                 mask: np.ndarray, overlap: bool) -> None:
        self.src, self.out, self.layout, self.rx_pack, self.mask = src, out, layout, rx_pack, mask
        self.token = trio.lowlevel.current_trio_token() if overlap else None
        self.early: torch.Tensor | None = None  # the blocks' mean |out| after the first half
        self.error: Exception | None = None
        self.live = True  # False once the hop failed: a late callback writes nothing

    @property
    def important(self) -> np.ndarray:
        """The blocks that came on the stream lane (once the first message is in)."""
        return self.mask != 0

    def post(self) -> None:
        """(Worker thread.) Both messages are in."""
        if self.token is not None:
            try:
                self.token.run_sync_soon(self._first_half)
            except trio.RunFinishedError:
                pass  # finish() makes it in one pass

    def _combine(self, land: torch.Tensor, received: np.ndarray) -> torch.Tensor:
        """``combine_blocks`` of this hop with the round's ``received`` blocks of ``land``."""
        imp = self.important
        return combine_blocks(self.src, land, self.rx_pack[: packed_numel(self.layout, imp)], self.out, self.layout,
                              received & ~imp, packed_offsets(self.layout, imp))

    def _first_half(self) -> None:
        if not self.live or self.early is not None:
            return
        try:
            self.early = self._combine(self.src, np.zeros(len(self.mask), bool))
        except Exception as exc:  # a callback must not raise into trio: finish() raises it
            self.error = exc

    def finish(self, land: torch.Tensor, received: np.ndarray) -> torch.Tensor:
        """(Trio thread, the round closed.) The sum with the round's ``received`` blocks of ``land``; returns the
        blocks' mean |out| (the next hop's scores)."""
        self.live = False
        if self.error is not None:
            raise self.error
        if self.early is None:
            return self._combine(land, received)
        add_blocks(self.out, land, self.layout, np.flatnonzero(received & ~self.important), self.early)
        return self.early


def lossy_on_streams(coll: Collective, ch: Chunking, flat: torch.Tensor) -> bool:
    """Whether a lossy ring call can take this path: stream hops on, both neighbours reachable on the hop socket,
    a lossy summable codec whose chunks are their own wire form (DGT), a contiguous float32 CPU bucket, and no
    empty chunk (every hop carries a round)."""
    caps = coll.codec.capabilities
    g = coll.group
    ep = g.endpoint
    return (ep.cfg.hops.mode != "off" and caps.lossy_tolerant and caps.in_place
            and ep.hop_ready((g.rank + 1) % g.world) and ep.hop_ready((g.rank - 1) % g.world)
            and flat.dtype == torch.float32 and streamable(flat)
            and all(ch.edges[i + 1] > ch.edges[i] for i in range(ch.k)))


class LossyHops:
    """The reduce-scatter of one lossy ring call (see the module docstring); the ring owns one, for its buffers."""

    def __init__(self, coll: Collective) -> None:
        self.coll = coll
        self._bufs: dict[tuple[int, int, int, int], _HopBuffers] = {}

    def buffers(self, step: int, n: int, tx: int, rx: int) -> _HopBuffers:
        key = (step, n, tx, rx)
        buf = self._bufs.get(key)
        if buf is None:
            if len(self._bufs) >= 64:
                self._bufs.clear()
            buf = self._bufs[key] = _HopBuffers(torch.zeros(tx, dtype=torch.uint8), torch.zeros(rx, dtype=torch.uint8),
                                                torch.empty(n, dtype=torch.float32), np.empty(0, np.uint8))
        return buf

    async def reduce_scatter(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                             stats: CollectiveStats, land: list[torch.Tensor], tickets: list[int | None]) -> None:
        """W-1 hops: step s sends chunk r-s (``src`` at step 0, the partial sum in ``flat`` after) and adds what
        the previous rank sends for chunk r-s-1 to this rank's input chunk, into ``flat``. ``land``: per step, the
        buffer the step's session round lands in (posted). ``tickets``: per step, its reserved exchange; each is set
        to None once its exchange holds it (the caller forfeits those left)."""
        W, r = self.coll.group.world, self.coll.group.rank
        means = None  # the block scores of the chunk the next hop sends, from the hop that summed it
        for s in range(W - 1):
            a, c = (r - s) % W, (r - s - 1) % W
            means = await self._hop(ch, ch.chunk(src if s == 0 else flat, a), a, c, ch.chunk(src, c),
                                    ch.chunk(flat, c), land[s], bucket_id, s, rnd, stats, tickets, means)

    async def _hop(self, ch: Chunking, out: torch.Tensor, a: int, c: int, mine_src: torch.Tensor,
                   mine: torch.Tensor, land: torch.Tensor, bucket_id: int, s: int, rnd: int, stats: CollectiveStats,
                   tickets: list[int | None], means: torch.Tensor | None) -> torch.Tensor:
        """One hop (see :meth:`reduce_scatter`); ``means``: the block scores of ``out`` when the previous hop
        computed them. Returns those of the chunk it summed into ``mine`` (the next hop's ``out``)."""
        coll = self.coll
        g = coll.group
        ep, op = g.endpoint, coll.call_code
        nxt, prv = (g.rank + 1) % g.world, (g.rank - 1) % g.world
        state = coll.state(state_key("rs", bucket_id, s), out, ch.segments[a])
        if means is not None:
            state.values[BLOCK_MEANS_HINT] = means  # encode consumes it at once
        (part,) = coll.codec.encode(out, state)
        layout = wire_layout(part)
        lay_c = BucketLayout.of(ch.segments[c], layout.block)
        cls = part.lane_class
        if not isinstance(cls, torch.Tensor):
            cls = torch.full((layout.nblocks,), int(cls), dtype=torch.int8)
        cls = cls.detach().to("cpu")
        key = transport_key(bucket_id, "rs", s, 0)
        hs = ep.plan_hop_round(nxt, key, rnd, host(part.data), layout, cls, part.order, op)  # nothing sent yet
        nb, nb_c = layout.nblocks, lay_c.nblocks
        buf = self.buffers(s, mine.numel(), nb + len(hs.control), nb_c + control_bytes(lay_c))
        tx = buf.tx_msg.numpy()
        tx[:nb] = (cls == 0).numpy()
        tx[nb:] = np.frombuffer(hs.control, np.uint8)
        rx = buf.rx_msg.numpy()
        seen: list[Any] = []  # in the worker thread: when the first message was in, then the datagram receipt

        def land_packed() -> torch.Tensor:  # in the worker thread, once the first message is in
            seen.append(time.perf_counter())
            return buf.rx_pack[: packed_numel(lay_c, rx[:nb_c] != 0)]

        receipt = ep.hop_receipt(prv, key, rnd, lay_c, 4, lambda: memoryview(rx[nb_c:]), buf.dgrams)
        early = _HopSum(mine_src, mine, lay_c, buf.rx_pack, rx[:nb_c], torch.get_num_threads() > 1)

        def datagrams_in() -> DatagramRecv:  # in the worker thread, once both messages are in
            early.post()
            seen.append(receipt())
            return seen[-1]  # type: ignore[no-any-return]

        hops = [Hop(transport_key(bucket_id, "rs", s, MASK_PART), rnd, nxt, buf.tx_msg, prv, buf.rx_msg, op=op),
                Hop(transport_key(bucket_id, "rs", s, PACKED_PART), rnd, nxt, hs.packed, prv,
                    land_later=land_packed, op=op, datagrams=hs.datagrams, datagrams_in=datagrams_in)]
        ticket, tickets[s] = tickets[s], None
        try:
            # family: a round of this call from ``prv`` on the session link means it took the round path (another
            # dtype or layout): RankMismatch on every rank at once, not a hop waiting for a mask that never comes
            done = await ep.exchange(hops, ticket=ticket, family=FAMILY_MASK)
        except BaseException:
            early.live = False  # the call fails: nothing more is written to this rank's chunk
            ep.hop_round_sent(hs, failed=True)  # what left is accounted; no report is waited for
            raise
        st = ep.hop_round_sent(hs)
        ep.land_hop_round(prv, key, rnd, memoryview(rx[nb_c:]), seen[1], seen[0])
        res = await ep.recv_round(prv, key, rnd, out=land)  # closed just now: returned at once
        stats.add_round(res.stats)
        check_op(op, res.codec, rnd)
        isz = part.data.element_size()
        stats.add_sent(1, part.nbytes - hs.packed.numel() * isz - st.unsent_bytes)
        stats.bytes_unsent += st.unsent_bytes
        stats.add_sent(0, hs.packed.numel() * isz)
        stats.bytes_received[0] = stats.bytes_received.get(0, 0) + sum(d.received for d in done)
        # the round counts the blocks it never announced as unsent: those on the stream lane were not
        stats.unsent -= min(int(early.important.sum()), stats.unsent)
        dst = res.data.reshape(-1)
        if dst.numel() != lay_c.numel or dst.dtype != mine.dtype or res.mask.numel() != lay_c.nblocks:
            raise RankMismatch(shape_mismatch(rnd), detail=f"rank {prv} sent {dst.numel()} x {dst.dtype} for rs step "
                               f"{s} of bucket {bucket_id}, this rank expects {lay_c.numel} x {mine.dtype}")
        return early.finish(dst, res.mask.numpy())
