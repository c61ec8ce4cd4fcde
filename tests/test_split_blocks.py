"""The sending end of a lossy ring hop in one pass (dgt.protocol.block_ops.split_blocks): the C pass, its torch twin
(``native=False``) and a naive per-block reference written here must agree bit for bit on the packed important
blocks, the residual out and the SENT blocks of the round's copy, for every residual mode (none, given, in place),
for multi-tensor layouts whose block starts differ modulo the block and end in partial blocks, and must refuse bad
input with a ValueError before writing anything."""

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgt.layout import BucketLayout
from dgt.protocol import block_ops
from dgt.protocol.block_ops import IMPORTANT, KEPT, NATIVE, SENT, packed_offsets, split_blocks, split_blocks_torch

NO_C = pytest.mark.skipif(not NATIVE, reason="the optional C extension dgt.protocol._blockops is not built")

LAYOUTS = [
    ([3000, 1024, 7, 5000, 1500], 1024),  # starts at residues 0, 952, 952, 959, 311 (mod 1024); partial tails
    ([4096], 1024),  # one tensor, every block full
    ([2500], 1024),  # one tensor, a partial tail
    ([300] * 12 + [0, 5], 256),  # many tensors, an empty one, a 5-element one
    ([1, 1023, 1025, 2047], 1024),  # starts at 0, 1, 0 (1024), 1 (2049): two residues; tails of 1 and 1023 elements
    ([1000, 2048], 1024),  # the full blocks in one residue class (1000), a short block before them
]


