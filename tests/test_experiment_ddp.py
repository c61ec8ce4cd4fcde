"""`dgt experiment ddp`: profiles, configuration, summaries and report, and every arm end to end on a tiny
configuration on loopback (netem when root, for one arm pair)."""

import json
import os

import pytest

from dgt.experiment.config import NetworkConfig
from dgt.experiment.ddp_config import ARMS, PROFILES, DDPConfig, profile_network
from dgt.experiment.ddp_report import render
from dgt.experiment.ddp_runner import profile_unsupported, summarize
from dgt.experiment.ddp_stats import aggregate, best_torch, ratios


def test_profiles_build_the_networks_the_issue_names():
    base = NetworkConfig(rate="40mbit", prefix="dgtd", cross_traffic="9mbit")
    pri = profile_network("priority", base)
    assert pri.priority and pri.cross_traffic is None and pri.loss == 0 and pri.delay is None
    fifo = profile_network("fifo", base)
    assert not fifo.priority and fifo.cross_traffic is None and fifo.loss == 0
    cross = profile_network("cross", base)
    assert not cross.priority and cross.cross_traffic == "20000000bit" and cross.cross_proto == "tcp"
    lossy = profile_network("lossy", base)
    assert not lossy.priority and lossy.loss == pytest.approx(0.01) and lossy.delay is None
    wan = profile_network("wan", base)
    assert not wan.priority and wan.delay == "20ms" and wan.loss > 0
    with pytest.raises(ValueError, match="unknown profile"):
        profile_network("lan", base)
    assert set(PROFILES) == {"priority", "fifo", "cross", "lossy", "wan"}


def test_config_rejects_bad_values():
    for bad in (dict(arms=["nccl"]), dict(arms=[]), dict(profile="x"), dict(workers=1), dict(target=0.0),
                dict(max_iters=0)):
        with pytest.raises(ValueError):
            DDPConfig(**bad)
    assert DDPConfig().arms == list(ARMS) and DDPConfig().workers == 4


def test_profile_unsupported_only_asks_the_kernel_for_delay_or_loss_on_netem():
    cfg = DDPConfig(profile="wan", network=profile_network("wan", NetworkConfig()))
    assert profile_unsupported(cfg, "loopback") is None
    assert profile_unsupported(DDPConfig(network=profile_network("fifo", NetworkConfig())), "netem") is None


def _rank(steps, evals, lanes=None, dropped=0):
    return {"steps": steps, "evals": evals, "train_time": sum(steps), "stop_reason": "target",
            "dgt": {"lanes": lanes or {}, "dropped": dropped, "blocks": 10} if lanes else {}}


def test_summarize_stops_at_the_first_evaluation_at_target_and_ratios_compare_with_gloo():
    evals = [{"it": 2, "train_time": 0.3, "acc": 0.5, "wire": {"tx": 200, "rx": 0}},
             {"it": 4, "train_time": 0.6, "acc": 0.9, "wire": {"tx": 400, "rx": 0}},
             {"it": 6, "train_time": 0.9, "acc": 0.95, "wire": {"tx": 600, "rx": 0}}]
    steps = [0.1, 0.2, 0.1, 0.2, 0.1, 0.2]
    s = summarize([_rank(steps, evals), _rank(steps, evals)], target=0.9)
    assert s["reached"] and s["iterations"] == 4 and s["time_to_target"] == 0.6
    assert s["step_mean"] == pytest.approx(0.15) and s["step_p95"] == 0.2
    assert s["wire_tx_per_rank_step"] == pytest.approx(100.0)
    miss = summarize([_rank(steps, evals, {"0": 60, "1": 30}, dropped=3)] * 2, target=0.99)
    assert not miss["reached"] and miss["time_to_target"] is None and miss["iterations"] == 6
    assert miss["dgt_lane_bytes_per_rank_step"] == {"0": 10.0, "1": 5.0} and miss["dgt_dropped_blocks"] == 6
    fast = summarize([_rank([0.05] * 6, evals)], target=0.9)
    r = ratios(aggregate([{"arm": "gloo", "summary": s}, {"arm": "dgt-hook", "summary": fast},
                          {"arm": "fp16", "summary": miss}, {"arm": "powersgd", "error": "boom"}]))
    assert r["gloo"] == {"time_to_target": 1.0, "step_mean": 1.0, "step_p50": 1.0, "step_p95": 1.0,
                         "steps_paired": 1.0, "time_to_target_paired": 1.0,
                         "time_to_target_vs_best_torch": None}  # the only torch arm (fp16) did not reach the target
    assert r["dgt-hook"]["time_to_target"] == pytest.approx(0.6 / 0.6) and r["dgt-hook"]["step_mean"] == \
        pytest.approx(0.05 / 0.15) and r["dgt-hook"]["step_p95"] == pytest.approx(0.05 / 0.2)
    assert r["fp16"]["time_to_target"] is None and "powersgd" not in r


