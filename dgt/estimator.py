"""Sliding Average Norm Estimation (eq. 1 of the DGT paper) and top-p% classification of sub-blocks per tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dgt.layout import BucketLayout


@dataclass
class Classification:
    """The result for one bucket and round.

    scores: C_k^j per block (float32); important: bool per block; order: unimportant block indices, most
    important first (the unreliable lanes' send order); cls: int8 lane class per block (0 = important/reliable).
    """

    scores: torch.Tensor
    important: torch.Tensor
    order: torch.Tensor
    cls: torch.Tensor
    p: float

    @property
    def n_important(self) -> int:
        return int(self.important.sum())


class ContributionEstimator:
    """C = alpha * C_prev + (1 - alpha) * mean|g| per sub-block, C(0) = 0; state reset when the layout changes.

    ``classify`` ranks the blocks of each tensor and marks ceil(p * blocks) of them important (at least one per
    tensor when p > 0). With ``classes`` > 2 the unimportant blocks are split into further lane classes by their rank
    across the bucket (class boundaries at equal shares of the unimportant blocks): the DGT paper's future work of
    "more channels for finer-grained control".
    """

    def __init__(self, layout: BucketLayout, alpha: float = 0.3, classes: int = 2) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError("momentum alpha must be in [0, 1]")
        if classes < 2:
            raise ValueError("need at least 2 classes (important, unimportant)")
        self.layout = layout
        self.alpha = alpha
        self.classes = classes
        self.scores: torch.Tensor | None = None
        self._tensor_first = torch.tensor(layout.tensor_first_block, dtype=torch.int64)

    def update(self, flat: torch.Tensor, means: torch.Tensor | None = None) -> torch.Tensor:
        """Fold one round's gradient into the scores (one pass over the bucket) and return them. ``means``: the
        bucket's ``layout.block_abs_mean`` when the caller already has it (no second pass)."""
        m = self.layout.block_abs_mean(flat) if means is None else means
        if self.scores is not None and self.scores.shape == m.shape and self.scores.device != m.device:
            self.scores = self.scores.to(m.device)  # restored from a CPU checkpoint: keep the average, move it
        if self.scores is None or self.scores.shape != m.shape:
            self.scores = (1.0 - self.alpha) * m
        else:
            self.scores.mul_(self.alpha).add_(m, alpha=1.0 - self.alpha)
        return self.scores

    def classify(self, p: float, scores: torch.Tensor | None = None) -> Classification:
        """Top-p% per tensor by score, vectorised over all blocks (two stable sorts, no loop over blocks)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError("p must be in [0, 1]")
        s = self.scores if scores is None else scores
        if s is None:
            raise RuntimeError("classify() before update()")
        dev = s.device
        L = self.layout
        if dev.type == "cpu" and len(L.sizes) == 1 and s.dtype == torch.float32:
            fast = self._classify_one_tensor(s, p)
            if fast is not None:
                return fast
        nb = L.blocks_per_tensor.to(dev)
        k = torch.ceil(nb.to(torch.float64) * p).to(torch.int64).clamp(max=nb)
        if p > 0:
            k = torch.maximum(k, (nb > 0).to(torch.int64))
        tensor_of = L.block_tensor.to(dev)
        by_score = torch.sort(s, descending=True, stable=True).indices
        regroup = torch.sort(tensor_of[by_score], stable=True).indices
        ranked = by_score[regroup]  # blocks grouped by tensor, best first within each tensor
        pos = torch.arange(L.nblocks, device=dev)
        rank_in_tensor = pos - self._tensor_first.to(dev)[tensor_of[ranked]]
        important = torch.zeros(L.nblocks, dtype=torch.bool, device=dev)
        important[ranked] = rank_in_tensor < k[tensor_of[ranked]]
        unimp = by_score[~important[by_score]]  # unimportant, most important first across the bucket
        cls = torch.zeros(L.nblocks, dtype=torch.int8, device=dev)
        if len(unimp):
            share = torch.arange(len(unimp), device=dev) * (self.classes - 1) // len(unimp)
            cls[unimp] = (1 + share).to(torch.int8)
        return Classification(s, important, unimp, cls, p)

    def _classify_one_tensor(self, s: torch.Tensor, p: float) -> Classification | None:
        """:meth:`classify` of a one-tensor bucket on the CPU in numpy: one stable sort, the same result (ties keep
        block order, as torch's stable descending sort does). None when a score is not finite (torch ranks NaN
        first, numpy last): the general path decides those."""
        sn = s.numpy()
        if not np.isfinite(sn).all():
            return None
        nb = self.layout.nblocks
        k = min(nb, math.ceil(nb * p))
        if p > 0 and nb > 0:
            k = max(k, 1)
        by_score = np.argsort(-sn, kind="stable")
        important = np.zeros(nb, dtype=bool)
        important[by_score[:k]] = True
        unimp = by_score[k:]
        cls = np.zeros(nb, dtype=np.int8)
        if len(unimp):
            cls[unimp] = 1 + np.arange(len(unimp)) * (self.classes - 1) // len(unimp)
        return Classification(s, torch.from_numpy(important), torch.from_numpy(unimp.astype(np.int64, copy=False)),
                              torch.from_numpy(cls), p)

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "scores": None if self.scores is None else self.scores.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = state["alpha"]
        self.scores = state["scores"]


def expected_important(layout: BucketLayout, p: float) -> int:
    """How many blocks ``classify(p)`` marks important (for accounting and tests)."""
    total = 0
    for nb in layout.blocks_per_tensor.tolist():
        k = min(nb, math.ceil(nb * p))
        total += max(k, 1 if (p > 0 and nb > 0) else 0)
    return total
