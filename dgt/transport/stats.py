"""What the endpoint API returns and counts: round results, send statistics and per-lane transport statistics,
all dataclasses that turn into JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dgt.layout import BucketLayout
from dgt.protocol.stats import RoundProgress, RoundStats


@dataclass
class RoundResult:
    """A received round: the tensor (zeros where blocks were lost), a bool per block (received), the receiver's
    statistics, the layout; ``elapsed`` runs from the round's opening frame to its close."""

    data: torch.Tensor
    mask: torch.Tensor
    stats: RoundStats
    layout: BucketLayout
    sender: int = 0
    bucket: int = 0
    round: int = 0
    elapsed: float = 0.0
    bulk: bool = False  # came as a lossless BULK message: ``mask`` and ``layout`` are those of a flat bucket
    codec: int = 0  # the sender's header codec byte: a collective's call code (its op), 0 when none was given

    @property
    def goodput(self) -> float:
        """Bytes of received blocks per second of the round."""
        if self.elapsed <= 0:
            return 0.0
        got = int(self.layout.block_len[self.mask].sum()) * self.data.element_size()
        return got / self.elapsed

    def to_dict(self) -> dict[str, Any]:
        return {
            "sender": self.sender, "bucket": self.bucket, "round": self.round, "elapsed": self.elapsed,
            "goodput": self.goodput, "received_blocks": int(self.mask.sum()), "stats": self.stats.to_dict(),
        }  # fmt: skip


@dataclass
class SendStats:
    """Sender-side account of one round to one peer."""

    peer: int
    bucket: int
    round: int
    important_blocks: int = 0
    unimportant_blocks: int = 0
    reliable_frames: int = 0
    reliable_bytes: int = 0
    datagrams: dict[int, int] = field(default_factory=dict)  # lane -> datagrams sent
    datagram_bytes: dict[int, int] = field(default_factory=dict)
    abandoned: dict[int, int] = field(default_factory=dict)  # lane -> datagrams not sent: the round had closed
    report: bool = False  # the receiver's drop report arrived
    lost_blocks: int = 0  # blocks sent that the receiver missed (from the drop report)
    unsent_blocks: int = 0  # unimportant blocks the send budget kept back (into error feedback, not lost)
    unsent_bytes: int = 0  # their payload bytes
    folded_elems: int = 0  # elements folded into the error-feedback residual
    copied: bool = False  # the bucket was copied (error-feedback residual added)
    elapsed: float = 0.0
    pace_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("datagrams", "datagram_bytes", "abandoned"):
            d[k] = {str(lane): v for lane, v in d[k].items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


@dataclass
class LaneStats:
    """One lane of an endpoint, both directions, since it opened."""

    lane: int
    name: str
    kind: str
    dscp: int
    priority: int
    tx_bytes: int = 0
    tx_frames: int = 0  # frames (TCP) or datagrams (UDP) handed to the kernel
    tx_calls: int = 0
    tx_gso_calls: int = 0
    tx_abandoned: int = 0  # datagrams never sent because their round had closed
    tx_unsent_blocks: int = 0  # unimportant blocks the send budget kept back (error feedback carries them)
    tx_lost_blocks: int = 0  # unimportant blocks sent on this lane that the receivers reported missing
    tx_errors: int = 0
    rx_bytes: int = 0
    rx_frames: int = 0
    rx_calls: int = 0
    rx_gro_reads: int = 0
    rx_dropped_hook: int = 0  # discarded by the drop_fraction test hook
    rx_unknown_source: int = 0
    rx_truncated: int = 0
    rx_kernel_drops: int = 0  # dropped by the kernel, receive buffer full (SO_RXQ_OVFL)
    delivered_blocks: int = 0  # blocks of finished rounds that arrived on this lane
    delivered_bytes: int = 0
    goodput: float = 0.0  # delivered bytes / seconds of receiving rounds
    gso: bool | None = None
    gro: bool | None = None
    rcvbuf: int | None = None
    sndbuf: int | None = None


@dataclass
class PendingRounds:
    """What an endpoint waits for, the first ``limit`` of each (``ep.inbound.pending_rounds()``): rounds a receive
    awaits, rounds in flight (sent, their drop report not in), results nobody collected yet, open rounds."""

    recv_waiters: list[tuple[int, int, int]]
    sending: list[tuple[int, int, int]]
    results: list[tuple[int, int, int]]
    open_rounds: list[RoundProgress]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"recv_waiters": [list(k) for k in self.recv_waiters],
                             "sending": [list(k) for k in self.sending], "results": [list(k) for k in self.results]}
        if self.open_rounds:
            d["open_rounds"] = [r.to_dict() for r in self.open_rounds]
        return d


@dataclass
class TransportStats:
    """Endpoint totals: lanes, rounds, losses, deadline waits, rejected input."""

    rank: int
    lanes: list[LaneStats]
    rounds_sent: int = 0
    rounds_received: int = 0
    blocks_received: int = 0
    blocks_dropped: int = 0  # unimportant blocks missing when their round closed
    late_frames: int = 0  # frames for rounds already closed
    rejected: int = 0  # invalid frames, wrong session token, ...
    reject_reasons: dict[str, int] = field(default_factory=dict)
    closed_by: dict[str, int] = field(default_factory=dict)  # complete / deadline / sender-gone / aborted
    deadline_wait_total: float = 0.0
    deadline_wait_max: float = 0.0
    receive_seconds: float = 0.0  # sum of round durations (opening frame to close)
    results_evicted: int = 0  # finished rounds nobody collected, evicted from the buffer
    rounds_copied: int = 0  # rounds given an ``out`` they could not land in (opened before it was posted): one copy
    pace_rates: dict[int, float] = field(default_factory=dict)  # peer -> bytes/s
    # lossy ring hops: rounds the CPU gate kept from sending datagrams (dgt.protocol.cpu_gate), and its reading:
    # the average fraction of a hop's transfer its thread waited for a CPU (None: no reading, or no gate)
    rounds_cpu_gated: int = 0
    cpu_wait: float | None = None
    pace_shared_peers: int = 0  # peers whose TCP bytes come off the datagrams' pacing budget (pace_shared)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pace_rates"] = {str(k): v for k, v in self.pace_rates.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
