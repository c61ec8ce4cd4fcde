"""`dgt inspect` on pcap files written without sockets (dgt.inspect.synth): exact agreement with the receiver,
link types, DSCP warnings, reordering, TCP reassembly, corruption and junk, volume, and the CLI."""

from __future__ import annotations

import argparse
import json
import random
import struct

import numpy as np
import pytest
from scapy.utils import RawPcapReader, RawPcapWriter

from dgt import wire
from dgt.cli import main as dgt_main
from dgt.cliargs import BadOption
from dgt.inspect import pcapio, reassembly
from dgt.inspect.summary import Options, summarize
from dgt.inspect.synth import Wire, synth_rounds
from dgt.inspect.traffic import TrafficSpec

ROUND_KEYS = ("important", "unimportant_received", "dropped", "unsent", "partial", "duplicated", "rejected", "lanes")
UDP_AT = 14 + 20 + 8  # Ethernet + IPv4 + UDP: where the DGT header starts in a default synthetic datagram


def assert_matches_receiver(summary: dict, truth) -> None:
    assert len(summary["rounds"]) == len(truth.stats)
    for got, want in zip(summary["rounds"], truth.stats):
        assert {k: got[k] for k in ROUND_KEYS} == {k: want[k] for k in ROUND_KEYS}
        assert got["report"]["agrees"] and got["report"]["dropped"] == want["dropped"]
    assert summary["totals"]["late_frames"] == truth.late


@pytest.fixture(scope="module")
def base_pcap(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("synth") / "base.pcap")
    truth = synth_rounds(path, TrafficSpec(rounds=4, lanes=3, seed=11))
    return path, truth


@pytest.mark.parametrize(
    "w",
    [
        Wire(),
        Wire(link=pcapio.LINUX_SLL, ipv6=True),
        Wire(vlan=7),
        Wire(link=pcapio.RAW),
        Wire(link=pcapio.LINUX_SLL2, mss=536),
    ],
    ids=["ether", "sll-ipv6", "vlan", "raw-ip", "sll2-small-mss"],
)
def test_summary_equals_receiver_stats(tmp_path, w):
    path = str(tmp_path / "r.pcap")
    truth = synth_rounds(path, TrafficSpec(rounds=3, lanes=3, seed=5), w)
    s = summarize(path)
    assert_matches_receiver(s, truth)
    assert s["lanes"]["0"]["dscp"] == {"46": s["lanes"]["0"]["packets"]} and s["lanes"]["0"]["dscp_ok"]
    for lane in ("1", "2"):
        assert s["lanes"][lane]["dscp"] == {"1": s["lanes"][lane]["packets"]} and s["lanes"][lane]["dscp_ok"]
    assert s["warnings"] == [] and s["malformed"]["total"] == 0
    assert s["totals"]["dropped"] > 0 and s["totals"]["duplicated"] > 0 and s["totals"]["late_frames"] > 0


def test_send_budget_shows_unsent_apart_from_dropped(tmp_path):
    path = str(tmp_path / "b.pcap")
    truth = synth_rounds(path, TrafficSpec(rounds=3, lanes=2, seed=4, budget=20_000))
    s = summarize(path)
    assert_matches_receiver(s, truth)  # per round: unsent and dropped (lost) equal the receiver's
    t = s["totals"]
    assert t["unsent"] == sum(st["unsent"] for st in truth.stats) > 0 and t["dropped"] > 0
    assert t["important"] + t["unimportant_received"] + t["dropped"] + t["unsent"] == t["blocks"]
    # per lane: one unreliable lane carries every lost and unsent block; the reliable lane none
    lanes = s["lanes"]
    assert (lanes["1"]["lost_blocks"], lanes["1"]["unsent_blocks"]) == (t["dropped"], t["unsent"])
    assert (lanes["0"]["lost_blocks"], lanes["0"]["unsent_blocks"]) == (0, 0)
    assert lanes["1"]["blocks"] == t["unimportant_received"] and t["lost_unplaced"] == t["unsent_unplaced"] == 0


def test_lost_blocks_per_lane_with_two_unreliable_lanes(base_pcap):
    path, truth = base_pcap
    s = summarize(path)
    t, lanes = s["totals"], s["lanes"]
    # partial blocks are placed on the lane their fragments came by; wholly missing ones cannot be
    assert sum(v["lost_blocks"] for v in lanes.values()) + t["lost_unplaced"] == t["dropped"] > 0
    assert sum(v["lost_blocks"] for v in lanes.values()) == t["partial"] and lanes["0"]["lost_blocks"] == 0
    assert sum(v["unsent_blocks"] for v in lanes.values()) + t["unsent_unplaced"] == t["unsent"]


