"""``dgt bench transport --variants dgt-p30-stale``: a paced sender's rounds closed by the receiver's deadline, the rest
abandoned. The bench runs and reports its figures, consistent with one another (their values are the benchmark's
business, not this test's)."""

import argparse
import statistics

import pytest

from dgt.bench import transport
from dgt.cliargs import BadOption


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    transport.add_arguments(p)
    return p.parse_args(list(flags))


@pytest.mark.slow  # (8.6 s; default suite time)
def test_stale_variant_reports_the_round_against_the_paced_send():
    out = transport.run(_args("--mb", "0.8", "--repeats", "2", "--variants", "dgt-p30-stale"))
    assert set(out["variants"]) == {"raw", "dgt-p30-stale"}  # the anchor always runs
    v = out["variants"]["dgt-p30-stale"]
    fig = out["stale_round"]
    assert fig == {k: v[k] for k in fig}  # the summary repeats the variant's own figures
    assert fig["pace_rate_fixed"] == 1e6 and v["pace_rate"] == [1e6, 1e6]  # the fixed pace, no controller
    # the unimportant bytes (70 % of the blocks, by the classification) at the fixed pace
    assert 0 < v["unimportant_bytes"] < out["bytes"]
    assert fig["paced_send_seconds"] == pytest.approx(v["unimportant_bytes"] / 1e6)
    assert fig["seconds_median"] == statistics.median(v["seconds"]) and all(t > 0 for t in v["seconds"])
    assert fig["seconds_vs_paced_send"] == pytest.approx(fig["seconds_median"] / fig["paced_send_seconds"])
    # what the figure is about: every round closed by the receiver's deadline with datagrams still queued at the
    # sender, abandoned there (each reported lost: one block per datagram over loopback), and none kept back
    assert fig["closed_by"] == ["deadline", "deadline"] and all(a > 0 for a in fig["abandoned_per_round"])
    assert all(lost >= a for lost, a in zip(v["lost_blocks"], fig["abandoned_per_round"]))
    assert v["unsent_blocks"] == [0, 0] and all(f < 1.0 for f in v["received_fraction"])
    # the last round, as every round: sent before the close or abandoned, every unimportant block
    assert v["datagrams"]["1"] + v["abandoned"]["1"] == v["unimportant_blocks"]


def test_stale_pace_must_be_positive_before_any_process_starts(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:  # the option's type: the parser's usage error
        _args("--stale-pace", "0", "--variants", "dgt-p30-stale")
    assert exc.value.code == 2 and "--stale-pace" in capsys.readouterr().err
    args = _args("--variants", "dgt-p30-stale")
    args.stale_pace = 0.0  # run() called without the parser checks it too
    with pytest.raises(BadOption, match="stale-pace"):
        transport.run(args)
