"""Configuration, phase schedule and per-layer plan of LGC."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import IntEnum

import torch


class Phase(IntEnum):
    DENSE = 0  # warm-up: every layer sent dense
    TOPK = 1  # top-k (error feedback) on all but the first layer while the autoencoder trains
    COMPRESSED = 2  # autoencoder-coded top-k on the middle layers, top-k on the last, dense first


ROLES = ("dense", "topk", "ae")


@dataclass
class LGCConfig:
    """Options of ``lgc:key=value,...`` (see docs/lgc.md for each)."""

    variant: str = "ps"  # ps | ring
    warmup: int = 200  # dense iterations
    ae_iters: int = 300  # top-k iterations during which the autoencoder trains
    topk: float = 0.005  # keep ratio per layer: k = ceil(topk * n_l) (the paper's 0.001 learned too slowly, issue 25)
    innovation: float = 0.01  # PS: share of the mu selected values sent as the innovation
    momentum_correction: bool = False  # DGC-style: u = m u + g; v = v + u; select on v
    momentum: float = 0.9
    normalize: bool = True  # divide the AE input by its RMS and send that scale as one float
    sim_weight: float = 0.0  # PS: lambda_2 of L_rec + lambda_2 L_sim (the paper: 0.5, with one shared code)
    ae_order: str = "value"  # value: AE input ordered by descending value (indices sent in that order) | index
    ae_opt: str = "adam"  # adam | sgd (the paper's; barely moves the AE in a few hundred steps, see docs/lgc.md)
    ae_lr: float = 3e-3  # measured better than 1e-3 on both variants (docs/lgc.md, issue 25)
    ae_replay: int = 15  # both variants: also train each step on this many past rounds (buffer of the last 256)
    ae_ef: bool = False  # compressed phase: the AE's reconstruction error stays in the error-feedback accumulator
    ae_loss: str = "mean"  # mean: squared-error sums divided by mu | sum: the paper's plain sums
    ae_steps: int = 1  # optimizer steps per training iteration (batch 1 = that iteration's K vectors)
    exact_innovation: bool = True  # PS: the server puts the exactly-sent innovation values back after decoding
    leader: int = 0  # PS: the worker (index among workers) that sends the latent code
    trainer: int = 0  # ring: the rank that trains the autoencoder
    seed: int = 0  # seeds the ring selector sequence and the PS common-code choice
    record: bool = False  # keep per-round diagnostics (true AE inputs, reconstructions) in the state, for the bench
    ae_ablate: str = ""  # ablation decoders: "zero" (zeros) | "template" (the running mean of the training targets)
    ps_codes: str = "all"  # PS compressed phase: only the leader sends a code (paper) | all: every worker its own
    ps_common: str = "random"  # PS training: whose code is the common one: random worker (paper) | leader (as used)

    def __post_init__(self) -> None:
        if self.variant not in ("ps", "ring"):
            raise ValueError(f"lgc variant must be 'ps' or 'ring', not {self.variant!r}")
        if self.warmup < 0 or self.ae_iters < 1:
            raise ValueError("lgc needs warmup >= 0 and ae_iters >= 1")
        if not 0.0 < self.topk <= 1.0 or not 0.0 < self.innovation <= 1.0:
            raise ValueError("lgc topk and innovation are ratios in (0, 1]")
        if self.ae_opt not in ("sgd", "adam"):
            raise ValueError(f"lgc ae_opt must be sgd or adam, not {self.ae_opt!r}")
        if self.ae_order not in ("value", "index"):
            raise ValueError(f"lgc ae_order must be value or index, not {self.ae_order!r}")
        if self.ae_ablate not in ("", "zero", "template"):
            raise ValueError(f"lgc ae_ablate must be empty, zero or template, not {self.ae_ablate!r}")
        if self.ae_replay < 0:
            raise ValueError("lgc ae_replay must be >= 0")
        if self.ae_ef and self.variant == "ps" and self.ps_codes != "all":
            raise ValueError("lgc ae_ef needs ps_codes=all on the PS variant (a worker must decode its own code)")
        if self.ae_loss not in ("mean", "sum"):
            raise ValueError(f"lgc ae_loss must be mean or sum, not {self.ae_loss!r}")
        if self.ps_codes not in ("leader", "all"):
            raise ValueError(f"lgc ps_codes must be leader or all, not {self.ps_codes!r}")
        if self.ps_common not in ("random", "leader"):
            raise ValueError(f"lgc ps_common must be random or leader, not {self.ps_common!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> LGCConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown lgc option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def phase(self, step: int) -> Phase:
        if step < self.warmup:
            return Phase.DENSE
        if step < self.warmup + self.ae_iters:
            return Phase.TOPK
        return Phase.COMPRESSED

    @property
    def switch_step(self) -> int:
        """The first compressed iteration (the trained AE weights are shipped just before it)."""
        return self.warmup + self.ae_iters


def default_roles(n_layers: int) -> tuple[str, ...]:
    """First layer dense, last layer top-k only, the others autoencoder-coded (one layer alone: autoencoder)."""
    if n_layers == 1:
        return ("ae",)
    if n_layers == 2:
        return ("dense", "topk")
    return ("dense",) + ("ae",) * (n_layers - 2) + ("topk",)


class LayerPlan:
    """Where each layer lives in the flat bucket, its role and its exact k."""

    def __init__(self, sizes: list[int] | tuple[int, ...], roles: list[str] | tuple[str, ...] | None = None,
                 topk: float = 0.005) -> None:
        self.sizes = tuple(int(s) for s in sizes)
        if not self.sizes or any(s <= 0 for s in self.sizes):
            raise ValueError("layer sizes must be positive")
        self.roles = tuple(roles) if roles is not None else default_roles(len(self.sizes))
        if len(self.roles) != len(self.sizes) or any(r not in ROLES for r in self.roles):
            raise ValueError(f"one role of {ROLES} per layer expected, got {self.roles}")
        self.numel = sum(self.sizes)
        self.offsets = [0]
        for s in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + s)
        self.k = tuple(min(n, max(1, math.ceil(topk * n))) if r != "dense" else n
                       for n, r in zip(self.sizes, self.roles))

    def layers(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role]

    def numel_of(self, role: str) -> int:
        return sum(self.sizes[i] for i in self.layers(role))

    def mu(self, role: str) -> int:
        """Length of the concatenated top-k vector of ``role``'s layers."""
        return sum(self.k[i] for i in self.layers(role))

    def region(self, flat: torch.Tensor, role: str) -> torch.Tensor:
        """The concatenation of ``role``'s layers of a flat bucket (a copy)."""
        parts = [flat[self.offsets[i] : self.offsets[i] + self.sizes[i]] for i in self.layers(role)]
        return torch.cat(parts) if parts else flat.new_zeros(0)

    def set_region(self, out: torch.Tensor, role: str, values: torch.Tensor) -> None:
        off = 0
        for i in self.layers(role):
            n = self.sizes[i]
            out[self.offsets[i] : self.offsets[i] + n] = values[off : off + n]
            off += n

    def select(self, v: torch.Tensor, role: str) -> torch.Tensor:
        """Exact top-k by magnitude per layer of ``role``: sorted global indices into the bucket (int64)."""
        idx = []
        for i in self.layers(role):
            seg = v[self.offsets[i] : self.offsets[i] + self.sizes[i]]
            top = torch.topk(seg.abs(), self.k[i], sorted=False).indices
            idx.append(torch.sort(top).values + self.offsets[i])
        return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64, device=v.device)

    def __repr__(self) -> str:
        return f"LayerPlan(sizes={self.sizes}, roles={self.roles}, k={self.k})"
