"""One rank of one arm of `dgt experiment ddp`: a plain ``DistributedDataParallel`` trainer, as a user writes it.

Run as ``python -m dgt.experiment.ddp_worker SPEC.json`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment (what torchrun sets); the process group meets through ``env://``. The arm decides the one line that
differs: no hook (Gloo), torch's fp16 or PowerSGD hook (plain, in fp16, or batched), the DGT hook with no options,
or ``backend="dgt"``.

Timing: a step is forward + backward (DDP all-reduces the buckets inside backward, and waits for them at its end)
+ optimizer step. Every ``eval_every`` steps rank 0 measures test accuracy while the others wait for its decision
(a file in the run's directory: ``worker.publish_decision``); every rank resumes within about a millisecond, so that
pause is outside every step and training time = sum of step times. Bytes on the wire: the host's eth0 counters
(netem: each rank has its own namespace), None on loopback, where every rank shares ``lo``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from dgt.experiment.data import ShardSampler
from dgt.experiment.ddp_config import DDPSpec
from dgt.experiment.worker import PROGRESS, await_decision, publish_decision, worker_main
from dgt.experiment.workloads import Workload, build_workload

POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 10, "use_error_feedback": True,
            "warm_start": True}
# the dgt-hook-lowrank arm: torch's POWERSGD on DGT's transport (rank 1; min_ratio 2 is PowerSGDState's default
# min_compression_rate; error feedback and the warm start are the codec's defaults; the dense warm-up is
# start_powerSGD_iter)
LOWRANK_CODEC = "lowrank:rank=1,min_ratio=2"
LOWRANK2_CODEC = "lowrank:rank=2,min_ratio=2"  # dgt-hook-lowrank2, against torch's powersgd-rank2
WORKAROUNDS: list[str] = []  # what this process changed in torch to run its arm (hook_counters reports it)


def wire_bytes(ifname: str | None) -> dict[str, int] | None:
    """(tx, rx) bytes of ``ifname`` in this process's network namespace; None when there is no such interface."""
    if ifname is None:
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    v = rest.split()
                    return {"rx": int(v[0]), "tx": int(v[8])}
    except OSError:
        pass
    return None


# the DGT hook arms: the DGTState keywords of each (ddp_config.ARMS says what they are; dgt-hook-loss also feeds
# the loss, in the training loop)
_LOWRANK_STATE = {"codec": LOWRANK_CODEC, "warmup_iters": POWERSGD["start_powerSGD_iter"]}
HOOK_ARMS: dict[str, dict[str, Any]] = {
    "dgt-hook": {}, "dgt-hook-loss": {}, "dgt-hook-direct": {"collective": "direct"},
    "dgt-hook-auto": {"collective": "auto"}, "dgt-hook-ring": {"collective": "ring"},
    "dgt-hook-choose-lowrank": {"chooser": "lowrank"}, "dgt-hook-sparse": {"sparse": True},
    "dgt-hook-pwarm": {"p_warmup": 50}, "dgt-hook-nowarm": {"p_warmup": 0},
    "dgt-hook-lowrank": {**_LOWRANK_STATE, "collective": "auto"},
    "dgt-hook-lowrank-ring": {**_LOWRANK_STATE, "collective": "ring"},
    "dgt-hook-lowrank2": {**_LOWRANK_STATE, "codec": LOWRANK2_CODEC, "collective": "auto"},
    "dgt-hook-noskip": {}, "dgt-hook-nolowrank": {"chooser": True}, "dgt-hook-probe2": {}, "dgt-hook-noscreen": {},
    "dgt-hook-rank2": {}, "dgt-hook-fp32lr": {}, "dgt-hook-warm2": {"warmup_iters": 2},
}
# arms whose state's chooser runs its low-rank path with another codec than the default's CHOOSER_LOW_RANK
HOOK_LOWRANK: dict[str, str] = {"dgt-hook-rank2": LOWRANK2_CODEC, "dgt-hook-fp32lr": "lowrank:rank=4,min_ratio=2"}
# arms whose state gets the default's chooser (start=DEFAULT_WARMUP_ITERS, chooser.DEFAULT_MODES) with these settings
# changed, built
# when the arm is attached (importing dgt.shim here would load it into every arm's workers): dgt-hook-noskip never
# skips far losers in its re-probes, dgt-hook-probe2 times 2 iterations per path, dgt-hook-noscreen probes in full
HOOK_CHOOSERS: dict[str, dict[str, Any]] = {"dgt-hook-noskip": {"skip": math.inf}, "dgt-hook-probe2": {"probe": 2},
                                            "dgt-hook-noscreen": {"screen": math.inf}}
