"""A group of ranks joined by DGT endpoints: rendezvous through the c10d store, then all-to-all connections."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from dgt.collectives.rendezvous import Rendezvous


class Group:
    """What every collective runs on: this rank's endpoint, the world size, per-bucket round counters."""

    def __init__(self, endpoint: Any, rank: int, world: int, token: int, store: dist.Store | None = None) -> None:
        self.endpoint = endpoint
        self.store = store  # rank 0 may host it: it must live as long as the group, or late ranks lose it
        self.rank = rank
        self.world = world
        self.token = token
        self._rounds: dict[tuple[str, int], int] = {}

    @classmethod
    async def create(
        cls,
        rank: int,
        world: int,
        *,
        store: dist.Store | None = None,
        config: Any = None,
        host: str = "127.0.0.1",
        timeout: float = 60.0,
        prefix: str = "dgt",
    ) -> Group:
        """Meet through the c10d store (``store`` or env://), open this rank's endpoint, connect to every peer."""
        import trio

        from dgt.endpoint import Endpoint, PeerAddress, TransportConfig

        rv = Rendezvous(rank, world, store, timeout, prefix)
        token = await trio.to_thread.run_sync(rv.token)
        ep = await Endpoint.open(rank, token, config or TransportConfig(), host=host)
        try:
            addr = dataclasses.asdict(ep.address)
            addrs = await trio.to_thread.run_sync(rv.exchange, addr)
            peers = {r: PeerAddress(**a) for r, a in addrs.items() if r != rank}
            if peers:
                with trio.fail_after(timeout + 5):
                    await ep.connect(peers, timeout=timeout)
        except BaseException:
            await ep.aclose()
            raise
        return cls(ep, rank, world, token, rv.store)

    def next_round(self, collective: str, bucket: int) -> int:
        """Round numbers advance per (collective, bucket); every rank calls collectives in the same order."""
        key = (collective, bucket)
        self._rounds[key] = self._rounds.get(key, -1) + 1
        return self._rounds[key]

    async def aclose(self) -> None:
        await self.endpoint.aclose()
