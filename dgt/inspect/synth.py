"""Write genuine DGT rounds straight into a pcap, without sockets: the frames come from ``RoundSender``, the
receiver's account from a ``RoundReceiver`` fed the same packets in the same order, so the file has a ground truth.

For tests that need what loopback cannot give quickly: other link types, IPv6, VLAN tags, bleached markings,
corruption, and captures of 100k packets. Headers are packed with ``struct`` (building scapy packets would
dominate the run time at that scale).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from dgt import wire
from dgt.inspect import pcapio
from dgt.inspect.traffic import TrafficResult, TrafficSpec, datagrams_of, plan_round, schedule
from dgt.layout import BucketLayout
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender


@dataclass
class Wire:
    """How packets are framed in the file."""

    link: int = pcapio.ETHERNET  # ETHERNET, LINUX_SLL, LINUX_SLL2 or RAW
    ipv6: bool = False
    vlan: int | None = None
    mss: int = 1448
    reliable_dscp: int = 46
    src: str = "10.0.0.1"
    dst: str = "10.0.0.2"
    tcp_ports: tuple[int, int] = (40000, 5201)  # sender, receiver
    udp_ports: tuple[int, int] = (40001, 5202)


def _ip_bytes(a: str, v6: bool) -> bytes:
    import ipaddress

    ip = ipaddress.ip_address(a)
    if v6 and ip.version == 4:
        ip = ipaddress.IPv6Address("fd00::" + a.replace(".", ":"))  # a stable v6 twin of a v4 test address
    return ip.packed


class PcapOut:
    """Minimal pcap writer (microsecond timestamps) for synthetic packets."""

    def __init__(self, path: str, w: Wire) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.w = w
        self.f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 1 << 18, w.link))
        self.packets = 0
        self._a, self._b = _ip_bytes(w.src, w.ipv6), _ip_bytes(w.dst, w.ipv6)
        self._l2s = {v6: self._l2(v6) for v6 in (False, True)}

    def close(self) -> None:
        self.f.close()

    def _l2(self, v6: bool) -> bytes:
        et = 0x86DD if v6 else 0x0800
        if self.w.link == pcapio.ETHERNET:
            tag = struct.pack(">HH", 0x8100, self.w.vlan) if self.w.vlan is not None else b""
            return b"\x02\0\0\0\0\x02\x02\0\0\0\0\x01" + tag + struct.pack(">H", et)
        if self.w.link == pcapio.LINUX_SLL:
            return struct.pack(">HHH8sH", 0, 1, 6, b"\x02\0\0\0\0\x01", et)
        if self.w.link == pcapio.LINUX_SLL2:
            return struct.pack(">HHIHBB8s", et, 0, 1, 1, 0, 6, b"\x02\0\0\0\0\x01")
        return b""

    def packet(
        self,
        ts: float,
        l4: bytes,
        proto: int,
        dscp: int,
        forward: bool = True,
        ipv4_total: int | None = None,
    ) -> None:
        w = self.w
        s, d = (self._a, self._b) if forward else (self._b, self._a)
        if w.ipv6:
            ip = struct.pack(">IHBB", (6 << 28) | (dscp << 22), len(l4), proto, 64) + s + d
        else:
            total = ipv4_total if ipv4_total is not None else 20 + len(l4)
            ip = struct.pack(">BBHHHBBH4s4s", 0x45, dscp << 2, total, 0, 0x4000, 64, proto, 0, s, d)
        frame = self._l2s[w.ipv6] + ip + l4
        sec = int(ts)
        self.f.write(struct.pack("<IIII", sec, int(round((ts - sec) * 1e6)), len(frame), len(frame)) + frame)
        self.packets += 1


def udp(sport: int, dport: int, payload: bytes) -> bytes:
    return struct.pack(">HHHH", sport, dport, 8 + len(payload), 0) + payload


def tcp(sport: int, dport: int, seq: int, payload: bytes, flags: int = 0x18) -> bytes:
    return struct.pack(">HHIIBBHHH", sport, dport, seq & 0xFFFFFFFF, 0, 5 << 4, flags, 65535, 0, 0) + payload


class _Conn:
    """One direction of a synthetic TCP connection: cuts a byte stream into MSS segments."""

    def __init__(self, out: PcapOut, forward: bool, isn: int) -> None:
        self.out, self.forward, self.seq = out, forward, isn
        w = out.w
        self.ports = w.tcp_ports if forward else w.tcp_ports[::-1]

    def syn(self, ts: float) -> None:
        self.out.packet(ts, tcp(*self.ports, self.seq, b"", 0x02), pcapio.TCP, self.out.w.reliable_dscp, self.forward)
        self.seq += 1

    def send(self, ts: float, data: bytes, step: float) -> float:
        for i in range(0, len(data), self.out.w.mss):
            seg = data[i : i + self.out.w.mss]
            self.out.packet(ts, tcp(*self.ports, self.seq, seg), pcapio.TCP, self.out.w.reliable_dscp, self.forward)
            self.seq += len(seg)
            ts += step
        return ts


def _open_conns(out: PcapOut, step: float) -> tuple[_Conn, _Conn, float]:
    """The reliable lane's two directions, their SYNs written; and the time after them."""
    fwd, back = _Conn(out, True, 1000), _Conn(out, False, 5000)
    ts = 1_700_000_000.0
    fwd.syn(ts)
    back.syn(ts + step)
    return fwd, back, ts + 2 * step


