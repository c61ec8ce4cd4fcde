"""Direct (transpose) all-reduce: a reduce-scatter and an all-gather of one round each, whatever the world size.

The bucket is cut in W block-aligned chunks (as the ring cuts it); rank j owns chunk j.

- **reduce-scatter**: every rank sends chunk j to rank j, for every j at once (W-1 concurrent transfers), and
  receives chunk r from every other rank. The owner sums the W contributions of its chunk in rank order (0, 1, ...,
  W-1: the same order whatever the arrival order, so a float64 or integer result is that of the dense reference
  ``x_0 + x_1 + ...``), accumulating fp16/bf16 in float32;
- **all-gather**: the owner sends its reduced chunk to every other rank at once, on the reliable lane, and receives
  every other chunk from its owner. Every rank applies ``op`` to the same bits, so all end with identical tensors.

**One round for small buckets** (``one_round_bytes``, off by default; the low-rank all-reduce's P and Q factors use
it): a dense lossless bucket of at most that many bytes goes whole to every other rank at once, and every rank sums
all W contributions in rank order itself: one round in series instead of two, for (W-1) times the bucket's bytes per
rank instead of 2(W-1)/W times. Every rank adds the same terms in the same order, so every rank holds the same bits,
and the same bits as the two-round schedule (whose owner adds each chunk's terms in that order). Worth it where the
payload is small against what a round in series costs (a 20 ms link: 40 ms per round).

A ring does the same work in 2(W-1) rounds in series, each of which pays the link's round trip and the transport's
fixed cost per round; here there are two, whose W-1 transfers share the link (OptiReduce's transpose all-reduce).
The bytes each rank sends are the ring's: (W-1)/W of the bucket per phase.

Codecs: a lossless codec whose chunks are their own wire form (``dense``, any dtype the ring takes) posts each
chunk as one lossless message (``post_send``) landed in place (``post_recv``); every other codec goes through
``encode``/``send_round``/``recv_round``/``decode``. A lossy codec (``dgt``) classes the blocks of every chunk it
sends in the reduce-scatter: important blocks on the reliable lane, the rest droppable, with the deadline, the drop
report and error feedback of the transport (a lost block is zero in the owner's sum and stays in the sender's error
feedback for a later round); the all-gather is always reliable. The owner's own contribution never crosses the
network and is added exactly.

Agreement: every message carries the call code (op and codec) and is checked on arrival, as is every received
chunk's size and dtype (an element-aligned codec), so ranks that called with another op, codec, size or dtype fail
with :class:`~dgt.errors.RankMismatch`, told to every rank (``tells_peers``); bad layouts are handled by
``any_layout`` (a contiguous working copy) or refused with :class:`~dgt.errors.InputRejected` before any traffic.

Written against the :class:`~dgt.transport.contract.Transport` contract only.
"""

from __future__ import annotations

from functools import partial

import torch

from dgt.codecs.base import Codec, Part, Received, rank_order_sum
from dgt.collectives.base import Collective, any_layout, tells_peers
from dgt.collectives.chunks import Chunking
from dgt.collectives.group import Group
from dgt.collectives.parts import (
    as_received,
    check_op,
    check_world,
    decode_parts,
    like_parts,
    recv_parts,
    send_parts,
    state_key,
    transport_key,
)
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import RankMismatch, one_error, open_nursery, shape_mismatch

PHASE = "direct"  # the transport key phase of its rounds (its own: a ring on the same group never meets them)
RS, AG = 0, 1  # the step field of their keys: the reduce-scatter's round and the all-gather's
# One key per phase for every codec, so a peer that called with another codec sends on the key this rank waits on and
# its call code tells (RankMismatch), instead of this rank waiting on a key nobody sends. The transport keeps error
# feedback per key and adds a key's residual to its next send, a lossless post included: a lossless call after lossy
# ones of the same bucket id delivers what they kept back (conserved, not exact that once)


