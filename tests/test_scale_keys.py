"""Key spaces and limits at scale (#23): transport keys for 4096 ranks and 16384 buckets refuse what they cannot hold
(never wrap into a neighbour's key), codec state keys of the collectives never overlap, and a receiver's open-round
limit holds per sender, so a server with hundreds of workers is not starved by a limit shared by all of them."""

import itertools

import pytest
import torch

from dgt import wire
from dgt.collectives.parts import MAX_BUCKETS, MAX_PARTS, MAX_STEPS, PHASES, check_world, transport_key
from dgt.errors import ProtocolError
from dgt.protocol.bulk import BulkReceiver
from dgt.protocol.receiver import RoundReceiver

TOKEN = 0xC0FFEE


def test_transport_keys_are_distinct_at_the_edges_and_fit_32_bits():
    buckets = [0, 1, 8191, 8192, 10_000, MAX_BUCKETS - 1]
    steps = [0, 1, 63, 64, 65, 255, 999, 1000, MAX_STEPS - 1]
    parts = [0, 1, MAX_PARTS - 1]
    keys = {}
    for b, ph, s, p in itertools.product(buckets, PHASES, steps, parts):
        k = transport_key(b, ph, s, p)
        assert 0 <= k < 1 << 32
        assert k not in keys, f"{(b, ph, s, p)} collides with {keys[k]}"
        keys[k] = (b, ph, s, p)
    assert MAX_STEPS >= 1024 and MAX_BUCKETS >= 10_000  # the targets: 1,000+ ranks, 10,000+ buckets
    from dgt.transport.endpoint import BYTES_BUCKET

    top = transport_key(MAX_BUCKETS - 1, max(PHASES, key=PHASES.get), MAX_STEPS - 1, MAX_PARTS - 1)
    assert top < BYTES_BUCKET  # never in the range of send_bytes messages


def test_transport_key_refuses_values_outside_their_field():
    with pytest.raises(ValueError, match="step 4096"):
        transport_key(0, "rs", MAX_STEPS)
    with pytest.raises(ValueError, match="bucket id 16384"):
        transport_key(MAX_BUCKETS, "push")
    with pytest.raises(ValueError, match="bucket id -1"):
        transport_key(-1, "push")
    with pytest.raises(ValueError, match="part 8"):
        transport_key(0, "push", 0, MAX_PARTS)
    with pytest.raises(ValueError, match="step -1"):
        transport_key(0, "ag", -1)
    check_world(MAX_STEPS, "ring")
    with pytest.raises(ValueError, match="4097 ranks"):
        check_world(MAX_STEPS + 1, "ring")


class _Group:
    def __init__(self, rank, world):
        self.rank, self.world, self.endpoint = rank, world, None


def test_collectives_refuse_worlds_the_keys_cannot_hold():
    from dgt.collectives import ParameterServer, RingAllReduce

    with pytest.raises(ValueError, match="exceeds the transport key"):
        RingAllReduce(_Group(0, MAX_STEPS + 1))
    with pytest.raises(ValueError, match="exceeds the transport key"):
        ParameterServer(_Group(0, MAX_STEPS + 1), server="sharded")
    RingAllReduce(_Group(0, 1000))
    ParameterServer(_Group(0, 1000), server="sharded")
    ParameterServer(_Group(0, MAX_STEPS + 1), server=0)  # a central server needs no step per rank


def test_ps_server_state_keys_do_not_overlap_at_scale():
    """The server keeps one decode state per (bucket, shard, worker): with 1000 workers and bucket ids past 8192
    every one is distinct (the old arithmetic reused keys from 64 workers on and spilled at bucket 8192)."""
    from dgt.collectives.parts import state_key

    keys = {state_key("push-rx", b, s, w) for b in (0, 1, 8192) for s in (0, 1) for w in range(1000)}
    assert len(keys) == 3 * 2 * 1000
    roles = {state_key(r, 8192, 1) for r in ("push", "pull", "pull-rx", "rs", "ag", "gossip")}
    assert len(roles) == 6


