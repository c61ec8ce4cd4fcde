"""The endpoint: one rank's session with its peers over the DGT lanes.

It owns a TCP listener, one UDP socket per unreliable lane, one TCP connection per peer (lower rank dials), the
sans-IO receiver (shared by all peers) and one sans-IO sender per peer (error feedback is per destination). Tasks:
accept, one reader and one writer per connection, one ingress per UDP lane, the datagram scheduler, the deadline
timer and the liveness monitor. Every frame-level decision is made by dgt.protocol; this module moves bytes,
feeds ``trio.current_time()`` and routes the events.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import trio

from dgt import wire
from dgt.channels.framing import KEEP, FrameReader
from dgt.channels.pacing import Pacer
from dgt.channels.ports import bind_in_range
from dgt.channels.sockopts import canonical_host, get_dscp, get_priority
from dgt.channels.tcp import TcpChannel, TcpListener, dial
from dgt.channels.udp import UdpChannel
from dgt.errors import (
    InputRejected,
    PeerClosed,
    PeerTimeout,
    ProtocolError,
    RankMismatch,
    WireError,
    one_error,
    path_mismatch,
)
from dgt.layout import BucketLayout
from dgt.protocol.budget import RoundWindow
from dgt.protocol.bulk import BulkDone, BulkReceiver, bulk_frames
from dgt.protocol.congestion import Feedback, LedbatRate
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.receiver import DropReportIn, RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender
from dgt.protocol.stats import RoundLaneStats, RoundStats
from dgt.scheduler.datagrams import DatagramJob, DatagramScheduler, sent_summary
from dgt.scheduler.reliable import ReliableWriter
from dgt.scheduler.slot import Slot
from dgt.scheduler.timer import DeadlineTimer
from dgt.transport import auth, control
from dgt.transport.checks import check_classes
from dgt.transport.config import PeerAddress, TransportConfig
from dgt.transport.stats import LaneStats, RoundResult, SendStats, TransportStats
from dgt.transport.stream_watch import StreamWatch
from dgt.transport.streams import Hop, HopResult, StreamHub
from dgt.wire import Flags, FrameType

BYTES_BUCKET = 0xFFFF0000  # buckets at and above this id carry send_bytes messages (tag in the low 16 bits)


@dataclass
class _Link:
    """One connected peer."""

    rank: int
    address: PeerAddress
    chan: TcpChannel
    reader: FrameReader
    writer: ReliableWriter
    sender: RoundSender
    pacer: Pacer | None
    udp_addrs: list[tuple]
    error: BaseException | None = None
    scope: trio.CancelScope | None = None
    last_ping: float = 0.0
    said_bye: bool = False
    dirty: set[int] = field(default_factory=set)  # buckets whose residual holds folded losses
    window: RoundWindow = field(default_factory=RoundWindow)  # expected round length, for the send budget


@dataclass
class _SendTrack:
    """A round on its way to a peer: the drop report slot and the datagram jobs (for the loss estimate)."""

    report: Slot = field(default_factory=Slot)
    jobs: list[DatagramJob] = field(default_factory=list)
    detached: bool = False  # send_round returned without waiting for the report
    t0: float = 0.0  # when the round started (the send budget learns the round's length from its report)
    cls: np.ndarray | None = None  # lane class per block (per-lane loss accounting)


class PendingSend:
    """A lossless message queued by :meth:`Endpoint.post_send`; the writer task sends it while the caller goes on."""

    __slots__ = ("stats", "_slot", "_t0", "_pacer")

    def __init__(self, stats: SendStats, slot: Slot, t0: float, pacer: Pacer | None) -> None:
        self.stats = stats
        self._slot = slot
        self._t0 = t0
        self._pacer = pacer

    @property
    def done(self) -> bool:
        return self._slot.done

    async def wait(self, timeout: float | None = None) -> SendStats:
        """Once the kernel took the last byte: the message's stats (``elapsed`` counts to this return). PeerClosed
        if the connection failed first; PeerTimeout after ``timeout``."""
        st = self.stats
        try:
            with trio.fail_after(timeout) if timeout else nullcontext():
                await self._slot.wait()
        except trio.TooSlowError:
            raise PeerTimeout(f"round {st.round} of bucket {st.bucket} to rank {st.peer}: not sent in "
                              f"{timeout} s") from None  # fmt: skip
        st.elapsed = trio.current_time() - self._t0
        st.pace_rate = None if self._pacer is None else self._pacer.rate
        return st


class Endpoint:
    """A rank's DGT session. Create with :meth:`open`, join peers with :meth:`connect`, then send and receive
    rounds concurrently from any number of tasks; :meth:`aclose` says goodbye and releases every socket."""

    def __init__(self, rank: int, token: int, cfg: TransportConfig | None = None, host: str = "127.0.0.1") -> None:
        self.rank = int(rank)
        self.token = int(token)
        self.cfg = cfg or TransportConfig()
        self.host = host
        c = self.cfg
        self.receiver = RoundReceiver(
            self.token, self.rank, limits=c.limits, deadline=c.deadline_policy(), allocator=self._allocate
        )
        self.listener = bind_in_range(lambda p: TcpListener(host, c.lanes[0], port=p), c.port_range, "TCP listener")
        self.udp: dict[int, UdpChannel] = {}
        try:
            for lane in range(1, len(c.lanes)):
                self.udp[lane] = bind_in_range(lambda p, lane=lane: UdpChannel(
                    host, c.lanes[lane], gso=c.gso, gro=c.gro, rcvbuf=c.udp_rcvbuf, sndbuf=c.udp_sndbuf,
                    max_segments=c.gso_segments, batch_bytes=c.udp_batch_bytes, port=p,
                ), c.port_range, f"UDP lane {lane}")  # fmt: skip
        except BaseException:
            self._close_sockets()
            raise
        self._links: dict[int, _Link] = {}
        self._link_ready: dict[int, Slot] = {}
        self._sources: dict[tuple[str, int], int] = {}
        self._recv_waiters: dict[tuple[int, int, int], Slot] = {}
        self._results: OrderedDict[tuple[int, int, int], RoundResult] = OrderedDict()
        self.bulk = BulkReceiver(c.limits.max_open_rounds, self.receiver.max_open_bytes, self._allocate)
        self._out: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()  # landing buffers, see post_recv
        self._opened: OrderedDict[tuple[int, int, int], float] = OrderedDict()
        self._sending: dict[tuple[int, int, int], _SendTrack] = {}
        self._layouts: dict[int, BucketLayout] = {}
        self._bytes_tx: dict[tuple[int, int], int] = {}
        self._bytes_rx: dict[tuple[int, int], int] = {}
        self._drop_rng = np.random.default_rng(c.drop_seed) if c.drop_fraction > 0 else None
        self._rx_dropped_hook: dict[int, int] = dict.fromkeys(self.udp, 0)
        self._tx_abandoned: dict[int, int] = dict.fromkeys(self.udp, 0)
        self._tx_unsent: dict[int, int] = dict.fromkeys(self.udp, 0)  # blocks the send budget kept back
        self._tx_lost: dict[int, int] = dict.fromkeys(self.udp, 0)  # blocks sent that the peers reported missing
        self._stats = TransportStats(self.rank, [])
        self._lane_delivered: dict[int, list[int]] = {}
        self.scheduler = DatagramScheduler(self.udp, self._round_closed, self._pacer_of)
        self.deadlines = DeadlineTimer(self.receiver, self._finished)
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._closing = False
        self._fatal: BaseException | None = None
        self._key = auth.session_key(self.token, auth.user_secret(c.secret))  # proves membership (handshakes)
        self._mac = DatagramMac(self._key) if c.datagram_mac else None  # datagram MAC (issue 22), same key
        self.receiver.mac = self._mac
        self._handshakes = 0  # accepted connections whose handshake is under way (capped)
        self._abort: RankMismatch | None = None  # the mismatch a peer reported (control ABORT), if any
        self._aborted = trio.Event()
        self._stream_watch = StreamWatch()  # messages awaited on stream lanes (i22: a peer on the round path)
        self._exchange_scopes: set[trio.CancelScope] = set()  # stream exchanges under way (an abort cancels them)
        self.streams = StreamHub(self.rank, self.token, c.connect_timeout or c.peer_timeout, self._dial_stream,
                                 self._link_error, native=c.native_hops(), frame_bytes=c.limits.max_payload,
                                 hop_threads=c.hop_thread_count())

    # ------------------------------------------------------------------------------------------------ lifecycle
    @classmethod
    async def open(
        cls,
        rank: int,
        token: int,
        cfg: TransportConfig | None = None,
        host: str = "127.0.0.1",
        *,
        nursery: trio.Nursery | None = None,
    ) -> Endpoint:
        """Bind the TCP listener and one UDP socket per unreliable lane (port 0) and start the background tasks
        (in ``nursery`` if given, else as a trio system task that ends with the run)."""
        ep = cls(rank, token, cfg, host)
        started = trio.Event()
        if nursery is None:
            trio.lowlevel.spawn_system_task(ep._service, started, name=f"dgt-endpoint-{rank}")
        else:
            nursery.start_soon(ep._service, started)
        await started.wait()
        return ep

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.host, self.listener.port, tuple(ch.port for ch in self.udp.values()), self.rank)

    @property
    def peers(self) -> list[int]:
        """Ranks with a live connection."""
        return [r for r, ln in self._links.items() if ln.error is None]

    async def _service(self, started: trio.Event) -> None:
        try:
            async with trio.open_nursery() as n:
                self._nursery = n
                n.start_soon(self._guard, self._accept_loop)
                for lane, chan in self.udp.items():
                    n.start_soon(self._guard, self._udp_ingress, lane, chan)
                n.start_soon(self._guard, self.scheduler.run)
                n.start_soon(self._guard, self.deadlines.run)
                n.start_soon(self._guard, self._liveness)
                started.set()
                await self._stop.wait()
                n.cancel_scope.cancel()
        finally:
            started.set()
            self._teardown(self._fatal or PeerClosed(f"rank {self.rank}: the endpoint was closed"))
            self._stopped.set()

    async def _guard(self, fn, *args) -> None:
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
        with trio.move_on_after(min(2.0, self.cfg.peer_timeout)):
            slots = [ln.writer.push([control.control(self.token, self.rank, control.BYE)], slot=Slot()) for ln in links]
            for s in slots:
                try:
                    await s.wait()
                except Exception:
                    pass
        self._stop.set()
        await self._stopped.wait()

    async def aborted(self, within: float) -> RankMismatch | None:
        """The mismatch a peer reported (control ABORT), waiting up to ``within`` s for one; None if none came."""
        with trio.move_on_after(within):
            await self._aborted.wait()
        return self._abort

    def abort_peers(self, why: str) -> None:
        """Tell every connected peer that this rank's collective failed for ``why`` (queued, no waiting): their
        pending operations on this rank fail with :class:`RankMismatch` carrying it, instead of waiting for a round
        that will never come."""
        for ln in self._links.values():
            if ln.error is None:
                ln.writer.push([control.control(self.token, self.rank, control.ABORT, why=why[:2000])])

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
        for job in list(self.scheduler.jobs):
            job.done.fail(error)
        self.scheduler.jobs.clear()
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

    # ------------------------------------------------------------------------------------------------ connecting
    @one_error
    async def connect(self, peers: Mapping[int, PeerAddress | dict], timeout: float | None = None) -> None:
        """Connect to ``peers`` (rank -> address). Both sides of a pair call it; the lower rank dials, the higher
        accepts, so all-to-all or any subset connects without deadlock. PeerTimeout if a peer does not show up
        within ``timeout`` (default: connect_timeout, else peer_timeout)."""
        self._check_open()
        timeout = timeout or self.cfg.connect_timeout or self.cfg.peer_timeout
        wanted = {}
        for rank, addr in peers.items():
            rank = int(rank)
            if rank == self.rank:
                continue
            addr = addr if isinstance(addr, PeerAddress) else PeerAddress.from_dict(addr)
            if len(addr.udp_ports) != len(self.udp):
                raise ValueError(f"rank {rank} has {len(addr.udp_ports)} UDP lanes, this endpoint {len(self.udp)}")
            wanted[rank] = addr
        async with trio.open_nursery() as n:
            for rank, addr in wanted.items():
                link = self._links.get(rank)
                if link is not None and link.error is None:
                    continue
                if self.rank < rank:
                    n.start_soon(self._dial, rank, addr, timeout)
                else:
                    n.start_soon(self._await_link, rank, timeout)

    async def _dial(self, rank: int, addr: PeerAddress, timeout: float) -> None:
        host = canonical_host(addr.host)
        # the acceptor may send its first round's datagrams right behind the welcome, and our UDP task can run before
        # the task reading the welcome: accept them (into the early buffer) from the address the store gave us
        early = [(host, p) for p in addr.udp_ports if (host, p) not in self._sources]
        for src in early:
            self._sources[src] = rank
        try:
            chan = await self._hello(rank, addr.host, addr.tcp_port, timeout)
        except BaseException:
            for src in early:
                self._sources.pop(src, None)
            raise
        self._register(rank, addr, host, chan, FrameReader(chan, self.cfg.limits, self.token))

    async def _dial_stream(self, rank: int, direction: int) -> TcpChannel:
        """Open one direction of a stream lane to ``rank`` (see dgt.transport.streams): another connection, welcomed
        like the first."""
        link = self._link(rank)
        timeout = self.cfg.connect_timeout or self.cfg.peer_timeout
        return await self._hello(rank, link.address.host, link.address.tcp_port, timeout, "a stream lane", stream=True,
                                 direction=direction)

    async def _hello(self, rank: int, host: str, port: int, timeout: float, what: str = "", **fields) -> TcpChannel:
        """Dial ``rank``, say hello (plus ``fields``) and read its answer exactly, never past it (a stream lane's first
        message may follow right behind); the connection once welcomed. ``what``: the connection, for errors."""
        try:
            with trio.fail_after(timeout):
                sock = await dial(host, port, self.cfg.lanes[0], timeout)
                chan = self._tcp_channel(sock, rank)
                try:
                    dn = auth.nonce()
                    hello = control.control(self.token, self.rank, control.HELLO, address=self.address.to_dict(),
                                            lanes=len(self.udp), nonce=dn, mac=self._mac is not None, **fields)
                    await chan.send_buffers([hello])
                    peer, msg = await self._read_control(chan)
                    if msg["op"] == control.CHALLENGE and peer == rank:
                        an, why = str(msg.get("nonce", "")), auth.purpose(fields)
                        if not auth.verify(self._key, msg.get("proof"), "acceptor", rank, self.rank, dn, an, why):
                            raise ProtocolError(f"rank {self.rank}: rank {rank} could not prove the session key "
                                                f"for {what or 'the session'} (another DGT_SECRET?)")
                        mine = auth.proof(self._key, "dialer", self.rank, rank, dn, an, why)
                        await chan.send_buffers([control.control(self.token, self.rank, control.AUTH, proof=mine)])
                        peer, msg = await self._read_control(chan)
                    if msg["op"] != control.WELCOME or peer != rank:
                        raise ProtocolError(f"rank {rank} refused {what or 'the session'}: {msg.get('why', msg['op'])}")
                except PeerClosed:
                    chan.close()
                    why = f"rank {self.rank}: rank {rank} hung up on our hello (another session token?)"
                    raise PeerClosed(why) from None
                except BaseException:
                    chan.close()
                    raise
        except trio.TooSlowError:
            why = f"rank {self.rank}: rank {rank} did not accept {what + ' ' if what else ''}within {timeout:g} s"
            raise PeerTimeout(why) from None
        return chan

    async def _read_control(self, chan: TcpChannel) -> tuple[int, dict]:
        """One CONTROL frame, read exactly (never past it: a stream lane's first message may follow right behind)."""
        head = bytearray(wire.HEADER_SIZE)
        await chan.recv_exactly(memoryview(head))
        h = wire.decode_header(head, self.cfg.limits, self.token)
        body = bytearray(min(int(h["length"]), self.cfg.limits.max_control))
        await chan.recv_exactly(memoryview(body))
        return control.parse(bytes(head + body), self.cfg.limits)

    async def _challenge(self, chan: TcpChannel, reader: FrameReader, rank: int, msg: dict) -> str | None:
        """The acceptor's half of the challenge-response (dgt.transport.auth): prove the key to the dialer, then
        check its proof. Why the dialer is refused, or None when it proved the key for the rank it claims."""
        dn, an, why = msg.get("nonce"), auth.nonce(), auth.purpose(msg)
        if not isinstance(dn, str) or len(dn) != 2 * auth.NONCE_BYTES:
            return "no valid nonce in the hello"
        mine = auth.proof(self._key, "acceptor", self.rank, rank, dn, an, why)
        await chan.send_buffers([control.control(self.token, self.rank, control.CHALLENGE, nonce=an, proof=mine)])
        rf = await reader.next(lambda h: KEEP)
        peer, answer = control.parse(rf.frame, self.cfg.limits)
        if peer != rank or answer["op"] != control.AUTH or \
                not auth.verify(self._key, answer.get("proof"), "dialer", rank, self.rank, dn, an, why):
            return "authentication failed"
        return None

    def _link_error(self, rank: int) -> BaseException | None:
        """Why the session link to ``rank`` is unusable (None: it is live)."""
        link = self._links.get(rank)
        if link is None:
            return self._fatal or PeerClosed(f"rank {self.rank} is not connected to rank {rank}")
        return link.error

    async def _await_link(self, rank: int, timeout: float) -> None:
        slot = self._link_ready.setdefault(rank, Slot())
        try:
            with trio.fail_after(timeout):
                await slot.wait()
        except trio.TooSlowError:
            raise PeerTimeout(f"rank {self.rank}: rank {rank} did not connect within {timeout:g} s") from None

    async def _accept_loop(self) -> None:
        """Accept dialers. Accept errors (EMFILE, ENFILE, ENOBUFS...) are counted (``accept:<errno>``) and
        survived with a short back-off; beyond ``max_pending_handshakes`` unfinished handshakes a new connection is
        closed at once (``handshake-cap``), so silent connections cannot exhaust memory or descriptors."""
        while True:
            try:
                sock = await self.listener.accept()
            except OSError as exc:
                self.receiver.counters.reject(f"accept:{errno.errorcode.get(exc.errno or 0, exc.errno)}")
                await trio.sleep(0.05)  # the listener stays readable while the limit holds: do not spin
                continue
            if self._handshakes >= self.cfg.max_pending_handshakes:
                self.receiver.counters.reject("handshake-cap")
                sock.close()
                continue
            self._handshakes += 1
            self._nursery.start_soon(self._handshake_in, sock)

    async def _handshake_in(self, sock) -> None:
        """Validate a dialer's hello (token, rank, lanes, proof of the key) within the connect timeout; welcome or
        refuse it."""
        try:
            await self._handshake(sock)
        finally:
            self._handshakes -= 1

    async def _handshake(self, sock) -> None:
        chan = self._tcp_channel(sock, -1)
        timeout = self.cfg.connect_timeout or self.cfg.peer_timeout
        try:
            with trio.fail_after(timeout):
                reader = FrameReader(chan, self.cfg.limits, self.token)
                rf = await reader.next(lambda h: KEEP)
                rank, msg = control.parse(rf.frame, self.cfg.limits)
                why = None
                if msg["op"] == control.HELLO:
                    why = await self._challenge(chan, reader, rank, msg)
                    if why is not None:
                        self.receiver.counters.reject("auth")
                        await chan.send_buffers([control.control(self.token, self.rank, control.REFUSE, why=why)])
                        chan.close()
                        return
                if msg["op"] == control.HELLO and msg.get("stream"):
                    direction = msg.get("direction", 0)
                    why = self.streams.refusal(rank, direction)
                    reply = control.control(self.token, self.rank, control.REFUSE, why=why) if why else \
                        control.control(self.token, self.rank, control.WELCOME)
                    await chan.send_buffers([reply])
                    if why:
                        chan.close()
                    else:
                        self.streams.accept(rank, chan, direction)
                    return
                if msg["op"] != control.HELLO:
                    why = "expected hello"
                elif rank == self.rank or (rank in self._links and self._links[rank].error is None):
                    why = f"rank {rank} is already connected"
                elif int(msg.get("lanes", -1)) != len(self.udp):
                    why = f"lane count {msg.get('lanes')} != {len(self.udp)}"
                elif bool(msg.get("mac")) != (self._mac is not None):  # (i22) else every datagram would be refused
                    why = f"datagram_mac {bool(msg.get('mac'))} != {self._mac is not None}"
                addr = PeerAddress.from_dict(msg["address"])
                if why is None and len(addr.udp_ports) != len(self.udp):
                    why = f"{len(addr.udp_ports)} UDP ports for {len(self.udp)} lanes"
                if why is not None:
                    await chan.send_buffers([control.control(self.token, self.rank, control.REFUSE, why=why)])
                    chan.close()
                    return
                host = canonical_host(addr.host)
                # accept the peer's datagrams before it hears the welcome: with lazy connections its first round
                # follows the handshake at once, and datagrams that beat _register were dropped as a stranger's
                # (lost for good: 12 blocks of a round with a 10 s deadline)
                early = [(host, p) for p in addr.udp_ports if (host, p) not in self._sources]
                for src in early:
                    self._sources[src] = rank
                try:
                    await chan.send_buffers([control.control(self.token, self.rank, control.WELCOME)])
                except BaseException:
                    for src in early:
                        self._sources.pop(src, None)
                    raise
        except Exception:  # wrong token, garbage, silence or a vanished dialer: not a peer of this session
            chan.close()
            self.receiver.counters.reject("handshake")
            return
        chan.label = f"rank {self.rank} <- rank {rank}"
        self._register(rank, addr, host, chan, reader)

    def _tcp_channel(self, sock, rank: int) -> TcpChannel:
        c = self.cfg
        chan = TcpChannel(sock, c.lanes[0], rcvbuf=c.tcp_rcvbuf, sndbuf=c.tcp_sndbuf, user_timeout=c.peer_timeout)
        chan.label = f"rank {self.rank} <-> rank {rank}"
        return chan

    def _register(self, rank: int, addr: PeerAddress, host: str, chan: TcpChannel, reader: FrameReader) -> None:
        c = self.cfg
        old = self._links.get(rank)
        if self._closing or (old is not None and old.error is None):  # closing, or a racing second connection
            chan.close()
            return
        udp_addrs = [(host, p) for p in addr.udp_ports]
        for p in addr.udp_ports:
            self._sources[(host, p)] = rank
        pacer = None
        now = trio.current_time()
        if c.congestion_control:
            top = min(c.pace_max, c.pace_rate or c.pace_max)  # a configured pace_rate is the start and the ceiling
            cc = LedbatRate(min(c.pace_start, top), min(c.pace_min, top), top, target=c.cc_target)
            pacer = Pacer(cc.rate, c.pace_burst, cc, now)
        elif c.pace_rate:
            pacer = Pacer(c.pace_rate, c.pace_burst, None, now)
        sender = RoundSender(
            self.token, self.rank, block=c.block, datagram_payload=c.datagram_payload,
            reliable_frame_bytes=c.reliable_frame_bytes, lanes=len(c.lanes), error_feedback=c.error_feedback,
            mac=self._mac, peer=rank,
        )  # fmt: skip
        link = _Link(rank, addr, chan, reader, ReliableWriter(chan), sender, pacer, udp_addrs, last_ping=now)
        self._links[rank] = link
        self._nursery.start_soon(self._run_link, link)
        self._link_ready.setdefault(rank, Slot()).set()

    async def _run_link(self, link: _Link) -> None:
        try:
            with trio.CancelScope() as scope:
                link.scope = scope
                if link.error is not None:
                    return
                async with trio.open_nursery() as n:
                    n.start_soon(self._link_task, link, self._reader, link)
                    n.start_soon(self._link_task, link, link.writer.run)
        finally:
            self._fail_peer(link.rank, PeerClosed(f"rank {self.rank}: the connection to rank {link.rank} ended"))

    async def _link_task(self, link: _Link, fn, *args) -> None:
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
        self._finished(self.receiver.abort(rank, trio.current_time()))
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

    def _link(self, peer: int) -> _Link:
        self._check_open()
        if self._abort is not None:
            raise self._abort.with_traceback(None)
        link = self._links.get(peer)
        if link is None:
            raise ValueError(f"rank {self.rank} is not connected to rank {peer}; call connect() first")
        if link.error is not None:
            raise link.error.with_traceback(None)
        return link

    # ------------------------------------------------------------------------------------------------ receiving
    async def _reader(self, link: _Link) -> None:
        recv = self.receiver
        rank = link.rank

        def place(h: np.void):
            if int(h["rank"]) != rank:
                return None  # a peer may only speak for itself
            ftype = int(h["ftype"])
            if ftype == FrameType.DATA and not int(h["flags"]) & Flags.FRAGMENT:
                return recv.payload_target(h, 0)
            if ftype == FrameType.BULK:
                return self.bulk.target(rank, h, trio.current_time())
            return KEEP

        def batchable(h: np.ndarray) -> np.ndarray:
            return (h["ftype"] == FrameType.DATA) & ((h["flags"] & Flags.FRAGMENT) == 0) & (h["rank"] == rank)

        budget = 0  # bytes handled since the last checkpoint: yield every so often, not per frame
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
            events = None
            if int(h["rank"]) != rank:
                recv.counters.reject("rank-mismatch")
            elif ftype == FrameType.DATA and not int(h["flags"]) & Flags.FRAGMENT:
                events = recv.commit(h, 0, now, rf.landed)
            elif ftype == FrameType.BULK:
                done = self.bulk.landed(rank, h, now)
                if done is not None:
                    self._bulk_done(done)
            elif ftype == FrameType.CONTROL:
                self._on_control(link, rf.frame)
            else:
                key = (rank, int(h["bucket"]), int(h["round"]))
                begin = ftype == FrameType.ROUND_BEGIN
                if begin:
                    why = "already closed" if key in recv.closed else None
                    self._opened[key] = now
                    while len(self._opened) > 4 * self.cfg.limits.max_open_rounds * max(1, len(self._links)):
                        self._opened.popitem(last=False)
                    before = dict(recv.counters.reasons)
                events = recv.receive_bytes(rf.frame, 0, now)
                if begin and why is None and key not in recv.rounds and key not in recv.closed:
                    grew = [r for r, n in recv.counters.reasons.items() if n > before.get(r, 0)]
                    why = f"refused ({', '.join(grew) or 'rejected'})"  # limits: too many rounds, memory budget
                if begin and why is not None:  # the sender would wait forever for this round: tell it now
                    link.writer.push([control.control(self.token, self.rank, control.STALE, bucket=key[1],
                                                      round=key[2], why=why)], urgent=True)  # fmt: skip
            if events:
                self._handle(events)
            budget += 4096 + int(h["length"])
            # every path reaches this check (a CONTROL frame right behind a ROUND_END must not skip it): a round whose
            # deadline just started would otherwise wait for the next frame that happens to leave the buffer empty
            if rf.idle:
                budget = 0
                self.deadlines.poke()
                await trio.lowlevel.checkpoint()

    def _on_control(self, link: _Link, frame: memoryview) -> None:
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
            error = RankMismatch(f"rank {link.rank} aborted: {str(msg.get('why', ''))[:2000]}", remote=link.rank)
            self._set_abort(error)
            self._fail_peer(link.rank, error)
            # the other peers' links stay up (closing them would race the ABORT they get from the same sender and
            # show them a closed connection instead of its reason); what waits on them fails now, and new
            # operations raise the mismatch (_link)
            for rank in list(self._links):
                self._fail_pending(rank, error)
        elif msg["op"] == control.STALE:
            key = (link.rank, int(msg.get("bucket", -1)), int(msg.get("round", -1)))
            track = self._sending.get(key)
            if track is not None:
                why = str(msg.get("why", "already closed"))
                hint = ": round keys must not be reused" if why == "already closed" else ""
                what = f"round {key[2]} of bucket {key[1]} was {why} at rank {link.rank}{hint}"
                track.report.fail(ProtocolError(what))
                for job in track.jobs:
                    if job in self.scheduler.jobs:
                        self.scheduler.jobs.remove(job)
                    job.done.set(job)

    async def _udp_ingress(self, lane: int, chan: UdpChannel) -> None:
        accept = self._accept_source if self.cfg.check_source else None
        frac = self.cfg.drop_fraction
        while True:
            try:
                mv, sizes = await chan.recv_batch(accept)
            except trio.ClosedResourceError:
                return
            if len(sizes) == 0:
                continue
            batch = wire.decode_datagrams(mv, sizes, self.cfg.limits, self.token)
            if self._drop_rng is not None:
                keep = self._drop_rng.random(len(sizes)) >= frac
                self._rx_dropped_hook[lane] += int((~keep).sum())
                batch = wire.Batch(batch.headers[keep], batch.payload_pos[keep], batch.reason[keep], batch.buf)
            events = self.receiver.receive_datagrams(batch, lane, trio.current_time())
            if events:
                self._handle(events)
            self.deadlines.poke()

    def _accept_source(self, addr: tuple) -> bool:
        return (addr[0], addr[1]) in self._sources

    def _allocate(self, key: tuple[int, int, int], numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        out = self._out.pop(key, None)  # the round opened: the receiver holds its buffer from now on
        if out is not None and out.numel() == numel and out.dtype == dtype and out.is_contiguous():
            return out.view(-1)
        return None

    def _handle(self, events: list) -> None:
        done = []
        for ev in events:
            if isinstance(ev, RoundDone):
                done.append(ev)
            elif isinstance(ev, DropReportIn):
                self._on_drop_report(ev.frame)
        if done:
            self._finished(done)

    def _finished(self, done: list[RoundDone]) -> None:
        """Rounds the receiver closed: report back to their senders, account, deliver or buffer the results."""
        now = trio.current_time()
        st = self._stats
        for d in done:
            key = (d.sender, d.bucket, d.round)
            opened = self._opened.pop(key, None)
            elapsed = max(now - opened, 0.0) if opened is not None else 0.0
            why = d.stats.closed_by
            link = self._links.get(d.sender)
            if link is not None and link.error is None and why not in ("aborted", "sender-gone") and d.report:
                link.writer.push([d.report], urgent=True)
            st.closed_by[why] = st.closed_by.get(why, 0) + 1
            if why == "aborted":
                waiter = self._recv_waiters.pop(key, None)
                if waiter is not None:
                    err = link.error if link is not None and link.error is not None else PeerClosed("round aborted")
                    waiter.fail(err)
                continue
            st.rounds_received += 1
            st.blocks_received += int(d.mask.sum())
            st.blocks_dropped += d.stats.dropped
            st.deadline_wait_total += d.stats.deadline_wait
            st.deadline_wait_max = max(st.deadline_wait_max, d.stats.deadline_wait)
            st.receive_seconds += elapsed
            for lane, ls in d.stats.lanes.items():
                acc = self._lane_delivered.setdefault(lane, [0, 0])
                acc[0] += ls.blocks
                acc[1] += ls.bytes
            self._deliver(key, RoundResult(d.data, d.mask, d.stats, d.layout, d.sender, d.bucket, d.round, elapsed,
                                           codec=d.codec))

    def _bulk_done(self, d: BulkDone) -> None:
        """A lossless message is in: account it like a complete round (every block received on the TCP lane)."""
        sender, bucket, round = d.key
        layout = self._layout(d.data.numel())
        n = layout.nblocks
        st = self._stats
        stats = RoundStats(sender, bucket, round, blocks=n, important=n, closed_by="complete",
                           lanes={0: RoundLaneStats(d.frames, n, d.nbytes)})  # fmt: skip
        st.closed_by["complete"] = st.closed_by.get("complete", 0) + 1
        st.rounds_received += 1
        st.blocks_received += n
        st.receive_seconds += d.elapsed
        acc = self._lane_delivered.setdefault(0, [0, 0])
        acc[0] += n
        acc[1] += d.nbytes
        mask = torch.ones(n, dtype=torch.bool)
        self._deliver(d.key, RoundResult(d.data, mask, stats, layout, sender, bucket, round, d.elapsed, bulk=True,
                                         codec=d.codec))

    def _deliver(self, key: tuple[int, int, int], res: RoundResult) -> None:
        waiter = self._recv_waiters.pop(key, None)
        if waiter is not None:
            waiter.set(res)
            return
        if self._stream_watch.expected(key):  # (i22) the peer took the round path for a call we run on streams
            self._stream_conflict(key)
        self._results[key] = res
        while len(self._results) > self.cfg.max_buffered_results:
            self._results.popitem(last=False)
            self._stats.results_evicted += 1

    def _on_drop_report(self, frame: wire.Frame) -> None:
        """A receiver closed one of our rounds: fold its losses into error feedback, steer pacing, stop sending."""
        peer = frame.rank
        link = self._links.get(peer)
        if link is None:
            self.receiver.counters.reject("report-from-stranger")
            return
        try:
            info = link.sender.on_drop_report(frame)
        except WireError:
            self.receiver.counters.reject("drop-report")
            return
        track = self._sending.get((peer, frame.bucket, frame.round))
        if track is not None:
            self._account_report(link, track, info)
            track.report.set(info)
            if track.detached:
                del self._sending[(peer, frame.bucket, frame.round)]
        if info.folded_elems:
            link.dirty.add(frame.bucket)
        self.scheduler.poke()

    def _account_report(self, link: _Link, track: _SendTrack, info) -> None:
        """Per-lane loss counts; the congestion controller's feedback and the round window of the send budget."""
        if info.lost_mask is not None and info.missing_blocks and track.cls is not None:
            lanes, counts = np.unique(track.cls[info.lost_mask], return_counts=True)
            for lane, n in zip(lanes.tolist(), counts.tolist()):
                self._tx_lost[lane] = self._tx_lost.get(lane, 0) + n
        if link.pacer is None or link.pacer.cc is None or info.timing is None or not track.jobs:
            return
        now = trio.current_time()
        t = info.timing
        n, nbytes, first, last = sent_summary(track.jobs)
        link.pacer.on_feedback(Feedback(n, nbytes, t.datagrams, t.nbytes, first, last, t.first, t.last, t.wait), now)
        link.window.observe(now - track.t0, t.wait)

    # ------------------------------------------------------------------------------------------------ sending
    def _round_closed(self, peer: int, bucket: int, round: int) -> bool:
        link = self._links.get(peer)
        return link is None or link.error is not None or link.sender.closed(bucket, round)

    def _pacer_of(self, peer: int) -> Pacer | None:
        link = self._links.get(peer)
        return None if link is None else link.pacer

    def _layout(self, numel: int) -> BucketLayout:
        lay = self._layouts.get(numel)
        if lay is None:
            if len(self._layouts) > 256:
                self._layouts.clear()
            lay = self._layouts[numel] = BucketLayout.flat(numel, self.cfg.block)
        return lay

    async def send_round(
        self,
        peer: int,
        bucket: int,
        round: int,
        flat: torch.Tensor,
        layout: BucketLayout | None = None,
        cls: torch.Tensor | int = 0,
        order: torch.Tensor | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,
        codec: int = 0,
    ) -> SendStats:
        """Send one round of ``bucket`` to ``peer``: blocks of class 0 over TCP (with the round's opening and
        closing frames), class k >= 1 over UDP lane k in ``order`` (most important first). ``cls=0`` sends
        everything reliably (lossless). With ``wait`` (default) returns once the receiver's drop report is in,
        so the stats say what was lost and error feedback has already folded it in; otherwise once every frame
        was handed to the kernel (the bucket is then copied, since error feedback needs it later). ``codec``: the
        frame headers' codec byte, a collective's call code (its op), the receiver's ``RoundResult.codec``."""
        if not 0 <= bucket < BYTES_BUCKET:
            raise ValueError(f"bucket ids must be in [0, {BYTES_BUCKET:#x}); higher ids carry send_bytes")
        return await self._send(peer, bucket, round, flat, layout, cls, order, wait, timeout, codec)

    @staticmethod
    async def _jobs_done(track: _SendTrack) -> None:
        for job in track.jobs:
            try:
                await job.done.wait()
            except OSError:
                pass  # the lane could not send: those datagrams are lost, the deadline covers them

    async def _jobs_until_report(self, track: _SendTrack) -> None:
        """Wait for the round's datagrams, or for its drop report, whichever comes first: once the receiver has
        closed the round the datagrams still queued (a pacer slowed by loss) are abandoned, not waited for. Waiting
        for them outlived a receiver that had reported and closed its endpoint (PeerClosed on a finished round)."""
        async with trio.open_nursery() as nursery:
            async def on_report() -> None:
                try:
                    await track.report.wait()
                finally:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(on_report)
            await self._jobs_done(track)
            nursery.cancel_scope.cancel()

    async def _send(self, peer, bucket, round, flat, layout, cls, order, wait, timeout, codec=0) -> SendStats:
        link = self._link(peer)
        t0 = trio.current_time()
        flat = flat.detach().reshape(-1)
        if flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to("cpu").contiguous()
        layout = layout or self._layout(flat.numel())
        if layout.block != self.cfg.block:
            raise ValueError(f"layout block {layout.block} != configured block {self.cfg.block}")
        if flat.numel() != layout.numel:
            raise InputRejected(f"bucket has {flat.numel()} elements, its layout {layout.numel}")
        check_classes(cls, order, layout)
        key = (peer, bucket, round)
        if key in self._sending and not self._sending[key].detached:
            raise ValueError(f"round {round} of bucket {bucket} to rank {peer} is already in flight")
        lossless = (cls == 0) if isinstance(cls, int) else not bool((cls != 0).any())
        if lossless and not wait:  # no report to wait for: no round state at all (BULK frames)
            return await self.post_send(peer, bucket, round, flat, codec=codec).wait(timeout)
        # Copy only when needed: to add a non-zero residual, or to keep the bucket for a report we do not wait for.
        copy = self.cfg.error_feedback and (bucket in link.dirty or (not wait and not lossless))
        link.dirty.discard(bucket)
        data = link.sender.prepare(bucket, flat) if copy else flat
        quiet = lossless and not wait  # nothing to learn from a report nobody waits for: ask for none
        budget: int | None = None  # only with error feedback, which carries the blocks kept back (else: lost)
        if not lossless and self.cfg.error_feedback and link.pacer is not None and link.pacer.cc is not None:
            budget = link.window.budget(link.pacer.rate)
        plan = link.sender.plan(bucket, round, data, layout, cls, order, report=not quiet, budget=budget,
                                codec=codec)
        stats = SendStats(peer, bucket, round, plan.important_blocks, plan.unimportant_blocks,
                          len(plan.reliable), plan.reliable_bytes, copied=copy,
                          unsent_blocks=plan.unsent_blocks, unsent_bytes=plan.unsent_bytes)  # fmt: skip
        for lane, n in plan.unsent_lanes.items():
            self._tx_unsent[lane] = self._tx_unsent.get(lane, 0) + n
        if plan.unsent_blocks and self.cfg.error_feedback:
            link.dirty.add(bucket)  # the blocks kept back are in the residual: the next round adds it
        track = self._sending[key] = _SendTrack(t0=t0, cls=plan.cls)
        finished = False
        try:
            with trio.fail_after(timeout) if timeout else nullcontext():
                begin = link.writer.push_frames(plan.reliable[:1], urgent=True)
                rest = link.writer.push_frames(plan.reliable[1:])
                await begin.wait()  # datagrams only after the round's opening frame is on the wire
                for lane in sorted(set(plan.datagrams) | set(plan.odd)):
                    rows = plan.datagrams.get(lane, np.zeros((0, 1), np.uint8))
                    job = DatagramJob(peer, lane, bucket, round, rows, plan.odd.get(lane, []), link.udp_addrs[lane - 1])
                    track.jobs.append(job)
                    self.scheduler.submit(job)
                await rest.wait()
                if wait:
                    await self._jobs_until_report(track)
                else:
                    await self._jobs_done(track)
                if wait:
                    info = await track.report.wait()
                    stats.report = True
                    stats.lost_blocks, stats.folded_elems = info.missing_blocks, info.folded_elems
            finished = True
        except trio.TooSlowError:
            raise PeerTimeout(f"round {round} of bucket {bucket} to rank {peer}: not done in {timeout} s") from None
        finally:
            for job in track.jobs:
                lane = job.lane
                stats.datagrams[lane] = stats.datagrams.get(lane, 0) + job.sent
                stats.datagram_bytes[lane] = stats.datagram_bytes.get(lane, 0) + job.sent_bytes
                stats.abandoned[lane] = stats.abandoned.get(lane, 0) + job.abandoned
                self._tx_abandoned[lane] = self._tx_abandoned.get(lane, 0) + job.abandoned
                if not job.done.done:  # cancelled mid-round: stop its datagrams
                    if job in self.scheduler.jobs:
                        self.scheduler.jobs.remove(job)
                    job.done.fail(PeerClosed("send cancelled"))
            if wait or not finished or track.report.done or quiet:
                if self._sending.get(key) is track:
                    del self._sending[key]
            else:
                track.detached = True  # the drop report removes it (pacing still wants the loss estimate)
        self._stats.rounds_sent += 1
        stats.elapsed = trio.current_time() - t0
        stats.pace_rate = None if link.pacer is None else link.pacer.rate
        return stats

    def post_send(self, peer: int, bucket: int, round: int, flat: torch.Tensor, codec: int = 0) -> PendingSend:
        """Queue round ``round`` of ``bucket`` to ``peer`` losslessly, without waiting: it goes out as BULK frames
        (see dgt.protocol.bulk) behind whatever the connection's writer already holds, and lands on the peer like a
        complete round (``recv_round``). ``flat`` is sent from in place: leave it unchanged until
        :meth:`PendingSend.wait` returned. A bucket whose residual holds folded losses is sent with that residual
        added (from a copy), as ``send_round`` would. Nothing here awaits, so a caller can start a send and a
        receive from one task (a ring hop) without spawning one."""
        if not 0 <= bucket < BYTES_BUCKET:
            raise ValueError(f"bucket ids must be in [0, {BYTES_BUCKET:#x}); higher ids carry send_bytes")
        link = self._link(peer)
        t0 = trio.current_time()
        flat = flat.detach().reshape(-1)
        if flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to("cpu").contiguous()
        copied = self.cfg.error_feedback and bucket in link.dirty
        if copied:
            flat = link.sender.prepare(bucket, flat)
            link.dirty.discard(bucket)
        frames = bulk_frames(self.token, self.rank, bucket, round, flat, self.cfg.reliable_frame_bytes, codec)
        nblocks = -(-flat.numel() // self.cfg.block)
        stats = SendStats(peer, bucket, round, nblocks, 0, len(frames),
                          flat.numel() * flat.element_size() + len(frames) * wire.HEADER_SIZE, copied=copied)
        slot = link.writer.push_frames(frames)
        self._stats.rounds_sent += 1
        return PendingSend(stats, slot, t0, link.pacer)

    @one_error
    async def exchange(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]:
        """Run ``hops`` (see :class:`~dgt.transport.streams.Hop`) in order on stream lanes, off the trio loop: the
        lossless path of a collective whose every rank knows the same sequence of messages (a ring all-reduce).
        Exchanges run one at a time, in the order they were called, which must be the same on every rank.
        ``timeout``: the longest a hop may make no progress (default: peer_timeout). ``family``: the bucket bits
        that name a message's family; a session-link message from a hop's peer in the same family and round means
        that peer took the round path for this call (RankMismatch on every rank, see dgt.transport.stream_watch).
        ``ticket``: a place in that order reserved earlier with ``self.streams.reserve()``, given back here however
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
            key = self._stream_watch.first_expected([*self._results, *self.bulk.open, *self.receiver.rounds])
            if key is not None:
                raise self._stream_conflict(key)
            with trio.CancelScope() as scope:  # an abort cancels it (a lane dial to a peer that gave up, too)
                self._exchange_scopes.add(scope)
                try:
                    started = True  # streams.exchange owns the ticket from here, however it ends
                    return await self.streams.exchange(hops, timeout or self.cfg.peer_timeout, ticket)
                except PeerClosed as exc:  # a peer that aborted may hang up on a lane before its ABORT is read
                    mismatch = await self.aborted(min(1.0, self.cfg.peer_timeout))
                    if mismatch is None:
                        raise
                    raise mismatch.with_traceback(None) from exc
            raise self._abort.with_traceback(None)
        finally:
            if ticket is not None and not started:
                self.streams.forfeit(ticket)
            if scope is not None:
                self._exchange_scopes.discard(scope)
            self._stream_watch.unwatch(entries)

    def _set_abort(self, error: RankMismatch) -> None:
        """The session's collectives failed with ``error`` (a peer's ABORT, or a mismatch seen here): remember the
        first, wake what waits for it, and end stream exchanges under way (a hop or a lane dial would otherwise
        wait for its own timeout)."""
        if self._abort is None:
            self._abort = error
            self._aborted.set()
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

    def post_recv(self, peer: int, bucket: int, round: int, out: torch.Tensor | None) -> None:
        """Name the contiguous CPU tensor a future round lands in, before :meth:`recv_round` is called for it.

        A round that opens before its receiver is ready would otherwise be reassembled into a fresh buffer and copied
        at the end; a collective that knows its next rounds (ring steps) posts them up front. ``recv_round`` for the
        round must then pass the same ``out`` (or none: the data is in ``out`` either way). At most a bounded number
        of posts are kept (the oldest are forgotten, which only costs that copy). ``out=None`` withdraws a post that
        will not be awaited (a collective that failed half-way): a round that opens later gets a buffer of its own."""
        key = (peer, bucket, round)
        if out is None:
            self._out.pop(key, None)
            return
        if key in self._results or key in self.receiver.rounds or key in self.receiver.closed or key in self.bulk.open:
            return  # already open or done: too late to land in place
        self._out[key] = out
        while len(self._out) > 4 * self.cfg.limits.max_open_rounds * max(1, len(self._links)):
            self._out.popitem(last=False)

    async def recv_round(
        self,
        peer: int,
        bucket: int,
        round: int,
        *,
        out: torch.Tensor | None = None,
        timeout: float | None = None,
    ) -> RoundResult:
        """The round ``round`` of ``bucket`` from ``peer`` once it closed (complete, or by its deadline once all
        important blocks were in). Rounds that closed before the call are buffered and returned at once. With
        ``out`` (called before the round opens), the data is reassembled straight into ``out``; otherwise it is
        copied there at the end. PeerClosed/PeerTimeout when the peer goes away; PeerTimeout after ``timeout``
        (default: the config's ``round_timeout``, so no receive waits unbounded)."""
        key = (peer, bucket, round)
        res = self._results.pop(key, None)
        if res is None:
            link = self._link(peer)
            if key in self._recv_waiters:
                raise ValueError(f"round {round} of bucket {bucket} from rank {peer} is already awaited")
            slot = self._recv_waiters[key] = Slot()
            if out is not None and key not in self.receiver.rounds and key not in self.bulk.open:
                self._out[key] = out
            try:
                timeout = timeout or self.cfg.round_timeout
                with trio.fail_after(timeout) if timeout else nullcontext():
                    res = await slot.wait()
            except trio.TooSlowError:
                raise PeerTimeout(f"round {round} of bucket {bucket} from rank {link.rank}: "
                                  f"nothing within {timeout} s") from None  # fmt: skip
            finally:
                if self._recv_waiters.get(key) is slot:
                    del self._recv_waiters[key]
                self._out.pop(key, None)
        if out is not None and res.data.data_ptr() == out.data_ptr():
            res.data = out  # reassembled in place: hand back the caller's tensor itself (its shape too)
        elif out is not None:
            if out.numel() != res.data.numel() or out.dtype != res.data.dtype:
                raise RankMismatch(f"rank {self.rank}: round {round} of bucket {bucket} from rank {peer} holds "
                                   f"{res.data.numel()} x {res.data.dtype}, this rank expects {out.numel()} x "
                                   f"{out.dtype}: the ranks called the collective with different sizes or dtypes")
            out.view(-1).copy_(res.data)
            res.data = out
            self._stats.rounds_copied += 1
        return res

    # ------------------------------------------------------------------------------------------------ bytes
    async def send_bytes(self, peer: int, data: bytes | bytearray | memoryview, tag: int = 0) -> None:
        """Send a message losslessly (all TCP); messages with the same tag arrive in order at recv_bytes."""
        if not 0 <= tag < 1 << 16:
            raise ValueError("tag must be in [0, 65536)")
        seq = self._bytes_tx.get((peer, tag), 0)
        self._bytes_tx[(peer, tag)] = seq + 1
        buf = bytearray(data)
        t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.zeros(0, dtype=torch.uint8)
        await self._send(peer, BYTES_BUCKET | tag, seq & 0xFFFFFFFF, t, None, 0, None, True, None)

    async def recv_bytes(self, peer: int, tag: int = 0, timeout: float | None = None) -> bytes:
        """The next message from ``peer`` with ``tag``."""
        seq = self._bytes_rx.get((peer, tag), 0)
        self._bytes_rx[(peer, tag)] = seq + 1
        res = await self.recv_round(peer, BYTES_BUCKET | tag, seq & 0xFFFFFFFF, timeout=timeout)
        return res.data.numpy().tobytes()

    async def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        """Lossless send of a small tensor with its shape and dtype (e.g. a model broadcast)."""
        meta = f"{wire.wire_dtype(tensor.dtype).value}:{','.join(map(str, tensor.shape))}".encode()
        await self.send_bytes(peer, meta, tag)
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        await self.send_bytes(peer, flat.view(torch.uint8).numpy().tobytes(), tag)

    async def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        meta = (await self.recv_bytes(peer, tag, timeout)).decode()
        dt, _, shape = meta.partition(":")
        dims = [int(s) for s in shape.split(",") if s]
        raw = bytearray(await self.recv_bytes(peer, tag, timeout))
        dtype = wire.TORCH_OF[wire.WireDType(int(dt))]
        if not raw:
            return torch.zeros(dims, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(dims)

    # ------------------------------------------------------------------------------------------------ liveness
    async def _liveness(self) -> None:
        """Ping idle links; declare a peer gone after peer_timeout without any byte from it."""
        c = self.cfg
        beat = c.heartbeat or c.peer_timeout / 4
        tick = min(beat, c.peer_timeout / 10)
        while True:
            await trio.sleep(tick)
            now = trio.current_time()
            for link in list(self._links.values()):
                if link.error is not None:
                    continue
                silent = now - link.chan.last_rx
                if silent >= c.peer_timeout - tick:
                    why = f"rank {self.rank}: rank {link.rank} silent for {silent:.2f} s (timeout {c.peer_timeout:g} s)"
                    self._fail_peer(link.rank, PeerTimeout(why))
                elif now - link.last_ping >= beat:
                    link.last_ping = now
                    link.writer.push([control.control(self.token, self.rank, control.PING)], urgent=True)

    # ------------------------------------------------------------------------------------------------ stats
    def stats(self) -> TransportStats:
        """A snapshot of the endpoint's counters (per lane both directions, rounds, losses, deadline waits)."""
        st = self._stats
        rc = self.receiver.counters
        lanes = []
        l0 = self.cfg.lanes[0]
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
            spec, cc = self.cfg.lanes[lane], ch.counters
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
        )  # fmt: skip

    def socket_info(self) -> dict:
        """DSCP and SO_PRIORITY read back from the kernel for every socket (listener, connections, UDP lanes)."""
        info: dict = {"listener": {"dscp": get_dscp(self.listener.sock), "priority": get_priority(self.listener.sock)}}
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
        return info
