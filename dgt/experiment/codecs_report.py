"""What ``dgt experiment codecs`` reports: per codec the accuracy, bytes per step, time to the target, and the paper's
own headline measure for that method beside the paper's figure; report.md, one plot, the console table."""

from __future__ import annotations

import os
from typing import Any

import torch

# the paper's headline measure of each method, the figure the paper gives, and its setting (papers/, briefs/)
PAPER: dict[str, dict[str, Any]] = {
    "dgt": {"measure": "BCT reduction vs dense", "unit": "%", "paper": 35.4,
            "setting": "DGT Table 1, AlexNet, 6 GPUs, 1 Gbps, Fashion-MNIST: BCT 36.72 -> 23.71 s"},
    "slimdp": {"measure": "communication time saved vs dense", "unit": "%", "paper": 55.12,
               "setting": "Slim-DP Table 1, GoogLeNet, K=4, ImageNet (alpha 0.3, eps 0.15); top-5 88.29 vs 88.06"},
    "qsgd": {"measure": "communication time saved vs dense", "unit": "%", "paper": 47.85,
             "setting": "Slim-DP Table 1, Quant-DP (QSGD 8 bit, bucket 512), GoogLeNet, K=4; top-5 88.02 vs 88.06"},
    "olandraj": {"measure": "bits per parameter (all metadata)", "unit": "bits", "paper": 3.78,
                 "setting": "Oland-Raj, MNIST MLP 784-392-50-10, c=6, M=4 (8.47x), accuracy at or above baseline"},
    "dcd": {"measure": "payload reduction vs fp32", "unit": "x", "paper": 4.0,
            "setting": "Tang et al. 2018, 8 bit: payload ~4x smaller, convergence per epoch matches all-reduce"},
    "ecd": {"measure": "payload reduction vs fp32", "unit": "x", "paper": 4.0,
            "setting": "Tang et al. 2018, 8 bit: payload ~4x smaller, convergence per epoch matches all-reduce"},
    "lgc-ps": {"measure": "compression ratio, compressed phase", "unit": "x", "paper": 8095.0,
               "setting": "LGC, ResNet101/CIFAR10, 4 nodes, PS: 93.57 % vs 93.75 % baseline"},
    "lgc-ring": {"measure": "compression ratio, compressed phase", "unit": "x", "paper": 2297.0,
                 "setting": "LGC, ResNet101/CIFAR10, 4 nodes, ring all-reduce: 93.07 % vs 93.75 % baseline"},
}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def final_accuracy(cfg: Any, final: torch.Tensor) -> float:
    """Test accuracy of a flat parameter vector on the run's model (evaluated here, in the parent)."""
    from torch.nn.utils import vector_to_parameters

    from dgt.experiment.data import load_dataset
    from dgt.experiment.models import build_model
    from dgt.experiment.worker import evaluate

    data = load_dataset("digits", seed=cfg.seed)
    model = build_model(cfg.model, data.shape, data.num_classes, seed=cfg.seed)
    vector_to_parameters(final.detach().float(), [p for p in model.parameters() if p.requires_grad])
    return evaluate(model, data)


