"""Dense codec: the whole bucket on the reliable lane, in the bucket's own dtype (lossless, bit-exact) or cast to
fp32/fp16/bf16 on the wire when asked."""

from __future__ import annotations

from dataclasses import replace

import torch

from dgt.codecs.base import RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.registry import register
from dgt.wire import WIRE_OF

_DTYPES = {"native": None, "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


@register("dense")
class DenseCodec(Codec):
    """Lossless baseline (``dtype=native``, the default: every element travels and is added in the bucket's own
    dtype, so integers and float64 stay bit-exact) or a plain cast (fp32/fp16/bf16, floating buckets only). Summable,
    so it serves ring all-reduce."""

    name = "dense"
    capabilities = Capabilities(summable=True, lossy_tolerant=False, in_place=True)

    def __init__(self, dtype: str = "native", block: int = 1024) -> None:
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"dense dtype must be one of {sorted(_DTYPES)}")
        self.wire_dtype: torch.dtype | None = _DTYPES[dtype]
        """The dtype on the wire; None: the bucket's own."""
        self.block = block
        self.capabilities = replace(self.capabilities, block=block, wire_dtype=self.wire_dtype)
        # native: every dtype the wire can carry except bool (a sum of bools is no bool); a cast: floating buckets
        self.accepted_dtypes = frozenset(WIRE_OF) if self.wire_dtype is None else _FLOATS

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        data = bucket.reshape(-1)
        if self.wire_dtype is not None:
            data = data.to(self.wire_dtype)
        return [Part(data, RELIABLE, self.block, "dense", state.segments)]

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        return parts[0].data.to(device=like.device, dtype=like.dtype).view_as(like)
