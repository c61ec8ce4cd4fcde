"""``dgt bench hop``: one lossy ring hop through the sans-IO protocol, stage by stage."""

import argparse

import pytest

from dgt.bench import hop


def _args(*flags: str, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    hop.add_arguments(p)
    return p.parse_args([*flags, *(f"--{k}={v}" for k, v in kw.items())])


def _cpu_figures_add_up(res: dict) -> None:
    """Every stage ran and took CPU time (process_time counts in ns: no stage of a 0.5 MB hop is under one), the total
    is the stages' sum, and the copy anchor is a real copy's time with the ratio taken against it."""
    per = res["cpu_ms_per_hop"]
    assert all(v > 0 for v in per.values()), per
    assert res["cpu_ms_total"] == pytest.approx(sum(per.values()))
    anchor = res["anchor_copy_ms"]
    assert anchor > 0 and res["total_vs_copy"] == pytest.approx(res["cpu_ms_total"] / anchor)


def test_hop_bench_times_every_stage_and_the_round_delivers_what_was_sent():
    res = hop.run(_args(mb=0.5, rounds=3, budget=20000))
    stages = {"encode", "prepare", "plan", "receive reliable", "receive datagrams", "ring add", "drop report"}
    assert stages <= set(res["cpu_ms_per_hop"])
    _cpu_figures_add_up(res)
    per = res["per_round"]
    assert per["unsent"] > 0 and per["datagrams"] > 0  # the budget kept blocks back, and some went as datagrams
    assert per["received"] == res["blocks"] - per["unsent"]  # nothing is lost without a network: all sent arrive


def test_hop_bench_without_a_budget_sends_every_block():
    res = hop.run(_args("--no-mac", mb=0.5, rounds=2, budget=-1))
    assert res["per_round"]["unsent"] == 0 and res["per_round"]["received"] == res["blocks"]


def test_hop_bench_delivers_the_odd_size_datagrams_of_a_partial_tail_block():
    """0.5 MB is 122 full blocks and a 72-element tail, which goes as an odd-size datagram in the rounds where it is
    unimportant: the bench must deliver it too (it used to read only the equal-size rows), not count it lost."""
    res = hop.run(_args("--split", mb=0.5, rounds=4, budget=-1))
    per = res["per_round"]
    assert per["odd datagrams"] > 0 and per["unsent"] == 0
    assert per["received"] + per["important"] == res["blocks"] == 123


def test_hop_bench_split_times_the_split_hop_stages_and_accounts_for_every_block():
    res = hop.run(_args("--split", mb=0.5, rounds=3, budget=20000))
    assert res["split"] is True
    stages = set(res["cpu_ms_per_hop"])
    assert {"encode", "plan_split", "receive reliable", "pack datagrams", "receive datagrams", "finalise", "combine",
            "drop report"} <= stages
    assert not stages & {"prepare", "plan", "ring add"}  # the round hop's stages are not run
    _cpu_figures_add_up(res)
    per = res["per_round"]
    assert per["important"] > 0 and per["unsent"] > 0 and per["datagrams"] > 0
    # every block once: on the stream lane, kept back by the budget, or received in the round (no network here)
    assert per["important"] + per["unsent"] + per["received"] == res["blocks"]
