"""What the layers above the transport read instead of private fields and getattr probes (issue 44): the endpoint's
public accessors, the codec contract's loss and p hooks."""

from __future__ import annotations

import socket

import torch

from dgt.codecs import make_codec
from dgt.experiment.worker import SO_MAX_PACING_RATE, pace_tcp, transport_state
from dgt.harness.endpoints import connected_pair
from dgt.transport import Pacing, Timeouts, TransportConfig


async def test_the_endpoint_says_what_it_waits_for_and_which_sockets_it_paces():
    cfg = TransportConfig(timeouts=Timeouts(peer=5), pacing=Pacing(rate=50e6, shared=True))
    async with connected_pair(7, cfg) as (a, b):
        assert a.stats().pace_shared_peers == 1 and b.stats().pace_shared_peers == 1
        socks = a.links.link_sockets()
        assert len(socks) == 1 and all(isinstance(s, socket.socket) for s in socks)
        assert pace_tcp(a, 1_000_000) == 1
        assert socks[0].getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) == 1_000_000
        assert transport_state(b) == {"recv_waiters": [], "sending": [], "results": []}  # nothing under way
        await a.send_round(1, 5, 0, torch.ones(1000), wait=True)  # returns once b's drop report is in
        assert transport_state(b) == {"recv_waiters": [], "sending": [], "results": [[0, 5, 0]]}  # not collected
        pending = b.inbound.pending_rounds()
        assert pending.results == [(0, 5, 0)] and pending.open_rounds == [] and pending.sending == []
        res = await b.recv_round(0, 5, 0)
        assert torch.equal(res.data, torch.ones(1000))
        assert transport_state(b)["results"] == []


def test_pending_rounds_name_the_open_rounds_progress():
    from dgt.protocol.stats import RoundProgress
    from dgt.transport.stats import PendingRounds

    r = RoundProgress((1, 2, 3), (4, 0, 9, 0), 2, 5, 0.25)
    d = PendingRounds([(1, 2, 3)], [], [], [r]).to_dict()
    assert d == {"recv_waiters": [[1, 2, 3]], "sending": [], "results": [],
                 "open_rounds": [{"key": [1, 2, 3], "end": (4, 0, 9, 0), "important_done": 2, "blocks_done": 5,
                                  "important_done_at": 0.25}]}


def test_codecs_take_the_loss_and_say_their_p_through_the_contract():
    dgt = make_codec("dgt:p=loss,p0=0.8")
    assert dgt.current_p() == 0.8  # no loss seen yet: p0
    dgt.observe_loss(2.0)
    dgt.observe_loss(1.0)  # the loss halved: p follows it
    assert dgt.current_p() == 0.4
    assert make_codec("dgt:p=0.3").current_p() == 0.3
    dense = make_codec("dense")
    dense.observe_loss(1.0)  # accepted, ignored
    assert dense.current_p() is None


def test_the_receiver_reports_its_open_rounds_progress():
    from dgt import wire
    from dgt.protocol.receiver import RoundReceiver

    rx = RoundReceiver(token=5)
    assert rx.progress() == []
    begin = wire.encode_round_begin(4096, 1024, 256, [4096])
    for rnd in range(3):
        rx.receive_bytes(wire.encode_frame(wire.FrameType.ROUND_BEGIN, begin, token=5, rank=1, bucket=2, round=rnd),
                         0, 0.0)
    got = rx.progress(limit=2)
    assert [p.key for p in got] == [(1, 2, 0), (1, 2, 1)]  # the first two open rounds
    assert all(p.end is None and p.blocks_done == 0 and p.important_done == 0 for p in got)
