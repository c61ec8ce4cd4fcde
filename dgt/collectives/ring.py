"""Ring all-reduce over the DGT transport: reduce-scatter (lossy allowed) then all-gather (always reliable).

Behaviour when blocks drop: in reduce-scatter step s a rank forwards the partial sum of one chunk; a block of it that
is lost at the deadline arrives as zeros, so that block's partial sum loses the contributions of every rank upstream
of the loss (the sender's error feedback re-sends it in a later round). The all-gather phase sends the reduced chunks
on the reliable lane, so every rank ends with the identical result, and the chunk owner keeps exactly the decoded
value the others receive.
"""

from __future__ import annotations

import torch
import trio

from dgt.codecs.base import Received
from dgt.collectives.base import Collective
from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import as_received, like_parts, recv_parts, send_parts
from dgt.collectives.stats import CollectiveResult, CollectiveStats


class RingAllReduce(Collective):
    name = "ring all-reduce"
    needs_summable = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    async def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0,
                        segments: list[int] | None = None) -> CollectiveResult:
        g = self.group
        W, r = g.world, g.rank
        flat = bucket.detach().reshape(-1).clone()
        stats = CollectiveStats()
        if W == 1:
            return CollectiveResult(self.finish(flat).view_as(bucket), stats)
        rnd = g.next_round("ring", bucket_id)
        ch = Chunking(segments or [flat.numel()], getattr(self.codec, "block", 1024), W)
        with self.phase(stats, "reduce_scatter"):
            for s in range(W - 1):
                # codec state follows (bucket, step): the same chunk travels at the same step every round
                dec = await self._hop(ch, flat, (r - s) % W, (r - s - 1) % W, bucket_id, "rs", s, rnd, stats,
                                      state_key=bucket_id * 4096 + s)
                if dec is not None:
                    mine = ch.chunk(flat, (r - s - 1) % W)
                    mine += dec.to(mine.dtype)
        with self.phase(stats, "all_gather"):
            own = (r + 1) % W  # after W-1 steps this rank holds the full sum of chunk r+1
            for s in range(W - 1):
                dec = await self._hop(ch, flat, (own - s) % W, (own - s - 1) % W, bucket_id, "ag", s, rnd, stats,
                                      state_key=(1 << 30) | bucket_id, reliable=True, keep_own=(s == 0))
                if dec is not None:
                    ch.chunk(flat, (own - s - 1) % W).copy_(dec)
        return CollectiveResult(self.finish(flat).view_as(bucket), stats)

    async def _hop(self, ch: Chunking, flat: torch.Tensor, send_c: int, recv_c: int, bucket_id: int, phase: str,
                   step: int, rnd: int, stats: CollectiveStats, state_key: int, reliable: bool = False,
                   keep_own: bool = False) -> torch.Tensor | None:
        """Send chunk ``send_c`` to the next rank while receiving chunk ``recv_c`` from the previous one; returns the
        decoded received chunk (None when that chunk is empty)."""
        g = self.group
        ep = g.endpoint
        out, mine = ch.chunk(flat, send_c), ch.chunk(flat, recv_c)
        parts = self.codec.encode(out, self.state(state_key, out, ch.segments[send_c])) if out.numel() else []
        if keep_own and parts:  # the owner keeps exactly what the others will decode
            out.copy_(self.codec.decode([as_received(p) for p in parts], self.state(state_key, out, None), out))
        like = like_parts(parts, ch.segments[recv_c], self.codec, mine)
        into = self._landing(like, mine, in_place=reliable)
        got: list[Received] = []

        async def recv() -> None:
            got.extend(await recv_parts(ep, (g.rank - 1) % g.world, bucket_id, phase, step, rnd, like, stats, into))

        async with trio.open_nursery() as nursery:
            if parts:
                nursery.start_soon(send_parts, ep, (g.rank + 1) % g.world, bucket_id, phase, step, rnd, parts, stats,
                                   reliable)
            if like:
                nursery.start_soon(recv)
        if not like:
            return None
        if into is not None and into[0] is mine:
            return mine  # already reassembled in place
        return self.codec.decode(got, self.state(-state_key - 1, mine, ch.segments[recv_c]), mine)

    def _landing(self, like, mine: torch.Tensor, in_place: bool) -> list[torch.Tensor] | None:
        """Where a dense single-part chunk can be received without an extra buffer: the chunk itself when it is
        overwritten (all-gather), else a scratch tensor reused across rounds (reduce-scatter adds it in)."""
        dense_codec = self.codec.name in ("dense", "dgt")
        if not dense_codec or len(like) != 1 or like[0].data.dtype != mine.dtype or mine.device.type != "cpu":
            return None
        if in_place:
            return [mine]
        key = (mine.numel(), mine.dtype)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(mine.numel(), dtype=mine.dtype)
        return [buf]
