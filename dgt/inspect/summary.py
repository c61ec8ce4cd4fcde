"""Summarise DGT traffic in a capture: per lane, per round and over time, from numpy arrays of parsed headers.

The per-round accounting mirrors :class:`dgt.protocol.receiver.RoundReceiver` (same validity rules, same duplicate
and completeness rules), so a capture taken where the receiver sits reproduces its ``RoundStats``; the round is
closed at the time its DROP_REPORT is seen (frames after that are late). See docs/inspect.md for every field.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from dgt import wire
from dgt.inspect.flows import (
    Flows,
    Streams,
    find_flows,
    frame_table,
    packet_lanes,
    reverse_direction,
    tcp_streams,
    udp_datagrams,
)
from dgt.inspect.options import Options
from dgt.inspect.pcapio import TCP, UDP, PacketTable, addr, read_pcap
from dgt.inspect.rounds import (
    Accounts,
    Frames,
    WireRound,
    account_rounds,
    addr_cols,
    group_rows,
    pair,
    segmented_reorder,
)
from dgt.protocol.report import split_report
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


def dscp_name(v: int) -> str:
    return f"{DSCP_NAMES[v]}({v})" if v in DSCP_NAMES else str(v)


def expected_dscp(lane: int, opts: Options, session: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    if lane in opts.expect_dscp:
        return opts.expect_dscp[lane]
    if lane in session:
        return session[lane]
    return DEFAULT_RELIABLE_DSCP if lane == 0 else DEFAULT_UNRELIABLE_DSCP


@dataclass
class _Control:
    session_dscp: dict[int, tuple[int, ...]]
    rounds: dict[tuple, WireRound]
    reports: list[tuple[int, np.ndarray | None]]
    frames: Counter[int]  # control frames per lane


def summarize(source: str | PacketTable, opts: Options | None = None) -> dict:
    """Everything ``dgt inspect`` prints, as a JSON-ready dict. Never raises on packet contents."""
    opts = opts or Options()
    table = read_pcap(source) if isinstance(source, str) else source
    n = len(table)
    malformed: Counter[str] = Counter()
    l4 = table.ok & ((table.proto == UDP) | (table.proto == TCP))
    flows = find_flows(table, l4, opts)
    dg = udp_datagrams(table, l4, flows, opts, malformed)
    streams = tcp_streams(table, l4, flows, opts, malformed)
    fr = frame_table(table, dg, streams)
    ctl = _control_frames(fr, opts.limits, malformed)
    _attach_data(fr, ctl.rounds)
    unmatched_reports = _match_reports(table, flows.flow_of, fr, ctl)
    fr.reordered = _reordering(fr)
    t0 = float(table.ts.min()) if n else 0.0
    acc = Accounts()
    round_out = account_rounds(ctl.rounds, fr, acc, t0)
    bulk_out = _bulk_messages(fr.h, fr.ts, fr.peer, t0, acc.lane, acc.good_ev, acc.warnings)
    pk_lane = packet_lanes(table, dg, streams, flows)
    dgt_pkts = pk_lane >= 0
    all_lanes = sorted(set(np.unique(pk_lane[dgt_pkts]).tolist()) | set(acc.lanes) | set(acc.unannounced))
    _place_unplaced(all_lanes, acc)
    lanes_out = _lanes_out(table, pk_lane, all_lanes, acc, ctl, opts)
    duration = float(table.ts.max() - table.ts.min()) if n else 0.0
    timeline = _timeline(table, pk_lane, all_lanes, acc, t0, duration, opts)
    totals = _totals(round_out, bulk_out, acc, unmatched_reports)
    flows_out = _flows_out(table, flows, streams)
    capture = _capture_health(table, streams, flows, pk_lane)
    mal_total = int(sum(malformed.values()))
    _closing_warnings(acc.warnings, capture["gap_bytes"], malformed, totals, bool(flows_out), n)
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
        session_dscp={str(k): list(v) for k, v in ctl.session_dscp.items()},
        lanes=lanes_out,
        totals=totals,
        rounds=round_out,
        bulk=bulk_out,
        flows=flows_out,
        malformed=dict(total=mal_total, reasons=dict(sorted(malformed.items()))),
        capture=capture,
        timeline=timeline,
        warnings=acc.warnings,
    )


def _control_frames(fr: Frames, limits: wire.Limits, malformed: Counter[str]) -> _Control:
    """Session configuration, rounds' begin/end, drop reports."""
    ctl = _Control({}, {}, [], Counter())
    ftype = fr.h["ftype"]
    for i in np.flatnonzero((ftype != FrameType.DATA) & (ftype != FrameType.BULK)).tolist():
        t = int(ftype[i])
        ctl.frames[int(fr.lane[i])] += 1
        p = fr.payloads.get(i, b"")
        key = fr.round_key(i)
        if t == FrameType.ROUND_BEGIN:
            try:
                numel, block, frag, sizes = wire.decode_round_begin(memoryview(p), limits)
            except wire.WireError:
                malformed["round-begin"] += 1
                continue
            r = ctl.rounds.setdefault(key, WireRound(key))
            if r.begin is None:
                r.begin = (float(fr.ts[i]), numel, block, frag, sizes, int(fr.h["dtype"][i]))
        elif t == FrameType.ROUND_END:
            try:
                end = wire.decode_round_end(memoryview(p))
            except wire.WireError:
                malformed["round-end"] += 1
                continue
            r = ctl.rounds.setdefault(key, WireRound(key))
            if r.end is None:
                r.end = (float(fr.ts[i]), end)
        elif t == FrameType.DROP_REPORT:
            ctl.reports.append((i, _drop_report(fr, i, p, malformed)))
        elif t == FrameType.CONTROL:
            _session_dscp(p, ctl.session_dscp, malformed)
    return ctl


