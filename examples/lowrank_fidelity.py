"""How much of a model's gradient one PowerSGD step carries: 4 ranks simulated in one process.

    python examples/lowrank_fidelity.py MODEL RANK STEPS     # e.g. alexnet 1 40, gpt 1 40, resnet 1 40

Trains the experiment's workload (``dgt.experiment.workloads``: its optimizer, batch and data) for STEPS steps, each
rank on its own batch, the update being what the low-rank codec (``lowrank:rank=RANK,min_ratio=2``, error feedback,
warm start; ``dgt.codecs.lowrank.reduce_in_process``) delivers. Per step it prints the training loss, the cosine
between the delivered sum and the exact sum of the ranks' gradients over the compressed matrices, and rank 0's
residual energy against its gradient's (|residual|^2 / |g|^2, the error feedback's size). Written to test whether
the codec's own view of a step (how much of the gradient the factors carry) tells which models need more steps
under low rank (docs/shim.md, "The chooser's low-rank path").
"""

from __future__ import annotations

import sys

import torch

from dgt.codecs.base import BucketState
from dgt.codecs.lowrank import LowRankCodec, reduce_in_process, set_shapes
from dgt.experiment.workloads import build_workload, defaults


def main(model_name: str, rank: int, steps: int, ranks: int = 4) -> list[tuple[int, float, float, float]]:
    torch.set_num_threads(1)
    w = build_workload(model_name, seed=0)
    batch = defaults(model_name).batch
    net = w.model
    opt = w.make_optimizer(net.parameters())
    params = [p for p in net.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    codecs = [LowRankCodec(rank=rank, min_ratio=2) for _ in range(ranks)]
    states = [BucketState(numel=numel, dtype=torch.float32) for _ in range(ranks)]
    for s in states:
        set_shapes(s, [tuple(p.shape) for p in params])
    gen = torch.Generator().manual_seed(0)
    n = len(w.data.y_train)
    rows = []
    for it in range(steps):
        grads = []
        for _ in range(ranks):
            idx = torch.randint(0, n, (batch,), generator=gen)
            net.zero_grad()
            loss = w.loss(net(w.data.x_train[idx]), w.data.y_train[idx])
            loss.backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        exact = torch.stack(grads).sum(0)
        delivered = reduce_in_process(codecs, states, grads)[0]
        mask = ~codecs[0].plan(states[0]).dense_mask
        residual = states[0].values["last"]["residual"]
        cos = float(torch.nn.functional.cosine_similarity(delivered[mask], exact[mask], dim=0))
        ef_ratio = float(residual.pow(2).sum()) / max(float(grads[0][mask].pow(2).sum()), 1e-30)
        rows.append((it, float(loss), cos, ef_ratio))
        off = 0
        for p in params:
            p.grad = (delivered[off : off + p.numel()].view_as(p) / ranks).clone()
            off += p.numel()
        opt.step()
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    name, r, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = main(name, r, k)
    for it, loss, cos, ef in out[:: max(1, k // 10)]:
        print(f"step {it:4d}  loss {loss:.3f}  cos(delivered, exact) {cos:.3f}  |ef|^2/|g|^2 {ef:.2f}")
    tail = out[10:] or out
    cos_mean = sum(x[2] for x in tail) / len(tail)
    ef_mean = sum(x[3] for x in tail) / len(tail)
    print(f"{name} rank {r}, steps {tail[0][0]}-{k - 1}: mean cos {cos_mean:.3f}, mean |ef|^2/|g|^2 {ef_mean:.2f}")
