"""Slow: LGC (PS and ring) vs dense training of a small CNN on scikit-learn's digits, 2 ranks, shortened phases."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch


@pytest.mark.slow
def test_lgc_converges_close_to_dense_at_100x():
    from dgt.bench.lgc import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # shortened phases (the bench defaults are 200 / 300 / 1000): 150 dense, 50 top-k + AE training, 200 compressed
    argv = ["--ranks", "2", "--warmup", "150", "--ae-iters", "50", "--iters", "400", "--threads", "1", "--no-ablation"]
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args)
    wall = time.perf_counter() - t0
    s = res["summary"]
    print(json.dumps({**s, "wall_s": round(wall, 1)}, indent=1))
    assert torch.get_num_threads() == 1
    for key in ("dense", "lgc_ps", "lgc_ring"):
        assert res[key]["replicas_identical"], key
    assert s["accuracy_dense"] > 90.0  # the baseline really learned
    assert s["gap_ps_points"] <= 2.0 and s["gap_ring_points"] <= 2.0
    assert s["compressed_phase_ratio_ps"] >= 100 and s["compressed_phase_ratio_ring"] >= 100
    for key in ("lgc_ps", "lgc_ring"):
        traffic = res[key]["traffic"]
        assert traffic["phases"]["compressed"]["iterations"] == 200
        assert traffic["phases"]["dense"]["ratio"]["all_layers"] == pytest.approx(1.0, abs=0.01)  # warm-up is dense
        rec = res[key]["reconstruction"]  # measured on the 200 compressed rounds; zeros would give 1.0
        assert rec["rounds"] == 200 and rec["rel_error"] < 0.9 and rec["cosine"] > 0.3
        acc = res[key]["accuracy"]
        assert acc["final"] >= acc["after_ae_training"] - 1.0  # the compressed phase did not lose what was learned
