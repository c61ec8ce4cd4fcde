"""QSGD-style stochastic quantization (Alistarh et al.), the "Quant-DP" baseline of the Slim-DP paper.

Per bucket of ``bucket`` (512) entries: one fp32 scale (``norm=max``: max |x|, the default; ``norm=l2``: the bucket's
L2 norm as in the QSGD paper) and, per entry, a sign-magnitude level in ``0..s`` with ``s = 2^(b-1) - 1`` (127 for
b = 8) chosen by unbiased stochastic rounding: ``E[decode(encode(x))] = x``. The code ``s + sign * level`` (in
``0..2^b - 2``) is packed at ``b`` bits.

Parts: ``codes`` (uint8, ceil(N b / 8) bytes, then one byte naming the bucket's dtype:
:data:`dgt.codecs.quantize.DTYPE_TAGS`) and ``scales`` (fp32, ceil(N / bucket) values), both reliable. There is no
other header: ``bits``/``bucket`` are codec options known to both ends and N comes from ``like``; a message whose
length does not hold N entries, or that names another dtype than ``like``'s, is refused (``ValueError``: the
collectives report the ranks' disagreement as a ``RankMismatch``). fp32 at b = 8: 8 + 32/512 = 8.0625 bits per
entry plus 8 bits per message, a 3.97x reduction.

Summable: no (the scales differ per rank), so a ring must decode, add and re-encode per hop or the collective
gathers; a parameter server decodes each push and sums. Randomness: one generator per (seed, rank, encode count), so
ranks and rounds are independent, as the unbiasedness argument needs.
"""

from __future__ import annotations

import torch

from dgt.codecs.base import RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.bucketinfo import element_mask_or_none
from dgt.codecs.quantize import (
    check_dtype_tag,
    dtype_tag,
    generator,
    nbuckets,
    pack_bits,
    packed_nbytes,
    qsgd_dequantize,
    qsgd_quantize,
    unpack_bits,
)
from dgt.codecs.registry import register


@register("qsgd")
class QSGDCodec(Codec):
    """Options: ``bits`` (8, 2..16), ``bucket`` (512), ``norm`` (max|l2), ``seed`` (0), ``rank`` (0)."""

    name = "qsgd"
    capabilities = Capabilities(summable=False, lossy_tolerant=False)

    def __init__(self, bits: int = 8, bucket: int = 512, norm: str = "max", seed: int = 0, rank: int = 0) -> None:
        super().__init__()
        if not 2 <= int(bits) <= 16:
            raise ValueError("qsgd bits must be in 2..16")
        if int(bucket) < 1:
            raise ValueError("bucket must be >= 1")
        if norm not in ("max", "l2"):
            raise ValueError("norm must be 'max' or 'l2'")
        self.bits = int(bits)
        self.bucket = int(bucket)
        self.norm = norm
        self.seed = int(seed)
        self.rank = int(rank)
        self.last_stats: dict[str, float] = {}

    def expected_bytes(self, n: int) -> int:
        """ceil(n * bits / 8) code bytes, the dtype byte, and 4 bytes per bucket."""
        return -(-n * self.bits // 8) + 1 + 4 * nbuckets(n, self.bucket)

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        x = bucket.reshape(-1)
        gen = generator(x.device, self.seed, self.rank, 3, state.step)
        codes, scales = qsgd_quantize(x, self.bits, self.bucket, gen, self.norm)
        state.step += 1
        # a codes block of 64 * bits bytes is exactly 512 entries: a lost block maps onto whole entries
        tag = torch.tensor([dtype_tag(x.dtype)], dtype=torch.uint8, device=x.device)
        packed = torch.cat([pack_bits(codes, self.bits), tag])  # the codes, then the byte naming the bucket's dtype
        parts = [
            Part(packed, RELIABLE, block_elems=64 * self.bits * 16, name="codes"),
            Part(scales, RELIABLE, block_elems=1024, name="scales"),
        ]
        nbytes = sum(p.nbytes for p in parts)
        self.last_stats = {"bytes": float(nbytes), "bits_per_entry": 8.0 * nbytes / max(1, x.numel())}
        return parts

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        """Dequantize; entries whose code bytes or bucket scale were lost decode as zero."""
        n = like.numel()
        nbytes = packed_nbytes(n, self.bits)
        if parts[0].data.numel() != nbytes + 1 or parts[1].data.numel() != nbuckets(n, self.bucket):
            # a message for another size (the sender's bucket differs: the collectives report the ranks' mismatch)
            raise ValueError(f"QSGD message of {parts[0].data.numel() - 1} code bytes and {parts[1].data.numel()} "
                             f"scales does not hold {n} entries")
        check_dtype_tag(int(parts[0].data[nbytes]), like, "QSGD message")  # the sender's bucket had another dtype
        codes = unpack_bits(parts[0].data[:nbytes], self.bits, n, narrow=True)
        out = qsgd_dequantize(codes, parts[1].data.to(torch.float32), self.bits, self.bucket, n)
        codes_ok = element_mask_or_none(parts[0])
        scales_ok = element_mask_or_none(parts[1])
        if codes_ok is not None or scales_ok is not None:
            ok = torch.ones(n, dtype=torch.bool, device=out.device)
            if codes_ok is not None:
                # entry i occupies bits [i b, (i + 1) b): intact when its first and last byte arrived
                i = torch.arange(n, device=out.device)
                ok &= codes_ok[(i * self.bits) // 8] & codes_ok[((i + 1) * self.bits - 1) // 8]
            if scales_ok is not None:
                nb = nbuckets(n, self.bucket)
                per_entry = torch.arange(n, device=out.device) // max(1, min(self.bucket, n))
                ok &= scales_ok[:nb][per_entry]
            out[~ok] = 0
        return out.to(device=like.device, dtype=like.dtype).view_as(like)


# The registry's built-in list predates the decentralized codecs: importing them here registers "dcd", "ecd" and
# "naive-gossip" whenever the registry loads this module (see docs/codecs.md).
from dgt.codecs import decentralized as _decentralized  # noqa: E402,F401
