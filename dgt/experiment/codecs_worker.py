"""One rank of one codec's run in ``dgt experiment codecs``: the same model, data, shards and SGD on every codec; only
the way the ranks communicate differs (the codec's family decides which collective carries it).

Families:
  ``ps``       gradient all-reduce through :class:`ParameterServer` (dense, DGT, QSGD): every rank steps with the mean.
  ``slim``     :class:`ModelServer` holding ``w`` (Slim-DP): push the gradient, pull and merge ``T_C(w)``.
  ``average``  :class:`ModelServer(average=True, every=steps_per_epoch)` (Oland-Raj): one local epoch, then the
               server averages the coded parameters and every worker continues from the mean.
  ``gossip``   :class:`Gossip` on a ring, W = 1/3 (DCD-PSGD, ECD-PSGD): the codec's node does the algorithm.
  ``lgc``      :class:`LGCRunner` over :class:`TransportComm` (LGC-PS, LGC-ring): returns the mean gradient.

Each rank returns its per-step records (step time without evaluation, bytes it handed to the transport), rank 0 its
evaluations, and every rank its final parameters (the gossip families are judged on the average model).

Run as ``python -m dgt.experiment.codecs_worker SPEC.json`` by :func:`dgt.experiment.launch.launch`, with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and DGT_BIND (the host's address in its netem namespace) in the environment;
every rank writes ``rank{R}.json`` (one result per codec of the spec) and ``rank{R}.pt`` (the final parameters).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dgt.experiment.data import ShardSampler, load_dataset
from dgt.experiment.models import build_model
from dgt.experiment.worker import PROGRESS, evaluate


@dataclass
class CodecsSpec:
    """What every rank of one batch gets (JSON): the codecs' runs, in order, and the network's settings."""

    workers: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    out_dir: str = "."
    pace_rate: float | None = None  # set by launch(): bytes/s per connection on loopback, None on netem
    wire_if: str | None = None  # netem: the host's own interface, whose counters are this rank's traffic

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CodecsSpec:
        return cls(**json.loads(text))


def _sent(stats: Any) -> int:
    return int(sum(stats.bytes_sent.values()))


class _Trainer:
    """Model, shard and gradient for one rank; the model's parameters are read and written as one flat vector."""

    def __init__(self, run: dict[str, Any], rank: int, world: int) -> None:
        self.data = load_dataset("digits", seed=run["seed"])
        self.model = build_model(run["model"], self.data.shape, self.data.num_classes, seed=run["seed"])
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.segments = [p.numel() for p in self.params]
        self.sampler = ShardSampler(len(self.data.y_train), rank, world, run["batch"], run["seed"])
        self.shard = len(self.sampler.indices)
        self.rank = rank

    def flat(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach().clone()

    def load(self, flat: torch.Tensor) -> None:
        vector_to_parameters(flat.detach(), self.params)

    def grad(self, it: int) -> tuple[torch.Tensor, float]:
        idx = self.sampler.next()
        self.model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.model(self.data.x_train[idx]), self.data.y_train[idx])
        loss.backward()
        v = float(loss.detach())
        if not math.isfinite(v):
            raise FloatingPointError(f"rank {self.rank}: training loss is {v} at iteration {it}")
        return torch.cat([p.grad.reshape(-1) for p in self.params]), v

    def accuracy(self, flat: torch.Tensor | None = None) -> float:
        if flat is not None:
            self.load(flat)
        return evaluate(self.model, self.data)


def _transport_config(run: dict[str, Any], family: str) -> Any:
    from dgt.transport import Pacing, TransportConfig

    # Slim-DP drops lost explorer records itself; the transport must not fold them into the next round
    # the low-rank residual's packed positions mean other blocks each step: its lost blocks must not come back there
    residual = family == "lowrank" and "residual_p" in run["spec"]
    return TransportConfig(deadline=run["deadline"], pacing=Pacing(rate=run.get("pace_rate")),
                           error_feedback=family not in ("slim", "average") and not residual)


