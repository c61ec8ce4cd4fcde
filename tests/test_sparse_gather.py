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
    from dgt.transport import Faults, TransportConfig

    if meddle == "busy":  # every hop reads as waiting for a CPU 40 % of the time: the CPU gate keeps blocks back
        import dgt.channels.hop_datagrams as hdm

        hdm.runqueue_seconds = lambda: 0.4 * time.perf_counter()

    async def main():
        cfg = TransportConfig(deadline="fixed:10")
        if meddle == "hold":  # half the datagrams lost (either reduce-scatter path), rounds closed at 0.3 s
            cfg = TransportConfig(deadline="fixed:0.3", faults=Faults(drop_fraction=0.5, drop_seed=rank))
        async with Group.open(rank, world, config=cfg, timeout=30) as g:
            ring = RingAllReduce(g, "dgt:p=0.3", op="sum")
            ring.sparse_gather = meddle != "off"  # (off by default, the hook's state turns it on)
            ring.hold_own = meddle == "hold"  # (off by default: DGTState(sparse=True))
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
            ch = Chunking(BucketLayout.of(SEGMENTS, DEFAULT_BLOCK), world)
            held = torch.zeros(NUMEL)  # what this rank holds back of its own chunk (hold_own)
            own = (rank + 1) % world
            if ring._held.held(0, own) is not None:
                held[ch.edges[own] : ch.edges[own + 1]] = ring._held.held(0, own).float()
            if dtype == torch.float32 or meddle == "hold":  # the reduce-scatter's error feedback (fp32: ring_lossy)
                sender = g.endpoint.links.table[(rank + 1) % world].sender
                for s in range(world - 1):
                    res = sender.residual(transport_key(0, "rs", s, 0))
                    if res is not None:
                        a = (rank - s) % world
                        kept[ch.edges[a] : ch.edges[a + 1]] += res.reshape(-1).float()
            return {"outs": outs, "kept": kept, "held": held, "block": DEFAULT_BLOCK, "ag_bytes": ag_bytes}

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


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.float16])
def test_the_owner_holds_its_own_value_where_nothing_arrived_and_the_gather_goes_sparse(dtype):
    """RingAllReduce.hold_own (DGTState(sparse=True)), dense inputs, the CPU gate keeping unimportant blocks back:
    each chunk's owner keeps its own value on the blocks the last hop brought nothing for (dgt.collectives.ring_hold),
    so the result is zero there on every rank and the all-gather sends only the blocks that arrived; nothing is lost:
    what every call applied + what error feedback and the owners hold = the inputs. Half the datagrams are lost
    (and the deadline closes the rounds), so the last hop brings nothing for some blocks. fp32: the stream
    reduce-scatter (ring_lossy); fp16: the reduce-scatter rounds (RingAllReduce._steps)."""
    world, calls = 3, 5
    res = run_ranks(_worker, world, dtype, False, calls, "hold", timeout=120)
    sparse_calls = 0
    for k in range(calls):
        out = res[0]["outs"][k][0]
        for r in range(world):
            assert torch.equal(bits(res[r]["outs"][k][0]), bits(out)), (r, k)
            sent, dense = _gather_bytes(r, world, res[0]["block"], out)
            assert res[r]["ag_bytes"][k] == sent
        held_k = sum(res[r]["outs"][k][1]["held_blocks"] for r in range(world))
        if held_k:
            sparse_calls += 1
            assert sent < 0.9 * dense and (out == 0).float().mean() > 0.1  # the held blocks are zero everywhere
    assert sparse_calls > 0, "blocks were lost and the owners held theirs"
    total = sum(data(r, k, sparse=False) for r in range(world) for k in range(calls))
    if dtype == torch.float16:
        total = sum(data(r, k, sparse=False).half().float() for r in range(world) for k in range(calls))
    held = sum(res[r]["held"] for r in range(world))
    assert held.abs().sum() > 0
    applied = sum(res[0]["outs"][k][0].float() for k in range(calls))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(applied + sum(res[r]["kept"] for r in range(world)) + held, total, rtol=tol, atol=tol)


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


def _sparse_hook_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dgt.shim import DGTState
    from dgt.shim.hook import submit

    dist.init_process_group("gloo", rank=rank, world_size=world)
    # the default codec and fp16 wire, no chooser (deterministic), no warm-up of p (it drops from the first lossy
    # round), half the datagrams lost, rounds closed at 0.3 s
    st = DGTState(warmup_iters=1, chooser=False, sparse=True, p_warmup=0,
                  transport={"deadline": "fixed:0.3", "faults": {"drop_fraction": 0.5, "drop_seed": rank}})
    res = [submit(st, data(rank, it, sparse=False), 0, SEGMENTS, use_codec=it >= 1, it=it).wait() for it in range(4)]
    out = {"results": res, "held": st.totals["held_blocks"], "hold_own": st._collectives[1].hold_own}
    st.close()
    dist.destroy_process_group()
    return out


def test_the_hook_with_sparse_true_applies_only_what_arrived_identically_on_every_rank():
    """DGTState(sparse=True) through the hook on 3 ranks with lost datagrams: the lossy ring's owners held blocks
    back, the applied update is zero there, and every rank applies the same bits."""
    world = 3
    res = run_ranks(_sparse_hook_rank, world, timeout=120)
    assert all(res[r]["hold_own"] for r in range(world)) and sum(res[r]["held"] for r in range(world)) > 0
    for it in range(4):
        out = res[0]["results"][it]
        for r in range(world):
            assert torch.equal(bits(res[r]["results"][it]), bits(out)), (r, it)
        if it == 0:  # the dense warm-up: the exact mean
            torch.testing.assert_close(out, sum(data(r, 0, sparse=False) for r in range(world)) / world)
    assert any(float((res[0]["results"][it] == 0).float().mean()) > 0.1 for it in range(1, 4))


def test_sparse_option_of_the_state():
    import pickle

    from dgt.shim import DGTState

    assert DGTState().sparse is False and DGTState(sparse=True).sparse is True
    assert DGTState(sparse=True, collective="ring").sparse
    for coll in ("direct", "ps"):
        with pytest.raises(ValueError, match="sparse=True"):
            DGTState(sparse=True, collective=coll)
    assert pickle.loads(pickle.dumps(DGTState(sparse=True))).sparse is True
    old = DGTState().__getstate__()
    del old["sparse"]  # a checkpoint from before the option
    back = DGTState.__new__(DGTState)
    back.__setstate__(old)
    assert back.sparse is False
