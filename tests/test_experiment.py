"""The Table 1 experiment: data loaders (digits, Fashion-MNIST IDX incl. gzip), models, the metrics, and the
runner end to end on a tiny configuration (loopback always; netem namespaces when root)."""

import dataclasses
import gzip
import json
import os
import struct

import numpy as np
import pytest
import torch

from dgt.errors import DgtError
from dgt.experiment.config import ExperimentConfig, NetworkConfig
from dgt.experiment.data import ShardSampler, load_digits, load_fashion_mnist, read_idx
from dgt.experiment.metrics import compare, summarize
from dgt.experiment.models import build_model, describe


def write_idx(path: str, arr: np.ndarray, code: int = 0x08) -> None:
    dt = {0x08: ">u1", 0x0D: ">f4", 0x0C: ">i4"}[code]
    raw = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(dt).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_round_trips_plain_and_gzip(tmp_path, suffix):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    p = str(tmp_path / f"x-idx3-ubyte{suffix}")
    write_idx(p, a)
    np.testing.assert_array_equal(read_idx(p), a)
    f = np.linspace(-1, 1, 6, dtype=np.float32).reshape(6)
    q = str(tmp_path / f"f-idx1{suffix}")
    write_idx(q, f, 0x0D)
    np.testing.assert_array_equal(read_idx(q), f)


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(DgtError, match="bad magic"):
        read_idx(str(bad))
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 2]) + struct.pack(">2I", 4, 4) + b"\x00" * 10)
    with pytest.raises(DgtError, match="promises"):
        read_idx(str(short))
    kind = tmp_path / "kind"
    kind.write_bytes(bytes([0, 0, 0x42, 1]) + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(DgtError, match="element type"):
        read_idx(str(kind))


def _fashion_dir(tmp_path, gz: bool, n_train: int = 40, n_test: int = 20):
    rng = np.random.default_rng(0)
    sfx = ".gz" if gz else ""
    files = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        imgs = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(str(tmp_path / f"{split}-images-idx3-ubyte{sfx}"), imgs)
        write_idx(str(tmp_path / f"{split}-labels-idx1-ubyte{sfx}"), labels)
        files[split] = (imgs, labels)
    return files


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_loader_reads_the_four_files(tmp_path, gz):
    files = _fashion_dir(tmp_path, gz)
    d = load_fashion_mnist(str(tmp_path))
    assert d.x_train.shape == (40, 1, 28, 28) and d.x_test.shape == (20, 1, 28, 28)
    assert d.y_train.tolist() == files["train"][1].tolist()
    assert d.num_classes == 10
    # normalised with the training statistics; pixel order preserved
    raw = files["train"][0].astype(np.float32) / 255.0
    expect = (raw - raw.mean()) / raw.std()
    np.testing.assert_allclose(d.x_train[:, 0].numpy(), expect, rtol=1e-4, atol=1e-4)
    limited = load_fashion_mnist(str(tmp_path), limit_train=10, limit_test=5)
    assert len(limited.y_train) == 10 and len(limited.y_test) == 5


def test_fashion_mnist_missing_or_mismatched_files_are_clear_errors(tmp_path):
    with pytest.raises(DgtError, match="train-images-idx3-ubyte"):
        load_fashion_mnist(str(tmp_path))
    _fashion_dir(tmp_path, False)
    write_idx(str(tmp_path / "t10k-labels-idx1-ubyte"), np.zeros(7, np.uint8))
    with pytest.raises(DgtError, match="do not match"):
        load_fashion_mnist(str(tmp_path))


def test_digits_split_and_shards():
    d = load_digits(seed=0)
    assert d.shape == (1, 8, 8) and d.num_classes == 10
    assert len(d.y_train) + len(d.y_test) == 1797
    assert abs(float(d.x_train.mean())) < 1e-4
    shards = [ShardSampler(len(d.y_train), r, 4, 32, seed=0) for r in range(4)]
    seen = [set(s.indices.tolist()) for s in shards]
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))
    assert set().union(*seen) == set(range(len(d.y_train)))
    # an epoch of batches covers the shard exactly once
    s = shards[1]
    got = torch.cat([s.next() for _ in range(len(s.indices) // s.batch)]).tolist()
    assert len(set(got)) == len(got) and set(got) <= seen[1]


@pytest.mark.parametrize("name", ["alexnet", "vgg11"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28)])
def test_models_shapes_and_deterministic_init(name, shape):
    a, b = build_model(name, shape, seed=3), build_model(name, shape, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    a.eval()
    assert a(torch.zeros(5, *shape)).shape == (5, 10)
    info = describe(a)
    assert info["gradient_bytes"] == 4 * info["parameters"] > 100_000
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet", shape)


def _rank(bcts, evals, sent, dropped=0, blocks=10, recv=None):
    t, recs = 0.0, []
    for i, b in enumerate(bcts, 1):
        t += b
        recs.append({"it": i, "bct": b, "compute": 0.01, "comm": b - 0.01, "loss": 1.0, "p": 0.5, "train_time": t,
                     "sent": sent, "recv": sent if recv is None else recv, "blocks": blocks, "dropped": dropped})
    return {"records": recs, "evals": evals, "stop_reason": "target", "eval_time": 0.1, "wall_time": t + 1}


def test_summary_is_time_and_iterations_at_the_first_evaluation_reaching_target():
    base = _rank([1.0] * 6, [{"it": 2, "train_time": 2.0, "acc": 0.5}, {"it": 4, "train_time": 4.0, "acc": 0.91},
                             {"it": 6, "train_time": 6.0, "acc": 0.95}], {"0": 100})
    s = summarize([base, _rank([1.0] * 6, [], {"0": 100})], target=0.9)
    assert s["reached"] and s["iterations"] == 4 and s["time_to_target"] == 4.0
    assert s["bct_mean"] == 1.0 and s["bytes_per_lane"] == {"0": 800}  # two ranks x 4 iterations
    dgt = _rank([0.5] * 6, [{"it": 6, "train_time": 3.0, "acc": 0.9}], {"0": 30, "1": 70}, dropped=4,
                recv={"0": 30, "1": 20})
    d = summarize([dgt], target=0.9)
    assert d["iterations"] == 6 and d["dropped_blocks"] == 24 and d["drop_rate"] == 0.4
    assert d["bytes_per_lane"] == {"0": 180, "1": 420} and d["bytes_delivered_per_lane"] == {"0": 180, "1": 120}
    c = compare(s, d)
    assert c["bct_reduction"] == pytest.approx(0.5)
    assert c["time_reduction"] == pytest.approx(0.25)
    assert c["iteration_increase"] == pytest.approx(0.5)
    assert c["delivered_reduction"] == pytest.approx(0.75)  # all ranks: 2 x 100 -> 1 x 50 bytes per iteration
    missed = summarize([_rank([1.0] * 3, [{"it": 3, "train_time": 3.0, "acc": 0.2}], {"0": 1})], target=0.9)
    assert not missed["reached"] and missed["time_to_target"] is None
    assert compare(s, missed)["time_reduction"] is None


def test_summary_counts_unsent_apart_from_lost_and_udp_delivery():
    rk = _rank([0.5] * 2, [{"it": 2, "train_time": 1.0, "acc": 0.95}], {"0": 30, "1": 70}, dropped=1,
               recv={"0": 30, "1": 63})
    for rec in rk["records"]:
        rec["unsent"], rec["unsent_bytes"] = 5, 4096
    lane1 = {"lane": 1, "tx_bytes": 150, "tx_frames": 3, "tx_unsent_blocks": 10, "tx_lost_blocks": 2,
             "delivered_blocks": 18, "delivered_bytes": 126, "name": "udp"}
    rk["transport"] = {"lanes": [{"lane": 0, "tx_bytes": 60}, lane1]}
    d = summarize([rk, dict(rk)], target=0.9)
    assert d["unsent_blocks"] == 20 and d["bytes_unsent"] == 4 * 4096 and d["dropped_blocks"] == 4
    assert d["udp_delivery"] == pytest.approx(0.9)  # 4 x 63 of 4 x 70 bytes
    assert d["transport_lanes"]["1"]["tx_unsent_blocks"] == 20 and d["transport_lanes"]["0"]["tx_bytes"] == 120
    assert d["udp_block_delivery"] == pytest.approx(36 / 40)  # unsent blocks are neither delivered nor lost


def test_config_validation_and_demo_defaults():
    demo = ExperimentConfig.demo()
    assert demo.models == ["alexnet"] and demo.workers == 4 and demo.protocols == ["baseline", "dgt"]
    assert demo.codecs["dgt"] == "dgt:p=loss,p0=1,alpha=0.3,block=1024" and demo.codecs["baseline"] == "dense"
    spec = demo.run_spec("alexnet", "dgt", "/tmp/x")
    assert spec.codec == demo.codecs["dgt"] and spec.target == demo.target
    with pytest.raises(ValueError):
        ExperimentConfig(workers=1)
    with pytest.raises(ValueError):
        ExperimentConfig(server="9")
    with pytest.raises(ValueError):
        ExperimentConfig(network=NetworkConfig(mode="wifi"))


def _tiny_cli(out: str, network: str) -> list[str]:
    # p = 0.3 constant instead of the loss schedule, so the unreliable lane carries traffic from iteration 1
    return ["experiment", "table1", "--models", "alexnet", "--workers", "2", "--max-iters", "6", "--eval-every", "3",
            "--target", "0.99", "--network", network, "--rate", "200mbit", "--dgt-codec", "dgt:p=0.3",
            "--max-time", "60", "--out", out]


def _check_outputs(out: str, mode: str) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["network"]["mode"] == mode
    runs = {r["protocol"]: r for r in res["runs"]}
    assert set(runs) == {"baseline", "dgt"} and all("summary" in r for r in runs.values()), runs
    for r in runs.values():
        s = r["summary"]
        assert s["iterations_run"] == 6 and len(r["bct"]) == 6 and s["bct_mean"] > 0
        assert [e["it"] for e in r["curve"]] == [3, 6]
    assert runs["baseline"]["summary"]["bytes_per_lane"].get("1", 0) == 0
    assert runs["dgt"]["summary"]["bytes_per_lane"].get("1", 0) > 0, "DGT must use the unreliable lane"
    assert runs["dgt"]["summary"]["p_mean"] == pytest.approx(0.3)
    u = runs["dgt"]["summary"]["unimportant_blocks"]  # what became of them, measured (issue 41.4)
    assert u["total"] > 0 and u["delivered"] + u["lost"] + u["held_back"] == u["total"]
    assert u["delivered"] > 0, u
    assert runs["baseline"]["summary"]["unimportant_blocks"]["total"] == 0
    # identical seeds and data: the first iteration's loss is the same under both protocols
    assert runs["baseline"]["loss"][0] == pytest.approx(runs["dgt"]["loss"][0])
    assert "alexnet" in res["comparisons"]
    report = open(os.path.join(out, "report.md")).read()
    assert "BCT reduction" in report and mode in report
    for png in ("accuracy_vs_time.png", "bct_distribution.png", "bytes_per_lane.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return res


@pytest.mark.slow
def test_table1_tiny_on_loopback_with_fashion_mnist_files(tmp_path):
    from dgt.cli import main

    _fashion_dir(tmp_path, gz=True, n_train=64, n_test=20)
    out = str(tmp_path / "res")
    assert main(_tiny_cli(out, "loopback") + ["--dataset", "fashion-mnist", "--data-dir", str(tmp_path)]) == 0
    res = _check_outputs(out, "loopback")
    assert "paced" in res["network"]["description"]
    # issue 41 (4): each pair of ranks' TCP and UDP share one budget, and the report says so
    assert res["network"]["shared_budget"]["shared_by"] == ["tcp", "udp"]
    assert "share" in res["network"]["description"] and "TCP connection and its UDP lanes share" in \
        open(os.path.join(out, "report.md")).read()
    for r in res["runs"]:
        ranks = [json.load(open(os.path.join(r["run_dir"], f"rank{k}.json"))) for k in range(2)]
        assert [rk["shared_budget_peers"] for rk in ranks] == [1, 1], r["protocol"]
    assert res["dataset"]["shape"] == [1, 28, 28] and res["dataset"]["train"] == 64


def _netem_ok() -> bool:
    from dgt.experiment.network import netem_unavailable_reason

    return netem_unavailable_reason() is None


@pytest.mark.slow
@pytest.mark.root
def test_table1_tiny_on_netem(tmp_path):
    if not _netem_ok():
        pytest.skip("netem emulation needs root and HTB/u32 in the kernel")
    from dgt.cli import main
    from dgt.netem import nsutil

    out = str(tmp_path / "res")
    # a TCP cross flow at half the link rate into the server's link, beside both runs
    assert main(_tiny_cli(out, "netem") + ["--cross-traffic", "100mbit", "--cross-proto", "tcp"]) == 0
    res = _check_outputs(out, "netem")
    for r in res["runs"]:
        cf = r["summary"]["cross_flow"]
        assert cf["proto"] == "tcp" and cf["spans_run"] is True, cf  # started before and stopped after the ranks
        assert cf["goodput_training_bps"] > 0 and cf["received_bytes"] > 0, cf
    assert res["comparisons"]["alexnet"]["cross_goodput_ratio"] > 0
    assert "## Cross traffic beside each run" in open(os.path.join(out, "report.md")).read()
    q = {r["protocol"]: r["queues"] for r in res["runs"]}
    # the baseline's pushes are EF only; DGT's droppable blocks go through the server's LE queue
    assert q["baseline"]["into_server"]["EF"]["bytes"] > 0 and q["baseline"]["into_server"]["LE"]["bytes"] == 0
    assert q["dgt"]["into_server"]["LE"]["bytes"] > 0
    assert not [ns for ns in nsutil.list_ns() if ns.startswith(f"dgtx{os.getpid() % 100000}")], "namespaces left"


def _procs_with(text: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_a_failing_rank_fails_the_run_fast_and_leaves_nothing_running(tmp_path):
    from dgt.experiment.launch import RunFailed, launch
    from dgt.experiment.network import Network

    cfg = ExperimentConfig(workers=2, max_iters=3, network=NetworkConfig(mode="loopback"))
    # the config refuses an unknown codec before anything starts; the spec it hands the ranks is altered here so
    # that the ranks fail in their own processes
    spec = dataclasses.replace(cfg.run_spec("alexnet", "dgt", str(tmp_path)), codec="no-such-codec")
    with Network(cfg.network, 2, "loopback") as net, pytest.raises(RunFailed, match="no-such-codec"):
        launch(net, spec, str(tmp_path), hard_timeout=90)
    assert _procs_with(str(tmp_path / "spec.json")) == []


def test_hard_timeout_kills_the_ranks(tmp_path):
    from dgt.experiment.launch import RunFailed, launch
    from dgt.experiment.network import Network

    cfg = ExperimentConfig(workers=2, max_iters=100000, max_time=1e6, network=NetworkConfig(mode="loopback"))
    spec = cfg.run_spec("alexnet", "baseline", str(tmp_path))
    with Network(cfg.network, 2, "loopback") as net, pytest.raises(RunFailed, match="hard timeout"):
        launch(net, spec, str(tmp_path), hard_timeout=4)
    assert _procs_with(str(tmp_path / "spec.json")) == []


def test_cli_adds_demo_and_experiment_table1():
    from dgt.cli import build_parser, main

    args = build_parser(["demo"]).parse_args(["demo"])
    assert args.func.__name__ == "demo" and args.network == "auto" and args.workers == 4 and args.lossy_pull
    args = build_parser(["experiment"]).parse_args(
        ["experiment", "table1", "--models", "vgg11", "--dataset", "fashion-mnist", "--data-dir", "/x",
         "--no-lossy-pull", "--server", "sharded", "--rate", "100mbit", "--cross-traffic", "5mbit",
         "--cross-proto", "tcp"])
    assert args.func.__name__ == "table1" and args.models == "vgg11" and args.dataset == "fashion-mnist"
    assert not args.lossy_pull and args.server == "sharded" and args.cross_traffic == "5mbit"
    assert args.cross_proto == "tcp" and args.cross_dscp == 0
    assert main(["experiment"]) == 2  # no experiment named: help, exit 2


@pytest.mark.parametrize("argv, says", [
    (["demo", "--workers", "1"], "workers: need at least 2"),
    (["demo", "--target", "2"], "target: a test accuracy in (0, 1]"),
    (["demo", "--server", "9"], "server: a worker rank (0 to 3)"),
    (["demo", "--rate", "fast"], "bad rate 'fast'"),
    (["experiment", "table1", "--models", "resnet"], "models: choose from alexnet, vgg11, got resnet"),
])
def test_bad_values_are_usage_errors_not_tracebacks(argv, says, capsys, tmp_path, monkeypatch):
    """Issue 41 (5): a value the option types let through but the experiment cannot run is refused by the parser
    (exit status 2, 'dgt demo: error: ...') before anything starts."""
    from dgt.cli import main
    from dgt.experiment import runner

    def never(*a, **k):
        raise AssertionError("the run must not start")

    monkeypatch.setattr(runner, "run_experiment", never)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = "dgt demo" if argv[0] == "demo" else "dgt experiment table1"
    assert f"{prog}: error: {says}" in err, err
    assert "Traceback" not in err


def test_reproduction_doc_gives_commands_that_work():
    """Issue 41 (5): docs/reproduction.md installs the extra `dgt demo` needs and runs the environment's dgt under
    sudo (a bare `sudo dgt` searches sudo's secure_path, which holds no virtual environment)."""
    import pathlib
    import re

    from dgt.extras import COMMAND_EXTRA

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "reproduction.md").read_text()
    block = doc.split("## Run it", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    installs = [ln for ln in block.splitlines() if ln.startswith("pip install")]
    assert installs and all(re.search(rf"-e '\.\[[^]]*\b{COMMAND_EXTRA['demo']}\b[^]]*\]'", ln) for ln in installs), \
        installs
    assert not re.search(r"^sudo dgt\b", doc, re.M)
    assert 'sudo "$(command -v dgt)" demo' in block
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:  # nor anywhere else a user reads
        if "history" not in path.parts:
            assert not re.search(r"^\s*sudo dgt\b", path.read_text(), re.M), path


def _held_back_results() -> dict:
    """A demo's results.json, as the runner writes it, for a baseline and a DGT run whose send budget held back
    most unimportant blocks (the figures of issue 41's demo: 86,402 of 87,582 held back)."""
    base = _rank([1.0] * 4, [{"it": 4, "train_time": 4.0, "acc": 0.98}], {"0": 400_000_000})
    dgt = _rank([0.5] * 4, [{"it": 4, "train_time": 2.0, "acc": 0.98}], {"0": 300_000_000, "1": 2_000_000},
                dropped=3, blocks=30_000)
    for i, rec in enumerate(dgt["records"]):
        rec["unsent"], rec["unsent_bytes"] = 21_600 + (2 if i == 0 else 0), 87_500_000
        rec["unimportant_delivered"] = 292 if i else 294
    cfg = ExperimentConfig.demo().to_dict()
    runs = [{"model": "alexnet", "protocol": p, "codec": cfg["codecs"][p], "run_dir": "x",
             "summary": summarize([rk], 0.97)} for p, rk in (("baseline", base), ("dgt", dgt))]
    return {"command": None, "config": cfg, "runs": runs,
            "network": {"mode": "loopback", "why_not_netem": None, "description": "loopback: paced"},
            "dataset": {"name": "digits", "train": 1, "test": 1, "shape": [1, 8, 8]},
            "models": {"alexnet": {"parameters": 1, "tensors": 1, "gradient_bytes": 4}},
            "machine": {"cpus": 2}, "comparisons": {"alexnet": compare(runs[0]["summary"], runs[1]["summary"])}}


def test_held_back_unimportant_blocks_are_in_the_table_the_report_and_the_json():
    """Issue 41 (4): the headline figures say what became of the unimportant blocks: delivered, lost, and held back
    by the send budget (never sent), not a drop rate over every block that hides the held-back ones."""
    from rich.console import Console

    from dgt.experiment.console import results_table
    from dgt.experiment.report import render

    res = _held_back_results()
    u = res["runs"][1]["summary"]["unimportant_blocks"]
    assert (u["delivered"], u["lost"], u["held_back"], u["total"]) == (1170, 12, 86_402, 87_584)
    assert u["held_back_share"] == pytest.approx(86_402 / 87_584)
    assert res["runs"][0]["summary"]["unimportant_blocks"]["total"] == 0  # the baseline has none
    json.dumps(res)  # results.json carries it as written
    console = Console(width=100, record=True)
    console.print(results_table(res))
    table = console.export_text()
    assert "Unimp. deliv/lost/held" in table and "1.3/0.0/98.7%" in table, table
    assert "held back" in table  # the caption says what the third figure is
    report = render(res)
    assert "| Unimportant blocks: delivered / lost / held back |" in report
    assert "1,170 / 12 / 86,402 of 87,584 (1.3/0.0/98.7%)" in report, report
    assert "86,402 of 87,584 unimportant blocks (350.0 MB, against 1.2 GB sent over TCP) were held back" in report
