"""The DGT codec: the paper's per-block classification as a payload codec.

Important blocks (top p% per tensor by the sliding average of mean |g|) ride the reliable lane; the rest ride the
droppable lanes, most important first. Dropped blocks decode as zeros; the transport's drop reports feed the sender's
error feedback, so lost information comes back in a later round.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dgt.codecs.base import BLOCK_MEANS_HINT, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.registry import register
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.p_schedule import PSchedule, make_schedule


@register("dgt")
class DGTCodec(Codec):
    """Floating buckets only (bool/int/complex are refused before any traffic). Options: ``p`` (a number for a
    constant p, or ``loss`` for p = p0 * loss_t / loss_0), ``p0``, ``p_min``, ``idle_p`` (with ``loss``: p until a
    loss is observed; default p0), ``alpha`` (contribution momentum, 0.3), ``block`` (n, 1024), ``classes`` (lane
    classes incl. reliable, 2)."""

    name = "dgt"
    capabilities = Capabilities(summable=True, lossy_tolerant=True, in_place=True)

    def __init__(
        self,
        p: float | str | PSchedule = "loss",
        p0: float = 1.0,
        p_min: float = 0.05,
        idle_p: float | None = None,
        alpha: float = 0.3,
        block: int = 1024,
        classes: int = 2,
    ) -> None:
        super().__init__()
        if p == "loss":
            p = f"loss:p0={p0},p_min={p_min}" + ("" if idle_p is None else f",idle_p={idle_p}")
        self.schedule = make_schedule(p)
        self.alpha = alpha
        self.block = block
        self.capabilities = replace(self.capabilities, block=block)
        self.classes = classes
        self.nonfinite = 0
        """NaN/Inf elements seen in encoded buckets (see :meth:`_nonfinite`)."""
        self.ramp = 1.0
        """How far a warm-up of p has gone, in [0, 1] (set by ``DGTState(p_warmup=N)``): the codec classifies with
        ``p ** ramp``, i.e. p = 1 (every block important) at 0, falling geometrically to the schedule's p at 1 (the
        default: no warm-up)."""

    def observe_loss(self, loss: float) -> None:
        self.schedule.observe_loss(loss)

    def current_p(self) -> float | None:
        """The p the next encode classifies with: the schedule's p, raised during a warm-up (:attr:`ramp`)."""
        p = float(self.schedule.p())
        return p if self.ramp >= 1.0 else p ** max(0.0, float(self.ramp))

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        flat = bucket.reshape(-1)
        est = state.values.get("estimator")
        if est is None:
            layout = BucketLayout.of(state.segments or [flat.numel()], self.block)
            est = ContributionEstimator(layout, self.alpha, self.classes)
            state.values["estimator"] = est
        hint = state.values.pop(BLOCK_MEANS_HINT, None)  # the same scores, from a pass that already read the bucket
        if hint is not None and hint.shape == (est.layout.nblocks,) and hint.device == flat.device:
            means = hint
        else:
            means = est.layout.block_abs_mean(flat)
        # the common case, one pass: a block's sum of |g| is finite only if each of its elements is (NaN and Inf
        # propagate); a sum that overflowed takes the exact path below, which treats finite values alike
        if bool(torch.isfinite(means).all()):
            est.update(flat, means)
            c = est.classify(self.current_p())
            cls, order = c.cls, c.order
        else:
            cls, order, c = self._nonfinite(flat, torch.isfinite(flat), est, state)
        state.values["last_p"] = c.p
        state.values["last_important"] = c.n_important
        return [Part(flat, cls, self.block, "dgt", state.segments, order)]

    def _nonfinite(self, flat: torch.Tensor, finite: torch.Tensor, est: ContributionEstimator,
                   state: BucketState):
        """The non-finite policy: NaN/Inf elements are counted (``nonfinite``, per bucket and in total), scored as
        zero (one NaN must not make a block important forever), and every block holding one rides the reliable
        lane, so it is delivered as it is and never enters the sender's residual (a lost NaN would come back a round
        later through error feedback)."""
        bad = ~finite
        n = int(bad.sum())
        self.nonfinite += n
        state.values["nonfinite"] = state.values.get("nonfinite", 0) + n
        est.update(torch.where(finite, flat, torch.zeros((), dtype=flat.dtype, device=flat.device)))
        c = est.classify(self.current_p())
        bad_block = est.layout.block_abs_mean(bad.to(torch.float32)) > 0
        cls = c.cls.clone()
        cls[bad_block] = 0
        return cls, c.order[~bad_block[c.order]], c

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        return parts[0].data.to(device=like.device, dtype=like.dtype).view_as(like)
