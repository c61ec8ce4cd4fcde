"""When a round stops waiting for unimportant blocks: policies evaluated against an injected clock."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from dgt.protocol.owner import owned, release


@dataclass
class DeadlineState:
    """What a policy may look at: when all important blocks were in, the unimportant arrivals so far."""

    important_done_at: float
    last_arrival: float | None
    mean_gap: float | None  # EWMA of inter-arrival times of unimportant frames
    remaining_frames: int | None  # unimportant frames announced but not yet in (None = unknown)
    batch_gap: float | None = None  # EWMA of the time between arrival batches (a GRO read, a drained socket)
    dense_wait: float | None = None  # what the missing unimportant bytes would take at the important blocks' rate


@owned
class DeadlinePolicy:
    """One receiver's policy: it belongs to the receiver's thread (its learning, :meth:`observe`, happens there); a
    worker thread that decides deadlines of its own evaluates a :meth:`frozen` copy (docs/architecture.md, Threads)."""

    def deadline(self, st: DeadlineState) -> float:
        raise NotImplementedError

    def longest_wait(self) -> float:
        """The most seconds this policy waits after the important blocks were in, whatever arrives (inf: unknown).
        A lossy ring hop's sender reads its own policy's as the longest its peer may still take datagrams."""
        return float("inf")

    def observe(self, wait: float, complete: bool) -> None:  # noqa: B027 - optional hook
        """A round closed ``wait`` seconds after its important blocks were in: ``complete`` when every announced
        unimportant block had arrived by then (``wait`` is what it needed), else at its deadline (it needed more)."""

    def frozen(self) -> DeadlinePolicy:
        """A copy of the policy as it stands, for another thread to evaluate (a lossy ring hop's datagram reads): it
        learns nothing this policy observes later, and belongs to the thread that first uses it."""
        twin = copy.copy(self)
        release(twin)
        return twin


@owned
@dataclass
class FixedGrace(DeadlinePolicy):
    """Wait a fixed time after the last important block."""

    grace: float = 0.005

    def deadline(self, st: DeadlineState) -> float:
        return st.important_done_at + self.grace

    def longest_wait(self) -> float:
        return self.grace


@owned
@dataclass
class AdaptiveGrace(DeadlinePolicy):
    """Wait while unimportant frames keep coming: until the stream has been quiet for ``k`` mean gaps, or long enough
    for the announced remaining frames at the observed rate, never less than ``floor`` and never more than ``cap``
    after the important blocks were complete (the hard bound).

    Across rounds (``learn`` = 1) the hard bound also learns, as OptiReduce's adaptive timeout does: an EWMA of the
    waits that rounds needed plus ``spread`` times their mean deviation (TCP's RTO estimator), once ``warm`` rounds
    were seen. A round that reached its deadline counts as needing its wait times ``grow``, so the bound climbs back
    when the unimportant traffic slows down; it never leaves [floor, cap].

    And a round never waits (beyond ``floor``) more than ``dense`` times what its missing unimportant bytes would
    take at the rate its important blocks came in (``dense_wait``), nor less than ``dense_floor``: a few late
    droppable blocks must not hold a round longer than sending them densely would have (``dense`` = 0 switches this
    bound off). ``dense_floor`` covers hosts whose datagram path is slower than their reliable lane (loopback: a
    burst of important blocks in one read says nothing about how soon the datagrams get through)."""

    k: float = 4.0
    floor: float = 0.002
    cap: float = 0.5
    dense: float = 2.0
    dense_floor: float = 0.01
    learn: float = 1.0
    alpha: float = 0.125
    spread: float = 4.0
    grow: float = 2.0
    warm: float = 4
    mean: float | None = None
    dev: float = 0.0
    seen: int = 0

    def observe(self, wait: float, complete: bool) -> None:
        if not self.learn or wait != wait or wait < 0:
            return
        sample = wait if complete else wait * self.grow
        self.seen += 1
        if self.mean is None:
            self.mean, self.dev = sample, sample / 2
            return
        self.dev += self.alpha * (abs(sample - self.mean) - self.dev)
        self.mean += self.alpha * (sample - self.mean)

    def bound(self) -> float:
        """The hard bound after the important blocks: ``cap``, or the learnt one once warm."""
        if not self.learn or self.mean is None or self.seen < self.warm:
            return self.cap
        return min(self.cap, max(self.floor, self.mean + self.spread * self.dev))

    def longest_wait(self) -> float:
        return self.bound()  # every deadline is at most this after the important blocks

    def deadline(self, st: DeadlineState) -> float:
        t0 = st.important_done_at
        hard = t0 + self.bound()
        if self.dense and st.dense_wait is not None:
            hard = min(hard, t0 + max(self.floor, self.dense_floor, self.dense * st.dense_wait))
        if st.last_arrival is None or st.mean_gap is None:
            return min(hard, t0 + max(self.floor, self.cap / 10))
        quiet = st.last_arrival + self.k * st.mean_gap
        if st.remaining_frames:
            quiet = max(quiet, st.last_arrival + st.remaining_frames * st.mean_gap * 1.5)
            if st.batch_gap is not None:  # bursty arrivals: the per-frame gap underestimates the wait for the next
                quiet = max(quiet, st.last_arrival + 2 * st.batch_gap)
        return min(hard, max(t0 + self.floor, quiet))


def make_deadline(spec: str | float | DeadlinePolicy) -> DeadlinePolicy:
    """``0.01`` / ``"fixed:0.01"`` -> FixedGrace; ``"adaptive"`` / ``"adaptive:cap=0.5,k=4"`` -> AdaptiveGrace."""
    if isinstance(spec, DeadlinePolicy):
        return spec
    if isinstance(spec, (int, float)):
        return FixedGrace(float(spec))
    name, _, args = spec.partition(":")
    if name == "fixed":
        return FixedGrace(float(args or 0.005))
    if name == "adaptive":
        kw: dict[str, Any] = {k: float(v) for k, v in (a.split("=") for a in filter(None, args.split(",")))}
        return AdaptiveGrace(**kw)
    raise ValueError(f"unknown deadline policy {spec!r} (use 'fixed:SECONDS' or 'adaptive:k=..,floor=..,cap=..')")
