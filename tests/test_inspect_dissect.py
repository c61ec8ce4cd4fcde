"""scapy dissectors: every frame type against the wire format, port binding, TCP stream reassembly."""

from __future__ import annotations

import numpy as np
import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.sessions import TCPSession
from scapy.utils import PcapReader, wrpcap

from dgt import wire
from dgt.inspect import dissect
from dgt.inspect.dissect import DGT, DGTControl, DGTDropReport, DGTRoundBegin, DGTRoundEnd, DGTStream
from dgt.wire import FrameType


def _frames() -> list[bytes]:
    data = np.arange(6, dtype="<f4")
    return [
        wire.encode_frame(
            FrameType.ROUND_BEGIN,
            wire.encode_round_begin(3000, 1024, 256, [1000, 2000]),
            token=7,
            rank=1,
            round=3,
            bucket=2,
        ),
        wire.encode_header(
            FrameType.DATA,
            token=7,
            rank=1,
            round=3,
            bucket=2,
            block=1,
            offset=1024,
            count=6,
            length=24,
            flags=wire.Flags.IMPORTANT,
        )
        + data.tobytes(),
        wire.encode_frame(FrameType.ROUND_END, wire.encode_round_end(1, 2, 3, 4), token=7, rank=1, round=3, bucket=2),
        wire.encode_frame(
            FrameType.DROP_REPORT,
            np.packbits([1, 0, 1]).tobytes(),
            token=7,
            rank=0,
            round=3,
            bucket=2,
            count=3,
            flags=wire.Flags.CLOSED,
        ),
        wire.encode_frame(FrameType.CONTROL, b'{"hello": 1}', token=7, rank=1),
    ]


def test_every_frame_type_dissects_to_the_wire_fields():
    begin, data, end, report, control = (DGT(f) for f in _frames())
    assert begin.ftype == FrameType.ROUND_BEGIN and begin.round == 3 and begin.bucket == 2
    assert begin[DGTRoundBegin].sizes == [1000, 2000] and begin[DGTRoundBegin].frag == 256
    assert data.flags == wire.Flags.IMPORTANT and data.offset == 1024 and data.length == 24
    assert dissect.values(data).tolist() == [0, 1, 2, 3, 4, 5]
    assert end[DGTRoundEnd].unimportant_frames == 4
    assert report[DGTDropReport].received().tolist() == [True, False, True]
    assert control[DGTControl].json() == {"hello": 1}
    for f in _frames():  # decode -> encode is the identity
        assert bytes(DGT(f)) == f


def test_built_frames_equal_wire_encoding():
    built = DGT(ftype=FrameType.ROUND_END, token=5, rank=2, round=9) / DGTRoundEnd(important_blocks=4)
    assert bytes(built) == wire.encode_frame(
        FrameType.ROUND_END, wire.encode_round_end(4, 0, 0, 0), token=5, rank=2, round=9
    )
    h = wire.decode_header(
        bytes(DGT(ftype=FrameType.ROUND_BEGIN) / DGTRoundBegin(numel=5, block=4, frag=2, sizes=[2, 3]))
    )
    assert int(h["length"]) == 20 + 2 * 8  # numel u64, block, frag, ntensors u32, then the sizes


def test_back_to_back_frames_split_by_length():
    stream = b"".join(_frames())
    s = dissect.dissect(stream)
    assert isinstance(s, DGTStream) and [int(f.ftype) for f in s.frames] == [2, 1, 3, 4, 5]
    assert dissect.frames_end(stream[:-3]) == len(stream) - len(_frames()[-1])