def _results(profile, runs, skipped=None):
    stats = aggregate(runs)
    res = {"config": DDPConfig(profile=profile).to_dict(), "profile": profile, "profile_description": "d",
           "network": {"mode": "netem", "description": "n", "why_not_netem": None},
           "dataset": {"name": "digits"}, "model": {"parameters": 10, "gradient_bytes": 40},
           "arms": dict(ARMS), "runs": runs, "stats": stats, "ratios": ratios(stats), "best_torch": best_torch(stats)}
    if skipped:
        res["skipped"] = skipped
    return res


def test_report_says_whether_the_goals_are_met_and_says_a_skip():
    def run(arm, step):  # target reached at step 4: time to target 4 * step
        s = summarize([_rank([step] * 4, [{"it": 4, "train_time": 4 * step, "acc": 0.99, "wire": None}])], 0.97)
        return {"arm": arm, "seed": 0, "summary": s, "queues": q}

    q = {"into_server": {"EF": {"drops": 2}, "LE": {"drops": 5}}, "from_server": {"FIFO": {"drops": 1}}}
    runs = [run("gloo", 0.1), run("fp16", 0.06), run("dgt-hook", 0.08)]  # dgt-hook: 0.8x Gloo, fp16 0.6x
    runs.append({"arm": "powersgd", "seed": 0, "error": "x\ny"})
    runs.append(run("fp16-powersgd", 0.065))
    text = render(_results("priority", runs))
    assert "| powersgd | 0/1 | failed: x |" in text and text.count(" | 0 | 8 |") == 4  # 0 dropped blocks, 8 queue drops
    assert "| dgt-hook | 1/1 | 0.3 | 4 | 0.080 | 0.080 | 0.80x | 0.80x | 0.80x | 1.33x |" in text
    assert "time to target vs Gloo: 0.80x (goal <= 0.75x): NOT met" in text
    assert "step mean vs Gloo: 0.80x (goal <= 0.7x): NOT met (step p50 0.80x, p95 0.80x)" in text
    assert "best torch arm by median time to target: `fp16` (0.60x Gloo's); dgt-hook / best = 1.33x" in text
    assert "One seed" in text and "## Each seed" not in text
    skipped = render(_results("wan", [], skipped="profile 'wan' needs a delay line"))
    assert "**Skipped**: profile 'wan' needs a delay line" in skipped and "## Results" not in skipped


def test_cli_parses_ddp_and_no_priority():
    from dgt.cli import build_parser

    args = build_parser(["experiment"]).parse_args(["experiment", "ddp", "--profile", "fifo", "--arms", "gloo,fp16"])
    assert args.func.__name__ == "ddp" and args.profile == "fifo" and args.arms == "gloo,fp16" and args.workers == 4
    from dgt.experiment.cli import _config
    from dgt.experiment.config import ExperimentConfig

    for argv, name in ((["demo", "--no-priority"], "demo"), (["experiment", "table1", "--no-priority"], "table1")):
        a = build_parser([argv[0]]).parse_args(argv)
        assert a.func.__name__ == name and a.no_priority
        assert _config(a, ExperimentConfig()).network.priority is False
    a = build_parser(["demo"]).parse_args(["demo"])
    assert _config(a, ExperimentConfig()).network.priority is True


def test_netem_asked_for_without_it_is_a_clear_error(monkeypatch, capsys):
    from dgt.cli import main
    from dgt.experiment import network

    monkeypatch.setattr(network, "netem_unavailable_reason", lambda: "not root (network namespaces need CAP_NET_ADMIN)")
    assert main(["experiment", "ddp", "--network", "netem", "--out", "/tmp/dgt-ddp-never-written"]) == 2
    assert "--network netem: not root" in capsys.readouterr().out


