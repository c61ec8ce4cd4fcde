"""DCD-PSGD and ECD-PSGD (Tang et al., NeurIPS 2018) and the naive "send C(x)" negative control, for gossip.

Two layers:

1. :class:`GossipQuantCodec` (registry names ``dcd``, ``ecd``, ``naive-gossip``): the unbiased compressor C as a
   Codec. ``encode(z)`` -> parts, ``decode(parts)`` -> C(z). Quantizers: ``quantizer=affine`` (default: per bucket
   ``min``/``scale`` fp32 + b-bit codes over 2^b points, stochastic rounding) or ``quantizer=fixed`` (grid ``k *
   step`` independent of |z|; width chosen per message, see :mod:`dgt.codecs.quantize`). ``bits=32`` sends fp32 as
   is (full-precision D-PSGD baseline). Randomness per (seed, rank, t): independent across ranks and iterations.
2. Per-rank algorithm state that a gossip collective drives (and :mod:`dgt.harness.simulate` drives in-process):
   :class:`DCDNode`, :class:`ECDNode`, :class:`NaiveNode`. Each holds the local model ``x`` (flat) and the
   neighbours' replicas, and per iteration::

       g = grad F_i(node.x)                       # the trainer
       parts = node.step(g)                       # payload for every neighbour (the same parts to each)
       for j in node.neighbours:                  # the collective ships parts and hands over what arrived
           node.receive(j, received_parts_of_j)

   The sender applies exactly the dequantized values it sends (it decodes its own parts with the receivers' code),
   so a replica of x_i held by a neighbour is bit-identical to x_i on ranks of one device type.

Memory: DCD (degree + 1) model copies; ECD (degree + 2); naive (degree + 1).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from dgt.codecs.base import RELIABLE, BucketState, Capabilities, Codec, Part, Received
from dgt.codecs.bucketinfo import received_from_parts
from dgt.codecs.quantize import (
    affine_dequantize,
    affine_quantize,
    fixed_step_dequantize,
    fixed_step_quantize,
    generator,
    nbuckets,
    pack_bits,
    unpack_bits,
)
from dgt.codecs.registry import register


class GossipQuantCodec(Codec):
    """Options: ``bits`` (8; 32 = no quantization), ``bucket`` (0 = one min/scale per tensor, the brief's reading;
    > 0: per bucket of that many entries), ``quantizer`` (affine|fixed), ``step`` (fixed grid step, 1e-4),
    ``max_bits`` (fixed: widest codes before the step doubles, 16), ``seed`` (0), ``rank`` (0)."""

    name = "gossip-quant"
    algorithm = "dcd"
    capabilities = Capabilities(summable=False, lossy_tolerant=False, replica_deltas=True)

    def __init__(
        self,
        bits: int = 8,
        bucket: int = 0,
        quantizer: str = "affine",
        step: float = 1e-4,
        max_bits: int = 16,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        super().__init__()
        bits = int(bits)
        if bits != 32 and not 1 <= bits <= 16:
            raise ValueError("bits must be 1..16 (or 32 for full precision)")
        if quantizer not in ("affine", "fixed"):
            raise ValueError("quantizer must be 'affine' or 'fixed'")
        self.bits = bits
        self.bucket = int(bucket)
        self.quantizer = quantizer
        self.step = float(step)
        self.max_bits = int(max_bits)
        self.seed = int(seed)
        self.rank = int(rank)
        self.last_stats: dict[str, float] = {}

    @property
    def exact(self) -> bool:
        return self.bits == 32 and self.quantizer == "affine"

    # -- the compressor ------------------------------------------------------------------------------------------
    def encode(self, bucket: torch.Tensor, state: BucketState) -> list[Part]:
        x = bucket.reshape(-1)
        gen = generator(x.device, self.seed, self.rank, 4, state.step)
        state.step += 1
        if self.exact:
            parts = [Part(x.to(torch.float32).clone(), RELIABLE, name="values")]
        elif self.quantizer == "affine":
            codes, meta = affine_quantize(x, self.bits, self.bucket, gen)
            parts = [
                Part(pack_bits(codes, self.bits), RELIABLE, name="codes"),
                Part(meta, RELIABLE, name="min_scale"),
            ]
        else:
            offs, bases, width, shift = fixed_step_quantize(x, self.step, self.bucket, gen, self.max_bits)
            head = torch.tensor([width, shift], dtype=torch.int32, device=x.device)
            codes = pack_bits(offs, width) if width else torch.zeros(0, dtype=torch.uint8, device=x.device)
            parts = [
                Part(torch.cat([head, bases.to(x.device)]), RELIABLE, name="width_shift_bases"),
                Part(codes, RELIABLE, name="codes"),
            ]
        nbytes = sum(p.nbytes for p in parts)
        self.last_stats = {"bytes": float(nbytes), "bits_per_entry": 8.0 * nbytes / max(1, x.numel())}
        return parts

    def expected_bytes(self, n: int) -> int | None:
        """Affine: ceil(n b / 8) + 8 bytes per bucket; exact: 4n; fixed: data dependent (None)."""
        if self.exact:
            return 4 * n
        if self.quantizer == "affine":
            return -(-n * self.bits // 8) + 8 * nbuckets(n, self.bucket)
        return None

    def decode(self, parts: list[Received], state: BucketState, like: torch.Tensor) -> torch.Tensor:
        n = like.numel()
        if self.exact:
            out = parts[0].data.to(torch.float32)
        elif self.quantizer == "affine":
            codes = unpack_bits(parts[0].data, self.bits, n, narrow=True)
            out = affine_dequantize(codes, parts[1].data.to(torch.float32), self.bucket, n)
        else:
            head = parts[0].data
            width, shift = (int(v) for v in head[:2].tolist())
            bases = head[2:]
            if width:
                offs = unpack_bits(parts[1].data, width, n)
            else:
                offs = torch.zeros(n, dtype=torch.int64, device=bases.device)
            out = fixed_step_dequantize(offs, bases, self.step, shift, self.bucket, n)
        return out.to(device=like.device, dtype=like.dtype).view_as(like)

    # -- per-rank algorithm state ---------------------------------------------------------------------------------
    def make_node(self, rank: int, x0: torch.Tensor, weights: Mapping[int, float], gamma: float) -> GossipNode:
        """The algorithm state of ``rank`` (its own copy of this codec, reseeded for the rank)."""
        codec = copy.copy(self)
        codec._states = {}
        codec.rank = int(rank)
        cls = {"dcd": DCDNode, "ecd": ECDNode, "naive": NaiveNode}[self.algorithm]
        return cls(codec, rank, x0, weights, gamma)


@register("dcd")
class DCDCodec(GossipQuantCodec):
    name = "dcd"
    algorithm = "dcd"


@register("ecd")
class ECDCodec(GossipQuantCodec):
    name = "ecd"
    algorithm = "ecd"


@register("naive-gossip")
class NaiveGossipCodec(GossipQuantCodec):
    name = "naive-gossip"
    algorithm = "naive"


# ---------------------------------------------------------------------------------------------------------------
# mixing matrices
# ---------------------------------------------------------------------------------------------------------------


def ring_matrix(n: int) -> torch.Tensor:
    """Symmetric doubly stochastic ring: W_ii = W_i,i+1 = W_i,i-1 = 1/3 (n = 2: 1/2 each; n = 1: [[1]])."""
    if n < 1:
        raise ValueError("n must be >= 1")
    w = torch.zeros(n, n, dtype=torch.float64)
    if n == 1:
        w[0, 0] = 1.0
        return w
    if n == 2:
        return w.fill_(0.5)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] = 1.0 / 3.0
    return w


def mixing_row(w: torch.Tensor, i: int) -> dict[int, float]:
    """Row i of W as {j: W_ij} over the non-zero entries (self included)."""
    if not torch.allclose(w, w.T) or not torch.allclose(w.sum(1), torch.ones(w.shape[0], dtype=w.dtype)):
        raise ValueError("the mixing matrix must be symmetric and doubly stochastic")
    return {j: float(w[i, j]) for j in range(w.shape[0]) if float(w[i, j]) != 0.0}


# ---------------------------------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------------------------------


class GossipNode:
    """Common state: the local model ``x`` (flat fp32), the mixing weights, the step size, the iteration counter."""

    def __init__(
        self, codec: GossipQuantCodec, rank: int, x0: torch.Tensor, weights: Mapping[int, float], gamma: float
    ) -> None:
        self.codec = codec
        self.rank = int(rank)
        self.x = x0.detach().reshape(-1).to(torch.float32).clone()
        self.weights = {int(j): float(v) for j, v in weights.items()}
        if self.rank not in self.weights:
            raise ValueError("the mixing row must contain the node itself")
        self.neighbours = [j for j in self.weights if j != self.rank]
        self.gamma = float(gamma)
        self.t = 1
        self.state = BucketState(numel=self.x.numel(), dtype=self.x.dtype)
        self._rx_state = BucketState(numel=self.x.numel(), dtype=self.x.dtype)
        self.bytes_sent = 0

    def _send(self, z: torch.Tensor) -> tuple[list[Part], torch.Tensor]:
        """Encode z and decode our own parts exactly as a receiver will: (parts, C(z))."""
        parts = self.codec.encode(z, self.state)
        self.bytes_sent += sum(p.nbytes for p in parts)
        return parts, self.codec.decode(received_from_parts(parts), self._rx_state, z)

    def _decode(self, parts: list[Received]) -> torch.Tensor:
        return self.codec.decode(parts, self._rx_state, self.x)

    def step(self, grad: torch.Tensor) -> list[Part]:
        raise NotImplementedError

    def receive(self, j: int, parts: list[Received]) -> None:
        raise NotImplementedError


class DCDNode(GossipNode):
    """DCD-PSGD: x_half = sum_j W_ij xhat_j - gamma g (xhat_i = x_i); q = C(x_half - x_i); x_i += q; send q."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replicas = {j: self.x.clone() for j in self.neighbours}

    def step(self, grad: torch.Tensor) -> list[Part]:
        x_half = self.x * self.weights[self.rank]
        for j in self.neighbours:
            x_half.add_(self.replicas[j], alpha=self.weights[j])
        x_half.add_(grad.reshape(-1).to(torch.float32), alpha=-self.gamma)
        parts, q = self._send(x_half - self.x)
        self.x += q
        self.t += 1
        return parts

    def receive(self, j: int, parts: list[Received]) -> None:
        self.replicas[j] += self._decode(parts)


