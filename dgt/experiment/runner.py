"""Table 1 end to end: for each model, train with the baseline then with DGT under identical seeds, data and
network; summarise, compare, and write results.json, the markdown report and the plots."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch

from dgt.experiment.config import ExperimentConfig
from dgt.experiment.console import Reporter
from dgt.experiment.data import load_dataset
from dgt.experiment.launch import RunFailed, launch
from dgt.experiment.load import LoadMeter
from dgt.experiment.metrics import compare, cross_flow, summarize
from dgt.experiment.models import build_model, describe
from dgt.experiment.network import Network, resolve_mode
from dgt.experiment.worker import write_json


def hard_timeout(cfg: ExperimentConfig) -> float:
    """Kill a run after this long: its training budget, evaluation pauses, and start-up on a loaded machine."""
    return 2.0 * cfg.max_time + 180.0


def run_experiment(cfg: ExperimentConfig, reporter: Reporter | None = None,
                   command: str | None = None) -> dict[str, Any]:
    """Run every (model, protocol) pair; returns the results dict also written to ``cfg.out_dir/results.json``."""
    ui = reporter or Reporter(quiet=True)
    mode, why = resolve_mode(cfg.network)
    os.makedirs(cfg.out_dir, exist_ok=True)
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.limit_train, cfg.limit_test)
    net_probe = Network(cfg.network, cfg.workers, mode)
    results: dict[str, Any] = {
        "command": command,
        "config": cfg.to_dict(),
        "network": {"mode": mode, "why_not_netem": why, "description": net_probe.describe(),
                    "shared_budget": net_probe.budget()},
        "dataset": data.describe(),
        "models": {m: describe(build_model(m, data.shape, data.num_classes, cfg.width)) for m in cfg.models},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [],
        "comparisons": {},
    }
    ui.note(f"[bold]network:[/bold] {results['network']['description']}"
            + (f"  [dim](netem unavailable: {why})[/dim]" if why and cfg.network.mode != "loopback" else ""))
    t0 = time.monotonic()
    for model in cfg.models:
        for i, protocol in enumerate(cfg.protocols):
            results["runs"].append(_one_run(cfg, model, protocol, mode, i, ui))
            _write(cfg, results)
        by = {r["protocol"]: r.get("summary") for r in results["runs"] if r["model"] == model}
        if by.get("baseline") and by.get("dgt"):
            results["comparisons"][model] = compare(by["baseline"], by["dgt"])
    results["elapsed"] = time.monotonic() - t0
    if cfg.plots:
        from dgt.experiment.plots import write_plots

        results["plots"] = write_plots(results, cfg.out_dir)
    _write(cfg, results)
    from dgt.experiment.report import write_report

    write_report(results, os.path.join(cfg.out_dir, "report.md"))
    return results


def _one_run(cfg: ExperimentConfig, model: str, protocol: str, mode: str, index: int,
             ui: Reporter) -> dict[str, Any]:
    run_dir = os.path.join(cfg.out_dir, model, protocol)
    spec = cfg.run_spec(model, protocol, run_dir)
    entry: dict[str, Any] = {"model": model, "protocol": protocol, "codec": spec.codec, "run_dir": run_dir}
    ui.start_run(model, protocol, cfg.max_iters)
    started = time.monotonic()
    meter = LoadMeter()
    try:
        with Network(cfg.network, cfg.workers, mode, tag=str(index)) as net:
            net.start_cross_traffic(hard_timeout(cfg))
            ranks = launch(net, spec, run_dir, ui.update, hard_timeout(cfg))
            try:
                flow = net.stop_cross_traffic()
            except RuntimeError as exc:  # the cross flow's processes failed: the run itself stands
                flow, entry["cross_flow_error"] = None, str(exc)
            entry["queues"] = net.counters()
            entry["load"] = meter.stop()
    except (RunFailed, OSError, RuntimeError) as exc:
        entry["error"] = str(exc)
        ui.end_run(error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return entry
    summary = summarize(ranks, cfg.target)
    summary["run_wall_time"] = time.monotonic() - started
    if flow is not None:
        summary["cross_flow"] = cross_flow(flow, ranks[0]["records"], summary["iterations"], cfg.network.cross_proto,
                                           cfg.network.cross_traffic)
    entry["summary"] = summary
    r0 = ranks[0]
    entry["curve"] = r0["evals"]
    entry["bct"] = [rec["bct"] for rec in r0["records"]]
    entry["p"] = [rec["p"] for rec in r0["records"]]
    entry["loss"] = [rec["loss"] for rec in r0["records"]]
    entry["transport"] = [rk["transport"] for rk in ranks]
    ui.end_run(summary)
    return entry


def _write(cfg: ExperimentConfig, results: dict[str, Any]) -> None:
    write_json(os.path.join(cfg.out_dir, "results.json"), results, indent=1)
