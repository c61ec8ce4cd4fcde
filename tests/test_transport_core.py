"""The receiver-core additions the transport relies on: batched reliable runs (same result as frame by frame),
early datagrams kept as batches, caller-provided round buffers, and ``abort`` keeping usable rounds."""

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender

TOKEN = 0xC0FFEE
SIZES = [3000, 1024, 5, 20000, 777]


def plan_round(p=0.3, seed=0, rnd=0, bucket=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layout = BucketLayout(SIZES)
    x = torch.randn(layout.numel).to(dtype)
    est = ContributionEstimator(layout)
    est.update(x.float())
    c = est.classify(p)
    tx = RoundSender(TOKEN, rank=2)
    return layout, x, c, tx.plan(bucket, rnd, tx.prepare(bucket, x), layout, c.cls, c.order)


def reliable_bytes(plan) -> bytes:
    return b"".join(h + bytes(p) for h, p in plan.reliable)


def split_frames(stream: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(stream):
        n = wire.HEADER_SIZE + int.from_bytes(stream[pos + 44 : pos + 48], "big")
        out.append(stream[pos : pos + n])
        pos += n
    return out


def as_batch(frames: list[bytes]) -> wire.Batch:
    return wire.decode_datagrams(b"".join(frames), [len(f) for f in frames], token=TOKEN)


def all_datagrams(plan) -> list[bytes]:
    out = []
    for arr in plan.datagrams.values():
        out += [arr[i].tobytes() for i in range(len(arr))]
    for odd in plan.odd.values():
        out += odd
    return out


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_batched_runs_equal_frame_by_frame(chunk):
    layout, x, c, plan = plan_round(p=0.4)
    frames = split_frames(reliable_bytes(plan))
    begin, data, end = frames[0], frames[1:-1], frames[-1]
    data = data + data[:2]  # duplicates too
    rx_a, rx_b = RoundReceiver(TOKEN), RoundReceiver(TOKEN)
    rx_a.receive_bytes(begin, 0, 0.0)
    rx_b.receive_bytes(begin, 0, 0.0)
    for f in data:
        rx_a.receive_bytes(f, 0, 0.1)
    for i in range(0, len(data), chunk):
        rx_b.receive_runs(as_batch(data[i : i + chunk]), 0, 0.1)
    ra, rb = rx_a.rounds[(2, 0, 0)], rx_b.rounds[(2, 0, 0)]
    assert np.array_equal(ra.nfrag, rb.nfrag) and np.array_equal(ra.important, rb.important)
    assert (ra.n_done, ra.n_imp_done) == (rb.n_done, rb.n_imp_done) == (c.n_important, c.n_important)
    assert ra.stats.lanes[0] == rb.stats.lanes[0] and ra.stats.duplicated == rb.stats.duplicated > 0
    assert torch.equal(ra.data, rb.data)
    rest = as_batch(all_datagrams(plan))
    ev_a = rx_a.receive_bytes(end, 0, 0.2) + rx_a.receive_datagrams(rest, 1, 0.3)
    ev_b = rx_b.receive_bytes(end, 0, 0.2) + rx_b.receive_datagrams(rest, 1, 0.3)
    (da,), (db,) = ev_a, ev_b
    assert torch.equal(da.data, x) and torch.equal(db.data, x) and da.stats.closed_by == db.stats.closed_by


def test_batched_runs_reject_bad_geometry_and_count_unknown_rounds():
    layout, x, c, plan = plan_round(p=0.5)
    frames = split_frames(reliable_bytes(plan))
    rx = RoundReceiver(TOKEN)
    rx.receive_runs(as_batch(frames[1:3]), 0, 0.0)  # before ROUND_BEGIN: unknown, not kept
    assert rx.counters.unknown == 2
    rx.receive_bytes(frames[0], 0, 0.0)
    bad = bytearray(frames[1])
    h = np.frombuffer(bad[:48], wire.HEADER_DTYPE).copy()
    h["offset"] += 1  # no longer starts on a block boundary
    bad[:48] = h.tobytes()
    rx.receive_runs(as_batch([bytes(bad), frames[2]]), 0, 0.0)
    r = rx.rounds[(2, 0, 0)]
    assert r.stats.rejected == 1 and r.stats.lanes[0].frames == 1


def test_early_datagrams_are_kept_as_batches_and_replayed():
    layout, x, c, plan = plan_round(p=0.3)
    rx = RoundReceiver(TOKEN)
    dgrams = all_datagrams(plan)
    assert rx.receive_datagrams(as_batch(dgrams), 1, 0.0) == []
    assert rx.counters.early_buffered == len(dgrams) and len(rx._early) <= 2  # equal-size rows + odd tails
    events = []
    for f in split_frames(reliable_bytes(plan)):
        events += rx.receive_bytes(f, 0, 0.1)
    (done,) = events
    assert done.stats.closed_by == "complete" and torch.equal(done.data, x)


def test_caller_buffer_is_used_and_lost_blocks_are_zeroed_in_it():
    layout, x, c, plan = plan_round(p=0.3)
    out = torch.full((layout.numel,), 7.0)
    rx = RoundReceiver(TOKEN, deadline=FixedGrace(0.01), allocator=lambda key, n, dt: out if key == (2, 0, 0) else None)
    events = []
    for f in split_frames(reliable_bytes(plan)):
        events += rx.receive_bytes(f, 0, 0.0)
    half = all_datagrams(plan)[::2]
    events += rx.receive_datagrams(as_batch(half), 1, 0.001)
    events += rx.on_time(1.0)
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    assert done.data.data_ptr() == out.data_ptr()
    got = layout.expand(done.mask)
    assert torch.equal(out[got], x[got]) and (out[~got] == 0).all() and not done.mask.all()
    # a buffer of the wrong size is refused (a fresh one is used) and counted
    rx2 = RoundReceiver(TOKEN, allocator=lambda key, n, dt: torch.zeros(3))
    for f in split_frames(reliable_bytes(plan)):
        rx2.receive_bytes(f, 0, 0.0)
    assert rx2.counters.reasons.get("buffer-mismatch") == 1


def test_abort_keeps_rounds_whose_important_blocks_are_in():
    _, _, _, plan_a = plan_round(p=0.3, rnd=0)
    _, _, _, plan_b = plan_round(p=0.3, rnd=1)
    rx = RoundReceiver(TOKEN, deadline=FixedGrace(10.0))
    for f in split_frames(reliable_bytes(plan_a)):  # round 0: important all in, waiting for its deadline
        rx.receive_bytes(f, 0, 0.0)
    frames_b = split_frames(reliable_bytes(plan_b))
    for f in frames_b[:2]:  # round 1: opened, important blocks still missing
        rx.receive_bytes(f, 0, 0.0)
    done = {d.round: d for d in rx.abort(2, 1.0)}
    assert done[0].stats.closed_by == "sender-gone" and done[1].stats.closed_by == "aborted"
    assert not rx.open_rounds()


def test_single_header_validation_matches_the_vectorised_one():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    base = wire.encode_header(wire.FrameType.DATA, token=TOKEN, rank=1, count=256, length=1024, offset=4096)

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 47), st.integers(0, 255)), max_size=4), st.sampled_from([None, TOKEN]))
    def check(flips, token):
        b = bytearray(base)
        for i, v in flips:
            b[i] = v
        h = np.frombuffer(bytes(b), wire.HEADER_DTYPE)
        assert wire.validate_one(bytes(b), token=token) == int(wire.validate(h, token=token)[0])

    check()


def test_adaptive_deadline_waits_for_the_next_burst():
    """GRO delivers datagrams in bursts: with frames still announced, the round waits about two batch gaps after
    the last burst instead of a few per-datagram gaps."""
    from dgt.protocol.deadline import AdaptiveGrace, DeadlineState

    pol = AdaptiveGrace()
    bursty = DeadlineState(1.0, 1.0, mean_gap=0.0001, remaining_frames=1, batch_gap=0.006)
    assert pol.deadline(bursty) == pytest.approx(1.012)
    smooth = DeadlineState(1.0, 1.0, mean_gap=0.0001, remaining_frames=1)
    assert pol.deadline(smooth) == pytest.approx(1.002)  # the floor
    done = DeadlineState(1.0, 1.0, mean_gap=0.0001, remaining_frames=0, batch_gap=0.006)
    assert pol.deadline(done) == pytest.approx(1.002)
