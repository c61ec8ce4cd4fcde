"""Less-than-best-effort congestion control of the unreliable lanes (LEDBAT-like, RFC 6817), sans-IO.

UDP has no congestion control of its own, and the unimportant blocks are worth only the spare capacity of the path:
a lane that pushes them into a full queue delays our own reliable lane (on a FIFO bottleneck) and other people's
traffic (RFC 8085), and the queue throws most of them away anyway. The controller here is fed, once per drop report,
a :class:`Feedback` built from the sender's send times and the receiver's report (arrival times of the round's first
and last unimportant datagrams, datagrams and bytes delivered; ``docs/protocol.md``, DROP_REPORT timing trailer).

One-way delay samples are ``receiver clock at arrival - sender clock at send``. The two clocks are not synchronised;
as in LEDBAT the offset cancels against the *base delay*, the minimum sample over a bounded history of intervals, so
``queuing delay = sample - base``. Each report gives one queuing-delay reading, from the round's *last* datagram
(the queue our own burst built); a round that lost more than ``loss_threshold`` gives none (the loss rule acts).
The base takes the last datagram's sample only from rounds where every datagram arrived
(:meth:`Feedback.delay_samples`). Like RFC 6817's current-delay filter, the controller acts on the minimum of the
last ``current_filter`` readings (:class:`CurrentDelay`): a queue that the lane builds persists from report to
report, while a stamp taken late because the sending or receiving process was not scheduled (a loaded CPU; on
loopback that is all the "delay" there is) shows up in single readings and is filtered out. The rate then moves:

* loss above ``loss_threshold`` (datagrams sent in time that never arrived, or arrived after the round closed):
  multiplicative back-off by ``beta``, and never above the round's goodput (``delivered bytes / (end - first
  send)``, sender clock, ``end`` the last moment a datagram could leave and still arrive before the close, or the
  report time: what the lane got through before the round closed). "Sent in time" (:func:`round_feedback`): a
  datagram handed to the kernel after ``close - base delay`` (the receiver's close time from the report, mapped to
  the sender's clock through the base delay, which holds the clock offset and the path's propagation) could not have
  arrived before the round closed even through an empty queue; it left too late to count, it was not lost on the
  way, and is not counted as sent (counting it made a loopback lane halve its rate every round: the sender keeps
  sending a round's tail until the report comes back, after the receiver has closed the round);
* otherwise towards the delay target: ``rate *= 1 + gain * (target - qdelay) / target``, the step bounded below by
  ``beta``; below the target it probes up, above it backs off in proportion to how far above it is;
* the time the receiver held the round open for unimportant blocks after the important ones were in counts as
  queuing delay too (the lane is that far behind, wherever the queue is: a link, a socket, a busy CPU), scaled so
  that a hold of ``hold_target`` (2 ms) reads as ``target``: a network queue delays other traffic, a hold delays
  our own step by all of it. It goes through the same filter (the reading of a report is the larger of its queuing
  delay and its scaled hold). With the hold read at the delay's 10 ms target, a 4-rank lossy ring on loopback was
  held ~10 ms per hop once the close time stopped the false loss back-offs: 141.5 ms per all-reduce against 125
  before; with 2 ms, 120-122 ms (``docs/history/transport-journal.md``);
* the important blocks' *slowdown* counts as queuing delay too: how much longer than their fastest recent time
  (per bucket, :class:`dgt.protocol.budget.RoundWindow`, less its 2 ms of slack; the endpoint reads none from a
  round with under 64 KiB of datagrams) they took to arrive, relative, scaled so that
  ``slowdown_target`` (20 %) reads as ``target``. The send budget lets unimportant blocks ride along in the time the
  important ones take; where they are not free (a FIFO bottleneck ignoring DSCP, a CPU-bound host) they lengthen
  that time, which raised the budget, which sent more: on a 4-rank lossy ring over loopback (2 cores) every
  unimportant block was soon sent and a call took 125-160 ms with 55-66 ms of CPU per rank, against 83-102 ms and
  36-44 ms with the rounds closed before the important blocks were in (``docs/history/transport-journal.md``);
* a rate the sender itself cannot reach is capped: when some of a round's datagrams did not leave by the last
  useful moment (sent after ``close - base``, or abandoned), the rate is at most what did leave in time over the
  time it took (:meth:`Feedback.send_rate`; a loaded CPU, not the path), so the budget does not promise blocks that
  can only miss their round;
* until the first decrease (*slow start*) a report with no loss and a queuing delay under half the target doubles
  the rate, so a fast idle path is found in a few rounds instead of dozens.

The endpoint applies the rate with a token bucket (:class:`dgt.protocol.pacing.Pacer`) and derives the send budget
of a round from it (:mod:`dgt.protocol.budget`). Nothing here reads a clock: every time is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dgt.protocol.report import Timing


@dataclass(frozen=True)
class Feedback:
    """What one drop report tells the controller about one round to one peer.

    sent_*: the round's datagrams the sender handed to the kernel in time to arrive before the round closed (or,
    without a close time, before the report; abandoned ones excluded); first_sent/last_sent: sender clock when the
    first and last of them left; recv_first/recv_last: receiver clock when its first and last unimportant datagram
    arrived (None: none arrived); delivered_*: what arrived; end: sender clock after which a send could not arrive
    before the close (None: unknown, the report time counts).
    """

    sent_datagrams: int
    sent_bytes: int
    delivered_datagrams: int
    delivered_bytes: int
    first_sent: float | None = None
    last_sent: float | None = None
    recv_first: float | None = None
    recv_last: float | None = None
    hold: float = 0.0  # seconds the receiver kept the round open for unimportant blocks after the important ones
    end: float | None = None
    late_bytes: int = 0  # bytes the round put on the lane that did not leave by ``end`` (sent later, or never)
    slowdown: float = 0.0  # how much longer the important blocks took than their fastest recent time (RoundWindow)

    @property
    def loss(self) -> float:
        if self.sent_datagrams <= 0:
            return 0.0
        return max(0.0, 1.0 - self.delivered_datagrams / self.sent_datagrams)

    def first_delay(self) -> float | None:
        """One-way delay (with the unknown clock offset) of the first arrival counted from the first send: never
        below that datagram's own delay (it left at or after ``first_sent``)."""
        if self.recv_first is None or self.first_sent is None:
            return None
        return self.recv_first - self.first_sent

    def last_delay(self) -> float | None:
        """``recv_last - last_sent``: the delay of the round's last datagram if it arrived. If it was lost or late,
        the last arrival belongs to an earlier datagram and this can be far *below* any real delay (-13.5 ms in a
        loopback run where both ends read one clock)."""
        if self.recv_last is None or self.last_sent is None:
            return None
        return self.recv_last - self.last_sent

    def delay_samples(self) -> tuple[float, ...]:
        """The samples the base delay may take: the first arrival's, and the last one's only when every datagram
        sent arrived. A round whose tail was lost would otherwise drag the base down for the whole base history
        and make every later reading look like a queue, pinning the rate at its floor."""
        first, last = self.first_delay(), self.last_delay()
        complete = self.delivered_datagrams >= self.sent_datagrams
        return tuple(d for d in (first, last if complete else None) if d is not None)

    def send_rate(self) -> float | None:
        """Bytes/s the sender got out in time when it could not get out all it meant to (``late_bytes``): it was
        still sending at ``end``, so ``sent_bytes / (end - first_sent)`` is what it could push (a loaded CPU, not
        the path); None when everything left in time (the rate then says nothing about the sender)."""
        if self.late_bytes <= 0 or self.end is None or self.first_sent is None or self.end <= self.first_sent:
            return None
        return self.sent_bytes / (self.end - self.first_sent)

    def goodput(self, now: float) -> float | None:
        """Bytes/s delivered from the first send to ``end``, or to the report (``now``, sender clock) if that is
        sooner or ``end`` is unknown; None: nothing was sent in that time."""
        end = now if self.end is None else min(now, self.end)
        if self.first_sent is None or end <= self.first_sent:
            return None
        return self.delivered_bytes / (end - self.first_sent)


