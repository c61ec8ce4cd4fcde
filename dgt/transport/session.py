"""What every part of the endpoint shares (issue 44): :class:`Session`, a small context with named fields, handed to
each part's constructor instead of the endpoint itself. It holds who this rank is and its config, the sans-IO
receivers every part feeds or reads (the :class:`~dgt.transport.inbound.Inbound` part installs their landing
buffers), the endpoint's round counters, and whether the endpoint is still open. The parts themselves
(dgt.transport.links, outbound, inbound, exchange, hop_round, handshake) own everything else.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from dgt.errors import PeerClosed
from dgt.layout import DEFAULT_BLOCK, BucketLayout
from dgt.transport.stats import TransportStats

if TYPE_CHECKING:
    import trio

    from dgt.protocol.bulk import BulkReceiver
    from dgt.protocol.receiver import RoundReceiver
    from dgt.transport.config import TransportConfig

Key = tuple[int, int, int]
"""(peer, bucket, round): one round of one bucket from or to one peer."""


class Session:
    """One rank's session as its parts see it. ``closing``/``fatal`` are set by the endpoint (its close, or an error
    in a service task); ``nursery`` is the endpoint's service nursery while it runs (:meth:`spawn`)."""

    def __init__(self, rank: int, token: int, cfg: TransportConfig, receiver: RoundReceiver,
                 bulk: BulkReceiver) -> None:
        self.rank = rank
        self.token = token
        self.cfg = cfg
        self.receiver = receiver
        self.bulk = bulk
        self.stats = TransportStats(rank, [])  # rounds sent and received, losses, deadline waits (both directions)
        self.closing = False
        self.fatal: BaseException | None = None
        self.nursery: trio.Nursery | None = None

    def check_open(self) -> None:
        """The error a new operation raises once the endpoint failed or closes."""
        if self.fatal is not None:
            raise self.fatal.with_traceback(None)
        if self.closing:
            raise PeerClosed(f"rank {self.rank}: the endpoint is closed")

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Start ``fn(*args)`` among the endpoint's service tasks (a link's tasks, an accepted handshake)."""
        if self.nursery is None:
            raise PeerClosed(f"rank {self.rank}: the endpoint is not running")
        self.nursery.start_soon(fn, *args)

    def layout(self, numel: int) -> BucketLayout:
        """The flat layout of a bucket of ``numel`` elements in the default block, for a round sent without a layout
        (the shared instance; a codec's part brings its own layout: the codec's block is the one source, issue 44)."""
        return BucketLayout.flat(numel, DEFAULT_BLOCK)

    def bound(self, links: int) -> int:
        """How many per-round entries a table keyed by round may keep (posts, openings, notices): bounded by the open
        round limit per connected peer."""
        return 4 * self.cfg.limits.max_open_rounds * max(1, links)
