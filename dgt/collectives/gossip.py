"""Decentralized gossip over the DGT transport: each rank exchanges with its neighbours under a mixing matrix W.

``exchange`` moves codec payloads to and from the neighbours (the substrate DCD/ECD-PSGD build on); ``mix`` returns
sum_j W[rank, j] * x_j with the neighbours' x_j decoded from what arrived (lost blocks count as zeros).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from dgt.codecs.base import Codec, Part, Received
from dgt.collectives.base import Collective, plain_input, tells_peers
from dgt.collectives.group import Group
from dgt.collectives.parts import decode_parts, recv_parts, send_parts, state_key
from dgt.collectives.stats import CollectiveResult, CollectiveStats
from dgt.errors import one_error, open_nursery


def ring_matrix(world: int) -> np.ndarray:
    """Symmetric doubly stochastic ring: 1/3 to self and each neighbour (1/2 each for 2 ranks)."""
    W = np.zeros((world, world))
    if world == 1:
        W[0, 0] = 1.0
        return W
    if world == 2:
        return np.full((2, 2), 0.5)
    for i in range(world):
        for j in (i - 1, i, i + 1):
            W[i, j % world] = 1.0 / 3.0
    return W


class Gossip(Collective):
    name = "gossip"
    round_family = "gossip"
    serves_replica_deltas = True

    def __init__(self, group: Group, codec: str | Codec = "dense", W: np.ndarray | None = None) -> None:
        super().__init__(group, codec, op="sum")
        W = ring_matrix(group.world) if W is None else np.asarray(W, dtype=np.float64)
        if W.shape != (group.world, group.world) or not np.allclose(W.sum(1), 1.0) or (W < 0).any():
            raise ValueError("mixing matrix must be world x world, non-negative, rows summing to 1")
        self.W = W
        self._round = 0  # the round of the last exchange (for the reason of a mismatch seen in decoding it)
        self.neighbours = [j for j in range(group.world) if j != group.rank and W[group.rank, j] > 0]
        senders = [j for j in range(group.world) if j != group.rank and W[j, group.rank] > 0]
        if sorted(senders) != sorted(self.neighbours):
            raise ValueError("mixing matrix must have a symmetric sparsity pattern (neighbours exchange both ways)")

    def peers(self) -> list[int]:
        return list(self.neighbours)

    @tells_peers
    @one_error
    async def exchange_parts(self, parts: list[Part], bucket_id: int = 0
                             ) -> tuple[dict[int, list[Received]], CollectiveStats]:
        """Send ``parts`` to every neighbour and return the parts each neighbour sent (as they arrived). Algorithms
        that keep their own per-neighbour state (DCD/ECD-PSGD nodes) drive the exchange with this."""
        g = self.group
        await self.connect()
        stats = CollectiveStats()
        rnd = self._round = g.next_round("gossip", bucket_id)
        got: dict[int, list[Received]] = {}

        async def recv(j: int) -> None:
            # the call code (op and codec) in every frame, and a summable codec's parts element by element: a
            # neighbour that called with another codec, size or dtype raises RankMismatch on every rank
            got[j] = await recv_parts(g.endpoint, j, bucket_id, "gossip", 0, rnd, parts, stats,
                                      device=parts[0].data.device if parts else None,
                                      exact=self.codec.capabilities.summable, op=self.call_code)

        with self.phase(stats, "exchange"):
            async with open_nursery() as nursery:
                for j in self.neighbours:
                    nursery.start_soon(partial(send_parts, g.endpoint, j, bucket_id, "gossip", 0, rnd, parts, stats,
                                               op=self.call_code))
                    nursery.start_soon(recv, j)
        return got, stats

    @tells_peers
    @one_error
    async def exchange(self, x: torch.Tensor, bucket_id: int = 0,
                       segments: list[int] | None = None) -> tuple[dict[int, torch.Tensor], CollectiveStats]:
        """Send the codec's encoding of ``x`` to every neighbour; return what each neighbour sent, decoded."""
        flat = plain_input(x).detach().reshape(-1)  # any layout: a contiguous working copy
        self.codec.check_input(flat)
        segs = segments or [flat.numel()]
        parts = self.codec.encode(flat, self.state(state_key("gossip", bucket_id), flat, segs))
        got, stats = await self.exchange_parts(parts, bucket_id)
        out = {}
        for j in self.neighbours:
            st = self.state(state_key("gossip-rx", bucket_id, j), flat, segs)
            out[j] = decode_parts(self.codec, got[j], st, flat, j, self._round).to(flat.dtype)
        return out, stats

    @tells_peers
    @one_error
    async def mix(self, x: torch.Tensor, bucket_id: int = 0, segments: list[int] | None = None) -> CollectiveResult:
        """sum_j W[rank, j] x_j: one gossip step."""
        theirs, stats = await self.exchange(x, bucket_id, segments)
        r = self.group.rank
        flat = plain_input(x).detach().reshape(-1)
        out = flat * float(self.W[r, r])
        for j, xj in theirs.items():
            out += float(self.W[r, j]) * xj
        return CollectiveResult(out.view_as(x), stats)