POWERSGD_ARMS = ("powersgd", "fp16-powersgd", "batched-powersgd", "powersgd-rank2")


def ddp_options(arm: str, model: Any) -> dict[str, Any]:
    """DDP's keyword arguments for ``arm``: none (torch's defaults) except for the PowerSGD arms, whose gradient is
    made one DDP bucket. torch's PowerSGD hooks issue their second and third all-reduce of a bucket from the
    completion callback of the one before, on Gloo's thread, while the backward pass issues the next bucket's first
    all-reduce on its own: with two buckets (DDP's default 1 MiB first bucket) the ranks can issue them in different
    orders, and Gloo aborts the process ("Received data size doesn't match expected size"; seen with the ResNet at
    its first compressed step). One bucket (``bucket_cap_mb`` above the gradient's size, which also lifts the small
    first bucket) leaves nothing to reorder. Recorded in ``WORKAROUNDS``."""
    if arm not in POWERSGD_ARMS:
        return {}
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    cap = max(25, int(mib) + 1)
    WORKAROUNDS.append(f"DDP(bucket_cap_mb={cap}): the gradient ({mib:.1f} MiB) is one bucket, so the PowerSGD "
                       "hook's chained all-reduces cannot be issued in different orders on different ranks")
    return {"bucket_cap_mb": cap}


def attach_arm(arm: str, ddp: Any) -> Any:
    """Register the arm's hook on ``ddp``; returns the hook's state (None: none)."""
    if arm in ("gloo", "dgt-backend"):
        return None
    if arm == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if arm in POWERSGD_ARMS:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        settings = {**POWERSGD, "matrix_approximation_rank": 2} if arm == "powersgd-rank2" else POWERSGD
        state = psgd.PowerSGDState(process_group=None, **settings)
        if arm == "batched-powersgd":
            runnable_batched_powersgd(psgd)
        hook = {"powersgd": psgd.powerSGD_hook, "powersgd-rank2": psgd.powerSGD_hook,
                "batched-powersgd": psgd.batched_powerSGD_hook,
                "fp16-powersgd": default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook)}[arm]
        ddp.register_comm_hook(state, hook)
        return state
    if arm in HOOK_ARMS:
        import dgt.shim
        from dgt.shim.chooser import DEFAULT_MODES, DropChooser
        from dgt.shim.state import DEFAULT_WARMUP_ITERS

        kwargs = dict(HOOK_ARMS[arm])
        if arm in HOOK_CHOOSERS:
            kwargs["chooser"] = DropChooser(**{"start": DEFAULT_WARMUP_ITERS, "modes": DEFAULT_MODES,
                                               **HOOK_CHOOSERS[arm]})
        state = dgt.shim.DGTState(**kwargs)
        if arm in HOOK_LOWRANK:
            from dgt.codecs.registry import make_codec

            state.lowrank_codec = make_codec(HOOK_LOWRANK[arm])
        ddp.register_comm_hook(state, dgt.shim.hook)
        return state
    raise ValueError(f"unknown arm {arm!r}")


