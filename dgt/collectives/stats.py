"""What a collective call reports: bytes per lane, drops, time per phase."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CollectiveStats:
    bytes_received: dict[int, int] = field(default_factory=dict)  # lane -> bytes (headers included)
    bytes_sent: dict[int, int] = field(default_factory=dict)  # lane -> bytes of payload parts handed to the transport
    blocks: int = 0  # blocks received in total
    dropped: int = 0  # blocks lost (wholly or partly) at their deadline
    unsent: int = 0  # blocks received as missing because their sender's send budget kept them back (not lost)
    unimportant_received: int = 0  # unimportant blocks that arrived before their round closed
    bytes_unsent: int = 0  # payload bytes this rank's send budget kept back (error feedback carries them)
    held_blocks: int = 0  # blocks of its own chunk whose own contribution the owner held back (ring hold_own)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    plan: Any = None  # the call's path: a dgt.collectives.plan.CallPlan (None: a collective without one)

    def add_round(self, stats) -> None:
        for lane, ls in stats.lanes.items():
            self.bytes_received[lane] = self.bytes_received.get(lane, 0) + ls.bytes
        self.blocks += stats.blocks
        self.dropped += stats.dropped
        self.unsent += getattr(stats, "unsent", 0)
        self.unimportant_received += getattr(stats, "unimportant_received", 0)

    def add_lossy_hop(self, res: Any) -> None:
        """What one lossy ring hop (a ``dgt.transport.lossy_hop.LossyHopResult``) received and sent."""
        self.add_round(res.round)
        for lane, n in res.sent.items():
            self.add_sent(lane, n)
        self.bytes_unsent += res.unsent_bytes
        self.bytes_received[0] = self.bytes_received.get(0, 0) + res.received
        # the round counts the blocks it never announced as unsent: those on the stream lane were not
        self.unsent -= min(res.important, self.unsent)

    def add_sent(self, lane: int, nbytes: int) -> None:
        self.bytes_sent[lane] = self.bytes_sent.get(lane, 0) + nbytes

    def merge(self, other: CollectiveStats) -> None:
        for lane, b in other.bytes_received.items():
            self.bytes_received[lane] = self.bytes_received.get(lane, 0) + b
        for lane, b in other.bytes_sent.items():
            self.add_sent(lane, b)
        self.blocks += other.blocks
        self.dropped += other.dropped
        self.unsent += other.unsent
        self.unimportant_received += other.unimportant_received
        self.bytes_unsent += other.bytes_unsent
        self.held_blocks += other.held_blocks
        for k, v in other.phases.items():
            self.phases[k] = self.phases.get(k, 0.0) + v

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.plan is not None:
            d["plan"] = self.plan.to_dict()
        return d


@dataclass
class CollectiveResult:
    tensor: object  # torch.Tensor
    stats: CollectiveStats
