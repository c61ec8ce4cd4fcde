"""Channels and schedulers in isolation: socket options, UDP GSO/GRO and fallback, reliable framing, pacing,
send order and stale-round abandonment, the deadline timer."""

import socket

import numpy as np
import pytest
import torch
import trio

from dgt import wire
from dgt.channels.framing import KEEP, FrameReader
from dgt.channels.lanes import LaneSpec, default_lanes, three_lanes, validate_lanes
from dgt.channels.sockopts import default_priority, get_dscp, parse_dscp, set_dscp
from dgt.channels.tcp import TcpChannel, TcpListener, dial
from dgt.channels.tcp_writer import ReliableWriter
from dgt.channels.udp import UdpChannel
from dgt.channels.udp_scheduler import DatagramJob, DatagramScheduler
from dgt.errors import PeerClosed, PeerTimeout, WireError
from dgt.layout import BucketLayout
from dgt.protocol.congestion import Feedback, LedbatRate
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.pacing import Pacer, TokenBucket
from dgt.protocol.receiver import RoundReceiver
from dgt.protocol.sender import RoundSender
from dgt.transport.deadline_timer import DeadlineTimer

TOKEN = 77
UDP = LaneSpec("bulk", "udp", 1)
TCP = default_lanes()[0]


def test_dscp_names_priorities_and_lane_specs():
    assert parse_dscp("EF") == 46 and parse_dscp("af21") == 18 and parse_dscp("LE") == 1 and parse_dscp(8) == 8
    with pytest.raises(ValueError):
        parse_dscp(64)
    assert default_priority(46) == 6 and default_priority(18) == 4 and default_priority(1) == 1
    assert default_priority(0) == 0
    assert LaneSpec.parse("udp:CS1:prio=2").so_priority == 2
    assert [ln.dscp for ln in three_lanes()] == [46, 18, 1]
    with pytest.raises(ValueError):
        validate_lanes([UDP, TCP])
    with pytest.raises(ValueError):
        LaneSpec("x", "sctp", 1)


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_dscp_reads_back_ipv4_and_ipv6(family, host):
    try:
        s = socket.socket(family, socket.SOCK_DGRAM)
    except OSError:
        pytest.skip("address family unavailable")
    with s:
        assert set_dscp(s, 46) and get_dscp(s) == 46
        assert set_dscp(s, 1) and get_dscp(s) == 1


def test_token_bucket_and_congestion_steered_pacer():
    tb = TokenBucket(1000.0, 100, now=0.0)
    assert tb.ready_at(0.0) == 0.0
    tb.consume(300, 0.0)  # 200 bytes of debt: ready after 0.2 s
    assert tb.ready_at(0.0) == pytest.approx(0.2)
    assert tb.ready_at(0.25) == 0.25
    tb.consume(300, 0.25)  # 50 tokens after the refill: 250 owed
    assert tb.debt(0.25) == pytest.approx(250) and tb.debt(0.35) == pytest.approx(150) and tb.debt(1.0) == 0.0
    tb.consume(600, 1.0)  # 500 owed at 1000 B/s: the next send is due at 1.5 s
    tb.set_rate(10.0)  # a cut to 1 % keeps that time, not the bytes (which would take 50 s at the new rate)
    assert tb.ready_at(1.0) == pytest.approx(1.5) and tb.debt(1.0) == pytest.approx(5.0)
    tb.set_rate(1000.0)
    assert tb.ready_at(1.0) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        tb.set_rate(0.0)
    p = Pacer(5.0, 1000, LedbatRate(1e6, min_rate=1e3), now=0.0)
    assert p.rate == 1e6  # the controller's rate wins over the nominal one
    p.on_feedback(Feedback(10, 14480, 5, 7240, 0.0, 0.01, 3.0, 3.01), 0.1)  # half the datagrams lost
    assert p.rate == pytest.approx(7240 / 0.1) and p.bucket.rate == p.rate  # the round's goodput
    fixed = Pacer(2e6, 1000, None, now=0.0)
    fixed.on_feedback(Feedback(10, 14480, 0, 0), 0.1)
    assert fixed.rate == 2e6


