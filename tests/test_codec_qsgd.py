"""QSGD codec: registry, exact byte accounting, error bound, unbiasedness through the codec, loss handling."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs import make_codec
from dgt.codecs.base import RELIABLE, BucketState
from dgt.codecs.bucketinfo import received_from_parts, wire_bytes
from dgt.codecs.qsgd import QSGDCodec


def _state(x: torch.Tensor) -> BucketState:
    return BucketState(x.numel(), x.dtype)


def test_registry_spec_and_defaults() -> None:
    c = make_codec("qsgd")
    assert isinstance(c, QSGDCodec) and (c.bits, c.bucket, c.norm) == (8, 512, "max")
    c = make_codec("qsgd:bits=4,bucket=256,norm=l2")
    assert (c.bits, c.bucket, c.norm) == (4, 256, "l2")
    assert not c.capabilities.summable and not c.capabilities.lossy_tolerant
    with pytest.raises(ValueError):
        make_codec("qsgd:bits=1")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("n", [1, 511, 512, 513, 10_000])
def test_bytes_are_exactly_codes_plus_scales(bits: int, n: int) -> None:
    c = QSGDCodec(bits=bits)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    parts = c.encode(x, _state(x))
    assert [p.name for p in parts] == ["codes", "scales"]
    assert all(p.lane_class == RELIABLE for p in parts)
    assert parts[0].nbytes == math.ceil(n * bits / 8) + 1  # the codes, then the byte naming the bucket's dtype
    assert parts[1].nbytes == 4 * math.ceil(n / 512)
    assert wire_bytes(parts) == c.expected_bytes(n) == c.last_stats["bytes"]


def test_eight_bit_ratio_matches_the_paper_setting() -> None:
    x = torch.randn(512 * 1000)
    parts = QSGDCodec().encode(x, _state(x))
    assert wire_bytes(parts) * 8 / x.numel() == pytest.approx(8.0625 + 8 / x.numel())  # + the dtype byte
    assert 4 * x.numel() / wire_bytes(parts) == pytest.approx(3.969, abs=1e-3)


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_round_trip_error_is_at_most_one_level(norm: str) -> None:
    c = QSGDCodec(bits=8, bucket=512, norm=norm)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 3
    y = c.decode(received_from_parts(c.encode(x, _state(x))), _state(x), x)
    assert y.shape == x.shape and y.dtype == x.dtype
    views = [(x[i : i + 512], y[i : i + 512]) for i in range(0, 5000, 512)]
    for xv, yv in views:
        scale = xv.abs().max() if norm == "max" else xv.norm()
        assert float((yv - xv).abs().max()) <= float(scale) / 127 * (1 + 1e-5)
        assert bool((torch.sign(yv) * torch.sign(xv) >= 0).all())  # never flips a sign


def test_unbiased_through_the_codec_across_rounds() -> None:
    """Successive encodes draw fresh randomness (seed, rank, step); their mean converges to x."""
    c = QSGDCodec(bits=2, bucket=64)  # 2 bits: one level per sign, the noisiest setting
    x = torch.randn(256, generator=torch.Generator().manual_seed(2))
    st = _state(x)
    rx = _state(x)
    outs = torch.stack([c.decode(received_from_parts(c.encode(x, st)), rx, x) for _ in range(1500)])
    sd = outs.std(0)
    varying = sd > 0  # the four bucket maxima sit on a level
    assert int((~varying).sum()) == 4
    z = (outs.mean(0) - x)[varying] / (sd[varying] / math.sqrt(outs.shape[0]))
    assert float(z.abs().max()) < 5.0
    assert 0.75 < float((z**2).mean()) < 1.3


def test_ranks_and_steps_draw_independent_randomness() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    a = QSGDCodec(bits=4, rank=0).encode(x, _state(x))[0].data
    b = QSGDCodec(bits=4, rank=1).encode(x, _state(x))[0].data
    st = _state(x)
    c0 = QSGDCodec(bits=4, rank=0)
    first = c0.encode(x, st)[0].data
    second = c0.encode(x, st)[0].data
    assert torch.equal(a, first)  # same (seed, rank, step): same codes
    assert not torch.equal(a, b) and not torch.equal(first, second)


def test_lost_blocks_decode_as_zero() -> None:
    c = QSGDCodec(bits=8)
    x = torch.randn(512 * 40, generator=torch.Generator().manual_seed(4)) + 5.0  # no zeros in x
    parts = c.encode(x, _state(x))
    code_blocks = -(-parts[0].data.numel() // parts[0].block_elems)
    code_mask = torch.ones(code_blocks, dtype=torch.bool)
    code_mask[1] = False  # block of 64*8*16 bytes = 16 buckets = 8192 entries
    scale_mask = torch.ones(1, dtype=torch.bool)
    y = c.decode(received_from_parts(parts, [code_mask, scale_mask]), _state(x), x)
    lost = slice(8192, 16384)
    assert bool((y[lost] == 0).all())
    assert bool((y[:8192] != 0).all()) and bool((y[16384:] != 0).all())


def test_half_precision_input() -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5)).half()
    c = QSGDCodec()
    y = c.decode(received_from_parts(c.encode(x, _state(x))), _state(x), x)
    assert y.dtype == torch.float16
    assert float((y.float() - x.float()).abs().max()) < float(x.float().abs().max()) / 127 + 2e-3


def test_a_message_names_its_buckets_dtype_and_decodes_only_into_it() -> None:
    """The byte after the codes names the bucket's dtype: a rank whose tensor has another dtype refuses the message
    (the collectives report it as the ranks' RankMismatch) instead of decoding it into its own dtype."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        xd = x.to(dtype)
        parts = QSGDCodec().encode(xd, _state(xd))
        assert QSGDCodec().decode(received_from_parts(parts), _state(xd), xd).dtype == dtype
        other = torch.float64 if dtype != torch.float64 else torch.float32
        with pytest.raises(ValueError, match=f"encoded from a {dtype} bucket, this rank decodes into {other}"):
            QSGDCodec().decode(received_from_parts(parts), _state(xd), x.to(other))
    with pytest.raises(ValueError, match="does not hold 2999 entries"):  # a message for another size
        QSGDCodec().decode(received_from_parts(QSGDCodec().encode(x, _state(x))), _state(x[1:]), x[1:])