def run_spec(spec: CodecsSpec, rank: int, world: int, bind: str) -> list[dict[str, Any]]:
    """Train each run's codec in turn, every one in its own group (its own endpoint and connections) met through one
    c10d store, so a batch of codecs costs one start of the processes."""
    from dgt.collectives.rendezvous import store_from_env
    from dgt.experiment.ddp_worker import wire_bytes

    store = store_from_env(rank, world, 120.0)
    out = []
    for run in spec.runs:
        wire0 = wire_bytes(spec.wire_if)
        res = run_rank(rank, world, {**run, "pace_rate": spec.pace_rate, "bind": bind}, store)
        wire1 = wire_bytes(spec.wire_if)
        res["wire"] = None if wire0 is None or wire1 is None else {k: wire1[k] - wire0[k] for k in wire1}
        out.append(res)
    _leave(store, rank, world, "dgtcodecs/left")  # rank 0 hosts the store: it leaves last
    return out


def run_rank(rank: int, world: int, run: dict[str, Any], store: Any) -> dict[str, Any]:
    """Train ``run["codec"]`` for ``run["iters"]`` steps on this rank."""
    torch.manual_seed(run["seed"] + rank)
    tr = _Trainer(run, rank, world)
    prefix = f"dgtcodecs/{run['name']}"
    if run["family"] == "lgc":
        res = _run_lgc(tr, run, rank, world, store, prefix)
    else:
        import trio

        res = trio.run(_run_async, tr, run, rank, world, store, prefix)
    return res


def _barrier(store: Any, key: str, world: int, timeout: float = 60.0) -> None:
    """Every rank has finished its last round: nobody closes connections a peer still reads from (a lossy round's
    droppable blocks may still be in flight when the sender's call returns)."""
    store.add(key, 1)
    end = time.monotonic() + timeout
    while store.add(key, 0) < world:
        if time.monotonic() > end:
            raise TimeoutError(f"{key}: not every rank finished within {timeout} s")
        time.sleep(0.01)


def _leave(store: Any, rank: int, world: int, key: str, timeout: float = 30.0) -> None:
    if rank != 0:
        store.add(key, 1)
        return
    end = time.monotonic() + timeout
    while store.add(key, 0) < world - 1 and time.monotonic() < end:
        time.sleep(0.01)


class _Log:
    """Per-step records, rank 0's evaluations and progress lines (evaluation time is kept out of train_time)."""

    def __init__(self, tr: _Trainer, run: dict[str, Any], rank: int) -> None:
        self.tr, self.run, self.rank = tr, run, rank
        self.records: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.train_time = 0.0
        self.t_start = time.perf_counter()

    def step(self, it: int, dt: float, comm: float, sent: int, loss: float, model: Any) -> None:
        self.train_time += dt
        self.records.append({"it": it, "time": dt, "comm": comm, "sent": sent, "loss": loss})
        if self.rank == 0 and (it % self.run["eval_every"] == 0 or it == self.run["iters"]):
            acc = self.tr.accuracy(model() if callable(model) else model)
            self.evals.append({"it": it, "train_time": self.train_time, "acc": acc})
            print(PROGRESS + json.dumps({"codec": self.run["name"], "it": it, "iters": self.run["iters"],
                                         "acc": acc, "loss": loss, "train_time": self.train_time,
                                         "sent": sent}), flush=True)
            sys.stdout.flush()

    def result(self, final: torch.Tensor, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"rank": self.rank, "records": self.records, "evals": self.evals, "train_time": self.train_time,
                "wall_time": time.perf_counter() - self.t_start, "final": final, **(extra or {})}


async def _run_async(tr: _Trainer, run: dict[str, Any], rank: int, world: int, store: Any,
                     prefix: str) -> dict[str, Any]:
    import trio

    from dgt.collectives import Group

    # every link at once when pacing: pace_tcp caps the connections open at that point (a lazy group has none yet)
    async with Group.open(rank, world, store=store, config=_transport_config(run, run["family"]),
                          host=run.get("bind", "127.0.0.1"), timeout=120.0, prefix=prefix,
                          connect="all" if run.get("pace_rate") else "lazy") as group:
        paced = 0
        if run.get("pace_rate"):
            from dgt.experiment.worker import pace_tcp

            paced = pace_tcp(group.endpoint, run["pace_rate"])
        step = {"ps": _ps, "slim": _model_server, "average": _model_server, "gossip": _gossip,
                "lowrank": _lowrank}[run["family"]]
        res = await step(tr, run, group)
        await trio.to_thread.run_sync(_barrier, store, prefix + "/done", world)
        return {**res, "paced_connections": paced}