async def _udp_pair(**kw):
    a = UdpChannel("127.0.0.1", UDP, rcvbuf=4 << 20, **kw)
    b = UdpChannel("127.0.0.1", UDP, rcvbuf=4 << 20, **kw)
    return a, b


def _datagrams(k: int, seg: int) -> np.ndarray:
    rows = np.zeros((k, seg), np.uint8)
    rows[:, 0] = np.arange(k) % 251
    return rows


@pytest.mark.parametrize("offload", [True, False])
async def test_udp_gso_gro_and_plain_fallback_deliver_the_same_datagrams(offload):
    a, b = await _udp_pair(gso=offload, gro=offload, max_segments=64)
    try:
        assert a.gso == offload and b.gro == offload
        rows = _datagrams(150, 1072)
        per = a.segments_per_send(1072)
        assert per == (61 if offload else 64)
        for i in range(0, len(rows), per):
            await a.send_rows(rows[i : i + per], ("127.0.0.1", b.port))
        await a.send_datagram(b"\x07" * 100, ("127.0.0.1", b.port))
        sizes, firsts = [], []
        with trio.fail_after(5):
            while len(sizes) < 151:
                mv, sz = await b.recv_batch(lambda addr: addr[1] == a.port)
                starts = np.concatenate(([0], np.cumsum(sz)[:-1])).astype(np.int64)
                firsts += [mv[p] for p in starts.tolist()]
                sizes += sz.tolist()
        assert sizes == [1072] * 150 + [100]
        assert firsts == [i % 251 for i in range(150)] + [7]
        c = a.counters
        assert c.tx_datagrams == 151
        assert (c.tx_gso_calls > 0) == offload and (b.counters.rx_gro_reads > 0) == offload
        assert c.tx_calls == (4 if offload else 151)
    finally:
        a.close()
        b.close()


async def test_udp_unknown_sources_are_dropped_and_counted():
    a, b = await _udp_pair()
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _ in range(3):
            stranger.sendto(b"x" * 60, ("127.0.0.1", b.port))
        await a.send_datagram(b"y" * 60, ("127.0.0.1", b.port))
        seen = []
        with trio.fail_after(5):
            while not seen:
                mv, sizes = await b.recv_batch(lambda addr: addr[1] == a.port)
                seen += sizes.tolist()
        assert seen == [60] and b.counters.rx_unknown_source == 3
    finally:
        stranger.close()
        a.close()
        b.close()


async def _tcp_pair(**kw):
    lst = TcpListener("127.0.0.1", TCP)
    async with trio.open_nursery() as n:
        box = {}

        async def acc():
            box["s"] = await lst.accept()

        n.start_soon(acc)
        c = await dial("127.0.0.1", lst.port, TCP, 5)
    lst.close()
    return TcpChannel(c, TCP, **kw), TcpChannel(box["s"], TCP, **kw)


async def test_tcp_framing_lands_keeps_skips_and_batches():
    a, b = await _tcp_pair()
    try:
        assert get_dscp(a.sock) == 46 and get_dscp(b.sock) == 46
        big = np.arange(300_000, dtype=np.uint8)
        small = [wire.encode_frame(wire.FrameType.DATA, bytes([i]) * 64, token=TOKEN, rank=1, count=64, dtype=3)
                 for i in range(20)]  # fmt: skip
        frames = [
            wire.encode_frame(wire.FrameType.CONTROL, b'{"op":"ping"}', token=TOKEN, rank=1),
            wire.encode_header(wire.FrameType.DATA, token=TOKEN, rank=1, count=len(big), dtype=3, length=len(big)),
            big.tobytes(),
            *small,
            wire.encode_frame(wire.FrameType.DATA, b"z" * 5000, token=TOKEN, rank=1, count=5000, dtype=3),
        ]
        async with trio.open_nursery() as n:
            n.start_soon(a.send_buffers, frames)
            r = FrameReader(b, wire.DEFAULT_LIMITS, TOKEN, staging=4096)
            target = memoryview(bytearray(len(big)))
            f = await r.next(lambda h: KEEP)
            assert f.frame is not None and bytes(f.frame[48:]) == b'{"op":"ping"}'
            f = await r.next(lambda h: target)
            assert f.landed and bytes(target) == big.tobytes()
            taken = 0
            with trio.fail_after(5):
                while taken < 20:
                    batch = r.take_staged(lambda h: h["length"] == 64, min_frames=1)
                    if batch is None:
                        f = await r.next(lambda h: KEEP)
                        assert f.frame[48] == taken
                        taken += 1
                        continue
                    for i, p in enumerate(batch.payload_pos.tolist()):
                        assert bytes(batch.buf[p : p + 64]) == bytes([taken + i]) * 64
                    taken += len(batch)
            f = await r.next(lambda h: None)  # discarded
            assert not f.landed and f.frame is None and int(f.header["length"]) == 5000
        # a header with the wrong token breaks the stream: WireError
        await a.send_buffers([wire.encode_frame(wire.FrameType.CONTROL, b"{}", token=TOKEN + 1, rank=1)])
        with pytest.raises(WireError):
            await r.next(lambda h: KEEP)
        a.close()
        with pytest.raises(PeerClosed):
            await b.recv_exactly(memoryview(bytearray(10)))
    finally:
        a.close()
        b.close()


