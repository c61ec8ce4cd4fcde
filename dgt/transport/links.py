"""The session links (part of :class:`dgt.transport.endpoint.Endpoint`): the registry of connected peers, each
link's tasks and the dispatch of its control messages, liveness, a peer's failure, and the session abort (a peer's
ABORT, a refused call, or the stream-watch conflict of issue 22) with what it cancels.

Parts that keep something per peer register as a :class:`PeerWatcher` (:meth:`Links.watch`): a failed peer fails
what they hold for it. Parts that answer a control message register a handler for it (:meth:`Links.on`).
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import trio

from dgt.channels.slot import Slot
from dgt.channels.sockopts import get_dscp, get_priority
from dgt.errors import PeerClosed, PeerTimeout, ProtocolError, RankMismatch, open_nursery, path_mismatch
from dgt.protocol.pacing import Pacer
from dgt.transport import control
from dgt.transport.records import Link
from dgt.transport.session import Key, Session
from dgt.transport.sockets import Sockets
from dgt.transport.stream_watch import StreamWatch
from dgt.transport.streams import StreamHub

SETTLE = 0.2
"""Seconds :meth:`Links.aborted` still waits for an ABORT once the peer it explains is known dead."""
LAST_WORDS = 0.5
"""Seconds a link whose write failed (the peer closed or reset the connection) waits for its reader to read what
the peer sent before it went (its LOST, its goodbye: the kernel still holds them after a reset) and meet the end of
the stream itself; a reader that sees the end at once makes it no wait at all."""


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


class PeerWatcher(Protocol):
    """A part that holds something per peer (waiters, rounds on their way)."""

    def peer_failed(self, rank: int, error: BaseException, closed: bool) -> None:
        """Fail what waits on ``rank`` with ``error``; ``closed``: its session link is gone too (else only what
        waits fails, as after a peer's ABORT)."""
        ...


ControlHandler = Callable[[Link, dict[str, Any]], None]


class Links:
    """The peers' session links: ``table`` (rank -> :class:`Link`, filled by the handshake), ``ready`` (a slot per
    rank awaited by ``connect``), ``sources`` ((host, UDP port) -> rank, the datagram sources accepted), the abort
    state, the refusals of one call's input, and the messages awaited on stream lanes (``stream_watch``, ``on_link``:
    a peer on the round path for such a message is a mismatch, issue 22)."""

    def __init__(self, session: Session, sockets: Sockets, hub: StreamHub) -> None:
        self.session = session
        self.cfg = session.cfg
        self.rank = session.rank
        self.token = session.token
        self.receiver = session.receiver
        self.sockets = sockets
        self.hub = hub
        self.table: dict[int, Link] = {}
        self.ready: dict[int, Slot] = {}
        self.sources: dict[tuple[str, int], int] = {}
        self.abort: RankMismatch | None = None  # the mismatch a peer reported (control ABORT), if any
        self._aborted = trio.Event()
        self._change = trio.Event()  # set (and replaced) when a link fails or the session aborts
        self._lost_sent = False  # call_failed told the peers already
        self.lost: dict[int, PeerClosed] = {}  # peers that said their collective failed on a lost peer (LOST)
        self.refusals = Refusals()  # peers' and this rank's refusals of one call's input (control REFUSED)
        self.stream_watch = StreamWatch()  # messages awaited on stream lanes (i22: a peer on the round path)
        self.on_link: OrderedDict[Key, None] = OrderedDict()  # peers' ON_LINK notices (i22)
        self.abort_scopes: set[trio.CancelScope] = set()  # stream exchanges under way (an abort cancels them)
        self._watchers: list[PeerWatcher] = []
        self._handlers: dict[str, ControlHandler] = {}

    # -- wiring ---------------------------------------------------------------------------------------------------
    def watch(self, watcher: PeerWatcher) -> None:
        """``watcher`` hears of every failed peer (in the order the watchers registered)."""
        self._watchers.append(watcher)

    def on(self, op: str, handler: ControlHandler) -> None:
        """``handler(link, msg)`` answers control message ``op`` (those this part does not answer itself)."""
        self._handlers[op] = handler

    # -- the registry ---------------------------------------------------------------------------------------------
    @property
    def peers(self) -> list[int]:
        """Ranks with a live connection."""
        return [r for r, ln in self.table.items() if ln.error is None]

    def live(self, peer: int) -> Link | None:
        """The link to ``peer`` if it is up, else None (no error: a caller that only queues a notice)."""
        link = self.table.get(peer)
        return link if link is not None and link.error is None else None

    def link(self, peer: int) -> Link:
        """The link a new operation to ``peer`` uses: the endpoint's, the session's or the link's error if there is
        none."""
        self.session.check_open()
        if self.abort is not None:
            raise self.abort.with_traceback(None)
        link = self.table.get(peer)
        if link is None:
            raise ValueError(f"rank {self.rank} is not connected to rank {peer}; call connect() first")
        if link.error is not None:
            raise link.error.with_traceback(None)
        return link

    def link_error(self, rank: int) -> BaseException | None:
        """Why the session link to ``rank`` is unusable (None: it is live)."""
        link = self.table.get(rank)
        if link is None:
            return self.session.fatal or PeerClosed(f"rank {self.rank} is not connected to rank {rank}")
        return link.error

    def round_closed(self, peer: int, bucket: int, round: int) -> bool:
        """Whether a round to ``peer`` needs no more datagrams (its report came, or the peer is gone)."""
        link = self.table.get(peer)
        return link is None or link.error is not None or link.sender.closed(bucket, round)

    def pacer_of(self, peer: int) -> Pacer | None:
        link = self.table.get(peer)
        return None if link is None else link.pacer

    def link_sockets(self) -> list[socket.socket]:
        """The TCP socket of every session link open now (not the stream lanes'), e.g. to pace them."""
        return [ln.chan.sock for ln in self.table.values() if not ln.chan.closed]

    def socket_info(self) -> dict[str, Any]:
        """DSCP and SO_PRIORITY read back from the kernel for every socket (listener, connections, stream lanes,
        UDP lanes, the hop socket)."""
        own = self.sockets.info()
        info: dict[str, Any] = {"listener": own.pop("listener")}
        info["tcp"] = {
            r: {"dscp": get_dscp(ln.chan.sock), "priority": get_priority(ln.chan.sock)}
            for r, ln in self.table.items()
            if not ln.chan.closed
        }
        info["stream"] = {
            ln.peer: {"dscp": get_dscp(ln.tx.sock), "priority": get_priority(ln.tx.sock),
                      "rx_dscp": get_dscp(ln.rx.sock), "rx_priority": get_priority(ln.rx.sock)}  # fmt: skip
            for ln in self.hub.lanes.values()
            if not (ln.tx.closed or ln.rx.closed)
        }
        info.update(own)
        return info

    # -- a link's life --------------------------------------------------------------------------------------------
    async def run(self, link: Link, reader: Callable[[Link], Awaitable[object]]) -> None:
        """The link's tasks: ``reader(link)`` and its writer; when either ends, the peer has failed."""
        try:
            with trio.CancelScope() as scope:
                link.scope = scope
                if link.error is not None:
                    return
                async with open_nursery() as n:
                    n.start_soon(self._link_task, link, reader, link)
                    n.start_soon(self._writer_task, link)
        finally:
            self.fail_peer(link.rank, PeerClosed(f"rank {self.rank}: the connection to rank {link.rank} "
                                                 f"ended"))

    async def _link_task(self, link: Link, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run a connection task; its failure (connection lost, protocol violation) fails that peer only."""
        try:
            await fn(*args)
        except Exception as exc:
            self.fail_peer(link.rank, exc)

    async def _writer_task(self, link: Link) -> None:
        """The link's writer. A write that fails because the peer closed (a reset after its LOST and goodbye: a
        rank that exits with unread bytes from us) does not fail the link before the reader has read what the peer
        sent first (:data:`LAST_WORDS`): else that notice, which names the rank that really failed, is lost and this
        rank names the one that merely left (issue 45's "name the dead rank on every rank")."""
        try:
            await link.writer.run()
        except PeerClosed as exc:
            await self._until(lambda: link.error is not None, min(LAST_WORDS, self.cfg.timeouts.peer))
            self.fail_peer(link.rank, exc)
        except Exception as exc:
            self.fail_peer(link.rank, exc)

    def fail_peer(self, rank: int, error: BaseException) -> None:
        """The peer is gone (or broke the protocol): fail everything pending on it, free its rounds."""
        link = self.table.get(rank)
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
        for w in self._watchers:
            w.peer_failed(rank, error, closed=True)
        # after a goodbye the peer's stream lane stays readable (what it sent before it left may still be unread);
        # any other failure shuts it down at once, waking a hop blocked on it
        self.hub.abort(rank, error, graceful=link.said_bye)
        self.ready.pop(rank, None)

    def fail_pending(self, rank: int, error: BaseException) -> None:
        """Fail what waits on ``rank`` (receives, drop reports, stream hops) without closing its session link."""
        for w in self._watchers:
            w.peer_failed(rank, error, closed=False)
        self.hub.abort(rank, error)

    def _fail_all_pending(self, error: BaseException) -> None:
        for rank in list(self.table):
            self.fail_pending(rank, error)

    def close(self, error: BaseException) -> None:
        """The endpoint is closing: every link fails with ``error``, and every ``connect`` waiting for one."""
        for rank in list(self.table):
            self.fail_peer(rank, error)
        for slot in list(self.ready.values()):
            slot.fail(error)

    async def liveness(self) -> None:
        """Ping idle links; declare a peer gone after peer_timeout without any byte from it."""
        c, me = self.cfg, self.rank
        beat = c.timeouts.heartbeat or c.timeouts.peer / 4
        tick = min(beat, c.timeouts.peer / 10)
        while True:
            await trio.sleep(tick)
            now = trio.current_time()
            for link in list(self.table.values()):
                if link.error is not None:
                    continue
                silent = now - link.chan.last_rx
                if silent >= c.timeouts.peer - tick:
                    why = f"rank {me}: rank {link.rank} silent for {silent:.2f} s (timeout {c.timeouts.peer:g} s)"
                    self.fail_peer(link.rank, PeerTimeout(why))
                elif now - link.last_ping >= beat:
                    link.last_ping = now
                    link.writer.push([control.control(self.token, me, control.PING)], urgent=True)

    # -- control messages -----------------------------------------------------------------------------------------
    def on_control(self, link: Link, frame: memoryview | None) -> None:
        """A CONTROL frame read on ``link``: BYE, ABORT, LOST, REFUSED and ON_LINK here, others by their handler."""
        try:
            _, msg = control.parse(frame, self.cfg.limits)
        except ProtocolError:
            self.receiver.counters.reject("control")
            return
        op = msg["op"]
        if op == control.BYE:
            link.said_bye = True  # the connection's end follows; pending operations fail as "closed its endpoint"
        elif op == control.ABORT:
            self._on_abort(link, msg)
        elif op == control.LOST:
            # the peer's collective failed because a peer of its own failed (one this rank may not be connected to,
            # a central server's other worker): whatever this rank waits for fails now, not at round_timeout
            why = str(msg.get("why", ""))[:2000]
            lost = PeerClosed(f"rank {self.rank}: rank {link.rank}'s collective failed: {why}")
            self.lost.setdefault(link.rank, lost)
            self._changed()
            self._fail_all_pending(lost)
        elif op == control.REFUSED:
            self._on_refused(link.rank, msg)
        elif op == control.ON_LINK:  # (i22) a peer that only receives on the round path says so
            key = (link.rank, int(msg.get("bucket", -1)), int(msg.get("round", -1)))
            if self.stream_watch.expected(key):
                self.stream_conflict(key)
            else:  # this rank's exchange may not have started yet: it looks here when it does (bounded)
                self.on_link[key] = None
                while len(self.on_link) > self.session.bound(len(self.table)):
                    self.on_link.popitem(last=False)
        elif op in self._handlers:
            self._handlers[op](link, msg)

    def _on_abort(self, link: Link, msg: dict[str, Any]) -> None:
        """The peer's collective failed for a reason every rank must see: whatever this rank waits for (on any peer)
        fails with it now; the session is over, the group must be rebuilt (or the process restarted)."""
        why = str(msg.get("why", ""))[:2000]
        error = RankMismatch(f"rank {link.rank} aborted: {why}", remote=link.rank)
        if self.abort is None:
            # relayed once, with the same reason, to this rank's other peers: ranks not connected to the one that
            # saw it (a central server's workers) would otherwise wait for a round that never comes
            for ln in self.table.values():
                if ln is not link and ln.error is None:
                    ln.writer.push([control.control(self.token, self.rank, control.ABORT, why=why)])
        self.set_abort(error)
        self.fail_peer(link.rank, error)
        # the other peers' links stay up (closing them would race the ABORT they get from the same sender and show
        # them a closed connection instead of its reason); what waits on them fails now, and new operations raise
        # the mismatch (link)
        self._fail_all_pending(error)

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
        rf = self.refusals
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
        self.set_abort(error)
        self._fail_all_pending(error)

    def enter_round(self, family: str, bucket: int, rnd: int) -> None:
        """This rank starts round ``rnd`` of ``family``/``bucket`` (:meth:`~dgt.collectives.Group.next_round`):
        :class:`RankMismatch` when a peer refused its input to this very call already (control REFUSED)."""
        rf = self.refusals
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
        rf = self.refusals
        key = (family, bucket, rnd)
        rf.entered[(family, bucket)] = max(rnd, rf.entered.get((family, bucket), -1))
        rf.keep(rf.mine, key, None)
        rf.pending.pop(key, None)
        msg = control.control(self.token, self.rank, control.REFUSED, family=family, bucket=bucket,
                              round=rnd, why=why[:2000])
        for p in sorted(set(peers)):
            ln = self.live(p)
            if ln is not None:
                ln.writer.push([msg], urgent=True)

    # -- the session abort ----------------------------------------------------------------------------------------
    async def aborted(self, within: float, dead: Iterable[int] | None = None) -> RankMismatch | None:
        """The mismatch a peer reported (control ABORT), waiting up to ``within`` s for one; None if none came.

        The wait is a grace for a peer that is alive and may have aborted (its ABORT trails its closed stream lanes by
        a moment); it ends as soon as nothing can explain the failure any more: one of ``dead`` (the peers whose
        failure is being explained) is known dead (its session link ended without a goodbye or an ABORT: EOF,
        reset, silence; a dead peer sends no ABORT, and the link's order put any it sent before its end), or no
        live link is left to bring an ABORT (then after a short settle, :data:`SETTLE`)."""
        watch = set(dead) if dead is not None else set()
        with trio.move_on_after(within):
            while self.abort is None:
                if watch & self.lost.keys():  # a peer reported its call failed on a dead peer: it settled already
                    break
                if any(self.failure_of([p]) is not None for p in watch) or not self.peers:
                    # nothing more comes from a dead peer; an ABORT another rank sent before this one died (a peer
                    # that exits on an ABORT closes with a reset, which can take the relayed copy with it) may still
                    # sit behind the reader tasks: a short settle, not the whole grace
                    with trio.move_on_after(SETTLE):
                        await self._aborted.wait()
                    break
                await self._change.wait()
        return self.abort

    async def failure(self, peers: Iterable[int], within: float = 0.0) -> BaseException | None:
        """:meth:`failure_of` once one of ``peers`` has ended (its session link failed, or it said goodbye) or
        reported (LOST), waiting up to ``within`` s for that. A call that failed on a closed connection may know it
        before the session link's reader does: a write that met a reset fails its call at once, while the peer's
        report (which names the rank that really failed) still waits to be read (:data:`LAST_WORDS`)."""
        watch = list(peers)
        if within > 0:
            await self._until(lambda: any(p in self.lost or self._ended(p) for p in watch), within)
        return self.failure_of(watch)

    def _ended(self, peer: int) -> bool:
        link = self.table.get(peer)
        return link is None or link.error is not None

    async def _until(self, done: Callable[[], bool], within: float) -> None:
        """Wait until ``done()`` holds, looking again at every change of the links (:meth:`_changed`), at most
        ``within`` s."""
        with trio.move_on_after(within):
            while not done():
                await self._change.wait()

    def failure_of(self, peers: Iterable[int]) -> BaseException | None:
        """The error that names why one of ``peers`` is gone: its session link's, when it ended without a goodbye
        or an ABORT (EOF, reset, silence), or the failure it reported (control LOST, naming the peer it lost);
        None when every one of them is alive (or left on purpose). A peer's report comes first: a peer that left
        after it reported (its link ended with a reset, not always after its goodbye) did not fail first."""
        peers = sorted(peers)
        for p in peers:
            if p in self.lost:
                return self.lost[p]
        for p in peers:
            link = self.table.get(p)
            err = None if link is None else link.error
            if err is not None and not isinstance(err, RankMismatch) and not getattr(err, "bye", False):
                return err
        return None

    def _changed(self) -> None:
        """Wake what waits in :meth:`aborted`: a link failed or the session aborted."""
        ev, self._change = self._change, trio.Event()
        ev.set()

    def _tell_all(self, op: str, urgent: bool = False, **fields: object) -> None:
        msg = control.control(self.token, self.rank, op, **fields)
        for ln in self.table.values():
            if ln.error is None:
                ln.writer.push([msg], urgent=urgent)

    def abort_peers(self, why: str) -> None:
        """Tell every connected peer that this rank's collective failed for ``why`` (queued, no waiting): their
        pending operations on this rank fail with :class:`RankMismatch` carrying it, instead of waiting for a round
        that will never come."""
        self._tell_all(control.ABORT, why=why[:2000])

    def call_failed(self, why: str) -> None:
        """Tell every live peer (once per endpoint, queued, no waiting) that this rank's collective failed because a
        peer failed (``why``: the error, naming that peer): what they wait for fails with PeerClosed at once. A peer
        not connected to the failed one (a central server's other workers) would otherwise wait for its round until
        ``round_timeout``."""
        if self._lost_sent:
            return
        self._lost_sent = True
        self._tell_all(control.LOST, urgent=True, why=why[:2000])

    def announce_on_link(self, peer: int, bucket: int, round: int) -> None:
        """Tell ``peer`` (queued, no waiting) that this rank runs ``bucket``/``round`` on the session link. A rank
        whose first move in a call is to receive (a central parameter server) sends nothing its peers could compare
        otherwise: a peer that runs the same message family on stream lanes (its tensor took the other path) raises
        :class:`RankMismatch` on seeing this, and tells every rank, instead of waiting ``peer_timeout`` for a stream
        lane or a hop that will never come (issue 22). A peer on the round path ignores it."""
        link = self.live(peer)
        if link is not None:
            link.writer.push([control.control(self.token, self.rank, control.ON_LINK, bucket=bucket,
                                              round=round)])

    def set_abort(self, error: RankMismatch) -> None:
        """The session's collectives failed with ``error`` (a peer's ABORT, or a mismatch seen here): remember the
        first, wake what waits for it, and end stream exchanges under way (a hop or a lane dial would otherwise
        wait for its own timeout)."""
        if self.abort is None:
            self.abort = error
            self._aborted.set()
            self._changed()
        for scope in self.abort_scopes:
            scope.cancel()

    def stream_conflict(self, key: Key) -> RankMismatch:
        """A session-link message arrived for what this rank exchanges on stream lanes (i22): fail this rank's
        pending operations and tell every peer, as a control ABORT would."""
        error = RankMismatch(path_mismatch(key[2]))
        self.set_abort(error)
        self.abort_peers(str(error))
        self._fail_all_pending(error)
        return error
