"""Oland & Raj's setting over the real transport: each worker trains one local epoch, pushes its parameters coded
with entropy-adaptive quantization + Huffman (the bit width chosen once per epoch, at the epoch's one encode), the
model server averages them and every worker continues from the average (ModelServer(average=True), OS processes over
loopback). Equal, bit for bit, to the in-process simulation ``simulate.train_model_averaging``."""

from __future__ import annotations

import pytest
import torch

from dgt.collectives.launch import run_ranks
from dgt.harness.offline import OfflineTransport
from dgt.harness.simulate import train_model_averaging

SPEC = "olandraj:c=6,M=4,F=0.03,seed=0"


def _rank(rank, world, spec, epochs, lr, batch, seed):
    import trio

    from dgt.collectives import Group
    from dgt.collectives.model_server import ModelServer
    from dgt.harness.simulate import MLP, Shards, digits

    torch.set_num_threads(1)
    model, data = MLP(), digits()
    shards = Shards(data, world, seed)

    async def main():
        async with Group.open(rank, world, timeout=30) as g:
            w0 = model.init(seed)
            ms = ModelServer(g, spec, model=w0, lr=lr, segments=model.segments, average=True)
            local, sent = w0.clone(), []
            for _ in range(epochs):
                for xb, yb in shards.epoch(rank, batch):
                    local -= lr * model.loss_grad(local, xb, yb)
                res = await ms.step(None, local)
                local = res.tensor.clone()
                sent.append(sum(res.stats.to_dict()["bytes_sent"].values()))
            last = getattr(ms.push_tx, "last_stats", {})
            return {"local": local, "sent": sent, "bits": last.get("bits_per_param"), "bytes": last.get("bytes")}

    return trio.run(main)


@pytest.mark.parametrize("spec", [SPEC, pytest.param("dense", marks=pytest.mark.slow)])
def test_model_averaging_over_the_transport_equals_the_simulation(spec):
    world, epochs, lr, batch, seed = 3, 2, 0.1, 16, 0
    out = run_ranks(_rank, world, spec, epochs, lr, batch, seed, timeout=180)
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with one thread each: the simulation must do the same arithmetic
    try:
        sim = train_model_averaging(spec if spec != "dense" else None, k=world, epochs=epochs, lr=lr, batch=batch,
                                    seed=seed)
    finally:
        torch.set_num_threads(old)
    for r in range(world):
        assert torch.equal(out[r]["local"], sim["final_params"]), f"rank {r} differs from the simulation"
    n = sim["numel"]
    for r in (1, 2):  # a worker's push: the coded parameters, once per epoch
        for b in out[r]["sent"]:
            if spec == "dense":
                assert b == 4 * n
            else:
                assert 0 < b < 4 * n / 2  # fewer than half the fp32 bytes even on this 4.8k-parameter MLP
        if spec != "dense":
            assert out[r]["sent"][-1] == out[r]["bytes"]  # exactly the codec's message (headers included)
    if spec != "dense":
        assert out[1]["bits"] == pytest.approx(sim["bits_per_param"], rel=0.2)


def test_model_server_checks_the_communication_frequency():
    from dgt.collectives import Group
    from dgt.collectives.model_server import ModelServer

    g = Group(OfflineTransport(), 0, 2, 1)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="every"):
            ModelServer(g, "dense", model=torch.zeros(8), lr=0.1, every=bad)
    ms = ModelServer(g, "olandraj", model=torch.zeros(8), lr=0.1, every=3, average=True)
    assert ms.every == 3 and ms.average and ms.pull_codec.name == "dense"  # the mean comes back in fp32
