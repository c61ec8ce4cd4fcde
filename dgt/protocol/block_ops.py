"""Both ends of a lossy ring hop, each in one pass over the chunk.

The sending end (:func:`split_blocks`): the chunk plus its error-feedback residual goes three ways, by block: the
important blocks packed for the stream lane, the blocks the send budget keeps back into the residual (which is zero
everywhere else afterwards), and the blocks sent as datagrams into the round's private copy. As separate passes that
was a copy with the residual added, a residual rewrite and a pack.

The receiving end: the sum and the next hop's block scores.

A reduce-scatter hop adds what the previous rank sent for a chunk to this rank's own chunk. With the important blocks
on the stream lane (packed, :mod:`dgt.protocol.packed_blocks`) and the rest in a DGT round that closed at its
deadline, a block of the result is this rank's input plus one of three things: the packed block, the round's block
(if it came in time), or nothing (lost, or kept back by the sender's send budget: its error feedback carries it).
Done as separate passes that is a zero-fill of the round's missing blocks, an unpack, a full add, and the next hop's
pass over the result for its block scores (DGT's mean |g|); :func:`combine_blocks` does all of it in one pass and
returns the scores, which the next hop hands to the codec (``BucketState.values["block_abs_mean"]``).

Both run in C when the optional extension ``dgt.protocol._blockops`` is built (setup.py), over as many threads as
:func:`dgt.layout.pass_threads` allows (a bucket's blocks cut into contiguous ranges); :func:`split_blocks_torch`
and :func:`combine_blocks_torch` are their pure-Python twins and references (tests check the twins agree).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dgt.layout import BucketLayout, pass_threads
from dgt.protocol.block_rows import row_groups

_blockops: Any
try:
    from dgt.protocol import _blockops  # type: ignore[attr-defined, no-redef]  # optional C extension, no stubs
except ImportError:  # built without a C compiler
    _blockops = None

NATIVE = _blockops is not None


def packed_offsets(layout: BucketLayout, mask: np.ndarray) -> np.ndarray:
    """Per block of ``layout``: where it starts in the packed message of the blocks ``mask`` selects (in
    :func:`dgt.protocol.packed_blocks.pack_blocks`' order), -1 for a block not in it."""
    mask = np.asarray(mask, dtype=bool)
    pk = layout.packing  # derived once per layout
    full = pk.full
    if pk.block_order:  # one residue class, the short tails last (a one-tensor bucket): block order
        order = np.flatnonzero(mask)
    elif pk.one_class:  # block order, the short tails after the full blocks
        order = np.concatenate((np.flatnonzero(mask & full), np.flatnonzero(mask & ~full)))
    else:
        starts, n = layout.block_start.numpy(), layout.block
        blocks = [np.searchsorted(starts, first + idx.numpy() * n)
                  for first, _, idx in row_groups(layout.numel, starts[mask & full], n)]
        blocks.append(np.flatnonzero(mask & ~full))
        order = np.concatenate(blocks).astype(np.int64)
    at = np.full(layout.nblocks, -1, dtype=np.int64)
    if len(order):
        lens = pk.lens[order]
        ends = np.cumsum(lens)
        at[order] = ends - lens
    return at


def combine_blocks(src: torch.Tensor, land: torch.Tensor, packed: torch.Tensor, out: torch.Tensor,
                   layout: BucketLayout, received: np.ndarray, packed_at: np.ndarray,
                   native: bool = True) -> torch.Tensor:
    """``out = src + (packed block | land block | 0)`` per block (see the module docstring) and the blocks' mean
    |out| (float32, one per block). ``src``, ``land``, ``out``: contiguous 1-D float32 CPU tensors of
    ``layout.numel`` (``out`` may be ``src``); ``received``: bool per block, the round's blocks that came in time;
    ``packed_at``: :func:`packed_offsets` of the packed blocks."""
    for t in (src, land, out, packed):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
            raise ValueError("combine_blocks: contiguous 1-D float32 CPU tensors")
    if src.numel() != layout.numel or land.numel() != layout.numel or out.numel() != layout.numel:
        raise ValueError(f"combine_blocks: {src.numel()} / {land.numel()} / {out.numel()} elements for {layout}")
    received = np.ascontiguousarray(received, dtype=bool)
    packed_at = np.ascontiguousarray(packed_at, dtype=np.int64)
    if len(received) != layout.nblocks or len(packed_at) != layout.nblocks:
        raise ValueError(f"combine_blocks: {len(received)} / {len(packed_at)} flags for {layout.nblocks} blocks")
    if _blockops is None or not native:
        return combine_blocks_torch(src, land, packed, out, layout, received, packed_at)
    sums = np.empty(layout.nblocks, dtype=np.float32)
    _blockops.combine(src.numpy(), land.numpy(), packed.numpy(), out.numpy(), layout.block_start.numpy(),
                      layout.block_len.numpy(), received.view(np.uint8), packed_at, sums,
                      pass_threads(4 * layout.numel))
    return torch.from_numpy(sums).div_(layout.block_len.to(torch.float32))


def combine_blocks_torch(src: torch.Tensor, land: torch.Tensor, packed: torch.Tensor, out: torch.Tensor,
                         layout: BucketLayout, received: np.ndarray, packed_at: np.ndarray) -> torch.Tensor:
    """The twin of the C pass, in whole-tensor torch operations (the bound checks included)."""
    starts, lens = layout.block_start.numpy(), layout.block_len.numpy()
    imp = packed_at >= 0
    if bool((packed_at[imp] + lens[imp] > packed.numel()).any()):
        raise ValueError("combine: an important block lies outside the packed blocks")
    add = torch.zeros(layout.numel, dtype=torch.float32)
    take = layout.expand(torch.from_numpy(received & ~imp))
    add[take] = land[take]
    for b in np.flatnonzero(imp).tolist():  # the reference: clarity over speed
        a, k, p = int(starts[b]), int(lens[b]), int(packed_at[b])
        add[a : a + k] = packed[p : p + k]
    torch.add(src, add, out=out)
    return layout.block_abs_mean(out)


def add_blocks(out: torch.Tensor, land: torch.Tensor, layout: BucketLayout, blocks: np.ndarray,
               means: torch.Tensor, native: bool = True) -> None:
    """``out += land`` on ``blocks`` (indices into ``layout``'s blocks, distinct) and their entries of ``means`` (the
    blocks' mean |out|, as :func:`combine_blocks` returns them) recomputed; nothing else is read or written. The
    second half of a combine split in two (:func:`combine_blocks` with no block received, while the round's
    datagrams come in; then this for those that came): the same result, bit for bit."""
    for t in (out, land):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
            raise ValueError("add_blocks: contiguous 1-D float32 CPU tensors")
    if out.numel() != layout.numel or land.numel() != layout.numel or means.shape != (layout.nblocks,):
        raise ValueError(f"add_blocks: {out.numel()} / {land.numel()} elements, {tuple(means.shape)} means for "
                         f"{layout}")
    blocks = np.ascontiguousarray(blocks, dtype=np.int64)
    if len(blocks) == 0:
        return
    if int(blocks.min()) < 0 or int(blocks.max()) >= layout.nblocks or len(np.unique(blocks)) != len(blocks):
        raise ValueError("add_blocks: block indices out of range or repeated")
    if _blockops is None or not native:  # the twin, in whole-tensor torch operations
        mask = np.zeros(layout.nblocks, dtype=bool)
        mask[blocks] = True
        take = layout.expand(torch.from_numpy(mask))
        out[take] += land[take]
        means[torch.from_numpy(blocks)] = layout.block_abs_mean(out)[torch.from_numpy(blocks)]
        return
    starts, lens = layout.block_start.numpy()[blocks], layout.block_len.numpy()[blocks]
    sums = np.empty(len(blocks), dtype=np.float32)
    o = out.numpy()
    _blockops.combine(o, land.numpy(), np.zeros(0, np.float32), o, starts, lens, np.ones(len(blocks), np.uint8),
                      np.full(len(blocks), -1, np.int64), sums, 1)
    means[torch.from_numpy(blocks)] = torch.from_numpy(sums).div_(torch.from_numpy(lens).to(torch.float32))


IMPORTANT, KEPT, SENT = 0, 1, 2  # split_blocks' kinds


def split_blocks(x: torch.Tensor, res_in: torch.Tensor | None, packed: torch.Tensor, res_out: torch.Tensor | None,
                 data: torch.Tensor, layout: BucketLayout, kind: np.ndarray, packed_at: np.ndarray,
                 native: bool = True, live: np.ndarray | None = None) -> None:
    """Per block, ``y = x + res_in`` (``res_in`` None: ``y = x``) goes to ``packed`` at ``packed_at`` (kind
    IMPORTANT), to ``res_out`` (KEPT) or to ``data`` (SENT); ``res_out`` (None: no block may be KEPT) is zero on
    the other blocks and may be ``res_in`` itself. Contiguous 1-D float32 CPU tensors, ``layout.numel`` long
    except ``packed``.

    ``live`` (a uint8 per block, only with ``res_out`` the same tensor as ``res_in``): 0 says the residual's block is
    zero already, so it is neither read nor zeroed again (the caller keeps that true): there ``y = x`` as without
    ``res_in`` (a -0.0 stays -0.0). Updated in place to ``kind == KEPT``, the blocks the residual holds afterwards."""
    for t in (x, res_in, packed, res_out, data):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                              or t.dim() != 1):
            raise ValueError("split_blocks: contiguous 1-D float32 CPU tensors")
    for t in (x, res_in, res_out, data):
        if t is not None and t.numel() != layout.numel:
            raise ValueError(f"split_blocks: {t.numel()} elements for {layout}")
    kind = np.ascontiguousarray(kind, dtype=np.uint8)
    packed_at = np.ascontiguousarray(packed_at, dtype=np.int64)
    if len(kind) != layout.nblocks or len(packed_at) != layout.nblocks:
        raise ValueError(f"split_blocks: {len(kind)} / {len(packed_at)} flags for {layout.nblocks} blocks")
    if live is not None and (live.dtype != np.uint8 or live.shape != (layout.nblocks,) or not live.flags.c_contiguous
                             or res_in is None or res_out is None or res_in.data_ptr() != res_out.data_ptr()):
        raise ValueError("split_blocks: live flags are a uint8 per block, with res_out the same tensor as res_in")
    if _blockops is None or not native:
        split_blocks_torch(x, res_in, packed, res_out, data, layout, kind, packed_at, live)
        return
    none = np.zeros(0, np.float32)
    _blockops.split(x.numpy(), none if res_in is None else res_in.numpy(), packed.numpy(),
                    none if res_out is None else res_out.numpy(), data.numpy(), layout.block_start.numpy(),
                    layout.block_len.numpy(), kind, packed_at, np.zeros(0, np.uint8) if live is None else live,
                    pass_threads(4 * layout.numel))


