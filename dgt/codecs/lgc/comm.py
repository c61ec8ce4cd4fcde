"""The communication steps LGC needs, as an explicit protocol, plus an in-process K-rank implementation for tests.

Every LGC transfer goes through one of the :class:`Comm` methods below, each call naming a ``tag`` under which the
bytes this rank put on the wire are counted. The real DGT collectives plug in through an adapter implementing the same
protocol; :class:`LocalComm` (ranks as threads of one process, real tensors, real byte counts) serves the tests.

Byte counting rule (both implementations must follow it): a rank counts the payload bytes it *sends* to other ranks
(``numel * element_size`` of every tensor or chunk it transmits); messages to itself are free; shapes and dtypes are
metadata the transport frames itself and are not counted (LGC's variable-length payloads carry their own headers,
see :mod:`dgt.codecs.lgc.wire`, and those are counted because they are payload).
"""

from __future__ import annotations

import threading
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


class _Hub:
    """State shared by the ranks of one LocalGroup: a reusable barrier, one slot per rank, mailboxes for p2p."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Any] = [None] * world_size
        self.cond = threading.Condition()
        self.mail: dict[tuple[int, int, str], list[torch.Tensor]] = defaultdict(list)


class LocalComm:
    """One rank of an in-process group (use :func:`run_ranks` or :class:`LocalGroup` to make and drive them).

    Data really moves between ranks as tensor copies; nothing is shared by reference.
    """

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.stats = CommStats()

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _exchange(self, item: Any) -> list[Any]:
        """Lock-step all-to-all of one Python object per rank (two barrier phases so slots can be reused)."""
        hub = self._hub
        hub.slots[self.rank] = item
        hub.barrier.wait()
        items = list(hub.slots)
        hub.barrier.wait()
        return items

    def barrier(self) -> None:
        self._hub.barrier.wait()

    # -- collectives -------------------------------------------------------------------------------------------
    def allreduce_sum(self, t: torch.Tensor, *, tag: str) -> torch.Tensor:
        k, r = self.world_size, self.rank
        flat = t.detach().reshape(-1).clone()
        if k == 1:
            return flat.view_as(t)
        chunks = list(torch.tensor_split(flat, k))  # views into flat
        left = (r - 1) % k  # each rank sends to (r + 1) % k and receives from its left neighbour
        # reduce-scatter: after k-1 steps rank r owns the full sum of chunk (r + 1) % k
        for s in range(k - 1):
            send_idx = (r - s) % k
            out = chunks[send_idx].clone()
            self.stats.add_sent(tag, nbytes(out))
            got = self._exchange(out)[left]
            recv_idx = (left - s) % k
            self.stats.add_received(tag, nbytes(got))
            chunks[recv_idx] += got.to(flat.device)
        # all-gather of the reduced chunks around the ring
        for s in range(k - 1):
            send_idx = (r + 1 - s) % k
            out = chunks[send_idx].clone()
            self.stats.add_sent(tag, nbytes(out))
            got = self._exchange(out)[left]
            recv_idx = (left + 1 - s) % k
            self.stats.add_received(tag, nbytes(got))
            chunks[recv_idx].copy_(got.to(flat.device))
        return flat.view_as(t)

    def allgather(self, t: torch.Tensor, *, tag: str) -> list[torch.Tensor]:
        own = t.detach().reshape(-1).clone()
        self.stats.add_sent(tag, nbytes(own) * (self.world_size - 1))
        items = self._exchange(own)
        out = []
        for j, x in enumerate(items):
            if j != self.rank:
                self.stats.add_received(tag, nbytes(x))
            out.append(x.to(t.device).clone())
        return out

    def broadcast(self, t: torch.Tensor | None, src: int, *, tag: str, device: Any = None) -> torch.Tensor:
        if self.rank == src:
            if t is None:
                raise ValueError("the broadcast source must pass a tensor")
            own = t.detach().reshape(-1).clone()
            self.stats.add_sent(tag, nbytes(own) * (self.world_size - 1))
            self._exchange(own)
            return own
        got = self._exchange(None)[src]
        self.stats.add_received(tag, nbytes(got))
        dev = t.device if t is not None else device
        return got.to(dev).clone() if dev is not None else got.clone()

    def gather_to(self, root: int, t: torch.Tensor, *, tag: str) -> list[torch.Tensor] | None:
        own = t.detach().reshape(-1).clone()
        if self.rank != root:
            self.stats.add_sent(tag, nbytes(own))
        items = self._exchange(own)
        if self.rank != root:
            return None
        out = []
        for j, x in enumerate(items):
            if j != root:
                self.stats.add_received(tag, nbytes(x))
            out.append(x.to(t.device).clone())
        return out

    def send_to(self, dst: int, t: torch.Tensor, *, tag: str) -> None:
        own = t.detach().reshape(-1).clone()
        if dst != self.rank:
            self.stats.add_sent(tag, nbytes(own))
        hub = self._hub
        with hub.cond:
            hub.mail[(self.rank, dst, tag)].append(own)
            hub.cond.notify_all()

    def recv_from(self, src: int, *, tag: str, device: Any = None) -> torch.Tensor:
        hub = self._hub
        key = (src, self.rank, tag)
        with hub.cond:
            if not hub.cond.wait_for(lambda: bool(hub.mail[key]), timeout=hub.timeout):
                raise TimeoutError(f"rank {self.rank}: nothing from rank {src} with tag {tag!r}")
            got = hub.mail[key].pop(0)
        if src != self.rank:
            self.stats.add_received(tag, nbytes(got))
        return got.to(device) if device is not None else got


class LocalGroup:
    """K LocalComm ranks sharing one hub (one per thread)."""

    def __init__(self, world_size: int, timeout: float = 120.0) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.hub = _Hub(world_size, timeout)
        self.comms = [LocalComm(self.hub, r) for r in range(world_size)]

    def abort(self) -> None:
        self.hub.barrier.abort()


def run_ranks(world_size: int, fn: Callable[[LocalComm], Any], timeout: float = 120.0) -> list[Any]:
    """Run ``fn(comm)`` on ``world_size`` threads (one per rank) and return their results in rank order.

    An exception on any rank breaks the barrier for the others and is re-raised here (the first one by rank).
    """
    group = LocalGroup(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(r: int) -> None:
        try:
            results[r] = fn(group.comms[r])
        except BaseException as exc:  # re-raised in the caller
            errors[r] = exc
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"lgc-rank{r}", daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    primary = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if primary:
        raise primary[0]
    for e in errors:
        if e is not None:
            raise e
    return results


def total_sent(comms: Sequence[Any], pred: Callable[[str], bool] = lambda _t: True) -> int:
    return sum(c.stats.sent_where(pred) for c in comms)