def runnable_batched_powersgd(psgd: Any) -> None:
    """Make torch's ``batched_powerSGD_hook`` run where it cannot: its module's ``_orthogonalize`` takes a batch of
    matrices (3-D) and asserts so, but the batched hook hands it one 2-D matrix per bucket, so the hook raises
    AssertionError at its first compressed step (torch 2.13). Where that is so, ``_orthogonalize`` is wrapped to view
    a 2-D matrix as a batch of one (in place, as the hook expects); 3-D input goes through unchanged. Recorded in
    ``WORKAROUNDS``. Nothing changes on a torch whose ``_orthogonalize`` takes a 2-D matrix."""
    import torch

    original = psgd._orthogonalize
    try:
        original(torch.ones(2, 1))
        return
    except AssertionError:
        pass

    def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    psgd._orthogonalize = orthogonalize
    WORKAROUNDS.append("powerSGD_hook._orthogonalize wrapped to take the batched hook's 2-D matrices (torch "
                       f"{torch.__version__} asserts 3-D)")


def dgt_counters(arm: str, state: Any) -> dict[str, Any]:
    """What DGT itself counted: bytes per lane and dropped blocks (hook), or the backend's counters."""
    import torch.distributed as dist

    if arm.startswith("dgt-hook") and state is not None:
        t = state.totals
        return {"lanes": {str(k): int(v) for k, v in t["bytes_sent"].items()}, "dropped": int(t["dropped"]),
                "blocks": int(t["blocks"]), "codec_buckets": int(t["codec_buckets"]), "buckets": int(t["buckets"]),
                "lossy_buckets": int(t.get("lossy_buckets", 0)), "held_blocks": int(t.get("held_blocks", 0)),
                "paths": t.get("paths", {}), "p": state.codec.current_p(),
                "lowrank_rank": state.lowrank_codec.rank if state.lowrank_codec is not None else None,
                "lowrank_wire": state.lowrank_codec.wire if state.lowrank_codec is not None else None,
                "transport": _transport_summary(state.transport_stats()),
                "choice": state.chooser.summary() if getattr(state, "chooser", None) is not None else None}
    if arm == "dgt-backend":
        pg = dist.distributed_c10d._get_default_group()
        stats = getattr(pg, "stats", None)
        return {"dropped": int(stats["dropped"]), "backend": dict(stats)} if stats else {}
    return {}


def hook_counters(state: Any) -> dict[str, Any] | None:
    """What torch's PowerSGD state counted (the PowerSGD arms): its iteration count, the iteration compression
    starts at, and the elements of every compressed step's buckets before and after compression (both 0 when no step
    was compressed). None for the other arms."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if not isinstance(state, PowerSGDState):
        return None
    return {"iter": int(state.iter), "start_powerSGD_iter": int(state.start_powerSGD_iter),
            "numel_before_compression": int(state.total_numel_before_compression),
            "numel_after_compression": int(state.total_numel_after_compression), "workarounds": list(WORKAROUNDS)}


def _transport_summary(st: dict[str, Any] | None) -> dict[str, Any] | None:
    """The endpoint counters that explain a step's time: deadline waits, how rounds closed, bytes per lane."""
    if st is None:
        return None
    keep = ("rounds_sent", "rounds_received", "blocks_received", "blocks_dropped", "closed_by",
            "deadline_wait_total", "deadline_wait_max", "receive_seconds", "late_frames")
    out = {k: st[k] for k in keep if k in st}
    out["lanes"] = {ls["name"]: {"tx_bytes": ls["tx_bytes"], "rx_bytes": ls["rx_bytes"],
                                 "tx_unsent_blocks": ls.get("tx_unsent_blocks", 0)} for ls in st["lanes"]}
    return out


