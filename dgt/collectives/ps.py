"""Parameter server over the DGT transport (the DGT paper's setting): workers push, the server aggregates, workers
pull.

Two placements: a central server rank (every rank is also a worker; the server's own gradient never crosses the
network), or ``server="sharded"``: every rank owns one block-aligned shard, reduces it and sends it back (with
``shards=S``, S ranks spread over the world serve one shard each: a worker then connects to S servers, not W-1).

Dropped blocks count as zeros from that worker. How the average is normalised is an option: ``normalize="world"``
divides every element by K (a lost block biases that block towards zero, like plain gradient dropping), while
``normalize="contributors"`` divides each element by the number of workers whose block arrived (unbiased for i.i.d.
worker gradients; needs codecs whose parts are element-aligned with the bucket, i.e. dense and dgt). Pulls travel on
the reliable lane by default, so every worker gets the identical aggregate; ``lossy_pull=True`` lets the pull use
the codec's lanes as well.

Lossless dense float32 buckets on the CPU (stream hops on) skip the generic push/gather/pull and run as one ordered
exchange on stream lanes, like the ring (:meth:`ParameterServer._stream_allreduce`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from dgt.codecs.base import Codec, Received
from dgt.collectives.base import Collective, any_layout, tells_peers
from dgt.collectives.chunks import Chunking
from dgt.collectives.group import Group
from dgt.collectives.parts import (
    FAMILY_MASK,
    as_received,
    check_world,
    decode_parts,
    like_parts,
    recv_parts,
    send_parts,
    state_key,
    transport_key,
)
from dgt.collectives.plan import CallPlan, plan_call
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import CodecMismatch, one_error, open_nursery
from dgt.transport.streams import Hop


@dataclass
class _Call:
    """One call on the round path, as its shards' tasks share it: the cut, the input, the result, and the call's
    keys, statistics and call code."""

    ch: Chunking
    flat: torch.Tensor
    out: torch.Tensor
    bucket_id: int
    rnd: int
    stats: CollectiveStats
    op: int


class ParameterServer(Collective):
    name = "parameter server"
    round_family = "ps"

    def __init__(self, group: Group, codec: str | Codec = "dense", op: str = "mean", server: int | str = 0,
                 normalize: str = "world", lossy_pull: bool = False, shards: int | None = None) -> None:
        super().__init__(group, codec, op)
        if normalize not in ("world", "contributors"):
            raise ValueError("normalize must be 'world' or 'contributors'")
        if normalize == "contributors" and not self.codec.capabilities.summable:
            raise CodecMismatch(f"normalize='contributors' needs an element-aligned codec; {self.codec.name!r} is not")
        if server != "sharded" and not (isinstance(server, int) and 0 <= server < group.world):
            raise ValueError("server must be a rank or 'sharded'")
        if server == "sharded":
            check_world(group.world, "sharded parameter server")
        W = group.world
        if shards is not None and (server != "sharded" or not 1 <= shards <= W):
            raise ValueError(f"shards: 1..{W} shard servers, and only with server='sharded'")
        S = W if shards is None else shards
        self.servers = [i * W // S for i in range(S)] if server == "sharded" else [server]
        self.server = server
        self.normalize = normalize
        self.lossy_pull = lossy_pull

    @tells_peers
    @one_error
    @any_layout
    async def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
                        out: torch.Tensor | None = None) -> CollectiveResult:
        """The server's aggregate of ``bucket`` over the group (every worker pulls it). ``out``: where the result
        goes (``bucket`` itself for an in-place all-reduce); by default a new tensor."""
        self.check_input(bucket)
        g = self.group
        if g.world > 1:
            await self.connect()  # workers-server (sharded: every rank serves a shard), first call only
        plan = plan_call(self, bucket, out=out, servers=self.servers, sharded=self.server == "sharded")
        if plan.schedule == "ps-streams":
            # no await before this point: the exchange's ticket follows the order collectives were called in
            return await self._stream_allreduce(bucket, bucket_id, segments or [bucket.numel()], out, plan)
        if out is not None:
            res = await self.allreduce(bucket, bucket_id, segments)
            self.working_copy(res.tensor, out)
            return CollectiveResult(out.view_as(bucket), res.stats)
        flat = bucket.detach().reshape(-1).clone()
        stats = CollectiveStats(plan=plan)
        if g.world == 1:
            return CollectiveResult(self.finish(flat).view_as(bucket), stats)
        rnd = g.next_round("ps", bucket_id)
        ch = self.chunking(segments or [flat.numel()], self.codec.capabilities.block, len(self.servers))
        out = flat.clone()
        self._announce_round_path(bucket_id, rnd)
        call = _Call(ch, flat, out, bucket_id, rnd, stats, self.code_of(stats))
        async with open_nursery() as nursery:
            for shard, owner in enumerate(self.servers):
                nursery.start_soon(self._serve_shard, call, shard, owner)
        return CollectiveResult(out.view_as(bucket), stats)  # averaged by the server already: op is applied there

    async def _serve_shard(self, call: _Call, shard: int, owner: int) -> None:
        """Shard ``shard`` of the round path: a worker pushes it to ``owner`` and pulls the aggregate; its owner
        gathers every worker's, reduces and sends the result back."""
        g = self.group
        ch, flat, bucket_id, rnd, stats, op = call.ch, call.flat, call.bucket_id, call.rnd, call.stats, call.op
        piece = ch.chunk(flat, shard)
        if piece.numel() == 0:
            return
        sg = ch.segments[shard]
        parts = self.codec.encode(piece, self.state(state_key("push", bucket_id, shard), piece, sg))
        if owner != g.rank:  # worker: push, then pull
            with self.phase(stats, "push"):
                await send_parts(g.endpoint, owner, bucket_id, "push", shard, rnd, parts, stats, op=op)
            with self.phase(stats, "pull"):
                like = like_parts(parts, sg, self.codec, piece)
                got = await recv_parts(g.endpoint, owner, bucket_id, "pull", shard, rnd, like, stats,
                                       device=piece.device, exact=self.codec.capabilities.summable, op=op)
                pull_state = self.state(state_key("pull-rx", bucket_id, shard), piece, sg)
                ch.chunk(call.out, shard).copy_(decode_parts(self.codec, got, pull_state, piece, owner, rnd))
            return
        with self.phase(stats, "gather"):
            received = await self._gather(call, shard, piece, parts)
        with self.phase(stats, "reduce"):
            reduced = self._reduce(call, shard, piece, received)
        with self.phase(stats, "pull"):
            pull = self.codec.encode(reduced, self.state(state_key("pull", bucket_id, shard), reduced, sg))
            own_rx = self.state(state_key("pull-rx", bucket_id, shard), piece, sg)
            mine = self.codec.decode([as_received(p) for p in pull], own_rx, piece)
            ch.chunk(call.out, shard).copy_(mine)
            async with open_nursery() as nursery:
                for w in range(g.world):
                    if w != g.rank:
                        nursery.start_soon(partial(send_parts, g.endpoint, w, bucket_id, "pull", shard, rnd,
                                                   pull, stats, not self.lossy_pull, op=op))

    async def _gather(self, call: _Call, shard: int, piece: torch.Tensor, parts: list) -> dict[int, list[Received]]:
        """The server of ``shard``: every worker's parts (its own as they are)."""
        g = self.group
        sg = call.ch.segments[shard]
        received: dict[int, list[Received]] = {g.rank: [as_received(p) for p in parts]}

        async def gather(w: int) -> None:
            like = like_parts(parts, sg, self.codec, piece)
            received[w] = await recv_parts(g.endpoint, w, call.bucket_id, "push", shard, call.rnd, like, call.stats,
                                           device=piece.device, exact=self.codec.capabilities.summable, op=call.op)

        async with open_nursery() as nursery:
            for w in range(g.world):
                if w != g.rank:
                    nursery.start_soon(gather, w)
        return received

    def _reduce(self, call: _Call, shard: int, piece: torch.Tensor,
                received: dict[int, list[Received]]) -> torch.Tensor:
        """The server of ``shard``: every worker's parts decoded and reduced (``op`` and ``normalize`` applied)."""
        sg = call.ch.segments[shard]
        decoded, counts = [], torch.zeros(piece.numel(), dtype=torch.float32, device=piece.device)
        for w in range(self.group.world):
            st = self.state(state_key("push-rx", call.bucket_id, shard, w), piece, sg)
            decoded.append(decode_parts(self.codec, received[w], st, piece, w, call.rnd).to(piece.dtype))
            if self.normalize == "contributors":
                counts += received[w][0].element_mask().to(device=piece.device, dtype=torch.float32)
        total = self.codec.aggregate(decoded)
        return self.finish(total, counts.clamp(min=1) if self.normalize == "contributors" else None)

    def _announce_round_path(self, bucket_id: int, rnd: int) -> None:
        """A central server on the round path receives first, so a worker that runs the call on stream lanes (its
        tensor took the other path) would wait for a lane or a pull until ``peer_timeout``: tell every worker which
        path this round takes; such a worker raises RankMismatch and tells every rank (issue 22)."""
        g = self.group
        if g.rank == self.server:
            for w in range(g.world):
                if w != g.rank:
                    g.endpoint.announce_on_link(w, transport_key(bucket_id, "pull"), rnd)

    def peers(self) -> list[int]:
        g = self.group
        if g.rank in self.servers:
            return [r for r in range(g.world) if r != g.rank]
        return [s for s in self.servers if s != g.rank]

    async def _stream_allreduce(self, bucket: torch.Tensor, bucket_id: int, segments: list[int],
                                out: torch.Tensor | None, plan: CallPlan) -> CollectiveResult:
        """The whole push and pull as one exchange on stream lanes (dgt.transport.streams); pushes are added on
        arrival, straight into the owner's part of the result.

        Sharded: at step s = 1..W-1 rank r sends shard r+s to its owner while shard r arrives from rank r-s (every
        rank sends and receives at once), then the summed shard goes back the same way. Central: the server takes
        the workers' buckets one after another, then sends the sum to each. Every rank applies ``op`` to the same
        sum, so all end with identical tensors, as with the generic path."""
        g = self.group
        W, r = g.world, g.rank
        src = bucket.detach().reshape(-1)
        res = self.result_buffer(bucket, out)
        rnd = g.next_round("ps", bucket_id)
        push, pull = transport_key(bucket_id, "push"), transport_key(bucket_id, "pull")
        stats = CollectiveStats(plan=plan)
        op = self.code_of(stats)  # in every message this call sends, compared by every receiver
        hops: list[Hop] = []
        ch = self.chunking(segments, self.codec.capabilities.block, W if self.server == "sharded" else 1)
        if self.server == "sharded":
            mine = ch.chunk(res, r)
            for s in range(1, W):
                to, frm = (r + s) % W, (r - s) % W
                hops.append(Hop(transport_key(bucket_id, "push", s), rnd, to, ch.chunk(src, to), frm, mine,
                                add_src=ch.chunk(src, r) if s == 1 else mine, op=op))
            for s in range(1, W):
                to, frm = (r + s) % W, (r - s) % W
                hops.append(Hop(transport_key(bucket_id, "pull", s), rnd, to, mine, frm, ch.chunk(res, frm), op=op))
        elif r == self.server:
            workers = [w for w in range(W) if w != r]
            hops = [Hop(push, rnd, recv_from=w, land=res, add_src=res if i else src, op=op)
                    for i, w in enumerate(workers)]
            hops += [Hop(pull, rnd, send_to=w, payload=res, op=op) for w in workers]
        else:
            hops = [Hop(push, rnd, send_to=self.server, payload=src, op=op),
                    Hop(pull, rnd, recv_from=self.server, land=res, op=op)]
        t0 = time.monotonic()
        done = await g.endpoint.exchange(hops, family=FAMILY_MASK)
        self.count_exchange(stats, hops, done, ch, res)
        pushed = done[len(hops) // 2 - 1].finished  # pushes come first, then as many pulls
        stats.phases["push"] = pushed - t0
        stats.phases["pull"] = done[-1].finished - pushed
        return CollectiveResult(self.finish(res, inplace=True).view_as(bucket), stats)
