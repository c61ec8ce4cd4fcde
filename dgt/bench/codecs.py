"""``dgt bench codecs``: encode+decode throughput and compression ratio of the payload codecs vs a memory pass.

Every codec runs on one fp32 tensor of ``--numel`` entries (default 25M, gradient-like: N(0, 0.01^2)) on one device;
the anchor is a plain ``x.clone()`` of the same tensor in the same run (best of ``--repeat``). Reported per codec:
encode and decode seconds (best of ``--repeat``), throughput in GB/s of fp32 input (4 N bytes / (encode + decode)),
that throughput as a fraction of the memory pass's, bytes produced (sum of Part.nbytes, headers included) and the
compression ratio 4 N / bytes. Slim-DP is reported twice: a core-refresh round (top-k + bitmap) and a cached round.
One untimed round per codec comes first (lazy initialisation).
"""

from __future__ import annotations

import argparse
import time

import torch

from dgt.cliargs import COUNT, NON_NEGATIVE, BadOption, codec_spec, torch_device
from dgt.codecs.base import BucketState, Codec
from dgt.codecs.bucketinfo import received_from_parts, wire_bytes
from dgt.codecs.registry import make_codec

DEFAULT_CODECS = ["qsgd:bits=8", "slimdp:alpha=0.3,eps=0.15,q=20", "olandraj", "dcd:bits=8", "dcd:bits=4"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=COUNT, default=25_000_000, help="entries of the fp32 test tensor (25M)")
    parser.add_argument("--repeat", type=COUNT, default=3, help="timed repetitions; the best is reported (3)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument(
        "--codec",
        action="append",
        dest="codecs",
        metavar="SPEC",
        help=f"codec spec to run (repeatable); default: {' '.join(DEFAULT_CODECS)}",
    )
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _bench_codec(codec: Codec, x: torch.Tensor, repeat: int, rounds: list[str]) -> dict[str, dict]:
    """Time encode and decode; ``rounds`` names the successive encodes to report separately (Slim-DP)."""
    device = x.device
    results: dict[str, dict] = {}
    best: dict[str, list[float]] = {r: [float("inf"), float("inf")] for r in rounds}
    nbytes: dict[str, int] = {}
    warm = BucketState(x.numel(), x.dtype)  # one untimed round: lazy initialisation, allocator warm-up
    codec.decode(received_from_parts(codec.encode(x, warm)), BucketState(x.numel(), x.dtype), x)
    for _ in range(repeat):
        tx = BucketState(x.numel(), x.dtype)
        rx = BucketState(x.numel(), x.dtype)
        for r in rounds:
            t_enc, parts = _timed(lambda tx=tx: codec.encode(x, tx), device)
            rec = received_from_parts(parts)
            t_dec, out = _timed(lambda rec=rec, rx=rx: codec.decode(rec, rx, x), device)
            best[r][0] = min(best[r][0], t_enc)
            best[r][1] = min(best[r][1], t_dec)
            nbytes[r] = wire_bytes(parts)
            del parts, rec, out
    in_bytes = 4 * x.numel()
    for r in rounds:
        enc, dec = best[r]
        results[r] = {
            "encode_s": enc,
            "decode_s": dec,
            "throughput_gbps": in_bytes / (enc + dec) / 1e9,
            "bytes": nbytes[r],
            "compression_ratio": in_bytes / nbytes[r],
            "bits_per_entry": 8.0 * nbytes[r] / x.numel(),
        }
    return results


def run(args: argparse.Namespace) -> dict:
    dev = torch_device("--device", args.device, auto=True)
    specs = [codec_spec("--codec", c) for c in args.codecs or DEFAULT_CODECS]
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(args.numel, generator=gen, device=device).mul_(0.01)
    repeat = max(1, int(args.repeat))

    x.clone()  # warm-up
    mem = min(_timed(lambda: x.clone(), device)[0] for _ in range(repeat))
    mem_gbps = 8 * x.numel() / mem / 1e9  # a clone reads and writes 4 N bytes each
    in_gbps = 4 * x.numel() / mem / 1e9
    out: dict = {
        "bench": "codecs",
        "device": str(device),
        "numel": x.numel(),
        "input_bytes": 4 * x.numel(),
        "input": "fp32 N(0, 0.01^2)",
        "repeat": repeat,
        "memory_pass": {
            "op": "x.clone()",
            "seconds": mem,
            "throughput_gbps": in_gbps,
            "read_write_gbps": mem_gbps,
        },
        "codecs": {},
    }
    for spec in specs:
        codec = make_codec(spec)
        if codec.name == "slimdp":
            res = _bench_codec(codec, x, repeat, ["refresh round", "cached round"])
            named = {f"{spec} ({r})": v for r, v in res.items()}
        else:
            named = {spec: _bench_codec(codec, x, repeat, ["round"])["round"]}
        for name, v in named.items():
            v["seconds_vs_memory_pass"] = (v["encode_s"] + v["decode_s"]) / mem
            v["throughput_vs_memory_pass"] = v["throughput_gbps"] / in_gbps
            out["codecs"][name] = v
    return out


def main(argv: list[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(prog="python -m dgt.bench.codecs", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        print(json.dumps(run(args), indent=2))
    except BadOption as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
