"""What `dgt experiment ddp` is: the arms (what a user's DDP trainer can switch on), the network profiles, the
training setup, and the spec one arm's worker processes get (as JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dgt.experiment.config import NetworkConfig

# arm -> what it is (the report prints this)
ARMS: dict[str, str] = {
    "gloo": "torch DDP on Gloo, no hook (the reference)",
    "fp16": "Gloo + torch's default_hooks.fp16_compress_hook",
    "powersgd": "Gloo + torch's powerSGD_hook, PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=10, "
                "use_error_feedback=True, warm_start=True) (PyTorch's recommended settings, rank 1); the four "
                "PowerSGD arms put the gradient in one DDP bucket (their chained all-reduces need it on Gloo: "
                "ddp_worker.ddp_options)",
    "fp16-powersgd": "Gloo + torch's default_hooks.fp16_compress_wrapper(powerSGD_hook), the same PowerSGDState as "
                     "powersgd (the P and Q factors travel as float16; torch's own example of the wrapper)",
    "batched-powersgd": "Gloo + torch's batched_powerSGD_hook, the same PowerSGDState as powersgd (each bucket as one "
                        "square matrix, rank 1: fewer, larger all-reduces than powersgd's per-layer matrices; where "
                        "torch's _orthogonalize rejects the hook's 2-D matrices, as in torch 2.13, it is wrapped to "
                        "take them, see ddp_worker.runnable_batched_powersgd)",
    "powersgd-rank2": "powersgd with matrix_approximation_rank=2 (what a user tries when rank 1 costs too many steps)",
    "dgt-hook": "Gloo + register_comm_hook(dgt.shim.DGTState(), dgt.shim.hook), no options (the README line: its "
                "chooser times lossless and lossy DGT, ring and direct, and the rank-4 low-rank path, and keeps the "
                "fastest, low rank weighed by a 1.5x steps prior)",
    "dgt-backend": "init_process_group(backend=\"dgt\"), no options",
    "dgt-hook-direct": "Gloo + register_comm_hook(dgt.shim.DGTState(collective=\"direct\"), dgt.shim.hook): the direct "
                       "all-reduce (two rounds whatever the world size) instead of the ring",
    "dgt-hook-auto": "Gloo + register_comm_hook(dgt.shim.DGTState(collective=\"auto\"), dgt.shim.hook): the chooser "
                     "probes ring and direct, lossless and lossy, and keeps the fastest",
    "dgt-hook-ring": "Gloo + register_comm_hook(dgt.shim.DGTState(collective=\"ring\"), dgt.shim.hook): the ring only "
                     "(the default before collective=\"auto\"), lossless or lossy as the chooser finds",
    "dgt-hook-loss": "dgt-hook + state.observe_loss(loss) every step (docs/shim.md's optional second line, which "
                     "feeds DGT's p = p0 * loss_t / loss_0; without it p stays at the default's idle_p = 0.1)",
    "dgt-hook-lowrank": "Gloo + register_comm_hook(dgt.shim.DGTState(codec=\"lowrank:rank=1,min_ratio=2\", "
                        "warmup_iters=10), dgt.shim.hook): powersgd's algorithm (rank-1 P/Q factors, error feedback, "
                        "warm start, 10 dense iterations first, matrices compressed only where it is 2x or better) "
                        "on DGT's transport, DDP's default buckets; P and Q summed by the direct all-reduce "
                        "(collective=\"auto\")",
    "dgt-hook-lowrank-ring": "dgt-hook-lowrank with collective=\"ring\": the P and Q factors summed by the ring "
                             "(2(n-1) transfers in series) instead of the direct all-reduce",
    "dgt-hook-lowrank2": "dgt-hook-lowrank at rank 2 (codec=\"lowrank:rank=2,min_ratio=2\"), against powersgd-rank2",
    "dgt-hook-sparse": "Gloo + register_comm_hook(dgt.shim.DGTState(sparse=True), dgt.shim.hook): the default hook "
                       "whose ring holds each owner's own contribution back where nothing arrived, so its update and "
                       "all-gather carry only the blocks that arrived",
    "dgt-hook-choose-lowrank": "Gloo + register_comm_hook(dgt.shim.DGTState(chooser=\"lowrank\"), dgt.shim.hook): "
                               "the default spelt out: the chooser also probes the low-rank path (rank-4 P/Q factors "
                               "on the direct all-reduce), its seconds weighed by a 1.5x steps prior",
    "dgt-hook-nolowrank": "Gloo + register_comm_hook(dgt.shim.DGTState(chooser=True), dgt.shim.hook): the default "
                          "hook whose chooser times DGT's paths only, lossless and lossy, ring and direct (the "
                          "default before the low-rank path joined it)",
    "dgt-hook-pwarm": "Gloo + register_comm_hook(dgt.shim.DGTState(p_warmup=50), dgt.shim.hook): the default hook "
                      "whose p falls from 1 to 0.1 over the 50 iterations after the dense warm-up (p ** (t / 50); "
                      "Deep Gradient Compression's sparsity warm-up; the default's p_warmup=\"auto\" spelt out)",
    "dgt-hook-noskip": "Gloo + register_comm_hook(dgt.shim.DGTState(chooser=DropChooser(start=1, skip=math.inf, "
                       "modes=(\"lowrank\", \"lossy\", \"lossless\"))), dgt.shim.hook): the default hook whose "
                       "chooser re-probes every other path after each hold, also those that lost by more than 2x",
    "dgt-hook-probe2": "Gloo + register_comm_hook(dgt.shim.DGTState(chooser=DropChooser(start=1, probe=2, modes=("
                       "\"lowrank\", \"lossy\", \"lossless\"))), dgt.shim.hook): the default hook whose chooser "
                       "times 2 iterations per path instead of 3 (a shorter probe window: 15 iterations on 3+ ranks "
                       "instead of 20)",
    "dgt-hook-noscreen": "Gloo + register_comm_hook(dgt.shim.DGTState(chooser=DropChooser(start=1, "
                         "screen=math.inf, modes=(\"lowrank\", \"lossy\", \"lossless\"))), dgt.shim.hook): the "
                         "default hook whose chooser probes every path in full (3 + 1 iterations each: 20 on 3+ "
                         "ranks) instead of cutting the probes of paths over 2x the best figure after one iteration "
                         "(the default before 2026-12-07's screening)",
    "dgt-hook-rank2": "Gloo + register_comm_hook(dgt.shim.DGTState(), dgt.shim.hook) with state.lowrank_codec = "
                      "make_codec(\"lowrank:rank=2,min_ratio=2\"): the default hook whose chooser's low-rank path "
                      "runs at rank 2 (the default before 2026-12-07, evening) instead of 4",
    "dgt-hook-fp32lr": "Gloo + register_comm_hook(dgt.shim.DGTState(), dgt.shim.hook) with state.lowrank_codec = "
                       "make_codec(\"lowrank:rank=4,min_ratio=2\"): the default hook whose chooser's low-rank path "
                       "sends its P and Q factors in float32 (the default before 2026-12-07's second session) instead "
                       "of bfloat16",
    "dgt-hook-warm2": "Gloo + register_comm_hook(dgt.shim.DGTState(warmup_iters=2), dgt.shim.hook): the default "
                      "hook with two dense lossless iterations before the chooser's first window (the default before "
                      "2026-12-07's second session) instead of DDP's first iteration alone",
    "dgt-hook-nowarm": "Gloo + register_comm_hook(dgt.shim.DGTState(p_warmup=0), dgt.shim.hook): the default hook "
                       "without the warm-up of p (the default before it)",
}

# profile -> (what it is, how its network differs from the `priority` one)
PROFILES: dict[str, str] = {
    "priority": "every host link shaped, DSCP priority classes honoured (EF > AF > BE > LE)",
    "fifo": "every host link shaped, one FIFO queue per link, DSCP bleached (most cloud networks)",
    "cross": "fifo + TCP cross traffic at half the link rate from an extra host into host 0's link",
    "lossy": "fifo + 1 % random loss per link direction",
    "wan": "fifo + 20 ms delay and 0.5 % loss per link direction (needs a delay line)",
}


def rate_half(rate: str) -> str:
    """Half of a tc rate, as bit/s."""
    from dgt.netem.spec import parse_rate

    bps = parse_rate(rate)
    if bps is None:
        raise ValueError(f"bad rate {rate!r}")
    return f"{int(bps // 2)}bit"


def profile_network(profile: str, base: NetworkConfig) -> NetworkConfig:
    """The network of ``profile``, starting from ``base`` (mode, rate, queue limit, prefix)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    common = dict(cross_traffic=None, loss=0.0, delay=None)
    if profile == "priority":
        return replace(base, priority=True, **common)
    net = replace(base, priority=False, **common)
    if profile == "cross":
        return replace(net, cross_traffic=rate_half(base.rate), cross_proto="tcp", cross_dscp=0)
    if profile == "lossy":
        return replace(net, loss=0.01)
    if profile == "wan":
        return replace(net, delay="20ms", loss=0.005)
    return net


