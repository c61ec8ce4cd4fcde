"""Stream lanes (dgt.transport.streams) between endpoints inside one trio run: exchanges land every byte and are
counted, run one at a time in call order, and end with a clear error (wrong order, silence, a closed peer,
cancellation) instead of a hang."""

from contextlib import asynccontextmanager

import pytest
import torch
import trio
import trio.testing

from dgt.channels.duplex import NATIVE
from dgt.channels.sockopts import parse_dscp
from dgt.errors import ProtocolError
from dgt.transport import Endpoint, PeerClosed, PeerTimeout, TransportConfig
from dgt.transport.streams import Hop

TOKEN = 0x5EED_0002
MODES = [pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="native hop loop not built")), "python"]


@asynccontextmanager
async def pair(mode="auto", timeout=5.0, ranks=(0, 1), **cfg):
    """Two connected endpoints (ranks ``ranks``), closed on the way out."""
    cfg = TransportConfig(peer_timeout=timeout, stream_hops=mode, **cfg)
    async with Endpoint.open(ranks[0], TOKEN, cfg) as a, Endpoint.open(ranks[1], TOKEN, cfg) as b:
        async with trio.open_nursery() as n:
            n.start_soon(a.connect, {ranks[1]: b.address})
            n.start_soon(b.connect, {ranks[0]: a.address})
        yield a, b


async def both(fa, fb):
    out = {}

    async def run(name, f):
        out[name] = await f()

    async with trio.open_nursery() as n:
        n.start_soon(run, "a", fa)
        n.start_soon(run, "b", fb)
    return out["a"], out["b"]


@pytest.mark.parametrize("hop_threads", [1, 2])
@pytest.mark.parametrize("mode", MODES)
async def test_exchange_both_ways_lands_sums_counts_and_marks_ef(mode, hop_threads):
    async with pair(mode, hop_threads=hop_threads) as (a, b):
        n = 500_003
        xa, xb, own = torch.randn(n), torch.randn(n), torch.randn(n)
        la, lb = torch.full((n,), float("nan")), torch.full((n,), float("nan"))
        before = a.stats().lanes[0].tx_bytes
        ra, rb = await both(
            lambda: a.exchange([Hop(7, 0, 1, xa, 1, la, add_src=own)]),
            lambda: b.exchange([Hop(7, 0, 0, xb, 0, lb)]))
        assert torch.equal(la, own + xb) and torch.equal(lb, xa)
        assert ra[0].sent == ra[0].received == rb[0].sent == 48 + 4 * n
        extra = a.stats().lanes[0].tx_bytes - before - (48 + 4 * n)
        assert 0 <= extra < 1024, extra  # the message, plus the stream lane's authenticated hello (and perhaps a ping)
        assert a.streams.exchanges == b.streams.exchanges == 1
        info = a.links.socket_info()["stream"]
        assert info[1]["dscp"] == info[1]["rx_dscp"] == parse_dscp(a.cfg.lanes.specs[0].dscp)
        # one connection per direction: rank 0 sends on what rank 1 receives on, and the other way round
        la, lb = a.streams.lanes[1], b.streams.lanes[0]
        assert la.tx.sock.getsockname() == lb.rx.sock.getpeername()
        assert la.rx.sock.getsockname() == lb.tx.sock.getpeername()
        assert la.tx.sock.getsockname() != la.rx.sock.getsockname()
        assert a.streams.split == b.streams.split == (hop_threads == 2 and mode == "native")


async def test_a_second_connection_for_a_direction_is_refused():
    async with pair() as (a, b):
        await both(lambda: a.exchange([Hop(1, 0, 1, torch.ones(10), 1, torch.empty(10))]),
                   lambda: b.exchange([Hop(1, 0, 0, torch.ones(10), 0, torch.empty(10))]))
        for direction in (0, 1):
            with pytest.raises(ProtocolError, match="already has a stream lane"):
                await a.handshake.dial_stream(1, direction)
        with pytest.raises(ProtocolError, match="not the lower rank"):
            await b.handshake.dial_stream(0, 0)


async def test_exchanges_called_concurrently_run_one_at_a_time_in_call_order():
    async with pair() as (a, b):
        xs = [torch.randn(200_000) for _ in range(3)]
        lands = [torch.empty(200_000) for _ in range(3)]

        async def side(ep, peer, send):
            async with trio.open_nursery() as n:
                for i in range(3):  # each takes its ticket before the next one starts
                    if send:
                        n.start_soon(ep.exchange, [Hop(i, 0, send_to=peer, payload=xs[i])])
                    else:
                        n.start_soon(ep.exchange, [Hop(i, 0, recv_from=peer, land=lands[i])])
                    await trio.testing.wait_all_tasks_blocked()

        with trio.fail_after(20):
            await both(lambda: side(a, 1, True), lambda: side(b, 0, False))
        assert all(torch.equal(x, y) for x, y in zip(xs, lands))


