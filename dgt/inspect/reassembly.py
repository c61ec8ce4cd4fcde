"""TCP stream reassembly for the reliable lane: order segments by sequence number, drop retransmitted bytes, note
capture gaps, then walk the length-prefixed DGT frames and resynchronise on the magic after garbage or a gap.

Each frame gets the capture time of the segment that completed it (when a receiver could first have decoded it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from dgt import wire

_PEEK = struct.Struct(">HBB")  # magic, version, ftype
_MAGIC = b"DG\x01"


@dataclass
class Stream:
    """One direction of one TCP connection, as contiguous bytes (gaps zero-filled)."""

    data: bytes
    seg_end: np.ndarray  # int64 stream offset just past each supplying segment, ascending
    seg_ts: np.ndarray  # capture time of each supplying segment
    seg_pkt: np.ndarray  # packet index of each supplying segment
    gaps: list[tuple[int, int]]  # [start, end) byte ranges missing from the capture
    retransmitted: int = 0  # segments that brought no new bytes (or only some)
    started_at_syn: bool = False


@dataclass
class StreamFrames:
    """Frames found in a stream: their headers, where they start, when they completed, and what went wrong."""

    headers: np.ndarray  # HEADER_DTYPE
    pos: np.ndarray  # int64 stream offset of each header
    ts: np.ndarray  # float64 completion time
    pkt: np.ndarray  # int64 packet index of the completing segment
    payloads: dict[int, bytes] = field(default_factory=dict)  # frame index -> payload, for non-DATA frames
    problems: dict[str, int] = field(default_factory=dict)  # 'resync' (garbage skipped), 'gap', 'truncated'
    skipped_bytes: int = 0
    tail_bytes: int = 0  # bytes after the last complete frame (capture ended mid-frame)


def reassemble(seq: np.ndarray, payloads: list[bytes], ts: np.ndarray, pkt: np.ndarray, syn_seq: int | None) -> Stream:
    """Build the byte stream of one TCP direction from its data segments (any order, with retransmissions)."""
    seq = np.asarray(seq, np.int64)
    if len(seq) == 0:
        return Stream(b"", np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), [])
    ref = int(seq[0]) if syn_seq is None else (syn_seq + 1) & 0xFFFFFFFF
    rel = ((seq - ref + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)  # signed distance, wrap-safe for streams < 2 GiB
    start = 0 if syn_seq is not None else int(rel.min())
    rel = rel - start
    order = np.lexsort((np.arange(len(rel)), rel))
    out: list[bytes] = []
    ends: list[int] = []
    sts: list[float] = []
    spk: list[int] = []
    gaps: list[tuple[int, int]] = []
    end = 0
    retrans = 0
    if syn_seq is not None and len(rel) and int(rel.min()) < 0:
        # data before the SYN's sequence number cannot be; treat the earliest byte as the start instead
        rel = rel - int(rel.min())
    for i in order.tolist():
        s = int(rel[i])
        d = payloads[i]
        e = s + len(d)
        if e <= end:
            retrans += 1
            continue
        if s > end:
            gaps.append((end, s))
            out.append(bytes(s - end))
        elif s < end:
            retrans += 1
            d = d[end - s :]
        out.append(d)
        end = e
        ends.append(e)
        sts.append(float(ts[i]))
        spk.append(int(pkt[i]))
    return Stream(
        b"".join(out),
        np.asarray(ends, np.int64),
        np.asarray(sts, np.float64),
        np.asarray(spk, np.int64),
        gaps,
        retrans,
        syn_seq is not None,
    )


_MAX_FTYPE = int(max(wire.FrameType))


def _plausible(data: bytes, pos: int, limits: wire.Limits) -> bool:
    """Cheap check that a frame header starts at ``pos`` (magic, version, type, bounded length)."""
    if pos + wire.HEADER_SIZE > len(data):
        return False
    magic, version, ftype = _PEEK.unpack_from(data, pos)
    if magic != wire.MAGIC or version != wire.VERSION or not 1 <= ftype <= _MAX_FTYPE:
        return False
    return int.from_bytes(data[pos + 44 : pos + 48], "big") <= limits.max_payload


def _in_gap(gaps: list[tuple[int, int]], a: int, b: int) -> tuple[int, int] | None:
    for g in gaps:
        if g[0] < b and a < g[1]:
            return g
    return None


def _resync(data: bytes, pos: int, limits: wire.Limits, gaps: list[tuple[int, int]]) -> int:
    """Next offset >= pos where a plausible header starts and the chain after it also holds (or ends the stream)."""
    while True:
        pos = data.find(_MAGIC, pos)
        if pos < 0:
            return len(data)
        if _plausible(data, pos, limits) and _in_gap(gaps, pos, pos + wire.HEADER_SIZE) is None:
            nxt = pos + wire.HEADER_SIZE + int.from_bytes(data[pos + 44 : pos + 48], "big")
            if nxt >= len(data) or _plausible(data, nxt, limits):
                return pos
        pos += 1


def _header_table(data: bytes, starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(start offsets, headers as a HEADER_DTYPE array) of the frames starting at ``starts`` in ``data``."""
    spos = np.asarray(starts, np.int64)
    if not len(spos):
        return spos, np.zeros(0, wire.HEADER_DTYPE)
    raw = np.frombuffer(data, np.uint8)
    hdr = raw[spos[:, None] + np.arange(wire.HEADER_SIZE)[None, :]]
    return spos, np.ascontiguousarray(hdr).view(wire.HEADER_DTYPE).reshape(-1)


