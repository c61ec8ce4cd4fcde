"""PNG plots of one experiment (matplotlib, Agg): accuracy against training time, the BCT distribution, and the
bytes each protocol put on each lane."""

from __future__ import annotations

import os
from typing import Any

from dgt.experiment.console import MODEL_NAMES

COLORS = {"baseline": "tab:blue", "dgt": "tab:orange"}


def _ok(results: dict[str, Any], model: str) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["model"] == model and r.get("summary")]


def write_plots(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Write the three figures into ``out_dir``; returns {name: file name relative to out_dir}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["config"]["models"]
    return {
        "accuracy_vs_time": _save(_accuracy_figure(plt, results, models), out_dir, "accuracy_vs_time.png"),
        "bct_distribution": _save(_bct_figure(plt, results, models), out_dir, "bct_distribution.png"),
        "bytes_per_lane": _save(_lanes_figure(plt, results, models), out_dir, "bytes_per_lane.png"),
    }


def _accuracy_figure(plt: Any, results: dict[str, Any], models: list[str]) -> Any:
    target = results["config"]["target"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in _ok(results, model):
            xs = [e["train_time"] for e in r["curve"]]
            ys = [e["acc"] for e in r["curve"]]
            ax.plot(xs, ys, marker=".", label=r["protocol"], color=COLORS.get(r["protocol"]))
            if r["summary"]["reached"]:
                ax.axvline(r["summary"]["time_to_target"], color=COLORS.get(r["protocol"]), ls=":", lw=1)
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:g}")
        ax.set(title=MODEL_NAMES.get(model, model), xlabel="training time (s, evaluation excluded)",
               ylabel="test accuracy", ylim=(0, 1))
        ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _bct_figure(plt: Any, results: dict[str, Any], models: list[str]) -> Any:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = _ok(results, model)
        data = [r["bct"][: r["summary"]["iterations"]] for r in runs]
        if data and all(data):
            ax.hist(data, bins=30, label=[r["protocol"] for r in runs], alpha=0.7,
                    color=[COLORS.get(r["protocol"], None) for r in runs])
            for r in runs:
                ax.axvline(r["summary"]["bct_mean"], color=COLORS.get(r["protocol"]), ls="--", lw=1)
        ax.set(title=f"{MODEL_NAMES.get(model, model)}: batch completion time", xlabel="BCT (s)",
               ylabel="iterations")
        ax.legend()
    fig.tight_layout()
    return fig


def _lanes_figure(plt: Any, results: dict[str, Any], models: list[str]) -> Any:
    fig, ax = plt.subplots(figsize=(4 + 3 * len(models), 4.5))
    labels: list[str] = []
    for model in models:
        for r in _ok(results, model):
            labels.append(f"{MODEL_NAMES.get(model, model)}\n{r['protocol']}")
            i = len(labels) - 1
            for dx, key, hatch in ((-0.2, "bytes_per_lane", ""), (0.2, "bytes_delivered_per_lane", "//")):
                lanes = r["summary"].get(key, {})
                tcp, udp = lanes.get("0", 0) / 1e6, lanes.get("1", 0) / 1e6
                ax.bar(i + dx, tcp, width=0.38, color="tab:green", hatch=hatch, edgecolor="black", lw=0.5)
                ax.bar(i + dx, udp, width=0.38, bottom=tcp, color="tab:red", hatch=hatch, edgecolor="black", lw=0.5)
    ax.set_xticks(range(len(labels)), labels)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:green", label="lane 0: TCP, DSCP EF (reliable)"),
                       Patch(color="tab:red", label="lane 1: UDP, DSCP LE (droppable)"),
                       Patch(facecolor="white", edgecolor="black", label="left: sent"),
                       Patch(facecolor="white", edgecolor="black", hatch="//", label="right: delivered")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set(ylabel="MB, all ranks, until the target", title="Bytes per lane")
    fig.tight_layout()
    return fig


def _save(fig: Any, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name
