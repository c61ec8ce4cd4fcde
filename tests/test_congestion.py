"""The less-than-best-effort controller (dgt.protocol.congestion) against a fake clock and a fluid model of one
FIFO bottleneck: converges to the spare rate, backs off when delay rises or datagrams are lost, recovers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dgt.protocol.congestion import BaseDelay, CurrentDelay, Feedback, LedbatRate

OFFSET = 1234.5  # receiver clock - sender clock: unknown to the controller, cancelled by the base delay
PROP = 0.004  # one-way propagation delay
DGRAM = 1448


class Link:
    """A FIFO bottleneck of ``capacity`` bytes/s with a ``buffer`` of bytes, shared with ``cross`` bytes/s of other
    traffic. ``send`` plays one round: our lane sends at ``rate`` for ``span`` seconds (fluid, in small steps), then
    the queue drains before the next round. Returns the feedback a drop report would carry."""

    def __init__(self, capacity: float, cross: float, buffer: float = 256e3, dt: float = 1e-3) -> None:
        self.capacity, self.cross, self.buffer, self.dt = capacity, cross, buffer, dt
        self.queue = 0.0

    def send(self, rate: float, t0: float, span: float = 0.1) -> Feedback:
        sent = delivered = 0.0
        recv_first = recv_last = None
        steps = int(round(span / self.dt))
        for i in range(steps):
            t = t0 + i * self.dt
            ours, theirs = rate * self.dt, self.cross * self.dt
            room = self.buffer - self.queue + self.capacity * self.dt
            taken = min(1.0, max(room, 0.0) / (ours + theirs)) if ours + theirs > 0 else 1.0
            sent += ours
            delivered += ours * taken
            self.queue = max(0.0, self.queue + (ours + theirs) * taken - self.capacity * self.dt)
            arrival = t + PROP + self.queue / self.capacity + OFFSET
            if ours * taken > 0:
                recv_first = arrival if recv_first is None else recv_first
                recv_last = arrival
        self.queue = 0.0  # the gap between rounds drains it
        n_sent, n_got = int(sent // DGRAM), int(delivered // DGRAM)
        return Feedback(n_sent, int(sent), n_got, int(delivered), first_sent=t0, last_sent=t0 + span - self.dt,
                        recv_first=recv_first, recv_last=recv_last)


def run(cc: LedbatRate, link: Link, rounds: int, t0: float = 0.0) -> tuple[list[float], float]:
    rates, t = [], t0
    for _ in range(rounds):
        fb = link.send(cc.rate, t)
        t += 0.2
        rates.append(cc.on_feedback(fb, t))
    return rates, t


@pytest.mark.parametrize("start", [1e6, 200e6])
def test_converges_to_the_spare_rate_of_the_link(start):
    link = Link(capacity=5e6, cross=3e6)  # 40 Mbit/s, 24 of them taken: 2 MB/s spare
    cc = LedbatRate(start, min_rate=0.1e6)
    rates, _ = run(cc, link, 120)
    tail = rates[-40:]
    mean = sum(tail) / len(tail)
    # the fixed point: the queue at the end of a 0.1 s send span equals the 10 ms target,
    # i.e. spare + target * capacity / span = 2.5 MB/s; within 30 % of the spare rate either way
    assert mean == pytest.approx(2e6 + cc.target * 5e6 / 0.1, rel=0.1), mean
    assert 0.7 * 2e6 <= min(tail) and max(tail) <= 1.3 * 2e6, (min(tail), max(tail))
    assert cc.qdelay is not None and cc.qdelay <= 3 * cc.target  # the queue it leaves is near the small target
    assert abs(cc.base.value - (PROP + OFFSET)) < 2e-3  # the clock offset is absorbed by the base delay


def test_backs_off_when_delay_rises_and_recovers_when_it_falls():
    link = Link(capacity=5e6, cross=0.0)
    cc = LedbatRate(1e6, min_rate=0.1e6)
    rates, t = run(cc, link, 80)
    free = sum(rates[-20:]) / 20
    assert free >= 0.75 * 5e6
    link.cross = 4.5e6  # someone else's flow arrives: the queue (and delay) rises, the lane must yield
    rates, t = run(cc, link, 80, t)
    yielded = sum(rates[-20:]) / 20
    # spare 0.5 MB/s plus the 10 ms target's worth over a 0.1 s span (0.5 MB/s): it gives up >= 3/4 of its rate
    assert yielded == pytest.approx(0.5e6 + cc.target * 5e6 / 0.1, rel=0.2) and yielded <= 0.25 * free
    assert cc.decreases > 0
    link.cross = 0.0  # the other flow is gone: recover
    rates, t = run(cc, link, 80, t)
    assert sum(rates[-20:]) / 20 >= 0.75 * 5e6


def test_slow_start_doubles_until_the_first_decrease():
    cc = LedbatRate(1e6, target=0.01, current_filter=1)  # each report's reading acted on at once
    for i in range(3):
        cc.on_feedback(Feedback(100, 144800, 100, 144800, i, i + 0.01, 5.0 + i, 5.01 + i), i + 0.1)
    assert cc.rate == pytest.approx(8e6) and cc.slow_start
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 3.0, 3.01, 8.0, 8.03), 3.1)  # 20 ms queue: back off
    assert not cc.slow_start and cc.rate == pytest.approx(6e6)
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 4.0, 4.01, 9.0, 9.01), 4.1)  # clean again: LEDBAT steps
    assert cc.rate == pytest.approx(7.5e6)


def test_delay_above_target_backs_off_in_proportion_and_below_probes_up():
    cc = LedbatRate(10e6, target=0.01, gain=0.25, slow_start=False, current_filter=1)
    base = Feedback(100, 144800, 100, 144800, 0.0, 0.01, 5.0, 5.01)
    cc.on_feedback(base, 0.1)  # qdelay 0: probes up by gain
    assert cc.rate == pytest.approx(12.5e6)
    q = Feedback(100, 144800, 100, 144800, 1.0, 1.01, 6.0, 6.03)  # last sample 20 ms above base: 2x target
    cc.on_feedback(q, 1.1)
    assert cc.qdelay == pytest.approx(0.02)
    assert cc.rate == pytest.approx(12.5e6 * 0.75)
    huge = Feedback(100, 144800, 100, 144800, 2.0, 2.01, 7.0, 8.01)  # 1 s of queue: step floored at beta
    cc.on_feedback(huge, 2.1)
    assert cc.rate == pytest.approx(12.5e6 * 0.75 * 0.5)


def test_a_round_held_open_by_the_lane_counts_as_delay():
    cc = LedbatRate(10e6, target=0.01, slow_start=False, current_filter=1)
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 0.0, 0.01, 5.0, 5.01, hold=0.0), 0.1)
    assert cc.rate == pytest.approx(12.5e6)
    # no queue in the samples, but the receiver waited 4 ms for our datagrams after the important blocks: twice
    # hold_target (2 ms), so it reads as twice the 10 ms delay target
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 1.0, 1.01, 6.0, 6.01, hold=0.004), 1.1)
    assert cc.qdelay == pytest.approx(0.0) and cc.behind == pytest.approx(0.02)
    assert cc.rate == pytest.approx(12.5e6 * 0.75)
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 2.0, 2.01, 7.0, 7.01, hold=0.001), 2.1)  # 1 ms: probes up
    assert cc.behind == pytest.approx(0.005) and cc.rate == pytest.approx(12.5e6 * 0.75 * 1.125)
    old = LedbatRate(10e6, target=0.01, slow_start=False, current_filter=1, hold_target=0.01)  # hold read as delay
    old.on_feedback(Feedback(100, 144800, 100, 144800, 1.0, 1.01, 6.0, 6.01, hold=0.004), 1.1)
    assert old.rate == pytest.approx(10e6 * 1.15)
    ss = LedbatRate(10e6, target=0.01, current_filter=1)
    ss.on_feedback(Feedback(100, 144800, 100, 144800, 0.0, 0.01, 5.0, 5.01, hold=0.03), 0.1)
    assert not ss.slow_start and ss.rate == pytest.approx(5e6)


def test_loss_backs_off_to_what_arrived():
    cc = LedbatRate(100e6, min_rate=10e3)
    fb = Feedback(1000, 1448000, 30, 43440, 0.0, 0.1, 3.0, 3.1)  # 97 % lost (or late); 43 kB in 0.2 s arrived
    cc.on_feedback(fb, 0.2)
    assert cc.loss_backoffs == 1
    assert cc.rate == pytest.approx(43440 / 0.2)  # the round's goodput, not half of 100 MB/s
    cc.on_feedback(Feedback(10, 14480, 0, 0, 1.0, 1.01), 1.2)  # nothing arrived: down to the floor
    assert cc.rate == cc.min_rate
    mild = LedbatRate(10e6)
    mild.on_feedback(Feedback(100, 144800, 90, 130320, 0.0, 0.01, 3.0, 3.01), 0.02)  # 10 % lost, goodput 6.5 MB/s
    assert mild.rate == pytest.approx(5e6)  # beta wins


def test_nothing_sent_changes_nothing_and_bounds_hold():
    cc = LedbatRate(5e6, min_rate=1e6, max_rate=6e6)
    assert cc.on_feedback(Feedback(0, 0, 0, 0), 1.0) == 5e6
    for i in range(20):
        cc.on_feedback(Feedback(10, 14480, 10, 14480, i, i + 0.01, 9.0 + i, 9.01 + i), i + 0.5)
    assert cc.rate == 6e6
    with pytest.raises(ValueError):
        LedbatRate(1e6, min_rate=0)
    with pytest.raises(ValueError):
        LedbatRate(1e6, beta=1.5)


def test_base_delay_forgets_old_minima():
    b = BaseDelay(interval=1.0, history=3)
    b.update(0.5, 0.0)
    b.update(0.9, 1.5)
    assert b.value == 0.5
    b.update(0.8, 3.2)  # interval 3: interval 0 is now older than 3 intervals
    assert b.value == 0.8


class BusyHost(Link):
    """The same link, but the receiving rank is not always scheduled when a datagram arrives (a loaded CPU): with
    probability ``p`` a report's arrival stamps are late by 5-60 ms though no queue grew (seeded, deterministic)."""

    def __init__(self, *args, p: float = 0.3, seed: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self.p, self.rng = p, random.Random(seed)

    def send(self, rate: float, t0: float, span: float = 0.1) -> Feedback:
        fb = super().send(rate, t0, span)
        if fb.recv_last is None or self.rng.random() >= self.p:
            return fb
        late = self.rng.uniform(0.005, 0.060)
        return replace(fb, recv_first=fb.recv_first + late, recv_last=fb.recv_last + late)


def test_scheduling_delay_in_single_reports_does_not_cut_the_rate():
    """A late stamp in ~30 % of reports is not queuing: the filtered controller keeps the idle link's rate, the one
    acting on every reading (current_filter=1, the controller before the filter) is dragged far below it."""
    filtered = LedbatRate(1e6, min_rate=10e3)
    rates, _ = run(filtered, BusyHost(capacity=5e6, cross=0.0), 150)
    assert sum(rates[-50:]) / 50 >= 0.75 * 5e6, sum(rates[-50:]) / 50
    raw = LedbatRate(1e6, min_rate=10e3, current_filter=1)
    rates_raw, _ = run(raw, BusyHost(capacity=5e6, cross=0.0), 150)
    assert sum(rates_raw[-50:]) / 50 <= 0.5 * 5e6, sum(rates_raw[-50:]) / 50
    assert filtered.decreases < raw.decreases


def test_a_persistent_queue_still_backs_off_after_the_filter_length():
    cc = LedbatRate(10e6, target=0.01, slow_start=False)  # current_filter=4
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 0.0, 0.01, 5.0, 5.01), 0.1)  # the base: no queue
    top = cc.rate
    for i in range(1, 4):  # 30 ms of queue behind every datagram: the clean reading is still in the window
        cc.on_feedback(Feedback(100, 144800, 100, 144800, i, i + 0.01, 5.0 + i, 5.04 + i), i + 0.1)
        assert cc.qdelay == pytest.approx(0.03) and cc.behind == pytest.approx(0.0) and cc.rate > top
        top = cc.rate
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 4.0, 4.01, 9.0, 9.04), 4.1)  # 4 readings in a row: back off
    assert cc.behind == pytest.approx(0.03) and cc.rate == pytest.approx(top * 0.5)
    cc.on_feedback(Feedback(100, 144800, 100, 144800, 5.0, 5.01, 10.0, 10.01), 5.1)  # the queue is gone: probe
    assert cc.behind == pytest.approx(0.0) and cc.rate == pytest.approx(top * 0.5 * 1.25)