def _drop_report(fr: Frames, i: int, p: bytes, malformed: Counter[str]) -> np.ndarray | None:
    """The received mask of a DROP_REPORT, None if malformed: the bitmap, then with flag TIMING a timing trailer of
    version 1 or 2 (dgt.protocol.report decodes both and checks the size each version has)."""
    try:
        return split_report(p, int(fr.h["count"][i]), bool(fr.h["flags"][i] & Flags.TIMING))[0]
    except wire.WireError:
        malformed["drop-report"] += 1
        return None


def _session_dscp(p: bytes, session_dscp: dict[int, tuple[int, ...]], malformed: Counter[str]) -> None:
    """The DSCP per lane a CONTROL message announces."""
    try:
        msg = json.loads(p.decode())
    except (UnicodeDecodeError, ValueError):
        malformed["control"] += 1
        return
    d = msg.get("dscp") if isinstance(msg, dict) else None
    if isinstance(d, dict):
        for k, v in d.items():
            try:
                session_dscp[int(k)] = tuple(int(x) for x in (v if isinstance(v, list) else [v]))
            except (TypeError, ValueError):
                pass


def _attach_data(fr: Frames, rounds: dict[tuple, WireRound]) -> None:
    """Attach DATA frames to rounds: reliable runs and fragments."""
    data_idx = np.flatnonzero(fr.h["ftype"] == FrameType.DATA)
    if not len(data_idx):
        return
    hd = fr.h[data_idx]
    kinv, _ = group_rows(
        hd["token"].astype(np.uint64),
        pair(hd["rank"], hd["bucket"]),
        hd["round"].astype(np.uint64),
        *addr_cols(fr.peer[data_idx]),
    )
    is_run = fr.tcp[data_idx] & ((fr.h["flags"][data_idx] & Flags.FRAGMENT) == 0)
    order = np.argsort(kinv, kind="stable")
    kb = np.flatnonzero(np.r_[True, np.diff(kinv[order]) != 0, True])
    for a, b in zip(kb[:-1].tolist(), kb[1:].tolist()):
        key = fr.round_key(int(data_idx[order[a]]))
        sel = data_idx[order[a:b]]
        run = is_run[order[a:b]]
        r = rounds.setdefault(key, WireRound(key))
        r.rel = sel[run].tolist()
        r.frag_rows = sel[~run]


def _match_reports(table: PacketTable, flow_of: np.ndarray, fr: Frames, ctl: _Control) -> int:
    """Match drop reports to rounds: same session/bucket/round, report sent by the data's destination. Returns the
    number of reports that match no round (or several)."""
    unmatched = 0
    for i, mask in ctl.reports:
        tok, rk, bk, rd = (int(fr.h[f][i]) for f in ("token", "rank", "bucket", "round"))
        src = bytes(fr.src[i])
        cands = [
            r
            for k, r in ctl.rounds.items()
            if k[0] == tok and k[2] == bk and k[3] == rd and k[4] == src and k[1] != rk and r.begin is not None
        ]
        if len(cands) > 1:
            # prefer the round whose reliable frames travel on the reverse direction of the report's connection
            rev = [r for r in cands if r.rel and reverse_direction(table, flow_of, fr.pkt[r.rel[0]], fr.pkt[i])]
            cands = rev if len(rev) == 1 else cands
        if len(cands) != 1:
            unmatched += 1
            continue
        r = cands[0]
        if r.report is None:
            r.report = (float(fr.ts[i]), mask)
    return unmatched


