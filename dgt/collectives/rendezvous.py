"""Ranks meet through torch's own c10d store: each publishes its lane endpoints, rank 0 publishes the session token.

Works with an explicit store, with ``env://`` variables (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), and under
``torchrun`` (whose agent already hosts the store). No home-made discovery.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from dgt.errors import RendezvousTimeout


@dataclass
class RendezvousInfo:
    rank: int
    world: int
    token: int
    addresses: dict[int, dict]  # rank -> the JSON-able endpoint address each rank published
    store: dist.Store


def store_from_env(rank: int, world: int, timeout: float = 60.0) -> dist.Store:
    """A TCPStore from MASTER_ADDR/MASTER_PORT; rank 0 hosts it unless torchrun's agent already does."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(host, port, world, is_master=(rank == 0 and not agent_hosts),
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _wait(st: dist.Store, keys: list[str], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not st.check(keys):
        if time.monotonic() >= deadline:
            raise RendezvousTimeout(f"{what} did not show up within {timeout:.1f} s")
        time.sleep(0.01)


class Rendezvous:
    """Two steps, because the token must be known before an endpoint opens and its address after:
    ``token()`` (rank 0 draws it), then ``exchange(address)``."""

    def __init__(self, rank: int, world: int, store: dist.Store | None = None, timeout: float = 60.0,
                 prefix: str = "dgt") -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        self.rank, self.world, self.timeout, self.prefix = rank, world, timeout, prefix
        self.store = store if store is not None else store_from_env(rank, world, timeout)
        self._st = dist.PrefixStore(f"{prefix}/", self.store)

    def token(self) -> int:
        if self.rank == 0:
            self._st.set("token", str(secrets.randbits(64)))
        _wait(self._st, ["token"], self.timeout, f"rendezvous '{self.prefix}': rank 0's session token")
        return int(self._st.get("token"))

    def exchange(self, address: dict) -> dict[int, dict]:
        self._st.set(f"addr/{self.rank}", json.dumps(address))
        keys = [f"addr/{r}" for r in range(self.world)]
        try:
            _wait(self._st, keys, self.timeout, "")
        except RendezvousTimeout:
            missing = [r for r in range(self.world) if not self._st.check([f"addr/{r}"])]
            raise RendezvousTimeout(
                f"rendezvous '{self.prefix}': ranks {missing} did not show up within {self.timeout:.1f} s"
            ) from None
        return {r: json.loads(self._st.get(f"addr/{r}")) for r in range(self.world)}


def rendezvous(
    address: dict,
    rank: int,
    world: int,
    store: dist.Store | None = None,
    timeout: float = 60.0,
    prefix: str = "dgt",
) -> RendezvousInfo:
    """Both steps at once (for callers whose address does not depend on the token)."""
    rv = Rendezvous(rank, world, store, timeout, prefix)
    token = rv.token()
    return RendezvousInfo(rank, world, token, rv.exchange(address), rv.store)
