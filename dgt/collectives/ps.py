"""Parameter server over the DGT transport (the DGT paper's setting): workers push, the server aggregates, workers
pull.

Two placements: a central server rank (every rank is also a worker; the server's own gradient never crosses the
network), or ``server="sharded"``: every rank owns one block-aligned shard, reduces it and sends it back.

Dropped blocks count as zeros from that worker. How the average is normalised is an option: ``normalize="world"``
divides every element by K (a lost block biases that block towards zero, like plain gradient dropping), while
``normalize="contributors"`` divides each element by the number of workers whose block arrived (unbiased for i.i.d.
worker gradients; needs codecs whose parts are element-aligned with the bucket, i.e. dense and dgt). Pulls travel on
the reliable lane by default, so every worker gets the identical aggregate; ``lossy_pull=True`` lets the pull use
the codec's lanes as well.
"""

from __future__ import annotations

import torch
import trio

from dgt.codecs.base import Codec, Received
from dgt.collectives.base import Collective
from dgt.collectives.group import Group
from dgt.collectives.parts import as_received, like_parts, recv_parts, send_parts
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import CodecMismatch, one_error


class ParameterServer(Collective):
    name = "parameter server"

    def __init__(self, group: Group, codec: str | Codec = "dense", op: str = "mean", server: int | str = 0,
                 normalize: str = "world", lossy_pull: bool = False) -> None:
        super().__init__(group, codec, op)
        if normalize not in ("world", "contributors"):
            raise ValueError("normalize must be 'world' or 'contributors'")
        if normalize == "contributors" and not self.codec.capabilities.summable:
            raise CodecMismatch(f"normalize='contributors' needs an element-aligned codec; {self.codec.name!r} is not")
        if server != "sharded" and not (isinstance(server, int) and 0 <= server < group.world):
            raise ValueError("server must be a rank or 'sharded'")
        self.server = server
        self.normalize = normalize
        self.lossy_pull = lossy_pull

    @one_error
    async def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
                        out: torch.Tensor | None = None) -> CollectiveResult:
        """The server's aggregate of ``bucket`` over the group (every worker pulls it). ``out``: where the result
        goes (``bucket`` itself for an in-place all-reduce); by default a new tensor."""
        g = self.group
        if out is not None:
            res = await self.allreduce(bucket, bucket_id, segments)
            self.working_copy(res.tensor, out)
            return CollectiveResult(out.view_as(bucket), res.stats)
        flat = bucket.detach().reshape(-1).clone()
        stats = CollectiveStats()
        if g.world == 1:
            return CollectiveResult(self.finish(flat).view_as(bucket), stats)
        rnd = g.next_round("ps", bucket_id)
        segs = segments or [flat.numel()]
        block = getattr(self.codec, "block", 1024)
        if self.server == "sharded":
            ch = self.chunking(segs, block, g.world)
            owners = list(range(g.world))
        else:
            ch = self.chunking(segs, block, 1)
            owners = [self.server]
        out = flat.clone()

        async def serve_shard(shard: int, owner: int) -> None:
            piece = ch.chunk(flat, shard)
            if piece.numel() == 0:
                return
            sg = ch.segments[shard]
            key = bucket_id * 1024 + shard
            parts = self.codec.encode(piece, self.state(key, piece, sg))
            if owner != g.rank:  # worker: push, then pull
                with self.phase(stats, "push"):
                    await send_parts(g.endpoint, owner, bucket_id, "push", shard, rnd, parts, stats)
                with self.phase(stats, "pull"):
                    like = like_parts(parts, sg, self.codec, piece)
                    got = await recv_parts(g.endpoint, owner, bucket_id, "pull", shard, rnd, like, stats,
                                           device=piece.device)
                    pull_state = self.state((1 << 29) | key, piece, sg)
                    ch.chunk(out, shard).copy_(self.codec.decode(got, pull_state, piece))
                return
            # server of this shard: gather every worker's parts, decode, reduce
            with self.phase(stats, "gather"):
                received: dict[int, list[Received]] = {g.rank: [as_received(p) for p in parts]}

                async def gather(w: int) -> None:
                    like = like_parts(parts, sg, self.codec, piece)
                    received[w] = await recv_parts(g.endpoint, w, bucket_id, "push", shard, rnd, like, stats,
                                                   device=piece.device)

                async with trio.open_nursery() as nursery:
                    for w in range(g.world):
                        if w != g.rank:
                            nursery.start_soon(gather, w)
            with self.phase(stats, "reduce"):
                decoded, counts = [], torch.zeros(piece.numel(), dtype=torch.float32, device=piece.device)
                for w in range(g.world):
                    st = self.state((2 << 29) | key * 64 + w, piece, sg)
                    decoded.append(self.codec.decode(received[w], st, piece).to(piece.dtype))
                    if self.normalize == "contributors":
                        counts += received[w][0].element_mask().to(device=piece.device, dtype=torch.float32)
                total = self.codec.aggregate(decoded)
                reduced = self.finish(total, counts.clamp(min=1) if self.normalize == "contributors" else None)
            with self.phase(stats, "pull"):
                pull = self.codec.encode(reduced, self.state((3 << 29) | key, reduced, sg))
                mine = self.codec.decode([as_received(p) for p in pull], self.state((1 << 29) | key, piece, sg), piece)
                ch.chunk(out, shard).copy_(mine)
                async with trio.open_nursery() as nursery:
                    for w in range(g.world):
                        if w != g.rank:
                            nursery.start_soon(send_parts, g.endpoint, w, bucket_id, "pull", shard, rnd, pull, stats,
                                               not self.lossy_pull)

        async with trio.open_nursery() as nursery:
            for shard, owner in enumerate(owners):
                nursery.start_soon(serve_shard, shard, owner)
        # results arrive already averaged by the server; op is applied there
        return CollectiveResult(out.view_as(bucket), stats)
