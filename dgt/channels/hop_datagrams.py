"""The datagrams of a lossy ring hop, sent and read in the stream exchange's worker thread (no trio).

A split ring hop (:mod:`dgt.transport.lossy_hop`) carries its important blocks on the stream lane and the rest
as one DGT round of datagrams. Driven from trio, that round cost more than its bytes: the link's reader for its
opening and closing frames, the UDP ingress, the datagram scheduler and their wake-ups, ~9 ms of the ~20 ms a
4-rank 25 MB call spends on the trio thread (issue 26, docs/history/transport-journal.md). Here the worker thread
that runs the hop's stream messages also runs its datagrams, on the endpoint's hop socket (one UDP socket of its own,
which trio never reads):

- the send half (:class:`DatagramSend`): the round's datagrams, packed on the trio side (headers, payloads, MAC
  trailers), handed to the kernel one GSO batch at a time from a pacer thread while the hop's stream messages
  travel, at the pacer's rate (a token bucket of its own, started from the pacer's tokens; the trio side charges
  the pacer afterwards with what left when), and the time those messages took (``window``, the send budget's);
- the receive half (:class:`DatagramRecv`): GRO reads into one buffer, from the peer's hop socket only, until every
  datagram the round announced is in or the round's deadline passes: the receiver's deadline policy evaluated on
  the arrivals as they come, from the moment the hop's stream messages (the important blocks) are in.

Nothing is interpreted here beyond the 12 header bytes that name a round, so that a late datagram of an earlier
round does not count as this one's. The trio side feeds the reads, with their arrival times, to the sans-IO
receiver, which checks, authenticates (MAC), lands and closes the round like any other
(:meth:`dgt.transport.hop_round.HopRounds.land`). Memory is bounded by the buffer the caller sized
from the round's geometry, whatever a header or a peer says: reads stop when it is full.
"""

from __future__ import annotations

import errno
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dgt.channels.sockopts import GSO_UNSUPPORTED, SOL_UDP, UDP_GRO, gso_cmsg
from dgt.channels.udp import read_sizes
from dgt.protocol.deadline import DeadlineState
from dgt.protocol.pacing import TokenBucket

SLOT = 1 << 16  # room for one read: a GRO run is at most 64 KiB
_ANC = socket.CMSG_SPACE(4) * 2
_MSG_TRUNC = int(socket.MSG_TRUNC)
NAME = slice(16, 28)  # the header bytes that name a round: rank, round, bucket (dgt.wire.HEADER_DTYPE)
SCHEDSTAT = "/proc/thread-self/schedstat"


