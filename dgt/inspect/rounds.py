"""Per-round accounting of a capture (the part of :func:`dgt.inspect.summary.summarize` that mirrors
:class:`dgt.protocol.receiver.RoundReceiver`): the frame table, rounds as seen on the wire, and what each round
received, lost, duplicated or got late, vectorised per round (no Python loop per frame).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dgt import wire
from dgt.inspect.pcapio import addr
from dgt.wire import Flags

# -- geometry (numpy twin of BucketLayout + Geometry, without torch) ------------------------------------------------


@dataclass
class Geom:
    block_start: np.ndarray
    block_end: np.ndarray
    needed: np.ndarray  # fragments per block
    frag: int
    per_block: int

    @classmethod
    def of(cls, sizes: list[int], block: int, frag: int) -> Geom:
        sizes_a = np.asarray(sizes, np.int64)
        nb = -(-sizes_a // block)
        offs = np.concatenate(([0], np.cumsum(sizes_a)[:-1])) if len(sizes_a) else np.zeros(0, np.int64)
        first = np.concatenate(([0], np.cumsum(nb)[:-1])) if len(nb) else np.zeros(0, np.int64)
        k = np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(first, nb)
        start = np.repeat(offs, nb) + k * block
        end = np.minimum(start + block, np.repeat(offs + sizes_a, nb))
        return cls(start, end, -(-(end - start) // frag), frag, -(-block // frag))

    @property
    def nblocks(self) -> int:
        return len(self.block_start)


@dataclass
class WireRound:
    key: tuple
    begin: tuple | None = None  # (ts, numel, block, frag, sizes, dtype)
    end: tuple | None = None  # (ts, (imp_blocks, unimp_blocks, imp_frames, unimp_frames))
    report: tuple | None = None  # (ts, received mask or None if malformed)
    rel: list[int] = field(default_factory=list)  # reliable DATA frame indices
    frag_rows: np.ndarray | None = None  # fragment indices


def group_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group rows by equal values in all ``cols``: (group id per row, first row of each group). A lexsort over
    integer columns: much faster than np.unique over structured or void rows."""
    n = len(cols[0]) if cols else 0
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort(cols[::-1])
    change = np.zeros(n, bool)
    change[0] = True
    for c in cols:
        cs = c[order]
        change[1:] |= cs[1:] != cs[:-1]
    inv = np.empty(n, np.int64)
    inv[order] = np.cumsum(change) - 1
    return inv, order[change]


def expand_ranges(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive block ranges -> (every block, index of its range)."""
    lens = last - first + 1
    run = np.repeat(np.arange(len(first)), lens)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(lens) else np.zeros(0, np.int64)
    return np.repeat(first, lens) + np.arange(int(lens.sum())) - np.repeat(starts, lens), run


def addr_cols(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An 'S16' address column as two uint64 columns."""
    u = np.ascontiguousarray(a.astype("S16")).view(np.uint8).reshape(-1, 16)
    w = np.ascontiguousarray(u).view(">u8").reshape(-1, 2).astype(np.uint64)
    return w[:, 0], w[:, 1]


def pair(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)


def segmented_reorder(group: np.ndarray, value: np.ndarray) -> np.ndarray:
    """For rows in arrival order: True where ``value`` is below the running maximum of earlier rows of its group."""
    n = len(group)
    if n == 0:
        return np.zeros(0, bool)
    order = np.lexsort((np.arange(n), group))
    g, v = group[order], value[order].astype(np.float64)
    span = float(v.max() - v.min() + 1) if n else 1.0
    boost = v + np.cumsum(np.r_[0, (np.diff(g) != 0)]) * span * 2  # later groups never see earlier maxima
    prev = np.maximum.accumulate(np.r_[-np.inf, boost[:-1]])
    first = np.r_[True, np.diff(g) != 0]
    out = np.zeros(n, bool)
    out[order] = ~first & (boost < prev)
    return out



@dataclass
class Frames:
    """Every DGT frame of the capture in one table: reliable frames (per stream, in stream order), then valid
    datagrams. Row i of every column describes frame i."""

    h: np.ndarray  # wire.HEADER_DTYPE headers
    ts: np.ndarray  # capture time of the packet that completed the frame
    pkt: np.ndarray  # that packet's row in the PacketTable
    flow: np.ndarray  # its flow id
    tcp: np.ndarray  # bool: came on the reliable (TCP) lane
    payloads: dict[int, bytes]  # payloads of reliable control frames, by frame row
    peer: np.ndarray  # destination address ('S16')
    src: np.ndarray  # source address ('S16')
    lane: np.ndarray  # lane from the header; 0 for every TCP frame
    reordered: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # see docs/inspect.md

    def __len__(self) -> int:
        return len(self.h)

    def round_key(self, i: int) -> tuple[int, int, int, int, bytes]:
        """(token, sender rank, bucket, round, destination) of frame ``i``."""
        h = self.h
        return int(h["token"][i]), int(h["rank"][i]), int(h["bucket"][i]), int(h["round"][i]), bytes(self.peer[i])


@dataclass
class Accounts:
    """What the per-round and bulk accounting add up across rounds: lane counters, timeline events, warnings."""

    lanes: dict[int, Counter[str]] = field(default_factory=dict)
    good_ev: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # (ts, lane, bytes)
    drop_ev: list[tuple[float, int]] = field(default_factory=list)
    late_ev: list[np.ndarray] = field(default_factory=list)
    unannounced: Counter[int] = field(default_factory=Counter)
    warnings: list[str] = field(default_factory=list)
    # blocks no fragment of which was seen: their lane is not on the wire (placed by summarize when it can be)
    lost_unplaced: int = 0
    unsent_unplaced: int = 0

    def lane(self, lane: int) -> Counter[str]:
        return self.lanes.setdefault(int(lane), Counter())


@dataclass
class _Tally:
    """One round's state while its frames are counted (the receiver's per-round arrays)."""

    g: Geom
    dt: int  # wire dtype code
    isz: int  # bytes per element
    close: float  # when the round closed (its drop report), inf if never
    nfrag: np.ndarray
    got: np.ndarray
    important: np.ndarray
    lane_of: np.ndarray
    st: Counter[str] = field(default_factory=Counter)
    lanes: dict[int, Counter[str]] = field(default_factory=dict)
    late_blocks: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, r: WireRound) -> _Tally:
        assert r.begin is not None
        _tb, _numel, block, frag, sizes, dt = r.begin
        g = Geom.of(sizes, block, frag)
        nb = g.nblocks
        isz = int(wire.ITEMSIZE[dt]) if dt < len(wire.ITEMSIZE) else 1
        close = r.report[0] if r.report else math.inf
        return cls(g, dt, isz, close, np.zeros(nb, np.int64), np.zeros((nb, g.per_block), bool), np.zeros(nb, bool),
                   np.zeros(nb, np.int64))


