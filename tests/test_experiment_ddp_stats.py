"""`dgt experiment ddp --seeds`: the statistics over seeds (median, range, p50/p95, censored times to target, ratios
of medians, the best torch arm), their table, the option, and the two added torch arms (fp16-powersgd,
batched-powersgd) end to end on a tiny configuration on loopback."""

import argparse
import json
import os

import pytest
import torch

from dgt.experiment.ddp_config import ARMS, DDPConfig
from dgt.experiment.ddp_report import censored_text, render, spread_text, table
from dgt.experiment.ddp_runner import summarize
from dgt.experiment.ddp_stats import (
    TORCH_ARMS,
    aggregate,
    best_torch,
    censored_spread,
    nearest_rank,
    paired_ratio,
    ratios,
    spread,
)


def test_nearest_rank_quantiles_from_known_inputs():
    assert nearest_rank(list(range(1, 101)), 0.95) == 95
    assert nearest_rank(list(range(20, 0, -1)), 0.95) == 19  # any order; 0.95 * 20 is not rounded past 19
    assert nearest_rank([0.3], 0.95) == 0.3
    assert nearest_rank(list(range(1, 11)), 0.5) == 5 and nearest_rank([1, 2, 3], 1.0) == 3
    for bad in ((0.0,), (1.5,)):
        with pytest.raises(ValueError):
            nearest_rank([1.0], *bad)
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


