"""A round's drop report, then the peer's goodbye in the same scheduler batch: the send succeeded.

Seen under load in test_model_server (rank 0: ``PeerClosed: rank 2 closed its endpoint``): the receiver reported the
round and closed its endpoint; the report woke the sender's report watcher, and the goodbye failed the round's datagram
jobs before that watcher could cancel the wait on them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from dgt.channels.slot import Slot
from dgt.errors import PeerClosed, open_nursery
from dgt.transport.outbound import Outbound
from dgt.transport.records import SendTrack


def _track() -> tuple[SendTrack, SimpleNamespace]:
    track = SendTrack()
    job = SimpleNamespace(done=Slot())
    track.jobs.append(job)
    return track, job


def test_a_report_then_a_goodbye_in_one_batch_is_a_finished_send():
    async def main() -> None:
        track, job = _track()

        async def peer() -> None:
            await trio.sleep(0.01)
            track.report.set("report")  # the round's drop report is in ...
            job.done.fail(PeerClosed("rank 2 closed its endpoint"))  # ... and the goodbye, before any checkpoint

        async with trio.open_nursery() as n:
            n.start_soon(peer)
            await Outbound._jobs_until_report(Outbound, track)
        assert await track.report.wait() == "report"

    trio.run(main)


def test_a_goodbye_without_a_report_still_fails_the_send():
    async def main() -> None:
        track, job = _track()

        async def peer() -> None:
            await trio.sleep(0.01)
            err = PeerClosed("rank 2 closed its endpoint")
            job.done.fail(err)
            track.report.fail(err)

        with pytest.raises(PeerClosed, match="closed its endpoint"):
            async with open_nursery() as n:  # dgt's: the error itself on every trio, as a collective raises it
                n.start_soon(peer)
                await Outbound._jobs_until_report(Outbound, track)

    trio.run(main)
