"""Collectives for code that is not trio: a trainer loop, a notebook, a thread pool.

:class:`BlockingCollective` owns a :class:`~dgt.collectives.worker.TrioWorker` (one background trio thread that
meets the other ranks through the c10d store and then runs calls one at a time, in call order, so every rank issues
its rounds in the same order) and one collective on that group. ``allreduce``/``mix`` block; the ``*_async``
variants return a ``torch.futures.Future`` at once.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from dgt.codecs.base import Codec
from dgt.collectives.gossip import Gossip
from dgt.collectives.group import Group
from dgt.collectives.ps import ParameterServer
from dgt.collectives.ring import RingAllReduce
from dgt.collectives.stats import CollectiveResult
from dgt.collectives.worker import TrioWorker

KINDS = {"ring": RingAllReduce, "ps": ParameterServer, "gossip": Gossip}


class BlockingCollective:
    """``kind`` (ring, ps or gossip) over ``codec`` for rank ``rank`` of ``world``; ``options`` go to the
    collective (e.g. ``server="sharded"`` for ps, ``op="sum"``). The group is created on first use (or ``start``)."""

    def __init__(self, kind: str, rank: int, world: int, codec: str | Codec = "dense", *, store: Any = None,
                 config: Any = None, host: str = "127.0.0.1", timeout: float = 60.0, prefix: str = "dgt",
                 **options: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, not {kind!r}")
        connect = partial(Group.create, rank, world, store=store, config=config, host=host, timeout=timeout,
                          prefix=prefix)
        self.kind = kind
        self.collective = KINDS[kind](_Unbound(world, rank), codec, **options)  # checks codec pairing now
        self._worker = TrioWorker(connect, name=f"dgt-{kind}-r{rank}")

    def start(self, timeout: float | None = None) -> None:
        """Meet the other ranks now (otherwise the first call does)."""
        self._worker.run(self._bind, timeout)

    async def _bind(self, group: Group) -> None:
        self.collective.group = group

    def allreduce_async(self, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
                        out: torch.Tensor | None = None) -> torch.futures.Future:
        """Queue an all-reduce; the future's value is the :class:`CollectiveResult`."""
        return self._worker.submit(self._allreduce_job(bucket, bucket_id, segments, out))

    def allreduce(self, bucket: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
                  out: torch.Tensor | None = None, timeout: float | None = None) -> CollectiveResult:
        return self._worker.run(self._allreduce_job(bucket, bucket_id, segments, out), timeout)

    def mix_async(self, x: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None) -> torch.futures.Future:
        """Queue a gossip step; the future's value is the :class:`CollectiveResult`."""
        return self._worker.submit(self._mix_job(x, bucket_id, segments))

    def mix(self, x: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None, *,
            timeout: float | None = None) -> CollectiveResult:
        return self._worker.run(self._mix_job(x, bucket_id, segments), timeout)

    def _allreduce_job(self, bucket, bucket_id, segments, out):
        if self.kind == "gossip":
            raise TypeError("gossip mixes with neighbours: use mix()")

        async def job(group: Group) -> CollectiveResult:
            await self._bind(group)
            return await self.collective.allreduce(bucket, bucket_id, segments, out=out)

        return job

    def _mix_job(self, x, bucket_id, segments):
        if self.kind != "gossip":
            raise TypeError("mix() is the gossip collective's call; this one all-reduces")

        async def job(group: Group) -> CollectiveResult:
            await self._bind(group)
            return await self.collective.mix(x, bucket_id, segments)

        return job

    def close(self, timeout: float = 10.0) -> None:
        """Let queued calls finish, close the group (its endpoint says goodbye to the peers) and stop the thread."""
        self._worker.close(timeout)

    def __enter__(self) -> BlockingCollective:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Unbound:
    """Stands in for the group until the worker thread has created it (construction only checks world and rank)."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

