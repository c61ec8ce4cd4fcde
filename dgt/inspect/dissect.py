"""scapy dissectors for DGT frames, so a user can ``show()`` a frame in a pcap the way they would any other protocol.

The bulk summaries never go through these classes (they parse headers with numpy, see ``pcapio``); these are for
display, for hand-crafting test frames and for scapy's own ``TCPSession`` stream reassembly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
from scapy.fields import (
    ByteEnumField,
    ByteField,
    FieldLenField,
    FieldListField,
    FlagsField,
    IntField,
    LongField,
    PacketListField,
    StrField,
    XLongField,
    XShortField,
)
from scapy.layers.inet import TCP, UDP
from scapy.packet import Packet, Padding, bind_layers, split_layers

from dgt import wire
from dgt.protocol.report import Timing, split_report

FTYPES = {int(t): t.name for t in wire.FrameType}
DTYPES = {int(t): t.name.lower() for t in wire.WireDType}
FLAG_NAMES = ["IMPORTANT", "FRAGMENT", "RESEND", "CLOSED", "NO_REPORT", "TIMING", "MAC"]


class DGT(Packet):
    """The 48-byte DGT header; the payload layer is chosen by ``ftype``; ``length`` bounds the payload so
    back-to-back frames (a TCP stream) split at the right place."""

    name = "DGT"
    fields_desc = [
        XShortField("magic", wire.MAGIC),
        ByteField("version", wire.VERSION),
        ByteEnumField("ftype", wire.FrameType.DATA, FTYPES),
        FlagsField("flags", 0, 8, FLAG_NAMES),
        ByteEnumField("dtype", 0, DTYPES),
        ByteField("codec", 0),
        ByteField("lane", 0),
        XLongField("token", 0),
        IntField("rank", 0),
        IntField("round", 0),
        IntField("bucket", 0),
        IntField("block", 0),
        LongField("offset", 0),
        IntField("count", 0),
        IntField("length", None),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.length is None:
            pkt = pkt[:44] + len(pay).to_bytes(4, "big") + pkt[48:]
        return pkt + pay

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        n = self.length or 0
        return s[:n], s[n:]

    def mysummary(self) -> str:
        return self.sprintf(
            "DGT %ftype% lane=%lane% rank=%rank% bucket=%bucket% round=%round% block=%block% "
            "off=%offset% n=%count% [%flags%]"
        )

    @classmethod
    def tcp_reassemble(cls, data: bytes, metadata: dict, session: dict) -> Packet | None:
        """scapy ``TCPSession`` hook: hand back the stream once it ends on a frame boundary (never half a frame)."""
        end = frames_end(data)
        if end == 0:
            return None
        return DGTStream(data[:end]) / Padding(data[end:]) if end < len(data) else DGTStream(data)


class DGTData(Packet):
    """DATA payload: ``count`` elements of ``dtype``, raw bytes (see :func:`values`)."""

    name = "DGT data"
    fields_desc = [StrField("data", b"")]


class DGTBulk(Packet):
    """BULK payload: elements ``[offset, offset+count)`` of a lossless message of ``block`` elements (see
    :func:`values`)."""

    name = "DGT bulk"
    fields_desc = [StrField("data", b"")]


class DGTRoundBegin(Packet):
    name = "DGT round begin"
    fields_desc = [
        LongField("numel", 0),
        IntField("block", 1024),
        IntField("frag", 1024),
        FieldLenField("ntensors", None, count_of="sizes", fmt="!I"),
        FieldListField("sizes", [], LongField("", 0), count_from=lambda p: p.ntensors),
    ]


class DGTRoundEnd(Packet):
    name = "DGT round end"
    fields_desc = [
        IntField("important_blocks", 0),
        IntField("unimportant_blocks", 0),
        IntField("important_frames", 0),
        IntField("unimportant_frames", 0),
    ]


class DGTDropReport(Packet):
    """Receiver -> sender: packbits bitmap of the blocks that arrived (the header's ``count`` = number of blocks),
    then with flag TIMING the timing trailer, version 1 or 2 (:mod:`dgt.protocol.report`); ``bitmap`` holds both."""

    name = "DGT drop report"
    fields_desc = [StrField("bitmap", b"")]

    def received(self) -> np.ndarray:
        """Boolean mask of received blocks (needs the header above it for the block count)."""
        under = self.underlayer
        n = int(under.count) if isinstance(under, DGT) else 8 * len(self.bitmap)
        return np.unpackbits(np.frombuffer(self.bitmap, np.uint8), count=n).astype(bool)

    def timing(self) -> Timing | None:
        """The timing trailer (None: the frame has no flag TIMING or no header above it); WireError if malformed."""
        under = self.underlayer
        if not isinstance(under, DGT) or not int(under.flags) & wire.Flags.TIMING:
            return None
        return split_report(self.bitmap, int(under.count), True)[1]

    def mysummary(self) -> str:
        got = self.received()
        out = f"drop report: {int(got.sum())}/{len(got)} blocks received"
        try:
            t = self.timing()
        except wire.WireError as e:
            return f"{out}; malformed timing trailer ({e})"
        if t is not None:
            out += f"; {t.datagrams} unimportant datagrams, {t.nbytes} B, waited {t.wait * 1e3:.3f} ms"
            out += "" if t.close is None else f", closed at {t.close:.6f} s (receiver clock)"
        return out


class DGTControl(Packet):
    name = "DGT control"
    fields_desc = [StrField("message", b"")]

    def json(self) -> object:
        return json.loads(self.message.decode())


class DGTStream(Packet):
    """Back-to-back frames of a reassembled reliable-lane (TCP) stream."""

    name = "DGT stream"
    fields_desc = [PacketListField("frames", [], DGT)]


bind_layers(DGT, DGTData, ftype=wire.FrameType.DATA)
bind_layers(DGT, DGTRoundBegin, ftype=wire.FrameType.ROUND_BEGIN)
bind_layers(DGT, DGTRoundEnd, ftype=wire.FrameType.ROUND_END)
bind_layers(DGT, DGTDropReport, ftype=wire.FrameType.DROP_REPORT)
bind_layers(DGT, DGTControl, ftype=wire.FrameType.CONTROL)
bind_layers(DGT, DGTBulk, ftype=wire.FrameType.BULK)


def values(frame: DGT) -> np.ndarray:
    """The elements a DATA or BULK frame carries, as a numpy array of its wire dtype (bfloat16 comes back as raw
    uint16)."""
    # payload bytes are the sender's tensor memory (little-endian); only the header is big-endian
    np_of = {0: "<f4", 1: "<f2", 2: "<u2", 3: "u1", 4: "<i4", 5: "<i8", 6: "<f8", 7: "i1"}
    return np.frombuffer(bytes(frame.payload.data), dtype=np_of[int(frame.dtype)])


def frames_end(data: bytes) -> int:
    """Byte offset just past the last complete frame of a stream chunk that starts on a frame boundary."""
    pos = 0
    while pos + wire.HEADER_SIZE <= len(data):
        if data[pos : pos + 2] != b"DG":
            return pos
        end = pos + wire.HEADER_SIZE + int.from_bytes(data[pos + 44 : pos + 48], "big")
        if end > len(data):
            break
        pos = end
    return pos


_bound: set[tuple[str, int]] = set()


def bind_ports(udp: Iterable[int] = (), tcp: Iterable[int] = ()) -> None:
    """Make scapy dissect these UDP ports as one DGT frame per datagram and these TCP ports as frame streams.

    A TCP segment need not start on a frame boundary: use scapy's ``TCPSession`` (which calls
    :meth:`DGT.tcp_reassemble`) or :func:`dgt.inspect.reassembly` for whole streams.
    """
    for proto, layer, target, ports in (("udp", UDP, DGT, udp), ("tcp", TCP, DGT, tcp)):
        for p in ports:
            if (proto, int(p)) in _bound:
                continue
            bind_layers(layer, target, dport=int(p))
            bind_layers(layer, target, sport=int(p))
            _bound.add((proto, int(p)))


def unbind_ports() -> None:
    """Undo :func:`bind_ports` (tests, or a long-lived interpreter inspecting captures of different sessions)."""
    for proto, p in list(_bound):
        layer = UDP if proto == "udp" else TCP
        split_layers(layer, DGT, dport=p)
        split_layers(layer, DGT, sport=p)
        _bound.discard((proto, p))


def dissect(payload: bytes) -> Packet:
    """Dissect bytes holding one or more back-to-back frames: a single :class:`DGT` or a :class:`DGTStream`."""
    end = frames_end(payload)
    if end == len(payload) and end and wire.HEADER_SIZE + int.from_bytes(payload[44:48], "big") == end:
        return DGT(payload)
    return DGTStream(payload)
