"""One geometry object per call (issue #24): a part is cut in the transport's block once (parts.wire_layout, the
shared BucketLayout.of instance), and a stream exchange's block count comes from the Chunking that cut the bucket."""

import pytest
import torch

from dgt.codecs.base import Part
from dgt.collectives.base import Collective
from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import wire_layout
from dgt.collectives.stats import CollectiveStats
from dgt.layout import BucketLayout
from dgt.transport.streams import Hop, HopResult


def test_a_part_travels_in_its_own_layout_or_is_cut_once_in_the_transport_block():
    dgt_like = Part(torch.zeros(3000), torch.zeros(3, dtype=torch.int8), 1024, "important", [1000, 2000])
    assert wire_layout(dgt_like, 1024) is dgt_like.layout is BucketLayout.of([1000, 2000], 1024)
    qsgd_like = Part(torch.zeros(3000, dtype=torch.uint8), 0, 700, "records", [3000])
    assert wire_layout(qsgd_like, 1024) is BucketLayout.of([3000], 1024)
    assert wire_layout(Part(torch.zeros(0), torch.zeros(0, dtype=torch.int8), 512), 1024).numel == 0
    # per-block lane classes name the codec's blocks: such a part travels in them (the codec's block is the one
    # source of the block size, issue 44), not re-cut into another size
    classed = Part(torch.zeros(3000), torch.zeros(5, dtype=torch.int8), 700, "important")
    assert wire_layout(classed, 1024) is classed.layout is BucketLayout.of([3000], 700)
    assert wire_layout(classed) is classed.layout


def test_blocks_in_counts_the_layout_blocks_of_a_slice():
    ch = Chunking(BucketLayout.of([100, 100, 100, 5000], 1024), 3)
    flat = torch.zeros(ch.layout.numel)
    per_chunk = [ch.blocks_in(flat, ch.chunk(flat, i)) for i in range(3)]
    assert sum(per_chunk) == ch.layout.nblocks == 3 + 5
    assert ch.blocks_in(flat, flat) == ch.layout.nblocks
    with pytest.raises(ValueError, match="not a slice"):
        ch.blocks_in(flat, torch.zeros(10))


def test_an_exchange_counts_the_blocks_of_the_geometry_not_the_elements_over_the_block():
    """Three 100-element tensors are three blocks (a block never straddles two tensors); 300 / 1024 rounded up: 1."""
    ch = Chunking(BucketLayout.of([100, 100, 100], 1024), 1)
    res = torch.zeros(300)
    hops = [Hop(1, 0, recv_from=w, land=res) for w in (1, 2)] + [Hop(2, 0, send_to=1, payload=res)]
    done = [HopResult(0, 1200, 0.0), HopResult(0, 1200, 0.0), HopResult(1248, 0, 0.0)]
    stats = CollectiveStats()
    Collective.count_exchange(stats, hops, done, ch, res)
    assert stats.blocks == 2 * 3
    assert stats.bytes_received[0] == 2400 and stats.bytes_sent[0] == 1200
