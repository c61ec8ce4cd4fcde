"""Length-prefixed framing on the reliable lane: the 48-byte DGT header is the length prefix.

Small frames are read in bulk into a preallocated staging buffer, their headers validated in one vectorised call,
and runs of them can be taken as one batch (:meth:`FrameReader.take_staged`). The payload of a large frame is
received with ``recv_into`` straight into the place the caller names (the receiver's round tensor), so bulk bytes
are copied once, by the kernel. After a large frame the next header is read on its own, so a following large
payload is not pulled through the staging buffer either.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dgt import wire
from dgt.channels.tcp import TcpChannel
from dgt.errors import WireError

KEEP = object()  # placement answer: deliver the whole frame (header + payload) to the caller
_LENGTH_DTYPE, _LENGTH_AT = wire.HEADER_DTYPE.fields["length"][:2]  # the payload length field and its offset
_LENGTH = struct.Struct(">I")  # that field (checked below) read on its own, without numpy's per-call cost
if _LENGTH_DTYPE != np.dtype(">u4"):
    raise AssertionError("the header's length field is no longer a big-endian u32")
LARGE = 64 << 10  # payloads at least this long are worth a header-only read before them


@dataclass
class ReadFrame:
    """One frame off the stream. ``landed``: the payload went into the caller's buffer. ``frame``: header +
    payload bytes for frames the caller asked to KEEP. Otherwise it was discarded. ``idle``: nothing further is
    staged (the next read will go to the socket)."""

    header: np.void
    landed: bool
    frame: memoryview | None
    idle: bool = False


@dataclass
class StagedBatch:
    """Whole frames taken from the staging buffer: headers, payload offsets into ``buf`` (valid until the next read)."""

    headers: np.ndarray
    payload_pos: np.ndarray
    buf: memoryview

    def __len__(self) -> int:
        return len(self.headers)


class FrameReader:
    """Reads frames from a :class:`TcpChannel`; a bad header raises :class:`WireError` (the stream cannot resync)."""

    STAGING = 1 << 20  # bytes staged per read once a peer is known (a handshake starts smaller: see reserve)

    def __init__(self, chan: TcpChannel, limits: wire.Limits, token: int, staging: int = STAGING) -> None:
        self.chan = chan
        self.limits = limits
        self.token = token
        self.buf = bytearray(max(staging, 2 * wire.HEADER_SIZE))
        self.mv = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.frames = 0
        self._last_len = 0
        self._headers = np.zeros(0, wire.HEADER_DTYPE)  # validated headers of staged frames, from _next on
        self._reasons = np.zeros(0, np.int8)
        self._pos = np.zeros(0, np.int64)  # their offsets in the staging buffer
        self._next = 0

    # -- staging
    def reserve(self, nbytes: int = STAGING) -> None:
        """Grow the staging buffer to at least ``nbytes``, keeping what is staged: a reader made small for a
        handshake (an unauthenticated connection must not hold a megabyte) gets its full size once the peer is in."""
        self._ensure_room(nbytes)

    def _ensure_room(self, need: int) -> None:
        if need > len(self.buf):
            grown = bytearray(need)
            grown[: self.end - self.start] = self.mv[self.start : self.end]
            self.buf, self.mv = grown, memoryview(grown)
            self.end -= self.start
            self.start = 0
            self._headers = self._headers[:0]
        elif self.start + need > len(self.buf):
            n = self.end - self.start
            self.mv[:n] = self.mv[self.start : self.end]
            self.start, self.end = 0, n
            self._headers = self._headers[:0]  # positions moved: rescan

    async def _fill(self, need: int) -> None:
        """Make ``need`` contiguous bytes available at ``start``."""
        if self.end - self.start >= need:
            return
        self._ensure_room(need)
        while self.end - self.start < need:
            # after a large payload ask for the header alone: the next payload may be large too (zero-copy)
            want = need - (self.end - self.start) if self._last_len >= LARGE else len(self.buf) - self.end
            self.end += await self.chan.recv_into(self.mv[self.end : self.end + want])

    def _scan(self) -> None:
        """Validate the header at ``start`` and every further whole header already staged in one vectorised call
        (a stream of small frames would otherwise pay numpy's per-call cost once per frame)."""
        pos, positions = self.start, []
        while pos + wire.HEADER_SIZE <= self.end:
            positions.append(pos)
            pos += wire.HEADER_SIZE + _LENGTH.unpack_from(self.buf, pos + _LENGTH_AT)[0]
        self._pos = np.asarray(positions, np.int64)
        self._next = 0
        if len(positions) == 1:  # the common case before a large payload: skip numpy's per-call overhead
            hb = bytes(self.mv[self.start : self.start + wire.HEADER_SIZE])
            self._headers = np.frombuffer(hb, wire.HEADER_DTYPE)
            self._reasons = np.array([wire.validate_one(hb, self.limits, self.token)], np.int8)
            return
        raw = np.frombuffer(self.mv, np.uint8)
        idx = self._pos[:, None] + np.arange(wire.HEADER_SIZE)
        self._headers = np.ascontiguousarray(raw[idx]).view(wire.HEADER_DTYPE).reshape(-1)
        self._reasons = wire.validate(self._headers, self.limits, self.token)

    def _header(self) -> np.void:
        if self._next >= len(self._headers) or self._pos[self._next] != self.start:
            self._scan()
        i = self._next
        self._next += 1
        if self._reasons[i]:
            raise WireError(f"invalid header: {wire.REASONS[int(self._reasons[i])]}")
        return self._headers[i]

    # -- reading
    async def next(self, place: Callable[[np.void], memoryview | object | None]) -> ReadFrame:
        """Read one frame. ``place(header)`` answers where its payload goes: a memoryview of exactly the payload
        length (received in place), :data:`KEEP` (returned with the header), or None (read and discarded)."""
        await self._fill(wire.HEADER_SIZE)
        h = self._header()
        hb = bytes(self.mv[self.start : self.start + wire.HEADER_SIZE])
        self.start += wire.HEADER_SIZE
        length = self._last_len = int(h["length"])
        self.frames += 1
        where = place(h)
        if isinstance(where, memoryview) and len(where) == length:
            k = min(length, self.end - self.start)
            where[:k] = self.mv[self.start : self.start + k]
            self.start += k
            if k < length:
                await self.chan.recv_exactly(where[k:])
            return ReadFrame(h, True, None, self.start == self.end)
        if where is KEEP:
            await self._fill(length)  # header already consumed: hand back header + payload as one frame
            frame = memoryview(hb + bytes(self.mv[self.start : self.start + length]))
            self.start += length
            return ReadFrame(h, False, frame, self.start == self.end)
        await self._skip(length)
        return ReadFrame(h, False, None, self.start == self.end)

    def take_staged(self, accept: Callable[[np.ndarray], np.ndarray], min_frames: int = 2) -> StagedBatch | None:
        """The longest run of valid, wholly staged frames from ``start`` on whose headers ``accept`` (vectorised,
        a bool per header) admits; None if fewer than ``min_frames``. The frames count as read."""
        if self.end - self.start < wire.HEADER_SIZE:
            return None
        if self._next >= len(self._headers) or self._pos[self._next] != self.start:
            self._scan()
        h = self._headers[self._next :]
        pos = self._pos[self._next :]
        ends = pos + wire.HEADER_SIZE + h["length"].astype(np.int64)
        ok = (self._reasons[self._next :] == 0) & (ends <= self.end) & accept(h)
        n = len(ok) if ok.all() else int(np.argmin(ok))
        if n < min_frames:
            return None
        batch = StagedBatch(h[:n], pos[:n] + wire.HEADER_SIZE, self.mv)
        self._next += n
        self.start = int(ends[n - 1])
        self.frames += n
        self._last_len = int(h["length"][n - 1])
        return batch

    async def _skip(self, length: int) -> None:
        k = min(length, self.end - self.start)
        self.start += k
        length -= k
        while length:
            self.start = self.end = 0
            self._headers = self._headers[:0]
            n = await self.chan.recv_into(self.mv[: min(length, len(self.buf))])
            length -= n
