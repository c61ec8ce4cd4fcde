"""Buffers reused across rounds (issue 26): a receiver's fresh result buffer, once the caller dropped the result, is
the next round's landing buffer (no page faults per round), and then must still deliver zeros for every block it
did not receive; the sender's private copy of a bucket is reused once its round's report is in, but never while a
round may still read it, and a caller's tensor never."""

import gc

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.protocol.block_rows import add_rows, zero_rows
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.receiver import HUGE_BYTES, RoundDone, RoundReceiver
from dgt.protocol.round_state import POOL
from dgt.protocol.sender import RoundSender

TOKEN = 0xB0FFE
SIZES = [(HUGE_BYTES // 4) + 5000, 777]  # over the pool's size threshold, with partial tail blocks


def _round(tx: RoundSender, rx: RoundReceiver, rnd: int, x: torch.Tensor, layout: BucketLayout, loss: float,
           seed: int) -> RoundDone:
    """One p = 30 % round of ``x`` through ``tx`` and ``rx``; ``loss`` of the datagrams dropped."""
    rng = np.random.default_rng(seed)
    est = ContributionEstimator(layout)
    est.update(x)
    c = est.classify(0.3)
    plan = tx.plan(0, rnd, tx.prepare(0, x), layout, c.cls, c.order)
    dgrams = [bytes(d) for d in np.asarray(plan.datagrams[1])] + list(plan.odd[1])
    kept = [d for d in dgrams if rng.random() >= loss]
    events = rx.receive_bytes(b"".join(bytes(h) + bytes(p) for h, p in plan.reliable), 0, 0.0)
    for i in range(0, len(kept), 500):
        chunk = kept[i : i + 500]
        events += rx.receive_datagrams(wire.decode_datagrams(b"".join(chunk), [len(d) for d in chunk], token=TOKEN),
                                       1, 0.001)
    events += rx.on_time(10.0)
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    tx.on_drop_report(wire.decode_frames(done.report)[0])
    return done


def test_a_dropped_result_is_the_next_rounds_buffer_and_its_lost_blocks_are_zero():
    layout = BucketLayout(SIZES)
    tx = RoundSender(TOKEN, rank=1, error_feedback=False)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01))
    POOL._free.clear()
    x0, x1 = torch.randn(layout.numel), torch.randn(layout.numel)
    done = _round(tx, rx, 0, x0, layout, loss=0.0, seed=0)
    assert done.mask.all() and torch.equal(done.data, x0)
    view = done.data[100:200]  # a live view keeps the buffer out of the pool
    del done
    gc.collect()
    assert not POOL._free
    view.fill_(7.0)  # stale values a recycled buffer would carry
    del view
    gc.collect()
    assert len(POOL._free) == 1

    done = _round(tx, rx, 1, x1, layout, loss=0.3, seed=1)
    assert not POOL._free  # the round took the recycled buffer
    mask = done.mask.numpy()
    assert 0 < int((~mask).sum()) < layout.nblocks
    elem_in = torch.from_numpy(np.repeat(mask, layout.block_len.numpy()))
    assert torch.equal(done.data[elem_in], x1[elem_in])  # bit-exact where reported
    assert not done.data[~elem_in].any()  # zeros elsewhere: no stale value of the earlier round survives


def test_sender_reuses_its_copy_once_the_report_is_in_never_a_pending_one_or_the_callers():
    layout = BucketLayout([5000, 3000])
    tx = RoundSender(TOKEN, rank=1)
    x = torch.randn(layout.numel)
    cls = torch.ones(layout.nblocks, dtype=torch.int8)
    cls[0] = 0
    c0 = tx.prepare(0, x)
    tx.plan(0, 0, c0, layout, cls)
    c1 = tx.prepare(0, x)  # round 0 is still pending: its copy must not be written
    assert c1.data_ptr() != c0.data_ptr() and torch.equal(c0, x)
    tx.plan(0, 1, c1, layout, cls)
    report = wire.encode_frame(wire.FrameType.DROP_REPORT, np.packbits(np.ones(layout.nblocks, bool)).tobytes(),
                               token=TOKEN, rank=0, round=0, bucket=0, count=layout.nblocks)
    tx.on_drop_report(wire.decode_frames(report)[0])  # round 0's copy is not the latest: not reused
    c2 = tx.prepare(0, x)
    assert c2.data_ptr() not in (c0.data_ptr(), c1.data_ptr())
    p1 = _packed(tx.plan(0, 2, c2, layout, cls))
    assert p1 != _packed(tx.plan(0, 9, c2, layout, cls))  # round 2 is pending: its packed blocks are not reused
    report = wire.encode_frame(wire.FrameType.DROP_REPORT, np.packbits(np.ones(layout.nblocks, bool)).tobytes(),
                               token=TOKEN, rank=0, round=2, bucket=0, count=layout.nblocks)
    tx.on_drop_report(wire.decode_frames(report)[0])
    y = torch.randn(layout.numel)
    c3 = tx.prepare(0, y)  # round 2 is over: its copy is reused
    assert c3.data_ptr() == c2.data_ptr() and torch.equal(c3, y)

    assert _packed(tx.plan(0, 3, y, layout, cls)) == p1  # the caller's own tensor; round 2's packing buffer
    report = wire.encode_frame(wire.FrameType.DROP_REPORT, np.packbits(np.ones(layout.nblocks, bool)).tobytes(),
                               token=TOKEN, rank=0, round=3, bucket=0, count=layout.nblocks)
    tx.on_drop_report(wire.decode_frames(report)[0])
    keep = y.clone()
    c4 = tx.prepare(0, x)
    assert c4.data_ptr() != y.data_ptr() and torch.equal(y, keep) and torch.equal(c4, x)


def _packed(plan) -> int:
    """Address of the plan's packed important blocks (the reliable pair with an empty header)."""
    (mv,) = [p for h, p in plan.reliable if len(h) == 0]
    return int(np.frombuffer(mv, np.uint8).ctypes.data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_updates_equal_the_elementwise_definition_over_several_residues(dtype):
    block = 64
    g = torch.Generator().manual_seed(3)
    dst = torch.randn(5000, generator=g).to(dtype)
    src = torch.randn(5000, generator=g).to(dtype)
    starts = np.array([0, 64, 1000, 3, 3 + 640, 4000, 4936, 130, 2000])  # residues 0, 3, 40, 2, 16, 8
    want_add, want_zero = dst.clone(), dst.clone()
    for s in starts.tolist():
        want_add[s : s + block] += src[s : s + block]
        want_zero[s : s + block] = 0
    got = dst.clone()
    add_rows(got, src, starts, block)
    assert torch.equal(got, want_add)
    got = dst.clone()
    zero_rows(got, starts, block)
    assert torch.equal(got, want_zero)
