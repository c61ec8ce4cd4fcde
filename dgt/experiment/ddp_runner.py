"""`dgt experiment ddp` end to end: each arm trains the same model, data and seed with a plain DDP trainer in K
processes on the profile's network, once per seed; summarise each run, aggregate each arm over the seeds
(ddp_stats), compare medians with Gloo and the best torch arm, write results.json, report.md and the accuracy-vs-time
plot."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from dgt.experiment.console import Reporter
from dgt.experiment.ddp_config import ARMS, PROFILES, DDPConfig, profile_network
from dgt.experiment.ddp_stats import aggregate, best_torch, nearest_rank, ratios
from dgt.experiment.launch import RunFailed, launch
from dgt.experiment.models import describe
from dgt.experiment.network import Network, resolve_mode
from dgt.experiment.worker import write_json
from dgt.experiment.workloads import build_workload, reached


def hard_timeout(cfg: DDPConfig) -> float:
    return 2.0 * cfg.max_time + 180.0


def profile_unsupported(cfg: DDPConfig, mode: str) -> str | None:
    """Why the profile's network cannot be built here (None: it can). Asks the topology itself, so a delay line
    that does not need sch_netem makes `wan` run as soon as the topology supports it."""
    if mode != "netem":
        return None
    net = cfg.network
    if not (net.delay or net.loss):
        return None
    from dgt.errors import EmulationUnsupported
    from dgt.netem import Topology

    topo = Topology(hosts=2, rate=net.rate, limit=net.queue_limit, priority=net.priority, loss=net.loss or None,
                    delay=net.delay, prefix=net.prefix)
    try:
        topo.check_kernel()
    except EmulationUnsupported as exc:
        return str(exc)
    return None


def run_ddp(cfg: DDPConfig, reporter: Reporter | None = None, command: str | None = None) -> dict[str, Any]:
    """Run every arm of ``cfg`` once per seed (seed by seed, every arm within a seed); returns the results dict also
    written to ``cfg.out_dir/results.json``: ``runs`` (one entry per seed and arm), ``stats`` (per arm, over the seeds)
    and ``ratios`` (medians)."""
    ui = reporter or Reporter(quiet=True)
    cfg = replace(cfg, network=profile_network(cfg.profile, cfg.network))
    mode, why = resolve_mode(cfg.network)
    os.makedirs(cfg.out_dir, exist_ok=True)
    seeds = cfg.seed_list()
    # what the report describes (model, data, optimizer); each run's workers build theirs with the run's seed
    wl = build_workload(cfg.model, cfg.dataset, cfg.data_dir, seeds[0], cfg.width, cfg.lr, cfg.momentum)
    net_desc = Network(cfg.network, cfg.workers, mode).describe() if mode == "netem" else (
        "loopback: all ranks on 127.0.0.1, nothing shaped (torch's Gloo sockets cannot be paced from outside), "
        f"so the {cfg.profile!r} profile is NOT emulated; run as root for the netem profiles")
    results: dict[str, Any] = {
        "experiment": "ddp", "command": command, "config": cfg.to_dict(), "profile": cfg.profile,
        "profile_description": PROFILES[cfg.profile],
        "network": {"mode": mode, "why_not_netem": why, "description": net_desc},
        "dataset": wl.data.describe(), "model": describe(wl.model),
        "workload": {"family": wl.family, "optimizer": wl.optimizer_name, "metric": wl.metric},
        "arms": {a: ARMS[a] for a in cfg.arms},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "seeds": seeds, "runs": [], "stats": {}, "ratios": {},
        "best_torch": None,
    }
    ui.note(f"[bold]profile {cfg.profile}:[/bold] {net_desc}")
    skipped = profile_unsupported(cfg, mode)
    if skipped:
        results["skipped"] = f"profile {cfg.profile!r} needs what this kernel lacks: {skipped}"
        ui.note(f"[yellow]skipped:[/yellow] {results['skipped']}")
    t0 = time.monotonic()
    jobs = [] if skipped else [(seed, arm) for seed in seeds for arm in cfg.arms]
    for i, (seed, arm) in enumerate(jobs):
        results["runs"].append(_one_arm(cfg, arm, mode, i, ui, seed, per_seed_dirs=len(seeds) > 1))
        _write(cfg, results)
    results["stats"] = aggregate(results["runs"])
    results["ratios"] = ratios(results["stats"])
    results["best_torch"] = best_torch(results["stats"])
    results["elapsed"] = time.monotonic() - t0
    if cfg.plots and results["runs"]:
        results["plots"] = {"accuracy_vs_time": write_plot(results, cfg.out_dir)}
    _write(cfg, results)
    from dgt.experiment.ddp_report import write_report

    write_report(results, os.path.join(cfg.out_dir, "report.md"))
    return results


def _one_arm(cfg: DDPConfig, arm: str, mode: str, index: int, ui: Reporter, seed: int,
             per_seed_dirs: bool) -> dict[str, Any]:
    """One arm with one seed, in ``out_dir/seedS/ARM`` (several seeds) or ``out_dir/ARM`` (one seed, as before)."""
    run_dir = os.path.join(cfg.out_dir, f"seed{seed}", arm) if per_seed_dirs else os.path.join(cfg.out_dir, arm)
    spec = cfg.spec(arm, run_dir, wire_if="eth0" if mode == "netem" else None, seed=seed)
    entry: dict[str, Any] = {"arm": arm, "seed": seed, "run_dir": run_dir}
    ui.start_run(cfg.model, f"{arm} seed {seed}" if per_seed_dirs else arm, cfg.max_iters)
    started = time.monotonic()
    try:
        with Network(cfg.network, cfg.workers, mode, tag=str(index)) as net:
            net.start_cross_traffic(hard_timeout(cfg))
            ranks = launch(net, spec, run_dir, ui.update, hard_timeout(cfg), module="dgt.experiment.ddp_worker")
            entry["queues"] = net.counters()
    except (RunFailed, OSError, RuntimeError) as exc:
        entry["error"] = str(exc)
        ui.end_run(error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return entry
    metric = metric_of(cfg)
    entry["summary"] = summarize(ranks, cfg.target, metric)
    entry["summary"]["run_wall_time"] = time.monotonic() - started
    entry["curve"] = [{k: e[k] for k in ("it", "train_time", metric)} for e in ranks[0]["evals"]]
    entry["steps"] = ranks[0]["steps"]
    entry["dgt"] = [r["dgt"] for r in ranks]
    entry["hook"] = [r.get("hook") for r in ranks]  # torch's PowerSGD counters (None for the other arms)
    ui.end_run(entry["summary"])
    return entry


def metric_of(cfg: DDPConfig) -> str:
    """The evaluation metric of ``cfg``'s model family: "acc" or "val_loss"."""
    from dgt.experiment.workloads import defaults

    return defaults(cfg.model).metric


