"""When a round stops waiting for unimportant blocks: policies evaluated against an injected clock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeadlineState:
    """What a policy may look at: when all important blocks were in, the unimportant arrivals so far."""

    important_done_at: float
    last_arrival: float | None
    mean_gap: float | None  # EWMA of inter-arrival times of unimportant frames
    remaining_frames: int | None  # unimportant frames announced but not yet in (None = unknown)
    batch_gap: float | None = None  # EWMA of the time between arrival batches (a GRO read, a drained socket)


class DeadlinePolicy:
    def deadline(self, st: DeadlineState) -> float:
        raise NotImplementedError


@dataclass
class FixedGrace(DeadlinePolicy):
    """Wait a fixed time after the last important block."""

    grace: float = 0.005

    def deadline(self, st: DeadlineState) -> float:
        return st.important_done_at + self.grace


@dataclass
class AdaptiveGrace(DeadlinePolicy):
    """Wait while unimportant frames keep coming: until the stream has been quiet for ``k`` mean gaps, or long enough
    for the announced remaining frames at the observed rate, never less than ``floor`` and never more than ``cap``
    after the important blocks were complete (the hard bound)."""

    k: float = 4.0
    floor: float = 0.002
    cap: float = 0.5

    def deadline(self, st: DeadlineState) -> float:
        t0 = st.important_done_at
        hard = t0 + self.cap
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
        kw = {k: float(v) for k, v in (a.split("=") for a in filter(None, args.split(",")))}
        return AdaptiveGrace(**kw)
    raise ValueError(f"unknown deadline policy {spec!r} (use 'fixed:SECONDS' or 'adaptive:k=..,floor=..,cap=..')")
