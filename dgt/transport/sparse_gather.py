"""The sparse all-gather's two messages per hop, on stream lanes (the lossy ring's all-gather,
:mod:`dgt.collectives.ring_gather`): what the owner sends, what a receiver checks and where it lands, and the chunk a
receiver rebuilds from them. Protocol work on the messages' bytes, so it lives with the transport; the collective
composes the hops and calls these.

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
zeros with the packed blocks over it (:func:`land_sparse`). The owner zeroes its unselected blocks (they held only
+-0.0) to +0.0, so every rank holds the same bits, the owner's chunk included: what is sent is what every rank
applies, exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dgt.errors import ProtocolError
from dgt.layout import BucketLayout
from dgt.protocol.packed_blocks import pack_blocks, packed_numel, unpack_blocks

SPARSE, DENSE = 0, 1  # the mask message's mode byte
DENSE_ABOVE = 0.9  # the owner sends its chunk densely when more than this share of its elements is selected


def nonzero_blocks(chunk: torch.Tensor, layout: BucketLayout) -> np.ndarray:
    """Per block of ``layout`` (over the 1-D ``chunk``): whether any element is nonzero (a NaN counts)."""
    # sum of |x| per block in float32: zero exactly when every element is +-0.0, NaN when one is NaN (NaN != 0)
    sums = layout.block_abs_mean(chunk)
    return np.asarray(sums.numpy() != 0, dtype=bool)


def choose_mode(layout: BucketLayout, mask: np.ndarray) -> int:
    """``DENSE`` unless the selected blocks hold at most ``DENSE_ABOVE`` of the chunk's elements."""
    return SPARSE if packed_numel(layout, mask) <= DENSE_ABOVE * layout.numel else DENSE


def owner_message(mine: torch.Tensor, layout: BucketLayout, tx_mask: torch.Tensor,
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


def land_sparse(chunk: torch.Tensor, got: torch.Tensor, layout: BucketLayout, rx_mask: torch.Tensor) -> None:
    """After the exchange: a ``SPARSE`` hop's chunk rebuilt from its packed values ``got`` (zeros elsewhere); a
    ``DENSE`` one landed in place already."""
    if int(rx_mask[0]) == SPARSE:
        chunk.zero_()
        unpack_blocks(chunk, got, layout, rx_mask.numpy()[1:] != 0)


def lander(step: int, rx_mask: torch.Tensor, rx_pack: torch.Tensor, layout: BucketLayout, chunk: torch.Tensor,
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


def forwarder(step: int, landed: list[torch.Tensor | None]) -> Callable[[], torch.Tensor]:
    """Called in the worker thread once step ``step`` is done: what it received, forwarded as it came."""

    def payload() -> torch.Tensor:
        out = landed[step]
        assert out is not None  # its hop ran before this one
        return out

    return payload
