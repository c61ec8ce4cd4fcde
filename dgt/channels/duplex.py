"""One full-duplex hop on stream lanes: send a message to one peer while receiving the expected one from another.

A ring hop is the hot loop of a lossless all-reduce: it moves megabytes per call through two sockets at once, and in
Python the work per system call costs about as much as the copy the kernel makes. So the loop comes in two twins
with one contract: ``_duplex.c`` (built at install when a C compiler is there; it releases the GIL for the whole
hop) and :func:`duplex_py` (pure Python, the fallback and the reference the native one is tested against). Both run
in a worker thread, never on the trio loop: they block in ``poll``.

Contract: the message is ``header + payload``; the receive expects exactly ``expect`` (the header the sender will
write, derived from both sides' shared state) followed by ``len(land)`` bytes. A different header is a protocol
error: the two ranks disagree on which message comes next, which only happens when they issued collectives in
different orders. ``add_src`` (float32): the payload is added to it on arrival, ``land = add_src + received``, a
stretch at a time through ``scratch`` while it is still in cache, instead of landing first and being added after.
Memory is bounded by the caller's buffers whatever a header says: the receiver never sizes anything from it.
"""

from __future__ import annotations

import errno
import select
import socket
import time

import numpy as np

from dgt import wire
from dgt.errors import PeerClosed, PeerTimeout, RankMismatch, op_mismatch, shape_mismatch

try:
    from dgt.channels import _duplex
except ImportError:  # built without a C compiler: the Python twin carries the hops
    _duplex = None

NATIVE = _duplex is not None
LOWAT_MIN = 128 << 10  # as in _duplex.c: payload rests shorter than this are read as they come
LOWAT_MAX = 1 << 20
SCRATCH_BYTES = 256 << 10  # add mode: received bytes are summed in stretches of this size (fits L2)


class HopCancelled(Exception):
    """The cancel fd fired: the caller gave up on the hop (its stream lane is now mid-message)."""


class _PyHop:
    """What one :func:`duplex_py` call has sent and received so far, and where the next received bytes go."""

    def __init__(self, send: socket.socket | None, header: bytes, payload, recv: socket.socket | None, expect: bytes,
                 land, add_src, scratch) -> None:
        out = [memoryview(header).cast("B"), memoryview(payload).cast("B")] if send is not None else []
        self.out = [v for v in out if len(v)]
        self.recv, self.expect = recv, expect
        self.land_b = memoryview(land).cast("B")
        self.rtot = len(expect) + len(self.land_b) if recv is not None else 0
        self.hdr = bytearray(len(expect))
        self.got = self.sent = self.pend = self.added = 0
        self.add = add_src is not None
        if self.add:
            self.src = np.frombuffer(add_src, np.float32)
            self.dst = np.frombuffer(self.land_b, np.float32)
            self.scr_b = memoryview(scratch).cast("B")
            self.scr = np.frombuffer(self.scr_b, np.uint8)

    def receive(self) -> tuple[bool, int]:
        """One read into the header, the scratch stretch (add mode) or the landing buffer: (progress, error code:
        -EPIPE at end of stream, -EPROTO for a header that is not the expected one, else 0)."""
        n_exp, before = len(self.expect), self.got
        assert self.recv is not None
        try:
            if before < n_exp:
                k = self.recv.recv_into(memoryview(self.hdr)[before:])
            elif self.add:
                k = self.recv.recv_into(self.scr_b[self.pend:], min(len(self.scr_b) - self.pend, self.rtot - before))
            else:
                k = self.recv.recv_into(self.land_b[before - n_exp:])
        except BlockingIOError:
            return False, 0
        if k == 0:
            return False, -errno.EPIPE
        self.got += k
        if before < n_exp <= self.got and bytes(self.hdr) != bytes(self.expect):
            return True, -errno.EPROTO
        if self.add and before >= n_exp:
            self.pend += k
            if self.pend == len(self.scr_b) or self.got == self.rtot:
                self.added, self.pend = _fold(self.src, self.scr, self.dst, self.added, self.pend)
        return True, 0

    def left(self) -> int:
        """The bytes the next read may take (in add mode, at most the rest of the scratch stretch)."""
        left = self.rtot - self.got
        if self.got < self.rtot and self.add and self.got >= len(self.expect):
            left = min(left, len(self.scr_b) - self.pend)
        return left


