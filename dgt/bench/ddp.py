"""``dgt bench ddp``: time per DDP training step of the example model (examples/ddp_dgt.py), or of a model family of
``dgt experiment ddp`` (``--model resnet``, ``gpt-l``, ...: dgt/experiment/workloads.py, with its data and optimizer),
Gloo vs the DGT hook (and, with ``--modes``, torch's fp16 and PowerSGD hooks).

Three modes by default, in the same processes: plain DDP on Gloo (the anchor), the DGT hook lossless (dense codec,
TCP lane only) and the DGT hook "lossy": by default ``DGTState()`` with no options, as the README line gives it (DGT
codec, important blocks on TCP, the rest on UDP, and the chooser of dgt/shim/chooser.py, which falls back to the
lossless path where dropping does not pay); ``--lossy-codec dgt:p=0.3`` forces a constant-p DGT codec instead. Each mode
first runs untimed warm-up steps (DDP's bucket rebuild, the hook's dense warm-up, connection set-up); the timed
steps are then split into rounds that cycle through the modes, each round starting after a barrier, so a machine
whose load drifts (shared CI runners) affects every mode alike. Reported: median and mean seconds per step (the
slowest rank's), and the ratio of each DGT mode to Gloo (below 1 = faster than Gloo). Bytes: what the DGT hook
counted on its lanes, and for every mode what the loopback interface sent during that mode's timed steps (rank 0
reads /proc/net/dev between barriers; per rank and step). ``lo`` counts every process of the network namespace: run
the bench in a namespace of its own (``unshare -n``, as root) for figures that are the bench's alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dgt.cliargs import COUNT, NON_NEGATIVE, POSITIVE, BadOption, codec_spec, number
from dgt.errors import DgtError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=COUNT, default=2, help="ranks (processes on this machine)")
    p.add_argument("--steps", type=COUNT, default=30, help="timed steps per mode")
    p.add_argument("--rounds", type=COUNT, default=3,
                   help="the timed steps are split into this many interleaved rounds")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=3, help="untimed steps per mode")
    p.add_argument("--hidden", type=COUNT, default=1024, help="width of the example MLP (64-h-h-10)")
    p.add_argument("--batch", type=COUNT, default=None,
                   help="samples per rank and step (default: 64, or the --model family's batch)")
    p.add_argument("--model", default=None, help="a model of dgt experiment ddp (resnet-s, resnet, resnet-l, gpt-s, "
                   "gpt, gpt-l, alexnet, vgg11) with its data and optimizer, instead of the example MLP (--hidden)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, gloo first, from {', '.join(MODES)} (default: %(default)s)")
    p.add_argument("--bucket-mb", type=POSITIVE, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--collective", choices=["ring", "ps"], default="ring")
    p.add_argument("--lossy-codec", default="default",
                   help="codec of the lossy mode: 'default' = DGTState() with no options (the README line: "
                   "dgt:idle_p=0.1 with the measuring lossless fallback); a spec such as dgt:p=0.3 forces that codec")
    p.add_argument("--drop", type=number(0.0, 1.0, below=True), default=0.0,
                   help="datagram loss injected at the receivers (lossy mode)")
    p.add_argument("--threads", type=COUNT, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=POSITIVE, default=600.0)


MODES = ("gloo", "dgt_lossless", "dgt_lossy", "fp16", "powersgd")
DEFAULT_MODES = ("gloo", "dgt_lossless", "dgt_lossy")
# as the powersgd arm of dgt experiment ddp, but compressing from the 2nd step: the untimed warm-up steps cover it
POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "use_error_feedback": True, "warm_start": True}


def lo_tx() -> int | None:
    """Bytes the loopback interface has sent in this network namespace (None: not readable)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except OSError:
        pass
    return None


