"""Exception types every dgt layer raises; one root so callers can catch all of dgt. Also how errors leave a trio
nursery: as the one error that ended an operation, not as an exception group of it."""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import trio

if sys.version_info < (3, 11):  # Python 3.10: the backport trio itself depends on (a builtin from 3.11)
    from exceptiongroup import BaseExceptionGroup


class DgtError(Exception):
    """Root of all dgt errors."""


class WireError(DgtError):
    """Bytes that are not a valid DGT frame (bad magic/version/type, lengths beyond limits, truncation)."""


class ProtocolError(DgtError):
    """A well-formed frame that makes no sense in the current state (unknown round, layout mismatch)."""


class PeerTimeout(DgtError):
    """A peer stopped answering: raised within the configured timeout instead of hanging."""


class PeerClosed(DgtError):
    """A peer closed its connection while an operation was pending."""

    bye: bool = False
    """The peer said goodbye first (closed its endpoint): a reason it sent (ABORT) may still be on its way."""
    mid_hop: bool = False
    """A stream lane closed in the middle of a hop's message: the peer may have aborted the call."""


class RendezvousTimeout(DgtError):
    """A rank never showed up at the rendezvous store within the timeout."""


class CodecMismatch(DgtError):
    """A codec was paired with a collective it cannot serve."""


class EmulationUnsupported(DgtError):
    """A requested network emulation property needs a kernel feature this machine lacks."""


class PrivilegeRequired(EmulationUnsupported):
    """Network emulation needs root, or the capabilities CAP_NET_ADMIN and CAP_SYS_ADMIN, which this process lacks
    (the kernel may well have every feature)."""


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``[exc]`` if it is no group."""
    inner = getattr(exc, "exceptions", None)
    if not inner:
        return [exc]
    return [leaf for e in inner for leaf in leaves(e)]


def root_cause(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (a collective's nursery fails once per peer task)."""
    return leaves(exc)[0]


@contextmanager
def single_error() -> Iterator[None]:
    """Re-raise an exception group whose leaves are all ordinary exceptions as its first leaf (the group becomes
    its ``__cause__``). trio >= 0.25 wraps every error that leaves a nursery in a group, older trio only several;
    callers of a collective or of ``connect`` expect ``PeerClosed``/``PeerTimeout`` itself either way.
    Cancellation and KeyboardInterrupt (BaseExceptions) pass through untouched, so trio still sees its own."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = leaves(group)
        if not all(isinstance(e, Exception) for e in found):
            raise
        # a mismatch between ranks explains the closed connections it causes: it is the one to report
        mismatch = [e for e in found if isinstance(e, RankMismatch)]
        raise (mismatch or found)[0] from group


@asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    """``trio.open_nursery()`` whose failure is the one error that ended it (:func:`single_error`), on every trio the
    package accepts: trio 0.22 raised a lone error as itself, trio >= 0.25 always wraps it in an exception group.
    Every nursery inside dgt is opened with this (tests/test_trio_compat.py checks it), so a caller's
    ``except PeerClosed`` works whichever trio pip picked."""
    with single_error():
        async with trio.open_nursery() as nursery:
            yield nursery


F = TypeVar("F", bound=Callable[..., Any])


def one_error(fn: F) -> F:
    """Decorator: :func:`single_error` around a coroutine function (a public operation that runs peer tasks)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        with single_error():
            return await fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class InputRejected(DgtError, ValueError):
    """A tensor or argument a collective cannot reduce correctly (a dtype the codec or op cannot carry bit-exactly,
    a class array that does not cover the bucket): refused before any traffic."""


OPS = ("", "sum", "mean")  # a collective's op as its call code's low two bits (0: none given)
CODEC_IDS = ("", "dense", "dgt", "qsgd", "olandraj", "slimdp", "gossip-quant", "dcd", "ecd", "naive-gossip", "lgc",
             "lowrank", "lowrank+dgt")
"""Codec names by their id in a call code's bits 2-5 (0: a codec not listed, unchecked). Append only: an id names
the same codec in every release, so ranks of two releases still compare it. At most 16 (bits 6-7: the call's plan)."""
assert len(CODEC_IDS) <= 16
PLAN_SHIFT = 6
"""A call's plan code (:attr:`dgt.collectives.plan.CallPlan.code`, two bits) sits in the call code's bits 6-7."""


def call_code(op: str, codec: str = "", plan: int = 0) -> int:
    """The frame header's codec byte for a collective call: its op in bits 0-1, its codec's id in bits 2-5, the code
    of the call's plan (which path it takes) in bits 6-7. Every receiver compares it with its own, so ranks that
    called with another op or codec, or planned the call differently, raise :class:`RankMismatch` on the first
    message instead of reducing payloads they read differently (or waiting for ones on another path)."""
    cid = CODEC_IDS.index(codec) if codec in CODEC_IDS else 0
    return OPS.index(op) | cid << 2 | (plan & 3) << PLAN_SHIFT


def _op_name(c: int) -> str:
    return OPS[c] if 0 < c < len(OPS) else f"op code {c}"


def _codec_name(c: int) -> str:
    return CODEC_IDS[c] if 0 < c < len(CODEC_IDS) else f"codec id {c}"


def op_mismatch(a: int, b: int, round: int) -> str:
    """The reason every rank gives when two call codes differ, the same whichever rank saw it (names sorted, no rank
    named): the ops when they differ, else the codecs, else the plans (the reduce phase on stream lanes on some
    ranks and in rounds on others: :func:`path_mismatch`, the reason the session-link watch of a stream exchange
    gives for the same disagreement; or the all-gather's sparse messages)."""
    ca, cb = (a >> 2) & 15, (b >> 2) & 15
    pa, pb = a >> PLAN_SHIFT, b >> PLAN_SHIFT
    if (a & 3) == (b & 3) and ca == cb and pa != pb:
        if (pa ^ pb) & 1:
            return path_mismatch(round)
        return (f"the ranks called a collective with different all-gather plans in round {round} (sparse messages on "
                f"some ranks, dense on others): different sparse_gather settings")
    if (a & 3) != (b & 3) or ca == cb:
        names = sorted(_op_name(c & 3) for c in {a & 3, b & 3})
        return f"the ranks called a collective with different ops ({' / '.join(names)}) in round {round}"
    names = sorted(_codec_name(c) for c in {ca, cb})
    return f"the ranks called a collective with different codecs ({' / '.join(names)}) in round {round}"


call_mismatch = op_mismatch


def shape_mismatch(round: int) -> str:
    """The reason every rank gives when the ranks called one collective with tensors of different sizes or dtypes,
    the same whichever rank saw it (two ranks may see it at once, each from its own side: what each saw goes in
    :attr:`RankMismatch.detail`, not in the reason)."""
    return f"the ranks called a collective with different sizes or dtypes in round {round}"


def path_mismatch(round: int) -> str:
    """The reason every rank gives when its peers took different paths for one call (stream lanes / rounds)."""
    return (f"the ranks called a collective with tensors that take different paths in round {round} (stream lanes on "
            f"some ranks, rounds on others): different dtypes, devices or memory layouts, or stream_hops settings")


class RankMismatch(ProtocolError):
    """Ranks called the same collective with different sizes, dtypes or ops, or collectives in different orders. The
    rank that sees it tells its peers (a control ABORT), so every rank of the call raises it with the same reason.
    ``remote``: the rank it was reported by (None where this rank saw it); ``detail``: what this rank saw, where it
    saw it (kept out of the message, which every rank shares)."""

    def __init__(self, message: str, remote: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.remote = remote
        self.detail = detail
