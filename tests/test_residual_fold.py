"""Error feedback without a zero-then-add pass: ``prepare`` adds the residual into its copy and leaves it *spent*
(reading as zero) instead of zeroing it, and ``plan`` writes the blocks the send budget kept back into a spent
residual in one pass (:func:`dgt.protocol.block_rows.keep_blocks`). Both must give exactly what the plain
definition gives, over rounds, with drop reports arriving between a round's prepare and its plan."""

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.block_rows import copy_rows, keep_blocks
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender

TOKEN = 0x5EED


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("share", [0.1, 0.5, 0.9])  # both sides of keep_blocks (fill + copy rows, copy + zero rows)
@pytest.mark.parametrize("sizes", [[3000, 1024, 7, 5000], [2048], [300] * 12])  # tails; one tensor; > 8 tensors
def test_keep_blocks_equals_the_elementwise_definition_bit_for_bit(dtype, share, sizes):
    layout = BucketLayout(sizes, 256)
    g = torch.Generator().manual_seed(len(sizes))
    src = torch.randn(layout.numel, generator=g).to(dtype)
    src[:5] = torch.tensor([float("inf"), float("nan"), -0.0, float("-inf"), 0.0]).to(dtype)  # copied as they are
    keep = np.random.default_rng(int(share * 10)).random(layout.nblocks) < share
    keep[0] = True  # the block holding inf / nan / -0.0 is kept
    dst = torch.randn(layout.numel, generator=g).to(dtype)  # stale values: every element must be written
    want = torch.zeros_like(src)
    for b in np.flatnonzero(keep).tolist():
        s, n = int(layout.block_start[b]), int(layout.block_len[b])
        want[s : s + n] = src[s : s + n]
    keep_blocks(dst, src, layout, keep)
    assert np.array_equal(_bits(dst), _bits(want))
    with pytest.raises(ValueError):
        keep_blocks(dst, src, layout, keep[:-1])


def test_copy_rows_copies_exactly_the_listed_blocks():
    src, dst = torch.arange(4096.0), torch.full((4096,), -1.0)
    copy_rows(dst, src, np.array([1024, 3072, 0]), 1024)
    want = torch.full((4096,), -1.0)
    for s in (0, 1024, 3072):
        want[s : s + 1024] = src[s : s + 1024]
    assert torch.equal(dst, want)


def _round(tx: RoundSender, rx: RoundReceiver, rnd: int, data: torch.Tensor, layout: BucketLayout,
           cls: torch.Tensor, budget: int, lose: np.ndarray):
    """One round through the sans-IO pair, with the datagrams of the blocks in ``lose`` dropped."""
    plan = tx.plan(0, rnd, data, layout, cls, None, budget=budget)
    ev = rx.receive_bytes(b"".join(bytes(h) + bytes(p) for h, p in plan.reliable), 0, float(rnd))
    for rows in plan.datagrams.values():
        for r in np.asarray(rows):
            f = wire.decode_frames(r.tobytes())[0]
            if not lose[f.block]:
                ev += rx.receive_frame(f, 1, float(rnd) + 0.001)
    ev += rx.on_time(float(rnd) + 5.0)
    (done,) = [e for e in ev if isinstance(e, RoundDone)]
    return plan, done


@pytest.mark.parametrize("seed", range(3))
def test_rounds_under_budget_and_loss_match_the_plain_residual_model(seed):
    """Integer-valued float32 data (every sum exact): per round, what the receiver got plus the sender's residual
    equals the plain model (data = x + R; R = the kept-back and the lost blocks of data), element for element; a
    drop report of round k lands after round k + 1's prepare (the ring does not wait for reports)."""
    rng = np.random.default_rng(seed)
    layout = BucketLayout([5000, 3000, 700], 256)
    tx = RoundSender(TOKEN, rank=1, datagram_payload=1024 + wire.HEADER_SIZE)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01))
    model = np.zeros(layout.numel, np.float32)
    lens = layout.block_len.numpy()
    late = None  # the previous round's report and its model update, applied after this round's prepare
    total_in = np.zeros(layout.numel, np.float64)
    total_out = np.zeros(layout.numel, np.float64)
    seen = {"unsent": 0, "lost": 0, "spent": 0}
    for rnd in range(6):
        x = torch.from_numpy(rng.integers(-50, 50, layout.numel).astype(np.float32))
        total_in += x.numpy()
        data = tx.prepare(0, x)
        seen["spent"] += 0 in tx._spent  # the residual was added and left spent, not zeroed
        want = x.numpy() + model
        assert np.array_equal(data.numpy(), want)
        model[:] = 0
        if late is not None:
            report, lost_elems, sent = late
            tx.on_drop_report(report)
            model[lost_elems] += sent[lost_elems]
        cls = torch.from_numpy((rng.random(layout.nblocks) < 0.7).astype(np.int64))  # 30 % important
        budget = int(rng.choice([0, 20_000, 10**9]))
        lose = rng.random(layout.nblocks) < 0.3
        plan, done = _round(tx, rx, rnd, data, layout, cls, budget, lose)
        mask = done.mask.numpy()
        seen["unsent"] += plan.unsent_blocks
        seen["lost"] += done.stats.dropped
        got = np.repeat(mask, lens)
        assert np.array_equal(done.data.numpy()[got], want[got])
        total_out += np.where(got, done.data.numpy(), 0)
        unsent = np.zeros(layout.nblocks, bool)
        if plan.unsent_blocks:
            unimp = np.flatnonzero(cls.numpy() > 0)
            unsent[unimp[len(unimp) - plan.unsent_blocks :]] = True  # block order: the tail is kept back
        kept = np.repeat(unsent, lens)
        model[kept] += want[kept]
        late = (wire.decode_frames(done.report)[0], ~got & ~kept, want.copy())
        res = tx.residual(0)
        if res is not None:  # before the late report: the kept-back blocks only
            assert np.array_equal(res.numpy(), model)
    report, lost_elems, sent = late
    tx.on_drop_report(report)
    model[lost_elems] += sent[lost_elems]
    assert np.array_equal(tx.residual(0).numpy(), model)
    assert np.array_equal(total_out + model, total_in)  # nothing lost, nothing counted twice
    assert seen["unsent"] and seen["lost"] and seen["spent"]  # every path ran


def test_prepare_without_plan_leaves_a_residual_that_reads_as_zero():
    layout = BucketLayout([4096], 1024)
    tx = RoundSender(TOKEN, rank=1)
    x = torch.ones(layout.numel)
    cls = torch.ones(layout.nblocks, dtype=torch.int64)
    tx.plan(0, 0, tx.prepare(0, x), layout, cls, None, budget=0)  # every block kept back
    assert torch.equal(tx.residual(0), x)
    first = tx.prepare(0, x)
    assert torch.equal(first, 2 * x)  # the residual was added ...
    second = tx.prepare(0, x)
    assert torch.equal(second, x)  # ... once: it reads as zero since
    assert not tx.residual(0).any()