def frames(stream: Stream, limits: wire.Limits = wire.DEFAULT_LIMITS) -> StreamFrames:
    """Walk the length-prefixed frames of a stream. Never raises: bad bytes are skipped and counted."""
    data = stream.data
    n = len(data)
    starts: list[int] = []
    problems: dict[str, int] = {}
    skipped = 0
    gaps = stream.gaps

    def note(what: str) -> None:
        problems[what] = problems.get(what, 0) + 1

    pos = 0
    if n and not _plausible(data, 0, limits):
        if not stream.started_at_syn:
            # the capture began mid-stream: finding the first frame boundary is expected, not an error
            pos = _resync(data, 0, limits, gaps)
            skipped += pos
            if pos:
                note("midstream-start")
    hs = wire.HEADER_SIZE
    while pos + hs <= n:
        g = _in_gap(gaps, pos, pos + hs)
        if g is not None:
            note("gap")
            nxt = _resync(data, g[1], limits, gaps)
            skipped += nxt - pos
            pos = nxt
            continue
        if not _plausible(data, pos, limits):
            note("resync")
            nxt = _resync(data, pos + 1, limits, gaps)
            skipped += nxt - pos
            pos = nxt
            continue
        end = pos + hs + int.from_bytes(data[pos + 44 : pos + 48], "big")
        if end > n:
            break
        starts.append(pos)
        pos = end
    tail = n - pos if pos < n else 0
    if tail:
        note("truncated")
    spos, headers = _header_table(data, starts)
    fend = spos + hs + headers["length"].astype(np.int64)
    seg = np.searchsorted(stream.seg_end, fend, side="left")
    seg = np.minimum(seg, max(len(stream.seg_end) - 1, 0))
    ts = stream.seg_ts[seg] if len(stream.seg_ts) else np.zeros(len(spos))
    pk = stream.seg_pkt[seg] if len(stream.seg_pkt) else np.zeros(len(spos), np.int64)
    payloads = {}
    data_like = (headers["ftype"] == wire.FrameType.DATA) | (headers["ftype"] == wire.FrameType.BULK)
    for i in np.flatnonzero(~data_like).tolist():  # control payloads only: element data is never copied
        p = int(spos[i]) + hs
        payloads[i] = data[p : p + int(headers["length"][i])]
    return StreamFrames(headers, spos, ts, pk, payloads, problems, skipped, tail)