def test_ports_without_auto_detection(base_pcap):
    path, truth = base_pcap
    assert summarize(path, Options(auto=False))["dgt_packets"] == 0
    s = summarize(path, Options(auto=False, tcp_ports=(5201,), udp_ports=(5202, 5203)))
    assert_matches_receiver(s, truth)
    assert {f["detected_by"] for f in s["flows"]} == {"port"}


def test_bleached_and_remarked_dscp_warn(tmp_path):
    path = str(tmp_path / "b.pcap")
    synth_rounds(path, TrafficSpec(rounds=1, low_dscp=0, seed=2), Wire(reliable_dscp=0))
    s = summarize(path)
    assert not s["lanes"]["0"]["dscp_ok"] and not s["lanes"]["1"]["dscp_ok"]
    assert sum("bleached" in w for w in s["warnings"]) == 2
    ok = summarize(path, Options(expect_dscp={0: (0,), 1: (0,)}))
    assert ok["lanes"]["0"]["dscp_ok"] and ok["lanes"]["1"]["dscp_ok"] and ok["warnings"] == []
    synth_rounds(path, TrafficSpec(rounds=1, low_dscp=46, seed=2))
    assert any("high priority" in w for w in summarize(path)["warnings"])


def _records(path):
    with RawPcapReader(path) as rd:
        lt = rd.linktype
        return lt, [(bytearray(d), m) for d, m in rd]


def _write(path, lt, recs):
    with RawPcapWriter(path, linktype=lt) as w:
        w.write_header(None)
        for d, m in recs:
            w.write_packet(bytes(d), sec=m.sec, usec=m.usec)


def test_reordering_matches_its_definition(base_pcap):
    """Reordered = a fragment below the highest offset already seen of its block, or a round below the highest
    round already seen of its (sender, bucket), per datagram flow (docs/inspect.md)."""
    path, _ = base_pcap
    _, recs = _records(path)
    seen_off: dict = {}
    seen_round: dict = {}
    expected = 0
    for d, _m in recs:
        if d[23] != 17:
            continue
        h = np.frombuffer(bytes(d[UDP_AT : UDP_AT + 48]), wire.HEADER_DTYPE)[0]
        flow = bytes(d[26:38])
        kb = (flow, int(h["rank"]), int(h["bucket"]), int(h["round"]), int(h["block"]))
        kr = (flow, int(h["rank"]), int(h["bucket"]))
        late_off = int(h["offset"]) < seen_off.get(kb, -1)
        late_round = int(h["round"]) < seen_round.get(kr, -1)
        expected += late_off or late_round
        seen_off[kb] = max(seen_off.get(kb, -1), int(h["offset"]))
        seen_round[kr] = max(seen_round.get(kr, -1), int(h["round"]))
    s = summarize(path)
    assert expected > 0
    assert sum(v["reordered"] for v in s["lanes"].values()) == expected


def test_tcp_reassembly_orders_dedups_and_resyncs():
    frames = [wire.encode_frame(wire.FrameType.CONTROL, b"{}" * k, token=1, rank=0) for k in range(1, 40)]
    stream = b"".join(frames)
    segs = [(i, stream[i : i + 97]) for i in range(0, len(stream), 97)]
    shuffled = segs[::-1] + segs[3:5]  # reversed, plus two retransmissions
    st = reassembly.reassemble(
        np.array([1001 + s for s, _ in shuffled]),
        [p for _, p in shuffled],
        np.arange(len(shuffled), dtype=float),
        np.arange(len(shuffled)),
        syn_seq=1000,
    )
    assert st.data == stream and st.retransmitted == 2 and st.gaps == []
    assert len(reassembly.frames(st).pos) == len(frames)
    # lose one segment: the frames it touched are gone, the walk resynchronises after the gap
    lossy = [s for k, s in enumerate(segs) if k != 5]
    st = reassembly.reassemble(
        np.array([1001 + s for s, _ in lossy]),
        [p for _, p in lossy],
        np.zeros(len(lossy)),
        np.arange(len(lossy)),
        syn_seq=1000,
    )
    sf = reassembly.frames(st)
    assert st.gaps == [(5 * 97, 6 * 97)] and sf.problems.get("gap") == 1
    assert len(frames) - 3 <= len(sf.pos) < len(frames)
    assert (wire.validate(sf.headers) == 0).all()


