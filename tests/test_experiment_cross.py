"""The cross flow beside an experiment run: the sink's arrival series, goodput within the training iterations, the
comparison of the two runs and the report (unit), and a real flow through a namespace bottleneck (root)."""

from __future__ import annotations

import os
import time

import pytest

from dgt.experiment.metrics import compare, cross_flow
from dgt.experiment.report import render
from dgt.netem.crosstraffic import FlowResult


def _flow(t0: float, per_bin: list[int], bin_s: float = 0.1) -> FlowResult:
    """A FlowResult as the sink reports it (run_sink's keys), bytes per bin from t0."""
    nz = [i for i, b in enumerate(per_bin) if b]
    received = {"proto": "tcp", "bytes": sum(per_bin), "packets": len(nz), "span_s": (nz[-1] - nz[0]) * bin_s,
                "goodput_bps": 0.0, "first_at": t0 + nz[0] * bin_s, "last_at": t0 + nz[-1] * bin_s,
                "series": {"t0": t0, "bin_s": bin_s, "bytes": per_bin}}
    return FlowResult(sent={"bytes": sum(per_bin) + 10, "packets": 5}, received=received)


def _records(starts: list[float], bct: float) -> list[dict]:
    return [{"it": i + 1, "at": s, "bct": bct} for i, s in enumerate(starts)]


def test_goodput_during_counts_only_the_windows_and_bins_in_proportion():
    f = _flow(100.0, [1000] * 10)  # 1000 bytes in each 0.1 s from t=100.0 to 101.0
    assert f.bytes_during([100.0], [101.0]).tolist() == pytest.approx([10000])
    assert f.bytes_during([100.05, 100.5], [100.15, 100.55]).tolist() == pytest.approx([1000, 500])
    assert f.bytes_during([99.0], [100.0]).tolist() == pytest.approx([0])  # before the first bin
    assert f.goodput_during([100.0, 100.5], [100.2, 100.7]) == pytest.approx(4000 * 8 / 0.4)
    assert f.goodput_during([100.0], [100.0]) is None
    assert f.spans(100.0, 100.9) and not f.spans(99.9, 100.5) and not f.spans(100.1, 101.0)
    with pytest.raises(ValueError, match="series"):
        FlowResult(sent={}, received={"bytes": 0}).goodput_during([0.0], [1.0])


def test_a_flow_says_when_the_host_took_the_machine_away(monkeypatch):
    """FlowResult.disturbed: steal above the share of the machine's CPU time over the flow's wall time."""
    from dgt.netem.crosstraffic import host_steal_s

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    quiet = FlowResult(sent={}, received={}, host_steal_s=0.05, wall_s=2.0)  # 1.25 % of 4 CPU-seconds
    stolen = FlowResult(sent={}, received={}, host_steal_s=0.2, wall_s=2.0)  # 5 %
    assert not quiet.disturbed() and stolen.disturbed()
    assert quiet.disturbed(share=0.01) and not stolen.disturbed(share=0.06)
    assert not FlowResult(sent={}, received={}).disturbed()  # no figures (an older result, or no steal column)
    first = host_steal_s()
    if first is None:
        pytest.skip("this kernel reports no steal time in /proc/stat")
    time.sleep(0.02)
    assert host_steal_s() >= first >= 0.0


