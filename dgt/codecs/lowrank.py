"""A PowerSGD-style low-rank codec (Vogels et al. 2019), optionally with DGT's importance split on its residual.

Every tensor of a bucket with at least two dimensions is read as a matrix ``M`` (``shape[0]`` rows, the rest
flattened), error feedback added; 1-D tensors (biases, norms) travel dense. One all-reduce takes three reductions,
each a plain element-wise sum that every rank ends with bit for bit (the ring's all-gather is reliable):

1. ``P = M Q`` for every matrix (``Q``: the previous call's reduced ``Q``, the warm start; the first call draws it
   from a generator seeded alike on every rank), all of them in one payload on the reliable lane;
2. the reduced ``P`` is orthonormalised (modified Gram-Schmidt on the reduced, identical ``P``: every rank computes
   the same ``P_hat``), ``Q = M^T P_hat``; the ``Q`` factors and the dense 1-D tensors go as one payload on the
   reliable lane (with ``residual_p > 0`` also each block's mean |residual|, one value per block);
3. (``residual_p > 0`` only) the residual ``R = M - P_hat Q^T`` (this rank's own ``Q``): the top ``residual_p``
   blocks of every matrix by DGT's contribution estimator (:class:`dgt.estimator.ContributionEstimator`, fed the
   reduced block means, so every rank picks the same blocks) are packed and summed on the droppable lane; the other
   blocks stay in error feedback.

The sum every rank applies is ``P_hat Q_sum^T`` per matrix, the dense sum of the 1-D tensors and, in step 3, the
packed residual sum scattered back onto its blocks. What this rank sent (its share of that sum: ``P_hat Q^T``, its
1-D tensors, its packed residual blocks) plus what it keeps in error feedback is its input plus the error feedback it
started with (exact for the 1-D tensors and the residual split, to float rounding for ``M - P_hat Q^T``).

With ``wire=bf16`` the P and Q payloads (and the 1-D tensors) travel as bfloat16: half the bytes, the range of
float32 (no overflow, no flush of small gradients to zero), 8 significant bits. The codec rounds what it hands over
and keeps the rounding in error feedback: its Q is rounded before the residual ``M - P_hat Q^T`` is taken, and a 1-D
tensor's rounding error (``x - bf16(x)``, exact in float32) is its error feedback, so what a rank sent plus what it
keeps is still its input (conservation). Rounding P only moves the basis, which every rank orthonormalises from the
same reduced P. The reductions add the bfloat16 terms in float32 and round the sum once (the direct all-reduce), the
same on every rank; that last rounding (2^-9 relative) is the one error not carried over.

The codec contract's single ``encode``/``decode`` cannot express the two dependent reductions, so the codec is
driven by :class:`dgt.collectives.lowrank.LowRankAllReduce` over the transport, or :func:`reduce_in_process` (K
ranks in one process: tests and :func:`dgt.harness.simulate.train_allreduce`); the generic collectives refuse it
(``runner``). The codec sees tensor shapes through :func:`set_shapes` (the driver calls it); a bucket without
shapes is all 1-D, i.e. dense.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from dgt.codecs.base import DROPPABLE, BucketState, Capabilities, Codec, Part, Received, rank_order_sum
from dgt.codecs.registry import register
from dgt.errors import CodecMismatch, InputRejected
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout

SHAPES_KEY = "shapes"
# the ``wire`` option: the dtype of the P and Q(+dense) payloads; fp16 is not offered (its range is 6.5e4 and the sum
# of several ranks' factors would need clamping), bf16 has float32's range
WIRE_DTYPES: dict[str, torch.dtype | None] = {"native": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def set_shapes(state: BucketState, shapes: Sequence[Sequence[int]]) -> None:
    """Declare the shapes of the tensors packed in a bucket, in order; their sizes must add up to its numel."""
    shp = [tuple(int(d) for d in s) for s in shapes]
    if any(d < 0 for s in shp for d in s):
        raise InputRejected(f"tensor shapes must have non-negative dimensions, got {shp}")
    total = sum(math.prod(s) for s in shp)
    if total != state.numel:
        raise InputRejected(f"shapes {shp} hold {total} elements, the bucket has {state.numel}")
    state.values[SHAPES_KEY] = shp


@dataclass(frozen=True)
class _Matrix:
    offset: int  # first element in the bucket
    rows: int
    cols: int
    rank: int  # min(rank, rows, cols)
    index: int  # tensor index in the bucket (seeds its first Q)


@dataclass(frozen=True)
class _Plan:
    """The geometry of one bucket: which tensors are compressed and where each factor sits in its payload."""

    matrices: tuple[_Matrix, ...]
    dense_mask: torch.Tensor  # bool per element: the tensors that travel dense
    p_numel: int
    q_numel: int
    dense_numel: int
    residual: BucketLayout  # the compressed matrices' elements, one tensor per matrix, cut in ``block`` blocks


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``p`` (n x r), in place, and returned. Deterministic (the same input
    gives the same bits on every rank of one device type and thread count) and scale-free: a column that is zero, or
    whose part outside the earlier columns is within rounding of nothing (``n eps`` of its norm), becomes zero (it
    contributes nothing instead of dividing by zero or amplifying rounding noise)."""
    rows, r = p.shape
    rel = torch.finfo(p.dtype).eps * max(1, rows)
    for i in range(r):
        col = p[:, i]
        before = float(torch.linalg.vector_norm(col))
        if i:
            prev = p[:, :i]
            col -= prev @ (prev.T @ col)
        norm = torch.linalg.vector_norm(col)
        if before > 0 and float(norm) > rel * before:
            col /= norm
        else:
            col.zero_()
    return p


