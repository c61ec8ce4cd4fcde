"""A registered link's life (part of :class:`dgt.transport.endpoint.Endpoint`): its reader and the dispatch of
what it reads, control messages, liveness, a peer's failure, and the session abort (a peer's ABORT, or the
stream-watch conflict of issue 22) with the stream exchanges it ends.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np
import trio

from dgt import wire
from dgt.channels.framing import KEEP
from dgt.errors import (
    PeerClosed,
    PeerTimeout,
    ProtocolError,
    RankMismatch,
    one_error,
    open_nursery,
    path_mismatch,
    shape_mismatch,
)
from dgt.protocol.events import Event
from dgt.transport import control
from dgt.transport.records import Link
from dgt.transport.session import EndpointState
from dgt.transport.streams import Hop, HopResult
from dgt.wire import Flags, FrameType

if sys.version_info < (3, 11):  # Python 3.10: the backport trio itself depends on (a builtin from 3.11)
    from exceptiongroup import BaseExceptionGroup


SETTLE = 0.2
"""Seconds :meth:`LinkMixin.aborted` still waits for an ABORT once the peer it explains is known dead."""


RefusalKey = tuple[str, int, int]  # (round family: "ring", "ps", "gossip"; bucket id; round number)
KEPT_REFUSALS = 1024
"""Refusal notices (and this rank's own refused rounds) kept for calls not entered yet; older ones are dropped."""


class Refusals:
    """Refusals of one call's input (issue 45), scoped to the call by its (family, bucket, round), so that a notice
    never fails another call: the round each (family, bucket) entered last here, the rounds this rank refused itself,
    and peers' notices for rounds this rank has not entered yet."""

    def __init__(self) -> None:
        self.entered: dict[tuple[str, int], int] = {}
        self.mine: OrderedDict[RefusalKey, None] = OrderedDict()
        self.pending: OrderedDict[RefusalKey, str] = OrderedDict()

    @staticmethod
    def keep(d: OrderedDict[RefusalKey, Any], key: RefusalKey, value: Any) -> None:
        d[key] = value
        while len(d) > KEPT_REFUSALS:
            d.popitem(last=False)


class LinkMixin(EndpointState):
    """Per-link tasks, failure and abort; the stream exchange that an abort cancels."""

    _refusals: Refusals  # (set by the Endpoint) refusals of one call's input, control REFUSED

    async def _run_link(self, link: Link) -> None:
        try:
            with trio.CancelScope() as scope:
                link.scope = scope
                if link.error is not None:
                    return
                async with open_nursery() as n:
                    n.start_soon(self._link_task, link, self._reader, link)
                    n.start_soon(self._link_task, link, link.writer.run)
        finally:
            self._fail_peer(link.rank, PeerClosed(f"rank {self.rank}: the connection to rank {link.rank} ended"))

    async def _link_task(self, link: Link, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run a connection task; its failure (connection lost, protocol violation) fails that peer only."""
        try:
            await fn(*args)
        except Exception as exc:
            self._fail_peer(link.rank, exc)

    def _fail_peer(self, rank: int, error: BaseException) -> None:
        """The peer is gone (or broke the protocol): fail everything pending on it, free its rounds."""
        link = self._links.get(rank)
        if link is None or link.error is not None:
            return
        if isinstance(error, PeerClosed) and link.said_bye:
            error = PeerClosed(f"rank {rank} closed its endpoint")
            error.bye = True  # a peer whose collective failed closes its group: its reason (ABORT) may come late
        link.error = error
        self._changed()
        link.writer.fail(error)
        link.chan.close()
        if link.scope is not None:
            link.scope.cancel()
        self.scheduler.drop_peer(rank, error)
        for key in [k for k in self._recv_waiters if k[0] == rank]:
            self._recv_waiters.pop(key).fail(error)
        for key in [k for k in self._sending if k[0] == rank]:
            track = self._sending[key]
            track.report.fail(error)
            if track.detached:
                del self._sending[key]
        self._handle(self.receiver.abort(rank, trio.current_time()))
        self.bulk.abort(rank)
        # after a goodbye the peer's stream lane stays readable (what it sent before it left may still be unread);
        # any other failure shuts it down at once, waking a hop blocked on it
        self.streams.abort(rank, error, graceful=link.said_bye)
        self._link_ready.pop(rank, None)

    def _fail_pending(self, rank: int, error: BaseException) -> None:
        """Fail what waits on ``rank`` (receives, drop reports, stream hops) without closing its session link."""
        for key in [k for k in self._recv_waiters if k[0] == rank]:
            self._recv_waiters.pop(key).fail(error)
        for key in [k for k in self._sending if k[0] == rank]:
            self._sending[key].report.fail(error)
        self.streams.abort(rank, error)

    def _link(self, peer: int) -> Link:
        self._check_open()
        if self._abort is not None:
            raise self._abort.with_traceback(None)
        link = self._links.get(peer)
        if link is None:
            raise ValueError(f"rank {self.rank} is not connected to rank {peer}; call connect() first")
        if link.error is not None:
            raise link.error.with_traceback(None)
        return link

    def _frame_routes(self, rank: int) -> tuple[Callable[[np.void], memoryview | object | None],
                                                Callable[[np.ndarray], np.ndarray]]:
        """For the reader of ``rank``'s link: where a frame's payload lands (``place``: the receiver's buffer for
        a data frame, the bulk receiver's for a BULK one, None to drop it, KEEP to read it into a frame), and which
        staged frames go to the receiver in one vectorised pass (``batchable``)."""
        recv = self.receiver

        def place(h: np.void) -> memoryview | object | None:
            if int(h["rank"]) != rank:
                return None  # a peer may only speak for itself
            ftype = int(h["ftype"])
            if ftype == FrameType.DATA and not int(h["flags"]) & Flags.FRAGMENT:
                return recv.payload_target(h, 0)
            if ftype == FrameType.BULK:
                return self.bulk.target(rank, h, trio.current_time())
            return KEEP

        def batchable(h: np.ndarray) -> np.ndarray:
            mask: np.ndarray = ((h["ftype"] == FrameType.DATA) & ((h["flags"] & Flags.FRAGMENT) == 0)
                                & (h["rank"] == rank))
            return mask

        return place, batchable

    async def _reader(self, link: Link) -> None:
        recv = self.receiver
        rank = link.rank
        place, batchable = self._frame_routes(rank)
        budget = 0  # bytes handled since the last checkpoint: yield every so often, not per frame
        events: Sequence[Event] | None
        waits = link.chan.waits
        while True:
            staged = link.reader.take_staged(batchable)
            if staged is not None:  # many small data frames already in memory: one vectorised pass
                batch = wire.Batch(staged.headers, staged.payload_pos, np.zeros(len(staged), np.int8), staged.buf)
                events = recv.receive_runs(batch, 0, trio.current_time())
                if events:
                    self._handle(events)
                budget += int(staged.headers["length"].astype(np.int64).sum())
                self.deadlines.poke()  # cheap (one look at the open rounds); the next read may block
                continue
            if budget >= 1 << 20:
                budget = 0
                self.deadlines.poke()
                if link.chan.waits == waits:  # no read waited since the last time: yield to the other tasks
                    await trio.lowlevel.checkpoint()
                waits = link.chan.waits
            rf = await link.reader.next(place)
            now = trio.current_time()
            h = rf.header
            ftype = int(h["ftype"])
            events = []
            if int(h["rank"]) != rank:
                recv.counters.reject("rank-mismatch")
            elif ftype == FrameType.DATA and not int(h["flags"]) & Flags.FRAGMENT:
                events = recv.commit(h, 0, now, rf.landed)
            elif ftype == FrameType.BULK:
                events = self.bulk.landed(rank, h, now)
            elif ftype == FrameType.CONTROL:
                self._on_control(link, rf.frame)
            else:
                if ftype == FrameType.ROUND_BEGIN:
                    key = (rank, int(h["bucket"]), int(h["round"]))
                    self._opened[key] = now
                    if self._stream_watch.expected(key):  # (i22) the peer runs on the round path what we run on
                        self._stream_conflict(key)  # stream lanes (a lossy ring's held round never closes itself)
                    while len(self._opened) > 4 * self.cfg.limits.max_open_rounds * max(1, len(self._links)):
                        self._opened.popitem(last=False)
                assert rf.frame is not None  # place() keeps every frame that reaches this branch
                events = recv.receive_bytes(rf.frame, 0, now)  # a refused ROUND_BEGIN: RoundRefused (_handle)
            if events:
                self._handle(events)
            budget += 4096 + int(h["length"])
            # every path reaches this check (a CONTROL frame right behind a ROUND_END must not skip it): a round whose
            # deadline just started would otherwise wait for the next frame that happens to leave the buffer empty
            if rf.idle:  # (no checkpoint of its own: the next read finds nothing and waits, which yields)
                budget = 0
                self.deadlines.poke()

    def _on_control(self, link: Link, frame: memoryview | None) -> None:
        try:
            _, msg = control.parse(frame, self.cfg.limits)
        except ProtocolError:
            self.receiver.counters.reject("control")
            return
        if msg["op"] == control.BYE:
            link.said_bye = True  # the connection's end follows; pending operations fail as "closed its endpoint"
        elif msg["op"] == control.ABORT:
            # the peer's collective failed for a reason every rank must see: whatever this rank waits for (on any
            # peer) fails with it now; the session is over, the group must be rebuilt (or the process restarted)
            why = str(msg.get("why", ""))[:2000]
            error = RankMismatch(f"rank {link.rank} aborted: {why}", remote=link.rank)
            if self._abort is None:
                # relayed once, with the same reason, to this rank's other peers: ranks not connected to the one that
                # saw it (a central server's workers) would otherwise wait for a round that never comes
                for ln in self._links.values():
                    if ln is not link and ln.error is None:
                        ln.writer.push([control.control(self.token, self.rank, control.ABORT, why=why)])
            self._set_abort(error)
            self._fail_peer(link.rank, error)
            # the other peers' links stay up (closing them would race the ABORT they get from the same sender and
            # show them a closed connection instead of its reason); what waits on them fails now, and new
            # operations raise the mismatch (_link)
            for rank in list(self._links):
                self._fail_pending(rank, error)
        elif msg["op"] == control.LOST:
            # the peer's collective failed because a peer of its own failed (one this rank may not be connected to,
            # a central server's other worker): whatever this rank waits for fails now, not at round_timeout
            why = str(msg.get("why", ""))[:2000]
            lost = PeerClosed(f"rank {self.rank}: rank {link.rank}'s collective failed: {why}")
            self._lost.setdefault(link.rank, lost)
            self._changed()
            for rank in list(self._links):
                self._fail_pending(rank, lost)
        elif msg["op"] == control.REFUSED:
            self._on_refused(link.rank, msg)
        elif msg["op"] == control.ON_LINK:  # (i22) a peer that only receives on the round path says so
            key = (link.rank, int(msg.get("bucket", -1)), int(msg.get("round", -1)))
            if self._stream_watch.expected(key):
                self._stream_conflict(key)
            else:  # this rank's exchange may not have started yet: it looks here when it does (bounded)
                self._on_link[key] = None
                while len(self._on_link) > 4 * self.cfg.limits.max_open_rounds * max(1, len(self._links)):
                    self._on_link.popitem(last=False)
        elif msg["op"] == control.STALE:
            key = (link.rank, int(msg.get("bucket", -1)), int(msg.get("round", -1)))
            track = self._sending.get(key)
            if track is not None and msg.get("why") == "mismatch":  # the receiver refused the round (issue 45)
                detail = str(msg.get("detail", ""))[:2000]
                track.report.fail(RankMismatch(shape_mismatch(key[2]), remote=link.rank, detail=detail))
                for job in track.jobs:
                    self.scheduler.cancel(job)
            elif track is not None:
                why = str(msg.get("why", "already closed"))
                hint = ": round keys must not be reused" if why == "already closed" else ""
                what = f"round {key[2]} of bucket {key[1]} was {why} at rank {link.rank}{hint}"
                track.report.fail(ProtocolError(what))
                for job in track.jobs:
                    self.scheduler.cancel(job)

    def _on_refused(self, peer: int, msg: dict[str, Any]) -> None:
        """A peer refused its input to one call (control REFUSED, issue 45). This rank inside that very call fails
        with RankMismatch now (and tells every rank, as for any mismatch); one that has not entered it yet fails
        when it does (:meth:`enter_round`); one that refused that call too, or is past it, ignores the notice (the
        common error of every rank passing the same bad input leaves the session usable)."""
        try:
            key = (str(msg.get("family", "")), int(msg.get("bucket", -1)), int(msg.get("round", -1)))
        except (TypeError, ValueError):
            self.receiver.counters.reject("control")
            return
        why = (f"rank {peer} refused its input to {key[0]} bucket {key[1]} round {key[2]}: "
               f"{str(msg.get('why', ''))[:2000]}")
        rf = self._refusals
        if key in rf.mine:
            return
        at = rf.entered.get(key[:2], -1)
        if at == key[2]:
            self._refused_call(RankMismatch(why))
        elif at < key[2]:
            rf.keep(rf.pending, key, why)

    def _refused_call(self, error: RankMismatch) -> None:
        """This rank's call cannot complete (a peer refused its input to it): fail what it waits for, as an ABORT
        does (the session is over, as after any mismatch)."""
        self._set_abort(error)
        for rank in list(self._links):
            self._fail_pending(rank, error)

    def enter_round(self, family: str, bucket: int, rnd: int) -> None:
        """This rank starts round ``rnd`` of ``family``/``bucket`` (:meth:`~dgt.collectives.Group.next_round`):
        :class:`RankMismatch` when a peer refused its input to this very call already (control REFUSED)."""
        rf = self._refusals
        rf.entered[(family, bucket)] = rnd
        why = rf.pending.pop((family, bucket, rnd), None)
        if why is not None:
            error = RankMismatch(why)
            self._refused_call(error)
            raise error

    def refuse_round(self, family: str, bucket: int, rnd: int, why: str, peers: Iterable[int]) -> None:
        """This rank refused its input to round ``rnd`` of ``family``/``bucket`` (InputRejected): tell ``peers``
        (queued, no waiting), so that ranks inside that call fail at once instead of waiting for this rank; a notice
        of the same call from a peer that refused it too is ignored from now on."""
        rf = self._refusals
        key = (family, bucket, rnd)
        rf.entered[(family, bucket)] = max(rnd, rf.entered.get((family, bucket), -1))
        rf.keep(rf.mine, key, None)
        rf.pending.pop(key, None)
        msg = control.control(self.token, self.rank, control.REFUSED, family=family, bucket=bucket, round=rnd,
                              why=why[:2000])
        for p in sorted(set(peers)):
            ln = self._links.get(p)
            if ln is not None and ln.error is None:
                ln.writer.push([msg], urgent=True)

    async def _liveness(self) -> None:
        """Ping idle links; declare a peer gone after peer_timeout without any byte from it."""
        c = self.cfg
        beat = c.timeouts.heartbeat or c.timeouts.peer / 4
        tick = min(beat, c.timeouts.peer / 10)
        while True:
            await trio.sleep(tick)
            now = trio.current_time()
            for link in list(self._links.values()):
                if link.error is not None:
                    continue
                silent = now - link.chan.last_rx
                if silent >= c.timeouts.peer - tick:
                    why = (f"rank {self.rank}: rank {link.rank} silent for {silent:.2f} s "
                           f"(timeout {c.timeouts.peer:g} s)")
                    self._fail_peer(link.rank, PeerTimeout(why))
                elif now - link.last_ping >= beat:
                    link.last_ping = now
                    link.writer.push([control.control(self.token, self.rank, control.PING)], urgent=True)

    async def aborted(self, within: float, dead: Iterable[int] | None = None) -> RankMismatch | None:
        """The mismatch a peer reported (control ABORT), waiting up to ``within`` s for one; None if none came.

        The wait is a grace for a peer that is alive and may have aborted (its ABORT trails its closed stream lanes by
        a moment); it ends as soon as nothing can explain the failure any more: one of ``dead`` (the peers whose
        failure is being explained) is known dead (its session link ended without a goodbye or an ABORT: EOF,
        reset, silence; a dead peer sends no ABORT, and the link's order put any it sent before its end), or no
        live link is left to bring an ABORT (then after a short settle, :data:`SETTLE`)."""
        watch = set(dead) if dead is not None else set()
        with trio.move_on_after(within):
            while self._abort is None:
                if watch & self._lost.keys():  # a peer reported its call failed on a dead peer: it settled already
                    break
                if any(self._dead(p) for p in watch) or not any(ln.error is None for ln in self._links.values()):
                    # nothing more comes from a dead peer; an ABORT another rank sent before this one died (a peer
                    # that exits on an ABORT closes with a reset, which can take the relayed copy with it) may still
                    # sit behind the reader tasks: a short settle, not the whole grace
                    with trio.move_on_after(SETTLE):
                        await self._aborted.wait()
                    break
                await self._link_change.wait()
        return self._abort

    def _dead(self, peer: int) -> bool:
        """Whether ``peer``'s session link ended without a goodbye or an ABORT (the peer died, or went silent), or
        the peer said its collective failed on a failed peer of its own (control LOST)."""
        return self.failure_of([peer]) is not None

    def failure_of(self, peers: Iterable[int]) -> BaseException | None:
        """The error that names why one of ``peers`` is gone: its session link's, when it ended without a goodbye
        or an ABORT (EOF, reset, silence), or the failure it reported (control LOST, naming the peer it lost);
        None when every one of them is alive (or left on purpose)."""
        for p in sorted(peers):
            if p in self._lost:
                return self._lost[p]
            link = self._links.get(p)
            err = None if link is None else link.error
            if err is not None and not isinstance(err, RankMismatch) and not getattr(err, "bye", False):
                return err
        return None

    def _changed(self) -> None:
        """Wake what waits in :meth:`aborted`: a link failed or the session aborted."""
        ev, self._link_change = self._link_change, trio.Event()
        ev.set()

    def abort_peers(self, why: str) -> None:
        """Tell every connected peer that this rank's collective failed for ``why`` (queued, no waiting): their
        pending operations on this rank fail with :class:`RankMismatch` carrying it, instead of waiting for a round
        that will never come."""
        for ln in self._links.values():
            if ln.error is None:
                ln.writer.push([control.control(self.token, self.rank, control.ABORT, why=why[:2000])])

    def call_failed(self, why: str) -> None:
        """Tell every live peer (once per endpoint, queued, no waiting) that this rank's collective failed because a
        peer failed (``why``: the error, naming that peer): what they wait for fails with PeerClosed at once. A peer
        not connected to the failed one (a central server's other workers) would otherwise wait for its round until
        ``round_timeout``."""
        if self._lost_sent:
            return
        self._lost_sent = True
        for ln in self._links.values():
            if ln.error is None:
                ln.writer.push([control.control(self.token, self.rank, control.LOST, why=why[:2000])], urgent=True)

    def announce_on_link(self, peer: int, bucket: int, round: int) -> None:
        """Tell ``peer`` (queued, no waiting) that this rank runs ``bucket``/``round`` on the session link. A rank
        whose first move in a call is to receive (a central parameter server) sends nothing its peers could compare
        otherwise: a peer that runs the same message family on stream lanes (its tensor took the other path) raises
        :class:`RankMismatch` on seeing this, and tells every rank, instead of waiting ``peer_timeout`` for a stream
        lane or a hop that will never come (issue 22). A peer on the round path ignores it."""
        link = self._links.get(peer)
        if link is not None and link.error is None:
            link.writer.push([control.control(self.token, self.rank, control.ON_LINK, bucket=bucket, round=round)])

    def _set_abort(self, error: RankMismatch) -> None:
        """The session's collectives failed with ``error`` (a peer's ABORT, or a mismatch seen here): remember the
        first, wake what waits for it, and end stream exchanges under way (a hop or a lane dial would otherwise
        wait for its own timeout)."""
        if self._abort is None:
            self._abort = error
            self._aborted.set()
            self._changed()
        for scope in self._exchange_scopes:
            scope.cancel()

    def _stream_conflict(self, key: tuple[int, int, int]) -> RankMismatch:
        """A session-link message arrived for what this rank exchanges on stream lanes (i22): fail this rank's
        pending operations and tell every peer, as a control ABORT would."""
        error = RankMismatch(path_mismatch(key[2]))
        self._set_abort(error)
        self.abort_peers(str(error))
        for rank in list(self._links):
            self._fail_pending(rank, error)
        return error

    def reserve_exchange(self) -> int:
        """A place in the order of stream exchanges for an :meth:`exchange` started later (its ``ticket``)."""
        return self.streams.reserve()

    def forfeit_exchange(self, ticket: int) -> None:
        """Give back a place from :meth:`reserve_exchange` whose exchange will never run (later ones go on)."""
        self.streams.forfeit(ticket)

    @one_error
    async def exchange(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]:
        """Run ``hops`` (see :class:`~dgt.transport.streams.Hop`) in order on stream lanes, off the trio loop: the
        lossless path of a collective whose every rank knows the same sequence of messages (a ring all-reduce).
        Exchanges run one at a time, in the order they were called, which must be the same on every rank.
        ``timeout``: the longest a hop may make no progress (default: peer_timeout). ``family``: the bucket bits
        that name a message's family; a session-link message from a hop's peer in the same family and round means
        that peer took the round path for this call (RankMismatch on every rank, see dgt.transport.stream_watch).
        ``ticket``: a place in that order reserved earlier with :meth:`reserve_exchange`, given back here however
        the call ends."""
        started = False
        try:
            self._check_open()
            if self._abort is not None:
                raise self._abort.with_traceback(None)
        except BaseException:
            if ticket is not None:
                self.streams.forfeit(ticket)
            raise
        entries, scope = self._stream_watch.watch(hops, family), None
        try:  # (i22) the peer's message may be in already
            key = self._stream_watch.first_expected([*self._results, *self.bulk.open_keys(),
                                                     *self.receiver.open_rounds(), *self._on_link])
            if key is not None:
                raise self._stream_conflict(key)
            with trio.CancelScope() as scope:  # an abort cancels it (a lane dial to a peer that gave up, too)
                self._exchange_scopes.add(scope)
                try:
                    started = True  # streams.exchange owns the ticket from here, however it ends
                    results = await self.streams.exchange(hops, timeout or self.cfg.timeouts.peer, ticket)
                    self._feed_cpu_gate(results)
                    return results
                except (PeerClosed, BaseExceptionGroup) as exc:
                    # a peer that aborted may hang up on a lane before its ABORT is read; both neighbours' lanes
                    # failing at once come as a group of PeerClosed (trio's MultiError), which must wait for it too
                    if not _all_peer_closed(exc):
                        raise
                    peers = {p for h in hops for p in (h.send_to, h.recv_from) if p is not None}
                    mismatch = await self.aborted(min(1.0, self.cfg.timeouts.peer), dead=peers)
                    if mismatch is None:
                        gone = self.failure_of(peers)
                        if gone is not None:  # it names the rank that went away; the lane's error does not
                            raise gone.with_traceback(None) from exc
                        raise
                    raise mismatch.with_traceback(None) from exc
            raise self._abort.with_traceback(None)
        finally:
            if ticket is not None and not started:
                self.streams.forfeit(ticket)
            if scope is not None:
                self._exchange_scopes.discard(scope)
            self._stream_watch.unwatch(entries)

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
