"""Small helpers shared by the payload codecs: layer boundaries of a bucket, byte accounting, received masks.

The Codec contract hands ``encode`` only a flat bucket. Codecs that work per layer (Oland-Raj, Slim-DP with
``scope=tensor``) read the bucket's tensor sizes from ``state.values["segments"]``, which the collective (or the
simulation) sets once per bucket with :func:`set_segments`. Without it the whole bucket is one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dgt.codecs.base import BucketState, Part, Received

SEGMENTS_KEY = "segments"


def set_segments(state: BucketState, sizes: Sequence[int]) -> None:
    """Declare the tensor (layer) sizes inside a bucket; they must add up to the bucket's numel."""
    sizes = [int(s) for s in sizes]
    if sum(sizes) != state.numel:
        raise ValueError(f"segments add up to {sum(sizes)}, bucket has {state.numel} elements")
    state.values[SEGMENTS_KEY] = sizes


def get_segments(state: BucketState, numel: int) -> list[int]:
    sizes = state.values.get(SEGMENTS_KEY)
    if not sizes or sum(sizes) != numel:
        return [numel]
    return list(sizes)


def wire_bytes(parts: Sequence[Part]) -> int:
    """Bytes a message puts on the wire: every codec here keeps its headers inside its parts, so this is exact."""
    return int(sum(p.nbytes for p in parts))


def received_from_parts(parts: Sequence[Part], masks: Sequence[torch.Tensor | None] | None = None) -> list[Received]:
    """What a lossless (or, with per-part block ``masks``, lossy) wire hands the receiver; lost blocks read as zero.

    Lossless parts share the sender's tensors (decoders never write into received data); lossy ones are copied.
    """

    out = []
    for i, p in enumerate(parts):
        data = p.data.reshape(-1)
        mask = None if masks is None else masks[i]
        if mask is None:
            mask = torch.ones(p.layout.nblocks, dtype=torch.bool, device=data.device)
            out.append(Received(data, mask, p.block_elems, p.segments))
            continue
        mask = mask.to(device=data.device, dtype=torch.bool)
        rec = Received(data.clone(), mask, p.block_elems, p.segments)
        if not bool(mask.all()):
            rec.data[~rec.element_mask()] = 0
        out.append(rec)
    return out


def element_mask_or_none(rec: Received) -> torch.Tensor | None:
    """The per-element arrival mask, or None when every block arrived (the common case costs one reduction)."""
    if rec.block_mask.numel() == 0 or bool(rec.block_mask.all()):
        return None
    return rec.element_mask()
