"""Ranks meet through torch's own c10d store: each publishes its lane endpoints, rank 0 publishes the session token.

Works with an explicit store, with ``env://`` variables (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), and under
``torchrun`` (whose agent already hosts the store). No home-made discovery.
"""

from __future__ import annotations

import json
import os
import secrets
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


def _wait(st: dist.Store, keys: list[str], timeout: float) -> bool:
    """One blocking store call (the store's own ``wait``): True once every key exists, False at the timeout."""
    try:
        st.wait(keys, timedelta(seconds=max(timeout, 0.001)))
    except dist.DistStoreError as exc:
        if "timeout" not in str(exc).lower():
            raise
        return False
    return True


class Rendezvous:
    """Two steps, because the token must be known before an endpoint opens and its address after:
    ``token()`` (rank 0 draws it), then ``exchange(address)``; then :meth:`addresses` of just the peers a collective
    needs. Store operations per rank are O(1) (set, add, wait) plus one ``multi_get`` of the wanted addresses; no
    polling. Use a fresh ``prefix`` per group on a shared store."""

    def __init__(self, rank: int, world: int, store: dist.Store | None = None, timeout: float = 60.0,
                 prefix: str = "dgt") -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        self.rank, self.world, self.timeout, self.prefix = rank, world, timeout, prefix
        self.store = store if store is not None else store_from_env(rank, world, timeout)
        self._st = dist.PrefixStore(f"{prefix}/", self.store)
        self.ops = 0  # store operations this rank issued (measured by the scale test)

    def token(self) -> int:
        if self.rank == 0:
            self._st.set("token", str(secrets.randbits(64)))
            self.ops += 1
        self.ops += 2
        if not _wait(self._st, ["token"], self.timeout):
            raise RendezvousTimeout(f"rendezvous '{self.prefix}': rank 0's session token did not show up within "
                                    f"{self.timeout:.1f} s")
        return int(self._st.get("token"))

    def exchange(self, address: dict) -> None:
        """Publish this rank's address and wait until every rank has (a counter; the last rank to arrive sets the
        ``ready`` key everyone waits on). RendezvousTimeout names the ranks that never published."""
        self._st.set(f"addr/{self.rank}", json.dumps(address))
        if self._st.add("arrived", 1) == self.world:
            self._st.set("ready", "1")
            self.ops += 1
        self.ops += 3
        if not _wait(self._st, ["ready"], self.timeout):
            missing = self.missing()
            raise RendezvousTimeout(
                f"rendezvous '{self.prefix}': ranks [{_ranges(missing)}] did not show up within {self.timeout:.1f} s "
                f"({len(missing)} of {self.world} missing)"
            )

    def publish_abort(self, why: str) -> None:
        """Leave why a collective of this session failed (a mismatch) where ranks that have no connection to this
        one yet find it (connections are lazy: an ABORT reaches only connected peers). The store is trusted as far
        as the rendezvous is (docs/security.md): a forged entry can only make a failing call name another reason."""
        self.ops += 1
        self._st.set("abort", why[:2000])

    def published_abort(self) -> str | None:
        """The reason :meth:`publish_abort` left, if any (one check, no waiting)."""
        self.ops += 1
        if not self._st.check(["abort"]):
            return None
        return bytes(self._st.get("abort")).decode("utf-8", errors="replace")

    def missing(self) -> list[int]:
        """Ranks whose address is not in the store (O(W) checks: for the error message only)."""
        return [r for r in range(self.world) if not self._st.check([f"addr/{r}"])]

    def addresses(self, ranks: list[int]) -> dict[int, dict]:
        """The published addresses of ``ranks`` (after :meth:`exchange`): one ``multi_get``."""
        ranks = sorted(set(ranks))
        if not ranks:
            return {}
        self.ops += 1
        vals = self._st.multi_get([f"addr/{r}" for r in ranks])
        return {r: json.loads(v) for r, v in zip(ranks, vals)}


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (a thousand missing ranks stay readable)."""
    out: list[list[int]] = []
    for r in ranks:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    out_s = [str(a) if a == b else f"{a}-{b}" for a, b in out]
    return ", ".join(out_s)


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
    rv.exchange(address)
    return RendezvousInfo(rank, world, token, rv.addresses(list(range(world))), rv.store)