def split_blocks_torch(x: torch.Tensor, res_in: torch.Tensor | None, packed: torch.Tensor,
                       res_out: torch.Tensor | None, data: torch.Tensor, layout: BucketLayout, kind: np.ndarray,
                       packed_at: np.ndarray, live: np.ndarray | None = None) -> None:
    """The twin of the C pass, in whole-tensor torch operations (the bound checks included)."""
    lens = layout.block_len.numpy()
    imp = kind == IMPORTANT
    if bool((kind > SENT).any()):
        raise ValueError("split: a block's kind is not 0, 1 or 2")
    if bool(((packed_at[imp] < 0) | (packed_at[imp] + lens[imp] > packed.numel())).any()):
        raise ValueError("split: an important block lies outside packed")
    if res_out is None and bool((kind == KEPT).any()):
        raise ValueError("split: a kept-back block needs res_out")
    dead = None if live is None else layout.expand(torch.from_numpy(live == 0))  # no residual there: y = x
    y = x.clone() if res_in is None else x + res_in if dead is None else torch.where(dead, x, x + res_in)
    for b in np.flatnonzero(imp).tolist():  # the reference: clarity over speed
        a, k, p = int(layout.block_start[b]), int(lens[b]), int(packed_at[b])
        packed[p : p + k] = y[a : a + k]
    sent = layout.expand(torch.from_numpy(kind == SENT))
    data[sent] = y[sent]
    if res_out is not None:
        kept = layout.expand(torch.from_numpy(kind == KEPT))
        rest = torch.zeros((), dtype=y.dtype) if dead is None else torch.where(dead, res_out, 0.0)
        res_out.copy_(torch.where(kept, y, rest))
    if live is not None:
        live[:] = kind == KEPT
