"""Shared pieces of the quantizing codecs: seeded generators, cheap dither, b-bit packing, unbiased quantizers.

Everything here is whole-tensor torch on the input's device (CPU or CUDA); the only Python loops run over at most 8
byte lanes of a packing group, never over elements.

Quantizers (all return/consume plain tensors; the codecs wrap them into :class:`~dgt.codecs.base.Part` objects):

- :func:`qsgd_quantize` / :func:`qsgd_dequantize`: QSGD-style sign-magnitude codes with ``2^(b-1) - 1`` levels per
  sign and one fp32 scale (max-abs or L2 norm) per bucket of ``bucket`` elements; stochastic rounding, unbiased.
- :func:`affine_quantize` / :func:`affine_dequantize`: ZipML style, per bucket (or per tensor) ``min`` and ``scale``
  (fp32) and b-bit codes over ``2^b`` uniformly spaced points ``min + k * scale``; stochastic rounding, unbiased.
- :func:`fixed_step_quantize` / :func:`fixed_step_dequantize`: a magnitude-independent grid ``k * step`` (ECD's
  fixed-precision option): per-bucket int32 base code and codes packed at the width the message needs (capped by
  ``max_bits``; beyond the cap the step is doubled for that message, which keeps it unbiased).

Stochastic rounding uses a 16-bit dither ``u = (k + 1/2) / 2^16`` (k uniform on 0..65535), generated as 64-bit random
words split four ways (4x fewer generator calls than ``torch.rand``). Its bias is at most ``2^-17`` of one
quantization step, far below anything the statistical tests can see; documented in docs/codecs.md.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1


def mix_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (splitmix64 chain): independent streams per (seed, rank, stream, step)."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (int(k) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h & ((1 << 63) - 1)


def generator(device: torch.device | str, *keys: int) -> torch.Generator:
    """A torch generator on ``device`` seeded from ``keys`` (same keys + same device type = same stream)."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(mix_seed(*keys))
    return g