def test_spread_and_censored_spread_from_known_inputs():
    assert spread([3.0, 1.0, 2.0]) == {"values": [3.0, 1.0, 2.0], "median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([4, 1, 2, 3])["median"] == 2.5
    assert spread([None, 5.0, None]) == {"values": [None, 5.0, None], "median": 5.0, "min": 5.0, "max": 5.0}
    assert spread([None, None])["median"] is None
    every = censored_spread([10.0, 12.0, 11.0], [True, True, True])
    assert (every["median"], every["min"], every["max"], every["reached"], every["n"]) == (11.0, 10.0, 12.0, 3, 3)
    # one of three missed (it ran 20 s without reaching): it counts as slower than every seed that did
    two = censored_spread([5.0, 20.0, 6.0], [True, False, True])
    assert (two["median"], two["min"], two["max"], two["reached"], two["unreached_max"]) == (6.0, 5.0, None, 2, 20.0)
    # the missed seed's 2 s budget is not a time to target: it still ranks above 7 and 8
    low = censored_spread([7.0, 2.0, 8.0], [True, False, True])
    assert low["median"] == 8.0 and low["min"] == 7.0 and low["max"] is None
    one = censored_spread([4.0, 30.0, 31.0], [True, False, False])
    assert one["median"] is None and one["min"] == 4.0 and one["max"] is None and one["reached"] == 1
    even = censored_spread([1.0, 2.0, 3.0, 9.0], [True, True, True, False])
    assert even["median"] == 2.5
    assert censored_spread([1.0, 2.0], [True, False])["median"] is None  # a middle value missed
    none = censored_spread([30.0, 31.0], [False, False])
    assert none["median"] is None and none["min"] is None and none["reached"] == 0
    with pytest.raises(ValueError):
        censored_spread([1.0], [True, False])


def _rank(steps, reach_at=None, every=2):
    """Rank 0 of one run: evaluations every ``every`` steps, accuracy 0.99 from step ``reach_at`` on (never: None)."""
    evals, t = [], 0.0
    for i, st in enumerate(steps, 1):
        t += st
        if i % every == 0:
            evals.append({"it": i, "train_time": t, "acc": 0.99 if reach_at and i >= reach_at else 0.5, "wire": None})
            if reach_at and i >= reach_at:
                break
    return {"steps": list(steps), "evals": evals, "train_time": sum(steps), "stop_reason": "target", "dgt": {}}


def _run(arm, seed, steps, reach_at=None, queues=None):
    return {"arm": arm, "seed": seed, "summary": summarize([_rank(steps, reach_at)], 0.97), "queues": queues}


def test_aggregate_reports_median_and_range_of_per_seed_p50_p95_and_time_to_target():
    # seed 0: twenty steps 0.01..0.20 s, target at step 20 -> p50 0.105, p95 0.19, time 2.1 s
    s0 = [i / 100 for i in range(1, 21)]
    # seed 1: 0.1 s steps but one 1.0 s stall, target at step 10 -> p50 0.1, p95 1.0, time 1.9 s
    s1 = [0.1] * 4 + [1.0] + [0.1] * 5
    # seed 2: never reaches the target in 6 steps of 0.2 s -> p50 0.2, p95 0.2, ran 1.2 s
    s2 = [0.2] * 6
    q = {"into_server": {"FIFO": {"drops": 3}}, "from_server": {"FIFO": {"drops": 1}}}
    runs = [_run("gloo", 0, s0, 20, q), _run("gloo", 1, s1, 10, q), _run("gloo", 2, s2, None, None),
            {"arm": "fp16", "seed": 0, "error": "rank 1 died\ntraceback"}, _run("fp16", 1, [0.05] * 4, 4)]
    stats = aggregate(runs)
    assert list(stats) == ["gloo", "fp16"]
    g = stats["gloo"]
    assert g["seeds"] == [0, 1, 2] and g["runs"] == 3 and g["failed"] == []
    t = g["time_to_target"]
    assert t["reached"] == 2 and t["n"] == 3 and t["reached_flags"] == [True, True, False]
    assert t["values"] == pytest.approx([2.1, 1.9, 1.2]) and t["min"] == pytest.approx(1.9)
    assert t["median"] == pytest.approx(2.1) and t["max"] is None  # seed 2 (ran 1.2 s) counts as slowest
    assert g["iterations"]["values"] == [20, 10, 6] and g["iterations"]["median"] == 20
    assert g["step_p50"]["values"] == pytest.approx([0.105, 0.1, 0.2])
    assert g["step_p50"]["median"] == pytest.approx(0.105) and g["step_p50"]["max"] == pytest.approx(0.2)
    assert g["step_p95"]["values"] == pytest.approx([0.19, 1.0, 0.2])
    assert (g["step_p95"]["median"], g["step_p95"]["min"], g["step_p95"]["max"]) == pytest.approx((0.2, 0.19, 1.0))
    assert g["step_mean"]["values"] == pytest.approx([0.105, 0.19, 0.2])
    assert g["wire_tx_per_rank_step"]["median"] is None  # loopback: not measured in any seed
    assert g["queue_drops"]["values"] == [4, 4, None] and g["queue_drops"]["median"] == 4
    f = stats["fp16"]
    assert f["seeds"] == [1] and f["runs"] == 2 and f["failed"] == [{"seed": 0, "error": "rank 1 died\ntraceback"}]
    assert f["time_to_target"]["median"] == pytest.approx(0.2)
    assert aggregate([{"arm": "powersgd", "seed": 0, "error": "boom"}])["powersgd"] == {
        "seeds": [], "runs": 1, "failed": [{"seed": 0, "error": "boom"}]}


def test_ratios_divide_medians_and_name_the_best_torch_arm():
    def arm(name, times, step, reached=(True, True, True)):
        return [_run(name, s, [step] * int(round(t / step)), int(round(t / step)) if r else None)
                for s, (t, r) in enumerate(zip(times, reached))]

    runs = (arm("gloo", [10.0, 12.0, 14.0], 0.5) + arm("fp16", [6.0, 5.0, 9.0], 0.25)
            + arm("powersgd", [4.0, 4.0, 4.0], 0.1, (True, False, False))  # median: not reached
            + arm("batched-powersgd", [3.0, 4.5, 6.0], 0.25) + arm("dgt-hook", [9.0, 8.0, 7.0], 0.5))
    stats = aggregate(runs)
    assert best_torch(stats) == "batched-powersgd"  # median 4.5 s beats fp16's 6 s; powersgd's median is unreached
    r = ratios(stats)
    assert r["gloo"]["time_to_target"] == 1.0 and r["gloo"]["step_p95"] == 1.0
    assert r["fp16"]["time_to_target"] == pytest.approx(6.0 / 12.0)
    assert r["fp16"]["step_p50"] == pytest.approx(0.25 / 0.5) and r["fp16"]["step_p95"] == pytest.approx(0.5)
    assert r["dgt-hook"]["time_to_target"] == pytest.approx(8.0 / 12.0)
    assert r["dgt-hook"]["time_to_target_vs_best_torch"] == pytest.approx(8.0 / 4.5)
    assert r["powersgd"]["time_to_target"] is None and r["powersgd"]["time_to_target_vs_best_torch"] is None
    assert r["powersgd"]["step_mean"] == pytest.approx(0.1 / 0.5)  # step times are measured whether reached or not
    assert set(TORCH_ARMS) <= set(ARMS) and "gloo" not in TORCH_ARMS
    no_gloo = ratios(aggregate(arm("fp16", [6.0, 5.0, 9.0], 0.25)))
    assert no_gloo == {"fp16": {"time_to_target_vs_best_torch": 1.0}}


def test_paired_ratios_divide_each_seed_by_its_own_gloo_run():
    # the GPT fifo pattern (docs/experiment-ddp.md): Gloo 188 / 148 / 132 steps, the hook 188 / 148 / 216: the ratio
    # of medians compares the hook's seed 0 with Gloo's seed 1 (188 / 148 = 1.27x); paired, 1.00 / 1.00 / 1.64x
    runs = [_run(a, seed, [0.1] * n, n) for a, ns in (("gloo", (188, 148, 132)), ("dgt-hook", (188, 148, 216)))
            for seed, n in enumerate(ns)]
    stats = aggregate(runs)
    r = ratios(stats)["dgt-hook"]
    assert stats["dgt-hook"]["iterations"]["median"] / stats["gloo"]["iterations"]["median"] == pytest.approx(188 / 148)
    assert r["steps_paired"] == pytest.approx(1.0) and r["time_to_target_paired"] == pytest.approx(1.0)
    assert ratios(stats)["gloo"]["steps_paired"] == 1.0
    # a seed the hook did not reach counts as +inf; one Gloo did not reach is left out
    runs[5] = _run("dgt-hook", 2, [0.1] * 300, None)
    assert paired_ratio(aggregate(runs)["dgt-hook"], aggregate(runs)["gloo"]) == pytest.approx(1.0)
    runs[4] = _run("dgt-hook", 1, [0.1] * 300, None)
    assert paired_ratio(aggregate(runs)["dgt-hook"], aggregate(runs)["gloo"]) is None  # 1.0, inf, inf
    runs[1] = _run("gloo", 1, [0.1] * 300, None)  # seed 1 out: 1.0 and inf, median inf
    assert paired_ratio(aggregate(runs)["dgt-hook"], aggregate(runs)["gloo"]) is None
    runs[2] = _run("gloo", 2, [0.1] * 300, None)  # only seed 0 pairs up
    assert paired_ratio(aggregate(runs)["dgt-hook"], aggregate(runs)["gloo"]) == pytest.approx(1.0)
    # seeds pair by number, not by position: the hook ran seeds 2, 0 (in that order), Gloo 0, 2
    two = [_run("gloo", 0, [0.1] * 100, 100), _run("gloo", 2, [0.1] * 200, 200),
           _run("dgt-hook", 2, [0.1] * 220, 220), _run("dgt-hook", 0, [0.1] * 130, 130)]
    st = aggregate(two)
    assert paired_ratio(st["dgt-hook"], st["gloo"]) == pytest.approx((1.1 + 1.3) / 2)


def test_table_shows_median_range_reached_and_p95():
    runs = ([_run("gloo", s, [0.1] * n, n) for s, n in enumerate((10, 12, 14))]
            + [_run("fp16", 0, [0.05] * 10, 10), _run("fp16", 1, [0.05] * 20, None),
               {"arm": "fp16", "seed": 2, "error": "x"}]
            + [_run("powersgd", s, [0.025] * 8, None) for s in range(3)])
    stats = aggregate(runs)
    lines = table(stats, ratios(stats))
    assert lines[0].startswith("| Arm | Reached | Time to target (s) | Steps | Step p50 (s) | Step p95 (s) | Time vs")
    assert lines[2] == ("| gloo | 3/3 | 1.2 [1.0–1.4] | 12 [10–14] | 0.100 [0.100–0.100] | 0.100 [0.100–0.100] | "
                        "1.00x | 1.00x | 1.00x | – | – | – | 0 [0–0] | – |")
    # fp16: one seed reached, one ran 20 steps (1.0 s) without, one failed: median over two is not reached
    assert lines[3].startswith("| fp16 (1 of 3 failed) | 1/2 | not reached [0.5–not reached] | not reached [10–not "
                               "reached] | 0.050 [0.050–0.050] | 0.050 [0.050–0.050] | – | 0.50x | 0.50x | – |")
    assert lines[4].startswith("| powersgd | 0/3 | not reached (>0.2) | >8 | 0.025 [0.025–0.025] |")
    assert censored_text(censored_spread([30.0, 31.0], [False, False])) == "not reached (>30.0–31.0)"
    assert censored_text(censored_spread([3.0], [True])) == "3.0" and spread_text(spread([0.25])) == "0.250"
    text = render(_results(runs, [0, 1, 2]))
    assert "median over the seeds with [min–max]" in text and "counts as slower than every seed" in text
    assert "## Each seed" in text and "### Seed 2" in text and "- `fp16` seed 2: x" in text
    seed2 = text[text.index("### Seed 2"):]
    assert "| fp16 | 0/1 | failed: x |" in seed2 and "| gloo | 1/1 | 1.4 | 14 | 0.100 | 0.100 | 1.00x |" in seed2
    assert "seeds 0, 1, 2 (every arm once per seed)" in text


def _results(runs, seeds):
    stats = aggregate(runs)
    return {"config": DDPConfig(seeds=seeds).to_dict(), "profile": "fifo", "profile_description": "d",
            "network": {"mode": "loopback", "description": "n", "why_not_netem": None}, "dataset": {"name": "digits"},
            "model": {"parameters": 10, "gradient_bytes": 40}, "arms": dict(ARMS), "seeds": seeds, "runs": runs,
            "stats": stats, "ratios": ratios(stats), "best_torch": best_torch(stats)}


def test_seeds_option_and_config():
    from dgt.cli import build_parser
    from dgt.experiment.ddp_cli import seed_list

    parse = build_parser(["experiment"]).parse_args
    assert parse(["experiment", "ddp", "--seeds", "0, 1,2"]).seeds == [0, 1, 2]
    a = parse(["experiment", "ddp", "--seed", "5"])
    assert a.seeds is None and a.seed == 5
    for bad in ("0,0", "1,x", "", "-1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)
    with pytest.raises(SystemExit):  # one or the other
        parse(["experiment", "ddp", "--seed", "1", "--seeds", "0,1"])
    assert DDPConfig().seed_list() == [0] and DDPConfig(seed=7).seed_list() == [7]
    assert DDPConfig(seeds=[2, 0]).seed_list() == [2, 0]
    assert DDPConfig(seeds=[3]).spec("gloo", "/tmp/x", seed=3).seed == 3
    assert DDPConfig(seed=4).spec("gloo", "/tmp/x").seed == 4
    for bad in ([1, 1], [-1], [True]):
        with pytest.raises(ValueError):
            DDPConfig(seeds=bad)


def test_batched_powersgd_is_made_runnable_only_where_torch_rejects_its_matrices(monkeypatch):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from dgt.experiment import ddp_worker

    monkeypatch.setattr(psgd, "_orthogonalize", psgd._orthogonalize)  # restored after the test
    monkeypatch.setattr(ddp_worker, "WORKAROUNDS", [])
    try:
        psgd._orthogonalize(torch.ones(2, 1))
        rejects = False
    except AssertionError:
        rejects = True
    ddp_worker.runnable_batched_powersgd(psgd)
    assert len(ddp_worker.WORKAROUNDS) == int(rejects)
    col = torch.tensor([[3.0], [4.0]])
    psgd._orthogonalize(col)  # in place, as the batched hook expects
    assert torch.allclose(col, torch.tensor([[0.6], [0.8]]))
    m = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    psgd._orthogonalize(m)
    assert torch.allclose(m.T @ m, torch.eye(3), atol=1e-5)
    batch = torch.randn(2, 6, 2, generator=torch.Generator().manual_seed(1))
    psgd._orthogonalize(batch)  # what powerSGD_hook itself passes still works
    assert all(torch.allclose(b.T @ b, torch.eye(2), atol=1e-5) for b in batch)


@pytest.mark.slow
def test_new_torch_arms_train_with_two_seeds_on_loopback_tiny(tmp_path):
    """fp16-powersgd and batched-powersgd train past start_powerSGD_iter (10), so compression really runs, once per
    seed; results keep every seed's run and aggregate them; the report and console show the per-arm table."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from dgt.cli import main

    try:
        psgd._orthogonalize(torch.ones(2, 1))
        torch_rejects_2d = False
    except AssertionError:
        torch_rejects_2d = True
    out = str(tmp_path / "res")
    rc = main(["experiment", "ddp", "--network", "loopback", "--workers", "2", "--max-iters", "12", "--eval-every",
               "6", "--target", "0.999", "--arms", "gloo,fp16-powersgd,batched-powersgd", "--seeds", "0,1",
               "--no-plots", "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["seeds"] == [0, 1]
    assert [(r["seed"], r["arm"]) for r in res["runs"]] == [
        (s, a) for s in (0, 1) for a in ("gloo", "fp16-powersgd", "batched-powersgd")]
    for r in res["runs"]:
        assert r["run_dir"] == os.path.join(out, f"seed{r['seed']}", r["arm"]) and os.path.isdir(r["run_dir"])
        s = r["summary"]
        assert s["iterations_run"] == 12 and len(r["steps"]) == 12 and s["step_p95"] >= s["step_median"] > 0
        if r["arm"] == "gloo":
            assert r["hook"] == [None, None]
            continue
        for h in r["hook"]:  # steps 11 and 12 were compressed on every rank
            assert h["iter"] == 12 and h["start_powerSGD_iter"] == 10
            assert 0 < h["numel_after_compression"] < h["numel_before_compression"]
            # every PowerSGD arm: its gradient in one DDP bucket (ddp_options); batched: _orthogonalize where needed
            assert any("bucket_cap_mb" in w for w in h["workarounds"])
            orth = [w for w in h["workarounds"] if "_orthogonalize" in w]
            assert bool(orth) == (r["arm"] == "batched-powersgd" and torch_rejects_2d)
    batched = res["runs"][2]["hook"][0]
    per_layer = res["runs"][1]["hook"][0]
    assert batched["numel_after_compression"] < per_layer["numel_after_compression"]  # one square matrix per bucket
    for arm in ("gloo", "fp16-powersgd", "batched-powersgd"):
        st = res["stats"][arm]
        assert st["seeds"] == [0, 1] and st["time_to_target"]["n"] == 2
        per_seed = [r["summary"]["step_p95"] for r in res["runs"] if r["arm"] == arm]
        assert st["step_p95"]["values"] == per_seed and st["step_p95"]["median"] == pytest.approx(
            sum(per_seed) / 2)
        assert res["ratios"][arm]["step_p50"] > 0 and res["ratios"][arm]["time_to_target"] is None
    assert res["ratios"]["gloo"]["step_p95"] == 1.0
    text = open(os.path.join(out, "report.md")).read()
    assert "| fp16-powersgd |" in text and "### Seed 1" in text and "Step p95 (s)" in text


def test_run_ddp_runs_every_arm_per_seed_and_keeps_each_run(tmp_path, monkeypatch):
    """The seed loop without processes: _one_arm is replaced by a fake that trains nothing."""
    from dgt.experiment import ddp_runner
    from dgt.experiment.config import NetworkConfig

    calls = []

    def fake(cfg, arm, mode, index, ui, seed, per_seed_dirs):
        calls.append((arm, seed, per_seed_dirs, index))
        steps = {"gloo": 0.2, "fp16": 0.1}[arm]
        run = _run(arm, seed, [steps] * (10 + seed), 10 + seed)
        run["curve"] = [{"it": 10 + seed, "train_time": steps * (10 + seed), "acc": 0.99}]
        return run

    monkeypatch.setattr(ddp_runner, "_one_arm", fake)
    net = NetworkConfig(mode="loopback", prefix="dgtd")
    res = ddp_runner.run_ddp(DDPConfig(arms=["gloo", "fp16"], seeds=[4, 2], network=net,
                                       out_dir=str(tmp_path / "a")))
    with open(tmp_path / "a" / "accuracy_vs_time.png", "rb") as f:  # one line per seed, one colour per arm
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "a" / "report.md").read_text()
    assert "seeds 4, 2 (every arm once per seed)" in report and "### Seed 4" in report and "### Seed 2" in report
    assert calls == [("gloo", 4, True, 0), ("fp16", 4, True, 1), ("gloo", 2, True, 2), ("fp16", 2, True, 3)]
    assert res["seeds"] == [4, 2]
    assert [(r["arm"], r["seed"]) for r in res["runs"]] == [("gloo", 4), ("fp16", 4), ("gloo", 2), ("fp16", 2)]
    assert res["stats"]["gloo"]["seeds"] == [4, 2] and res["stats"]["gloo"]["iterations"]["values"] == [14, 12]
    assert res["ratios"]["fp16"]["time_to_target"] == pytest.approx(0.5) and res["best_torch"] == "fp16"
    with open(tmp_path / "a" / "results.json") as f:
        assert json.load(f)["stats"]["fp16"]["time_to_target"]["median"] == pytest.approx(1.3)
    calls.clear()
    one = ddp_runner.run_ddp(DDPConfig(arms=["gloo"], seeds=[5], network=net, plots=False,
                                       out_dir=str(tmp_path / "b")))
    assert calls == [("gloo", 5, False, 0)] and one["seeds"] == [5]  # one seed: out/ARM, the seed given
    calls.clear()
    ddp_runner.run_ddp(DDPConfig(arms=["gloo"], seed=3, network=net, plots=False, out_dir=str(tmp_path / "c")))
    assert calls == [("gloo", 3, False, 0)]


def test_powersgd_arms_get_the_whole_gradient_in_one_ddp_bucket(monkeypatch):
    """torch's PowerSGD hooks issue chained all-reduces from completion callbacks: with DDP's two default buckets the
    ranks can issue them in different orders (Gloo aborted the ResNet run). Their arms get a bucket cap above the
    gradient's size (an explicit cap also sets DDP's first-bucket cap to it); every other arm keeps torch's defaults."""
    from dgt.experiment import ddp_worker
    from dgt.experiment.workloads import build_workload

    monkeypatch.setattr(ddp_worker, "WORKAROUNDS", [])
    model = build_workload("resnet").model
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    for arm in ("gloo", "fp16", "dgt-hook", "dgt-backend"):
        assert ddp_worker.ddp_options(arm, model) == {}
    assert ddp_worker.WORKAROUNDS == []
    for arm in ddp_worker.POWERSGD_ARMS:
        cap = ddp_worker.ddp_options(arm, model)["bucket_cap_mb"]
        assert cap >= 25 and cap > mib
    assert len(ddp_worker.WORKAROUNDS) == len(ddp_worker.POWERSGD_ARMS) and "one bucket" in ddp_worker.WORKAROUNDS[0]
    big = torch.nn.Linear(4096, 2048)  # 32 MiB of float32: the cap grows past torch's 25 MiB default
    assert ddp_worker.ddp_options("powersgd", big)["bucket_cap_mb"] == 33
