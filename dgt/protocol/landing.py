"""Fragment and run landing for :class:`dgt.protocol.receiver.RoundReceiver`: validate input against a round's
geometry, de-duplicate it, copy the payload into the round buffer and mark the blocks it completes (vectorised over
the frames of a batch). Each function returns whether the round may have progressed (the caller then checks it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from dgt import wire
from dgt.protocol.datagram_mac import DatagramMac, _nh
from dgt.protocol.datagram_rows import scatter_rows
from dgt.protocol.round_state import OpenRound, first_of
from dgt.protocol.stats import ReceiverCounters
from dgt.wire import Flags

# the C landing reads these header fields at fixed offsets (dgt/protocol/_nh.c): off when the layout differs
_C_FIELDS = {"flags": (4, "|u1"), "dtype": (5, "|u1"), "block": (28, ">u4"), "offset": (32, ">u8"),
             "count": (40, ">u4"), "length": (44, ">u4")}
_HEADER_FIELDS: dict[str, Any] = dict(wire.HEADER_DTYPE.fields or {})
FUSED = (
    _nh is not None and hasattr(_nh, "land") and wire.HEADER_DTYPE.itemsize == wire.HEADER_SIZE == 48
    and all((_HEADER_FIELDS[f][1], _HEADER_FIELDS[f][0].str) == c for f, c in _C_FIELDS.items())
)  # fmt: skip
_NO_MAC = np.zeros(0, np.uint64)


def _count_lane(r: OpenRound, lane: int, frames: int, nbytes: int) -> None:
    ls = r.stats.lane(lane)
    ls.frames += frames
    ls.bytes += nbytes


def mark_run(r: OpenRound, h: np.void, lane: int) -> bool:
    """Mark the blocks of one reliable-lane run (header ``h``, payload already in the buffer) as complete."""
    b0 = int(h["block"])
    off, cnt = int(h["offset"]), int(h["count"])
    b1 = int(np.searchsorted(r.geom.block_end, off + cnt)) + 1
    fresh = r.nfrag[b0:b1] < r.geom.frags_needed[b0:b1]
    n_fresh = int(fresh.sum())
    if n_fresh < b1 - b0:
        r.stats.duplicated += 1
    imp_done_before = int((r.important[b0:b1] & ~fresh).sum())
    r.nfrag[b0:b1] = r.geom.frags_needed[b0:b1]
    if int(h["flags"]) & Flags.IMPORTANT:
        r.important[b0:b1] = True
    r.n_done += n_fresh  # every block of the run is complete now
    r.n_imp_done += int(r.important[b0:b1].sum()) - imp_done_before
    r.lane_of[b0:b1] = lane
    _count_lane(r, lane, 1, wire.HEADER_SIZE + cnt * r.isz)
    return True


def land_runs(r: OpenRound, h: np.ndarray, src: np.ndarray, pos: np.ndarray, lane: int) -> bool:
    """Check runs against the layout (start on a block start, end on a block end), copy them, mark their blocks."""
    g, isz, nb = r.geom, r.isz, r.geom.nblocks
    blk = h["block"].astype(np.int64)
    off = h["offset"].astype(np.int64)
    cnt = h["count"].astype(np.int64)
    b = np.where(blk < nb, blk, 0)
    last = np.searchsorted(g.block_end, off + cnt)
    lastc = np.minimum(last, max(nb - 1, 0))
    good = (
        (blk < nb) & (h["dtype"] == r.dtype) & (cnt > 0) & (off == g.block_start[b]) & (last < nb)
        & (g.block_end[lastc] == off + cnt)
    )  # fmt: skip
    r.stats.rejected += int((~good).sum())
    h, b, last, off, cnt, pos = h[good], b[good], last[good], off[good], cnt[good], pos[good]
    if len(b) == 0:
        return False
    nbytes = cnt * isz
    if (nbytes == nbytes[0]).all():
        scatter_rows(r.raw, off * isz, src, pos, int(nbytes[0]))
    else:  # runs of different lengths: one slice copy per frame
        for o, p, n in zip(off.tolist(), pos.tolist(), nbytes.tolist()):
            r.raw[o * isz : o * isz + n] = src[p : p + n]
    per = last - b + 1  # blocks per run
    first = np.repeat(np.cumsum(per) - per, per)
    allb = np.repeat(b, per) + (np.arange(int(per.sum())) - first)
    ub, ufirst = np.unique(allb, return_index=True)
    again = np.ones(len(allb), dtype=bool)
    again[ufirst] = False  # a block seen earlier in this batch
    dup = again | (r.nfrag[allb] >= g.frags_needed[allb])
    r.stats.duplicated += int(np.logical_or.reduceat(dup, np.cumsum(per) - per).sum())
    done_before = r.nfrag[ub] >= g.frags_needed[ub]
    imp_done_before = int((done_before & r.important[ub]).sum())
    r.nfrag[ub] = g.frags_needed[ub]
    imp = np.repeat((h["flags"] & Flags.IMPORTANT) != 0, per)
    r.important[allb[imp]] = True
    r.lane_of[allb] = lane
    r.n_done += int((~done_before).sum())
    r.n_imp_done += int(r.important[ub].sum()) - imp_done_before
    _count_lane(r, lane, len(b), int((nbytes + wire.HEADER_SIZE).sum()))
    return True


def _scatter_fragments(r: OpenRound, off: np.ndarray, cnt: np.ndarray, src: np.ndarray, pos: np.ndarray) -> None:
    """Copy fragments into the round buffer: one strided scatter for the full ones, a slice per short tail."""
    isz = r.isz
    full = cnt == r.geom.frag
    fb = r.geom.frag * isz
    if full.all():
        scatter_rows(r.raw, off * isz, src, pos, fb)
    elif full.any():
        scatter_rows(r.raw, off[full] * isz, src, pos[full], fb)
    for i in np.flatnonzero(~full).tolist():
        r.raw[off[i] * isz : (off[i] + cnt[i]) * isz] = src[pos[i] : pos[i] + cnt[i] * isz]


def _note_arrival(r: OpenRound, k: int, now: float) -> None:
    """Arrival times of ``k`` unimportant frames at ``now``: the gaps the deadline policy reads, the report's span."""
    if r.last_arrival is not None:
        gap = max(now - r.last_arrival, 0.0) / k
        r.mean_gap = gap if r.mean_gap is None else 0.8 * r.mean_gap + 0.2 * gap
        span = max(now - r.last_arrival, 0.0)
        r.batch_gap = span if r.batch_gap is None else 0.8 * r.batch_gap + 0.2 * span
    r.last_arrival = now
    if r.first_arrival is None:
        r.first_arrival = now
    r.unimp_frames += k


