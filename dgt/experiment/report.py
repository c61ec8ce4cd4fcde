"""The markdown report of one experiment: setup, the measured Table 1 beside the paper's, traffic and queues."""

from __future__ import annotations

from typing import Any

from dgt.experiment.console import MODEL_NAMES, PAPER, fmt_bytes, pct, unimportant_cell
from dgt.experiment.metrics import reduction


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render(results: dict[str, Any]) -> str:
    lines = _setup(results) + _results_table(results) + _traffic_table(results) + _comparison(results) \
        + _queues_and_plots(results)
    return "\n".join(lines)


def _setup(results: dict[str, Any]) -> list[str]:
    cfg = results["config"]
    net = results["network"]
    server = "sharded over all ranks" if cfg["server"] == "sharded" else f"rank {cfg['server']}"
    pull = "through the codec (lossy lanes too)" if cfg["lossy_pull"] else "reliable"
    lines = [
        "# DGT Table 1 reproduction (emulated)",
        "",
        f"Started {results.get('started', '?')}; finished in {results.get('elapsed', 0):.0f} s.",
    ]
    if results.get("command"):
        lines += ["", "Command:", "", "```sh", results["command"], "```"]
    lines += [
        "",
        "## Setup",
        "",
        f"- **Network ({net['mode']})**: {net['description']}."
        + (f" Netem was not used: {net['why_not_netem']}." if net.get("why_not_netem") else ""),
        f"- **Data**: {results['dataset']['name']}, {results['dataset']['train']} training / "
        f"{results['dataset']['test']} test images {results['dataset']['shape']}, split over {cfg['workers']} workers.",
        f"- **Training**: SGD lr {cfg['lr']}, momentum {cfg['momentum']}, batch {cfg['batch']} per worker, seed "
        f"{cfg['seed']}; test accuracy every {cfg['eval_every']} iterations (evaluation time excluded from training "
        f"time); target accuracy {cfg['target']:g}; budget {cfg['max_iters']} iterations / {cfg['max_time']:g} s.",
        f"- **Collective**: parameter server ({server}), pull {pull}; deadline "
        f"`{cfg['deadline']}` after the last important block.",
        f"- **Protocols**: baseline `{cfg['codecs']['baseline']}` (every block over TCP), DGT "
        f"`{cfg['codecs']['dgt']}` (important blocks TCP/EF, the rest UDP/LE).",
    ]
    for m, d in results["models"].items():
        lines.append(f"- **{MODEL_NAMES.get(m, m)}**: {d['parameters']:,} parameters in {d['tensors']} tensors, "
                     f"{fmt_bytes(d['gradient_bytes'])} of gradient per worker per iteration.")
    return lines


