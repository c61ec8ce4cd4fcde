"""How a flat bucket of several tensors is cut into sub-blocks of n elements (blocks never straddle two tensors)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np
import torch

DEFAULT_BLOCK = 1024


try:  # the optional C pass of a float32 CPU bucket's block scores (dgt.protocol._blockops; setup.py builds it)
    from dgt.protocol import _blockops  # type: ignore[attr-defined]  # no stubs
except ImportError:  # built without a C compiler: the torch path below
    _blockops = None

PASS_MIN_BYTES = 1 << 20  # a smaller C pass runs on the calling thread alone: starting threads would cost more
PASS_MAX_THREADS = 4


def pass_threads(nbytes: int) -> int:
    """Threads a C pass over ``nbytes`` of a bucket (``dgt.protocol._blockops``) splits its blocks over: torch's
    intra-op thread count (the user's setting; torchrun sets 1 when it starts several processes per node), at most
    PASS_MAX_THREADS, and 1 under PASS_MIN_BYTES. On a host with idle cores a lossy ring hop's passes, which its
    next hop waits for, then take a fraction of the time."""
    if nbytes < PASS_MIN_BYTES:
        return 1
    return max(1, min(PASS_MAX_THREADS, torch.get_num_threads()))


def _abs_sum(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of |t| (over ``dim``) in float32. Floats of at most 32 bits take the 1-norm, which reduces |x| as it goes:
    no temporary of |t| as large as the bucket (fresh memory, so first-touch page faults, on every call)."""
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(t, 1, dim=dim, dtype=torch.float32)
    return t.abs().sum(dim, dtype=torch.float32)


class PackingFacts(NamedTuple):
    """Per layout, for packing a subset of its blocks: block lengths (int64), which blocks are full, whether the full
    blocks fall in one residue class modulo the block size (then packed in block order, the short tails after), and
    whether moreover every short block comes after every full one (then the packed order is the block order)."""

    lens: np.ndarray
    full: np.ndarray
    one_class: bool
    block_order: bool


class BucketLayout:
    """Block geometry of a flat bucket: tensor k of ``sizes[k]`` elements gets ceil(size/n) blocks, the last partial.

    Everything is precomputed once per layout as index tensors, so per-round work is whole-tensor ops. This is the one
    geometry object of the package: codecs' parts (``Part.layout``), chunkings, the transport's rounds and the
    protocol's fragment split (:class:`dgt.protocol.geometry.Geometry`) all take it; :meth:`of` hands out one
    shared instance per geometry, so it is built once and passed down instead of being re-derived by each layer.
    A layout is never modified after it is built.
    """

    def __init__(self, sizes: Sequence[int], block: int = DEFAULT_BLOCK) -> None:
        if block <= 0:
            raise ValueError("block size must be positive")
        self.sizes = [int(s) for s in sizes]
        if any(s < 0 for s in self.sizes):
            raise ValueError("tensor sizes must be >= 0")
        self.block = int(block)
        self.numel = sum(self.sizes)
        starts, lens, tensor_ids, self.tensor_first_block = [], [], [], []
        self.tensor_offsets = []
        off = 0
        nb_total = 0
        for k, s in enumerate(self.sizes):
            nb = -(-s // self.block)
            self.tensor_offsets.append(off)
            self.tensor_first_block.append(nb_total)
            if nb:
                st = torch.arange(nb, dtype=torch.int64) * self.block + off
                ln = torch.full((nb,), self.block, dtype=torch.int64)
                ln[-1] = s - self.block * (nb - 1)
                starts.append(st)
                lens.append(ln)
                tensor_ids.append(torch.full((nb,), k, dtype=torch.int64))
            off += s
            nb_total += nb
        empty = torch.zeros(0, dtype=torch.int64)
        self.block_start = torch.cat(starts) if starts else empty
        self.block_len = torch.cat(lens) if lens else empty
        self.block_tensor = torch.cat(tensor_ids) if tensor_ids else empty
        self.nblocks = nb_total
        self.blocks_per_tensor = torch.tensor([-(-s // self.block) for s in self.sizes], dtype=torch.int64)

    @classmethod
    def of(cls, sizes: Sequence[int], block: int = DEFAULT_BLOCK) -> BucketLayout:
        """The shared layout of ``sizes`` cut in ``block``-element blocks (one instance per geometry, cached)."""
        return _shared(tuple(int(s) for s in sizes), int(block))

    @classmethod
    def flat(cls, numel: int, block: int = DEFAULT_BLOCK) -> BucketLayout:
        return cls.of((numel,), block)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketLayout) and self.sizes == other.sizes and self.block == other.block

    def __hash__(self) -> int:
        return hash((tuple(self.sizes), self.block))

    def __repr__(self) -> str:
        return f"BucketLayout(tensors={len(self.sizes)}, numel={self.numel}, block={self.block}, blocks={self.nblocks})"

    @cached_property
    def packing(self) -> PackingFacts:
        """What :func:`dgt.protocol.block_ops.packed_offsets` reads of this layout, derived once (numpy)."""
        starts, lens = self.block_start.numpy(), self.block_len.numpy().astype(np.int64)
        full = lens == self.block
        res = starts[full] % self.block
        one_class = len(res) == 0 or bool((res == res[0]).all())
        short = np.flatnonzero(~full)
        tails_last = one_class and (len(short) == 0 or int(short.min()) > int(np.flatnonzero(full).max(initial=-1)))
        return PackingFacts(lens, full, one_class, tails_last)

    @cached_property
    def _segments(self) -> list[tuple[int, int, int]]:
        """(offset, full_blocks, tail_len) per non-empty tensor: the views the block sums are taken over."""
        out = []
        for off, s in zip(self.tensor_offsets, self.sizes):
            if s:
                out.append((off, s // self.block, s % self.block))
        return out

    def block_abs_mean(self, flat: torch.Tensor, native: bool = True) -> torch.Tensor:
        """mean |g| of every block, float32, on ``flat``'s device: one C pass for a contiguous float32 CPU bucket
        (``native=False``: its twin), else one strided view per tensor, no loop over blocks."""
        if flat.numel() != self.numel:
            raise ValueError(f"bucket has {flat.numel()} elements, layout expects {self.numel}")
        if native and _blockops is not None and flat.dtype == torch.float32 and flat.device.type == "cpu" \
                and flat.is_contiguous():
            sums = np.empty(self.nblocks, dtype=np.float32)  # one C pass (dgt.protocol._blockops), GIL released
            _blockops.abs_sums(flat.reshape(-1).numpy(), self.block_start.numpy(), self.block_len.numpy(), sums,
                               pass_threads(4 * self.numel))
            return torch.from_numpy(sums).div_(self.block_len.to(torch.float32))
        n = self.block
        parts = []
        for off, full, tail in self._segments:
            if full:
                parts.append(_abs_sum(flat[off : off + full * n].view(full, n), 1))
            if tail:
                parts.append(_abs_sum(flat[off + full * n : off + full * n + tail]).view(1))
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=flat.device)
        sums = torch.cat(parts)
        return sums / self.block_len.to(device=flat.device, dtype=torch.float32)

    def expand(self, block_mask: torch.Tensor) -> torch.Tensor:
        """Per-block values -> per-element values (repeat_interleave by block length)."""
        lens = self.block_len.to(block_mask.device)
        return torch.repeat_interleave(block_mask, lens, output_size=self.numel)

    def whole_blocks(self, mask: torch.Tensor, of: BucketLayout) -> torch.Tensor:
        """Per block of this layout: True when every one of its elements arrived, given ``mask`` per block of ``of``
        (the same elements cut in other blocks: a transport's drop mask read in a codec's blocks). Vectorised."""
        if bool(mask.all()):
            return torch.ones(self.nblocks, dtype=torch.bool)
        if of == self:
            return mask.clone()
        lost = torch.zeros(of.numel + 1, dtype=torch.int64)
        torch.cumsum((~of.expand(mask)).to(torch.int64), 0, out=lost[1:])
        return lost[self.block_start + self.block_len] == lost[self.block_start]

    def blocks_of_tensor(self, k: int) -> slice:
        first = self.tensor_first_block[k]
        return slice(first, first + int(self.blocks_per_tensor[k]))


@lru_cache(maxsize=128)  # bounded: layouts also come off the wire (ROUND_BEGIN)
def _shared(sizes: tuple[int, ...], block: int) -> BucketLayout:
    return BucketLayout(sizes, block)
