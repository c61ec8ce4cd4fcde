"""The model families of `dgt experiment ddp --model` (dgt/experiment/workloads.py): sizes, data, optimizers, metric
direction, the per-family defaults of the config, and each family end to end under every arm on loopback."""

import json
import os
import sysconfig

import pytest
import torch

from dgt.errors import DgtError
from dgt.experiment.ddp_config import ARMS, DDPConfig
from dgt.experiment.workloads import (
    GPT_CONTEXT,
    MODELS,
    STDLIB_FILES,
    VOCAB,
    build_workload,
    defaults,
    family,
    load_stdlib_text,
    reached,
)


def _params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_families_sizes_and_optimizers():
    assert family("resnet-l") == "resnet" and family("gpt") == "gpt" and family("alexnet") == "alexnet"
    with pytest.raises(DgtError, match="unknown model"):
        family("bert")
    sizes = {}
    for name in ("resnet-s", "resnet", "resnet-l", "gpt-s", "gpt", "gpt-l"):
        wl = build_workload(name)
        sizes[name] = _params(wl.model)
        opt = wl.make_optimizer(wl.model.parameters())
        if name.startswith("resnet"):
            assert isinstance(opt, torch.optim.SGD) and not isinstance(opt, torch.optim.AdamW)
            assert opt.defaults["momentum"] == 0.9 and opt.defaults["weight_decay"] == 5e-4 and wl.metric == "acc"
            assert any(isinstance(m, torch.nn.BatchNorm2d) for m in wl.model.modules())
        else:
            assert isinstance(opt, torch.optim.AdamW) and opt.defaults["weight_decay"] == 0.1
            assert wl.metric == "val_loss"
            kinds = {type(m).__name__ for m in wl.model.modules()}
            assert {"Embedding", "LayerNorm", "CausalSelfAttention"} <= kinds
    assert sizes["resnet"] >= 1_000_000 and sizes["gpt"] >= 1_000_000  # the issue's floor for the experiment models
    assert sizes["resnet-s"] < sizes["resnet"] < sizes["resnet-l"] and sizes["gpt-s"] < sizes["gpt"] < sizes["gpt-l"]
    alex = build_workload("alexnet")  # the original workload is untouched: plain SGD, no momentum
    opt = alex.make_optimizer(alex.model.parameters())
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0 and _params(alex.model) == 154_698


