"""Slim-DP codec: set sizes and disjointness, core = top-k, uniform explorer, key caching, exact bytes, merge."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.codecs import make_codec
from dgt.codecs.base import DROPPABLE, RELIABLE, BucketState
from dgt.codecs.bucketinfo import received_from_parts, set_segments, wire_bytes
from dgt.codecs.quantize import generator
from dgt.codecs.slimdp import HEADER_BYTES, SlimDPCodec, sample_outside, topk_mask


def _state(n: int) -> BucketState:
    return BucketState(n, torch.float32)


def _explorer_keys(parts) -> torch.Tensor:
    rec = parts[-1].data.view(-1, 8)
    return rec[:, :4].contiguous().view(torch.int32).view(-1).to(torch.int64)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_registry_spec_from_the_issue() -> None:
    c = make_codec("slimdp:alpha=0.3,eps=0.15")
    assert isinstance(c, SlimDPCodec) and (c.alpha, c.eps, c.q, c.mode) == (0.3, 0.15, 20, "push")
    assert c.capabilities.lossy_tolerant and c.capabilities.stateful_server and not c.capabilities.summable
    for bad in ("slimdp:alpha=0", "slimdp:alpha=0.3,eps=0.4", "slimdp:q=0", "slimdp:mode=both"):
        with pytest.raises(ValueError):
            make_codec(bad)


@pytest.mark.parametrize("n", [1000, 4810, 99_991])
def test_set_sizes_disjointness_and_core_is_top_k(n: int) -> None:
    c = SlimDPCodec(alpha=0.3, eps=0.15)
    x = _x(n)
    st = _state(n)
    parts = c.encode(x, st)
    k_core, k_exp = c.set_sizes(n)
    assert k_core == round(0.15 * n) and k_exp == round(0.15 * n)
    core = st.values["tx_core_idx"]
    exp = _explorer_keys(parts)
    assert core.numel() == k_core and exp.numel() == k_exp
    assert exp.unique().numel() == k_exp  # drawn without replacement
    both = torch.cat([core, exp])
    assert both.unique().numel() == k_core + k_exp  # disjoint: |T_C| = alpha N
    outside = torch.ones(n, dtype=torch.bool)
    outside[core] = False
    assert float(x.abs()[core].min()) >= float(x.abs()[outside].max())  # the core is the top (alpha - eps) N
    # the push decodes to T_C(x): x on the communication set, zero elsewhere
    y = c.decode(received_from_parts(parts), _state(n), x)
    expect = torch.zeros(n)
    expect[both] = x[both]
    assert torch.equal(y, expect)


@pytest.mark.parametrize("alpha,eps", [(0.3, 0.15), (0.2, 0.1), (0.3, 0.0), (0.3, 0.3), (0.5, 0.25)])
@pytest.mark.parametrize("n", [777, 10_000])
def test_exact_bytes_steady_and_refresh(alpha: float, eps: float, n: int) -> None:
    c = SlimDPCodec(alpha=alpha, eps=eps, q=3)
    x = _x(n, 1)
    st = _state(n)
    k_core, k_exp = c.set_sizes(n)
    sizes = []
    for _ in range(4):
        parts = c.encode(x, st)
        sizes.append((wire_bytes(parts), [p.name for p in parts]))
    steady = HEADER_BYTES + 4 * k_core + 8 * k_exp  # (alpha + eps) N values' worth + a 24-byte header
    assert steady == c.steady_bytes(n)
    assert abs(steady - HEADER_BYTES - 4 * (alpha + eps) * n) <= 12  # rounding of the two set sizes only
    refresh = steady + math.ceil(n / 8)
    assert [b for b, _ in sizes] == [refresh, steady, steady, refresh]  # q = 3: refresh on encodes 0 and 3
    assert sizes[0][1] == ["header", "core", "core_keys", "explorer"]
    assert sizes[1][1] == ["header", "core", "explorer"]


def test_lanes_and_record_aligned_blocks() -> None:
    c = SlimDPCodec()
    parts = c.encode(_x(5000), _state(5000))
    lanes = {p.name: p.lane_class for p in parts}
    assert lanes == {"header": RELIABLE, "core": RELIABLE, "core_keys": RELIABLE, "explorer": DROPPABLE}
    ex = parts[-1]
    assert ex.block_elems % 8 == 0  # (int32 key, fp32 value) records never straddle a block


def test_key_caching_keeps_the_core_between_refreshes() -> None:
    c = SlimDPCodec(q=5)
    st, rx = _state(3000), _state(3000)
    cores, explorers = [], []
    for t in range(10):
        x = _x(3000, 100 + t)  # a different gradient every round
        parts = c.encode(x, st)
        y = c.decode(received_from_parts(parts), rx, x)
        core = st.values["tx_core_idx"].clone()
        cores.append(core)
        explorers.append(_explorer_keys(parts))
        assert torch.equal(y[core], x[core])  # the receiver's cached keys place the values correctly
    for t in range(1, 10):
        assert torch.equal(cores[t], cores[t - 1]) == (t % 5 != 0)
        assert not torch.equal(explorers[t], explorers[t - 1])  # the explorer is redrawn every round


def test_receiver_detects_a_missed_refresh() -> None:
    c = SlimDPCodec(q=2)
    st = _state(2000)
    x = _x(2000)
    c.encode(x, st)  # refresh message lost
    parts = c.encode(x, st)
    with pytest.raises(ValueError, match="out of sync"):
        c.decode(received_from_parts(parts), _state(2000), x)


def test_explorer_is_uniform_outside_the_core() -> None:
    """Over many rounds with a fixed core every outside position is drawn with probability k_exp / (N - k_core)."""
    n = 400
    c = SlimDPCodec(alpha=0.3, eps=0.15, q=10**9)
    st = _state(n)
    x = _x(n, 7)
    counts = torch.zeros(n)
    rounds = 2000
    for _ in range(rounds):
        counts[_explorer_keys(c.encode(x, st))] += 1
    core = st.values["tx_core_idx"]
    assert float(counts[core].sum()) == 0
    outside = torch.ones(n, dtype=torch.bool)
    outside[core] = False
    p = 60 / 340
    z = (counts[outside] - rounds * p) / math.sqrt(rounds * p * (1 - p))
    assert float(z.abs().max()) < 4.5
    assert 0.8 < float((z**2).mean()) < 1.25


def test_large_bucket_selection_paths_are_exact() -> None:
    """Above 2^20 entries: sample-bracketed top-k and Bernoulli-then-trim explorer; both must stay exact."""
    n = (1 << 20) + 4321
    a = torch.randn(n, generator=torch.Generator().manual_seed(9)).abs()
    g = generator("cpu", 1)
    k = int(0.15 * n)
    m = topk_mask(a, k, g)
    assert int(m.sum()) == k
    assert float(a[m].min()) >= float(a[~m].max())
    e = sample_outside(m, k, g)
    assert e.numel() == k and e.unique().numel() == k and not bool(m[e].any())
    # heavy ties (most entries exactly zero) force the fallback path
    z = torch.zeros(n)
    z[:1000] = torch.arange(1, 1001, dtype=torch.float32)
    mz = topk_mask(z, 5000, g)
    assert int(mz.sum()) == 5000 and bool(mz[:1000].all())


def test_pull_merges_and_lost_explorer_blocks_keep_local_values() -> None:
    n = 20_000
    server = SlimDPCodec(mode="pull", alpha=0.3, eps=0.15)
    w = _x(n, 11)
    local = _x(n, 12)
    parts = server.encode(w, _state(n))
    ex_blocks = -(-parts[-1].data.numel() // parts[-1].block_elems)
    mask = torch.ones(ex_blocks, dtype=torch.bool)
    mask[::2] = False  # lose every other explorer block
    masks = [None] * (len(parts) - 1) + [mask]
    merged = server.decode(received_from_parts(parts, masks), _state(n), local)
    core = torch.zeros(n, dtype=torch.bool)
    core[topk_mask(w.abs(), server.set_sizes(n)[0], generator("cpu", 0))] = True
    assert torch.equal(merged[core], w[core])  # pulled core overwrites
    keys = _explorer_keys(parts)
    per_block = parts[-1].block_elems // 8
    arrived = mask.repeat_interleave(per_block)[: keys.numel()]
    assert torch.equal(merged[keys[arrived]], w[keys[arrived]])  # explorer records that arrived overwrite
    assert torch.equal(merged[keys[~arrived]], local[keys[~arrived]])  # lost ones keep the local value
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[core] = False
    untouched[keys] = False
    assert torch.equal(merged[untouched], local[untouched])
    # the same loss on a push: lost explorer records count as zero
    push = SlimDPCodec()
    pp = push.encode(w, _state(n))
    y = push.decode(received_from_parts(pp, [None] * (len(pp) - 1) + [mask]), _state(n), w)
    pk = _explorer_keys(pp)
    assert bool((y[pk[~arrived]] == 0).all()) and torch.equal(y[pk[arrived]], w[pk[arrived]])


def test_shared_seed_sends_no_explorer_keys_and_decodes_the_same() -> None:
    n = 5000
    x = _x(n, 13)
    keyed, seeded = SlimDPCodec(), SlimDPCodec(shared_seed=True)
    pk = keyed.encode(x, _state(n))
    ps = seeded.encode(x, _state(n))
    k_core, k_exp = keyed.set_sizes(n)
    assert wire_bytes(pk) - wire_bytes(ps) == 4 * k_exp  # the keys are the only difference
    yk = keyed.decode(received_from_parts(pk), _state(n), x)
    ys = seeded.decode(received_from_parts(ps), _state(n), x)
    assert torch.equal(yk, ys)  # same draw seed: same explorer, regenerated at the receiver


def test_per_tensor_scope_is_a_quota_per_tensor() -> None:
    sizes = [3000, 100, 1900]
    n = sum(sizes)
    x = torch.cat([_x(3000, 1) * 10, _x(100, 2) * 0.01, _x(1900, 3)])
    st = _state(n)
    set_segments(st, sizes)
    c = SlimDPCodec(scope="tensor", alpha=0.3, eps=0.15)
    c.encode(x, st)
    core = st.values["tx_core_idx"]
    per = [int(((core >= a) & (core < a + s)).sum()) for a, s in zip([0, 3000, 3100], sizes)]
    assert per == [450, 15, 285]  # 15% of each tensor, even the one with tiny values
    glob = SlimDPCodec(alpha=0.3, eps=0.15)
    st2 = _state(n)
    glob.encode(x, st2)
    c2 = st2.values["tx_core_idx"]
    assert int(((c2 >= 3000) & (c2 < 3100)).sum()) == 0  # the global top-k (the paper's) starves it


def test_half_precision_values() -> None:
    n = 3000
    x = _x(n, 4).half()
    c = SlimDPCodec()
    parts = c.encode(x, BucketState(n, torch.float16))
    k_core, k_exp = c.set_sizes(n)
    assert wire_bytes(parts) == HEADER_BYTES + 2 * k_core + 6 * k_exp + math.ceil(n / 8)
    y = c.decode(received_from_parts(parts), BucketState(n, torch.float16), x)
    assert y.dtype == torch.float16 and int((y != 0).sum()) == k_core + k_exp
