"""The sans-IO round protocol under simulated loss, reordering and duplication, with a fake clock."""

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgt import wire
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.protocol.deadline import AdaptiveGrace, DeadlineState, FixedGrace, make_deadline
from dgt.protocol.receiver import DropReportIn, RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender

TOKEN = 0xC0FFEE
SIZES = [3000, 1024, 5, 20000, 777]


def datagrams_of(plan):
    """Every unreliable datagram of a plan as bytes (equal-size ones and odd ones)."""
    out = []
    for lane, arr in plan.datagrams.items():
        out += [(lane, arr[i].tobytes()) for i in range(len(arr))]
    for lane, odd in plan.odd.items():
        out += [(lane, b) for b in odd]
    return out


def make_round(p=0.3, seed=0, sizes=SIZES, dtype=torch.float32, sender=None, rnd=0, bucket=0):
    torch.manual_seed(seed)
    layout = BucketLayout(sizes)
    g = torch.randn(layout.numel).to(dtype)
    est = ContributionEstimator(layout)
    est.update(g)
    c = est.classify(p)
    sender = sender or RoundSender(TOKEN, rank=3)
    flat = sender.prepare(bucket, g)
    return layout, g, c, sender, flat, sender.plan(bucket, rnd, flat, layout, c.cls, c.order)


def feed(rx, items, t=0.0, dt=1e-4):
    """Feed (lane, bytes) items one by one, datagram lanes through the vectorised batch path."""
    events = []
    for lane, b in items:
        t += dt
        if lane == 0:
            events += rx.receive_bytes(b, 0, t)
        else:
            events += rx.receive_datagrams(wire.decode_datagrams(b, [len(b)], token=TOKEN), lane, t)
    return events, t


def reliable_items(plan):
    return [(0, h + bytes(p)) for h, p in plan.reliable]


def test_lossless_round_is_bit_identical_and_closes_complete():
    layout, g, c, _, flat, plan = make_round(p=0.3)
    rx = RoundReceiver(TOKEN)
    items = reliable_items(plan) + [(lane, b) for lane, b in datagrams_of(plan)]
    events, _ = feed(rx, items)
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    assert done.stats.closed_by == "complete"
    assert torch.equal(done.data, g)
    assert done.mask.all()
    st_ = done.stats
    assert st_.important == c.n_important and st_.dropped == 0
    assert st_.important + st_.unimportant_received + st_.dropped == layout.nblocks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_buckets_round_trip(dtype):
    _, g, _, _, _, plan = make_round(p=0.5, dtype=dtype)
    rx = RoundReceiver(TOKEN)
    events, _ = feed(rx, reliable_items(plan) + datagrams_of(plan))
    (done,) = events
    assert done.data.dtype == dtype and torch.equal(done.data, g)


