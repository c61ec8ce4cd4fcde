"""``dgt experiment codecs``: every codec trained through the real transport, one run per codec, each in K OS processes
(:func:`dgt.experiment.launch.launch`), on the digits task of the other experiments, on the network profile of
``dgt experiment ddp`` (:func:`dgt.experiment.ddp_config.profile_network`): netem namespaces as root, else paced
loopback (:mod:`dgt.experiment.network`).

The runs share model, data, shards, seed, learning rate, step count and network; rank 0 prints progress lines, the
parent collects every rank's records and writes ``results.json``, ``report.md`` and one plot (:mod:`codecs_report`).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from dgt.experiment.config import NetworkConfig
from dgt.experiment.ddp_config import PROFILES, profile_network

# name -> (family, codec spec, what it is); LGC's phase lengths are filled in from the run length (lgc_phases)
CODECS: dict[str, tuple[str, str, str]] = {
    "dense": ("ps", "dense", "every gradient over TCP through the parameter server (the baseline)"),
    "dgt": ("ps", "dgt:p=loss,p0=1,alpha=0.3,block=1024", "DGT: unimportant blocks on the droppable lane"),
    "slimdp": ("slim", "slimdp:alpha=0.3,eps=0.15,q=20", "Slim-DP: model server, core + explorer push and pull"),
    "qsgd": ("ps", "qsgd:bits=8,bucket=512,norm=l2", "QSGD 8 bit, bucket 512, l2 norm (Slim-DP's Quant-DP)"),
    "olandraj": ("average", "olandraj:c=6,M=4,F=0.03",
                 "Oland-Raj: one local epoch, then the coded parameters are averaged"),
    "dcd": ("gossip", "dcd:bits=8", "DCD-PSGD, 8-bit differences, ring W = 1/3"),
    "ecd": ("gossip", "ecd:quantizer=fixed,step=0.001", "ECD-PSGD, fixed-step 1e-3 quantizer, ring W = 1/3"),
    "lgc-ps": ("lgc", "lgc:variant=ps", "LGC, parameter-server variant (autoencoder, innovation)"),
    "lgc-ring": ("lgc", "lgc:variant=ring", "LGC, ring all-reduce variant (autoencoder)"),
}
# run only when named in --codecs (not part of the default set, whose table docs/codecs.md reports)
OPT_IN: dict[str, tuple[str, str, str]] = {
    "lowrank": ("lowrank", "lowrank:rank=2",
                "PowerSGD rank 2: P and Q factors on the reliable lane (ring), error feedback, warm start"),
    "lowrank-dgt": ("lowrank", "lowrank:rank=2,residual_p=0.1",
                    "PowerSGD rank 2 + the residual's top 10 % blocks per matrix (DGT's estimator) on the droppable "
                    "lane, the rest in error feedback"),
}
KNOWN: dict[str, tuple[str, str, str]] = {**CODECS, **OPT_IN}


@dataclass
class CodecsConfig:
    """One ``dgt experiment codecs`` run (every codec in ``codecs`` under the same settings)."""

    codecs: list[str] = field(default_factory=lambda: list(CODECS))
    model: str = "alexnet"
    workers: int = 4
    iters: int = 200
    batch: int = 32
    lr: float = 0.05  # the other experiments use 0.1; LGC-ring diverged there (docs/codecs.md)
    seed: int = 0
    target: float = 0.9
    eval_every: int = 10
    deadline: str = "fixed:0.002"
    lgc_warmup: float = 0.2  # share of the steps in LGC's dense warm-up
    lgc_ae: float = 0.2  # share of the steps in LGC's top-k + autoencoder training phase
    lgc_topk: float = 0.01
    profile: str = "priority"  # the network profiles of dgt experiment ddp (netem only; loopback has none)
    network: NetworkConfig = field(default_factory=lambda: NetworkConfig(prefix="dgtc"))
    out_dir: str = "dgt-codecs"
    plots: bool = True
    timeout: float = 600.0  # per codec run
    isolate: bool = True  # every codec in its own processes (False: all codecs in one set of processes, one spawn)

    def __post_init__(self) -> None:
        unknown = [c for c in self.codecs if c not in KNOWN]
        if unknown:
            raise ValueError(f"unknown codecs {unknown}; known: {', '.join(KNOWN)}")
        if not self.codecs:
            raise ValueError("no codecs to run")
        if self.workers < 2 or self.iters < 1 or self.eval_every < 1 or self.batch < 1:
            raise ValueError("need workers >= 2 and positive iters, eval_every, batch")
        if not 0.0 < self.target <= 1.0:
            raise ValueError("target accuracy must be in (0, 1]")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if self.network.mode not in ("auto", "netem", "loopback"):
            raise ValueError("network mode must be auto, netem or loopback")
        if "dense" not in self.codecs:
            raise ValueError("the dense run is the reference of every comparison: keep it in --codecs")

    def lgc_phases(self) -> tuple[int, int]:
        warm = max(1, round(self.lgc_warmup * self.iters))
        return warm, max(1, round(self.lgc_ae * self.iters))

    def spec(self, name: str) -> str:
        family, spec, _ = KNOWN[name]
        if family == "lgc":
            warm, ae = self.lgc_phases()
            spec += f",warmup={warm},ae_iters={ae},topk={self.lgc_topk},seed={self.seed}"
        elif name in ("slimdp", "qsgd", "olandraj", "dcd", "ecd"):
            spec += f",seed={self.seed}"
        return spec

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _describe_network(cfg: CodecsConfig, mode: str) -> str:
    from dgt.experiment.network import Network

    desc = Network(cfg.network, cfg.workers, mode).describe()
    if mode == "loopback" and cfg.profile != "priority":
        desc += f"; the {cfg.profile!r} profile is NOT emulated (netem only)"
    return desc


def run_batch(cfg: CodecsConfig, names: list[str], mode: str, on_progress: Any = None,
              tag: str = "") -> dict[str, dict[str, Any]]:
    """Train the codecs ``names`` one after the other in one set of ``cfg.workers`` processes (each codec in its own
    group) in a fresh network of ``mode``; {name: condensed entry} (see codecs_report.condense). A failing rank fails
    the whole batch."""
    from dgt.experiment.codecs_report import condense
    from dgt.experiment.codecs_worker import CodecsSpec
    from dgt.experiment.launch import launch
    from dgt.experiment.network import Network

    runs = [{"name": n, "family": KNOWN[n][0], "spec": cfg.spec(n), "model": cfg.model, "iters": cfg.iters,
             "batch": cfg.batch, "lr": cfg.lr, "seed": cfg.seed, "eval_every": cfg.eval_every,
             "deadline": cfg.deadline} for n in names]
    spec = CodecsSpec(workers=cfg.workers, runs=runs, wire_if="eth0" if mode == "netem" else None)
    run_dir = os.path.join(cfg.out_dir, "runs", "+".join(names))

    def show(rec: dict[str, Any]) -> None:
        line = on_progress(rec) if on_progress is not None else None
        if line:
            print(line, flush=True)

    t0 = time.monotonic()
    timeout = cfg.timeout * len(names)
    with Network(cfg.network, cfg.workers, mode, tag=tag) as net:
        net.start_cross_traffic(timeout)
        ranks = launch(net, spec, run_dir, show, timeout, module="dgt.experiment.codecs_worker")
        queues = net.counters()
    wall = time.monotonic() - t0
    for r, res in enumerate(ranks):  # the final parameters travel beside the JSON
        for run, final in zip(res["runs"], torch.load(os.path.join(run_dir, f"rank{r}.pt"))):
            run["final"] = final
    out = {}
    for i, (name, run) in enumerate(zip(names, runs)):
        entry = condense(cfg, name, run, [ranks[r]["runs"][i] for r in range(cfg.workers)])
        entry.update(about=KNOWN[name][2], batch_wall_time=wall, batch=names, run_dir=run_dir)
        if queues is not None:
            entry["queues"] = queues  # the server's link, per priority class, over the whole batch
        out[name] = entry
    return out


def run_codecs(cfg: CodecsConfig, on_progress: Any = None, command: str | None = None,
               on_done: Any = None) -> dict[str, Any]:
    """Every codec of ``cfg`` one after the other; writes results.json (after each run), report.md and the plot."""
    from dgt.experiment.codecs_report import headline, write_plot, write_report
    from dgt.experiment.ddp_runner import profile_unsupported
    from dgt.experiment.network import Network, resolve_mode

    cfg = replace(cfg, network=profile_network(cfg.profile, cfg.network))
    mode, why = resolve_mode(cfg.network)  # --network netem without root raises RuntimeError
    os.makedirs(cfg.out_dir, exist_ok=True)
    results: dict[str, Any] = {
        "command": command, "config": cfg.to_dict(), "profile": cfg.profile,
        "profile_description": PROFILES[cfg.profile],
        "network": {"mode": mode, "why_not_netem": why, "description": _describe_network(cfg, mode)},
        "pace_rate": Network(cfg.network, cfg.workers, mode).pace_rate,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {},
    }
    order = ["dense"] + [c for c in cfg.codecs if c != "dense"]  # dense first: the others are measured against it
    batches = [[n] for n in order] if cfg.isolate else [order]
    skipped = profile_unsupported(cfg, mode)  # reads cfg.network only
    if skipped:
        results["skipped"] = f"profile {cfg.profile!r} needs what this kernel lacks: {skipped}"
        batches = []
    for i, names in enumerate(batches):
        try:
            results["runs"].update(run_batch(cfg, names, mode, on_progress, tag=str(i)))
        except Exception as exc:  # one failing codec must not lose the others' results
            for name in names:
                results["runs"][name] = {"error": f"{type(exc).__name__}: {str(exc)[-3000:]}",
                                         "spec": cfg.spec(name), "about": KNOWN[name][2]}
        headline(results)
        _write(cfg, results)
        if on_done is not None:
            for name in names:
                on_done(name, results["runs"][name])
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if cfg.plots:
        results["plot"] = write_plot(results, cfg.out_dir)
    _write(cfg, results)
    write_report(results, os.path.join(cfg.out_dir, "report.md"))
    return results


def _write(cfg: CodecsConfig, results: dict[str, Any]) -> None:
    from dgt.experiment.worker import write_json

    write_json(os.path.join(cfg.out_dir, "results.json"), results, indent=1)
