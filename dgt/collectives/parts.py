"""Moving codec parts over the transport: one transport round per part, keyed so rounds never collide."""

from __future__ import annotations

import torch

from dgt.codecs.base import Part, Received
from dgt.collectives.stats import CollectiveStats
from dgt.errors import DgtError, RankMismatch, op_mismatch, open_nursery, shape_mismatch
from dgt.layout import DEFAULT_BLOCK, BucketLayout
from dgt.transport.checks import check_classes

PHASES = {"push": 0, "pull": 1, "rs": 2, "ag": 3, "gossip": 4, "direct": 5}
# (phase 6 and 7 of the highest bucket id would reach the send_bytes range: a new collective shares a phase by step)
# the 32-bit transport bucket id, most significant first: bucket (14 bits) | phase (3) | step (12) | part (3)
PART_BITS, STEP_BITS, PHASE_BITS, BUCKET_BITS = 3, 12, 3, 14
MAX_PARTS = 1 << PART_BITS  # parts one codec emits per chunk
MAX_STEPS = 1 << STEP_BITS  # ring steps / PS shards: worlds up to 4096 ranks
MAX_BUCKETS = 1 << BUCKET_BITS  # bucket ids 0..16383
assert PART_BITS + STEP_BITS + PHASE_BITS + BUCKET_BITS == 32 and len(PHASES) <= 1 << PHASE_BITS
# the key bits that name a message family (bucket and phase): a stream exchange and the rounds a peer on the other
# path sends for the same call agree on these (Endpoint.exchange's ``family``), whatever their steps and parts
FAMILY_MASK = 0xFFFFFFFF ^ ((1 << (STEP_BITS + PART_BITS)) - 1)


def transport_key(bucket: int, phase: str, step: int = 0, part: int = 0) -> int:
    """A 32-bit transport bucket id unique per (bucket, phase, step, part): each field has its own bits, and a value
    outside its field is refused here (never wrapped into a neighbour's key). Error feedback state follows it."""
    if not 0 <= part < MAX_PARTS:
        raise ValueError(f"part {part} outside the transport key's {MAX_PARTS} parts per chunk")
    if not 0 <= step < MAX_STEPS:
        raise ValueError(f"step {step} outside the transport key's {MAX_STEPS} steps (a world of at most "
                         f"{MAX_STEPS} ranks)")
    if not 0 <= bucket < MAX_BUCKETS:
        raise ValueError(f"bucket id {bucket} outside the transport key's range 0..{MAX_BUCKETS - 1}")
    return (((bucket << PHASE_BITS | PHASES[phase]) << STEP_BITS | step) << PART_BITS) | part


def check_world(world: int, what: str) -> None:
    """Refuse, when a collective is made, a world whose steps or shards the transport key cannot tell apart."""
    if world > MAX_STEPS:
        raise ValueError(f"{what}: a world of {world} ranks exceeds the transport key's {MAX_STEPS} steps")


def state_key(role: str, bucket: int, *index: int) -> tuple:
    """A codec state key: a tuple per (role, bucket, index...), so no arithmetic on ids can make two overlap."""
    return (role, bucket, *index)


def host(t: torch.Tensor) -> torch.Tensor:
    """The contiguous CPU tensor the transport packs from (device buckets cross to pinned host memory once)."""
    if t.device.type == "cpu":
        return t.contiguous().view(-1)
    out = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
    out.copy_(t.reshape(-1), non_blocking=False)
    return out


def wire_layout(part: Part, block: int = DEFAULT_BLOCK) -> BucketLayout:
    """The one geometry ``part`` travels in, cut once: its own layout when the codec cut it in ``block``-element
    blocks (DGT, dense) or gave it per-block lane classes (those name the codec's blocks: the codec's block size is
    the one source, issue 44), else the same bytes in ``block``-element blocks (a codec's own size for a part of one
    class, QSGD buckets...: a cut that changes nothing of what arrives); either way the shared
    :meth:`BucketLayout.of` instance."""
    if part.data.numel() == 0:
        return BucketLayout.of([0], part.block_elems if isinstance(part.lane_class, torch.Tensor) else block)
    if part.block_elems == block or isinstance(part.lane_class, torch.Tensor):
        return part.layout
    return BucketLayout.of(part.segments or [part.data.numel()], block)


async def send_parts(ep, peer: int, bucket: int, phase: str, step: int, rnd: int, parts: list[Part],
                     stats: CollectiveStats, reliable: bool = False, wait_report: bool = True, op: int = 0) -> None:
    """Send every part to ``peer`` concurrently. ``reliable`` forces all blocks onto the reliable lane. ``op``: the
    collective's call code (its op), carried in every frame header for the receiver to compare.
    ``wait_report=False``: return once every frame is handed to the kernel, without waiting a round trip for the
    receiver's drop report (the transport keeps a copy and folds the report into error feedback when it comes)."""
    jobs = []
    for i, part in enumerate(parts):
        layout = wire_layout(part)
        # an empty part has nothing to lose: its round stays off the droppable lanes
        cls = 0 if reliable or part.data.numel() == 0 else part.lane_class
        if isinstance(cls, torch.Tensor):
            cls = cls.detach().to("cpu")
        order = None if part.order is None else part.order.detach().to("cpu")
        # every part's classes checked before any part's first frame leaves: a call refused for its last part has
        # sent nothing of its first (InputRejected, told to the peers), never an IndexError half way through
        check_classes(cls, order, layout)
        jobs.append((ep, peer, transport_key(bucket, phase, step, i), rnd, host(part.data), layout, cls,
                     order, wait_report, op))
        _count_sent(stats, part, layout, cls)
    if len(jobs) == 1:  # the common case (dense, DGT): no nursery to set up per hop
        await _send_one(stats, *jobs[0])
        return
    async with open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(_send_one, stats, *job)