def _model(hidden: int) -> torch.nn.Module:
    """The example's model (examples/ddp_dgt.py), same seed on every rank."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _modes(cfg: dict, rank: int) -> dict[str, dict | None]:
    """The modes ``cfg`` asks for -> their hook options (None: Gloo alone)."""
    drop = {"faults": {"drop_fraction": cfg["drop"], "drop_seed": rank}} if cfg["drop"] else None
    every = {
        "gloo": None,
        "dgt_lossless": {"codec": "dense"},
        "dgt_lossy": {"codec": cfg["lossy_codec"], "transport": drop},
        "fp16": {"torch": "fp16"},
        "powersgd": {"torch": "powersgd"},
    }
    return {m: every[m] for m in cfg["modes"]}


def _build(cfg: dict) -> tuple[torch.nn.Module, Any]:
    """One mode's model (same initial weights in every mode and rank) and its optimizer factory."""
    if cfg["model"]:
        from dgt.experiment.workloads import build_workload

        wl = build_workload(cfg["model"])
        return wl.model, wl.make_optimizer
    return _model(cfg["hidden"]), lambda ps: torch.optim.SGD(ps, lr=0.01)


def _interleaved(modes: dict, step: Any, cfg: dict) -> tuple[dict[str, list[float]], dict[str, int | None]]:
    """The timed steps, in rounds interleaved over the modes (drifting machine load hits every mode alike): per
    mode, its step times and the loopback bytes its steps sent (None where the counter cannot be read)."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {n: [] for n in modes}
    lo: dict[str, int | None] = {n: 0 for n in modes}
    rounds = max(1, cfg["rounds"])
    per_round = max(1, cfg["steps"] // rounds)
    for _ in range(rounds):
        for name in modes:
            dist.barrier()
            tx0 = lo_tx()
            times[name] += [step(name) for _ in range(per_round)]
            dist.barrier()  # every rank's steps are done before the counter is read again
            tx1 = lo_tx()
            prev = lo[name]
            lo[name] = None if prev is None or tx0 is None or tx1 is None else prev + tx1 - tx0
    return times, lo


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    x, y, loss_fn = _data(cfg, gen)
    modes = _modes(cfg, rank)
    out: dict = {"params": sum(p.numel() for p in _build(cfg)[0].parameters())}
    runs = {}
    for name, opts in modes.items():  # every mode's model and state exist side by side
        net, make_opt = _build(cfg)
        ddp = DDP(net, bucket_cap_mb=cfg["bucket_mb"])
        state = _register(ddp, opts, cfg)
        runs[name] = (ddp, state, make_opt(ddp.parameters()), [])

    def step(name: str) -> float:
        ddp, _state, opt, _times = runs[name]
        idx = torch.randint(len(x), (cfg["batch"],), generator=gen)
        t0 = time.perf_counter()
        loss = loss_fn(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        runs[name][3].append(loss.item())
        return time.perf_counter() - t0

    for name in modes:  # untimed: bucket rebuild, dense warm-up, connection set-up
        for _ in range(cfg["warmup"]):
            step(name)
    totals0 = {n: _snapshot(r[1]) for n, r in runs.items() if r[1] is not None}
    times, lo = _interleaved(modes, step, cfg)
    for name, (_ddp, state, _opt, losses) in runs.items():
        out[name] = _mode_result(times[name], losses, lo[name], world, state, totals0.get(name))
    dist.destroy_process_group()
    return out


def _data(cfg: dict, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The training inputs, labels and loss: the model family's (``--model``), else the example's random data."""
    if cfg["model"]:
        from dgt.experiment.workloads import build_workload

        wl0 = build_workload(cfg["model"])
        return wl0.data.x_train, wl0.data.y_train, wl0.loss  # type: ignore[attr-defined]
    x = torch.randn(1024, 64, generator=gen)
    y = torch.randint(10, (1024,), generator=gen)
    return x, y, torch.nn.functional.cross_entropy


