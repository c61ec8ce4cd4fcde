"""Every receive has a bound (issue 22: ``recv_round`` had no timeout, so a live peer that never sent a round kept a
rank waiting forever). Real endpoints on loopback; each wait is guarded by a trio deadline far above its bound, so
a receive without one fails this test instead of hanging it."""

import pytest
import torch
import trio

from dgt.harness.endpoints import connected_pair
from dgt.transport import PeerTimeout, TransportConfig
from dgt.transport.streams import Hop

TOKEN = 0x22_B0D0
GUARD = 15.0  # seconds: a receive still waiting by then has no bound


def _pair(**cfg):
    return connected_pair(TOKEN, TransportConfig(peer_timeout=5, **cfg))


def test_a_round_a_live_peer_never_sends_ends_in_peer_timeout_after_round_timeout():
    async def main():
        # the peer stays live (pings): only the receive's own bound ends it
        async with _pair(round_timeout=0.5) as (a, b):
            with trio.fail_after(GUARD):
                for recv in (lambda: b.recv_round(0, 7, 0), lambda: b.inbound.recv_bytes(0, tag=3),
                             lambda: b.recv_round(0, 7, 1, timeout=0.3)):
                    t0 = trio.current_time()
                    with pytest.raises(PeerTimeout, match="nothing within"):
                        await recv()
                    assert trio.current_time() - t0 < 2.0
            # the session is intact: a round sent now is received whole
            x = torch.arange(4096, dtype=torch.float32)
            async with trio.open_nursery() as n:
                n.start_soon(a.send_round, 1, 7, 2, x)
                res = await b.recv_round(0, 7, 2)
            assert torch.equal(res.data, x)

    trio.run(main)


def test_a_stream_hop_whose_peer_never_sends_ends_in_peer_timeout():
    async def main():
        async with _pair() as (a, b):
            x, land_a, land_b = torch.ones(1000), torch.empty(1000), torch.empty(1000)
            async with trio.open_nursery() as n:  # one matching exchange: the lane is open
                n.start_soon(a.exchange, [Hop(1, 0, send_to=1, payload=x, recv_from=1, land=land_a)])
                await b.exchange([Hop(1, 0, send_to=0, payload=x, recv_from=0, land=land_b)])
            assert torch.equal(land_a, x) and torch.equal(land_b, x)
            t0 = trio.current_time()
            with trio.fail_after(GUARD), pytest.raises(PeerTimeout):
                await b.exchange([Hop(1, 1, recv_from=0, land=land_b)], timeout=0.5)  # rank 0 never sends it
            assert trio.current_time() - t0 < 3.0

    trio.run(main)
