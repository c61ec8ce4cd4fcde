"""The endpoint's own sockets (part of :class:`dgt.transport.endpoint.Endpoint`): the TCP listener, one UDP socket
per unreliable lane and the lossy ring hops' socket, each bound on a port of the configured range, and the address
peers reach them at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dgt.channels.lanes import LaneSpec
from dgt.channels.ports import bind_in_range
from dgt.channels.sockopts import get_dscp, get_priority
from dgt.channels.tcp import TcpListener
from dgt.channels.udp import UdpChannel
from dgt.transport.config import PeerAddress, TransportConfig


class Sockets:
    """``listener``, ``udp`` (lane -> channel) and ``hop`` (None: stream hops off, no UDP lane, or no port left for
    it; the lossy ring hops' datagrams, dgt.channels.hop_datagrams: trio never reads it, the stream hub closes it)."""

    def __init__(self, rank: int, host: str, cfg: TransportConfig) -> None:
        self.rank = rank
        self.host = host
        c = cfg
        self.listener = bind_in_range(lambda p: TcpListener(host, c.lanes.specs[0], port=p), c.lanes.port_range,
                                      "TCP listener")
        self.udp: dict[int, UdpChannel] = {}

        def udp_lane(spec: LaneSpec) -> Callable[[int], UdpChannel]:
            s = c.sockets
            return lambda p: UdpChannel(host, spec, gso=s.gso, gro=s.gro, rcvbuf=s.udp_rcvbuf, sndbuf=s.udp_sndbuf,
                                        max_segments=s.gso_segments, batch_bytes=s.udp_batch_bytes, port=p)

        self.hop: UdpChannel | None = None
        try:
            for lane in range(1, len(c.lanes.specs)):
                self.udp[lane] = bind_in_range(udp_lane(c.lanes.specs[lane]), c.lanes.port_range, f"UDP lane {lane}")
            if self.udp and c.hops.mode != "off":
                try:
                    self.hop = bind_in_range(udp_lane(c.lanes.specs[1]), c.lanes.port_range, "the hop socket")
                except OSError:  # no port left in the range: lossy hops run their rounds on the session link
                    self.hop = None
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> PeerAddress:
        hop = self.hop
        return PeerAddress(self.host, self.listener.port, tuple(ch.port for ch in self.udp.values()), self.rank,
                           0 if hop is None else hop.port)

    def close(self) -> None:
        """The listener and the lanes' UDP sockets (the hop socket closes with the stream hub)."""
        self.listener.close()
        for ch in self.udp.values():
            ch.close()

    def info(self) -> dict[str, Any]:
        """DSCP and SO_PRIORITY read back from the kernel for the listener, the UDP lanes and the hop socket."""
        info: dict[str, Any] = {
            "listener": {"dscp": get_dscp(self.listener.sock), "priority": get_priority(self.listener.sock)}}
        info["udp"] = {
            lane: {"dscp": get_dscp(ch.sock), "priority": get_priority(ch.sock), "gso": ch.gso, "gro": ch.gro,
                   "rcvbuf": ch.rcvbuf}  # fmt: skip
            for lane, ch in self.udp.items()
            if not ch.closed
        }
        hop = self.hop
        if hop is not None and not hop.closed:  # the lossy ring hops' datagrams (marked like lane 1)
            info["hop"] = {"dscp": get_dscp(hop.sock), "priority": get_priority(hop.sock), "gso": hop.gso,
                           "gro": hop.gro, "rcvbuf": hop.rcvbuf, "port": hop.port}
        return info