def account_rounds(rounds: dict[tuple, WireRound], fr: Frames, acc: Accounts, t0: float) -> list[dict]:
    """One record per announced round, in the order the rounds began; frames of unannounced rounds are only
    counted per lane."""
    out: list[dict] = []
    for key, r in sorted(rounds.items(), key=lambda kv: (kv[1].begin[0] if kv[1].begin else math.inf, kv[0][:4])):
        fr_rows = r.frag_rows if r.frag_rows is not None else np.zeros(0, np.int64)
        if r.begin is None:
            for i in r.rel + fr_rows.tolist():
                acc.unannounced[int(fr.lane[i])] += 1
            continue
        t = _Tally.of(r)
        if r.rel:
            _reliable_runs(t, np.asarray(r.rel, np.int64), fr, acc)
        if len(fr_rows):
            _fragments(t, fr_rows, fr, acc)
        out.append(_round_record(key, r, t, fr, acc, t0))
    return out


def _reliable_runs(t: _Tally, rel: np.ndarray, fr: Frames, acc: Accounts) -> None:
    """Reliable runs of whole blocks, in completion order, vectorised like dgt.protocol.landing.mark_run."""
    g, nb, dt, isz = t.g, t.g.nblocks, t.dt, t.isz
    rel = rel[np.argsort(fr.ts[rel], kind="stable")]
    hh = fr.h[rel]
    b0 = hh["block"].astype(np.int64)
    off = hh["offset"].astype(np.int64)
    cnt = hh["count"].astype(np.int64)
    inb = (b0 >= 0) & (b0 < nb)
    b0c = np.where(inb, b0, 0)
    ok = inb & (hh["dtype"] == dt) & (cnt > 0) & (off == (g.block_start[b0c] if nb else -1))
    b1 = np.searchsorted(g.block_end, off + cnt) if nb else np.zeros(len(b0), np.int64)
    b1c = np.minimum(b1, max(nb - 1, 0))
    ok &= (b1 < nb) & ((g.block_end[b1c] if nb else -1) == off + cnt)
    late = ok & (fr.ts[rel] > t.close)
    on = ok & ~late
    nrej, nlate = int((~ok).sum()), int(late.sum())
    t.st["rejected"] += nrej
    t.st["late_frames"] += nlate
    acc.lane(0)["rejected"] += nrej
    acc.lane(0)["late_frames"] += nlate
    if nlate:
        acc.late_ev.append(fr.ts[rel[late]])
        t.late_blocks.update(expand_ranges(b0[late], b1[late])[0].tolist())
    idx = np.flatnonzero(on)
    if not len(idx):
        return
    blocks, run = expand_ranges(b0[idx], b1[idx])
    first_run = np.full(nb, len(idx), np.int64)
    np.minimum.at(first_run, blocks, run)
    fresh = first_run[blocks] == run
    ndup = int((np.bincount(run, weights=~fresh, minlength=len(idx)) > 0).sum())
    t.st["duplicated"] += ndup
    acc.lane(0)["duplicated"] += ndup
    fb = np.bincount(run, weights=fresh * (g.block_end - g.block_start)[blocks], minlength=len(idx))
    gb = fb.astype(np.int64) * isz
    acc.good_ev.append((fr.ts[rel[idx]], np.zeros(len(idx), np.int64), gb))
    acc.lane(0)["goodput_bytes"] += int(gb.sum())
    t.nfrag[blocks] = g.needed[blocks]
    imp_run = (hh["flags"][idx] & Flags.IMPORTANT) != 0
    t.important[blocks[imp_run[run]]] = True
    t.lane_of[blocks] = 0
    lc = t.lanes.setdefault(0, Counter())
    lc["frames"] += len(idx)
    lc["bytes"] += int((wire.HEADER_SIZE + cnt[idx] * isz).sum())


