"""The codec contract: how a payload codec turns a flat gradient bucket into parts the transport can carry.

A codec never does I/O. The collective calls ``encode`` on every rank, ships each :class:`Part` over the lane its
``lane_class`` names (0 = reliable, >= 1 = droppable best-effort classes, higher = less important), hands the
received parts (with their per-block received masks) to ``decode``/``aggregate``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dgt.layout import BucketLayout

HALF = (torch.float16, torch.bfloat16)


def rank_order_sum(terms: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The ranks' ``terms`` added in rank order, as every rank adds them (the same bits on each): in ``dtype``, or
    in float32 when ``dtype`` is 16-bit (the caller rounds the sum once). The direct all-reduce's reduce and the
    low-rank codec's in-process reference both add this way."""
    acc_dtype = torch.float32 if dtype in HALF else dtype
    acc = terms[0].to(acc_dtype, copy=True)
    for t in terms[1:]:
        acc.add_(t.to(acc_dtype))
    return acc

RELIABLE = 0
"""Lane class of data that must arrive (TCP, DSCP EF)."""
DROPPABLE = 1
"""Lane class of data that may be lost (UDP, low DSCP)."""


@dataclass(frozen=True)
class Capabilities:
    """What a codec promises, so a collective can refuse a pairing it cannot serve.

    summable: payloads of different ranks can be added element-wise on the way (dense, same-index sparse), so ring
        all-reduce can reduce-scatter them; otherwise the collective must gather then reduce.
    lossy_tolerant: parts with lane_class >= 1 may be dropped (all of them or some of their blocks).
    stateful_server: the codec needs server-side state (e.g. LGC decoders, Slim-DP model pulls): only a collective
        that keeps it (the model server) can serve it; elsewhere its decoded payloads would be silently wrong.
    replica_deltas: payloads are differences against replicas each neighbour keeps (DCD/ECD-PSGD): only gossip nodes
        (``dgt.codecs.decentralized``) drive it; a plain reduction would add the differences as if they were values.

    What the collectives need to carry and land the parts (so that none of them tests a codec's name or probes its
    attributes):

    block: elements per transport block the codec cuts a bucket into; collectives cut chunks on its multiples.
    wire_dtype: the dtype of the bucket's elements on the wire; None: the bucket's own.
    in_place: the codec's message is one part holding the bucket's elements in order (decode is a cast at most), so
        a chunk can land straight in the result (ring, stream lanes) and, lossless, replace a replica (model pull).
    merges: a pull codec that merges the pulled parts into the local replica (:meth:`Codec.merge`, Slim-DP) instead
        of replacing it.
    header_part: the first part describes the rest (:meth:`Codec.wire_parts`): a receiver reads it before it knows
        how many parts follow and how they are cut.
    variable_length: reliable parts whose length only the message itself says (Oland-Raj's Huffman streams).
    transport_feedback: the transport may fold lost blocks into the next round (its error feedback); False when
        the codec's droppable blocks are records the algorithm drops (Slim-DP's explorer).
    """

    summable: bool
    lossy_tolerant: bool
    stateful_server: bool = False
    replica_deltas: bool = False
    block: int = 1024
    wire_dtype: torch.dtype | None = None
    in_place: bool = False
    merges: bool = False
    header_part: bool = False
    variable_length: bool = False
    transport_feedback: bool = True


@dataclass
class Part:
    """One contiguous payload of an encoded bucket.

    data: 1-D tensor to ship (any dtype the wire knows: float32/16, bfloat16, uint8, int32, int64, float64).
    lane_class: one class for the whole part, or a per-block int8 tensor (DGT: per sub-block importance class).
    block_elems: elements per transport block of this part; the receiver reports loss per block of this size.
        Codecs whose records must not be split choose a multiple of their record size.
    name: a label for statistics ("important", "core", "explorer", ...).
    """

    data: torch.Tensor
    lane_class: int | torch.Tensor = RELIABLE
    block_elems: int = 1024
    name: str = "payload"
    segments: list[int] | None = None
    """Sizes of the tensors inside ``data`` (blocks never straddle two tensors); None = one tensor."""
    order: torch.Tensor | None = None
    """Droppable blocks in send order, most important first (None = block order)."""

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def layout(self) -> BucketLayout:
        """The part's block geometry (the shared instance: see :meth:`dgt.layout.BucketLayout.of`)."""
        return BucketLayout.of(self.segments or [self.data.numel()], self.block_elems)