def summarize(ranks: list[dict[str, Any]], target: float, metric: str = "acc") -> dict[str, Any]:
    """Rank 0's times up to the first evaluation that reaches ``target`` (accuracy at or above it, a validation
    loss at or below it; the whole run when never reached); wire bytes per rank and step up to the same point;
    DGT's own counters over the whole run."""
    r0 = ranks[0]
    hit = next((e for e in r0["evals"] if reached(metric, e[metric], target)), None)
    upto = hit or (r0["evals"][-1] if r0["evals"] else {"it": len(r0["steps"]), "train_time": r0["train_time"]})
    n = upto["it"]
    steps = r0["steps"][:n]
    wires = [next((e["wire"] for e in r["evals"] if e["it"] == n), None) for r in ranks]
    tx = [w["tx"] for w in wires if w]
    lanes: dict[str, int] = {}
    for r in ranks:
        for lane, b in r["dgt"].get("lanes", {}).items():
            lanes[lane] = lanes.get(lane, 0) + b
    run_steps = sum(len(r["steps"]) for r in ranks)
    return {
        "reached": hit is not None,
        "time_to_target": hit["train_time"] if hit else None,
        "iterations": n,
        "iterations_run": len(r0["steps"]),
        "train_time": upto["train_time"],
        "step_mean": statistics.fmean(steps) if steps else None,
        "step_p95": nearest_rank(steps, 0.95) if steps else None,
        "step_median": statistics.median(steps) if steps else None,
        "metric": metric,
        f"final_{metric}": r0["evals"][-1][metric] if r0["evals"] else None,
        "wire_tx_per_rank_step": statistics.fmean(tx) / n if tx and n else None,
        "dgt_lane_bytes_per_rank_step": {k: v / run_steps for k, v in lanes.items()} if lanes else None,
        "dgt_dropped_blocks": sum(r["dgt"].get("dropped", 0) for r in ranks),
        "dgt_blocks": sum(r["dgt"].get("blocks", 0) for r in ranks),
        "stop_reason": r0["stop_reason"],
    }


def write_plot(results: dict[str, Any], out_dir: str) -> str:
    """Test accuracy (or gpt's validation loss) against training time, every arm on one chart (one colour per arm,
    one line per seed); returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = results["config"]["target"]
    metric = results.get("workload", {}).get("metric", "acc")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[str, Any] = {}
    for r in results["runs"]:
        if not r.get("summary"):
            continue
        first = r["arm"] not in colours
        line, = ax.plot([e["train_time"] for e in r["curve"]], [e[metric] for e in r["curve"]], marker=".",
                        label=r["arm"] if first else None, color=colours.get(r["arm"]))
        colours.setdefault(r["arm"], line.get_color())
        if r["summary"]["reached"]:
            ax.axvline(r["summary"]["time_to_target"], color=line.get_color(), ls=":", lw=1)
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
    seeds = results.get("seeds") or [results["config"]["seed"]]
    ax.set(title=f"DDP {results['config']['model']}, {results['config']['workers']} workers, profile "
                 f"{results['profile']}, seed{'s' if len(seeds) > 1 else ''} {','.join(map(str, seeds))} "
                 f"({results['network']['mode']})", xlabel="training time (s, evaluation excluded)",
           ylabel="validation loss (nats/byte)" if metric == "val_loss" else "test accuracy")
    if metric != "val_loss":
        ax.set_ylim(0, 1)
    ax.legend(loc="upper right" if metric == "val_loss" else "lower right")
    fig.tight_layout()
    name = "accuracy_vs_time.png"
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name


def _write(cfg: DDPConfig, results: dict[str, Any]) -> None:
    write_json(os.path.join(cfg.out_dir, "results.json"), results, indent=1)