def _reordering(fr: Frames) -> np.ndarray:
    """Reordering per datagram flow (see docs/inspect.md for the definition)."""
    reordered = np.zeros(len(fr), bool)
    fidx = np.flatnonzero(~fr.tcp & (fr.h["ftype"] == FrameType.DATA))
    if len(fidx):
        hf = fr.h[fidx]
        flow = fr.flow[fidx].astype(np.uint64)
        tok, rb = hf["token"].astype(np.uint64), pair(hf["rank"], hf["bucket"])
        g1, _ = group_rows(flow, tok, rb, pair(hf["round"], hf["block"]))
        r1 = segmented_reorder(g1, hf["offset"].astype(np.int64))
        g2, _ = group_rows(flow, tok, rb)
        r2 = segmented_reorder(g2, hf["round"].astype(np.int64))
        reordered[fidx] = r1 | r2
    return reordered


def _place_unplaced(all_lanes: list[int], acc: Accounts) -> None:
    """Lost and unsent blocks none of whose fragments was seen go on the unreliable lane when there is just one."""
    unreliable = [lane for lane in all_lanes if lane > 0]
    if len(unreliable) == 1:
        acc.lane(unreliable[0])["lost_blocks"] += acc.lost_unplaced
        acc.lane(unreliable[0])["unsent_blocks"] += acc.unsent_unplaced
        acc.lost_unplaced = acc.unsent_unplaced = 0


def _lanes_out(table: PacketTable, pk_lane: np.ndarray, all_lanes: list[int], acc: Accounts, ctl: _Control,
               opts: Options) -> dict[str, dict]:
    """Per lane: packets, DSCP against the expected marking (with a warning when off), frames and accounting."""
    lanes_out: dict[str, dict] = {}
    for lane in all_lanes:
        m = pk_lane == lane
        vals, cnts = np.unique(table.dscp[m], return_counts=True)
        pk = dict(packets=int(m.sum()), wire_bytes=int(table.iplen[m].sum()),
                  dscp={str(int(v)): int(c) for v, c in zip(vals, cnts)})
        a = acc.lanes.get(lane, Counter())
        exp = expected_dscp(lane, opts, ctl.session_dscp)
        seen = {int(k): v for k, v in pk["dscp"].items()}
        off_mark = {k: v for k, v in seen.items() if k not in exp}
        ok = not off_mark
        lanes_out[str(lane)] = dict(
            transport="tcp" if lane == 0 else "udp",
            packets=pk["packets"],
            wire_bytes=pk["wire_bytes"],
            frames=a["frames"],
            control_frames=ctl.frames.get(lane, 0),
            blocks=a["blocks"],
            bytes=a["bytes"],
            dscp=pk["dscp"],
            expected_dscp=list(exp),
            dscp_ok=ok,
            duplicated=a["duplicated"],
            reordered=a["reordered"],
            late_frames=a["late_frames"],
            rejected=a["rejected"],
            goodput_bytes=a["goodput_bytes"],
            # lost: sent on this lane, missing when the round closed; unsent: kept back by the send budget. With
            # several unreliable lanes a block none of whose fragments was seen counts in totals["lost_unplaced"] /
            # totals["unsent_unplaced"] instead
            lost_blocks=a["lost_blocks"],
            unsent_blocks=a["unsent_blocks"],
            bulk_frames=a["bulk_frames"],
            unannounced_frames=acc.unannounced.get(lane, 0),
        )
        if not ok and pk["packets"]:
            acc.warnings.append(_dscp_warning(lane, off_mark, exp, pk["packets"]))
    return lanes_out


def _dscp_warning(lane: int, off_mark: dict[int, int], exp: tuple[int, ...], packets: int) -> str:
    bad = sum(off_mark.values())
    names = ", ".join(dscp_name(k) for k in sorted(off_mark))
    want = " or ".join(dscp_name(k) for k in exp)
    why = ""
    if set(off_mark) == {0}:
        why = ": the marking was bleached to best effort (by the network, or never set by the sender)"
    elif lane != 0 and any(k >= 32 for k in off_mark):
        why = ": unimportant traffic is marked high priority"
    return (f"lane {lane} ({'tcp' if lane == 0 else 'udp'}): DSCP {names} on {bad} of "
            f"{packets} packets, expected {want}{why}")


