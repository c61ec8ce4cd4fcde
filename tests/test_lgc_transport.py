"""LGC over the real DGT transport: both variants run end to end across OS processes, every transfer counted."""

import pytest
import torch

from dgt.collectives.launch import run_ranks

SIZES = [640, 20000, 6000, 1290]  # dense / ae / ae / topk


def _lgc_rank(rank, world, variant, steps, warmup, ae_iters):
    from dgt.codecs.lgc import LGCCodec, LGCRunner
    from dgt.collectives.lgc_comm import TransportComm

    comm = TransportComm.start(rank, world, timeout=30)
    try:
        numel = sum(SIZES)
        runner = LGCRunner(LGCCodec(variant=variant, warmup=warmup, ae_iters=ae_iters, topk=0.01), comm, numel,
                           layers=SIZES)
        gen = torch.Generator().manual_seed(100 + rank)
        rows = []
        for _ in range(steps):
            g = torch.randn(numel, generator=gen)
            rows.append((g, runner.step(g)))
        return rows, dict(runner.iters), {k: dict(v) for k, v in runner.bytes.items()}, comm.stats.total_sent
    finally:
        comm.close()


@pytest.mark.parametrize("variant", ["ps", "ring"])
def test_lgc_variants_over_the_transport(variant):
    steps, warmup, ae_iters = 7, 2, 2
    res = run_ranks(_lgc_rank, 2, variant, steps, warmup, ae_iters, timeout=180)
    (rows0, iters, nbytes0, sent0), (rows1, _, _, sent1) = res[0], res[1]
    assert iters == {"dense": warmup, "topk": ae_iters, "compressed": steps - warmup - ae_iters}
    for t in range(steps):
        assert torch.equal(rows0[t][1], rows1[t][1])  # both ranks apply the same update
        assert torch.isfinite(rows0[t][1]).all()
    for t in range(warmup):  # dense warm-up: exactly the mean gradient
        torch.testing.assert_close(rows0[t][1], (rows0[t][0] + rows1[t][0]) / 2, rtol=1e-5, atol=1e-5)
    dense = sum(nbytes0["dense"].values()) / warmup
    compressed = sum(nbytes0["compressed"].values()) / (steps - warmup - ae_iters)
    assert 0 < compressed < dense / 3  # the compressed phase moves far fewer bytes than the dense one
    assert sent0 > 0 and sent1 > 0