def test_corrupted_payloads_are_counted_not_fatal(base_pcap, tmp_path):
    path, truth = base_pcap
    lt, recs = _records(path)
    udp = [d for d, _ in recs if d[23] == 17]
    tcp_data = [d for d, _ in recs if d[23] == 6 and len(d) > 54 + 48]
    udp[0][UDP_AT] ^= 0xFF  # magic
    udp[1][UDP_AT] ^= 0xFF
    udp[2][UDP_AT + 3] = 9  # ftype
    struct.pack_into(">I", udp[3], UDP_AT + 40, 7)  # count no longer matches the payload length
    struct.pack_into(">II", udp[4], UDP_AT + 40, 1, 4)  # a consistent header that does not match the datagram
    udp[5][UDP_AT + 2] = 7  # version
    # the reliable stream: garbage in the first header of a later segment that starts a frame
    victim = next(d for d in tcp_data[1:] if bytes(d[54:57]) == b"DG\x01")
    victim[54:58] = b"XXXX"
    out = str(tmp_path / "corrupt.pcap")
    _write(out, lt, recs)
    s = summarize(out)
    r = s["malformed"]["reasons"]
    assert r["magic"] == 2 and r["ftype"] == 1 and r["count"] == 1 and r["length"] == 1 and r["version"] == 1
    assert r["stream-garbage"] >= 1
    assert s["malformed"]["total"] == sum(r.values()) and any("malformed" in w for w in s["warnings"])
    assert s["totals"]["rounds"] >= truth.stats.__len__() - 1  # rounds after the damage are still found
    assert dgt_main(["inspect", out, "--strict", "--json"]) == 1


def test_junk_inputs(tmp_path, capsys):
    notpcap = tmp_path / "x.pcap"
    notpcap.write_bytes(b"this is not a capture" * 10)
    assert dgt_main(["inspect", str(notpcap)]) == 2
    assert "x.pcap" in capsys.readouterr().err
    assert dgt_main(["inspect", str(tmp_path / "missing.pcap")]) == 2
    empty = str(tmp_path / "empty.pcap")
    _write(empty, 1, [])
    assert summarize(empty)["packets"] == 0