def dither(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``n`` float32 values ``(k + 0.5) / 65536`` with k uniform on 0..65535 (16-bit resolution, mean 1/2)."""
    words = -(-n // 4)
    r = torch.empty(words, dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1, generator=gen)
    k = r.view(torch.int16)[:n].to(torch.float32)  # -32768..32767
    return k.add_(32768.5).mul_(1.0 / 65536.0)


# ---------------------------------------------------------------------------------------------------------------
# bit packing
# ---------------------------------------------------------------------------------------------------------------


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` codes packed at ``bits`` bits each: ceil(n * bits / 8)."""
    return -(-n * bits // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer codes ``< 2^bits`` (1 <= bits <= 32) into ``ceil(n*bits/8)`` uint8, LSB first.

    Codes are grouped so a group fills whole bytes (g = 8/gcd(bits, 8) codes, at most 8): a loop over the <= 8 codes
    of a group and the <= 7 bytes it fills, each step a whole-tensor op. Codes wider than 8 bits are split into a
    low byte plane (sent as is) and the high bits (packed recursively).
    """
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in 1..32, got {bits}")
    codes = codes.reshape(-1)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits in (1, 2, 4):  # byte arithmetic only (bitmaps are large)
        g = 8 // bits
        c = codes.to(torch.uint8)
        if c.numel() % g:
            c = torch.cat([c, c.new_zeros(g - c.numel() % g)])
        c = c.view(-1, g)
        out = c[:, 0].clone()
        for j in range(1, g):
            out |= c[:, j] << (bits * j)
        return out
    if bits > 8:
        c = codes.to(torch.int64)
        low = (c & 0xFF).to(torch.uint8)
        return torch.cat([low, pack_bits(c >> 8, bits - 8)])
    g = 8 // math.gcd(bits, 8)
    group_bytes = g * bits // 8
    ngroups = -(-n // g)
    c = codes.to(torch.int64)
    if ngroups * g != n:
        c = torch.cat([c, c.new_zeros(ngroups * g - n)])
    c = c.view(ngroups, g)
    word = c[:, 0].clone()
    for j in range(1, g):
        word |= c[:, j] << (bits * j)
    out = torch.empty(ngroups, group_bytes, dtype=torch.uint8, device=codes.device)
    for m in range(group_bytes):
        out[:, m] = ((word >> (8 * m)) & 0xFF).to(torch.uint8)
    return out.view(-1)[:nbytes]


def unpack_bits(data: torch.Tensor, bits: int, n: int, narrow: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes as int64 (``narrow=True``: 8-bit codes come back as the uint8
    data itself, no copy, for dequantizers that convert to float anyway)."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in 1..32, got {bits}")
    data = data.reshape(-1)
    if data.numel() < packed_nbytes(n, bits):
        raise ValueError(f"{data.numel()} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return data[:n] if narrow else data[:n].to(torch.int64)
    if bits in (1, 2, 4):
        g = 8 // bits
        d = data[: packed_nbytes(n, bits)]
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
        out = ((d.view(-1, 1) >> shifts) & ((1 << bits) - 1)).view(-1)[:n]
        return out if narrow else out.to(torch.int64)
    if bits > 8:
        low = data[:n].to(torch.int64)
        high = unpack_bits(data[n:], bits - 8, n)
        return low | (high << 8)
    g = 8 // math.gcd(bits, 8)
    group_bytes = g * bits // 8
    ngroups = -(-n // g)
    d = data[: packed_nbytes(n, bits)].to(torch.int64)
    if d.numel() != ngroups * group_bytes:
        d = torch.cat([d, d.new_zeros(ngroups * group_bytes - d.numel())])
    d = d.view(ngroups, group_bytes)
    word = d[:, 0].clone()
    for m in range(1, group_bytes):
        word |= d[:, m] << (8 * m)
    mask = (1 << bits) - 1
    out = torch.empty(ngroups, g, dtype=torch.int64, device=data.device)
    for j in range(g):
        out[:, j] = (word >> (bits * j)) & mask
    return out.view(-1)[:n]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as a bitmap of ceil(n/8) bytes."""
    return pack_bits(mask.reshape(-1).to(torch.uint8), 1)


def unpack_mask(data: torch.Tensor, n: int) -> torch.Tensor:
    d = data.reshape(-1)[: packed_nbytes(n, 1)]
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((d.view(-1, 1) >> shifts) & 1).view(-1)[:n].to(torch.bool)


# ---------------------------------------------------------------------------------------------------------------
# per-bucket views (no padding copy of the input: full buckets as one 2-D view, the tail as a second one)
# ---------------------------------------------------------------------------------------------------------------


def bucket_views(x: torch.Tensor, bucket: int) -> list[torch.Tensor]:
    """``x`` (1-D) as a list of 2-D views [(full, bucket), (1, tail)] (empty ones left out). bucket <= 0: whole."""
    n = x.numel()
    if bucket <= 0 or bucket >= n:
        return [x.view(1, n)] if n else []
    full, tail = divmod(n, bucket)
    out = []
    if full:
        out.append(x[: full * bucket].view(full, bucket))
    if tail:
        out.append(x[full * bucket :].view(1, tail))
    return out


# the bucket dtypes a gather-then-reduce codec's message names (QSGD's last code byte, Oland-Raj's layer header), so
# a receiver whose own bucket has another dtype sees the ranks' disagreement instead of decoding into its own dtype;
# append only: a tag names the same dtype in every release (0: a message that names none)
DTYPE_TAGS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dtype_tag(dtype: torch.dtype) -> int:
    """The tag (1..) a message carries for a bucket of ``dtype``; 0 for a dtype without one."""
    return DTYPE_TAGS.index(dtype) + 1 if dtype in DTYPE_TAGS else 0


def check_dtype_tag(tag: int, like: torch.Tensor, what: str) -> None:
    """ValueError when a message encoded from another dtype than ``like``'s (tag 0: unnamed, not checked). The
    collectives turn a peer's message that does not decode into this rank's tensor into a RankMismatch."""
    mine = dtype_tag(like.dtype)
    if tag and mine and tag != mine:
        theirs = DTYPE_TAGS[tag - 1] if tag <= len(DTYPE_TAGS) else f"dtype tag {tag}"
        raise ValueError(f"{what} was encoded from a {theirs} bucket, this rank decodes into {like.dtype}")


def nbuckets(n: int, bucket: int) -> int:
    if n == 0:
        return 0
    if bucket <= 0 or bucket >= n:
        return 1
    return -(-n // bucket)


# ---------------------------------------------------------------------------------------------------------------
# QSGD (sign-magnitude, bucketed, max-abs or L2 scale)
# ---------------------------------------------------------------------------------------------------------------


def code_dtype(bits: int) -> torch.dtype:
    """The narrowest integer dtype that holds ``bits``-bit codes (uint8 up to 8 bits, int32 up to 31)."""
    return torch.uint8 if bits <= 8 else torch.int32


def qsgd_quantize(
    x: torch.Tensor, bits: int, bucket: int, gen: torch.Generator, norm: str = "max"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in [0, 2^bits - 2] as uint8/int32, scales float32 per bucket): code = s + sign(x) level, s = 2^(b-1) - 1.

    Codes are written straight into a preallocated narrow buffer (the float -> integer conversion fuses with the
    copy), the buckets as 2-D views of the input: no padded copy, no int64 intermediate."""
    if not 2 <= bits <= 16:
        raise ValueError("QSGD bits must be in 2..16")
    if norm not in ("max", "l2"):
        raise ValueError(f"norm must be 'max' or 'l2', got {norm!r}")
    s = (1 << (bits - 1)) - 1
    xf = x.reshape(-1).to(torch.float32)
    n = xf.numel()
    u = dither(n, gen, xf.device)
    codes = torch.empty(n, dtype=code_dtype(bits), device=xf.device)
    scales = []
    off = 0
    for v in bucket_views(xf, bucket):
        sc = v.abs().amax(dim=1) if norm == "max" else torch.linalg.vector_norm(v, dim=1)
        inv = torch.where(sc > 0, s / sc, torch.zeros_like(sc))
        lvl = v.abs().mul_(inv[:, None]).add_(u[off : off + v.numel()].view_as(v)).floor_().clamp_(max=s)
        codes[off : off + v.numel()].view_as(v).copy_(torch.copysign(lvl, v).add_(s))
        scales.append(sc)
        off += v.numel()
    if not scales:
        return codes, torch.zeros(0, device=x.device)
    return codes, torch.cat(scales)


def qsgd_dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, bucket: int, n: int) -> torch.Tensor:
    s = (1 << (bits - 1)) - 1
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    off = b = 0
    for v in bucket_views(out, bucket):
        rows, cols = v.shape
        c = codes[off : off + rows * cols].view(rows, cols).to(torch.float32).sub_(s)
        v.copy_(c.mul_((scales[b : b + rows] / s)[:, None]))
        off += rows * cols
        b += rows
    return out


# ---------------------------------------------------------------------------------------------------------------
# affine (min / scale, 2^b points), bucketed or per tensor
# ---------------------------------------------------------------------------------------------------------------


def affine_quantize(x: torch.Tensor, bits: int, bucket: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in [0, 2^bits - 1] as uint8/int32, meta float32 [min_0, scale_0, min_1, scale_1, ...] per bucket)."""
    if not 1 <= bits <= 16:
        raise ValueError("affine bits must be in 1..16")
    top = (1 << bits) - 1
    xf = x.reshape(-1).to(torch.float32)
    n = xf.numel()
    u = dither(n, gen, xf.device)
    codes = torch.empty(n, dtype=code_dtype(bits), device=xf.device)
    metas = []
    off = 0
    for v in bucket_views(xf, bucket):
        lo = v.amin(dim=1)
        hi = v.amax(dim=1)
        scale = (hi - lo) / top
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        c = (v - lo[:, None]).mul_(inv[:, None]).add_(u[off : off + v.numel()].view_as(v)).floor_().clamp_(0, top)
        codes[off : off + v.numel()].view_as(v).copy_(c)
        metas.append(torch.stack([lo, scale], dim=1).reshape(-1))
        off += v.numel()
    if not metas:
        return codes, torch.zeros(0, device=x.device)
    return codes, torch.cat(metas)


def affine_dequantize(codes: torch.Tensor, meta: torch.Tensor, bucket: int, n: int) -> torch.Tensor:
    """min + code * scale (a multiply then an add, two separate ops: the same bits on every rank of one device type)."""
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    m = meta.view(-1, 2)
    off = b = 0
    for v in bucket_views(out, bucket):
        rows, cols = v.shape
        c = codes[off : off + rows * cols].view(rows, cols).to(torch.float32)
        c = c * m[b : b + rows, 1:2]
        v.copy_(c + m[b : b + rows, 0:1])
        off += rows * cols
        b += rows
    return out


# ---------------------------------------------------------------------------------------------------------------
# fixed step (magnitude independent), width chosen per message
# ---------------------------------------------------------------------------------------------------------------


def fixed_step_quantize(
    x: torch.Tensor, step: float, bucket: int, gen: torch.Generator, max_bits: int = 16
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(offsets int64, bases int32 per bucket, width bits, shift): x ~ (base + offset) * step * 2^shift, unbiased.

    The width is what the message's widest bucket needs; when it exceeds ``max_bits`` the step is doubled ``shift``
    times and the message re-quantized (with a fresh dither), so values are never clipped.
    """
    if step <= 0:
        raise ValueError("step must be positive")
    xd = x.reshape(-1).to(torch.float64)
    n = xd.numel()
    u = dither(n, gen, xd.device)
    shift = 0
    while True:
        st = step * (2.0**shift)
        k = (xd / st).add_(u).floor_()
        big = float(k.abs().max()) if n else 0.0
        if big >= 2**30:  # bases must fit int32: coarsen the grid (rare: only for huge values / tiny steps)
            shift += max(1, math.ceil(math.log2(big / 2**29)))
            continue
        k = k.to(torch.int64)
        bases, offs = [], []
        width = 0
        for v in bucket_views(k, bucket):
            base = v.amin(dim=1)
            off = v - base[:, None]
            bases.append(base)
            offs.append(off.reshape(-1))
        if offs:
            span = max(int(o.max()) for o in offs)
            width = span.bit_length()
        if width <= max_bits:
            break
        shift += width - max_bits
        u = dither(n, gen, xd.device)
    if not offs:
        empty = torch.zeros(0, dtype=torch.int64, device=x.device)
        return empty, empty.to(torch.int32), 0, shift
    return torch.cat(offs), torch.cat(bases).to(torch.int32), width, shift


def fixed_step_dequantize(
    offsets: torch.Tensor, bases: torch.Tensor, step: float, shift: int, bucket: int, n: int
) -> torch.Tensor:
    st = step * (2.0**shift)
    out = torch.empty(n, dtype=torch.float32, device=bases.device)
    off = b = 0
    for v in bucket_views(out, bucket):
        rows, cols = v.shape
        k = offsets[off : off + rows * cols].view(rows, cols) + bases[b : b + rows, None].to(torch.int64)
        v.copy_(k.to(torch.float64).mul_(st).to(torch.float32))
        off += rows * cols
        b += rows
    return out
