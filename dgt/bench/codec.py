"""``dgt bench codec``: the DGT estimator + classification + frame packing against a plain abs().sum() pass.

The anchor is the cheapest thing any importance estimate must do: read every element once. The ratio says how close
the whole DGT send-side pipeline (score update, per-tensor top-p, building every frame) comes to that.
"""

from __future__ import annotations

import argparse

import torch

from dgt.bench.timing import best_of
from dgt.cliargs import COUNT, FRACTION, NON_NEGATIVE, BadOption
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.protocol.sender import RoundSender


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=COUNT, default=25_000_000, help="elements of the flat fp32 gradient (default 25M)")
    p.add_argument("--tensors", type=COUNT, default=16, help="tensors in the bucket (awkward sizes)")
    p.add_argument("--p", type=FRACTION, default=0.3, help="fraction of important blocks")
    p.add_argument("--repeat", type=COUNT, default=5)
    p.add_argument("--threads", type=NON_NEGATIVE, default=0, help="torch threads (0 = torch default)")


def _sizes(numel: int, k: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(k, generator=g) + 0.2
    sizes = (w / w.sum() * numel).long()
    sizes[-1] = numel - int(sizes[:-1].sum())
    return [int(s) for s in sizes]


def run(args: argparse.Namespace) -> dict:
    if args.numel < args.tensors:
        raise BadOption(f"--numel ({args.numel}) must be at least --tensors ({args.tensors}): one element per tensor")
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = BucketLayout(_sizes(args.numel, args.tensors), 1024)
    g = torch.randn(args.numel)
    est = ContributionEstimator(layout)
    sender = RoundSender(token=1, rank=0, error_feedback=False)
    state = {}

    def anchor() -> None:
        g.abs().sum()

    def classify() -> None:
        est.update(g)
        state["c"] = est.classify(args.p)

    def pipeline() -> None:
        est.update(g)
        c = est.classify(args.p)
        sender.plan(0, 0, g, layout, c.cls, c.order)

    t_anchor = best_of(anchor, args.repeat)
    t_cls = best_of(classify, args.repeat)
    t_all = best_of(pipeline, args.repeat)
    gb = args.numel * 4 / 1e9
    return {
        "bench": "codec",
        "numel": args.numel,
        "tensors": args.tensors,
        "blocks": layout.nblocks,
        "p": args.p,
        "threads": torch.get_num_threads(),
        "anchor_abs_sum_s": t_anchor,
        "classify_s": t_cls,
        "classify_and_pack_s": t_all,
        "anchor_GBps": gb / t_anchor,
        "classify_GBps": gb / t_cls,
        "classify_and_pack_GBps": gb / t_all,
        "classify_speed_ratio": t_anchor / t_cls,
        "classify_and_pack_speed_ratio": t_anchor / t_all,
        "goal_classify_ratio": 0.7,
        "goal_met": t_anchor / t_cls >= 0.7,
    }
