"""The receiver's close time (DROP_REPORT timing trailer v2) in the congestion controller's loss rule, against a fake
clock: datagrams that left after ``close - base delay`` could not arrive in time and are not counted as sent (they
left too late; they were not lost), while datagrams really dropped before the close still back the rate off."""

from __future__ import annotations

import pytest

from dgt.protocol.congestion import Feedback, LedbatRate, round_feedback
from dgt.protocol.report import Timing

OFFSET = 500.25  # receiver clock - sender clock (unknown to the controller)
PROP = 0.0003  # one-way delay through an empty queue
DGRAM = 1448
CHUNK = 16  # datagrams per send call (one GSO send)


def play_round(rate: float, t0: float, *, window: float = 0.02, lag: float = 0.004, hold: float = 0.0005,
               report_delay: float = 0.003, drop_every: int = 0) -> tuple[list[tuple[float, int, int]], Timing, float]:
    """One round on a loopback-like path: the sender's datagrams start ``lag`` after the round (behind its opening
    frame) and are paced at ``rate`` for a budget of ``rate * window`` bytes; the receiver closes the round ``hold``
    after its important blocks are in (at ``t0 + window``) and its report reaches the sender ``report_delay`` later,
    when the sender abandons what it has not sent. A datagram arrives iff it left by ``close - PROP`` and its send
    call is not one of every ``drop_every`` (0: none dropped). Returns (send calls, the report's timing, report time,
    sender clock)."""
    close = t0 + window + hold  # sender clock
    report_at = close + report_delay
    budget = rate * window
    gap = CHUNK * DGRAM / rate
    sends, arrivals, t, nbytes, k = [], [], t0 + lag, 0.0, 0
    while nbytes < budget and t < report_at:
        sends.append((t, CHUNK, CHUNK * DGRAM))
        if t + PROP <= close and not (drop_every and k % drop_every == drop_every - 1):
            arrivals.append(t + PROP + OFFSET)
        nbytes += CHUNK * DGRAM
        t += gap
        k += 1
    timing = Timing(CHUNK * len(arrivals), arrivals[0] if arrivals else None, arrivals[-1] if arrivals else None,
                    hold, CHUNK * DGRAM * len(arrivals), close + OFFSET)
    return sends, timing, report_at


def rounds(cc: LedbatRate, n: int, use_close: bool, **kw: float) -> list[float]:
    rates, t = [], 0.0
    for _ in range(n):
        sends, timing, now = play_round(cc.rate, t, **kw)
        if not use_close:  # what a version 1 trailer says: no close time, every send call counts (the old rule)
            timing = Timing(timing.datagrams, timing.first, timing.last, timing.wait, timing.nbytes)
        cc.on_feedback(round_feedback(sends, timing, cc.base.value), now)
        rates.append(cc.rate)
        t += 0.05
    return rates


def test_a_tail_sent_after_the_close_is_not_a_loss_and_the_rate_does_not_back_off():
    """The loopback collapse: the tail of every round leaves after the receiver closed it. Counted as sent (no close
    time) it is a loss of over 2 % every round and the rate halves every round; with the close time it is not
    counted and the rate climbs."""
    start = 25e6
    before = LedbatRate(start, min_rate=1e6)
    old = rounds(before, 12, use_close=False)
    assert before.loss_backoffs >= 6 and old[2] == start / 8 and max(old[3:]) < start / 4  # the collapse
    cc = LedbatRate(start, min_rate=1e6)
    new = rounds(cc, 8, use_close=True)
    assert cc.loss_backoffs == 0 and new == [start * 2 ** (i + 1) for i in range(8)]  # slow start, undisturbed


def test_datagrams_dropped_before_the_close_still_back_off():
    """Every other send call lost on the way, all of them in time to arrive: a real loss, and the rate halves every
    round down to the floor."""
    cc = LedbatRate(25e6, min_rate=1e6)
    rates = rounds(cc, 5, use_close=True, drop_every=2)
    assert cc.loss_backoffs == 5 and rates == [12.5e6, 6.25e6, 3.125e6, 1.5625e6, 1e6]


def test_round_feedback_counts_only_calls_that_could_arrive_before_the_close():
    sends = [(1.000, 10, 14480), (1.010, 10, 14480), (1.020, 10, 14480), (1.030, 5, 7240)]
    t = Timing(20, 1.0003 + OFFSET, 1.0103 + OFFSET, 0.002, 28960, 1.015 + OFFSET)
    fb = round_feedback(sends, t, PROP + OFFSET)
    assert (fb.sent_datagrams, fb.sent_bytes) == (20, 28960)  # the calls at 1.020 and 1.030 left too late
    assert fb.first_sent == 1.0 and fb.last_sent == 1.010 and fb.loss == 0.0
    assert fb.end == pytest.approx(1.015 - PROP)
    assert fb.delay_samples() == pytest.approx((PROP + OFFSET, PROP + OFFSET))  # complete: the last one's sample too
    assert fb.goodput(1.5) == pytest.approx(28960 / (1.015 - PROP - 1.0))  # up to the end, not to the report
    # no base delay yet (the path's first report): the round's own first sample stands in
    assert round_feedback(sends, t, None) == fb
    assert round_feedback(sends, t, 2 * OFFSET).end == fb.end  # a larger (stale) base: the round's sample wins
    # a version 1 trailer (no close time), or no arrival and no base: every call counts, as before
    for fb in (round_feedback(sends, Timing(20, t.first, t.last, 0.002, 28960), PROP + OFFSET),
               round_feedback(sends, Timing(0, None, None, 0.002, 0, t.close), None)):  # fmt: skip
        assert (fb.sent_datagrams, fb.end) == (35, None) and fb.last_sent == 1.030
        assert fb.loss == pytest.approx(1 - fb.delivered_datagrams / 35)
        assert fb.goodput(1.5) == pytest.approx(fb.delivered_bytes / 0.5)
    empty = round_feedback([], t, PROP + OFFSET)
    assert empty.sent_datagrams == 0 and empty.first_sent is None
    late = round_feedback([(1.02, 10, 14480)], Timing(0, None, None, 0.0, 0, t.close), PROP + OFFSET)  # too late
    assert late.sent_datagrams == 0 and LedbatRate(5e6).on_feedback(late, 2.0) == 5e6