def test_the_blockops_extension_is_built_where_a_compiler_is():
    """An install on a machine with a C compiler must not silently fall back to the torch passes (every C test here and
    tests/test_pass_threads.py would be skipped): the extension imports and has every entry point dgt calls."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the torch passes are the expected ones")
    assert NATIVE and block_ops._blockops is not None, "dgt.protocol._blockops was not built (setup.py, optional=True)"
    missing = [f for f in ("split", "combine", "abs_sums") if not hasattr(block_ops._blockops, f)]
    assert not missing, f"dgt.protocol._blockops lacks {missing}: a stale build"


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


def _reference(x, res_in, layout, kind, packed_at, n_packed):
    """Block by block in numpy, as the docstring states it: y = x (+ res_in), then by kind."""
    xs = x.numpy()
    y = xs.copy() if res_in is None else xs + res_in.numpy()
    packed = {}
    res_out = np.zeros(layout.numel, np.float32)
    sent = {}
    for b in range(layout.nblocks):
        a, k = int(layout.block_start[b]), int(layout.block_len[b])
        if kind[b] == IMPORTANT:
            packed[int(packed_at[b])] = y[a : a + k].copy()
        elif kind[b] == KEPT:
            res_out[a : a + k] = y[a : a + k]
        else:
            sent[b] = y[a : a + k].copy()
    return packed, res_out, sent


def _inputs(sizes, block, seed, shares=(0.3, 0.3, 0.4), special=True):
    layout = BucketLayout(sizes, block)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.numel, generator=g) * 100
    if special and layout.numel >= 6:
        x[:6] = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0, 1e-45, -3.4e38])  # copied as they are
    kind = rng.choice([IMPORTANT, KEPT, SENT], size=layout.nblocks, p=list(shares)).astype(np.uint8)
    return layout, x, kind, g


def _run(native, x, res_in, layout, kind, packed_at, n_packed, alias, with_res_out, fill=7.0):
    """One call on fresh buffers pre-filled with ``fill`` (stale values every written element must replace)."""
    packed = torch.full((n_packed,), fill)
    data = torch.full((layout.numel,), fill)
    r_in = None if res_in is None else res_in.clone()
    if alias:
        res_out = r_in
    else:
        res_out = torch.full((layout.numel,), fill) if with_res_out else None
    split_blocks(x, r_in, packed, res_out, data, layout, kind, packed_at, native=native)
    return packed, res_out, data


def _check_against_reference(out, ref, layout, kind, packed_at):
    packed, res_out, data = out
    want_packed, want_res, want_sent = ref
    for p, v in want_packed.items():
        assert np.array_equal(_bits(packed[p : p + len(v)]), v.view(np.int32)), f"packed at {p}"
    if res_out is not None:
        assert np.array_equal(_bits(res_out), want_res.view(np.int32))
    for b, v in want_sent.items():
        a = int(layout.block_start[b])
        assert np.array_equal(_bits(data[a : a + len(v)]), v.view(np.int32)), f"sent block {b}"


@pytest.mark.parametrize("sizes,block", LAYOUTS)
@pytest.mark.parametrize("res_mode", ["none", "given", "alias"])
@pytest.mark.parametrize("seed", range(3))
def test_c_twin_and_reference_agree_bit_for_bit(sizes, block, res_mode, seed):
    layout, x, kind, g = _inputs(sizes, block, seed)
    res_in = None if res_mode == "none" else torch.randn(layout.numel, generator=g)
    imp = kind == IMPORTANT
    packed_at = packed_offsets(layout, imp)
    n_packed = int(layout.block_len.numpy()[imp].sum())
    ref = _reference(x, res_in, layout, kind, packed_at, n_packed)
    outs = []
    for native in ([True, False] if NATIVE else [False]):
        out = _run(native, x, res_in, layout, kind, packed_at, n_packed, res_mode == "alias", True)
        _check_against_reference(out, ref, layout, kind, packed_at)
        outs.append(out)
    if len(outs) == 2:  # the twins agree on everything they wrote, from the same stale buffers
        for c, t in zip(outs[0], outs[1]):
            assert np.array_equal(_bits(c), _bits(t))
    packed = outs[0][0]
    assert packed.numel() == n_packed  # packed_offsets tiles the packed message exactly
    if n_packed:
        assert not bool((packed == 7.0).any())  # every element of it was written


@pytest.mark.parametrize("sizes,block", LAYOUTS)
def test_packed_order_is_the_pack_blocks_order(sizes, block):
    """With packed_offsets, the packed message is what packed_blocks.pack_blocks makes of y (the receiver unpacks it
    with unpack_blocks)."""
    from dgt.protocol.packed_blocks import pack_blocks

    layout, x, kind, g = _inputs(sizes, block, 11, shares=(0.5, 0.2, 0.3))
    res_in = torch.randn(layout.numel, generator=g)
    imp = kind == IMPORTANT
    n = int(layout.block_len.numpy()[imp].sum())
    want = pack_blocks(x + res_in, layout, imp, torch.empty(n))
    for native in ([True, False] if NATIVE else [False]):
        packed, _, _ = _run(native, x, res_in, layout, kind, packed_offsets(layout, imp), n, False, True)
        assert np.array_equal(_bits(packed), _bits(want))


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6), block=st.sampled_from([4, 256, 1024]),
       seed=st.integers(0, 2**16))
def test_packed_offsets_place_each_block_where_pack_blocks_puts_it(sizes, block, seed):
    """Every layout shape (one residue class or several, short blocks anywhere): block b of the mask lies at
    ``packed_offsets[b]`` of pack_blocks' message, the others are -1."""
    from dgt.protocol.packed_blocks import pack_blocks

    layout = BucketLayout.of(sizes, block)
    rng = np.random.default_rng(seed)
    mask = rng.random(layout.nblocks) < 0.5
    x = torch.arange(layout.numel, dtype=torch.float32)
    n = int(layout.block_len.numpy()[mask].sum())
    packed = pack_blocks(x, layout, mask, torch.empty(n)).numpy()
    at = packed_offsets(layout, mask)
    assert np.array_equal(at < 0, ~mask)
    starts, lens = layout.block_start.numpy(), layout.block_len.numpy()
    for b in np.flatnonzero(mask):
        assert np.array_equal(packed[at[b] : at[b] + lens[b]], x.numpy()[starts[b] : starts[b] + lens[b]]), b


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("res_mode", ["none", "given"])
def test_no_res_out_when_no_block_is_kept(native, res_mode):
    if native and not NATIVE:
        pytest.skip("the optional C extension dgt.protocol._blockops is not built")
    layout, x, kind, g = _inputs([3000, 1024, 7, 5000], 1024, 5, shares=(0.4, 0.0, 0.6))
    assert not (kind == KEPT).any() and (kind == IMPORTANT).any() and (kind == SENT).any()
    res_in = None if res_mode == "none" else torch.randn(layout.numel, generator=g)
    imp = kind == IMPORTANT
    packed_at = packed_offsets(layout, imp)
    n = int(layout.block_len.numpy()[imp].sum())
    keep = None if res_in is None else res_in.clone()
    out = _run(native, x, res_in, layout, kind, packed_at, n, False, False)
    assert out[1] is None
    _check_against_reference(out, _reference(x, res_in, layout, kind, packed_at, n), layout, kind, packed_at)
    if keep is not None:  # res_in is only read
        split_blocks(x, res_in, torch.empty(n), None, torch.empty(layout.numel), layout, kind, packed_at, native=native)
        assert torch.equal(res_in, keep)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("only", [IMPORTANT, KEPT, SENT])
