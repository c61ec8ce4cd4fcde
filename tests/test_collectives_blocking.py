"""The blocking face of the collectives, called from plain threads across OS processes."""

import pytest
import torch

from dgt.collectives.launch import run_ranks

NUMEL = 50_000


def _x(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))


def _worker(rank, world):
    from dgt.collectives.blocking import BlockingCollective
    from dgt.collectives.rendezvous import store_from_env

    store = store_from_env(rank, world, 30)  # one c10d store for the three groups (each prefix its own keys)
    out = {}
    with BlockingCollective("ring", rank, world, store=store, prefix="b-ring", timeout=30) as ring:
        out["ring"] = ring.allreduce(_x(rank), timeout=60).tensor
        fut = ring.allreduce_async(_x(rank) * 2, bucket_id=1)  # returns at once; the value comes later
        out["ring_async"] = fut.wait().tensor
        y = _x(rank)
        res = ring.allreduce(y, out=y, timeout=60)  # in place
        out["in_place"] = res.tensor.data_ptr() == y.data_ptr() and torch.equal(y, out["ring"])
        with pytest.raises(TypeError):
            ring.mix(_x(rank))
    ps_opts = dict(server="sharded", op="sum", timeout=30)
    with BlockingCollective("ps", rank, world, store=store, prefix="b-ps", **ps_opts) as ps:
        out["ps_sum"] = ps.allreduce(_x(rank), timeout=60).tensor
    with BlockingCollective("gossip", rank, world, store=store, prefix="b-gossip", timeout=30) as gossip:
        out["mix"] = gossip.mix(_x(rank), timeout=60).tensor
    return out


def test_blocking_collectives_across_processes():
    world = 3
    res = run_ranks(_worker, world, timeout=120)
    xs = torch.stack([_x(r) for r in range(world)])
    for r in range(world):
        torch.testing.assert_close(res[r]["ring"], xs.mean(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res[r]["ring_async"], 2 * xs.mean(0), rtol=1e-5, atol=1e-5)
        assert res[r]["in_place"]
        torch.testing.assert_close(res[r]["ps_sum"], xs.sum(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res[r]["mix"], xs.mean(0), rtol=1e-5, atol=1e-5)  # 3-ring: 1/3 each = mean


def test_unknown_kind_and_codec_mismatch_fail_at_construction():
    from dgt.collectives.blocking import BlockingCollective
    from dgt.errors import CodecMismatch

    with pytest.raises(ValueError, match="kind"):
        BlockingCollective("tree", 0, 2)
    with pytest.raises(CodecMismatch):
        BlockingCollective("ring", 0, 2, codec="qsgd")