def test_bound_ports_and_tcp_session_reassembly(tmp_path):
    """Frames cut across TCP segments at odd places come back whole through scapy's TCPSession."""
    stream = b"".join(_frames()) * 2
    cuts = [0, 30, 31, 200, 250, len(stream)]
    pkts = [Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / TCP(sport=40000, dport=5201, flags="S", seq=99)]
    for a, b in zip(cuts[:-1], cuts[1:]):
        pkts.append(
            Ether()
            / IP(src="10.0.0.1", dst="10.0.0.2")
            / TCP(sport=40000, dport=5201, flags="PA", seq=100 + a)
            / stream[a:b]
        )
    datagram = wire.encode_header(
        FrameType.DATA, token=7, rank=1, count=1, length=4, lane=1, flags=wire.Flags.FRAGMENT
    ) + bytes(4)
    pkts.append(Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=40001, dport=5202) / datagram)
    path = str(tmp_path / "d.pcap")
    wrpcap(path, pkts)
    dissect.bind_ports(udp=[5202], tcp=[5201])
    try:
        session = TCPSession()
        got, udp = [], []
        for p in PcapReader(path):
            if UDP in p:
                udp.append(p)
                continue
            out = session.process(p)
            if out is not None and DGTStream in out:
                got += [int(f.ftype) for f in out[DGTStream].frames]
        assert got == [2, 1, 3, 4, 5] * 2
        assert DGT in udp[0] and udp[0][DGT].lane == 1 and udp[0][DGT].flags == wire.Flags.FRAGMENT
    finally:
        dissect.unbind_ports()
    assert DGT not in Ether(bytes(pkts[-1]))


@pytest.mark.parametrize("junk", [b"", b"DG", b"DG\x01" + bytes(60), bytes(range(256))])
def test_dissecting_junk_never_raises(junk):
    dissect.dissect(junk).summary()


def test_bulk_frames_dissect_with_their_elements():
    import torch

    from dgt.inspect.dissect import DGTBulk
    from dgt.protocol.bulk import bulk_frames

    x = torch.arange(10, dtype=torch.float32)
    frames = [bytes(h) + bytes(p) for h, p in bulk_frames(7, 1, 3, 2, x, 16)]
    assert len(frames) == 3
    pkt = DGT(frames[1])
    assert pkt.ftype == FrameType.BULK and pkt.block == 10 and pkt.offset == 4 and pkt.count == 4
    assert isinstance(pkt.payload, DGTBulk) and dissect.values(pkt).tolist() == [4.0, 5.0, 6.0, 7.0]
    assert bytes(pkt) == frames[1]


def test_drop_report_timing_trailer_versions_1_and_2():
    """The dissector and the summary's report parser read both trailer versions and reject a malformed one."""
    from collections import Counter

    from dgt.inspect.summary import _drop_report
    from dgt.protocol.report import TRAILER_V1, Timing, encode_timing

    bitmap = np.packbits([1, 0, 1]).tobytes()
    v2 = encode_timing(Timing(5, 1.0, 1.5, 0.002, 7000, 1.75))
    v1 = TRAILER_V1.pack(1, 0, 0, 5, 1_000_000_000, 1_500_000_000, 2_000_000, 7000)
    flags = wire.Flags.CLOSED | wire.Flags.TIMING
    for trailer, close in ((v2, 1.75), (v1, None)):
        frame = DGT(wire.encode_frame(FrameType.DROP_REPORT, bitmap + trailer, token=7, rank=0, round=3, bucket=2,
                                      count=3, flags=flags))  # fmt: skip
        t = frame[DGTDropReport].timing()
        assert (t.datagrams, t.nbytes, t.close) == (5, 7000, close) and t.wait == pytest.approx(0.002)
        assert frame[DGTDropReport].received().tolist() == [True, False, True]
        assert "5 unimportant datagrams" in frame.summary() and ("closed at" in frame.summary()) == (close is not None)
    bad = DGT(wire.encode_frame(FrameType.DROP_REPORT, bitmap + v2[:-3], token=7, rank=0, count=3, flags=flags))
    assert "malformed timing trailer" in bad.summary()

    class _Fr:  # what _drop_report reads of the summary's frame table
        h = {"count": np.array([3]), "flags": np.array([int(flags)])}

    malformed: Counter[str] = Counter()
    for payload in (bitmap + v2, bitmap + v1):
        assert _drop_report(_Fr(), 0, payload, malformed).tolist() == [True, False, True]
    assert _drop_report(_Fr(), 0, bitmap + v2[:-1], malformed) is None and malformed["drop-report"] == 1