def land_fragments(
    r: OpenRound,
    h: np.ndarray,
    src: np.ndarray,
    pos: np.ndarray,
    lane: int,
    now: float,
    mac: tuple[DatagramMac, int, ReceiverCounters] | None = None,
    native: bool = True,
) -> bool:
    """Validate, de-duplicate and scatter fragments into the round buffer. With ``mac`` (the datagram MAC, this
    receiver's rank, its counters) every fragment's MAC trailer is checked. One C call (:func:`land_fragments_c`)
    when the extension is built (and ``native``, and the MAC's own ``native``), else the numpy twin
    (:func:`land_fragments_numpy`); both land the same bytes and count the same (tests/test_fused_landing.py)."""
    if FUSED and native and (mac is None or mac[0].native):
        return land_fragments_c(r, h, src, pos, lane, now, mac)
    return land_fragments_numpy(r, h, src, pos, lane, now, mac)


def land_fragments_c(
    r: OpenRound,
    h: np.ndarray,
    src: np.ndarray,
    pos: np.ndarray,
    lane: int,
    now: float,
    mac: tuple[DatagramMac, int, ReceiverCounters] | None = None,
) -> bool:
    """:func:`land_fragments_numpy` in one call of the C extension (``_nh.land``): geometry checks, MAC, de-duplication
    (of several copies of a fragment in one batch the last lands, as in the twin), copy and marks, no numpy call
    per batch beyond the argument conversion."""
    g = r.geom
    key: np.ndarray = _NO_MAC
    tail, pads = _NO_MAC, _NO_MAC
    if mac is not None:
        dm, rank, counters = mac
        if r.pads is None:
            r.pads = dm.pads(r.key[0], rank, r.key[1], r.key[2], g.nblocks * g.frags_per_block)
        key, tail, pads = dm.key, dm.tail, r.pads
    rejected, bad_mac, dup, kept, kept_bytes, d_done, d_imp = _nh.land(
        np.ascontiguousarray(h), np.ascontiguousarray(pos, np.int64), src, r.raw, r.got, r.nfrag, r.important,
        r.lane_of, r.scratch_block(), g.block_start, g.block_end, g.frags_needed, g.nblocks, g.frags_per_block,
        g.frag, r.isz, int(r.dtype), lane, int(Flags.IMPORTANT), int(Flags.MAC), mac is not None, key, tail, pads)
    r.stats.rejected += rejected + bad_mac
    if bad_mac and mac is not None:
        mac[2].reject("bad-mac", bad_mac)
    r.stats.duplicated += dup
    r.n_done += d_done
    r.n_imp_done += d_imp
    if kept == 0:
        return False
    _count_lane(r, lane, kept, kept_bytes)
    _note_arrival(r, kept, now)
    return True