def _fragments(t: _Tally, fr_rows: np.ndarray, fr: Frames, acc: Accounts) -> None:
    """Fragments (unreliable lanes), vectorised like dgt.protocol.landing.land_fragments."""
    g, nb, dt = t.g, t.g.nblocks, t.dt
    fr_rows = fr_rows[np.argsort(fr.ts[fr_rows], kind="stable")]
    hh = fr.h[fr_rows]
    blk = hh["block"].astype(np.int64)
    off = hh["offset"].astype(np.int64)
    cnt = hh["count"].astype(np.int64)
    inb = blk < nb
    b = np.where(inb, blk, 0)
    relo = off - g.block_start[b] if nb else np.zeros(len(b), np.int64)
    fi = relo // g.frag
    good = (
        inb
        & (hh["dtype"] == dt)
        & (relo >= 0)
        & (relo % g.frag == 0)
        & (fi < (g.needed[b] if nb else 0))
        & (cnt == (np.minimum(g.frag, g.block_end[b] - off) if nb else -1))
    )
    t.st["rejected"] += int((~good).sum())
    late = good & (fr.ts[fr_rows] > t.close)
    t.st["late_frames"] += int(late.sum())
    if late.any():
        acc.late_ev.append(fr.ts[fr_rows[late]])
        t.late_blocks.update(b[late].tolist())
    on = good & ~late
    ln = fr.lane[fr_rows]
    for lane in np.unique(ln[on]).tolist():
        m = on & (ln == lane)
        lc = t.lanes.setdefault(int(lane), Counter())
        lc["frames"] += int(m.sum())
        lc["bytes"] += int((hh["length"][m].astype(np.int64) + wire.HEADER_SIZE).sum())
    oi = np.flatnonzero(on)
    flat_id = b[oi] * g.per_block + fi[oi]
    _, firsts = np.unique(flat_id, return_index=True)
    uniq = np.zeros(len(oi), bool)
    uniq[firsts] = True
    fresh = uniq & ~t.got[b[oi], fi[oi]]
    t.st["duplicated"] += int((~fresh).sum())
    fo = oi[fresh]
    t.got[b[fo], fi[fo]] = True
    np.add.at(t.nfrag, b[fo], 1)
    t.lane_of[b[fo]] = ln[fo]
    t.important[b[fo]] |= (hh["flags"][fo] & Flags.IMPORTANT) != 0
    acc.good_ev.append((fr.ts[fr_rows[fo]], ln[fo], hh["length"][fo].astype(np.int64)))
    for lane in np.unique(ln[fo]).tolist():
        acc.lane(lane)["goodput_bytes"] += int(hh["length"][fo][ln[fo] == lane].astype(np.int64).sum())
    reordered = fr.reordered[fr_rows]
    t.st["reordered"] += int(reordered.sum())
    for what, m in (("rejected", ~good), ("late_frames", late), ("reordered", reordered)):
        for lane, c in zip(*np.unique(ln[m], return_counts=True)):
            acc.lane(int(lane))[what] += int(c)
    for lane, c in zip(*np.unique(ln[oi[~fresh]], return_counts=True)):
        acc.lane(int(lane))["duplicated"] += int(c)
    t.st["fragments_seen"] = int(np.unique(b[good] * g.per_block + fi[good]).size)


