"""What all collectives share: the codec pairing check, per-bucket codec state, timing of phases."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import trio

from dgt.codecs.base import BucketState, Codec
from dgt.codecs.registry import make_codec
from dgt.collectives.chunks import Chunking
from dgt.collectives.group import Group
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import (
    PLAN_SHIFT,
    CodecMismatch,
    DgtError,
    InputRejected,
    PeerClosed,
    PeerTimeout,
    RankMismatch,
    call_code,
)
from dgt.layout import BucketLayout
from dgt.transport.streams import Hop, HopResult

F = TypeVar("F", bound=Callable[..., Any])


def tells_peers(fn: F) -> F:
    """Decorator of a collective call (outside :func:`~dgt.errors.one_error`): a :class:`RankMismatch` this rank
    saw is sent to every peer before it is raised, so each rank of the call fails with the same reason at once
    instead of waiting for a round that will never come; a failed peer (PeerClosed, PeerTimeout, a failed connect)
    is explained (a peer's ABORT behind it, or the error naming the rank that went away) and told to the live peers
    (:meth:`~dgt.transport.Endpoint.call_failed`). Nested calls (gossip's ``mix`` over ``exchange``) do it once."""

    @functools.wraps(fn)
    async def wrapper(self: Collective, *args: Any, **kwargs: Any) -> Any:
        bucket_id = kwargs.get("bucket_id", args[1] if len(args) > 1 else 0)
        family = self.round_family if isinstance(bucket_id, int) else None
        before = self.group.round_of(family, bucket_id) if family is not None else -1
        try:
            return await fn(self, *args, **kwargs)
        except InputRejected as exc:
            if family is not None and not getattr(exc, "_dgt_told", False):
                setattr(exc, "_dgt_told", True)  # noqa: B010 - a mark on the exception object
                await _refuse(self, exc, family, bucket_id, before)
            raise
        except (RankMismatch, PeerClosed, PeerTimeout, ConnectionError) as exc:
            if getattr(exc, "_dgt_told", False):  # a call of this decorator inside this one handled it (gossip's mix)
                raise
            out = await _tell(self, exc)
            setattr(out, "_dgt_told", True)  # noqa: B010 - a mark on the exception object
            if out is exc:
                raise
            raise out.with_traceback(None) from exc

    return wrapper  # type: ignore[return-value]


async def _tell(coll: Collective, exc: BaseException) -> BaseException:
    """What :func:`tells_peers` does with a call's error: tell the peers, and return the error to raise."""
    ep = coll.group.endpoint
    if isinstance(exc, RankMismatch):
        if exc.remote is None:
            ep.abort_peers(str(exc))
            coll.group.publish_abort(str(exc))  # for ranks not connected to this one (lazy connections)
        return exc
    mismatch = await _peer_abort(coll, exc)
    if mismatch is not None:
        return mismatch
    peers = _call_peers(coll)
    # the error that names the rank that went away (a closed connection: once the links have seen it too)
    gone = await ep.failure(peers, min(1.0, ep.cfg.timeouts.peer) if isinstance(exc, PeerClosed) else 0.0)
    # ranks of this call that are not connected to it (a central server's other workers) would wait for this rank
    # until round_timeout; they fail now, with this text
    ep.call_failed(str(gone or exc))
    return exc if gone is None else gone


async def _refuse(coll: Collective, exc: InputRejected, family: str, bucket_id: int, before: int) -> None:
    """What :func:`tells_peers` does when this rank refuses a call's input (issue 45): the peers of the call, which
    took a round for it, are told (control REFUSED, scoped to that round), so they fail at once with RankMismatch
    instead of waiting for this rank. A refusal before any traffic uses up the round the call would have had, so the
    next call has the same round as on the peers (which took it) and a notice of this call never matches it; every
    rank refusing the same input (the common error) leaves the session usable."""
    g = coll.group
    tell = g.endpoint.refuse_round
    if g.world == 1:
        return
    rnd = g.round_of(family, bucket_id)
    if rnd == before:
        rnd = g.skip_round(family, bucket_id)
    try:  # the peers this call would talk to (lazy connections): a peer waits for this rank to dial it
        with trio.move_on_after(g.endpoint.cfg.timeouts.peer):
            await coll.connect()
    except (DgtError, OSError, ValueError):  # the notice goes to the peers that are connected
        pass
    tell(family, bucket_id, rnd, str(exc), _call_peers(coll))


def plain_input(t: Any, what: str = "bucket") -> torch.Tensor:
    """``t`` as the collectives reduce it: a contiguous (row-major) dense tensor, ``t`` itself when it is one, else a
    contiguous copy (a strided view, a transposed or channels-last tensor). :class:`~dgt.errors.InputRejected` for
    what no copy makes one (not a tensor, a sparse or other non-strided layout)."""
    if not isinstance(t, torch.Tensor):
        raise InputRejected(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.layout != torch.strided:
        raise InputRejected(f"{what} must be a dense (strided) tensor, not {t.layout}")
    return t if t.is_contiguous() else t.contiguous()


def any_layout(fn: F) -> F:
    """Decorator of a collective's ``allreduce(bucket, bucket_id, segments, *, out)``: the one place where any layout
    the public API accepts becomes the contiguous tensor every path and codec below expects. A non-contiguous
    ``bucket`` (a strided view, transposed, channels-last) is reduced from a contiguous working copy; a
    non-contiguous ``out`` (``bucket`` itself for an in-place all-reduce) gets the result written back into it.
    ``out`` of another size or dtype than ``bucket``: :class:`~dgt.errors.InputRejected`, before any traffic."""

    @functools.wraps(fn)
    async def wrapper(self: Collective, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None,
                      *, out: torch.Tensor | None = None) -> Any:
        work = plain_input(bucket)
        if out is None:
            return await fn(self, work, bucket_id, segments)
        plain_input(out, "out")
        if out.numel() != bucket.numel() or out.dtype != bucket.dtype:
            raise InputRejected(f"out must be a {bucket.dtype} tensor of {bucket.numel()} elements like the bucket, "
                                f"not {out.dtype} x {out.numel()}")
        if out.is_contiguous():
            return await fn(self, work, bucket_id, segments, out=out)
        res = await fn(self, work, bucket_id, segments)  # (work is a copy when out is bucket itself)
        with torch.no_grad():
            out.copy_(res.tensor.reshape(out.shape))
        res.tensor = out if out.shape == bucket.shape else out.reshape(bucket.shape)
        return res

    return wrapper  # type: ignore[return-value]


def _call_peers(coll: Collective) -> list[int]:
    cache = coll.__dict__.get("_peer_cache")
    return list(cache[1]) if cache is not None else coll.peers()


async def _peer_abort(coll: Collective, exc: BaseException) -> RankMismatch | None:
    """The mismatch behind a closed peer, if there is one. A peer that saw a mismatch in a stream hop shuts its
    stream lanes as it raises, and its ABORT (on the session link) may trail that by a moment; a rank that got another
    peer's ABORT closes its group (a goodbye) before that ABORT reaches us; a failed connect (ConnectionError) may be a
    peer that aborted: wait up to a second for the ABORT in those cases, less once one of the call's peers is known
    dead (a killed peer sends no ABORT: it is named at once, issue 45). A peer that hung up on our hello is closing
    (``bye``): it may have aborted on another rank's ABORT before this rank connected to it, and that rank's reason
    reaches this one as an ABORT on a live link or in the store, where it may land a moment after the hang-up (the
    detecting rank publishes it as its call raises: test_rank_mismatch's dtype-path case failed on that once)."""
    ep = coll.group.endpoint
    if isinstance(exc, ConnectionError) or (isinstance(exc, PeerClosed) and (exc.mid_hop or exc.bye)):
        mismatch = await ep.aborted(min(1.0, ep.cfg.timeouts.peer), dead=_call_peers(coll))  # less: a peer is dead
        if mismatch is not None:
            return mismatch
    why = coll.group.published_abort()
    return RankMismatch(why) if why else None


class Collective:
    name = "collective"
    round_family: str | None = None
    """The name its calls take rounds under (Group.next_round); a refused input is told to the call's peers."""
    needs_summable = False
    serves_stateful_server = False
    """Keeps the server-side state a ``stateful_server`` codec needs (the model server)."""
    serves_replica_deltas = False
    """Drives per-neighbour replicas for ``replica_deltas`` codecs (gossip)."""

    def __init__(self, group: Group, codec: str | Codec = "dense", op: str = "mean") -> None:
        if op not in ("sum", "mean"):
            raise ValueError("op must be 'sum' or 'mean'")
        self.group = group
        self.codec = make_codec(codec)
        self.op = op
        self.call_code = call_code(op, self.codec.name)  # on every message this collective sends (the header's codec
        # byte), so a rank whose peer called with another op or codec sees it (RankMismatch) on the first message
        # instead of returning a different answer or waiting for messages on another path
        if self.codec.runner is not None:
            raise CodecMismatch(f"codec {self.codec.name!r} is driven by {self.codec.runner}, not by the generic "
                                f"{self.name}")
        caps = self.codec.capabilities
        if caps.stateful_server and not self.serves_stateful_server:
            raise CodecMismatch(f"codec {self.codec.name!r} needs server-side state that the {self.name} does not keep "
                                f"(its result would be silently wrong); use the model server (ModelServer)")
        if caps.replica_deltas and not self.serves_replica_deltas:
            raise CodecMismatch(f"codec {self.codec.name!r} sends differences against per-neighbour replicas; only "
                                f"gossip nodes drive it (Gossip + dgt.codecs.decentralized), not the {self.name}")
        if self.needs_summable and not caps.summable:
            raise CodecMismatch(
                f"codec {self.codec.name!r} is not summable (its payloads cannot be added on the way), so it cannot "
                f"serve {self.name}; use the parameter server (gather-then-reduce) or a summable codec (dense, dgt)"
            )

    def peers(self) -> list[int]:
        """The ranks this collective exchanges with, i.e. the connections it needs; by default every other rank."""
        return [r for r in range(self.group.world) if r != self.group.rank]

    async def connect(self) -> None:
        """Connect to :meth:`peers` on the first call (lazily); later calls return without yielding."""
        g = self.group
        cache = self.__dict__.get("_peer_cache")
        if cache is None or cache[0] is not g:
            cache = self._peer_cache = (g, self.peers())
        await g.links(cache[1])

    def check_input(self, bucket: torch.Tensor) -> None:
        """Refuse, before any traffic, a bucket this call cannot reduce bit-exactly or correctly: a dtype the codec
        does not accept, or a mean of integers (it has no exact integer result; use op='sum')."""
        self.codec.check_input(bucket)
        if self.op == "mean" and not (bucket.dtype.is_floating_point or bucket.dtype.is_complex):
            raise InputRejected(f"op='mean' of a {bucket.dtype} tensor has no exact {bucket.dtype} result; "
                                f"use op='sum' (and divide yourself) or a floating tensor")

    def state(self, key: Hashable, t: torch.Tensor, segments: list[int] | None) -> BucketState:
        return self.codec.state_for(key, t, segments)

    @staticmethod
    @contextmanager
    def phase(stats: CollectiveStats, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            stats.phases[name] = stats.phases.get(name, 0.0) + time.perf_counter() - t0

    def finish(self, total: torch.Tensor, count: torch.Tensor | int | None = None,
               inplace: bool = False) -> torch.Tensor:
        if self.op == "sum":
            return total
        if count is None:
            count = self.group.world
        return total.div_(count) if inplace else total / count

    @staticmethod
    def working_copy(bucket: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The flat tensor a collective reduces in: a fresh copy of ``bucket``, or ``out`` (``bucket`` itself for an
        in-place all-reduce, like ``torch.distributed.all_reduce``), which saves allocating and faulting in a new
        bucket every call."""
        if out is None:
            return bucket.detach().reshape(-1).clone()
        if out.numel() != bucket.numel() or out.dtype != bucket.dtype or not out.is_contiguous():
            raise InputRejected(f"out must be a contiguous {bucket.dtype} tensor of {bucket.numel()} elements")
        flat = out.detach().view(-1)
        if out.data_ptr() != bucket.data_ptr():
            flat.copy_(bucket.detach().reshape(-1))
        return flat

    @staticmethod
    def result_buffer(bucket: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Where a collective that writes every element of its result puts it: ``out`` (checked, contents ignored)
        or a new tensor; unlike ``working_copy`` the input is not copied in first."""
        if out is None:
            return torch.empty(bucket.numel(), dtype=bucket.dtype, device=bucket.device)
        if out.numel() != bucket.numel() or out.dtype != bucket.dtype or not out.is_contiguous():
            raise InputRejected(f"out must be a contiguous {bucket.dtype} tensor of {bucket.numel()} elements")
        return out.detach().view(-1)

    def source_and_result(self, bucket: torch.Tensor, out: torch.Tensor | None,
                          reads_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(what a call sends and adds from, where its result goes). ``reads_only``: the call's path only reads its
        input and writes every element of its result (a lossless codec whose chunks are their own wire form): the
        input itself, and ``out`` or a new tensor, no copy first; else one working copy for both (a lossy round's
        drop report may come after the call returns, and the transport sends such a round from its own copy)."""
        if reads_only:
            return bucket.detach().reshape(-1), self.result_buffer(bucket, out)
        flat = self.working_copy(bucket, out)
        return flat, flat

    def alone(self, bucket: torch.Tensor, out: torch.Tensor | None, stats: CollectiveStats) -> CollectiveResult:
        """A group of one: the result is the input (``op`` applied), in ``out`` or a copy."""
        return CollectiveResult(self.finish(self.working_copy(bucket, out), inplace=True).view_as(bucket), stats)

    def code_of(self, stats: CollectiveStats) -> int:
        """The call code of the call ``stats`` belong to (the header's codec byte of its every message): this
        collective's op and codec, and the code of the call's plan (``stats.plan``, dgt.collectives.plan), so ranks
        that planned the call differently see it on the first message (RankMismatch)."""
        plan = stats.plan
        if plan is None:
            return self.call_code
        # from ``call_code``, which an owner may have set (the low-rank all-reduce's inner rings carry its op and codec)
        return (self.call_code & ~(3 << PLAN_SHIFT)) | (int(plan.code) & 3) << PLAN_SHIFT

    @staticmethod
    def count_exchange(stats: CollectiveStats, hops: list[Hop], done: list[HopResult], ch: Chunking,
                       flat: torch.Tensor) -> None:
        """Bytes and blocks of a stream exchange (hops and their results), all on lane 0. The blocks landed come
        from the call's geometry: ``ch`` cut the bucket ``flat`` that every hop lands in."""
        for h, d in zip(hops, done):
            if h.payload is not None:
                stats.add_sent(0, h.payload.numel() * h.payload.element_size())
            stats.bytes_received[0] = stats.bytes_received.get(0, 0) + d.received
            if h.land is not None:
                stats.blocks += ch.blocks_in(flat, h.land)

    def chunking(self, segments: list[int], block: int, k: int) -> Chunking:
        """Block-aligned chunks of a bucket, cached per geometry (a bucket keeps its shape from step to step)."""
        cache: dict[tuple[tuple[int, ...], int, int], Chunking] = self.__dict__.setdefault("_chunkings", {})
        key = (tuple(segments), block, k)
        ch = cache.get(key)
        if ch is None:
            if len(cache) >= 64:
                cache.clear()
            ch = cache[key] = Chunking(BucketLayout.of(segments, block), k)
        return ch