def synth_rounds(
    path: str,
    spec: TrafficSpec | None = None,
    w: Wire | None = None,
    step: float = 2e-6,
    truth: bool = True,
) -> TrafficResult:
    """Write ``spec.rounds`` rounds to ``path`` and return the receiver's statistics for them.

    ``truth=False`` skips the receiver (and so the drop reports): only for volume, e.g. a 100k-packet file."""
    spec = spec or TrafficSpec()
    w = w or Wire()
    rng = np.random.default_rng(spec.seed)
    layout = BucketLayout(list(spec.sizes), spec.block)
    tx = RoundSender(spec.token, 0, lanes=spec.lanes)
    rx = RoundReceiver(spec.token, rank=1)
    out = PcapOut(path, w)
    fwd, back, ts = _open_conns(out, step)
    res = TrafficResult(tcp_port=w.tcp_ports[1], udp_ports=[w.udp_ports[1] + k for k in range(spec.lanes - 1)])
    done: list[RoundDone] = []
    clock = [ts]

    def closed(events: list) -> None:
        """A finalised round: its drop report goes back on the reliable lane right away."""
        for e in events:
            if isinstance(e, RoundDone):
                done.append(e)
                clock[0] = back.send(clock[0], e.report, step)
                tx.on_drop_report(wire.decode_frames(e.report)[0])

    def feed_udp(lane: int, g: bytes) -> None:
        sport, dport = w.udp_ports[0] + lane - 1, w.udp_ports[1] + lane - 1
        out.packet(clock[0], udp(sport, dport, g), pcapio.UDP, spec.low_dscp)
        if truth:
            closed(rx.receive_datagrams(wire.decode_datagrams(g, [len(g)]), lane, clock[0]))
        clock[0] += step
        res.sent_datagrams += 1

    try:
        for rnd in range(spec.rounds):
            plan = plan_round(rng, spec, tx, layout, rnd)
            stream = b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)
            res.sent_reliable_bytes += len(stream)
            n = len(done)
            clock[0] = fwd.send(clock[0], stream, step)
            for f in wire.decode_frames(stream) if truth else []:
                closed(rx.receive_frame(f, 0, clock[0]))
            late: list[tuple[int, bytes]] = []
            for lane in range(1, spec.lanes):
                for g in schedule(rng, spec, lane, datagrams_of(plan, lane), late):
                    feed_udp(lane, g)
            closed(rx.on_time(clock[0] + 3600.0))  # the deadline passes
            if truth and len(done) == n:
                raise RuntimeError(f"round {rnd} did not close")
            for lane, g in late:
                feed_udp(lane, g)
        res.stats, res.late, res.rejected = [d.stats.to_dict() for d in done], rx.counters.late, rx.counters.rejected
    finally:
        out.close()
    return res
