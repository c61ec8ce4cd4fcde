"""``dgt bench allreduce`` end to end on a small tensor: the report's shape, ratios consistent with its own times,
and every DGT method's result checked against Gloo's sum (speed itself is measured by the benchmark, not here)."""

import argparse
import math

import pytest

from dgt.bench import allreduce
from dgt.channels.duplex import NATIVE
from dgt.cliargs import BadOption


@pytest.mark.parametrize("hops", ["auto", "off"])
def test_bench_reports_times_ratios_and_agreement_with_gloo(hops):
    args = argparse.Namespace(ranks=3, mb=0.3, repeat=2, codec="dense", timeout=240.0, stream_hops=hops,
                              collectives="ring,ps_sharded,ps_central")
    out = allreduce.run(args)
    assert out["ring_hops"].startswith("session link" if hops == "off" else "native loop" if NATIVE else "python loop")
    sec = out["seconds"]
    assert set(sec) == {"gloo", "ring", "ps_sharded", "ps_central"} and all(v > 0 for v in sec.values())
    for k, ratio in out["speed_vs_gloo"].items():
        assert math.isclose(ratio, sec["gloo"] / sec[k])
    assert out["goal_met"] == (out["speed_vs_gloo"]["ring"] >= 1.0)
    assert out["goal"] == "lossless DGT ring >= 1.0x Gloo: 0.3 MB at 3 ranks (this run)"  # what ran (issue 41.4)
    # lossless: the same sum as Gloo's up to float rounding (a NaN would mean part of the result was never written)
    diffs = out["max_rel_diff_vs_gloo"]
    assert set(diffs) == {"ring", "ps_sharded", "ps_central"}
    assert all(d < 1e-5 for d in diffs.values()), diffs


def test_bench_times_only_the_collectives_asked_for():
    args = argparse.Namespace(ranks=2, mb=0.1, repeat=2, codec="dense", timeout=240.0, stream_hops="auto",
                              collectives="ps_central")
    out = allreduce.run(args)
    assert set(out["seconds"]) == {"gloo", "ps_central"} and "goal_met" not in out  # the goal is the ring's
    assert out["max_rel_diff_vs_gloo"]["ps_central"] < 1e-5
    with pytest.raises(BadOption, match="unknown"):
        allreduce.run(argparse.Namespace(**{**vars(args), "collectives": "ring,tree"}))


@pytest.mark.skipif(not NATIVE, reason="hop threads are a native-loop setting")
def test_bench_times_the_ring_once_per_hop_thread_count():
    args = argparse.Namespace(ranks=2, mb=0.2, repeat=2, codec="dense", timeout=240.0, stream_hops="auto",
                              collectives="ring", hop_threads="1,2")
    out = allreduce.run(args)
    assert set(out["seconds"]) == {"gloo", "ring/1t", "ring/2t"} and "goal_met" not in out
    assert out["ring_hops"] == "native loop, 1/2 thread(s)"
    assert all(d < 1e-5 for d in out["max_rel_diff_vs_gloo"].values()), out["max_rel_diff_vs_gloo"]
    with pytest.raises(BadOption, match="hop-threads"):
        allreduce.run(argparse.Namespace(**{**vars(args), "hop_threads": "3"}))


def test_bench_reports_each_trial_with_its_cpu_and_unreliable_lane_counters():
    """Per trial: the slowest rank's time (the best and the median come from these), the mean CPU per rank, and for a
    lossy codec what the unreliable lanes did in that trial (what makes one trial slower than another)."""
    args = argparse.Namespace(ranks=2, mb=0.3, repeat=3, codec="dgt:p=0.3", timeout=240.0, stream_hops="auto",
                              collectives="ring")
    out = allreduce.run(args)
    trials = out["per_trial"]
    assert set(trials) == {"gloo", "ring"} and all(len(v) == 3 for v in trials.values())
    for name, rows in trials.items():
        assert min(r["seconds"] for r in rows) == out["seconds"][name]
        assert all(r["cpu_ms_per_rank"] > 0 for r in rows)
        assert out["cpu_ms_per_rank_median"][name] == sorted(r["cpu_ms_per_rank"] for r in rows)[1]
    ring = trials["ring"]
    # the endpoints' totals over every call (the uncounted warm-up and the 3 trials): each call plans the same number
    # of unimportant blocks (p is constant), and over loopback each goes as one datagram (a block fits one), was
    # abandoned (its round closed first) or was kept back by the send budget
    tot = out["transport"].values()
    planned = sum(t["udp_datagrams_sent"] + t["udp_abandoned"] + t["unsent_blocks"] for t in tot)
    assert planned > 0 and planned % 4 == 0, planned
    per_call = planned // 4
    for r in ring:
        assert all(isinstance(r[f], int) for f in ("datagrams", "unsent_blocks", "lost_blocks"))
        # sent or kept back, never more than were planned; what was neither was abandoned, and so reported lost
        assert r["datagrams"] + r["unsent_blocks"] <= per_call <= r["datagrams"] + r["unsent_blocks"] + r["lost_blocks"]
        assert r["lost_blocks"] <= per_call - r["unsent_blocks"]  # only a block handed to the lane can be lost
        # the receivers' waits (summed over the 2 ranks) happened within the trial (its slowest rank's time)
        assert 0 <= r["deadline_wait_s"] <= 2 * r["seconds"], r
    # the trials' counters are part of the endpoints' totals (which also hold the warm-up call)
    for f, k in (("datagrams", "udp_datagrams_sent"), ("unsent_blocks", "unsent_blocks"),
                 ("lost_blocks", "lost_blocks"), ("cpu_gated_rounds", "cpu_gated_rounds")):
        assert sum(r[f] for r in ring) <= sum(t[k] for t in tot), f
    assert sum(r["deadline_wait_s"] for r in ring) <= sum(t["deadline_wait_total"] for t in tot) + 1e-9
    # every unimportant block of every trial either went out as datagrams or was kept back (or both, in part)
    assert all(r["datagrams"] + r["unsent_blocks"] > 0 for r in ring)
    for r in trials["gloo"]:  # no DGT round is planned, sent or received during Gloo's trials
        assert r["datagrams"] == r["unsent_blocks"] == r["lost_blocks"] == r["cpu_gated_rounds"] == 0, r
        assert r["deadline_wait_s"] == 0.0, r