async def test_dial_gives_up_with_peer_timeout():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    with pytest.raises(PeerTimeout):
        await dial("127.0.0.1", port, TCP, 0.3)


async def test_reliable_writer_puts_urgent_frames_first_and_fails_queued_ones():
    a, b = await _tcp_pair()
    w = ReliableWriter(a)
    order = []
    try:
        bulk = w.push_frames([(b"B", memoryview(b"1")), (b"B", memoryview(b"2"))])
        urgent = w.push([b"U!"], urgent=True, slot=None)
        assert urgent is None
        async with trio.open_nursery() as n:
            n.start_soon(w.run)
            await bulk.wait()
            buf = memoryview(bytearray(6))
            await b.recv_exactly(buf)
            order.append(bytes(buf))
            n.cancel_scope.cancel()
        assert order == [b"U!B1B2"]
        w.fail(PeerClosed("gone"))
        late = w.push_frames([(b"x", memoryview(b"y"))])
        with pytest.raises(PeerClosed):
            await late.wait()
    finally:
        a.close()
        b.close()


async def test_datagram_scheduler_orders_lanes_paces_and_abandons_closed_rounds():
    chans = {1: UdpChannel("127.0.0.1", UDP, max_segments=4), 2: UdpChannel("127.0.0.1", UDP, max_segments=4)}
    sink = UdpChannel("127.0.0.1", UDP, rcvbuf=4 << 20, gro=False)
    closed = set()
    pacer = Pacer(200_000.0, 2000, now=trio.current_time())
    sched = DatagramScheduler(chans, lambda p, b, r: (b, r) in closed, lambda p: pacer)
    addr = ("127.0.0.1", sink.port)
    try:
        low = DatagramJob(0, 2, 0, 0, _datagrams(10, 500), [], addr)
        high = DatagramJob(0, 1, 1, 0, _datagrams(10, 500), [b"odd"], addr)
        stale = DatagramJob(0, 1, 2, 0, _datagrams(400, 500), [], addr)
        for j in (low, stale, high):
            sched.submit(j)
        closed.add((2, 0))  # the receiver already closed the stale round
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(sched.run)
            for j in (high, low, stale):
                await j.done.wait()
            n.cancel_scope.cancel()
        assert stale.sent == 0 and stale.abandoned == 400 and stale.sends == []
        assert high.sent == 11 and low.sent == 10
        # every send call is stamped for the congestion controller: (clock, datagrams, bytes), the odd tail with the
        # last rows (3 calls of at most 4 rows), in time order, and together they are what the job sent
        assert [n for _, n, _ in high.sends] == [4, 4, 3] and sum(b for *_, b in high.sends) == high.sent_bytes
        assert sum(n for _, n, _ in low.sends) == 10 and sum(b for *_, b in low.sends) == low.sent_bytes
        stamps = [t for t, _, _ in high.sends + low.sends]
        assert stamps == sorted(stamps) and t0 <= stamps[0] and stamps[-1] <= trio.current_time()
        # paced in chunks of 4 datagrams: everything but the burst and the last chunk waited for tokens
        assert trio.current_time() - t0 >= (10_003 - 2000 - 1000) / 200_000.0 * 0.9
        got = []
        while True:
            try:
                got.append(sink.sock.recv(2000))
            except BlockingIOError:
                break
        lanes_in_order = [len(g) for g in got]
        assert lanes_in_order[:11].count(500) == 10 and b"odd" in got[:11]  # lane 1 before lane 2
    finally:
        for c in (*chans.values(), sink):
            c.close()


