"""Decode a read of datagrams (:func:`dgt.wire.decode_datagrams`) in one C pass when the extension is built.

The numpy decode costs ~40 numpy calls per read whatever its size (the header gather, ``validate``'s dozen masks,
the length check), about as much as landing the read's payloads once that is fused (``_nh.land``). ``_nh.decode``
does the same per datagram in one loop: the header copied out, the same reason code (the first failing check in
``validate``'s order, then the size check, then truncation), the payload position. :func:`dgt.wire.decode_datagrams`
stays the reference and the fallback; tests/test_fused_landing.py checks that both give the same ``Batch``."""

from __future__ import annotations

import numpy as np

from dgt import wire
from dgt.protocol import landing
from dgt.protocol.datagram_mac import _nh

_FTYPES = np.array([wire.FrameType.DATA, wire.FrameType.CONTROL, wire.FrameType.BULK, max(wire.FrameType)], np.int64)
_ITEMSIZE = np.ascontiguousarray(wire.ITEMSIZE, np.uint8)


def decode_datagrams(
    buf: bytes | bytearray | memoryview,
    sizes: np.ndarray | list[int],
    limits: wire.Limits = wire.DEFAULT_LIMITS,
    token: int | None = None,
    native: bool = True,
) -> wire.Batch:
    """:func:`dgt.wire.decode_datagrams`, in C when the extension is built (and ``native``)."""
    if not (landing.FUSED and native and hasattr(_nh, "decode")):
        return wire.decode_datagrams(buf, sizes, limits, token)
    mv = memoryview(buf).cast("B")
    sz = np.ascontiguousarray(sizes, np.int64)
    n = len(sz)
    h = np.empty(n, wire.HEADER_DTYPE)
    pos = np.empty(n, np.int64)
    reason = np.empty(n, np.int8)
    lim = np.array([limits.max_payload, limits.max_bucket_elems, limits.max_control, limits.max_rank], np.int64)
    _nh.decode(mv, sz, h, pos, reason, lim, _FTYPES, _ITEMSIZE, token is not None, 0 if token is None else token,
               wire.MAGIC, wire.VERSION, int(wire.Flags.MAC))
    return wire.Batch(h, pos, reason, mv)


def all_fragments(batch: wire.Batch, native: bool = True) -> bool:
    """Whether every datagram of ``batch`` is valid, DATA and a fragment (nothing for the receiver's screening to
    count or leave out): one C call when built, else numpy."""
    if landing.FUSED and native and hasattr(_nh, "all_fragments"):
        return bool(_nh.all_fragments(np.ascontiguousarray(batch.headers), np.ascontiguousarray(batch.reason, np.int8),
                                      int(wire.FrameType.DATA), int(wire.Flags.FRAGMENT)))
    h = batch.headers
    return bool(
        (batch.reason == 0).all() and (h["ftype"] == wire.FrameType.DATA).all()
        and ((h["flags"] & wire.Flags.FRAGMENT) != 0).all()
    )  # fmt: skip
