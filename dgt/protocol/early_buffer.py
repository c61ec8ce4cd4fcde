"""The receiver's early buffer: input for rounds whose ROUND_BEGIN has not arrived yet (datagrams and frames often
overtake it), kept as bytes and replayed in arrival order when the round opens.

Bounded in bytes (all peers together, and per round: a quarter of that), in rounds per peer, and in age: forged
future rounds must not wait forever, and one round (forged or not) cannot take the whole buffer from the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from dgt import wire
from dgt.protocol.events import Key
from dgt.protocol.stats import ReceiverCounters
from dgt.wire import Flags


class EarlyEntry(NamedTuple):
    """Input for a round not open yet: one frame's bytes (``sizes`` None) or datagrams back to back (their sizes)."""

    key: Key
    lane: int
    data: bytes
    sizes: np.ndarray | None
    arrival: float


def reencode(f: wire.Frame) -> bytes:
    """A frame back to bytes (for the early buffer: frames that overtook their round's ROUND_BEGIN)."""
    h = wire.headers(1)
    h[0] = (wire.MAGIC, wire.VERSION, f.ftype, f.flags, f.dtype, f.codec, f.lane, f.token, f.rank, f.round,
            f.bucket, f.block, f.offset, f.count, len(f.payload))  # fmt: skip
    return h.tobytes() + bytes(f.payload)


def datagram_sizes(batch: wire.Batch, sel: np.ndarray) -> np.ndarray:
    """The sizes on the wire (header, payload, MAC trailer) of the selected datagrams of ``batch``."""
    hsel = batch.headers[sel]
    mac = ((hsel["flags"] & Flags.MAC) != 0) * wire.MAC_TAG
    sizes: np.ndarray = hsel["length"].astype(np.int64) + wire.HEADER_SIZE + mac
    return sizes


def pack_datagrams(batch: wire.Batch, sel: np.ndarray, sizes: np.ndarray) -> bytes:
    """The selected datagrams of ``batch`` (``sizes`` from :func:`datagram_sizes`) back to back."""
    src = np.frombuffer(batch.buf, np.uint8)
    starts = batch.payload_pos[sel] - wire.HEADER_SIZE
    data: bytes
    if (sizes == sizes[0]).all():
        n = int(sizes[0])
        rows = np.lib.stride_tricks.as_strided(src, shape=(len(src) - n + 1, n), strides=(1, 1))
        data = rows[starts].tobytes()
    else:  # odd-size tails mixed in: rare, a slice per datagram
        data = b"".join(src[a : a + n].tobytes() for a, n in zip(starts.tolist(), sizes.tolist()))
    return data


class EarlyBuffer:
    """Entries in arrival order; the limits are the receiver's ``early_*`` settings, refusals and expiries are
    counted in its ``counters``."""

    def __init__(self, counters: ReceiverCounters, max_bytes: int, ttl: float, rounds_per_peer: int) -> None:
        self.counters = counters
        self.max_bytes = max_bytes
        self.round_bytes = max(max_bytes // 4, 1)  # one round's share
        self.ttl = ttl
        self.rounds_per_peer = rounds_per_peer
        self.entries: list[EarlyEntry] = []
        self.size = 0  # bytes held

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[EarlyEntry]:
        return iter(self.entries)

    def expire(self, now: float) -> None:
        """Drop entries older than ``ttl`` (counted): a round whose opening never came in time was forged or
        abandoned, and must not be filled from them later."""
        if self.entries and now - self.entries[0].arrival > self.ttl:  # entries are in arrival order
            keep = [e for e in self.entries if now - e.arrival <= self.ttl]
            self.counters.early_expired += len(self.entries) - len(keep)
            self.entries = keep
            self.size = sum(len(e.data) for e in keep)

    def admit(self, key: Key, nbytes: int, now: float) -> bool:
        """Whether ``nbytes`` more of round ``key`` fit (after expiring old entries): a peer may hold at most
        ``rounds_per_peer`` rounds here, one round ``round_bytes``, all peers together ``max_bytes``; a refusal is
        counted (``early_refused``) either way, and the input is dropped (a datagram's blocks then reach error
        feedback as lost)."""
        self.expire(now)
        if self.size + nbytes > self.max_bytes:
            self.counters.early_refused += 1
            return False
        rounds = {e.key for e in self.entries if e.key[0] == key[0]}
        if key not in rounds and len(rounds) >= self.rounds_per_peer:
            self.counters.early_refused += 1
            return False
        if sum(len(e.data) for e in self.entries if e.key == key) + nbytes > self.round_bytes:
            self.counters.early_refused += 1
            return False
        return True

    def add(self, key: Key, lane: int, data: bytes, sizes: np.ndarray | None, now: float) -> None:
        """Keep ``data`` (already admitted) for round ``key``."""
        self.entries.append(EarlyEntry(key, lane, data, sizes, now))
        self.size += len(data)

    def take(self, key: Key, now: float) -> list[EarlyEntry]:
        """Remove and return the unexpired entries of round ``key`` (it just opened), in arrival order."""
        self.expire(now)
        if not self.entries:
            return []
        replay = [e for e in self.entries if e.key == key]
        self.entries = [e for e in self.entries if e.key != key]
        self.size = sum(len(e.data) for e in self.entries)
        return replay