def _account_blocks(t: _Tally, acc: Accounts, done: np.ndarray, partial: np.ndarray, dropped: int,
                    unsent: int) -> None:
    """A round's complete blocks per lane (its tally), its lost and unsent ones (the capture's accounts)."""
    for lane, c in zip(*np.unique(t.lane_of[done], return_counts=True)):
        t.lanes.setdefault(int(lane), Counter())["blocks"] = int(c)
    # a partial block was sent (and lost) on the lane its fragments came by; the rest of the lost blocks and the
    # unsent ones are placed on the unreliable lane by summarize when the capture has only one
    for lane, c in zip(*np.unique(t.lane_of[partial], return_counts=True)):
        acc.lane(int(lane))["lost_blocks"] += int(c)
    acc.lost_unplaced += dropped - int(partial.sum())
    acc.unsent_unplaced += unsent


def _announced(r: WireRound, st: Counter) -> dict | None:
    """What the round's ROUND_END announced (None: none was seen)."""
    if not r.end:
        return None
    ib, ub, ifr, ufr = r.end[1]
    return dict(
        important_blocks=ib,
        unimportant_blocks=ub,
        important_frames=ifr,
        unimportant_frames=ufr,
        unimportant_frames_not_seen=max(ufr - st["fragments_seen"], 0),
    )


def _round_record(key: tuple, r: WireRound, t: _Tally, fr: Frames, acc: Accounts, t0: float) -> dict:
    """The JSON record of one announced round (docs/inspect.md), its drop event and its lanes' totals."""
    assert r.begin is not None
    tb, numel, block, frag, _sizes, dt = r.begin
    nb, st, lanes = t.g.nblocks, t.st, t.lanes
    fr_rows = r.frag_rows if r.frag_rows is not None else np.zeros(0, np.int64)
    done = t.nfrag >= t.g.needed
    partial = (t.nfrag > 0) & ~done
    # blocks the ROUND_END does not announce were kept back by the sender's send budget: unsent, not lost
    unsent = min(max(nb - r.end[1][0] - r.end[1][1], 0), nb - int(done.sum())) if r.end else 0
    dropped = nb - int(done.sum()) - unsent
    late_blocks_n = len([x for x in t.late_blocks if not done[x]])
    _account_blocks(t, acc, done, partial, dropped, unsent)
    t_last = float(fr.ts[r.rel + fr_rows.tolist()].max()) if (r.rel or len(fr_rows)) else tb
    t_close = r.report[0] if r.report else None
    acc.drop_ev.append((t_close if t_close is not None else t_last, dropped))
    rec: dict = dict(
        token=f"{key[0]:#018x}",
        sender=key[1],
        peer=addr(key[4]),
        bucket=key[2],
        round=key[3],
        t_begin=round(tb - t0, 6),
        t_end=round(r.end[0] - t0, 6) if r.end else None,
        t_close=round(t_close - t0, 6) if t_close is not None else None,
        duration=round((t_close if t_close is not None else t_last) - tb, 6),
        dtype=wire.WireDType(dt).name.lower() if dt < len(wire.ITEMSIZE) else str(dt),
        numel=numel,
        block=block,
        frag=frag,
        blocks=nb,
        important=int((done & t.important).sum()),
        unimportant_received=int((done & ~t.important).sum()),
        dropped=dropped,
        unsent=unsent,
        partial=int(partial.sum()),
        missing=dropped - int(partial.sum()),
        late_frames=st["late_frames"],
        late_blocks=late_blocks_n,
        duplicated=st["duplicated"],
        reordered=st["reordered"],
        rejected=st["rejected"],
        lanes={
            str(k): dict(frames=v["frames"], blocks=v["blocks"], bytes=v["bytes"]) for k, v in sorted(lanes.items())
        },
        announced=_announced(r, st),
        report=None,
    )
    if r.report:
        _check_report(rec, key, r.report[1], done, nb, unsent, acc.warnings)
    for lane, v in lanes.items():
        a = acc.lane(lane)
        for f in ("frames", "blocks", "bytes"):
            a[f] += v[f]
    return rec


def _check_report(rec: dict, key: tuple, m: np.ndarray | None, done: np.ndarray, nb: int, unsent: int,
                  warnings: list[str]) -> None:
    """The receiver's drop report against what the capture shows."""
    if m is None or len(m) != nb:
        rec["report"] = dict(valid=False)
        return
    rec["report"] = dict(valid=True, received=int(m.sum()), dropped=nb - int(m.sum()) - unsent,
                         agrees=bool((m == done).all()))
    if not rec["report"]["agrees"]:
        warnings.append(
            f"round {key[3]} bucket {key[2]} from rank {key[1]}: the receiver's drop report says "
            f"{int(m.sum())} blocks arrived, the capture shows {int(done.sum())} (capture point differs "
            "from the receiver, or packets were lost between them)"
        )

