"""Dense codec: the whole bucket on the reliable lane, optionally cast to fp16/bf16 on the wire."""

from __future__ import annotations

import torch

from dgt.codecs.base import RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.registry import register

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@register("dense")
class DenseCodec(Codec):
    """Lossless baseline (fp32) or a plain cast (fp16/bf16). Summable, so it serves ring all-reduce."""

    name = "dense"
    capabilities = Capabilities(summable=True, lossy_tolerant=False)

    def __init__(self, dtype: str = "fp32", block: int = 1024) -> None:
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"dense dtype must be one of {sorted(_DTYPES)}")
        self.wire_dtype = _DTYPES[dtype]
        self.block = block

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        data = bucket.reshape(-1).to(self.wire_dtype)
        return [Part(data, RELIABLE, self.block, "dense", state.segments)]

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        return parts[0].data.to(device=like.device, dtype=like.dtype).view_as(like)