def test_fuzzed_and_truncated_captures_never_crash(base_pcap, tmp_path):
    path, _ = base_pcap
    lt, recs = _records(path)
    rnd = random.Random(3)
    for d, _ in rnd.sample(recs, 120):
        for _ in range(rnd.randint(1, 8)):
            d[rnd.randrange(len(d))] = rnd.randrange(256)
        if rnd.random() < 0.2:
            del d[rnd.randrange(len(d)) :]
    out = str(tmp_path / "fuzz.pcap")
    _write(out, lt, recs)
    s = summarize(out)
    json.dumps(s)
    assert s["packets"] == len(recs)
    raw = open(out, "rb").read()
    cut = str(tmp_path / "cut.pcap")
    open(cut, "wb").write(raw[: len(raw) // 2 + 7])  # capture killed mid-record
    assert 0 < summarize(cut)["packets"] < len(recs)


def test_cli_json_and_plot(base_pcap, tmp_path, capsys):
    path, truth = base_pcap
    png = tmp_path / "t.png"
    assert dgt_main(["inspect", path, "--json", "--plot", str(png), "--bin", "0.0005"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert_matches_receiver(s, truth)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert s["timeline"]["bin_s"] == 0.0005 and sum(s["timeline"]["drops"]) == s["totals"]["dropped"]
    assert dgt_main(["inspect", path, "--dissect", "5", "--dscp", "1=CS1"]) == 0
    text = capsys.readouterr().out
    assert "lanes" in text and "DGT ROUND_BEGIN" in text and "CS1(8)" in text and "warning" in text


def test_hundred_thousand_packets_are_summarised(tmp_path):
    """Volume: every packet and round of a ~100k-packet capture is accounted for. How fast: ``dgt bench inspect``
    (the same capture by default; test_bench_inspect_reports_... below runs it small)."""
    path = str(tmp_path / "big.pcap")
    synth_rounds(path, TrafficSpec(rounds=68, sizes=(131072,), block=64, seed=1), truth=False)
    s = summarize(path)
    assert s["packets"] >= 100_000 and s["totals"]["rounds"] == 68
    assert s["packets"] == s["dgt_packets"] + s["other_packets"]


def test_bench_inspect_reports_the_summary_against_the_bare_read():
    """``dgt bench inspect`` on a small capture: its figures, consistent with one another (not their values)."""

    from dgt.bench import inspect as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = bench.run(p.parse_args(["--rounds", "3", "--repeat", "2"]))
    assert out["rounds_found"] == 3 and out["packets"] > out["dgt_packets"] > 0 and out["file_bytes"] > 0
    readers = {"bare_read", "read_pcap", "summarize"}
    assert set(out["seconds"]) == set(out["median_seconds"]) == set(out["packets_per_s"]) == readers
    for k in readers:
        assert 0 < out["seconds"][k] <= out["median_seconds"][k]  # the best of 2 is at most their median
        assert out["packets_per_s"][k] == pytest.approx(out["packets"] / out["seconds"][k])
    assert out["vs_bare_read"] == pytest.approx({k: out["seconds"][k] / out["seconds"]["bare_read"]
                                                 for k in ("read_pcap", "summarize")})
    with pytest.raises(SystemExit) as exc:  # the option's type: the parser's usage error
        p.parse_args(["--repeat", "0"])
    assert exc.value.code == 2
    with pytest.raises(BadOption, match="at least 1"):  # run() called without the parser checks too
        bench.run(argparse.Namespace(**{**vars(p.parse_args([])), "repeat": 0}))


def test_gso_aggregates_are_cut_into_datagrams(tmp_path):
    """On loopback a UDP GSO send is captured unsegmented: one packet, its datagrams back to back."""
    from dgt.inspect.flows import split_datagrams as _datagrams
    from dgt.inspect.synth import PcapOut, udp

    grams = [
        wire.encode_header(
            wire.FrameType.DATA,
            token=1,
            rank=0,
            block=k,
            offset=4 * k,
            count=4,
            length=16,
            lane=1,
            flags=wire.Flags.FRAGMENT,
        )
        + bytes(16)
        for k in range(3)
    ]
    path = str(tmp_path / "gso.pcap")
    out = PcapOut(path, Wire())
    out.packet(1.0, udp(1, 2, b"".join(grams)), pcapio.UDP, 1)
    out.packet(1.1, udp(1, 2, grams[0][:-4]), pcapio.UDP, 1)  # short datagram: one, with a bad length
    out.close()
    t = pcapio.read_pcap(path)
    rows, h, size = _datagrams(t, np.arange(len(t)))
    assert rows.tolist() == [0, 0, 0, 1] and h["block"].tolist() == [0, 1, 2, 0] and size.tolist() == [64] * 3 + [60]


def test_bulk_messages_are_counted_per_message_and_as_goodput(tmp_path):
    """BULK frames (lossless messages without round state) in a TCP stream: one complete message, one cut short
    by the end of the capture, one whose frames skip a piece; each is reported with its bytes and completeness."""
    import torch

    from dgt.inspect.synth import PcapOut, _Conn
    from dgt.protocol.bulk import bulk_frames

    path = str(tmp_path / "bulk.pcap")
    out = PcapOut(path, Wire())
    conn = _Conn(out, True, 1000)
    conn.syn(0.0)
    x = torch.arange(3000, dtype=torch.float32)
    whole = bulk_frames(0x42, 0, 7, 0, x, 4096)  # 3 frames
    cut = bulk_frames(0x42, 0, 7, 1, x, 4096)[:2]  # the capture ends before the last frame
    holed = bulk_frames(0x42, 0, 8, 0, x, 4096)
    holed = [holed[0], holed[2]]  # the middle frame is missing
    ts = 0.01
    for hdr, payload in whole + holed + cut:
        ts = conn.send(ts, hdr + bytes(payload), 1e-5)
    out.close()
    s = summarize(path, Options())
    by_key = {(m["bucket"], m["round"]): m for m in s["bulk"]}
    assert set(by_key) == {(7, 0), (7, 1), (8, 0)}
    w, c, h = by_key[(7, 0)], by_key[(7, 1)], by_key[(8, 0)]
    assert w["complete"] and w["frames"] == 3 and w["elements"] == w["total"] == 3000 and w["bytes"] == 12000
    assert w["dtype"] == "float32" and w["sender"] == 0 and w["token"] == f"{0x42:#018x}"
    assert not c["complete"] and c["in_order"] and c["elements"] == 2048
    assert not h["complete"] and not h["in_order"]
    t = s["totals"]
    assert (t["bulk_messages"], t["bulk_complete"], t["bulk_bytes"]) == (3, 1, 12000 + 8192 + 4096 + 3808)
    lane = s["lanes"]["0"]
    assert lane["bulk_frames"] == 7 and lane["control_frames"] == 0
    assert lane["goodput_bytes"] == t["bulk_bytes"] and s["rounds"] == []
    assert any("do not continue" in w for w in s["warnings"])
