"""The endpoint: one rank's session with its peers over the DGT lanes.

It owns a TCP listener, one UDP socket per unreliable lane, one TCP connection per peer (lower rank dials), the
sans-IO receiver (shared by all peers) and one sans-IO sender per peer (error feedback is per destination). Tasks:
accept, one reader and one writer per connection, one ingress per UDP lane, the datagram scheduler, the deadline
timer and the liveness monitor. Every frame-level decision is made by dgt.protocol; this module moves bytes,
feeds ``trio.current_time()`` and routes the events.

:class:`Endpoint` is a small face (issue 44) over parts that own their state, each built here with the parts it
needs and a :class:`~dgt.transport.session.Session` (rank, config, the sans-IO receivers, the counters), never the
endpoint: ``sockets`` (dgt.transport.sockets: the listener, the UDP lanes, the hop socket), ``links``
(dgt.transport.links: the link registry, control messages, liveness, failure, the session abort and the refusals),
``outbound`` (dgt.transport.outbound: the send APIs, the datagram scheduler, drop reports, pacing feedback),
``inbound`` (dgt.transport.inbound: the links' readers, UDP ingress, landing buffers, results, the receive APIs,
the deadline timer), ``exchanges`` (dgt.transport.exchange: stream exchanges), ``hop_rounds``
(dgt.transport.hop_round: the lossy ring hops' rounds) and ``handshake`` (dgt.transport.handshake: dialling,
accepting, registering links). The face starts the service tasks, reports stats, and offers the
:class:`~dgt.transport.contract.Transport` protocol by delegating to the part that owns each call.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

import torch
import trio

from dgt.channels.slot import Slot
from dgt.channels.tcp import TcpChannel
from dgt.channels.udp import merged
from dgt.errors import PeerClosed, RankMismatch, open_nursery
from dgt.layout import BucketLayout
from dgt.protocol.bulk import BulkReceiver
from dgt.protocol.cpu_gate import CpuGate
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.receiver import RoundReceiver
from dgt.transport import auth, control
from dgt.transport.config import PeerAddress, TransportConfig
from dgt.transport.exchange import Exchanges
from dgt.transport.handshake import Handshake
from dgt.transport.hop_round import HopRounds
from dgt.transport.inbound import Inbound
from dgt.transport.links import Links
from dgt.transport.lossy_hop import LossyHopResult, LossyHopSpec, lossy_hop
from dgt.transport.outbound import BYTES_BUCKET, Outbound, PendingSend
from dgt.transport.records import Link, SendTrack
from dgt.transport.session import Session
from dgt.transport.sockets import Sockets
from dgt.transport.stats import LaneStats, RoundResult, SendStats, TransportStats
from dgt.transport.streams import Hop, HopResult, StreamHub

__all__ = ["BYTES_BUCKET", "Endpoint", "OpenBlock", "PendingSend", "Link", "SendTrack"]

T = TypeVar("T")

MOVED = {
    "send_bytes": ("outbound", "send_bytes"),
    "recv_bytes": ("inbound", "recv_bytes"),
    "pending_rounds": ("inbound", "pending_rounds"),
    "link_sockets": ("links", "link_sockets"),
    "socket_info": ("links", "socket_info"),
}
"""Endpoint methods that moved to the part owning them (issue 44): name -> (part, its method). ``ep.<name>`` still
works for one release, with a DeprecationWarning naming the new place (docs/api.md)."""


class OpenBlock(Generic[T]):
    """What :meth:`Endpoint.open` returns: an async context manager only. Awaiting it raises a TypeError saying
    how the endpoint is opened now (``await Endpoint.open(...)`` started a hidden system task before issue #24)."""

    def __init__(self, cm: AbstractAsyncContextManager[T]) -> None:
        self._cm = cm

    async def __aenter__(self) -> T:
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._cm.__aexit__(*exc)

    def __await__(self) -> Generator[Any, None, NoReturn]:
        raise TypeError("Endpoint.open(...) is an async context manager: write `async with Endpoint.open(...) as ep:` "
                        "(the endpoint closes when the block ends), or `ep = await Endpoint.start(..., nursery=n)` "
                        "to run it in a nursery of yours until `await ep.aclose()`")


class Endpoint:
    """A rank's DGT session. Open with ``async with Endpoint.open(...)`` (or :meth:`start` in a nursery of the
    caller's), join peers with :meth:`connect`, then send and receive rounds concurrently from any number of tasks;
    :meth:`aclose` says goodbye and releases every socket."""

    def __init__(self, rank: int, token: int, cfg: TransportConfig | None = None, host: str = "127.0.0.1") -> None:
        self.rank = int(rank)
        self.token = int(token)
        self.cfg = cfg or TransportConfig()
        self.host = host
        c = self.cfg
        key = auth.session_key(self.token, auth.user_secret(c.security.secret))  # proves membership (handshakes)
        mac = DatagramMac(key) if c.security.datagram_mac else None  # datagram MAC (issue 22), same key
        # the receivers' landing buffers are the inbound part's (it installs its allocator)
        self.receiver = RoundReceiver(self.token, self.rank, limits=c.limits, deadline=c.deadline_policy(), mac=mac)
        self.bulk = BulkReceiver(c.limits.max_open_rounds, self.receiver.max_open_bytes, lambda *_: None)
        self.session = Session(self.rank, self.token, c, self.receiver, self.bulk)
        self.sockets = Sockets(self.rank, host, c)
        # the lossy ring hops' CPU gate, fed on this (the trio) thread with the readings the hops' worker returns
        self.cpu_gate = CpuGate(c.congestion.cpu_gate) if c.congestion.cpu_gate else None
        # the hub dials stream lanes through the handshake and asks the links whether a peer's link is up; both are
        # built after it (they use it), so it reaches them through this face's wiring, the one place that knows
        # every part
        self.streams = StreamHub(self.rank, self.token, c.timeouts.connect or c.timeouts.peer, self._dial_stream,
                                 self._link_error, native=c.native_hops(), frame_bytes=c.limits.max_payload,
                                 hop_threads=c.hop_thread_count(), hop=self.sockets.hop,
                                 cpu_wait=self.cpu_gate is not None)
        self.links = Links(self.session, self.sockets, self.streams)
        self.outbound = Outbound(self.session, self.links, self.sockets.udp)
        self.inbound = Inbound(self.session, self.links, self.outbound, list(self.sockets.udp))
        self.exchanges = Exchanges(self.session, self.links, self.inbound, self.streams, self.cpu_gate)
        self.hop_rounds = HopRounds(self.session, self.links, self.inbound, self.outbound, self.streams,
                                    self.cpu_gate)
        self.handshake = Handshake(self.session, self.sockets, self.links, self.inbound, self.streams, key, mac)
        self._stop = trio.Event()
        self._stopped = trio.Event()

    async def _dial_stream(self, rank: int, direction: int) -> TcpChannel:
        return await self.handshake.dial_stream(rank, direction)

    def _link_error(self, rank: int) -> BaseException | None:
        return self.links.link_error(rank)

    @classmethod
    async def start(cls, rank: int, token: int, cfg: TransportConfig | None = None, host: str = "127.0.0.1", *,
                    nursery: trio.Nursery) -> Endpoint:
        """Bind the TCP listener and one UDP socket per unreliable lane (port 0) and start the service tasks in
        ``nursery``, which the caller owns (the thread bridge's owners: dgt.transport.bridge, ``Group.create``).
        The service lasts until :meth:`aclose` (or until the nursery is cancelled); an unexpected error in it fails
        every pending operation and is then raised in ``nursery``. :meth:`open` is this with a nursery of its own."""
        ep = cls(rank, token, cfg, host)
        await nursery.start(ep._service)
        return ep

    @classmethod
    def open(cls, rank: int, token: int, cfg: TransportConfig | None = None,
             host: str = "127.0.0.1") -> OpenBlock[Endpoint]:
        """``async with Endpoint.open(rank, token, cfg) as ep:`` the endpoint, its service tasks in a nursery of
        this block's own: leaving the block closes it (:meth:`aclose`) and no task of it outlives the block. An
        error in the service cancels the block and is raised from it (the error itself, not a group of it).
        Awaiting it instead (``await Endpoint.open(...)``, the API before issue #24) raises a TypeError that says
        what to write."""
        return OpenBlock(cls._serve(rank, token, cfg, host))

    @classmethod
    @asynccontextmanager
    async def _serve(cls, rank: int, token: int, cfg: TransportConfig | None,
                     host: str) -> AsyncIterator[Endpoint]:
        async with open_nursery() as nursery:
            ep = await cls.start(rank, token, cfg, host, nursery=nursery)
            try:
                yield ep
            finally:
                await ep.aclose()

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """``async with ep:`` on an endpoint from :meth:`start` closes it when the block ends."""
        await self.aclose()

    @property
    def address(self) -> PeerAddress:
        """Where peers reach this rank (what the rendezvous publishes)."""
        return self.sockets.address

    @property
    def peers(self) -> list[int]:
        """Ranks with a live connection."""
        return self.links.peers

    async def _service(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with open_nursery() as n:
                self.session.nursery = n
                n.start_soon(self._guard, self.handshake.accept_loop)
                for lane, chan in self.sockets.udp.items():
                    n.start_soon(self._guard, self.inbound.udp_ingress, lane, chan)
                n.start_soon(self._guard, self.outbound.scheduler.run)
                n.start_soon(self._guard, self.inbound.deadlines.run)
                n.start_soon(self._guard, self.links.liveness)
                task_status.started()
                await self._stop.wait()
                n.cancel_scope.cancel()
        finally:
            self._teardown(self.session.fatal or PeerClosed(f"rank {self.rank}: the endpoint was closed"))
            self._stopped.set()
        if self.session.fatal is not None:  # the teardown failed every pending operation with it: the owner's turn
            raise self.session.fatal

    async def _guard(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run a service task; an unexpected error ends the endpoint and fails every pending operation with it."""
        try:
            await fn(*args)
        except Exception as exc:
            if self.session.fatal is None and not self.session.closing:
                self.session.fatal = exc
            self._stop.set()

    async def aclose(self) -> None:
        """Say goodbye to every peer (after the frames already queued for it), then close all sockets. Pending
        operations fail with PeerClosed."""
        if self.session.closing:
            await self._stopped.wait()
            return
        self.session.closing = True
        links = [ln for ln in self.links.table.values() if ln.error is None]
        with trio.move_on_after(min(2.0, self.cfg.timeouts.peer)):
            slots = [Slot() for _ in links]
            for ln, s in zip(links, slots):
                ln.writer.push([control.control(self.token, self.rank, control.BYE)], slot=s)
            for s in slots:
                try:
                    await s.wait()
                except Exception:
                    pass
        self._stop.set()
        await self._stopped.wait()

    def _teardown(self, error: BaseException) -> None:
        self.session.closing = True
        self.links.close(error)
        self.inbound.close(error)
        self.outbound.close(error)
        self.streams.close(error)
        self.sockets.close()

    def stats(self) -> TransportStats:
        """A snapshot of the endpoint's counters (per lane both directions, rounds, losses, deadline waits)."""
        st = self.session.stats
        out, links = self.outbound, list(self.links.table.values())
        rc = self.receiver.counters
        gate = self.cpu_gate
        lanes = []
        l0 = self.cfg.lanes.specs[0]
        tcp = LaneStats(0, l0.name, l0.kind, l0.dscp, l0.so_priority)
        for link in self.links.table.values():
            tcp.tx_bytes += link.chan.tx_bytes
            tcp.tx_calls += link.chan.tx_calls
            tcp.tx_frames += link.writer.frames
            tcp.rx_bytes += link.chan.rx_bytes
            tcp.rx_calls += link.chan.rx_calls
            tcp.rx_frames += link.reader.frames
        for chan in self.streams.channels():
            tcp.tx_bytes += chan.tx_bytes
            tcp.tx_calls += chan.tx_calls
            tcp.rx_bytes += chan.rx_bytes
            tcp.rx_calls += chan.rx_calls
        lanes.append(tcp)
        for lane, ch in self.sockets.udp.items():
            spec, cc = self.cfg.lanes.specs[lane], ch.counters
            if lane == 1 and self.streams.hop is not None:  # the hop socket's datagrams are lane 1's too
                cc = merged(cc, self.streams.hop.counters)
            lanes.append(LaneStats(
                lane, spec.name, spec.kind, spec.dscp, spec.so_priority,
                tx_bytes=cc.tx_bytes, tx_frames=cc.tx_datagrams, tx_calls=cc.tx_calls, tx_gso_calls=cc.tx_gso_calls,
                tx_abandoned=out.tx_abandoned.get(lane, 0), tx_unsent_blocks=out.tx_unsent.get(lane, 0),
                tx_lost_blocks=out.tx_lost.get(lane, 0), tx_errors=cc.tx_errors, rx_bytes=cc.rx_bytes,
                rx_frames=cc.rx_datagrams, rx_calls=cc.rx_calls, rx_gro_reads=cc.rx_gro_reads,
                rx_dropped_hook=self.inbound.rx_dropped_hook.get(lane, 0), rx_unknown_source=cc.rx_unknown_source,
                rx_truncated=cc.rx_truncated, rx_kernel_drops=ch.kernel_drops(), gso=ch.gso, gro=ch.gro,
                rcvbuf=ch.rcvbuf, sndbuf=ch.sndbuf,
            ))  # fmt: skip
        for ls in lanes:
            blocks, nbytes = self.inbound.lane_delivered.get(ls.lane, (0, 0))
            ls.delivered_blocks, ls.delivered_bytes = blocks, nbytes
            ls.goodput = nbytes / st.receive_seconds if st.receive_seconds > 0 else 0.0
        return TransportStats(
            self.rank, lanes, st.rounds_sent, st.rounds_received, st.blocks_received, st.blocks_dropped,
            late_frames=rc.late, rejected=rc.rejected, reject_reasons=dict(rc.reasons), closed_by=dict(st.closed_by),
            deadline_wait_total=st.deadline_wait_total, deadline_wait_max=st.deadline_wait_max,
            receive_seconds=st.receive_seconds, results_evicted=st.results_evicted, rounds_copied=st.rounds_copied,
            pace_rates={r: ln.pacer.rate for r, ln in self.links.table.items() if ln.pacer is not None},
            rounds_cpu_gated=0 if gate is None else gate.gated, cpu_wait=None if gate is None else gate.value,
            pace_shared_peers=sum(ln.pacer is not None and ln.pacer.shared is not None for ln in links),
        )  # fmt: skip

    # -- the Transport protocol (dgt.transport.contract): each call is the owning part's ------------------------------
    async def connect(self, peers: Mapping[int, PeerAddress | dict[str, object]], timeout: float | None = None) -> None:
        """Connect to ``peers`` (rank -> address). Both sides of a pair call it; the lower rank dials, the higher
        accepts, so all-to-all or any subset connects without deadlock. PeerTimeout if a peer does not show up
        within ``timeout`` (default: connect_timeout, else peer_timeout). (:meth:`Handshake.connect`)"""
        await self.handshake.connect(peers, timeout)

    async def send_round(self, peer: int, bucket: int, round: int, flat: torch.Tensor,
                         layout: BucketLayout | None = None, cls: torch.Tensor | int = 0,
                         order: torch.Tensor | None = None, *, wait: bool = True, timeout: float | None = None,
                         op: int = 0) -> SendStats:
        """One round of ``bucket`` to ``peer`` (see :meth:`Outbound.send_round`)."""
        return await self.outbound.send_round(peer, bucket, round, flat, layout, cls, order, wait=wait,
                                              timeout=timeout, op=op)

    async def recv_round(self, peer: int, bucket: int, round: int, *, out: torch.Tensor | None = None,
                         timeout: float | None = None) -> RoundResult:
        """Round ``round`` of ``bucket`` from ``peer`` once it closed (see :meth:`Inbound.recv_round`)."""
        return await self.inbound.recv_round(peer, bucket, round, out=out, timeout=timeout)

    def post_send(self, peer: int, bucket: int, round: int, flat: torch.Tensor, op: int = 0) -> PendingSend:
        """A lossless round queued without waiting (see :meth:`Outbound.post_send`)."""
        return self.outbound.post_send(peer, bucket, round, flat, op)

    def post_recv(self, peer: int, bucket: int, round: int, out: torch.Tensor | None, *,
                  zero_lost: bool = True, hold: bool = False) -> None:
        """Where a future round lands (see :meth:`Inbound.post_recv`)."""
        self.inbound.post_recv(peer, bucket, round, out, zero_lost=zero_lost, hold=hold)

    async def exchange(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]:
        """Run ``hops`` in order on stream lanes (see :meth:`Exchanges.run`)."""
        return await self.exchanges.run(hops, timeout, family, ticket)

    def reserve_exchange(self) -> int:
        """A place in the order of stream exchanges for an :meth:`exchange` started later (its ``ticket``)."""
        return self.exchanges.reserve()

    def forfeit_exchange(self, ticket: int) -> None:
        """Give back a place from :meth:`reserve_exchange` whose exchange will never run (later ones go on)."""
        self.exchanges.forfeit(ticket)

    async def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        """Lossless send of a small tensor with its shape and dtype (e.g. a model broadcast)."""
        await self.outbound.send_tensor(peer, tensor, tag)

    async def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        """The next tensor from ``peer`` with ``tag`` (:meth:`send_tensor`)."""
        return await self.inbound.recv_tensor(peer, tag, timeout)

    def abort_peers(self, why: str) -> None:
        """Tell every connected peer that this rank's collective failed for ``why`` (:meth:`Links.abort_peers`)."""
        self.links.abort_peers(why)

    async def failure(self, peers: Iterable[int], within: float = 0.0) -> BaseException | None:
        """The error naming why one of ``peers`` is gone, None if all are alive, once one of them has ended or
        reported (waiting up to ``within`` s for that: :meth:`Links.failure`)."""
        return await self.links.failure(peers, within)

    def call_failed(self, why: str) -> None:
        """Tell every live peer that this rank's collective failed on a failed peer (:meth:`Links.call_failed`)."""
        self.links.call_failed(why)

    def enter_round(self, family: str, bucket: int, rnd: int) -> None:
        """This rank starts round ``rnd`` of ``family``/``bucket`` (:meth:`Links.enter_round`)."""
        self.links.enter_round(family, bucket, rnd)

    def refuse_round(self, family: str, bucket: int, rnd: int, why: str, peers: Iterable[int]) -> None:
        """This rank refused its input to that round: tell ``peers`` (:meth:`Links.refuse_round`)."""
        self.links.refuse_round(family, bucket, rnd, why, peers)

    async def aborted(self, within: float, dead: Iterable[int] | None = None) -> RankMismatch | None:
        """The mismatch a peer reported, waiting up to ``within`` s for one (:meth:`Links.aborted`)."""
        return await self.links.aborted(within, dead)

    def announce_on_link(self, peer: int, bucket: int, round: int) -> None:
        """Tell ``peer`` that this rank runs ``bucket``/``round`` on the session link (:meth:`Links.announce_on_link`,
        issue 22)."""
        self.links.announce_on_link(peer, bucket, round)

    def hop_ready(self, peer: int) -> bool:
        """Whether a lossy ring hop to and from ``peer`` can take the hop socket (:meth:`HopRounds.ready`)."""
        return self.hop_rounds.ready(peer)

    async def lossy_hop(self, spec: LossyHopSpec) -> LossyHopResult:
        """One reduce-scatter hop of a lossy ring, whole (:func:`dgt.transport.lossy_hop.lossy_hop`, on this
        endpoint's hop-round part)."""
        return await lossy_hop(self, spec)

    if not TYPE_CHECKING:  # hidden from mypy: typed code must use the new places

        def __getattr__(self, name: str) -> Any:
            """The methods that moved to a part (:data:`MOVED`), for one release, with a DeprecationWarning."""
            if name in MOVED:
                part, attr = MOVED[name]
                warnings.warn(f"Endpoint.{name} is deprecated: use Endpoint.{part}.{attr} (it goes away in the "
                              f"release after 0.1)", DeprecationWarning, stacklevel=2)
                return getattr(getattr(self, part), attr)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
