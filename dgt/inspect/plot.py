"""Timeline plot of a summary: throughput per lane and goodput over time, with dropped blocks and late frames below,
so bursts of loss can be lined up with what each lane was carrying at the time."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_timeline(summary: dict, out: str) -> str:
    """Write a PNG (or any format matplotlib infers from ``out``) and return its path."""
    tl = summary["timeline"]
    bin_s = tl["bin_s"]
    x = np.arange(tl["bins"]) * bin_s
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw=dict(height_ratios=[3, 1]))
    for lane, v in tl["lanes"].items():
        proto = summary["lanes"].get(lane, {}).get("transport", "")
        top.step(x, np.asarray(v["wire_bytes"]) * 8 / bin_s / 1e6, where="post", label=f"lane {lane} ({proto}) wire")
    top.step(x, np.asarray(tl["goodput_bps"]) / 1e6, where="post", color="black", linestyle="--", label="goodput")
    top.set_ylabel("Mbit/s")
    top.legend(loc="upper right", fontsize="small")
    top.set_title(f"DGT timeline: {summary.get('file') or 'capture'}")
    bottom.bar(x, tl["drops"], width=bin_s, align="edge", color="tab:red", label="dropped blocks")
    bottom.bar(
        x, tl["late_frames"], width=bin_s, align="edge", bottom=tl["drops"], color="tab:orange", label="late frames"
    )
    bottom.set_ylabel("count")
    bottom.set_xlabel(f"seconds since first packet (bins of {bin_s:g} s)")
    bottom.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
