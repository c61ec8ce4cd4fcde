"""The DROP_REPORT payload: the bitmap of arrived blocks and, with flag TIMING, a timing trailer that feeds the
sender's congestion controller and send budget (``docs/protocol.md``).

Trailer (big-endian, after the bitmap), version 2 (``TRAILER_SIZE`` bytes): u8 trailer version, u8 reserved, u16
reserved, u32 unimportant datagrams received, i64 receiver clock (ns) at the first and at the last of them, i64 ns the
receiver waited after the important blocks were complete (its deadline wait), u64 unimportant bytes received (headers
included), i64 receiver clock (ns) when it closed the round. Version 1 (``TRAILER_V1_SIZE`` bytes, what receivers
before the close time send) is the same without the last field; both are decoded, and the payload size must be the
one of the version its first byte names. A report without the flag is the bare bitmap.

The close time lets the sender tell a datagram lost on the way from one that left too late to count: a datagram sent
after ``close - base one-way delay`` (sender clock) could not have arrived before the round closed, so the congestion
controller does not count it as sent (``dgt.protocol.congestion.round_feedback``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from dgt import wire

TRAILER_V1 = struct.Struct(">BBHIqqqQ")
TRAILER = struct.Struct(">BBHIqqqQq")
TRAILER_SIZE = TRAILER.size  # what this version sends
TRAILER_V1_SIZE = TRAILER_V1.size
TRAILER_VERSION = 2
_SIZES = {1: TRAILER_V1_SIZE, 2: TRAILER_SIZE}  # trailer version -> bytes
_NS = 1e9


@dataclass(frozen=True)
class Timing:
    """What the receiver saw of a round's unimportant datagrams (times in seconds of the receiver's clock).
    ``close``: when it closed the round (None: a version 1 trailer, which does not say)."""

    datagrams: int
    first: float | None
    last: float | None
    wait: float
    nbytes: int
    close: float | None = None


def _ns(t: float | None) -> int:
    return -1 if t is None else int(round(t * _NS))


def encode_timing(t: Timing) -> bytes:
    return TRAILER.pack(TRAILER_VERSION, 0, 0, min(t.datagrams, 0xFFFFFFFF), _ns(t.first), _ns(t.last),
                        int(round(max(t.wait, 0.0) * _NS)), max(t.nbytes, 0), _ns(t.close))  # fmt: skip


def split_report(payload: bytes | memoryview, nblocks: int, timed: bool) -> tuple[np.ndarray, Timing | None]:
    """(arrived mask over ``nblocks`` blocks, timing or None) of a DROP_REPORT payload; ``timed``: the frame has flag
    TIMING. Raises WireError on a payload of the wrong size or an unknown trailer version."""
    nbitmap = (nblocks + 7) // 8
    timing = None
    if timed:
        if len(payload) <= nbitmap:
            raise wire.WireError(f"drop report with timing: {len(payload)} bytes for {nblocks} blocks")
        ver = payload[nbitmap]
        size = _SIZES.get(ver)
        if size is None:
            raise wire.WireError(f"drop report timing trailer version {ver} unknown")
        if len(payload) != nbitmap + size:
            raise wire.WireError(f"drop report with a version {ver} timing trailer: {len(payload)} bytes for "
                                 f"{nblocks} blocks")  # fmt: skip
        if ver == 1:
            _, _, _, n, first, last, wait, nbytes = TRAILER_V1.unpack_from(payload, nbitmap)
            close = -1
        else:
            _, _, _, n, first, last, wait, nbytes, close = TRAILER.unpack_from(payload, nbitmap)
        timing = Timing(n, None if n == 0 or first < 0 else first / _NS, None if n == 0 or last < 0 else last / _NS,
                        wait / _NS, nbytes, None if close < 0 else close / _NS)  # fmt: skip
    elif len(payload) != nbitmap:
        raise wire.WireError(f"drop report of {len(payload)} bytes for {nblocks} blocks")
    got = np.unpackbits(np.frombuffer(payload[:nbitmap], np.uint8), count=nblocks).astype(bool)
    return got, timing


def decode_report(frame: wire.Frame) -> tuple[np.ndarray, Timing | None]:
    """(arrived mask over ``frame.count`` blocks, timing or None): :func:`split_report` of the frame's payload."""
    return split_report(frame.payload, frame.count, bool(frame.flags & wire.Flags.TIMING))