def train(spec: DDPSpec, rank: int, world: int, emit: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if spec.arm == "dgt-backend":
        import dgt.shim  # noqa: F401 - registers backend "dgt"
    if spec.wire_if:  # netem: Gloo would pick the address the host name resolves to (loopback); use the host's link
        os.environ.setdefault("GLOO_SOCKET_IFNAME", spec.wire_if)
    dist.init_process_group("dgt" if spec.arm == "dgt-backend" else "gloo", init_method="env://")
    store = dist.distributed_c10d._get_default_store()
    wl = build_workload(spec.model, spec.dataset, spec.data_dir, spec.seed, spec.width, spec.lr, spec.momentum)
    data, model = wl.data, wl.model  # the family's model, data, optimizer, loss and metric (workloads.py)
    ddp = DDP(model, **ddp_options(spec.arm, model))
    state = attach_arm(spec.arm, ddp)
    opt = wl.make_optimizer(ddp.parameters())
    sampler = ShardSampler(len(data.y_train), rank, world, spec.batch, spec.seed)
    wire0 = wire_bytes(spec.wire_if)
    steps: list[float] = []
    evals: list[dict[str, Any]] = []
    train_time = 0.0
    stop_reason = "max_iters"
    t_start = time.perf_counter()
    for it in range(1, spec.max_iters + 1):
        t0 = time.perf_counter()
        idx = sampler.next()
        loss = wl.loss(ddp(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if spec.arm == "dgt-hook-loss":
            state.observe_loss(loss)
        dt = time.perf_counter() - t0
        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"rank {rank}: training loss is {loss_v} at iteration {it}")
        steps.append(dt)
        train_time += dt
        decision = None
        if it % spec.eval_every == 0 or it == spec.max_iters:
            decision = _decide(rank, it, spec, wl, train_time)
            wire = wire_bytes(spec.wire_if)
            evals.append({"it": it, "train_time": train_time, wl.metric: decision["value"],
                          "wire": _delta(wire, wire0)})
        if emit:
            out = {"it": it, "bct": dt, "loss": loss_v, "train_time": train_time}
            if decision is not None:
                out[wl.metric] = decision["value"]
            print(PROGRESS + json.dumps(out), flush=True)
        if decision is not None and decision["stop"]:
            stop_reason = decision["reason"]
            break
    counters = dgt_counters(spec.arm, state)
    hook = hook_counters(state)
    _leave(store, rank, world)
    if state is not None and hasattr(state, "close"):
        state.close()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "arm": spec.arm, "steps": steps, "evals": evals, "train_time": train_time,
            "wall_time": time.perf_counter() - t_start, "stop_reason": stop_reason, "dgt": counters, "hook": hook,
            "wire": _delta(wire_bytes(spec.wire_if), wire0)}


def _delta(now: dict[str, int] | None, then: dict[str, int] | None) -> dict[str, int] | None:
    return None if now is None or then is None else {k: now[k] - then[k] for k in now}


def _decide(rank: int, it: int, spec: DDPSpec, wl: Workload, train_time: float) -> dict[str, Any]:
    """Rank 0 evaluates (test accuracy, or gpt's validation loss) and publishes {value, stop, reason}; the others
    wait for it (``worker.publish_decision``: a file, not the store, whose answer reaches them late)."""
    if rank == 0:
        value = wl.evaluate()
        reason = ("target" if wl.reached(value, spec.target) else "max_iters" if it >= spec.max_iters
                  else "max_time" if train_time >= spec.max_time else None)
        decision = {"value": value, "stop": reason is not None, "reason": reason}
        publish_decision(spec.out_dir, it, decision)
        return decision
    return await_decision(spec.out_dir, it)


def _leave(store: Any, rank: int, world: int, timeout: float = 30.0) -> None:
    """Every rank has read its counters before anyone tears the group down; rank 0 hosts the store, so it goes last,
    after every other rank said it no longer needs the store."""
    store.add("dgtddp/left", 1)
    end = time.monotonic() + timeout
    while store.add("dgtddp/left", 0) < world and time.monotonic() < end:
        time.sleep(0.01)
    if rank != 0:
        store.add("dgtddp/gone", 1)
        return
    while store.add("dgtddp/gone", 0) < world - 1 and time.monotonic() < end:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "dgt.experiment.ddp_worker", DDPSpec.from_json,
                       lambda spec, rank, world: train(spec, rank, world, rank == 0))


if __name__ == "__main__":
    sys.exit(main())