def round_feedback(sends: Sequence[tuple[float, int, int]], t: Timing, base: float | None,
                   planned_bytes: int = 0, slowdown: float | None = None) -> Feedback:
    """The feedback of one round from the sender's send calls (``(sender clock, datagrams, bytes)`` each, every job
    of the round to that peer), the report's timing ``t`` and the controller's base delay (``LedbatRate.base.value``).
    With the receiver's close time and a base delay, only the calls made at or before ``t.close - base`` count as
    sent: the base delay is the smallest ``arrival - send`` seen, so a datagram that left later reached the receiver
    after it had closed the round, through an empty queue or not. The round's own first sample (first arrival -
    first send, never below a real delay) stands in for the base when it is smaller or there is none yet. Without
    a close time (a version 1 trailer) or any sample, every call counts (the rule before the close time).
    ``planned_bytes``: what the round put on the lane (its send budget's datagrams); what of it did not leave in time
    is ``late_bytes`` (0 without a close time). ``slowdown``: the round window's
    (:class:`dgt.protocol.budget.RoundWindow`; None: not known yet)."""
    a = np.asarray(sends, dtype=np.float64).reshape(-1, 3)
    if t.first is not None and len(a):  # this round's first sample (the base takes it too): no older one needed
        sample = t.first - float(a[:, 0].min())
        base = sample if base is None else min(base, sample)
    end = None if t.close is None or base is None else t.close - base
    if end is not None:
        a = a[a[:, 0] <= end]
    first = float(a[:, 0].min()) if len(a) else None
    last = float(a[:, 0].max()) if len(a) else None
    sent = int(a[:, 2].sum())
    late = 0 if end is None else max(planned_bytes - sent, 0)
    return Feedback(int(a[:, 1].sum()), sent, t.datagrams, t.nbytes, first, last, t.first, t.last, t.wait, end,
                    late, slowdown or 0.0)  # fmt: skip


