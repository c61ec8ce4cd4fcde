"""One rank of one training run: compute the gradient, all-reduce it through the parameter server, step.

Run as ``python -m dgt.experiment.worker SPEC.json`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
DGT_BIND, the address to bind inside a namespace) in the environment. Every rank writes ``rank{R}.json`` with its
per-iteration records; rank 0 also prints one ``@@ {json}`` progress line per iteration on stdout.

Timing: the batch completion time (BCT) of an iteration is the wall time from the start of the forward pass until
the optimizer step is done (compute + communication). Every ``eval_every`` iterations rank 0 measures test accuracy
while the others wait; that pause is outside every BCT, so training time = sum of BCTs. Rank 0 decides when to stop
(target reached, iteration or time budget spent) and publishes the decision through the rendezvous store, so all
ranks stop at the same iteration.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dgt.errors import open_nursery
from dgt.experiment.config import RunSpec
from dgt.experiment.data import Dataset, ShardSampler, load_dataset
from dgt.experiment.models import build_model

PROGRESS = "@@ "
# how often a rank waiting for rank 0's evaluation looks for its decision file (publish_decision)
DECISION_POLL_S = 0.0005
DECISION_TIMEOUT_S = 900.0
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)


def evaluate(model: torch.nn.Module, data: Dataset, batch: int = 1000) -> float:
    """Test accuracy (eval mode, no gradients)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(data.y_test), batch):
            correct += int((model(data.x_test[i : i + batch]).argmax(1) == data.y_test[i : i + batch]).sum())
    model.train()
    return correct / len(data.y_test)


def pace_tcp(endpoint: Any, rate: float) -> int:
    """Loopback mode: cap every TCP connection of the endpoint at ``rate`` bytes/s (SO_MAX_PACING_RATE makes the
    kernel pace TCP itself). The transport paces its UDP lanes to the same rate from a budget the TCP bytes come
    off too (TransportConfig.pacing: rate, shared), so both together stay within ``rate``. Returns how many
    sockets were paced."""
    socks = endpoint.links.link_sockets()
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(rate))
    return len(socks)


def transport_state(endpoint: Any) -> dict[str, Any]:
    """What a stuck all-reduce waits for (rounds awaited, rounds in flight, rounds open at the receiver), for the
    error message: ``Endpoint.inbound.pending_rounds``."""
    return endpoint.inbound.pending_rounds(20).to_dict()


def _lane_dict(d: dict) -> dict[str, int]:
    return {str(k): int(v) for k, v in d.items()}


async def train(spec: RunSpec, rank: int, world: int, bind: str, emit: bool) -> dict[str, Any]:
    """One rank's run of ``spec``; the group's endpoint serves in a nursery of this call (closed before it ends)."""

    async with open_nursery() as services:
        try:
            return await _train(spec, rank, world, bind, emit, services)
        finally:
            services.cancel_scope.cancel()  # group.aclose() ended the service already; a close cut short ends here


async def _connect(spec: RunSpec, rank: int, world: int, bind: str, services: Any) -> tuple[Any, Any, Any, int, int]:
    """The rendezvous store, the group (every link open), its parameter server, the number of TCP sockets paced and
    of peers whose TCP and UDP share one budget."""
    import trio

    from dgt.collectives import Group, ParameterServer
    from dgt.collectives.rendezvous import store_from_env
    from dgt.transport import Congestion, Pacing, Sockets, Timeouts, TransportConfig

    store = await trio.to_thread.run_sync(store_from_env, rank, world, 120.0)
    # loopback: one budget per peer that TCP and UDP share (pace_shared), so DGT gets no more than the baseline
    cfg = TransportConfig(deadline=spec.deadline, timeouts=Timeouts(peer=spec.peer_timeout),
                          sockets=Sockets(gso=spec.gso),
                          pacing=Pacing(rate=spec.pace_rate, shared=bool(spec.pace_rate)),
                          congestion=Congestion(enabled=spec.congestion_control))
    # every link now: TCP pacing below applies to the connections open at this point
    group = await Group.create(rank, world, store=store, config=cfg, host=bind, timeout=120.0, prefix="dgtexp",
                               connect="all", nursery=services)
    paced = pace_tcp(group.endpoint, spec.pace_rate) if spec.pace_rate else 0
    # peers whose TCP and UDP bytes come off one budget (loopback: all of them), read off the links for the record
    shared = group.endpoint.stats().pace_shared_peers
    server: int | str = "sharded" if spec.server == "sharded" else int(spec.server)
    ps = ParameterServer(group, spec.codec, server=server, lossy_pull=spec.lossy_pull)
    return store, group, ps, paced, shared


