"""The markdown report of `dgt experiment ddp`: setup, one row per arm (median [min–max] over the seeds), the ratios
of medians against Gloo and the best torch arm, each seed's own table, the goals."""

from __future__ import annotations

from typing import Any

from dgt.experiment.console import fmt_bytes
from dgt.experiment.ddp_stats import aggregate, censored_spread
from dgt.experiment.ddp_stats import ratios as median_ratios

# issue #19's acceptance: dgt-hook time to target <= 0.75x Gloo (priority), <= 0.85x (fifo); step <= 0.7x (priority)
GOALS = {"priority": {"time_to_target": 0.75, "step_mean": 0.7}, "fifo": {"time_to_target": 0.85}}
# issue #43's acceptance for the resnet (momentum SGD) and gpt (AdamW) families: dgt-hook steps <= 1.2x Gloo's
STEPS_GOAL = 1.2


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


HEADER = ["Arm", "Reached", "Time to target (s)", "Steps", "Step p50 (s)", "Step p95 (s)", "Time vs Gloo",
          "Step p50 vs Gloo", "Step p95 vs Gloo", "Time vs best torch", "Wire tx / rank / step",
          "DGT TCP/UDP / rank / step", "Dropped blocks", "Queue drops (host 0)"]


def spread_text(sp: dict[str, Any] | None, fmt: str = "{:.3f}") -> str:
    """``median [min–max]`` over the seeds; the median alone for one seed; – when not measured."""
    if not sp or sp["median"] is None:
        return "–"
    known = [v for v in sp["values"] if v is not None]
    if len(known) < 2:
        return fmt.format(sp["median"])
    return f"{fmt.format(sp['median'])} [{fmt.format(sp['min'])}–{fmt.format(sp['max'])}]"


def censored_text(c: dict[str, Any], fmt: str = "{:.1f}", long: bool = True) -> str:
    """A time or step count to target (ddp_stats.censored_spread): ``median [min–max]``, "not reached" where the
    median or max is; when no seed reached, what the seeds ran without reaching it (``>ran``)."""
    if c["reached"] == 0:
        lo, hi = min(c["values"]), max(c["values"])
        ran = f">{fmt.format(lo)}" + (f"–{fmt.format(hi)}" if hi != lo else "")
        return f"not reached ({ran})" if long else ran
    med = "not reached" if c["median"] is None else fmt.format(c["median"])
    if c["n"] == 1:
        return med
    hi = "not reached" if c["max"] is None else fmt.format(c["max"])
    return f"{med} [{fmt.format(c['min'])}–{hi}]"


def table(stats: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float | None]]) -> list[str]:
    return [_row(HEADER), _row(["---"] + ["---:"] * (len(HEADER) - 1))] + [
        arm_row(arm, st, ratios.get(arm, {})) for arm, st in stats.items()]


