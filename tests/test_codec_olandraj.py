"""Oland-Raj codec: bit width from the entropy estimate, bin-centre round trips, self-describing messages, bytes."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs import make_codec
from dgt.codecs.base import RELIABLE, BucketState
from dgt.codecs.bucketinfo import received_from_parts, set_segments, wire_bytes
from dgt.codecs.huffman import auto_chunk, codebook_nbytes
from dgt.codecs.olandraj import HEADER_BYTES, OlandRajCodec, bin_centres, quantize_indices


def _state(n: int, sizes: list[int] | None = None) -> BucketState:
    st = BucketState(n, torch.float32)
    if sizes:
        set_segments(st, sizes)
    return st


def _round_trip(codec: OlandRajCodec, x: torch.Tensor, sizes: list[int] | None = None):
    parts = codec.encode(x, _state(x.numel(), sizes))
    y = OlandRajCodec().decode(received_from_parts(parts), _state(x.numel()), x)  # defaults: self-describing
    return parts, y


def test_registry_and_defaults() -> None:
    c = make_codec("olandraj")
    assert isinstance(c, OlandRajCodec)
    assert (c.c, c.M, c.F, c.ceiling, c.huffman) == (6, 4, 0.03, 10, True)
    c5 = make_codec("olandraj:c=5,M=4,huffman=false")
    assert c5.c == 5 and not c5.huffman
    assert not c.capabilities.summable and not c.capabilities.lossy_tolerant


def test_bit_width_follows_the_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    uniform = torch.rand(100_000, generator=g)  # H(M=4) = 4 bits -> 4 + 6 = 10 (the ceiling)
    peaked = torch.cat([torch.randn(99_000, generator=g) * 1e-3, torch.tensor([-1.0, 1.0]).repeat(500)])
    c = OlandRajCodec()
    c.encode(uniform, _state(uniform.numel()))
    lay = c.last_stats["layers"][0]
    assert lay["H"] == pytest.approx(4.0, abs=0.05) and lay["N"] == 10
    c.encode(peaked, _state(peaked.numel()))
    lay = c.last_stats["layers"][0]
    # the bulk straddles the two middle bins of 16: H ~ 1 bit -> N = ceil(H + 6) = 8
    assert lay["H"] < 1.2 and lay["N"] == math.ceil(lay["H"] + 6) == 8
    capped = OlandRajCodec(c=9)
    capped.encode(uniform, _state(uniform.numel()))
    assert capped.last_stats["layers"][0]["N"] == 10  # ceil(4 + 9) capped at 10


@pytest.mark.parametrize("huff", [True, False])
def test_round_trip_is_bin_centres_per_layer(huff: bool) -> None:
    g = torch.Generator().manual_seed(1)
    sizes = [5000, 64, 640, 10]
    x = torch.cat([torch.randn(s, generator=g) * scale for s, scale in zip(sizes, [0.1, 0.01, 1.0, 3.0])])
    c = OlandRajCodec(huffman=huff)
    parts, y = _round_trip(c, x, sizes)
    assert len(parts) == 4 and all(p.lane_class == RELIABLE for p in parts)
    off = 0
    for s, lay in zip(sizes, c.last_stats["layers"]):
        w, v = x[off : off + s], y[off : off + s]
        lo, hi = float(w.min()), float(w.max())
        nbits = lay["N"]
        assert torch.allclose(v, bin_centres(quantize_indices(w, lo, hi, nbits), lo, hi, nbits))
        assert float((v - w).abs().max()) <= (hi - lo) / 2 ** (nbits + 1) * (1 + 1e-3) + 1e-7  # half a bin
        off += s


def test_quantizer_index_formula_and_edges() -> None:
    w = torch.tensor([0.0, 0.25, 0.5, 0.999, 1.0])
    assert quantize_indices(w, 0.0, 1.0, 2).tolist() == [0, 1, 2, 3, 3]  # w_max lands in the last bin
    parts, y = _round_trip(OlandRajCodec(), torch.full((300,), 0.75))  # constant layer: no indices at all
    assert wire_bytes(parts) == HEADER_BYTES and torch.equal(y, torch.full((300,), 0.75))
    parts, y = _round_trip(OlandRajCodec(), torch.zeros(0))
    assert y.numel() == 0


def test_bytes_are_header_codebook_sync_and_stream() -> None:
    n = 20_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    c = OlandRajCodec()
    parts = c.encode(x, _state(n))
    lay = c.last_stats["layers"][0]
    nbits = lay["N"]
    body = parts[0].data[HEADER_BYTES:]
    present = int(torch.bincount(quantize_indices(x, float(x.min()), float(x.max()), nbits)).gt(0).sum())
    sync = 2 * (math.ceil(n / auto_chunk(n)) - 1)
    assert body.numel() == codebook_nbytes(2**nbits, present) + sync + lay["payload_bits"] // 8
    assert wire_bytes(parts) == c.last_stats["bytes"] == HEADER_BYTES + body.numel()
    assert c.last_stats["bits_per_param"] == pytest.approx(8 * wire_bytes(parts) / n)
    raw = OlandRajCodec(huffman=False)
    parts = raw.encode(x, _state(n))
    n_raw = raw.last_stats["layers"][0]["N"]
    assert wire_bytes(parts) == HEADER_BYTES + math.ceil(n * n_raw / 8)


def test_huffman_beats_raw_bits_on_bell_shaped_weights() -> None:
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 0.05
    c = OlandRajCodec()
    c.encode(x, _state(x.numel()))
    st = c.last_stats
    # N = 10 raw; a Gaussian at bins of 8.6 sd / 1024 has entropy ~8.95 bits
    assert st["payload_bits_per_param"] < st["raw_bits_per_param"] - 0.8
    assert st["bits_per_param"] < st["raw_bits_per_param"]


def test_fixed_bits_option_and_sampled_entropy_reproducible() -> None:
    x = torch.randn(4000, generator=torch.Generator().manual_seed(4))
    c = OlandRajCodec(bits=8)
    parts, y = _round_trip(c, x)
    assert c.last_stats["layers"][0]["N"] == 8
    a, b = OlandRajCodec(seed=1), OlandRajCodec(seed=1)
    a.encode(x, _state(4000))
    b.encode(x, _state(4000))
    assert a.last_stats["layers"][0]["H"] == b.last_stats["layers"][0]["H"]


def test_decoder_rejects_foreign_or_mismatched_messages() -> None:
    x = torch.randn(100)
    parts = OlandRajCodec().encode(x, _state(100))
    with pytest.raises(ValueError):
        OlandRajCodec().decode(received_from_parts(parts), _state(50), torch.zeros(50))
    bad = parts[0].data.clone()
    bad[0] = 0
    parts[0].data = bad
    with pytest.raises(ValueError):
        OlandRajCodec().decode(received_from_parts(parts), _state(100), x)


def test_a_message_names_its_buckets_dtype_and_decodes_only_into_it() -> None:
    """The header's dtype field names the bucket's dtype: a rank whose tensor has another dtype refuses the message
    (the collectives report it as the ranks' RankMismatch) instead of decoding it into its own dtype; a message that
    names none (0, as older senders wrote the field) is decoded as before."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        parts = OlandRajCodec().encode(x.to(dtype), _state(x.numel()))
        y = OlandRajCodec().decode(received_from_parts(parts), _state(x.numel()), x.to(dtype))
        assert y.dtype == dtype
        other = torch.float64 if dtype != torch.float64 else torch.float32
        with pytest.raises(ValueError, match=f"encoded from a {dtype} bucket, this rank decodes into {other}"):
            OlandRajCodec().decode(received_from_parts(parts), _state(x.numel()), x.to(other))
    parts = OlandRajCodec().encode(x, _state(x.numel()))
    parts[0].data[6:8] = 0  # the dtype field (little-endian u16 at byte 6): unnamed
    y = OlandRajCodec().decode(received_from_parts(parts), _state(x.numel()), x.double())
    assert y.dtype == torch.float64
