"""Edges the strict type check of dgt.transport brought up (issue #24): each now fails with a clear error."""

from __future__ import annotations

import pytest
import torch

from dgt import wire
from dgt.errors import PeerClosed, ProtocolError
from dgt.transport import control
from dgt.transport.streams import Hop, StreamHub


def test_control_parse_refuses_a_frame_without_its_bytes():
    with pytest.raises(ProtocolError, match="without its bytes"):
        control.parse(None)
    rank, msg = control.parse(control.control(5, 3, control.PING))  # a real one still parses
    assert rank == 3 and msg["op"] == control.PING


async def _no_dial(peer: int, direction: int):
    raise AssertionError("not dialled")


@pytest.mark.parametrize("hop", [Hop(bucket=1, round=0, send_to=1), Hop(bucket=1, round=0, recv_from=1)])
def test_a_hop_with_a_peer_but_no_tensor_is_refused(hop):
    hub = StreamHub(0, 5, 1.0, _no_dial, lambda r: None, native=False, frame_bytes=wire.DEFAULT_LIMITS.max_payload)
    try:
        with pytest.raises(ValueError, match="needs its (payload|land) tensor"):
            hub._plan(hop, {})
        ok = Hop(bucket=1, round=0, send_to=1, payload=torch.zeros(4))
        with pytest.raises(KeyError):  # past the check: the lane to peer 1 is not open in this bare hub
            hub._plan(ok, {})
    finally:
        hub.close(PeerClosed("test over"))


def test_peer_closed_declares_why_it_may_hide_an_abort():
    exc = PeerClosed("x")
    assert exc.bye is False and exc.mid_hop is False


async def test_a_round_reported_before_the_peer_said_goodbye_is_complete():
    """The drop report and the peer's goodbye read in one pass: the goodbye fails the datagrams still queued
    (PeerClosed) before the sender runs again. The round was reported, so the send is complete; without a report
    the PeerClosed stands."""
    from types import SimpleNamespace

    from dgt.channels.slot import Slot
    from dgt.transport.outbound import Outbound
    from dgt.transport.records import SendTrack

    out = Outbound.__new__(Outbound)
    for reported in (True, False):
        job = SimpleNamespace(done=Slot())
        track = SendTrack(jobs=[job])
        if reported:
            track.report.set("info")
        job.done.fail(PeerClosed("rank 1 closed its endpoint"))
        if reported:
            await out._jobs_until_report(track)
            assert await track.report.wait() == "info"
        else:
            with pytest.raises(PeerClosed, match="closed its endpoint"):
                await out._jobs_until_report(track)