@register("lowrank")
class LowRankCodec(Codec):
    """PowerSGD low-rank factors on the reliable lane. Options: ``rank`` (r, 1), ``warm_start`` (true: reuse the
    reduced Q), ``seed`` (0; the first Q, the same on every rank), ``min_ratio`` (1.0: a matrix is sent dense unless
    its factors are at least this many times smaller than it), ``residual_p`` (0: no residual; > 0: the top share of
    each matrix's residual blocks by DGT's estimator on the droppable lane, the rest in error feedback), ``alpha``
    (the estimator's momentum, 0.3), ``block`` (elements per residual block, 1024), ``wire`` (``native``: the payloads
    in the bucket's dtype; ``bf16``: P, Q and the 1-D tensors as bfloat16, the rounding kept in error feedback).
    float32 and float64 buckets."""

    name = "lowrank"
    runner = "dgt.collectives.lowrank.LowRankAllReduce (or dgt.codecs.lowrank.reduce_in_process; docs/codecs.md)"
    capabilities = Capabilities(summable=True, lossy_tolerant=False)
    accepted_dtypes = frozenset({torch.float32, torch.float64})
    wire = "native"  # (class defaults: a codec pickled before the option existed unpickles as native)
    wire_dtype: torch.dtype | None = None

    def __init__(self, rank: int = 1, warm_start: bool = True, seed: int = 0, min_ratio: float = 1.0,
                 residual_p: float = 0.0, alpha: float = 0.3, block: int = 1024, wire: str = "native") -> None:
        super().__init__()
        if int(rank) != rank or rank < 1:
            raise ValueError(f"lowrank rank must be an integer >= 1, got {rank!r}")
        if not 0.0 <= float(residual_p) <= 1.0:
            raise ValueError(f"lowrank residual_p must be in [0, 1], got {residual_p!r}")
        if float(min_ratio) < 1.0:
            raise ValueError(f"lowrank min_ratio must be >= 1, got {min_ratio!r}")
        if int(block) < 1:
            raise ValueError(f"lowrank block must be >= 1, got {block!r}")
        if wire not in WIRE_DTYPES:
            raise ValueError(f"lowrank wire must be one of {sorted(WIRE_DTYPES)}, got {wire!r}")
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self.min_ratio = float(min_ratio)
        self.residual_p = float(residual_p)
        self.alpha = float(alpha)
        self.block = int(block)
        self.wire = wire
        self.wire_dtype: torch.dtype | None = WIRE_DTYPES[wire]
        """The dtype of the P and Q(+dense) payloads; None: the bucket's own."""
        if self.residual_p > 0:
            self.name = "lowrank+dgt"
        self.capabilities = replace(self.capabilities, block=self.block, lossy_tolerant=self.residual_p > 0,
                                    transport_feedback=False)
        self.last_stats: dict[str, int] = {}
        """Bytes this rank handed to each reduction in the last call: ``p_bytes``, ``q_dense_bytes`` (Q factors,
        dense tensors, block means), ``residual_bytes`` (packed residual blocks, droppable)."""

    # -- the generic contract: refused (two dependent reductions) -------------------------------------------------
    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        raise CodecMismatch(f"codec {self.name!r} needs two dependent reductions; it is driven by {self.runner}")

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        raise CodecMismatch(f"codec {self.name!r} needs two dependent reductions; it is driven by {self.runner}")

    # -- geometry -------------------------------------------------------------------------------------------------
    def plan(self, state: BucketState) -> _Plan:
        """The bucket's geometry (cached in the state; recomputed when its shapes change)."""
        shapes = state.values.get(SHAPES_KEY) or [(state.numel,)]
        key = (tuple(shapes), self.rank, self.min_ratio, self.block)
        cached = state.values.get("plan")
        if isinstance(cached, _Plan) and state.values.get("plan_key") == key:
            return cached
        mats, off, p_numel, q_numel = [], 0, 0, 0
        dense = torch.ones(state.numel, dtype=torch.bool)
        for i, shp in enumerate(shapes):
            n = math.prod(shp)
            if len(shp) >= 2 and n:
                rows, cols = shp[0], n // shp[0]
                r = min(self.rank, rows, cols)
                if (rows + cols) * r * self.min_ratio <= rows * cols:
                    mats.append(_Matrix(off, rows, cols, r, i))
                    dense[off : off + n] = False
                    p_numel += rows * r
                    q_numel += cols * r
            off += n
        residual = BucketLayout.of([m.rows * m.cols for m in mats] or [0], self.block)
        plan = _Plan(tuple(mats), dense, p_numel, q_numel, int(dense.sum()), residual)
        state.values["plan"], state.values["plan_key"] = plan, key
        for k in ("ef", "q", "estimator"):  # a new geometry: nothing carried over from the old one
            state.values.pop(k, None)
        return plan

    def _first_q(self, m: _Matrix, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A Q every rank draws alike: a CPU generator seeded by (seed, tensor index, step), then moved."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + m.index) * 1_000_033 + step)
        return torch.randn(m.cols, m.rank, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    # -- the three steps of one all-reduce ---------------------------------------------------------------------
    def begin(self, bucket: torch.Tensor, state: BucketState) -> torch.Tensor:
        """Step 1: this rank's input plus error feedback (kept in the state) and the P payload (``M Q`` of every
        matrix, concatenated) for a reliable sum."""
        self.check_input(bucket)
        plan = self.plan(state)
        flat = bucket.detach().reshape(-1)
        ef = state.values.get("ef")
        m_all = flat.clone() if ef is None else flat + ef.to(device=flat.device, dtype=flat.dtype)
        state.values["m"] = m_all
        qs = state.values.get("q") or {}
        if not self.warm_start:
            qs = {}
        p = torch.empty(plan.p_numel, dtype=flat.dtype, device=flat.device)
        po = 0
        for m in plan.matrices:
            q = qs.get(m.index)
            if q is None or q.shape != (m.cols, m.rank):
                q = self._first_q(m, 0 if self.warm_start else state.step, flat.dtype, flat.device)
            qs[m.index] = q.to(device=flat.device, dtype=flat.dtype)
            mat = m_all[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
            torch.matmul(mat, qs[m.index], out=p[po : po + m.rows * m.rank].view(m.rows, m.rank))
            po += m.rows * m.rank
        state.values["q"] = qs
        return p if self.wire_dtype is None else p.to(self.wire_dtype)

    def middle(self, p_sum: torch.Tensor, state: BucketState) -> torch.Tensor:
        """Step 2: orthonormalise the reduced P (identical on every rank), this rank's Q = M^T P_hat, its residual;
        the payload for a reliable sum: every Q, then the dense tensors, then (``residual_p > 0``) the residual's
        mean |r| per block."""
        plan = self.plan(state)
        m_all: torch.Tensor = state.values["m"]
        if p_sum.numel() != plan.p_numel:
            raise InputRejected(f"reduced P has {p_sum.numel()} elements, the plan expects {plan.p_numel}")
        p_hat = p_sum.to(device=m_all.device, dtype=m_all.dtype).clone()
        residual = torch.empty(plan.residual.numel, dtype=m_all.dtype, device=m_all.device)
        q_local = torch.empty(plan.q_numel, dtype=m_all.dtype, device=m_all.device)
        po = qo = ro = 0
        for m in plan.matrices:
            ph = orthonormalise(p_hat[po : po + m.rows * m.rank].view(m.rows, m.rank))
            mat = m_all[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
            q = q_local[qo : qo + m.cols * m.rank].view(m.cols, m.rank)
            torch.matmul(mat.T, ph, out=q)
            if self.wire_dtype is not None:  # the rounded Q travels: the residual (error feedback) keeps the rest
                q.copy_(q.to(self.wire_dtype))
            res = residual[ro : ro + m.rows * m.cols].view(m.rows, m.cols)
            torch.sub(mat, ph @ q.T, out=res)  # this rank's share of the sum is P_hat Q^T; the rest is residual
            po, qo, ro = po + m.rows * m.rank, qo + m.cols * m.rank, ro + m.rows * m.cols
        state.values["p_hat"], state.values["q_local"], state.values["residual"] = p_hat, q_local, residual
        dense = m_all[plan.dense_mask.to(m_all.device)]
        if self.wire_dtype is not None:  # the 1-D tensors travel rounded; their rounding error is their error feedback
            sent = dense.to(self.wire_dtype).to(m_all.dtype)
            state.values["dense_error"] = dense - sent
            dense = sent
        state.values["dense_sent"] = dense
        pieces = [q_local, dense]
        if self.residual_p > 0:
            pieces.append(plan.residual.block_abs_mean(residual).to(m_all.dtype))
        payload = torch.cat(pieces)
        return payload if self.wire_dtype is None else payload.to(self.wire_dtype)

    def end(self, qd_sum: torch.Tensor, state: BucketState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 3: the sum every rank applies (``P_hat Q_sum^T`` per matrix, the dense sum) and, with
        ``residual_p > 0``, this rank's packed residual blocks for a droppable sum (None without). Error feedback:
        the residual, less the blocks packed here."""
        plan = self.plan(state)
        m_all: torch.Tensor = state.values.pop("m")
        p_hat: torch.Tensor = state.values.pop("p_hat")
        residual: torch.Tensor = state.values.pop("residual")
        q_local: torch.Tensor = state.values.pop("q_local")
        dense_sent: torch.Tensor = state.values.pop("dense_sent")
        nblk = plan.residual.nblocks if self.residual_p > 0 else 0
        if qd_sum.numel() != plan.q_numel + plan.dense_numel + nblk:
            raise InputRejected(f"reduced Q payload has {qd_sum.numel()} elements, the plan expects "
                                f"{plan.q_numel + plan.dense_numel + nblk}")
        qd_sum = qd_sum.to(device=m_all.device, dtype=m_all.dtype)
        out = torch.empty_like(m_all)
        out[plan.dense_mask.to(m_all.device)] = qd_sum[plan.q_numel : plan.q_numel + plan.dense_numel]
        qs = state.values["q"]
        po = qo = 0
        for m in plan.matrices:
            ph = p_hat[po : po + m.rows * m.rank].view(m.rows, m.rank)
            q_sum = qd_sum[qo : qo + m.cols * m.rank].view(m.cols, m.rank)
            torch.matmul(ph, q_sum.T, out=out[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols))
            if bool(q_sum.any()):
                qs[m.index] = q_sum.clone()  # warm start: the reduced Q, identical on every rank
            else:  # a zero Q would keep P and Q zero for ever: the next call draws a fresh one (alike everywhere)
                qs.pop(m.index, None)
            po, qo = po + m.rows * m.rank, qo + m.cols * m.rank
        ef = torch.zeros_like(m_all)
        packed = None
        sent_mask = None
        if self.residual_p > 0 and plan.residual.nblocks:
            est = state.values.get("estimator")
            if est is None or est.layout != plan.residual:
                est = state.values["estimator"] = ContributionEstimator(plan.residual, self.alpha, 2)
            est.update(residual, qd_sum[plan.q_numel + plan.dense_numel :].to(torch.float32).cpu())
            important = est.classify(self.residual_p).important
            sent_mask = plan.residual.expand(important).to(residual.device)
            packed = residual[sent_mask]
            state.values["residual_blocks"] = important
            state.values["residual_mask"] = sent_mask
        # error feedback: the residual, less what was packed (exact: the packed blocks are zeroed, nothing added), and
        # with a 16-bit wire the 1-D tensors' rounding error
        kept = residual if sent_mask is None else residual.masked_fill(sent_mask, 0)
        self._fill_ef(ef, plan, kept, state.values.pop("dense_error", None))
        state.values["ef"] = ef
        state.values["out"] = out
        # what this rank handed to the reductions (references, no copies): its factors and packed residual blocks
        state.values["last"] = {"p_hat": p_hat, "q": q_local, "dense": dense_sent,
                                "packed": packed, "residual_mask": sent_mask,
                                "residual": residual}
        nbytes = m_all.element_size() if self.wire_dtype is None else self.wire_dtype.itemsize
        self.last_stats = {"p_bytes": plan.p_numel * nbytes,
                           "q_dense_bytes": (plan.q_numel + plan.dense_numel + nblk) * nbytes,
                           "residual_bytes": 0 if packed is None else packed.numel() * nbytes}
        state.step += 1
        return out, packed

    @staticmethod
    def _fill_ef(ef: torch.Tensor, plan: _Plan, kept: torch.Tensor, dense_error: torch.Tensor | None) -> None:
        """Write the kept residual of each matrix (and the 1-D tensors' rounding error, if any) into ``ef``."""
        ro = 0
        for m in plan.matrices:
            ef[m.offset : m.offset + m.rows * m.cols] = kept[ro : ro + m.rows * m.cols]
            ro += m.rows * m.cols
        if dense_error is not None:
            ef[plan.dense_mask.to(ef.device)] = dense_error

    def land_residual(self, r_sum: torch.Tensor, state: BucketState) -> torch.Tensor:
        """With ``residual_p > 0``: add the reduced packed residual (lost blocks read as zero) onto the result of
        :meth:`end`, at the blocks every rank packed; returns the final sum."""
        plan = self.plan(state)
        out: torch.Tensor = state.values.pop("out")
        mask: torch.Tensor | None = state.values.get("residual_mask")
        if mask is None:
            return out
        full = torch.zeros(plan.residual.numel, dtype=out.dtype, device=out.device)
        full[mask] = r_sum.to(device=out.device, dtype=out.dtype)
        ro = 0
        for m in plan.matrices:
            out[m.offset : m.offset + m.rows * m.cols] += full[ro : ro + m.rows * m.cols]
            ro += m.rows * m.cols
        return out

    def finish(self, state: BucketState) -> torch.Tensor:
        """Without a residual step: the result of :meth:`end`."""
        out: torch.Tensor = state.values.pop("out")
        return out

class DroppableCodec(Codec):
    """The residual step's payload over a lossy ring: every block on the droppable lane, in block order. Lost
    blocks arrive as zeros and are not sent again (the transport's error feedback must be off: the packed positions
    mean other blocks next call)."""

    name = "lowrank-residual"
    capabilities = Capabilities(summable=True, lossy_tolerant=True, in_place=True, transport_feedback=False)

    def __init__(self, block: int = 1024) -> None:
        super().__init__()
        self.block = int(block)
        self.capabilities = replace(self.capabilities, block=self.block)

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        flat = bucket.reshape(-1)
        nb = BucketLayout.of(state.segments or [flat.numel()], self.block).nblocks
        cls = torch.full((nb,), DROPPABLE, dtype=torch.int8)
        return [Part(flat, cls, self.block, "residual", state.segments, torch.arange(nb))]

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        return parts[0].data.to(device=like.device, dtype=like.dtype).view_as(like)


def reduce_in_process(codecs: Sequence[LowRankCodec], states: Sequence[BucketState], buckets: Sequence[torch.Tensor],
                      residual_masks: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None
                      ) -> list[torch.Tensor]:
    """One low-rank all-reduce (sum) of K ranks in one process: each reduction adds the ranks' payloads in rank
    order and hands every rank the same tensor (what a ring's reliable all-gather does). ``residual_masks(r,
    packed)``: a bool per element of rank r's packed residual, False where that element was lost on the droppable
    lane (its contribution is missing from the sum, as on a lossy network), or None (all arrived). Returns each
    rank's result (equal tensors)."""
    k = len(codecs)
    if not (len(states) == len(buckets) == k):
        raise ValueError("one codec, state and bucket per rank")
    p = [codecs[r].begin(buckets[r], states[r]) for r in range(k)]
    p_sum = _sum(p)
    qd = [codecs[r].middle(p_sum, states[r]) for r in range(k)]
    qd_sum = _sum(qd)
    ends = [codecs[r].end(qd_sum, states[r]) for r in range(k)]
    if ends[0][1] is None:
        return [codecs[r].finish(states[r]) for r in range(k)]
    packed = []
    for r in range(k):
        pr = ends[r][1]
        assert pr is not None
        mask = None if residual_masks is None else residual_masks(r, pr)
        packed.append(pr if mask is None else pr.masked_fill(~mask.to(pr.device), 0))
    r_sum = _sum(packed)
    return [codecs[r].land_residual(r_sum, states[r]) for r in range(k)]


def _sum(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ranks' terms added in rank order and rounded once, as the direct all-reduce adds them."""
    return rank_order_sum(xs, xs[0].dtype).to(xs[0].dtype)
