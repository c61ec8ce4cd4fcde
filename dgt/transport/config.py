"""Configuration of an endpoint and the address it publishes to its peers."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from dgt import wire
from dgt.channels.duplex import NATIVE
from dgt.channels.lanes import LaneSpec, default_lanes, validate_lanes
from dgt.channels.ports import check_port_range, env_port_range
from dgt.channels.sockopts import family_of, route_mtu
from dgt.protocol.deadline import DeadlinePolicy, make_deadline


@dataclass(frozen=True)
class PeerAddress:
    """Where a peer listens: its TCP port and one UDP port per unreliable lane. Picklable and JSON-able, for a
    rendezvous store."""

    host: str
    tcp_port: int
    udp_ports: tuple[int, ...]
    rank: int = -1
    hop_port: int = 0  # the UDP socket of its lossy ring hops (dgt.channels.hop_datagrams); 0: none

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "tcp_port": self.tcp_port, "udp_ports": list(self.udp_ports), "rank": self.rank,
                "hop_port": self.hop_port}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerAddress:
        return cls(str(d["host"]), int(d["tcp_port"]), tuple(int(p) for p in d["udp_ports"]), int(d.get("rank", -1)),
                   int(d.get("hop_port", 0)))

    @classmethod
    def from_json(cls, text: str) -> PeerAddress:
        return cls.from_dict(json.loads(text))


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


FALLBACK_PAYLOAD = 1400  # fits a 1500-byte MTU: IPv6 + UDP + the DGT header + 1400 = 1496


def payload_for_mtu(mtu: int | None, ipv6: bool = False) -> int:
    """The datagram payload (after the DGT header) that fills one IP packet of ``mtu`` bytes without fragmenting;
    FALLBACK_PAYLOAD for an unknown MTU; at most the 65000 bytes a datagram may carry, at least 64."""
    if not mtu:
        return FALLBACK_PAYLOAD
    return max(64, min(65000, mtu - (48 if ipv6 else 28) - wire.HEADER_SIZE))


@dataclass
class TransportConfig:
    """Everything an endpoint needs to know; every field has a default that works over loopback and LANs.

    lanes: lane 0 the TCP lane, then UDP lanes in descending importance (block class k goes to lane k).
    datagram_payload: bytes of block data (and MAC tag) per datagram, after its 48-byte header. None (default):
        per peer, what the route to that peer carries in one IP packet (its MTU, e.g. 1500 on Ethernet, 9000 with
        jumbo frames, 65536 over loopback) less the IP, UDP and DGT headers, so no datagram is fragmented and none
        is smaller than it need be; 1400 where the MTU cannot be read. A block never spans datagrams' worth more
        than it needs: a fragment is at most one block. Set it where the path MTU is smaller than the first
        hop's (a tunnel the kernel does not know of).
    pace_rate: bytes/s per peer over all unreliable lanes: fixed without congestion_control, the ceiling with it.
    pace_shared: the reliable lane's bytes to a peer come off the same budget as its unreliable lanes: one token
        bucket at pace_rate per peer that both protocols draw from (dgt.protocol.pacing.Pacer ``shared``), so TCP
        and UDP together stay within pace_rate, as on one link; the send budget counts a round's important bytes
        before it sizes the unimportant ones. Needs pace_rate. The session link's TCP bytes are counted (the
        stream lanes of lossless ring hops are not). The experiments' loopback fallback sets it, with the TCP
        sockets paced to the same rate by the kernel (SO_MAX_PACING_RATE).
    congestion_control: a less-than-best-effort controller per peer (dgt.protocol.congestion: LEDBAT-like, queuing
        delay target ``cc_target`` seconds, back-off on loss) sets the unreliable lanes' rate from the drop reports,
        starting at pace_start within [pace_min, pace_max] (pace_max capped by pace_rate), and a send budget
        (dgt.protocol.budget) keeps back the unimportant blocks that rate cannot deliver before the round's expected
        close: they go into error feedback as ``unsent``. False: the behaviour before (unpaced, or paced at a fixed
        pace_rate; every unimportant block sent).
    deadline: "adaptive", "fixed:SECONDS", seconds, or a DeadlinePolicy.
    peer_timeout: silence after which a peer counts as gone; pending operations then fail with PeerTimeout.
    drop_fraction: test hook: the receiver discards this fraction of arriving datagrams (seeded by drop_seed).
    check_source: drop datagrams not sent from a connected peer's lane socket.
    datagram_mac: every datagram carries an 8-byte MAC (dgt.protocol.datagram_mac, keyed by the session key);
        datagrams without a right one are dropped (counted as ``bad-mac``). Every rank must use the same setting.
    stream_hops: how lossless ring hops run on stream lanes (dgt.transport.streams): "auto" (the native loop when
        it was built, else the Python one), "native", "python", or "off" (on the session link, as BULK frames).
    port_range: (LO, HI): bind the TCP listener and the UDP lane sockets to free ports in this range (firewalled
        clusters); None: any port. Default: the DGT_PORT_RANGE environment variable ("30000-30999"), else None.
    hop_threads: threads per native stream hop: 1 (send and receive in one loop) or 2 (the send half on a second
        thread, so the kernel's two copies of a hop run on two cores); 0 = auto (see :meth:`hop_thread_count`).
    cpu_gate: a lossy ring hop sends no unimportant datagram (its send budget is zero: error feedback carries those
        blocks) while its stream transfers spend more than this fraction of their time waiting for a CPU (an EWMA
        of the kernel's runqueue wait; dgt.protocol.cpu_gate): on a host with no core to spare the datagrams are not
        free, they slow the step. 0 switches the gate off (every hop sends what the congestion controller allows).
        Only with congestion_control and error_feedback (the send budget's conditions).
    """

    lanes: list[LaneSpec] = field(default_factory=default_lanes)
    datagram_payload: int | None = None
    pace_rate: float | None = None
    pace_shared: bool = False
    congestion_control: bool = True
    cc_target: float = 0.010
    pace_start: float = 12.5e6
    pace_min: float = 10e3
    pace_max: float = 10e9
    pace_burst: int = 256 << 10
    deadline: str | float | DeadlinePolicy = "adaptive"
    peer_timeout: float = 10.0
    # session secret (else DGT_SECRET / DGT_SECRET_FILE, else derived from the token): never printed or exported
    secret: bytes | str | None = field(default=None, repr=False)
    max_pending_handshakes: int = 64  # accepted connections not yet authenticated; more are closed at once
    round_timeout: float = 600.0  # the longest a receive waits for a live peer's round (ranks may be out of step)
    connect_timeout: float | None = None  # default: peer_timeout
    heartbeat: float | None = None  # default: peer_timeout / 4
    gso: bool = True
    gro: bool = True
    gso_segments: int = 64
    error_feedback: bool = True
    block: int = 1024
    reliable_frame_bytes: int = 4 << 20  # fewer, larger frames: per-frame work is amortised over 4 MiB
    drop_fraction: float = 0.0
    drop_seed: int | None = None
    check_source: bool = True
    datagram_mac: bool = True
    udp_rcvbuf: int | None = 32 << 20
    udp_sndbuf: int | None = 4 << 20
    tcp_rcvbuf: int | None = None  # None: kernel autotuning
    tcp_sndbuf: int | None = None
    udp_batch_bytes: int = 4 << 20
    max_buffered_results: int = 256
    stream_hops: str = "auto"
    hop_threads: int = 0
    cpu_gate: float = 0.1
    limits: wire.Limits = field(default_factory=lambda: wire.DEFAULT_LIMITS)
    port_range: tuple[int, int] | None = field(default_factory=env_port_range)

    def __post_init__(self) -> None:
        self.lanes = validate_lanes([ln if isinstance(ln, LaneSpec) else LaneSpec.parse(ln) for ln in self.lanes])
        if not 0.0 <= self.drop_fraction <= 1.0:
            raise ValueError("drop_fraction must be in [0, 1]")
        if self.peer_timeout <= 0 or self.round_timeout <= 0:
            raise ValueError("peer_timeout and round_timeout must be positive")
        if self.datagram_payload is not None and not 16 <= self.datagram_payload <= 65000:
            raise ValueError("datagram_payload must be in [16, 65000] bytes")
        make_deadline(self.deadline)  # fail early on a bad spec
        if self.stream_hops not in ("auto", "native", "python", "off"):
            raise ValueError("stream_hops must be auto, native, python or off")
        if self.stream_hops == "native" and not NATIVE:
            raise ValueError("stream_hops='native': dgt was installed without its native hop loop (no C compiler)")
        self.port_range = check_port_range(self.port_range)
        if self.hop_threads not in (0, 1, 2):
            raise ValueError("hop_threads must be 0 (auto), 1 or 2")
        if not 0.0 <= self.cpu_gate <= 1.0:
            raise ValueError("cpu_gate must be in [0, 1] (0: off)")
        if self.pace_shared and not self.pace_rate:
            raise ValueError("pace_shared needs pace_rate: the rate of the budget TCP and UDP share")

    def payload_for(self, host: str) -> int:
        """``datagram_payload`` for a peer at ``host``: the configured value, else sized by the route's MTU."""
        if self.datagram_payload is not None:
            return self.datagram_payload
        mtu = route_mtu(host)
        return payload_for_mtu(mtu, mtu is not None and family_of(host) == socket.AF_INET6)

    def native_hops(self) -> bool:
        """Whether stream hops run in the native loop."""
        return self.stream_hops == "native" or (self.stream_hops == "auto" and NATIVE)

    def hop_thread_count(self) -> int:
        """``hop_threads``, with auto resolved: 2 where this process may use at least 2 cores, else 1."""
        if self.hop_threads:
            return self.hop_threads
        return 2 if usable_cores() >= 2 else 1

    @property
    def unreliable_lanes(self) -> int:
        return len(self.lanes) - 1

    def deadline_policy(self) -> DeadlinePolicy:
        return make_deadline(self.deadline)

    def to_dict(self) -> dict[str, Any]:
        skip = ("lanes", "limits", "deadline", "secret")
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skip}
        d["lanes"] = [ln.to_dict() for ln in self.lanes]
        d["deadline"] = self.deadline if isinstance(self.deadline, (str, int, float)) else repr(self.deadline)
        return d