@pytest.mark.parametrize("seed", range(5))
def test_loss_reorder_duplication_with_fake_clock(seed):
    rng = random.Random(seed)
    layout, g, c, sender, flat, plan = make_round(p=0.2, seed=seed)
    rx = RoundReceiver(TOKEN, deadline=FixedGrace(0.050))
    dgrams = datagrams_of(plan)
    kept = [d for d in dgrams if rng.random() > 0.25]  # 25% loss
    dups = rng.sample(kept, len(kept) // 5)  # 20% duplicated
    udp = kept + dups
    rng.shuffle(udp)  # reordered
    # UDP may overtake the reliable lane: part of it arrives before ROUND_BEGIN (early buffer)
    early, late = udp[: len(udp) // 3], udp[len(udp) // 3 :]
    ev1, t = feed(rx, early)
    assert rx.counters.early_buffered == len(early)
    ev2, t_imp = feed(rx, reliable_items(plan), t)  # the last reliable frame (ROUND_END) completes the important set
    ev3, t = feed(rx, late, t_imp)
    assert not [e for e in ev1 + ev2 + ev3 if isinstance(e, RoundDone)], "must wait for the deadline: blocks missing"
    assert rx.next_deadline() == pytest.approx(t_imp + 0.050)
    assert rx.on_time(t_imp + 0.049) == []
    (done,) = rx.on_time(t_imp + 0.050)
    assert done.stats.closed_by == "deadline"

    # all important blocks delivered, exactly
    emask = layout.expand(c.important)
    assert torch.equal(done.data[emask], g[emask])
    assert done.mask[c.important].all()
    # delivered blocks are exact, lost blocks are zero
    m = layout.expand(done.mask)
    assert torch.equal(done.data[m], g[m])
    assert (done.data[~m] == 0).all()
    # which blocks must be complete: every fragment kept
    got_frags = {}
    for _, b in kept:
        h = np.frombuffer(b[:48], dtype=wire.HEADER_DTYPE)[0]
        got_frags.setdefault(int(h["block"]), set()).add(int(h["offset"]))
    geom = sender.geometry(layout, 4)
    expect = c.important.clone()
    for blk, offs in got_frags.items():
        if len(offs) == geom.frags_needed[blk]:
            expect[blk] = True
    assert torch.equal(done.mask, expect)
    # counters add up exactly
    st_ = done.stats
    assert st_.important == c.n_important
    assert st_.important + st_.unimportant_received + st_.dropped == layout.nblocks
    assert st_.dropped == int((~expect).sum())
    assert st_.duplicated == len(dups)
    assert st_.lane(1).frames == len(udp)
    assert st_.rejected == 0
    # late frames of a finalised round are counted and discarded
    feed(rx, dgrams[:3], t + 1)
    assert rx.counters.late == 3
    # the drop report says exactly what was missing; error feedback folds it into the residual
    (f,) = wire.decode_frames(done.report, token=TOKEN)
    assert f.ftype == wire.FrameType.DROP_REPORT and f.count == layout.nblocks
    info = sender.on_drop_report(f)
    assert info.missing_blocks == st_.dropped
    res = sender.residual(0)
    torch.testing.assert_close(res[~m], g[~m])
    assert (res[m] == 0).all()
    assert sender.closed(0, 0)


def test_error_feedback_resends_lost_information_next_round():
    layout, g, c, sender, flat, plan = make_round(p=0.3)
    rx = RoundReceiver(TOKEN, deadline=FixedGrace(0.0))
    feed(rx, reliable_items(plan))  # every datagram lost
    (done,) = rx.on_time(10.0)
    sender.on_drop_report(wire.decode_frames(done.report)[0])
    g2 = torch.randn(layout.numel)
    flat2 = sender.prepare(0, g2)
    lost = ~layout.expand(done.mask)
    torch.testing.assert_close(flat2[lost], g2[lost] + g[lost])
    torch.testing.assert_close(flat2[~lost], g2[~lost])
    # round 2 lossless: the receiver now holds g2 + what round 1 lost, so the two rounds together sum to g + g2
    plan2 = sender.plan(0, 1, flat2, layout, 0)
    events, _ = feed(rx, reliable_items(plan2))
    (done2,) = events
    torch.testing.assert_close(done.data + done2.data, g + g2)
    assert sender.residual(0).abs().sum() == 0


def test_error_feedback_off_keeps_no_residual():
    sender = RoundSender(TOKEN, 3, error_feedback=False)
    layout, g, c, sender, flat, plan = make_round(sender=sender)
    rx = RoundReceiver(TOKEN, deadline=FixedGrace(0.0))
    feed(rx, reliable_items(plan))
    (done,) = rx.on_time(1.0)
    sender.on_drop_report(wire.decode_frames(done.report)[0])
    assert sender.residual(0) is None


def test_adaptive_deadline_waits_for_a_flowing_stream_and_caps():
    pol = AdaptiveGrace(k=4, floor=0.001, cap=0.2)
    st_ = DeadlineState(important_done_at=1.0, last_arrival=1.05, mean_gap=0.001, remaining_frames=0)
    assert pol.deadline(st_) == pytest.approx(1.054)
    st_ = DeadlineState(1.0, 1.0, 0.001, remaining_frames=50)  # 50 frames still to come at 1 ms
    assert pol.deadline(st_) == pytest.approx(1.075)
    st_ = DeadlineState(1.0, 1.0, 0.01, remaining_frames=10_000)
    assert pol.deadline(st_) == pytest.approx(1.2)  # hard bound
    assert isinstance(make_deadline("adaptive:cap=0.3"), AdaptiveGrace)
    assert make_deadline("fixed:0.02").grace == 0.02


def test_adaptive_deadline_learns_its_bound_across_rounds():
    pol = AdaptiveGrace(k=4, floor=0.001, cap=0.5, warm=4)
    quiet = DeadlineState(important_done_at=1.0, last_arrival=None, mean_gap=None, remaining_frames=None)
    assert pol.deadline(quiet) == pytest.approx(1.05)  # nothing learnt: cap / 10 within the cap
    for _ in range(3):
        pol.observe(0.004, complete=True)
    assert pol.bound() == 0.5  # not warm yet
    pol.observe(0.004, complete=True)
    assert pol.bound() == pytest.approx(0.004 + 4 * pol.dev) and pol.bound() < 0.02
    # rounds whose unimportant blocks all came within ~4 ms no longer wait 50 ms for a silent stream
    assert pol.deadline(quiet) == pytest.approx(1.0 + pol.bound())
    flowing = DeadlineState(1.0, 1.0, 0.01, remaining_frames=10_000)
    assert pol.deadline(flowing) == pytest.approx(1.0 + pol.bound())
    # rounds that keep reaching their deadline teach it to wait longer again, up to the cap
    before = pol.bound()
    for _ in range(40):
        pol.observe(pol.bound(), complete=False)
    assert pol.bound() > 4 * before
    for _ in range(200):
        pol.observe(pol.bound(), complete=False)
    assert pol.bound() == 0.5
    for bad in (float("nan"), -1.0):  # never poisoned
        pol.observe(bad, complete=True)
    assert pol.bound() == 0.5
    off = make_deadline("adaptive:learn=0")
    for _ in range(10):
        off.observe(0.001, complete=True)
    assert off.bound() == off.cap  # the behaviour before: a fixed hard bound


@settings(max_examples=200, deadline=None)
@given(t0=st.floats(0, 1e3), last=st.one_of(st.none(), st.floats(0, 2e3)), gap=st.one_of(st.none(), st.floats(0, 10)),
       left=st.one_of(st.none(), st.integers(0, 10**6)), batch=st.one_of(st.none(), st.floats(0, 10)),
       dense=st.one_of(st.none(), st.floats(0, 10)), waits=st.lists(st.floats(0, 2), max_size=12))
def test_no_deadline_passes_the_policys_longest_wait(t0, last, gap, left, batch, dense, waits):
    """A hop's send half abandons its datagrams past ``longest_wait`` and a transfer time
    (dgt.channels.hop_datagrams): no round the policy closes may still be waiting for them then, learnt bound or
    not."""
    pol = AdaptiveGrace()
    for i, w in enumerate(waits):
        pol.observe(w, complete=i % 3 != 0)
    state = DeadlineState(t0, last, gap, left, batch, dense)
    assert pol.deadline(state) <= t0 + pol.longest_wait() + 1e-9
    fixed = FixedGrace(0.02)
    assert fixed.deadline(state) <= t0 + fixed.longest_wait() + 1e-9


def test_adaptive_deadline_never_waits_longer_than_sending_the_rest_densely():
    pol = AdaptiveGrace(k=4, floor=0.001, cap=0.5, learn=0)
    silent = DeadlineState(1.0, None, None, remaining_frames=3, dense_wait=0.0004)
    assert pol.deadline(silent) == pytest.approx(1.01)  # 2 x 0.4 ms, but never under dense_floor
    assert AdaptiveGrace(floor=0.001, learn=0, dense_floor=0).deadline(silent) == pytest.approx(1.001)  # nor floor
    flowing = DeadlineState(1.0, 1.0, 0.01, remaining_frames=100, dense_wait=0.02)
    assert pol.deadline(flowing) == pytest.approx(1.04)  # 2 x what the rest would take densely
    assert AdaptiveGrace(cap=0.5, learn=0, dense=0).deadline(flowing) == pytest.approx(1.5)  # the bound off
    assert pol.deadline(DeadlineState(1.0, 1.0, 0.01, remaining_frames=100)) == pytest.approx(1.5)  # rate unknown


def test_receiver_measures_the_dense_wait_from_the_important_blocks_rate():
    *_, plan = make_round(p=0.3)
    rx = RoundReceiver(TOKEN, deadline=AdaptiveGrace(k=4, floor=0.0001, cap=10.0, learn=0, dense_floor=0))
    rel = reliable_items(plan)
    _, t = feed(rx, rel, dt=0.01)  # the important blocks trickle in: a slow reliable lane (silent: cap/10 = 1 s)
    (r,) = rx.rounds.values()
    imp_bytes = r.end[0] * r.layout.block * r.isz
    rate = imp_bytes / (r.imp_done_at - r.opened_at)
    want = r.end[3] * r.geom.frag * r.isz / rate  # no datagram in yet: all of them missing
    assert 0.0001 < 2 * want < 1.0
    assert rx.next_deadline() == pytest.approx(r.imp_done_at + 2 * want)
    (done,) = rx.on_time(rx.next_deadline())
    assert done.stats.closed_by == "deadline" and done.stats.dropped == r.end[1]


def test_receiver_teaches_the_deadline_only_with_lossy_rounds():
    pol = AdaptiveGrace(k=4, floor=0.001, cap=1.0)
    rx = RoundReceiver(TOKEN, deadline=pol)
    *_, plan = make_round(p=1.0)  # all important: nothing to learn
    feed(rx, reliable_items(plan) + datagrams_of(plan))
    assert pol.seen == 0
    *_, plan = make_round(p=0.3, rnd=1)
    dg = datagrams_of(plan)
    events, t = feed(rx, reliable_items(plan) + dg, dt=0.001)
    assert [e.stats.closed_by for e in events] == ["complete"] and pol.seen == 1
    assert pol.mean == pytest.approx(events[0].stats.deadline_wait)
    *_, plan = make_round(p=0.3, rnd=2)
    events, t = feed(rx, reliable_items(plan) + datagrams_of(plan)[:-1], t, dt=0.001)
    assert events == []
    (done,) = rx.on_time(rx.next_deadline())
    assert done.stats.closed_by == "deadline" and pol.seen == 2


def test_adaptive_deadline_in_receiver_extends_while_frames_arrive():
    layout, g, c, sender, flat, plan = make_round(p=0.1)
    # (dense=0: here the important blocks come as fast as the datagrams, so the dense bound would close it sooner)
    rx = RoundReceiver(TOKEN, deadline=AdaptiveGrace(k=4, floor=0.001, cap=1.0, dense=0))
    dg = datagrams_of(plan)
    _, t = feed(rx, reliable_items(plan) + dg[: len(dg) // 2], dt=0.001)
    d1 = rx.next_deadline()
    assert d1 > t  # more frames announced: waits at least k gaps
    assert rx.on_time(t + 0.0005) == []
    events, t = feed(rx, dg[len(dg) // 2 :], t, dt=0.001)
    assert [e.stats.closed_by for e in events] == ["complete"]


def test_several_senders_and_buckets_in_flight():
    rx = RoundReceiver(TOKEN, deadline=FixedGrace(0.01))
    plans = []
    for rank in (1, 2):
        s = RoundSender(TOKEN, rank)
        for bucket in (0, 7):
            plans.append(make_round(p=0.5, seed=rank * 10 + bucket, sender=s, bucket=bucket, rnd=bucket + 1))
    items = []
    for *_, plan in plans:
        items += reliable_items(plan)
    for *_, plan in plans:
        items += datagrams_of(plan)
    random.Random(0).shuffle(items)  # interleave lanes, rounds, senders
    events, _ = feed(rx, items)
    done = {(e.sender, e.bucket): e for e in events if isinstance(e, RoundDone)}
    assert len(done) == 4
    for _layout, g, _c, s, _flat, plan in plans:
        assert torch.equal(done[(s.rank, plan.bucket)].data, g)


def test_wrong_token_and_garbage_are_counted_not_raised():
    rx = RoundReceiver(TOKEN)
    *_, plan = make_round()
    other = RoundReceiver(TOKEN + 1)
    feed(other, reliable_items(plan))
    assert other.counters.rejected >= len(plan.reliable) and not other.rounds
    assert rx.receive_bytes(b"\x00" * 100, 1, 0.0) == []
    batch = wire.decode_datagrams(b"junk" * 30, [40, 80])
    assert rx.receive_datagrams(batch, 1, 0.0) == []
    assert rx.counters.rejected == 3


def test_drop_report_in_is_routed_to_the_sender_side():
    rx = RoundReceiver(TOKEN)
    rep = wire.encode_frame(wire.FrameType.DROP_REPORT, b"\xff", token=TOKEN, rank=2, count=8)
    (ev,) = rx.receive_bytes(rep, 0, 0.0)
    assert isinstance(ev, DropReportIn) and ev.frame.rank == 2


def test_hostile_round_begin_cannot_allocate_beyond_limits():
    lim = wire.Limits(max_bucket_elems=1 << 20, max_open_rounds=4)
    rx = RoundReceiver(TOKEN, limits=lim, max_open_bytes=8 << 20)
    huge = wire.encode_round_begin(1 << 40, 1024, 256, [1 << 40])
    rx.receive_bytes(wire.encode_frame(wire.FrameType.ROUND_BEGIN, huge, token=TOKEN, rank=1), 0, 0.0)
    assert not rx.rounds
    ok = wire.encode_round_begin(1 << 20, 1024, 256, [1 << 20])
    for rnd in range(10):
        rx.receive_bytes(wire.encode_frame(wire.FrameType.ROUND_BEGIN, ok, token=TOKEN, rank=1, round=rnd), 0, 0.0)
    assert len(rx.rounds) <= 4  # bounded by max_open_rounds and the memory budget
    assert sum(r.nbytes for r in rx.rounds.values()) <= 8 << 20
    assert rx.counters.rejected >= 6


@settings(max_examples=300, deadline=None)
@given(blobs=st.lists(st.binary(max_size=200), max_size=10), flips=st.lists(st.integers(0, 2000), max_size=10))
def test_fuzz_receiver_never_raises(blobs, flips):
    rx = RoundReceiver(TOKEN, limits=wire.Limits(max_bucket_elems=1 << 16, max_open_rounds=2))
    layout, g, c, sender, flat, plan = make_round(p=0.5, sizes=[3000])
    valid = [h + bytes(p) for h, p in plan.reliable] + [b for _, b in datagrams_of(plan)]
    mutated = []
    for i, pos in enumerate(flips):
        b = bytearray(valid[i % len(valid)])
        b[pos % len(b)] ^= 0xFF
        mutated.append(bytes(b))
    for j, b in enumerate(list(blobs) + mutated + valid):
        lane = j % 2
        if lane:
            rx.receive_datagrams(wire.decode_datagrams(b, [len(b)], token=TOKEN), 1, float(j))
        else:
            rx.receive_bytes(b, 0, float(j))
        rx.on_time(float(j))
    per_sender = {}
    for k in rx.rounds:
        per_sender[k[0]] = per_sender.get(k[0], 0) + 1
    assert max(per_sender.values(), default=0) <= 2  # max_open_rounds holds per sender


@given(sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=6), frame_kb=st.sampled_from([4, 12, 64, 1024]))
@settings(max_examples=40, deadline=None)
def test_lossless_fast_path_cuts_the_same_frames_as_the_run_finder(sizes, frame_kb):
    """A round with every block important takes a shortcut; it must frame the bucket exactly like the general path."""
    layout = BucketLayout(sizes, 256)
    s = RoundSender(1, 0, reliable_frame_bytes=frame_kb << 10)
    flat = torch.randn(layout.numel)
    raw = flat.view(torch.uint8).numpy()
    geom = s.geometry(layout, 4)
    common = dict(token=1, rank=0, round=0, bucket=0, codec=0)
    blocks = np.arange(layout.nblocks)
    fast = s._whole(raw, 4, 0, geom, layout.nblocks, common)
    general = s._run_frames(raw, 4, 0, geom, blocks, common)
    if layout.nblocks >= 8:  # shorter buckets go through the general path (packed single blocks), never the shortcut
        assert [(bytes(h), bytes(p)) for h, p in fast] == [(bytes(h), bytes(p)) for h, p in general]
    assert b"".join(bytes(p) for _, p in fast) == raw.tobytes()  # the frames tile the bucket in order


def test_no_report_flag_only_on_wholly_reliable_rounds_and_losses_are_still_reported():
    layout = BucketLayout(SIZES)
    g = torch.randn(layout.numel)
    s = RoundSender(TOKEN, rank=3)
    quiet = s.plan(0, 0, g, layout, 0, report=False)  # every block reliable: the receiver sends no report
    rx = RoundReceiver(TOKEN)
    events, _ = feed(rx, reliable_items(quiet))
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    assert done.report is None and done.mask.all() and torch.equal(done.data, g)
    # a round with unreliable blocks ignores report=False: its sender needs the report for error feedback
    c = ContributionEstimator(layout)
    c.update(g)
    cls = c.classify(0.3)
    lossy = s.plan(0, 1, s.prepare(0, g), layout, cls.cls, cls.order, report=False)
    events, t = feed(rx, reliable_items(lossy))  # every datagram lost
    done = rx.on_time(t + 10.0)[0]
    assert done.stats.dropped > 0 and done.report is not None
    # a receiver that finds a flagged round short still reports: cut the last important frame of a quiet round
    quiet2 = s.plan(0, 2, g, layout, 0, report=False)
    items = reliable_items(quiet2)
    events, t = feed(rx, items[:-2] + items[-1:])
    assert not [e for e in events if isinstance(e, RoundDone)]  # an important block is missing: no close yet
    (aborted,) = rx.abort(3, t)
    assert aborted.stats.dropped > 0 and aborted.report is not None
