"""What an experiment is: the training setup, the network, the two protocols, the stopping rule.

One :class:`ExperimentConfig` describes a whole Table 1 reproduction; :meth:`ExperimentConfig.run_spec` derives the
:class:`RunSpec` one protocol's run hands to its worker processes (as JSON), so the baseline and DGT runs differ in
the codec and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

PROTOCOLS: dict[str, str] = {
    # the paper's baseline: every gradient over the reliable lane (TCP), as MXNet/TensorFlow do
    "baseline": "dense",
    # the paper's setting: n = 1024, alpha = 0.3, p = p0 * loss_t / loss_0 with p0 = 1
    "dgt": "dgt:p=loss,p0=1,alpha=0.3,block=1024",
}


@dataclass
class NetworkConfig:
    """The emulated network every run shares.

    mode: ``netem`` (root: one namespace per worker on a switch, every host link shaped to ``rate`` with HTB and DSCP
        priority classes EF > AF > BE > LE), ``loopback`` (no root: every socket paced to ``rate``, no shared queue,
        no priorities), or ``auto`` (netem when this process can build namespaces).
    rate: link rate (tc units: '40mbit'); the server's link is the bottleneck of a parameter server.
    queue_limit: packets per priority class queue.
    cross_traffic: rate of a flow from an extra host into the server's (host 0's) link through each whole run
        (None: none); its goodput during the training iterations is reported per run.
    priority: DSCP priority classes on every link (False: one FIFO queue per link, DSCP bleached, as on most cloud
        networks).
    loss: random loss per link direction, a fraction (netem only).
    delay: one-way delay per link direction (netem only; needs the kernel's delay line).
    cross_proto: ``udp`` or ``tcp`` for the cross traffic; cross_dscp: its DSCP (0: best effort).
    """

    mode: str = "auto"
    rate: str = "40mbit"
    queue_limit: int = 200
    cross_traffic: str | None = None
    cross_dscp: int = 0
    prefix: str = "dgtx"
    priority: bool = True
    loss: float = 0.0
    delay: str | None = None
    cross_proto: str = "udp"


@dataclass
class ExperimentConfig:
    """Everything about one Table 1 reproduction (both protocols, one or more models)."""

    models: list[str] = field(default_factory=lambda: ["alexnet", "vgg11"])
    protocols: list[str] = field(default_factory=lambda: ["baseline", "dgt"])
    dataset: str = "digits"
    data_dir: str | None = None
    limit_train: int | None = None
    limit_test: int | None = 2000
    width: int = 1
    workers: int = 4
    batch: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    target: float = 0.97
    eval_every: int = 2
    max_iters: int = 500
    max_time: float = 400.0  # seconds of training (evaluation excluded) per run
    server: str = "0"  # parameter server rank, or "sharded"
    lossy_pull: bool = True
    deadline: str = "fixed:0.002"
    gso: bool = False
    peer_timeout: float = 30.0
    round_timeout: float = 60.0  # one all-reduce taking longer than this fails the run (a hang, not slowness)
    loss_smoothing: float = 0.0
    congestion_control: bool = True  # TransportConfig.congestion.enabled: LEDBAT-like UDP rate and send budget
    codecs: dict[str, str] = field(default_factory=lambda: dict(PROTOCOLS))
    network: NetworkConfig = field(default_factory=NetworkConfig)
    out_dir: str = "dgt-results"
    plots: bool = True

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError(f"workers: need at least 2 (a parameter server and a worker), got {self.workers}")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target: a test accuracy in (0, 1], got {self.target:g}")
        if self.eval_every < 1 or self.max_iters < 1 or self.max_time <= 0 or self.batch < 1 or self.width < 1:
            raise ValueError(f"eval_every ({self.eval_every}), max_iters ({self.max_iters}), max_time "
                             f"({self.max_time:g}), batch ({self.batch}) and width ({self.width}) must be positive")
        unknown = [p for p in self.protocols if p not in self.codecs]
        if unknown:
            raise ValueError(f"unknown protocols {unknown}; known: {sorted(self.codecs)}")
        if self.server != "sharded" and not (self.server.isdigit() and int(self.server) < self.workers):
            raise ValueError(f"server: a worker rank (0 to {self.workers - 1}) or 'sharded', got {self.server!r}")
        if self.network.mode not in ("auto", "netem", "loopback"):
            raise ValueError("network mode must be auto, netem or loopback")
        if self.network.cross_proto not in ("udp", "tcp"):
            raise ValueError("cross traffic protocol must be udp or tcp")
        self._check_values()

    def _check_values(self) -> None:
        """What a run would only find out in its worker processes: the optimizer's, the data split's, the queues'
        and the codecs' own checks, made here so a bad value is one clear error before anything starts."""
        from dgt.codecs import make_codec
        from dgt.protocol.deadline import make_deadline

        if not self.lr > 0.0 or not 0.0 <= self.momentum < 1.0 or self.seed < 0:
            raise ValueError(f"lr must be positive, momentum in [0, 1) and seed non-negative: lr {self.lr:g}, "
                             f"momentum {self.momentum:g}, seed {self.seed}")
        if self.network.queue_limit < 1 or not 0 <= self.network.cross_dscp <= 63:
            raise ValueError(f"queue_limit must be at least 1 packet and cross_dscp in 0..63: queue_limit "
                             f"{self.network.queue_limit}, cross_dscp {self.network.cross_dscp}")
        make_deadline(self.deadline)  # ValueError naming the policies
        for protocol in self.protocols:
            try:
                make_codec(self.codecs[protocol])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{protocol} codec {self.codecs[protocol]!r}: {exc}") from None

    @classmethod
    def demo(cls, **overrides: Any) -> ExperimentConfig:
        """`dgt demo`: AlexNet on digits, 4 workers, both protocols, under 5 minutes on 2 cores."""
        base = cls(models=["alexnet"], max_iters=300, max_time=150.0, out_dir="dgt-demo")
        return replace(base, **overrides)

    def run_spec(self, model: str, protocol: str, out_dir: str) -> RunSpec:
        return RunSpec(
            model=model, protocol=protocol, codec=self.codecs[protocol], dataset=self.dataset, data_dir=self.data_dir,
            limit_train=self.limit_train, limit_test=self.limit_test, width=self.width, workers=self.workers,
            batch=self.batch, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, seed=self.seed,
            target=self.target, eval_every=self.eval_every, max_iters=self.max_iters, max_time=self.max_time,
            server=self.server, lossy_pull=self.lossy_pull, deadline=self.deadline, gso=self.gso,
            peer_timeout=self.peer_timeout, round_timeout=self.round_timeout, loss_smoothing=self.loss_smoothing,
            out_dir=out_dir, congestion_control=self.congestion_control,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunSpec:
    """What every worker process of one run gets (written as JSON next to the run's outputs)."""

    model: str
    protocol: str
    codec: str
    dataset: str
    data_dir: str | None
    limit_train: int | None
    limit_test: int | None
    width: int
    workers: int
    batch: int
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    target: float
    eval_every: int
    max_iters: int
    max_time: float
    server: str
    lossy_pull: bool
    deadline: str
    gso: bool
    peer_timeout: float
    round_timeout: float
    loss_smoothing: float
    out_dir: str
    pace_rate: float | None = None  # bytes/s on every socket (loopback mode)
    congestion_control: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
