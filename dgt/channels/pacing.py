"""Pacing of the unreliable lanes: a token bucket at a configured rate, and an adaptive controller that moves that
rate with the loss the drop reports show (UDP has no congestion control of its own)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def set_rate(self, rate: float) -> None:
        self.rate = float(rate)


@dataclass
class AdaptiveRate:
    """Multiplicative decrease on loss, multiplicative probe upward otherwise, within [min_rate, max_rate].

    ``observe(sent, lost)`` takes the unimportant blocks a drop report covered that were sent before the report
    (blocks abandoned because the round closed are not loss) and how many of them the receiver missed.
    """

    rate: float
    min_rate: float = 1e6
    max_rate: float = 10e9
    loss_threshold: float = 0.01
    backoff: float = 0.5  # the rate never falls below this factor in one step
    probe: float = 0.1  # upward step per clean report
    decreases: int = 0
    increases: int = 0

    def observe(self, sent: int, lost: int) -> float:
        if sent <= 0:
            return self.rate
        loss = lost / sent
        if loss > self.loss_threshold:
            self.rate = max(self.min_rate, self.rate * max(self.backoff, 1.0 - loss))
            self.decreases += 1
        else:
            self.rate = min(self.max_rate, self.rate * (1.0 + self.probe))
            self.increases += 1
        return self.rate


class Pacer:
    """Per-peer pacing state: a token bucket, optionally steered by an :class:`AdaptiveRate`."""

    def __init__(self, rate: float, burst: int, adaptive: AdaptiveRate | None = None, now: float = 0.0) -> None:
        self.bucket = TokenBucket(rate, burst, now)
        self.adaptive = adaptive

    @property
    def rate(self) -> float:
        return self.bucket.rate

    def ready_at(self, now: float) -> float:
        return self.bucket.ready_at(now)

    def consume(self, nbytes: int, now: float) -> None:
        self.bucket.consume(nbytes, now)

    def on_report(self, sent: int, lost: int) -> None:
        if self.adaptive is not None:
            self.bucket.set_rate(self.adaptive.observe(sent, lost))
