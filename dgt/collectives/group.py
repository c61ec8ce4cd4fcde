"""A group of ranks joined by DGT endpoints: rendezvous through the c10d store, then connections opened lazily, only
to the peers a collective talks to (ring: two neighbours; parameter server: workers and server; gossip: the mixing
matrix's neighbours)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from dgt.collectives.rendezvous import Rendezvous
from dgt.errors import PeerClosed, open_nursery
from dgt.transport.contract import Transport

if TYPE_CHECKING:
    import trio
    from torch._C._distributed_c10d import Store

    from dgt.transport.config import TransportConfig

CONNECT = ("lazy", "all")


class Group:
    """What every collective runs on: this rank's transport (the :class:`~dgt.transport.contract.Transport`
    protocol, an :class:`~dgt.transport.Endpoint` in practice), the world size, per-bucket round counters, and the
    links collectives ask for (:meth:`links`). Build one with :meth:`open` or :meth:`create`; code that checks
    construction without traffic passes a :class:`dgt.harness.offline.OfflineTransport`."""

    def __init__(self, endpoint: Transport, rank: int, world: int, token: int, store: Store | None = None,
                 rendezvous: Rendezvous | None = None, timeout: float = 60.0) -> None:
        if endpoint is None:
            raise TypeError("Group needs a transport (an Endpoint: Group.open / Group.create), not None; to check "
                            "construction without traffic pass dgt.harness.offline.OfflineTransport()")
        self.endpoint = endpoint
        self.store = store  # rank 0 may host it: it must live as long as the group, or late ranks lose it
        self.rank = rank
        self.world = world
        self.token = token
        self.rendezvous = rendezvous
        self.timeout = timeout
        self._rounds: dict[tuple[str, int], int] = {}
        self._linked: set[int] = set()  # peers connected through links()
        self._seq = 0  # calls of links() so far; they pass in call order (see links)
        self._passed = 0
        self._gave_up: set[int] = set()
        self._turns: dict[int, trio.Event] = {}
        self._connecting: dict[int, trio.Event] = {}  # peer -> trio.Event set when the call connecting it is done

    @classmethod
    async def create(
        cls,
        rank: int,
        world: int,
        *,
        store: Store | None = None,
        config: TransportConfig | None = None,
        host: str = "127.0.0.1",
        timeout: float = 60.0,
        prefix: str = "dgt",
        connect: str = "lazy",
        nursery: trio.Nursery,
    ) -> Group:
        """Meet through the c10d store (``store`` or env://) and open this rank's endpoint. ``connect="lazy"``
        (default): no connection yet; each collective connects to the peers it needs on its first call.
        ``connect="all"``: connect to every peer now (for code that drives the endpoint to arbitrary peers).
        ``nursery``: the caller's, where the endpoint's service tasks run until :meth:`aclose` (the thread bridge
        passes its own, see :meth:`~dgt.transport.Endpoint.start`); :meth:`open` brings one of its own."""
        import trio

        from dgt.transport import Endpoint, TransportConfig

        if connect not in CONNECT:
            raise ValueError(f"connect must be one of {CONNECT}, not {connect!r}")
        rv = Rendezvous(rank, world, store, timeout, prefix)
        # a thread of its own (not trio's shared pool of 40): many ranks in one process all block in the store's wait
        token = await trio.to_thread.run_sync(rv.token, limiter=trio.CapacityLimiter(1))
        cfg = config or TransportConfig()
        # every other rank may dial at once (a sharded PS server: W-1 workers), each with up to 3 connections (session
        # link, two stream lanes): the cap on unauthenticated handshakes must not refuse the group's own members
        need = 3 * (world - 1)
        if cfg.security.max_pending_handshakes < need:
            cfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, max_pending_handshakes=need))
        ep = await Endpoint.start(rank, token, cfg, host=host, nursery=nursery)
        try:
            await trio.to_thread.run_sync(rv.exchange, dataclasses.asdict(ep.address), limiter=trio.CapacityLimiter(1))
            group = cls(ep, rank, world, token, rv.store, rv, timeout)
            if connect == "all":
                await group.links(range(world))
        except BaseException:
            await ep.aclose()
            raise
        return group

    @classmethod
    @asynccontextmanager
    async def open(cls, rank: int, world: int, *, store: Store | None = None, config: TransportConfig | None = None,
                   host: str = "127.0.0.1", timeout: float = 60.0, prefix: str = "dgt",
                   connect: str = "lazy") -> AsyncIterator[Group]:
        """``async with Group.open(rank, world, ...) as group:`` :meth:`create` (the same arguments but ``nursery``)
        in a nursery of this block's own: leaving the block closes the group and no task of its endpoint outlives
        the block; an error in the endpoint's service cancels the block and is raised from it."""

        async with open_nursery() as nursery:
            group = await cls.create(rank, world, store=store, config=config, host=host, timeout=timeout,
                                     prefix=prefix, connect=connect, nursery=nursery)
            try:
                yield group
            finally:
                await group.aclose()

    def next_round(self, collective: str, bucket: int) -> int:
        """Round numbers advance per (collective, bucket); every rank calls collectives in the same order."""
        key = (collective, bucket)
        rnd = self._rounds[key] = self._rounds.get(key, -1) + 1
        self.endpoint.enter_round(collective, bucket, rnd)  # a peer that refused this call already fails it
        return rnd

    def round_of(self, collective: str, bucket: int) -> int:
        """The last round :meth:`next_round` gave out for (collective, bucket); -1 before the first."""
        return self._rounds.get((collective, bucket), -1)

    def skip_round(self, collective: str, bucket: int) -> int:
        """Use up the next round of (collective, bucket) without entering it: this rank refused the call's input
        before any traffic (its peers took that round for the call), so its next call has the next round, as theirs."""
        key = (collective, bucket)
        rnd = self._rounds[key] = self._rounds.get(key, -1) + 1
        return rnd

    @property
    def connected(self) -> list[int]:
        """Peers this rank has a live connection to (opened by it or by the peer)."""
        return sorted(self.endpoint.peers)

    def publish_abort(self, why: str) -> None:
        """Tell ranks not connected to this one why the session's collectives failed (via the store)."""
        if self.rendezvous is not None:
            self.rendezvous.publish_abort(why)

    def published_abort(self) -> str | None:
        """A mismatch another rank published (None: none, or no rendezvous)."""
        if self.rendezvous is None:
            return None
        try:
            return self.rendezvous.published_abort()
        except Exception:  # the store is gone too (its host died): the caller's own error stands
            return None

    async def links(self, peers: Iterable[int]) -> None:
        """Make sure this rank is connected to ``peers`` (both sides of a pair ask; the lower rank dials). Once they
        are connected this returns without yielding, so a collective that takes a stream ticket right after it
        keeps its call order; calls that had to wait for a connection leave here in the order they came."""
        want = {int(p) for p in peers if p != self.rank}
        seq = self._seq
        self._seq += 1
        if seq == self._passed and want <= self._linked and want.issubset(self.endpoint.peers):
            self._passed += 1
            return
        try:
            await self._connect(want)
            await self._turn(seq)
        finally:
            self._leave(seq)

    async def _connect(self, want: set[int]) -> None:
        """Connect to the peers of ``want`` not connected yet; a peer another call is connecting already is waited
        for, not dialled twice."""
        import trio

        from dgt.transport import PeerAddress

        live = set(self.endpoint.peers)
        gone = sorted((want & self._linked) - live)
        if gone:  # a link that was up and failed is not dialled again: waiting for a dead peer would cost `timeout`
            raise PeerClosed(f"rank {self.rank}: the connection to rank(s) {gone} was lost (a failed peer is not "
                             f"reconnected: close the group and build a new one)")
        missing = sorted(r for r in want - live if r not in self._connecting)
        others = [self._connecting[r] for r in sorted(want - live) if r in self._connecting]
        if missing:
            if self.rendezvous is None:
                raise ValueError(f"rank {self.rank} is not connected to ranks {missing} and has no rendezvous")
            done = trio.Event()
            for r in missing:
                self._connecting[r] = done
            try:
                dial = [r for r in missing if r > self.rank]  # the higher rank waits for the lower to dial it
                addrs = await trio.to_thread.run_sync(self.rendezvous.addresses, dial,
                                                      limiter=trio.CapacityLimiter(1)) if dial else {}
                # a lower rank's address is never dialled (its hello carries it): a placeholder with the lane count
                # one port per UDP lane
                nowhere = PeerAddress("0.0.0.0", 0, (0,) * (len(self.endpoint.cfg.lanes.specs) - 1))
                wanted = {r: PeerAddress.from_dict(addrs[r]) if r in addrs else nowhere for r in missing}
                await self.endpoint.connect(wanted, timeout=self.timeout)
            finally:
                for r in missing:
                    self._connecting.pop(r, None)
                done.set()
        for ev in others:
            await ev.wait()
        lost = sorted(want - set(self.endpoint.peers))
        if lost:  # another call's connection attempt failed (its caller got the reason)
            raise ConnectionError(f"rank {self.rank} could not connect to ranks {lost}")
        self._linked |= want

    async def _turn(self, seq: int) -> None:
        import trio

        while self._passed < seq:
            ev = self._turns.setdefault(seq, trio.Event())
            await ev.wait()

    def _leave(self, seq: int) -> None:
        self._gave_up.add(seq)
        while self._passed in self._gave_up:
            self._gave_up.discard(self._passed)
            self._passed += 1
        ev = self._turns.pop(self._passed, None)
        if ev is not None:
            ev.set()

    async def aclose(self) -> None:
        await self.endpoint.aclose()