def runqueue_seconds(path: str = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (the kernel's schedstat, second field);
    None where the kernel does not keep it (not Linux, schedstats off): the CPU gate then never closes."""
    try:
        with open(path, "rb") as f:
            fields = f.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class HopDatagramsCancelled(Exception):
    """The cancel fd fired while the hop's datagrams were under way."""


@dataclass
class DatagramSend:
    """A round's datagrams to send: ``rows`` ``[k, seg]`` uint8 (packed), then ``odd`` (shorter ones), to ``addr``
    at ``rate`` bytes/s (a bucket of ``burst`` bytes holding ``tokens`` at the start). Filled in by
    :class:`HopDatagrams`: ``sends`` (``time.perf_counter()`` when the call started, datagrams, bytes) per send call,
    ``window``."""

    rows: np.ndarray
    odd: list[bytes]
    addr: tuple[str, int]
    rate: float
    burst: int
    tokens: float
    segments: int = 64  # datagrams per GSO call
    gso: bool = True
    limit: float = 10.0  # seconds: what is not sent by then is abandoned (a pacer slowed to a crawl)
    sends: list[tuple[float, int, int]] = field(default_factory=list)
    sent: int = 0
    sent_bytes: int = 0
    errors: int = 0  # datagrams a send error kept from leaving
    abandoned: int = 0
    window: float | None = None  # seconds from the hop's start (its first datagrams) until its stream messages ended

    @property
    def total(self) -> int:
        return len(self.rows) + len(self.odd)


@dataclass
class DatagramRecv:
    """Where a round's datagrams land: ``buf`` (uint8, sized by the caller from the round's geometry), from
    ``addr`` only; ``name``: the 12 header bytes of the round's datagrams; ``expect``: how many the round announced;
    ``deadline``: the receiver's policy (a copy). Filled in by :class:`HopDatagrams`: ``reads`` (start, bytes,
    segment size) per read; ``drains`` (reads so far, ``time.perf_counter()``) per pass that emptied the socket, a
    batch for the receiver; ``imp_at``/``closed_at``: when the important blocks were in, when it stopped waiting."""

    buf: np.ndarray
    addr: tuple[str, int]
    name: bytes
    expect: int
    deadline: Callable[[DeadlineState], float]
    reads: list[tuple[int, int, int]] = field(default_factory=list)
    drains: list[tuple[int, float]] = field(default_factory=list)
    pos: int = 0
    got: int = 0  # datagrams of this round
    imp_at: float = 0.0
    closed_at: float | None = None
    last: float | None = None
    mean_gap: float | None = None
    batch_gap: float | None = None
    stale: int = 0  # datagrams of other rounds (late ones of an earlier round, early ones of the next)
    others: dict[bytes, int] = field(default_factory=dict)  # those, by the 12 header bytes of their round
    longest: float = float("inf")  # the most to wait whatever the policy says (the next hop's peer waits meanwhile)
    # the most the peer this hop sends to waits for its datagrams after its important blocks (the policy's longest,
    # its peer runs the same): the send half abandons what it still holds past that (HopDatagrams.finish)
    peer_wait: float = float("inf")
    strangers: int = 0  # datagrams from another address (dropped)
    truncated: int = 0
    full: bool = False  # the buffer filled up before the round did

    def state(self) -> DeadlineState:
        left = max(self.expect - self.got, 0)
        return DeadlineState(self.imp_at, self.last, self.mean_gap, left, self.batch_gap, None)


class HopDatagrams:
    """One hop's datagrams on the hop socket ``sock`` (non-blocking). :meth:`start`, as the hop's stream messages
    start: the pacer thread sends what the tokens allow at once and the rest at the pacer's rate while the messages
    travel (the native loop releases the GIL), as the round's datagrams travelled beside its important blocks on the
    session link. :meth:`finish`, once the messages are in: the receive half until its
    round closed, then the send half's end."""

    COALESCE = 0.0005  # seconds between reads while a round's datagrams trickle in: a few per wake-up, not one

    def __init__(self, sock: socket.socket, tx: DatagramSend | None, pacer: PacerThread,
                 clock: Callable[[], float] = time.perf_counter, cpu_wait: bool = True) -> None:
        self.sock, self.tx, self.clock, self.thread = sock, tx, clock, pacer
        self.t0 = clock()
        # (this thread carries the hop's stream messages) its runqueue wait from here until they are done: ``queued``
        # seconds of ``span`` (the CPU gate's reading, dgt.protocol.cpu_gate); None where the kernel keeps none, or
        # not read (``cpu_wait`` False: no gate to feed)
        self._queued0 = runqueue_seconds() if cpu_wait else None
        self.queued: float | None = None
        self.span = 0.0
        self.pacer = None if tx is None else TokenBucket(tx.rate, tx.burst, self.t0)
        if tx is not None and self.pacer is not None:
            self.pacer.tokens = min(float(tx.burst), tx.tokens)
        self.row = self.odd = 0
        self.stop = False
        self.cutoff = float("inf")  # (clock) what the send half still holds then is abandoned (see finish)
        self._wake = threading.Event()  # wakes a pacing sleep: stop, or a new cutoff
        self.error: BaseException | None = None
        self._done: threading.Event | None = None  # set once the pacer thread is done with this hop

    def _sending(self) -> bool:
        tx = self.tx
        return not self.stop and tx is not None and (self.row < len(tx.rows) or self.odd < len(tx.odd))

    def start(self) -> None:
        """Hand the datagrams to the pacer thread (see the class docstring): it sends what the tokens cover at once
        and the rest at the pacer's rate, while this thread sends the hop's stream messages. (Sending the burst here
        first held the important blocks back by its send calls, ~0.2-0.5 ms a hop.)"""
        if self._sending():
            self._done = self.thread.submit(self._paced)

    def _next_call(self) -> int:
        """The bytes the next send call carries when the tokens allow: a full GSO batch of rows, or an odd one."""
        tx = self.tx
        assert tx is not None
        if self.row < len(tx.rows):
            return min(tx.segments if tx.gso else 1, len(tx.rows) - self.row) * tx.rows.shape[1]
        return len(tx.odd[self.odd])

    def _paced(self) -> None:
        tx, pacer, clock = self.tx, self.pacer, self.clock
        assert tx is not None and pacer is not None
        try:
            while self._sending():
                now = clock()
                end = min(self.t0 + tx.limit, self.cutoff)
                if now > end:
                    tx.abandoned += len(tx.rows) - self.row + len(tx.odd) - self.odd
                    return
                short = min(self._next_call(), pacer.burst) - pacer.available(now)
                if short > 0:  # a whole GSO call at a time: one wake-up and one system call per batch, not per datagram
                    if self._wake.wait(min(short / pacer.rate, end - now)):  # stop or a cutoff wakes it at once
                        self._wake.clear()  # (stop and cutoff are set before the wake-up, read after this)
                    continue
                self.row, self.odd = _send_some(self.sock, tx, pacer, self.row, self.odd, now)
        except BaseException as exc:  # the caller raises it (finish)
            self.error = exc

    def finish(self, rx: DatagramRecv | None, cancel_fd: int = -1) -> None:
        """(Called once the hop's stream messages are done: the send half's ``window`` is the time they took.)
        The receive half until it closed: every datagram the round announced is in, its deadline passed (from
        now: the important blocks are in), or the buffer is full; then the send half's end (sent, or abandoned after
        ``tx.limit`` seconds, or once the peer's round must have closed: ``rx.peer_wait``). HopDatagramsCancelled when
        the cancel fd fires (the send half stops too).

        The peer's deadline starts when its important blocks are in: about when this rank's were (``rx.imp_at``, the
        hop's stream messages in both directions are done), later if the peer's own messages took longer, hence the
        slack of one more transfer time (``tx.window``, what this hop's messages took) after its longest wait. A pacer
        slowed to a crawl (a fixed low ``pace_rate``, no send budget) held the hop, and through it the whole ring,
        until ``tx.limit`` for datagrams its peer no longer takes."""
        self.span = self.clock() - self.t0
        q0 = self._queued0
        q1 = None if q0 is None else runqueue_seconds()
        self.queued = None if q0 is None or q1 is None else q1 - q0
        if self.tx is not None:
            self.tx.window = self.span
        try:
            if rx is not None:
                self._receive(rx, cancel_fd)
                if self.tx is not None and rx.peer_wait < float("inf"):
                    self.cutoff = rx.imp_at + min(rx.peer_wait, rx.longest) + (self.tx.window or 0.0)
                    self._wake.set()
            while self._done is not None and not self._done.wait(0.002):
                _wait(None, cancel_fd, 0.0)
        finally:
            self.stop = True
            self._wake.set()  # a pacing sleep ends now, not when its tokens would have come
            if self._done is not None:
                self._done.wait()
        if self.error is not None:
            raise self.error

    def _receive(self, rx: DatagramRecv, cancel_fd: int) -> None:
        clock = self.clock
        rx.imp_at = clock()
        while True:
            _drain(self.sock, rx, clock)
            now = clock()
            due = now if rx.got >= rx.expect or rx.full else min(rx.deadline(rx.state()), rx.imp_at + rx.longest)
            if now >= due:
                rx.closed_at = now
                return
            if rx.got:  # they are coming: let a few gather (the kernel holds them) before the next wake-up
                time.sleep(min(self.COALESCE, due - now))
            _wait(self.sock, cancel_fd, max(due - clock(), 0.0))


class PacerThread:
    """A daemon thread for hops' paced sends (made on first use): a hop hands it its send loop (:meth:`submit`)
    instead of starting a thread of its own each time. A stream hub owns one and runs one exchange at a time, so
    jobs never wait behind each other; :meth:`close` ends the thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        """Run ``fn`` on the pacer thread; the event is set once it returned (it catches its own errors)."""
        done = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="dgt hop pacer", daemon=True)
                self._thread.start()
        self._jobs.put((fn, done))
        return done

    def close(self) -> None:
        """The thread ends once the jobs before this call are done (a later submit starts a new one)."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread = None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                fn()
            finally:
                done.set()


def _send_some(sock: socket.socket, tx: DatagramSend, pacer: TokenBucket, row: int, odd: int,
               now: float) -> tuple[int, int]:
    """One send call: a GSO batch of rows (as many as the segments and the tokens allow, at least one), else the
    next odd datagram. Returns the new positions."""
    k, seg = tx.rows.shape if len(tx.rows) else (0, 1)
    if row < k:
        n = min(tx.segments if tx.gso else 1, k - row, max(int(pacer.available(now) // seg), 1))
        done = _send_call(sock, tx, pacer, memoryview(tx.rows[row : row + n]).cast("B"), n, seg, now)
        return row + (n if done else 0), odd
    d = tx.odd[odd]
    return row, odd + (1 if _send_call(sock, tx, pacer, d, 1, len(d), now) else 0)


def _send_call(sock: socket.socket, tx: DatagramSend, pacer: TokenBucket, data: memoryview | bytes, n: int,
               seg: int, now: float) -> bool:
    """``n`` datagrams of ``seg`` bytes in one call (GSO when more than one): whether they are done with (sent, or
    lost to an error a datagram may meet); False to try again (a full socket; GSO refused, now off)."""
    try:
        if n > 1:
            sock.sendmsg([data], gso_cmsg(seg), 0, tx.addr)
        else:
            sock.sendto(data, tx.addr)
    except BlockingIOError:
        _wait_writable(sock)
        return False
    except OSError as exc:
        if exc.errno in GSO_UNSUPPORTED and n > 1:
            tx.gso = False  # this path cannot segment: one datagram per call from here on
            return False
        if not _passing(exc, tx, n):
            raise
        return True
    tx.sends.append((now, n, n * seg))
    pacer.consume(n * seg, now)
    tx.sent += n
    tx.sent_bytes += n * seg
    return True


def _passing(exc: OSError, tx: DatagramSend, n: int) -> bool:
    """Errors ``n`` datagrams may meet without ending the hop (not sent, so lost; error feedback carries them): an
    ICMP error from an earlier datagram, a full device queue. They count in ``tx.errors``, not in ``tx.sent``."""
    if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENOBUFS):
        tx.errors += n
        return True
    return False


def _drain(sock: socket.socket, rx: DatagramRecv, clock: Callable[[], float]) -> None:
    """Read what the socket holds (while the buffer has room for a read); count this round's datagrams (one numpy
    pass over the new reads) and keep the arrival statistics the deadline policy reads (as the receiver's landing
    keeps them)."""
    n0 = len(rx.reads)
    mv = memoryview(rx.buf)
    while rx.pos + SLOT <= len(rx.buf):
        try:
            n, anc, flags, addr = sock.recvmsg_into([mv[rx.pos : rx.pos + SLOT]], _ANC)
        except BlockingIOError:
            break
        except (ConnectionRefusedError, ConnectionResetError):
            continue  # ICMP errors for our own earlier sends
        seg = n
        for level, kind, data in anc:
            if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
                seg = int.from_bytes(data[:4], sys.byteorder) or n
        if flags & _MSG_TRUNC:
            rx.truncated += -(-n // seg) if n else 1
            continue
        if (addr[0], addr[1]) != rx.addr:
            rx.strangers += -(-n // seg) if n else 1
            continue
        rx.reads.append((rx.pos, n, seg))
        rx.pos += n
    else:
        rx.full = True
    if len(rx.reads) == n0:
        return
    now = clock()
    total, k, others = _count(rx.buf, rx.reads[n0:], rx.name)
    rx.got += k
    rx.stale += total - k
    for name, n in others.items():
        rx.others[name] = rx.others.get(name, 0) + n
    if k:
        if rx.last is not None:
            span = max(now - rx.last, 0.0)
            rx.mean_gap = span / k if rx.mean_gap is None else 0.8 * rx.mean_gap + 0.2 * span / k
            rx.batch_gap = span if rx.batch_gap is None else 0.8 * rx.batch_gap + 0.2 * span
        rx.last = now
    rx.drains.append((len(rx.reads), now))


def _count(buf: np.ndarray, reads: list[tuple[int, int, int]], name: bytes) -> tuple[int, int, dict[bytes, int]]:
    """(datagrams, those naming the round ``name``, the others by the round they name) in ``reads`` ((start, bytes,
    segment size) each, laid back to back; the last datagram of a read shorter): every header's bytes 16-28 compared
    in one numpy step."""
    sizes = read_sizes([r[1] for r in reads], [r[2] for r in reads])
    starts = reads[0][0] + np.cumsum(sizes) - sizes
    starts = starts[sizes >= NAME.stop]  # room for a name (else: not ours)
    heads = buf[starts[:, None] + np.arange(NAME.start, NAME.stop)]
    mine = (heads == np.frombuffer(name, np.uint8)).all(axis=1)
    k = int(mine.sum())
    others: dict[bytes, int] = {}
    if k < len(heads):  # rare: late ones of an earlier round, or early ones of the next
        names, n = np.unique(np.ascontiguousarray(heads[~mine]).view(f"V{NAME.stop - NAME.start}"), return_counts=True)
        others = {bytes(v): int(c) for v, c in zip(names, n)}
    return len(sizes), k, others


def _wait(sock: socket.socket | None, cancel_fd: int, timeout: float) -> None:
    """Until ``sock`` is readable (if given), the cancel fd fires, or ``timeout`` seconds passed."""
    poller = select.poll()
    if sock is not None:
        poller.register(sock.fileno(), select.POLLIN)
    if cancel_fd >= 0:
        poller.register(cancel_fd, select.POLLIN)
    ms = int(timeout * 1000 + 0.999) if timeout != float("inf") else 1000
    for fd, ev in poller.poll(max(ms, 0)):
        if fd == cancel_fd and ev & select.POLLIN:
            raise HopDatagramsCancelled()


def _wait_writable(sock: socket.socket) -> None:
    select.select([], [sock], [], 0.005)
