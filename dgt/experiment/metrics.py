"""From the ranks' per-iteration records to one run's Table 1 row (BCT, iterations and time to the target
accuracy) and the comparison of two runs."""

from __future__ import annotations

import statistics
from typing import Any


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _sum_lanes(rows: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        for lane, n in row.items():
            out[lane] = out.get(lane, 0) + int(n)
    return out


def _transport_lanes(ranks: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per lane over all ranks, whole run (the endpoints' counters): bytes and frames sent and received, blocks
    delivered, kept back by the send budget (unsent) and lost."""
    out: dict[str, dict[str, int]] = {}
    for rk in ranks:
        for ls in rk.get("transport", {}).get("lanes", []):
            acc = out.setdefault(str(ls["lane"]), {})
            for k, v in ls.items():
                if k.startswith(("tx_", "rx_", "delivered_")) and isinstance(v, (int, float)):
                    acc[k] = acc.get(k, 0) + int(v)
    return out


def _block_delivery(lane: dict[str, int]) -> float | None:
    got, lost = lane.get("delivered_blocks", 0), lane.get("tx_lost_blocks", 0)
    return got / (got + lost) if got + lost else None


def unimportant_blocks(delivered: int, lost: int, held_back: int) -> dict[str, Any]:
    """What became of the unimportant blocks (every receiver, every round until the target): delivered before their
    round closed, lost (sent, missing at the deadline) and held back (never sent: the sender's send budget kept them
    back), each also as a share of them all (None when there were none)."""
    total = delivered + lost + held_back
    share = (lambda k: k / total if total else None)
    return {"total": total, "delivered": delivered, "lost": lost, "held_back": held_back,
            "delivered_share": share(delivered), "lost_share": share(lost), "held_back_share": share(held_back)}


def summarize(ranks: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """One run: rank 0's clock is the run's clock (it is the evaluator and, as the server, the last to finish an
    iteration). Time to target = training time (sum of BCTs, evaluation pauses excluded) at the first evaluation
    whose accuracy reached ``target``; the paper's Total Time. Traffic sums every rank's sent bytes per lane
    (0 = reliable TCP, 1 = unreliable UDP), what the receivers took in per lane (frame headers included), and every
    receiver's dropped blocks."""
    r0 = ranks[0]
    recs = r0["records"]
    lanes = _transport_lanes(ranks)
    evals = r0["evals"]
    hit = next((e for e in evals if e["acc"] >= target), None)
    n = hit["it"] if hit else len(recs)
    upto = recs[:n]
    bcts = [r["bct"] for r in upto]
    sent_all = _sum_lanes([rec["sent"] for rk in ranks for rec in rk["records"]])
    sent_upto = _sum_lanes([rec["sent"] for rk in ranks for rec in rk["records"][:n]])
    recv_upto = _sum_lanes([rec["recv"] for rk in ranks for rec in rk["records"][:n]])
    dropped = sum(rec["dropped"] for rk in ranks for rec in rk["records"][:n])
    unsent = sum(rec.get("unsent", 0) for rk in ranks for rec in rk["records"][:n])
    unsent_bytes = sum(rec.get("unsent_bytes", 0) for rk in ranks for rec in rk["records"][:n])
    blocks = sum(rec["blocks"] for rk in ranks for rec in rk["records"][:n])
    delivered = sum(rec.get("unimportant_delivered", 0) for rk in ranks for rec in rk["records"][:n])
    return {
        "reached": hit is not None,
        "target": target,
        "iterations": n,
        "time_to_target": hit["train_time"] if hit else None,
        "train_time": upto[-1]["train_time"] if upto else 0.0,
        "bct_mean": statistics.fmean(bcts) if bcts else 0.0,
        "bct_median": statistics.median(bcts) if bcts else 0.0,
        "bct_p95": _quantile(bcts, 0.95),
        "compute_mean": statistics.fmean(r["compute"] for r in upto) if upto else 0.0,
        "comm_mean": statistics.fmean(r["comm"] for r in upto) if upto else 0.0,
        "p_mean": statistics.fmean(r["p"] for r in upto) if upto else 1.0,
        "final_acc": evals[-1]["acc"] if evals else None,
        "best_acc": max((e["acc"] for e in evals), default=None),
        "bytes_per_lane": sent_upto,
        "bytes_per_lane_run": sent_all,
        "bytes_delivered_per_lane": recv_upto,
        "bytes_per_iteration": sum(sent_upto.values()) / n if n else 0.0,
        "delivered_per_iteration": sum(recv_upto.values()) / n if n else 0.0,
        "dropped_blocks": dropped,
        "unsent_blocks": unsent,  # kept back by the senders' send budget (error feedback carries them; not lost)
        "bytes_unsent": unsent_bytes,
        # bytes delivered (headers included) / payload bytes sent on UDP, until the target
        "udp_delivery": recv_upto.get("1", 0) / sent_upto["1"] if sent_upto.get("1") else None,
        "transport_lanes": lanes,
        # whole run, blocks: delivered / (delivered + lost) on lane 1 (unsent blocks are neither)
        "udp_block_delivery": _block_delivery(lanes.get("1", {})),
        "received_blocks": blocks,
        "drop_rate": dropped / blocks if blocks else 0.0,  # of every block, important ones included
        "unimportant_blocks": unimportant_blocks(delivered, dropped, unsent),
        "iterations_run": len(recs),
        "stop_reason": r0["stop_reason"],
        "eval_time": r0["eval_time"],
        "wall_time": r0["wall_time"],
    }


def cross_flow(flow: Any, records: list[dict[str, Any]], n: int, proto: str, rate: str | None) -> dict[str, Any]:
    """What the cross flow (a :class:`dgt.netem.FlowResult` with an arrival series) got beside one run: goodput
    during rank 0's first ``n`` training iterations (the BCT windows until the target, so evaluation pauses and
    start-up, when the link is idle, do not count), over the whole flow, and whether it ran through every
    iteration of the run."""
    out: dict[str, Any] = {
        "proto": proto, "rate": rate,
        "sent_bytes": int(flow.sent.get("bytes", 0)), "received_bytes": int(flow.received.get("bytes", 0)),
        "goodput_flow_bps": flow.goodput_bps, "goodput_training_bps": None, "training_s": 0.0, "spans_run": None,
    }
    timed = [r for r in records if "at" in r]
    if timed and flow.received.get("series"):
        upto = timed[:n]
        starts = [r["at"] for r in upto]
        ends = [r["at"] + r["bct"] for r in upto]
        out["goodput_training_bps"] = flow.goodput_during(starts, ends)
        out["training_s"] = float(sum(r["bct"] for r in upto))
        out["spans_run"] = flow.spans(timed[0]["at"], timed[-1]["at"] + timed[-1]["bct"])
    return out


def reduction(base: float | None, new: float | None) -> float | None:
    """Relative reduction (base - new) / base, None when either side is missing."""
    if base is None or new is None or base <= 0:
        return None
    return (base - new) / base


def compare(baseline: dict[str, Any], dgt: dict[str, Any]) -> dict[str, Any]:
    """The reductions the paper quotes: BCT and total time to the same target accuracy."""
    return {
        "bct_reduction": reduction(baseline["bct_mean"], dgt["bct_mean"]),
        "time_reduction": reduction(baseline["time_to_target"], dgt["time_to_target"]),
        "iteration_increase": (dgt["iterations"] / baseline["iterations"] - 1.0)
        if baseline["reached"] and dgt["reached"] else None,
        "delivered_reduction": reduction(baseline["delivered_per_iteration"], dgt["delivered_per_iteration"]),
        "both_reached": bool(baseline["reached"] and dgt["reached"]),
        # the cross flow's goodput during DGT's training iterations / during the baseline's (>= 1: DGT left it as
        # much of the bottleneck as the baseline did)
        "cross_goodput_ratio": _ratio(baseline.get("cross_flow"), dgt.get("cross_flow")),
    }


def _ratio(base: dict[str, Any] | None, new: dict[str, Any] | None) -> float | None:
    b = (base or {}).get("goodput_training_bps")
    d = (new or {}).get("goodput_training_bps")
    return d / b if b and d is not None else None
