"""``dgt bench allreduce``: DGT ring and parameter-server all-reduce against torch.distributed Gloo all_reduce on the
same tensor and ranks, in the same run (each rank times both; a Gloo barrier aligns the ranks before every trial).
Every method copies the input into a result buffer allocated once (Gloo reduces it in place, ours with ``out=``), so
neither pays for allocating and faulting in a new 25 MB tensor per trial."""

from __future__ import annotations

import argparse
import time
from functools import partial

from dgt.collectives.launch import run_ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (processes on this machine)")
    p.add_argument("--mb", type=float, default=25.0, help="tensor size in MB of fp32")
    p.add_argument("--repeat", type=int, default=5, help="timed trials per method (best is reported)")
    p.add_argument("--codec", default="dense", help="codec for the DGT collectives (dense = lossless)")
    p.add_argument("--timeout", type=float, default=300.0)


def _rank(rank: int, world: int, numel: int, repeat: int, codec: str) -> dict:
    import torch
    import torch.distributed as dist
    import trio

    from dgt.collectives import Group, ParameterServer, RingAllReduce

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    y = torch.empty_like(x)  # every method reduces a fresh copy of x into a result buffer it reuses

    def gloo() -> None:
        y.copy_(x)
        dist.all_reduce(y)

    def timed(fn) -> float:
        best = float("inf")
        for i in range(repeat + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i:
                best = min(best, time.perf_counter() - t0)
        return best

    out = {"gloo": timed(gloo)}

    async def dgt_part():
        g = await Group.create(rank, world, store=store, prefix="bench-allreduce", timeout=60)
        portal = trio.lowlevel.current_trio_token()
        try:
            for name, coll in (("ring", RingAllReduce(g, codec, op="sum")),
                               ("ps_sharded", ParameterServer(g, codec, op="sum", server="sharded")),
                               ("ps_central", ParameterServer(g, codec, op="sum", server=0))):
                res = {}

                def run(coll=coll, res=res):
                    res["r"] = trio.from_thread.run(partial(coll.allreduce, x, 0, None, out=y), trio_token=portal)

                out[name] = await trio.to_thread.run_sync(timed, run)
        finally:
            await g.aclose()

    trio.run(dgt_part)
    dist.barrier()
    dist.destroy_process_group()
    return out


def run(args: argparse.Namespace) -> dict:
    numel = int(args.mb * 1e6 / 4)
    res = run_ranks(_rank, args.ranks, numel, args.repeat, args.codec, timeout=args.timeout)
    worst = {k: max(r[k] for r in res.values()) for k in res[0]}  # a collective ends when its slowest rank does
    out = {"bench": "allreduce", "ranks": args.ranks, "mb": args.mb, "codec": args.codec, "seconds": worst}
    out["speed_vs_gloo"] = {k: worst["gloo"] / v for k, v in worst.items() if k != "gloo"}
    out["goal"] = "lossless DGT ring >= 1.0x Gloo for 25 MB at 2 and 4 ranks"
    out["goal_met"] = out["speed_vs_gloo"]["ring"] >= 1.0
    return out
