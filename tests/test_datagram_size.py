"""Datagram size from the route's MTU (TransportConfig.datagram_payload=None) and batched datagram sends (issue 26):
a UdpChannel send of many rows packs them once and hands them to the kernel GSO-send by GSO-send; the scheduler
sends as many whole GSO sends per step as the pacer's tokens cover, at most ``batch_bytes``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import trio

from dgt import wire
from dgt.channels.lanes import LaneSpec
from dgt.channels.sockopts import route_mtu
from dgt.channels.udp import UdpChannel
from dgt.channels.udp_scheduler import DatagramJob, DatagramScheduler
from dgt.estimator import ContributionEstimator
from dgt.harness.endpoints import connected_pair
from dgt.layout import BucketLayout
from dgt.protocol.datagram_rows import DatagramRows
from dgt.protocol.pacing import Pacer
from dgt.transport import Congestion, Lanes, Timeouts, TransportConfig
from dgt.transport.config import FALLBACK_PAYLOAD, payload_for_mtu

UDP = LaneSpec("bulk", "udp", 1)
TOKEN = 0x5EED_0026


def test_payload_fills_one_ip_packet_of_the_mtu():
    assert payload_for_mtu(1500) == 1500 - 20 - 8 - wire.HEADER_SIZE  # Ethernet, IPv4
    assert payload_for_mtu(1500, ipv6=True) == 1500 - 40 - 8 - wire.HEADER_SIZE
    assert payload_for_mtu(9000) == 9000 - 28 - wire.HEADER_SIZE  # jumbo frames
    assert payload_for_mtu(65536) == 65000  # loopback: the most a datagram may carry
    assert payload_for_mtu(None) == payload_for_mtu(0) == FALLBACK_PAYLOAD == 1400
    assert payload_for_mtu(68) == 64  # never below a usable minimum
    for mtu in (576, 1280, 1500, 9000):  # header + payload + IP/UDP headers never exceed the MTU
        assert payload_for_mtu(mtu, ipv6=True) + wire.HEADER_SIZE + 48 <= mtu


def test_route_mtu_is_the_loopback_interfaces():
    mtu = route_mtu("127.0.0.1")
    path = "/sys/class/net/lo/mtu"
    if os.path.exists(path):
        assert mtu == min(int(open(path).read()), 65535)  # an IPv4 packet is at most 64 KiB - 1
    assert mtu is not None and mtu >= 1280
    assert route_mtu("no-such-host.invalid") is None  # unreadable: the caller falls back


def test_config_payload_explicit_or_from_the_route():
    assert TransportConfig(lanes=Lanes(datagram_payload=1400)).payload_for("127.0.0.1") == 1400
    assert TransportConfig().payload_for("127.0.0.1") == payload_for_mtu(route_mtu("127.0.0.1"))
    for bad in (8, 70000):
        with pytest.raises(ValueError, match="datagram_payload"):
            TransportConfig(lanes=Lanes(datagram_payload=bad))


@pytest.mark.parametrize("payload", [None, 1400])
async def test_a_lossy_round_over_loopback_sends_a_block_per_datagram_by_default(payload):
    """Over loopback (MTU 64 KiB) a 4 KiB block travels as one datagram; at 1400 bytes as four. Either way the round
    lands bit for bit."""
    cfg = TransportConfig(timeouts=Timeouts(peer=5), lanes=Lanes(datagram_payload=payload),
                          congestion=Congestion(enabled=False), deadline="fixed:2")
    x = torch.randn(64 * 1024)
    layout = BucketLayout([x.numel()])
    est = ContributionEstimator(layout)
    est.update(torch.arange(layout.numel, dtype=torch.float32))
    c = est.classify(0.25)
    unimportant = int((c.cls != 0).sum())
    async with connected_pair(TOKEN, cfg) as (a, b):
        async with trio.open_nursery() as n:
            sent = []

            async def send():
                sent.append(await a.send_round(1, 0, 1, x, layout, c.cls, c.order))

            n.start_soon(send)
            res = await b.recv_round(0, 0, 1, timeout=10)
    assert bool(res.mask.all()) and torch.equal(res.data, x)
    per_block = 1 if payload is None else 4
    assert sum(sent[0].datagrams.values()) == unimportant * per_block


async def _pair(**kw):
    a = UdpChannel("127.0.0.1", UDP, rcvbuf=8 << 20, **kw)
    b = UdpChannel("127.0.0.1", UDP, rcvbuf=8 << 20, **kw)
    return a, b


async def _drain(a: UdpChannel, b: UdpChannel, n: int) -> tuple[list[int], bytes]:
    sizes: list[int] = []
    data = bytearray()
    with trio.fail_after(5):
        while len(sizes) < n:
            mv, sz = await b.recv_batch(lambda addr: addr[1] == a.port)
            sizes += sz.tolist()
            data += bytes(mv)
    return sizes, bytes(data)


def _rows(k: int, payload: int) -> tuple[DatagramRows, np.ndarray]:
    raw = np.random.default_rng(1).integers(0, 256, k * payload + 3, dtype=np.uint8)
    headers = np.random.default_rng(2).integers(0, 256, (k, wire.HEADER_SIZE), dtype=np.uint8)
    offsets = (np.arange(k, dtype=np.int64)[::-1] * payload + 1).copy()  # out of order, unaligned
    return DatagramRows(headers, raw, offsets, payload), np.concatenate([headers, raw[offsets[:, None] +
                                                                                      np.arange(payload)]], axis=1)


@pytest.mark.parametrize("offload", [True, False])
async def test_one_send_of_many_rows_delivers_every_datagram_in_order(offload):
    """A batch of 3 GSO sends' worth of DatagramRows (and of a plain array) in one call: packed once, every datagram
    arrives whole and in order; the kernel gets one GSO send per ``segments_per_send`` rows (or one per datagram)."""
    a, b = await _pair(gso=offload, gro=offload, max_segments=64)
    try:
        rows, expect = _rows(150, 1024)
        seg = rows.shape[1]
        per = a.segments_per_send(seg)
        await a.send_rows(rows, ("127.0.0.1", b.port))
        sizes, data = await _drain(a, b, 150)
        assert sizes == [seg] * 150 and data == expect.tobytes()
        assert a.counters.tx_datagrams == 150
        assert a.counters.tx_calls == (-(-150 // per) if offload else 150)
        plain = np.ascontiguousarray(expect[:70])
        await a.send_rows(plain, ("127.0.0.1", b.port))
        sizes, data = await _drain(a, b, 70)
        assert sizes == [seg] * 70 and data == plain.tobytes()
    finally:
        a.close()
        b.close()


async def _scheduled(chan: UdpChannel, pacer: Pacer | None, batch_bytes: int, job: DatagramJob) -> DatagramJob:
    """``job`` sent by a scheduler of ``chan`` alone (lane 1), until its last datagram left."""
    sched = DatagramScheduler({1: chan}, lambda p, b, r: False, lambda p: pacer, batch_bytes=batch_bytes)
    sched.submit(job)
    async with trio.open_nursery() as n:
        n.start_soon(sched.run)
        await job.done.wait()
        n.cancel_scope.cancel()
    return job


async def test_scheduler_sends_whole_gso_batches_per_step_within_the_pacers_tokens():
    chan = UdpChannel("127.0.0.1", UDP, max_segments=8)
    sink = UdpChannel("127.0.0.1", UDP, rcvbuf=8 << 20)
    addr = ("127.0.0.1", sink.port)
    seg = 1000
    try:
        per = chan.segments_per_send(seg)
        assert per == 8
        # unpaced: batch_bytes covers 3 GSO sends (24 rows): 100 rows go out in 5 steps (24 x 4 + 4)
        job = await _scheduled(chan, None, 3 * per * seg, DatagramJob(0, 1, 0, 0, np.zeros((100, seg), np.uint8), [],
                                                                      addr))
        assert [k for _, k, _ in job.sends] == [24, 24, 24, 24, 4] and job.sent == 100
        # paced: tokens for two GSO sends at the start (the burst), then at least one per step as tokens allow
        pacer = Pacer(50e6, 2 * per * seg, now=trio.current_time())
        job = await _scheduled(chan, pacer, 1 << 20, DatagramJob(0, 1, 0, 1, np.zeros((40, seg), np.uint8), [], addr))
        counts = [k for _, k, _ in job.sends]
        assert counts[0] == 2 * per and sum(counts) == 40 and all(k % per == 0 or k == counts[-1] for k in counts)
        assert all(k <= 2 * per for k in counts)  # never more than the burst's worth in one step
    finally:
        chan.close()
        sink.close()
