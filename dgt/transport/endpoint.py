"""The endpoint: one rank's session with its peers over the DGT lanes.

It owns a TCP listener, one UDP socket per unreliable lane, one TCP connection per peer (lower rank dials), the
sans-IO receiver (shared by all peers) and one sans-IO sender per peer (error feedback is per destination). Tasks:
accept, one reader and one writer per connection, one ingress per UDP lane, the datagram scheduler, the deadline
timer and the liveness monitor. Every frame-level decision is made by dgt.protocol; this module moves bytes,
feeds ``trio.current_time()`` and routes the events.

:class:`Endpoint` is the face: it owns the sockets and the shared state, starts the service tasks and reports stats;
its behaviour is composed from mixins by ownership (issue #24): dgt.transport.handshake (dialling, accepting, the
link registry), dgt.transport.links (each link's reader and control dispatch, liveness, failure, the session abort
and the stream exchange it ends), dgt.transport.inbound (UDP ingress, landing buffers, results, the receive APIs)
and dgt.transport.outbound (the send APIs, drop reports, pacing feedback).
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, NoReturn, TypeVar

import numpy as np
import torch
import trio

from dgt.channels.lanes import LaneSpec
from dgt.channels.ports import bind_in_range
from dgt.channels.slot import Slot
from dgt.channels.sockopts import get_dscp, get_priority
from dgt.channels.tcp import TcpListener
from dgt.channels.udp import UdpChannel, merged
from dgt.channels.udp_scheduler import DatagramScheduler
from dgt.errors import PeerClosed, RankMismatch, open_nursery
from dgt.protocol.bulk import BulkReceiver
from dgt.protocol.cpu_gate import CpuGate
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.receiver import RoundReceiver
from dgt.transport import auth, control
from dgt.transport.config import PeerAddress, TransportConfig
from dgt.transport.deadline_timer import DeadlineTimer
from dgt.transport.handshake import HandshakeMixin
from dgt.transport.hop_round import HopRoundMixin
from dgt.transport.inbound import InboundMixin
from dgt.transport.links import LinkMixin, Refusals
from dgt.transport.outbound import BYTES_BUCKET, PendingSend
from dgt.transport.records import Link, SendTrack
from dgt.transport.stats import LaneStats, PendingRounds, RoundResult, TransportStats
from dgt.transport.stream_watch import StreamWatch
from dgt.transport.streams import StreamHub

__all__ = ["BYTES_BUCKET", "Endpoint", "OpenBlock", "PendingSend", "Link", "SendTrack"]

T = TypeVar("T")


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


class Endpoint(HandshakeMixin, LinkMixin, InboundMixin, HopRoundMixin):
    """A rank's DGT session. Open with ``async with Endpoint.open(...)`` (or :meth:`start` in a nursery of the
    caller's), join peers with :meth:`connect`, then send and receive rounds concurrently from any number of tasks;
    :meth:`aclose` says goodbye and releases every socket."""

    def __init__(self, rank: int, token: int, cfg: TransportConfig | None = None, host: str = "127.0.0.1") -> None:
        self.rank = int(rank)
        self.token = int(token)
        self.cfg = cfg or TransportConfig()
        self.host = host
        c = self.cfg
        self.receiver = RoundReceiver(
            self.token, self.rank, limits=c.limits, deadline=c.deadline_policy(), allocator=self._allocate
        )
        hop = self._bind_sockets(host)  # lossy ring hops' datagrams (dgt.channels.hop_datagrams); trio never reads it
        self._links: dict[int, Link] = {}
        self._link_ready: dict[int, Slot] = {}
        self._sources: dict[tuple[str, int], int] = {}
        self._recv_waiters: dict[tuple[int, int, int], Slot] = {}
        self._results: OrderedDict[tuple[int, int, int], RoundResult] = OrderedDict()
        self.bulk = BulkReceiver(c.limits.max_open_rounds, self.receiver.max_open_bytes, self._allocate)
        self._out: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()  # landing buffers, see post_recv
        self._opened: OrderedDict[tuple[int, int, int], float] = OrderedDict()
        self._sending: dict[tuple[int, int, int], SendTrack] = {}
        self._bytes_tx: dict[tuple[int, int], int] = {}
        self._bytes_rx: dict[tuple[int, int], int] = {}
        self._drop_rng = np.random.default_rng(c.faults.drop_seed) if c.faults.drop_fraction > 0 else None
        self._rx_dropped_hook: dict[int, int] = dict.fromkeys(self.udp, 0)
        self._tx_abandoned: dict[int, int] = dict.fromkeys(self.udp, 0)
        self._tx_unsent: dict[int, int] = dict.fromkeys(self.udp, 0)  # blocks the send budget kept back
        self._tx_lost: dict[int, int] = dict.fromkeys(self.udp, 0)  # blocks sent that the peers reported missing
        self._stats = TransportStats(self.rank, [])
        self._lane_delivered: dict[int, list[int]] = {}
        self.scheduler = DatagramScheduler(self.udp, self._round_closed, self._pacer_of)
        self.deadlines = DeadlineTimer(self.receiver, self._handle)
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._closing = False
        self._fatal: BaseException | None = None
        # proves membership (handshakes)
        self._key = auth.session_key(self.token, auth.user_secret(c.security.secret))
        self._mac = DatagramMac(self._key) if c.security.datagram_mac else None  # datagram MAC (issue 22), same key
        self.receiver.mac = self._mac
        self._handshakes = 0  # accepted connections whose handshake is under way (capped)
        self._abort: RankMismatch | None = None  # the mismatch a peer reported (control ABORT), if any
        self._aborted = trio.Event()
        self._link_change = trio.Event()
        self._lost_sent = False  # call_failed told the peers already
        self._lost: dict[int, PeerClosed] = {}  # peers that said their collective failed on a lost peer (LOST)
        self._stream_watch = StreamWatch()  # messages awaited on stream lanes (i22: a peer on the round path)
        self._on_link: OrderedDict[tuple[int, int, int], None] = OrderedDict()  # peers' ON_LINK notices (i22)
        self._exchange_scopes: set[trio.CancelScope] = set()  # stream exchanges under way (an abort cancels them)
        # the lossy ring hops' CPU gate, fed on this (the trio) thread with the readings the hops' worker returns
        self.cpu_gate = CpuGate(c.congestion.cpu_gate) if c.congestion.cpu_gate else None
        self._refusals = Refusals()  # peers' and this rank's refusals of one call's input (control REFUSED)
        self.streams = StreamHub(self.rank, self.token, c.timeouts.connect or c.timeouts.peer, self._dial_stream,
                                 self._link_error, native=c.native_hops(), frame_bytes=c.limits.max_payload,
                                 hop_threads=c.hop_thread_count(), hop=hop,
                                 cpu_wait=self.cpu_gate is not None)

    def _bind_sockets(self, host: str) -> UdpChannel | None:
        """The TCP listener and one UDP socket per unreliable lane (``listener``, ``udp``), each on a port of the
        configured range; returns the hop socket (None: stream hops off, no UDP lane, or no port left for it)."""
        c = self.cfg
        self.listener = bind_in_range(lambda p: TcpListener(host, c.lanes.specs[0], port=p), c.lanes.port_range,
                                      "TCP listener")
        self.udp = {}

        def udp_lane(spec: LaneSpec) -> Callable[[int], UdpChannel]:
            s = c.sockets
            return lambda p: UdpChannel(host, spec, gso=s.gso, gro=s.gro, rcvbuf=s.udp_rcvbuf, sndbuf=s.udp_sndbuf,
                                        max_segments=s.gso_segments, batch_bytes=s.udp_batch_bytes, port=p)

        hop: UdpChannel | None = None
        try:
            for lane in range(1, len(c.lanes.specs)):
                self.udp[lane] = bind_in_range(udp_lane(c.lanes.specs[lane]), c.lanes.port_range, f"UDP lane {lane}")
            if self.udp and c.hops.mode != "off":
                try:
                    hop = bind_in_range(udp_lane(c.lanes.specs[1]), c.lanes.port_range, "the hop socket")
                except OSError:  # no port left in the range: lossy hops run their rounds on the session link
                    hop = None
        except BaseException:
            self._close_sockets()
            raise
        return hop

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
        hop = self.streams.hop
        return PeerAddress(self.host, self.listener.port, tuple(ch.port for ch in self.udp.values()), self.rank,
                           0 if hop is None else hop.port)

    @property
    def peers(self) -> list[int]:
        """Ranks with a live connection."""
        return [r for r, ln in self._links.items() if ln.error is None]

    async def _service(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with open_nursery() as n:
                self._nursery = n
                n.start_soon(self._guard, self._accept_loop)
                for lane, chan in self.udp.items():
                    n.start_soon(self._guard, self._udp_ingress, lane, chan)
                n.start_soon(self._guard, self.scheduler.run)
                n.start_soon(self._guard, self.deadlines.run)
                n.start_soon(self._guard, self._liveness)
                task_status.started()
                await self._stop.wait()
                n.cancel_scope.cancel()
        finally:
            self._teardown(self._fatal or PeerClosed(f"rank {self.rank}: the endpoint was closed"))
            self._stopped.set()
        if self._fatal is not None:  # after the teardown failed every pending operation with it: the owner's turn
            raise self._fatal

    def _spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Start ``fn(*args)`` among the endpoint's service tasks (a link's reader, an accepted handshake)."""
        if self._nursery is None:
            raise PeerClosed(f"rank {self.rank}: the endpoint is not running")
        self._nursery.start_soon(fn, *args)

    async def _guard(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run a service task; an unexpected error ends the endpoint and fails every pending operation with it."""
        try:
            await fn(*args)
        except Exception as exc:
            if self._fatal is None and not self._closing:
                self._fatal = exc
            self._stop.set()

    async def aclose(self) -> None:
        """Say goodbye to every peer (after the frames already queued for it), then close all sockets. Pending
        operations fail with PeerClosed."""
        if self._closing:
            await self._stopped.wait()
            return
        self._closing = True
        links = [ln for ln in self._links.values() if ln.error is None]
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
        self._closing = True
        for rank in list(self._links):
            self._fail_peer(rank, error)
        for slot in list(self._link_ready.values()):
            slot.fail(error)
        for slot in list(self._recv_waiters.values()):
            slot.fail(error)
        for track in list(self._sending.values()):
            track.report.fail(error)
        self.scheduler.fail_all(error)
        self.streams.close(error)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.listener.close()
        for ch in self.udp.values():
            ch.close()

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise self._fatal.with_traceback(None)
        if self._closing:
            raise PeerClosed(f"rank {self.rank}: the endpoint is closed")

    def stats(self) -> TransportStats:
        """A snapshot of the endpoint's counters (per lane both directions, rounds, losses, deadline waits)."""
        st = self._stats
        rc = self.receiver.counters
        gate = self.cpu_gate
        lanes = []
        l0 = self.cfg.lanes.specs[0]
        tcp = LaneStats(0, l0.name, l0.kind, l0.dscp, l0.so_priority)
        for link in self._links.values():
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
        for lane, ch in self.udp.items():
            spec, cc = self.cfg.lanes.specs[lane], ch.counters
            if lane == 1 and self.streams.hop is not None:  # the hop socket's datagrams are lane 1's too
                cc = merged(cc, self.streams.hop.counters)
            lanes.append(LaneStats(
                lane, spec.name, spec.kind, spec.dscp, spec.so_priority,
                tx_bytes=cc.tx_bytes, tx_frames=cc.tx_datagrams, tx_calls=cc.tx_calls, tx_gso_calls=cc.tx_gso_calls,
                tx_abandoned=self._tx_abandoned.get(lane, 0), tx_unsent_blocks=self._tx_unsent.get(lane, 0),
                tx_lost_blocks=self._tx_lost.get(lane, 0), tx_errors=cc.tx_errors, rx_bytes=cc.rx_bytes,
                rx_frames=cc.rx_datagrams, rx_calls=cc.rx_calls, rx_gro_reads=cc.rx_gro_reads,
                rx_dropped_hook=self._rx_dropped_hook.get(lane, 0), rx_unknown_source=cc.rx_unknown_source,
                rx_truncated=cc.rx_truncated, rx_kernel_drops=ch.kernel_drops(), gso=ch.gso, gro=ch.gro,
                rcvbuf=ch.rcvbuf, sndbuf=ch.sndbuf,
            ))  # fmt: skip
        for ls in lanes:
            blocks, nbytes = self._lane_delivered.get(ls.lane, (0, 0))
            ls.delivered_blocks, ls.delivered_bytes = blocks, nbytes
            ls.goodput = nbytes / st.receive_seconds if st.receive_seconds > 0 else 0.0
        return TransportStats(
            self.rank, lanes, st.rounds_sent, st.rounds_received, st.blocks_received, st.blocks_dropped,
            late_frames=rc.late, rejected=rc.rejected, reject_reasons=dict(rc.reasons), closed_by=dict(st.closed_by),
            deadline_wait_total=st.deadline_wait_total, deadline_wait_max=st.deadline_wait_max,
            receive_seconds=st.receive_seconds, results_evicted=st.results_evicted, rounds_copied=st.rounds_copied,
            pace_rates={r: ln.pacer.rate for r, ln in self._links.items() if ln.pacer is not None},
            rounds_cpu_gated=0 if gate is None else gate.gated, cpu_wait=None if gate is None else gate.value,
            pace_shared_peers=sum(ln.pacer is not None and ln.pacer.shared is not None for ln in self._links.values()),
        )  # fmt: skip

    def pending_rounds(self, limit: int = 20) -> PendingRounds:
        """What this endpoint waits for (see :class:`PendingRounds`), for the error message of a stuck call."""
        return PendingRounds(list(self._recv_waiters)[:limit], list(self._sending)[:limit],
                             list(self._results)[:limit], self.receiver.progress(limit))

    def link_sockets(self) -> list[socket.socket]:
        """The TCP socket of every session link open now (not the stream lanes'), e.g. to pace them."""
        return [ln.chan.sock for ln in self._links.values() if not ln.chan.closed]

    def socket_info(self) -> dict[str, Any]:
        """DSCP and SO_PRIORITY read back from the kernel for every socket (listener, connections, UDP lanes)."""
        info: dict[str, Any] = {
            "listener": {"dscp": get_dscp(self.listener.sock), "priority": get_priority(self.listener.sock)}}
        info["tcp"] = {
            r: {"dscp": get_dscp(ln.chan.sock), "priority": get_priority(ln.chan.sock)}
            for r, ln in self._links.items()
            if not ln.chan.closed
        }
        info["stream"] = {
            ln.peer: {"dscp": get_dscp(ln.tx.sock), "priority": get_priority(ln.tx.sock),
                      "rx_dscp": get_dscp(ln.rx.sock), "rx_priority": get_priority(ln.rx.sock)}  # fmt: skip
            for ln in self.streams.lanes.values()
            if not (ln.tx.closed or ln.rx.closed)
        }
        info["udp"] = {
            lane: {"dscp": get_dscp(ch.sock), "priority": get_priority(ch.sock), "gso": ch.gso, "gro": ch.gro,
                   "rcvbuf": ch.rcvbuf}  # fmt: skip
            for lane, ch in self.udp.items()
            if not ch.closed
        }
        hop = self.streams.hop
        if hop is not None and not hop.closed:  # the lossy ring hops' datagrams (marked like lane 1)
            info["hop"] = {"dscp": get_dscp(hop.sock), "priority": get_priority(hop.sock), "gso": hop.gso,
                           "gro": hop.gro, "rcvbuf": hop.rcvbuf, "port": hop.port}
        return info
