"""`dgt bench lgc --ablation`: the AE against a zero decoder and a template-only decoder in the same runs."""

from __future__ import annotations

import pytest
import torch

from dgt.bench.lgc import ablation_report


def _fake(acc, loss, rel, cos):
    return {"accuracy": {"final": acc}, "final_train_loss": loss,
            "reconstruction": {"rel_error": rel, "cosine": cos, "per_worker": []}}


def test_margin_is_taken_against_the_better_ablated_decoder():
    rep = ablation_report(_fake(97.0, 1e-3, 0.20, 0.98),
                          {"zero": _fake(96.0, 3e-3, 0.97, 0.20), "template": _fake(97.5, 2e-3, 0.32, 0.95)})
    m = rep["margin"]
    assert m["rel_error"] == pytest.approx(0.12)  # against the template (0.32), not zero (0.97)
    assert m["cosine"] == pytest.approx(0.03)
    assert m["accuracy"] == pytest.approx(-0.5)  # the template run ended higher: reported as a negative margin
    assert m["final_train_loss"] == pytest.approx(1e-3)
    assert m["train_loss_ratio"] == pytest.approx(2.0)
    assert rep["zero"]["rel_error"] == 0.97 and rep["ae"]["per_worker_rel_error"] is None


def test_a_diverged_ablation_is_never_the_better_one():
    nan = float("nan")
    # the template run diverged (NaN loss and cosine, no reconstruction figure); listed first so that a plain
    # min()/max() would pick the NaN
    rep = ablation_report(_fake(97.5, 0.02, 0.22, 0.97),
                          {"template": _fake(10.0, nan, None, nan), "zero": _fake(94.7, 0.22, 0.99, 0.16)})
    m = rep["margin"]
    assert m["final_train_loss"] == pytest.approx(0.20)
    assert m["cosine"] == pytest.approx(0.81)
    assert m["rel_error"] == pytest.approx(0.77)
    assert m["accuracy"] == pytest.approx(2.8)
    assert m["train_loss_ratio"] == pytest.approx(11.0)
    # every ablation diverged: no margin rather than a NaN one
    rep = ablation_report(_fake(97.5, 0.02, 0.22, 0.97), {"template": _fake(10.0, nan, None, nan)})
    assert rep["margin"]["final_train_loss"] is None and rep["margin"]["train_loss_ratio"] is None


# ~30 s of CPU (dense, then each variant with the AE, zero and template decoders); about twice that on a loaded 2-core
# machine
@pytest.mark.slow
def test_small_ablation_run_the_ae_beats_both_code_free_decoders():
    """4 dense rounds, 50 rounds of top-k while the AE trains, 10 compressed rounds: on those held-out rounds the AE's
    decoded update is closer to the true one than the zero and the template decoder's, on both variants (measured:
    rel_error 0.245 against the template's 0.313 (PS), 0.301 against 0.430 (ring); cosine 0.970 / 0.950 and
    0.955 / 0.908). With 6 AE-training rounds (the earlier tiny run) or 30 it does not: the template (the mean of the
    AE's training targets) is right from its first round, the AE needs some 50 Adam steps to pass it (docs/lgc.md,
    "What the numbers show", Tests). Seed 0, the bench's default."""
    import argparse

    from dgt.bench.lgc import add_arguments, run
    from dgt.codecs.lgc.plan import LGCConfig

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--iters", "64", "--warmup", "4", "--ae-iters", "50", "--ablation"])
    res = run(args)
    for variant in ("ps", "ring"):
        abl = res["ablation"][variant]
        assert set(abl) == {"ae", "zero", "template", "margin"}
        # the AE beats the better of the two code-free decoders on the held-out reconstruction, both figures
        assert abl["margin"]["rel_error"] > 0 and abl["margin"]["cosine"] > 0, (variant, abl)
        for other in ("zero", "template"):
            assert abl["ae"]["rel_error"] < abl[other]["rel_error"] and abl["ae"]["cosine"] > abl[other]["cosine"]
        if variant == "ring":  # nothing but the decoded output reaches the AE layers: predicting zeros is 1.0
            assert abl["zero"]["rel_error"] == pytest.approx(1.0)
        else:  # PS keeps the exactly-sent innovation values
            assert 0.5 < abl["zero"]["rel_error"] < 1.0
        assert abl["zero"]["rel_error"] > abl["template"]["rel_error"]  # the template already beats zeros
        # the AE run's own figure for the zero decoder is measured on its vectors, not a constant (issue 41.4)
        zero = res[f"lgc_{variant}"]["reconstruction"]["rel_error_zero"]
        if variant == "ring":
            assert zero == pytest.approx(1.0)
        else:
            assert 0.5 < zero < 1.0
        # the default top-k (0.5 %) keeps the compressed phase in issue 25's band: at least 100x, but not the paper's
        # 0.1 % (1093x PS / 1779x ring on this model), whose top-k learned too slowly to stay within 2 points of dense
        assert 100 <= res[f"lgc_{variant}"]["traffic"]["compressed_phase_ratio"] < 500
    assert res["config"]["lgc"]["topk"] == LGCConfig().topk == 0.005
    assert res["paper_choices"] == {}
