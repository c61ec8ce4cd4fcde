"""The direct (transpose) all-reduce (dgt.collectives.direct), on in-process groups on loopback: results equal the
dense reference (bit-exact for integers and float64, exact for the lossy codec at p=1), every rank holds the same
bits (with drops too), what was delivered plus what error feedback holds is the input, 2/3/4 ranks with uneven and
empty chunks; and the DDP hook taking the direct schedule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import trio

from dgt.collectives import DirectAllReduce, RingAllReduce
from dgt.collectives.chunks import Chunking
from dgt.collectives.direct import AG, RS
from dgt.collectives.parts import transport_key
from dgt.errors import DgtError
from dgt.harness.groups import local_groups
from dgt.layout import BucketLayout
from dgt.transport import TransportConfig

BOUND = 60.0
SEGMENTS = [3000, 5, 20000, 1500]  # uneven chunks: 24505 elements in 1024-element blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN and -0.0 compare as themselves)."""
    ints = {torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints[t.dtype]) if t.dtype in ints else t


def data(rank: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


async def on_every_rank(world: int, fn, **cfg):
    """``fn(rank, group)`` on every rank of a fresh in-process group at once; the per-rank results."""
    config = TransportConfig(peer_timeout=10.0, **cfg)
    out: list = [None] * world
    with trio.fail_after(BOUND):
        async with local_groups(world, dist.HashStore(), config=config, timeout=BOUND, prefix="d") as groups:

            async def one(r: int) -> None:
                try:
                    out[r] = await fn(r, groups[r])
                except DgtError as exc:
                    out[r] = exc

            async with trio.open_nursery() as n:
                for r in range(world):
                    n.start_soon(one, r)
    for r, o in enumerate(out):
        assert not isinstance(o, BaseException), (r, o)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.float32])
