"""The lossy path's wire dtype (DGTState(wire_dtype=...)): the default hook's lossy rounds travel in fp16, pre-divided
by the world size like torch's fp16_compress_hook; explicit codecs and the lossless path keep the bucket's dtype."""

from __future__ import annotations

import pickle

import pytest
import torch

from dgt.collectives.launch import run_ranks


def test_default_state_casts_the_lossy_path_and_an_explicit_codec_does_not():
    from dgt.shim import DGTState

    assert DGTState().wire_dtype == torch.float16
    assert DGTState(codec="dgt:p=0.3").wire_dtype is None
    assert DGTState(codec="dense").wire_dtype is None
    assert DGTState(codec="dgt:p=0.3", wire_dtype="bf16").wire_dtype == torch.bfloat16
    assert DGTState(wire_dtype="native").wire_dtype is None
    assert DGTState(wire_dtype=torch.float16).wire_dtype == torch.float16
    for bad in ("int8", "fp8", torch.float64):
        with pytest.raises(ValueError, match="wire"):
            DGTState(wire_dtype=bad)
    st = pickle.loads(pickle.dumps(DGTState()))
    assert st.wire_dtype == torch.float16


def test_lossy_input_divides_by_the_world_then_casts():
    from dgt.shim import DGTState

    x = torch.tensor([1.0, -3.0, 1e-3, 2e5], dtype=torch.float32)
    y = DGTState().lossy_input(x, 4)
    assert y.dtype == torch.float16
    assert torch.equal(y, (x / 4).to(torch.float16))  # 2e5 / 4 = 5e4 fits fp16 (2e5 itself would overflow)
    assert torch.isfinite(y).all()
    assert DGTState(codec="dgt:p=0.3").lossy_input(x, 4) is x  # native: the bucket itself, for the mean collective
    half = x.to(torch.bfloat16)
    assert DGTState().lossy_input(half, 2).dtype == torch.bfloat16  # a narrower bucket keeps its dtype


def _bucket(rank: int, it: int) -> torch.Tensor:
    return torch.randn(5000, generator=torch.Generator().manual_seed(100 * it + rank))


def _wire_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dgt.shim import DGTState
    from dgt.shim.hook import submit

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    # p = 1: every block important, nothing dropped, so the fp16 result is exactly the fp16 sum of the fp16 shares
    for wire in ("fp16", "native"):
        st = DGTState(codec="dgt:p=1", wire_dtype=wire, warmup_iters=1, chooser=False)
        res = [submit(st, _bucket(rank, it), 0, use_codec=it >= 1, it=it).wait() for it in range(3)]
        out[wire] = {"results": res, "lane0": st.totals["bytes_sent"].get(0, 0)}
        st.close()
    dist.destroy_process_group()
    return out


def test_fp16_wire_halves_the_bytes_and_lossless_rounds_stay_exact():
    world = 2
    res = run_ranks(_wire_rank, world, timeout=120)
    for it in range(3):
        xs = [_bucket(r, it) for r in range(world)]
        exact = (xs[0] + xs[1]) / 2
        a, b = res[0]["fp16"]["results"][it], res[1]["fp16"]["results"][it]
        assert a.dtype == torch.float32 and torch.equal(a, b), "every rank gets the same result, in the bucket's dtype"
        if it == 0:  # the dense warm-up is never cast: bit-exact
            torch.testing.assert_close(a, exact, rtol=1e-6, atol=1e-6)
            assert not torch.equal(a, ((xs[0] / 2).half() + (xs[1] / 2).half()).float())
        else:
            assert torch.equal(a, ((xs[0] / 2).half() + (xs[1] / 2).half()).float())
        native = res[0]["native"]["results"][it]
        torch.testing.assert_close(native, exact, rtol=1e-6, atol=1e-6)
    # two codec rounds of 5000 elements: reduce-scatter + all-gather each send half the bucket per rank
    fp16, native = res[0]["fp16"]["lane0"], res[0]["native"]["lane0"]
    warm = 5000 * 4  # the warm-up round (fp32 both times)
    assert fp16 - warm == pytest.approx((native - warm) / 2, rel=0.01)
