"""One plan per collective call (issue 44): which path a call takes, decided once, in one function.

:func:`plan_call` looks at the codec's capabilities, the bucket (dtype, device, contiguity), the transport's settings
and what it can reach (stream hops on, a hop socket to both ring neighbours) and returns a frozen :class:`CallPlan`:
the codec, the wire dtype, whether chunks land in place, the schedule and the all-gather's lane. The ring and the
parameter server run what it says and nothing else decides; the plan is recorded in the call's statistics
(``CollectiveStats.plan``).

Ranks must agree on it. The plan's :attr:`CallPlan.code` (two bits: the reduce phase on stream lanes or in rounds,
and whether the all-gather sends sparse messages) is folded into the call code every frame and stream message of
the call carries in its header (:func:`dgt.errors.call_code`, bits 6-7), which every receiver compares with its own:
two ranks that planned the call differently raise :class:`~dgt.errors.RankMismatch` on the first message between
them, whichever path each took. What the code does not name (the wire dtype, the all-gather's lane when both reduce
in rounds) is checked by what already travels: the dtype in every header, and the session-link watch of a stream
exchange (a round of the call's family arriving while a stream message is awaited).

Schedules:

- ``ring-streams``: a lossless ring as one ordered exchange on stream lanes (adds on arrival; float32 CPU);
- ``ring-lossy-streams``: a lossy ring whose reduce-scatter hops are one transport call each (``lossy_hop``: the
  important blocks on the stream lane, the rest a DGT round on the hop socket) and whose all-gather is one stream
  exchange (``gather``: ``streams``, or ``sparse-streams`` with the ring's ``sparse_gather``);
- ``ring-rounds``: every reduce-scatter hop a round on the session link (lossy lanes, deadlines); the all-gather
  rounds too, or one stream exchange for a lossy codec whose chunks land in place (``gather``);
- ``ps-streams`` / ``ps-rounds``: the parameter server's push and pull as one stream exchange, or rounds;
- ``local``: a world of one (no traffic).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dgt.collectives.base import Collective
from dgt.collectives.chunks import Chunking
from dgt.collectives.parts import MAX_STEPS
from dgt.transport.streams import streamable

STREAM_REDUCE = ("ring-streams", "ring-lossy-streams", "ps-streams")  # code bit 0


@dataclass(frozen=True)
class CallPlan:
    """The path of one collective call (see the module docstring). ``note``: why a faster schedule was not taken,
    when one exists for this codec (e.g. the lossy stream hops carry float32 only)."""

    family: str
    codec: str
    dtype: str
    wire_dtype: str
    direct: bool
    lossy: bool
    schedule: str
    gather: str = ""
    note: str = ""

    @property
    def code(self) -> int:
        """Two bits the ranks compare on every message (:func:`dgt.errors.call_code`): bit 0, the reduce phase on
        stream lanes; bit 1, a sparse all-gather."""
        return int(self.schedule in STREAM_REDUCE) | int(self.gather == "sparse-streams") << 1

    @property
    def streams(self) -> bool:
        """Whether the call uses stream lanes at all."""
        return self.schedule in STREAM_REDUCE or self.gather in ("streams", "sparse-streams")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "code": self.code, "streams": self.streams}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def plan_call(coll: Collective, bucket: torch.Tensor, *, chunks: Chunking | None = None,
              out: torch.Tensor | None = None, sparse_gather: bool = False, servers: list[int] | None = None,
              sharded: bool = False) -> CallPlan:
    """The plan of one call of ``coll`` on ``bucket`` (contiguous; ``out``: where the result goes, if given).
    A ring: ``chunks``, its cut of the bucket (a lossy stream hop carries a round, so no chunk may be empty);
    ``sparse_gather``, its option. A parameter server (``coll.round_family == "ps"``): its ``servers`` and whether
    it is ``sharded``."""
    caps = coll.codec.capabilities
    wire = caps.wire_dtype or bucket.dtype
    base = dict(family=coll.round_family or coll.name, codec=coll.codec.name, dtype=_name(bucket.dtype),
                wire_dtype=_name(wire), lossy=caps.lossy_tolerant,
                direct=caps.in_place and wire == bucket.dtype and bucket.device.type == "cpu")
    if coll.group.world == 1:
        return CallPlan(schedule="local", **base)  # type: ignore[arg-type]
    tensors = [bucket] if out is None else [bucket, out]
    if coll.round_family == "ps":
        return _plan_ps(coll, tensors, servers or [], sharded, base)
    return _plan_ring(coll, tensors, chunks, sparse_gather, base)


def _plan_ring(coll: Collective, tensors: list[torch.Tensor], ch: Chunking | None, sparse_gather: bool,
               base: dict[str, Any]) -> CallPlan:
    caps, direct = coll.codec.capabilities, base["direct"]
    bucket = tensors[0]
    g = coll.group
    ep = g.endpoint
    hops_on = ep.cfg.hops.mode != "off"
    if not caps.lossy_tolerant:
        if direct and hops_on and all(streamable(t, add=True) for t in tensors):
            return CallPlan(schedule="ring-streams", gather="in-exchange", **base)
        why = ("stream hops are off" if not hops_on else "the stream ring adds float32 CPU tensors on arrival"
               if direct else "chunks are not their own wire form (a codec's wire dtype, or not on the CPU)")
        return CallPlan(schedule="ring-rounds", gather="rounds", note=why, **base)
    on_lanes = all(streamable(t) for t in tensors)
    gather = ("sparse-streams" if sparse_gather else "streams") if direct and hops_on and on_lanes else "rounds"
    if not direct or not hops_on:
        why = "stream hops are off" if not hops_on else "chunks are not their own wire form"
        return CallPlan(schedule="ring-rounds", gather=gather, note=why, **base)
    why = ""
    if bucket.dtype != torch.float32:
        why = f"the lossy stream hops carry float32 chunks (the packed blocks and the sum); this call's are " \
              f"{base['dtype']}"
    elif not on_lanes:
        why = "the bucket is not a contiguous CPU tensor"
    elif not (ep.hop_ready((g.rank + 1) % g.world) and ep.hop_ready((g.rank - 1) % g.world)):
        why = "a ring neighbour has no hop socket"
    elif ch is None or any(ch.edges[i + 1] <= ch.edges[i] for i in range(ch.k)):
        why = "a chunk is empty (every lossy stream hop carries a round)"
    return CallPlan(schedule="ring-rounds" if why else "ring-lossy-streams", gather=gather, note=why, **base)


def _plan_ps(coll: Collective, tensors: list[torch.Tensor], servers: list[int], sharded: bool,
             base: dict[str, Any]) -> CallPlan:
    caps = coll.codec.capabilities
    g = coll.group
    fits = [caps.in_place and not caps.lossy_tolerant, base["wire_dtype"] == base["dtype"], g.world <= MAX_STEPS,
            not sharded or len(servers) == g.world, g.endpoint.cfg.hops.mode != "off",
            all(streamable(t, add=True) for t in tensors)]
    if all(fits):
        return CallPlan(schedule="ps-streams", **base)
    whys = ["a lossy or not in-place codec", "a codec wire dtype", "a world over the key's steps",
            "shards on fewer ranks than the world", "stream hops are off", "not float32 contiguous CPU tensors"]
    return CallPlan(schedule="ps-rounds", note="; ".join(w for w, ok in zip(whys, fits) if not ok), **base)