def _begin(rank: int, rnd: int, numel: int = 4096) -> bytes:
    body = wire.encode_round_begin(numel, 1024, 256, [numel])
    return wire.encode_frame(wire.FrameType.ROUND_BEGIN, body, token=TOKEN, rank=rank, round=rnd)


def test_open_round_limit_holds_per_sender():
    """300 senders with 2 rounds each all open under max_open_rounds=2 (the old limit was shared: 2 in all); a
    third round from one sender is refused."""
    rx = RoundReceiver(TOKEN, limits=wire.Limits(max_open_rounds=2), max_open_bytes=1 << 30)
    for sender in range(300):
        for rnd in range(2):
            rx.receive_bytes(_begin(sender, rnd), 0, 0.0)
    assert len(rx.rounds) == 600
    assert rx.counters.rejected == 0
    rx.receive_bytes(_begin(7, 2), 0, 0.0)
    assert (7, 0, 2) not in rx.rounds
    assert rx.counters.reasons.get("too-many-rounds") == 1


def test_open_rounds_stay_bounded_by_memory_whatever_the_senders():
    rx = RoundReceiver(TOKEN, limits=wire.Limits(max_open_rounds=64), max_open_bytes=1 << 20)
    for sender in range(1000):
        rx.receive_bytes(_begin(sender, 0, 1 << 16), 0, 0.0)
    assert sum(r.nbytes for r in rx.rounds.values()) <= 1 << 20
    assert rx.counters.reasons.get("memory-budget", 0) >= 900


def test_bulk_messages_in_progress_are_limited_per_peer():
    bulk = BulkReceiver(2, 1 << 30, lambda key, n, dt: None)
    h = wire.headers(1)[0]
    h["dtype"], h["offset"], h["count"], h["block"] = int(wire.WireDType.FLOAT32), 0, 4, 16
    for peer in range(100):  # a server's worth of peers, each with messages in progress
        for rnd in range(2):
            h["round"] = rnd
            bulk.target(peer, h, 0.0)
    assert len(bulk.open) == 200
    h["round"] = 2
    with pytest.raises(ProtocolError, match="more than 2 bulk messages"):
        bulk.target(5, h, 0.0)
    assert torch.is_tensor(next(iter(bulk.open.values())).data)


def test_port_range_binds_every_socket_inside_it_and_says_when_full(monkeypatch):
    """Endpoints bind their listener and UDP lanes to free ports of TransportConfig.port_range / DGT_PORT_RANGE."""
    import socket

    import trio

    from dgt.channels.ports import parse_port_range
    from dgt.collectives.launch import free_port
    from dgt.transport import Endpoint, Lanes, TransportConfig

    lo = free_port()
    lo = min(lo, 65535 - 16)
    monkeypatch.setenv("DGT_PORT_RANGE", f"{lo}-{lo + 15}")
    cfg = TransportConfig()
    assert cfg.lanes.port_range == (lo, lo + 15)
    with pytest.raises(ValueError, match="LO-HI"):
        parse_port_range("30000")
    with pytest.raises(ValueError, match="need 1 <= LO <= HI"):
        TransportConfig(lanes=Lanes(port_range=(5, 1)))
    taken = socket.socket()
    taken.bind(("127.0.0.1", lo))  # the first port is busy: the next free one is used

    async def main():
        async with Endpoint.open(0, 1, cfg) as a, Endpoint.open(1, 1, cfg) as b:
            ports = [p for ep in (a, b) for p in (ep.address.tcp_port, *ep.address.udp_ports)]
            assert all(lo <= p <= lo + 15 for p in ports), ports
            assert lo not in (a.address.tcp_port, b.address.tcp_port)  # busy for TCP: skipped
        with pytest.raises(OSError, match=f"no free port .* {lo}-{lo}"):
            Endpoint(0, 1, TransportConfig(lanes=Lanes(port_range=(lo, lo))))

    try:
        trio.run(main)
    finally:
        taken.close()
