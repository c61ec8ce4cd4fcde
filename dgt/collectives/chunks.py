"""Block-aligned split of a bucket into per-rank chunks (ring segments, PS shards)."""

from __future__ import annotations

import torch

from dgt.layout import BucketLayout


class Chunking:
    """Splits a bucket of ``segments`` tensors into ``k`` contiguous chunks whose edges are block starts, so every
    chunk keeps the bucket's sub-blocks intact (DGT scores and drop masks stay per block)."""

    def __init__(self, layout: BucketLayout, k: int) -> None:
        self.layout = layout
        segments = layout.sizes
        n = self.layout.numel
        starts = self.layout.block_start
        if len(starts) == 0:
            edges = [0] * (k + 1)
        else:
            targets = torch.arange(1, k, dtype=torch.float64) * n / k
            idx = torch.searchsorted(starts.double(), targets).clamp(max=len(starts) - 1)
            edges = [0] + starts[idx].tolist() + [n]
            edges = [max(edges[i], edges[i - 1]) if i else 0 for i in range(len(edges))]
        self.edges = edges
        self.k = k
        self.segments = [self._segments_in(edges[i], edges[i + 1], segments) for i in range(k)]

    @staticmethod
    def _segments_in(lo: int, hi: int, segments: list[int]) -> list[int]:
        out, off = [], 0
        for s in segments:
            a, b = max(lo, off), min(hi, off + s)
            if b > a:
                out.append(b - a)
            off += s
        return out or [0]

    def chunk(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.edges[i] : self.edges[i + 1]]

    def blocks_in(self, flat: torch.Tensor, part: torch.Tensor) -> int:
        """How many blocks of the layout lie in ``part``, a contiguous slice of the bucket ``flat`` (a chunk, or the
        whole bucket): counted on the layout's block starts, as a round's statistics count the blocks it carries."""
        if part.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            raise ValueError("blocks_in: the part is not a slice of the bucket")
        lo = part.storage_offset() - flat.storage_offset()
        if lo < 0 or lo + part.numel() > flat.numel():
            raise ValueError(f"blocks_in: elements {lo}..{lo + part.numel()} lie outside the bucket of {flat.numel()}")
        ends = torch.tensor([lo, lo + part.numel()], dtype=self.layout.block_start.dtype)
        first, stop = torch.searchsorted(self.layout.block_start, ends).tolist()
        return int(stop - first)