def _register(ddp: Any, opts: dict | None, cfg: dict) -> Any:
    """Register the mode's communication hook on ``ddp``: torch's (fp16, PowerSGD) or DGT's; returns the DGT state
    (None for Gloo and torch's hooks)."""
    import dgt.shim

    state = None
    if opts is not None and "torch" in opts:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        if opts["torch"] == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            ddp.register_comm_hook(psgd.PowerSGDState(process_group=None, **POWERSGD), psgd.powerSGD_hook)
    elif opts is not None and opts["codec"] == "default":  # the README line: no options at all
        kw = {"transport": opts["transport"]} if opts.get("transport") else {}
        if cfg["collective"] != "ring":
            kw["collective"] = cfg["collective"]
        state = dgt.shim.DGTState(**kw)
    elif opts is not None:
        state = dgt.shim.DGTState(codec=opts["codec"], collective=cfg["collective"], warmup_iters=1,
                                  transport=opts.get("transport"))
    if state is not None:
        ddp.register_comm_hook(state, dgt.shim.hook)
    return state


def _mode_result(ts: list[float], losses: list[float], lo_total: int | None, world: int, state: Any,
                 t0: dict | None) -> dict:
    """One mode's figures: step times, final loss, loopback bytes and, for a DGT state, its counters over the timed
    steps (``t0``: its totals before them); closes the state."""
    res: dict[str, Any] = {"median": statistics.median(ts), "mean": statistics.fmean(ts), "final_loss": losses[-1],
                           "steps": len(ts)}
    res["lo_tx_bytes_per_rank_step"] = None if lo_total is None else lo_total / world / len(ts)
    if state is not None and t0 is not None:
        t = state.totals
        n = len(ts)
        res["hook_comm_s_per_step"] = (t["seconds"] - t0["seconds"]) / n
        res["dropped_blocks"] = t["dropped"] - t0["dropped"]
        for lane, key in ((0, "reliable"), (1, "droppable")):
            res[f"{key}_bytes_per_step"] = (t["bytes_sent"].get(lane, 0) - t0["bytes_sent"].get(lane, 0)) / n
        if state.chooser is not None:  # which path the default state chose, on what figures
            res["choice"] = state.chooser.summary()
        state.close()
    return res


def _snapshot(state) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.totals.items()}


def run(args: argparse.Namespace) -> dict:
    from dgt.collectives.launch import run_ranks

    cfg = {k: getattr(args, k) for k in ("steps", "rounds", "warmup", "hidden", "batch", "bucket_mb", "collective",
                                         "lossy_codec", "drop", "threads", "model")}
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not names or names[0] != "gloo" or len(set(names)) != len(names) or any(m not in MODES for m in names):
        raise BadOption(f"--modes must start with gloo and name each mode once, from {', '.join(MODES)}: "
                        f"{args.modes!r}")
    cfg["modes"] = names
    from dgt.experiment.workloads import defaults

    if args.model:
        try:
            defaults(args.model)  # an unknown model is a clear error here, not in every rank
        except DgtError as exc:
            raise BadOption(f"--model: {exc}") from None
    if "dgt_lossy" in names and args.lossy_codec != "default":
        codec_spec("--lossy-codec", args.lossy_codec)
    if cfg["batch"] is None:
        cfg["batch"] = defaults(args.model).batch if args.model else 64
    res = run_ranks(_rank, args.world, cfg, timeout=args.timeout, env={"DGT_THREADS": str(args.threads)})
    modes: dict = {}
    for name in names:
        per_rank = [res[r][name] for r in range(args.world)]
        m = {"s_per_step_median": max(p["median"] for p in per_rank),
             "s_per_step_mean": max(p["mean"] for p in per_rank),
             "final_loss_rank0": per_rank[0]["final_loss"],
             "lo_tx_bytes_per_rank_step": per_rank[0]["lo_tx_bytes_per_rank_step"]}
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
        "model": args.model or f"mlp-64-{args.hidden}-{args.hidden}-10",
        "batch": cfg["batch"],
        "params": res[0]["params"],
        "grad_mb": res[0]["params"] * 4 / 1e6,
        "steps": res[0]["gloo"]["steps"],
        "rounds": args.rounds,
        "lossy_codec": args.lossy_codec,
        "drop": args.drop,
        "collective": args.collective,
        "modes": modes,
        "ratios": {f"{name}/gloo": modes[name]["s_per_step_median"] / base for name in names[1:]},
    }