def test_one_kind_for_every_block(native, only):
    """All important (the whole bucket packed), all kept (res_out = y), all sent (data = y); res_out in place."""
    if native and not NATIVE:
        pytest.skip("the optional C extension dgt.protocol._blockops is not built")
    layout = BucketLayout([3000, 1024, 7, 5000], 1024)
    g = torch.Generator().manual_seed(only)
    x, res = torch.randn(layout.numel, generator=g), torch.randn(layout.numel, generator=g)
    y = x + res
    kind = np.full(layout.nblocks, only, np.uint8)
    imp = kind == IMPORTANT
    packed, data = torch.full((layout.numel,), 7.0), torch.full((layout.numel,), 7.0)
    split_blocks(x, res, packed, res, data, layout, kind, packed_offsets(layout, imp), native=native)
    zero = torch.zeros(layout.numel)
    assert torch.equal(res, y if only == KEPT else zero)
    assert torch.equal(data, y if only == SENT else torch.full((layout.numel,), 7.0))
    if only == IMPORTANT:
        from dgt.protocol.packed_blocks import unpack_blocks

        back = torch.zeros(layout.numel)
        unpack_blocks(back, packed, layout, imp)
        assert torch.equal(back, y)


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_packed_positions_with_gaps(seed):
    """split writes each important block wherever packed_at says (not only packed_offsets' order); the gaps are left
    alone. C and twin and reference agree."""
    layout, x, kind, g = _inputs([3000, 1024, 7, 5000, 1500], 1024, seed, shares=(0.6, 0.1, 0.3))
    lens = layout.block_len.numpy()
    imp = np.flatnonzero(kind == IMPORTANT)
    rng = np.random.default_rng(seed)
    order = rng.permutation(imp)
    gaps = rng.integers(0, 50, len(order))
    ends = np.cumsum(lens[order] + gaps)
    packed_at = np.full(layout.nblocks, -1, np.int64)
    packed_at[order] = ends - lens[order]
    n = int(ends[-1]) + 3 if len(ends) else 3
    res_in = torch.randn(layout.numel, generator=g)
    ref = _reference(x, res_in, layout, kind, packed_at, n)
    outs = []
    for native in ([True, False] if NATIVE else [False]):
        out = _run(native, x, res_in, layout, kind, packed_at, n, False, True)
        _check_against_reference(out, ref, layout, kind, packed_at)
        written = np.zeros(n, bool)
        for b in order.tolist():
            written[packed_at[b] : packed_at[b] + lens[b]] = True
        assert bool((out[0][torch.from_numpy(~written)] == 7.0).all())  # gaps untouched
        outs.append(out)
    if len(outs) == 2:
        for c, t in zip(outs[0], outs[1]):
            assert np.array_equal(_bits(c), _bits(t))


def test_native_false_runs_the_twin_and_native_true_does_not(monkeypatch):
    calls = []
    real = block_ops.split_blocks_torch
    monkeypatch.setattr(block_ops, "split_blocks_torch", lambda *a: (calls.append(1), real(*a)))
    layout, x, kind, _ = _inputs([3000], 1024, 0)
    imp = kind == IMPORTANT
    args = (x, None, torch.empty(3000), torch.empty(3000), torch.empty(3000), layout, kind, packed_offsets(layout, imp))
    block_ops.split_blocks(*args, native=False)
    assert calls == [1]
    block_ops.split_blocks(*args, native=True)
    assert calls == ([1] if NATIVE else [1, 1])


