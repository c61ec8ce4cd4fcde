"""Ring all-reduce over the DGT transport: reduce-scatter (lossy allowed) then all-gather (always reliable).

Behaviour when blocks drop: in reduce-scatter step s a rank forwards the partial sum of one chunk; a block of it that
is lost at the deadline arrives as zeros, so that block's partial sum loses the contributions of every rank upstream
of the loss (the sender's error feedback re-sends it in a later round). The all-gather phase sends the reduced chunks
on the reliable lane, so every rank ends with the identical result, and the chunk owner keeps exactly the decoded
value the others receive.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from dgt.codecs.base import Received
from dgt.collectives.base import Collective, any_layout, tells_peers
from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import (
    FAMILY_MASK,
    as_received,
    check_op,
    check_world,
    like_parts,
    recv_parts,
    send_parts,
    state_key,
    transport_key,
)
from dgt.collectives.plan import plan_call
from dgt.collectives.ring_gather import SparseGather, nonzero_blocks
from dgt.collectives.ring_hold import HeldBack
from dgt.collectives.ring_lossy import LossyHops
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import one_error, open_nursery
from dgt.layout import BucketLayout
from dgt.transport.streams import Hop


class RingAllReduce(Collective):
    name = "ring all-reduce"
    round_family = "ring"
    needs_summable = True
    prepost = True  # lossless: post each reduce-scatter scratch for the next round once this round is done with it
    # a lossy ring's all-gather on stream lanes sends only the blocks that hold a value (dgt.collectives.ring_gather);
    # off by default: a dense chunk then costs an extra message per hop (its cost on loopback not yet measured
    # cleanly, see docs/collectives.md); the hook's DGTState turns it on for its lossy collective
    sparse_gather = False
    # a lossy ring's owner holds its own contribution back where the last reduce-scatter hop brought nothing, so the
    # result is as sparse as what arrived (dgt.collectives.ring_hold); off by default: DGTState(sparse=True) sets it
    hold_own = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_world(self.group.world, self.name)
        self._scratch: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        self._lossy = LossyHops(self)
        self._held = HeldBack()
        self._gather = SparseGather()

    @tells_peers
    @one_error
    @any_layout
    async def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
                        out: torch.Tensor | None = None) -> CollectiveResult:
        """Sum (or mean) of ``bucket`` over the group. ``out``: where the result goes (``bucket`` itself for an
        in-place all-reduce); by default a new tensor."""
        self.check_input(bucket)
        g = self.group
        W = g.world
        stats = CollectiveStats()
        if W == 1:
            stats.plan = plan_call(self, bucket)
            return self.alone(bucket, out, stats)
        await self.connect()  # the two neighbours, on the first call; then it does not yield
        ch = self.chunking(segments or [bucket.numel()], self.codec.capabilities.block, W)
        plan = stats.plan = plan_call(self, bucket, chunks=ch, out=out, sparse_gather=self.sparse_gather)
        # direct: no copy of the input first. Every chunk of the result is written by a reduce-scatter add (input
        # chunk + received) or lands from the all-gather, so the input is only read, in the hops. A lossy round's
        # drop report comes after this call returns, but the transport sends such a round from its own copy
        # (send_round without waiting for the report), which error feedback reads
        src, flat = self.source_and_result(bucket, out, plan.direct)
        rnd = g.next_round("ring", bucket_id)
        # no await from here to the first exchange: its ticket follows the order collectives were called in
        if plan.schedule == "ring-streams":
            await self._stream_steps(ch, src, flat, bucket_id, rnd, stats)
        elif plan.schedule == "ring-lossy-streams":
            await self._lossy_steps(ch, src, flat, bucket_id, rnd, stats)
        else:
            await self._round_steps(ch, src, flat, bucket_id, rnd, stats)
        return CollectiveResult(self.finish(flat, inplace=True).view_as(bucket), stats)

    async def _round_steps(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                           stats: CollectiveStats) -> None:
        """The ``ring-rounds`` schedule: every hop a round on the session link (the all-gather of a lossy direct
        codec one exchange on stream lanes, by the plan)."""
        g = self.group
        W, r = g.world, g.rank
        direct = stats.plan.direct
        own = (r + 1) % W  # after W-1 reduce-scatter steps this rank holds the full sum of chunk r+1
        rs_land = [self._scratch_for(ch.chunk(flat, (r - s - 1) % W), s) for s in range(W - 1)] if direct else None
        ag_land = [ch.chunk(flat, (own - s - 1) % W) for s in range(W - 1)] if direct else None
        # a lossy direct codec: the all-gather (lossless) runs as one exchange on the stream lanes, whose place in
        # the call order is taken now, before the first await (the reduce-scatter rounds come first)
        ag = [g.endpoint.reserve_exchange()] if stats.plan.gather in ("streams", "sparse-streams") else None
        try:
            if direct:
                # post every step's landing now: a neighbour running ahead must not find its round without a buffer
                self._post(rs_land, bucket_id, "rs", rnd)
                if not self.codec.capabilities.lossy_tolerant:
                    # all-gather targets are chunks this rank no longer reads once it sent them; with a lossy codec a
                    # drop report may still read them (error feedback), so those are posted after reduce-scatter
                    self._post(ag_land, bucket_id, "ag", rnd)
            if ch.chunk(src, r).numel() == 0:
                # this rank's first hop sends nothing (a bucket of fewer than W blocks), and it may block on its own
                # receive before its first send: tell the next rank this call runs on rounds, which a rank whose
                # tensor took the stream path (another dtype) would otherwise wait peer_timeout to learn (issue 45)
                g.endpoint.announce_on_link((r + 1) % W, transport_key(bucket_id, "rs"), rnd)
            await self._steps(ch, src, flat, bucket_id, rnd, stats, direct, rs_land, ag_land, ag)
        except BaseException:
            if ag and ag[0] is not None:  # its exchange never ran: later exchanges must not wait for it
                g.endpoint.forfeit_exchange(ag[0])
            if direct:  # rounds not open yet must not land in the caller's tensor after this call gave up
                self._post([None] * len(rs_land), bucket_id, "rs", rnd)
                self._post([None] * len(ag_land), bucket_id, "ag", rnd)
                self._post([None] * len(rs_land), bucket_id, "rs", rnd + 1)
            raise

    async def _lossy_steps(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                           stats: CollectiveStats) -> None:
        """The ``ring-lossy-streams`` schedule (dgt.collectives.ring_lossy): each reduce-scatter hop is one
        ``lossy_hop`` call of the transport (its important blocks on the stream lane, the rest a DGT round); the
        all-gather is one stream exchange. Every exchange's place in the call order is reserved here, before the
        first await."""
        W, r = self.group.world, self.group.rank
        ep = self.group.endpoint
        rs_land = [self._scratch_for(ch.chunk(flat, (r - s - 1) % W), s) for s in range(W - 1)]
        tickets: list[int | None] = [ep.reserve_exchange() for _ in range(W - 1)]
        ag: list[int | None] = [ep.reserve_exchange()]
        try:
            with self.phase(stats, "reduce_scatter"):
                await self._lossy.reduce_scatter(ch, src, flat, bucket_id, rnd, stats, rs_land, tickets,
                                                 self._held if self.hold_own else None)
            await self._stream_gather(ch, flat, bucket_id, rnd, stats, ag)
        except BaseException:
            for t in [*tickets, *ag]:
                if t is not None:  # never ran: later exchanges must not wait for it
                    ep.forfeit_exchange(t)
            raise

    async def _steps(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                     stats: CollectiveStats, direct: bool, rs_land: list[torch.Tensor] | None,
                     ag_land: list[torch.Tensor] | None, ag: list[int | None] | None = None) -> None:
        """``src``: the input (``flat`` itself unless the lossless path skipped the copy); step 0 sends from it and
        every reduce-scatter add reads it, writing ``flat``. ``ag``: ``[ticket]`` when the all-gather runs as an
        exchange on stream lanes (set to None once the exchange holds it)."""
        W, r = self.group.world, self.group.rank
        own = (r + 1) % W
        with self.phase(stats, "reduce_scatter"):
            for s in range(W - 1):
                # codec state follows (bucket, step): the same chunk travels at the same step every round
                into = [rs_land[s]] if direct else None
                dec = await self._hop(ch, src if s == 0 else flat, (r - s) % W, (r - s - 1) % W, bucket_id, "rs", s,
                                      rnd, stats, state_key=state_key("rs", bucket_id, s), into=into)
                if dec is not None:  # (None: an empty chunk)
                    c = (r - s - 1) % W
                    hold = s == W - 2 and self.hold_own and self.codec.capabilities.lossy_tolerant
                    own_src = self._held.add_to(bucket_id, c, ch.chunk(src, c)) if hold else ch.chunk(src, c)
                    torch.add(own_src, dec.to(flat.dtype), out=ch.chunk(flat, c))
                    if hold:  # nothing arrived on a block: this rank's own value waits too (ring_hold)
                        lay = BucketLayout.of(ch.segments[c], ch.layout.block)
                        arrived = torch.from_numpy(nonzero_blocks(dec, lay))
                        stats.held_blocks += self._held.keep(bucket_id, c, own_src, ch.chunk(flat, c), arrived, lay)
                if direct and self.prepost and not self.codec.capabilities.lossy_tolerant:
                    # this step's scratch is free again: post it for the next round now, so a neighbour that
                    # finishes this call first and starts the next one lands there instead of in a fresh buffer
                    self._post(rs_land[s : s + 1], bucket_id, "rs", rnd + 1, first=s)
        if ag is not None:
            await self._stream_gather(ch, flat, bucket_id, rnd, stats, ag)
            return
        if direct and self.codec.capabilities.lossy_tolerant:
            self._post(ag_land, bucket_id, "ag", rnd)
        with self.phase(stats, "all_gather"):
            for s in range(W - 1):
                into = [ag_land[s]] if direct else None
                # the owner keeps exactly what the others decode; with a direct codec that is the chunk itself
                dec = await self._hop(ch, flat, (own - s) % W, (own - s - 1) % W, bucket_id, "ag", s, rnd, stats,
                                      state_key=state_key("ag", bucket_id), reliable=True,
                                      keep_own=(s == 0 and not direct), into=into)
                if dec is not None and not direct:
                    ch.chunk(flat, (own - s - 1) % W).copy_(dec)

    async def _stream_steps(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                            stats: CollectiveStats) -> None:
        """The whole ring as one exchange on stream lanes (dgt.transport.streams): each reduce-scatter hop adds the
        received chunk to this rank's input on arrival, straight into ``flat``; all-gather hops land in ``flat``."""
        g = self.group
        W, r = g.world, g.rank
        nxt, prv, own = (r + 1) % W, (r - 1) % W, (r + 1) % W
        op = self.code_of(stats)
        hops = []
        for s in range(W - 1):
            a, c = (r - s) % W, (r - s - 1) % W
            hops.append(Hop(transport_key(bucket_id, "rs", s, 0), rnd, nxt, ch.chunk(src if s == 0 else flat, a), prv,
                            ch.chunk(flat, c), add_src=ch.chunk(src, c), op=op))
        for s in range(W - 1):
            hops.append(Hop(transport_key(bucket_id, "ag", s, 0), rnd, nxt, ch.chunk(flat, (own - s) % W), prv,
                            ch.chunk(flat, (own - s - 1) % W), op=op))
        t0 = time.monotonic()
        done = await g.endpoint.exchange(hops, family=FAMILY_MASK)
        self.count_exchange(stats, hops, done, ch, flat)
        stats.phases["reduce_scatter"] = stats.phases.get("reduce_scatter", 0.0) + done[W - 2].finished - t0
        stats.phases["all_gather"] = stats.phases.get("all_gather", 0.0) + done[-1].finished - done[W - 2].finished

    async def _stream_gather(self, ch: Chunking, flat: torch.Tensor, bucket_id: int, rnd: int,
                             stats: CollectiveStats, ag: list[int | None]) -> None:
        """The all-gather of a lossy ring on stream lanes: W-1 lossless hops in the native loop (GIL released), the
        reduced chunks landing in ``flat``, instead of W-1 DGT rounds on the session link; with ``sparse_gather``
        each hop carries only the blocks of its chunk that hold a value, or the chunk densely
        (dgt.collectives.ring_gather). The sender of
        each reduce-scatter round keeps its own copy for error feedback, so ``flat`` may be overwritten here."""
        ticket, ag[0] = ag[0], None  # the exchange (or the gather, failing before it) gives the ticket back
        if stats.plan.gather == "sparse-streams":
            with self.phase(stats, "all_gather"):
                await self._gather.gather(self, ch, flat, bucket_id, rnd, stats, ticket)
            return
        g = self.group
        W, r = g.world, g.rank
        nxt, prv, own = (r + 1) % W, (r - 1) % W, (r + 1) % W
        hops = [Hop(transport_key(bucket_id, "ag", s, 0), rnd, nxt, ch.chunk(flat, (own - s) % W), prv,
                    ch.chunk(flat, (own - s - 1) % W)) for s in range(W - 1)]
        with self.phase(stats, "all_gather"):
            done = await g.endpoint.exchange(hops, ticket=ticket, family=FAMILY_MASK)
        self.count_exchange(stats, hops, done, ch, flat)

    async def _hop(self, ch: Chunking, flat: torch.Tensor, send_c: int, recv_c: int, bucket_id: int, phase: str,
                   step: int, rnd: int, stats: CollectiveStats, state_key: tuple, reliable: bool = False,
                   keep_own: bool = False, into: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """Send chunk ``send_c`` to the next rank while receiving chunk ``recv_c`` from the previous one; returns the
        decoded received chunk (None when that chunk is empty). ``into``: the received chunk lands there whole."""
        g = self.group
        ep = g.endpoint
        out, mine = ch.chunk(flat, send_c), ch.chunk(flat, recv_c)
        if into is not None and not self.codec.capabilities.lossy_tolerant:
            return await self._lossless_hop(out, into[0] if mine.numel() else None, bucket_id, phase, step, rnd, stats)
        parts = self.codec.encode(out, self.state(state_key, out, ch.segments[send_c])) if out.numel() else []
        if keep_own and parts:  # the owner keeps exactly what the others will decode
            out.copy_(self.codec.decode([as_received(p) for p in parts], self.state(state_key, out, None), out))
        if mine.numel() == 0:
            into = None
        like = [] if mine.numel() == 0 else like_parts(parts, ch.segments[recv_c], self.codec, mine)
        got: list[Received] = []

        async def recv() -> None:
            got.extend(await recv_parts(ep, (g.rank - 1) % g.world, bucket_id, phase, step, rnd, like, stats, into,
                                        device=mine.device, exact=True, op=self.code_of(stats)))

        async with open_nursery() as nursery:
            if parts:
                # the next hop needs what this one receives, not the drop report of what it sent: do not wait a
                # round trip per hop for it (error feedback folds it in when it comes)
                nursery.start_soon(partial(send_parts, ep, (g.rank + 1) % g.world, bucket_id, phase, step, rnd, parts,
                                           stats, reliable, wait_report=False, op=self.code_of(stats)))
            if like:
                nursery.start_soon(recv)
        if not like:
            return None
        if into is not None:
            return into[0]  # reassembled in place (a dense chunk: the decoded value is the data itself)
        return self.codec.decode(got, self.state(("rx", *state_key), mine, ch.segments[recv_c]), mine)

    async def _lossless_hop(self, out: torch.Tensor, land: torch.Tensor | None, bucket_id: int, phase: str, step: int,
                            rnd: int, stats: CollectiveStats) -> torch.Tensor | None:
        """A hop of a direct lossless codec (a chunk is its own wire form): the chunk ``out`` goes to the next rank
        as one lossless message while the previous rank's lands in ``land``. The send is queued on the connection's
        writer and the receive awaited from this task, so a hop spawns no task."""
        g = self.group
        ep = g.endpoint
        key = transport_key(bucket_id, phase, step, 0)
        op = self.code_of(stats)
        pending = None
        if out.numel():
            pending = ep.post_send((g.rank + 1) % g.world, key, rnd, out, op=op)
            stats.add_sent(0, out.numel() * out.element_size())
        if land is not None:
            res = await ep.recv_round((g.rank - 1) % g.world, key, rnd, out=land)
            stats.add_round(res.stats)
            check_op(op, res.codec, rnd)
        if pending is not None:
            await pending.wait()  # the chunk may be overwritten (all-gather landing) once this returns
        return land

    def peers(self) -> list[int]:
        g = self.group
        return sorted({(g.rank - 1) % g.world, (g.rank + 1) % g.world} - {g.rank})

    def _post(self, landings: list, bucket_id: int, phase: str, rnd: int, first: int = 0,
              zero_lost: bool = True) -> None:
        """Post (or, with None entries, withdraw) the landing buffers of steps ``first``, ``first + 1``... of
        ``phase`` (``zero_lost``: see ``post_recv``; a held landing is the transport's lossy hop's own)."""
        g = self.group
        for s, buf in enumerate(landings, first):
            if buf is None or buf.numel():
                g.endpoint.post_recv((g.rank - 1) % g.world, transport_key(bucket_id, phase, s, 0), rnd, buf,
                                     zero_lost=zero_lost)

    def _scratch_for(self, mine: torch.Tensor, step: int) -> torch.Tensor:
        """Where reduce-scatter step ``step`` receives (then adds from): one buffer per step, reused across rounds,
        so every step can be posted before the first one runs."""
        key = (mine.numel(), mine.dtype, step)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(mine.numel(), dtype=mine.dtype)
        return buf