@dataclass
class DDPConfig:
    """One `dgt experiment ddp` run: every arm, one profile."""

    arms: list[str] = field(default_factory=lambda: list(ARMS))
    profile: str = "priority"
    model: str = "alexnet"
    dataset: str = "digits"
    data_dir: str | None = None
    width: int = 1
    workers: int = 4
    # None: the model family's default (dgt/experiment/workloads.py; alexnet: 32, 0.1, 0, 0.97, 2)
    batch: int | None = None
    lr: float | None = None
    momentum: float | None = None
    seed: int = 0
    seeds: list[int] = field(default_factory=list)  # every arm once per seed; empty: the one run of `seed`
    target: float | None = None  # test accuracy, or gpt's validation loss
    eval_every: int | None = None
    max_iters: int = 300
    max_time: float | None = None  # training seconds (evaluation excluded) per arm; None: the family's (150 s alexnet)
    network: NetworkConfig = field(default_factory=lambda: NetworkConfig(prefix="dgtd"))
    out_dir: str = "dgt-ddp"
    plots: bool = True

    def __post_init__(self) -> None:
        from dgt.experiment.workloads import MODELS, defaults

        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        d = defaults(self.model)
        for name in ("batch", "lr", "momentum", "target", "eval_every", "max_time"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(d, name))
        if self.workers < 2:
            raise ValueError("need at least 2 workers")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if d.metric == "acc" and not 0.0 < self.target <= 1.0:
            raise ValueError("target accuracy must be in (0, 1]")
        if d.metric == "val_loss" and not self.target > 0.0:
            raise ValueError("target validation loss must be positive")
        if self.eval_every < 1 or self.max_iters < 1 or self.max_time <= 0:
            raise ValueError("eval_every, max_iters and max_time must be positive")
        if self.batch < 1 or not self.lr > 0.0 or not self.momentum >= 0.0:
            raise ValueError(f"batch must be at least 1, lr positive and momentum non-negative: batch {self.batch}, "
                             f"lr {self.lr}, momentum {self.momentum}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative: {self.seed}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds repeat: {self.seeds}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be non-negative integers: {self.seeds}")

    def seed_list(self) -> list[int]:
        """The seeds every arm runs with, in order: ``seeds``, or ``[seed]`` when none were given."""
        return list(self.seeds) if self.seeds else [self.seed]

    def spec(self, arm: str, out_dir: str, wire_if: str | None = None, seed: int | None = None) -> DDPSpec:
        return DDPSpec(arm=arm, model=self.model, dataset=self.dataset, data_dir=self.data_dir, width=self.width,
                       workers=self.workers, batch=self.batch, lr=self.lr, momentum=self.momentum,
                       seed=self.seed if seed is None else seed,
                       target=self.target, eval_every=self.eval_every, max_iters=self.max_iters,
                       max_time=self.max_time, out_dir=out_dir, wire_if=wire_if)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DDPSpec:
    """What every worker process of one arm gets."""

    arm: str
    model: str
    dataset: str
    data_dir: str | None
    width: int
    workers: int
    batch: int
    lr: float
    momentum: float
    seed: int
    target: float
    eval_every: int
    max_iters: int
    max_time: float
    out_dir: str
    wire_if: str | None = None  # the interface whose counters are this rank's own (netem: eth0; loopback: none)
    pace_rate: float | None = None  # set by launch(); the DDP worker does not pace (Gloo's sockets are torch's)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> DDPSpec:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