@pytest.mark.slow
def test_every_arm_trains_on_loopback_tiny(tmp_path):
    from dgt.cli import main

    out = str(tmp_path / "res")
    rc = main(["experiment", "ddp", "--network", "loopback", "--workers", "2", "--max-iters", "3", "--eval-every",
               "3", "--target", "0.99", "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["network"]["mode"] == "loopback" and "NOT emulated" in res["network"]["description"]
    assert [r["arm"] for r in res["runs"]] == list(ARMS)
    for r in res["runs"]:
        s = r["summary"]
        assert s["iterations"] == 3 and s["iterations_run"] == 3 and len(r["steps"]) == 3, r["arm"]
        assert s["step_mean"] > 0 and len(r["curve"]) == 1 and 0.0 <= r["curve"][0]["acc"] <= 1.0
        assert s["wire_tx_per_rank_step"] is None  # loopback: no per-host wire counter
    hook = next(r for r in res["runs"] if r["arm"] == "dgt-hook")
    assert hook["summary"]["dgt_lane_bytes_per_rank_step"]["0"] > 0  # the dense warm-up went over DGT's TCP lane
    assert all(d["buckets"] >= 3 and d["codec_buckets"] >= 2 for d in hook["dgt"])  # 1 dense warm-up step
    for d in hook["dgt"]:  # what explains a step's time: per path (phases) and the endpoint's deadline waits
        assert d["paths"]["lossless"]["buckets"] >= 1 and d["paths"]["lossless"]["seconds"] > 0
        tr = d["transport"]
        # the endpoint's TCP lane carried at least the payload bytes the hook counted as sent on lane 0 (and headers)
        assert 0 < d["lanes"]["0"] <= tr["lanes"]["critical"]["tx_bytes"], (d["lanes"], tr["lanes"])
        # every DGT round received closed one way or another, none aborted (the lossless hops' stream messages are
        # not rounds: 0 of each here)
        assert sum(tr["closed_by"].values()) == tr["rounds_received"] and "aborted" not in tr["closed_by"], tr
        # the deadline waits are parts of the rounds' time: the longest within the sum, the sum within the rounds'
        assert 0 <= tr["deadline_wait_max"] <= tr["deadline_wait_total"] <= tr["receive_seconds"], tr
        if d["lossy_buckets"] == 0:  # no lossy round was run (3 steps: the chooser's first is lossless): no wait
            assert tr["deadline_wait_total"] == 0.0 and tr["blocks_dropped"] == 0, tr
    fed = next(r for r in res["runs"] if r["arm"] == "dgt-hook-loss")
    assert all(d["codec_buckets"] >= 1 for d in fed["dgt"]) and fed["summary"]["dgt_lane_bytes_per_rank_step"]["0"] > 0
    backend = next(r for r in res["runs"] if r["arm"] == "dgt-backend")
    assert all(d["backend"]["dgt"] >= 2 for d in backend["dgt"])  # DDP's all-reduces went over DGT
    assert set(res["ratios"]) == set(ARMS) and res["ratios"]["gloo"]["step_mean"] == 1.0
    text = open(os.path.join(out, "report.md")).read()
    assert "| dgt-backend |" in text and "NOT emulated" in text
    with open(os.path.join(out, "accuracy_vs_time.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _tiny_loopback_run(tmp_path, arms: list[str], iters: int) -> dict:
    """``dgt experiment ddp`` on loopback, 2 workers, ``iters`` steps of ``arms`` (target out of reach); its
    results.json."""
    from dgt.cli import main

    out = str(tmp_path / "res")
    rc = main(["experiment", "ddp", "--network", "loopback", "--workers", "2", "--max-iters", str(iters),
               "--eval-every", str(iters), "--target", "0.99", "--arms", ",".join(arms), "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_lowrank_arms_train_on_loopback_tiny(tmp_path):
    """The low-rank hook arms past their 10 dense iterations (torch's start_powerSGD_iter): the P/Q factors go
    over DGT's reliable lane and nothing is dropped; the rank-2 arm sends more factor bytes than rank 1. torch's
    powersgd-rank2 arm trains through its first compressed steps too."""
    arms = ["dgt-hook-lowrank", "dgt-hook-lowrank-ring", "dgt-hook-lowrank2", "powersgd-rank2"]
    res = _tiny_loopback_run(tmp_path, arms, 12)
    assert [r["arm"] for r in res["runs"]] == arms
    torch_arm = res["runs"].pop()
    assert torch_arm["summary"]["iterations"] == 12 and torch_arm["summary"]["step_mean"] > 0
    lane0 = {r["arm"]: sum(int(d["lanes"]["0"]) for d in r["dgt"]) for r in res["runs"]}
    assert lane0["dgt-hook-lowrank2"] > lane0["dgt-hook-lowrank"]
    for r in res["runs"]:
        s = r["summary"]
        assert s["iterations"] == 12 and len(r["steps"]) == 12 and s["step_mean"] > 0, r["arm"]
        for d in r["dgt"]:
            # 10 dense warm-up iterations, then 2 compressed ones; every bucket on the reliable lane, none dropped
            assert d["codec_buckets"] >= 2 and d["buckets"] >= 12 and d["dropped"] == 0, d
            assert int(d["lanes"]["0"]) > 0 and int(d["lanes"].get("1", 0)) == 0, d
            assert d["choice"] is None  # no chooser on the low-rank path


def _first_window(first: dict, full: int, block: int = 4) -> None:
    """A screened first window (DropChooser.screen) closes at iteration ``full`` (the warm-up's iterations (1, DDP's
    first) + its paths' full probes of ``block`` iterations - 1) less what it cut: ``block - 1`` iterations for a
    probe cut at its first iteration, ``block`` for one never run (the lossless ring, whose figure the warm-up
    gave)."""
    cut = first.get("cut", [])
    assert full - block * len(cut) <= first["iter"] <= full - (block - 1) * len(cut), first


@pytest.mark.slow
def test_choose_lowrank_sparse_and_pwarm_arms_on_loopback_tiny(tmp_path):
    """dgt-hook-choose-lowrank (DGTState(chooser="lowrank")) on 2 workers: after the dense warm-up (DDP's first
    iteration) its chooser probes low rank, lossy and lossless (4 iterations each, less what screening cuts),
    decides on the agreed figures, low rank weighed by its 1.5x steps prior, and the low-rank iterations ran on their
    own path.
    dgt-hook-noscreen probes all three in full and decides at iteration 12. dgt-hook-sparse (DGTState(sparse=True))
    trains through its probe window and counts what its owners held back. The default's low-rank path is rank 4;
    dgt-hook-rank2 probes it at rank 2; its factors travel as bfloat16, dgt-hook-fp32lr's as float32.
    dgt-hook-warm2 has two dense iterations, the default one."""
    arms = ["dgt-hook-choose-lowrank", "dgt-hook-sparse", "dgt-hook-pwarm", "dgt-hook-noskip", "dgt-hook-nolowrank",
            "dgt-hook-probe2", "dgt-hook-noscreen", "dgt-hook-rank2", "dgt-hook-fp32lr", "dgt-hook-warm2"]
    res = _tiny_loopback_run(tmp_path, arms, 16)
    choose, sparse, pwarm, noskip, nolowrank, probe2, noscreen, rank2, fp32lr, warm2 = res["runs"]
    assert [r["arm"] for r in res["runs"]] == arms
    assert choose["summary"]["iterations"] == sparse["summary"]["iterations"] == 16
    decisions = []
    for d in choose["dgt"]:
        assert d["paths"]["lowrank"]["buckets"] >= 1 and d["paths"]["lossy"]["buckets"] >= 1, d["paths"]
        first = d["choice"]["decisions"][0]
        _first_window(first, 12)
        assert set(first["seconds"]) == {"lossless", "lossy", "lowrank"}
        assert first["lowrank_weighed_s"] == pytest.approx(1.5 * first["seconds"]["lowrank"])
        decisions.append(first)
    assert all(repr(dec) == repr(decisions[0]) for dec in decisions), "every rank decides on the same agreed figures"
    for d in sparse["dgt"]:  # (the default's chooser: its probe window also runs the low-rank path)
        assert d["paths"]["lossy"]["buckets"] >= 1 and d["held_blocks"] >= 0 and d["paths"]["lowrank"]["buckets"] >= 1
    # dgt-hook-pwarm (DGTState(p_warmup=50)): 16 steps into its warm-up of p, after its lossy probe iterations
    # (the last lossy round at iteration <= 15: t <= 14 of 50), p is still far above the default's 0.1
    for d in pwarm["dgt"]:
        assert d["paths"]["lossy"]["buckets"] >= 1 and 0.1 ** (14 / 50) <= d["p"] <= 1.0, d
    # dgt-hook-noskip (the default's three paths, skip=math.inf): its first window decided, and it never sets a
    # path aside for the next re-probe, however far behind it was
    for d in noskip["dgt"]:
        decisions = d["choice"]["decisions"]
        _first_window(decisions[0], 12)
        assert all("skip_next" not in x for x in decisions), decisions
        assert set(decisions[0]["seconds"]) == {"lossless", "lossy", "lowrank"}
    # dgt-hook-nolowrank (chooser=True): DGT's two paths on 2 ranks (full window: iteration 8), no low-rank round
    for d in nolowrank["dgt"]:
        first = d["choice"]["decisions"][0]
        _first_window(first, 8)
        assert "seconds" not in first and "lowrank" not in d["paths"], d
    # dgt-hook-probe2 (probe=2): 1 + 2 iterations per path, the three paths' full window closes at 1 + 9 - 1 = 9
    for d in probe2["dgt"]:
        first = d["choice"]["decisions"][0]
        _first_window(first, 9, 3)
        assert set(first["seconds"]) == {"lossless", "lossy", "lowrank"}, d
        assert d["paths"]["lowrank"]["buckets"] >= 1, d["paths"]
    # dgt-hook-noscreen (screen=math.inf): every path probed in full, decided at iteration 12, nothing cut
    for d in noscreen["dgt"]:
        first = d["choice"]["decisions"][0]
        assert first["iter"] == 12 and "cut" not in first and d["paths"]["lowrank"]["buckets"] >= 4, d
    # the default's low-rank path is rank 4; dgt-hook-rank2 runs it at rank 2 (the default before), and probes it
    assert {d["lowrank_rank"] for d in choose["dgt"]} == {4} and {d["lowrank_rank"] for d in rank2["dgt"]} == {2}
    for d in rank2["dgt"]:
        assert d["paths"]["lowrank"]["buckets"] >= 1 and set(d["choice"]["decisions"][0]["seconds"]) == {
            "lossless", "lossy", "lowrank"}, d
    # the default's factors travel as bfloat16; dgt-hook-fp32lr's (the default before) as float32, also probed
    assert {d["lowrank_wire"] for d in choose["dgt"]} == {"bf16"} and {d["lowrank_wire"] for d in fp32lr["dgt"]} == {
        "native"} and {d["lowrank_rank"] for d in fp32lr["dgt"]} == {4}
    assert all(d["paths"]["lowrank"]["buckets"] >= 1 for d in fp32lr["dgt"])
    # dgt-hook-warm2 (warmup_iters=2, the default before): one more dense iteration, its window one iteration later
    for d, c in zip(warm2["dgt"], choose["dgt"]):
        _first_window(d["choice"]["decisions"][0], 13)
        assert d["buckets"] - d["codec_buckets"] > c["buckets"] - c["codec_buckets"] > 0, (d, c)  # dense buckets


def test_rank_zeros_decision_reaches_the_other_ranks_through_the_run_directory(tmp_path):
    """The evaluation pause's decision (worker.publish_decision): a waiting rank gets exactly what rank 0 wrote,
    whenever rank 0 writes it, and a clear error when it never does."""
    import threading

    from dgt.experiment.worker import await_decision, decision_path, publish_decision

    out = str(tmp_path)
    decision = {"value": 0.5, "stop": False, "reason": None}
    writer = threading.Timer(0.05, publish_decision, (out, 4, decision))
    writer.start()
    try:
        assert await_decision(out, 4, timeout=30) == decision
    finally:
        writer.cancel()
    assert os.path.exists(decision_path(out, 4)) and not os.path.exists(decision_path(out, 4) + ".tmp")
    with pytest.raises(TimeoutError, match="no decision for iteration 6"):
        await_decision(out, 6, timeout=0.01)


def test_a_stale_decision_in_a_reused_run_directory_is_not_read(tmp_path):
    """A run directory reused by a later run (same --out) holds the earlier run's decision files: launch() removes
    them before the workers start, and after. Here the stale file says 'stop' at iteration 2: read by rank 1 while
    rank 0 evaluates and goes on, it would leave rank 0 alone in the next all-reduce."""
    from dgt.cli import main
    from dgt.experiment.worker import decision_path, publish_decision

    out = str(tmp_path / "res")
    publish_decision(os.path.join(out, "gloo"), 2, {"value": 1.0, "stop": True, "reason": "target"})
    rc = main(["experiment", "ddp", "--network", "loopback", "--workers", "2", "--max-iters", "4", "--eval-every",
               "2", "--target", "0.99", "--arms", "gloo", "--out", out, "--no-plots"])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        run = json.load(f)["runs"][0]
    assert run["summary"]["iterations_run"] == 4 and len(run["curve"]) == 2  # no rank stopped at iteration 2
    assert not os.path.exists(os.path.dirname(decision_path(os.path.join(out, "gloo"), 2)))
