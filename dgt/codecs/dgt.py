"""The DGT codec: the paper's per-block classification as a payload codec.

Important blocks (top p% per tensor by the sliding average of mean |g|) ride the reliable lane; the rest ride the
droppable lanes, most important first. Dropped blocks decode as zeros; the transport's drop reports feed the sender's
error feedback, so lost information comes back in a later round.
"""

from __future__ import annotations

import torch

from dgt.codecs.base import BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.registry import register
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.schedule import PSchedule, make_schedule


@register("dgt")
class DGTCodec(Codec):
    """Options: ``p`` (a number for a constant p, or ``loss`` for p = p0 * loss_t / loss_0), ``p0``, ``p_min``,
    ``idle_p`` (with ``loss``: p until a loss is observed; default p0), ``alpha`` (contribution momentum, 0.3),
    ``block`` (n, 1024), ``classes`` (lane classes incl. reliable, 2)."""

    name = "dgt"
    capabilities = Capabilities(summable=True, lossy_tolerant=True)

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
        self.classes = classes

    def observe_loss(self, loss: float) -> None:
        self.schedule.observe_loss(loss)

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        flat = bucket.reshape(-1)
        est = state.values.get("estimator")
        if est is None:
            layout = BucketLayout(state.segments or [flat.numel()], self.block)
            est = ContributionEstimator(layout, self.alpha, self.classes)
            state.values["estimator"] = est
        est.update(flat)
        c = est.classify(self.schedule.p())
        state.values["last_p"] = c.p
        state.values["last_important"] = c.n_important
        return [Part(flat, c.cls, self.block, "dgt", state.segments, c.order)]

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        return parts[0].data.to(device=like.device, dtype=like.dtype).view_as(like)
