"""One geometry object (issue #24): a bucket's block geometry is a BucketLayout built once per (sizes, block) and
passed down; the fragment split (protocol Geometry) is built once per (layout, fragment); neither is modified."""

import numpy as np
import pytest
import torch

from dgt.codecs.base import Part, Received
from dgt.collectives.chunks import Chunking
from dgt.layout import BucketLayout
from dgt.protocol.geometry import Geometry
from dgt.protocol.receiver import RoundReceiver
from dgt.protocol.sender import RoundSender

TOKEN = 0xC0FFEE


def test_a_geometry_is_built_once_and_shared():
    a = BucketLayout.of([5000, 3000], 1024)
    assert BucketLayout.of((5000, 3000), 1024) is a and BucketLayout.flat(8000, 1024) is BucketLayout.of([8000], 1024)
    assert BucketLayout.of([5000, 3000], 512) is not a
    part = Part(torch.zeros(8000), 1, 1024, "p", [5000, 3000])
    assert part.layout is a
    assert Received(part.data, torch.ones(a.nblocks, dtype=torch.bool), 1024, [5000, 3000]).layout is a
    assert Geometry.of(a, 256) is Geometry.of(BucketLayout([5000, 3000], 1024), 256)  # equal layouts: one geometry
    assert Chunking(a, 3).layout is a


def test_sender_plan_and_receiver_round_use_the_same_geometry():
    layout = BucketLayout.of([3000, 1024, 5], 1024)
    sender = RoundSender(TOKEN, rank=3)
    x = torch.randn(layout.numel)
    cls = torch.zeros(layout.nblocks, dtype=torch.int8)
    plan = sender.plan(0, 0, sender.prepare(0, x), layout, cls, torch.arange(layout.nblocks))
    rx = RoundReceiver(TOKEN)
    rx.receive_bytes(plan.reliable[0][0] + bytes(plan.reliable[0][1]), 0, 0.0)
    (r,) = rx.rounds.values()
    assert r.layout is layout and r.geom is sender.geometry(layout, x.element_size())


def test_the_shared_geometry_cannot_be_written():
    g = Geometry.of(BucketLayout.of([5000], 1024), 256)
    for a in (g.block_start, g.block_len, g.block_end, g.frags_needed):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1
    assert np.array_equal(g.block_start, [0, 1024, 2048, 3072, 4096])


def test_whole_blocks_reads_a_transport_mask_in_other_blocks():
    t = BucketLayout.of([5000], 1024)
    c = BucketLayout.of([5000], 768)
    m = torch.tensor([True, False, True, True, True])
    assert c.whole_blocks(m, t).tolist() == [True, False, False, True, True, True, True]
    assert t.whole_blocks(m, t) is not m and torch.equal(t.whole_blocks(m, t), m)