def duplex_py(send: socket.socket | None, header: bytes, payload, recv: socket.socket | None, expect: bytes,
              land, add_src, scratch, timeout: float, cancel_fd: int = -1) -> tuple[int, int, int, bytes]:
    """The Python twin of ``_duplex.duplex``: same arguments (sockets instead of fds, ``timeout`` in seconds),
    same ``(code, sent, received, header)`` result."""
    hop = _PyHop(send, header, payload, recv, expect, land, add_src, scratch)
    lowat, last, code = 1, time.monotonic(), 0
    try:
        while hop.out or hop.got < hop.rtot:
            progress = False
            if hop.out:
                n = _send_some(send, hop.out)
                if n >= 0:
                    hop.sent += n
                    progress = True
            if hop.got < hop.rtot:
                moved, code = hop.receive()
                if code:
                    break
                progress = progress or moved
            if progress:
                last = time.monotonic()
                continue
            wait = last + timeout - time.monotonic()
            if wait <= 0:
                code = -errno.ETIMEDOUT
                break
            cancelled, lowat = _poll(send if hop.out else None, recv if hop.got < hop.rtot else None, hop.left(),
                                     lowat, cancel_fd, wait)
            if cancelled:
                code = -errno.ECANCELED
                break
    except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as exc:
        code = -exc.errno
    except OSError as exc:
        code = -(exc.errno or errno.EIO)
    finally:
        if lowat != 1:
            try:
                recv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass
    return code, hop.sent, hop.got, bytes(hop.hdr[: min(hop.got, len(expect))])


def _send_some(send: socket.socket, out: list[memoryview]) -> int:
    """One ``sendmsg`` of what is left; drops the views (or their heads) it sent. -1 when the socket is full."""
    try:
        n = sent = send.sendmsg(out)
    except BlockingIOError:
        return -1
    while n:
        k = min(n, len(out[0]))
        n -= k
        out[0] = out[0][k:]
        if not len(out[0]):
            out.pop(0)
    return sent


