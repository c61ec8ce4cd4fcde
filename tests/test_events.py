"""The receivers' one event vocabulary (dgt.protocol.events): frozen classes, every receive method answers a list of
them, and a ROUND_BEGIN that is not opened answers why (RoundRefused) instead of leaving it to the counters."""

import dataclasses
import typing

import pytest
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol import events
from dgt.protocol.bulk import BulkReceiver, bulk_frames
from dgt.protocol.events import ALREADY_CLOSED, BulkDone, DropReportIn, RoundDone, RoundRefused
from dgt.protocol.receiver import RoundReceiver
from dgt.protocol.sender import RoundSender

TOKEN = 0xC0FFEE


def _begin(rnd: int, bucket: int = 0, numel: int = 4096, p: float = 1.0) -> tuple[bytes, list[bytes]]:
    """The ROUND_BEGIN frame of a lossless round from rank 3, and the rest of its reliable frames."""
    layout = BucketLayout([numel])
    sender = RoundSender(TOKEN, rank=3)
    flat = sender.prepare(bucket, torch.randn(numel))
    cls = torch.zeros(layout.nblocks, dtype=torch.int8)
    plan = sender.plan(bucket, rnd, flat, layout, cls, torch.arange(layout.nblocks))
    frames = [h + bytes(pl) for h, pl in plan.reliable]
    return frames[0], frames[1:]


def test_every_event_is_frozen_and_in_the_union():
    assert set(typing.get_args(events.Event)) == {RoundDone, DropReportIn, BulkDone, RoundRefused}
    ev = RoundRefused((3, 0, 1), "too-many-rounds")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.reason = "x"  # type: ignore[misc]
    assert ev.why == "refused (too-many-rounds)"
    assert RoundRefused((3, 0, 1), ALREADY_CLOSED).why == "already closed"


def test_a_round_beyond_the_open_round_limit_is_refused_with_its_key():
    rx = RoundReceiver(TOKEN, limits=wire.Limits(max_open_rounds=1))
    first, _ = _begin(0)
    assert rx.receive_bytes(first, 0, 0.0) == []
    assert rx.is_open((3, 0, 0))
    second, _ = _begin(0, bucket=1)
    assert rx.receive_bytes(second, 0, 0.0) == [RoundRefused((3, 1, 0), "too-many-rounds")]
    assert not rx.is_open((3, 1, 0)) and rx.counters.reasons["too-many-rounds"] == 1


def test_a_round_over_the_memory_budget_is_refused():
    rx = RoundReceiver(TOKEN, max_open_bytes=1000)
    begin, _ = _begin(0, numel=4096)
    assert rx.receive_bytes(begin, 0, 0.0) == [RoundRefused((3, 0, 0), "memory-budget")]


def test_a_reused_round_key_is_refused_as_already_closed():
    rx = RoundReceiver(TOKEN)
    begin, rest = _begin(7)
    evs = rx.receive_bytes(begin, 0, 0.0)
    for f in rest:
        evs += rx.receive_bytes(f, 0, 0.0)
    (done,) = evs
    assert isinstance(done, RoundDone) and done.key == (3, 0, 7)
    assert rx.is_closed((3, 0, 7)) and not rx.is_open((3, 0, 7))
    again, _ = _begin(7)
    assert rx.receive_bytes(again, 0, 1.0) == [RoundRefused((3, 0, 7), ALREADY_CLOSED)]


def test_a_malformed_round_begin_is_refused_with_the_wire_error():
    rx = RoundReceiver(TOKEN)
    bad = wire.encode_frame(wire.FrameType.ROUND_BEGIN, b"\0" * 8, token=TOKEN, rank=3, round=2, bucket=5)
    (ev,) = rx.receive_bytes(bad, 0, 0.0)
    assert isinstance(ev, RoundRefused) and ev.key == (3, 5, 2) and "truncated" in ev.reason


def test_a_repeated_round_begin_of_an_open_round_is_no_refusal():
    rx = RoundReceiver(TOKEN)
    begin, _ = _begin(0)
    rx.receive_bytes(begin, 0, 0.0)
    assert rx.receive_bytes(begin, 0, 0.0) == []


def test_bulk_landed_answers_events():
    rx = BulkReceiver(4, 1 << 20, lambda *a: None)
    frames = bulk_frames(TOKEN, 3, 1, 0, torch.arange(3000, dtype=torch.float32), 4096)
    out = []
    for hdr, payload in frames:
        h = wire.decode_header(hdr, token=TOKEN)
        rx.target(3, h, 0.0)[:] = payload
        assert rx.is_open((3, 1, 0))
        out.append(rx.landed(3, h, 0.5))
    assert out[:-1] == [[] for _ in frames[:-1]]
    (done,) = out[-1]
    assert isinstance(done, BulkDone) and done.key == (3, 1, 0) and not rx.is_open((3, 1, 0))
    assert torch.equal(done.data, torch.arange(3000, dtype=torch.float32))