def _count_sent(stats: CollectiveStats, part: Part, layout: BucketLayout, cls) -> None:
    if isinstance(cls, int):
        stats.add_sent(min(cls, 1), part.nbytes)
        return
    isz = part.data.element_size()
    rel = int(layout.block_len[cls == 0].sum()) * isz
    stats.add_sent(0, rel)
    stats.add_sent(1, part.nbytes - rel)


async def _send_one(stats: CollectiveStats, ep, peer, key, rnd, data, layout, cls, order, wait_report, op) -> None:
    # a lossless round has nothing to learn from its drop report: do not spend a round trip waiting for it
    lossless = cls == 0 if isinstance(cls, int) else not bool((cls != 0).any())
    st = await ep.send_round(peer, key, rnd, data, layout=layout, cls=cls, order=order,
                             wait=wait_report and not lossless, op=op)
    unsent = getattr(st, "unsent_bytes", 0)
    if unsent:  # the send budget kept these back (error feedback carries them): not sent on the unreliable lane
        stats.add_sent(1, -unsent)
        stats.bytes_unsent += unsent


async def recv_parts(ep, peer: int, bucket: int, phase: str, step: int, rnd: int, like: list[Part],
                     stats: CollectiveStats, into: list[torch.Tensor | None] | None = None,
                     device: torch.device | None = None, exact: bool = False, op: int = 0) -> list[Received]:
    """Receive the parts ``peer`` sends (shaped like our own ``like`` parts: same count and block geometry).
    ``into``: per part, a contiguous CPU tensor to reassemble straight into (no extra buffer, no copy).
    ``device``: where the caller decodes (the bucket's device): data and block masks move there together, since
    decoders index the data with the masks. ``exact``: the parts are element-aligned (a summable codec), so a part
    of another size or dtype means the ranks called the collective differently (:class:`RankMismatch`). ``op``:
    this rank's call code; a part sent with another one means the ranks called it with different ops."""
    out: list[Received | None] = [None] * len(like)

    async def one(i: int, part: Part) -> None:
        dst = into[i] if into else None
        res = await ep.recv_round(peer, transport_key(bucket, phase, step, i), rnd, out=dst)
        stats.add_round(res.stats)
        check_op(op, res.codec, rnd)
        want = part.layout.numel
        # parts of summable codecs hold one element per element and must match exactly; those of other codecs
        # (QSGD records, sparse payloads) may differ in size from rank to rank
        if exact and (res.data.numel() != want or res.data.dtype != part.data.dtype):
            raise RankMismatch(shape_mismatch(rnd), detail=f"rank {peer} sent {res.data.numel()} x {res.data.dtype} "
                               f"for {phase} step {step} of bucket {bucket}, this rank expects {want} x "
                               f"{part.data.dtype}")
        # a BULK message is lossless and knows no segments: every block of our geometry arrived
        if res.bulk:
            mask = torch.ones(part.layout.nblocks, dtype=torch.bool)
        elif res.layout.block != part.block_elems:  # sent cut in the transport's blocks: back to the codec's
            mask = part.layout.whole_blocks(res.mask, res.layout)
        else:
            mask = res.mask
        got = Received(res.data, mask, part.block_elems, part.segments)
        out[i] = got if device is None else got.to(device)

    if len(like) == 1:
        await one(0, like[0])
    else:
        async with open_nursery() as nursery:
            for i, part in enumerate(like):
                nursery.start_soon(one, i, part)
    return out  # type: ignore[return-value]


def decode_parts(codec, got: list[Received], state, like: torch.Tensor, peer: int, rnd: int) -> torch.Tensor:
    """``codec.decode`` of the parts ``peer`` sent: parts that do not decode into ``like`` (a non-summable codec's
    message for another size: no element-wise check could see it on arrival) are the ranks' disagreement, a
    :class:`RankMismatch` (told to every rank), not the codec's ValueError on one rank while the others wait."""
    try:
        return codec.decode(got, state, like)  # type: ignore[no-any-return]
    except (ValueError, RuntimeError, IndexError) as exc:
        if isinstance(exc, DgtError):
            raise
        raise RankMismatch(shape_mismatch(rnd), detail=f"rank {peer}'s parts do not decode into {like.numel()} x "
                           f"{like.dtype}: {exc}") from exc


def check_op(mine: int, theirs: int, rnd: int) -> None:
    """Raise :class:`RankMismatch` when a peer sent with another call code (op) than this rank's (0: unchecked)."""
    if mine and theirs != mine:
        raise RankMismatch(op_mismatch(theirs, mine, rnd))


def like_parts(template: list[Part], segments: list[int], codec, data: torch.Tensor) -> list[Part]:
    """Geometry of the parts a peer sends for a chunk of ``segments``, from our own parts for another chunk
    (summable codecs emit one part per chunk, one element per element); falls back to encoding ``data``."""
    if data.numel() == 0:
        return []
    if template and all(p.data.numel() == sum(p.segments or [p.data.numel()]) for p in template):
        return [Part(torch.empty(0, dtype=p.data.dtype), 0, p.block_elems, p.name, list(segments)) for p in template]
    return codec.encode(data, codec.state_for(-1, data, segments))


def as_received(part: Part) -> Received:
    """A part as if it arrived whole (to decode locally exactly what peers will decode)."""
    n = part.layout.nblocks
    return Received(part.data, torch.ones(n, dtype=torch.bool), part.block_elems, part.segments)
