"""Statistics over the seeds of `dgt experiment ddp`: every arm runs once per seed; this module turns the per-seed
summaries (``ddp_runner.summarize``) into one entry per arm (median, min and max over the seeds) and the ratios,
which compare medians.

Not reaching the target is kept, not hidden: time and steps to target are *censored* figures. A seed that did not
reach the target counts as slower than every seed that did (as +inf), so the median is a time only when more than half
of the seeds reached the target (for an even count, when both middle values did), and the max is "not reached" as soon
as one seed did not; ``reached`` says how many did. Step times (p50, p95 and mean of each seed's steps up to the
target, or of the whole run when it was not reached), bytes and drops are plain figures over the seeds that ran.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

# the arms a user could pick from torch itself; "best torch" is the fastest of these by median time to target
# the arms a careful torch user would pick (issue #42 names the first four; rank 2 is what a user tries when rank 1
# costs too many steps, so it counts as well)
TORCH_ARMS = ("fp16", "powersgd", "fp16-powersgd", "batched-powersgd", "powersgd-rank2")


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) by nearest rank: the smallest value with at least ``q`` of the values at or
    below it (p95 of 1..100 is 95, of 1..20 it is 19)."""
    if not values:
        raise ValueError("no values")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered) - 1e-9) - 1)]


def spread(values: list[float | int | None]) -> dict[str, Any]:
    """Median, min and max of the known ``values`` (None: not measured there, e.g. wire bytes on loopback);
    all None when none is known."""
    known = [v for v in values if v is not None]
    if not known:
        return {"values": list(values), "median": None, "min": None, "max": None}
    return {"values": list(values), "median": statistics.median(known), "min": min(known), "max": max(known)}


def censored_spread(values: list[float], reached: list[bool]) -> dict[str, Any]:
    """Median, min and max of a time (or step count) to target, where ``values[i]`` is the figure when
    ``reached[i]`` and what seed i ran without reaching it otherwise. Unreached seeds count as +inf; a median or max
    that is +inf is None ("not reached"), and so is min when no seed reached."""
    if len(values) != len(reached):
        raise ValueError("one reached flag per value")
    keyed = [v if r else math.inf for v, r in zip(values, reached)]
    med = statistics.median(keyed) if keyed else math.inf
    done = [v for v, r in zip(values, reached) if r]
    return {"values": list(values), "reached_flags": list(reached), "reached": len(done), "n": len(values),
            "median": None if math.isinf(med) else med, "min": min(done) if done else None,
            "max": max(values) if values and all(reached) else None,
            "unreached_max": max((v for v, r in zip(values, reached) if not r), default=None)}


def queue_drops(queues: dict[str, Any] | None) -> int | None:
    """Packets host 0's link queues dropped, both directions, every class (netem only; None on loopback)."""
    if not queues:
        return None
    return sum(int(c["drops"]) for way in queues.values() for c in way.values())


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One entry per arm (in the order the arms first appear in ``runs``) over that arm's seeds. A run without a
    summary failed: it is listed under ``failed`` and left out of every figure."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["arm"], []).append(r)
    return {arm: _one(rs) for arm, rs in by.items()}


def _one(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("summary")]
    failed = [{"seed": r.get("seed"), "error": r.get("error") or "no summary"} for r in runs if not r.get("summary")]
    out: dict[str, Any] = {"seeds": [r.get("seed") for r in ok], "runs": len(runs), "failed": failed}
    if not ok:
        return out
    ss = [r["summary"] for r in ok]
    reached = [bool(s["reached"]) for s in ss]
    out["time_to_target"] = censored_spread(
        [s["time_to_target"] if s["reached"] else s["train_time"] for s in ss], reached)
    out["iterations"] = censored_spread([s["iterations"] for s in ss], reached)
    out["train_time"] = spread([s["train_time"] for s in ss])
    out["step_p50"] = spread([s["step_median"] for s in ss])
    out["step_p95"] = spread([s["step_p95"] for s in ss])
    out["step_mean"] = spread([s["step_mean"] for s in ss])
    out["wire_tx_per_rank_step"] = spread([s.get("wire_tx_per_rank_step") for s in ss])
    lanes = [s.get("dgt_lane_bytes_per_rank_step") or {} for s in ss]
    names = sorted({k for d in lanes for k in d})
    out["dgt_lane_bytes_per_rank_step"] = {k: spread([d.get(k, 0) for d in lanes]) for k in names} or None
    out["dgt_dropped_blocks"] = spread([s.get("dgt_dropped_blocks", 0) for s in ss])
    out["queue_drops"] = spread([queue_drops(r.get("queues")) for r in ok])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratio(arm: dict[str, Any], base: dict[str, Any], key: str = "iterations") -> float | None:
    """The median over the seeds of ``arm``'s figure divided by ``base``'s on the **same seed** (``key``: a
    censored figure, ``"iterations"`` or ``"time_to_target"``). Seeds pair up what only the seed changes (the
    initial weights and the data order), so this ratio does not compare one seed's trajectory with another's, as a
    ratio of medians can. A seed where the base did not reach the target is left out; one where only ``arm`` did not
    counts as +inf; None when no seed pairs up or the median is +inf."""
    if key not in arm or key not in base:
        return None
    ref = {seed: (v, ok) for seed, v, ok in zip(base["seeds"], base[key]["values"], base[key]["reached_flags"])}
    rs = [v / ref[seed][0] if ok else math.inf
          for seed, v, ok in zip(arm["seeds"], arm[key]["values"], arm[key]["reached_flags"])
          if seed in ref and ref[seed][1] and ref[seed][0]]
    med = statistics.median(rs) if rs else math.inf
    return None if math.isinf(med) else med


def best_torch(stats: dict[str, dict[str, Any]]) -> str | None:
    """The torch arm (TORCH_ARMS) with the smallest median time to target; None when none reached it."""
    cands = [(s["time_to_target"]["median"], a) for a, s in stats.items()
             if a in TORCH_ARMS and s.get("time_to_target") and s["time_to_target"]["median"] is not None]
    return min(cands)[1] if cands else None


def ratios(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Every arm's medians against Gloo's (time to target, step mean, p50 and p95; below 1 = faster than Gloo), the
    paired medians of its per-seed steps and time to target against Gloo's (``paired_ratio``: ``steps_paired``,
    ``time_to_target_paired``), and its median time to target against the best torch arm's (``best_torch``). A
    time ratio is None when either median is "not reached". Arms with no successful seed are left out; without a
    Gloo arm only the torch ratio is given."""
    base = stats.get("gloo")
    if base is not None and "time_to_target" not in base:
        base = None
    best = best_torch(stats)
    best_t = stats[best]["time_to_target"]["median"] if best else None
    out: dict[str, dict[str, float | None]] = {}
    for arm, s in stats.items():
        if "time_to_target" not in s:
            continue
        r: dict[str, float | None] = {}
        if base is not None:
            r["time_to_target"] = _ratio(s["time_to_target"]["median"], base["time_to_target"]["median"])
            for k in ("step_mean", "step_p50", "step_p95"):
                r[k] = _ratio(s[k]["median"], base[k]["median"])
            r["steps_paired"] = paired_ratio(s, base, "iterations")
            r["time_to_target_paired"] = paired_ratio(s, base, "time_to_target")
        r["time_to_target_vs_best_torch"] = _ratio(s["time_to_target"]["median"], best_t)
        out[arm] = r
    return out
