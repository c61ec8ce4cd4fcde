"""DCD / ECD / naive gossip codecs and node state: bytes, unbiasedness, bit-identical replicas, exact D-PSGD."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs import make_codec
from dgt.codecs.base import BucketState
from dgt.codecs.bucketinfo import received_from_parts, wire_bytes
from dgt.codecs.decentralized import DCDNode, ECDNode, GossipQuantCodec, NaiveNode, mixing_row, ring_matrix


def _state(n: int) -> BucketState:
    return BucketState(n, torch.float32)


def test_registry_names_and_options() -> None:
    for name, algo in (("dcd", "dcd"), ("ecd", "ecd"), ("naive-gossip", "naive")):
        c = make_codec(name)
        assert isinstance(c, GossipQuantCodec) and c.algorithm == algo
        assert (c.bits, c.bucket, c.quantizer) == (8, 0, "affine")
    c = make_codec("ecd:quantizer=fixed,step=0.001,max_bits=12")
    assert (c.quantizer, c.step, c.max_bits) == ("fixed", 0.001, 12)
    with pytest.raises(ValueError):
        make_codec("dcd:bits=20")


def test_ring_mixing_matrix() -> None:
    w = ring_matrix(5)
    assert torch.allclose(w, w.T) and torch.allclose(w.sum(0), torch.ones(5, dtype=torch.float64))
    assert mixing_row(w, 0) == pytest.approx({0: 1 / 3, 1: 1 / 3, 4: 1 / 3})
    assert torch.equal(ring_matrix(2), torch.full((2, 2), 0.5, dtype=torch.float64))
    bad = torch.tensor([[0.5, 0.5], [0.2, 0.8]], dtype=torch.float64)
    with pytest.raises(ValueError):
        mixing_row(bad, 0)


@pytest.mark.parametrize("bits,bucket", [(8, 0), (4, 0), (8, 512), (3, 100)])
def test_affine_bytes_and_error(bits: int, bucket: int) -> None:
    n = 10_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    c = GossipQuantCodec(bits=bits, bucket=bucket)
    parts = c.encode(x, _state(n))
    nb = 1 if bucket == 0 else math.ceil(n / bucket)
    assert wire_bytes(parts) == math.ceil(n * bits / 8) + 8 * nb == c.expected_bytes(n)
    y = c.decode(received_from_parts(parts), _state(n), x)
    span = float(x.max() - x.min()) if bucket == 0 else max(float(v.max() - v.min()) for v in x.split(bucket))
    assert float((y - x).abs().max()) <= span / (2**bits - 1) * (1 + 1e-5)


def test_full_precision_mode_is_exact() -> None:
    x = torch.randn(1000)
    c = GossipQuantCodec(bits=32)
    parts = c.encode(x, _state(1000))
    assert wire_bytes(parts) == 4000
    assert torch.equal(c.decode(received_from_parts(parts), _state(1000), x), x)


def test_fixed_step_codec_bytes_match_its_header() -> None:
    n = 4096
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    c = GossipQuantCodec(quantizer="fixed", step=1e-3, bucket=512, max_bits=16)
    parts = c.encode(x, _state(n))
    width, shift = (int(v) for v in parts[0].data[:2])
    assert shift == 0 and 10 <= width <= 16
    assert wire_bytes(parts) == 4 * (2 + n // 512) + math.ceil(n * width / 8)
    y = c.decode(received_from_parts(parts), _state(n), x)
    assert float((y - x).abs().max()) < 1e-3


def test_codec_is_unbiased_across_iterations() -> None:
    c = GossipQuantCodec(bits=2, bucket=0)
    x = torch.randn(300, generator=torch.Generator().manual_seed(6))
    st = _state(300)
    outs = torch.stack([c.decode(received_from_parts(c.encode(x, st)), _state(300), x) for _ in range(1500)])
    sd = outs.std(0)
    ok = sd > 0
    z = (outs.mean(0) - x)[ok] / (sd[ok] / math.sqrt(1500))
    assert int((~ok).sum()) <= 2  # only the min and the max sit on a grid point
    assert float(z.abs().max()) < 5.0 and 0.75 < float((z**2).mean()) < 1.3


def _run_nodes(spec: str, steps: int = 30, n: int = 5, dim: int = 257):
    """Nodes on a ring fed random 'gradients'; returns the nodes after ``steps`` synchronous iterations."""
    w = ring_matrix(n)
    proto = make_codec(spec)
    x0 = torch.randn(dim, generator=torch.Generator().manual_seed(0))
    nodes = [proto.make_node(r, x0, mixing_row(w, r), 0.1) for r in range(n)]
    g = torch.Generator().manual_seed(1)
    grads_log = []
    for _ in range(steps):
        grads = [torch.randn(dim, generator=g) for _ in range(n)]
        grads_log.append(grads)
        payloads = [nd.step(gr) for nd, gr in zip(nodes, grads)]
        for nd in nodes:
            for j in nd.neighbours:
                nd.receive(j, received_from_parts(payloads[j]))
    return nodes, x0, grads_log, w


def test_dcd_replicas_are_bit_identical_to_the_senders_model() -> None:
    nodes, *_ = _run_nodes("dcd:bits=4")
    assert all(isinstance(nd, DCDNode) for nd in nodes)
    for nd in nodes:
        for j in nd.neighbours:
            assert torch.equal(nd.replicas[j], nodes[j].x)


def test_ecd_estimates_agree_bit_for_bit() -> None:
    nodes, *_ = _run_nodes("ecd:bits=8")
    assert all(isinstance(nd, ECDNode) for nd in nodes)
    for nd in nodes:
        for j in nd.neighbours:
            assert torch.equal(nd.estimates[j], nodes[j].estimates[j])  # what i holds of j == j's own estimate


def test_ecd_estimate_is_exact_without_quantization() -> None:
    """ECD's extrapolation recovers x_{t+1} exactly when C is the identity."""
    nodes, *_ = _run_nodes("ecd:bits=32", steps=12)
    for nd in nodes:
        assert torch.allclose(nd.estimates[nd.rank], nd.x, atol=1e-5)


def test_full_precision_dcd_is_d_psgd() -> None:
    nodes, x0, grads_log, w = _run_nodes("dcd:bits=32", steps=10)
    xs = torch.stack([x0.clone() for _ in range(len(nodes))])  # D-PSGD: X_{t+1} = W X_t - gamma G_t
    wf = w.to(torch.float32)
    for grads in grads_log:
        xs = wf @ xs - 0.1 * torch.stack(grads)
    for r, nd in enumerate(nodes):
        assert torch.allclose(nd.x, xs[r], atol=1e-5)


def test_naive_control_adds_uncorrected_noise() -> None:
    nodes, x0, grads_log, w = _run_nodes("naive-gossip:bits=4", steps=10)
    assert all(isinstance(nd, NaiveNode) for nd in nodes)
    xs = torch.stack([x0.clone() for _ in range(len(nodes))])
    for grads in grads_log:
        xs = w.to(torch.float32) @ xs - 0.1 * torch.stack(grads)
    dcd, *_ = _run_nodes("dcd:bits=4", steps=10)
    naive_err = sum(float((nd.x - xs[r]).norm()) for r, nd in enumerate(nodes))
    dcd_err = sum(float((nd.x - xs[r]).norm()) for r, nd in enumerate(dcd))
    assert naive_err > 2 * dcd_err > 0
