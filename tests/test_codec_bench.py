"""``dgt bench codecs``: the JSON it returns, on a small tensor; registry names usable from the CLI/shim."""

from __future__ import annotations

import argparse

import pytest
import torch

from dgt.bench import codecs as bench
from dgt.codecs import available, make_codec
from dgt.codecs.base import BucketState
from dgt.codecs.bucketinfo import received_from_parts


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    argv = []
    for k, v in kw.items():
        if k == "codecs":
            for spec in v:
                argv += ["--codec", spec]
        else:
            argv += [f"--{k}", str(v)]
    return p.parse_args(argv)


def test_defaults() -> None:
    a = _args()
    assert a.numel == 25_000_000 and a.codecs is None and a.device == "auto"


def test_run_reports_every_codec_against_the_memory_pass() -> None:
    res = bench.run(_args(numel=50_000, repeat=1, device="cpu"))
    assert res["bench"] == "codecs" and res["numel"] == 50_000 and res["input_bytes"] == 200_000
    mem = res["memory_pass"]
    assert mem["op"] == "x.clone()" and mem["seconds"] > 0 and mem["throughput_gbps"] > 0
    names = list(res["codecs"])
    assert any(n.startswith("slimdp") and "refresh" in n for n in names)
    assert any(n.startswith("slimdp") and "cached" in n for n in names)
    assert {"qsgd:bits=8", "olandraj", "dcd:bits=8"} <= set(names)
    for v in res["codecs"].values():
        assert v["encode_s"] > 0 and v["decode_s"] > 0
        assert v["compression_ratio"] == pytest.approx(200_000 / v["bytes"])
        assert v["throughput_vs_memory_pass"] == pytest.approx(v["throughput_gbps"] / mem["throughput_gbps"])
    assert res["codecs"]["qsgd:bits=8"]["bytes"] == 50_000 + 4 * 98 + 1  # + the byte naming the dtype
    cached = next(v for n, v in res["codecs"].items() if "cached" in n)
    assert cached["bytes"] == 24 + 4 * 7500 + 8 * 7500  # (alpha + eps) N values' worth + header


def test_custom_codec_list() -> None:
    res = bench.run(_args(numel=4096, repeat=1, device="cpu", codecs=["qsgd:bits=4", "olandraj:huffman=false"]))
    assert set(res["codecs"]) == {"qsgd:bits=4", "olandraj:huffman=false"}
    assert res["codecs"]["qsgd:bits=4"]["compression_ratio"] == pytest.approx(4 * 4096 / (2048 + 32 + 1))


def test_every_registry_name_builds_and_round_trips() -> None:
    names = {"slimdp", "qsgd", "olandraj", "dcd", "ecd", "naive-gossip"}
    assert names <= set(available())
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    for spec in (
        "slimdp:alpha=0.3,eps=0.15",
        "qsgd:bits=8",
        "olandraj:c=6",
        "dcd:bits=8",
        "ecd:bits=8",
        "naive-gossip:bits=8",
    ):
        c = make_codec(spec)
        parts = c.encode(x, BucketState(3000, x.dtype))
        y = c.decode(received_from_parts(parts), BucketState(3000, x.dtype), x)
        assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "spec", ["slimdp", "slimdp:shared_seed=true", "qsgd", "olandraj", "dcd:bits=8", "ecd:quantizer=fixed",
             "naive-gossip:bits=8", "dgt:p=0.3", "dense", "dense:dtype=fp16"]
)
def test_cuda_round_trip_matches_cpu_semantics(spec: str) -> None:
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(1)).cuda()
    c = make_codec(spec)
    parts = c.encode(x, BucketState(x.numel(), x.dtype))
    assert all(p.data.is_cuda for p in parts)
    y = c.decode(received_from_parts(parts), BucketState(x.numel(), x.dtype), x)
    assert y.is_cuda and y.shape == x.shape
    if spec.startswith("slimdp"):
        sent = y != 0
        assert int(sent.sum()) == sum(c.set_sizes(x.numel())) and torch.equal(y[sent], x[sent])
    else:
        assert float((y - x).abs().max()) < 0.05 * float(x.abs().max())