async def test_deadline_timer_finalises_at_the_receivers_deadline():
    layout = BucketLayout([4096])
    tx = RoundSender(TOKEN, 1)
    x = torch.randn(4096)
    cls = torch.tensor([0, 1, 1, 1], dtype=torch.int8)
    plan = tx.plan(0, 0, tx.prepare(0, x), layout, cls)
    rx = RoundReceiver(TOKEN, 0, deadline=FixedGrace(0.05))
    done = []
    timer = DeadlineTimer(rx, done.extend)
    async with trio.open_nursery() as n:
        n.start_soon(timer.run)
        for h, p in plan.reliable:
            rx.receive_bytes(h + bytes(p), 0, trio.current_time())
        t0 = trio.current_time()
        timer.poke()
        with trio.fail_after(2):
            while not done:
                await trio.sleep(0.005)
        n.cancel_scope.cancel()
    assert done[0].stats.closed_by == "deadline" and trio.current_time() - t0 >= 0.045
    assert done[0].mask.tolist() == [True, False, False, False]


async def test_large_payload_reads_wake_on_rcvlowat_yet_trickles_and_eof_still_finish():
    a, b = await _tcp_pair()
    try:
        data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
        dst = bytearray(len(data))

        async def trickle():
            for k in range(0, len(data), 200_000):  # pieces smaller than the low-water mark, with pauses
                await a.send_buffers([memoryview(data)[k : k + 200_000]])
                await trio.sleep(0.002)

        async with trio.open_nursery() as n:
            n.start_soon(trickle)
            with trio.fail_after(10):
                await b.recv_exactly(memoryview(dst))
        assert bytes(dst) == data.tobytes()
        assert b.rx_calls < 3 * len(data) / 200_000  # woken per ~1 MiB or per piece, not per kernel skb
        # the mark is left high until the next wait, which sets its own: a small frame that follows still wakes
        await a.send_buffers([b"x" * 48])
        with trio.fail_after(5):
            assert await b.recv_into(memoryview(bytearray(48))) == 48
        small = bytearray(10)
        async with trio.open_nursery() as n:
            n.start_soon(b.recv_into, memoryview(small))  # waits: with the mark back at 1
            await trio.sleep(0.05)
            await a.send_buffers([b"y" * 10])
        assert bytes(small) == b"y" * 10 and b.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        # a peer that goes away mid-payload ends the read at once, low-water mark or not
        await a.send_buffers([memoryview(data)[:100_000]])
        a.close()
        with trio.fail_after(5), pytest.raises(PeerClosed):
            await b.recv_exactly(memoryview(bytearray(2 << 20)))
    finally:
        a.close()
        b.close()


async def test_bytes_waiting_in_the_kernel_count_as_a_live_peer():
    """The liveness check reads ``last_rx``: bytes a reader has not taken yet (it waits for a low-water mark on a
    slow link) still show the peer is there."""
    a, b = await _tcp_pair()
    try:
        t0 = b.last_rx
        await trio.sleep(0.05)
        assert b.last_rx == t0  # nothing came: the time stays
        await a.send_buffers([b"z" * 100_000])
        await trio.sleep(0.05)
        t1 = b.last_rx
        assert t1 > t0 and b.rx_bytes == 0  # seen in the kernel's queue, not read
        await trio.sleep(0.05)
        assert b.last_rx == t1  # the same bytes, still unread: no newer sign of life
        await b.recv_exactly(memoryview(bytearray(100_000)))
        assert b.last_rx == t1  # reading what was already counted is no new sign either
    finally:
        a.close()
        b.close()
