"""Configuration of an endpoint and the address it publishes to its peers."""

from __future__ import annotations

import json
import os
import socket
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from dgt import wire
from dgt.channels.duplex import NATIVE
from dgt.channels.lanes import LaneSpec, default_lanes, validate_lanes
from dgt.channels.ports import check_port_range, env_port_range
from dgt.channels.sockopts import family_of, route_mtu
from dgt.layout import DEFAULT_BLOCK
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


# -- the groups ---------------------------------------------------------------------------------------------------
# Each group is a frozen dataclass with defaults that work over loopback and LANs, checked when it is made.
# docs/options.md documents every field (tests/test_options_reference.py walks the groups).


@dataclass(frozen=True)
class Lanes:
    """What the lanes are, how much a datagram carries, and where the sockets bind.

    specs: lane 0 the reliable TCP lane, then UDP lanes in descending importance (block class k goes to lane k):
        ``LaneSpec``s or strings (``"tcp:EF"``, ``"udp:AF21"``); ``three_lanes()`` for three classes.
    datagram_payload: bytes of block data (and MAC tag) per datagram, after its 48-byte header. None (default): per
        peer, what the route to that peer carries in one IP packet (its MTU) less the IP, UDP and DGT headers, so no
        datagram is fragmented; 1400 where the MTU cannot be read. A fragment is at most one block. Set it where the
        path MTU is smaller than the first hop's (a tunnel the kernel does not know of).
    port_range: (LO, HI): bind the TCP listener and the UDP lane sockets to free ports in this range (firewalled
        clusters); None: any port. Default: the DGT_PORT_RANGE environment variable ("30000-30999"), else None.
    """

    specs: Sequence[LaneSpec] = field(default_factory=default_lanes)
    datagram_payload: int | None = None
    port_range: tuple[int, int] | None = field(default_factory=env_port_range)

    def __post_init__(self) -> None:
        specs = [_lane(ln) for ln in self.specs]
        object.__setattr__(self, "specs", tuple(validate_lanes(specs)))
        if self.datagram_payload is not None and not 16 <= self.datagram_payload <= 65000:
            raise ValueError("Lanes.datagram_payload must be in [16, 65000] bytes (None: from the route's MTU)")
        object.__setattr__(self, "port_range", check_port_range(self.port_range))

    if not TYPE_CHECKING:  # ``cfg.lanes`` read as the list it was before issue 44: deprecated, at run time only
        def __len__(self) -> int:
            _lanes_as_list()
            return len(self.specs)

        def __getitem__(self, i: Any) -> Any:
            _lanes_as_list()
            return self.specs[i]

        def __iter__(self) -> Any:
            _lanes_as_list()
            return iter(self.specs)


def _lanes_as_list() -> None:
    warnings.warn("reading TransportConfig.lanes as a list is deprecated: read cfg.lanes.specs (the lanes are a "
                  "Lanes group since issue 44; the list reads go away in the release after 0.1)", DeprecationWarning,
                  stacklevel=3)


def _lane(ln: LaneSpec | str | Mapping[str, Any]) -> LaneSpec:
    if isinstance(ln, LaneSpec):
        return ln
    if isinstance(ln, Mapping):  # LaneSpec.to_dict's form (TransportConfig.to_dict)
        return LaneSpec(str(ln["name"]), str(ln["kind"]), int(ln["dscp"]), ln.get("priority"))
    return LaneSpec.parse(ln)


@dataclass(frozen=True)
class Pacing:
    """The token bucket each peer's unreliable lanes are paced by.

    rate: bytes/s per peer over all unreliable lanes: the fixed rate without congestion control, the ceiling with it;
        None: unpaced (without congestion control) or the controller's own ceiling.
    shared: the reliable lane's bytes to a peer come off the same bucket (dgt.protocol.pacing.Pacer ``shared``), so
        TCP and UDP together stay within ``rate``, as on one link; the send budget counts a round's important bytes
        before it sizes the unimportant ones. Needs ``rate``. The session link's TCP bytes are counted (the stream
        lanes of lossless ring hops are not). The experiments' loopback fallback sets it.
    burst: the bucket's depth, bytes: what the pacer lets out at once.
    """

    rate: float | None = None
    shared: bool = False
    burst: int = 256 << 10

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError("Pacing.rate must be positive bytes/s (None: not fixed)")
        if self.shared and not self.rate:
            raise ValueError("Pacing.shared needs Pacing.rate: the rate of the budget TCP and UDP share")
        if self.burst < 1:
            raise ValueError("Pacing.burst must be at least 1 byte")