def land_fragments_numpy(
    r: OpenRound,
    h: np.ndarray,
    src: np.ndarray,
    pos: np.ndarray,
    lane: int,
    now: float,
    mac: tuple[DatagramMac, int, ReceiverCounters] | None = None,
) -> bool:
    """Validate, de-duplicate and scatter fragments into the round buffer (vectorised over the fragments): the
    reference for :func:`land_fragments_c`, and the path without the C extension."""
    g = r.geom
    blk = h["block"].astype(np.int64)
    off = h["offset"].astype(np.int64)
    cnt = h["count"].astype(np.int64)
    inb = blk < g.nblocks
    b = np.where(inb, blk, 0)
    rel = off - g.block_start[b]
    fidx = rel // g.frag
    good = (
        inb
        & (h["dtype"] == r.dtype)
        & (rel >= 0)
        & (rel % g.frag == 0)
        & (fidx < g.frags_needed[b])
        & (cnt == np.minimum(g.frag, g.block_end[b] - off))
    )
    if not good.all():
        r.stats.rejected += int((~good).sum())
        b, fidx, off, cnt, pos, h = b[good], fidx[good], off[good], cnt[good], pos[good], h[good]
    if mac is not None and len(b):  # before de-duplication: a forged copy must not shut out the genuine one
        dm, rank, counters = mac
        if r.pads is None:
            r.pads = dm.pads(r.key[0], rank, r.key[1], r.key[2], g.nblocks * g.frags_per_block)
        ok = dm.check_fragments(h, src, pos, r.pads, b, fidx, cnt, g.frag, r.isz, g.frags_per_block)
        if not ok.all():
            counters.reject("bad-mac", int((~ok).sum()))
            r.stats.rejected += int((~ok).sum())
            b, fidx, off, cnt, pos, h = b[ok], fidx[ok], off[ok], cnt[ok], pos[ok], h[ok]
    if len(b) == 0:
        return False
    fresh = first_of(b * g.frags_per_block + fidx, r.scratch_frag()) & ~r.got[b, fidx]
    if not fresh.all():
        r.stats.duplicated += int((~fresh).sum())
        b, fidx, off, cnt, pos = b[fresh], fidx[fresh], off[fresh], cnt[fresh], pos[fresh]
    if len(b):
        touched = b[first_of(b, r.scratch_block())]
        done_before = r.nfrag[touched] >= g.frags_needed[touched]
        imp_done_before = int((done_before & r.important[touched]).sum())
        _scatter_fragments(r, off, cnt, src, pos)
        r.got[b, fidx] = True
        np.add.at(r.nfrag, b, 1)
        r.lane_of[b] = lane
        r.important[b] |= (h["flags"][fresh] & Flags.IMPORTANT) != 0
        done_after = r.nfrag[touched] >= g.frags_needed[touched]
        r.n_done += int(done_after.sum()) - int(done_before.sum())
        r.n_imp_done += int((done_after & r.important[touched]).sum()) - imp_done_before
    _count_lane(r, lane, len(h), int((h["length"].astype(np.int64) + wire.HEADER_SIZE).sum()))
    _note_arrival(r, len(h), now)
    return True
