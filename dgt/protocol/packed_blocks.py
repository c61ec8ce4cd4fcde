"""A set of blocks of a flat bucket packed back to back, in an order both ends derive from the block mask alone.

A lossy ring hop on stream lanes (dgt.transport.lossy_hop) sends its important blocks as one message: the sender
packs them out of the round's data, the receiver learns which blocks they are from a mask message that precedes
them, and unpacks them into the round's landing buffer. Neither end sends offsets: the order is a function of the
mask and the layout (:func:`packed_numel` gives the message size).

Order: the full blocks first, grouped by the residue of their start modulo the block (one ``[rows, block]`` view of
the bucket per residue, as :func:`dgt.protocol.block_rows.row_groups` reads it; a bucket of one tensor has one), in
block order within a group; then the partial blocks (at most one per tensor), in block order. The copies are
``index_select`` / ``index_copy_`` per residue group, never a Python loop per block.
"""

from __future__ import annotations

import numpy as np
import torch

from dgt.layout import BucketLayout
from dgt.protocol.block_rows import row_groups


def _check(t: torch.Tensor, layout: BucketLayout, mask: np.ndarray, what: str) -> np.ndarray:
    if t.dim() != 1 or not t.is_contiguous() or t.numel() != layout.numel:
        raise ValueError(f"{what}: a contiguous 1-D tensor of {layout.numel} elements, not {tuple(t.shape)}")
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (layout.nblocks,):
        raise ValueError(f"{what}: {mask.shape} flags for {layout.nblocks} blocks")
    return mask


def packed_numel(layout: BucketLayout, mask: np.ndarray) -> int:
    """Elements of the blocks ``mask`` selects (the packed message's length)."""
    return int(layout.block_len.numpy()[np.asarray(mask, dtype=bool)].sum())


def _plan(layout: BucketLayout, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts, lens, n = layout.block_start.numpy(), layout.block_len.numpy(), layout.block
    full = lens == n
    return starts[mask & full], starts[mask & ~full], lens[mask & ~full]


def pack_blocks(src: torch.Tensor, layout: BucketLayout, mask: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """The blocks of ``src`` where ``mask`` (a bool per block of ``layout``) packed into ``out`` (1-D, ``src``'s
    dtype, at least :func:`packed_numel` long); returns the packed prefix of ``out``."""
    mask = _check(src, layout, mask, "pack_blocks")
    total = packed_numel(layout, mask)
    if out.dim() != 1 or not out.is_contiguous() or out.numel() < total or out.dtype != src.dtype:
        raise ValueError(f"pack_blocks: room for {total} x {src.dtype} needed, got {out.numel()} x {out.dtype}")
    full, tails, tail_lens = _plan(layout, mask)
    n, pos = layout.block, 0
    for first, rows, idx in row_groups(src.numel(), full, n):
        k = len(idx)
        torch.index_select(src[first : first + rows * n].view(rows, n), 0, idx, out=out[pos : pos + k * n].view(k, n))
        pos += k * n
    for s, ln in zip(tails.tolist(), tail_lens.tolist()):  # at most one per tensor
        out[pos : pos + ln] = src[s : s + ln]
        pos += ln
    return out[:total]


def unpack_blocks(dst: torch.Tensor, packed: torch.Tensor, layout: BucketLayout, mask: np.ndarray) -> None:
    """Write ``packed`` (as :func:`pack_blocks` made it for ``mask``) back into the blocks of ``dst`` where
    ``mask``; the other blocks are left as they are."""
    mask = _check(dst, layout, mask, "unpack_blocks")
    total = packed_numel(layout, mask)
    if packed.numel() != total or packed.dtype != dst.dtype:
        raise ValueError(f"unpack_blocks: {total} x {dst.dtype} expected, got {packed.numel()} x {packed.dtype}")
    full, tails, tail_lens = _plan(layout, mask)
    n, pos = layout.block, 0
    for first, rows, idx in row_groups(dst.numel(), full, n):
        k = len(idx)
        dst[first : first + rows * n].view(rows, n).index_copy_(0, idx, packed[pos : pos + k * n].view(k, n))
        pos += k * n
    for s, ln in zip(tails.tolist(), tail_lens.tolist()):
        dst[s : s + ln] = packed[pos : pos + ln]
        pos += ln
