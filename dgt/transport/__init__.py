"""DGT transport: endpoint sessions over the reliable and unreliable lanes. This package is the session API the
collectives, the DDP shim and the experiments import (implementation in dgt.transport.endpoint and its neighbours).

    async with Endpoint.open(rank, token, TransportConfig(), host="127.0.0.1") as ep:   # closed when the block ends
    (settings in groups: ``TransportConfig(timeouts=Timeouts(peer=5), pacing=Pacing(rate=1e8))``, docs/options.md)
        await ep.connect({peer: address})
        stats = await ep.send_round(peer, bucket, round, flat, cls=classes, order=order)
        res = await ep.recv_round(peer, bucket, round)   # RoundResult(data, mask, stats, layout)

(``await Endpoint.start(..., nursery=n)`` runs the endpoint's service in a nursery of the caller's instead.)
"""

from dgt.channels.lanes import LaneSpec, default_lanes, three_lanes
from dgt.errors import PeerClosed, PeerTimeout
from dgt.transport.blocking import BlockingEndpoint
from dgt.transport.config import (
    Congestion,
    Faults,
    Hops,
    Lanes,
    Pacing,
    PeerAddress,
    Security,
    Sockets,
    Timeouts,
    TransportConfig,
)
from dgt.transport.endpoint import BYTES_BUCKET, Endpoint
from dgt.transport.stats import LaneStats, RoundResult, SendStats, TransportStats
from dgt.wire import Limits

__all__ = [
    "BYTES_BUCKET",
    "BlockingEndpoint",
    "Congestion",
    "Endpoint",
    "Faults",
    "Hops",
    "LaneSpec",
    "LaneStats",
    "Lanes",
    "Limits",
    "Pacing",
    "PeerAddress",
    "PeerClosed",
    "PeerTimeout",
    "RoundResult",
    "Security",
    "SendStats",
    "Sockets",
    "Timeouts",
    "TransportConfig",
    "TransportStats",
    "default_lanes",
    "three_lanes",
]
