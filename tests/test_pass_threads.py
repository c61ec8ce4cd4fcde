"""The C passes of a lossy ring hop (dgt.protocol._blockops: abs_sums, split, combine) split over threads: the same
bits for every thread count (the blocks cut into contiguous ranges, none sharing an output), more threads than
blocks included, and the policy that picks the count (dgt.layout.pass_threads)."""

import numpy as np
import pytest
import torch

from dgt import layout as layout_mod
from dgt.layout import PASS_MAX_THREADS, PASS_MIN_BYTES, BucketLayout, pass_threads
from dgt.protocol import block_ops
from dgt.protocol.block_ops import IMPORTANT, KEPT, NATIVE, SENT, combine_blocks, packed_offsets, split_blocks

pytestmark = pytest.mark.skipif(not NATIVE, reason="the optional C extension dgt.protocol._blockops is not built")

LAYOUTS = [
    ([3000, 1024, 7, 5000, 1500], 1024),  # block starts at several residues, partial tails
    ([2048], 1024),  # two blocks: more threads than blocks
    ([1], 1024),  # one block of one element
    ([70_000, 333, 40_000], 256),  # ~430 blocks
]
THREADS = [1, 2, 3, 5, 16, 100]  # 100: more than the pass's cap (16), and than most layouts' blocks


def _bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a).view(np.int32)


def _case(sizes, block, seed):
    lay = BucketLayout(sizes, block)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(lay.numel, generator=g) * 10
    kind = rng.choice([IMPORTANT, KEPT, SENT], size=lay.nblocks).astype(np.uint8)
    return lay, x, torch.randn(lay.numel, generator=g), kind, rng


@pytest.mark.parametrize("sizes,block", LAYOUTS)
@pytest.mark.parametrize("seed", range(2))
def test_abs_sums_are_the_same_bits_for_every_thread_count(sizes, block, seed):
    lay, x, _, _, _ = _case(sizes, block, seed)
    st, ln = lay.block_start.numpy(), lay.block_len.numpy()
    want = np.empty(lay.nblocks, np.float32)
    block_ops._blockops.abs_sums(x.numpy(), st, ln, want)  # no thread argument: one thread, as before
    for t in THREADS:
        got = np.full(lay.nblocks, np.nan, np.float32)
        block_ops._blockops.abs_sums(x.numpy(), st, ln, got, t)
        assert np.array_equal(_bits(got), _bits(want)), t


@pytest.mark.parametrize("sizes,block", LAYOUTS)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("mode", ["no-res", "res", "live"])
def test_split_is_the_same_bits_for_every_thread_count(sizes, block, seed, mode):
    """No residual, one read and another written, or one in place with residual flags (live)."""
    lay, x, res, kind, _ = _case(sizes, block, seed)
    imp = kind == IMPORTANT
    at = packed_offsets(lay, imp)
    n_packed = int(lay.block_len.numpy()[imp].sum())
    st, ln = lay.block_start.numpy(), lay.block_len.numpy()
    none = np.zeros(0, np.float32)
    live0 = np.random.default_rng(seed).integers(0, 2, lay.nblocks).astype(np.uint8) if mode == "live" else None
    outs = []
    for t in THREADS:
        packed, res_out, data = (np.full(n, 7.0, np.float32) for n in (n_packed, lay.numel, lay.numel))
        res_in, live = (res.numpy() if mode == "res" else none), np.zeros(0, np.uint8)
        if live0 is not None:
            res_out, live = res.numpy().copy(), live0.copy()
            res_in = res_out
        block_ops._blockops.split(x.numpy(), res_in, packed, res_out, data, st, ln, kind, at, live, t)
        outs.append((packed, res_out, data, live))
    twin = (torch.full((n_packed,), 7.0), torch.full((lay.numel,), 7.0), torch.full((lay.numel,), 7.0))
    live = None if live0 is None else live0.copy()
    if live is None:
        block_ops.split_blocks_torch(x, res if mode == "res" else None, *twin, lay, kind, at)
    else:
        twin = (twin[0], res.clone(), twin[2])
        block_ops.split_blocks_torch(x, twin[1], twin[0], twin[1], twin[2], lay, kind, at, live)
    for t, out in zip(THREADS, outs):
        for got, want in zip(out[:3], twin):
            assert np.array_equal(_bits(got), _bits(want)), t
        if live is not None:
            assert np.array_equal(out[3], live), t


