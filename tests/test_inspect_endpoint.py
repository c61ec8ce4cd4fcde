"""A capture of traffic made by the real transport (dgt.transport.Endpoint on loopback) agrees with the
Endpoint's own round statistics, and its DSCP marks are the lanes' configured ones."""

from __future__ import annotations

import os
import time

import pytest
import torch
import trio

from dgt.harness.endpoints import connected_pair
from dgt.inspect.capture import LiveCapture
from dgt.inspect.summary import Options, summarize
from dgt.transport import Sockets

endpoint = pytest.importorskip("dgt.transport", reason="the transport (dgt.transport) is not built yet")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="packet capture needs root (CAP_NET_RAW)")
TOKEN = 0x1D5EC7_0000_0042


async def _run_pair(cfg, body) -> tuple[list, list, object, object]:
    """Two connected endpoints; ``body(a, b, sent, got)`` exchanges rounds; returns what it collected and the
    endpoints' addresses (their ports tell the capture which flows are ours)."""
    sent, got = [], []
    async with connected_pair(TOKEN, cfg) as (a, b):
        await body(a, b, sent, got)
        addr_a, addr_b = a.address, b.address
    return sent, got, addr_a, addr_b


async def _exchange(rounds: int, layout_numel: int) -> tuple[list, list, object, object]:
    # a generous deadline: every datagram is in before a round closes, so the capture and the receiver see the same
    # set (with the adaptive deadline a datagram still in flight at the deadline is on the wire but not received)
    async def body(a, b, sent, got) -> None:
        gen = torch.Generator().manual_seed(0)
        for rnd in range(rounds):
            flat = torch.randn(layout_numel, generator=gen)
            nblocks = -(-layout_numel // 1024)
            cls = (torch.rand(nblocks, generator=gen) > 0.3).long()  # ~30% important
            async with trio.open_nursery() as n:

                async def send(flat=flat, cls=cls, rnd=rnd) -> None:
                    sent.append(await a.send_round(1, 0, rnd, flat, cls=cls, timeout=10))

                n.start_soon(send)
                got.append(await b.recv_round(0, 0, rnd, timeout=10))

    return await _run_pair(endpoint.TransportConfig(deadline="fixed:2.0"), body)


def test_capture_of_endpoint_traffic_matches_its_statistics(tmp_path):
    path = str(tmp_path / "ep.pcap")
    cap = LiveCapture(path, "lo").start()
    try:
        sent, got, addr_a, addr_b = trio.run(_exchange, 3, 40_000)
        time.sleep(0.2)
    finally:
        res = cap.stop()
    assert res.kernel_drops == 0
    ports = {addr_a.tcp_port, addr_b.tcp_port}
    udp = {*addr_a.udp_ports, *addr_b.udp_ports}
    s = summarize(path, Options(auto=False, tcp_ports=tuple(ports), udp_ports=tuple(udp)))
    rounds = [r for r in s["rounds"] if r["sender"] == 0]
    assert len(rounds) == len(got) == 3
    keys = ("important", "unimportant_received", "dropped", "partial", "duplicated", "rejected", "lanes")
    for mine, theirs, snd in zip(rounds, got, sent):
        want = theirs.stats.to_dict()
        assert {k: mine[k] for k in keys} == {k: want[k] for k in keys}
        assert mine["report"]["agrees"] and mine["report"]["dropped"] == want["dropped"]
        assert mine["lanes"]["1"]["frames"] == snd.datagrams.get(1, 0) - snd.abandoned.get(1, 0)
    assert s["malformed"]["total"] == 0, s["malformed"]
    lanes = endpoint.default_lanes()
    for lane, spec in enumerate(lanes):
        v = s["lanes"][str(lane)]
        assert v["dscp"] == {str(spec.dscp): v["packets"]}, (lane, spec)


async def _bulk_exchange(sizes: list[int]) -> tuple[list, list, object, object]:
    async def body(a, b, sent, got) -> None:
        for rnd, n in enumerate(sizes):
            sent.append(await a.send_round(1, 3, rnd, torch.randn(n), wait=False))  # lossless, unawaited: BULK
            got.append(await b.recv_round(0, 3, rnd, timeout=10))

    return await _run_pair(endpoint.TransportConfig(sockets=Sockets(reliable_frame_bytes=256 << 10)), body)


def test_capture_of_bulk_messages_matches_the_transport(tmp_path):
    path = str(tmp_path / "bulk.pcap")
    cap = LiveCapture(path, "lo").start()
    try:
        sent, got, addr_a, addr_b = trio.run(_bulk_exchange, [100_000, 7, 300_000])
        time.sleep(0.2)
    finally:
        res = cap.stop()
    assert res.kernel_drops == 0
    assert all(r.bulk for r in got)
    s = summarize(path, Options(auto=False, tcp_ports=(addr_a.tcp_port, addr_b.tcp_port)))
    msgs = sorted((m for m in s["bulk"] if m["sender"] == 0), key=lambda m: m["round"])
    assert [m["round"] for m in msgs] == [0, 1, 2] and all(m["complete"] for m in msgs)
    for m, snd, r in zip(msgs, sent, got):
        assert m["frames"] == snd.reliable_frames == r.stats.lanes[0].frames
        assert m["bytes"] + m["frames"] * 48 == snd.reliable_bytes == r.stats.lanes[0].bytes
    assert s["rounds"] == [] and s["malformed"]["total"] == 0


async def _stream_exchange(sizes: list[int]) -> tuple[list, list, object, object]:
    """Stream-lane exchanges (a 2-rank ring's hops), with a frame limit small enough that the larger one splits."""
    from dgt import wire
    from dgt.transport.streams import Hop

    async def body(a, b, sent, got) -> None:
        for rnd, n in enumerate(sizes):
            x, land = torch.randn(n), torch.empty(n)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.exchange, [Hop(5, rnd, send_to=1, payload=x)])
                got.append(await b.exchange([Hop(5, rnd, recv_from=0, land=land)]))
            sent.append(x)

    return await _run_pair(endpoint.TransportConfig(limits=wire.Limits(max_payload=512 << 10)), body)


def test_capture_of_stream_lanes_shows_their_bulk_frames_marked_ef(tmp_path):
    path = str(tmp_path / "stream.pcap")
    cap = LiveCapture(path, "lo").start()
    try:
        sent, got, addr_a, addr_b = trio.run(_stream_exchange, [300_000, 9])
        time.sleep(0.2)
    finally:
        res = cap.stop()
    assert res.kernel_drops == 0
    # stream lanes connect to the same listener port as the session link
    s = summarize(path, Options(auto=False, tcp_ports=(addr_a.tcp_port, addr_b.tcp_port)))
    msgs = sorted((m for m in s["bulk"] if m["sender"] == 0 and m["bucket"] == 5), key=lambda m: m["round"])
    assert [m["round"] for m in msgs] == [0, 1] and all(m["complete"] for m in msgs)
    assert [m["frames"] for m in msgs] == [-(-300_000 * 4 // (512 << 10)), 1]
    for m, x, r in zip(msgs, sent, got):
        assert m["bytes"] == x.numel() * 4 and m["bytes"] + m["frames"] * 48 == r[0].received
    assert s["malformed"]["total"] == 0, s["malformed"]
    v = s["lanes"]["0"]
    assert v["dscp"] == {str(endpoint.default_lanes()[0].dscp): v["packets"]}
