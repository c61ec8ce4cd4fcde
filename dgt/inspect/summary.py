"""Summarise DGT traffic in a capture: per lane, per round and over time, from numpy arrays of parsed headers.

The per-round accounting mirrors :class:`dgt.protocol.receiver.RoundReceiver` (same validity rules, same duplicate
and completeness rules), so a capture taken where the receiver sits reproduces its ``RoundStats``; the round is
closed at the time its DROP_REPORT is seen (frames after that are late). See docs/inspect.md for every field.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dgt import wire
from dgt.inspect import reassembly
from dgt.inspect.pcapio import TCP, UDP, PacketTable, addr, read_pcap
from dgt.protocol.report import TRAILER_SIZE
from dgt.wire import Flags, FrameType

EF, CS1, LE = 46, 8, 1
DSCP_NAMES = {
    0: "BE",
    1: "LE",
    8: "CS1",
    10: "AF11",
    16: "CS2",
    18: "AF21",
    24: "CS3",
    26: "AF31",
    32: "CS4",
    34: "AF41",
    40: "CS5",
    46: "EF",
    48: "CS6",
    56: "CS7",
}
DEFAULT_RELIABLE_DSCP = (EF,)
DEFAULT_UNRELIABLE_DSCP = (LE, CS1)
REASONS = (*wire.REASONS, "not-a-fragment", "ip-fragment")
_NOT_FRAGMENT = REASONS.index("not-a-fragment")
_IP_FRAGMENT = REASONS.index("ip-fragment")


def dscp_name(v: int) -> str:
    return f"{DSCP_NAMES[v]}({v})" if v in DSCP_NAMES else str(v)


@dataclass
class Options:
    """What the tool cannot learn from the capture: extra DGT ports, and the DSCP each lane was configured with."""

    tcp_ports: tuple[int, ...] = ()
    udp_ports: tuple[int, ...] = ()
    auto: bool = True  # also detect DGT flows by the magic/version at the start of payloads and streams
    expect_dscp: dict[int, tuple[int, ...]] = field(default_factory=dict)  # lane -> acceptable DSCP values
    bin_s: float | None = None  # timeline bin width (None: about 60 bins over the capture)
    limits: wire.Limits = wire.DEFAULT_LIMITS


def expected_dscp(lane: int, opts: Options, session: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    if lane in opts.expect_dscp:
        return opts.expect_dscp[lane]
    if lane in session:
        return session[lane]
    return DEFAULT_RELIABLE_DSCP if lane == 0 else DEFAULT_UNRELIABLE_DSCP


# -- geometry (numpy twin of BucketLayout + Geometry, without torch) ------------------------------------------------


@dataclass
class _Geom:
    block_start: np.ndarray
    block_end: np.ndarray
    needed: np.ndarray  # fragments per block
    frag: int
    per_block: int

    @classmethod
    def of(cls, sizes: list[int], block: int, frag: int) -> _Geom:
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
class _Round:
    key: tuple
    begin: tuple | None = None  # (ts, numel, block, frag, sizes, dtype)
    end: tuple | None = None  # (ts, (imp_blocks, unimp_blocks, imp_frames, unimp_frames))
    report: tuple | None = None  # (ts, received mask or None if malformed)
    rel: list[int] = field(default_factory=list)  # reliable DATA frame indices
    frag_rows: np.ndarray | None = None  # fragment indices


def _group(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _expand(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive block ranges -> (every block, index of its range)."""
    lens = last - first + 1
    run = np.repeat(np.arange(len(first)), lens)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(lens) else np.zeros(0, np.int64)
    return np.repeat(first, lens) + np.arange(int(lens.sum())) - np.repeat(starts, lens), run