# -- bad input: a clear ValueError from both twins, nothing written


def _bad_case(case):
    layout = BucketLayout([3000, 1024, 7], 1024)
    nb, n = layout.nblocks, layout.numel
    kind = np.array([IMPORTANT, KEPT, SENT, IMPORTANT, SENT, SENT], np.uint8)[:nb]
    assert len(kind) == nb
    imp = kind == IMPORTANT
    at = packed_offsets(layout, imp)
    n_imp = int(layout.block_len.numpy()[imp].sum())
    a = dict(x=torch.randn(n), res_in=torch.randn(n), packed=torch.full((n_imp,), 7.0), res_out=torch.full((n,), 7.0),
             data=torch.full((n,), 7.0), layout=layout, kind=kind, packed_at=at)
    if case == "kind3":
        a["kind"] = kind.copy()
        a["kind"][2] = 3
        msg = "kind"
    elif case == "past_packed":
        a["packed"] = torch.full((n_imp - 1,), 7.0)
        msg = "outside packed"
    elif case == "important_unplaced":
        a["packed_at"] = at.copy()
        a["packed_at"][3] = -1
        msg = "outside packed"
    elif case == "kept_no_res_out":
        a["res_out"] = None
        msg = "res_out"
    elif case == "short_x":
        a["x"] = torch.randn(n - 1)
        msg = "elements"
    elif case == "short_res_in":
        a["res_in"] = torch.randn(n + 1)
        msg = "elements"
    elif case == "short_data":
        a["data"] = torch.full((n - 2,), 7.0)
        msg = "elements"
    elif case == "short_kind":
        a["kind"] = kind[:-1]
        msg = "flags"
    elif case == "short_packed_at":
        a["packed_at"] = np.append(at, -1)
        msg = "flags"
    elif case == "float64":
        a["x"] = torch.randn(n, dtype=torch.float64)
        msg = "float32"
    elif case == "bfloat16_packed":
        a["packed"] = torch.zeros(n_imp, dtype=torch.bfloat16)
        msg = "float32"
    elif case == "strided":
        a["data"] = torch.full((2 * n,), 7.0)[::2]
        msg = "contiguous"
    elif case == "two_d":
        a["res_out"] = torch.full((1, n), 7.0)
        msg = "1-D"
    return a, msg


BAD = ["kind3", "past_packed", "important_unplaced", "kept_no_res_out", "short_x", "short_res_in", "short_data",
       "short_kind", "short_packed_at", "float64", "bfloat16_packed", "strided", "two_d"]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_before_anything_is_written(native, case):
    if native and not NATIVE:
        pytest.skip("the optional C extension dgt.protocol._blockops is not built")
    a, msg = _bad_case(case)
    before = {k: a[k].clone() for k in ("packed", "res_out", "data", "res_in") if isinstance(a[k], torch.Tensor)}
    with pytest.raises(ValueError, match=msg):
        split_blocks(**a, native=native)
    for k, t in before.items():
        assert torch.equal(a[k], t), f"{k} was written"


@pytest.mark.parametrize("case", ["kind3", "past_packed", "important_unplaced", "kept_no_res_out"])
def test_the_torch_twin_alone_checks_its_bounds(case):
    """split_blocks_torch called directly (as the reference it is) refuses the same input."""
    a, msg = _bad_case(case)
    before = {k: a[k].clone() for k in ("packed", "res_out", "data") if isinstance(a[k], torch.Tensor)}
    with pytest.raises(ValueError, match=msg):
        split_blocks_torch(a["x"], a["res_in"], a["packed"], a["res_out"], a["data"], a["layout"], a["kind"],
                           a["packed_at"])
    for k, t in before.items():
        assert torch.equal(a[k], t), f"{k} was written"


@NO_C
@pytest.mark.parametrize("case", ["sizes", "res_in", "res_out", "lens", "kind_len", "outside", "negative", "packed4",
                                  "live_len", "live_apart"])