async def test_different_orders_on_the_two_ranks_are_a_protocol_error_not_a_hang():
    async with pair() as (a, b):
        x = torch.randn(1000)
        errors = []

        async def run(ep, hops):
            try:
                await ep.exchange(hops)
            except Exception as exc:
                errors.append(exc)

        with trio.fail_after(20):
            await both(lambda: run(a, [Hop(1, 0, 1, x, 1, torch.empty(1000))]),
                       lambda: run(b, [Hop(2, 0, 0, x, 0, torch.empty(1000))]))
        assert errors and all(isinstance(e, (ProtocolError, PeerClosed)) for e in errors), errors
        assert any(isinstance(e, ProtocolError) and "different orders" in str(e) for e in errors), errors


async def test_silence_times_out_and_the_lane_then_refuses_further_exchanges():
    async with pair(timeout=30) as (a, b):
        land = torch.empty(1000)
        with trio.fail_after(10):
            with pytest.raises(PeerTimeout, match="no progress"):
                await a.exchange([Hop(1, 0, recv_from=1, land=land)], timeout=0.3)
        # the lane failed with the hop (it may be mid-message): later exchanges say so instead of reading garbage
        with pytest.raises(PeerTimeout):
            await a.exchange([Hop(2, 0, recv_from=1, land=land)])


async def test_a_cancelled_exchange_returns_at_once_and_fails_its_lane():
    async with pair(timeout=30) as (a, b):
        land = torch.empty(1000)
        x = torch.randn(1000)
        await both(lambda: a.exchange([Hop(0, 0, send_to=1, payload=x)]),
                   lambda: b.exchange([Hop(0, 0, recv_from=0, land=land)]))  # the lane is up
        t0 = trio.current_time()
        with trio.move_on_after(0.3) as scope:
            await b.exchange([Hop(1, 0, recv_from=0, land=land)])  # nobody sends: waits until cancelled
        assert scope.cancelled_caught and trio.current_time() - t0 < 5
        with pytest.raises(PeerClosed):
            await b.exchange([Hop(2, 0, recv_from=0, land=land)])


async def test_closing_the_peer_mid_exchange_fails_the_hop_and_data_sent_before_a_goodbye_is_still_read():
    async with pair(timeout=30) as (a, b):
        x = torch.randn(1000)
        await a.exchange([Hop(1, 0, send_to=1, payload=x)])  # fits the socket buffers: done before b reads
        await a.aclose()
        await trio.sleep(0.2)  # b has seen the goodbye by now
        land = torch.empty(1000)
        await b.exchange([Hop(1, 0, recv_from=0, land=land)])
        assert torch.equal(land, x)
        with trio.fail_after(10):
            with pytest.raises(PeerClosed, match="closed its endpoint"):
                await b.exchange([Hop(2, 0, recv_from=0, land=land)])


async def test_an_unreachable_stream_peer_times_out_clearly():
    async with pair(ranks=(1, 0), connect_timeout=0.5) as (a, b):
        with trio.fail_after(10):  # rank 1 waits for rank 0 to dial, which never calls exchange
            with pytest.raises(PeerTimeout, match="did not open its stream lane"):
                await a.exchange([Hop(1, 0, recv_from=0, land=torch.empty(10))])


async def test_messages_larger_than_a_frame_go_as_several_and_uneven_hops_pair_up():
    """With a 64 KiB frame limit, a 1.2 MB message crosses as 19 BULK frames; one side sends more pieces than it
    receives (a ring's chunks differ in size), and the sums still come out exact."""
    from dgt import wire

    async with pair(limits=wire.Limits(max_payload=64 << 10)) as (a, b):
        big, small = torch.randn(300_001), torch.randn(10_000)
        own = torch.randn(small.numel())
        at_b, at_a = torch.empty(big.numel()), torch.empty(small.numel())
        ra, rb = await both(
            lambda: a.exchange([Hop(3, 1, 1, big, 1, at_a, add_src=own)]),
            lambda: b.exchange([Hop(3, 1, 0, small, 0, at_b)]))
        assert torch.equal(at_b, big) and torch.equal(at_a, own + small)
        frames = -(-big.numel() * 4 // (64 << 10))
        assert ra[0].sent == rb[0].received == frames * wire.HEADER_SIZE + big.numel() * 4
        assert a.stats().lanes[0].tx_calls >= frames


async def test_a_lane_failing_between_lookup_and_run_fails_the_exchange(monkeypatch):
    """The peer's link dies after its lane was looked up but before the hops run (on a 16-core host this window
    was hit: the abort closed the idle lane's sockets, and the ring returned a sum it never received). The exchange
    must raise, whatever the window."""
    async with pair() as (a, b):
        await both(lambda: a.exchange([Hop(1, 0, 1, torch.ones(10), 1, torch.empty(10))]),
                   lambda: b.exchange([Hop(1, 0, 0, torch.ones(10), 0, torch.empty(10))]))
        lookup = a.streams._lanes  # (open lanes are looked up at once, without lane())

        async def lanes_then_link_fails(peers):
            lanes = await lookup(peers)
            a.streams.abort(1, PeerClosed("the link to rank 1 failed (injected)"))
            return lanes

        monkeypatch.setattr(a.streams, "_lanes", lanes_then_link_fails)
        land = torch.full((10,), float("nan"))
        with pytest.raises(PeerClosed, match="injected"):
            await a.exchange([Hop(1, 1, 1, torch.ones(10), 1, land)])
        assert a.streams.exchanges == 1
