"""A small DDP training script: an MLP on scikit-learn's digits, one process per rank.

Launch (one machine, two ranks; on several machines add --nnodes/--node-rank/--master-addr as usual):

    torchrun --nproc-per-node 2 examples/ddp_dgt.py --steps 50

The switch to DGT is the one line marked ``# <- DGT``; ``--hook none`` trains plain DDP for comparison, and
``--backend dgt`` runs the whole process group on the DGT backend instead.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dgt.shim  # registers backend="dgt"


def build_model(hidden: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def load_digits(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the 1797 8x8 digit images (shipped with scikit-learn), standardised."""
    from sklearn.datasets import load_digits as sk_digits

    x, y = sk_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(y, dtype=torch.int64)
    return x[rank::world], y[rank::world]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default="gloo", help="gloo, nccl or dgt")
    ap.add_argument("--hook", choices=["dgt", "none"], default="dgt")
    ap.add_argument("--codec", default=None,
                    help="hook codec (default: DGTState's own, as the README's one line: after the warm-up the hook "
                    "measures whether dropping pays and drops in fp16 where it does); an explicit one such as dgt "
                    "(p = p0*loss/loss0), dgt:p=0.3 or dense is used as given, without the chooser or the fp16 wire")
    ap.add_argument("--collective", choices=["ring", "ps"], default=None, help="default: DGTState's (ring)")
    ap.add_argument("--warmup", type=int, default=None, help="dense warm-up iterations (default: DGTState's, 2)")
    ap.add_argument("--drop", type=float, default=0.0, help="inject this fraction of datagram loss (demo)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return ap.parse_args(argv)


def make_state(args: argparse.Namespace) -> dgt.shim.DGTState:
    """The hook's state: ``DGTState()`` with only the options given on the command line, so with none it is the
    README's one line."""
    given = {"codec": args.codec, "collective": args.collective, "warmup_iters": args.warmup,
             "transport": {"faults": {"drop_fraction": args.drop}} if args.drop else None}
    return dgt.shim.DGTState(**{k: v for k, v in given.items() if v is not None})


def main() -> None:
    args = parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=args.backend)  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = DDP(build_model(args.hidden).to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    state = None
    if args.hook == "dgt":
        state = make_state(args)  # DGTState() unless options were given
        model.register_comm_hook(state, dgt.shim.hook)  # <- DGT: the one-line change
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x, y = load_digits(rank, world)
    gen = torch.Generator().manual_seed(rank)

    t0 = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(len(x), (args.batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state is not None:
            state.observe_loss(loss)  # feeds DGT's p = p0 * loss_t / loss_0
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        extra = ""
        if state is not None:
            t = state.totals
            extra = f" buckets={t['buckets']} codec_buckets={t['codec_buckets']} dropped_blocks={t['dropped']}"
        print(f"done world={world} backend={args.backend} hook={args.hook} steps={args.steps} "
              f"final_loss={loss.item():.4f} s_per_step={elapsed / max(1, args.steps):.4f}{extra}", flush=True)
    if state is not None:
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