def condense(cfg: Any, name: str, run: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One codec's entry of results.json from its ranks' results."""
    r0 = ranks[0]
    iters = len(r0["records"])
    numel = int(r0["final"].numel())
    family = run["family"]
    # gossip: every node has its own model; the paper judges the average model, as simulate.train_gossip does
    final = torch.stack([r["final"] for r in ranks]).mean(0) if family == "gossip" else r0["final"]
    reach = next((e for e in r0["evals"] if e["acc"] >= cfg.target), None)
    sent = [sum(rec["sent"] for rec in r["records"]) for r in ranks]
    entry: dict[str, Any] = {
        "spec": run["spec"], "family": family, "iterations": iters, "parameters": numel,
        "final_accuracy": final_accuracy(cfg, final),
        "rank0_final_accuracy": r0["evals"][-1]["acc"] if r0["evals"] else None,
        "best_accuracy": max((e["acc"] for e in r0["evals"]), default=None),
        "reached": reach is not None,
        "time_to_target": reach["train_time"] if reach else None,
        "iters_to_target": reach["it"] if reach else None,
        "train_time": r0["train_time"],
        "rank0_wall_time": r0["wall_time"],
        "step_time_mean": _mean([rec["time"] for rec in r0["records"]]),
        "comm_time_mean": _mean([rec["comm"] for rec in r0["records"]]),
        "comm_time_mean_workers": _mean([rec["comm"] for r in ranks[1:] for rec in r["records"]]),
        "bytes_per_step": sum(sent) / max(iters, 1),  # every rank's sends, per training step
        "bytes_per_step_per_rank": [s / max(iters, 1) for s in sent],
        "dense_fp32_bytes": 4 * numel,
        "curve": r0["evals"],
        "paced_connections": [r.get("paced_connections", 0) for r in ranks],  # loopback: TCP sockets capped per rank
    }
    wires = [r.get("wire") for r in ranks]
    if all(wires):  # netem: what each host's interface sent, headers and retransmissions included
        entry["wire_tx_per_step"] = sum(w["tx"] for w in wires) / max(iters, 1)
    if family == "gossip":
        degree = 1 if len(ranks) == 2 else 2
        per_msg = _mean([s / (max(iters, 1) * degree) for s in sent])
        entry["bytes_per_message"] = per_msg
        entry["payload_reduction"] = 4 * numel / per_msg if per_msg else None
    if family == "average":
        bits = [b for r in ranks[1:] for b in r.get("bits_per_param", [])]
        entry["bits_per_param"] = _mean(bits)
        entry["average_every"] = ranks[1].get("every")
    if family in ("ps", "lowrank"):
        entry["dropped_blocks"] = sum(r.get("dropped_blocks", 0) for r in ranks)
        entry["received_blocks"] = sum(r.get("received_blocks", 0) for r in ranks)  # transport blocks, all ranks
    if family in ("slim", "average"):
        entry["lost_codec_blocks"] = sum(r.get("lost_codec_blocks", 0) for r in ranks)
    if family == "lgc":
        entry["lgc"] = _lgc_figures(ranks, numel)
    return entry


def _lgc_figures(ranks: list[dict[str, Any]], numel: int) -> dict[str, Any]:
    """Compressed-phase bytes a worker sent per iteration (rank 1: a worker that is not the PS server) and the ratio
    to its fp32 gradient; the phase lengths."""
    s = ranks[1]["lgc"]
    n = s["iterations"].get("compressed", 0)
    b = sum(s["bytes_sent"].get("compressed", {}).values())
    per_it = b / n if n else None
    return {"iterations": s["iterations"], "compressed_bytes_per_iteration": per_it,
            "compression_ratio": 4 * numel / per_it if per_it else None, "ae_training": s.get("ae_training"),
            "all_ranks_compressed_bytes_per_iteration":
                sum(sum(r["lgc"]["bytes_sent"].get("compressed", {}).values()) for r in ranks) / n if n else None}


def headline(results: dict[str, Any]) -> None:
    """Fill every run's ``headline`` (the paper's own measure, ours beside the paper's) and its ratios to dense."""
    runs = results["runs"]
    dense = runs.get("dense")
    if not dense or "error" in dense:
        return
    for name, r in runs.items():
        if "error" in r:
            continue
        r["bytes_vs_dense"] = r["bytes_per_step"] / dense["bytes_per_step"]
        r["accuracy_gap_vs_dense"] = r["final_accuracy"] - dense["final_accuracy"]
        paper = PAPER.get(name)
        if paper is None:
            continue
        ours: float | None
        if name == "dgt":
            ours = 100 * (1 - r["step_time_mean"] / dense["step_time_mean"])
        elif name in ("slimdp", "qsgd"):
            ours = 100 * (1 - r["comm_time_mean"] / dense["comm_time_mean"])
        elif name == "olandraj":
            ours = r.get("bits_per_param")
        elif name in ("dcd", "ecd"):
            ours = r.get("payload_reduction")
        else:
            ours = r["lgc"]["compression_ratio"]
        r["headline"] = {**paper, "ours": ours}


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{v:.1f} %"
    if unit == "x":
        return f"{v:,.0f}x" if v >= 100 else f"{v:.2f}x"
    return f"{v:.2f}"


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The table of report.md and the console: one row per codec."""
    out = []
    target = results["config"]["target"]
    for name, r in results["runs"].items():
        if "error" in r:
            why = [ln for ln in r["error"].splitlines() if ln.strip()][-1][:90]
            out.append([name, "failed", why, "-", "-", "-", "-", "-", "-"])
            continue
        h = r.get("headline")
        ttt = f"{r['time_to_target']:.1f} s (it {r['iters_to_target']})" if r["reached"] \
            else f"not reached ({target:g}) in {r['train_time']:.1f} s"
        out.append([
            name, f"{100 * r['final_accuracy']:.2f}", ttt, f"{r['bytes_per_step']:,.0f}",
            f"{r.get('bytes_vs_dense', 1.0):.3f}", f"{1e3 * r['step_time_mean']:.1f}",
            h["measure"] if h else ("(reference)" if name == "dense" else "-"),
            _fmt(h["ours"], h["unit"]) if h else "-",
            _fmt(h["paper"], h["unit"]) if h else "-",
        ])
    return out


HEADERS = ["codec", "accuracy %", "time to target (train s)", "bytes/step (all ranks)", "vs dense", "step ms",
           "paper's measure", "ours", "paper"]


def write_report(results: dict[str, Any], path: str) -> None:
    cfg = results["config"]
    lines = [
        "# dgt experiment codecs", "",
        f"Command: `{results.get('command') or '(library call)'}`", "",
        f"Task: digits, {cfg['model']}, {cfg['workers']} worker processes, {cfg['iters']} steps, batch {cfg['batch']} "
        f"per worker, SGD lr {cfg['lr']}, seed {cfg['seed']}; target accuracy {cfg['target']:g}.", "",
        f"Network ({results['network']['mode']}, profile {results['profile']}: {results['profile_description']}): "
        f"{results['network']['description']}"
        + (f" (netem not used: {results['network']['why_not_netem']})" if results['network']['why_not_netem'] else "")
        + ".", "",
        f"Machine: {results['machine']}.", "",
        "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    if results.get("skipped"):
        lines += ["", f"**Skipped**: {results['skipped']}"]
    lines += ["", "Specs and the paper's setting:", ""]
    for name, r in results["runs"].items():
        h = r.get("headline")
        lines.append(f"- `{name}`: `{r.get('spec')}`: {r.get('about', '')}"
                     + (f". Paper: {h['setting']}" if h else "")
                     + (f". **Failed**: {r['error'].splitlines()[0]}" if "error" in r else ""))
    lines += ["", "Accuracy: the final model's test accuracy (gossip: the average of the nodes' models; Slim-DP: the "
              "server's w). Time to target: training time of rank 0 (evaluation excluded) at the first evaluation "
              "at or above the target. Bytes/step: what every rank handed to the transport per training step, summed "
              "over ranks (pushes and pulls). Step ms: mean wall time of rank 0's steps (compute + communication). "
              "Communication time saved: 1 - (rank 0's mean time in the collective) / dense's.", ""]
    wired = {n: r for n, r in results["runs"].items() if r.get("wire_tx_per_step") is not None}
    if wired:
        lines += ["On the wire (netem: every host's eth0, headers and retransmissions included), and the server "
                  "link's queues (bytes / drops per class, into the server) over the codec's processes: its own run, "
                  "or every codec's with --shared-processes:", ""]
        for name, r in wired.items():
            q = (r.get("queues") or {}).get("into_server", {})
            cls = ", ".join(f"{c} {v['bytes']:,} B / {v['drops']} drops" for c, v in q.items() if v["bytes"])
            lines.append(f"- `{name}`: {r['wire_tx_per_step']:,.0f} B/step; {cls or 'no counters'}")
        lines.append("")
    dense = results["runs"].get("dense", {})
    if dense.get("comm_time_mean") and results.get("pace_rate"):
        # rank 0 is the PS server: per step it receives K-1 fp32 pushes and sends K-1 fp32 pulls, over K-1 links
        per_link = 8 * dense["bytes_per_step_per_rank"][0] / (cfg["workers"] - 1) / dense["comm_time_mean"]
        lines += [f"Pacing check: dense's server sent {per_link / 1e6:.1f} Mbit/s per link while communicating; the "
                  f"configured pace is {8 * results['pace_rate'] / 1e6:.1f} Mbit/s per connection. The transport "
                  "paces its UDP lanes itself; TCP is paced by the kernel (SO_MAX_PACING_RATE), and where the first "
                  "figure is well above the second that did not hold, so codecs that use only TCP are favoured.", ""]
    if results.get("plot"):
        lines.append(f"![accuracy and bytes]({results['plot']})")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(results: dict[str, Any], out_dir: str) -> str:
    """One PNG: test accuracy against training time per codec, and bytes per step (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in results["runs"].items() if "error" not in r}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in ok.items():
        ax1.plot([e["train_time"] for e in r["curve"]], [e["acc"] for e in r["curve"]], label=name, lw=1.2)
    ax1.axhline(results["config"]["target"], color="grey", ls=":", lw=1)
    ax1.set_xlabel("training time of rank 0, s (evaluation excluded)")
    ax1.set_ylabel("test accuracy")
    ax1.legend(fontsize=8)
    names = list(ok)
    ax2.barh(names, [ok[n]["bytes_per_step"] for n in names], color="tab:blue")
    ax2.set_xscale("log")
    ax2.set_xlabel("bytes per step, all ranks (log)")
    ax2.invert_yaxis()
    fig.suptitle(f"dgt experiment codecs: digits, {results['config']['model']}, {results['config']['workers']} "
                 f"workers, {results['config']['iters']} steps")
    fig.tight_layout()
    name = "codecs.png"
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    plt.close(fig)
    return name


def console_table(results: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="dgt experiment codecs")
    for h in HEADERS:
        t.add_column(h, justify="left" if h in ("codec", "paper's measure") else "right")
    for row in rows(results):
        t.add_row(*row)
    return t
