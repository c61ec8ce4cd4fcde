"""Shared quantization pieces: bit packing, dither, seeded streams, unbiased quantizers (statistical, fixed seeds)."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs.quantize import (
    affine_dequantize,
    affine_quantize,
    dither,
    fixed_step_dequantize,
    fixed_step_quantize,
    generator,
    mix_seed,
    pack_bits,
    pack_mask,
    packed_nbytes,
    qsgd_dequantize,
    qsgd_quantize,
    unpack_bits,
    unpack_mask,
)


@pytest.mark.parametrize("bits", list(range(1, 17)) + [20, 24, 31, 32])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_round_trip_and_exact_size(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 2**bits, (n,), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_mask_round_trip() -> None:
    m = torch.rand(12_345, generator=torch.Generator().manual_seed(0)) < 0.3
    packed = pack_mask(m)
    assert packed.numel() == math.ceil(12_345 / 8)
    assert torch.equal(unpack_mask(packed, 12_345), m)


def test_unpack_rejects_short_buffer() -> None:
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 5, 10)


def test_seeded_streams_are_reproducible_and_distinct() -> None:
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert len({mix_seed(0, r, s) for r in range(8) for s in range(64)}) == 8 * 64
    a = torch.rand(4, generator=generator("cpu", 7, 1))
    b = torch.rand(4, generator=generator("cpu", 7, 1))
    c = torch.rand(4, generator=generator("cpu", 7, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dither_is_uniform_on_the_unit_interval() -> None:
    u = dither(200_000, generator("cpu", 3), torch.device("cpu"))
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.003  # sd of the mean = 0.29 / sqrt(2e5) = 6.5e-4
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.005


def _check_unbiased(samples: torch.Tensor, truth: torch.Tensor, step: torch.Tensor | float) -> None:
    """Sample means of the varying entries within 5 sd of the truth (1000 entries: a |z| beyond 5 has probability
    ~6e-4 under unbiasedness) and mean z^2 near 1 (a bias of a few percent of a level pushes it far above 1);
    entries that never varied must sit within ``5/trials`` levels of the truth (on a grid point, or so close to
    one that rounding away is too rare to show in ``trials`` draws)."""
    t = samples.shape[0]
    sd = samples.std(0)
    varying = sd > 0
    z = (samples.mean(0)[varying] - truth[varying]) / (sd[varying] / math.sqrt(t))
    assert float(z.abs().max()) < 5.0
    assert 0.8 < float((z**2).mean()) < 1.2
    step_t = torch.as_tensor(step, dtype=torch.float32).expand_as(truth)
    err = (samples[0, ~varying] - truth[~varying]).abs()
    assert bool((err <= step_t[~varying] * 5 / t + 1e-6 * truth[~varying].abs() + 1e-12).all())


def _awkward_vector(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 0, n)[torch.randperm(n, generator=g)]
    x[::37] = 0.0
    return x


TRIALS = 3000
N = 1024


def _trials(x: torch.Tensor) -> torch.Tensor:
    """TRIALS copies of x back to back: with buckets that divide N, one call quantizes every copy independently."""
    return x.repeat(TRIALS)


def test_qsgd_quantizer_is_unbiased() -> None:
    x = _awkward_vector(N, 0)
    codes, scales = qsgd_quantize(_trials(x), 4, 128, generator("cpu", 11))
    assert int(codes.max()) <= 14
    s = qsgd_dequantize(codes, scales, 4, 128, N * TRIALS).view(TRIALS, N)
    bucket_max = x.abs().view(-1, 128).amax(1).repeat_interleave(128)
    _check_unbiased(s, x, bucket_max / 7)  # 4 bits: 7 levels per sign


def test_affine_quantizer_is_unbiased() -> None:
    x = _awkward_vector(N, 1)
    codes, meta = affine_quantize(_trials(x), 3, N, generator("cpu", 12))  # one min/scale per copy
    assert int(codes.max()) <= 7
    s = affine_dequantize(codes, meta, N, N * TRIALS).view(TRIALS, N)
    _check_unbiased(s, x, float(x.max() - x.min()) / 7)


def test_fixed_step_quantizer_is_unbiased_even_when_the_step_grows() -> None:
    x = _awkward_vector(N, 2) * 10
    offs, bases, width, shift = fixed_step_quantize(_trials(x), 1e-3, 256, generator("cpu", 13), max_bits=8)
    assert width <= 8
    assert shift > 0  # 8 bits cannot cover a bucket at step 1e-3: the grid was coarsened, not clipped
    s = fixed_step_dequantize(offs, bases, 1e-3, shift, 256, N * TRIALS).view(TRIALS, N)
    _check_unbiased(s, x, 1e-3 * 2.0**shift)


def test_fixed_step_error_is_bounded_by_the_step() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    offs, bases, width, shift = fixed_step_quantize(x, 1e-3, 512, generator("cpu", 1), max_bits=16)
    assert shift == 0 and width <= 16
    y = fixed_step_dequantize(offs, bases, 1e-3, shift, 512, x.numel())
    assert float((y - x).abs().max()) < 1e-3 * (1 + 1e-4)
