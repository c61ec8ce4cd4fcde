"""The markdown report of `dgt experiment ddp`: setup, one row per arm, the ratios against Gloo, the goals."""

from __future__ import annotations

from typing import Any

from dgt.experiment.console import fmt_bytes

# issue #19's acceptance: dgt-hook time to target <= 0.75x Gloo (priority), <= 0.85x (fifo); step <= 0.7x (priority)
GOALS = {"priority": {"time_to_target": 0.75, "step_mean": 0.7}, "fifo": {"time_to_target": 0.85}}
# issue #43's acceptance for the resnet (momentum SGD) and gpt (AdamW) families: dgt-hook steps <= 1.2x Gloo's
STEPS_GOAL = 1.2


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


HEADER = ["Arm", "Time to target (s)", "Steps", "Step mean (s)", "Step p95 (s)", "Time vs Gloo", "Step vs Gloo",
          "Wire tx / rank / step", "DGT TCP/UDP / rank / step", "Dropped blocks", "Queue drops (host 0)"]


def queue_drops(queues: dict[str, Any] | None) -> int | None:
    """Packets host 0's link queues dropped, both directions, every class (netem only; None on loopback)."""
    if not queues:
        return None
    return sum(c["drops"] for way in queues.values() for c in way.values())


def table(runs: list[dict[str, Any]], ratios: dict[str, dict[str, float | None]]) -> list[str]:
    return [_row(HEADER), _row(["---"] + ["---:"] * (len(HEADER) - 1))] + [
        arm_row(r, ratios.get(r["arm"], {})) for r in runs]


def arm_row(r: dict[str, Any], ratio: dict[str, float | None]) -> str:
    s = r.get("summary")
    if s is None:
        return _row([r["arm"], "failed: " + (r.get("error") or "?").splitlines()[0]] + [""] * (len(HEADER) - 2))
    qd = queue_drops(r.get("queues"))
    lanes = s.get("dgt_lane_bytes_per_rank_step")
    lane_txt = "/".join(fmt_bytes(lanes.get(k, 0)) for k in ("0", "1")) if lanes else "–"
    wire = s.get("wire_tx_per_rank_step")
    return _row([
        r["arm"], f"{s['time_to_target']:.1f}" if s["reached"] else f"not reached (>{s['train_time']:.1f})",
        str(s["iterations"]), _num(s["step_mean"]), _num(s["step_p95"]),
        _num(ratio.get("time_to_target"), "{:.2f}x"), _num(ratio.get("step_mean"), "{:.2f}x"),
        fmt_bytes(wire) if wire is not None else "–", lane_txt, str(s["dgt_dropped_blocks"]),
        "–" if qd is None else str(qd),
    ])


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    net = results["network"]
    lines = [f"# DDP drop-in: Gloo, fp16, PowerSGD and DGT — profile `{results['profile']}`", "",
             f"Started {results.get('started', '?')}; finished in {results.get('elapsed', 0):.0f} s."]
    if results.get("command"):
        lines += ["", "```sh", results["command"], "```"]
    m = results["model"]
    wl = results.get("workload", {"optimizer": "SGD", "metric": "acc"})
    what = "validation loss (nats/byte, lower is better)" if wl["metric"] == "val_loss" else "test accuracy"
    lines += [
        "", "## Setup", "",
        f"- **Profile `{results['profile']}`**: {results['profile_description']}.",
        f"- **Network ({net['mode']})**: {net['description']}."
        + (f" Netem was not used: {net['why_not_netem']}." if net.get("why_not_netem") else ""),
        f"- **Training**: `torch.nn.parallel.DistributedDataParallel` in {cfg['workers']} processes meeting through "
        f"env:// (as under torchrun); {cfg['model']} ({m['parameters']:,} parameters, "
        f"{fmt_bytes(m['gradient_bytes'])} of gradient), {results['dataset']['name']}, {wl['optimizer']}, lr "
        f"{cfg['lr']:g}, batch {cfg['batch']} per worker, seed {cfg['seed']}; {what} every {cfg['eval_every']} steps "
        f"(outside the timed steps); target {cfg['target']:g}; budget {cfg['max_iters']} steps / "
        f"{cfg['max_time']:g} s.",
        "- **Arms**:",
    ]
    lines += [f"  - `{a}`: {d}" for a, d in results["arms"].items()]
    if results.get("skipped"):
        lines += ["", f"**Skipped**: {results['skipped']}"]
        return "\n".join(lines) + "\n"
    lines += ["", "## Results", ""] + table(results["runs"], results["ratios"])
    lines += ["", "Times are rank 0's training time (sum of step times, evaluation excluded) until the first "
              "evaluation at or above the target; a step is forward + backward (DDP's all-reduce) + optimizer step. "
              "Wire tx: bytes the host's eth0 sent per step (netem only: everything on the wire, headers and "
              "retransmissions included). DGT TCP/UDP: payload bytes DGT's hook counted on its reliable and droppable "
              "lanes (the backend does not count lanes). Dropped blocks: DGT blocks not delivered by the deadline "
              "(summed over ranks); Gloo and the torch hooks are lossless. Queue drops: packets the queues of host 0's "
              "link dropped, both directions (cross traffic included)."]
    lines += _choices(results["runs"])
    lines += _goals(results)
    return "\n".join(lines) + "\n"


