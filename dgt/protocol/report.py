"""The DROP_REPORT payload: the bitmap of arrived blocks and, with flag TIMING, a fixed-size timing trailer that
feeds the sender's congestion controller and send budget (``docs/protocol.md``).

Trailer (big-endian, ``TRAILER_SIZE`` bytes, after the bitmap): u8 trailer version (1), u8 reserved, u16 reserved,
u32 unimportant datagrams received, i64 receiver clock (ns) at the first and at the last of them, i64 ns the
receiver waited after the important blocks were complete (its deadline wait), u64 unimportant bytes received
(headers included). A report without the flag is the bare bitmap (what receivers before the trailer send).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from dgt import wire

TRAILER = struct.Struct(">BBHIqqqQ")
TRAILER_SIZE = TRAILER.size
TRAILER_VERSION = 1
_NS = 1e9


@dataclass(frozen=True)
class Timing:
    """What the receiver saw of a round's unimportant datagrams (times in seconds of the receiver's clock)."""

    datagrams: int
    first: float | None
    last: float | None
    wait: float
    nbytes: int


def encode_timing(t: Timing) -> bytes:
    first = -1 if t.first is None else int(round(t.first * _NS))
    last = -1 if t.last is None else int(round(t.last * _NS))
    return TRAILER.pack(TRAILER_VERSION, 0, 0, min(t.datagrams, 0xFFFFFFFF), first, last,
                        int(round(max(t.wait, 0.0) * _NS)), max(t.nbytes, 0))


def decode_report(frame: wire.Frame) -> tuple[np.ndarray, Timing | None]:
    """(arrived mask over ``frame.count`` blocks, timing or None). Raises WireError on a payload of the wrong size
    or an unknown trailer version."""
    nb = frame.count
    nbitmap = (nb + 7) // 8
    payload = frame.payload
    timing = None
    if frame.flags & wire.Flags.TIMING:
        if len(payload) != nbitmap + TRAILER_SIZE:
            raise wire.WireError(f"drop report with timing: {len(payload)} bytes for {nb} blocks")
        ver, _, _, n, first, last, wait, nbytes = TRAILER.unpack_from(payload, nbitmap)
        if ver != TRAILER_VERSION:
            raise wire.WireError(f"drop report timing trailer version {ver} unknown")
        timing = Timing(n, None if n == 0 or first < 0 else first / _NS, None if n == 0 or last < 0 else last / _NS,
                        wait / _NS, nbytes)
    elif len(payload) != nbitmap:
        raise wire.WireError(f"drop report of {len(payload)} bytes for {nb} blocks")
    got = np.unpackbits(np.frombuffer(payload[:nbitmap], np.uint8), count=nb).astype(bool)
    return got, timing
