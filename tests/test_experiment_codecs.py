"""``dgt experiment codecs`` in its tiny configuration: every codec trains through the real transport (2 OS processes
over paced loopback, one start for all codecs), and the byte counts each run reports are the ones its codec must put
on the wire; results.json, report.md and the plot are written. As root, the same on a netem profile (2 hosts in
namespaces)."""

from __future__ import annotations

import json
import os

import pytest

from dgt.experiment.codecs_run import CODECS, CodecsConfig, run_codecs
from dgt.experiment.config import NetworkConfig


def test_config_checks():
    with pytest.raises(ValueError, match="unknown codecs"):
        CodecsConfig(codecs=["dense", "nope"])
    with pytest.raises(ValueError, match="dense"):
        CodecsConfig(codecs=["qsgd"])
    cfg = CodecsConfig(iters=100)
    assert cfg.lgc_phases() == (20, 20)
    assert cfg.spec("lgc-ps") == "lgc:variant=ps,warmup=20,ae_iters=20,topk=0.01,seed=0"
    assert cfg.spec("qsgd").endswith("norm=l2,seed=0")  # the QSGD paper's norm, said in the report
    with pytest.raises(ValueError, match="unknown profile"):
        CodecsConfig(profile="lan")
    with pytest.raises(ValueError, match="network mode"):
        CodecsConfig(network=NetworkConfig(mode="sim"))


def test_netem_asked_for_without_it_is_a_clear_error(monkeypatch, capsys):
    from dgt.cli import main
    from dgt.experiment import network

    monkeypatch.setattr(network, "netem_unavailable_reason", lambda: "not root (network namespaces need CAP_NET_ADMIN)")
    assert main(["experiment", "codecs", "--network", "netem", "--out", "/tmp/dgt-codecs-never-written"]) == 2
    assert "--network netem: not root" in capsys.readouterr().out
    assert not os.path.exists("/tmp/dgt-codecs-never-written")


@pytest.mark.slow  # default suite time (CI 10:20); the slow set runs it in CI
def test_every_codec_over_the_transport_tiny(tmp_path):
    k, iters = 2, 10
    # batch 64: a shard of digits is 9 steps per epoch, so Oland-Raj averages once within the 10 steps
    cfg = CodecsConfig(workers=k, iters=iters, batch=64, eval_every=5, out_dir=str(tmp_path), isolate=False,
                       timeout=60, network=NetworkConfig(mode="loopback", prefix="dgtc"))
    shown = []
    res = run_codecs(cfg, on_progress=lambda rec: shown.append(rec) and None)
    assert res["network"]["mode"] == "loopback" and "paced" in res["network"]["description"]
    runs = res["runs"]
    assert set(runs) == set(CODECS)
    for name, r in runs.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["iterations"] == iters
        assert 0.0 <= r["final_accuracy"] <= 1.0
        assert r["bytes_per_step"] > 0
        assert [e["it"] for e in r["curve"]] == [5, 10]
    # progress came from rank 0 of every run, through the parent
    assert {rec["codec"] for rec in shown} == set(CODECS)
    # loopback: every rank's TCP connections were paced (one per peer, the group connects them all at once)
    assert all(r["paced_connections"] == [k - 1] * k for r in runs.values()), {
        n: r["paced_connections"] for n, r in runs.items()}
    n = runs["dense"]["parameters"]
    # dense PS, server rank 0 trains: one push and one pull of fp32 per other rank
    assert runs["dense"]["bytes_per_step"] == 2 * (k - 1) * 4 * n
    # DGT hands at most dense's bytes to the transport (blocks on UDP; its congestion control may abandon some)
    assert 0.5 * runs["dense"]["bytes_per_step"] < runs["dgt"]["bytes_per_step"] <= runs["dense"]["bytes_per_step"]
    # QSGD 8 bit, bucket 512: one byte per entry + one fp32 scale per 512 entries + the message's dtype byte, on the
    # push and the (lossy) pull
    assert runs["qsgd"]["bytes_per_step"] == 2 * (k - 1) * (n + 1 + 4 * -(-n // 512))
    assert 0.4 < runs["slimdp"]["bytes_vs_dense"] < 0.5  # (alpha + eps) = 0.45 of the values both ways, + headers
    assert runs["dcd"]["payload_reduction"] == pytest.approx(4.0, rel=0.01)
    assert 1.0 < runs["ecd"]["payload_reduction"] < 32.0
    assert 0 < runs["olandraj"]["bits_per_param"] < 32
    assert runs["olandraj"]["average_every"] == 9
    for v in ("lgc-ps", "lgc-ring"):
        lgc = runs[v]["lgc"]
        assert lgc["iterations"] == {"dense": 2, "topk": 2, "compressed": 6}
        assert lgc["compression_ratio"] > 20  # top-k 1 % + codes: far below the fp32 gradient
    for name in CODECS:
        if name != "dense":
            h = runs[name]["headline"]
            assert h["paper"] > 0 and h["ours"] is not None and h["setting"]
    for f in ("results.json", "report.md", "codecs.png"):
        assert os.path.getsize(tmp_path / f) > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"]["qsgd"]["bytes_per_step"] == runs["qsgd"]["bytes_per_step"]
    report = (tmp_path / "report.md").read_text()
    for name in CODECS:
        assert f"| {name} |" in report


def _netem_ok() -> bool:
    from dgt.experiment.network import netem_unavailable_reason

    return netem_unavailable_reason() is None


@pytest.mark.slow
@pytest.mark.root
def test_tiny_codecs_on_netem(tmp_path):
    """Three codecs (one per collective family that differs most: PS with a lossy lane, gossip, LGC), 2 hosts in
    namespaces on the priority profile: they train, their traffic crosses the shaped links, nothing is left over."""
    if not _netem_ok():
        pytest.skip("netem emulation needs root and HTB/u32 in the kernel")
    from dgt.netem import nsutil

    k, iters = 2, 6
    cfg = CodecsConfig(codecs=["dense", "dgt", "dcd", "lgc-ring"], workers=k, iters=iters, batch=64, eval_every=3,
                       out_dir=str(tmp_path), isolate=False, timeout=90, plots=False,
                       network=NetworkConfig(mode="netem", rate="100mbit", prefix="dgtc"))
    res = run_codecs(cfg)
    assert res["network"]["mode"] == "netem" and res["network"]["description"].startswith("netem:")
    assert res["pace_rate"] is None
    runs = res["runs"]
    for name, r in runs.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["iterations"] == iters and 0.0 <= r["final_accuracy"] <= 1.0
        assert r["paced_connections"] == [0] * k  # netem shapes the links; nothing is paced at the sockets
        # every host's interface carried at least what the codec handed to the transport
        assert r["wire_tx_per_step"] >= r["bytes_per_step"] > 0, name
    n = runs["dense"]["parameters"]
    assert runs["dense"]["bytes_per_step"] == 2 * (k - 1) * 4 * n
    q = runs["dense"]["queues"]["into_server"]  # one batch: the counters cover all four codecs
    assert q["EF"]["bytes"] > 4 * n * iters  # the dense pushes went through the server's link, important class
    assert "netem" in (tmp_path / "report.md").read_text()
    assert not [ns for ns in nsutil.list_ns() if ns.startswith(f"dgtc{os.getpid() % 100000}")], "namespaces left"