def _fold(src: np.ndarray, scr: np.ndarray, dst: np.ndarray, added: int, pend: int) -> tuple[int, int]:
    """Add the whole float32s received into the scratch so far to ``src`` into ``dst``; the tail of a split float
    moves to the front of the scratch. Returns the new (added, pending) byte counts."""
    whole = pend & ~3
    a = added // 4
    np.add(src[a : a + whole // 4], scr[:whole].view(np.float32), out=dst[a : a + whole // 4])
    scr[: pend - whole] = scr[whole:pend]
    return added + whole, pend - whole


def _poll(send: socket.socket | None, recv: socket.socket | None, left: int, lowat: int, cancel_fd: int,
          wait: float) -> tuple[bool, int]:
    """Wait up to ``wait`` seconds for the send socket to take more, ``recv`` to hold enough of the ``left`` bytes
    (SO_RCVLOWAT, so a big rest wakes once, not per segment) or the cancel fd. Returns (cancelled, lowat now)."""
    events: dict[int, int] = {}  # one registration per fd: both neighbours may be one socket
    if send is not None:
        events[send.fileno()] = select.POLLOUT
    if recv is not None:
        want = min(left, LOWAT_MAX) if left >= LOWAT_MIN else 1
        if want != lowat:
            recv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            lowat = want
        events[recv.fileno()] = events.get(recv.fileno(), 0) | select.POLLIN
    if cancel_fd >= 0:
        events[cancel_fd] = select.POLLIN
    poller = select.poll()
    for fd, ev in events.items():
        poller.register(fd, ev)
    for fd, ev in poller.poll(wait * 1000):
        if fd == cancel_fd and ev & select.POLLIN:
            return True, lowat
    return False, lowat


def describe(header: bytes) -> str:
    """A BULK header in words (which message a rank sent), for protocol errors."""
    if len(header) < wire.HEADER_SIZE:
        return f"{len(header)} header bytes"
    try:
        h = wire.decode_header(header)
    except Exception as exc:  # not even a header: say so
        return f"an invalid header ({exc})"
    return f"rank {int(h['rank'])}'s message {int(h['bucket']):#x} round {int(h['round'])} ({int(h['length'])} bytes)"


def _message_id(header: bytes) -> tuple[int, int] | None:
    """(bucket, round) a BULK header names; None if it is no valid header."""
    try:
        h = wire.decode_header(header)
    except Exception:
        return None
    return int(h["bucket"]), int(h["round"])


def duplex(send: socket.socket | None, header: bytes, payload, recv: socket.socket | None, expect: bytes, land,
           add_src=None, scratch=None, *, timeout: float, cancel_fd: int = -1, native: bool = NATIVE,
           label: str = "stream", split: bool = False) -> tuple[int, int]:
    """Run one hop to completion (blocking; call it from a worker thread). Returns (bytes sent, bytes received),
    headers included. PeerClosed, PeerTimeout (no progress for ``timeout`` s), ProtocolError (another message than
    ``expect`` came), :class:`HopCancelled`."""
    if add_src is not None and scratch is None:
        raise ValueError("add mode needs a scratch buffer")
    if recv is None:
        land, expect = bytearray(), b""
    for sock, what in ((send, "send"), (recv, "receive")):
        # fd -1 means "no such side" to the native loop: a closed socket must fail here, not skip its half
        if sock is not None and sock.fileno() < 0:
            raise PeerClosed(f"{label}: the {what} connection is closed")
    if native:
        if _duplex is None:
            raise RuntimeError("dgt was installed without its native hop loop (no C compiler at install time)")
        code, sent, got, hdr = _duplex.duplex(-1 if send is None else send.fileno(), header, payload,
                                              -1 if recv is None else recv.fileno(), expect, land, add_src, scratch,
                                              max(1, int(timeout * 1000)), cancel_fd, split)
    else:
        code, sent, got, hdr = duplex_py(send, header, payload, recv, expect, land, add_src, scratch, timeout,
                                         cancel_fd)
    if code == 0:
        return sent, got
    if code == -errno.ECANCELED:
        raise HopCancelled(label)
    if code == -errno.EPROTO:
        mid, want = _message_id(hdr), _message_id(expect)
        same = mid is not None and mid == want
        if mid is not None and want is not None and hdr[6] and expect[6] and hdr[6] != expect[6]:  # the codec byte
            # the call's op or codec differs: the peer may be on another message of the call (a lossy hop's mask
            # message against a dense hop), so this is checked first; the reason is the same on both ranks
            raise RankMismatch(op_mismatch(hdr[6], expect[6], min(mid[1], want[1])))
        seen = f"{label}: expected {describe(expect)}, got {describe(hdr)}"
        if mid is not None and same:  # the reason every rank gives, whichever saw it; what this one saw: the detail
            raise RankMismatch(shape_mismatch(mid[1]), detail=seen)
        raise RankMismatch(f"{seen}: the ranks issued collectives in different orders")
    if code == -errno.ETIMEDOUT:
        raise PeerTimeout(f"{label}: no progress for {timeout:g} s (sent {sent}, received {got} bytes)")
    if code in (-errno.EPIPE, -errno.ECONNRESET, -errno.ECONNABORTED, -errno.ENOTCONN, -errno.EBADF):
        exc = PeerClosed(f"{label}: the connection was closed mid-message (sent {sent}, received {got} bytes)")
        exc.mid_hop = True  # a peer that saw a mismatch shuts its lanes before its ABORT arrives (collectives wait)
        raise exc
    raise OSError(-code, f"{label}: {errno.errorcode.get(-code, -code)}")