def test_bench_times_several_codecs_in_one_run_and_reports_each_against_the_first():
    """``--codec dense --codec dgt:p=0.3``: each collective once per codec, trial by trial in the same run, and the
    lossy ring's best and median time over the lossless ring's (issue 26's ratio, without two runs to compare)."""
    args = argparse.Namespace(ranks=2, mb=0.2, repeat=2, codec=["dense", "dgt:p=0.3", "dense"], timeout=240.0,
                              stream_hops="auto", collectives="ring,ps_central")
    out = allreduce.run(args)
    assert out["codec"] == ["dense", "dgt:p=0.3"]  # a repeated codec is timed once
    sec, med = out["seconds"], out["median_seconds"]
    assert set(sec) == {"gloo", "ring[dense]", "ring[dgt:p=0.3]", "ps_central[dense]", "ps_central[dgt:p=0.3]"}
    assert "goal_met" not in out  # the lossless-ring goal is a one-codec run's
    vs = out["vs_first_codec"]
    assert out["lossy_goal_met"] == (vs["ring[dgt:p=0.3]"]["best"] <= 1.5)  # the ring's, not the PS's
    assert set(vs) == {"ring[dgt:p=0.3]", "ps_central[dgt:p=0.3]"}
    for k, r in vs.items():
        base = k.replace("[dgt:p=0.3]", "[dense]")
        assert math.isclose(r["best"], sec[k] / sec[base]) and math.isclose(r["median"], med[k] / med[base])
    assert all(len(v) == 2 for v in out["per_trial"].values())
    assert out["per_trial"]["ring[dgt:p=0.3]"][0]["datagrams"] + out["per_trial"]["ring[dgt:p=0.3]"][0][
        "unsent_blocks"] > 0
    diffs = out["max_rel_diff_vs_gloo"]
    assert diffs["ring[dense]"] < 1e-5 and diffs["ps_central[dense]"] < 1e-5, diffs  # lossless stays exact
    assert all(d == d for d in diffs.values())  # no method left part of the result unwritten (NaN)


def test_bench_codec_option_repeats():
    import argparse as ap

    p = ap.ArgumentParser()
    allreduce.add_arguments(p)
    assert allreduce._codecs(p.parse_args([]).codec) == ("dense",)
    assert allreduce._codecs(p.parse_args(["--codec", "dgt:p=0.3"]).codec) == ("dgt:p=0.3",)
    assert allreduce._codecs(p.parse_args(["--codec", "dense", "--codec", "dgt:p=0.3"]).codec) == ("dense", "dgt:p=0.3")


def test_the_table_prints_bracketed_keys_as_text(capsys, monkeypatch):
    """``dgt bench ... `` without --json prints a rich table: a key such as ring[dgt:p=0.3] is text, not markup that
    rich would swallow (two rows then both read ``seconds.ring``)."""
    from dgt.bench import cli

    monkeypatch.setenv("COLUMNS", "160")
    cli._print_table({"bench": "allreduce", "seconds": {"ring[dense]": 0.5, "ring[dgt:p=0.3]": 0.75},
                      "per_trial": {"ring[dense]": [{"seconds": 0.5, "note": "[bold]x"}]}})
    out = capsys.readouterr().out
    assert "seconds.ring[dense]" in out and "seconds.ring[dgt:p=0.3]" in out
    assert "per_trial.ring[dense][0]" in out and "[bold]x" in out


def test_the_cpu_gate_can_be_switched_off_for_a_run():
    """``--cpu-gate 0``: no lossy ring hop is kept from sending datagrams, whatever the host's load (the datagram
    path's own cost, beside the default run); a value outside [0, 1] is refused before any rank starts."""
    args = argparse.Namespace(ranks=2, mb=0.3, repeat=3, codec="dgt:p=0.3", timeout=240.0, stream_hops="auto",
                              collectives="ring", cpu_gate=0.0)
    out = allreduce.run(args)
    assert out["cpu_gate"] == 0.0
    assert all(r["cpu_gated_rounds"] == 0 for r in out["per_trial"]["ring"])
    assert all(t["cpu_gated_rounds"] == 0 and t["cpu_wait"] is None for t in out["transport"].values())
    with pytest.raises(BadOption, match="cpu-gate"):
        allreduce.run(argparse.Namespace(ranks=2, mb=0.3, repeat=1, codec="dense", timeout=60.0, cpu_gate=1.5))


def test_bench_times_the_direct_all_reduce_when_asked_lossless_and_lossy():
    args = argparse.Namespace(ranks=3, mb=0.2, repeat=1, codec=["dense", "dgt:p=1.0"], timeout=240.0,
                              stream_hops="auto", collectives="ring,direct")
    out = allreduce.run(args)
    assert set(out["seconds"]) == {"gloo", "ring[dense]", "direct[dense]", "ring[dgt:p=1.0]", "direct[dgt:p=1.0]"}
    diffs = out["max_rel_diff_vs_gloo"]
    assert all(d < 1e-5 for d in diffs.values()), diffs  # p=1: every block reliable, the sum exact