@dataclass(frozen=True)
class Congestion:
    """The less-than-best-effort controller of the unreliable lanes and the send budget it drives.

    enabled: a controller per peer (dgt.protocol.congestion: LEDBAT-like, back-off on loss) sets the unreliable
        lanes' rate from the drop reports, starting at ``start_rate`` within [``min_rate``, ``max_rate``]
        (``max_rate`` capped by ``Pacing.rate``), and a send budget (dgt.protocol.budget) keeps back the unimportant
        blocks that rate cannot deliver before the round's expected close: they go into error feedback as
        ``unsent``. False: unpaced, or paced at a fixed ``Pacing.rate``; every unimportant block sent.
    target: the queuing-delay target, seconds.
    start_rate, min_rate, max_rate: the controller's start, floor and ceiling, bytes/s per peer.
    cpu_gate: a lossy ring hop sends no unimportant datagram (error feedback carries those blocks) while its stream
        transfers spend more than this fraction of their time waiting for a CPU (an EWMA of the kernel's runqueue
        wait; dgt.protocol.cpu_gate). 0 switches the gate off. Only with ``enabled`` and error feedback.
    """

    enabled: bool = True
    target: float = 0.010
    start_rate: float = 12.5e6
    min_rate: float = 10e3
    max_rate: float = 10e9
    cpu_gate: float = 0.1

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ValueError("Congestion.target must be positive seconds")
        if not 0 < self.min_rate <= self.max_rate:
            raise ValueError("Congestion.min_rate and max_rate must satisfy 0 < min_rate <= max_rate")
        if not self.start_rate > 0:
            raise ValueError("Congestion.start_rate must be positive bytes/s")
        if not 0.0 <= self.cpu_gate <= 1.0:
            raise ValueError("Congestion.cpu_gate must be in [0, 1] (0: off)")


@dataclass(frozen=True)
class Security:
    """Who may talk to the endpoint.

    secret: the session secret (bytes or str); None: DGT_SECRET, else DGT_SECRET_FILE, else derived from the token.
        Never printed (repr) or exported (to_dict).
    datagram_mac: every datagram carries an 8-byte MAC (dgt.protocol.datagram_mac, keyed by the session key);
        datagrams without a right one are dropped (``bad-mac``). Every rank must use the same setting.
    check_source: drop datagrams not sent from a connected peer's lane socket.
    max_pending_handshakes: accepted connections not yet authenticated; more are closed at once.
    """

    secret: bytes | str | None = field(default=None, repr=False)
    datagram_mac: bool = True
    check_source: bool = True
    max_pending_handshakes: int = 64

    def __post_init__(self) -> None:
        if self.max_pending_handshakes < 1:
            raise ValueError("Security.max_pending_handshakes must be at least 1")


@dataclass(frozen=True)
class Timeouts:
    """How long the endpoint waits, seconds.

    peer: silence after which a peer counts as gone (pending operations then fail with PeerTimeout).
    connect: how long a connection (and its handshake, a stream lane's opening) may take; None: ``peer``.
    heartbeat: the interval of liveness pings on idle links; None: ``peer / 4``.
    round: the longest a receive waits for a live peer's round (ranks may be out of step).
    """

    peer: float = 10.0
    connect: float | None = None
    heartbeat: float | None = None
    round: float = 600.0

    def __post_init__(self) -> None:
        if not (self.peer > 0 and self.round > 0):
            raise ValueError("Timeouts.peer and Timeouts.round must be positive seconds")
        for name in ("connect", "heartbeat"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"Timeouts.{name} must be positive seconds (None: derived from Timeouts.peer)")


