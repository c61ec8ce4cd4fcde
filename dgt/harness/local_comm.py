"""LGC's :class:`~dgt.codecs.lgc.comm.Comm` with K ranks as threads of one process (tests and the LGC bench).

Data really moves between ranks as tensor copies through a shared barrier and mailboxes, and every rank counts its
bytes as the Comm protocol's rule says, so a test can check the runner's byte accounting without sockets. The same
choreography over real sockets is :class:`dgt.collectives.lgc_comm.TransportComm`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from dgt.codecs.lgc.comm import CommStats, nbytes


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
    """One rank of an in-process group (use :func:`run_threads` or :class:`LocalGroup` to make and drive them).

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


def run_threads(fn: Callable[[LocalComm], Any], world_size: int, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(comm)`` on ``world_size`` threads (one per rank) and return their results in rank order; the
    in-process counterpart of :func:`dgt.collectives.launch.run_ranks` (processes over the real transport), with the
    same argument order.

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
