"""``dgt bench lgc``: learned gradient compression vs dense training on a small real problem.

scikit-learn's digits (8x8 images, 10 classes; 75 % train / 25 % test), a small CNN, K data-parallel ranks as threads
over the in-process Comm. The same seeds, initial weights and mini-batches are used for dense training (ring all-reduce
of the full gradient) and for LGC's parameter-server and ring variants, so the accuracy difference comes from the
gradient compression alone. Compression ratios are measured from the bytes the Comm counted.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dgt.cliargs import COUNT, FRACTION, NON_NEGATIVE, POSITIVE, BadOption, codec_spec, number, torch_device
from dgt.codecs.lgc import LGCCodec, LGCRunner
from dgt.codecs.lgc.plan import ROLES, LGCConfig
from dgt.harness.digits import digits_split_standardised
from dgt.harness.local_comm import run_threads

PHASES = ("dense", "topk", "compressed")


class DigitsCNN(nn.Module):
    """conv 1->16, conv 16->32, pool, conv 32->64, pool, fc 256->128, fc 128->10 (about 57k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def layer_params(model: nn.Module) -> list[list[nn.Parameter]]:
    """Parameters grouped by layer (weight + bias of each module with parameters), in forward order."""
    groups = []
    for mod in model.modules():
        own = list(mod.parameters(recurse=False))
        if own:
            groups.append(own)
    return groups


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean()) * 100.0


def _set_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    off = 0
    for p in params:
        p.grad.copy_(flat[off : off + p.numel()].view_as(p))
        off += p.numel()


def _replica(init: dict[str, Any], dev: torch.device) -> tuple[torch.nn.Module, list[torch.Tensor], list[int]]:
    """A rank's model from the shared initial weights, its parameters in layer order and each layer's size."""
    model = DigitsCNN()
    model.load_state_dict(init)
    model.to(dev)
    groups = layer_params(model)
    return model, [p for g in groups for p in g], [sum(p.numel() for p in g) for g in groups]


def _local_gradient(model: torch.nn.Module, opt: torch.optim.Optimizer, params: list[torch.Tensor], x: torch.Tensor,
                    y: torch.Tensor, losses: list[float]) -> torch.Tensor:
    """One batch's flat gradient (its loss appended to ``losses``)."""
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    losses.append(loss.item())
    return torch.cat([p.grad.reshape(-1) for p in params])