def _results_table(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines += ["", "## Results", "",
              _row(["Model", "Protocol", "BCT (s)", "Total Iters", "Total Time (s)", "TCP bytes", "UDP bytes",
                    "Unimportant blocks: delivered / lost / held back", "Mean p", "BCT p95 (s)", "Compute (s)",
                    "Reached"]),
              _row(["---"] * 2 + ["---:"] * 10)]
    for r in results["runs"]:
        s = r.get("summary")
        name = MODEL_NAMES.get(r["model"], r["model"])
        if s is None:
            lines.append(_row([name, r["protocol"], "failed: " + r.get("error", "?").splitlines()[0]] + [""] * 9))
            continue
        lanes = s["bytes_per_lane"]
        lines.append(_row([
            name, r["protocol"], f"{s['bct_mean']:.3f}", str(s["iterations"]),
            f"{s['time_to_target']:.1f}" if s["reached"] else f"not reached (>{s['train_time']:.1f})",
            fmt_bytes(lanes.get("0", 0)), fmt_bytes(lanes.get("1", 0)),
            unimportant_cell(s, counts=True), f"{s['p_mean']:.2f}", f"{s['bct_p95']:.3f}",
            f"{s['compute_mean']:.3f}", "yes" if s["reached"] else "no",
        ]))
    return lines


def _traffic_table(results: dict[str, Any]) -> list[str]:
    """Notes on load and accounting, then the traffic sent and delivered per lane."""
    lines: list[str] = []
    loads = [(r, r["load"]) for r in results["runs"] if r.get("load") and r["load"].get("other_cores") is not None]
    if loads:
        lines += ["", "Other load on the machine during each run (average cores busy with processes outside the "
                  "experiment, kernel network work included; the machine has "
                  f"{results['machine']['cpus']} cores): "
                  + ", ".join(f"{MODEL_NAMES.get(r['model'], r['model'])} {r['protocol']} {ld['other_cores']:.2f}"
                              for r, ld in loads) + "."]
    lines += ["", "BCT and Compute are rank 0's means per iteration until the target (Compute: forward, backward and "
              "optimizer step; the rest of the BCT is communication). A compute time well above the other runs' "
              "means the machine was busy with something else during that run.", "",
              "Bytes are what all ranks handed to each lane (push and pull) until the target was reached. The "
              "unimportant blocks (1024 elements each, every receiver, push and pull, until the target) were "
              "delivered before their round closed, lost (sent, given up on at the deadline) or held back: never "
              "sent, because the sender's send budget (what the congestion controller's rate can deliver before "
              "the round closes) kept them back. Error feedback carries lost and held-back blocks into a later "
              "round." + _held_back_note(results), "",
              "Traffic until the target, sent -> delivered (frame headers included in delivered):", "",
              _row(["Model", "Protocol", "TCP sent", "TCP delivered", "UDP sent", "UDP delivered",
                    "UDP blocks delivered/(delivered+lost)", "Held back (send budget)", "Delivered per iteration"]),
              _row(["---"] * 2 + ["---:"] * 7)]
    for r in results["runs"]:
        s = r.get("summary")
        if s is None:
            continue
        sent, got = s["bytes_per_lane"], s.get("bytes_delivered_per_lane", {})
        lines.append(_row([MODEL_NAMES.get(r["model"], r["model"]), r["protocol"], fmt_bytes(sent.get("0", 0)),
                           fmt_bytes(got.get("0", 0)), fmt_bytes(sent.get("1", 0)), fmt_bytes(got.get("1", 0)),
                           pct(s.get("udp_block_delivery")), fmt_bytes(s.get("bytes_unsent", 0)),
                           fmt_bytes(s.get("delivered_per_iteration", 0))]))
    lines += _lane_lines(results)
    return lines


def _held_back_note(results: dict[str, Any]) -> str:
    """One sentence per run that held back unimportant blocks: how many, and their bytes beside the TCP lane's."""
    out = []
    for r in results["runs"]:
        s = r.get("summary") or {}
        u = s.get("unimportant_blocks") or {}
        if u.get("held_back"):
            tcp = s["bytes_per_lane"].get("0", 0)
            out.append(f" {MODEL_NAMES.get(r['model'], r['model'])} {r['protocol']}: {u['held_back']:,} of "
                       f"{u['total']:,} unimportant blocks ({fmt_bytes(s.get('bytes_unsent', 0))}, against "
                       f"{fmt_bytes(tcp)} sent over TCP) were held back and never sent.")
    return "".join(out)


def _comparison(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines += ["", "## DGT against the baseline, beside the paper", "",
              _row(["Model", "BCT reduction", "paper", "Time-to-target reduction", "paper", "Iterations", "paper"]),
              _row(["---"] + ["---:"] * 6)]
    for m, c in results["comparisons"].items():
        p = PAPER.get(m)
        pb = pct(reduction(p["baseline"]["bct"], p["dgt"]["bct"])) if p else "-"
        pt = pct(reduction(p["baseline"]["time"], p["dgt"]["time"])) if p else "-"
        pi = f"{100 * (p['dgt']['iters'] / p['baseline']['iters'] - 1):+.0f}%" if p else "-"
        inc = "-" if c["iteration_increase"] is None else f"{100 * c['iteration_increase']:+.0f}%"
        lines.append(_row([MODEL_NAMES.get(m, m), pct(c["bct_reduction"]), pb, pct(c["time_reduction"]), pt, inc,
                           pi]))
    lines += ["", "The paper (6 GTX 1080 Ti, 1 Gbps, Fashion-MNIST, target 0.8): AlexNet BCT 36.72 -> 23.71 s, "
              "1300 -> 1700 iterations, 47494 -> 40314 s; VGG-11 BCT 105.34 -> 73.75 s, 420 -> 490 iterations, "
              "44246 -> 36141 s.", ""]
    lines += _cross_flow_lines(results)
    return lines


def _queues_and_plots(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    queues = [(r, r.get("queues")) for r in results["runs"] if r.get("queues")]
    fifo = [(r, q) for r, q in queues if any("FIFO" in cls for cls in q.values())]
    if fifo:
        lines += ["## The server's link (its one FIFO queue, whole run; cross traffic included)", "",
                  _row(["Model", "Protocol", "Direction", "Bytes", "Packets", "Drops"]),
                  _row(["---"] * 3 + ["---:"] * 3)]
        for r, q in fifo:
            for way, cls in q.items():
                c = cls.get("FIFO", {})
                lines.append(_row([MODEL_NAMES.get(r["model"], r["model"]), r["protocol"], way.replace("_", " "),
                                   fmt_bytes(c.get("bytes", 0)), str(c.get("packets", 0)), str(c.get("drops", 0))]))
        lines.append("")
        queues = [(r, q) for r, q in queues if (r, q) not in fifo]
    if queues:
        lines += ["## The server's link (HTB class counters, whole run)", "",
                  _row(["Model", "Protocol", "Direction", "EF bytes", "EF drops", "BE bytes", "LE bytes", "LE drops"]),
                  _row(["---"] * 3 + ["---:"] * 5)]
        for r, q in queues:
            for way, cls in q.items():
                ef, be, le = (cls.get(c, {}) for c in ("EF", "BE", "LE"))
                lines.append(_row([
                    MODEL_NAMES.get(r["model"], r["model"]), r["protocol"], way.replace("_", " "),
                    fmt_bytes(ef.get("bytes", 0)), str(ef.get("drops", 0)), fmt_bytes(be.get("bytes", 0)),
                    fmt_bytes(le.get("bytes", 0)), str(le.get("drops", 0)),
                ]))
        lines.append("")
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{name}]({path})" for name, path in results["plots"].items()] + [""]
    return lines


def _lane_lines(results: dict[str, Any]) -> list[str]:
    """Per lane, whole run, all ranks (the endpoints' counters): sent, delivered, unsent and lost."""
    rows = [(r, r["summary"].get("transport_lanes") or {}) for r in results["runs"] if r.get("summary")]
    if not any(lanes for _, lanes in rows):
        return []
    lines = ["", "Per lane, whole run, all ranks (the endpoints' counters): bytes sent and received (frame headers "
             "included), and 1024-element blocks of DGT rounds: delivered before their round closed, held back "
             "(never sent: kept back by the send budget) and lost (sent, reported missing), both carried on by "
             "error feedback; abandoned datagrams were not sent because their round had already closed. The "
             "baseline's dense gradients travel as bulk messages, not rounds of blocks, so its block counts are 0.", "",
             _row(["Model", "Protocol", "Lane", "Sent", "Received", "Blocks delivered", "Blocks held back",
                   "Blocks lost", "Datagrams abandoned"]),
             _row(["---"] * 3 + ["---:"] * 6)]
    for r, lanes in rows:
        for lane, c in sorted(lanes.items()):
            lines.append(_row([MODEL_NAMES.get(r["model"], r["model"]), r["protocol"], lane,
                               fmt_bytes(c.get("tx_bytes", 0)), fmt_bytes(c.get("rx_bytes", 0)),
                               str(c.get("delivered_blocks", 0)), str(c.get("tx_unsent_blocks", 0)),
                               str(c.get("tx_lost_blocks", 0)), str(c.get("tx_abandoned", 0))]))
    return lines


def _mbit(bps: float | None) -> str:
    return "-" if bps is None else f"{bps / 1e6:.2f}"


def _cross_flow_lines(results: dict[str, Any]) -> list[str]:
    """The cross flow beside each run (goodput during the training iterations, whole flow) and DGT / baseline."""
    rows = [(r, r["summary"]["cross_flow"]) for r in results["runs"] if (r.get("summary") or {}).get("cross_flow")]
    errors = [r for r in results["runs"] if r.get("cross_flow_error")]
    if not rows and not errors:
        return []
    cfg = results["config"]["network"]
    lines = ["## Cross traffic beside each run", "",
             f"A {cfg['cross_proto'].upper()} flow "
             + ("not paced" if cfg["cross_traffic"] == "unpaced" else f"paced to {cfg['cross_traffic']}")
             + f" (DSCP {cfg['cross_dscp']}) from an "
             "extra host into the server's link, started before the ranks and stopped after them. Goodput is "
             "measured at its sink: during rank 0's training iterations until the target (the BCT windows; "
             "start-up and evaluation pauses, when the link is idle, excluded) and over the whole flow.", "",
             _row(["Model", "Protocol", "Goodput during training (Mbit/s)", "Whole flow (Mbit/s)", "Sent",
                   "Received", "Spans the run"]),
             _row(["---"] * 2 + ["---:"] * 4 + ["---"])]
    for r, cf in rows:
        spans = "-" if cf.get("spans_run") is None else ("yes" if cf["spans_run"] else "no")
        lines.append(_row([MODEL_NAMES.get(r["model"], r["model"]), r["protocol"],
                           _mbit(cf.get("goodput_training_bps")), _mbit(cf.get("goodput_flow_bps")),
                           fmt_bytes(cf.get("sent_bytes", 0)), fmt_bytes(cf.get("received_bytes", 0)), spans]))
    for r in errors:
        lines.append(_row([MODEL_NAMES.get(r["model"], r["model"]), r["protocol"],
                           "failed: " + r["cross_flow_error"].splitlines()[0]] + [""] * 4))
    for m, c in results["comparisons"].items():
        if c.get("cross_goodput_ratio") is not None:
            lines += ["", f"{MODEL_NAMES.get(m, m)}: the cross flow got {c['cross_goodput_ratio']:.2f}x the goodput "
                      "beside DGT that it got beside the baseline."]
    return lines + [""]


def write_report(results: dict[str, Any], path: str) -> str:
    with open(path, "w") as f:
        f.write(render(results))
    return path
