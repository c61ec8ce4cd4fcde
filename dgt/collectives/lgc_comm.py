"""LGC's ``Comm`` protocol over the DGT transport, so every LGC transfer crosses real sockets and is counted.

LGC drives its rounds synchronously; this adapter owns a :class:`~dgt.transport.bridge.TrioThread` running a
:class:`Group` (its endpoint in the thread's nursery), and each ``Comm`` call runs one coroutine there. Everything
travels on the reliable lane (LGC is not loss-tolerant): all-reduce as our ring all-reduce (dense, sum), the
variable-length transfers as lossless tensor messages.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import trio

from dgt.codecs.lgc.comm import CommStats, nbytes
from dgt.collectives.group import Group
from dgt.collectives.ring import RingAllReduce
from dgt.errors import PeerClosed, open_nursery, single_error
from dgt.transport.bridge import TrioThread

R = TypeVar("R")


def _tag_id(tag: str) -> int:
    """A message tag for the transport that every rank derives alike from LGC's string tag."""
    return 0x4000 | (zlib.crc32(tag.encode()) & 0x3FFF)


class TransportComm:
    """One rank's Comm; build with :meth:`start` (rendezvous via the c10d store or env://), end with :meth:`close`."""

    def __init__(self) -> None:
        self.stats = CommStats()
        self.rank = -1
        self.world_size = 0
        self._bridge: TrioThread[Group] | None = None
        self._group: Group | None = None
        self._ring: RingAllReduce | None = None
        self._buckets: dict[str, int] = {}
        self._self_mail: dict[str, list[torch.Tensor]] = {}  # messages to ourselves never touch the network

    @classmethod
    def start(cls, rank: int, world: int, **group_kwargs: Any) -> TransportComm:
        self = cls()

        async def setup(nursery: trio.Nursery) -> Group:  # all-gather/broadcast: every link at once
            return await Group.create(rank, world, connect="all", nursery=nursery, **group_kwargs)

        self._bridge = TrioThread(f"dgt-lgc-comm-{rank}", closed=PeerClosed)
        self._group = self._bridge.start(setup, teardown=Group.aclose)
        self.rank, self.world_size = rank, world
        self._ring = RingAllReduce(self._group, "dense", op="sum")
        return self

    def close(self) -> None:
        if self._bridge is not None:
            self._bridge.stop(30)

    def _run(self, fn, *args):
        with single_error():  # the peer tasks' error itself, not a group of it
            return self._bridge.call(fn, *args)

    @property
    def _ep(self):
        return self._group.endpoint

    def on_endpoint(self, fn: Callable[[Any], R]) -> R:
        """``fn(endpoint)`` on the comm's trio thread, which owns the endpoint (docs/architecture.md, Threads)."""
        return self._bridge.call_sync(fn, self._ep)

    # -- the Comm protocol ---------------------------------------------------------------------------------------
    def allreduce_sum(self, t: torch.Tensor, *, tag: str) -> torch.Tensor:
        bucket = self._buckets.setdefault(tag, len(self._buckets))  # collective: every rank sees tags in one order
        # the ring is the only collective on this comm's own group: tag ids are its bucket ids (transport keys hold
        # bucket ids below 16384; send_tensor messages travel in their own key range)
        res = self._run(self._ring.allreduce, t.detach().to("cpu", torch.float32), bucket, None)
        self.stats.add_sent(tag, sum(res.stats.bytes_sent.values()))
        self.stats.add_received(tag, nbytes(t) * 2 * (self.world_size - 1) // max(self.world_size, 1))
        return res.tensor.to(device=t.device, dtype=t.dtype)

    def allgather(self, t: torch.Tensor, *, tag: str) -> list[torch.Tensor]:
        tid, flat = _tag_id(tag), t.detach().reshape(-1).to("cpu")
        out: list[torch.Tensor | None] = [None] * self.world_size
        out[self.rank] = flat

        async def go() -> None:
            async def recv(p: int) -> None:
                out[p] = await self._ep.recv_tensor(p, tid)

            async with open_nursery() as nursery:
                for p in range(self.world_size):
                    if p != self.rank:
                        nursery.start_soon(self._ep.send_tensor, p, flat, tid)
                        nursery.start_soon(recv, p)

        self._run(go)
        self.stats.add_sent(tag, nbytes(flat) * (self.world_size - 1))
        for p, x in enumerate(out):
            if p != self.rank:
                self.stats.add_received(tag, nbytes(x))
        return [x.to(t.device) for x in out]  # type: ignore[union-attr]

    def broadcast(self, t: torch.Tensor | None, src: int, *, tag: str, device: Any = None) -> torch.Tensor:
        tid = _tag_id(tag)
        if self.rank == src:
            flat = t.detach().reshape(-1).to("cpu")

            async def go() -> None:
                async with open_nursery() as nursery:
                    for p in range(self.world_size):
                        if p != src:
                            nursery.start_soon(self._ep.send_tensor, p, flat, tid)

            self._run(go)
            self.stats.add_sent(tag, nbytes(flat) * (self.world_size - 1))
            return t
        got = self._run(self._ep.recv_tensor, src, tid)
        self.stats.add_received(tag, nbytes(got))
        return got.to(device or "cpu")

    def gather_to(self, root: int, t: torch.Tensor, *, tag: str) -> list[torch.Tensor] | None:
        tid, flat = _tag_id(tag), t.detach().reshape(-1).to("cpu")
        if self.rank != root:
            self._run(self._ep.send_tensor, root, flat, tid)
            self.stats.add_sent(tag, nbytes(flat))
            return None
        out: list[torch.Tensor | None] = [None] * self.world_size
        out[root] = flat

        async def go() -> None:
            async def recv(p: int) -> None:
                out[p] = await self._ep.recv_tensor(p, tid)

            async with open_nursery() as nursery:
                for p in range(self.world_size):
                    if p != root:
                        nursery.start_soon(recv, p)

        self._run(go)
        for p, x in enumerate(out):
            if p != root:
                self.stats.add_received(tag, nbytes(x))
        return [x.to(t.device) for x in out]  # type: ignore[union-attr]

    def send_to(self, dst: int, t: torch.Tensor, *, tag: str) -> None:
        flat = t.detach().reshape(-1).to("cpu")
        if dst == self.rank:
            self._self_mail.setdefault(tag, []).append(flat.clone())
            return
        self._run(self._ep.send_tensor, dst, flat, _tag_id(tag))
        self.stats.add_sent(tag, nbytes(flat))

    def recv_from(self, src: int, *, tag: str, device: Any = None) -> torch.Tensor:
        if src == self.rank:
            return self._self_mail[tag].pop(0).to(device or "cpu")
        got = self._run(self._ep.recv_tensor, src, _tag_id(tag))
        self.stats.add_received(tag, nbytes(got))
        return got.to(device or "cpu")