async def test_lossless_equals_the_dense_reference_bit_for_bit(world, dtype):
    n = sum(SEGMENTS)

    async def fn(r, g):
        coll = DirectAllReduce(g, "dense", op="sum")
        outs = []
        for k in range(2):  # a second call reuses the landing buffers
            res = await coll.allreduce(data(r, n, dtype, k), 0, SEGMENTS)
            outs.append(res.tensor)
            assert res.stats.bytes_sent[0] > 0
        return outs

    res = await on_every_rank(world, fn)
    for k in range(2):
        ref = data(0, n, dtype, k)
        for r in range(1, world):
            ref = ref + data(r, n, dtype, k)  # rank order, as the owner sums
        for r in range(world):
            assert res[r][k].dtype == dtype
            assert torch.equal(bits(res[r][k]), bits(ref)), (world, dtype, r, k)


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_mean_in_place_and_into_out_on_float32(world):
    n = sum(SEGMENTS)

    async def fn(r, g):
        coll = DirectAllReduce(g, "dense", op="mean")
        x = data(r, n)
        out = torch.full((n,), 7.0)
        a = (await coll.allreduce(x.clone(), 0, SEGMENTS, out=out)).tensor
        assert a.data_ptr() == out.data_ptr()
        b = (await coll.allreduce(x, 1, SEGMENTS, out=x)).tensor  # in place
        assert b.data_ptr() == x.data_ptr()
        return a, b

    res = await on_every_rank(world, fn)
    ref = sum(data(r, n) for r in range(world)) / world
    for r in range(world):
        for t in res[r]:
            torch.testing.assert_close(t, ref, rtol=1e-6, atol=1e-6)
            assert torch.equal(bits(t), bits(res[0][0]))


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("codec", ["dense", "dgt:p=1.0"])
async def test_empty_chunks_small_and_empty_buckets(world, codec):
    """1500 elements in two blocks over 3 or 4 ranks: some ranks own no chunk; 5 elements: one owner; 0: nothing."""
    sizes = [1500, 5, 0]

    async def fn(r, g):
        coll = DirectAllReduce(g, codec, op="sum")
        return [(await coll.allreduce(data(r, n), i)).tensor for i, n in enumerate(sizes)]

    res = await on_every_rank(world, fn)
    for i, n in enumerate(sizes):
        ch = Chunking(BucketLayout.of([n], 1024), world)
        if n == 1500:
            assert any(ch.edges[j + 1] == ch.edges[j] for j in range(world))  # (the case: an empty chunk)
        ref = sum(data(r, n) for r in range(world))
        for r in range(world):
            torch.testing.assert_close(res[r][i], ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(bits(res[r][i]), bits(res[0][i]))


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_lossy_at_p1_is_exact_and_identical_on_every_rank(world):
    """p=1: every block important (reliable): the owner's sum is that of the dense reference, in rank order."""
    n = sum(SEGMENTS)

    async def fn(r, g):
        coll = DirectAllReduce(g, "dgt:p=1.0", op="sum")
        return [(await coll.allreduce(data(r, n, seed=k), 0, SEGMENTS)).tensor for k in range(2)]

    res = await on_every_rank(world, fn, cpu_gate=0.0)
    for k in range(2):
        ref = data(0, n, seed=k)
        for r in range(1, world):
            ref = ref + data(r, n, seed=k)
        for r in range(world):
            assert torch.equal(bits(res[r][k]), bits(ref)), (r, k)


async def _lossy_run(world: int, calls: int, dtype: torch.dtype, **cfg):
    """``calls`` lossy calls (p=0.3) with datagrams dropped at the receiver; per rank the results, the statistics and
    what this rank's error feedback holds for every chunk it sent, in the bucket's geometry."""
    n = sum(SEGMENTS)

    async def fn(r, g):
        coll = DirectAllReduce(g, "dgt:p=0.3", op="sum")
        outs = [await coll.allreduce(data(r, n, dtype, k), 0, SEGMENTS) for k in range(calls)]
        # every drop report is in once a lossless call after them completed on every rank and a moment passed
        barrier = DirectAllReduce(g, "dense", op="sum")
        await barrier.allreduce(torch.ones(4), 1)
        await trio.sleep(0.5)
        ch = Chunking(BucketLayout.of(SEGMENTS, g.endpoint.cfg.block), world)
        kept = torch.zeros(n, dtype=torch.float32)
        for j in range(world):
            if j == r:
                continue
            res = g.endpoint._links[j].sender.residual(transport_key(0, RS, 0, 0))
            if res is not None:
                kept[ch.edges[j] : ch.edges[j + 1]] += res.reshape(-1).float()
        return [o.tensor for o in outs], [o.stats for o in outs], kept

    return await on_every_rank(world, fn, cpu_gate=0.0, deadline="fixed:0.5", **cfg)


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_lossy_with_drops_is_identical_on_every_rank_and_conserves_the_input(world):
    calls = 3
    res = await _lossy_run(world, calls, torch.float32, drop_fraction=0.3, drop_seed=1)
    n = sum(SEGMENTS)
    dropped = sum(res[r][1][k].dropped for r in range(world) for k in range(calls))
    assert dropped > 0  # (the case: blocks were lost)
    for k in range(calls):
        for r in range(world):
            assert torch.equal(bits(res[r][0][k]), bits(res[0][0][k])), (r, k)
    total = sum(data(r, n, seed=k) for r in range(world) for k in range(calls))
    kept = sum(res[r][2] for r in range(world))
    assert kept.abs().sum() > 0  # error feedback holds what was lost
    delivered = sum(res[0][0][k] for k in range(calls))
    torch.testing.assert_close(delivered + kept, total, rtol=1e-4, atol=1e-4)


async def test_lossy_fp16_wire_identical_on_every_rank():
    """The hook's default: fp16 buckets through the lossy codec; the owner accumulates in float32."""
    world = 3
    res = await _lossy_run(world, 2, torch.float16, drop_fraction=0.2, drop_seed=2)
    n = sum(SEGMENTS)
    for k in range(2):
        out = res[0][0][k]
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        for r in range(world):
            assert torch.equal(bits(res[r][0][k]), bits(out))
    total = sum(data(r, n, torch.float16, k).float() for r in range(world) for k in range(2))
    kept = sum(res[r][2] for r in range(world))
    delivered = sum(res[0][0][k].float() for k in range(2))
    torch.testing.assert_close(delivered + kept, total, rtol=2e-2, atol=2e-2)


async def test_direct_and_ring_on_one_group_do_not_meet():
    """Its own transport key phases and round family: a ring and a direct all-reduce of the same bucket id, called
    alternately on one group, each return the right sum."""
    n = 5000

    async def fn(r, g):
        ring, direct = RingAllReduce(g, "dense", op="sum"), DirectAllReduce(g, "dense", op="sum")
        return [(await (ring if k % 2 else direct).allreduce(data(r, n, seed=k), 0)).tensor for k in range(4)]

    res = await on_every_rank(3, fn)
    for k in range(4):
        ref = sum(data(r, n, seed=k) for r in range(3))
        for r in range(3):
            torch.testing.assert_close(res[r][k], ref, rtol=1e-5, atol=1e-5)
    assert transport_key(0, RS) != transport_key(0, "rs") and transport_key(0, AG) != transport_key(0, "ag")
