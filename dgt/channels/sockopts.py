"""Socket options the lanes rely on: DSCP marking, SO_PRIORITY, buffer sizes, UDP GSO/GRO, kernel drop counters.

Each setter tries the option and reports what the kernel accepted instead of raising, because support varies by
kernel, privilege and address family; callers record the outcome in the lane statistics.
"""

from __future__ import annotations

import errno
import socket
import struct

# Linux constants Python's socket module does not name on every version.
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)
_MEMINFO = struct.Struct("=9I")  # sk_meminfo: ..., index 8 = datagrams dropped by the socket
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
SOL_UDP = getattr(socket, "SOL_UDP", 17)

# Largest UDP payload one GSO send may carry (IPv4 limit; IPv6 allows a few bytes more).
GSO_MAX_BYTES = 65507

DSCP_NAMES = {
    "CS0": 0, "DF": 0, "BE": 0, "LE": 1, "CS1": 8, "AF11": 10, "AF12": 12, "AF13": 14, "CS2": 16, "AF21": 18,
    "AF22": 20, "AF23": 22, "CS3": 24, "AF31": 26, "AF32": 28, "AF33": 30, "CS4": 32, "AF41": 34, "AF42": 36,
    "AF43": 38, "CS5": 40, "VA": 44, "EF": 46, "CS6": 48, "CS7": 56,
}  # fmt: skip


def parse_dscp(value: str | int) -> int:
    """A DSCP code point from a number or a name (EF, AF21, LE, CS1, ...)."""
    if isinstance(value, int):
        code = value
    else:
        text = value.strip().upper()
        code = DSCP_NAMES[text] if text in DSCP_NAMES else int(text, 0)
    if not 0 <= code < 64:
        raise ValueError(f"DSCP {value!r} is not in 0..63")
    return code


def default_priority(dscp: int) -> int:
    """SO_PRIORITY for a DSCP, so pfifo_fast/prio qdiscs classify like the DSCP does (EF -> 6 interactive,
    AF2x -> 4, best effort -> 0, LE/CS1 -> 1 filler). Values above 6 would need CAP_NET_ADMIN."""
    if dscp >= 40:
        return 6
    if dscp >= 24:
        return 5
    if dscp >= 16:
        return 4
    if dscp == 0:
        return 0
    return 1 if dscp in (1, 8) else 2


def family_of(host: str) -> socket.AddressFamily:
    """AF_INET or AF_INET6 for a numeric or resolvable host."""
    info = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    return info[0][0]


IP_MTU = getattr(socket, "IP_MTU", 14)
IPV6_MTU = getattr(socket, "IPV6_MTU", 24)


def route_mtu(host: str) -> int | None:
    """The MTU of the route to ``host`` as the kernel knows it (IP_MTU / IPV6_MTU of a connected UDP socket: the
    outgoing interface's MTU, or a smaller path MTU the kernel has learnt), or None where it cannot be read.
    Connecting a UDP socket sends nothing."""
    try:
        fam = family_of(host)
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            if fam == socket.AF_INET6:
                return int(s.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU))
            return int(s.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except (OSError, ValueError):  # unresolvable, or not a host name at all (idna refuses it)
        return None


def canonical_host(host: str) -> str:
    """The textual form the kernel reports in recvfrom addresses, so source checks compare equal strings."""
    fam = family_of(host)
    addr = socket.getaddrinfo(host, None, fam, socket.SOCK_DGRAM)[0][4][0]
    return socket.inet_ntop(fam, socket.inet_pton(fam, addr))


def set_dscp(sock: socket.socket, dscp: int) -> bool:
    """Mark outgoing packets with ``dscp`` (IP_TOS for IPv4, IPV6_TCLASS for IPv6; ECN bits left zero)."""
    tos = (dscp & 0x3F) << 2
    try:
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
        else:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        return True
    except OSError:
        return False


def get_dscp(sock: socket.socket) -> int:
    """The DSCP the socket marks its packets with, read back from the kernel."""
    if sock.family == socket.AF_INET6:
        tos = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
    else:
        tos = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
    return tos >> 2


def set_priority(sock: socket.socket, prio: int) -> bool:
    """SO_PRIORITY (set after the DSCP: setting IP_TOS resets the priority on Linux)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, prio)
        return True
    except (OSError, AttributeError):
        return False


def get_priority(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY)


def set_buffers(sock: socket.socket, rcvbuf: int | None, sndbuf: int | None) -> tuple[int, int]:
    """Ask for buffer sizes, with the *FORCE variants first (root can exceed rmem_max/wmem_max); returns what the
    kernel granted (it reports twice the request, which includes its bookkeeping)."""
    for size, force, plain in ((rcvbuf, SO_RCVBUFFORCE, socket.SO_RCVBUF), (sndbuf, SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        if size:
            try:
                sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, plain, size)
                except OSError:
                    pass
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF), sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)


def tune_tcp(sock: socket.socket, user_timeout: float | None) -> None:
    """TCP_NODELAY (frames go out as soon as they are queued) and TCP_USER_TIMEOUT (unacked data fails the
    connection instead of retrying for minutes)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if user_timeout:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, max(1, int(user_timeout * 1000)))
        except OSError:
            pass


def enable_gro(sock: socket.socket) -> bool:
    """UDP_GRO: the kernel hands back runs of same-size datagrams as one buffer plus the segment size in a cmsg."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        return bool(sock.getsockopt(SOL_UDP, UDP_GRO))
    except OSError:
        return False


def probe_gso(sock: socket.socket) -> bool:
    """Whether UDP_SEGMENT is known to this kernel (the segment size itself travels per send in a cmsg)."""
    try:
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, 0)
        return True
    except OSError:
        return False


def gso_cmsg(segment: int) -> list[tuple[int, int, bytes]]:
    return [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", segment))]


def enable_rxq_ovfl(sock: socket.socket) -> bool:
    """SO_RXQ_OVFL: every receive reports how many datagrams the kernel dropped for a full receive buffer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
        return True
    except OSError:
        return False


def socket_drops(sock: socket.socket) -> int | None:
    """Datagrams the kernel dropped on this socket so far (SO_MEMINFO), readable at any time unlike the
    SO_RXQ_OVFL cmsg, which only arrives with the next datagram; None where unsupported."""
    try:
        return _MEMINFO.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size))[8]
    except (OSError, struct.error):
        return None


GSO_UNSUPPORTED = {errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP}


def close_socket(sock: socket.socket) -> None:
    """Close a socket trio may be waiting on: waiters wake (with ClosedResourceError) instead of hanging."""
    import trio

    try:
        trio.lowlevel.notify_closing(sock)
    except (OSError, ValueError):
        pass
    sock.close()
