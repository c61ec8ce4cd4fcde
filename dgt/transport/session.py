"""What the endpoint's parts share: the state :class:`~dgt.transport.endpoint.Endpoint` builds in ``__init__`` and
the methods one part calls on another, declared once so that each mixin (handshake, links, inbound, outbound) is
type-checked on its own (mypy strict, issue #24). Declarations only: nothing here runs, and the owner of each name
is said beside it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch
    import trio

    from dgt import wire
    from dgt.channels.slot import Slot
    from dgt.channels.tcp import TcpChannel, TcpListener
    from dgt.channels.udp import UdpChannel
    from dgt.channels.udp_scheduler import DatagramScheduler
    from dgt.errors import PeerClosed, RankMismatch
    from dgt.layout import BucketLayout
    from dgt.protocol.bulk import BulkReceiver
    from dgt.protocol.cpu_gate import CpuGate
    from dgt.protocol.datagram_mac import DatagramMac
    from dgt.protocol.events import BulkDone, Event, RoundDone
    from dgt.protocol.pacing import Pacer
    from dgt.protocol.receiver import RoundReceiver
    from dgt.transport.config import PeerAddress, TransportConfig
    from dgt.transport.deadline_timer import DeadlineTimer
    from dgt.transport.records import Link, SendTrack
    from dgt.transport.stats import RoundResult, TransportStats
    from dgt.transport.stream_watch import StreamWatch
    from dgt.transport.streams import StreamHub

Key = tuple[int, int, int]
"""(peer, bucket, round): one round of one bucket from or to one peer."""


class EndpointState:
    """The attributes every part of the endpoint reads (set by ``Endpoint.__init__``)."""

    rank: int
    token: int
    cfg: TransportConfig
    host: str
    receiver: RoundReceiver
    bulk: BulkReceiver
    listener: TcpListener
    udp: dict[int, UdpChannel]
    scheduler: DatagramScheduler
    deadlines: DeadlineTimer
    streams: StreamHub
    cpu_gate: CpuGate | None  # endpoint: fed the lossy hops' readings on the trio thread (links.exchange)
    _links: dict[int, Link]  # handshake: the link registry
    _link_ready: dict[int, Slot]
    _sources: dict[tuple[str, int], int]  # (host, UDP port) -> rank
    _handshakes: int
    _key: bytes
    _mac: DatagramMac | None
    _recv_waiters: dict[Key, Slot]  # inbound
    _results: OrderedDict[Key, RoundResult]
    _out: OrderedDict[Key, torch.Tensor]
    _opened: OrderedDict[Key, float]
    _on_link: OrderedDict[Key, None]  # endpoint: peers' ON_LINK notices (a round-path bucket family, i22)
    _bytes_rx: dict[tuple[int, int], int]
    _drop_rng: np.random.Generator | None
    _rx_dropped_hook: dict[int, int]
    _lane_delivered: dict[int, list[int]]
    _sending: dict[Key, SendTrack]  # outbound
    _layouts: dict[int, BucketLayout]
    _bytes_tx: dict[tuple[int, int], int]
    _tx_abandoned: dict[int, int]
    _tx_unsent: dict[int, int]
    _tx_lost: dict[int, int]
    _stats: TransportStats
    _nursery: trio.Nursery | None  # endpoint: the service tasks
    _closing: bool
    _fatal: BaseException | None
    _abort: RankMismatch | None  # links: the session abort
    _aborted: trio.Event
    _lost_sent: bool  # links: call_failed told the peers
    _lost: dict[int, PeerClosed]  # links: the failures peers reported (control LOST)
    _link_change: trio.Event  # links: set (and replaced) when a link fails or the session aborts
    _stream_watch: StreamWatch
    _exchange_scopes: set[trio.CancelScope]

    if TYPE_CHECKING:  # methods one part calls on another (defined where the comment says)

        @property
        def address(self) -> PeerAddress: ...  # endpoint

        def _check_open(self) -> None: ...  # endpoint

        def _spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None: ...  # endpoint

        def _link(self, peer: int) -> Link: ...  # links

        async def _run_link(self, link: Link) -> None: ...  # links

        def _fail_peer(self, rank: int, error: BaseException) -> None: ...  # links

        def _fail_pending(self, rank: int, error: BaseException) -> None: ...  # links

        def _stream_conflict(self, key: Key) -> RankMismatch: ...  # links

        async def aborted(self, within: float, dead: Iterable[int] | None = None) -> RankMismatch | None: ...  # links

        def _handle(self, events: Sequence[Event]) -> None: ...  # inbound

        def _finished(self, done: list[RoundDone]) -> None: ...  # inbound

        def _bulk_done(self, d: BulkDone) -> None: ...  # inbound

        def _on_drop_report(self, frame: wire.Frame) -> None: ...  # outbound

        def _layout(self, numel: int) -> BucketLayout: ...  # outbound

        def _pacer_of(self, peer: int) -> Pacer | None: ...  # outbound

        async def _dial_stream(self, rank: int, direction: int) -> TcpChannel: ...  # handshake

        def _link_error(self, rank: int) -> BaseException | None: ...  # handshake
