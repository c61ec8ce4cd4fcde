"""The all-gather of a lossy ring on stream lanes, carrying only the blocks of a chunk that hold a value.

The messages (a mask message, then the packed values or the dense chunk) and what a receiver does with them are the
transport's (:mod:`dgt.transport.sparse_gather`, whose docstring describes them); this module composes one call's
hops (the owner's messages at step 0, each later step forwarding what the one before received) into one stream
exchange, with buffers reused across calls. The all-gather is lossless: nothing is dropped, so no error feedback is
involved (a zero block is sent as zero).
"""

from __future__ import annotations

from typing import Any

import torch

from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import FAMILY_MASK, transport_key
from dgt.collectives.stats import CollectiveStats
from dgt.layout import BucketLayout
from dgt.transport.sparse_gather import (  # noqa: F401 - DENSE, DENSE_ABOVE, SPARSE, nonzero_blocks: this module's names
    DENSE,
    DENSE_ABOVE,
    SPARSE,
    choose_mode,
    forwarder,
    land_sparse,
    lander,
    nonzero_blocks,
    owner_message,
)
from dgt.transport.streams import Hop

MASK_PART, VALUES_PART = 1, 2  # transport key parts of a hop's two messages


class _Pool:
    """Buffers reused across calls, by geometry; one is lent to one call at a time (a call's exchange may still be
    reading or writing its buffers while a later call of the same ring prepares its own), bounded."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, key: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get(key)
        return free.pop() if free else torch.zeros(numel, dtype=dtype)

    def give(self, key: tuple, t: torch.Tensor) -> None:
        if len(self._free) >= 64 and key not in self._free:
            self._free.clear()
        free = self._free.setdefault(key, [])
        if len(free) < 2:
            free.append(t)


class SparseGather:
    """The all-gather of one lossy ring (see the module docstring); the ring owns one, for its buffers."""

    def __init__(self) -> None:
        self._pool = _Pool()

    @staticmethod
    def owner_message(mine: torch.Tensor, layout: BucketLayout, tx_mask: torch.Tensor,
                      tx_pack: torch.Tensor) -> torch.Tensor:
        """The owner's messages for its chunk (:func:`dgt.transport.sparse_gather.owner_message`)."""
        return owner_message(mine, layout, tx_mask, tx_pack)

    async def gather(self, coll: Any, ch: Chunking, flat: torch.Tensor, bucket_id: int, rnd: int,
                     stats: CollectiveStats, ticket: int | None) -> None:
        """W-1 hops: step s sends chunk ``own - s`` (the owner's at step 0, then what the previous step received)
        and receives chunk ``own - s - 1``; ``ticket``: the exchange's reserved place (None: take one now)."""
        g = coll.group
        W, own = g.world, (g.rank + 1) % g.world
        block = ch.layout.block
        lays = [BucketLayout.of(ch.segments[i], block) for i in range(W)]
        chunks = [ch.chunk(flat, i) for i in range(W)]
        # (key, tensor) of every buffer this call borrows: masks (a mode byte and a byte per block) and values
        keys = [("mask", lays[own].nblocks + 1), ("vals", lays[own].numel, flat.dtype)]
        keys += [k for s in range(W - 1) for k in (("mask", lays[(own - s - 1) % W].nblocks + 1),
                                                   ("vals", lays[(own - s - 1) % W].numel, flat.dtype))]
        lent: list[tuple[tuple, torch.Tensor]] = []
        try:
            for k in keys:
                lent.append((k, self._pool.take(k, k[1], torch.uint8 if k[0] == "mask" else flat.dtype)))
        except BaseException:
            if ticket is not None:  # the exchange never ran: later exchanges must not wait for it
                g.endpoint.forfeit_exchange(ticket)
            raise
        try:
            await self._gather(coll, ch, flat, bucket_id, rnd, stats, ticket, lays, chunks, [t for _, t in lent])
        finally:
            for k, t in lent:
                self._pool.give(k, t)

    async def _gather(self, coll: Any, ch: Chunking, flat: torch.Tensor, bucket_id: int, rnd: int,
                      stats: CollectiveStats, ticket: int | None, lays: list[BucketLayout], chunks: list[torch.Tensor],
                      bufs: list[torch.Tensor]) -> None:
        g = coll.group
        W, r = g.world, g.rank
        nxt, prv, own = (r + 1) % W, (r - 1) % W, (r + 1) % W
        op = coll.code_of(stats)
        tx_mask = bufs[0]
        rx_masks, rx_packs = bufs[2::2], bufs[3::2]
        landed: list[torch.Tensor | None] = [None] * (W - 1)  # per step: where its values landed (in the thread)
        hops: list[Hop] = []
        try:
            tx_vals = self.owner_message(chunks[own], lays[own], tx_mask, bufs[1])
            for s in range(W - 1):
                c = (own - s - 1) % W
                send_mask = tx_mask if s == 0 else rx_masks[s - 1]
                hops.append(Hop(transport_key(bucket_id, "ag", s, MASK_PART), rnd, nxt, send_mask, prv, rx_masks[s],
                                op=op))
                hops.append(Hop(transport_key(bucket_id, "ag", s, VALUES_PART), rnd, nxt,
                                tx_vals if s == 0 else None, prv,
                                land_later=lander(s, rx_masks[s], rx_packs[s], lays[c], chunks[c], landed, prv),
                                payload_later=None if s == 0 else forwarder(s - 1, landed), op=op))
        except BaseException:
            if ticket is not None:  # the exchange never ran: later exchanges must not wait for it
                g.endpoint.forfeit_exchange(ticket)
            raise
        done = await g.endpoint.exchange(hops, ticket=ticket, family=FAMILY_MASK)
        isz = flat.element_size()
        stats.add_sent(0, tx_mask.numel() + tx_vals.numel() * isz)
        for s in range(W - 1):
            c = (own - s - 1) % W
            got = landed[s]
            assert got is not None  # the exchange completed every hop
            if s < W - 2:
                stats.add_sent(0, rx_masks[s].numel() + got.numel() * isz)  # forwarded by step s + 1
            land_sparse(chunks[c], got, lays[c], rx_masks[s])
            stats.blocks += lays[c].nblocks
        for d in done:
            stats.bytes_received[0] = stats.bytes_received.get(0, 0) + d.received