async def _train(spec: RunSpec, rank: int, world: int, bind: str, emit: bool, services: Any) -> dict[str, Any]:
    import trio

    data = load_dataset(spec.dataset, spec.data_dir, spec.seed, spec.limit_train, spec.limit_test)
    model = build_model(spec.model, data.shape, data.num_classes, spec.width, seed=spec.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    segments = [p.numel() for p in params]
    opt = torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    sampler = ShardSampler(len(data.y_train), rank, world, spec.batch, spec.seed)
    store, group, ps, paced, shared = await _connect(spec, rank, world, bind, services)
    codec = ps.codec

    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    train_time = 0.0
    eval_time = 0.0
    smoothed: float | None = None
    stop_reason = "max_iters"
    grad = torch.empty(sum(segments))
    t_start = time.perf_counter()
    try:
        for it in range(1, spec.max_iters + 1):
            t0 = time.perf_counter()
            at = time.monotonic()  # the system-wide clock, to place the iteration against the cross flow's arrivals
            loss_v = _local_gradient(model, params, opt, data, sampler.next(), grad, rank, it)
            smoothed, p = _observe(codec, smoothed, loss_v, spec.loss_smoothing)
            t1 = time.perf_counter()
            res = await _allreduce(ps, grad, segments, spec.round_timeout, rank, it, group.endpoint)
            t2 = time.perf_counter()
            _apply(params, res.tensor)
            opt.step()
            t3 = time.perf_counter()
            bct = t3 - t0
            train_time += bct
            st = res.stats
            records.append(_record(it, at, (t0, t1, t2, t3), loss_v, p, train_time, st))
            decision = None
            if it % spec.eval_every == 0 or it == spec.max_iters:  # every rank pauses at the same iterations
                te = time.perf_counter()
                decision = await _decide(rank, it, spec, model, data, train_time)
                eval_time += time.perf_counter() - te
                evals.append({"it": it, "train_time": train_time, "acc": decision["acc"]})
            if emit:
                _progress(it, bct, loss_v, p, train_time, st, decision)
            if decision is not None and decision["stop"]:
                stop_reason = decision["reason"]
                break
        await trio.to_thread.run_sync(_leave, store, rank, world)
    finally:
        with trio.move_on_after(5):
            await group.aclose()
    return {
        "rank": rank, "world": world, "protocol": spec.protocol, "codec": spec.codec, "model": spec.model,
        "records": records, "evals": evals, "train_time": train_time, "eval_time": eval_time,
        "wall_time": time.perf_counter() - t_start, "stop_reason": stop_reason, "paced_tcp_sockets": paced,
        "shared_budget_peers": shared,
        "transport": _transport_summary(group.endpoint.stats()),
    }


def _observe(codec: Any, smoothed: float | None, loss: float, s: float) -> tuple[float, float]:
    """Feed the smoothed loss to the codec's p schedule: (the smoothed loss, the p it gives, 1 for none)."""
    smoothed = loss if smoothed is None else s * smoothed + (1 - s) * loss
    codec.observe_loss(smoothed)
    p = codec.current_p()
    return smoothed, 1.0 if p is None else p


async def _allreduce(ps: Any, grad: torch.Tensor, segments: list[int], timeout: float, rank: int, it: int,
                     endpoint: Any) -> Any:
    """``ps.allreduce`` of the gradient, bounded by ``timeout``: a stuck one fails saying what the transport awaits."""
    import trio

    try:
        with trio.fail_after(timeout):
            return await ps.allreduce(grad, 0, segments)
    except trio.TooSlowError:
        raise TimeoutError(f"rank {rank}: all-reduce of iteration {it} not done in {timeout} s; "
                           f"transport state: {transport_state(endpoint)}") from None


def _local_gradient(model: torch.nn.Module, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, data: Any,
                    idx: torch.Tensor, grad: torch.Tensor, rank: int, it: int) -> float:
    """Forward and backward on the batch ``idx``; the flat gradient goes to ``grad``; returns the loss."""
    loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
    opt.zero_grad(set_to_none=False)
    loss.backward()
    torch.cat([p.grad.reshape(-1) for p in params], out=grad)
    loss_v = float(loss.detach())
    if not math.isfinite(loss_v):
        raise FloatingPointError(f"rank {rank}: training loss is {loss_v} at iteration {it}")
    return loss_v


def _progress(it: int, bct: float, loss_v: float, p: float, train_time: float, st: Any,
              decision: dict[str, Any] | None) -> None:
    """One progress line for the parent (dgt experiment's live display)."""
    out = {"it": it, "bct": bct, "loss": loss_v, "p": p, "train_time": train_time, "dropped": st.dropped,
           "blocks": st.blocks}
    if decision is not None:
        out["acc"] = decision["acc"]
    print(PROGRESS + json.dumps(out), flush=True)


def _apply(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """The reduced flat gradient back into the parameters' .grad."""
    off = 0
    for prm in params:
        prm.grad.copy_(flat[off : off + prm.numel()].view_as(prm))
        off += prm.numel()


def _record(it: int, at: float, t: tuple[float, float, float, float], loss_v: float, p: float, train_time: float,
            st: Any) -> dict[str, Any]:
    """One iteration's record for results.json (at: time.monotonic() at its start; t: start, all-reduce start,
    all-reduce end, step end)."""
    t0, t1, t2, t3 = t
    return {"it": it, "at": at, "bct": t3 - t0, "compute": (t1 - t0) + (t3 - t2), "comm": t2 - t1, "loss": loss_v,
            "p": p, "train_time": train_time, "sent": _lane_dict(st.bytes_sent), "recv": _lane_dict(st.bytes_received),
            "blocks": st.blocks, "dropped": st.dropped, "unsent": st.unsent, "unsent_bytes": st.bytes_unsent,
            "unimportant_delivered": st.unimportant_received,
            "phases": {k: round(v, 6) for k, v in st.phases.items()}}


def _transport_summary(tstats: Any) -> dict[str, Any]:
    return {"late_frames": tstats.late_frames, "closed_by": dict(tstats.closed_by),
            "deadline_wait_total": tstats.deadline_wait_total,
            "pace_rates": {str(k): v for k, v in tstats.pace_rates.items()},
            "lanes": [_lane_row(ls) for ls in tstats.lanes]}


def _lane_row(ls: Any) -> dict[str, Any]:
    """One lane of the endpoint for results.json: sent, delivered (to this rank), unsent and lost blocks."""
    keys = ("lane", "name", "kind", "dscp", "tx_bytes", "tx_frames", "rx_bytes", "rx_frames", "tx_abandoned",
            "tx_unsent_blocks", "tx_lost_blocks", "delivered_blocks", "delivered_bytes")
    return {k: getattr(ls, k, 0) for k in keys}


def _leave(store: Any, rank: int, world: int, timeout: float = 30.0) -> None:
    """Rank 0 hosts the store: it stays until every rank has read the last decision (or ``timeout``)."""
    if rank != 0:
        store.add("dgtexp/left", 1)
        return
    end = time.monotonic() + timeout
    while store.add("dgtexp/left", 0) < world - 1 and time.monotonic() < end:
        time.sleep(0.01)


async def _decide(rank: int, it: int, spec: RunSpec, model: torch.nn.Module, data: Dataset,
                  train_time: float) -> dict[str, Any]:
    """Rank 0 evaluates and publishes {acc, stop, reason}; the others wait for it (this is the evaluation pause; see
    :func:`publish_decision` for why not through the store)."""
    import trio

    if rank == 0:
        acc = evaluate(model, data)
        reason = ""
        if acc >= spec.target:
            reason = "target"
        elif it >= spec.max_iters:
            reason = "max_iters"
        elif train_time >= spec.max_time:
            reason = "max_time"
        decision = {"acc": acc, "stop": bool(reason), "reason": reason or None}
        publish_decision(spec.out_dir, it, decision)
        return decision
    return await trio.to_thread.run_sync(await_decision, spec.out_dir, it)


def decisions_dir(out_dir: str) -> str:
    """Where rank 0's decisions of a run go (launch() clears it before and after the run)."""
    return os.path.join(out_dir, "decisions")


def decision_path(out_dir: str, it: int) -> str:
    return os.path.join(decisions_dir(out_dir), f"{it}.json")


def publish_decision(out_dir: str, it: int, decision: dict[str, Any]) -> None:
    """Rank 0's decision after its evaluation at iteration ``it``, for :func:`await_decision`.

    A file in the run's directory (which every worker shares already: its result goes there), not the c10d store:
    the store's server runs beside rank 0, so through it the other ranks heard the decision one to two round trips
    of the emulated network after rank 0 went on (``store.get`` is a wait and a get), and rank 0's next step waited
    that long for them inside its first all-reduce. On ``wan`` (80 ms round trips) that added about 0.19 s to every
    step after an evaluation, for every arm. Read by polling every :data:`DECISION_POLL_S`, every rank resumes within
    about a millisecond of rank 0, so the evaluation pause stays outside the steps."""
    os.makedirs(decisions_dir(out_dir), exist_ok=True)
    write_json(decision_path(out_dir, it), decision)


def await_decision(out_dir: str, it: int, timeout: float = DECISION_TIMEOUT_S) -> dict[str, Any]:
    """The decision rank 0 published for iteration ``it`` (:func:`publish_decision`); TimeoutError after
    ``timeout`` seconds without it (rank 0 died or evaluates far too slowly)."""
    path = decision_path(out_dir, it)
    end = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            if time.monotonic() > end:
                raise TimeoutError(f"rank 0 published no decision for iteration {it} within {timeout:g} s "
                                   f"(expected {path})") from None
            time.sleep(DECISION_POLL_S)


def write_json(path: str, obj: Any, indent: int | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a reader such as launch() never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(path + ".tmp", path)


def worker_main(argv: list[str] | None, module: str, parse: Callable[[str], Any],
                train_rank: Callable[[Any, int, int], Any]) -> int:
    """A worker process's entry point under launch(): ``python -m MODULE SPEC.json`` with RANK and WORLD_SIZE in the
    environment; ``train_rank(spec, rank, world)`` runs the rank, whose result goes to ``out_dir/rank{R}.json``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {module} SPEC.json", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    with open(argv[0]) as f:
        spec = parse(f.read())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = train_rank(spec, rank, world)
    write_json(os.path.join(spec.out_dir, f"rank{rank}.json"), result)
    return 0


def main(argv: list[str] | None = None) -> int:
    import trio

    bind = os.environ.get("DGT_BIND", "127.0.0.1")
    return worker_main(argv, "dgt.experiment.worker", RunSpec.from_json,
                       lambda spec, rank, world: trio.run(train, spec, rank, world, bind, rank == 0))


if __name__ == "__main__":
    sys.exit(main())
