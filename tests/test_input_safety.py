"""Bad input never returns a wrong answer (issue 22): lossless dense is bit-exact in every dtype it accepts, other
dtypes and ops are refused before any traffic, the sender validates its class array, non-finite gradients are kept
out of scores and residual."""

import pytest
import torch

from dgt.collectives.launch import run_ranks

# values float32 cannot hold: a float32 path rounds them (2^40+1 -> 2^40, 16777217 -> 16777216, 1+1e-12 -> 1)
EXACT = {
    "int64": (torch.int64, [2**40 + 1, -(2**52) - 3, 7]),
    "int32": (torch.int32, [16_777_217, -5, 1 << 30]),
    "float64": (torch.float64, [1 + 1e-12, 2.0**60 + 2.0**8, -3.5]),
    "int8": (torch.int8, [3, -7, 50]),
    "uint8": (torch.uint8, [1, 2, 100]),
    "float16": (torch.float16, [1.0009765625, 3.0, -2.5]),
}


def _exact_worker(rank, world, kind, name):
    import trio

    from dgt.collectives import Group, ParameterServer, RingAllReduce
    from dgt.endpoint import TransportConfig

    dtype, vals = EXACT[name]
    x = torch.tensor(vals * 700, dtype=dtype)  # a few blocks, so every hop carries data

    async def main():
        cfg = TransportConfig(stream_hops=kind.split("/")[1])
        g = await Group.create(rank, world, config=cfg, timeout=30)
        try:
            coll = RingAllReduce(g, "dense", op="sum") if kind.startswith("ring") else \
                ParameterServer(g, "dense", op="sum", server="sharded")
            res = await coll.allreduce(x)
            return res.tensor
        finally:
            await g.aclose()

    return trio.run(main)


@pytest.mark.parametrize("kind", ["ring/auto", "ps/off"])
@pytest.mark.parametrize("name", sorted(EXACT))
def test_lossless_dense_is_bit_exact_in_the_tensors_own_dtype(kind, name):
    dtype, vals = EXACT[name]
    x = torch.tensor(vals * 700, dtype=dtype)
    res = run_ranks(_exact_worker, 2, kind, name, timeout=60)
    for r in (0, 1):
        out = res[r]
        assert out.dtype == dtype
        assert torch.equal(out, x + x), (name, out[:3], (x + x)[:3])


def test_refused_dtypes_and_ops_fail_before_any_traffic():
    from dgt.collectives import ParameterServer, RingAllReduce
    from dgt.collectives.gossip import Gossip
    from dgt.collectives.group import Group
    from dgt.errors import InputRejected

    g = Group(None, 0, 2, 1)  # no endpoint: any traffic would fail with another error
    cases = [
        (RingAllReduce(g, "dense"), torch.zeros(8, dtype=torch.complex64), "complex64"),
        (RingAllReduce(g, "dense"), torch.zeros(8, dtype=torch.bool), "bool"),
        (RingAllReduce(g, "dense"), torch.zeros(8, dtype=torch.int16), "int16"),
        (RingAllReduce(g, "dense", op="mean"), torch.zeros(8, dtype=torch.int64), "op='mean'"),
        (RingAllReduce(g, "dgt:p=0.3"), torch.zeros(8, dtype=torch.bool), "bool"),
        (RingAllReduce(g, "dgt:p=0.3"), torch.zeros(8, dtype=torch.int32), "int32"),
        (ParameterServer(g, "dgt:p=0.3"), torch.zeros(8, dtype=torch.complex64), "complex64"),
        (ParameterServer(g, "dense:dtype=fp16"), torch.zeros(8, dtype=torch.int64), "int64"),
    ]
    import trio

    for coll, x, what in cases:
        with pytest.raises(InputRejected, match=what):
            trio.run(coll.allreduce, x)
    with pytest.raises(InputRejected, match="bool"):
        trio.run(Gossip(g, "dgt:p=0.3").mix, torch.zeros(8, dtype=torch.bool))
