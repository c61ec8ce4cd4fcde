"""Unreliable lane: a non-blocking UDP socket with GSO sends and GRO receives where the kernel supports them.

Sends take rows of an equal-size datagram array (what the sans-IO sender produces) and hand up to
``max_segments`` of them to the kernel in one ``sendmsg`` with a UDP_SEGMENT cmsg; without GSO each datagram is
its own ``sendmsg``. Receives drain the socket into one preallocated buffer with ``recvmsg_into`` (a GRO read
carries many datagrams plus their segment size) and return the datagram sizes, ready for ``wire.decode_datagrams``.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import trio

from dgt.channels.lanes import LaneSpec
from dgt.channels.sockopts import (
    GSO_MAX_BYTES,
    GSO_UNSUPPORTED,
    SO_RXQ_OVFL,
    SOL_UDP,
    UDP_GRO,
    close_socket,
    enable_gro,
    enable_rxq_ovfl,
    family_of,
    gso_cmsg,
    probe_gso,
    set_buffers,
    set_dscp,
    set_priority,
    socket_drops,
)
from dgt.protocol.datagram_rows import DatagramRows

SLOT = 1 << 16  # room for one read: a GRO run is at most 64 KiB, a plain datagram at most 65507 bytes
_ANC = socket.CMSG_SPACE(4) * 2
_MSG_TRUNC = int(socket.MSG_TRUNC)  # a plain int: the enum's & costs microseconds per read


@dataclass
class UdpCounters:
    tx_datagrams: int = 0
    tx_bytes: int = 0
    tx_calls: int = 0
    tx_gso_calls: int = 0
    tx_errors: int = 0
    rx_datagrams: int = 0
    rx_bytes: int = 0
    rx_calls: int = 0
    rx_gro_reads: int = 0  # reads that returned more than one datagram
    rx_unknown_source: int = 0
    rx_truncated: int = 0
    rx_kernel_drops: int = 0  # SO_RXQ_OVFL: dropped by the kernel for a full receive buffer


def read_sizes(nbytes: list[int], segs: list[int]) -> np.ndarray:
    """Per-datagram sizes of reads laid back to back (``nbytes`` each, GRO segment size ``segs``): each read is
    full segments plus a shorter last one (vectorised)."""
    if not nbytes:
        return np.zeros(0, np.int64)
    n = np.asarray(nbytes, np.int64)
    seg = np.maximum(np.asarray(segs, np.int64), 1)
    count = np.maximum(-(-n // seg), 1)
    sizes = np.repeat(seg, count)
    sizes[np.cumsum(count) - 1] = n - (count - 1) * seg
    return sizes


def merged(a: UdpCounters, b: UdpCounters) -> UdpCounters:
    """Two sockets' counters as one lane's (the kernel drop count: the larger)."""
    out = UdpCounters(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(UdpCounters)})
    out.rx_kernel_drops = max(a.rx_kernel_drops, b.rx_kernel_drops)
    return out


class UdpChannel:
    """One UDP socket of an unreliable lane; sends to any peer, receives from the peers ``accept`` admits."""

    def __init__(self, host: str, lane: LaneSpec, *, gso: bool = True, gro: bool = True, rcvbuf: int | None = None,
                 sndbuf: int | None = None, max_segments: int = 64, batch_bytes: int = 4 << 20, port: int = 0) -> None:
        sock = socket.socket(family_of(host), socket.SOCK_DGRAM)
        try:
            sock.bind((host, port))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.lane = lane
        self.dscp_ok = set_dscp(sock, lane.dscp)
        self.priority_ok = set_priority(sock, lane.so_priority)
        self.rcvbuf, self.sndbuf = set_buffers(sock, rcvbuf, sndbuf)
        self.gso = gso and probe_gso(sock)
        self.gro = gro and enable_gro(sock)
        self.rxq_ovfl = enable_rxq_ovfl(sock)
        self.max_segments = max(1, max_segments)
        self.buf = bytearray(max(batch_bytes, 2 * SLOT))
        self.mv = memoryview(self.buf)
        self.counters = UdpCounters()
        self._stage: np.ndarray | None = None  # flat uint8 staging buffer for DatagramRows sends, reused
        self.closed = False

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def kernel_drops(self) -> int:
        """Datagrams dropped by the kernel for a full receive buffer, as of now."""
        now = None if self.closed else socket_drops(self.sock)
        if now is not None:
            self.counters.rx_kernel_drops = max(self.counters.rx_kernel_drops, now)
        return self.counters.rx_kernel_drops

    def segments_per_send(self, segment: int) -> int:
        """How many datagrams of ``segment`` bytes one send call carries."""
        if not self.gso:
            return self.max_segments
        return max(1, min(self.max_segments, GSO_MAX_BYTES // max(segment, 1)))

    # -- sending
    async def send_rows(self, rows: np.ndarray | DatagramRows, addr: tuple) -> None:
        """Send the datagrams ``rows`` (k of them, each ``seg`` bytes) to ``addr``: a [k, seg] uint8 array, or
        :class:`DatagramRows` (headers + views of the bucket), packed for the whole batch with one vectorised gather
        (and one MAC pass) into a staging buffer this channel reuses from send to send, then handed to the kernel
        ``segments_per_send`` at a time (one GSO ``sendmsg`` each; without GSO one ``sendmsg`` per datagram). A
        batch of several GSO sends costs one pack and one Python call, not one per 64 KiB."""
        k = len(rows)
        if k == 0:
            return
        seg = rows.shape[1]
        if not isinstance(rows, DatagramRows):
            await self._send_packed(rows, k, seg, addr)
            return
        stage, self._stage = self._stage, None  # taken while the send awaits: a concurrent send gets its own
        need = max(k, self.segments_per_send(seg)) * seg
        if stage is None or stage.size < need:
            stage = np.empty(need, np.uint8)
        try:
            await self._send_packed(rows.pack(stage[:need].reshape(-1, seg)), k, seg, addr)
        finally:
            self._stage = stage

    async def _send_packed(self, rows: np.ndarray, k: int, seg: int, addr: tuple) -> None:
        per = self.segments_per_send(seg)
        pos = 0
        if self.gso and k > 1:
            flat = memoryview(np.ascontiguousarray(rows[:k])).cast("B")
            anc = gso_cmsg(seg)
            try:
                while pos < k:
                    n = min(per, k - pos)
                    if n > 1:
                        await self._sendmsg(flat[pos * seg : (pos + n) * seg], anc, addr)
                        self.counters.tx_gso_calls += 1
                    else:
                        await self._sendmsg(flat[pos * seg : (pos + 1) * seg], None, addr)
                    self.counters.tx_datagrams += n
                    pos += n
                return
            except OSError as exc:
                if exc.errno not in GSO_UNSUPPORTED:
                    raise
                self.gso = False  # this path cannot segment: fall back for good, from the datagram it failed on
        for i in range(pos, k):
            await self._sendmsg(memoryview(rows[i]), None, addr)
            self.counters.tx_datagrams += 1

    async def send_datagram(self, data: bytes | memoryview, addr: tuple) -> None:
        await self._sendmsg(memoryview(data).cast("B"), None, addr)
        self.counters.tx_datagrams += 1

    async def _sendmsg(self, data: memoryview, anc, addr: tuple) -> None:
        while True:
            try:
                if anc:
                    self.sock.sendmsg([data], anc, 0, addr)
                else:
                    self.sock.sendto(data, addr)
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_writable)
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # qdisc/device queue full: back off briefly, then retry
                    await trio.sleep(0.0005)
                    continue
                if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    # an ICMP error from an earlier datagram: this one is not sent; UDP promises nothing more
                    self.counters.tx_errors += 1
                    return
                raise
            self.counters.tx_calls += 1
            self.counters.tx_bytes += len(data)
            return

    # -- receiving
    async def recv_batch(self, accept: Callable[[tuple], bool] | None = None, max_reads: int = 256
                         ) -> tuple[memoryview, np.ndarray]:
        """Wait for datagrams, then drain the socket (up to the batch buffer) without further waits.

        Returns the filled prefix of the batch buffer and the size of every datagram laid back to back in it.
        Reads from sources ``accept`` rejects are dropped and counted. The buffer is reused by the next call.
        """
        await self._wait(trio.lowlevel.wait_readable)
        c = self.counters
        pos = 0
        nbytes: list[int] = []
        segs: list[int] = []
        for _ in range(max_reads):
            if pos + SLOT > len(self.buf):
                break
            try:
                n, anc, flags, addr = self.sock.recvmsg_into([self.mv[pos : pos + SLOT]], _ANC)
            except BlockingIOError:
                break
            except (ConnectionRefusedError, ConnectionResetError):
                continue  # ICMP errors for our own earlier sends surface here on Linux
            c.rx_calls += 1
            seg = n
            for level, kind, data in anc:
                if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
                    seg = int.from_bytes(data[:4], sys.byteorder) or n
                elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= 4:
                    c.rx_kernel_drops = int.from_bytes(data[:4], sys.byteorder)
            count = -(-n // seg) if n else 1
            if flags & _MSG_TRUNC:
                c.rx_truncated += count
                continue
            if accept is not None and not accept(addr):
                c.rx_unknown_source += count
                continue
            if count > 1:
                c.rx_gro_reads += 1
            nbytes.append(n)
            segs.append(seg)
            pos += n
        return self.mv[:pos], self._sizes(nbytes, segs)

    def _sizes(self, nbytes: list[int], segs: list[int]) -> np.ndarray:
        sizes = read_sizes(nbytes, segs)
        self.counters.rx_datagrams += len(sizes)
        self.counters.rx_bytes += sum(nbytes)
        return sizes

    async def _wait(self, waiter) -> None:
        if self.closed:
            raise trio.ClosedResourceError("UDP lane closed")
        await waiter(self.sock)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            close_socket(self.sock)
