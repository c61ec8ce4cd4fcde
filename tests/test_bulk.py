"""BULK messages: lossless rounds without round state. The sans-IO framing and receiver (order, limits, budget), then
the endpoint: lossless rounds nobody waits a report for go as BULK, land in posted buffers, and a peer that breaks
the framing fails with a clear error instead of a hang."""

import numpy as np
import pytest
import torch
import trio

from dgt import wire
from dgt.errors import ProtocolError
from dgt.harness.endpoints import connected_pair
from dgt.protocol.bulk import BulkReceiver, bulk_frames
from dgt.protocol.receiver import RoundReceiver
from dgt.transport import Faults, Sockets, Timeouts, TransportConfig

TOKEN = 0xB01C


def _header(raw: bytes) -> np.void:
    return np.frombuffer(raw, wire.HEADER_DTYPE)[0]


def _deliver(rx: BulkReceiver, frames, rank: int = 3, now: float = 0.0):
    """Feed frames the way the endpoint's reader does: validate, place, copy, commit."""
    done = []
    for hdr, payload in frames:
        assert wire.validate_one(hdr, wire.DEFAULT_LIMITS, TOKEN) == 0
        h = _header(hdr)
        target = rx.target(rank, h, now)
        assert len(target) == len(payload)
        target[:] = payload
        done += rx.landed(rank, h, now + 1.0)
    return done


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 1000, 4097])
def test_round_trip_in_frames_of_bounded_size(dtype, numel):
    x = (torch.randn(numel) * 50).to(dtype)
    frames = bulk_frames(TOKEN, 3, 77, 5, x, frame_bytes=1024)
    isz = x.element_size()
    assert len(frames) == max(1, -(-numel * isz // (1024 // isz * isz)))
    assert all(len(p) <= 1024 for _, p in frames)
    rx = BulkReceiver(4, 1 << 20, lambda key, n, dt: None)
    done = _deliver(rx, frames)
    assert len(done) == 1 and done[0].key == (3, 77, 5) and done[0].frames == len(frames)
    assert done[0].data.dtype == dtype and torch.equal(done[0].data, x)
    assert done[0].nbytes == numel * isz + len(frames) * wire.HEADER_SIZE and done[0].elapsed == 1.0
    assert not rx.open and rx.allocated == 0


def test_posted_buffer_is_used_and_not_charged_to_the_budget():
    x = torch.randn(5000)
    posted = torch.empty_like(x)
    asked = []

    def landing(key, n, dt):
        asked.append((key, n, dt))
        return posted if (n, dt) == (x.numel(), x.dtype) else None

    rx = BulkReceiver(4, 100, landing)  # a budget far below the message: only the posted buffer can take it
    done = _deliver(rx, bulk_frames(TOKEN, 3, 1, 0, x, 4096))
    assert asked == [((3, 1, 0), 5000, torch.float32)]
    assert done[0].data.data_ptr() == posted.data_ptr() and torch.equal(posted, x)


def test_frames_out_of_order_or_not_fitting_are_protocol_errors():
    x = torch.randn(3000)
    frames = bulk_frames(TOKEN, 3, 1, 0, x, 4096)
    assert len(frames) == 3
    rx = BulkReceiver(4, 1 << 20, lambda *a: None)
    with pytest.raises(ProtocolError, match="starts at element"):
        rx.target(3, _header(frames[1][0]), 0.0)  # a message must begin at element 0
    rx.target(3, _header(frames[0][0]), 0.0)
    rx.landed(3, _header(frames[0][0]), 0.0)
    with pytest.raises(ProtocolError, match="does not continue"):
        rx.target(3, _header(frames[2][0]), 0.0)  # skips the middle frame
    other = bulk_frames(TOKEN, 3, 1, 0, torch.randn(3000).double(), 8192)
    with pytest.raises(ProtocolError, match="does not continue"):
        rx.target(3, _header(other[1][0]), 0.0)  # another dtype under the same key


def test_open_messages_and_allocated_bytes_are_bounded():
    rx = BulkReceiver(2, 10_000, lambda *a: None)
    for bucket in (1, 2):  # two messages begun, neither finished
        f = bulk_frames(TOKEN, 3, bucket, 0, torch.zeros(1000), 1024)
        rx.target(3, _header(f[0][0]), 0.0)
    assert rx.allocated == 8000
    with pytest.raises(ProtocolError, match="in progress"):
        rx.target(3, _header(bulk_frames(TOKEN, 3, 9, 0, torch.zeros(10), 1024)[0][0]), 0.0)
    rx.abort(3)  # the peer went away: its partial messages and their bytes are released
    assert not rx.open and rx.allocated == 0
    # a header announcing more than the budget is refused before anything is allocated
    hdr = bytearray(bulk_frames(TOKEN, 3, 1, 0, torch.zeros(10), 1024)[0][0])
    h = np.frombuffer(hdr, wire.HEADER_DTYPE)
    h["block"] = 1 << 29  # half a billion floats announced in a 40-byte frame
    with pytest.raises(ProtocolError, match="budget"):
        rx.target(3, h[0], 0.0)
    assert rx.allocated == 0


def test_validation_of_bulk_headers():
    good = bytearray(bulk_frames(TOKEN, 3, 1, 0, torch.zeros(10), 1024)[0][0])
    assert wire.validate_one(good, wire.DEFAULT_LIMITS, TOKEN) == 0
    for field, value in (("block", 5), ("length", 39), ("offset", 1)):  # beyond the message, wrong size
        bad = bytearray(good)
        np.frombuffer(bad, wire.HEADER_DTYPE)[field] = value
        arr = np.frombuffer(bytes(bad), wire.HEADER_DTYPE)
        one = wire.validate_one(bad, wire.DEFAULT_LIMITS, TOKEN)
        assert one == wire.REASONS.index("count") and int(wire.validate(np.repeat(arr, 9), token=TOKEN)[0]) == one


def test_a_bulk_frame_in_a_datagram_is_counted_and_dropped():
    rx = RoundReceiver(TOKEN, 0)
    hdr, payload = bulk_frames(TOKEN, 3, 1, 0, torch.ones(4), 1024)[0]
    assert rx.receive_bytes(hdr + bytes(payload), 1, 0.0) == []
    assert rx.counters.reasons == {"bulk-not-on-stream": 1}


# ---- through the endpoint -----------------------------------------------------------------------------------------


def _pair(cfg):
    return connected_pair(TOKEN, cfg)


async def test_lossless_unawaited_rounds_travel_as_bulk_and_land_in_place():
    async with _pair(TransportConfig(timeouts=Timeouts(peer=30),
                                     sockets=Sockets(reliable_frame_bytes=64 << 10))) as (a, b):
        x = torch.randn(100_000)  # 400 kB: 7 frames of at most 64 KiB
        posted = torch.empty_like(x)
        b.post_recv(0, 4, 0, posted)
        rx_frames = b.links.table[0].reader.frames
        sent = await a.send_round(1, 4, 0, x, wait=False)
        with trio.fail_after(10):
            res = await b.recv_round(0, 4, 0)
        assert res.bulk and res.data.data_ptr() == posted.data_ptr() and torch.equal(posted, x)
        assert b.links.table[0].reader.frames - rx_frames == sent.reliable_frames == 7  # no BEGIN/END, no report
        assert res.mask.all() and res.stats.closed_by == "complete" and res.stats.blocks == res.layout.nblocks
        assert sent.reliable_bytes == res.stats.lanes[0].bytes == x.numel() * 4 + 7 * wire.HEADER_SIZE
        st = b.stats()
        assert st.rounds_received == 1 and st.blocks_received == res.layout.nblocks and not b.bulk.open
        # a waited-for or lossy round still goes the round way, with its drop report
        sent, res2 = await _both(a, b, 5, x, wait=True)
        assert sent.report and not res2.bulk and torch.equal(res2.data, x)


async def _both(a, b, bucket, x, **kw):
    out = {}

    async def send():
        out["sent"] = await a.send_round(1, bucket, 0, x, **kw)

    async with trio.open_nursery() as n:
        n.start_soon(send)
        with trio.fail_after(10):
            out["res"] = await b.recv_round(0, bucket, 0)
    return out["sent"], out["res"]


async def test_a_peer_breaking_bulk_order_fails_the_waiter_with_a_protocol_error():
    async with _pair(TransportConfig(timeouts=Timeouts(peer=30))) as (a, b):
        frames = bulk_frames(TOKEN, 0, 8, 0, torch.randn(3000), 4096)
        a.links.table[1].writer.push_frames([frames[0], frames[2]])  # the middle frame never comes

        with pytest.raises(ProtocolError, match="does not continue"):
            with trio.fail_after(10):
                await b.recv_round(0, 8, 0)
        assert not b.bulk.open and b.bulk.allocated == 0


async def test_post_send_queues_without_a_task_and_adds_a_folded_residual():
    # b drops every datagram it gets (an injected loss): only the reliable lane gets through to it
    async with _pair(TransportConfig(timeouts=Timeouts(peer=30), sockets=Sockets(reliable_frame_bytes=64 << 10),
                                     faults=Faults(drop_fraction=1.0), deadline="fixed:0.05")) as (a, b):
        # one task starts a send and awaits the matching receive: the writer task does the sending
        x = torch.randn(50_000)
        posted = torch.empty_like(x)
        b.post_recv(0, 2, 0, posted)
        t0 = trio.current_time()
        pending = a.post_send(1, 2, 0, x)
        with trio.fail_after(10):
            res = await b.recv_round(0, 2, 0)
            sent = await pending.wait()
        waited = trio.current_time() - t0
        assert pending.done and res.bulk and res.data.data_ptr() == posted.data_ptr() and torch.equal(posted, x)
        # 200 kB took time to send, and the send's clock ran within the test's (from post_send to wait's return)
        assert sent.reliable_frames == 4 and not sent.copied and 0 < sent.elapsed <= waited
        assert sent.reliable_bytes == res.stats.lanes[0].bytes == x.numel() * 4 + 4 * wire.HEADER_SIZE
        with pytest.raises(ValueError, match="bucket ids"):
            a.post_send(1, 0xFFFF0001, 0, x)
        # a lossy round loses its unimportant blocks, and error feedback keeps them...
        n = 8192
        z = torch.randn(n)
        cls = torch.zeros(n // 1024, dtype=torch.int64)
        cls[4:] = 1
        sent_lossy, res_lossy = await _both(a, b, 3, z, cls=cls, order=torch.arange(4, 8))
        assert sent_lossy.lost_blocks == 4 and not res_lossy.mask[4:].any()
        residual = a.links.table[1].sender.residual(3).clone()
        assert torch.equal(residual[4096:], z[4096:]) and (residual[:4096] == 0).all()
        # ...and the next lossless message of that bucket carries them, sent from a copy
        y = torch.randn(n)
        pending = a.post_send(1, 3, 1, y)
        with trio.fail_after(10):
            res = await b.recv_round(0, 3, 1)
            sent = await pending.wait()
        assert sent.copied and res.bulk and torch.equal(res.data, y + residual)
        assert a.links.table[1].sender.residual(3).abs().sum() == 0
