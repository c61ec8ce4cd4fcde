"""The low-rank all-reduce over the DGT transport: :class:`~dgt.codecs.lowrank.LowRankCodec`'s three reductions as
all-reduces on one group.

1. the P factors: a lossless ring, or with ``inner="direct"`` the direct all-reduce (dense, reliable lane; factors of
   at most ``one_round_bytes`` in one round, the others in two);
2. the Q factors, the 1-D tensors and (with ``residual_p``) the residual's block means: the same, lossless;
3. (``residual_p > 0``) the packed residual blocks: a lossy ring whose every block rides the droppable lane
   (:class:`~dgt.codecs.lowrank.DroppableCodec`); its all-gather is reliable, so every rank lands the same sum.

Every reduction ends with the same tensor on every rank (the ring's and the direct all-reduce's all-gather send the
owner's reduced chunk; the direct one adds the ranks' terms in rank order, as :func:`reduce_in_process`), the
codec orthonormalises that identical P and every rank computes the same result from identical factors: the result
is bit-identical across ranks (``tests/test_codec_lowrank.py``). Lost residual blocks are not sent again: the
transport's error feedback would fold them into positions that mean other blocks next call, so a group with it on is
refused when ``residual_p > 0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dgt.codecs.base import Codec
from dgt.codecs.lowrank import DroppableCodec, LowRankCodec, set_shapes
from dgt.codecs.registry import make_codec
from dgt.collectives.base import _refuse, plain_input
from dgt.collectives.direct import DirectAllReduce
from dgt.collectives.group import Group
from dgt.collectives.parts import MAX_BUCKETS
from dgt.collectives.ring import RingAllReduce
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import CodecMismatch, InputRejected, call_code

PHASES = 3  # transport bucket ids per low-rank bucket: P, Q + dense, residual
# inner="direct": factors of at most this many bytes go in one round (every rank sends them whole to every other and
# sums in rank order; DirectAllReduce's one_round_bytes). On 4 ranks that sends 3x their bytes instead of 1.5x, for
# one round in series instead of two: at 40 Mbit 1.5 x 16 KiB is about 5 ms, against a round trip of 40 ms on the
# wan profile
ONE_ROUND_BYTES = 16 << 10


class LowRankAllReduce:
    """``await LowRankAllReduce(group, "lowrank:rank=2").allreduce(bucket, bucket_id, shapes)``: the sum (or mean)
    of ``bucket`` over the group, each tensor of ``shapes`` with >= 2 dimensions sent as rank-r factors."""

    name = "low-rank all-reduce"

    def __init__(self, group: Group, codec: str | Codec = "lowrank", op: str = "mean", inner: str = "ring",
                 one_round_bytes: int = ONE_ROUND_BYTES) -> None:
        if op not in ("sum", "mean"):
            raise ValueError("op must be 'sum' or 'mean'")
        if inner not in ("ring", "direct"):
            raise ValueError(f"inner must be 'ring' or 'direct', not {inner!r}")
        c = make_codec(codec)
        if not isinstance(c, LowRankCodec):
            raise CodecMismatch(f"the {self.name} drives the lowrank codec, not {c.name!r}")
        self.group = group
        self.codec = c
        self.op = op
        if c.residual_p > 0 and group.endpoint.cfg.error_feedback:
            raise CodecMismatch(f"codec {c.name!r} must not get the transport's error feedback (lost residual blocks "
                                f"would be folded into other blocks' places): open the group with "
                                f"TransportConfig(error_feedback=False)")
        # the P and Q(+dense) reductions: a ring (2(n-1) transfers in series) or the direct all-reduce (2, each rank
        # exchanging with all at once: fewer waits on a high-latency link for these small payloads)
        self._dense: RingAllReduce | DirectAllReduce = (
            RingAllReduce(group, "dense", op="sum") if inner == "ring"
            else DirectAllReduce(group, "dense", op="sum", one_round_bytes=one_round_bytes))
        self.inner = inner
        self._residual = RingAllReduce(group, DroppableCodec(c.block), op="sum") if c.residual_p > 0 else None
        # every frame of the three rings carries this call's op and codec (lowrank / lowrank+dgt), not the inner
        # rings' own (sum, dense): a rank that called with another op, codec or collective raises RankMismatch on
        # every rank from the first message, as with the other collectives
        code = call_code(op, c.name)
        for ring in (self._dense, self._residual):
            if ring is not None:
                ring.call_code = code

    async def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0,
                        shapes: Sequence[Sequence[int]] | None = None) -> CollectiveResult:
        """Every rank calls with a bucket of the same size, dtype and ``shapes`` (None: one 1-D tensor, sent dense).
        Bucket ids up to MAX_BUCKETS / 3 (each takes three transport bucket ids)."""
        if not 0 <= bucket_id < MAX_BUCKETS // PHASES:
            raise InputRejected(f"bucket id {bucket_id} outside 0..{MAX_BUCKETS // PHASES - 1} (the low-rank "
                                f"all-reduce takes {PHASES} transport bucket ids per bucket)")
        c = self.codec
        base = PHASES * bucket_id
        try:
            bucket = plain_input(bucket)  # any layout: a contiguous working copy of a non-contiguous one
            c.check_input(bucket)
            st = c.state_for(bucket_id, bucket)
            if shapes is not None:
                set_shapes(st, shapes)
        except InputRejected as exc:
            # refused before any traffic: the peers' first ring of this call (P, or Q when no tensor is a matrix)
            # fails at once with RankMismatch, as with the other collectives; every rank refusing leaves it usable
            family = self._dense.round_family
            assert family is not None
            for ring_bucket in (base, base + 1):
                await _refuse(self._dense, exc, family, ring_bucket, self.group.round_of(family, ring_bucket))
            raise
        stats = CollectiveStats()
        p = c.begin(bucket, st)
        p_sum = await self._reduce(self._dense, p, base, stats)
        qd = c.middle(p_sum, st)
        qd_sum = await self._reduce(self._dense, qd, base + 1, stats)
        out, packed = c.end(qd_sum, st)
        if packed is None:
            out = c.finish(st)
        else:
            assert self._residual is not None
            r_sum = await self._reduce(self._residual, packed, base + 2, stats)
            out = c.land_residual(r_sum, st)
        if self.op == "mean":
            out.div_(self.group.world)
        return CollectiveResult(out.view_as(bucket), stats)

    @staticmethod
    async def _reduce(ring: RingAllReduce | DirectAllReduce, t: torch.Tensor, bucket_id: int,
                      stats: CollectiveStats) -> torch.Tensor:
        if t.numel() == 0:  # no matrix in the bucket (or no residual block): nothing to send, on every rank alike
            return t
        res = await ring.allreduce(t, bucket_id)
        stats.merge(res.stats)
        return res.tensor  # type: ignore[return-value]
