"""Stream exchanges (part of :class:`dgt.transport.endpoint.Endpoint`): an ordered sequence of
:class:`~dgt.transport.streams.Hop` run on the stream lanes off the trio loop, guarded against a peer that took the
round path for the same call (dgt.transport.stream_watch), ended by a session abort, and explained by the peer's own
failure or ABORT when its lane fails; the hops' CPU-gate readings are fed to the gate here, on the trio thread.
"""

from __future__ import annotations

import sys

import trio

from dgt.errors import PeerClosed, one_error
from dgt.protocol.cpu_gate import CpuGate
from dgt.transport.inbound import Inbound
from dgt.transport.links import Links
from dgt.transport.session import Session
from dgt.transport.streams import Hop, HopResult, StreamHub

if sys.version_info < (3, 11):  # Python 3.10: the backport trio itself depends on (a builtin from 3.11)
    from exceptiongroup import BaseExceptionGroup


class Exchanges:
    """The order of stream exchanges (tickets, held by the hub) and the exchanges themselves."""

    def __init__(self, session: Session, links: Links, inbound: Inbound, hub: StreamHub,
                 cpu_gate: CpuGate | None) -> None:
        self.session = session
        self.cfg = session.cfg
        self.receiver = session.receiver
        self.bulk = session.bulk
        self.links = links
        self.inbound = inbound
        self.hub = hub
        self.cpu_gate = cpu_gate

    def reserve(self) -> int:
        """A place in the order of stream exchanges for an :meth:`run` started later (its ``ticket``)."""
        return self.hub.reserve()

    def forfeit(self, ticket: int) -> None:
        """Give back a place from :meth:`reserve` whose exchange will never run (later ones go on)."""
        self.hub.forfeit(ticket)

    @one_error
    async def run(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]:
        """Run ``hops`` (see :class:`~dgt.transport.streams.Hop`) in order on stream lanes, off the trio loop: the
        lossless path of a collective whose every rank knows the same sequence of messages (a ring all-reduce).
        Exchanges run one at a time, in the order they were called, which must be the same on every rank.
        ``timeout``: the longest a hop may make no progress (default: peer_timeout). ``family``: the bucket bits
        that name a message's family; a session-link message from a hop's peer in the same family and round means
        that peer took the round path for this call (RankMismatch on every rank, see dgt.transport.stream_watch).
        ``ticket``: a place in that order reserved earlier with :meth:`reserve`, given back here however
        the call ends."""
        started = False
        try:
            self.session.check_open()
            if self.links.abort is not None:
                raise self.links.abort.with_traceback(None)
        except BaseException:
            if ticket is not None:
                self.hub.forfeit(ticket)
            raise
        entries, scope = self.links.stream_watch.watch(hops, family), None
        try:  # (i22) the peer's message may be in already
            key = self.links.stream_watch.first_expected([*self.inbound.results, *self.bulk.open_keys(),
                                                     *self.receiver.open_rounds(), *self.links.on_link])
            if key is not None:
                raise self.links.stream_conflict(key)
            with trio.CancelScope() as scope:  # an abort cancels it (a lane dial to a peer that gave up, too)
                self.links.abort_scopes.add(scope)
                try:
                    started = True  # streams.exchange owns the ticket from here, however it ends
                    results = await self.hub.exchange(hops, timeout or self.cfg.timeouts.peer, ticket)
                    self._feed_cpu_gate(results)
                    return results
                except (PeerClosed, BaseExceptionGroup) as exc:
                    # a peer that aborted may hang up on a lane before its ABORT is read; both neighbours' lanes
                    # failing at once come as a group of PeerClosed (trio's MultiError), which must wait for it too
                    if not _all_peer_closed(exc):
                        raise
                    peers = {p for h in hops for p in (h.send_to, h.recv_from) if p is not None}
                    mismatch = await self.links.aborted(min(1.0, self.cfg.timeouts.peer), dead=peers)
                    if mismatch is None:
                        gone = self.links.failure_of(peers)
                        if gone is not None:  # it names the rank that went away; the lane's error does not
                            raise gone.with_traceback(None) from exc
                        raise
                    raise mismatch.with_traceback(None) from exc
            raise self.links.abort.with_traceback(None)
        finally:
            if ticket is not None and not started:
                self.hub.forfeit(ticket)
            if scope is not None:
                self.links.abort_scopes.discard(scope)
            self.links.stream_watch.unwatch(entries)

    def _feed_cpu_gate(self, results: list[HopResult]) -> None:
        """The CPU gate's readings the hops' worker thread measured and returned (on the trio thread, which owns
        the gate: docs/architecture.md, Threads)."""
        if self.cpu_gate is not None:
            for r in results:
                if r.cpu_wait is not None:
                    self.cpu_gate.observe(*r.cpu_wait)



def _all_peer_closed(exc: BaseException) -> bool:
    """Whether ``exc`` is a PeerClosed, or an exception group made only of PeerClosed."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_all_peer_closed(e) for e in exc.exceptions)
    return isinstance(exc, PeerClosed)
