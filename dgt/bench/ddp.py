"""``dgt bench ddp``: time per DDP training step of the example model (examples/ddp_dgt.py), Gloo vs the DGT hook.

Three modes in the same processes: plain DDP on Gloo (the anchor), the DGT hook lossless (dense codec, TCP lane
only) and the DGT hook "lossy": by default ``DGTState()`` with no options, as the README line gives it (DGT codec,
important blocks on TCP, the rest on UDP, and the chooser of dgt/shim/chooser.py, which falls back to the lossless
path where dropping does not pay); ``--lossy-codec dgt:p=0.3`` forces a constant-p DGT codec instead. Each mode
first runs untimed warm-up steps (DDP's bucket rebuild, the hook's dense warm-up, connection set-up); the timed
steps are then split into rounds that cycle through the modes, each round starting after a barrier, so a machine
whose load drifts (shared CI runners) affects every mode alike. Reported: median and mean seconds per step (the
slowest rank's), and the ratio of each DGT mode to Gloo (below 1 = faster than Gloo).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=2, help="ranks (processes on this machine)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    p.add_argument("--rounds", type=int, default=3, help="the timed steps are split into this many interleaved rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    p.add_argument("--hidden", type=int, default=1024, help="width of the example MLP (64-h-h-10)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--collective", choices=["ring", "ps"], default="ring")
    p.add_argument("--lossy-codec", default="default",
                   help="codec of the lossy mode: 'default' = DGTState() with no options (the README line: "
                   "dgt:idle_p=0.1 with the measuring lossless fallback); a spec such as dgt:p=0.3 forces that codec")
    p.add_argument("--drop", type=float, default=0.0, help="datagram loss injected at the receivers (lossy mode)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=600.0)


def _model(hidden: int) -> torch.nn.Module:
    """The example's model (examples/ddp_dgt.py), same seed on every rank."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dgt.shim

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1024, 64, generator=gen)
    y = torch.randint(10, (1024,), generator=gen)
    modes = {
        "gloo": None,
        "dgt_lossless": {"codec": "dense"},
        "dgt_lossy": {"codec": cfg["lossy_codec"],
                      "transport": {"drop_fraction": cfg["drop"], "drop_seed": rank} if cfg["drop"] else None},
    }
    out: dict = {"params": sum(p.numel() for p in _model(cfg["hidden"]).parameters())}
    runs = {}
    for name, opts in modes.items():  # every mode's model and state exist side by side
        ddp = DDP(_model(cfg["hidden"]), bucket_cap_mb=cfg["bucket_mb"])
        state = None
        if opts is not None and opts["codec"] == "default":  # the README line: no options at all
            kw = {"transport": opts["transport"]} if opts.get("transport") else {}
            if cfg["collective"] != "ring":
                kw["collective"] = cfg["collective"]
            state = dgt.shim.DGTState(**kw)
        elif opts is not None:
            state = dgt.shim.DGTState(codec=opts["codec"], collective=cfg["collective"], warmup_iters=1,
                                      transport=opts.get("transport"))
        if state is not None:
            ddp.register_comm_hook(state, dgt.shim.hook)
        runs[name] = (ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.01), [])

    def step(name: str) -> float:
        ddp, _state, opt, _times = runs[name]
        idx = torch.randint(len(x), (cfg["batch"],), generator=gen)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        runs[name][3].append(loss.item())
        return time.perf_counter() - t0

    for name in modes:  # untimed: bucket rebuild, dense warm-up, connection set-up
        for _ in range(cfg["warmup"]):
            step(name)
    totals0 = {n: _snapshot(r[1]) for n, r in runs.items() if r[1] is not None}
    times: dict[str, list[float]] = {n: [] for n in modes}
    rounds = max(1, cfg["rounds"])
    per_round = max(1, cfg["steps"] // rounds)
    for _ in range(rounds):  # interleaved, so drifting machine load hits every mode alike
        for name in modes:
            dist.barrier()
            times[name] += [step(name) for _ in range(per_round)]
    for name, (_ddp, state, _opt, losses) in runs.items():
        ts = times[name]
        res = {"median": statistics.median(ts), "mean": statistics.fmean(ts), "final_loss": losses[-1],
               "steps": len(ts)}
        if state is not None:
            t, t0 = state.totals, totals0[name]
            n = len(ts)
            res["hook_comm_s_per_step"] = (t["seconds"] - t0["seconds"]) / n
            res["dropped_blocks"] = t["dropped"] - t0["dropped"]
            for lane, key in ((0, "reliable"), (1, "droppable")):
                res[f"{key}_bytes_per_step"] = (t["bytes_sent"].get(lane, 0) - t0["bytes_sent"].get(lane, 0)) / n
            if state.chooser is not None:  # which path the default state chose, on what figures
                res["choice"] = state.chooser.summary()
            state.close()
        out[name] = res
    dist.destroy_process_group()
    return out


def _snapshot(state) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.totals.items()}


def run(args: argparse.Namespace) -> dict:
    from dgt.collectives.launch import run_ranks

    cfg = {k: getattr(args, k) for k in ("steps", "rounds", "warmup", "hidden", "batch", "bucket_mb", "collective",
                                         "lossy_codec", "drop", "threads")}
    res = run_ranks(_rank, args.world, cfg, timeout=args.timeout, env={"DGT_THREADS": str(args.threads)})
    modes: dict = {}
    for name in ("gloo", "dgt_lossless", "dgt_lossy"):
        per_rank = [res[r][name] for r in range(args.world)]
        m = {"s_per_step_median": max(p["median"] for p in per_rank),
             "s_per_step_mean": max(p["mean"] for p in per_rank),
             "final_loss_rank0": per_rank[0]["final_loss"]}
        for k in ("hook_comm_s_per_step", "reliable_bytes_per_step", "droppable_bytes_per_step", "choice"):
            if k in per_rank[0]:
                m[k] = per_rank[0][k]
        if "dropped_blocks" in per_rank[0]:
            m["dropped_blocks"] = sum(p["dropped_blocks"] for p in per_rank)
        modes[name] = m
    base = modes["gloo"]["s_per_step_median"]
    return {
        "bench": "ddp",
        "world": args.world,
        "params": res[0]["params"],
        "grad_mb": res[0]["params"] * 4 / 1e6,
        "steps": res[0]["gloo"]["steps"],
        "rounds": args.rounds,
        "lossy_codec": args.lossy_codec,
        "drop": args.drop,
        "collective": args.collective,
        "modes": modes,
        "ratios": {f"{name}/gloo": modes[name]["s_per_step_median"] / base for name in ("dgt_lossless", "dgt_lossy")},
    }