@dataclass
class BaseDelay:
    """Minimum one-way delay over the last ``history`` intervals of ``interval`` seconds each (RFC 6817's
    BASE_HISTORY): old minima age out, so a route change or clock drift is forgotten after a bounded time."""

    interval: float = 60.0
    history: int = 10
    _mins: deque[tuple[int, float]] = field(default_factory=deque)  # (interval index, minimum)
    samples: int = 0  # samples taken so far

    def update(self, sample: float, now: float) -> None:
        self.samples += 1
        idx = int(now // self.interval)
        if self._mins and self._mins[-1][0] == idx:
            if sample < self._mins[-1][1]:
                self._mins[-1] = (idx, sample)
        else:
            self._mins.append((idx, sample))
        while self._mins and self._mins[0][0] <= idx - self.history:
            self._mins.popleft()

    @property
    def value(self) -> float | None:
        return min(m for _, m in self._mins) if self._mins else None


@dataclass
class CurrentDelay:
    """The minimum of the last ``readings`` queuing-delay readings (RFC 6817's current-delay filter, one reading per
    drop report): a delay must persist for that many reports before the controller backs off for it."""

    readings: int = 4
    _recent: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        if self.readings < 1:
            raise ValueError("the current-delay filter needs at least one reading")
        self._recent = deque(maxlen=self.readings)

    def update(self, reading: float) -> float:
        """Take one reading; returns the filtered delay."""
        self._recent.append(reading)  # the oldest falls out (maxlen)
        return min(self._recent)


@dataclass
class LedbatRate:
    """The lane's send rate in bytes/s, moved by :meth:`on_feedback` within ``[min_rate, max_rate]``."""

    rate: float
    min_rate: float = 1e6
    max_rate: float = 10e9
    target: float = 0.010  # seconds of queuing delay the lane may cause (RFC 6817 allows up to 0.1)
    gain: float = 0.25  # relative rate step per report at zero queuing delay
    beta: float = 0.5  # multiplicative back-off on loss; also the largest single downward step
    loss_threshold: float = 0.02
    current_filter: int = 4  # reports whose minimum delay reading the controller acts on (1: no filter)
    hold_target: float = 0.002  # the receiver's hold (seconds) that counts as ``target`` of queuing delay
    slowdown_target: float = 0.2  # the important blocks' slowdown (relative) that counts as ``target``
    base: BaseDelay = field(default_factory=BaseDelay)
    qdelay: float | None = None  # last (unfiltered) queuing delay of the round's last datagram
    behind: float | None = None  # the filtered reading the controller last acted on (queuing delay or hold)
    slow_start: bool = True  # doubling per clean report until the first decrease
    decreases: int = 0
    increases: int = 0
    loss_backoffs: int = 0
    sender_caps: int = 0  # reports whose rate was capped at what the sender got out in time

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.max_rate:
            raise ValueError("need 0 < min_rate <= max_rate")
        if self.target <= 0 or self.hold_target <= 0 or self.slowdown_target <= 0 or not 0 < self.beta < 1 \
                or self.gain <= 0:
            raise ValueError("need target > 0, hold_target > 0, slowdown_target > 0, 0 < beta < 1, gain > 0")
        self.rate = self._clamp(self.rate)
        self._current = CurrentDelay(self.current_filter)

    def _clamp(self, rate: float) -> float:
        return min(self.max_rate, max(self.min_rate, float(rate)))

    def on_feedback(self, fb: Feedback, now: float) -> float:
        """Take one report's feedback (``now``: the sender's clock); returns the new rate, never above what the
        sender itself got out in time when it could not send all the round's datagrams (:meth:`Feedback.send_rate`:
        a rate the sender cannot reach only makes the send budget promise datagrams that miss their round)."""
        self.rate = self._on_feedback(fb, now)
        cap = fb.send_rate()
        if cap is not None and cap < self.rate:
            self.rate = self._clamp(cap)
            self.sender_caps += 1
            self.slow_start = False  # doubling again would only promise twice what the sender can do
        return self.rate

    def _on_feedback(self, fb: Feedback, now: float) -> float:
        samples = fb.delay_samples()
        for s in samples:
            self.base.update(s, now)
        if fb.sent_datagrams <= 0:
            return self.rate  # nothing was sent: nothing learnt about the path
        behind = None
        if fb.loss <= self.loss_threshold:  # a lossier round backs off for the loss and gives no delay reading:
            # its tail probably did not arrive, and its first datagram's delay would hide the queue from the filter
            sample = fb.last_delay()
            sample = fb.first_delay() if sample is None else sample
            if sample is not None and self.base.value is not None:
                self.qdelay = max(0.0, sample - self.base.value)
                hold = fb.hold * self.target / self.hold_target  # a held round costs its whole step time
                slow = fb.slowdown * self.target / self.slowdown_target  # so do important blocks slowed down
                behind = self.behind = self._current.update(max(self.qdelay, hold, slow))
        if fb.loss > self.loss_threshold:
            new = self.rate * self.beta
            gp = fb.goodput(now)
            if gp is not None:
                new = min(new, gp)
            self.rate = self._clamp(new)
            self.slow_start = False
            self.loss_backoffs += 1
            self.decreases += 1
            return self.rate
        if behind is None:  # no delay samples
            return self.rate
        off = (self.target - behind) / self.target  # 1 at an empty queue, negative above the target
        step = max(self.beta, 1.0 + self.gain * off)
        if self.slow_start and off > 0.5:
            step = 2.0
        if step > 1.0:
            self.increases += 1
        elif step < 1.0:
            self.decreases += 1
            self.slow_start = False
        self.rate = self._clamp(self.rate * step)
        return self.rate