def _timeline(table: PacketTable, pk_lane: np.ndarray, all_lanes: list[int], acc: Accounts, t0: float,
              duration: float, opts: Options) -> dict:
    """Wire bytes and goodput per lane, drops and late frames, in time bins."""
    n = len(table)
    bin_s = opts.bin_s or _nice_bin(duration)
    nbins = max(1, int(math.floor(duration / bin_s)) + 1) if n else 1
    edges = t0 + np.arange(nbins + 1) * bin_s
    tl_lanes: dict[str, dict] = {}
    good_ev = acc.good_ev
    gts = np.concatenate([e[0] for e in good_ev]) if good_ev else np.zeros(0)
    gln = np.concatenate([e[1] for e in good_ev]) if good_ev else np.zeros(0, np.int64)
    gby = np.concatenate([e[2] for e in good_ev]) if good_ev else np.zeros(0, np.int64)
    for lane in all_lanes:
        m = pk_lane == lane
        wb, _ = np.histogram(table.ts[m], bins=edges, weights=table.iplen[m])
        gm = gln == lane
        gb, _ = np.histogram(gts[gm], bins=edges, weights=gby[gm])
        tl_lanes[str(lane)] = dict(wire_bytes=wb.astype(np.int64).tolist(), goodput_bytes=gb.astype(np.int64).tolist())
    dts = np.array([d[0] for d in acc.drop_ev]) if acc.drop_ev else np.zeros(0)
    dn = np.array([d[1] for d in acc.drop_ev]) if acc.drop_ev else np.zeros(0)
    drops, _ = np.histogram(dts, bins=edges, weights=dn)
    lts = np.concatenate(acc.late_ev) if acc.late_ev else np.zeros(0)
    lateh, _ = np.histogram(lts, bins=edges)
    goodput_total = np.histogram(gts, bins=edges, weights=gby)[0]
    return dict(
        bin_s=bin_s,
        t0=t0,
        bins=nbins,
        lanes=tl_lanes,
        drops=drops.astype(np.int64).tolist(),
        late_frames=lateh.astype(np.int64).tolist(),
        goodput_bps=[round(float(x) * 8 / bin_s, 1) for x in goodput_total],
    )


_TOTAL_KEYS = ("blocks", "important", "unimportant_received", "dropped", "unsent", "partial", "missing",
               "late_frames", "late_blocks", "duplicated", "reordered", "rejected")


def _totals(round_out: list[dict], bulk_out: list[dict], acc: Accounts, unmatched_reports: int) -> dict:
    totals = {k: int(sum(rr[k] for rr in round_out)) for k in _TOTAL_KEYS}
    totals["rounds"] = len(round_out)
    totals["rounds_closed"] = sum(1 for rr in round_out if rr["t_close"] is not None)
    totals["unannounced_frames"] = int(sum(acc.unannounced.values()))
    totals["unmatched_reports"] = unmatched_reports
    totals["lost_unplaced"], totals["unsent_unplaced"] = acc.lost_unplaced, acc.unsent_unplaced
    totals["bulk_messages"] = len(bulk_out)
    totals["bulk_complete"] = sum(1 for m in bulk_out if m["complete"])
    totals["bulk_bytes"] = int(sum(m["bytes"] for m in bulk_out))
    return totals


def _flows_out(table: PacketTable, flows: Flows, streams: Streams) -> list[dict]:
    out = []
    for f in np.flatnonzero(flows.dgt).tolist():
        m = flows.flow_of == f
        vals, cnts = np.unique(table.dscp[m], return_counts=True)
        fo = dict(
            proto="tcp" if flows.proto[f] == TCP else "udp",
            src=addr(table.src[flows.rep[f]]),
            sport=int(flows.sport[f]),
            dst=addr(table.dst[flows.rep[f]]),
            dport=int(flows.dport[f]),
            detected_by=flows.how[f],
            packets=int(m.sum()),
            wire_bytes=int(table.iplen[m].sum()),
            dscp={str(int(v)): int(c) for v, c in zip(vals, cnts)},
        )
        if f in streams.info:
            fo.update(streams.info[f])
        out.append(fo)
    return out


def _capture_health(table: PacketTable, streams: Streams, flows: Flows, pk_lane: np.ndarray) -> dict:
    info = streams.info
    acks = int((flows.dgt[streams.flow] & (table.paylen[streams.rows] == 0)).sum()) if len(streams.rows) else 0
    return dict(
        gap_bytes=sum(s.get("gap_bytes", 0) for s in info.values()),
        retransmitted_segments=sum(s.get("retransmitted_segments", 0) for s in info.values()),
        snapped_packets=int((table.snapped & (pk_lane >= 0)).sum()),
        unknown_link_packets=table.unknown_link,
        tcp_acks=acks,
    )


def _closing_warnings(warnings: list[str], gap_bytes: int, malformed: Counter[str], totals: dict, any_flows: bool,
                      n: int) -> None:
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
    if not any_flows and n:
        warnings.append(
            "no DGT traffic found: pass --udp-port/--tcp-port if the flows carry no DGT header at their start"
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
    kinv, _ = group_rows(hb["token"].astype(np.uint64), pair(hb["rank"], hb["bucket"]),
                         hb["round"].astype(np.uint64), *addr_cols(fr_peer[bidx]))  # fmt: skip
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