class DirectAllReduce(Collective):
    """Sum (or mean) of a bucket over the group in two rounds (see the module docstring). Same API as
    :class:`~dgt.collectives.RingAllReduce`: ``allreduce(bucket, bucket_id, segments, *, out)``."""

    name = "direct all-reduce"
    round_family = "direct"
    needs_summable = True

    def __init__(self, group: Group, codec: str | Codec = "dense", op: str = "mean", one_round_bytes: int = 0) -> None:
        if one_round_bytes < 0:
            raise ValueError("one_round_bytes must be >= 0")
        super().__init__(group, codec, op)
        check_world(self.group.world, self.name)
        self.one_round_bytes = int(one_round_bytes)  # dense buckets up to this size: one round (module docstring)
        self._scratch: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}

    @tells_peers
    @one_error
    @any_layout
    async def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
                        out: torch.Tensor | None = None) -> CollectiveResult:
        """Sum (or mean) of ``bucket`` over the group. ``out``: where the result goes (``bucket`` itself for an
        in-place all-reduce); by default a new tensor."""
        self.check_input(bucket)
        g = self.group
        stats = CollectiveStats()
        if g.world == 1:
            return self.alone(bucket, out, stats)
        await self.connect()  # every other rank, on the first call; then it does not yield
        direct = self._direct(bucket)
        # direct: the input is only read: every chunk of the result is written by the owner's sum or lands from the
        # all-gather, which an owner sends only once it received this rank's chunk (so nothing lands in a chunk this
        # rank still sends from, even in place)
        src, flat = self.source_and_result(bucket, out, direct)
        rnd = g.next_round(self.round_family, bucket_id)
        if direct and 0 < flat.numel() * flat.element_size() <= self.one_round_bytes:
            await self._one_round(src, flat, bucket_id, rnd, stats)
            return CollectiveResult(self.finish(flat, inplace=True).view_as(bucket), stats)
        ch = self.chunking(segments or [flat.numel()], self.codec.capabilities.block, g.world)
        if direct:
            await self._lossless(ch, src, flat, bucket_id, rnd, stats)
        else:
            await self._coded(ch, flat, bucket_id, rnd, stats)
        return CollectiveResult(self.finish(flat, inplace=True).view_as(bucket), stats)

    # -- a codec whose chunks are their own wire form, lossless (dense) -------------------------------------------
    async def _lossless(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                        stats: CollectiveStats) -> None:
        g = self.group
        ep = g.endpoint
        W, r = g.world, g.rank
        op = self.call_code
        rs_key, ag_key = transport_key(bucket_id, PHASE, RS), transport_key(bucket_id, PHASE, AG)
        mine = ch.chunk(flat, r)
        others = [w for w in range(W) if w != r]
        land = {w: self._scratch_for(mine, bucket_id, w) for w in others} if mine.numel() else {}
        # post every landing now: a peer running ahead must not find its message without a buffer
        for w in land:
            ep.post_recv(w, rs_key, rnd, land[w])
        for j in others:
            if ch.chunk(flat, j).numel():
                ep.post_recv(j, ag_key, rnd, ch.chunk(flat, j))
        pending = []
        try:
            with self.phase(stats, "reduce_scatter"):
                for j in others:  # chunk j to its owner, every owner at once
                    piece = ch.chunk(src, j)
                    if piece.numel():
                        pending.append(ep.post_send(j, rs_key, rnd, piece, op=op))
                        stats.add_sent(0, piece.numel() * piece.element_size())
                await self._land_all(land, rs_key, rnd, stats)
                if mine.numel():
                    self._reduce(mine, [land[w] if w != r else ch.chunk(src, r) for w in range(W)])
            with self.phase(stats, "all_gather"):
                if mine.numel():
                    for w in others:  # the reduced chunk to every other rank at once
                        pending.append(ep.post_send(w, ag_key, rnd, mine, op=op))
                        stats.add_sent(0, mine.numel() * mine.element_size())
                await self._land_all({j: ch.chunk(flat, j) for j in others if ch.chunk(flat, j).numel()}, ag_key,
                                     rnd, stats)
                for p in pending:
                    await p.wait()  # the caller may overwrite its input (or read ``flat``) once this returns
        except BaseException:
            # landings not opened yet must not be written after this call gave up
            for w in land:
                ep.post_recv(w, rs_key, rnd, None)
            for j in others:
                if ch.chunk(flat, j).numel():
                    ep.post_recv(j, ag_key, rnd, None)
            raise

    async def _one_round(self, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                         stats: CollectiveStats) -> None:
        """A small dense bucket: ``src`` whole to every other rank at once (on the reduce-scatter's key: a peer that
        cut the bucket otherwise sends a message of another size, which the landing refuses), every rank's
        contribution landed, and the sum in rank order written to ``flat`` once every send is done (``flat`` may be
        ``src``)."""
        g = self.group
        ep = g.endpoint
        W, r = g.world, g.rank
        op = self.call_code
        key = transport_key(bucket_id, PHASE, RS)
        others = [w for w in range(W) if w != r]
        land = {w: self._scratch_for(src, bucket_id, w) for w in others}
        for w in others:
            ep.post_recv(w, key, rnd, land[w])
        try:
            with self.phase(stats, "one_round"):
                pending = [ep.post_send(j, key, rnd, src, op=op) for j in others]
                stats.add_sent(0, len(others) * src.numel() * src.element_size())
                await self._land_all(land, key, rnd, stats)
                for p in pending:
                    await p.wait()  # before the sum overwrites ``flat``, which may be the input sent from in place
                self._reduce(flat, [land[w] if w != r else src for w in range(W)])
        except BaseException:
            for w in others:  # landings not opened yet must not be written after this call gave up
                ep.post_recv(w, key, rnd, None)
            raise

    # -- any other summable codec: encode, rounds with lane classes, decode ---------------------------------------
    async def _coded(self, ch: Chunking, flat: torch.Tensor, bucket_id: int, rnd: int, stats: CollectiveStats) -> None:
        """``flat``: a working copy of the input; every chunk is encoded from it (and handed to the transport)
        before the owner's sum and the all-gather write it."""
        with self.phase(stats, "reduce_scatter"):
            template = await self._coded_rs(ch, flat, bucket_id, rnd, stats)
        with self.phase(stats, "all_gather"):
            await self._coded_ag(ch, flat, bucket_id, rnd, stats, template)

    async def _coded_rs(self, ch: Chunking, flat: torch.Tensor, bucket_id: int, rnd: int,
                        stats: CollectiveStats) -> list[Part]:
        """The reduce-scatter: chunk j encoded (the codec classes its blocks: important ones reliable, the rest
        droppable) and sent to rank j, every j at once; this rank's chunk summed. Returns parts of this call (the
        geometry of a peer's parts)."""
        g = self.group
        ep = g.endpoint
        W, r = g.world, g.rank
        op = self.call_code
        mine = ch.chunk(flat, r)
        sent: dict[int, list[Part]] = {}
        for j in range(W):
            piece = ch.chunk(flat, j)
            if j != r and piece.numel():
                sent[j] = self.codec.encode(piece, self.state(state_key("drs", bucket_id, j), piece, ch.segments[j]))
        template = next(iter(sent.values()), [])
        like = like_parts(template, ch.segments[r], self.codec, mine)
        got: dict[int, list[Received]] = {}

        async def rs_from(w: int) -> None:
            got[w] = await recv_parts(ep, w, bucket_id, PHASE, RS, rnd, like, stats, device=mine.device,
                                      exact=self.codec.capabilities.summable, op=op)

        async with open_nursery() as nursery:
            for j, parts in sent.items():
                # the owner needs what arrives by the deadline, not the drop report: error feedback folds it in
                nursery.start_soon(partial(send_parts, ep, j, bucket_id, PHASE, RS, rnd, parts, stats,
                                           wait_report=False, op=op))
            if like:
                for w in range(W):
                    if w != r:
                        nursery.start_soon(rs_from, w)
        if like:
            terms = [mine if w == r else decode_parts(self.codec, got[w], self.state(
                state_key("drs-rx", bucket_id, w), mine, ch.segments[r]), mine, w, rnd) for w in range(W)]
            self._reduce(mine, terms)
        return template or like

    async def _coded_ag(self, ch: Chunking, flat: torch.Tensor, bucket_id: int, rnd: int, stats: CollectiveStats,
                        template: list[Part]) -> None:
        """The all-gather: this rank's reduced chunk, encoded, to every other rank at once on the reliable lane
        (the owner keeps exactly what they decode: a cast on the wire rounds it); every other chunk from its
        owner."""
        g = self.group
        ep = g.endpoint
        W, r = g.world, g.rank
        op = self.call_code
        mine = ch.chunk(flat, r)
        parts = []
        if mine.numel():
            parts = self.codec.encode(mine, self.state(state_key("dag", bucket_id), mine, ch.segments[r]))
            own = self.state(state_key("dag-rx", bucket_id, r), mine, ch.segments[r])
            mine.copy_(self.codec.decode([as_received(p) for p in parts], own, mine))
        rx: dict[int, list[Received]] = {}

        async def ag_from(j: int, like: list[Part]) -> None:
            rx[j] = await recv_parts(ep, j, bucket_id, PHASE, AG, rnd, like, stats, device=mine.device,
                                     exact=self.codec.capabilities.summable, op=op)

        async with open_nursery() as nursery:
            for j in range(W):
                piece = ch.chunk(flat, j)
                if j == r:
                    for w in range(W) if parts else ():
                        if w != r:
                            nursery.start_soon(partial(send_parts, ep, w, bucket_id, PHASE, AG, rnd, parts, stats,
                                                       True, wait_report=False, op=op))
                elif piece.numel():
                    nursery.start_soon(ag_from, j, like_parts(parts or template, ch.segments[j], self.codec, piece))
        for j, recv in rx.items():
            piece = ch.chunk(flat, j)
            st = self.state(state_key("dag-rx", bucket_id, j), piece, ch.segments[j])
            piece.copy_(decode_parts(self.codec, recv, st, piece, j, rnd))

    # -- helpers -----------------------------------------------------------------------------------------------
    async def _land_all(self, into: dict[int, torch.Tensor], key: int, rnd: int, stats: CollectiveStats) -> None:
        """Receive round ``rnd`` of ``key`` from every peer of ``into`` at once, each landed in its buffer (posted
        before), its op checked against this call's."""
        ep, op = self.group.endpoint, self.call_code

        async def land(w: int) -> None:
            res = await ep.recv_round(w, key, rnd, out=into[w])
            stats.add_round(res.stats)
            check_op(op, res.codec, rnd)

        async with open_nursery() as nursery:
            for w in into:
                nursery.start_soon(land, w)

    @staticmethod
    def _reduce(mine: torch.Tensor, terms: list[torch.Tensor]) -> None:
        """``mine`` = the sum of ``terms`` (one per rank) in rank order; fp16/bf16 accumulate in float32. A term of
        another size than ``mine`` means the ranks cut the bucket differently (checked on arrival already)."""
        for t in terms:
            if t.numel() != mine.numel():
                raise RankMismatch(shape_mismatch(-1), detail=f"a contribution of {t.numel()} elements to a chunk of "
                                   f"{mine.numel()}")
        mine.copy_(rank_order_sum(terms, mine.dtype))

    def _direct(self, flat: torch.Tensor) -> bool:
        """A lossless codec whose chunks travel as one part in the bucket's own dtype (dense): posted and landed in
        place, no encode or decode."""
        caps = self.codec.capabilities
        return (caps.in_place and not caps.lossy_tolerant and (caps.wire_dtype or flat.dtype) == flat.dtype
                and flat.device.type == "cpu")

    def _scratch_for(self, mine: torch.Tensor, bucket_id: int, peer: int) -> torch.Tensor:
        """Where the reduce-scatter message from ``peer`` lands: one buffer per bucket and peer, reused across
        calls (a call reduces it before it returns)."""
        key = (bucket_id, mine.numel(), mine.dtype, peer)
        buf = self._scratch.get(key)
        if buf is None:
            if len(self._scratch) >= 256:
                self._scratch.clear()
            buf = self._scratch[key] = torch.empty(mine.numel(), dtype=mine.dtype)
        return buf
