"""Joining peers (part of :class:`dgt.transport.endpoint.Endpoint`): dialling, accepting, and registering the
session links.

The lower rank dials, the higher accepts; both prove the session key (dgt.transport.auth) before a link is
registered. Stream lanes (dgt.transport.streams) are dialled and welcomed here too.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np
import trio

from dgt import wire
from dgt.channels.framing import KEEP, FrameReader
from dgt.channels.slot import Slot
from dgt.channels.sockopts import canonical_host
from dgt.channels.tcp import TcpChannel, dial
from dgt.channels.tcp_writer import ReliableWriter
from dgt.errors import PeerClosed, PeerTimeout, ProtocolError, one_error, open_nursery
from dgt.protocol.congestion import LedbatRate
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.pacing import Pacer, TokenBucket
from dgt.protocol.sender import RoundSender
from dgt.transport import auth, control
from dgt.transport.config import PeerAddress
from dgt.transport.inbound import Inbound
from dgt.transport.links import Links
from dgt.transport.records import Link
from dgt.transport.session import Session
from dgt.transport.sockets import Sockets
from dgt.transport.streams import StreamHub

HANDSHAKE_STAGING = 4096  # (i22) bytes an accepted connection stages until its peer proved the key (was 1 MiB)


def _control_only(h: np.void) -> object:
    """Where a handshake frame's payload goes: only CONTROL frames (at most ``max_control`` bytes) are read before a
    peer is authenticated; anything else ends the handshake before its payload is read."""
    if int(h["ftype"]) != wire.FrameType.CONTROL:
        raise ProtocolError(f"expected a CONTROL frame in the handshake, got frame type {int(h['ftype'])}")
    return KEEP


class Handshake:
    """Connecting: dial, accept, the hello/challenge handshake, and the links it registers (in ``links.table``,
    their datagram sources in ``links.sources``; each link's tasks run in the endpoint's service nursery: its reader
    is the inbound part's). ``key`` proves membership; ``mac`` (or None) signs the links' datagrams. ``pending``:
    accepted connections whose handshake is under way (capped)."""

    def __init__(self, session: Session, sockets: Sockets, links: Links, inbound: Inbound, hub: StreamHub,
                 key: bytes, mac: DatagramMac | None) -> None:
        self.session = session
        self.cfg = session.cfg
        self.rank = session.rank
        self.token = session.token
        self.receiver = session.receiver
        self.sockets = sockets
        self.links = links
        self.inbound = inbound
        self.hub = hub
        self._key = key
        self._mac = mac
        self.pending = 0

    @one_error
    async def connect(self, peers: Mapping[int, PeerAddress | dict[str, object]], timeout: float | None = None) -> None:
        """Connect to ``peers`` (rank -> address). Both sides of a pair call it; the lower rank dials, the higher
        accepts, so all-to-all or any subset connects without deadlock. PeerTimeout if a peer does not show up
        within ``timeout`` (default: connect_timeout, else peer_timeout)."""
        self.session.check_open()
        timeout = timeout or self.cfg.timeouts.connect or self.cfg.timeouts.peer
        wanted = {}
        for rank, addr in peers.items():
            rank = int(rank)
            if rank == self.rank:
                continue
            addr = addr if isinstance(addr, PeerAddress) else PeerAddress.from_dict(addr)
            if len(addr.udp_ports) != len(self.sockets.udp):
                raise ValueError(f"rank {rank} has {len(addr.udp_ports)} UDP lanes, this endpoint "
                                 f"{len(self.sockets.udp)}")
            wanted[rank] = addr
        async with open_nursery() as n:
            for rank, addr in wanted.items():
                link = self.links.table.get(rank)
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
        early = [(host, p) for p in addr.udp_ports if (host, p) not in self.links.sources]
        for src in early:
            self.links.sources[src] = rank
        try:
            chan = await self._hello(rank, addr.host, addr.tcp_port, timeout)
        except BaseException:
            for src in early:
                self.links.sources.pop(src, None)
            raise
        self._register(rank, addr, host, chan, FrameReader(chan, self.cfg.limits, self.token))

    async def dial_stream(self, rank: int, direction: int) -> TcpChannel:
        """Open one direction of a stream lane to ``rank`` (see dgt.transport.streams): another connection, welcomed
        like the first."""
        link = self.links.link(rank)
        timeout = self.cfg.timeouts.connect or self.cfg.timeouts.peer
        return await self._hello(rank, link.address.host, link.address.tcp_port, timeout, "a stream lane", stream=True,
                                 direction=direction)

    async def _hello(self, rank: int, host: str, port: int, timeout: float, what: str = "",
                     **fields: object) -> TcpChannel:
        """Dial ``rank``, say hello (plus ``fields``) and read its answer exactly, never past it (a stream lane's first
        message may follow right behind); the connection once welcomed. ``what``: the connection, for errors."""
        try:
            with trio.fail_after(timeout):
                sock = await dial(host, port, self.cfg.lanes.specs[0], timeout)
                chan = self._tcp_channel(sock, rank)
                try:
                    dn = auth.nonce()
                    hello = control.control(self.token, self.rank, control.HELLO,
                                            address=self.sockets.address.to_dict(),
                                            lanes=len(self.sockets.udp), nonce=dn, mac=self._mac is not None, **fields)
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
                    hung_up = PeerClosed(why)
                    hung_up.bye = True  # a peer that is closing its endpoint (its call failed): its reason may follow
                    raise hung_up from None
                except BaseException:
                    chan.close()
                    raise
        except trio.TooSlowError:
            why = f"rank {self.rank}: rank {rank} did not accept {what + ' ' if what else ''}within {timeout:g} s"
            raise PeerTimeout(why) from None
        return chan

    async def _read_control(self, chan: TcpChannel) -> tuple[int, dict[str, Any]]:
        """One CONTROL frame, read exactly (never past it: a stream lane's first message may follow right behind)."""
        head = bytearray(wire.HEADER_SIZE)
        await chan.recv_exactly(memoryview(head))
        h = wire.decode_header(head, self.cfg.limits, self.token)
        body = bytearray(min(int(h["length"]), self.cfg.limits.max_control))
        await chan.recv_exactly(memoryview(body))
        return control.parse(bytes(head + body), self.cfg.limits)

    async def _challenge(self, chan: TcpChannel, reader: FrameReader, rank: int, msg: dict[str, Any]) -> str | None:
        """The acceptor's half of the challenge-response (dgt.transport.auth): prove the key to the dialer, then
        check its proof. Why the dialer is refused, or None when it proved the key for the rank it claims."""
        dn, an, why = msg.get("nonce"), auth.nonce(), auth.purpose(msg)
        if not isinstance(dn, str) or len(dn) != 2 * auth.NONCE_BYTES:
            return "no valid nonce in the hello"
        mine = auth.proof(self._key, "acceptor", self.rank, rank, dn, an, why)
        await chan.send_buffers([control.control(self.token, self.rank, control.CHALLENGE, nonce=an, proof=mine)])
        rf = await reader.next(_control_only)
        peer, answer = control.parse(rf.frame, self.cfg.limits)
        if peer != rank or answer["op"] != control.AUTH or \
                not auth.verify(self._key, answer.get("proof"), "dialer", rank, self.rank, dn, an, why):
            return "authentication failed"
        return None

    async def _await_link(self, rank: int, timeout: float) -> None:
        slot = self.links.ready.setdefault(rank, Slot())
        try:
            with trio.fail_after(timeout):
                await slot.wait()
        except trio.TooSlowError:
            raise PeerTimeout(f"rank {self.rank}: rank {rank} did not connect within {timeout:g} s") from None

    async def accept_loop(self) -> None:
        """Accept dialers. Accept errors (EMFILE, ENFILE, ENOBUFS...) are counted (``accept:<errno>``) and
        survived with a short back-off; beyond ``max_pending_handshakes`` unfinished handshakes a new connection is
        closed at once (``handshake-cap``), so silent connections cannot exhaust memory or descriptors."""
        while True:
            try:
                sock = await self.sockets.listener.accept()
            except OSError as exc:
                self.receiver.counters.reject(f"accept:{errno.errorcode.get(exc.errno or 0, exc.errno)}")
                await trio.sleep(0.05)  # the listener stays readable while the limit holds: do not spin
                continue
            if self.pending >= self.cfg.security.max_pending_handshakes:
                self.receiver.counters.reject("handshake-cap")
                sock.close()
                continue
            self.pending += 1
            self.session.spawn(self._handshake_in, sock)

    async def _handshake_in(self, sock: socket.socket) -> None:
        """Validate a dialer's hello (token, rank, lanes, proof of the key) within the connect timeout; welcome or
        refuse it."""
        try:
            await self._handshake(sock)
        finally:
            self.pending -= 1

    async def _handshake(self, sock: socket.socket) -> None:
        chan = self._tcp_channel(sock, -1)
        timeout = self.cfg.timeouts.connect or self.cfg.timeouts.peer
        try:
            with trio.fail_after(timeout):
                reader = FrameReader(chan, self.cfg.limits, self.token, staging=HANDSHAKE_STAGING)
                rf = await reader.next(_control_only)
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
                    why = self.hub.refusal(rank, direction)
                    reply = control.control(self.token, self.rank, control.REFUSE, why=why) if why else \
                        control.control(self.token, self.rank, control.WELCOME)
                    await chan.send_buffers([reply])
                    if why:
                        chan.close()
                    else:
                        self.hub.accept(rank, chan, direction)
                    return
                why, addr = self._session_refusal(rank, msg)
                if why is not None:
                    await chan.send_buffers([control.control(self.token, self.rank, control.REFUSE, why=why)])
                    chan.close()
                    return
                host = canonical_host(addr.host)
                # accept the peer's datagrams before it hears the welcome: with lazy connections its first round
                # follows the handshake at once, and datagrams that beat _register were dropped as a stranger's
                # (lost for good: 12 blocks of a round with a 10 s deadline)
                early = [(host, p) for p in addr.udp_ports if (host, p) not in self.links.sources]
                for src in early:
                    self.links.sources[src] = rank
                try:
                    await chan.send_buffers([control.control(self.token, self.rank, control.WELCOME)])
                except BaseException:
                    for src in early:
                        self.links.sources.pop(src, None)
                    raise
        except Exception:  # wrong token, garbage, silence or a vanished dialer: not a peer of this session
            chan.close()
            self.receiver.counters.reject("handshake")
            return
        chan.label = f"rank {self.rank} <- rank {rank}"
        reader.reserve()  # authenticated: now the link's full staging buffer
        self._register(rank, addr, host, chan, reader)

    def _session_refusal(self, rank: int, msg: dict[str, Any]) -> tuple[str | None, PeerAddress]:
        """Why an authenticated session hello from ``rank`` is refused (None: it is not), and the address it gave
        (an error if it gave none that parses: the handshake fails)."""
        why = None
        if msg["op"] != control.HELLO:
            why = "expected hello"
        elif rank == self.rank or (rank in self.links.table and self.links.table[rank].error is None):
            why = f"rank {rank} is already connected"
        elif int(msg.get("lanes", -1)) != len(self.sockets.udp):
            why = f"lane count {msg.get('lanes')} != {len(self.sockets.udp)}"
        elif bool(msg.get("mac")) != (self._mac is not None):  # (i22) else every datagram would be refused
            why = f"datagram_mac {bool(msg.get('mac'))} != {self._mac is not None}"
        addr = PeerAddress.from_dict(msg["address"])
        if why is None and len(addr.udp_ports) != len(self.sockets.udp):
            why = f"{len(addr.udp_ports)} UDP ports for {len(self.sockets.udp)} lanes"
        return why, addr

    def _tcp_channel(self, sock: socket.socket, rank: int) -> TcpChannel:
        c = self.cfg
        chan = TcpChannel(sock, c.lanes.specs[0], rcvbuf=c.sockets.tcp_rcvbuf, sndbuf=c.sockets.tcp_sndbuf,
                          user_timeout=c.timeouts.peer)
        chan.label = f"rank {self.rank} <-> rank {rank}"
        return chan

    def _register(self, rank: int, addr: PeerAddress, host: str, chan: TcpChannel, reader: FrameReader) -> None:
        c = self.cfg
        old = self.links.table.get(rank)
        if self.session.closing or (old is not None and old.error is None):  # closing, or a racing second connection
            chan.close()
            return
        udp_addrs = [(host, p) for p in addr.udp_ports]
        for p in addr.udp_ports:
            self.links.sources[(host, p)] = rank
        pacer = None
        now = trio.current_time()
        # pace_shared: the budget this peer's TCP and UDP bytes both come off (the config checked pace_rate is set)
        shared = TokenBucket(c.pacing.rate, c.pacing.burst, now) if c.pacing.shared and c.pacing.rate else None
        if c.congestion.enabled:
            g = c.congestion
            top = min(g.max_rate, c.pacing.rate or g.max_rate)  # a configured pacing rate is the start and the ceiling
            cc = LedbatRate(min(g.start_rate, top), min(g.min_rate, top), top, target=g.target)
            pacer = Pacer(cc.rate, c.pacing.burst, cc, now, shared=shared)
        elif c.pacing.rate:
            pacer = Pacer(c.pacing.rate, c.pacing.burst, None, now, shared=shared)
        sender = RoundSender(
            self.token, self.rank, datagram_payload=c.payload_for(host),
            reliable_frame_bytes=c.sockets.reliable_frame_bytes, lanes=len(c.lanes.specs),
            error_feedback=c.error_feedback,
            mac=self._mac, peer=rank,
        )  # fmt: skip
        link = Link(rank, addr, chan, reader, ReliableWriter(chan), sender, pacer, udp_addrs, last_ping=now)
        self.links.table[rank] = link
        self.session.spawn(self.links.run, link, self.inbound.read)
        self.links.ready.setdefault(rank, Slot()).set()