@dataclass(frozen=True)
class Sockets:
    """Kernel buffers and offloads of the lanes' sockets, and the reliable lane's framing.

    gso, gro: UDP segmentation / receive offload (probed at open, with a fallback where the kernel refuses).
    gso_segments: the most datagrams one GSO send carries.
    udp_rcvbuf, udp_sndbuf, tcp_rcvbuf, tcp_sndbuf: kernel buffer sizes, bytes; None: the kernel's (autotuning).
    udp_batch_bytes: each UDP lane's user-space receive buffer, bytes.
    reliable_frame_bytes: the largest bulk frame on the reliable lane (fewer, larger frames: per-frame work is
        amortised over 4 MiB).
    """

    gso: bool = True
    gro: bool = True
    gso_segments: int = 64
    udp_rcvbuf: int | None = 32 << 20
    udp_sndbuf: int | None = 4 << 20
    tcp_rcvbuf: int | None = None
    tcp_sndbuf: int | None = None
    udp_batch_bytes: int = 4 << 20
    reliable_frame_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.gso_segments < 1:
            raise ValueError("Sockets.gso_segments must be at least 1")
        for name in ("udp_rcvbuf", "udp_sndbuf", "tcp_rcvbuf", "tcp_sndbuf"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"Sockets.{name} must be positive bytes (None: the kernel's)")
        if self.udp_batch_bytes < 65536 or self.reliable_frame_bytes < 1:
            raise ValueError("Sockets.udp_batch_bytes must hold one datagram (>= 65536), reliable_frame_bytes >= 1")


@dataclass(frozen=True)
class Hops:
    """How lossless (and float32 lossy) ring hops run on stream lanes (dgt.transport.streams).

    mode: "auto" (the native loop when it was built, else the Python one), "native", "python", or "off" (on the
        session link, as BULK frames).
    threads: threads per native stream hop: 1 (send and receive in one loop) or 2 (the send half on a second
        thread); 0 = auto (see :meth:`TransportConfig.hop_thread_count`).
    """

    mode: str = "auto"
    threads: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "native", "python", "off"):
            raise ValueError("Hops.mode must be auto, native, python or off")
        if self.mode == "native" and not NATIVE:
            raise ValueError("Hops.mode='native': dgt was installed without its native hop loop (no C compiler)")
        if self.threads not in (0, 1, 2):
            raise ValueError("Hops.threads must be 0 (auto), 1 or 2")


@dataclass(frozen=True)
class Faults:
    """Test hooks: injected loss.

    drop_fraction: the receiver discards this fraction of arriving datagrams (the lanes' and the lossy hops').
    drop_seed: the seed of that random choice (None: fresh entropy).
    """

    drop_fraction: float = 0.0
    drop_seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.drop_fraction <= 1.0:
            raise ValueError("Faults.drop_fraction must be in [0, 1]")


GROUPS: dict[str, type] = {"lanes": Lanes, "pacing": Pacing, "congestion": Congestion, "security": Security,
                           "limits": wire.Limits, "timeouts": Timeouts, "sockets": Sockets, "hops": Hops,
                           "faults": Faults}
"""TransportConfig's grouped fields and their classes (``limits`` is :class:`dgt.wire.Limits` itself)."""

LEGACY: dict[str, tuple[str, str]] = {
    "datagram_payload": ("lanes", "datagram_payload"), "port_range": ("lanes", "port_range"),
    "pace_rate": ("pacing", "rate"), "pace_shared": ("pacing", "shared"), "pace_burst": ("pacing", "burst"),
    "congestion_control": ("congestion", "enabled"), "cc_target": ("congestion", "target"),
    "pace_start": ("congestion", "start_rate"), "pace_min": ("congestion", "min_rate"),
    "pace_max": ("congestion", "max_rate"), "cpu_gate": ("congestion", "cpu_gate"),
    "secret": ("security", "secret"), "datagram_mac": ("security", "datagram_mac"),
    "check_source": ("security", "check_source"), "max_pending_handshakes": ("security", "max_pending_handshakes"),
    "peer_timeout": ("timeouts", "peer"), "connect_timeout": ("timeouts", "connect"),
    "heartbeat": ("timeouts", "heartbeat"), "round_timeout": ("timeouts", "round"),
    **{k: ("sockets", k) for k in ("gso", "gro", "gso_segments", "udp_rcvbuf", "udp_sndbuf", "tcp_rcvbuf",
                                   "tcp_sndbuf", "udp_batch_bytes", "reliable_frame_bytes")},
    "stream_hops": ("hops", "mode"), "hop_threads": ("hops", "threads"),
    "drop_fraction": ("faults", "drop_fraction"), "drop_seed": ("faults", "drop_seed"),
}
"""The flat keywords of TransportConfig before issue 44 -> (group, field). They still work, with a
DeprecationWarning, until the release after 0.1 (docs/api.md, "Deprecations")."""

