"""The LGC autoencoder (1-D convolutions over the concatenated top-k vector) and its two training objectives.

Encoder: conv 64/128/256/64 (kernel 3, stride 2) + conv 4 (kernel 1), leaky-ReLU after all but the last conv, so a
vector of length mu (padded to a multiple of 16) becomes a 4 x mu/16 latent code (mu/4 floats).
Decoder: transposed conv 4 (k3 s1), 32/64/128/32 (k3 s2, each doubling the length), then a 1-channel conv (k1); in the
parameter-server variant the innovation vector joins as a 33rd channel before that last conv.

Losses are the paper's squared-error sums divided by mu (the same relative weighting of L_rec and L_sim; equivalent to
the paper's loss with the learning rate scaled by 1/mu), so one learning rate serves every vector length.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

MULTIPLE = 16
LATENT_CHANNELS = 4
_SLOPE = 0.01


def padded_length(mu: int) -> int:
    return max(MULTIPLE, -(-mu // MULTIPLE) * MULTIPLE)


def latent_numel(mu: int) -> int:
    """Floats in one latent code of a length-mu vector."""
    return LATENT_CHANNELS * padded_length(mu) // MULTIPLE


def to_signal(x: torch.Tensor) -> torch.Tensor:
    """(B, mu) or (mu,) -> (B, 1, padded) zero-padded signal."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    mu = x.shape[-1]
    return F.pad(x, (0, padded_length(mu) - mu)).unsqueeze(1)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        chans = [1, 64, 128, 256, 64]
        self.convs = nn.ModuleList(
            nn.Conv1d(cin, cout, kernel_size=3, stride=2, padding=1) for cin, cout in zip(chans, chans[1:])
        )
        self.out = nn.Conv1d(64, LATENT_CHANNELS, kernel_size=1)

    def forward(self, sig: torch.Tensor) -> torch.Tensor:
        h = sig
        for conv in self.convs:
            h = F.leaky_relu(conv(h), _SLOPE)
        return self.out(h)


class Decoder(nn.Module):
    def __init__(self, innovation: bool = False) -> None:
        super().__init__()
        self.innovation = innovation
        self.first = nn.ConvTranspose1d(LATENT_CHANNELS, LATENT_CHANNELS, kernel_size=3, stride=1, padding=1)
        chans = [LATENT_CHANNELS, 32, 64, 128, 32]
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(cin, cout, kernel_size=3, stride=2, padding=1, output_padding=1)
            for cin, cout in zip(chans, chans[1:])
        )
        self.out = nn.Conv1d(32 + int(innovation), 1, kernel_size=1)

    def forward(self, code: torch.Tensor, innov: torch.Tensor | None = None) -> torch.Tensor:
        h = F.leaky_relu(self.first(code), _SLOPE)
        for up in self.ups:
            h = F.leaky_relu(up(h), _SLOPE)
        if self.innovation:
            if innov is None:
                raise ValueError("this decoder needs the innovation signal")
            h = torch.cat([h, innov.expand(h.shape[0], -1, -1)], dim=1)
        return self.out(h)


