"""Oland-Raj over the real transport: ModelServer(average=True, every=<steps per epoch>) is the paper's scheme
(one local epoch, then the coded parameters are averaged; the bit width is chosen once per averaging round, i.e.
per epoch) and reproduces the in-process simulation ``simulate.train_model_averaging`` bit for bit."""

from __future__ import annotations

import math

import torch

from dgt.collectives.launch import run_ranks
from dgt.harness.simulate import MLP, Shards, digits, train_model_averaging

SPEC = "olandraj:c=6,M=4,F=0.03"


def _rank(rank: int, world: int, epochs: int, lr: float, batch: int, seed: int) -> dict:
    import trio

    from dgt.collectives import Group
    from dgt.collectives.model_server import ModelServer

    torch.set_num_threads(1)
    model, data = MLP(), digits()
    shards = Shards(data, world, seed)
    steps = math.ceil(shards.parts[rank].numel() / batch)

    async def main() -> dict:
        async with Group.open(rank, world, timeout=30) as g:
            w0 = model.init(seed)
            ms = ModelServer(g, SPEC, model=w0, lr=lr, segments=model.segments, average=True, every=steps)
            local, bits, sent = w0.clone(), [], []
            for _ in range(epochs):
                for xb, yb in shards.epoch(rank, batch):
                    local -= lr * model.loss_grad(local, xb, yb)
                    res = await ms.step(None, local)
                    local = res.tensor
                    sent.append(sum(res.stats.bytes_sent.values()))
                    if res.stats.bytes_sent:
                        bits.append(ms.push_tx.last_stats["bits_per_param"])
            return {"local": local, "bits": bits, "sent": sent, "steps": steps}

    return trio.run(main)


def test_olandraj_model_averaging_over_the_transport_equals_the_simulation():
    world, epochs, lr, batch, seed = 3, 3, 0.1, 64, 0
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = run_ranks(_rank, world, epochs, lr, batch, seed, timeout=180)
        sim = train_model_averaging(SPEC, k=world, epochs=epochs, lr=lr, batch=batch, seed=seed)
    finally:
        torch.set_num_threads(old)
    steps = out[0]["steps"]
    assert all(o["steps"] == steps > 1 for o in out.values())  # the same epoch length on every rank
    for r in range(world):
        assert torch.equal(out[r]["local"], sim["final_params"]), f"rank {r}'s model differs from the simulation's"
        # only the last step of each local epoch communicates: one averaging round (and one bit width) per epoch
        assert [s > 0 for s in out[r]["sent"]] == ([False] * (steps - 1) + [True]) * epochs
    workers_bits = [b for r in range(1, world) for b in out[r]["bits"]]
    assert len(workers_bits) == epochs * (world - 1)
    assert 0 < min(workers_bits) and max(workers_bits) < 32