def test_resnet_data_is_the_digits_upsampled_and_it_learns():
    wl = build_workload("resnet-s", seed=0)
    assert tuple(wl.data.x_train.shape[1:]) == (1, 16, 16) and len(wl.data.y_train) == 1257
    torch.manual_seed(0)
    opt = wl.make_optimizer(wl.model.parameters())
    before = wl.evaluate()
    for i in range(30):
        idx = torch.arange(i * 32, i * 32 + 32) % len(wl.data.y_train)
        loss = wl.loss(wl.model(wl.data.x_train[idx]), wl.data.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = wl.evaluate()
    assert 0 <= before <= 1 and after > before + 0.3, (before, after)


def test_gpt_text_is_the_stdlib_with_a_held_out_split():
    root = sysconfig.get_paths()["stdlib"]
    assert list(STDLIB_FILES) == sorted(STDLIB_FILES)
    assert all(os.path.isfile(os.path.join(root, f)) for f in STDLIB_FILES)
    d = load_stdlib_text()
    assert d.x_train.shape[1] == GPT_CONTEXT and d.x_train.dtype == torch.int64
    assert torch.equal(d.x_train[:, 1:], d.y_train[:, :-1])  # y is x shifted by one byte
    assert 0.08 < d.val_bytes / (d.train_bytes + d.val_bytes) < 0.12
    with open(os.path.join(root, STDLIB_FILES[0]), "rb") as f:
        first = f.read()
    cut = int(len(first) * 0.9)
    assert bytes(d.x_train[0].tolist()) == first[:GPT_CONTEXT]  # training windows come from the first 90 %
    val = {bytes(row.tolist()) for row in d.x_test}
    train_text = first[:cut]
    assert not any(v in train_text for v in val)  # the held-out windows are not in the training part
    with pytest.raises(DgtError, match="cannot read"):
        load_stdlib_text(directory="/nonexistent-dgt-dir")


def test_gpt_is_causal_and_its_metric_is_a_loss():
    wl = build_workload("gpt-s")
    x = wl.data.x_test[:2]
    with torch.no_grad():
        a = wl.model(x)
        y = x.clone()
        y[:, -1] = (y[:, -1] + 1) % VOCAB  # changing the last byte must not change any earlier prediction
        b = wl.model(y)
    assert a.shape == (2, GPT_CONTEXT, VOCAB)
    assert torch.allclose(a[:, :-1], b[:, :-1]) and not torch.allclose(a[:, -1], b[:, -1])
    v = wl.evaluate()
    assert abs(v - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5  # starts near uniform over bytes
    assert reached("val_loss", 1.9, 2.0) and not reached("val_loss", 2.1, 2.0)
    assert reached("acc", 0.98, 0.97) and not reached("acc", 0.96, 0.97)


def test_config_takes_the_family_defaults_and_checks_the_target():
    assert (DDPConfig().lr, DDPConfig().batch, DDPConfig().target, DDPConfig().momentum) == (0.1, 32, 0.97, 0.0)
    assert DDPConfig().max_time == 150.0 and DDPConfig().eval_every == 2
    r = DDPConfig(model="resnet")
    d = defaults("resnet")
    assert (r.lr, r.batch, r.target, r.momentum, r.max_time) == (d.lr, d.batch, d.target, 0.9, d.max_time)
    g = DDPConfig(model="gpt", lr=1e-3)
    assert g.lr == 1e-3 and g.target == defaults("gpt").target and g.target > 1  # a loss, not an accuracy
    with pytest.raises(ValueError, match="validation loss"):
        DDPConfig(model="gpt", target=-1.0)
    with pytest.raises(ValueError, match="accuracy"):
        DDPConfig(model="resnet", target=2.0)
    with pytest.raises(ValueError, match="unknown model"):
        DDPConfig(model="bert")
    assert set(MODELS) >= {"alexnet", "vgg11", "resnet", "gpt"}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet", "gpt"])
def test_every_arm_trains_each_family_on_loopback_tiny(tmp_path, model):
    from dgt.cli import main

    out = str(tmp_path / model)
    rc = main(["experiment", "ddp", "--network", "loopback", "--model", model, "--workers", "2", "--max-iters", "3",
               "--eval-every", "3", "--out", out])
    assert rc == 0
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    metric = "val_loss" if model == "gpt" else "acc"
    assert res["workload"]["metric"] == metric and res["model"]["parameters"] >= 1_000_000
    assert [r["arm"] for r in res["runs"]] == list(ARMS)
    for r in res["runs"]:
        s = r["summary"]
        assert "error" not in r and s["iterations_run"] == 3 and len(r["steps"]) == 3, r["arm"]
        assert s["metric"] == metric and not s["reached"] and len(r["curve"]) == 1
        v = r["curve"][0][metric]
        assert (0.0 <= v <= 1.0) if metric == "acc" else (0.0 < v < 7.0), (r["arm"], v)
    hook = next(r for r in res["runs"] if r["arm"] == "dgt-hook")
    # the >= 1 M-parameter gradient, whole, in the dense warm-up step of the 3 (DDP's first; the other two are the
    # screened window's, the low-rank path's far fewer bytes first)
    assert hook["summary"]["dgt_lane_bytes_per_rank_step"]["0"] >= 4 * 1_000_000 / 3
    text = open(os.path.join(out, "report.md")).read()
    assert ("AdamW" in text) == (model == "gpt") and ("momentum 0.9" in text) == (model == "resnet")
    with open(os.path.join(out, "accuracy_vs_time.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_ddp_rejects_bad_modes_and_models(capsys):
    from dgt.cli import main

    for argv, message in ((["--modes", "dgt_lossy,gloo"], "--modes must start with gloo"),
                          (["--modes", "gloo,nccl"], "--modes must start with gloo"),
                          (["--modes", "gloo,fp16,fp16"], "--modes must start with gloo"),
                          (["--model", "bert"], "unknown model 'bert'")):
        with pytest.raises(SystemExit) as exc:  # the usage error, before any rank starts
            main(["bench", "ddp", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, err


@pytest.mark.slow
def test_bench_ddp_runs_a_family_under_every_mode(capsys):
    from dgt.cli import main

    rc = main(["bench", "ddp", "--model", "resnet-s", "--modes", "gloo,dgt_lossless,dgt_lossy,fp16,powersgd",
               "--steps", "2", "--rounds", "1", "--warmup", "3", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    res = json.loads(out[out.index("{"):])
    assert res["model"] == "resnet-s" and res["params"] == 308_538 and res["batch"] == 32
    assert set(res["ratios"]) == {"dgt_lossless/gloo", "dgt_lossy/gloo", "fp16/gloo", "powersgd/gloo"}
    grad = 4 * res["params"]
    for name, m in res["modes"].items():
        assert m["s_per_step_median"] > 0 and m["lo_tx_bytes_per_rank_step"] is not None, name
    # lo counts every process of the namespace, so only floors are certain: 2 ranks, each sends its whole gradient
    assert res["modes"]["gloo"]["lo_tx_bytes_per_rank_step"] >= 0.9 * grad
    assert res["modes"]["dgt_lossless"]["reliable_bytes_per_step"] == pytest.approx(grad, rel=0.01)


def test_scaling_figure_reads_bench_outputs_and_rejects_others(tmp_path):
    from dgt.bench import ddp_scaling

    def bench(model, mb, gloo_s, dgt_s):
        return {"bench": "ddp", "model": model, "grad_mb": mb, "modes": {
            "gloo": {"s_per_step_median": gloo_s, "lo_tx_bytes_per_rank_step": mb * 1e6},
            "dgt_lossy": {"s_per_step_median": dgt_s, "lo_tx_bytes_per_rank_step": mb * 0.5e6,
                          "reliable_bytes_per_step": mb * 0.4e6, "droppable_bytes_per_step": mb * 0.1e6}}}

    files = []
    for i, (model, mb) in enumerate((("resnet-l", 19.6), ("resnet", 4.9), ("gpt", 5.0))):
        path = tmp_path / f"{i}.json"
        path.write_text("a warning line\n" + json.dumps(bench(model, mb, 0.2 * mb, 0.1 * mb)))
        files.append(str(path))
    out = tmp_path / "fig.png"
    assert ddp_scaling.main([*files, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = ddp_scaling.rows([ddp_scaling.load(f) for f in files])
    assert [(r["model"], r["mode"]) for r in table][:4] == [("gpt", "gloo"), ("gpt", "dgt_lossy"),
                                                          ("resnet", "gloo"), ("resnet", "dgt_lossy")]
    r = next(r for r in table if r["model"] == "resnet-l" and r["mode"] == "dgt_lossy")
    assert r["vs_gloo"] == pytest.approx(0.5) and r["dgt_bytes"] == pytest.approx(19.6 * 0.5e6)
    assert "| resnet-l | 19.60 | dgt_lossy | 1.960 | 0.50x | 9.80 | 9.80 |" in ddp_scaling.markdown(table)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bench": "allreduce"}))
    with pytest.raises(DgtError, match="not the output of dgt bench ddp"):
        ddp_scaling.load(str(bad))
    bad.write_text("no json here")
    with pytest.raises(DgtError, match="no JSON object"):
        ddp_scaling.load(str(bad))


def test_report_of_a_family_judges_the_steps_goal_not_issue_19s():
    from dgt.experiment.ddp_report import render
    from dgt.experiment.ddp_runner import summarize

    def run(arm, n_to_target, target=2.8):
        evals = [{"it": i, "train_time": 0.5 * i, "val_loss": 3.0 if i < n_to_target else 2.7, "wire": None}
                 for i in range(4, 200, 4)]
        rank = {"steps": [0.5] * 196, "evals": evals, "train_time": 98.0, "stop_reason": "target", "dgt": {}}
        return {"arm": arm, "summary": summarize([rank], target, "val_loss")}

    def results(runs):
        return {"config": DDPConfig(model="gpt").to_dict(), "profile": "priority", "profile_description": "d",
                "network": {"mode": "netem", "description": "n", "why_not_netem": None},
                "dataset": {"name": "stdlib-bytes"}, "model": {"parameters": 10, "gradient_bytes": 40},
                "workload": {"family": "gpt", "optimizer": "AdamW", "metric": "val_loss"},
                "arms": dict(ARMS), "runs": runs, "ratios": {}}

    text = render(results([run("gloo", 100), run("dgt-hook", 116)]))
    assert "dgt-hook steps to target vs Gloo: 116 / 100 = 1.16x (goal <= 1.2x): met" in text
    assert "issue #19" not in text and "AdamW" in text and "validation loss" in text
    text = render(results([run("gloo", 100), run("dgt-hook", 124)]))
    assert "124 / 100 = 1.24x (goal <= 1.2x): NOT met" in text
    text = render(results([run("gloo", 100), run("dgt-hook", 400)]))
    assert "dgt-hook did not reach the target" in text


def test_report_of_several_seeds_judges_the_steps_goal_on_the_median_and_each_seed():
    # the goal line once read one summary per arm, so with --seeds it judged only the last seed
    from dgt.experiment.ddp_report import render
    from dgt.experiment.ddp_runner import summarize

    def run(arm, seed, n_to_target, target=2.8):
        evals = [{"it": i, "train_time": 0.5 * i, "val_loss": 3.0 if i < n_to_target else 2.7, "wire": None}
                 for i in range(4, 200, 4)]
        rank = {"steps": [0.5] * 196, "evals": evals, "train_time": 98.0, "stop_reason": "target", "dgt": {}}
        return {"arm": arm, "seed": seed, "summary": summarize([rank], target, "val_loss")}

    def results(runs):
        return {"config": DDPConfig(model="gpt").to_dict(), "profile": "priority", "profile_description": "d",
                "network": {"mode": "netem", "description": "n", "why_not_netem": None},
                "dataset": {"name": "stdlib-bytes"}, "model": {"parameters": 10, "gradient_bytes": 40},
                "workload": {"family": "gpt", "optimizer": "AdamW", "metric": "val_loss"}, "seeds": [0, 1, 2],
                "arms": dict(ARMS), "runs": runs, "ratios": {}}

    runs = [run("gloo", 0, 100), run("dgt-hook", 0, 116), run("gloo", 1, 120), run("dgt-hook", 1, 160),
            run("gloo", 2, 100), run("dgt-hook", 2, 400)]
    text = render(results(runs))
    assert "- dgt-hook steps to target vs Gloo, median over 3 seeds: 160 / 100 = 1.60x (goal <= 1.2x): NOT met" in text
    assert "- seed 0: dgt-hook steps to target vs Gloo: 116 / 100 = 1.16x (goal <= 1.2x): met" in text
    assert "- seed 1: dgt-hook steps to target vs Gloo: 160 / 120 = 1.33x (goal <= 1.2x): NOT met" in text
    assert "- seed 2: dgt-hook did not reach the target: no steps ratio." in text
    runs[3] = run("dgt-hook", 1, 400)  # the hook misses on two seeds of three: no median
    text = render(results(runs))
    assert "- median over 3 seeds: dgt-hook did not reach the target on at least half of them: no steps ratio." in text
    assert "- seed 0: dgt-hook steps to target vs Gloo: 116 / 100 = 1.16x (goal <= 1.2x): met" in text
    runs = [run("gloo", 0, 100), run("dgt-hook", 0, 108), run("gloo", 1, 120), run("dgt-hook", 1, 124)]
    text = render(results(runs))
    assert "median over 2 seeds: 116 / 110 = 1.05x (goal <= 1.2x): met" in text
    # with the ratios (as the runner writes them) the line also gives the paired median of the per-seed ratios
    from dgt.experiment.ddp_stats import aggregate, ratios

    runs = [run("gloo", 0, 188), run("dgt-hook", 0, 188), run("gloo", 1, 148), run("dgt-hook", 1, 148),
            run("gloo", 2, 132), run("dgt-hook", 2, 216)]
    res = results(runs)
    res["ratios"] = ratios(aggregate(runs))
    assert ("median over 3 seeds: 188 / 148 = 1.27x (goal <= 1.2x): NOT met; paired, the median of each seed's "
            "ratio to its own Gloo run: 1.00x (met)") in render(res)
