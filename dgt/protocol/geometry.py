"""Fragment geometry shared by sender and receiver: how blocks split into datagram-sized fragments."""

from __future__ import annotations

from functools import cached_property, lru_cache

import numpy as np

from dgt.layout import BucketLayout


def fragment_elems(block: int, itemsize: int, datagram_payload: int) -> int:
    """Largest divisor of ``block`` whose bytes fit in one datagram payload, so full blocks split into equal parts
    (equal datagrams are what UDP GSO needs)."""
    cap = max(1, datagram_payload // itemsize)
    if cap >= block:
        return block
    best = 1
    d = 1
    while d * d <= block:
        if block % d == 0:
            for c in (d, block // d):
                if best < c <= cap:
                    best = c
        d += 1
    return best


class Geometry:
    """numpy views of a layout's blocks plus the fragment split. :meth:`of` hands out one shared instance per
    (layout, fragment size), so the sender's plan and the receiver's open round use the same one; never modified."""

    @staticmethod
    def of(layout: BucketLayout, frag: int) -> Geometry:
        """The shared geometry of ``layout`` split in ``frag``-element fragments (cached)."""
        return _shared(layout, frag)

    def __init__(self, layout: BucketLayout, frag: int) -> None:
        if not 0 < frag <= layout.block:
            raise ValueError("fragment size must be in (0, block]")
        self.layout = layout
        self.frag = frag
        self.block_start = layout.block_start.numpy()
        self.block_len = layout.block_len.numpy()
        self.block_end = self.block_start + self.block_len
        self.frags_needed = -(-self.block_len // frag)  # per block
        self.frags_per_block = -(-layout.block // frag)
        for a in (self.block_start, self.block_len, self.block_end, self.frags_needed):
            a.setflags(write=False)

    @property
    def nblocks(self) -> int:
        return self.layout.nblocks

    @cached_property
    def total_frags(self) -> int:
        return int(self.frags_needed.sum())

    def fragments_of(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(block, element offset, element count) of every fragment of ``blocks``, in the given block order."""
        need = self.frags_needed[blocks]
        blk = np.repeat(blocks, need)
        first = np.concatenate(([0], np.cumsum(need)[:-1])) if len(need) else np.zeros(0, np.int64)
        fidx = np.arange(len(blk), dtype=np.int64) - np.repeat(first, need)
        off = self.block_start[blk] + fidx * self.frag
        cnt = np.minimum(self.frag, self.block_end[blk] - off)
        return blk, off, cnt


@lru_cache(maxsize=128)  # bounded: layouts also come off the wire (ROUND_BEGIN)
def _shared(layout: BucketLayout, frag: int) -> Geometry:
    return Geometry(layout, frag)
