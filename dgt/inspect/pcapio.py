"""Read a pcap/pcapng file into a columnar packet table: link, IP and UDP/TCP headers parsed with numpy.

Reading is the one per-packet Python loop (scapy's RawPcapReader hands out records one by one); everything after
that works on arrays. Only the first ``HEAD`` bytes of each packet are kept for header parsing, plus the full
payload of TCP segments (needed for stream reassembly), so memory stays near the size of the reliable lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scapy.error import Scapy_Exception
from scapy.utils import RawPcapReader

HEAD = 192  # bytes kept per packet: Ethernet + 2 VLAN tags + IPv4 options + TCP options + one DGT header
CHUNK = 1 << 15  # packets parsed per vectorised pass
MAX_RECORD = 1 << 20  # read whole loopback GSO segments (scapy's default cuts records at 64 KiB)

# link types (pcap LINKTYPE_*): where the network header starts
ETHERNET, RAW, RAW_OLD, RAW_OPENBSD, NULL, LOOP = 1, 101, 12, 14, 0, 108
LINUX_SLL, LINUX_SLL2, IPV4, IPV6 = 113, 276, 228, 229
KNOWN_LINKS = (ETHERNET, RAW, RAW_OLD, RAW_OPENBSD, NULL, LOOP, LINUX_SLL, LINUX_SLL2, IPV4, IPV6)
TCP, UDP = 6, 17


class PcapError(Exception):
    """The file is not a readable pcap/pcapng capture."""


@dataclass
class PacketTable:
    """One row per captured packet; header fields of non-IP or unparsable packets are zero with ``ok`` False."""

    ts: np.ndarray  # float64 seconds
    caplen: np.ndarray  # bytes captured
    wirelen: np.ndarray  # bytes on the wire
    ok: np.ndarray  # bool: IPv4/IPv6 with a UDP or TCP header fully captured
    ipver: np.ndarray  # 4, 6 or 0
    src: np.ndarray  # 'S16' (IPv4 as ::ffff:a.b.c.d)
    dst: np.ndarray
    dscp: np.ndarray  # uint8
    ecn: np.ndarray
    proto: np.ndarray  # 6 / 17
    iplen: np.ndarray  # IP packet length (header + payload) from the IP header
    sport: np.ndarray
    dport: np.ndarray
    payoff: np.ndarray  # byte offset of the L4 payload in the captured packet
    paylen: np.ndarray  # L4 payload length according to the headers
    seq: np.ndarray  # TCP sequence number (uint32 as int64)
    tcpflags: np.ndarray  # TCP flags byte
    ipfrag: np.ndarray  # bool: IPv4 fragment (not the first one, or more to come)
    gso: np.ndarray  # bool: UDP GSO aggregate of several datagrams of ``paylen`` bytes (the last may be shorter)
    head: np.ndarray  # uint8 [n, HEAD] first bytes of each packet
    tcp_payload: dict[int, bytes] = field(default_factory=dict)  # packet index -> captured TCP payload
    gso_payload: dict[int, bytes] = field(default_factory=dict)  # packet index -> UDP payload of a GSO aggregate
    linktypes: set[int] = field(default_factory=set)
    unknown_link: int = 0  # packets of a link type this reader does not parse

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def snapped(self) -> np.ndarray:
        """Packets whose L4 payload was cut by the capture's snap length."""
        return self.ok & (self.caplen - self.payoff < self.paylen)

    def udp_payload_head(self, rows: np.ndarray, nbytes: int) -> np.ndarray:
        """uint8 [len(rows), nbytes]: the first bytes of each row's UDP payload (zero-filled past the capture)."""
        if len(rows) == 0:
            return np.zeros((0, nbytes), np.uint8)
        idx = self.payoff[rows, None] + np.arange(nbytes)[None, :]
        avail = idx < np.minimum(self.caplen[rows], HEAD)[:, None]
        out = self.head[rows[:, None], np.minimum(idx, HEAD - 1)]
        out[~avail] = 0
        return out