def _average(comm: Any, runner: Any, flat: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The mean gradient: LGC's step, or (``runner`` None) a dense all-reduce; and the dense bytes it sent."""
    if runner is not None:
        return runner.step(flat), 0
    before = comm.stats.total_sent
    mean = comm.allreduce_sum(flat, tag="dense") / comm.world_size
    return mean, comm.stats.total_sent - before


def _rank_result(rank: int, is_worker: bool, acc: dict[str, float], losses: list[float],
                 params: list[torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank, "is_worker": is_worker, "accuracy": acc,
                           "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None}
    if is_worker:
        out["weights"] = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
    return out


def train(method: str, *, ranks: int = 2, iters: int = 700, warmup: int = 200, ae_iters: int = 300,
          batch: int = 32, lr: float = 0.05, momentum: float = 0.9, seed: int = 0, device: str = "cpu",
          lgc_options: dict[str, Any] | None = None, sparse_momentum: float = 0.0) -> dict[str, Any]:
    """Train the digits CNN on ``ranks`` workers with ``method`` in dense | ps | ring; returns accuracies and the
    per-rank byte summaries. The PS variant runs a dedicated server as one more thread.

    ``momentum`` is the SGD momentum of dense training and of LGC's warm-up; after the warm-up LGC's optimizer uses
    ``sparse_momentum`` (default 0: SGD momentum on top of error-feedback top-k updates destabilised this problem;
    the codec's DGC momentum correction, ``momentum_correction=true``, is the momentum-carrying alternative)."""
    opts = dict(lgc_options or {})
    if opts.get("momentum_correction"):
        opts.setdefault("momentum", momentum)
    if method not in ("dense", "ps", "ring"):
        raise ValueError(f"method must be dense, ps or ring, not {method!r}")
    dev = torch.device(device)
    xtr, ytr, xte, yte = (t.to(dev) for t in digits_split_standardised(seed))
    world = ranks + 1 if method == "ps" else ranks
    checkpoints = {warmup: "after_warmup", warmup + ae_iters: "after_ae_training", iters: "final"}

    torch.manual_seed(seed)
    init = DigitsCNN().state_dict()  # built once here: threads share torch's global RNG

    def body(comm: Any) -> dict[str, Any]:
        model, params, sizes = _replica(init, dev)
        numel = sum(sizes)
        runner = None
        if method != "dense":
            codec = LGCCodec(variant=method, warmup=warmup, ae_iters=ae_iters, seed=seed, **{"record": True, **opts})
            runner = LGCRunner(codec, comm, numel, layers=sizes, device=dev, server=world - 1,
                               dedicated_server=method == "ps")
        is_worker, worker = (runner.is_worker, runner.codec.worker) if runner is not None else (True, comm.rank)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        gen = torch.Generator().manual_seed(seed * 1000 + worker)
        shard = torch.arange(worker, len(ytr), ranks) if is_worker else None
        acc: dict[str, float] = {}
        dense_bytes = 0
        losses: list[float] = []
        for it in range(iters):
            if runner is not None and it == warmup:
                for group in opt.param_groups:
                    group["momentum"] = sparse_momentum
            flat = None
            if shard is not None:
                pick = shard[torch.randint(len(shard), (batch,), generator=gen)].to(dev)
                flat = _local_gradient(model, opt, params, xtr[pick], ytr[pick], losses)
            mean, sent = _average(comm, runner, flat)
            dense_bytes += sent
            if is_worker:
                _set_grads(params, mean)
                opt.step()
                if it + 1 in checkpoints:
                    acc[checkpoints[it + 1]] = _accuracy(model, xte, yte)
        out = _rank_result(comm.rank, is_worker, acc, losses, params)
        out["summary"] = runner.summary() if runner is not None else {"dense_bytes": dense_bytes, "numel": numel}
        out["diag"] = runner.state.values.get("diag", []) if runner is not None else []
        return out

    t0 = time.perf_counter()
    results = run_threads(body, world, timeout=600.0)
    return _report(method, results, ranks, iters, time.perf_counter() - t0, opts)


def _report(method: str, results: list[dict[str, Any]], ranks: int, iters: int, wall: float,
            opts: dict[str, Any]) -> dict[str, Any]:
    """What :func:`train` returns: accuracies, whether the replicas agree, traffic and reconstruction."""
    workers = [r for r in results if r["is_worker"]]
    ref = workers[0]["weights"]
    in_sync = all(torch.equal(ref, r["weights"]) for r in workers[1:])
    report: dict[str, Any] = {"method": method, "ranks": ranks, "iterations": iters, "wall_s": round(wall, 2),
                              "accuracy": workers[0]["accuracy"], "replicas_identical": in_sync,
                              "final_train_loss": workers[0]["final_train_loss"]}
    if method == "dense":
        s = workers[0]["summary"]
        report["bytes_per_rank_per_iteration"] = s["dense_bytes"] / iters
        report["dense_fp32_bytes_per_iteration"] = s["numel"] * 4
    else:
        report["traffic"] = traffic_report(method, [r["summary"] for r in results], ranks)
        numel = sum(results[0]["summary"]["dense_bytes_per_iteration"].values()) // 4
        report["reconstruction"] = reconstruction_report(method, results, numel, leader=int(opts.get("leader", 0)),
                                                         trainer=int(opts.get("trainer", 0)))
    return report


ABLATION_DECODERS = ("zero", "template")
# where the defaults depart from the paper: (label, options restoring the paper's choice, variants it concerns)
_PAPER_PS = {"ps_codes": "leader", "sim_weight": 0.5}
_PAPER_AE = {"ae_order": "index", "ae_opt": "sgd", "ae_lr": 1e-3, "ae_loss": "sum", "ae_replay": 0}
PAPER_CHOICES: tuple[tuple[str, dict[str, Any], tuple[str, ...]], ...] = (
    ("ae_order=index", {"ae_order": "index"}, ("ps", "ring")),
    ("ae_opt=sgd,ae_lr=1e-3", {"ae_opt": "sgd", "ae_lr": 1e-3}, ("ps", "ring")),
    ("ae_opt=sgd,ae_lr=1e-3,ae_loss=sum", {"ae_opt": "sgd", "ae_lr": 1e-3, "ae_loss": "sum"}, ("ps", "ring")),
    ("ps_codes=leader,sim_weight=0.5", _PAPER_PS, ("ps",)),
    ("ae_replay=0", {"ae_replay": 0}, ("ps", "ring")),
    ("all_paper", _PAPER_AE, ("ring",)),
    ("all_paper", {**_PAPER_AE, **_PAPER_PS}, ("ps",)),
)


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """The figures that tell decoders apart: final test accuracy, the last 20 iterations' train loss, and the
    held-out reconstruction error and cosine of the decoded AE-layer update (compressed phase)."""
    rec = run.get("reconstruction") or {}
    return {"accuracy": run["accuracy"].get("final"), "final_train_loss": run["final_train_loss"],
            "rel_error": rec.get("rel_error"), "cosine": rec.get("cosine"),
            "per_worker_rel_error": [p["rel_error"] for p in rec.get("per_worker", [])] or None}


def ablation_report(ae_run: dict[str, Any], ablated: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The AE against each code-free decoder trained in the same run (same seeds, batches, phases). ``margin``: by
    how much the AE beats the *better* of the ablated decoders: reconstruction error and train loss lower, cosine
    and accuracy higher (positive = AE ahead)."""
    out = {"ae": _brief(ae_run), **{d: _brief(r) for d, r in ablated.items()}}
    ae = out["ae"]
    margin: dict[str, float | None] = {}
    for key, sign in (("rel_error", -1), ("final_train_loss", -1), ("cosine", 1), ("accuracy", 1)):
        # a diverged run (NaN, or no reconstruction figure) is the worst, never the best, of the ablated decoders
        others = [v for v in (out[d][key] for d in ablated) if v is not None and math.isfinite(v)]
        if ae[key] is None or not math.isfinite(ae[key]) or not others:
            margin[key] = None
            continue
        best = min(others) if sign < 0 else max(others)
        margin[key] = sign * (ae[key] - best)
    losses = [v for v in (out[d]["final_train_loss"] for d in ablated) if v is not None and math.isfinite(v)]
    ae_loss = ae["final_train_loss"]
    margin["train_loss_ratio"] = (min(losses) / ae_loss if losses and ae_loss and math.isfinite(ae_loss)
                                  else None)
    out["margin"] = margin
    return out


def _rel(err2: float, ref2: float) -> float | None:
    return (err2 / ref2) ** 0.5 if ref2 > 0 else None


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.reshape(1, -1).double(), b.reshape(1, -1).double()).item())


def reconstruction_report(method: str, results: list[dict[str, Any]], numel: int, *, leader: int = 0,
                          trainer: int = 0) -> dict[str, Any] | None:
    """How well the compressed phase's decoded AE-layer update matches the true top-k update, on vectors the AE
    never trained on (every compressed round), from the per-round records (``record=true``; not sent, not counted).

    ``rel_error`` = sqrt(sum ||decoded - true||^2 / sum ||true||^2) over the compressed rounds, each round's vectors
    divided by that round's scale (the AE works in these units). ``template`` is a code-free decoder that outputs the
    mean of the AE's (normalised) training targets, times the round's scale (PS: with the exact innovation values
    written back, like the real decoder): what the value ordering alone buys. ``rel_error_zero``: the zero decoder's
    error on the same vectors, measured like the others (ring: zeros, so 1.0; PS: zeros with the exact innovation
    values written back, below 1.0).
    ``cosine`` is the mean over rounds of the cosine between the decoded and the true AE-layer update (ring: the
    mean of the aligned vectors; PS: the sum over workers of their vectors scattered to their indices).
    """
    if method == "ring":
        return _ring_reconstruction(results, trainer)
    return _ps_reconstruction(results, numel, leader)


def _ring_reconstruction(results: list[dict[str, Any]], trainer: int) -> dict[str, Any] | None:
    """:func:`reconstruction_report` of the ring: ``trainer``'s decoded mean against the true mean."""
    per_rank = [r["diag"] for r in sorted(results, key=lambda r: r["rank"])]
    rounds = len(per_rank[0])
    if not rounds:
        return None
    e2 = t2 = z2 = r2 = 0.0
    cos, cos_t = [], []
    for i in range(rounds):
        own = per_rank[trainer][i]
        truth = torch.stack([d[i]["x"] for d in per_rank]).mean(0)
        s = float(own["scale"].reshape(-1)[0])
        e2 += float((own["rec"] - truth).pow(2).sum()) / s**2
        t2 += float((own["template"] - truth).pow(2).sum()) / s**2
        z2 += float((torch.zeros_like(truth) - truth).pow(2).sum()) / s**2  # the ring's zero decoder: zeros
        r2 += float(truth.pow(2).sum()) / s**2
        cos.append(_cos(own["rec"], truth))
        cos_t.append(_cos(own["template"], truth))
    return {"rounds": rounds, "rel_error": _rel(e2, r2), "rel_error_template": _rel(t2, r2),
            "rel_error_zero": _rel(z2, r2), "cosine": sum(cos) / rounds, "cosine_template": sum(cos_t) / rounds}


def _ps_reconstruction(results: list[dict[str, Any]], numel: int, leader: int) -> dict[str, Any] | None:
    """:func:`reconstruction_report` of the parameter server: what it decoded of each worker against its vectors."""
    server = next((r for r in results if not r["is_worker"]), None)
    workers = sorted((r for r in results if r["is_worker"]), key=lambda r: r["rank"])
    if server is None:  # co-located server: its records are mixed with its worker's
        server = workers[0]
    srv = [d for d in server["diag"] if "rec" in d]
    wrk = [[d for d in r["diag"] if "x" in d] for r in workers]
    k = len(workers)
    rounds = len(wrk[0])
    if not rounds or len(srv) != rounds * k:
        return None
    by_worker = {w: [d for d in srv if d["worker"] == w] for w in range(k)}
    acc = {w: [0.0, 0.0, 0.0, 0.0] for w in range(k)}  # err2, template err2, ref2, zero err2 (normalised units)
    cos, cos_t = [], []
    for i in range(rounds):
        true_sum = torch.zeros(numel, dtype=torch.float64)
        dec_sum = torch.zeros(numel, dtype=torch.float64)
        tmp_sum = torch.zeros(numel, dtype=torch.float64)
        for w in range(k):
            mine, got = wrk[w][i], by_worker[w][i]
            s = float(mine["scale"].reshape(-1)[0])
            acc[w][0] += float((got["rec"] - mine["x"]).pow(2).sum()) / s**2
            acc[w][1] += float((got["template"] - mine["x"]).pow(2).sum()) / s**2
            acc[w][2] += float(mine["x"].pow(2).sum()) / s**2
            acc[w][3] += float((got["zero"] - mine["x"]).pow(2).sum()) / s**2
            true_sum.index_add_(0, mine["idx"], mine["x"].double())
            dec_sum.index_add_(0, got["idx"], got["rec"].double())
            tmp_sum.index_add_(0, got["idx"], got["template"].double())
        cos.append(_cos(dec_sum, true_sum))
        cos_t.append(_cos(tmp_sum, true_sum))
    tot = [sum(a[j] for a in acc.values()) for j in range(4)]
    return {"rounds": rounds, "rel_error": _rel(tot[0], tot[2]), "rel_error_template": _rel(tot[1], tot[2]),
            "rel_error_zero": _rel(tot[3], tot[2]), "cosine": sum(cos) / rounds, "cosine_template": sum(cos_t) / rounds,
            "per_worker": [{"worker": w, "leader": w == leader, "rel_error": _rel(a[0], a[2]),
                            "rel_error_template": _rel(a[1], a[2])} for w, a in acc.items()]}


def traffic_report(method: str, summaries: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """Per phase: bytes per worker per iteration for each role and the compression ratio vs fp32 dense.

    Headline (the issue's definition): compressed phase, AE-coded layers: dense fp32 bytes of those layers / bytes
    actually transmitted for them (codes + innovation values and positions + DEFLATE-coded indices + scale floats),
    with all frame headers and the PS meta bytes charged to them as well. PS: uplink (worker -> server), per worker;
    the server's downlink is reported separately. Ring: everything each rank sends (index broadcasts by the
    round's selector + its share of the ring all-reduce), summed over ranks.
    """
    dense_ref = summaries[0]["dense_bytes_per_iteration"]
    iters = summaries[0]["iterations"]
    workers = [s for s in summaries if s["worker"] >= 0]
    out: dict[str, Any] = {"dense_fp32_bytes_per_iteration": dense_ref, "mu": summaries[0]["mu"], "phases": {}}
    for phase in PHASES:
        n = iters[phase]
        if not n:
            continue
        sent = {r: sum(s["bytes_sent"][phase].get(r, 0) for s in workers) for r in (*ROLES, "overhead")}
        per_worker_iter = {r: b / (n * ranks) for r, b in sent.items()}
        ratio = {r: (dense_ref[r] * n * ranks / sent[r]) if sent[r] else None for r in ROLES}
        charged_ae = sent["ae"] + sent["overhead"]
        ratio["ae_incl_overhead"] = dense_ref["ae"] * n * ranks / charged_ae if charged_ae else None
        total = sum(sent.values())
        ratio["all_layers"] = sum(dense_ref.values()) * n * ranks / total if total else None
        entry: dict[str, Any] = {"iterations": n, "bytes_per_worker_per_iteration": per_worker_iter, "ratio": ratio}
        if method == "ps":
            down = sum(s["bytes_sent"][phase].get("down", 0) for s in summaries)
            entry["downlink_bytes_per_iteration"] = down / n
            per = []
            for s in workers:
                b = s["bytes_sent"][phase]
                mine = b.get("ae", 0) + b.get("overhead", 0)
                per.append({"worker": s["worker"], "ae_bytes_per_iteration": mine / n,
                            "ae_ratio": dense_ref["ae"] * n / mine if mine else None})
            entry["per_worker"] = per
        out["phases"][phase] = entry
    weights = sum(s["bytes_sent"][p].get("ctl", 0) for s in summaries for p in PHASES)
    out["one_time_ae_weights_bytes"] = weights
    comp = out["phases"].get("compressed")
    out["compressed_phase_ratio"] = comp["ratio"]["ae_incl_overhead"] if comp else None
    if comp:
        n = comp["iterations"]
        sent = sum(s["bytes_sent"]["compressed"].get(r, 0) for s in workers for r in ("ae", "overhead"))
        # the same ratio with the one-time AE weights charged to this run's compressed phase
        out["compressed_phase_ratio_incl_weights"] = dense_ref["ae"] * n * ranks / (sent + weights)
    out["ae_training"] = next((s["ae_training"] for s in summaries if s.get("ae_training")), None)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=COUNT, default=2, help="data-parallel workers (default 2)")
    parser.add_argument("--iters", type=COUNT, default=1000, help="training iterations in all (default 1000)")
    parser.add_argument("--warmup", type=NON_NEGATIVE, default=200, help="dense warm-up iterations (default 200)")
    parser.add_argument("--ae-iters", type=NON_NEGATIVE, default=300,
                        help="top-k + AE training iterations (default 300)")
    parser.add_argument("--batch", type=COUNT, default=32, help="mini-batch per worker (default 32)")
    parser.add_argument("--lr", type=POSITIVE, default=0.05, help="SGD learning rate of the CNN (default 0.05)")
    parser.add_argument("--momentum", type=number(0.0, 1.0, below=True), default=0.9,
                        help="SGD momentum, dense and warm-up (default 0.9)")
    parser.add_argument("--sparse-momentum", type=number(0.0, 1.0, below=True), default=0.0,
                        help="SGD momentum of LGC after the warm-up (default 0)")
    parser.add_argument("--topk", type=number(0.0, 1.0, above=True), default=LGCConfig.topk,
                        help="top-k keep ratio per layer (default: the codec's, %(default)s)")
    parser.add_argument("--innovation", type=FRACTION, default=LGCConfig.innovation,
                        help="PS innovation share of mu (default: the codec's, %(default)s)")
    parser.add_argument("--lgc", default="", help="extra lgc options, e.g. 'ae_opt=adam,momentum_correction=true'")
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--threads", type=COUNT, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--ablation", action="store_true",
                        help="also run each LGC variant with a zero decoder and a template-only decoder (the mean "
                             "training target, ignoring the code) and report the AE's margin over both")
    parser.add_argument("--paper-choices", action="store_true",
                        help="also run each LGC variant with the paper's choice where the defaults depart from it "
                             "(ae_order=index, ae_opt=sgd at ae_lr=1e-3, ae_loss=sum, ae_replay=0; PS: "
                             "ps_codes=leader with sim_weight=0.5), one at a time and all together")
    parser.add_argument("--no-ablation", action="store_true", help="no ablation runs (the default; kept for scripts)")
    try:
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
    except argparse.ArgumentError:  # the bench front end provides it already
        pass


def lgc_options(args: argparse.Namespace) -> dict[str, Any]:
    from dgt.codecs.registry import parse_spec

    _, extra = parse_spec("lgc:" + (args.lgc or ""))
    return {"topk": args.topk, "innovation": args.innovation, **extra}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Dense vs LGC-PS vs LGC-ring with the same seeds; returns the JSON-able result."""
    torch_device("--device", args.device)
    codec_spec("--lgc", "lgc:" + (args.lgc or ""))
    if args.iters <= args.warmup + args.ae_iters:
        raise BadOption(f"--iters ({args.iters}) must exceed --warmup + --ae-iters ({args.warmup + args.ae_iters}): "
                        "the compressed phase comes after both")
    torch.set_num_threads(args.threads)
    common = dict(ranks=args.ranks, iters=args.iters, warmup=args.warmup, ae_iters=args.ae_iters, batch=args.batch,
                  lr=args.lr, momentum=args.momentum, seed=args.seed, device=args.device)
    opts = lgc_options(args)
    dense = train("dense", **common)
    ps = train("ps", lgc_options=opts, sparse_momentum=args.sparse_momentum, **common)
    ring = train("ring", lgc_options=opts, sparse_momentum=args.sparse_momentum, **common)
    ablation: dict[str, Any] = {}
    paper: dict[str, Any] = {}
    for m, res in (("ps", ps), ("ring", ring)):
        if args.ablation and not args.no_ablation:
            ablation[m] = ablation_report(res, {d: train(m, lgc_options={**opts, "ae_ablate": d},
                                                         sparse_momentum=args.sparse_momentum, **common)
                                                for d in ABLATION_DECODERS})
        if args.paper_choices:
            paper[m] = {"defaults": _brief(res)}
            for label, choice, variants in PAPER_CHOICES:
                if m in variants:
                    paper[m][label] = _brief(train(m, lgc_options={**opts, **choice},
                                                   sparse_momentum=args.sparse_momentum, **common))
    base = dense["accuracy"]["final"]
    result = {
        "bench": "lgc",
        "problem": "sklearn digits 8x8, DigitsCNN, test accuracy (%) on a held-out 25 %",
        "config": {**common, "sparse_momentum": args.sparse_momentum, "lgc": opts},
        "dense": dense,
        "lgc_ps": ps,
        "lgc_ring": ring,
        "ablation": ablation,
        "paper_choices": paper,
        "summary": {
            "accuracy_dense": base,
            "accuracy_lgc_ps": ps["accuracy"]["final"],
            "accuracy_lgc_ring": ring["accuracy"]["final"],
            "gap_ps_points": round(base - ps["accuracy"]["final"], 2),
            "gap_ring_points": round(base - ring["accuracy"]["final"], 2),
            "compressed_phase_ratio_ps": ps["traffic"]["compressed_phase_ratio"],
            "compressed_phase_ratio_ring": ring["traffic"]["compressed_phase_ratio"],
            **{f"{key}_{m}": (res["reconstruction"] or {}).get(key)
               for key in ("rel_error", "rel_error_template", "rel_error_zero", "cosine")
               for m, res in (("ps", ps), ("ring", ring))},
            "ae_training_rel_error_ps": ps["traffic"]["ae_training"],
            "ae_training_rel_error_ring": ring["traffic"]["ae_training"],
            **{f"ablation_{m}_ae_margin": a["margin"] for m, a in ablation.items()},
        },
    }
    s = result["summary"]
    ratios_ok = min(s["compressed_phase_ratio_ps"] or 0, s["compressed_phase_ratio_ring"] or 0) >= 100
    s["pass"] = bool(s["gap_ps_points"] <= 2.0 and s["gap_ring_points"] <= 2.0 and ratios_ok)
    return result


def main(argv: list[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(prog="dgt bench lgc", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        res = run(args)
    except BadOption as exc:
        parser.error(str(exc))
    print(json.dumps(res, indent=2) if args.json else json.dumps(res["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