class ECDNode(GossipNode):
    """ECD-PSGD: x_half = sum_j W_ij xtilde_j (own estimate included); x_{t+1} = x_half - gamma g;
    z = (1 - t/2) x_t + (t/2) x_{t+1}; send C(z); every holder: xtilde <- (1 - 2/t) xtilde + (2/t) C(z)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.estimates = {j: self.x.clone() for j in [self.rank, *self.neighbours]}
        self._t_sent = 1

    @staticmethod
    def _blend(est: torch.Tensor, c: torch.Tensor, t: int) -> None:
        est.mul_(1.0 - 2.0 / t).add_(c, alpha=2.0 / t)

    def step(self, grad: torch.Tensor) -> list[Part]:
        t = self.t
        x_half = torch.zeros_like(self.x)
        for j, w in self.weights.items():
            x_half.add_(self.estimates[j], alpha=w)
        x_new = x_half.add_(grad.reshape(-1).to(torch.float32), alpha=-self.gamma)
        z = self.x * (1.0 - t / 2.0) + x_new * (t / 2.0)
        parts, c = self._send(z)
        self._blend(self.estimates[self.rank], c, t)
        self.x = x_new
        self._t_sent = t
        self.t += 1
        return parts

    def receive(self, j: int, parts: list[Received]) -> None:
        self._blend(self.estimates[j], self._decode(parts), self._t_sent)


class NaiveNode(GossipNode):
    """Negative control: x_{t+1} = W_ii x_i + sum_j W_ij C(x_j) - gamma g; send C(x_{t+1}) (errors never cancel)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received = {j: self.x.clone() for j in self.neighbours}

    def step(self, grad: torch.Tensor) -> list[Part]:
        x_new = self.x * self.weights[self.rank]
        for j in self.neighbours:
            x_new.add_(self.received[j], alpha=self.weights[j])
        x_new.add_(grad.reshape(-1).to(torch.float32), alpha=-self.gamma)
        self.x = x_new
        self.t += 1
        parts, _ = self._send(self.x)
        return parts

    def receive(self, j: int, parts: list[Received]) -> None:
        self.received[j] = self._decode(parts)
