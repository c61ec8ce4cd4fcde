"""The reduce-scatter hops of a lossy ring (DGT) whose hops each are one transport call.

The collective side of the ``ring-lossy-streams`` schedule (dgt.collectives.plan): per hop this rank encodes the
chunk it sends (the codec scores its blocks, reading the block scores the previous hop's sum left, and classes the
top p% important), then hands the encoded chunk, the peers, the layouts, where the incoming round lands and the chunk
it is summed into to the transport in one call, ``Transport.lossy_hop`` (:mod:`dgt.transport.lossy_hop`: the
important blocks packed on the stream lane, the rest a DGT round with its deadline, drop report and error feedback,
landed and summed). What comes back is the sum's block scores (the next hop's codec reads them), the arrival mask
and the statistics. The collective owns the codec state, the step loop and the schedule; it never touches protocol
or channel objects.

Stream exchanges run in the order they were called on every rank: every hop's place is reserved when the call
starts, before its first await (as the lossless ring's one exchange takes its ticket), and handed to its hop.
"""

from __future__ import annotations

import torch

from dgt.codecs.base import BLOCK_MEANS_HINT
from dgt.collectives.base import Collective
from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import FAMILY_MASK, host, state_key, transport_key, wire_layout
from dgt.collectives.ring_hold import HeldBack
from dgt.collectives.stats import CollectiveStats
from dgt.layout import BucketLayout
from dgt.transport.lossy_hop import LossyHopPool, LossyHopSpec

MASK_PART, PACKED_PART = 1, 2  # transport key parts of a hop's two stream messages (part 0: its round)


class LossyHops:
    """The reduce-scatter of one lossy ring call (see the module docstring); the ring owns one, for its buffers."""

    def __init__(self, coll: Collective) -> None:
        self.coll = coll
        self.pool = LossyHopPool()

    async def reduce_scatter(self, ch: Chunking, src: torch.Tensor, flat: torch.Tensor, bucket_id: int, rnd: int,
                             stats: CollectiveStats, land: list[torch.Tensor], tickets: list[int | None],
                             held: HeldBack | None = None) -> None:
        """W-1 hops: step s sends chunk r-s (``src`` at step 0, the partial sum in ``flat`` after) and adds what
        the previous rank sends for chunk r-s-1 to this rank's input chunk, into ``flat``. ``land``: per step, the
        buffer the step's round lands in. ``tickets``: per step, its reserved exchange; each is set to None once its
        hop holds it (the caller forfeits those left). ``held``: the ring's store of this rank's held-back own
        contribution (``RingAllReduce.hold_own``): added to its own chunk at the last hop, refilled from the blocks
        that hop brought nothing for."""
        W, r = self.coll.group.world, self.coll.group.rank
        means = None  # the block scores of the chunk the next hop sends, from the hop that summed it
        for s in range(W - 1):
            a, c = (r - s) % W, (r - s - 1) % W
            hold = held is not None and s == W - 2
            own_src = held.add_to(bucket_id, c, ch.chunk(src, c)) if hold and held else ch.chunk(src, c)
            spec = self._spec(ch, ch.chunk(src if s == 0 else flat, a), a, c, own_src, ch.chunk(flat, c),
                              land[s], bucket_id, s, rnd, stats, means, tickets)
            res = await self.coll.group.endpoint.lossy_hop(spec)
            stats.add_lossy_hop(res)
            means = res.means
            if hold and held:
                arrived = res.arrived if res.arrived is not None else res.mask
                stats.held_blocks += held.keep(bucket_id, c, own_src, ch.chunk(flat, c), arrived, spec.recv_layout)

    def _spec(self, ch: Chunking, out: torch.Tensor, a: int, c: int, mine_src: torch.Tensor, mine: torch.Tensor,
              land: torch.Tensor, bucket_id: int, s: int, rnd: int, stats: CollectiveStats,
              means: torch.Tensor | None, tickets: list[int | None]) -> LossyHopSpec:
        """Hop ``s``: chunk ``a`` (``out``) encoded and described for the transport; ``means``: the block scores of
        ``out`` when the previous hop computed them. Takes the hop's ticket out of ``tickets``."""
        coll = self.coll
        g = coll.group
        state = coll.state(state_key("rs", bucket_id, s), out, ch.segments[a])
        if means is not None:
            state.values[BLOCK_MEANS_HINT] = means  # encode consumes it at once
        (part,) = coll.codec.encode(out, state)
        cls = part.lane_class
        layout = wire_layout(part)  # the codec's blocks: the one block size (issue 44)
        if not isinstance(cls, torch.Tensor):
            cls = torch.full((layout.nblocks,), int(cls), dtype=torch.int8)
        keys = (transport_key(bucket_id, "rs", s, 0), transport_key(bucket_id, "rs", s, MASK_PART),
                transport_key(bucket_id, "rs", s, PACKED_PART))
        data, cls, lay_c = host(part.data), cls.detach().to("cpu"), BucketLayout.of(ch.segments[c], layout.block)
        ticket, tickets[s] = tickets[s], None  # the hop owns it from here (gives it back if it fails first)
        return LossyHopSpec(send_to=(g.rank + 1) % g.world, recv_from=(g.rank - 1) % g.world, keys=keys, round=rnd,
                            data=data, layout=layout, cls=cls, order=part.order, op=coll.code_of(stats),
                            recv_layout=lay_c, land=land,
                            mine_src=mine_src, mine=mine, ticket=ticket, family=FAMILY_MASK, pool=self.pool, step=s,
                            label=f"rs step {s} of bucket {bucket_id}")
