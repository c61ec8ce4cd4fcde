"""Schedules for p, the fraction of blocks classified important."""

from __future__ import annotations

import math
from dataclasses import dataclass


class PSchedule:
    """Maps the training loss stream to p in [0, 1]."""

    def observe_loss(self, loss: float) -> None:  # noqa: B027 - optional hook
        """Feed the latest training loss (ignored by schedules that do not use it)."""

    def p(self) -> float:
        raise NotImplementedError


@dataclass
class ConstantP(PSchedule):
    value: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 <= self.value <= 1.0:
            raise ValueError("p must be in [0, 1]")

    def p(self) -> float:
        return self.value


@dataclass
class LossProportionalP(PSchedule):
    """The DGT paper's heuristic p = p0 * loss_t / loss_0, clamped to [p_min, 1].

    loss_0 is the first finite loss observed; before any loss is seen p = ``idle_p`` (None: p0, the paper's start).
    A trainer that never feeds the loss (the DDP hook's one-line change) stays at ``idle_p``, so it still drops.
    Non-finite losses are ignored so one diverged batch cannot zero the schedule.
    """

    p0: float = 1.0
    p_min: float = 0.05
    loss0: float | None = None
    last: float | None = None
    idle_p: float | None = None

    def __post_init__(self) -> None:
        if self.idle_p is not None and not 0.0 <= self.idle_p <= 1.0:
            raise ValueError("idle_p must be in [0, 1]")

    def observe_loss(self, loss: float) -> None:
        loss = float(loss)
        if not math.isfinite(loss):
            return
        if self.loss0 is None:
            if loss <= 0:
                return
            self.loss0 = loss
        self.last = loss

    def p(self) -> float:
        if self.loss0 is None or self.last is None:
            return min(1.0, max(self.p_min, self.p0 if self.idle_p is None else self.idle_p))
        return min(1.0, max(self.p_min, self.p0 * self.last / self.loss0))


def make_schedule(spec: str | float | PSchedule) -> PSchedule:
    """``0.3`` or ``"const:0.3"`` -> constant; ``"loss"`` / ``"loss:p0=1,p_min=0.05,idle_p=0.3"`` ->
    loss-proportional."""
    if isinstance(spec, PSchedule):
        return spec
    if isinstance(spec, (int, float)):
        return ConstantP(float(spec))
    name, _, args = spec.partition(":")
    if name in ("const", "constant"):
        return ConstantP(float(args or 0.3))
    if name == "loss":
        kw = {k: float(v) for k, v in (a.split("=") for a in filter(None, args.split(",")))}
        return LossProportionalP(**kw)
    try:
        return ConstantP(float(spec))
    except ValueError:
        raise ValueError(f"unknown p schedule {spec!r} (use a number, 'const:P' or "
                         f"'loss:p0=..,p_min=..,idle_p=..')") from None
