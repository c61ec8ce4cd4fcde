"""In-process simulation of K ranks for the payload codecs (tests and experiments; no transport, no processes).

Three loops, each calling the codecs exactly as a collective will (encode -> Received built from the parts, with
droppable blocks optionally lost -> decode / aggregate / merge):

- :func:`train_ps`: parameter server (Plump-DP, Slim-DP push + pull, Quant-DP = QSGD push + dense pull).
- :func:`train_gossip`: decentralized ring with a mixing matrix (D-PSGD, DCD, ECD, naive compression).
- :func:`train_model_averaging`: local epochs then model averaging of encoded parameters (Oland-Raj).

The problem: scikit-learn's digits (1797 8x8 images, 10 classes; :func:`dgt.harness.digits.digits`), a fixed
stratified 70/30 split, the training part
sharded iid over the ranks, and a small MLP whose parameters live in one flat vector (forward by views of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dgt.codecs.base import BucketState, Codec, Part, Received
from dgt.codecs.bucketinfo import received_from_parts, set_segments, wire_bytes
from dgt.codecs.registry import make_codec
from dgt.harness.digits import Data, digits
from dgt.layout import BucketLayout

# ---------------------------------------------------------------------------------------------------------------
# data and model
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MLP:
    """A fully connected net over a flat parameter vector: sizes [in, hidden..., out]."""

    sizes: tuple[int, ...] = (64, 64, 10)
    act: str = "relu"
    shapes: list[tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self.shapes = []
        for a, b in zip(self.sizes[:-1], self.sizes[1:]):
            self.shapes += [(b, a), (b,)]

    @property
    def segments(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.segments)

    def init(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        parts = []
        for s in self.shapes:
            if len(s) == 2:
                bound = 1.0 / math.sqrt(s[1])
                parts.append((torch.rand(s, generator=g) * 2 - 1).mul_(bound).reshape(-1))
            else:
                parts.append(torch.zeros(s).reshape(-1))
        return torch.cat(parts)

    def forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        off = 0
        h = x
        nl = len(self.shapes) // 2
        for layer in range(nl):
            ws, bs = self.shapes[2 * layer], self.shapes[2 * layer + 1]
            w = flat[off : off + math.prod(ws)].view(ws)
            off += math.prod(ws)
            b = flat[off : off + bs[0]]
            off += bs[0]
            h = F.linear(h, w, b)
            if layer < nl - 1:
                h = torch.relu(h) if self.act == "relu" else torch.tanh(h)
        return h

    def loss_grad(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, l1: float = 0.0) -> torch.Tensor:
        p = flat.detach().requires_grad_(True)
        loss = F.cross_entropy(self.forward(p, x), y)
        (g,) = torch.autograd.grad(loss, p)
        if l1:
            g = g + l1 * torch.sign(p.detach())
        return g

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor, data: Data) -> dict[str, float]:
        out_te = self.forward(flat, data.x_test)
        out_tr = self.forward(flat, data.x_train)
        return {
            "accuracy": float((out_te.argmax(1) == data.y_test).float().mean()) * 100.0,
            "train_loss": float(F.cross_entropy(out_tr, data.y_train)),
            "test_loss": float(F.cross_entropy(out_te, data.y_test)),
        }


class Shards:
    """The training set split iid over K ranks; each rank samples mini-batches with its own generator."""

    def __init__(self, data: Data, k: int, seed: int, iid: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(data.x_train.shape[0], generator=g)
        if iid:
            self.parts = [perm[i::k] for i in range(k)]
        else:  # label-sorted contiguous shards: each rank sees only a few classes
            order = perm[torch.argsort(data.y_train[perm], stable=True)]
            self.parts = list(torch.chunk(order, k))
        self.data = data
        self.gens = [torch.Generator().manual_seed(seed * 1000 + 17 + i) for i in range(k)]

    def batch(self, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.parts[rank]
        pick = idx[torch.randint(idx.numel(), (size,), generator=self.gens[rank])]
        return self.data.x_train[pick], self.data.y_train[pick]

    def epoch(self, rank: int, size: int):
        idx = self.parts[rank]
        perm = idx[torch.randperm(idx.numel(), generator=self.gens[rank])]
        for s in range(0, perm.numel(), size):
            pick = perm[s : s + size]
            yield self.data.x_train[pick], self.data.y_train[pick]


# ---------------------------------------------------------------------------------------------------------------
# the wire
# ---------------------------------------------------------------------------------------------------------------


class Wire:
    """Delivers parts: reliable parts always arrive; blocks of droppable parts (lane_class >= 1) are lost iid with
    probability ``drop`` (zero-filled, as the transport does). Counts the bytes it carries."""

    def __init__(self, drop: float = 0.0, seed: int = 0) -> None:
        self.drop = float(drop)
        self.gen = torch.Generator().manual_seed(seed)
        self.bytes = 0
        self.blocks_lost = 0

    def send(self, parts: list[Part]) -> list[Received]:
        self.bytes += wire_bytes(parts)
        if self.drop <= 0:
            return received_from_parts(parts)
        masks = []
        for p in parts:
            droppable = isinstance(p.lane_class, torch.Tensor) or p.lane_class >= 1
            if not droppable:
                masks.append(None)
                continue
            nb = p.layout.nblocks
            m = torch.rand(nb, generator=self.gen) >= self.drop
            self.blocks_lost += int((~m).sum())
            masks.append(m)
        return received_from_parts(parts, masks)


def _make(spec: str | Codec, **extra: object) -> Codec:
    """A codec from a spec, with extra options (rank, mode) appended unless the spec sets them."""
    if isinstance(spec, Codec):
        return spec
    name, _, opts = spec.partition(":")
    given = {kv.split("=")[0].strip() for kv in opts.split(",") if kv}
    add = [f"{k}={v}" for k, v in extra.items() if k not in given]
    joined = ",".join(filter(None, [opts, *add]))
    return make_codec(f"{name}:{joined}" if joined else name)


# ---------------------------------------------------------------------------------------------------------------
# parameter server
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _PSCodecs:
    """The codecs and per-rank states of :func:`train_ps` (None: dense, no codec)."""

    push_tx: list[Codec]
    push_rx: Codec | None
    push_tx_state: list[BucketState]
    push_rx_state: list[BucketState]  # one receive state per sender
    pull_tx: Codec | None
    pull_tx_state: BucketState
    pull_rx_state: list[BucketState]

    @classmethod
    def make(cls, push: str | None, pull: str | None, k: int, seed: int, w: torch.Tensor, model: MLP) -> _PSCodecs:
        if pull and pull.partition(":")[0].strip() != "slimdp":
            raise ValueError("a compressed pull needs a codec with merge semantics (slimdp)")
        fresh = lambda: BucketState(w.numel(), w.dtype)  # noqa: E731
        c = cls(
            push_tx=[_make(push, rank=r, seed=seed) for r in range(k)] if push else [],
            push_rx=_make(push, seed=seed) if push else None,
            push_tx_state=[fresh() for _ in range(k)],
            push_rx_state=[fresh() for _ in range(k)],
            pull_tx=_make(pull, mode="pull", rank=k, seed=seed) if pull else None,
            pull_tx_state=fresh(),
            pull_rx_state=[fresh() for _ in range(k)],
        )
        for st in (*c.push_tx_state, *c.push_rx_state, c.pull_tx_state, *c.pull_rx_state):
            set_segments(st, model.segments)
        return c


def _local_step(model: MLP, local: list[torch.Tensor], r: int, batch: tuple[torch.Tensor, torch.Tensor], lr: float,
                pending: list[torch.Tensor | None], every: int, t: int) -> torch.Tensor | None:
    """Worker ``r``'s SGD step on its replica; the gradient to push, or None on a step without communication (with
    ``every`` > 1 the gradients of the steps in between are summed)."""
    xb, yb = batch
    g = model.loss_grad(local[r], xb, yb)
    local[r] -= lr * g
    if every > 1:
        pending[r] = g.clone() if pending[r] is None else pending[r].add_(g)
        if (t + 1) % every:
            return None
        g, pending[r] = pending[r], None
    return g


def train_ps(
    push: str | None = None,
    pull: str | None = None,
    *,
    k: int = 4,
    rounds: int = 400,
    lr: float = 0.05,
    batch: int = 32,
    seed: int = 0,
    drop: float = 0.0,
    model: MLP | None = None,
    eval_every: int = 0,
    iid: bool = True,
    every: int = 1,
) -> dict:
    """Synchronous PS training: each round every worker takes one local SGD step on its mini-batch, pushes its
    gradient (dense when ``push`` is None), the server applies ``w <- w - lr * sum_k decoded_k`` and every worker
    pulls (dense copy of w when ``pull`` is None; otherwise the server encodes w once and each worker merges).

    ``every=p`` (Slim-DP's communication frequency): the push/pull happens after every p-th local step only, with
    the gradients of those p steps summed (the accumulated update delta_k); ``rounds`` counts local steps, so the
    bytes per round are per mini-batch (``ModelServer(every=p)`` does the same over the transport)."""
    if int(every) != every or every < 1:
        raise ValueError("every must be an integer >= 1")
    pending: list[torch.Tensor | None] = [None] * k
    model = model or MLP()
    data = digits()
    shards = Shards(data, k, seed, iid)
    w = model.init(seed)
    local = [w.clone() for _ in range(k)]
    wire_up, wire_down = Wire(drop, seed + 1), Wire(drop, seed + 2)
    c = _PSCodecs.make(push, pull, k, seed, w, model)
    push_rx = c.push_rx
    history = []
    for t in range(rounds):
        decoded = []
        for r in range(k):
            g = _local_step(model, local, r, shards.batch(r, batch), lr, pending, every, t)
            if g is None:
                continue
            if push_rx is None:
                wire_up.bytes += g.numel() * g.element_size()
                decoded.append(g)
            else:
                parts = c.push_tx[r].encode(g, c.push_tx_state[r])
                decoded.append(push_rx.decode(wire_up.send(parts), c.push_rx_state[r], g))
        if not decoded:  # a local step without communication (every > 1)
            if eval_every and (t + 1) % eval_every == 0:
                history.append({"round": t + 1, **model.evaluate(w, data)})
            continue
        agg = push_rx.aggregate(decoded) if push_rx is not None else torch.stack(decoded).sum(0)
        w -= lr * agg
        local = _pull(c, w, local, wire_down)
        if eval_every and (t + 1) % eval_every == 0:
            history.append({"round": t + 1, **model.evaluate(w, data)})
    return _ps_result(model.evaluate(w, data), rounds, k, w, wire_up, wire_down, history, local)


def _pull(c: _PSCodecs, w: torch.Tensor, local: list[torch.Tensor], wire_down: Wire) -> list[torch.Tensor]:
    """Every worker's model after the pull: a dense copy of ``w``, or the pull codec's parts merged."""
    if c.pull_tx is None:
        wire_down.bytes += len(local) * w.numel() * w.element_size()
        return [w.clone() for _ in local]
    parts = c.pull_tx.encode(w, c.pull_tx_state)
    return [c.pull_tx.merge(wire_down.send(parts), c.pull_rx_state[r], m) for r, m in enumerate(local)]


def _ps_result(res: dict, rounds: int, k: int, w: torch.Tensor, wire_up: Wire, wire_down: Wire, history: list,
               local: list[torch.Tensor]) -> dict:
    n = w.numel()
    res.update(
        rounds=rounds,
        numel=n,
        push_bytes_per_round_per_worker=wire_up.bytes / (rounds * k),
        pull_bytes_per_round_per_worker=wire_down.bytes / (rounds * k),
        push_ratio=4.0 * n / (wire_up.bytes / (rounds * k)),
        blocks_lost=wire_up.blocks_lost + wire_down.blocks_lost,
        history=history,
        final_params=w,
        local_models=local,
    )
    return res


# ---------------------------------------------------------------------------------------------------------------
# gossip
# ---------------------------------------------------------------------------------------------------------------


def train_gossip(
    spec: str,
    *,
    k: int = 4,
    rounds: int = 400,
    lr: float = 0.1,
    batch: int = 32,
    seed: int = 0,
    model: MLP | None = None,
    mixing: torch.Tensor | None = None,
    eval_every: int = 0,
) -> dict:
    """Decentralized SGD on a ring (W = 1/3 by default) with the algorithm the codec names (dcd / ecd /
    naive-gossip; ``dcd:bits=32`` is full-precision D-PSGD). Evaluates the average of the local models."""
    from dgt.codecs.decentralized import mixing_row, ring_matrix

    model = model or MLP()
    data = digits()
    shards = Shards(data, k, seed)
    x0 = model.init(seed)
    w = mixing if mixing is not None else ring_matrix(k)
    proto = _make(spec, seed=seed)
    nodes = [proto.make_node(r, x0, mixing_row(w, r), lr) for r in range(k)]
    wire = Wire(0.0, seed)
    history = []
    for t in range(rounds):
        payloads = []
        for r, node in enumerate(nodes):
            xb, yb = shards.batch(r, batch)
            payloads.append(node.step(model.loss_grad(node.x, xb, yb)))
        for node in nodes:
            for j in node.neighbours:
                node.receive(j, wire.send(payloads[j]))
        if eval_every and (t + 1) % eval_every == 0:
            xbar = torch.stack([nd.x for nd in nodes]).mean(0)
            history.append({"round": t + 1, **model.evaluate(xbar, data)})
    xbar = torch.stack([nd.x for nd in nodes]).mean(0)
    res = model.evaluate(xbar, data)
    msgs = rounds * sum(len(nd.neighbours) for nd in nodes)
    res.update(
        rounds=rounds,
        numel=x0.numel(),
        bytes_per_message=wire.bytes / msgs,
        ratio=4.0 * x0.numel() / (wire.bytes / msgs),
        consensus=float(torch.stack([(nd.x - xbar).norm() for nd in nodes]).max()),
        worst_node_accuracy=min(model.evaluate(nd.x, data)["accuracy"] for nd in nodes),
        history=history,
        nodes=nodes,
        xbar=xbar,
    )
    return res


# ---------------------------------------------------------------------------------------------------------------
# model averaging (Oland-Raj)
# ---------------------------------------------------------------------------------------------------------------


def train_model_averaging(
    spec: str | None = None,
    *,
    k: int = 4,
    epochs: int = 30,
    lr: float = 0.1,
    batch: int = 16,
    l1: float = 0.0,
    seed: int = 0,
    model: MLP | None = None,
) -> dict:
    """Each epoch every worker trains one local epoch on its shard, then sends its parameters (encoded with ``spec``,
    or fp32 when None); every worker decodes all K messages and takes their mean, so all end with the same model."""
    model = model or MLP()
    data = digits()
    shards = Shards(data, k, seed)
    w = model.init(seed)
    codecs = [_make(spec, rank=r, seed=seed) for r in range(k)] if spec else []
    states = [BucketState(w.numel(), w.dtype) for _ in range(k)]
    for st in states:
        set_segments(st, model.segments)
    wire = Wire(0.0, seed)
    bits, payload_bits, raw_bits, layer_bits = [], [], [], []
    for _ in range(epochs):
        decoded = []
        for r in range(k):
            local = w.clone()
            for xb, yb in shards.epoch(r, batch):
                local -= lr * model.loss_grad(local, xb, yb, l1)
            if codecs:
                parts = codecs[r].encode(local, states[r])
                st = codecs[r].last_stats
                bits.append(st["bits_per_param"])
                payload_bits.append(st["payload_bits_per_param"])
                raw_bits.append(st["raw_bits_per_param"])
                layer_bits.append([L["N"] for L in st["layers"]])
                decoded.append(codecs[r].decode(wire.send(parts), states[r], local))
            else:
                wire.bytes += local.numel() * 4
                bits.append(32.0)
                payload_bits.append(32.0)
                raw_bits.append(32.0)
                decoded.append(local)
        w = torch.stack(decoded).mean(0)
    res = model.evaluate(w, data)
    mean = lambda v: sum(v) / len(v)
    res.update(
        epochs=epochs,
        numel=w.numel(),
        bits_per_param=mean(bits),
        payload_bits_per_param=mean(payload_bits),
        raw_bits_per_param=mean(raw_bits),
        reduction=32.0 / mean(bits),
        payload_reduction=32.0 / mean(payload_bits),
        layer_bits_last=layer_bits[-k:] if layer_bits else [],
        final_params=w,
    )
    return res


# ---------------------------------------------------------------------------------------------------------------
# data-parallel all-reduce (dense, DGT, low-rank)
# ---------------------------------------------------------------------------------------------------------------


class _AllReduceArm:
    """The all-reduce of :func:`train_allreduce`: ``reduce(grads)`` is the sum every rank applies; ``bytes`` and
    ``lost`` count what the ranks handed over and the droppable blocks lost."""

    def __init__(self, spec: str | None, k: int, drop: float, seed: int, model: MLP, w: torch.Tensor) -> None:
        from dgt.codecs.lowrank import LowRankCodec, set_shapes

        self.k, self.drop = k, drop
        self.wire = Wire(drop, seed + 1)
        self.codecs = [_make(spec) for _ in range(k)] if spec else []
        self.lowrank = bool(self.codecs) and isinstance(self.codecs[0], LowRankCodec)
        self.states = [BucketState(w.numel(), w.dtype) for _ in range(k)]
        for st in self.states:
            set_segments(st, model.segments)
            if self.lowrank:
                set_shapes(st, model.shapes)
        self.ef: list[torch.Tensor | None] = [None] * k
        self.gen = torch.Generator().manual_seed(seed + 3)
        self._bytes = 0
        self._lost = 0

    @property
    def bytes(self) -> int:
        return self.wire.bytes if self.codecs and not self.lowrank else self._bytes

    @property
    def lost(self) -> int:
        return self.wire.blocks_lost if self.codecs and not self.lowrank else self._lost

    def _lose(self, r: int, packed: torch.Tensor) -> torch.Tensor | None:
        if self.drop <= 0:
            return None
        lay = BucketLayout.flat(packed.numel(), self.codecs[0].block)  # type: ignore[attr-defined]
        keep = torch.rand(lay.nblocks, generator=self.gen) >= self.drop
        self._lost += int((~keep).sum())
        return lay.expand(keep)

    def reduce(self, grads: list[torch.Tensor]) -> torch.Tensor:
        from dgt.codecs.lowrank import reduce_in_process

        if not self.codecs:
            self._bytes += sum(g.numel() * g.element_size() for g in grads)
            return torch.stack(grads).sum(0)
        if self.lowrank:
            outs = reduce_in_process(self.codecs, self.states, grads, self._lose)  # type: ignore[arg-type]
            self._bytes += sum(sum(c.last_stats.values()) for c in self.codecs)  # type: ignore[attr-defined]
            return outs[0]
        decoded = []
        for r in range(self.k):
            e = self.ef[r]
            g = grads[r] if e is None else grads[r] + e
            d = self.codecs[r].decode(self.wire.send(self.codecs[r].encode(g, self.states[r])), self.states[r], g)
            self.ef[r] = g - d if self.drop > 0 else None
            decoded.append(d)
        return self.codecs[0].aggregate(decoded)


def train_allreduce(
    spec: str | None = None,
    *,
    k: int = 4,
    rounds: int = 300,
    lr: float = 0.1,
    batch: int = 32,
    seed: int = 0,
    drop: float = 0.0,
    model: MLP | None = None,
    eval_every: int = 10,
    target: float | None = None,
) -> dict:
    """Synchronous data-parallel SGD: every round each rank computes its gradient at the shared model, the gradients
    are all-reduced with ``spec`` (None: dense fp32) and every rank applies ``w <- w - lr * mean``.

    A codec of the generic contract (dense, dgt) is encoded per rank and decoded from what the :class:`Wire`
    delivers (droppable blocks lost iid with probability ``drop``); lost elements are added to that rank's next
    gradient, as the transport's error feedback does. ``lowrank`` runs :func:`dgt.codecs.lowrank.reduce_in_process`
    (every tensor's shape known; with ``residual_p`` the packed residual blocks are lost iid with ``drop`` per
    codec block and not sent again, as over the transport).

    ``target``: test accuracy (%) to reach; ``rounds_to_target`` is the first evaluated round (every
    ``eval_every``) at or above it (None if never). Bytes: per round per rank handed to the reductions
    (``bytes_per_round_per_worker``; low-rank: all three reductions, droppable residual included)."""
    model = model or MLP()
    data = digits()
    shards = Shards(data, k, seed)
    w = model.init(seed)
    arm = _AllReduceArm(spec, k, drop, seed, model, w)
    history: list[dict] = []
    reached = None
    for t in range(rounds):
        total = arm.reduce([model.loss_grad(w, *shards.batch(r, batch)) for r in range(k)])
        w -= lr * (total / k)
        if eval_every and (t + 1) % eval_every == 0:
            ev = model.evaluate(w, data)
            history.append({"round": t + 1, **ev})
            if target is not None and reached is None and ev["accuracy"] >= target:
                reached = t + 1
    res = model.evaluate(w, data)
    per = arm.bytes / (rounds * k)
    res.update(rounds=rounds, numel=w.numel(), bytes_per_round_per_worker=per, ratio=4.0 * w.numel() / per,
               blocks_lost=arm.lost, rounds_to_target=reached, history=history, final_params=w)
    return res