_NO_BLOCK = ("TransportConfig has no block size since issue 44: a round is cut in its layout's blocks, i.e. the "
             "codec's (e.g. codec 'dgt:block=512'); pass send_round(layout=BucketLayout.flat(n, block)) for a "
             "raw round")
"""Why ``block`` is gone. The codec is the one source of the block size: a part with per-block lane classes travels
in its own blocks, any other part and a ``send_round`` without a layout in ``dgt.layout.DEFAULT_BLOCK``-element ones
(a cut that changes nothing of what arrives)."""


def _spelling(old: str) -> str:
    group, name = LEGACY[old]
    cls = GROUPS[group].__name__
    return f"TransportConfig({group}={cls}({name}=...))"


def _fold_legacy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the flat keywords of before issue 44 folded into their groups (each with a
    DeprecationWarning); a ``block`` that is not the default fails (the layout's block is the only one)."""
    old = [k for k in kwargs if k in LEGACY or k == "block"]
    lanes = kwargs.get("lanes")
    flat_lanes = lanes is not None and not isinstance(lanes, (Lanes, Mapping))
    if not old and not flat_lanes:
        return kwargs
    out = dict(kwargs)
    if "block" in out:
        block = out.pop("block")
        if block != DEFAULT_BLOCK:
            raise TypeError(f"TransportConfig(block={block!r}): {_NO_BLOCK}")
        warnings.warn(f"TransportConfig(block=...) is deprecated and has no effect: {_NO_BLOCK}",
                      DeprecationWarning, stacklevel=3)
    if flat_lanes:
        warnings.warn("TransportConfig(lanes=[...]) is deprecated: write TransportConfig(lanes=Lanes(specs=[...])) "
                      "(the flat keywords go away in the release after 0.1)", DeprecationWarning, stacklevel=3)
        out["lanes"] = {"specs": lanes}
    moved: dict[str, dict[str, Any]] = {}
    for key in [k for k in out if k in LEGACY]:
        group, name = LEGACY[key]
        warnings.warn(f"TransportConfig({key}=...) is deprecated: write {_spelling(key)} (the flat keywords go away "
                      f"in the release after 0.1)", DeprecationWarning, stacklevel=3)
        moved.setdefault(group, {})[name] = out.pop(key)
    for group, values in moved.items():
        base = out.get(group)
        if base is None:
            out[group] = values
        elif isinstance(base, Mapping):
            out[group] = {**base, **values}
        else:
            out[group] = replace(base, **values)
    return out


def _as_group(cls: type, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    raise TypeError(f"expected a {cls.__name__} (or a dict of its fields), not {type(value).__name__}")


@dataclass
class TransportConfig:
    """Everything an endpoint needs to know, in groups; every field has a default that works over loopback and LANs.

    lanes: the lanes, the datagram size, the port range (:class:`Lanes`).
    pacing: the token bucket of the unreliable lanes (:class:`Pacing`).
    congestion: the less-than-best-effort controller, the send budget, the CPU gate (:class:`Congestion`).
    security: the secret, datagram MACs, source checks, the handshake cap (:class:`Security`).
    limits: the bounds the receiver enforces on every header (:class:`dgt.wire.Limits`, that class itself).
    timeouts: peer silence, connect, heartbeat, round (:class:`Timeouts`).
    sockets: kernel buffers, GSO/GRO, reliable framing (:class:`Sockets`).
    hops: how stream hops run (:class:`Hops`).
    faults: injected loss, for tests (:class:`Faults`).
    deadline: "adaptive", "fixed:SECONDS", seconds, or a DeadlinePolicy: when a round closes once its important
        blocks are in.
    error_feedback: blocks lost or kept back are folded into the next round of their bucket.
    max_buffered_results: rounds finished before their receive was called that are kept (the oldest evicted).

    A group may be given as a dict of its fields (``TransportConfig(pacing={"rate": 1e8})``, JSON configs). The flat
    keywords of before issue 44 (``pace_rate=...``) still work for one release with a DeprecationWarning naming the
    new spelling (:data:`LEGACY`). There is no block size here: a round is cut in its layout's blocks (the codec's).
    """

    lanes: Lanes = field(default_factory=Lanes)
    pacing: Pacing = field(default_factory=Pacing)
    congestion: Congestion = field(default_factory=Congestion)
    security: Security = field(default_factory=Security)
    limits: wire.Limits = field(default_factory=lambda: wire.DEFAULT_LIMITS)
    timeouts: Timeouts = field(default_factory=Timeouts)
    sockets: Sockets = field(default_factory=Sockets)
    hops: Hops = field(default_factory=Hops)
    faults: Faults = field(default_factory=Faults)
    deadline: str | float | DeadlinePolicy = "adaptive"
    error_feedback: bool = True
    max_buffered_results: int = 256

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            object.__setattr__(self, name, _as_group(cls, getattr(self, name)))
        make_deadline(self.deadline)  # fail early on a bad spec
        if self.max_buffered_results < 1:
            raise ValueError("max_buffered_results must be at least 1")

    if not TYPE_CHECKING:  # the deprecated flat names, at run time only: type checkers see the grouped ones alone
        def __getattr__(self, name: str) -> Any:
            if name in LEGACY:
                warnings.warn(f"TransportConfig.{name} is deprecated: read {_spelling(name)} as "
                              f"cfg.{'.'.join(LEGACY[name])}", DeprecationWarning, stacklevel=2)
                group, field_name = LEGACY[name]
                return getattr(getattr(self, group), field_name)
            if name == "block":
                raise AttributeError(_NO_BLOCK)
            raise AttributeError(f"'TransportConfig' object has no attribute {name!r}")

        def __setattr__(self, name: str, value: Any) -> None:
            if name in LEGACY:
                warnings.warn(f"setting TransportConfig.{name} is deprecated: set cfg.{LEGACY[name][0]} to a new "
                              f"group ({_spelling(name)})", DeprecationWarning, stacklevel=2)
                group, field_name = LEGACY[name]
                value, name = replace(getattr(self, group), **{field_name: value}), group
            elif name == "block":
                raise AttributeError(_NO_BLOCK)
            elif name not in self.__dataclass_fields__:
                raise AttributeError(f"TransportConfig has no field {name!r}")
            object.__setattr__(self, name, value)

    def payload_for(self, host: str) -> int:
        """``lanes.datagram_payload`` for a peer at ``host``: the configured value, else sized by the route's MTU."""
        if self.lanes.datagram_payload is not None:
            return self.lanes.datagram_payload
        mtu = route_mtu(host)
        return payload_for_mtu(mtu, mtu is not None and family_of(host) == socket.AF_INET6)

    def native_hops(self) -> bool:
        """Whether stream hops run in the native loop."""
        return self.hops.mode == "native" or (self.hops.mode == "auto" and NATIVE)

    def hop_thread_count(self) -> int:
        """``hops.threads``, with auto resolved: 2 where this process may use at least 2 cores, else 1."""
        if self.hops.threads:
            return self.hops.threads
        return 2 if usable_cores() >= 2 else 1

    @property
    def unreliable_lanes(self) -> int:
        return len(self.lanes.specs) - 1

    def deadline_policy(self) -> DeadlinePolicy:
        return make_deadline(self.deadline)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: each group a dict of its fields (the secret left out), ``TransportConfig(**d)`` rebuilds it."""
        d: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in GROUPS:
                v = {g.name: getattr(v, g.name) for g in fields(v) if g.name != "secret"}
            d[f.name] = v
        d["lanes"]["specs"] = [ln.to_dict() for ln in self.lanes.specs]
        d["deadline"] = self.deadline if isinstance(self.deadline, (str, int, float)) else repr(self.deadline)
        return d


_generated_init = TransportConfig.__init__


def _init(self: TransportConfig, *args: Any, **kwargs: Any) -> None:
    _generated_init(self, *args, **_fold_legacy(kwargs))


_init.__doc__ = _generated_init.__doc__
_init.__wrapped__ = _generated_init  # type: ignore[attr-defined]  # inspect.signature shows the grouped fields
TransportConfig.__init__ = _init  # type: ignore[method-assign]