def _addr_cols(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An 'S16' address column as two uint64 columns."""
    u = np.ascontiguousarray(a.astype("S16")).view(np.uint8).reshape(-1, 16)
    w = np.ascontiguousarray(u).view(">u8").reshape(-1, 2).astype(np.uint64)
    return w[:, 0], w[:, 1]


def _pair(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)


def _segmented_reorder(group: np.ndarray, value: np.ndarray) -> np.ndarray:
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


def summarize(source: str | PacketTable, opts: Options | None = None) -> dict:
    """Everything ``dgt inspect`` prints, as a JSON-ready dict. Never raises on packet contents."""
    opts = opts or Options()
    table = read_pcap(source) if isinstance(source, str) else source
    limits = opts.limits
    n = len(table)
    malformed: Counter[str] = Counter()
    warnings: list[str] = []

    # ---- flows
    l4 = table.ok & ((table.proto == UDP) | (table.proto == TCP))
    rows = np.flatnonzero(l4)
    ports = (table.sport[rows] << 24) | (table.dport[rows] << 8) | table.proto[rows]
    finv, first_row = _group(*_addr_cols(table.src[rows]), *_addr_cols(table.dst[rows]), ports)
    flow_of = np.full(n, -1, np.int64)
    flow_of[rows] = finv
    nflows = len(first_row)
    frow = rows[first_row]  # a representative packet of each flow
    fproto = table.proto[frow]
    fsport, fdport = table.sport[frow], table.dport[frow]
    fdgt = np.zeros(nflows, bool)
    fhow = [""] * nflows
    udp_ports, tcp_ports = set(opts.udp_ports), set(opts.tcp_ports)
    for f in range(nflows):
        ports = {int(fsport[f]), int(fdport[f])}
        if (fproto[f] == UDP and ports & udp_ports) or (fproto[f] == TCP and ports & tcp_ports):
            fdgt[f] = True
            fhow[f] = "port"

    # ---- UDP datagrams: one frame each
    urows, uh, upl = _datagrams(table, np.flatnonzero(l4 & (table.proto == UDP)))
    ureason = wire.validate(uh, limits).astype(np.int64)
    tag = ((uh["flags"] & Flags.MAC) != 0).astype(np.int64) * wire.MAC_TAG  # a MAC trailer (not checked here: no key)
    bad_len = (ureason == 0) & (uh["length"].astype(np.int64) + wire.HEADER_SIZE + tag != upl)
    ureason[bad_len] = REASONS.index("length")
    ureason[upl < wire.HEADER_SIZE] = REASONS.index("truncated")
    notfrag = (ureason == 0) & ((uh["ftype"] != FrameType.DATA) | ((uh["flags"] & Flags.FRAGMENT) == 0))
    ureason[notfrag] = _NOT_FRAGMENT
    ureason[table.ipfrag[urows]] = _IP_FRAGMENT
    uflow = flow_of[urows]
    if opts.auto and len(urows):
        good_per_flow = np.bincount(uflow, weights=(ureason == 0), minlength=nflows) > 0
        for f in np.flatnonzero(good_per_flow & ~fdgt).tolist():
            fdgt[f] = True
            fhow[f] = "magic"
    udgt = fdgt[uflow] if len(urows) else np.zeros(0, bool)
    for code, cnt in zip(*np.unique(ureason[udgt & (ureason != 0)], return_counts=True)):
        malformed[REASONS[int(code)]] += int(cnt)

    # ---- TCP streams: reassemble each direction, walk frames
    trows = np.flatnonzero(l4 & (table.proto == TCP))
    tflow = flow_of[trows]
    stream_info: dict[int, dict] = {}
    rel_parts: list[tuple[int, reassembly.StreamFrames]] = []
    tcp_order = np.argsort(tflow, kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(tflow[tcp_order]) != 0, True]) if len(trows) else np.zeros(1, int)
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        prow = trows[tcp_order[a:b]]
        f = int(flow_of[prow[0]])
        syn = prow[(table.tcpflags[prow] & 0x02) != 0]
        data_rows = prow[table.paylen[prow] > 0]
        data_rows = np.array([r for r in data_rows.tolist() if r in table.tcp_payload], np.int64)
        if len(data_rows) == 0:
            continue
        st = reassembly.reassemble(
            table.seq[data_rows],
            [table.tcp_payload[r] for r in data_rows.tolist()],
            table.ts[data_rows],
            data_rows,
            int(table.seq[syn[0]]) if len(syn) else None,
        )
        sf = reassembly.frames(st, limits)
        reason = wire.validate(sf.headers, limits)
        nvalid = int((reason == 0).sum())
        if not fdgt[f] and opts.auto and nvalid and (nvalid >= 2 or (len(sf.pos) and sf.pos[0] == 0)):
            fdgt[f] = True
            fhow[f] = "magic"
        if not fdgt[f]:
            continue
        for code, cnt in zip(*np.unique(reason[reason != 0], return_counts=True)):
            malformed[wire.REASONS[int(code)]] += int(cnt)
        if sf.problems.get("resync"):
            malformed["stream-garbage"] += sf.problems["resync"]
        stream_info[f] = dict(
            frames=len(sf.pos),
            gap_bytes=int(sum(e - s for s, e in st.gaps)),
            gaps=len(st.gaps),
            retransmitted_segments=st.retransmitted,
            skipped_bytes=sf.skipped_bytes,
            tail_bytes=sf.tail_bytes,
            problems=dict(sf.problems),
        )
        keep = reason == 0
        sf.headers, sf.pos, sf.ts, sf.pkt = sf.headers[keep], sf.pos[keep], sf.ts[keep], sf.pkt[keep]
        old = np.flatnonzero(keep)
        sf.payloads = {j: sf.payloads[int(i)] for j, i in enumerate(old.tolist()) if int(i) in sf.payloads}
        rel_parts.append((f, sf))

    # ---- one frame table: reliable frames then valid datagrams
    uvalid = udgt & (ureason == 0)
    uv = urows[uvalid]
    hs = [sf.headers for _, sf in rel_parts] + [uh[uvalid]]
    fr_h = np.concatenate(hs) if hs else np.zeros(0, wire.HEADER_DTYPE)
    fr_ts = np.concatenate([sf.ts for _, sf in rel_parts] + [table.ts[uv]])
    fr_pkt = np.concatenate([sf.pkt for _, sf in rel_parts] + [uv]).astype(np.int64)
    fr_flow = np.concatenate([np.full(len(sf.pos), f, np.int64) for f, sf in rel_parts] + [flow_of[uv]])
    fr_tcp = np.concatenate([np.ones(len(sf.pos), bool) for _, sf in rel_parts] + [np.zeros(len(uv), bool)])
    payloads: dict[int, bytes] = {}
    base = 0
    for _, sf in rel_parts:
        for j, p in sf.payloads.items():
            payloads[base + j] = p
        base += len(sf.pos)
    fr_peer = table.dst[fr_pkt] if len(fr_pkt) else np.zeros(0, "S16")
    fr_src = table.src[fr_pkt] if len(fr_pkt) else np.zeros(0, "S16")
    nfr = len(fr_h)
    fr_lane = fr_h["lane"].astype(np.int64)
    fr_lane[fr_tcp] = 0

    # ---- control frames: session configuration, rounds' begin/end, drop reports
    session_dscp: dict[int, tuple[int, ...]] = {}
    rounds: dict[tuple, _Round] = {}
    reports: list[tuple[int, np.ndarray | None]] = []
    control_frames: Counter[int] = Counter()
    ftype = fr_h["ftype"]
    for i in np.flatnonzero((ftype != FrameType.DATA) & (ftype != FrameType.BULK)).tolist():
        t = int(ftype[i])
        control_frames[int(fr_lane[i])] += 1
        p = payloads.get(i, b"")
        key = (
            int(fr_h["token"][i]),
            int(fr_h["rank"][i]),
            int(fr_h["bucket"][i]),
            int(fr_h["round"][i]),
            bytes(fr_peer[i]),
        )
        if t == FrameType.ROUND_BEGIN:
            try:
                numel, block, frag, sizes = wire.decode_round_begin(memoryview(p), limits)
            except wire.WireError:
                malformed["round-begin"] += 1
                continue
            r = rounds.setdefault(key, _Round(key))
            if r.begin is None:
                r.begin = (float(fr_ts[i]), numel, block, frag, sizes, int(fr_h["dtype"][i]))
        elif t == FrameType.ROUND_END:
            try:
                end = wire.decode_round_end(memoryview(p))
            except wire.WireError:
                malformed["round-end"] += 1
                continue
            r = rounds.setdefault(key, _Round(key))
            if r.end is None:
                r.end = (float(fr_ts[i]), end)
        elif t == FrameType.DROP_REPORT:
            nb = int(fr_h["count"][i])
            nbm = (nb + 7) // 8  # the bitmap, then with flag TIMING the timing trailer (dgt.protocol.report)
            if len(p) != nbm + (TRAILER_SIZE if fr_h["flags"][i] & Flags.TIMING else 0):
                malformed["drop-report"] += 1
                reports.append((i, None))
                continue
            reports.append((i, np.unpackbits(np.frombuffer(p[:nbm], np.uint8), count=nb).astype(bool)))
        elif t == FrameType.CONTROL:
            try:
                msg = json.loads(p.decode())
            except (UnicodeDecodeError, ValueError):
                malformed["control"] += 1
                continue
            d = msg.get("dscp") if isinstance(msg, dict) else None
            if isinstance(d, dict):
                for k, v in d.items():
                    try:
                        session_dscp[int(k)] = tuple(int(x) for x in (v if isinstance(v, list) else [v]))
                    except (TypeError, ValueError):
                        pass

    # ---- attach DATA frames to rounds
    data_idx = np.flatnonzero(ftype == FrameType.DATA)
    unannounced: Counter[int] = Counter()
    if len(data_idx):
        hd = fr_h[data_idx]
        kinv, _ = _group(
            hd["token"].astype(np.uint64),
            _pair(hd["rank"], hd["bucket"]),
            hd["round"].astype(np.uint64),
            *_addr_cols(fr_peer[data_idx]),
        )
        is_run = fr_tcp[data_idx] & ((fr_h["flags"][data_idx] & Flags.FRAGMENT) == 0)
        order = np.argsort(kinv, kind="stable")
        kb = np.flatnonzero(np.r_[True, np.diff(kinv[order]) != 0, True])
        for a, b in zip(kb[:-1].tolist(), kb[1:].tolist()):
            i0 = data_idx[order[a]]
            key = (
                int(fr_h["token"][i0]),
                int(fr_h["rank"][i0]),
                int(fr_h["bucket"][i0]),
                int(fr_h["round"][i0]),
                bytes(fr_peer[i0]),
            )
            sel = data_idx[order[a:b]]
            run = is_run[order[a:b]]
            r = rounds.setdefault(key, _Round(key))
            r.rel = sel[run].tolist()
            r.frag_rows = sel[~run]

    # ---- match drop reports to rounds: same session/bucket/round, report sent by the data's destination
    unmatched_reports = 0
    for i, mask in reports:
        tok, rk, bk, rd = (int(fr_h[f][i]) for f in ("token", "rank", "bucket", "round"))
        src = bytes(fr_src[i])
        cands = [
            r
            for k, r in rounds.items()
            if k[0] == tok and k[2] == bk and k[3] == rd and k[4] == src and k[1] != rk and r.begin is not None
        ]
        if len(cands) > 1:
            # prefer the round whose reliable frames travel on the reverse direction of the report's connection
            rev = [r for r in cands if r.rel and _reverse(table, flow_of, fr_pkt[r.rel[0]], fr_pkt[i])]
            cands = rev if len(rev) == 1 else cands
        if len(cands) != 1:
            unmatched_reports += 1
            continue
        r = cands[0]
        if r.report is None:
            r.report = (float(fr_ts[i]), mask)

    # ---- reordering per datagram flow (see docs/inspect.md for the definition)
    reordered = np.zeros(nfr, bool)
    fidx = np.flatnonzero(~fr_tcp & (ftype == FrameType.DATA))
    if len(fidx):
        hf = fr_h[fidx]
        flow = fr_flow[fidx].astype(np.uint64)
        tok, rb = hf["token"].astype(np.uint64), _pair(hf["rank"], hf["bucket"])
        g1, _ = _group(flow, tok, rb, _pair(hf["round"], hf["block"]))
        r1 = _segmented_reorder(g1, hf["offset"].astype(np.int64))
        g2, _ = _group(flow, tok, rb)
        r2 = _segmented_reorder(g2, hf["round"].astype(np.int64))
        reordered[fidx] = r1 | r2

    # ---- per-round accounting
    t0 = float(table.ts.min()) if n else 0.0
    good_ev: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ts, lane, fresh payload bytes)
    drop_ev: list[tuple[float, int]] = []
    late_ev: list[np.ndarray] = []
    lane_acc: dict[int, Counter] = {}
    round_out: list[dict] = []

    def lacc(lane: int) -> Counter:
        return lane_acc.setdefault(int(lane), Counter())

    for key, r in sorted(rounds.items(), key=lambda kv: (kv[1].begin[0] if kv[1].begin else math.inf, kv[0][:4])):
        fr_rows = r.frag_rows if r.frag_rows is not None else np.zeros(0, np.int64)
        if r.begin is None:
            for i in r.rel + fr_rows.tolist():
                unannounced[int(fr_lane[i])] += 1
            continue
        tb, numel, block, frag, sizes, dt = r.begin
        g = _Geom.of(sizes, block, frag)
        nb = g.nblocks
        isz = int(wire.ITEMSIZE[dt]) if dt < len(wire.ITEMSIZE) else 1
        close = r.report[0] if r.report else math.inf
        nfrag = np.zeros(nb, np.int64)
        got = np.zeros((nb, g.per_block), bool)
        important = np.zeros(nb, bool)
        lane_of = np.zeros(nb, np.int64)
        st = Counter()
        lanes: dict[int, Counter] = {}
        late_blocks: set[int] = set()
        # reliable runs of whole blocks, in completion order, vectorised like RoundReceiver._mark_run
        if r.rel:
            rel = np.asarray(r.rel, np.int64)
            rel = rel[np.argsort(fr_ts[rel], kind="stable")]
            hh = fr_h[rel]
            b0 = hh["block"].astype(np.int64)
            off = hh["offset"].astype(np.int64)
            cnt = hh["count"].astype(np.int64)
            inb = (b0 >= 0) & (b0 < nb)
            b0c = np.where(inb, b0, 0)
            ok = inb & (hh["dtype"] == dt) & (cnt > 0) & (off == (g.block_start[b0c] if nb else -1))
            b1 = np.searchsorted(g.block_end, off + cnt) if nb else np.zeros(len(b0), np.int64)
            b1c = np.minimum(b1, max(nb - 1, 0))
            ok &= (b1 < nb) & ((g.block_end[b1c] if nb else -1) == off + cnt)
            late = ok & (fr_ts[rel] > close)
            on = ok & ~late
            nrej, nlate = int((~ok).sum()), int(late.sum())
            st["rejected"] += nrej
            st["late_frames"] += nlate
            lacc(0)["rejected"] += nrej
            lacc(0)["late_frames"] += nlate
            if nlate:
                late_ev.append(fr_ts[rel[late]])
                late_blocks.update(_expand(b0[late], b1[late])[0].tolist())
            idx = np.flatnonzero(on)
            if len(idx):
                blocks, run = _expand(b0[idx], b1[idx])
                first_run = np.full(nb, len(idx), np.int64)
                np.minimum.at(first_run, blocks, run)
                fresh = first_run[blocks] == run
                ndup = int((np.bincount(run, weights=~fresh, minlength=len(idx)) > 0).sum())
                st["duplicated"] += ndup
                lacc(0)["duplicated"] += ndup
                fb = np.bincount(run, weights=fresh * (g.block_end - g.block_start)[blocks], minlength=len(idx))
                gb = fb.astype(np.int64) * isz
                good_ev.append((fr_ts[rel[idx]], np.zeros(len(idx), np.int64), gb))
                lacc(0)["goodput_bytes"] += int(gb.sum())
                nfrag[blocks] = g.needed[blocks]
                imp_run = (hh["flags"][idx] & Flags.IMPORTANT) != 0
                important[blocks[imp_run[run]]] = True
                lane_of[blocks] = 0
                lc = lanes.setdefault(0, Counter())
                lc["frames"] += len(idx)
                lc["bytes"] += int((wire.HEADER_SIZE + cnt[idx] * isz).sum())
        # fragments (unreliable lanes), vectorised like RoundReceiver._fragments
        if len(fr_rows):
            fr_rows = fr_rows[np.argsort(fr_ts[fr_rows], kind="stable")]
            hh = fr_h[fr_rows]
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
            st["rejected"] += int((~good).sum())
            late = good & (fr_ts[fr_rows] > close)
            st["late_frames"] += int(late.sum())
            if late.any():
                late_ev.append(fr_ts[fr_rows[late]])
                late_blocks.update(b[late].tolist())
            on = good & ~late
            ln = fr_lane[fr_rows]
            for lane in np.unique(ln[on]).tolist():
                m = on & (ln == lane)
                lc = lanes.setdefault(int(lane), Counter())
                lc["frames"] += int(m.sum())
                lc["bytes"] += int((hh["length"][m].astype(np.int64) + wire.HEADER_SIZE).sum())
            oi = np.flatnonzero(on)
            flat_id = b[oi] * g.per_block + fi[oi]
            _, firsts = np.unique(flat_id, return_index=True)
            uniq = np.zeros(len(oi), bool)
            uniq[firsts] = True
            fresh = uniq & ~got[b[oi], fi[oi]]
            st["duplicated"] += int((~fresh).sum())
            fo = oi[fresh]
            got[b[fo], fi[fo]] = True
            np.add.at(nfrag, b[fo], 1)
            lane_of[b[fo]] = ln[fo]
            important[b[fo]] |= (hh["flags"][fo] & Flags.IMPORTANT) != 0
            good_ev.append((fr_ts[fr_rows[fo]], ln[fo], hh["length"][fo].astype(np.int64)))
            for lane in np.unique(ln[fo]).tolist():
                lacc(lane)["goodput_bytes"] += int(hh["length"][fo][ln[fo] == lane].astype(np.int64).sum())
            st["reordered"] += int(reordered[fr_rows].sum())
            for what, m in (("rejected", ~good), ("late_frames", late), ("reordered", reordered[fr_rows])):
                for lane, c in zip(*np.unique(ln[m], return_counts=True)):
                    lacc(int(lane))[what] += int(c)
            for lane, c in zip(*np.unique(ln[oi[~fresh]], return_counts=True)):
                lacc(int(lane))["duplicated"] += int(c)
            st["fragments_seen"] = int(np.unique(b[good] * g.per_block + fi[good]).size)
        done = nfrag >= g.needed
        partial = (nfrag > 0) & ~done
        # blocks the ROUND_END does not announce were kept back by the sender's send budget: unsent, not lost
        unsent = min(max(nb - r.end[1][0] - r.end[1][1], 0), nb - int(done.sum())) if r.end else 0
        dropped = nb - int(done.sum()) - unsent
        late_blocks_n = len([x for x in late_blocks if not done[x]])
        for lane, c in zip(*np.unique(lane_of[done], return_counts=True)):
            lanes.setdefault(int(lane), Counter())["blocks"] = int(c)
        t_last = float(fr_ts[r.rel + fr_rows.tolist()].max()) if (r.rel or len(fr_rows)) else tb
        t_close = r.report[0] if r.report else None
        drop_ev.append((t_close if t_close is not None else t_last, dropped))
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
            important=int((done & important).sum()),
            unimportant_received=int((done & ~important).sum()),
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
            announced=None,
            report=None,
        )
        if r.end:
            ib, ub, ifr, ufr = r.end[1]
            rec["announced"] = dict(
                important_blocks=ib,
                unimportant_blocks=ub,
                important_frames=ifr,
                unimportant_frames=ufr,
                unimportant_frames_not_seen=max(ufr - st["fragments_seen"], 0),
            )
        if r.report:
            m = r.report[1]
            if m is None or len(m) != nb:
                rec["report"] = dict(valid=False)
            else:
                rec["report"] = dict(
                    valid=True, received=int(m.sum()), dropped=nb - int(m.sum()) - unsent,
                    agrees=bool((m == done).all())
                )
                if not rec["report"]["agrees"]:
                    warnings.append(
                        f"round {key[3]} bucket {key[2]} from rank {key[1]}: the receiver's drop report says "
                        f"{int(m.sum())} blocks arrived, the capture shows {int(done.sum())} (capture point differs "
                        "from the receiver, or packets were lost between them)"
                    )
        for lane, v in lanes.items():
            a = lacc(lane)
            for f in ("frames", "blocks", "bytes"):
                a[f] += v[f]
        round_out.append(rec)
    bulk_out = _bulk_messages(fr_h, fr_ts, fr_peer, t0, lacc, good_ev, warnings)

    # ---- per-lane packet view: DSCP, wire bytes
    lane_pkts: dict[int, dict] = {}
    pk_lane = np.full(n, -1, np.int64)
    # datagrams: lane from their header; undecodable ones take their flow's most common lane
    if len(urows):
        ul = uh["lane"].astype(np.int64)
        for f in np.unique(uflow[udgt]).tolist():
            m = udgt & (uflow == f)
            okl = ul[m & (ureason == 0)]
            mode = int(np.bincount(okl).argmax()) if len(okl) else -1
            ul[m & (ureason != 0)] = mode
        pk_lane[urows[udgt]] = ul[udgt]
    if len(trows):
        tdgt = fdgt[tflow] & (table.paylen[trows] > 0)
        pk_lane[trows[tdgt]] = 0
    dgt_pkts = pk_lane >= 0
    all_lanes = sorted(set(np.unique(pk_lane[dgt_pkts]).tolist()) | set(lane_acc) | set(unannounced))
    for lane in all_lanes:
        m = pk_lane == lane
        vals, cnts = np.unique(table.dscp[m], return_counts=True)
        lane_pkts[lane] = dict(
            packets=int(m.sum()),
            wire_bytes=int(table.iplen[m].sum()),
            dscp={str(int(v)): int(c) for v, c in zip(vals, cnts)},
        )
    nonack_tcp_dgt_acks = 0
    if len(trows):
        nonack_tcp_dgt_acks = int((fdgt[tflow] & (table.paylen[trows] == 0)).sum())

    # ---- lanes out, DSCP warnings
    lanes_out: dict[str, dict] = {}
    for lane in all_lanes:
        pk = lane_pkts.get(lane, dict(packets=0, wire_bytes=0, dscp={}))
        acc = lane_acc.get(lane, Counter())
        exp = expected_dscp(lane, opts, session_dscp)
        seen = {int(k): v for k, v in pk["dscp"].items()}
        off_mark = {k: v for k, v in seen.items() if k not in exp}
        ok = not off_mark
        lanes_out[str(lane)] = dict(
            transport="tcp" if lane == 0 else "udp",
            packets=pk["packets"],
            wire_bytes=pk["wire_bytes"],
            frames=acc["frames"],
            control_frames=control_frames.get(lane, 0),
            blocks=acc["blocks"],
            bytes=acc["bytes"],
            dscp=pk["dscp"],
            expected_dscp=list(exp),
            dscp_ok=ok,
            duplicated=acc["duplicated"],
            reordered=acc["reordered"],
            late_frames=acc["late_frames"],
            rejected=acc["rejected"],
            goodput_bytes=acc["goodput_bytes"],
            bulk_frames=acc["bulk_frames"],
            unannounced_frames=unannounced.get(lane, 0),
        )
        if not ok and pk["packets"]:
            bad = sum(off_mark.values())
            names = ", ".join(dscp_name(k) for k in sorted(off_mark))
            want = " or ".join(dscp_name(k) for k in exp)
            why = ""
            if set(off_mark) == {0}:
                why = ": the marking was bleached to best effort (by the network, or never set by the sender)"
            elif lane != 0 and any(k >= 32 for k in off_mark):
                why = ": unimportant traffic is marked high priority"
            warnings.append(
                f"lane {lane} ({'tcp' if lane == 0 else 'udp'}): DSCP {names} on {bad} of "
                f"{pk['packets']} packets, expected {want}{why}"
            )

    # ---- timeline
    duration = float(table.ts.max() - table.ts.min()) if n else 0.0
    bin_s = opts.bin_s or _nice_bin(duration)
    nbins = max(1, int(math.floor(duration / bin_s)) + 1) if n else 1
    edges = t0 + np.arange(nbins + 1) * bin_s
    tl_lanes: dict[str, dict] = {}
    gts = np.concatenate([e[0] for e in good_ev]) if good_ev else np.zeros(0)
    gln = np.concatenate([e[1] for e in good_ev]) if good_ev else np.zeros(0, np.int64)
    gby = np.concatenate([e[2] for e in good_ev]) if good_ev else np.zeros(0, np.int64)
    for lane in all_lanes:
        m = pk_lane == lane
        wb, _ = np.histogram(table.ts[m], bins=edges, weights=table.iplen[m])
        gm = gln == lane
        gb, _ = np.histogram(gts[gm], bins=edges, weights=gby[gm])
        tl_lanes[str(lane)] = dict(wire_bytes=wb.astype(np.int64).tolist(), goodput_bytes=gb.astype(np.int64).tolist())
    dts = np.array([d[0] for d in drop_ev]) if drop_ev else np.zeros(0)
    dn = np.array([d[1] for d in drop_ev]) if drop_ev else np.zeros(0)
    drops, _ = np.histogram(dts, bins=edges, weights=dn)
    lts = np.concatenate(late_ev) if late_ev else np.zeros(0)
    lateh, _ = np.histogram(lts, bins=edges)
    goodput_total = np.histogram(gts, bins=edges, weights=gby)[0]
    timeline = dict(
        bin_s=bin_s,
        t0=t0,
        bins=nbins,
        lanes=tl_lanes,
        drops=drops.astype(np.int64).tolist(),
        late_frames=lateh.astype(np.int64).tolist(),
        goodput_bps=[round(float(x) * 8 / bin_s, 1) for x in goodput_total],
    )

    # ---- totals, flows, warnings
    tot_keys = (
        "blocks",
        "important",
        "unimportant_received",
        "dropped",
        "unsent",
        "partial",
        "missing",
        "late_frames",
        "late_blocks",
        "duplicated",
        "reordered",
        "rejected",
    )
    totals = {k: int(sum(rr[k] for rr in round_out)) for k in tot_keys}
    totals["rounds"] = len(round_out)
    totals["rounds_closed"] = sum(1 for rr in round_out if rr["t_close"] is not None)
    totals["unannounced_frames"] = int(sum(unannounced.values()))
    totals["unmatched_reports"] = unmatched_reports
    totals["bulk_messages"] = len(bulk_out)
    totals["bulk_complete"] = sum(1 for m in bulk_out if m["complete"])
    totals["bulk_bytes"] = int(sum(m["bytes"] for m in bulk_out))
    flows_out = []
    for f in np.flatnonzero(fdgt).tolist():
        m = flow_of == f
        vals, cnts = np.unique(table.dscp[m], return_counts=True)
        fo = dict(
            proto="tcp" if fproto[f] == TCP else "udp",
            src=addr(table.src[frow[f]]),
            sport=int(fsport[f]),
            dst=addr(table.dst[frow[f]]),
            dport=int(fdport[f]),
            detected_by=fhow[f],
            packets=int(m.sum()),
            wire_bytes=int(table.iplen[m].sum()),
            dscp={str(int(v)): int(c) for v, c in zip(vals, cnts)},
        )
        if f in stream_info:
            fo.update(stream_info[f])
        flows_out.append(fo)
    gap_bytes = sum(s.get("gap_bytes", 0) for s in stream_info.values())
    capture = dict(
        gap_bytes=gap_bytes,
        retransmitted_segments=sum(s.get("retransmitted_segments", 0) for s in stream_info.values()),
        snapped_packets=int((table.snapped & (pk_lane >= 0)).sum()),
        unknown_link_packets=table.unknown_link,
        tcp_acks=nonack_tcp_dgt_acks,
    )
    if gap_bytes:
        warnings.append(
            f"{gap_bytes} bytes of reliable-lane streams are missing from the capture (capture drops, "
            "or the capture started after the connection): affected frames are not counted"
        )
    mal_total = int(sum(malformed.values()))
    if mal_total:
        warnings.append(
            f"{mal_total} malformed DGT packets/frames: " + ", ".join(f"{k} {v}" for k, v in sorted(malformed.items()))
        )
    if totals["unannounced_frames"]:
        warnings.append(
            f"{totals['unannounced_frames']} DATA frames belong to rounds whose ROUND_BEGIN is not in the "
            "capture (started mid-round?): counted per lane only"
        )
    if not flows_out and n:
        warnings.append(
            "no DGT traffic found: pass --udp-port/--tcp-port if the flows carry no DGT header at their start"
        )
    sessions: dict[str, dict] = {}
    for rr in round_out:
        s = sessions.setdefault(rr["token"], dict(token=rr["token"], ranks=set(), rounds=0))
        s["ranks"].add(rr["sender"])
        s["rounds"] += 1
    return dict(
        file=source if isinstance(source, str) else None,
        packets=n,
        dgt_packets=int(dgt_pkts.sum()),
        other_packets=int(n - dgt_pkts.sum()),
        start_ts=t0,
        duration_s=round(duration, 6),
        sessions=[dict(token=s["token"], ranks=sorted(s["ranks"]), rounds=s["rounds"]) for s in sessions.values()],
        session_dscp={str(k): list(v) for k, v in session_dscp.items()},
        lanes=lanes_out,
        totals=totals,
        rounds=round_out,
        bulk=bulk_out,
        flows=flows_out,
        malformed=dict(total=mal_total, reasons=dict(sorted(malformed.items()))),
        capture=capture,
        timeline=timeline,
        warnings=warnings,
    )


def _bulk_messages(fr_h: np.ndarray, fr_ts: np.ndarray, fr_peer: np.ndarray, t0: float, lacc, good_ev: list,
                   warnings: list[str]) -> list[dict]:
    """BULK messages (lossless, no round state) per (session, sender, bucket, round, destination): frames, bytes, and
    whether the capture holds all of it in order. Their payload counts as reliable-lane goodput."""
    bidx = np.flatnonzero(fr_h["ftype"] == FrameType.BULK)
    out: list[dict] = []
    if not len(bidx):
        return out
    hb = fr_h[bidx]
    kinv, _ = _group(hb["token"].astype(np.uint64), _pair(hb["rank"], hb["bucket"]), hb["round"].astype(np.uint64),
                     *_addr_cols(fr_peer[bidx]))  # fmt: skip
    order = np.argsort(kinv, kind="stable")  # stable: each message's frames stay in stream order
    kb = np.flatnonzero(np.r_[True, np.diff(kinv[order]) != 0, True])
    for a, b in zip(kb[:-1].tolist(), kb[1:].tolist()):
        sel = bidx[order[a:b]]
        h = fr_h[sel]
        cnt = h["count"].astype(np.int64)
        in_order = bool((h["offset"].astype(np.int64) == np.r_[0, np.cumsum(cnt)[:-1]]).all())
        total, got = int(h["block"][0]), int(cnt.sum())
        i0 = int(sel[0])
        dt = int(h["dtype"][0])
        out.append(dict(
            token=f"{int(h['token'][0]):#018x}", sender=int(h["rank"][0]), peer=addr(fr_peer[i0]),
            bucket=int(h["bucket"][0]), round=int(h["round"][0]),
            dtype=wire.WireDType(dt).name.lower() if dt < len(wire.ITEMSIZE) else str(dt),
            frames=len(sel), elements=got, total=total, bytes=int(h["length"].astype(np.int64).sum()),
            in_order=in_order, complete=in_order and got == total,
            t_first=round(float(fr_ts[sel].min()) - t0, 6), t_last=round(float(fr_ts[sel].max()) - t0, 6),
        ))  # fmt: skip
        if not in_order:
            warnings.append(f"bulk message round {out[-1]['round']} bucket {out[-1]['bucket']} from rank "
                            f"{out[-1]['sender']}: frames do not continue each other in the capture")  # fmt: skip
    nbytes = hb["length"].astype(np.int64)
    a = lacc(0)
    a["frames"] += len(bidx)
    a["bulk_frames"] += len(bidx)
    a["bytes"] += int((nbytes + wire.HEADER_SIZE).sum())
    a["goodput_bytes"] += int(nbytes.sum())
    good_ev.append((fr_ts[bidx], np.zeros(len(bidx), np.int64), nbytes))
    return out


def _datagrams(table: PacketTable, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packet row, DGT header, size) per datagram. A GSO aggregate (on loopback the capture sees the unsegmented
    send: one UDP packet, its datagrams back to back) is cut back into its datagrams by their length fields, so
    they count as the receiver sees them."""
    head = table.udp_payload_head(rows, wire.HEADER_SIZE)
    size = table.paylen[rows].astype(np.int64)
    gso = table.gso[rows]
    if gso.any():
        keep = ~gso
        xr, xh, xs = [rows[keep]], [head[keep]], [size[keep]]
        for r in rows[gso].tolist():
            pay = table.gso_payload.get(r, b"")
            pos, cuts = 0, []
            while pos < len(pay):
                n = int.from_bytes(pay[pos + 44 : pos + 48], "big") + wire.HEADER_SIZE if pos + 48 <= len(pay) else 0
                n += wire.MAC_TAG if n and pay[pos + 4] & Flags.MAC else 0  # the datagram's MAC trailer
                end = pos + n if wire.HEADER_SIZE <= n <= len(pay) - pos else len(pay)  # bad length: rest is one
                cuts.append(pay[pos:end])
                pos = end
            if any(c[:3] != b"DG\x01" for c in cuts[1:]):  # not an aggregate: one datagram, wrong length field
                i = int(np.flatnonzero(rows == r)[0])
                cuts = [pay[: int(size[i])]]
            xr.append(np.full(len(cuts), r, np.int64))
            xh.append(np.frombuffer(b"".join(c[:48].ljust(48, b"\0") for c in cuts), np.uint8).reshape(-1, 48))
            xs.append(np.asarray([len(c) for c in cuts], np.int64))
        rows, head, size = np.concatenate(xr), np.concatenate(xh), np.concatenate(xs)
        order = np.argsort(rows, kind="stable")  # capture order; a packet's datagrams stay in their order
        rows, head, size = rows[order], head[order], size[order]
    h = np.ascontiguousarray(head).view(wire.HEADER_DTYPE).reshape(-1)
    return rows, h, size


def _reverse(table: PacketTable, flow_of: np.ndarray, a: int, b: int) -> bool:
    """True if packets a and b travel in opposite directions of the same connection."""
    return bool(
        table.src[a] == table.dst[b]
        and table.dst[a] == table.src[b]
        and table.sport[a] == table.dport[b]
        and table.dport[a] == table.sport[b]
    )


def _nice_bin(duration: float) -> float:
    """A 1/2/5 x 10^k bin width giving about 60 bins."""
    if duration <= 0:
        return 0.001
    raw = duration / 60
    k = math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * 10**k >= raw:
            return float(m * 10**k)
    return float(10 ** (k + 1))