def _choices(runs: list[dict[str, Any]]) -> list[str]:
    """What the default hook's chooser (dgt/shim/chooser.py) decided, on rank 0's agreed figures."""
    out = []
    for r in runs:
        ch = next((d.get("choice") for d in r.get("dgt") or [] if isinstance(d, dict) and d.get("choice")), None)
        if not ch:
            continue
        dec = "; ".join(f"iter {d['iter']}: lossless {d['lossless_s'] * 1e3:.0f} ms, lossy {d['lossy_s'] * 1e3:.0f} ms"
                        f" -> {d['chosen']}" for d in ch.get("decisions", []))
        it = ch.get("iters", {})
        out.append(f"- `{r['arm']}` chose (collective time per iteration, mean over ranks): {dec or 'none'}"
                   f" ({it.get('lossy', 0)} iterations lossy, {it.get('lossless', 0)} lossless after the warm-up).")
        out += _split(r)
    return ["", "Path chosen by the hook's chooser (docs/shim.md):", ""] + out if out else []


def _split(run: dict[str, Any]) -> list[str]:
    """Where rank 0's collective time went, per path: per bucket, each phase; and its receive rounds' deadline waits."""
    d = next((d for d in run.get("dgt") or [] if isinstance(d, dict) and d.get("paths")), None)
    if d is None:
        return []
    out = []
    for name, p in sorted(d["paths"].items()):
        n = max(p["buckets"], 1)
        phases = ", ".join(f"{k.replace('_', '-')} {v / n * 1e3:.0f}" for k, v in p.items()
                           if k not in ("buckets", "seconds"))
        out.append(f"  - {name} path (rank 0): {p['buckets']} buckets, {p['seconds'] / n * 1e3:.0f} ms per bucket"
                   + (f" ({phases} ms)" if phases else ""))
    t = d.get("transport")
    if t and t.get("rounds_received"):
        out.append(f"  - deadline waits (rank 0): {t['deadline_wait_total'] * 1e3:.0f} ms over {t['rounds_received']}"
                   f" receive rounds (max {t['deadline_wait_max'] * 1e3:.0f} ms); closed by {t.get('closed_by')}")
    return out


def _steps_goal(results: dict[str, Any]) -> list[str]:
    """Issue #43 (the resnet and gpt families): the DGT hook reaches the target in at most 1.2x Gloo's steps."""
    by = {r["arm"]: r["summary"] for r in results["runs"] if r.get("summary")}
    gloo, hook = by.get("gloo"), by.get("dgt-hook")
    if gloo is None or hook is None:
        return []
    if not (gloo["reached"] and hook["reached"]):
        got = "gloo" if not gloo["reached"] else "dgt-hook"
        return ["", "## Against the goal of issue #43", "", f"- {got} did not reach the target: no steps ratio."]
    ratio = hook["iterations"] / gloo["iterations"]
    verdict = "met" if ratio <= STEPS_GOAL else "NOT met"
    return ["", "## Against the goal of issue #43", "",
            f"- dgt-hook steps to target vs Gloo: {hook['iterations']} / {gloo['iterations']} = {ratio:.2f}x "
            f"(goal <= {STEPS_GOAL}x): {verdict}"]


def _goals(results: dict[str, Any]) -> list[str]:
    if results.get("workload", {}).get("family", "alexnet") in ("resnet", "gpt"):
        return _steps_goal(results)
    goals = GOALS.get(results["profile"])
    r = results["ratios"].get("dgt-hook")
    if not goals or r is None:
        return []
    out = ["", "## Against the goals of issue #19", ""]
    for key, goal in goals.items():
        got = r.get(key)
        verdict = "–" if got is None else ("met" if got <= goal else "NOT met")
        out.append(f"- dgt-hook {key.replace('_', ' ')} vs Gloo: {_num(got, '{:.2f}x')} (goal <= {goal}x): {verdict}")
    others = {a: results["ratios"].get(a, {}).get("time_to_target") for a in ("fp16", "powersgd")}
    best = min((v for v in others.values() if v is not None), default=None)
    if best is not None and r.get("time_to_target") is not None:
        out.append(f"- best torch hook time to target vs Gloo: {best:.2f}x; dgt-hook / best = "
                   f"{r['time_to_target'] / best:.2f}x (below 1: DGT ahead)")
    return out


def write_report(results: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        f.write(render(results))
