"""The scaling figure of docs/experiment-ddp.md: step time and bytes per rank and step of every mode of
``dgt bench ddp --json`` against the gradient's size, one line per mode and model family.

    python -m dgt.bench.ddp_scaling resnet-s.json resnet.json resnet-l.json gpt-s.json ... --out scaling.png

Each input is the JSON ``dgt bench ddp --model NAME --json`` printed (text before the first ``{`` is skipped, so a
captured stdout with warnings works). Prints the table the figure shows (markdown) on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dgt.errors import DgtError


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        text = f.read()
    start = text.find("{")
    if start < 0:
        raise DgtError(f"{path}: no JSON object in it")
    try:
        res: dict[str, Any] = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise DgtError(f"{path}: not the JSON of dgt bench ddp: {exc}") from exc
    if res.get("bench") != "ddp" or "modes" not in res:
        raise DgtError(f"{path}: not the output of dgt bench ddp --json")
    return res


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, mode): gradient MB, median step, lo bytes and DGT's own reliable/droppable bytes."""
    out = []
    for res in sorted(results, key=lambda r: (str(r.get("model", "")).split("-")[0], r["grad_mb"])):
        for mode, m in res["modes"].items():
            out.append({"model": res.get("model", "?"), "family": str(res.get("model", "?")).split("-")[0],
                        "grad_mb": res["grad_mb"], "mode": mode, "step_s": m["s_per_step_median"],
                        "lo_bytes": m.get("lo_tx_bytes_per_rank_step"),
                        "dgt_bytes": (m["reliable_bytes_per_step"] + m.get("droppable_bytes_per_step", 0.0)
                                      if "reliable_bytes_per_step" in m else None),
                        "vs_gloo": m["s_per_step_median"] / res["modes"]["gloo"]["s_per_step_median"]})
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| Model | Gradient (MB) | Mode | Median step (s) | Step vs Gloo | lo tx / rank / step (MB) | "
             "DGT lanes / rank / step (MB) |", "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in table:
        lo = "–" if r["lo_bytes"] is None else f"{r['lo_bytes'] / 1e6:.2f}"
        dgt = "–" if r["dgt_bytes"] is None else f"{r['dgt_bytes'] / 1e6:.2f}"
        lines.append(f"| {r['model']} | {r['grad_mb']:.2f} | {r['mode']} | {r['step_s']:.3f} | {r['vs_gloo']:.2f}x | "
                     f"{lo} | {dgt} |")
    return "\n".join(lines)


def plot(table: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"resnet": "-", "gpt": "--"}  # line style per family, colour per mode
    modes = sorted({r["mode"] for r in table})
    colours = {m: f"C{i}" for i, m in enumerate(modes)}
    for key in sorted({(r["family"], r["mode"]) for r in table}):
        pts = sorted((r["grad_mb"], r["step_s"], r["lo_bytes"]) for r in table if (r["family"], r["mode"]) == key)
        label = f"{key[0]} {key[1]}"
        ls = styles.get(key[0], ":")
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=colours[key[1]], marker="o", label=label)
        if all(p[2] is not None for p in pts):
            ax_b.plot([p[0] for p in pts], [p[2] / 1e6 for p in pts], ls, color=colours[key[1]], marker="o",
                      label=label)
    ax_t.set(xscale="log", yscale="log", xlabel="gradient (MB, float32)", ylabel="median step (s)",
             title="step time per mode")
    ax_b.set(xscale="log", yscale="log", xlabel="gradient (MB, float32)", ylabel="loopback tx / rank / step (MB)",
             title="bytes on the wire per mode")
    for ax in (ax_t, ax_b):
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_t.legend(fontsize=7)
    ax_b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.bench.ddp_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="outputs of dgt bench ddp --model NAME --json")
    p.add_argument("--out", default="ddp-scaling.png", help="the figure (default: %(default)s)")
    args = p.parse_args(argv)
    table = rows([load(f) for f in args.files])
    plot(table, args.out)
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
