"""Stream lanes: two more TCP connections per peer, one per direction, for ordered lossless messages, driven off
the trio loop.

A lossless ring all-reduce is a fixed sequence of hops that both neighbours know in advance. On the session link
every hop pays for trio's readiness waits, the framing reader and the writer task; here the whole sequence runs in
one worker thread through :func:`dgt.channels.duplex.duplex`, each message one BULK frame (the same 48-byte header
as on the session link, so captures dissect it alike), its header checked against the one this rank expects.

The price is order: a stream carries one message after another, so the ranks must run their exchanges in the same
order. Every rank already issues its collectives in the same order (the Group contract); an exchange takes a ticket
when it is called, before its first await, and exchanges run one at a time in ticket order. Ranks that disagree
anyway get a ProtocolError that names both messages, never a hang or a wrong sum.

Lanes open lazily (the lower rank dials both connections, with a hello that says ``stream`` and which direction the
connection carries: 0 lower -> higher rank, 1 higher -> lower), are marked like lane 0 (EF), fail with their peer's
session link, and are never reused after an error: a failed or cancelled exchange leaves its streams mid-message.

One connection per direction, so that with ``hop_threads=2`` a hop's send half (its own thread) and receive half
never share a socket: TCP serialises a socket's send and receive copies under one lock, and a 2-rank ring, whose
two neighbours are one peer, would otherwise get no parallelism from the second thread (on a 16-core host the
2-rank ring's two hops took 8.9-9.4 ms on one socket, split or not, and 5.6-6.5 ms split over two).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import outcome
import torch
import trio

from dgt import wire
from dgt.channels.duplex import NATIVE, SCRATCH_BYTES, HopCancelled, duplex
from dgt.channels.hop_datagrams import DatagramRecv, DatagramSend, HopDatagrams, HopDatagramsCancelled, PacerThread
from dgt.channels.slot import Slot
from dgt.channels.tcp import TcpChannel
from dgt.channels.udp import UdpChannel
from dgt.errors import PeerClosed, PeerTimeout, open_nursery
from dgt.protocol.sender import raw_bytes
from dgt.wire import FrameType


@dataclass
class Hop:
    """Send ``payload`` to ``send_to`` while ``land`` fills from ``recv_from`` (either side may be None; tensors are
    contiguous CPU tensors, sent and landed as flat bytes). With
    ``add_src`` (float32, like ``land``) the received payload is added on arrival: ``land = add_src + received``.
    ``bucket``/``round`` name the message in its header, as for a round on the session link."""

    bucket: int
    round: int
    send_to: int | None = None
    payload: torch.Tensor | None = None
    recv_from: int | None = None
    land: torch.Tensor | None = None
    add_src: torch.Tensor | None = None
    op: int = 0  # a collective's call code (its reduce op), in the headers' codec byte: both ends must agree
    land_later: Callable[[], torch.Tensor] | None = None
    """Instead of ``land``: called in the worker thread once the hops before this one are done, for a landing
    whose size depends on what they received (a lossy hop's packed blocks, sized by the mask message before it)."""
    payload_later: Callable[[], torch.Tensor] | None = None
    """Instead of ``payload``: called in the worker thread once the hops before this one are done, for a message
    that forwards what one of them received (a sparse all-gather's packed blocks, dgt.collectives.ring_gather)."""
    datagrams: DatagramSend | None = None
    """Beside this hop's messages: a round's datagrams to ``send_to``, from the hub's hop socket
    (:mod:`dgt.channels.hop_datagrams`), while those of ``datagrams_in`` are read."""
    datagrams_in: Callable[[], DatagramRecv] | None = None
    """Called in the worker thread once this hop's messages are in: where the datagrams of ``recv_from``'s round
    land (read until the round announced them all or its deadline passed)."""


@dataclass
class HopResult:
    sent: int  # bytes, header included
    received: int
    finished: float  # time.monotonic() when the hop completed
    cpu_wait: tuple[float | None, float] | None = None
    """A hop with datagrams, when the hub measures it (``cpu_wait``): (seconds its thread was runnable but waiting
    for a CPU, seconds its messages took), the CPU gate's reading, handed to the endpoint's trio thread, which feeds
    its gate (dgt.protocol.cpu_gate; docs/architecture.md, Threads)."""


def _given(t: torch.Tensor | None, what: str, h: Hop) -> torch.Tensor:
    if t is None:
        raise ValueError(f"a hop with a peer needs its {what} tensor (bucket {h.bucket:#x}, round {h.round})")
    return t


def streamable(t: torch.Tensor, add: bool = False) -> bool:
    """Whether a tensor can travel on a stream lane: contiguous, on the CPU; float32 when it is summed on arrival."""
    return t.device.type == "cpu" and t.is_contiguous() and (not add or t.dtype == torch.float32)


class StreamLane:
    """The stream connections to a peer: ``tx`` carries this rank's messages to it, ``rx`` the peer's to this rank.
    ``busy`` while a worker thread drives them: an abort then only shuts the sockets down (which wakes the thread),
    and the exchange closes them once the thread let go."""

    def __init__(self, peer: int, tx: TcpChannel, rx: TcpChannel) -> None:
        self.peer = peer
        self.tx = tx
        self.rx = rx
        self.busy = False
        self.error: BaseException | None = None

    @property
    def chans(self) -> tuple[TcpChannel, TcpChannel]:
        return self.tx, self.rx

    def abort(self, error: BaseException, graceful: bool = False) -> None:
        """No further exchanges on this lane, and a hop under way wakes up with an error. ``graceful`` (the peer
        said goodbye) changes nothing yet: what the peer sent before it left can still be read, and reading past it
        ends the stream (PeerClosed). The endpoint's own close aborts it for good."""
        if graceful:
            return
        if self.error is None:
            self.error = error
        for chan in self.chans:
            try:
                chan.sock.shutdown(2)  # SHUT_RDWR: a thread blocked in poll on it wakes up
            except OSError:
                pass
            if not self.busy:
                chan.close()

    def release(self) -> None:
        self.busy = False
        if self.error is not None:
            for chan in self.chans:
                chan.close()


class StreamHub:
    """The endpoint's stream lanes: lazy connects, the ticket order, and exchanges run in a worker thread."""

    def __init__(self, rank: int, token: int, timeout: float, dial: Callable[[int, int], Awaitable[TcpChannel]],
                 link_error: Callable[[int], BaseException | None], native: bool = NATIVE,
                 frame_bytes: int = wire.DEFAULT_LIMITS.max_payload, hop_threads: int = 1,
                 hop: UdpChannel | None = None, cpu_wait: bool = False) -> None:
        self.rank = rank
        self.hop = hop  # the hop socket (datagrams of lossy hops, dgt.channels.hop_datagrams); closed with the hub
        # measure, in the worker thread, every datagram hop's runqueue wait while its messages travelled: returned in
        # its HopResult (the endpoint's CPU gate is fed on the trio thread, dgt.protocol.cpu_gate)
        self.cpu_wait = cpu_wait
        self._pacer = PacerThread()  # their paced sends
        self._carried: OrderedDict[bytes, int] = OrderedDict()  # datagrams read ahead of their round, by its name
        self.split = hop_threads == 2 and native  # a hop's send half on a second thread (native loop only)
        self.frame_bytes = frame_bytes  # a message larger than a frame may be goes as several, in offset order
        self.token = token
        self.timeout = timeout
        self.native = native
        self._dial = dial  # (peer, direction) -> a welcomed connection
        self._link_error = link_error
        self.lanes: dict[int, StreamLane] = {}
        self._halves: dict[int, dict[int, TcpChannel]] = {}  # accepted connections of a lane not yet complete
        self._ready: dict[int, Slot] = {}
        self._next = 0  # next ticket to hand out
        self._turn = 0  # ticket whose exchange may run
        self._skipped: set[int] = set()
        self._turned = trio.Event()
        self._cancel_r, self._cancel_w = os.pipe()
        os.set_blocking(self._cancel_r, False)
        os.set_blocking(self._cancel_w, False)
        self._scratch = bytearray(SCRATCH_BYTES)
        self._running = False  # a worker thread may be polling the cancel pipe
        self.exchanges = 0
        self.closed: BaseException | None = None

    # -- lanes ------------------------------------------------------------------------------------------------
    def refusal(self, peer: int, direction: object = 0) -> str | None:
        """Why a stream hello from ``peer`` for ``direction`` cannot be accepted (None: it can)."""
        if self.closed is not None:
            return "the endpoint is closing"
        if peer >= self.rank:
            return f"rank {peer} is not the lower rank: rank {self.rank} dials it"
        if direction not in (0, 1):
            return f"stream direction {direction!r} is not 0 or 1"
        if self._link_error(peer) is not None:
            return f"no live session link with rank {peer}"
        if peer in self.lanes or direction in self._halves.get(peer, {}):
            return f"rank {peer} already has a stream lane"
        return None

    def accept(self, peer: int, chan: TcpChannel, direction: int = 0) -> None:
        """Take an accepted stream connection (after the welcome went out: nothing may precede it); the lane is
        ready once both directions are in."""
        if self.refusal(peer, direction) is not None:  # the situation changed while the welcome was sent
            chan.close()
            return
        halves = self._halves.setdefault(peer, {})
        halves[direction] = chan
        if len(halves) == 2:
            del self._halves[peer]
            self._add(peer, halves[1], halves[0])  # the acceptor is the higher rank: it sends on direction 1

    def _add(self, peer: int, tx: TcpChannel, rx: TcpChannel) -> StreamLane:
        tx.label = f"rank {self.rank} -> rank {peer} (stream)"
        rx.label = f"rank {self.rank} <- rank {peer} (stream)"
        lane = self.lanes[peer] = StreamLane(peer, tx, rx)
        self._ready.setdefault(peer, Slot()).set(lane)
        return lane

    async def lane(self, peer: int) -> StreamLane:
        """The stream lane to ``peer``, connecting it first if need be (the lower rank dials both directions)."""
        lane = self.lanes.get(peer)
        if lane is None:
            if self.rank < peer:
                chans: list[TcpChannel] = []
                try:
                    for direction in (0, 1):
                        chans.append(await self._dial(peer, direction))
                except BaseException:
                    for chan in chans:
                        chan.close()
                    raise
                if self.closed is not None:
                    for chan in chans:
                        chan.close()
                    raise self.closed.with_traceback(None)
                lane = self.lanes.get(peer) or self._add(peer, chans[0], chans[1])
            else:
                try:
                    with trio.fail_after(self.timeout):
                        lane = await self._ready.setdefault(peer, Slot()).wait()
                except trio.TooSlowError:
                    raise PeerTimeout(f"rank {self.rank}: rank {peer} did not open its stream lane within "
                                      f"{self.timeout:g} s") from None
        if lane.error is not None:
            raise lane.error.with_traceback(None)
        return lane

    def abort(self, peer: int, error: BaseException, graceful: bool = False) -> None:
        """``peer``'s session link failed: its stream lane fails with it (and waiters for one)."""
        lane = self.lanes.get(peer)
        if lane is not None:
            lane.abort(error, graceful)
        if not graceful:
            for chan in self._halves.pop(peer, {}).values():
                chan.close()
        slot = self._ready.get(peer)
        if slot is not None and not slot.done:
            slot.fail(error)

    def close(self, error: BaseException) -> None:
        """The endpoint is closing: fail every lane. The cancel pipe stays open while a thread may still poll it."""
        self.closed = self.closed or error
        for peer in list(set(self.lanes) | set(self._ready) | set(self._halves)):
            self.abort(peer, error)  # also closes a lane's half that came in alone
        if not self._running:
            self._close_pipe()

    def _close_pipe(self) -> None:
        """The cancel pipe, the hop socket and its pacer thread, once no worker thread may use them."""
        self._pacer.close()
        if self.hop is not None:
            self.hop.close()
        for fd in (self._cancel_r, self._cancel_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._cancel_r = self._cancel_w = -1

    def channels(self) -> list[TcpChannel]:
        return [chan for ln in self.lanes.values() for chan in ln.chans]

    # -- exchanges --------------------------------------------------------------------------------------------
    def reserve(self) -> int:
        """Take the next ticket now, for an exchange that runs later (``exchange(hops, ticket=...)``): a collective
        that awaits other work first keeps its place in the call order. A ticket that will never run must be given
        back with :meth:`forfeit`, or every later exchange waits for it."""
        ticket = self._next
        self._next += 1
        return ticket

    def forfeit(self, ticket: int) -> None:
        """Give back a reserved ticket whose exchange will not run."""
        self._advance(ticket)

    async def exchange(self, hops: list[Hop], timeout: float | None = None,
                       ticket: int | None = None) -> list[HopResult]:
        """Run ``hops`` in order (see the module docstring); the ticket is taken before the first await, unless
        one was reserved (:meth:`reserve`)."""
        if ticket is None:
            ticket = self.reserve()
        try:
            while self._turn != ticket:
                await self._turned.wait()
            if self.closed is not None:
                raise self.closed.with_traceback(None)
            return await self._exchange(hops, timeout or self.timeout)
        finally:
            self._advance(ticket)

    def _advance(self, ticket: int) -> None:
        if self._turn != ticket:  # gave up before its turn: the turn skips it when it comes
            self._skipped.add(ticket)
            return
        self._turn += 1
        while self._turn in self._skipped:
            self._skipped.discard(self._turn)
            self._turn += 1
        ev, self._turned = self._turned, trio.Event()
        ev.set()

    async def _exchange(self, hops: list[Hop], timeout: float) -> list[HopResult]:
        peers = sorted({p for h in hops for p in (h.send_to, h.recv_from) if p is not None})
        lanes = await self._lanes(peers)
        for ln in lanes.values():
            ln.busy = True
        self._running = True
        try:
            for ln in lanes.values():
                # a lane may have failed since it was looked up (its peer's link died while the other neighbour's
                # lane was being fetched): its sockets may be closed already, and a closed socket must never
                # reach the hop loop, which would take its fd -1 for "no receive" and return 0 bytes as success
                if ln.error is not None:
                    raise ln.error.with_traceback(None)
            # per hop, its pieces (None: planned in the thread when its turn comes, see Hop.land_later)
            plan: list[list[tuple[Any, ...]] | None] = [
                None if h.land_later is not None or h.payload_later is not None else self._plan(h, lanes)
                for h in hops]
            results = await self._in_thread(lambda: self._run(plan, hops, lanes, timeout))
        except BaseException as exc:
            # a stream left mid-message cannot carry another: fail the lanes, and report the peer's own failure
            # (liveness, a BYE) when that is what ended the hop
            for p, ln in lanes.items():
                ln.abort(exc if isinstance(exc, Exception) else PeerClosed(f"stream lane to rank {p} abandoned"))
            for p in peers:
                err = self._link_error(p)
                if err is not None and isinstance(exc, (PeerClosed, PeerTimeout)):
                    raise err.with_traceback(None) from exc
            raise
        finally:
            self._running = False
            for ln in lanes.values():
                ln.release()
            if self.closed is not None:
                self._close_pipe()
        self.exchanges += 1
        for pieces in plan:
            for send, _, _, recv, *_ in pieces or []:
                if send is not None:
                    send.tx.tx_calls += 1
                if recv is not None:
                    recv.rx.rx_calls += 1
        for h, r in zip(hops, results):
            if h.send_to is not None:
                lanes[h.send_to].tx.tx_bytes += r.sent
            if h.recv_from is not None:
                lanes[h.recv_from].rx.rx_bytes += r.received
        return results

    async def _lanes(self, peers: list[int]) -> dict[int, StreamLane]:
        """The lanes to ``peers``: those already open at once (every exchange after a call's first), else all of
        them connected at once, each neighbour may be waiting for the other."""
        known = {p: self.lanes[p] for p in peers if p in self.lanes}
        if len(known) == len(peers):
            for ln in known.values():
                if ln.error is not None:
                    raise ln.error.with_traceback(None)
            return known
        lanes: dict[int, StreamLane] = {}
        async with open_nursery() as n:

            async def get(p: int) -> None:
                lanes[p] = await self.lane(p)

            for p in peers:
                n.start_soon(get, p)
        return lanes

    def _plan(self, h: Hop, lanes: dict[int, StreamLane]) -> list[tuple[Any, ...]]:
        """What the thread needs for one hop, built on the trio side: lanes, headers and buffer views, one tuple per
        piece. A message goes as BULK frames of at most ``frame_bytes`` (``offset``/``count`` say which elements),
        so the receiver's frame limit holds; send and receive pieces are paired in order."""
        payload, land, add_src = (None if t is None else t.reshape(-1) for t in (h.payload, h.land, h.add_src))
        sends = self._pieces(self.rank, h, _given(payload, "payload", h)) if h.send_to is not None else []
        recvs = self._pieces(h.recv_from, h, _given(land, "land", h)) if h.recv_from is not None else []
        label = f"rank {self.rank} stream hop (bucket {h.bucket:#x}, round {h.round})"
        out = []
        for i in range(max(len(sends), len(recvs), 1)):
            send = recv = add = None
            header = expect = b""
            send_view: Any = b""
            land_view: Any = b""
            if i < len(sends):  # sends is empty unless send_to and payload are given
                assert h.send_to is not None and payload is not None
                send = lanes[h.send_to]
                header, a, b = sends[i]
                send_view = raw_bytes(payload[a:b])
            if i < len(recvs):
                assert h.recv_from is not None and land is not None
                recv = lanes[h.recv_from]
                expect, a, b = recvs[i]
                land_view = raw_bytes(land[a:b])
                if add_src is not None:
                    add = raw_bytes(add_src[a:b])
            out.append((send, header, send_view, recv, expect, land_view, add, label))
        return out

    def _pieces(self, sender: int, h: Hop, t: torch.Tensor) -> list[tuple[bytes, int, int]]:
        """(header, first element, end element) of each frame of ``t`` as ``sender`` sends it."""
        n, isz = t.numel(), t.element_size()
        per = max(1, self.frame_bytes // isz)
        dt = wire.wire_dtype(t.dtype)
        return [(wire.encode_header(FrameType.BULK, token=self.token, rank=sender, round=h.round, bucket=h.bucket,
                                    block=n, offset=a, count=min(per, n - a), length=min(per, n - a) * isz, dtype=dt,
                                    codec=h.op),
                 a, min(a + per, n)) for a in range(0, max(n, 1), per)]

    def _run(self, plan: list[list[tuple[Any, ...]] | None], hops: list[Hop], lanes: dict[int, StreamLane],
             timeout: float) -> list[HopResult]:
        """The worker thread: every hop (every piece of it) in order, no trio. A hop planned late (``land_later``,
        ``payload_later``) is planned here, its entry of ``plan`` filled in."""
        out = []
        for i, h in enumerate(hops):
            pieces = plan[i]
            if pieces is None:
                assert h.land_later is not None or h.payload_later is not None
                land = h.land_later() if h.land_later is not None else h.land
                payload = h.payload_later() if h.payload_later is not None else h.payload
                pieces = plan[i] = self._plan(replace(h, land=land, payload=payload, land_later=None,
                                                      payload_later=None), lanes)
            sent = got = 0
            reading = None
            dgrams = self._datagrams_first(h)  # before the messages: they travel beside them
            for send, header, payload, recv, expect, land, add, label in pieces:
                s, g = duplex(None if send is None else send.tx.sock, header, payload,
                              None if recv is None else recv.rx.sock, expect, land, add,
                              self._scratch if add is not None else None, timeout=timeout,
                              cancel_fd=self._cancel_r, native=self.native, label=label, split=self.split)
                sent += s
                got += g
            if dgrams is not None:
                self._datagrams_rest(h, dgrams, timeout / 2)
                reading = (dgrams.queued, dgrams.span) if self.cpu_wait else None
            out.append(HopResult(sent, got, time.monotonic(), reading))
        return out

    def _datagrams_first(self, h: Hop) -> HopDatagrams | None:
        """A hop with datagrams (see :class:`Hop`), in the worker thread: handed to the pacer thread as its
        messages start."""
        if h.datagrams is None and h.datagrams_in is None:
            return None
        if self.hop is None:
            raise RuntimeError("a hop with datagrams needs the hop socket (this endpoint has none)")
        dgrams = HopDatagrams(self.hop.sock, h.datagrams, self._pacer, cpu_wait=self.cpu_wait)
        dgrams.start()
        return dgrams

    def _datagrams_rest(self, h: Hop, dgrams: HopDatagrams, longest: float = float("inf")) -> None:
        """Once the hop's messages are in: the rest of its datagrams, and those of its round from ``recv_from``,
        waited for at most ``longest`` seconds (half the exchange's progress timeout: a neighbour whose next hop
        waits for this rank must not give up first, whatever deadline policy the user configured)."""
        rx = h.datagrams_in() if h.datagrams_in is not None else None
        if rx is not None:  # an earlier hop's reads may have taken some of this round's (a peer ahead): counted
            rx.got = self._carried.pop(rx.name, 0)
            rx.longest = min(rx.longest, longest)
        try:
            dgrams.finish(rx, self._cancel_r)
        except HopDatagramsCancelled:
            raise HopCancelled(f"rank {self.rank} hop datagrams (bucket {h.bucket:#x}, round {h.round})") from None
        if rx is not None:  # what it read of later rounds: their own hops count it (the receiver buffers the data)
            for name, n in rx.others.items():
                self._carried[name] = self._carried.get(name, 0) + n
            while len(self._carried) > 64:  # late ones of finished rounds are never asked for: bounded
                self._carried.popitem(last=False)

    async def _in_thread(self, fn: Callable[[], list[HopResult]]) -> list[HopResult]:
        """``fn`` in a worker thread (trio's thread cache, no task of its own). Cancelling the caller writes the
        cancel pipe, which the hop loop polls, and waits until the thread has let go of the buffers: nothing lands
        in them after this returns."""
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        cancelled = False

        def deliver(result: outcome.Outcome[list[HopResult]]) -> None:  # in the worker thread, when fn is done
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        def abort(_: Any) -> trio.lowlevel.Abort:
            nonlocal cancelled
            cancelled = True
            try:
                os.write(self._cancel_w, b"x")
            except OSError:
                pass
            return trio.lowlevel.Abort.FAILED  # the thread still holds the buffers: wait for it (deliver)

        trio.lowlevel.start_thread_soon(fn, deliver, name="dgt stream exchange")
        try:
            results = await trio.lowlevel.wait_task_rescheduled(abort)
        except HopCancelled:
            results = None
        finally:
            if cancelled:
                self._drain()
        if results is None:  # cancelled: the pending cancellation raises Cancelled at the next checkpoint
            await trio.lowlevel.checkpoint()
            raise PeerClosed(f"rank {self.rank}: a stream exchange was cancelled")
        return results  # type: ignore[no-any-return]

    def _drain(self) -> None:
        try:
            while os.read(self._cancel_r, 64):
                pass
        except OSError:
            pass
