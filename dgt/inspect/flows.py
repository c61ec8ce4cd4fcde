"""From packets to DGT frames: flows and which of them carry DGT, UDP datagrams (GSO aggregates cut back into
datagrams) and reassembled TCP streams, validated like the receiver, in one frame table (the first steps of
:func:`dgt.inspect.summary.summarize`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from dgt import wire
from dgt.inspect import reassembly
from dgt.inspect.options import Options
from dgt.inspect.pcapio import TCP, UDP, PacketTable
from dgt.inspect.rounds import Frames, addr_cols, group_rows
from dgt.wire import Flags, FrameType

REASONS = (*wire.REASONS, "not-a-fragment", "ip-fragment")
_NOT_FRAGMENT = REASONS.index("not-a-fragment")
_IP_FRAGMENT = REASONS.index("ip-fragment")


@dataclass
class Flows:
    """Flows (5-tuples) of the capture and which of them carry DGT."""

    flow_of: np.ndarray  # flow id per packet, -1 for packets that are neither UDP nor TCP
    rep: np.ndarray  # a representative packet of each flow
    proto: np.ndarray
    sport: np.ndarray
    dport: np.ndarray
    dgt: np.ndarray  # bool per flow
    how: list[str]  # how it was detected: "port" or "magic"

    def mark(self, f: int, how: str) -> None:
        self.dgt[f] = True
        self.how[f] = how


@dataclass
class Datagrams:
    rows: np.ndarray  # packet row per datagram
    h: np.ndarray  # header per datagram
    reason: np.ndarray  # 0 = valid, else an index into REASONS
    flow: np.ndarray
    dgt: np.ndarray  # bool: on a DGT flow


@dataclass
class Streams:
    rows: np.ndarray  # TCP packet rows
    flow: np.ndarray
    info: dict[int, dict]  # per DGT stream: frames, gaps, retransmissions, problems
    parts: list[tuple[int, reassembly.StreamFrames]]  # (flow, its valid frames)


def find_flows(table: PacketTable, l4: np.ndarray, opts: Options) -> Flows:
    """Group UDP/TCP packets into flows; those on the configured ports are DGT."""
    rows = np.flatnonzero(l4)
    ports = (table.sport[rows] << 24) | (table.dport[rows] << 8) | table.proto[rows]
    finv, first_row = group_rows(*addr_cols(table.src[rows]), *addr_cols(table.dst[rows]), ports)
    flow_of = np.full(len(table), -1, np.int64)
    flow_of[rows] = finv
    nflows = len(first_row)
    frow = rows[first_row]
    fl = Flows(flow_of, frow, table.proto[frow], table.sport[frow], table.dport[frow], np.zeros(nflows, bool),
                [""] * nflows)
    udp_ports, tcp_ports = set(opts.udp_ports), set(opts.tcp_ports)
    for f in range(nflows):
        fports = {int(fl.sport[f]), int(fl.dport[f])}
        if (fl.proto[f] == UDP and fports & udp_ports) or (fl.proto[f] == TCP and fports & tcp_ports):
            fl.mark(f, "port")
    return fl


def udp_datagrams(table: PacketTable, l4: np.ndarray, flows: Flows, opts: Options,
                   malformed: Counter[str]) -> Datagrams:
    """UDP datagrams, one frame each, validated like the receiver; flows with valid ones are DGT (auto)."""
    limits = opts.limits
    urows, uh, upl = split_datagrams(table, np.flatnonzero(l4 & (table.proto == UDP)))
    ureason = wire.validate(uh, limits).astype(np.int64)
    tag = ((uh["flags"] & Flags.MAC) != 0).astype(np.int64) * wire.MAC_TAG  # a MAC trailer (not checked here: no key)
    bad_len = (ureason == 0) & (uh["length"].astype(np.int64) + wire.HEADER_SIZE + tag != upl)
    ureason[bad_len] = REASONS.index("length")
    ureason[upl < wire.HEADER_SIZE] = REASONS.index("truncated")
    notfrag = (ureason == 0) & ((uh["ftype"] != FrameType.DATA) | ((uh["flags"] & Flags.FRAGMENT) == 0))
    ureason[notfrag] = _NOT_FRAGMENT
    ureason[table.ipfrag[urows]] = _IP_FRAGMENT
    uflow = flows.flow_of[urows]
    if opts.auto and len(urows):
        good_per_flow = np.bincount(uflow, weights=(ureason == 0), minlength=len(flows.dgt)) > 0
        for f in np.flatnonzero(good_per_flow & ~flows.dgt).tolist():
            flows.mark(f, "magic")
    udgt = flows.dgt[uflow] if len(urows) else np.zeros(0, bool)
    for code, cnt in zip(*np.unique(ureason[udgt & (ureason != 0)], return_counts=True)):
        malformed[REASONS[int(code)]] += int(cnt)
    return Datagrams(urows, uh, ureason, uflow, udgt)


def tcp_streams(table: PacketTable, l4: np.ndarray, flows: Flows, opts: Options,
                 malformed: Counter[str]) -> Streams:
    """Reassemble each TCP direction and walk its frames; streams that start with valid frames are DGT (auto)."""
    limits = opts.limits
    trows = np.flatnonzero(l4 & (table.proto == TCP))
    tflow = flows.flow_of[trows]
    out = Streams(trows, tflow, {}, [])
    tcp_order = np.argsort(tflow, kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(tflow[tcp_order]) != 0, True]) if len(trows) else np.zeros(1, int)
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        prow = trows[tcp_order[a:b]]
        f = int(flows.flow_of[prow[0]])
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
        if not flows.dgt[f] and opts.auto and nvalid and (nvalid >= 2 or (len(sf.pos) and sf.pos[0] == 0)):
            flows.mark(f, "magic")
        if not flows.dgt[f]:
            continue
        for code, cnt in zip(*np.unique(reason[reason != 0], return_counts=True)):
            malformed[wire.REASONS[int(code)]] += int(cnt)
        if sf.problems.get("resync"):
            malformed["stream-garbage"] += sf.problems["resync"]
        out.info[f] = dict(
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
        out.parts.append((f, sf))
    return out


def frame_table(table: PacketTable, dg: Datagrams, streams: Streams) -> Frames:
    """One frame table: reliable frames then valid datagrams."""
    rel_parts = streams.parts
    uvalid = dg.dgt & (dg.reason == 0)
    uv = dg.rows[uvalid]
    hs = [sf.headers for _, sf in rel_parts] + [dg.h[uvalid]]
    fr_h = np.concatenate(hs) if hs else np.zeros(0, wire.HEADER_DTYPE)
    fr_ts = np.concatenate([sf.ts for _, sf in rel_parts] + [table.ts[uv]])
    fr_pkt = np.concatenate([sf.pkt for _, sf in rel_parts] + [uv]).astype(np.int64)
    fr_flow = np.concatenate([np.full(len(sf.pos), f, np.int64) for f, sf in rel_parts] + [dg.flow[uvalid]])
    fr_tcp = np.concatenate([np.ones(len(sf.pos), bool) for _, sf in rel_parts] + [np.zeros(len(uv), bool)])
    payloads: dict[int, bytes] = {}
    base = 0
    for _, sf in rel_parts:
        for j, p in sf.payloads.items():
            payloads[base + j] = p
        base += len(sf.pos)
    fr_peer = table.dst[fr_pkt] if len(fr_pkt) else np.zeros(0, "S16")
    fr_src = table.src[fr_pkt] if len(fr_pkt) else np.zeros(0, "S16")
    fr_lane = fr_h["lane"].astype(np.int64)
    fr_lane[fr_tcp] = 0
    return Frames(fr_h, fr_ts, fr_pkt, fr_flow, fr_tcp, payloads, fr_peer, fr_src, fr_lane)


def packet_lanes(table: PacketTable, dg: Datagrams, streams: Streams, flows: Flows) -> np.ndarray:
    """The lane of every DGT packet (-1: not DGT). Datagrams: lane from their header; undecodable ones take their
    flow's most common lane."""
    pk_lane = np.full(len(table), -1, np.int64)
    if len(dg.rows):
        ul = dg.h["lane"].astype(np.int64)
        for f in np.unique(dg.flow[dg.dgt]).tolist():
            m = dg.dgt & (dg.flow == f)
            okl = ul[m & (dg.reason == 0)]
            mode = int(np.bincount(okl).argmax()) if len(okl) else -1
            ul[m & (dg.reason != 0)] = mode
        pk_lane[dg.rows[dg.dgt]] = ul[dg.dgt]
    if len(streams.rows):
        tdgt = flows.dgt[streams.flow] & (table.paylen[streams.rows] > 0)
        pk_lane[streams.rows[tdgt]] = 0
    return pk_lane


def split_datagrams(table: PacketTable, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def reverse_direction(table: PacketTable, flow_of: np.ndarray, a: int, b: int) -> bool:
    """True if packets a and b travel in opposite directions of the same connection."""
    return bool(
        table.src[a] == table.dst[b]
        and table.dst[a] == table.src[b]
        and table.sport[a] == table.dport[b]
        and table.dport[a] == table.sport[b]
    )
