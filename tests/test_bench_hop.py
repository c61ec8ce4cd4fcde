"""``dgt bench hop``: one lossy ring hop through the sans-IO protocol, stage by stage."""

import argparse

from dgt.bench import hop


def _args(*flags: str, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    hop.add_arguments(p)
    return p.parse_args([*flags, *(f"--{k}={v}" for k, v in kw.items())])


def test_hop_bench_times_every_stage_and_the_round_delivers_what_was_sent():
    res = hop.run(_args(mb=0.5, rounds=3, budget=20000))
    stages = {"encode", "prepare", "plan", "receive reliable", "receive datagrams", "ring add", "drop report"}
    assert stages <= set(res["cpu_ms_per_hop"]) and res["cpu_ms_total"] > 0 and res["anchor_copy_ms"] >= 0
    per = res["per_round"]
    assert per["unsent"] > 0 and per["datagrams"] > 0  # the budget kept blocks back, and some went as datagrams
    assert per["received"] == res["blocks"] - per["unsent"]  # nothing is lost without a network: all sent arrive


def test_hop_bench_without_a_budget_sends_every_block():
    res = hop.run(_args("--no-mac", mb=0.5, rounds=2, budget=-1))
    assert res["per_round"]["unsent"] == 0 and res["per_round"]["received"] == res["blocks"]
