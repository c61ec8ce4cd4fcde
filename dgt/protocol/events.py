"""What the sans-IO receivers tell the endpoint, as one vocabulary of frozen event classes (the h11 model).

Every receive method of :class:`dgt.protocol.receiver.RoundReceiver` and :class:`dgt.protocol.bulk.BulkReceiver`
returns a ``list[Event]``; the endpoint dispatches on the class and never reads the receivers' internals or their
counters to learn what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.stats import RoundStats

Key = tuple[int, int, int]  # (sender rank, bucket, round)

ALREADY_CLOSED = "already closed"


@dataclass(frozen=True)
class RoundDone:
    """A finalised round: the tensor (zeros where blocks were lost), the per-block received mask, the statistics,
    and the DROP_REPORT frame to send back to the sender on the reliable lane."""

    sender: int
    bucket: int
    round: int
    data: torch.Tensor
    mask: torch.Tensor
    stats: RoundStats
    report: bytes | None  # the DROP_REPORT frame for the sender; None when the sender asked for none
    layout: BucketLayout
    codec: int = 0  # the ROUND_BEGIN header's codec byte (a collective's call code: its op)

    @property
    def key(self) -> Key:
        return (self.sender, self.bucket, self.round)


@dataclass(frozen=True)
class DropReportIn:
    """A drop report from a peer, for this endpoint's sender."""

    frame: wire.Frame


@dataclass(frozen=True)
class BulkDone:
    """A complete lossless message (BULK frames, :mod:`dgt.protocol.bulk`)."""

    key: Key
    data: torch.Tensor
    frames: int
    nbytes: int  # payload + headers
    elapsed: float
    codec: int = 0


@dataclass(frozen=True)
class RoundRefused:
    """A ROUND_BEGIN the receiver did not open: its sender would wait forever for the round, so the endpoint tells
    it why. ``reason``: :data:`ALREADY_CLOSED` (a round key reused), or the rejection counted in the receiver's
    counters (``too-many-rounds``, ``memory-budget``, a malformed ROUND_BEGIN's wire error)."""

    key: Key
    reason: str

    @property
    def why(self) -> str:
        """The text the sender's error carries."""
        return self.reason if self.reason == ALREADY_CLOSED else f"refused ({self.reason})"


Event = RoundDone | DropReportIn | BulkDone | RoundRefused
