"""The state object of the DGT communication hook (modelled on PyTorch's ``PowerSGDState``).

It holds the hyperparameters (codec, collective, warm-up, transport settings), the per-bucket bookkeeping that DDP's
bucket rebuild after iteration 1 invalidates, the loss feed of the p schedule, running statistics, and at run time
the background trio worker with its group. It pickles without the worker and the process group, so it can be
saved in a checkpoint and loaded into a fresh process (the worker reconnects on the next hook call).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

from dgt.codecs.base import Codec
from dgt.codecs.dgt import DGTCodec
from dgt.codecs.lowrank import LowRankCodec
from dgt.codecs.registry import make_codec, parse_spec
from dgt.collectives.stats import CollectiveStats
from dgt.collectives.worker import TrioWorker
from dgt.shim.chooser import (
    ALL_MODES,
    DEFAULT_MODES,
    DIRECT_MODES,
    LOSSLESS,
    LOSSY,
    LOSSY_MODES,
    LOWRANK,
    DropChooser,
    screen_order,
)
from dgt.shim.net import checked_transport, group_connector, transport_config

logger = logging.getLogger(__name__)

COLLECTIVES = ("ring", "ps", "direct", "auto")
# collective="auto": the ring, and with the chooser on DIRECT_MIN_WORLD or more ranks the direct all-reduce as well,
# lossless and lossy, each probed and kept where it measures fastest (docs/shim.md). On 2 ranks both schedules are the
# same two transfers, so there is nothing to choose
DIRECT_MIN_WORLD = 3
# DGT's p = p0 * loss_t / loss_0 once the trainer feeds the loss (observe_loss); until then (and for the README's
# one-line change, which never feeds it) a fixed p = 0.1 instead of p0 = 1, which would drop nothing: docs/shim.md
DEFAULT_CODEC = "dgt:idle_p=0.1"
# the dtype the lossy path's buckets travel in; "auto": fp16 for the default codec (docs/shim.md), the bucket's own
# dtype for an explicitly given codec. The lossless path (warm-up, the chooser's fallback, codec="dense") never casts
WIRE_DTYPES = {"native": None, "fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
               "bfloat16": torch.bfloat16}
# the low-rank codec's P and Q reductions: on the ring or the direct all-reduce, as ``collective`` names; "auto": the
# direct one (2 rounds in series, not 2(n-1): on wan 0.52 s a step against the ring's 0.79 s, on fifo the same; docs/
# shim.md "Low rank"). The dense warm-up stays on the ring. "ps" cannot drive the codec
LOW_RANK_INNER = {"ring": "ring", "direct": "direct", "auto": "direct"}
# chooser="lowrank": its low-rank path's codec: rank 4 (GPT/AdamW needed 172 steps at rank 4, 208 at rank 2, Gloo 156),
# matrices compressed 2x or more (torch's min_compression_rate), factors as bfloat16 (half the bytes; float32 until
# 2026-12-07's second session). docs/experiment-ddp.md "Rank 4 ..." and "bfloat16 factors ..."
CHOOSER_LOW_RANK = "lowrank:rank=4,min_ratio=2,wire=bf16"
# ... and its bucket ids: DDP bucket i is low-rank bucket LOWRANK_BUCKETS + i (transport ids from 3 * LOWRANK_BUCKETS),
# apart from the ring's and the direct all-reduce's ids (error feedback is per id; these rounds mean other things)
LOWRANK_BUCKETS = 4096
# p_warmup="auto" (the default codec): DGT's p falls from 1 to its idle 0.1 over 50 iterations after the dense
# warm-up, p ** (t / 50) (Deep Gradient Compression's sparsity warm-up). GPT/AdamW, fifo, 3 seeds: steps to target
# 1.09x Gloo's (paired median) against 1.16x without, time 0.81x the hook's without (docs/shim.md "Warm-up of p")
DEFAULT_P_WARMUP = 50
DEFAULT_WARMUP_ITERS = 1  # DDP's first iteration alone (2 until 2026-12-07's 2nd session; docs/options.md)
AGREE_BUCKET = 16383  # the bucket id of the chooser's agreement all-reduce (DDP's buckets are numbered from 0)
_starts = itertools.count()  # one rendezvous prefix per worker start; every rank starts its workers in the same order
_starts_lock = threading.Lock()


class DGTState:
    """Everything :func:`dgt.shim.hook` needs.

    Args:
        process_group: the group whose ranks take part (None: the default group, resolved on first use).
        codec: a codec spec (``"dgt"``, ``"dgt:p=0.3"``, ``"dense"``, any registered codec) or a ``Codec``.
            ``"dense"`` makes the hook lossless. Default: DGT with p = p0 * loss_t / loss_0 once a loss is observed
            and p = 0.1 before (``DEFAULT_CODEC``). ``"lowrank:rank=1"`` (any ``lowrank`` spec): PowerSGD's rank-r
            P/Q factors with error feedback and the warm start, driven by
            :class:`~dgt.collectives.lowrank.LowRankAllReduce` with each gradient's shape (docs/shim.md "Low rank");
            it takes collective ``"ring"``, ``"direct"`` or ``"auto"`` (P and Q on the direct all-reduce, the
            warm-up on the ring), no chooser and no wire dtype, and
            with ``residual_p`` the state turns the transport's error feedback off.
        chooser: whether the hook measures if dropping pays (:class:`~dgt.shim.chooser.DropChooser`: it times
            lossless and lossy iterations, the ranks agree, and it keeps the faster path, re-probing now and then):
            a ``DropChooser`` with its settings, ``None`` (or False) for none, True for ``DropChooser(start=
            warmup_iters, modes=("lossy", "lossless"))`` (lossless and lossy DGT only), ``"lowrank"``: that
            chooser with the low-rank path as one more mode (``CHOOSER_LOW_RANK``, PowerSGD's factors with error
            feedback on the direct all-reduce, its time per iteration weighed by the chooser's ``lowrank_steps``
            prior; docs/shim.md "Low rank"), or
            ``"auto"`` (default): ``"lowrank"`` for the default codec (True where the collective is ``"ps"``, which
            cannot run the low-rank path), none for an explicitly given codec. Kept as the field ``state.chooser``
            (a DropChooser or None); ``state.lowrank_codec`` is the low-rank path's codec when a chooser has that
            mode.
        collective: ``"ring"`` (ring all-reduce), ``"direct"`` (the direct all-reduce: one reduce-scatter round
            and one all-gather round whatever the world size, :class:`~dgt.collectives.DirectAllReduce`), ``"auto"``
            (the default: the ring, and with the chooser on 3 or more ranks the direct all-reduce too, lossless and
            lossy: the chooser probes the four paths and keeps the fastest) or ``"ps"`` (parameter server;
            ``server`` = a rank or ``"sharded"``, ``normalize`` and ``lossy_pull`` as in
            :class:`~dgt.collectives.ParameterServer`).
        warmup_iters: iterations reduced densely and losslessly before the codec takes over (DDP rebuilds its
            buckets after iteration 1, and the first gradients are the least compressible).
        transport: a ``TransportConfig`` or a dict of its fields, a group as a dict of its fields
            (``{"faults": {"drop_fraction": 0.1}}``).
        host: the address this rank's endpoint advertises (default: the route towards MASTER_ADDR, or DGT_HOST).
        timeout: seconds allowed for the rendezvous and the connections.
        store: the c10d store to meet on (default: the default group's store).
        wire_dtype: the dtype of the lossy path on the wire: ``"fp16"``, ``"bf16"`` (or a ``torch.dtype``),
            ``"native"`` or None (the bucket's own), or ``"auto"`` (default: ``"fp16"`` for the default codec,
            ``"native"`` for an explicitly given one). A float32/float64 bucket is divided by the world size and cast
            before the lossy collective (as torch's ``fp16_compress_hook`` does) and cast back after; the lossless path
            is never cast (bit-exact). Kept as the field ``state.wire_dtype`` (a torch.dtype, or None: not cast).
        sparse: on the ring's lossy path, each chunk's owner holds its own contribution back (in an error-feedback
            store of the ring) on the blocks for which nothing arrived in the last reduce-scatter hop, so the applied
            update carries only the blocks that arrived and the all-gather only those
            (:mod:`dgt.collectives.ring_hold`; docs/shim.md "Sparse updates"). Default False. The direct
            all-reduce's lossy path is unchanged; ``collective`` must be ``"ring"`` or ``"auto"``.
        p_warmup: a warm-up of DGT's p over this many iterations after the dense warm-up (Deep Gradient
            Compression's sparsity warm-up): at iteration ``warmup_iters + t`` the lossy path classifies with
            ``p ** (t / p_warmup)``, from p = 1 (every block important) down to the schedule's p; 0: none;
            ``"auto"`` (default): ``DEFAULT_P_WARMUP`` (50) for the default codec, 0 for an explicitly given one.
            Only the ``dgt`` codec has a p; docs/shim.md "Warm-up of p".

    ``DGTState()`` is ``DGTState(codec=DEFAULT_CODEC, wire_dtype="fp16", chooser="lowrank", p_warmup=50)`` spelt
    out, i.e. ``chooser=DropChooser(start=1, modes=("lowrank", "lossy", "lossless"))`` (``DEFAULT_WARMUP_ITERS``).
    The keywords ``choose=`` and ``wire=`` of before issue 44 still work for one release, with a DeprecationWarning.
    """

    __slots__ = (
        "process_group", "store",
        # hyperparameters
        "codec", "warmup_codec", "collective", "server", "normalize", "lossy_pull", "warmup_iters", "transport",
        "host", "timeout", "wire_dtype", "sparse", "p_warmup",
        # internal state (pickled)
        "iter", "buckets", "bucket_resets", "last_loss", "totals", "last_stats", "_clear_iter", "chooser",
        "lowrank_codec",
        # run time only (not pickled)
        "_worker", "_collectives", "_direct", "_lowrank",
    )
    _RUNTIME = ("process_group", "store", "_worker", "_collectives", "_direct", "_lowrank")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        codec: str | Codec = DEFAULT_CODEC,
        collective: str = "auto",
        *,
        warmup_iters: int = DEFAULT_WARMUP_ITERS,
        server: int | str = 0,
        normalize: str = "world",
        lossy_pull: bool = False,
        transport: Any = None,
        host: str | None = None,
        timeout: float = 60.0,
        store: dist.Store | None = None,
        chooser: DropChooser | bool | str | None = "auto",
        wire_dtype: str | torch.dtype | None = "auto",
        sparse: bool = False,
        p_warmup: int | str = "auto",
        **deprecated: Any,
    ) -> None:
        chooser, wire_dtype = _deprecated_keywords(deprecated, chooser, wire_dtype)
        _check_options(collective, warmup_iters, sparse, p_warmup)
        self.process_group = process_group
        self.store = store
        self.codec = make_codec(codec)
        if isinstance(self.codec, LowRankCodec):
            chooser, wire_dtype, transport = _low_rank_options(self.codec, collective, chooser, wire_dtype, transport)
        self.warmup_codec = make_codec("dense")
        self.collective = collective
        self.server = server
        self.normalize = normalize
        self.lossy_pull = lossy_pull
        self.warmup_iters = warmup_iters
        self.transport = checked_transport(transport)
        self.host = host
        self.timeout = timeout
        self.sparse = bool(sparse)
        self.iter = 0
        self.buckets: dict[int, tuple[int, str, tuple[int, ...]]] = {}
        self.bucket_resets = 0
        self.last_loss: float | None = None
        self.totals: dict[str, Any] = _new_totals()
        self.last_stats: dict[int, dict] = {}
        self._worker: TrioWorker | None = None
        self._collectives: tuple[Any, Any] | None = None
        self._direct: tuple[Any, Any] | None = None  # collective="auto": the direct pair, when the chooser offers it
        self._lowrank: Any = None  # the chooser's low-rank path: its LowRankAllReduce, built on first use
        self._clear_iter = -1
        default = is_default_codec(codec)
        self.p_warmup = _p_warmup(p_warmup, default, self.codec)
        self.wire_dtype = _wire_dtype(wire_dtype, default)
        self.chooser: DropChooser | None = _chooser(chooser, default, warmup_iters, self.codec, collective)
        self.lowrank_codec: LowRankCodec | None = _chooser_low_rank(self.chooser, collective)

    # -- the loss feed ----------------------------------------------------------------------------------------
    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """Feed the training loss to the codec's p schedule (DGT: p = p0 * loss_t / loss_0). Call once per step
        with this rank's loss; a tensor is read with ``float()`` (a device sync on CUDA)."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self.last_loss = value
        self.codec.observe_loss(value)

    @property
    def past_warmup(self) -> bool:
        """Whether the current iteration uses the configured codec (False during the dense warm-up)."""
        return self.iter >= self.warmup_iters

    # -- run time ---------------------------------------------------------------------------------------------
    @property
    def worker(self) -> TrioWorker:
        """The background trio worker, created on first use; its thread connects the group asynchronously."""
        if self._worker is None:
            pg = self.process_group
            if pg is None:
                if not dist.is_initialized():
                    raise RuntimeError("DGTState needs torch.distributed initialised (or an explicit process_group)")
                pg = self.process_group = dist.distributed_c10d._get_default_group()
            store = self.store if self.store is not None else dist.distributed_c10d._get_default_store()
            with _starts_lock:
                n = next(_starts)
            prefix = f"dgt-hook/{_group_name(pg)}/{n}"
            connect = group_connector(pg.rank(), pg.size(), store=store, config=self.transport,
                                      host=self.host, timeout=self.timeout, prefix=prefix)
            self._worker = TrioWorker(connect, name=f"dgt-hook-{n}")
        return self._worker

    def collectives(self, group: Any) -> tuple[Any, Any]:
        """(warm-up collective, main collective) on ``group``; built once, in the worker thread. With a wire dtype
        the main collective sums (:meth:`lossy_input` divided by the world size already)."""
        if self._collectives is None or self._collectives[0].group is not group:
            op = "mean" if self.wire_dtype is None else "sum"
            self._collectives = (self._make(group, self.warmup_codec), self._make(group, self.codec, op))
            self._direct = None
            self._lowrank = None
            if self.chooser is not None:  # (the direct modes' bound: DropChooser.world)
                self.chooser.world = group.world
            if self.collective == "auto" and self.chooser and group.world >= DIRECT_MIN_WORLD:
                extra = (LOWRANK,) if LOWRANK in self.chooser.modes else ()
                # before its first iteration (the first call, on every rank); the screened window's order
                self.chooser.offer(screen_order(ALL_MODES + extra))
        return self._collectives

    def pick(self, group: Any, use_codec: bool, it: int | None) -> tuple[Any, str]:
        """(the collective, its mode) for a bucket of iteration ``it``: the warm-up and the lossless path take the
        lossless collective (mode ``LOSSLESS``), else the main one (``LOSSY``); on the direct all-reduce when the
        chooser's mode for ``it`` says so (``collective="auto"``), on the low-rank all-reduce for its ``LOWRANK``
        mode. Called in the worker thread, in job order."""
        warm, main = self.collectives(group)
        mode = LOSSLESS if not use_codec else LOSSY if self.chooser is None or it is None else self.chooser.mode(it)
        if mode == LOWRANK:
            if self._lowrank is None:
                from dgt.collectives.lowrank import LowRankAllReduce

                self._lowrank = LowRankAllReduce(group, self.lowrank_codec, op="mean",  # type: ignore[arg-type]
                                                 inner=LOW_RANK_INNER[self.collective])
            return self._lowrank, mode
        lossy = mode in LOSSY_MODES
        if mode not in DIRECT_MODES:
            return (main if lossy else warm), mode
        if self._direct is None:
            from dgt.collectives import DirectAllReduce

            op = "mean" if self.wire_dtype is None else "sum"
            self._direct = (DirectAllReduce(group, self.warmup_codec), DirectAllReduce(group, self.codec, op=op))
        return self._direct[1 if lossy else 0], mode

    def warm_p(self, it: int | None) -> None:
        """Set the codec's warm-up of p for a lossy round of iteration ``it`` (``p_warmup``; worker thread, before
        the round): ``ramp = (it - warmup_iters) / p_warmup``, capped at 1. Within a probe window of the chooser
        ``it`` is the window's first iteration: p holds still while the chooser times its paths, so it compares
        them at one p (the lossy ring and the lossy direct all-reduce are probed several iterations apart).
        Nothing without a warm-up or without an iteration number."""
        if self.p_warmup and it is not None and isinstance(self.codec, DGTCodec):
            first = None if self.chooser is None else self.chooser.window_first(it)
            at = it if first is None else first
            self.codec.ramp = min(1.0, max(0, at - self.warmup_iters) / self.p_warmup)

    @property
    def low_rank(self) -> bool:
        """Whether the configured codec is the low-rank one (PowerSGD factors): its main collective is a
        :class:`~dgt.collectives.lowrank.LowRankAllReduce`, which takes the bucket's tensor shapes."""
        return isinstance(self.codec, LowRankCodec)

    @property
    def needs_shapes(self) -> bool:
        """Whether the hook must pass the buckets' tensor shapes: the configured codec or the chooser's low-rank
        path reads matrices."""
        return self.low_rank or self.lowrank_codec is not None

    def clear_codecs(self) -> None:
        """DDP rebuilt its buckets: drop every codec's per-bucket state (worker thread)."""
        self.codec.load_state_dict({})
        if self.lowrank_codec is not None:
            self.lowrank_codec.load_state_dict({})

    def _make(self, group: Any, codec: Codec, op: str = "mean") -> Any:
        from dgt.collectives import DirectAllReduce, ParameterServer, RingAllReduce

        if isinstance(codec, LowRankCodec):
            from dgt.collectives.lowrank import LowRankAllReduce

            return LowRankAllReduce(group, codec, op=op, inner=LOW_RANK_INNER[self.collective])
        if self.collective == "direct":
            return DirectAllReduce(group, codec, op=op)
        if self.collective in ("ring", "auto"):
            ring = RingAllReduce(group, codec, op=op)
            ring.sparse_gather = codec.capabilities.lossy_tolerant  # the lossy path's all-gather: nonzero blocks only
            ring.hold_own = self.sparse and codec.capabilities.lossy_tolerant  # ... and only the blocks that arrived
            return ring
        return ParameterServer(group, codec, op=op, server=self.server, normalize=self.normalize,
                               lossy_pull=self.lossy_pull)

    def lossy_input(self, buf: torch.Tensor, world: int) -> torch.Tensor:
        """What the main (lossy) collective reduces: ``buf`` itself, or, with a wire dtype, ``buf / world`` in that
        dtype (a float32/float64 bucket; a narrower one keeps its dtype) for the summing collective."""
        if self.wire_dtype is None:
            return buf
        scaled = buf / world
        if buf.dtype in (torch.float32, torch.float64):
            return scaled.to(self.wire_dtype)
        return scaled

    def lossy_now(self, it: int | None) -> bool:
        """Whether iteration ``it`` (past the warm-up) runs the configured codec: always without a chooser (or
        without an iteration number), else as the chooser plans. Called in the worker thread, in job order."""
        return self.chooser is None or it is None or self.chooser.mode(it) in LOSSY_MODES

    async def open_paths(self, group: Any) -> None:
        """Connect to the peers the chooser's paths need before the hook times DDP's first iteration (the lossless
        ring's first figure), so neither it nor a probe pays for a handshake (on the ``lossy`` profile a lost one
        made the low-rank path's first iteration 0.7-1.1 s): every other rank for a path on the direct all-reduce
        (direct modes, or low rank on ``"auto"``/``"direct"``), else the ring's two neighbours (none for ``"ps"``).
        Connected peers return at once (worker thread, in job order)."""
        ch = self.chooser
        if ch is None or group.world < 2:
            return
        if any(m in DIRECT_MODES for m in ch.modes) or (LOWRANK in ch.modes and LOW_RANK_INNER.get(
                self.collective) == "direct"):
            await group.links([r for r in range(group.world) if r != group.rank])
        elif self.collective in ("ring", "auto"):
            await group.links({(group.rank + 1) % group.world, (group.rank - 1) % group.world})

    async def after_round(self, group: Any, it: int, last: bool, seconds: float) -> None:
        """Feed one bucket's collective time to the chooser (worker thread); at the close of a probe window (after
        the iteration's last bucket, the same job on every rank) the ranks agree on the mean of their figures with
        a tiny lossless all-reduce and the chooser decides."""
        ch = self.chooser
        ch.observe(it, seconds, last)
        if not last:
            return
        agreed = await self._agree(group) if ch.screening(it) else None
        if agreed is not None:
            ch.cut(it, agreed)  # (a cut can close the window here: it drops the window's later probes)
        if ch.due(it):  # one agreement serves both: a cut leaves the figures as they were
            ch.decide(it, agreed if agreed is not None else await self._agree(group))
            self.totals["choice"] = ch.summary()

    async def _agree(self, group: Any) -> list[float]:
        """The mean over ranks of the chooser's :meth:`~DropChooser.local` figures: one tiny all-reduce on the
        lossless collective, bit-identical on every rank. A mode without a figure (one that sat out the window:
        DropChooser.skip) travels as -1, not NaN; every rank runs the same schedule, so either all ranks have a
        figure for a mode or none has."""
        warm, _main = self.collectives(group)
        assert self.chooser is not None
        mine = torch.tensor([-1.0 if math.isnan(x) else x for x in self.chooser.local()], dtype=torch.float32)
        res = await warm.allreduce(mine, AGREE_BUCKET)
        return [x if x >= 0 else math.nan for x in res.tensor.tolist()]

    def note_bucket(self, index: int, numel: int, dtype: torch.dtype, segments: list[int]) -> bool:
        """Record a bucket's geometry; True when it changed (DDP rebuilt its buckets) and this is the first change
        seen in this iteration, i.e. the hook should drop the codec's per-bucket state before the next round."""
        sig = (numel, str(dtype), tuple(segments))
        old = self.buckets.get(index)
        if old == sig:
            return False
        self.buckets[index] = sig
        if old is None:
            return False
        self.bucket_resets += 1
        if self._clear_iter == self.iter:
            return False
        self._clear_iter = self.iter
        return True

    def record(self, index: int, stats: CollectiveStats, use_codec: bool, seconds: float,
               lossy: bool | None = None, mode: str | None = None) -> None:
        """Fold one bucket's collective statistics into the running totals (called in the worker thread).
        ``codec_buckets`` counts the buckets past the dense warm-up, ``lossy_buckets`` those of them that ran the
        configured codec or the chooser's low-rank path (``lossy``, default ``use_codec``; the chooser may have
        sent the others lossless); ``mode`` ``LOWRANK``: the low-rank path (its own entry in ``paths``)."""
        lossy = use_codec if lossy is None else lossy
        low = mode == LOWRANK
        t = self.totals
        t["buckets"] += 1
        t["codec_buckets"] += int(use_codec)
        t["lossy_buckets"] = t.get("lossy_buckets", 0) + int(lossy)
        t["blocks"] += stats.blocks
        t["dropped"] += stats.dropped
        t["held_blocks"] = t.get("held_blocks", 0) + stats.held_blocks  # (sparse=True: own values held back)
        t["seconds"] += seconds
        for lane, b in stats.bytes_sent.items():
            t["bytes_sent"][lane] = t["bytes_sent"].get(lane, 0) + b
        name = LOWRANK if low else "lossy" if lossy else "lossless"
        path = t.setdefault("paths", {}).setdefault(name, {"buckets": 0, "seconds": 0.0})
        path["buckets"] += 1
        path["seconds"] += seconds
        for name, sec in stats.phases.items():
            path[name] = path.get(name, 0.0) + sec
        codec = self.lowrank_codec.name if low and self.lowrank_codec else self.codec.name if lossy else "dense"
        entry = {"codec": codec, "seconds": seconds, "blocks": stats.blocks,
                 "dropped": stats.dropped, "bytes_sent": dict(stats.bytes_sent)}
        if mode is not None:
            entry["mode"] = mode
        p = self.codec.current_p() if lossy and not low else None
        if p is not None:
            entry["p"] = p
        self.last_stats[index] = entry

    def transport_stats(self) -> dict[str, Any] | None:
        """The endpoint's counters (deadline waits, rounds closed by deadline, lanes), None before it connected.
        Read on the worker's trio thread, which owns them (:meth:`TrioWorker.transport_stats`)."""
        stats = None if self._worker is None else self._worker.transport_stats()
        return None if stats is None else stats.to_dict()

    def close(self) -> None:
        """Stop the worker thread and close the transport (the state stays usable: it reconnects on next use)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
            self._collectives = None
            self._direct = None
            self._lowrank = None

    # -- checkpointing ----------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, the store and the worker (like PowerSGDState); call between steps."""
        return {s: getattr(self, s) for s in self.__slots__ if s not in self._RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot in self._RUNTIME:
            setattr(self, slot, None)
        self.wire_dtype = None  # (checkpoints from before the wire option: the lossy path was not cast)
        self.chooser = None  # (checkpoints from before the chooser)
        self.lowrank_codec = None  # (checkpoints from before the chooser's low-rank path)
        self.sparse = False  # (checkpoints from before sparse=)
        self.p_warmup = 0  # (checkpoints from before p_warmup=)
        for k, v in state.items():
            setattr(self, k, v)
        if dist.is_initialized():
            self.process_group = dist.distributed_c10d._get_default_group()

    def state_dict(self) -> dict[str, Any]:
        return self.__getstate__()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keep = self.process_group, self.store
        self.close()
        self.__setstate__(state)
        self.process_group, self.store = keep if keep[0] is not None else (self.process_group, keep[1])

    def __repr__(self) -> str:
        wire = "native" if self.wire_dtype is None else str(self.wire_dtype).replace("torch.", "")
        chooser = "DropChooser(...)" if self.chooser is not None else "None"
        return (f"DGTState(codec={self.codec.name!r}, collective={self.collective!r}, warmup_iters={self.warmup_iters},"
                f" wire_dtype={wire!r}, chooser={chooser}, iter={self.iter})")


def _check_options(collective: str, warmup_iters: int, sparse: bool, p_warmup: int | str) -> None:
    """A ValueError for a collective that does not exist, a negative warm-up, or ``sparse`` off the ring."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, not {collective!r}")
    if p_warmup != "auto" and (isinstance(p_warmup, str) or p_warmup < 0):
        raise ValueError(f"p_warmup must be 'auto' or an iteration count >= 0, not {p_warmup!r}")
    if warmup_iters < 0:
        raise ValueError("warmup_iters must be >= 0")
    if sparse and collective not in ("ring", "auto"):
        raise ValueError(f"sparse=True holds back on the ring's lossy path: collective 'ring' or 'auto', not "
                         f"{collective!r}")


def _p_warmup(p_warmup: int | str, default_codec: bool, codec: Codec) -> int:
    """The warm-up of p in iterations: ``"auto"`` is ``DEFAULT_P_WARMUP`` for the default codec and 0 for an
    explicitly given one; a count for a codec without a p is a ValueError."""
    if p_warmup == "auto":
        return DEFAULT_P_WARMUP if default_codec else 0
    if p_warmup and not isinstance(codec, DGTCodec):
        raise ValueError(f"p_warmup warms up DGT's p: codec {codec.name!r} has none")
    return int(p_warmup)


def is_default_codec(codec: str | Codec) -> bool:
    """Whether ``codec`` is the default codec's spec, compared parsed (name and options, values as numbers), not as
    text: ``"dgt:idle_p=0.10"`` and ``"dgt: idle_p=0.1"`` are the default as much as ``DEFAULT_CODEC`` itself, and get
    its chooser and fp16 wire. A ``Codec`` instance is an explicit choice."""
    if not isinstance(codec, str):
        return False
    try:
        return parse_spec(codec) == parse_spec(DEFAULT_CODEC)
    except ValueError:  # not a spec at all: make_codec says why
        return False


def _deprecated_keywords(given: dict[str, Any], chooser: Any, wire_dtype: Any) -> tuple[Any, Any]:
    """``choose=`` and ``wire=`` (before issue 44) onto ``chooser`` and ``wire_dtype``, each with a warning."""
    unknown = set(given) - {"choose", "wire"}
    if unknown:
        raise TypeError(f"DGTState() got unexpected keyword argument(s) {sorted(unknown)}")
    for old, new in (("choose", "chooser"), ("wire", "wire_dtype")):
        if old in given:
            warnings.warn(f"DGTState({old}=...) is deprecated: write DGTState({new}=...) (the old keyword goes away "
                          f"in the release after 0.1)", DeprecationWarning, stacklevel=3)
    if "choose" in given:
        chooser = "auto" if given["choose"] is None else given["choose"]
    if "wire" in given:
        wire_dtype = given["wire"]
    return chooser, wire_dtype


def _low_rank_options(codec: LowRankCodec, collective: str, chooser: Any, wire_dtype: Any, transport: Any
                      ) -> tuple[Any, Any, Any]:
    """(chooser, wire_dtype, transport) for the low-rank codec, or a ValueError saying what it cannot take: the
    parameter server (it does not drive the codec's two dependent reductions), a chooser (nothing is dropped on the
    factors' path: there is no lossless/lossy choice to time), a wire dtype (the factors stay in the bucket's float32
    or float64). With ``residual_p > 0`` the group's transport gets ``error_feedback=False`` (the residual blocks it
    loses must not be folded into other blocks' places; the codec keeps its own error feedback): set here when the
    transport is not given or given as a dict without the key; a dict or TransportConfig asking for it is refused."""
    if collective not in LOW_RANK_INNER:
        raise ValueError(f"codec {codec.name!r} runs on collective 'ring', 'direct' or 'auto', not {collective!r} "
                         f"(the parameter server does not drive the low-rank codec's two dependent reductions)")
    if chooser not in ("auto", None, False):
        raise ValueError(f"codec {codec.name!r} takes no chooser (its factors are never dropped: there is no lossless "
                         f"or lossy path to choose); leave chooser='auto' or pass None")
    if wire_dtype not in ("auto", "native", None):
        raise ValueError(f"codec {codec.name!r} takes no wire_dtype (its P and Q factors travel in the bucket's own "
                         f"float32/float64); leave wire_dtype='auto' or pass 'native' or None")
    if codec.residual_p > 0:
        if transport is None or (isinstance(transport, dict) and "error_feedback" not in transport):
            transport = {**(transport or {}), "error_feedback": False}
        elif transport_config(transport).error_feedback:
            raise ValueError(f"codec {codec.name!r} needs the transport's error feedback off (lost residual blocks "
                             f"would be folded into other blocks' places): pass error_feedback=False (or "
                             f"TransportConfig(error_feedback=False)), or leave the key out and the state turns it off")
    return None, None, transport


def _chooser(chooser: Any, default: bool, warmup_iters: int, codec: Codec, collective: str) -> DropChooser | None:
    """The state's chooser from its ``chooser`` argument (DGTState's docstring); None for a lossless codec."""
    if chooser == "auto":  # the default codec: its chooser with the low-rank path where the collective can run it
        chooser = ("lowrank" if collective in LOW_RANK_INNER else True) if default else None
    if chooser == "lowrank":
        chooser = DropChooser(start=warmup_iters, modes=DEFAULT_MODES)
    elif isinstance(chooser, str):
        raise ValueError(f"chooser must be a DropChooser, None, True, False, 'auto' or 'lowrank', not {chooser!r}")
    if chooser is True:
        chooser = DropChooser(start=warmup_iters, modes=screen_order((LOSSLESS, LOSSY)))
    if chooser and not codec.capabilities.lossy_tolerant:
        chooser = None  # a lossless codec has nothing to choose
    return chooser or None


def _chooser_low_rank(chooser: DropChooser | None, collective: str) -> LowRankCodec | None:
    """The codec of the chooser's low-rank path when it has that mode (``CHOOSER_LOW_RANK``), else None."""
    if chooser is None or LOWRANK not in chooser.modes:
        return None
    if collective not in LOW_RANK_INNER:
        raise ValueError(f"the chooser's low-rank path runs on collective 'ring', 'direct' or 'auto', not "
                         f"{collective!r}")
    return make_codec(CHOOSER_LOW_RANK)  # type: ignore[return-value]


def _wire_dtype(wire: str | torch.dtype | None, default_codec: bool) -> torch.dtype | None:
    if wire is None:
        return None
    if isinstance(wire, torch.dtype):
        if wire not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be torch.float16 or torch.bfloat16, not {wire}")
        return wire
    if wire == "auto":
        return torch.float16 if default_codec else None
    if wire not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be 'auto' or one of {sorted(WIRE_DTYPES)}, not {wire!r}")
    return WIRE_DTYPES[wire]


def _new_totals() -> dict[str, Any]:
    return {"buckets": 0, "codec_buckets": 0, "lossy_buckets": 0, "blocks": 0, "dropped": 0, "seconds": 0.0,
            "bytes_sent": {}}


def _group_name(pg: dist.ProcessGroup) -> str:
    try:
        return str(pg.group_name)
    except Exception:  # a Python process group without a registered name
        return "pg"