async def _ps(tr: _Trainer, run: dict[str, Any], group: Any) -> dict[str, Any]:
    from dgt.collectives import ParameterServer

    ps = ParameterServer(group, run["spec"], server=0, lossy_pull=True)
    codec = ps.codec
    return await _allreduce_loop(tr, run, group, lambda g: ps.allreduce(g, 0, tr.segments), codec.observe_loss)


async def _lowrank(tr: _Trainer, run: dict[str, Any], group: Any) -> dict[str, Any]:
    """The low-rank all-reduce (dgt.collectives.lowrank): every parameter's shape tells the codec its matrices."""
    from dgt.collectives.lowrank import LowRankAllReduce

    coll = LowRankAllReduce(group, run["spec"], op="mean")
    shapes = [tuple(p.shape) for p in tr.params]
    return await _allreduce_loop(tr, run, group, lambda g: coll.allreduce(g, 0, shapes), None)


async def _allreduce_loop(tr: _Trainer, run: dict[str, Any], group: Any, reduce: Callable[[Any], Awaitable[Any]],
                          observe_loss: Callable[[float], None] | None) -> dict[str, Any]:
    """Train with one all-reduce of the gradient per step (``reduce``: the collective's call), ``observe_loss``
    fed each step's loss first (the codec's p schedule); counts dropped and received blocks."""
    log = _Log(tr, run, group.rank)
    w = tr.flat()
    dropped = blocks = 0
    for it in range(1, run["iters"] + 1):
        t0 = time.perf_counter()
        g, loss = tr.grad(it)
        if observe_loss is not None:
            observe_loss(loss)
        t1 = time.perf_counter()
        res = await reduce(g)
        t2 = time.perf_counter()
        w -= run["lr"] * res.tensor
        tr.load(w)
        dropped += res.stats.dropped
        blocks += res.stats.blocks
        log.step(it, time.perf_counter() - t0, t2 - t1, _sent(res.stats), loss, None)
    return log.result(w, {"dropped_blocks": dropped, "received_blocks": blocks})


def _buckets(segments: list[int], most: int) -> list[tuple[int, int, list[int]]]:
    """Consecutive layers in buckets of at most ``most`` tensors: (start, end, sizes) each. Oland-Raj codes every
    layer as one part and the transport keys at most MAX_PARTS parts per message."""
    out, start = [], 0
    for i in range(0, len(segments), most):
        sizes = segments[i : i + most]
        out.append((start, start + sum(sizes), sizes))
        start += sum(sizes)
    return out


