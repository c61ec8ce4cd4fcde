"""Round statistics: what each lane carried and what was lost, as a dataclass that turns into JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def lane_counts(classes: np.ndarray) -> dict[int, int]:
    """How many of ``classes`` (lane classes: small non-negative ints) are in each lane, for the lanes with any."""
    counts = np.bincount(np.asarray(classes).astype(np.intp, copy=False))
    lanes = np.flatnonzero(counts)
    return dict(zip(lanes.tolist(), counts[lanes].tolist()))


@dataclass
class RoundLaneStats:
    """What one lane carried for one round (receiver side); the transport's per-lane totals are
    :class:`dgt.transport.stats.LaneStats`."""

    frames: int = 0
    blocks: int = 0
    bytes: int = 0  # payload + header bytes received on this lane for the round


@dataclass
class RoundStats:
    """Receiver-side account of one round. Invariant: important + unimportant_received + dropped + unsent == blocks."""

    sender: int = 0
    bucket: int = 0
    round: int = 0
    blocks: int = 0
    important: int = 0
    unimportant_received: int = 0
    dropped: int = 0  # unimportant blocks sent but missing (wholly or partly) at finalisation: lost
    unsent: int = 0  # unimportant blocks the sender's send budget kept back (not announced in ROUND_END)
    partial: int = 0  # of the dropped blocks, those with some fragments in (zeroed)
    duplicated: int = 0  # frames whose data had already arrived
    rejected: int = 0  # frames that failed validation against the round (bad offsets, counts)
    late: int = 0  # frames that arrived after the round was finalised
    deadline_wait: float = 0.0  # seconds from "all important in" to finalisation
    closed_by: str = ""  # "complete", "deadline", "sender-gone" (important all in) or "aborted"
    lanes: dict[int, RoundLaneStats] = field(default_factory=dict)

    def lane(self, lane: int) -> RoundLaneStats:
        if lane not in self.lanes:
            self.lanes[lane] = RoundLaneStats()
        return self.lanes[lane]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lanes"] = {str(k): asdict(v) for k, v in self.lanes.items()}
        return d


@dataclass(frozen=True)
class RoundProgress:
    """How far an open round has come (what a stuck call waits for: :meth:`RoundReceiver.progress`)."""

    key: tuple[int, int, int]  # (sender, bucket, round)
    end: tuple[int, int, int, int] | None  # its ROUND_END's announcement, None until it came
    important_done: int  # important blocks complete
    blocks_done: int  # blocks complete
    important_done_at: float | None  # when the last important block came in

    def to_dict(self) -> dict[str, Any]:
        return {"key": list(self.key), "end": self.end, "important_done": self.important_done,
                "blocks_done": self.blocks_done, "important_done_at": self.important_done_at}


@dataclass
class ReceiverCounters:
    """Counters of frames that belong to no open round (kept across rounds)."""

    rejected: int = 0  # invalid headers / wrong session token
    late: int = 0  # for rounds already finalised
    unknown: int = 0  # for rounds never announced and beyond the early buffer
    early_buffered: int = 0
    early_expired: int = 0  # early-buffer entries dropped unreplayed after ``early_ttl``
    early_refused: int = 0  # input refused by the early buffer's bounds (``early_rounds_per_peer``, ``early_bytes``)
    reasons: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str, n: int = 1) -> None:
        self.rejected += n
        self.reasons[reason] = self.reasons.get(reason, 0) + n
