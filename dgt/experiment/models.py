"""AlexNet- and VGG-11-style networks, scaled so four of them train side by side on two CPU cores.

The layer structure follows the originals (AlexNet: 5 conv + 3 FC with dropout; VGG-11: 8 conv in 5 stages + 3 FC);
widths are cut down and pooling stages adapted to small images (8x8 digits, 28x28 Fashion-MNIST). What matters for
the experiment is the gradient size relative to compute, which ``describe`` reports.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

DROPOUT = 0.2  # the originals use 0.5; these nets are ~100x narrower and 0.5 slows them to a crawl


def init_weights(model: nn.Module) -> nn.Module:
    """He initialisation for every conv/linear layer (torchvision's VGG does the same): with PyTorch's default
    scaled-down init a deep narrow ReLU stack sits on a loss plateau for hundreds of iterations."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for m in layers[:-1]:
        nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        nn.init.zeros_(m.bias)
    nn.init.normal_(layers[-1].weight, std=0.01)  # the output layer starts near uniform: loss_0 = ln(classes)
    nn.init.zeros_(layers[-1].bias)
    return model


def _flat_features(features: nn.Module, in_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *in_shape)).numel())


class AlexNetSmall(nn.Module):
    """AlexNet's shape (conv 5 / FC 3, ReLU, max-pool after conv 1, 2 and 5, dropout in the classifier), narrow."""

    def __init__(self, in_shape: tuple[int, int, int] = (1, 8, 8), num_classes: int = 10, width: int = 1,
                 dropout: float = DROPOUT) -> None:
        super().__init__()
        c, h, _ = in_shape
        big = h >= 24  # 28x28: stride-2 first conv like AlexNet's stride-4 stem; 8x8: keep the resolution
        w = [16 * width, 32 * width, 48 * width, 48 * width, 32 * width]
        self.features = nn.Sequential(
            nn.Conv2d(c, w[0], 5 if big else 3, stride=2 if big else 1, padding=2 if big else 1), nn.ReLU(True),
            nn.MaxPool2d(2) if big else nn.Identity(),
            nn.Conv2d(w[0], w[1], 3, padding=1), nn.ReLU(True), nn.MaxPool2d(2),
            nn.Conv2d(w[1], w[2], 3, padding=1), nn.ReLU(True),
            nn.Conv2d(w[2], w[3], 3, padding=1), nn.ReLU(True),
            nn.Conv2d(w[3], w[4], 3, padding=1), nn.ReLU(True), nn.MaxPool2d(2),
        )
        flat = _flat_features(self.features, in_shape)
        hidden = 256 * width
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(flat, hidden), nn.ReLU(True),
            nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(True), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


VGG11_STAGES = [[1], [2], [4, 4], [8, 8], [8, 8]]  # VGG-11 ("A"): 64 | 128 | 256 256 | 512 512 | 512 512, in 8ths


class VGG11Small(nn.Module):
    """VGG-11 (configuration A: 8 conv 3x3 with BN-free ReLU in 5 stages, then 3 FC), channels 64*k -> 8*k*width.

    Small inputs cannot take five 2x2 pools; the pools of the first stages are skipped until the remaining pools fit.
    """

    def __init__(self, in_shape: tuple[int, int, int] = (1, 8, 8), num_classes: int = 10, width: int = 1,
                 dropout: float = DROPOUT) -> None:
        super().__init__()
        c, h, _ = in_shape
        pools = 0
        while h >> (pools + 1) >= 1 and pools < 5:
            pools += 1
        layers: list[nn.Module] = []
        base = 8 * width
        for i, stage in enumerate(VGG11_STAGES):
            for mult in stage:
                layers += [nn.Conv2d(c, base * mult, 3, padding=1), nn.ReLU(True)]
                c = base * mult
            if i >= 5 - pools:
                layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        flat = _flat_features(self.features, in_shape)
        hidden = 256 * width
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(dropout), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS: dict[str, Callable[..., nn.Module]] = {"alexnet": AlexNetSmall, "vgg11": VGG11Small}


def build_model(name: str, in_shape: tuple[int, int, int], num_classes: int = 10, width: int = 1,
                seed: int = 0) -> nn.Module:
    """The named model with deterministic initial weights (every worker starts from the same point)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(seed)
    return init_weights(MODELS[name](in_shape, num_classes, width))


def describe(model: nn.Module) -> dict[str, int]:
    """Parameter count, tensors and gradient bytes (fp32): what each worker pushes per iteration."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    return {"parameters": n, "tensors": len(params), "gradient_bytes": 4 * n}
