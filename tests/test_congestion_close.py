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


def play_round(rate: float, t0: float, *, window: float = 0.02, lag: float = 0.004, hold: float = 0.002,
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
