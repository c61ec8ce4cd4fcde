"""Lazy connections (#23): a group opens no connection until a collective needs one, then exactly the collective's
peers (ring: two neighbours; central PS: workers-server; gossip: the mixing matrix's neighbours), and calls that had
to wait for a connection still run in the order they were made (ranks started on several buckets at once)."""

import torch
import torch.distributed as dist
import trio
import trio.testing

from dgt.collectives import Gossip, Group, ParameterServer, RingAllReduce
from dgt.harness.groups import local_groups
from dgt.transport import Timeouts, TransportConfig

W = 6


def _groups(prefix, connect="lazy"):
    return local_groups(W, dist.HashStore(), config=TransportConfig(timeouts=Timeouts(peer=30)), timeout=30,
                                                                    prefix=prefix,
                        connect=connect)


async def _all(groups, fn):
    out = [None] * W

    async def one(r):
        out[r] = await fn(r)

    async with trio.open_nursery() as n:
        for r in range(W):
            n.start_soon(one, r)
    return out


def xs(bucket):
    return [torch.randn(5000, generator=torch.Generator().manual_seed(bucket * 100 + r)) for r in range(W)]


async def test_collectives_connect_only_to_the_peers_they_need_in_call_order():
    async with _groups("links") as groups:
        assert [g.connected for g in groups] == [[]] * W
        rings = [RingAllReduce(g) for g in groups]

        async def three_buckets(r):
            """Three calls in flight before any connection exists, made in bucket order (each blocks waiting for
            its connections before the next is made): they must still run in that order on every rank."""
            out = {}

            async def call(b):
                out[b] = (await rings[r].allreduce(xs(b)[r], b)).tensor

            async with trio.open_nursery() as n:
                for b in range(3):
                    n.start_soon(call, b)
                    await trio.testing.wait_all_tasks_blocked()
            return out

        res = await _all(groups, three_buckets)
        for b in range(3):
            ref = torch.stack(xs(b)).mean(0)
            for r in range(W):
                torch.testing.assert_close(res[r][b], ref, rtol=1e-5, atol=1e-6)
        assert [g.connected for g in groups] == [sorted({(r - 1) % W, (r + 1) % W}) for r in range(W)]
        # a central server adds the server's links only
        pss = [ParameterServer(g, server=2) for g in groups]
        res = await _all(groups, lambda r: pss[r].allreduce(xs(5)[r], 5))
        torch.testing.assert_close(res[0].tensor, torch.stack(xs(5)).mean(0), rtol=1e-5, atol=1e-6)
        assert groups[2].connected == [0, 1, 3, 4, 5]
        assert groups[4].connected == [2, 3, 5]


async def test_gossip_neighbours_and_connect_all():
    async with _groups("gossip") as groups:
        mixing = torch.zeros(W, W, dtype=torch.float64)
        for i in range(W):  # pairs (0,3), (1,4), (2,5)
            mixing[i, i] = mixing[i, (i + 3) % W] = 0.5
        goss = [Gossip(g, W=mixing.numpy()) for g in groups]
        res = await _all(groups, lambda r: goss[r].mix(xs(0)[r], 0))
        x = xs(0)
        torch.testing.assert_close(res[1].tensor, (x[1] + x[4]) / 2)
        assert [g.connected for g in groups] == [[(r + 3) % W] for r in range(W)]
    async with _groups("all", connect="all") as groups:
        assert [g.connected for g in groups] == [[p for p in range(W) if p != r] for r in range(W)]


class _FakeEndpoint:
    """Connections complete when the test says so (per peer); the Transport members Group uses to connect."""

    def __init__(self):
        from dgt.transport import TransportConfig

        self.peers, self.cfg, self.release = [], TransportConfig(), {}  # default lanes: TCP + one UDP lane

    async def connect(self, wanted, timeout=None):
        for r in wanted:
            await self.release.setdefault(r, trio.Event()).wait()
            self.peers.append(r)


class _FakeRendezvous:
    def addresses(self, ranks):
        return {r: {"host": "127.0.0.1", "tcp_port": 1, "udp_ports": [2]} for r in ranks}


async def test_calls_leave_links_in_the_order_they_came_whatever_connects_first():
    """Call 0 needs peer 1, call 1 needs peer 2, call 2 needs nothing new; peer 2 connects before peer 1. The calls
    still leave in the order 0, 1, 2 (a stream ticket taken right after must follow the call order)."""
    ep = _FakeEndpoint()
    g = Group(ep, 0, 4, 1, rendezvous=_FakeRendezvous())
    order = []

    async def call(i, peers):
        await g.links(peers)
        order.append(i)

    async with trio.open_nursery() as n:
        n.start_soon(call, 0, [1])
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(call, 1, [2])
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(call, 2, [])
        await trio.testing.wait_all_tasks_blocked()
        assert order == []
        ep.release.setdefault(2, trio.Event()).set()
        await trio.testing.wait_all_tasks_blocked()
        assert order == []  # call 1 is connected but waits for call 0
        ep.release.setdefault(1, trio.Event()).set()
    assert order == [0, 1, 2]
    # connected now: a call passes without yielding
    with trio.CancelScope() as cs:
        cs.cancel()
        await g.links([1, 2])  # a checkpoint would raise Cancelled here
    assert g._passed == g._seq == 4


async def test_a_peer_lost_between_calls_fails_the_next_call_at_once_not_after_the_connect_timeout():
    """A ring neighbour whose link failed after the first call is not waited for again (the connect timeout, 30 s
    here): the next call raises PeerClosed at once. Before, the higher rank waited for a redial that never came
    (test_killed_rank_fails_the_others_with_a_clear_error took 34 s once under load)."""
    from dgt.errors import PeerClosed

    async with _groups("lost") as groups:
        rings = [RingAllReduce(g, "dense") for g in groups]
        await _all(groups, lambda r: rings[r].allreduce(xs(0)[r], 0))
        await groups[1].aclose()  # rank 1 leaves; rank 2 (its higher neighbour) sees the link close
        with trio.fail_after(10):
            while 1 in groups[2].endpoint.peers:
                await trio.sleep(0.01)
        with trio.fail_after(5):  # far below the group's 30 s connect timeout
            try:
                await rings[2].allreduce(xs(1)[2], 1)
            except PeerClosed as exc:
                assert "rank(s) [1] was lost" in str(exc)
            else:
                raise AssertionError("a call with a lost neighbour must fail")
