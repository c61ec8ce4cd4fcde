"""The communication steps LGC needs, as an explicit protocol.

Every LGC transfer goes through one of the :class:`Comm` methods below, each call naming a ``tag`` under which the
bytes this rank put on the wire are counted. The real DGT collectives plug in through an adapter implementing the same
protocol (:class:`dgt.collectives.lgc_comm.TransportComm`); :class:`dgt.harness.local_comm.LocalComm` (ranks as
threads of one process, real tensors, real byte counts) serves the tests and the LGC bench.

Byte counting rule (both implementations must follow it): a rank counts the payload bytes it *sends* to other ranks
(``numel * element_size`` of every tensor or chunk it transmits); messages to itself are free; shapes and dtypes are
metadata the transport frames itself and are not counted (LGC's variable-length payloads carry their own headers,
see :mod:`dgt.codecs.lgc.wire`, and those are counted because they are payload).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class CommStats:
    """Bytes a rank sent and received, per tag (tags are free-form strings chosen by the caller)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add_sent(self, tag: str, nbytes: int) -> None:
        self.sent[tag] += int(nbytes)
        self.messages[tag] += 1

    def add_received(self, tag: str, nbytes: int) -> None:
        self.received[tag] += int(nbytes)

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    def sent_where(self, pred: Callable[[str], bool]) -> int:
        return sum(v for k, v in self.sent.items() if pred(k))


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@runtime_checkable
class Comm(Protocol):
    """What LGC asks of a communication backend. All methods are collective over the whole group unless noted.

    Tensors may live on any device; results come back on the caller's input device (or ``device`` when the caller
    passes no tensor). ``tag`` only labels the byte counters.
    """

    rank: int
    world_size: int
    stats: CommStats

    def allreduce_sum(self, t: torch.Tensor, *, tag: str) -> torch.Tensor:
        """Element-wise sum over all ranks of same-shape float tensors (LocalComm: ring reduce-scatter + all-gather,
        each rank sends 2 (K-1)/K of the tensor)."""
        ...

    def allgather(self, t: torch.Tensor, *, tag: str) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (1-D, lengths may differ; each rank sends its tensor to K-1 others)."""
        ...

    def broadcast(self, t: torch.Tensor | None, src: int, *, tag: str, device: Any = None) -> torch.Tensor:
        """``src``'s 1-D tensor on every rank; the others pass None (the length is not known to them in advance)."""
        ...

    def gather_to(self, root: int, t: torch.Tensor, *, tag: str) -> list[torch.Tensor] | None:
        """Every rank's 1-D tensor (lengths may differ) at ``root`` in rank order; None elsewhere."""
        ...

    def send_to(self, dst: int, t: torch.Tensor, *, tag: str) -> None:
        """Point to point (pairs with ``recv_from`` on ``dst``); not collective."""
        ...

    def recv_from(self, src: int, *, tag: str, device: Any = None) -> torch.Tensor:
        ...


def total_sent(comms: Sequence[Any], pred: Callable[[str], bool] = lambda _t: True) -> int:
    return sum(c.stats.sent_where(pred) for c in comms)