def arm_row(arm: str, st: dict[str, Any], ratio: dict[str, float | None]) -> str:
    """One arm over its seeds (ddp_stats.aggregate): medians with [min–max], ratios of medians."""
    failed = st.get("failed") or []
    if "time_to_target" not in st:
        return _row([arm, f"0/{st['runs']}", "failed: " + (failed[0]["error"] if failed else "?").splitlines()[0]]
                    + [""] * (len(HEADER) - 3))
    name = arm + (f" ({len(failed)} of {st['runs']} failed)" if failed else "")
    t = st["time_to_target"]
    lanes = st.get("dgt_lane_bytes_per_rank_step")
    lane_txt = "/".join(fmt_bytes(lanes[k]["median"]) if k in lanes else fmt_bytes(0) for k in ("0", "1")) \
        if lanes else "–"
    wire = st["wire_tx_per_rank_step"]["median"]
    return _row([
        name, f"{t['reached']}/{t['n']}", censored_text(t), censored_text(st["iterations"], "{:g}", long=False),
        spread_text(st["step_p50"]), spread_text(st["step_p95"]),
        _num(ratio.get("time_to_target"), "{:.2f}x"), _num(ratio.get("step_p50"), "{:.2f}x"),
        _num(ratio.get("step_p95"), "{:.2f}x"), _num(ratio.get("time_to_target_vs_best_torch"), "{:.2f}x"),
        fmt_bytes(wire) if wire is not None else "–", lane_txt, spread_text(st["dgt_dropped_blocks"], "{:g}"),
        spread_text(st["queue_drops"], "{:g}"),
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
        f"{cfg['lr']:g}, batch {cfg['batch']} per worker, {_seeds_text(results)}; {what} every {cfg['eval_every']} "
        f"steps (outside the timed steps); target {cfg['target']:g}; budget {cfg['max_iters']} steps / "
        f"{cfg['max_time']:g} s.",
        "- **Arms**:",
    ]
    lines += [f"  - `{a}`: {d}" for a, d in results["arms"].items()]
    if results.get("skipped"):
        lines += ["", f"**Skipped**: {results['skipped']}"]
        return "\n".join(lines) + "\n"
    seeds = _seeds(results)
    stats = results.get("stats") or aggregate(results["runs"])
    lines += ["", "## Results", ""] + table(stats, results["ratios"])
    lines += ["", STATS_NOTE if len(seeds) > 1 else ONE_SEED_NOTE,
              "", "Times are rank 0's training time (sum of step times, evaluation excluded) until the first "
              "evaluation at or above the target; a step is forward + backward (DDP's all-reduce) + optimizer step. "
              "Wire tx: bytes the host's eth0 sent per step (netem only: everything on the wire, headers and "
              "retransmissions included). DGT TCP/UDP: payload bytes DGT's hook counted on its reliable and droppable "
              "lanes (the backend does not count lanes). Dropped blocks: DGT blocks not delivered by the deadline "
              "(summed over ranks); Gloo and the torch hooks are lossless. Queue drops: packets the queues of host 0's "
              "link dropped, both directions (cross traffic included)."]
    failed = [(a, f) for a, st in stats.items() for f in st.get("failed") or []]
    if failed:
        lines += ["", "Failed runs (left out of every figure):", ""] + [
            f"- `{a}` seed {f['seed']}: {str(f['error']).splitlines()[0] if f['error'] else '?'}" for a, f in failed]
    if len(seeds) > 1:
        lines += ["", "## Each seed", "", "The same table for each seed alone; its ratios compare with that seed's own "
                  "Gloo and best torch arm."]
        for seed in seeds:
            one = aggregate([r for r in results["runs"] if r.get("seed") == seed])
            lines += ["", f"### Seed {seed}", ""] + table(one, median_ratios(one))
    lines += _choices(results["runs"], len(seeds) > 1)
    lines += _goals(results)
    return "\n".join(lines) + "\n"


STATS_NOTE = ("Every arm ran once per seed (seed by seed, every arm within a seed). Each figure is the median over "
              "the seeds with [min–max]; ratios divide medians. Reached: seeds whose run reached the target. A seed "
              "that did not reach it counts as slower than every seed that did, so a median time or step count is "
              "\"not reached\" unless more than half of the seeds reached the target (for an even count: both middle "
              "ones), and the max is \"not reached\" as soon as one seed did not. Step p50 and p95: each seed's median "
              "and 95th-percentile step time (up to the target, or the whole run when not reached), then their median "
              "[min–max] over the seeds. Time vs best torch: against the fastest of the torch arms that ran (fp16, "
              "powersgd, fp16-powersgd, batched-powersgd, powersgd-rank2) by median time to target.")
ONE_SEED_NOTE = ("One seed: every figure is one run (run with --seeds 0,1,2 for medians and ranges). Step p50 and p95: "
                 "the median and 95th-percentile step time up to the target (the whole run when not reached). Time vs "
                 "best torch: against the fastest of the torch arms that ran (fp16, powersgd, fp16-powersgd, "
                 "batched-powersgd, powersgd-rank2).")


def _seeds(results: dict[str, Any]) -> list[int]:
    return list(results.get("seeds") or [results["config"]["seed"]])


def _seeds_text(results: dict[str, Any]) -> str:
    seeds = _seeds(results)
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {', '.join(map(str, seeds))} (every arm once per seed)"


def _choices(runs: list[dict[str, Any]], per_seed: bool = False) -> list[str]:
    """What the default hook's chooser (dgt/shim/chooser.py) decided, on rank 0's agreed figures."""
    out = []
    for r in runs:
        ch = next((d.get("choice") for d in r.get("dgt") or [] if isinstance(d, dict) and d.get("choice")), None)
        if not ch:
            continue
        dec = "; ".join(f"iter {d['iter']}: lossless {d['lossless_s'] * 1e3:.0f} ms, lossy {d['lossy_s'] * 1e3:.0f} ms"
                        f" -> {d['chosen']}" for d in ch.get("decisions", []))
        it = ch.get("iters", {})
        who = f"`{r['arm']}`" + (f" seed {r.get('seed')}" if per_seed else "")
        out.append(f"- {who} chose (collective time per iteration, mean over ranks): {dec or 'none'}"
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
    """Issue #43 (the resnet and gpt families): the DGT hook reaches the target in at most 1.2x Gloo's steps. One
    seed: that run's steps. Several: the median steps over the seeds (a seed that did not reach the target counts as
    slower than every seed that did, as in the table), then each seed against its own Gloo run."""
    seeds: list[Any] = []
    by: dict[tuple[Any, str], dict[str, Any]] = {}
    for r in results["runs"]:
        if r.get("summary"):
            by[(r.get("seed"), r["arm"])] = r["summary"]
            if r.get("seed") not in seeds:
                seeds.append(r.get("seed"))
    pairs = [(s, by[(s, "gloo")], by[(s, "dgt-hook")]) for s in seeds if (s, "gloo") in by and (s, "dgt-hook") in by]
    if not pairs:
        return []
    head = ["", "## Against the goal of issue #43", ""]
    if len(pairs) == 1:
        return head + [_steps_line("", pairs[0][1], pairs[0][2])]
    g_it = censored_spread([g["iterations"] for _, g, _ in pairs], [bool(g["reached"]) for _, g, _ in pairs])
    h_it = censored_spread([h["iterations"] for _, _, h in pairs], [bool(h["reached"]) for _, _, h in pairs])
    if g_it["median"] is None or h_it["median"] is None:
        got = "gloo" if g_it["median"] is None else "dgt-hook"
        line = (f"- median over {len(pairs)} seeds: {got} did not reach the target on at least half of them: "
                "no steps ratio.")
    else:
        ratio = h_it["median"] / g_it["median"]
        verdict = "met" if ratio <= STEPS_GOAL else "NOT met"
        line = (f"- dgt-hook steps to target vs Gloo, median over {len(pairs)} seeds: {h_it['median']:g} / "
                f"{g_it['median']:g} = {ratio:.2f}x (goal <= {STEPS_GOAL}x): {verdict}")
    paired = results.get("ratios", {}).get("dgt-hook", {}).get("steps_paired")
    if paired is not None:
        line += (f"; paired, the median of each seed's ratio to its own Gloo run: {paired:.2f}x "
                 f"({'met' if paired <= STEPS_GOAL else 'NOT met'})")
    return head + [line] + [_steps_line(f"seed {s}: ", g, h) for s, g, h in pairs]


def _steps_line(prefix: str, gloo: dict[str, Any], hook: dict[str, Any]) -> str:
    if not (gloo["reached"] and hook["reached"]):
        got = "gloo" if not gloo["reached"] else "dgt-hook"
        return f"- {prefix}{got} did not reach the target: no steps ratio."
    ratio = hook["iterations"] / gloo["iterations"]
    verdict = "met" if ratio <= STEPS_GOAL else "NOT met"
    return (f"- {prefix}dgt-hook steps to target vs Gloo: {hook['iterations']} / {gloo['iterations']} = {ratio:.2f}x "
            f"(goal <= {STEPS_GOAL}x): {verdict}")


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
        extra = (f" (step p50 {_num(r.get('step_p50'), '{:.2f}x')}, p95 {_num(r.get('step_p95'), '{:.2f}x')})"
                 if key == "step_mean" else "")
        out.append(f"- dgt-hook {key.replace('_', ' ')} vs Gloo: {_num(got, '{:.2f}x')} (goal <= {goal}x): {verdict}"
                   + extra)
    best = results.get("best_torch")
    vs_best = r.get("time_to_target_vs_best_torch")
    if best is not None and vs_best is not None:
        b = results["ratios"].get(best, {}).get("time_to_target")
        out.append(f"- best torch arm by median time to target: `{best}` ({_num(b, '{:.2f}x')} Gloo's); dgt-hook / "
                   f"best = {vs_best:.2f}x (below 1: DGT ahead)")
    return out


def write_report(results: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        f.write(render(results))