@dataclass
class Received:
    """A part as it came off the wire: the data (zeros where lost) and which blocks arrived."""

    data: torch.Tensor
    block_mask: torch.Tensor  # bool, one per block of the part
    block_elems: int
    segments: list[int] | None = None

    def to(self, device: torch.device | str) -> Received:
        """This part on ``device``, data and block mask together (decoders index one with the other); itself if
        it is there already."""
        if self.data.device == torch.device(device) and self.block_mask.device == torch.device(device):
            return self
        return replace(self, data=self.data.to(device), block_mask=self.block_mask.to(device))

    @property
    def layout(self) -> BucketLayout:
        """The part's block geometry (the shared instance: see :meth:`dgt.layout.BucketLayout.of`)."""
        return BucketLayout.of(self.segments or [self.data.numel()], self.block_elems)

    def element_mask(self) -> torch.Tensor:
        """Expand the per-block mask to one bool per element (vectorised)."""
        return self.layout.expand(self.block_mask)


BLOCK_MEANS_HINT = "block_abs_mean"
"""``BucketState.values`` key: the mean |x| of every block (float32, one per block of the state's layout) of the
next bucket this state's ``encode`` gets, computed by a pass that already read it (a lossy ring hop's sum,
dgt.protocol.block_ops). A codec that scores blocks by it may take it instead of reading the bucket again; it is
consumed by that ``encode`` (popped), so it never outlives the bucket it describes."""


@dataclass
class BucketState:
    """Per-bucket codec state (error feedback, EMA scores, cached indices). Reset when the bucket's shape changes.

    ``values`` is a plain dict of tensors/numbers so the whole state pickles for checkpoints.
    """

    numel: int
    dtype: torch.dtype
    values: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    segments: list[int] | None = None
    """Sizes of the tensors packed in the bucket (DDP buckets hold several parameters); None = one tensor."""


class Codec:
    """Base class: subclasses set ``name``/``capabilities`` and implement encode/decode (and may override aggregate)."""

    name: str = "codec"
    capabilities: Capabilities = Capabilities(summable=True, lossy_tolerant=False)
    runner: str | None = None
    """The driver a codec needs instead of the generic collectives (LGC's phases and autoencoder training), named
    for the error message; the collectives refuse a codec that sets it at construction, before any traffic."""

    def __init__(self) -> None:
        self._states: dict[Hashable, BucketState] = {}

    # -- state -------------------------------------------------------------------------------------------------
    def state_for(self, bucket_id: Hashable, bucket: torch.Tensor, segments: list[int] | None = None) -> BucketState:
        """The state of ``bucket_id`` (a bucket id, or a collective's key naming the bucket, phase and peer), created
        fresh (or reset) when the bucket's size, dtype or tensors changed."""
        st = self._states.get(bucket_id)
        if (st is None or st.numel != bucket.numel() or st.dtype != bucket.dtype
                or (segments and st.segments != list(segments))):
            st = BucketState(numel=bucket.numel(), dtype=bucket.dtype, segments=list(segments) if segments else None)
            self._states[bucket_id] = st
        return st

    def state_dict(self) -> dict[Hashable, BucketState]:
        return self._states

    def load_state_dict(self, states: dict[Hashable, BucketState]) -> None:
        self._states = dict(states)

    # -- the contract -------------------------------------------------------------------------------------------
    accepted_dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16,
                                                         torch.float64})
    """Bucket dtypes this codec reduces correctly; anything else is refused before any traffic
    (:meth:`check_input`)."""

    def check_input(self, bucket: torch.Tensor) -> None:
        """Raise :class:`~dgt.errors.InputRejected` (before any traffic) for a bucket this codec cannot carry."""
        if bucket.dtype not in self.accepted_dtypes:
            from dgt.errors import InputRejected

            ok = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.accepted_dtypes))
            raise InputRejected(f"codec {self.name!r} cannot reduce {bucket.dtype} tensors (accepted: {ok})")

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        raise NotImplementedError

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        """Rebuild a dense tensor shaped like ``like`` from one rank's received parts (lost blocks count as zero)."""
        raise NotImplementedError

    def aggregate(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        """Combine decoded per-rank tensors into the sum (collectives divide for the mean)."""
        out = decoded[0].clone()
        for t in decoded[1:]:
            out += t
        return out

    def observe_loss(self, loss: float) -> None:
        """This step's training loss, for a codec whose schedule follows it (DGT's p); the others ignore it."""

    def current_p(self) -> float | None:
        """The fraction the next encode classifies as important, for a codec with a schedule of p (DGT); None for
        the others."""
        return None

    def merge(self, parts: list[Received], state: BucketState, local: torch.Tensor) -> torch.Tensor:
        """A pull codec with ``capabilities.merges``: the local replica updated by the pulled parts."""
        raise NotImplementedError(f"codec {self.name!r} does not merge pulled parts (capabilities.merges is False)")

    def wire_parts(self, header: torch.Tensor, like: torch.Tensor) -> list[Part]:
        """A codec with ``capabilities.header_part``: the geometry of every part, read from the first part."""
        raise NotImplementedError(f"codec {self.name!r} has no header part (capabilities.header_part is False)")

    def feedback(self, parts: list[Part], received_masks: list[torch.Tensor], state: BucketState) -> None:
        """Told which blocks of each sent part were lost (drop report); lossy codecs fold them into error feedback."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
