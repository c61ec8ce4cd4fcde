"""The send budget (dgt.protocol.budget) and the drop report's timing trailer (dgt.protocol.report), sans-IO:
blocks beyond the budget are unsent (not lost), come back through error feedback, and nothing is lost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.budget import RoundWindow, fold_blocks, split_budget, wire_bytes_of_blocks
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.geometry import Geometry
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.report import (
    TRAILER_SIZE,
    TRAILER_V1,
    TRAILER_V1_SIZE,
    Timing,
    decode_report,
    encode_timing,
    split_report,
)
from dgt.protocol.sender import RoundSender

TOKEN = 99


def _frames(plan):
    out = b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)
    dgrams = [bytes(r) for rows in plan.datagrams.values() for r in rows] + [d for o in plan.odd.values() for d in o]
    return out, dgrams


def _round(sender, receiver, x, layout, cls, order, budget, rnd, drop=(), t=0.0):
    plan = sender.plan(0, rnd, x, layout, cls, order, budget=budget)
    rel, dgrams = _frames(plan)
    events = receiver.receive_bytes(rel, 0, t)
    for i, d in enumerate(dgrams):
        if i not in drop:
            events += receiver.receive_frame(_decode(d), 1, t + 0.001 * (i + 1))
    events += receiver.on_time(t + 10.0)
    done = [e for e in events if isinstance(e, RoundDone)]
    assert len(done) == 1
    return plan, done[0]


def _decode(d: bytes) -> wire.Frame:
    (frame,) = wire.decode_frames(d)
    return frame


def test_split_budget_keeps_the_most_important_prefix_that_fits():
    layout = BucketLayout([10 * 1024 + 100])
    geom = Geometry(layout, 256)
    order = np.array([7, 3, 10, 0, 5])
    cost = wire_bytes_of_blocks(geom, order, 4)
    assert cost[0] == 4096 + 4 * wire.HEADER_SIZE and cost[2] == 400 + wire.HEADER_SIZE  # block 10 is a 100-elem tail
    sent, unsent = split_budget(geom, order, 4, int(cost[:3].sum()))
    assert sent.tolist() == [7, 3, 10] and unsent.tolist() == [0, 5]
    assert split_budget(geom, order, 4, None)[0].tolist() == order.tolist()
    assert split_budget(geom, order, 4, 1)[0].tolist() == [7]  # a small budget still probes with one block
    none, rest = split_budget(geom, order, 4, 0)  # the pacer is still paying off earlier rounds: nothing
    assert len(none) == 0 and rest.tolist() == order.tolist()
    assert len(split_budget(geom, order, 4, -500)[0]) == 0
    assert len(split_budget(geom, order[:0], 4, 100)[0]) == 0


def test_round_window_learns_the_reliable_part_of_a_round():
    w = RoundWindow(alpha=0.5, floor=0.01, initial=0.05)
    assert abs(w.budget(1e6) - 50_000) <= 1  # no report yet: the initial window
    w.observe(0.30, 0.10)  # 0.3 s to the report, of which the receiver waited 0.1 s for unimportant blocks
    assert w.value == pytest.approx(0.2) and abs(w.budget(1e6) - 200_000) <= 1
    w.observe(0.50, 0.0)  # a longer round: averaged in
    assert w.value == pytest.approx(0.35)
    w.observe(0.10, 0.0)  # a shorter one: taken at once, so the budget never holds rounds open
    assert w.value == pytest.approx(0.1)
    w.observe(0.001, 0.0)
    assert abs(w.budget(1e6) - 10_000) <= 1  # the floor
    assert abs(w.budget(1e6, debt=4_000) - 6_000) <= 1  # bytes the pacer still owes leave first
    assert w.budget(1e4, debt=4_000) < 0  # a slow lane that just sent a block sends none now


def test_timing_trailer_round_trip_and_bad_input():
    t = Timing(42, 12.5, 12.75, 0.003, 60_000, 12.8)
    bitmap = np.packbits(np.array([1, 0, 1], bool)).tobytes()
    frame = _decode(wire.encode_frame(wire.FrameType.DROP_REPORT, bitmap + encode_timing(t), token=1, rank=0, count=3,
                                      flags=wire.Flags.CLOSED | wire.Flags.TIMING))
    got, back = decode_report(frame)
    assert got.tolist() == [True, False, True]
    assert back.datagrams == 42 and back.first == pytest.approx(12.5) and back.last == pytest.approx(12.75)
    assert back.wait == pytest.approx(0.003) and back.nbytes == 60_000 and back.close == pytest.approx(12.8)
    none = decode_report(_decode(wire.encode_frame(
        wire.FrameType.DROP_REPORT, bitmap + encode_timing(Timing(0, None, None, 0.0, 0)), token=1, rank=0, count=3,
        flags=wire.Flags.TIMING)))[1]
    assert none.first is None and none.last is None and none.close is None
    bare = _decode(wire.encode_frame(wire.FrameType.DROP_REPORT, bitmap, token=1, rank=0, count=3))
    assert decode_report(bare)[1] is None  # a report from a receiver without the trailer
    for bad in (b"\0" * 5, b"", encode_timing(t)[:-1], encode_timing(t) + b"\0", TRAILER_V1.pack(1, 0, 0, 1, 2, 3, 4, 5)
                + b"\0" * 8):  # short, none, one byte short or over, a version 1 trailer with version 2's size
        short = _decode(wire.encode_frame(wire.FrameType.DROP_REPORT, bitmap + bad, token=1, rank=0, count=3,
                                          flags=wire.Flags.TIMING))
        with pytest.raises(wire.WireError):
            decode_report(short)
    bad_version = bytearray(bitmap + encode_timing(t))
    bad_version[len(bitmap)] = 9
    frame = _decode(wire.encode_frame(wire.FrameType.DROP_REPORT, bytes(bad_version), token=1, rank=0,
                                                 count=3, flags=wire.Flags.TIMING))
    with pytest.raises(wire.WireError, match="version"):
        decode_report(frame)
    assert (TRAILER_SIZE, TRAILER_V1_SIZE) == (48, 40)


def test_a_version_1_timing_trailer_still_decodes_without_a_close_time():
    """Receivers before the close time send the 40-byte version 1 trailer: same fields, close None."""
    bitmap = np.packbits(np.array([1, 1, 0], bool)).tobytes()
    v1 = TRAILER_V1.pack(1, 0, 0, 7, 2_500_000_000, 2_750_000_000, 1_000_000, 10_136)
    got, t = decode_report(_decode(wire.encode_frame(wire.FrameType.DROP_REPORT, bitmap + v1, token=1, rank=0,
                                                     count=3, flags=wire.Flags.CLOSED | wire.Flags.TIMING)))
    assert got.tolist() == [True, True, False]
    assert t == Timing(7, 2.5, 2.75, 0.001, 10_136, None)
    assert split_report(bitmap + v1, 3, True)[1] == t


@pytest.mark.parametrize("lost", [(), (0, 1)])  # datagrams 0 and 1: two fragments of block 9
def test_budget_unsent_blocks_go_to_error_feedback_and_nothing_is_lost(lost):
    """Blocks beyond the budget are not framed, are counted unsent (not lost) on both sides, are in the residual at
    once, and the next round delivers them; lost datagrams are folded too. Sum over rounds == sum of inputs."""
    layout = BucketLayout([16 * 1024])
    sender = RoundSender(TOKEN, 0, datagram_payload=1024)
    receiver = RoundReceiver(TOKEN, 1, deadline=FixedGrace(0.5))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(layout.numel, generator=g)
    cls = torch.ones(layout.nblocks, dtype=torch.int64)
    cls[:4] = 0
    order = torch.tensor([9, 4, 15, 7, 5, 6, 8, 10, 11, 12, 13, 14])  # most important first
    per_block = 4096 + 4 * wire.HEADER_SIZE
    plan, done = _round(sender, receiver, sender.prepare(0, x), layout, cls, order, 3 * per_block, 0, drop=lost)
    assert plan.unimportant_blocks == 3 and plan.unsent_blocks == 9 and plan.unsent_lanes == {1: 9}
    assert plan.unsent_bytes == 9 * 4096 and plan.unreliable_frames() == 12
    st = done.stats
    assert st.unsent == 9 and st.dropped == (1 if lost else 0)
    assert st.important + st.unimportant_received + st.dropped + st.unsent == st.blocks
    assert done.report is not None
    report = _decode(done.report)
    assert report.flags & wire.Flags.TIMING
    _, timing = decode_report(report)
    assert timing.datagrams == 12 - len(lost) and timing.first is not None and timing.last >= timing.first
    assert timing.close == pytest.approx(10.0 if lost else timing.last)  # the deadline, or the last datagram in
    info = sender.on_drop_report(report)
    assert info.unsent_blocks == 9 and info.missing_blocks == (1 if lost else 0)
    sent_blocks = set(order[:3].tolist())
    assert info.lost_mask.sum() == info.missing_blocks and set(np.flatnonzero(info.lost_mask)) <= sent_blocks
    residual = sender.residual(0)
    got = done.mask
    missing = layout.expand(~got)
    assert torch.equal(residual[missing], x[missing]) and not residual[~missing].any()
    # round 2: nothing new; with no budget every block goes: the receiver gets exactly what was kept back or lost
    data = sender.prepare(0, torch.zeros_like(x))
    plan2, done2 = _round(sender, receiver, data, layout, 0, None, None, 1)
    assert done2.mask.all() and plan2.unsent_blocks == 0
    total = done.data + done2.data
    assert torch.equal(total, x)  # nothing lost, bit-exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_fold_blocks_equals_the_elementwise_definition(dtype):
    layout = BucketLayout([3000, 1024, 7, 5000])  # partial tail blocks, starts not multiples of the block
    g = torch.Generator().manual_seed(1)
    sent = torch.randn(layout.numel, generator=g).to(dtype)
    res = torch.randn(layout.numel, generator=g).to(dtype)
    blocks = torch.tensor([0, 2, 3, 4, 6, 8, 9])  # 2, 4 and 9 are partial tails
    want = res.clone()
    for b in blocks.tolist():
        s, n = int(layout.block_start[b]), int(layout.block_len[b])
        want[s : s + n] += sent[s : s + n]
    n = fold_blocks(res, sent, layout, blocks)
    assert n == int(layout.block_len[blocks].sum()) and torch.equal(res, want)