def test_cross_flow_takes_the_training_iterations_until_the_target_and_the_report_shows_both_runs():
    # the flow gets 2000 B/bin while the run is idle (start-up, evaluation pauses) and 500 B/bin during iterations
    bins = [2000] * 100
    starts = [101.0, 102.0, 103.0, 104.0]
    for s in starts:
        for i in range(int(round((s - 100.0) / 0.1)), int(round((s + 0.5 - 100.0) / 0.1))):
            bins[i] = 500
    base = cross_flow(_flow(100.0, bins), _records(starts, 0.5), n=3, proto="tcp", rate="20mbit")
    assert base["goodput_training_bps"] == pytest.approx(500 * 8 / 0.1)  # idle time between iterations excluded
    assert base["training_s"] == pytest.approx(1.5) and base["spans_run"] is True
    assert base["received_bytes"] == sum(bins) and base["proto"] == "tcp"
    # beside DGT the flow gets 1500 B/bin in the iterations, but the run ends before the flow's data starts coming
    late = [0] * 12 + [1500] * 88
    dgt = cross_flow(_flow(100.0, late), _records(starts, 0.5), n=4, proto="tcp", rate="20mbit")
    assert dgt["spans_run"] is False  # nothing arrived before the first iteration started
    assert dgt["goodput_training_bps"] == pytest.approx((1500 * 15 + 1500 * 3) * 8 / 2.0)
    summary = {"bct_mean": 1.0, "time_to_target": 1.0, "iterations": 3, "reached": True,
               "delivered_per_iteration": 1.0}
    c = compare(dict(summary, cross_flow=base), dict(summary, cross_flow=dgt))
    assert c["cross_goodput_ratio"] == pytest.approx(dgt["goodput_training_bps"] / base["goodput_training_bps"])
    assert compare(summary, summary)["cross_goodput_ratio"] is None  # no cross flow: no ratio
    # no series (old sink): the whole-flow figure only
    plain = FlowResult(sent={"bytes": 5}, received={"bytes": 4, "goodput_bps": 32.0})
    assert cross_flow(plain, _records(starts, 0.5), 4, "udp", "1mbit")["goodput_training_bps"] is None

    lanes = {"0": {"tx_bytes": 900, "tx_frames": 9, "delivered_bytes": 900, "delivered_blocks": 9},
             "1": {"tx_bytes": 500, "tx_frames": 5, "rx_bytes": 300, "delivered_bytes": 280, "delivered_blocks": 3,
                   "tx_unsent_blocks": 7, "tx_lost_blocks": 2, "tx_abandoned": 1}}
    run_s = dict(summary, bytes_per_lane={"0": 1}, bytes_delivered_per_lane={}, train_time=1.0, dropped_blocks=0,
                 drop_rate=0.0, p_mean=1.0, bct_p95=1.0, compute_mean=0.1, transport_lanes=lanes)
    results = {
        "config": {"server": "0", "lossy_pull": True, "workers": 4, "lr": 0.1, "momentum": 0.0, "batch": 32,
                   "seed": 0, "eval_every": 2, "target": 0.97, "max_iters": 10, "max_time": 10.0,
                   "deadline": "fixed:0.002", "codecs": {"baseline": "dense", "dgt": "dgt"},
                   "network": {"cross_proto": "tcp", "cross_traffic": "20mbit", "cross_dscp": 0}},
        "network": {"mode": "netem", "description": "x"},
        "dataset": {"name": "digits", "train": 1, "test": 1, "shape": [1, 8, 8]}, "models": {},
        "machine": {"cpus": 2},
        "runs": [{"model": "alexnet", "protocol": "baseline", "summary": dict(run_s, cross_flow=base),
                  "queues": {"into_server": {"FIFO": {"bytes": 5000, "packets": 5, "drops": 3}}}},
                 {"model": "alexnet", "protocol": "dgt", "summary": dict(run_s, cross_flow=dgt)}],
        "comparisons": {"alexnet": dict(c, bct_reduction=0.0, time_reduction=0.0, iteration_increase=0.0)},
    }
    md = render(results)
    assert "## Cross traffic beside each run" in md and "TCP flow paced to 20mbit" in md
    assert f"| AlexNet | baseline | {base['goodput_training_bps'] / 1e6:.2f} |" in md
    assert f"| AlexNet | dgt | {dgt['goodput_training_bps'] / 1e6:.2f} |" in md and "| no |" in md
    assert f"{c['cross_goodput_ratio']:.2f}x the goodput beside DGT" in md
    assert "one FIFO queue" in md and "| AlexNet | baseline | into server | 5.0 kB | 5 | 3 |" in md
    results["config"]["network"]["cross_traffic"] = "unpaced"
    assert "A TCP flow not paced (DSCP 0)" in render(results)
    from dgt.experiment.network import cross_rate

    assert cross_rate("unpaced") is None and cross_rate("20mbit") == "20mbit"
    # per lane: sent, delivered, unsent, lost
    assert "| AlexNet | dgt | 1 | 500 B | 300 B | 3 | 7 | 2 | 1 |" in md


def _netem_reason() -> str | None:
    from dgt.experiment.network import netem_unavailable_reason

    return netem_unavailable_reason()


@pytest.mark.root
@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_a_real_flow_records_its_arrivals_and_its_goodput_in_a_window(proto):
    if _netem_reason():
        pytest.skip(f"netem emulation unavailable: {_netem_reason()}")
    from dgt.netem import Flow, Topology

    with Topology(hosts=2, rate="40mbit", prefix=f"dgtc{os.getpid() % 100000}", replace=True) as topo:
        # idle=30: the sink waits out gaps, as in the experiment; stop() still ends it at once
        flow = Flow(topo, 1, 0, proto=proto, rate="10mbit", duration=20.0, port=5331, bin_s=0.02, burst=0.1,
                    idle=30.0)
        before = time.monotonic()
        flow.start()
        try:
            time.sleep(0.6)
            a = time.monotonic()
            time.sleep(1.0)
            b = time.monotonic()
            time.sleep(0.3)  # a paced flow sends a chunk every ~50 ms: let one arrive after the window
            stopping = time.monotonic()
            res = flow.stop()
            assert time.monotonic() - stopping < 5.0
        finally:
            flow.kill()
    ser = res.received["series"]
    assert sum(ser["bytes"]) == res.received["bytes"] > 0 and ser["bin_s"] == 0.02
    assert res.spans(a, b) and not res.spans(before - 1.0, b)
    assert res.bytes_during([before - 1.0], [before]).tolist() == [0.0]
    got = res.goodput_during([a], [b])
    print(f"paced {proto} flow, 10 Mbit/s asked, 40 Mbit/s link: {got / 1e6:.2f} Mbit/s in a 1 s window")
    assert 7e6 <= got <= 12e6  # the sender paces to the rate (a bounded credit: it never catches up in a burst)