def seeded_init(module: nn.Module, seed: int) -> nn.Module:
    """Re-draw every conv weight/bias like PyTorch's default init, from a private generator (threads share the
    global RNG, so module construction alone is not reproducible when ranks run as threads)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
                w = m.weight
                fan_in = w.shape[1] * w.shape[2] if isinstance(m, nn.Conv1d) else w.shape[0] * w.shape[2]
                bound = 1.0 / fan_in**0.5  # kaiming_uniform(a=sqrt(5)) and the bias share this bound
                w.copy_(torch.rand(w.shape, generator=gen) * 2 * bound - bound)
                if m.bias is not None:
                    m.bias.copy_(torch.rand(m.bias.shape, generator=gen) * 2 * bound - bound)
    return module


def _optimizer(params, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown AE optimizer {kind!r} (sgd | adam)")


class PSAutoencoder(nn.Module):
    """Shared encoder, one decoder per worker (with the innovation channel); trained on the server."""

    def __init__(self, workers: int, opt: str = "sgd", lr: float = 1e-3, sim_weight: float = 0.5, seed: int = 0,
                 common: int | None = None, loss_sum: bool = False):
        super().__init__()
        self.loss_sum = loss_sum  # True: the paper's plain squared-error sums; False: divided by mu
        # None: a random worker's code is the common one each step (paper); -1: every decoder gets its own worker's
        # code (ps_codes=all); else that worker's code
        self.common = common
        self.encoder = Encoder()
        self.decoders = nn.ModuleList(Decoder(innovation=True) for _ in range(workers))
        seeded_init(self, seed)
        self.sim_weight = sim_weight
        self.opt_kind, self.lr = opt, lr
        self._opt: torch.optim.Optimizer | None = None
        self._gen = torch.Generator().manual_seed(seed)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, mu) normalised vectors -> (B, 4, padded/16) codes."""
        return self.encoder(to_signal(x))

    def decode(self, worker: int, code: torch.Tensor, innov: torch.Tensor, mu: int) -> torch.Tensor:
        """One latent code (4, L) + the worker's innovation vector (mu,) -> its reconstructed vector (mu,)."""
        out = self.decoders[worker](code.reshape(1, LATENT_CHANNELS, -1), to_signal(innov))
        return out.reshape(-1)[:mu]

    def train_step(self, x: torch.Tensor, innov: torch.Tensor) -> dict[str, float]:
        """x, innov: (K, mu), or (B, K, mu) for a batch of B rounds (the current one first). Loss = L_rec +
        sim_weight * L_sim, averaged over the rounds; the common code is a randomly chosen worker's (the paper), that
        worker's with ``common`` set, or every worker's own with ``common=-1``. Reports the first round's errors."""
        if self._opt is None:
            self._opt = _optimizer(self.parameters(), self.opt_kind, self.lr)
        if x.dim() == 2:
            x, innov = x.unsqueeze(0), innov.unsqueeze(0)
        b, k, mu = x.shape
        codes = self.encode(x.reshape(b * k, mu)).reshape(b, k, LATENT_CHANNELS, -1)
        diff = codes.unsqueeze(1) - codes.unsqueeze(2)  # (B, K, K, 4, L); the diagonal is zero
        norm = 1.0 if self.loss_sum else mu
        l_sim = diff.pow(2).flatten(1).sum(1) / norm  # (B,)
        rows = torch.arange(b)
        if self.common == -1:
            src = torch.arange(k).expand(b, k)
        else:
            j = torch.randint(k, (b,), generator=self._gen) if self.common is None else torch.full((b,), self.common)
            src = j.unsqueeze(1).expand(b, k)
        sig_innov = to_signal(innov.reshape(b * k, mu)).reshape(b, k, 1, -1)
        recs = torch.stack([self.decoders[w](codes[rows, src[:, w]], sig_innov[:, w]) for w in range(k)], 1)
        l_rec = (recs[:, :, 0, :mu] - x).pow(2).flatten(1).sum(1) / norm  # (B,)
        loss = (l_rec + self.sim_weight * l_sim).mean()
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        self._opt.step()
        per = mu if self.loss_sum else 1.0  # report per-element means either way
        l_rec, l_sim = l_rec.detach(), l_sim.detach()
        return {"loss": float(l_rec[0] + self.sim_weight * l_sim[0]) / per, "rec": float(l_rec[0]) / per,
                "sim": float(l_sim[0]) / per, "energy": x[0].pow(2).sum().item() / mu}


class RingAutoencoder(nn.Module):
    """One encoder, one decoder reconstructing the mean vector from the mean latent code (no innovation)."""

    def __init__(self, opt: str = "sgd", lr: float = 1e-3, seed: int = 0, loss_sum: bool = False):
        super().__init__()
        self.loss_sum = loss_sum
        self.encoder = Encoder()
        self.decoder = Decoder(innovation=False)
        seeded_init(self, seed)
        self.opt_kind, self.lr = opt, lr
        self._opt: torch.optim.Optimizer | None = None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(to_signal(x))

    def decode(self, code: torch.Tensor, mu: int) -> torch.Tensor:
        return self.decoder(code.reshape(1, LATENT_CHANNELS, -1)).reshape(-1)[:mu]

    def train_step(self, x: torch.Tensor) -> dict[str, float]:
        """x: (K, mu) aligned, normalised vectors, or (B, K, mu) for a batch of B rounds (the current one first).
        L_rec = ||D(mean_k E(x_k)) - mean_k x_k||^2, averaged over the rounds; reports the first round's error."""
        if self._opt is None:
            self._opt = _optimizer(self.parameters(), self.opt_kind, self.lr)
        if x.dim() == 2:
            x = x.unsqueeze(0)
        b, k, mu = x.shape
        z = self.encode(x.reshape(b * k, mu)).reshape(b, k, LATENT_CHANNELS, -1).mean(1)
        rec = self.decoder(z)[:, 0, :mu]
        target = x.mean(1)
        l_rec = (rec - target).pow(2).sum(1) / (1.0 if self.loss_sum else mu)  # (B,)
        loss = l_rec.mean()
        self._opt.zero_grad(set_to_none=True)
        loss.backward()
        self._opt.step()
        rec_mean = float(l_rec[0].detach()) / (mu if self.loss_sum else 1.0)
        return {"loss": rec_mean, "rec": rec_mean, "energy": target[0].pow(2).sum().item() / mu}