def test_goodput_ends_at_the_last_useful_send():
    fb = Feedback(10, 14480, 10, 14480, first_sent=1.0, last_sent=1.01, end=1.02)
    assert fb.goodput(3.0) == pytest.approx(14480 / 0.02)
    assert fb.goodput(1.01) == pytest.approx(14480 / 0.01)  # a report before the end: the report time
    assert Feedback(10, 14480, 0, 0, first_sent=1.0, end=0.9).goodput(3.0) is None


def test_a_sender_that_cannot_reach_the_rate_caps_it_at_what_it_got_out_in_time():
    """The round's budget asked for 100 send calls' worth; the sender (a loaded CPU) got 40 out by the last useful
    moment and the rest later or never. The path lost nothing, so no back-off for loss, but the rate comes down to
    the 40 calls' rate: a higher one only makes the budget promise datagrams that miss their round."""
    gap = 0.001  # one call of CHUNK datagrams per ms: 23.2 MB/s
    sends = [(1.0 + i * gap, CHUNK, CHUNK * DGRAM) for i in range(60)]
    end = 1.0 + 39.5 * gap  # calls 0..39 left in time
    t = Timing(40 * CHUNK, 1.0 + PROP + OFFSET, 1.039 + PROP + OFFSET, 0.0005, 40 * CHUNK * DGRAM, end + PROP + OFFSET)
    fb = round_feedback(sends, t, PROP + OFFSET, planned_bytes=100 * CHUNK * DGRAM)
    assert fb.sent_datagrams == 40 * CHUNK and fb.late_bytes == 60 * CHUNK * DGRAM and fb.loss == 0.0
    assert fb.send_rate() == pytest.approx(40 * CHUNK * DGRAM / (39.5 * gap))
    cc = LedbatRate(200e6, min_rate=1e6)
    assert cc.on_feedback(fb, 1.1) == pytest.approx(fb.send_rate())
    assert cc.sender_caps == 1 and cc.loss_backoffs == 0 and not cc.slow_start
    # everything left in time: no cap, the rate is the controller's (slow start doubles it)
    ok = round_feedback(sends[:40], t, PROP + OFFSET, planned_bytes=40 * CHUNK * DGRAM)
    assert ok.late_bytes == 0 and ok.send_rate() is None
    assert LedbatRate(5e6, min_rate=1e6).on_feedback(ok, 1.1) == 10e6
    # without a close time nothing is known to be late
    v1 = Timing(t.datagrams, t.first, t.last, t.wait, t.nbytes)
    assert round_feedback(sends, v1, PROP + OFFSET, planned_bytes=100 * CHUNK * DGRAM).late_bytes == 0


def test_the_sender_cap_keeps_a_slow_sender_from_overfilling_its_rounds():
    """Rounds on a path with room but a sender that gets out only 8 MB/s: without the cap (no planned bytes given,
    as before) the rate climbs far past it and most of each round's budget misses the round; with it the rate
    settles near what the sender can do and little is late."""
    def play(cc: LedbatRate, cap_on: bool, n: int = 20) -> tuple[float, float]:
        t, late, planned_total = 0.0, 0.0, 0.0
        for _ in range(n):
            window, push = 0.02, 8e6
            planned = cc.rate * window
            gap = CHUNK * DGRAM / min(cc.rate, push)
            close = t + window + 0.0005
            sends, k = [], 0
            while k * CHUNK * DGRAM < planned and t + k * gap < close + 0.003:
                sends.append((t + k * gap, CHUNK, CHUNK * DGRAM))
                k += 1
            arrived = [s for s in sends if s[0] + PROP <= close]
            timing = Timing(CHUNK * len(arrived), arrived[0][0] + PROP + OFFSET, arrived[-1][0] + PROP + OFFSET,
                            0.0005, CHUNK * DGRAM * len(arrived), close + OFFSET)
            fb = round_feedback(sends, timing, cc.base.value, int(planned) if cap_on else 0)
            late += planned - fb.sent_bytes
            planned_total += planned
            cc.on_feedback(fb, close + 0.003)
            t += 0.05
        return cc.rate, late / planned_total

    rate_off, late_off = play(LedbatRate(12.5e6, min_rate=1e6), cap_on=False)
    rate_on, late_on = play(LedbatRate(12.5e6, min_rate=1e6), cap_on=True)
    assert rate_off > 50e6 and late_off > 0.5  # what the fix of the false loss alone does with a slow sender
    assert 6e6 <= rate_on <= 12e6 and late_on < 0.3
