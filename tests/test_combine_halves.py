"""A lossy ring hop's combine in two halves (dgt.protocol.block_ops.add_blocks): the sum with the stream lane's
packed blocks while the round's datagrams come in, then the blocks that came as datagrams added. Together they give
the one-pass combine's output and block means, bit for bit in C; the twin gives the same output and close means.
Bad block lists are refused before anything is written."""

import numpy as np
import pytest
import torch

from dgt.layout import BucketLayout
from dgt.protocol.block_ops import NATIVE, add_blocks, combine_blocks, packed_offsets

LAYOUTS = [
    ([3000, 1024, 7, 5000, 1500], 1024),  # starts at several residues, partial tails
    ([16384], 1024),
    ([1], 1024),
    ([70_000, 333, 40_000], 256),
]
NATIVES = [True, False] if NATIVE else [False]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.int32)


@pytest.mark.parametrize("sizes,block", LAYOUTS)
@pytest.mark.parametrize("native", NATIVES, ids=lambda n: "c" if n else "twin")
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
@pytest.mark.parametrize("seed", range(3))
def test_two_halves_equal_the_one_pass(sizes, block, native, in_place, seed):
    lay = BucketLayout(sizes, block)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    src, land = torch.randn(lay.numel, generator=g) * 10, torch.randn(lay.numel, generator=g)
    land[:: 7] = -0.0  # signed zeros must survive the split as they do the one pass
    imp = rng.random(lay.nblocks) < 0.3
    received = (rng.random(lay.nblocks) < [0.0, 0.2, 0.9][seed]) & ~imp
    at = packed_offsets(lay, imp)
    packed = torch.randn(int(lay.block_len.numpy()[imp].sum()), generator=g)

    want = src.clone() if in_place else torch.empty(lay.numel)
    want_means = combine_blocks(src.clone(), land, packed, want, lay, received, at, native=native)

    first = src.clone()
    out = first if in_place else torch.full((lay.numel,), 7.0)
    means = combine_blocks(first, land, packed, out, lay, np.zeros(lay.nblocks, bool), at, native=native)
    before = out.clone()
    add_blocks(out, land, lay, np.flatnonzero(received), means, native=native)
    assert np.array_equal(_bits(out), _bits(want))
    if native:
        assert np.array_equal(_bits(means), _bits(want_means))
    else:
        torch.testing.assert_close(means, want_means, rtol=1e-5, atol=0)
    untouched = ~lay.expand(torch.from_numpy(received))
    assert np.array_equal(_bits(out[untouched]), _bits(before[untouched]))  # only the received blocks are written


@pytest.mark.parametrize("native", NATIVES, ids=lambda n: "c" if n else "twin")
@pytest.mark.parametrize("blocks", [[-1], [16], [3, 3], [0, 99]], ids=["negative", "past-end", "repeated", "far"])
def test_a_bad_block_list_is_refused_before_anything_is_written(native, blocks):
    lay = BucketLayout([16384], 1024)
    out, land = torch.ones(lay.numel), torch.ones(lay.numel)
    means = torch.zeros(lay.nblocks)
    with pytest.raises(ValueError, match="add_blocks"):
        add_blocks(out, land, lay, np.array(blocks), means, native=native)
    assert bool((out == 1).all()) and bool((means == 0).all())


def test_shapes_and_dtypes_are_checked():
    lay = BucketLayout([4096], 1024)
    with pytest.raises(ValueError, match="add_blocks"):
        add_blocks(torch.ones(lay.numel, dtype=torch.float64), torch.ones(lay.numel), lay, np.array([0]),
                   torch.zeros(lay.nblocks))
    with pytest.raises(ValueError, match="add_blocks"):
        add_blocks(torch.ones(lay.numel), torch.ones(lay.numel - 1), lay, np.array([0]), torch.zeros(lay.nblocks))
    with pytest.raises(ValueError, match="add_blocks"):
        add_blocks(torch.ones(lay.numel), torch.ones(lay.numel), lay, np.array([0]), torch.zeros(lay.nblocks + 1))