def _be16(h: np.ndarray, rows: np.ndarray, off: np.ndarray) -> np.ndarray:
    return (h[rows, off].astype(np.int64) << 8) | h[rows, off + 1]


def _be32(h: np.ndarray, rows: np.ndarray, off: np.ndarray) -> np.ndarray:
    return (_be16(h, rows, off) << 16) | _be16(h, rows, off + 2)


def _link_layer(h: np.ndarray, rows: np.ndarray, linktype: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per packet: the offset of the IP header (-1: unknown link), the ethertype (0: decide by the IP version
    nibble) and whether the version nibble decides."""
    n = len(rows)
    l3 = np.full(n, -1, np.int64)
    et = np.zeros(n, np.int64)  # ethertype, or 0 = decide by IP version nibble
    eth = linktype == ETHERNET
    l3[eth] = 14
    et[eth] = _be16(h, rows[eth], np.full(eth.sum(), 12))
    for _ in range(2):  # 802.1Q / 802.1ad tags
        vlan = eth & ((et == 0x8100) | (et == 0x88A8))
        et[vlan] = _be16(h, rows[vlan], l3[vlan] + 2)
        l3[vlan] += 4
    sll = linktype == LINUX_SLL
    l3[sll] = 16
    et[sll] = _be16(h, rows[sll], np.full(sll.sum(), 14))
    sll2 = linktype == LINUX_SLL2
    l3[sll2] = 20
    et[sll2] = _be16(h, rows[sll2], np.zeros(sll2.sum(), np.int64))
    raw = np.isin(linktype, (RAW, RAW_OLD, RAW_OPENBSD, IPV4, IPV6))
    l3[raw] = 0
    null = np.isin(linktype, (NULL, LOOP))
    l3[null] = 4
    bynibble = raw | null
    return l3, et, bynibble


def _addresses(h: np.ndarray, rows: np.ndarray, l3c: np.ndarray, v4: np.ndarray,
               v6: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination addresses, 16 bytes a packet (IPv4 as IPv4-mapped IPv6)."""
    n = len(h)
    src = np.zeros((n, 16), np.uint8)
    dst = np.zeros((n, 16), np.uint8)
    a4 = l3c[v4, None]
    src[v4, 10:12] = 0xFF
    dst[v4, 10:12] = 0xFF
    src[v4, 12:] = h[rows[v4, None], a4 + 12 + np.arange(4)]
    dst[v4, 12:] = h[rows[v4, None], a4 + 16 + np.arange(4)]
    a6 = l3c[v6, None]
    src[v6] = h[rows[v6, None], a6 + 8 + np.arange(16)]
    dst[v6] = h[rows[v6, None], a6 + 24 + np.arange(16)]
    return src, dst


def _udp_gso(h: np.ndarray, rows: np.ndarray, payoff: np.ndarray, udp_ok: np.ndarray, ippay: np.ndarray,
             paylen: np.ndarray) -> np.ndarray:
    """Which UDP packets are GSO aggregates (seen unsegmented on loopback): the UDP length is one segment, the IP
    length all of them, or, as loopback also shows them, one UDP packet holding the whole run of equal datagrams back
    to back (a DGT header whose length ends before the payload does)."""
    p0 = np.minimum(payoff, HEAD)
    first_len = _be32(h, rows, p0 + 44)
    magic = (h[rows, p0] == 0x44) & (h[rows, p0 + 1] == 0x47)
    return udp_ok & ((ippay - 8 > paylen) | (magic & (first_len + 48 < paylen)))


def _parse(head: np.ndarray, caplen: np.ndarray, linktype: np.ndarray) -> dict[str, np.ndarray]:
    """Vectorised link/IP/L4 parse of a chunk of packet heads."""
    n = len(head)
    h = np.zeros((n, HEAD + 64), np.uint8)  # room so fixed offsets never index past the end
    h[:, :HEAD] = head
    rows = np.arange(n)
    l3, et, bynibble = _link_layer(h, rows, linktype)
    l3c = np.maximum(l3, 0)
    ver = h[rows, l3c] >> 4
    v4 = (l3 >= 0) & np.where(bynibble, ver == 4, et == 0x0800) & (ver == 4)
    v6 = (l3 >= 0) & np.where(bynibble, ver == 6, et == 0x86DD) & (ver == 6)

    ihl = np.where(v4, (h[rows, l3c] & 0xF).astype(np.int64) * 4, 40)
    tos = np.where(v4, h[rows, l3c + 1], ((h[rows, l3c] & 0xF) << 4) | (h[rows, l3c + 1] >> 4)).astype(np.uint8)
    totlen4 = _be16(h, rows, l3c + 2)
    iplen = np.where(v4, totlen4, _be16(h, rows, l3c + 4) + 40)
    # TSO/GSO captures may carry IPv4 total length 0: trust the capture then
    iplen = np.where(v4 & (totlen4 == 0), caplen - l3c, iplen)
    proto = np.where(v4, h[rows, l3c + 9], h[rows, l3c + 6]).astype(np.int64)
    fragw = _be16(h, rows, l3c + 6)
    ipfrag = v4 & (((fragw & 0x2000) != 0) | ((fragw & 0x1FFF) != 0))
    src, dst = _addresses(h, rows, l3c, v4, v6)

    l4 = l3c + ihl
    ip = (v4 | v6) & (ihl >= 20) & ~(v4 & ((fragw & 0x1FFF) != 0))
    is_udp = ip & (proto == UDP)
    is_tcp = ip & (proto == TCP)
    l4c = np.minimum(l4, HEAD)
    sport = _be16(h, rows, l4c)
    dport = _be16(h, rows, l4c + 2)
    doff = (h[rows, l4c + 12] >> 4).astype(np.int64) * 4
    payoff = np.where(is_tcp, l4 + doff, l4 + 8)
    ippay = iplen - ihl
    paylen = np.where(is_tcp, ippay - doff, _be16(h, rows, l4c + 4) - 8)
    ok = (is_udp | (is_tcp & (doff >= 20))) & (payoff <= np.minimum(caplen, HEAD)) & (paylen >= 0)
    ok &= l4 + 8 <= HEAD
    z = lambda a: np.where(ok, a, 0)
    gso = _udp_gso(h, rows, payoff, ok & is_udp & (paylen > 0), ippay, paylen)
    return dict(
        gso=gso,
        udpall=np.where(gso, np.maximum(ippay - 8, paylen), 0),
        ok=ok,
        ipver=np.where(v4, 4, np.where(v6, 6, 0)).astype(np.uint8),
        src=np.ascontiguousarray(src).view("S16").reshape(-1),
        dst=np.ascontiguousarray(dst).view("S16").reshape(-1),
        dscp=(tos >> 2).astype(np.uint8),
        ecn=(tos & 3).astype(np.uint8),
        proto=z(proto).astype(np.uint8),
        iplen=np.where(v4 | v6, iplen, 0),
        sport=z(sport),
        dport=z(dport),
        payoff=z(payoff),
        paylen=z(paylen),
        seq=np.where(ok & is_tcp, _be32(h, rows, l4c + 4), 0),
        tcpflags=np.where(ok & is_tcp, h[rows, l4c + 13], 0).astype(np.uint8),
        ipfrag=ipfrag,
    )


def _timestamp(meta, nano: bool) -> float:
    if hasattr(meta, "tsresol"):
        return ((meta.tshigh << 32) | meta.tslow) / meta.tsresol
    return meta.sec + meta.usec * (1e-9 if nano else 1e-6)


def _read_chunk(reader: RawPcapReader, room: int, nano: bool,
                default_lt: int) -> tuple[list[bytes], list[float], list[int], list[int], bool]:
    """Up to ``room`` packet records: their bytes, times, wire lengths, link types, and whether the file ended (or
    broke off: a truncated last record just ends it)."""
    datas: list[bytes] = []
    ts: list[float] = []
    wl: list[int] = []
    lts: list[int] = []
    while len(datas) < room:
        try:
            rec = reader._read_packet(MAX_RECORD)
        except (EOFError, Scapy_Exception):
            return datas, ts, wl, lts, True
        if rec is None:  # pcapng block that is not a packet
            continue
        data, meta = rec
        datas.append(data)
        ts.append(_timestamp(meta, nano))
        wl.append(int(meta.wirelen))
        lts.append(int(getattr(meta, "linktype", default_lt)))
    return datas, ts, wl, lts, False


def _keep(out: dict[int, bytes], datas: list[bytes], base: int, cols: dict[str, np.ndarray], rows: np.ndarray,
          length: str) -> None:
    """The payload (from ``payoff``, ``cols[length]`` bytes) of each packet of ``rows``, by its index in the table."""
    at = np.flatnonzero(rows)
    offs, lens = cols["payoff"][at].tolist(), cols[length][at].tolist()
    for i, off, ln in zip(at.tolist(), offs, lens):
        out[base + i] = datas[i][off : off + ln]


def read_pcap(path: str, max_packets: int | None = None) -> PacketTable:
    """Parse a capture file. Raises :class:`PcapError` if it is not a pcap/pcapng file; a truncated last record
    just ends the table (a capture killed mid-write is still worth summarising)."""
    try:
        reader = RawPcapReader(path)
    except (Scapy_Exception, OSError, EOFError, ValueError) as exc:
        raise PcapError(f"{path}: {exc}") from None
    parts: list[dict[str, np.ndarray]] = []
    tcp_payload: dict[int, bytes] = {}
    gso_payload: dict[int, bytes] = {}
    linktypes: set[int] = set()
    nano = bool(getattr(reader, "nano", False))
    default_lt = getattr(reader, "linktype", ETHERNET)
    base = 0
    unknown = 0
    try:
        done = False
        while not done:
            room = CHUNK if max_packets is None else min(CHUNK, max_packets - base)
            datas, ts, wl, lts, done = _read_chunk(reader, room, nano, default_lt)
            done = done or (max_packets is not None and base + len(datas) >= max_packets)
            if not datas:
                break
            caplen = np.fromiter((len(d) for d in datas), np.int64, len(datas))
            head = np.frombuffer(b"".join(d[:HEAD].ljust(HEAD, b"\0") for d in datas), np.uint8)
            head = head.reshape(len(datas), HEAD)
            lt = np.asarray(lts, np.int64)
            linktypes.update(np.unique(lt).tolist())
            unknown += int((~np.isin(lt, KNOWN_LINKS)).sum())
            cols = _parse(head, caplen, lt)
            cols.update(ts=np.asarray(ts, np.float64), caplen=caplen, wirelen=np.asarray(wl, np.int64), head=head)
            _keep(tcp_payload, datas, base, cols, cols["ok"] & (cols["proto"] == TCP) & (cols["paylen"] > 0), "paylen")
            _keep(gso_payload, datas, base, cols, cols["gso"], "udpall")
            parts.append(cols)
            base += len(datas)
    finally:
        reader.close()
    if not parts:
        empty = _parse(np.zeros((0, HEAD), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64))
        empty.update(
            ts=np.zeros(0),
            caplen=np.zeros(0, np.int64),
            wirelen=np.zeros(0, np.int64),
            head=np.zeros((0, HEAD), np.uint8),
        )
        parts = [empty]
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    cols.pop("udpall")
    table = PacketTable(**cols, tcp_payload=tcp_payload, gso_payload=gso_payload, linktypes=linktypes)
    table.unknown_link = unknown
    return table


def addr(a: bytes) -> str:
    """Printable address from the 16-byte column (IPv4-mapped shown as dotted quad)."""
    import ipaddress

    a = a.ljust(16, b"\0")
    ip = ipaddress.IPv6Address(a)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)