@pytest.mark.parametrize("sizes,block", LAYOUTS)
@pytest.mark.parametrize("seed", range(2))
def test_combine_is_the_same_bits_for_every_thread_count(sizes, block, seed):
    lay, src, land, kind, rng = _case(sizes, block, seed)
    imp = kind == IMPORTANT
    at = packed_offsets(lay, imp)
    n_packed = int(lay.block_len.numpy()[imp].sum())
    packed = torch.randn(n_packed, generator=torch.Generator().manual_seed(seed + 7))
    received = (rng.random(lay.nblocks) < 0.5) & ~imp
    st, ln = lay.block_start.numpy(), lay.block_len.numpy()
    want_out = torch.empty(lay.numel)
    want_means = combine_blocks(src, land, packed, want_out, lay, received, at, native=False)
    for t in THREADS:
        out, sums = np.full(lay.numel, 7.0, np.float32), np.full(lay.nblocks, np.nan, np.float32)
        block_ops._blockops.combine(src.numpy(), land.numpy(), packed.numpy(), out, st, ln, received.view(np.uint8),
                                    at, sums, t)
        assert np.array_equal(_bits(out), _bits(want_out)), t
        torch.testing.assert_close(torch.from_numpy(sums) / lay.block_len.to(torch.float32), want_means,
                                   rtol=1e-5, atol=0)


def test_a_large_bucket_splits_its_passes_and_matches_the_twin(monkeypatch):
    """Through block_ops with the policy's thread count (forced to 3 here): a bucket over PASS_MIN_BYTES."""
    monkeypatch.setattr(block_ops, "pass_threads", lambda nbytes: 3)
    lay, x, res, kind, rng = _case([PASS_MIN_BYTES // 4 + 5000, 1025], 1024, 0)
    imp = kind == IMPORTANT
    at = packed_offsets(lay, imp)
    n_packed = int(lay.block_len.numpy()[imp].sum())
    outs = {}
    for native in (True, False):
        bufs = (torch.full((n_packed,), 7.0), torch.full((lay.numel,), 7.0), torch.full((lay.numel,), 7.0))
        split_blocks(x, res, bufs[0], bufs[1], bufs[2], lay, kind, at, native=native)
        out = torch.empty(lay.numel)
        means = combine_blocks(x, bufs[2], bufs[0], out, lay, (rng.random(lay.nblocks) < 2) & ~imp, at, native=native)
        outs[native] = (*bufs, out, means)
    for c, t in zip(outs[True][:4], outs[False][:4]):
        assert np.array_equal(_bits(c), _bits(t))
    torch.testing.assert_close(outs[True][4], outs[False][4], rtol=1e-5, atol=0)


def test_the_thread_count_policy(monkeypatch):
    monkeypatch.setattr(layout_mod.torch, "get_num_threads", lambda: 16)
    assert pass_threads(PASS_MIN_BYTES - 1) == 1  # small: the calling thread alone
    assert pass_threads(PASS_MIN_BYTES) == PASS_MAX_THREADS == 4  # capped
    monkeypatch.setattr(layout_mod.torch, "get_num_threads", lambda: 2)
    assert pass_threads(100 << 20) == 2  # torch's intra-op setting (torchrun: 1 per process with several per node)
    monkeypatch.setattr(layout_mod.torch, "get_num_threads", lambda: 1)
    assert pass_threads(100 << 20) == 1


def test_a_bad_thread_count_is_one_thread():
    lay, x, _, _, _ = _case([5000], 1024, 0)
    want = np.empty(lay.nblocks, np.float32)
    block_ops._blockops.abs_sums(x.numpy(), lay.block_start.numpy(), lay.block_len.numpy(), want)
    for t in (0, -3):
        got = np.empty(lay.nblocks, np.float32)
        block_ops._blockops.abs_sums(x.numpy(), lay.block_start.numpy(), lay.block_len.numpy(), got, t)
        assert np.array_equal(_bits(got), _bits(want))
