"""Canonical Huffman coding: optimal lengths, length limit, round trips (skewed / uniform / degenerate) on every
decode path, size close to the entropy, and a decoder that needs nothing but the message."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgt.codecs import huffman
from dgt.codecs.huffman import (
    MAX_LEN,
    canonical_codes,
    code_lengths,
    decode_message,
    encode_message,
    kraft_ok,
)


def _heap_cost(counts: np.ndarray) -> int:
    """Total coded bits of a textbook (unlimited) Huffman code, as a reference."""
    h = [int(c) for c in counts if c > 0]
    if len(h) == 1:
        return h[0]
    heapq.heapify(h)
    cost = 0
    while len(h) > 1:
        a, b = heapq.heappop(h), heapq.heappop(h)
        cost += a + b
        heapq.heappush(h, a + b)
    return cost


def test_code_lengths_are_optimal_and_prefix_free() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = int(rng.integers(1, 400))
        counts = rng.integers(0, 1000, a) * (rng.random(a) < 0.6)
        if rng.random() < 0.3:
            counts = (rng.pareto(1.2, a) * 50).astype(np.int64)
        if counts.sum() == 0:
            continue
        unlimited = huffman._huffman_lengths(counts)
        assert int((unlimited * counts).sum()) == _heap_cost(counts)  # optimal
        lengths = code_lengths(counts)
        assert np.array_equal(lengths > 0, counts > 0)
        assert kraft_ok(lengths) and lengths.max() <= MAX_LEN
        if unlimited.max() <= MAX_LEN:
            assert np.array_equal(lengths, unlimited)
    codes = canonical_codes(np.array([2, 1, 3, 3, 0]))
    assert codes.tolist() == [0b10, 0b0, 0b110, 0b111, 0]


def test_length_limit_on_a_fibonacci_histogram() -> None:
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    counts = np.array(fib, dtype=np.int64)  # unlimited Huffman would need 29-bit codes
    lengths = code_lengths(counts)
    assert lengths.max() <= MAX_LEN and kraft_ok(lengths)
    sym = torch.from_numpy(np.repeat(np.arange(30), counts // 1000 + 1))
    assert torch.equal(decode_message(encode_message(sym, 30), 30, sym.numel()), sym)


def _data(kind: str, n: int, alphabet: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "skewed":
        u = torch.rand(n, generator=g).clamp_min(1e-12)
        return (torch.log(u) / math.log(0.7)).floor().to(torch.int64).clamp_(max=alphabet - 1)  # geometric
    if kind == "uniform":
        return torch.randint(0, alphabet, (n,), generator=g)
    if kind == "single":
        return torch.full((n,), alphabet // 3, dtype=torch.int64)
    if kind == "two":
        return (torch.rand(n, generator=g) < 0.01).to(torch.int64) * (alphabet - 1)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["skewed", "uniform", "single", "two"])
@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 5000])
@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_round_trip(kind: str, n: int, chunk: int) -> None:
    sym = _data(kind, n, 1024, n + chunk)
    msg = encode_message(sym, 1024, chunk)
    assert msg.dtype == torch.uint8
    assert torch.equal(decode_message(msg, 1024, n, chunk), sym)


@pytest.mark.parametrize("path", ["jump", "table", "window"])
@pytest.mark.parametrize("kind", ["skewed", "uniform"])
def test_every_decode_path(monkeypatch: pytest.MonkeyPatch, path: str, kind: str) -> None:
    """Pointer jumping (small streams), per-bit table loop (medium), byte-window loop (large): same symbols."""
    if path == "table":
        monkeypatch.setattr(huffman, "_JUMP_BITS", 0)
    elif path == "window":
        monkeypatch.setattr(huffman, "_JUMP_BITS", 0)
        monkeypatch.setattr(huffman, "_PRECOMPUTE_BITS", 0)
    sym = _data(kind, 60_000, 512, 3)
    for chunk in (64, 1000):
        assert torch.equal(decode_message(encode_message(sym, 512, chunk), 512, sym.numel(), chunk), sym)


@pytest.mark.parametrize("group_bits,chunk", [
    pytest.param(g, c, marks=pytest.mark.slow if (g, c) == (1, 1) else ())  # (1, 1): 9.6 s of a loaded default run
    for c in (1, 64, 1000) for g in (1 << 30, 50_000, 1)])
def test_pointer_jumping_in_lane_groups(monkeypatch: pytest.MonkeyPatch, group_bits: int, chunk: int) -> None:
    """The CUDA decode path, forced on CPU: one group, several groups, and a group per lane give the same symbols."""
    monkeypatch.setattr(huffman, "_JUMP_GROUP_BITS", group_bits)
    sym = _data("skewed", 60_000, 512, 4)
    msg = encode_message(sym, 512, chunk)
    lengths, used = huffman.unpack_lengths(msg.numpy(), 512)
    lanes = -(-sym.numel() // chunk)
    sb = msg[used : used + 2 * (lanes - 1)].to(torch.int64).view(-1, 2)
    stream = msg[used + 2 * (lanes - 1) :]
    codes = huffman.canonical_codes(lengths)
    got = huffman.decode_symbols(stream, lengths, codes, sym.numel(), sb[:, 0] | (sb[:, 1] << 8), chunk, jump=True)
    assert torch.equal(got, sym)
    assert 8 * stream.numel() > 50_000  # so that 50_000 splits the lanes into groups


def test_size_is_close_to_the_entropy() -> None:
    n, alphabet = 200_000, 1024
    for kind in ("skewed", "uniform"):
        sym = _data(kind, n, alphabet, 5)
        stats: dict = {}
        msg = encode_message(sym, alphabet, 256, stats)
        p = torch.bincount(sym, minlength=alphabet).double() / n
        p = p[p > 0]
        entropy = float(-(p * torch.log2(p)).sum())
        stream_bits = 8 * stats["stream"] / n
        slack = 0.1 if kind == "uniform" else 0.2  # Huffman is within 1 bit of H; here much closer
        assert entropy <= stream_bits < entropy + slack
        assert stats["codebook"] + stats["sync"] + stats["stream"] == msg.numel()
        assert stats["sync"] == 2 * (math.ceil(n / 256) - 1)
    assert stream_bits == pytest.approx(10.0, abs=0.02)  # uniform over 1024 symbols: 10 bits each


def test_skewed_data_compresses_well_below_fixed_width() -> None:
    sym = _data("skewed", 100_000, 1024, 6)  # geometric(0.3): entropy ~2.9 bits
    msg = encode_message(sym, 1024)
    assert 8 * msg.numel() / sym.numel() < 3.2  # versus 10 bits fixed


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        encode_message(torch.tensor([0, 5]), 4)  # symbol outside the alphabet
    with pytest.raises(ValueError):
        encode_message(torch.tensor([0, 1]), 4, chunk=5000)


@settings(max_examples=60, deadline=None)
@given(
    symbols=st.lists(st.integers(0, 40), min_size=0, max_size=600),
    chunk=st.integers(1, 300),
    extra=st.integers(0, 20),
)
def test_round_trip_property(symbols: list[int], chunk: int, extra: int) -> None:
    alphabet = 41 + extra
    sym = torch.tensor(symbols, dtype=torch.int64)
    msg = encode_message(sym, alphabet, chunk)
    assert torch.equal(decode_message(msg, alphabet, len(symbols), chunk), sym)
