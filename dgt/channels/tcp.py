"""Reliable lane: a non-blocking TCP socket driven by trio's readiness waits.

The socket is a plain stdlib socket in non-blocking mode: every call first tries the syscall and only waits when
the kernel says EAGAIN, so a busy stream costs one syscall per chunk and no event-loop round trip. Connection loss
becomes :class:`PeerClosed`.
"""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
import termios

import trio

from dgt.channels.lanes import LaneSpec
from dgt.channels.sockopts import close_socket, family_of, set_buffers, set_dscp, set_priority, tune_tcp
from dgt.errors import PeerClosed, PeerTimeout

_LOST = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)
RCVLOWAT_MIN = 128 << 10  # payload rests shorter than this are read as they come
RCVLOWAT_MAX = 1 << 20  # wake once at least this much of a large payload is in


class TcpChannel:
    """One connected TCP socket: scatter-gather sends, ``recv_into`` receives, byte counters, last-receive time."""

    def __init__(self, sock: socket.socket, lane: LaneSpec, *, rcvbuf: int | None = None, sndbuf: int | None = None,
                 user_timeout: float | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.lane = lane
        tune_tcp(sock, user_timeout)
        self.dscp_ok = set_dscp(sock, lane.dscp)
        self.priority_ok = set_priority(sock, lane.so_priority)
        self.rcvbuf, self.sndbuf = set_buffers(sock, rcvbuf, sndbuf)
        self.closed = False
        self._rcvlowat = 1
        self.waits = 0
        self.tx_bytes = 0
        self.tx_calls = 0
        self.rx_bytes = 0
        self.rx_calls = 0
        self._last_rx = trio.current_time()
        self._rx_seen = 0
        self.label = "peer"

    def _lost(self, exc: BaseException | None = None) -> PeerClosed:
        why = "the connection was closed" if exc is None else f"the connection failed ({exc})"
        return PeerClosed(f"{self.label}: {why}")

    async def send_buffers(self, bufs: list) -> None:
        """Send every byte of ``bufs`` in order (one sendmsg per kernel-accepted chunk, partial sends resumed)."""
        views = [memoryview(b).cast("B") for b in bufs]
        views = [v for v in views if len(v)]
        while views:
            n = await self._syscall(self.sock.sendmsg, views, trio.lowlevel.wait_writable)
            self.tx_calls += 1
            self.tx_bytes += n
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0

    async def recv_into(self, buf: memoryview, lowat: int = 1) -> int:
        """Receive at least one byte into ``buf``; PeerClosed at end of stream. ``lowat``: should the socket have
        nothing yet, wait until that many bytes are in (SO_RCVLOWAT; end of stream and errors still wake at once)."""
        n = await self._syscall(self.sock.recv_into, buf, trio.lowlevel.wait_readable, lowat)
        if n == 0 and len(buf):
            raise self._lost()
        self.rx_calls += 1
        self.rx_bytes += n
        return n

    @property
    def last_rx(self) -> float:
        """When bytes last came in, as seen by the last look (the liveness check looks every tick): noting the
        time on every read would cost the hot path a clock call per read. Bytes the kernel holds but nobody read
        yet count too: a large payload read waits for a low-water mark, which takes long on a slow link."""
        seen = self.rx_bytes + self._queued()
        if seen != self._rx_seen:
            self._rx_seen = seen
            self._last_rx = trio.current_time()
        return self._last_rx

    def _queued(self) -> int:
        """Bytes in the socket's receive queue (FIONREAD); 0 once closed."""
        if self.closed:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return 0

    async def _syscall(self, call, arg, waiter, lowat: int = 0) -> int:
        """``call(arg)`` on the non-blocking socket, waiting with ``waiter`` until the kernel takes or gives bytes;
        a connection that went away becomes PeerClosed. ``lowat`` (receives): the low-water mark for that wait."""
        while True:
            try:
                return call(arg)
            except BlockingIOError:
                if lowat:
                    self._lowat(lowat)
                await self._wait(waiter)
            except _LOST as exc:
                raise self._lost(exc) from exc
            except OSError as exc:
                if self.closed or exc.errno == errno.EBADF:
                    raise self._lost() from exc
                raise

    async def recv_exactly(self, buf: memoryview) -> None:
        """Fill ``buf``. A large payload raises SO_RCVLOWAT so the socket reports readable only once a good share of
        the rest is in: fewer wake-ups and larger reads. A non-blocking read takes whatever is there regardless of
        the mark, so the mark is only changed before a wait (every wait sets its own)."""
        got = 0
        while got < len(buf):
            got += await self.recv_into(buf[got:], min(len(buf) - got, RCVLOWAT_MAX))

    def _lowat(self, n: int) -> None:
        n = n if n >= RCVLOWAT_MIN else 1
        if n != self._rcvlowat and not self.closed:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
                self._rcvlowat = n
            except OSError:
                pass  # not settable here: plain wake-ups

    async def _wait(self, waiter) -> None:
        if self.closed:
            raise self._lost()
        self.waits += 1  # a wait is a checkpoint: callers that yield for fairness can skip theirs
        try:
            await waiter(self.sock)
        except (trio.ClosedResourceError, OSError) as exc:
            raise self._lost(exc) from exc

    def close(self) -> None:
        """Close the socket, waking any task blocked on it (they see PeerClosed)."""
        if self.closed:
            return
        self.closed = True
        try:
            trio.lowlevel.notify_closing(self.sock)
        except (OSError, ValueError):
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpListener:
    """A listening socket bound to ``host`` (port 0 picks a free port), marked like the reliable lane so that
    accepted connections inherit the marking from their first packet on."""

    def __init__(self, host: str, lane: LaneSpec, port: int = 0, backlog: int = 4096) -> None:
        # backlog: a server rank is dialled by every worker at once (the kernel caps it at net.core.somaxconn)
        fam = family_of(host)
        sock = socket.socket(fam, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            set_dscp(sock, lane.dscp)
            set_priority(sock, lane.so_priority)
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.lane = lane
        self.closed = False

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    async def accept(self) -> socket.socket:
        while True:
            try:
                conn, _ = self.sock.accept()
                return conn
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
            except (ConnectionAbortedError, InterruptedError):
                continue

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            close_socket(self.sock)


async def dial(host: str, port: int, lane: LaneSpec, timeout: float) -> socket.socket:
    """Connect within ``timeout`` seconds, retrying refused connections (the peer may still be starting);
    PeerTimeout when the peer never accepts. The socket is marked before connect so even the SYN carries the DSCP."""
    fam = family_of(host)
    delay = 0.01
    with trio.move_on_after(timeout):
        while True:
            sock = socket.socket(fam, socket.SOCK_STREAM)
            set_dscp(sock, lane.dscp)
            set_priority(sock, lane.so_priority)
            sock.setblocking(False)
            try:
                err = sock.connect_ex((host, port))
                if err in (errno.EINPROGRESS, errno.EAGAIN):
                    await trio.lowlevel.wait_writable(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err == 0:
                    return sock
            except BaseException:
                sock.close()
                raise
            sock.close()
            if err not in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EHOSTUNREACH):
                raise OSError(err, f"connect to {host}:{port}: {errno.errorcode.get(err, err)}")
            await trio.sleep(delay)
            delay = min(delay * 2, 0.25)
    raise PeerTimeout(f"could not connect to {host}:{port} within {timeout:g} s")