def test_current_delay_is_the_minimum_of_the_last_readings():
    f = CurrentDelay(3)
    assert [f.update(x) for x in (0.05, 0.01, 0.03, 0.04, 0.06, 0.02)] == [0.05, 0.01, 0.01, 0.01, 0.03, 0.02]
    with pytest.raises(ValueError):
        CurrentDelay(0)


def test_a_round_whose_tail_was_lost_does_not_corrupt_the_base_delay():
    """Start-up into a full queue: 70 % lost, tail included, so the last datagram to arrive was sent 80 ms before
    the last send. Its raw 'delay' is 76 ms below the path's; taken as a sample it would be the base for minutes and
    every later reading a phantom 80 ms queue. Only the first arrival counts for such a round: the controller backs
    off for the loss and then finds the idle link again."""
    cc = LedbatRate(5e6, min_rate=10e3)
    lossy = Feedback(1000, 1448000, 300, 434400, first_sent=0.0, last_sent=0.1,
                     recv_first=OFFSET + PROP + 0.05, recv_last=OFFSET + PROP + 0.02)
    assert lossy.delay_samples() == (pytest.approx(PROP + OFFSET + 0.05),)
    cc.on_feedback(lossy, 0.2)
    assert cc.loss_backoffs == 1
    rates, _ = run(cc, Link(capacity=5e6, cross=0.0), 60, t0=1.0)
    assert abs(cc.base.value - (PROP + OFFSET)) < 2e-3
    assert sum(rates[-20:]) / 20 >= 0.75 * 5e6, sum(rates[-20:]) / 20
    complete = Feedback(10, 14480, 10, 14480, 0.0, 0.01, OFFSET + 0.004, OFFSET + 0.015)
    assert complete.delay_samples() == (pytest.approx(OFFSET + 0.004), pytest.approx(OFFSET + 0.005))
