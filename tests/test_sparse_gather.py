"""The lossy ring's all-gather carries only the blocks that hold a value (dgt.collectives.ring_gather): the owner's
message, its dense fallback, and end to end (ranks in processes on loopback) on both lossy ring paths (fp32: stream
reduce-scatter; fp16, the hook's default wire: reduce-scatter rounds on the session link), bit-identical on every
rank, with conservation (what the ring delivered plus what error feedback holds is the input), and the hook."""

from __future__ import annotations

import pytest
import torch

from dgt.collectives.launch import run_ranks
from dgt.collectives.ring_gather import DENSE, DENSE_ABOVE, SPARSE, SparseGather, choose_mode, nonzero_blocks
from dgt.layout import DEFAULT_BLOCK, BucketLayout

# tensor 2 is zero on every rank (an embedding's unused rows): most of two of the three chunks of a 3-rank ring
SEGMENTS = [3000, 5, 20000, 1500]
NUMEL = sum(SEGMENTS)
ZERO = slice(3005, 23005)


def data(rank: int, seed: int = 0, sparse: bool = True) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed * 100 + rank))
    if sparse:
        x[ZERO] = 0
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN and -0.0 compare as themselves)."""
    return t.view({torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype])


# -- the owner's message, no network ------------------------------------------------------------------------------
def test_a_block_counts_when_any_element_is_nonzero_nan_included_and_minus_zero_not():
    lay = BucketLayout.of([10, 7], 4)  # blocks: 4 4 2 | 4 3
    x = torch.zeros(17, dtype=torch.float16)
    x[1] = 1e-7  # an fp16 subnormal (about 1.2e-7): nonzero
    x[5] = -0.0
    x[10] = float("nan")
    x[16] = -3.0
    assert nonzero_blocks(x, lay).tolist() == [True, False, False, True, True]
    assert nonzero_blocks(x.float(), lay).tolist() == [True, False, False, True, True]


def test_the_owner_packs_the_nonzero_blocks_and_a_receiver_rebuilds_its_chunk_bit_for_bit():
    from dgt.protocol.packed_blocks import packed_numel, unpack_blocks

    lay = BucketLayout.of([3000, 5, 5000, 1500], 1024)
    x = torch.randn(lay.numel).half()
    x[3005:8005] = 0
    x[4000:4100] = -0.0  # a block of -0.0 is no value: the owner writes +0.0 there, as every receiver does
    mask = nonzero_blocks(x, lay)
    assert choose_mode(lay, mask) == SPARSE
    tx_mask, tx_pack = torch.zeros(lay.nblocks + 1, dtype=torch.uint8), torch.empty(lay.numel, dtype=torch.float16)
    owner = x.clone()
    vals = SparseGather().owner_message(owner, lay, tx_mask, tx_pack)
    assert tx_mask[0] == SPARSE and tx_mask[1:].numpy().astype(bool).tolist() == mask.tolist()
    assert vals.numel() == packed_numel(lay, mask) < lay.numel
    # the owner changed nothing but the sign of its zeros
    assert torch.equal(owner, x) and not torch.equal(bits(owner), bits(x))
    assert (bits(owner[3005:8005]) == 0).all()
    rx = torch.full_like(x, 7.0)  # a receiver's stale chunk
    rx.zero_()
    unpack_blocks(rx, vals.clone(), lay, tx_mask.numpy()[1:] != 0)
    assert torch.equal(bits(rx), bits(owner))


def test_a_chunk_with_few_zero_blocks_goes_dense_as_it_is():
    lay = BucketLayout.of([20 * 1024], 1024)
    x = torch.randn(lay.numel)
    x[:1024] = 0  # one block of 20 zero: 95 % selected, above DENSE_ABOVE
    assert choose_mode(lay, nonzero_blocks(x, lay)) == DENSE
    tx_mask, tx_pack = torch.zeros(lay.nblocks + 1, dtype=torch.uint8), torch.empty(lay.numel)
    owner = x.clone()
    vals = SparseGather().owner_message(owner, lay, tx_mask, tx_pack)
    assert tx_mask[0] == DENSE and vals is owner and torch.equal(bits(owner), bits(x))
    x[: 3 * 1024] = 0  # 3 of 20: 85 % selected
    assert choose_mode(lay, nonzero_blocks(x, lay)) == SPARSE
    assert DENSE_ABOVE == 0.9


# -- end to end ----------------------------------------------------------------------------------------------------
def _worker(rank, world, dtype, sparse, calls, meddle=None):
    import time

    import trio

    from dgt.collectives import Group, RingAllReduce
    from dgt.collectives.chunks import Chunking
    from dgt.collectives.parts import transport_key
    from dgt.transport import TransportConfig

    if meddle == "busy":  # every hop reads as waiting for a CPU 40 % of the time: the CPU gate keeps blocks back
        import dgt.channels.hop_datagrams as hdm

        hdm.runqueue_seconds = lambda: 0.4 * time.perf_counter()

    async def main():
        cfg = TransportConfig(deadline="fixed:10")
        async with Group.open(rank, world, config=cfg, timeout=30) as g:
            ring = RingAllReduce(g, "dgt:p=0.3", op="sum")
            ring.sparse_gather = meddle != "off"  # (off by default, the hook's state turns it on)
            gather = ring._gather.gather
            ag_bytes = []  # per call: what this rank's all-gather sent

            async def spy(coll, ch, flat, bucket_id, rnd, stats, ticket):
                before = stats.bytes_sent.get(0, 0)
                await gather(coll, ch, flat, bucket_id, rnd, stats, ticket)
                ag_bytes.append(stats.bytes_sent[0] - before)

            ring._gather.gather = spy
            outs = []
            for k in range(calls):
                res = await ring.allreduce(data(rank, k, sparse).to(dtype), 0, SEGMENTS)
                outs.append((res.tensor, res.stats.to_dict()))
            assert len(ag_bytes) == (0 if meddle == "off" else calls)  # every call took the sparse all-gather
            kept = torch.zeros(NUMEL)
            if dtype == torch.float32:  # the stream reduce-scatter's error feedback (dgt.collectives.ring_lossy)
                ch = Chunking(BucketLayout.of(SEGMENTS, DEFAULT_BLOCK), world)
                sender = g.endpoint.links.table[(rank + 1) % world].sender
                for s in range(world - 1):
                    res = sender.residual(transport_key(0, "rs", s, 0))
                    if res is not None:
                        a = (rank - s) % world
                        kept[ch.edges[a] : ch.edges[a + 1]] += res.reshape(-1)
            return {"outs": outs, "kept": kept, "block": DEFAULT_BLOCK, "ag_bytes": ag_bytes}

    return trio.run(main)


def _gather_bytes(rank: int, world: int, block: int, result: torch.Tensor) -> tuple[int, int]:
    """(what ``rank``'s all-gather sends, the same densely) from the result every rank holds: W-1 hops, hop s
    forwarding chunk ``rank + 1 - s``, each a mask message (a mode byte and a byte per block of the chunk) and the
    chunk's values, packed where the chunk goes sparse."""
    from dgt.collectives.chunks import Chunking

    ch = Chunking(BucketLayout.of(SEGMENTS, block), world)
    sent = dense = 0
    isz = result.element_size()
    for s in range(world - 1):
        c = (rank + 1 - s) % world
        lay = BucketLayout.of(ch.segments[c], block)
        mask = nonzero_blocks(ch.chunk(result, c), lay)
        n = int(lay.block_len.numpy()[mask].sum()) if choose_mode(lay, mask) == SPARSE else lay.numel
        sent += lay.nblocks + 1 + n * isz
        dense += lay.nblocks + 1 + lay.numel * isz
    return sent, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_rank_holds_the_same_bits_and_the_zero_blocks_do_not_travel(dtype):
    world, calls = 3, 2
    res = run_ranks(_worker, world, dtype, True, calls, timeout=120)
    for k in range(calls):
        out = res[0]["outs"][k][0]
        assert out.dtype == dtype
        for r in range(world):
            assert torch.equal(bits(res[r]["outs"][k][0]), bits(out)), f"rank {r} call {k}"
        assert (bits(out[ZERO]) == 0).all()  # +0.0 on every rank, owner included
        assert torch.isfinite(out).all() and (out[:3005] != 0).float().mean() > 0.99
        ref = sum(data(r, k) for r in range(world))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if all(res[r]["outs"][k][1]["unsent"] == 0 and res[r]["outs"][k][1]["dropped"] == 0 for r in range(world)):
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
        for r in range(world):
            sent, dense = _gather_bytes(r, world, res[0]["block"], out)
            assert res[r]["ag_bytes"][k] == sent, (r, k)
            assert sent < 0.5 * dense  # 20000 of 24505 elements are zero


def test_conservation_with_blocks_kept_back_and_a_sparse_gather():
    """The CPU gate keeps unimportant blocks back (error feedback) from call 2 or 3 on; the all-gather sends the
    sparse chunks. Over the calls, world * what every rank applied (the ring's mean... here the sum) plus what every
    rank's error feedback still holds is the whole input."""
    world, calls = 3, 5
    res = run_ranks(_worker, world, torch.float32, True, calls, "busy", timeout=120)
    for k in range(calls):
        for r in range(world):
            assert torch.equal(bits(res[r]["outs"][k][0]), bits(res[0]["outs"][k][0]))
            sent, dense = _gather_bytes(r, world, res[0]["block"], res[0]["outs"][k][0])
            assert res[r]["ag_bytes"][k] == sent < 0.5 * dense  # the gather went sparse
        assert (bits(res[0]["outs"][k][0][ZERO]) == 0).all()
    assert any(res[r]["outs"][k][1]["unsent"] > 0 for r in range(world) for k in range(calls))
    total = sum(data(r, k) for r in range(world) for k in range(calls))
    held = sum(res[0]["outs"][k][0] for k in range(calls)) + sum(res[r]["kept"] for r in range(world))
    assert sum(res[r]["kept"].abs().sum() for r in range(world)) > 0  # (something was kept back)
    torch.testing.assert_close(held, total, rtol=1e-4, atol=1e-4)


def test_dense_chunks_fall_back_to_the_dense_all_gather():
    world = 3
    res = run_ranks(_worker, world, torch.float16, False, 1, timeout=120)
    out = res[0]["outs"][0][0]
    for r in range(world):
        assert torch.equal(bits(res[r]["outs"][0][0]), bits(out))
        sent, dense = _gather_bytes(r, world, res[0]["block"], out)
        assert res[r]["ag_bytes"][0] == sent == dense


def _hook_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dgt.collectives import ring_gather
    from dgt.shim import DGTState
    from dgt.shim.hook import submit

    gather = ring_gather.SparseGather.gather
    ag_bytes: list[int] = []

    async def spy(self, coll, ch, flat, bucket_id, rnd, stats, ticket):
        before = stats.bytes_sent.get(0, 0)
        await gather(self, coll, ch, flat, bucket_id, rnd, stats, ticket)
        ag_bytes.append(stats.bytes_sent[0] - before)

    ring_gather.SparseGather.gather = spy
    dist.init_process_group("gloo", rank=rank, world_size=world)
    st = DGTState(warmup_iters=1, chooser=False)  # the default codec and its fp16 wire, no chooser (deterministic)
    res = [submit(st, data(rank, it), 0, SEGMENTS, use_codec=it >= 1, it=it).wait() for it in range(3)]
    wire = st.wire_dtype
    st.close()
    dist.destroy_process_group()
    return {"results": res, "ag_bytes": ag_bytes, "wire": wire}


def test_the_default_hook_gathers_sparse_chunks_in_fp16_identically_on_every_rank():
    """A tiny hook run (3 ranks, the default state: DGT, fp16 wire): the lossy iterations' all-gather sends only
    the nonzero blocks, every rank gets the same bits, the zero tensor stays exactly zero."""
    world = 3
    res = run_ranks(_hook_rank, world, timeout=120)
    assert res[0]["wire"] == torch.float16
    for it in range(3):
        out = res[0]["results"][it]
        assert out.dtype == torch.float32
        for r in range(world):
            assert torch.equal(bits(res[r]["results"][it]), bits(out)), (r, it)
        assert (bits(out[ZERO]) == 0).all()
        mean = sum(data(r, it) for r in range(world)) / world
        if it == 0:  # the dense warm-up: lossless, float32
            torch.testing.assert_close(out, mean, rtol=1e-6, atol=1e-6)
        else:  # fp16 shares; on a loaded host the CPU gate may keep some blocks back (error feedback carries them)
            assert torch.isfinite(out).all() and ((out - mean).abs() <= 0.05).float().mean() > 0.8
    for r in range(world):
        assert len(res[r]["ag_bytes"]) == 2  # the two lossy iterations took the stream all-gather
        for it in (1, 2):
            fp16 = res[0]["results"][it].to(torch.float16)  # (only its zero pattern is read)
            sent, dense = _gather_bytes(r, world, 1024, fp16)
            assert res[r]["ag_bytes"][it - 1] == sent < 0.5 * dense


def _small_worker(rank, world):
    import trio

    from dgt.collectives import Group, RingAllReduce

    async def main():
        async with Group.open(rank, world, timeout=30) as g:
            ring = RingAllReduce(g, "dgt:p=0.3", op="sum")
            outs = []
            for n in (1500, 5):  # 2 blocks and 1 block over 3 ranks: chunks without a block
                x = torch.zeros(n, dtype=torch.float16)
                x[: n // 2] = rank + 1
                outs.append((await ring.allreduce(x, 0, [n])).tensor)
            return outs

    return trio.run(main)


def test_chunks_without_a_block_gather_too():
    world = 3
    res = run_ranks(_small_worker, world, timeout=120)
    for i, n in enumerate((1500, 5)):
        want = torch.zeros(n, dtype=torch.float16)
        want[: n // 2] = 6
        for r in range(world):
            assert torch.equal(bits(res[r][i]), bits(want)), (r, n)


def test_the_sparse_gather_is_off_by_default_outside_the_hook():
    """A RingAllReduce of its own keeps the dense all-gather (no mask messages): what each rank sends in the
    all-gather is its W-1 chunks' values, the zero tensor included."""
    from dgt.collectives import RingAllReduce

    assert RingAllReduce.sparse_gather is False
    world = 3
    res = run_ranks(_worker, world, torch.float16, True, 1, "off", timeout=120)
    out = res[0]["outs"][0][0]
    for r in range(world):
        assert torch.equal(bits(res[r]["outs"][0][0]), bits(out))
    assert (bits(out[ZERO]) == 0).all()
