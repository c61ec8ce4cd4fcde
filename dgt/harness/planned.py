"""One planned DGT round for the protocol tests: a random bucket of a few odd-sized tensors, 30 % of its blocks
important, planned by a :class:`~dgt.protocol.sender.RoundSender` (with or without the datagram MAC), and its
datagrams one by one. Shared by the MAC and the fused-landing tests, which feed the same rounds to receivers."""

from __future__ import annotations

import numpy as np
import torch

from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.sender import RoundPlan, RoundSender

SIZES = [3000, 1024, 5, 20000, 777]  # odd tensor tails make odd-size datagrams too


def plan_round(token: int, sender: int, receiver: int, mac: DatagramMac | None, rnd: int = 0, bucket: int = 0,
               seed: int = 0, dtype: torch.dtype = torch.float32,
               sizes: list[int] = SIZES) -> tuple[BucketLayout, torch.Tensor, RoundPlan]:
    """(layout, the sender's flat copy, the plan) of round ``rnd`` of ``bucket`` from rank ``sender`` to
    ``receiver``; the bucket is ``torch.randn`` under ``seed``."""
    torch.manual_seed(seed)
    layout = BucketLayout(sizes)
    g = torch.randn(layout.numel).to(dtype)
    est = ContributionEstimator(layout)
    est.update(g)
    c = est.classify(0.3)
    tx = RoundSender(token, rank=sender, mac=mac, peer=receiver)
    flat = tx.prepare(bucket, g)
    return layout, flat, tx.plan(bucket, rnd, flat, layout, c.cls, c.order)


def plan_datagrams(plan: RoundPlan) -> list[tuple[int, bytearray]]:
    """Every datagram of the plan as ``(lane, its bytes)``, the GSO rows first, then the odd-size tails."""
    out = []
    for lane, rows in plan.datagrams.items():
        out += [(lane, bytearray(np.asarray(rows)[i].tobytes())) for i in range(len(rows))]
    for lane, odd in plan.odd.items():
        out += [(lane, bytearray(b)) for b in odd]
    return out
