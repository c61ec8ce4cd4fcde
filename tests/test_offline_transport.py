"""The offline transport of dgt.harness (a Group with no peers, for construction checks) is a full Transport, and a
Group refuses to be built on nothing."""

import inspect

import pytest
import torch
import trio

from dgt.collectives import Group, RingAllReduce
from dgt.errors import PeerClosed
from dgt.harness.offline import OfflineTransport
from dgt.transport.contract import Transport


def test_the_offline_transport_has_every_transport_member_with_the_same_parameters():
    members = [n for n in vars(Transport) if not n.startswith("_")] + list(Transport.__annotations__)
    t = OfflineTransport(rank=1)
    for name in members:
        assert hasattr(t, name), name
        if name in Transport.__annotations__:
            continue  # a data attribute
        want = getattr(Transport, name)
        if callable(want):
            assert list(inspect.signature(want).parameters) == list(inspect.signature(
                getattr(OfflineTransport, name)).parameters), name
    assert t.rank == 1 and t.peers == [] and len(t.address.udp_ports) == len(t.cfg.lanes.specs) - 1


def test_a_group_is_never_built_on_no_transport():
    with pytest.raises(TypeError, match="OfflineTransport"):
        Group(None, 0, 2, 1)
    assert Group(OfflineTransport(), 0, 2, 1).endpoint.peers == []


def test_traffic_on_the_offline_transport_fails_with_a_clear_error():
    g = Group(OfflineTransport(), 0, 2, 1)

    async def main():
        assert RingAllReduce(g, "dense").group is g  # construction needs no traffic
        with pytest.raises(PeerClosed, match="offline transport"):
            await g.endpoint.send_round(1, 0, 0, torch.ones(8))
        with pytest.raises(PeerClosed, match="offline transport"):
            await g.endpoint.connect({1: g.endpoint.address})
        with pytest.raises(PeerClosed, match="offline transport"):
            g.endpoint.reserve_exchange()
        assert await g.endpoint.aborted(0.0) is None
        await g.aclose()

    trio.run(main)
