"""``dgt bench allreduce``: DGT ring and parameter-server all-reduce against torch.distributed Gloo all_reduce on the
same tensor and ranks, in the same run (each rank times both; a Gloo barrier aligns the ranks before every trial).
Only the all-reduce is timed: Gloo reduces a result buffer in place, so the input is copied into it before the
barrier, outside the timed part; ours reads the input and writes the same buffer (``out=``), which needs no copy.
Both reuse one buffer allocated once, so neither pays for faulting in a new 25 MB tensor per trial."""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from dgt.collectives.launch import run_ranks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="number of ranks (processes on this machine)")
    p.add_argument("--mb", type=float, default=25.0, help="tensor size in MB of fp32")
    p.add_argument("--repeat", type=int, default=5, help="timed trials per method (the best and the median are "
                   "reported, each trial timed by its slowest rank)")
    p.add_argument("--codec", default="dense", help="codec for the DGT collectives (dense = lossless)")
    p.add_argument("--stream-hops", default="auto", choices=["auto", "native", "python", "off"],
                   help="how the lossless ring's hops run: on stream lanes with the native loop (auto: when built) or "
                   "its Python twin, or off: on the session link (see docs/transport.md)")
    p.add_argument("--timeout", type=float, default=300.0)


def _rank(rank: int, world: int, numel: int, repeat: int, codec: str, stream_hops: str = "auto") -> dict:
    import torch
    import torch.distributed as dist
    import trio

    from dgt.collectives import Group, ParameterServer, RingAllReduce
    from dgt.endpoint import TransportConfig

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    y = torch.empty_like(x)  # every method writes the sum into this buffer, reused across trials

    def timed(fn, prep=None) -> list[float]:
        times = []
        for i in range(repeat + 1):  # the first call warms up (connections, buffers) and is not counted
            if prep is not None:
                prep()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i:
                times.append(time.perf_counter() - t0)
        return times

    out = {"gloo": timed(partial(dist.all_reduce, y), prep=partial(y.copy_, x))}
    ref = y.clone()  # Gloo's sum: each of ours must agree with it (to float rounding: the order of adds differs)
    diffs = {}

    async def dgt_part():
        g = await Group.create(rank, world, store=store, prefix="bench-allreduce", timeout=60,
                               config=TransportConfig(stream_hops=stream_hops))
        portal = trio.lowlevel.current_trio_token()
        try:
            for name, coll in (("ring", RingAllReduce(g, codec, op="sum")),
                               ("ps_sharded", ParameterServer(g, codec, op="sum", server="sharded")),
                               ("ps_central", ParameterServer(g, codec, op="sum", server=0))):
                res = {}

                def run(coll=coll, res=res):
                    res["r"] = trio.from_thread.run(partial(coll.allreduce, x, 0, None, out=y), trio_token=portal)

                y.fill_(float("nan"))  # a method that left part of the buffer unwritten shows up as NaN
                out[name] = await trio.to_thread.run_sync(timed, run)
                diffs[name] = float((y - ref).abs().max())
        finally:
            await g.aclose()

    trio.run(dgt_part)
    dist.barrier()
    dist.destroy_process_group()
    return {"seconds": out, "max_abs_diff": diffs, "scale": float(ref.abs().max())}


def run(args: argparse.Namespace) -> dict:
    numel = int(args.mb * 1e6 / 4)
    hops = getattr(args, "stream_hops", "auto")
    res = run_ranks(_rank, args.ranks, numel, args.repeat, args.codec, hops, timeout=args.timeout)
    # a collective ends when its slowest rank does: per trial the slowest rank's time, then the best and the median
    trials = {k: [max(t) for t in zip(*(r["seconds"][k] for r in res.values()))] for k in res[0]["seconds"]}
    best = {k: min(v) for k, v in trials.items()}
    median = {k: statistics.median(v) for k, v in trials.items()}
    out = {"bench": "allreduce", "ranks": args.ranks, "mb": args.mb, "codec": args.codec, "repeat": args.repeat,
           "seconds": best, "median_seconds": median}  # fmt: skip
    from dgt.endpoint import TransportConfig

    out["ring_hops"] = ("session link" if hops == "off" else
                        "native loop" if TransportConfig(stream_hops=hops).native_hops() else "python loop")
    # largest difference from Gloo's sum on any rank, relative to the sum's magnitude (NaN: a part never written)
    out["max_rel_diff_vs_gloo"] = {k: max(r["max_abs_diff"][k] / max(r["scale"], 1e-30) for r in res.values())
                                   for k in res[0]["max_abs_diff"]}  # fmt: skip
    out["speed_vs_gloo"] = {k: best["gloo"] / v for k, v in best.items() if k != "gloo"}  # best trial vs best
    out["median_speed_vs_gloo"] = {k: median["gloo"] / v for k, v in median.items() if k != "gloo"}
    out["goal"] = "lossless DGT ring >= 1.0x Gloo for 25 MB at 2 and 4 ranks"
    out["goal_met"] = out["speed_vs_gloo"]["ring"] >= 1.0
    return out