def test_the_c_pass_checks_its_own_arguments(case):
    """The extension called directly (no Python wrapper in front) refuses inconsistent buffers."""
    from dgt.protocol import _blockops

    n = 2048
    x, ri, ro, data = (np.zeros(n, np.float32) for _ in range(4))
    packed = np.full(1024, 7, np.float32)
    starts, lens = np.array([0, 1024], np.int64), np.array([1024, 1024], np.int64)
    kind, at = np.array([0, 2], np.uint8), np.array([0, -1], np.int64)
    live = np.zeros(0, np.uint8)
    if case == "live_len":
        ro, live = ri, np.ones(3, np.uint8)
    elif case == "live_apart":  # flags describe one residual, read and written in place
        live = np.ones(2, np.uint8)
    elif case == "sizes":
        data = np.zeros(n - 1, np.float32)
    elif case == "res_in":
        ri = np.zeros(n + 1, np.float32)
    elif case == "res_out":
        ro = np.zeros(7, np.float32)
    elif case == "lens":
        lens = lens[:1]
    elif case == "kind_len":
        kind = np.array([0, 2, 2], np.uint8)
    elif case == "outside":
        starts = np.array([0, 1025], np.int64)
    elif case == "negative":
        lens = np.array([1024, -1], np.int64)
    elif case == "packed4":
        packed = np.full(1024, 7, np.float32).view(np.uint8)[:4095]
    with pytest.raises(ValueError, match="split"):
        _blockops.split(x, ri, packed, ro, data, starts, lens, kind, at, live)
    if case not in ("packed4",):
        assert (packed == 7).all()  # nothing written


@pytest.mark.parametrize("native", [pytest.param(True, marks=NO_C), False], ids=["c", "torch"])
@pytest.mark.parametrize("sizes,block", LAYOUTS)
@pytest.mark.parametrize("seed", range(3))
def test_live_flags_skip_the_zero_blocks_of_an_in_place_residual(native, sizes, block, seed):
    """With ``live``, a block flagged 0 is neither read (y = x, -0.0 kept) nor written in the residual; the others as
    without flags; the flags end as ``kind == KEPT``. Stale values under a 0 flag show both: they stay, and y ignores
    them."""
    layout, x, kind, g = _inputs(sizes, block, seed)
    rng = np.random.default_rng(seed + 10)
    live = rng.integers(0, 2, layout.nblocks).astype(np.uint8)
    res = torch.randn(layout.numel, generator=g)
    dead = layout.expand(torch.from_numpy(live == 0))
    imp = kind == IMPORTANT
    packed_at = packed_offsets(layout, imp)
    n_packed = int(layout.block_len.numpy()[imp].sum())
    ref = _reference(torch.where(dead, x, x + res), None, layout, kind, packed_at, n_packed)  # flagged 0: y = x
    packed, data = torch.full((n_packed,), 7.0), torch.full((layout.numel,), 7.0)
    r = res.clone()
    flags = live.copy()
    split_blocks(x, r, packed, r, data, layout, kind, packed_at, native=native, live=flags)
    want = torch.from_numpy(ref[1].copy())
    stale = dead & ~layout.expand(torch.from_numpy(kind == KEPT))
    want[stale] = res[stale]  # a block flagged zero and not kept is left as it was
    _check_against_reference((packed, None, data), ref, layout, kind, packed_at)  # the residual: below
    assert np.array_equal(_bits(r), _bits(want))
    assert np.array_equal(flags, (kind == KEPT).astype(np.uint8))


@pytest.mark.parametrize("native", [pytest.param(True, marks=NO_C), False], ids=["c", "torch"])
@pytest.mark.parametrize("bad", ["dtype", "length", "no_res_in", "apart"])
def test_live_flags_are_refused_where_they_cannot_hold(native, bad):
    layout, x, kind, _ = _inputs([4096], 1024, 0)
    res, other = torch.zeros(layout.numel), torch.zeros(layout.numel)
    live = np.ones(layout.nblocks, np.uint8)
    res_in, res_out = res, res
    if bad == "dtype":
        live = live.astype(bool)
    elif bad == "length":
        live = np.ones(layout.nblocks + 1, np.uint8)
    elif bad == "no_res_in":
        res_in = None
    else:
        res_out = other
    imp = kind == IMPORTANT
    with pytest.raises(ValueError, match="live flags"):
        split_blocks(x, res_in, torch.empty(layout.numel), res_out, torch.empty(layout.numel), layout, kind,
                     packed_offsets(layout, imp), native=native, live=live)