async def _model_server(tr: _Trainer, run: dict[str, Any], group: Any) -> dict[str, Any]:
    from dgt.collectives.model_server import ModelServer
    from dgt.collectives.parts import MAX_PARTS

    average = run["family"] == "average"
    every = max(1, tr.shard // run["batch"]) if average else 1  # Oland-Raj: average after each local epoch
    w0 = tr.flat()
    buckets = _buckets(tr.segments, MAX_PARTS) if average else [(0, w0.numel(), tr.segments)]
    servers = [ModelServer(group, run["spec"], model=w0[a:b], lr=run["lr"], segments=sizes, average=average,
                           every=every, bucket_id=i) for i, (a, b, sizes) in enumerate(buckets)]
    log = _Log(tr, run, group.rank)
    local = w0.clone()
    bits: list[tuple[float, int]] = []
    lost = 0
    head = servers[0]
    for it in range(1, run["iters"] + 1):
        t0 = time.perf_counter()
        tr.load(local)
        g, loss = tr.grad(it)
        local -= run["lr"] * g
        t1 = time.perf_counter()
        sent = 0
        merged = torch.empty_like(local)
        for ms, (a, b, _) in zip(servers, buckets):
            res = await ms.step(None if average else g[a:b], local[a:b])
            merged[a:b] = res.tensor
            sent += _sent(res.stats)
            lost += sum(res.stats.lost_blocks.values())
            last = getattr(ms.push_tx, "last_stats", None)
            if average and res.stats.bytes_sent and last and "bits_per_param" in last:
                bits.append((float(last["bits_per_param"]), b - a))
        t2 = time.perf_counter()
        local = merged
        # Slim-DP: the server's w is the model; its own replica is w merged with its local steps
        log.step(it, time.perf_counter() - t0, t2 - t1, sent, loss,
                 (lambda: head.w.clone()) if head.is_server and not average else local)
    final = head.w.clone() if head.is_server and not average else local
    # bits per parameter of each averaging round, over the whole model (buckets weighted by their size)
    per_round = [sum(b * n for b, n in bits[i : i + len(buckets)]) / w0.numel()
                 for i in range(0, len(bits), len(buckets))]
    return log.result(final, {"bits_per_param": per_round, "every": every, "lost_codec_blocks": lost})


async def _gossip(tr: _Trainer, run: dict[str, Any], group: Any) -> dict[str, Any]:
    from dgt.codecs import make_codec
    from dgt.codecs.decentralized import mixing_row, ring_matrix
    from dgt.collectives import Gossip

    proto = make_codec(run["spec"])
    node = proto.make_node(group.rank, tr.flat(), mixing_row(ring_matrix(group.world), group.rank), run["lr"])
    gossip = Gossip(group, proto)
    log = _Log(tr, run, group.rank)
    for it in range(1, run["iters"] + 1):
        t0 = time.perf_counter()
        tr.load(node.x)
        g, loss = tr.grad(it)
        parts = node.step(g)
        t1 = time.perf_counter()
        got, stats = await gossip.exchange_parts(parts, bucket_id=0)
        for j in node.neighbours:
            node.receive(j, got[j])
        t2 = time.perf_counter()
        log.step(it, time.perf_counter() - t0, t2 - t1, _sent(stats), loss, node.x)
    return log.result(node.x.clone())


def _run_lgc(tr: _Trainer, run: dict[str, Any], rank: int, world: int, store: Any, prefix: str) -> dict[str, Any]:
    from dgt.codecs import make_codec
    from dgt.codecs.lgc import LGCRunner
    from dgt.collectives.lgc_comm import TransportComm

    comm = TransportComm.start(rank, world, store=store, prefix=prefix, config=_transport_config(run, "lgc"),
                               host=run.get("bind", "127.0.0.1"), timeout=120.0)
    paced = 0
    if run.get("pace_rate"):  # TransportComm connects every link at start
        from dgt.experiment.worker import pace_tcp

        paced = comm.on_endpoint(lambda ep: pace_tcp(ep, run["pace_rate"]))  # on the comm's trio thread
    try:
        runner = LGCRunner(make_codec(run["spec"]), comm, sum(tr.segments), layers=tr.segments)
        log = _Log(tr, run, rank)
        w = tr.flat()
        for it in range(1, run["iters"] + 1):
            t0 = time.perf_counter()
            g, loss = tr.grad(it)
            sent0 = comm.stats.total_sent
            t1 = time.perf_counter()
            mean = runner.step(g)
            t2 = time.perf_counter()
            w -= run["lr"] * mean
            tr.load(w)
            log.step(it, time.perf_counter() - t0, t2 - t1, comm.stats.total_sent - sent0, loss, None)
        _barrier(store, prefix + "/done", world)
        return log.result(w, {"lgc": runner.summary(), "paced_connections": paced})
    finally:
        comm.close()


def _save(out_dir: str, rank: int, results: list[dict[str, Any]]) -> None:
    """rank{R}.pt (the final parameters, one tensor per codec), then rank{R}.json, which launch() waits for."""
    base = os.path.join(out_dir, f"rank{rank}")
    torch.save([r.pop("final") for r in results], base + ".pt.tmp")
    os.replace(base + ".pt.tmp", base + ".pt")
    with open(base + ".json.tmp", "w") as f:
        json.dump({"rank": rank, "runs": results}, f)
    os.replace(base + ".json.tmp", base + ".json")


def main(argv: list[str] | None = None) -> int:
    """``python -m dgt.experiment.codecs_worker SPEC.json`` under launch(): RANK, WORLD_SIZE from the environment."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dgt.experiment.codecs_worker")
    ap.add_argument("spec", help="the batch's spec.json, written by dgt.experiment.launch.launch")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with open(args.spec) as f:
        spec = CodecsSpec.from_json(f.read())
    rank = int(os.environ["RANK"])
    _save(spec.out_dir, rank, run_spec(spec, rank, int(os.environ["WORLD_SIZE"]),
                                       os.environ.get("DGT_BIND", "127.0.0.1")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
