"""Pacing of the unreliable lanes: a token bucket at a rate that is either fixed or set by the sans-IO congestion
controller (dgt.protocol.congestion.LedbatRate) from the drop reports (UDP has no congestion control of its own).
Sans-IO: time is passed in; the datagram scheduler (:mod:`dgt.channels.udp_scheduler`) feeds trio's clock."""

from __future__ import annotations

from dgt.protocol.congestion import Feedback, LedbatRate
from dgt.protocol.owner import owned


class TokenBucket:
    """``rate`` bytes/s with a burst of ``burst`` bytes. Time is passed in (the channel feeds trio's clock)."""

    def __init__(self, rate: float, burst: int, now: float = 0.0) -> None:
        if rate <= 0:
            raise ValueError("pacing rate must be positive")
        self.rate = float(rate)
        self.burst = max(int(burst), 1)
        self.tokens = float(self.burst)
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def ready_at(self, now: float) -> float:
        """Earliest time a send may start (sends may overdraw; the debt delays the next one)."""
        self._refill(now)
        return now if self.tokens >= 0 else now + (-self.tokens) / self.rate

    def consume(self, nbytes: int, now: float) -> None:
        self._refill(now)
        self.tokens -= nbytes

    def available(self, now: float) -> float:
        """Bytes that may leave now without waiting (negative: a debt)."""
        self._refill(now)
        return self.tokens

    def debt(self, now: float) -> float:
        """Bytes sent ahead of the rate that are not paid for yet (0 when the bucket has tokens)."""
        self._refill(now)
        return max(0.0, -self.tokens)

    def set_rate(self, rate: float) -> None:
        """A new rate; a debt keeps the time it takes to pay off (the next send is due when it was), so a cut from
        MB/s to the 10 kB/s floor does not turn a burst sent at the old rate into a stall of many seconds."""
        rate = float(rate)
        if rate <= 0:
            raise ValueError("pacing rate must be positive")
        if self.tokens < 0:
            self.tokens *= rate / self.rate
        self.rate = rate


@owned
class Pacer:
    """Per-peer pacing state: a token bucket, optionally steered by a congestion controller (``cc``).

    ``shared``: a second bucket, at a fixed rate, that the peer's reliable lane draws from too
    (:meth:`charge_reliable`): the unreliable lanes then send only what that one budget has left after the TCP
    bytes, so both protocols together stay within its rate (the loopback emulation of one link that TCP and UDP
    share; TransportConfig.pacing.shared). Every method answers for both buckets: the later ready time, the larger
    debt, the fewer tokens."""

    def __init__(self, rate: float, burst: int, cc: LedbatRate | None = None, now: float = 0.0,
                 shared: TokenBucket | None = None) -> None:
        self.cc = cc
        self.bucket = TokenBucket(rate if cc is None else cc.rate, burst, now)
        self.shared = shared

    @property
    def rate(self) -> float:
        return self.bucket.rate if self.shared is None else min(self.bucket.rate, self.shared.rate)

    def ready_at(self, now: float) -> float:
        t = self.bucket.ready_at(now)
        return t if self.shared is None else max(t, self.shared.ready_at(now))

    def consume(self, nbytes: int, now: float) -> None:
        self.bucket.consume(nbytes, now)
        if self.shared is not None:
            self.shared.consume(nbytes, now)

    def charge_reliable(self, nbytes: int, now: float) -> None:
        """``nbytes`` handed to the peer's reliable lane: they come off the shared budget (nothing without one)."""
        if self.shared is not None and nbytes:
            self.shared.consume(nbytes, now)

    def debt(self, now: float) -> float:
        d = self.bucket.debt(now)
        return d if self.shared is None else max(d, self.shared.debt(now))

    def tokens(self, now: float) -> float:
        """Bytes that may leave now without waiting (negative: a debt)."""
        t = self.bucket.available(now)
        return t if self.shared is None else min(t, self.shared.available(now))

    def on_feedback(self, fb: Feedback, now: float) -> None:
        """One drop report's feedback (``now``: the sender's clock): the controller moves the rate, if there is one."""
        if self.cc is not None:
            self.bucket.set_rate(self.cc.on_feedback(fb, now))
