"""Oland & Raj: per-layer entropy-adaptive quantization of the parameters to bin centres + canonical Huffman coding.

Per layer l (the tensors of ``state.values["segments"]``, see :func:`dgt.codecs.bucketinfo.set_segments`; one layer
when absent):

1. ``w_min``, ``w_max`` of the layer.
2. Entropy estimate H: a random sample of ``max(ceil(F n), min(n, min_sample))`` weights (drawn with replacement;
   the floor of 256 samples is a deviation for tiny layers such as biases, where 3% is a handful), quantized to
   ``M`` bits with the layer's range; H = -sum p log2 p over the 2^M-bin histogram.
3. ``N = min(ceil(H + c), ceiling)`` bits (at least 1); ``bits=K`` forces a fixed N = K instead (the paper's
   fixed-quantization baseline).
4. ``i = min(floor(2^N (w - w_min) / (w_max - w_min)), 2^N - 1)`` (the paper prints ``w_max - w``: off by one
   direction; a constant layer sends no indices at all).
5. Canonical Huffman code of the indices (:mod:`dgt.codecs.huffman`), or raw N-bit packing with ``huffman=false``.

Decode: ``w = w_min + (w_max - w_min) (i + 0.5) / 2^N`` (deterministic bin centres: biased, so never pair this codec
with DCD/ECD, which need an unbiased compressor).

Every layer is one self-describing uint8 :class:`Part` (``layer<l>``): a 20-byte header (magic 0x4F, version, N,
flags, chunk u16, dtype u16, numel u32, w_min f32, w_max f32, little-endian), then the Huffman message (codebook,
sync points, stream) or the packed indices. All reliable (a Huffman stream cannot lose a block). ``dtype`` names the
bucket's dtype (:data:`dgt.codecs.quantize.DTYPE_TAGS`; 0, as older senders wrote the field, names none): a message
encoded from another dtype than the tensor it decodes into is refused, like one for another size (``ValueError``:
the collectives report the ranks' disagreement as a ``RankMismatch``).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from dgt.codecs import huffman
from dgt.codecs.base import RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.bucketinfo import get_segments
from dgt.codecs.quantize import check_dtype_tag, dtype_tag, generator, pack_bits, unpack_bits
from dgt.codecs.registry import register

MAGIC = 0x4F
VERSION = 1
HEADER = struct.Struct("<BBBBHHIff")
HEADER_BYTES = HEADER.size  # 20
FLAG_HUFFMAN = 1
FLAG_CONSTANT = 2


def entropy_bits(
    w: torch.Tensor, w_min: float, w_max: float, m_bits: int, frac: float, min_sample: int, gen: torch.Generator
) -> float:
    """H of an M-bit quantization of a random sample of ``w`` (bits)."""
    n = w.numel()
    if n == 0 or w_max <= w_min:
        return 0.0
    k = max(math.ceil(frac * n), min(n, min_sample))
    sample = w[torch.randint(n, (k,), generator=gen, device=w.device)]
    idx = quantize_indices(sample, w_min, w_max, m_bits)
    p = torch.bincount(idx, minlength=1 << m_bits).to(torch.float64) / k
    p = p[p > 0]
    return float(-(p * torch.log2(p)).sum())


def quantize_indices(w: torch.Tensor, w_min: float, w_max: float, bits: int) -> torch.Tensor:
    levels = 1 << bits
    scale = levels / (w_max - w_min)
    return (w.to(torch.float32) - w_min).mul_(scale).floor_().clamp_(0, levels - 1).to(torch.int64)


def bin_centres(idx: torch.Tensor, w_min: float, w_max: float, bits: int) -> torch.Tensor:
    step = (w_max - w_min) / (1 << bits)
    return idx.to(torch.float32).add_(0.5).mul_(step).add_(w_min)


@register("olandraj")
class OlandRajCodec(Codec):
    """Options: ``c`` (6), ``M`` (4), ``F`` (0.03), ``ceiling`` (10), ``bits`` (0 = adaptive; K = fixed K bits),
    ``huffman`` (true), ``chunk`` (0 = automatic Huffman sync interval), ``min_sample`` (256), ``seed``, ``rank``."""

    name = "olandraj"
    # variable_length: a layer's message length depends on its bits and Huffman code: receivers take it from the
    # transport (every part is reliable and self-describing)
    capabilities = Capabilities(summable=False, lossy_tolerant=False, variable_length=True)

    def __init__(
        self,
        c: float = 6,
        M: int = 4,
        F: float = 0.03,
        ceiling: int = 10,
        bits: int = 0,
        huffman: bool = True,
        chunk: int = 0,
        min_sample: int = 256,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        super().__init__()
        if not 1 <= int(ceiling) <= 16:
            raise ValueError("ceiling must be in 1..16 (Huffman alphabet up to 2^16)")
        if int(bits) and not 1 <= int(bits) <= 16:
            raise ValueError("bits must be 0 (adaptive) or 1..16")
        self.c = float(c)
        self.M = int(M)
        self.F = float(F)
        self.ceiling = int(ceiling)
        self.bits = int(bits)
        self.huffman = bool(huffman)
        self.chunk = int(chunk)
        self.min_sample = int(min_sample)
        self.seed = int(seed)
        self.rank = int(rank)
        self.last_stats: dict[str, object] = {}

    def choose_bits(self, w: torch.Tensor, w_min: float, w_max: float, gen: torch.Generator) -> tuple[int, float]:
        if self.bits:
            return self.bits, float("nan")
        h = entropy_bits(w, w_min, w_max, self.M, self.F, self.min_sample, gen)
        return max(1, min(self.ceiling, math.ceil(h + self.c))), h

    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        x = bucket.reshape(-1)
        gen = generator(x.device, self.seed, self.rank, 5, state.step)
        state.step += 1
        parts: list[Part] = []
        layers = []
        off = 0
        for li, n in enumerate(get_segments(state, x.numel())):
            w = x[off : off + n]
            off += n
            if n:
                mm = torch.aminmax(w.to(torch.float32))
                w_min, w_max = float(mm.min), float(mm.max)
            else:
                w_min = w_max = 0.0
            # the header carries fp32 bounds: quantize against exactly what the receiver will read
            w_min, w_max = (float(v) for v in np.array([w_min, w_max], dtype=np.float32))
            constant = not w_max > w_min
            if constant:
                nbits, h = 0, 0.0
            else:
                nbits, h = self.choose_bits(w, w_min, w_max, gen)
            chunk = self.chunk or huffman.auto_chunk(n)
            flags = (FLAG_HUFFMAN if self.huffman else 0) | (FLAG_CONSTANT if constant else 0)
            head = HEADER.pack(MAGIC, VERSION, nbits, flags, chunk, dtype_tag(x.dtype), n, w_min, w_max)
            head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(x.device)
            if constant:
                body = torch.zeros(0, dtype=torch.uint8, device=x.device)
                payload_bits = 0
            else:
                idx = quantize_indices(w, w_min, w_max, nbits)
                if self.huffman:
                    sections: dict = {}
                    body = huffman.encode_message(idx, 1 << nbits, chunk, sections)
                    payload_bits = 8 * sections["stream"]
                else:
                    body = pack_bits(idx, nbits)
                    payload_bits = 8 * body.numel()
            data = torch.cat([head_t, body])
            parts.append(Part(data, RELIABLE, block_elems=4096, name=f"layer{li}"))
            layers.append({"numel": n, "N": nbits, "H": h, "bytes": int(data.numel()), "payload_bits": payload_bits})
        total = sum(p.nbytes for p in parts)
        numel = max(1, x.numel())
        self.last_stats = {
            "bytes": total,
            # everything on the wire: headers, codebooks, sync points, streams
            "bits_per_param": 8.0 * total / numel,
            # the coded indices alone (Huffman stream or packed indices), no metadata
            "payload_bits_per_param": sum(L["payload_bits"] for L in layers) / numel,
            # N bits per parameter before entropy coding
            "raw_bits_per_param": sum(L["N"] * L["numel"] for L in layers) / numel,
            "layers": layers,
        }
        return parts

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
        off = 0
        for rec in parts:
            data = rec.data
            magic, version, nbits, flags, chunk, tag, n, w_min, w_max = HEADER.unpack(
                bytes(data[:HEADER_BYTES].cpu().numpy().tobytes())
            )
            if magic != MAGIC or version != VERSION:
                raise ValueError("not an Oland-Raj layer message")
            check_dtype_tag(tag, like, "Oland-Raj message")  # the sender's bucket had another dtype
            if off + n > out.numel():
                raise ValueError("Oland-Raj message holds more entries than the tensor it decodes into")
            dst = out[off : off + n]
            off += n
            if flags & FLAG_CONSTANT:
                dst.fill_(w_min)
                continue
            body = data[HEADER_BYTES:].to(out.device)
            if flags & FLAG_HUFFMAN:
                idx = huffman.decode_message(body, 1 << nbits, n, chunk)
            else:
                idx = unpack_bits(body, nbits, n)
            dst.copy_(bin_centres(idx, w_min, w_max, nbits))
        if off != out.numel():
            raise ValueError(f"Oland-Raj message holds {off} entries, the tensor has {out.numel()}")
        return out.to(like.dtype).view_as(like)
