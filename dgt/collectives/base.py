"""What all collectives share: the codec pairing check, per-bucket codec state, timing of phases."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from dgt.codecs.base import BucketState, Codec
from dgt.codecs.registry import make_codec
from dgt.collectives.group import Group
from dgt.collectives.stats import CollectiveStats
from dgt.errors import CodecMismatch


class Collective:
    name = "collective"
    needs_summable = False

    def __init__(self, group: Group, codec: str | Codec = "dense", op: str = "mean") -> None:
        if op not in ("sum", "mean"):
            raise ValueError("op must be 'sum' or 'mean'")
        self.group = group
        self.codec = make_codec(codec)
        self.op = op
        if self.needs_summable and not self.codec.capabilities.summable:
            raise CodecMismatch(
                f"codec {self.codec.name!r} is not summable (its payloads cannot be added on the way), so it cannot "
                f"serve {self.name}; use the parameter server (gather-then-reduce) or a summable codec (dense, dgt)"
            )

    def state(self, key: int, t: torch.Tensor, segments: list[int] | None) -> BucketState:
        return self.codec.state_for(key, t, segments)

    @staticmethod
    @contextmanager
    def phase(stats: CollectiveStats, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            stats.phases[name] = stats.phases.get(name, 0.0) + time.perf_counter() - t0

    def finish(self, total: torch.Tensor, count: torch.Tensor | int | None = None) -> torch.Tensor:
        if self.op == "sum":
            return total
        if count is None:
            count = self.group.world
        return total / count
