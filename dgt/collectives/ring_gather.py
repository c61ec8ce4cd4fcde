"""The all-gather of a lossy ring on stream lanes, carrying only the blocks of a chunk that hold a value.

After a lossy reduce-scatter each rank owns the sum of one chunk; blocks of it may be zero (a gradient that is zero
there on every rank, e.g. an embedding's unused rows; or, if contributions are sparsified, nobody's block arrived).
The owner sends, per hop, two messages on the stream lane:

- a **mask message**: one mode byte (``SPARSE`` or ``DENSE``) then a byte per block of the chunk (1: the block is in
  the packed message), in the layout of the chunk's segments cut in the bucket's blocks;
- the **values**: with ``SPARSE`` the blocks the mask selects packed back to back in the bucket's dtype (the wire
  dtype: fp16 with the hook's default wire), in :mod:`dgt.protocol.packed_blocks`' order, so no offsets travel; with
  ``DENSE`` the chunk itself, landing in place.

A block is selected when any of its elements is nonzero (NaN included). The owner picks ``DENSE`` when the packed
values would not be clearly smaller (more than ``DENSE_ABOVE`` of the chunk's elements selected), so a dense chunk
costs one small mask message more than before and no pack or unpack. Every other rank forwards both messages as they
came (the next hop's payload is the buffer the previous hop landed in) and, after the exchange, writes the chunk as
zeros with the packed blocks over it. The owner zeroes its unselected blocks (they held only +-0.0) to +0.0, so every
rank holds the same bits, the owner's chunk included: what is sent is what every rank applies, exactly.

The all-gather is lossless: nothing is dropped, so no error feedback is involved (a zero block is sent as zero).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import FAMILY_MASK, transport_key
from dgt.collectives.stats import CollectiveStats
from dgt.errors import ProtocolError
from dgt.layout import BucketLayout
from dgt.protocol.packed_blocks import pack_blocks, packed_numel, unpack_blocks
from dgt.transport.streams import Hop

SPARSE, DENSE = 0, 1  # the mask message's mode byte
DENSE_ABOVE = 0.9  # the owner sends its chunk densely when more than this share of its elements is selected
MASK_PART, VALUES_PART = 1, 2  # transport key parts of a hop's two messages


def nonzero_blocks(chunk: torch.Tensor, layout: BucketLayout) -> np.ndarray:
    """Per block of ``layout`` (over the 1-D ``chunk``): whether any element is nonzero (a NaN counts)."""
    # sum of |x| per block in float32: zero exactly when every element is +-0.0, NaN when one is NaN (NaN != 0)
    sums = layout.block_abs_mean(chunk)
    return np.asarray(sums.numpy() != 0, dtype=bool)


def choose_mode(layout: BucketLayout, mask: np.ndarray) -> int:
    """``DENSE`` unless the selected blocks hold at most ``DENSE_ABOVE`` of the chunk's elements."""
    return SPARSE if packed_numel(layout, mask) <= DENSE_ABOVE * layout.numel else DENSE


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

    def owner_message(self, mine: torch.Tensor, layout: BucketLayout, tx_mask: torch.Tensor,
                      tx_pack: torch.Tensor) -> torch.Tensor:
        """The owner's messages for its chunk ``mine`` (1-D): fills ``tx_mask`` (``layout.nblocks + 1`` bytes) and
        returns the values (``mine`` itself, or the packed prefix of ``tx_pack``). With ``SPARSE`` the unselected
        blocks of ``mine`` are set to +0.0 (they were +-0.0), as every receiver will write them."""
        mask = nonzero_blocks(mine, layout)
        m = tx_mask.numpy()
        mode = choose_mode(layout, mask)
        m[0] = mode
        if mode == DENSE:
            m[1:] = 1
            return mine
        m[1:] = mask
        if not mask.all():
            mine.masked_fill_(layout.expand(torch.from_numpy(~mask)), 0)
        return pack_blocks(mine, layout, mask, tx_pack)

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
                                land_later=_lander(s, rx_masks[s], rx_packs[s], lays[c], chunks[c], landed, prv),
                                payload_later=None if s == 0 else _forwarder(s - 1, landed), op=op))
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
            if int(rx_masks[s][0]) == SPARSE:
                mine = chunks[c]
                mine.zero_()
                unpack_blocks(mine, got, lays[c], rx_masks[s].numpy()[1:] != 0)
            stats.blocks += lays[c].nblocks
        for d in done:
            stats.bytes_received[0] = stats.bytes_received.get(0, 0) + d.received

def _lander(step: int, rx_mask: torch.Tensor, rx_pack: torch.Tensor, layout: BucketLayout, chunk: torch.Tensor,
            landed: list[torch.Tensor | None], peer: int) -> Callable[[], torch.Tensor]:
    """Called in the worker thread once step ``step``'s mask message is in: where its values land."""

    def land() -> torch.Tensor:
        m = rx_mask.numpy()
        if m[0] == DENSE:
            out = chunk
        elif m[0] == SPARSE:
            if bool((m[1:] > 1).any()):
                raise ProtocolError(f"rank {peer} sent a sparse all-gather mask (step {step}) with a byte not 0 or 1")
            out = rx_pack[: packed_numel(layout, m[1:] != 0)]
        else:
            raise ProtocolError(f"rank {peer} sent a sparse all-gather mode byte {int(m[0])} (step {step}), "
                                f"not {SPARSE} or {DENSE}")
        landed[step] = out
        return out

    return land


def _forwarder(step: int, landed: list[torch.Tensor | None]) -> Callable[[], torch.Tensor]:
    """Called in the worker thread once step ``step`` is done: what it received, forwarded as it came."""

    def payload() -> torch.Tensor:
        out = landed[step]
        assert out is not None  # its hop ran before this one
        return out

    return payload
