"""The workloads `dgt experiment ddp` and `dgt bench ddp` train: a model family, its data, its optimizer, its loss and
its evaluation metric, so the DDP trainer is the same for every family.

- ``alexnet``, ``vgg11`` (dgt/experiment/models.py): the original workloads, unchanged (the digits 8x8, or
  Fashion-MNIST; plain SGD, momentum 0 unless asked; target test accuracy).
- ``resnet`` (``resnet-s``, ``resnet-l``): a ResNet-style CNN (a BatchNorm stem, four stages of one residual basic
  block each, global average pooling, one linear layer; ResNet-18's layout with one block per stage instead of two)
  on scikit-learn's digits upsampled to 16x16 (bilinear): a real image task that ships with scikit-learn, so nothing
  is downloaded; 16x16 rather than 8x8 so four stride-2 stages have pixels to work on. SGD with momentum 0.9 and
  weight decay 5e-4 (the usual ResNet recipe); target test accuracy.
- ``gpt`` (``gpt-s``, ``gpt-l``): a decoder-only transformer (token and position embeddings, pre-LayerNorm blocks of
  causal multi-head self-attention and a 4x GELU MLP, a final LayerNorm and an untied output layer) on byte-level
  text from the Python standard library's own source files (:data:`STDLIB_FILES`, read from
  ``sysconfig.get_paths()['stdlib']``; every Python installation has them): the first 90 % of each file's bytes
  train, the last 10 % are the held-out validation split. AdamW (betas 0.9/0.95, weight decay 0.1); target a
  validation loss (nats per byte, lower is better).

Sizes: the bare family name is the experiment's model (at least 1 M parameters); ``-s`` and ``-l`` are the smaller
and larger variants for the scaling figures of ``dgt bench ddp --model``.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dgt.errors import DgtError
from dgt.experiment.data import Dataset

# a fixed sorted list of large pure-Python modules present (as single files) in CPython 3.10 to 3.13
STDLIB_FILES = ("argparse.py", "dataclasses.py", "difflib.py", "inspect.py", "subprocess.py", "tarfile.py",
                "threading.py", "typing.py")
VAL_FRACTION = 0.1
VOCAB = 256  # bytes: no tokenizer to build or ship


@dataclass(frozen=True)
class Defaults:
    """What a family trains with unless told otherwise."""

    lr: float
    batch: int
    target: float
    momentum: float
    metric: str  # "acc" (higher is better) or "val_loss" (lower is better)
    optimizer: str  # what the report prints
    eval_every: int
    max_time: float  # training seconds per arm


# gpt's target 2.6: Gloo with 4 workers first reaches it at steps 188 / 148 / 132 with seeds 0 / 1 / 2 (at least 100
# steps on every seed, docs/experiment-ddp.md); 2.8 sat just under the byte-unigram plateau, reached at step 24 or 48.
# resnet's 0.972 (525 of 540 test digits): Gloo at steps 116 / 122 / 112; 0.97 gave 98 on seed 2
DEFAULTS: dict[str, Defaults] = {
    "alexnet": Defaults(0.1, 32, 0.97, 0.0, "acc", "SGD", 2, 150.0),
    "vgg11": Defaults(0.1, 32, 0.97, 0.0, "acc", "SGD", 2, 150.0),
    "resnet": Defaults(0.05, 32, 0.972, 0.9, "acc", "SGD, momentum 0.9, weight decay 5e-4", 2, 600.0),
    "gpt": Defaults(3e-3, 8, 2.6, 0.0, "val_loss", "AdamW, betas (0.9, 0.95), weight decay 0.1", 4, 600.0),
}
VAL_WINDOWS = 128  # gpt's validation loss is measured on this many held-out windows, spread over every file
RESNET_WIDTHS = {"resnet-s": 16, "resnet": 32, "resnet-l": 64}  # channels of the first stage; x2 per stage
GPT_SIZES = {"gpt-s": (96, 4, 4), "gpt": (128, 6, 4), "gpt-l": (256, 6, 8)}  # (d_model, layers, heads)
GPT_CONTEXT = 64
MODELS = ("alexnet", "vgg11", *RESNET_WIDTHS, *GPT_SIZES)


def family(model: str) -> str:
    """``resnet-l`` -> ``resnet``; raises DgtError for a model no family knows."""
    if model not in MODELS:
        raise DgtError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return model.split("-")[0]


def defaults(model: str) -> Defaults:
    return DEFAULTS[family(model)]


# -- ResNet ----------------------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm, ReLU, and the identity (or a strided 1x1 conv + BN) added back."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNetSmall(nn.Module):
    """Stem (3x3 conv, BN, ReLU) then four stages (w, 2w, 4w, 8w channels; stride 1, 2, 2, 2) of one basic block,
    global average pooling and a linear classifier."""

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, width: int = 32) -> None:
        super().__init__()
        c = in_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True))
        widths = [width, 2 * width, 4 * width, 8 * width]
        blocks = []
        cin = width
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.stages = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():  # the last BN of each residual branch starts at 0: each block starts as identity
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1), 1))


# -- GPT -------------------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        if d % heads:
            raise DgtError(f"d_model {d} is not a multiple of {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTSmall(nn.Module):
    """Token + learned position embeddings, ``layers`` pre-LN transformer blocks, final LayerNorm, output layer."""

    def __init__(self, vocab: int = VOCAB, context: int = GPT_CONTEXT, d: int = 128, layers: int = 6,
                 heads: int = 4) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith("proj.weight") or name.endswith("mlp.2.weight") \
                    else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise DgtError(f"sequence of {t} tokens is longer than the context ({self.context})")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


# -- data ------------------------------------------------------------------------------------------------------------
@dataclass
class TextData:
    """Byte-level windows: x [N, T] input bytes, y [N, T] the next bytes (int64), train and validation."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    files: tuple[str, ...]
    train_bytes: int
    val_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        return VOCAB

    def describe(self) -> dict:
        return {"name": self.name, "train": len(self.y_train), "test": len(self.y_test), "shape": list(self.shape),
                "classes": VOCAB, "files": list(self.files), "train_bytes": self.train_bytes,
                "val_bytes": self.val_bytes}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@lru_cache(maxsize=2)
def load_stdlib_text(context: int = GPT_CONTEXT, directory: str | None = None) -> TextData:
    """:data:`STDLIB_FILES` as bytes; each file's first 90 % train, the rest validate; cut into windows of
    ``context + 1`` bytes (stride ``context``: every byte is predicted once)."""
    root = directory or stdlib_dir()
    train: list[bytes] = []
    val: list[bytes] = []
    for name in STDLIB_FILES:
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise DgtError(f"gpt's text: cannot read the standard library's {path}: {exc}") from exc
        cut = int(len(raw) * (1 - VAL_FRACTION))
        train.append(raw[:cut])
        val.append(raw[cut:])

    def windows(parts: list[bytes]) -> torch.Tensor:
        rows = []
        for part in parts:  # windows never straddle two files
            t = torch.frombuffer(bytearray(part), dtype=torch.uint8).long()
            n = (len(t) - 1) // context
            if n > 0:
                rows.append(t[: n * context + 1].unfold(0, context + 1, context))
        return torch.cat(rows)

    wtr, wva = windows(train), windows(val)
    if len(wva) > VAL_WINDOWS:  # a fixed, evenly spread subset: one evaluation costs ~1 s on one core, not ~10
        wva = wva[torch.linspace(0, len(wva) - 1, VAL_WINDOWS).long()]
    return TextData("stdlib-bytes", wtr[:, :-1].contiguous(), wtr[:, 1:].contiguous(), wva[:, :-1].contiguous(),
                    wva[:, 1:].contiguous(), STDLIB_FILES, sum(map(len, train)), sum(map(len, val)))


def upsampled_digits(seed: int = 0, size: int = 16) -> Dataset:
    """The experiment's digits split (dgt.experiment.data.load_digits), each image upsampled bilinearly to
    ``size`` x ``size`` (values re-normalised by the same mean/std as the 8x8 ones)."""
    from dgt.experiment.data import load_digits

    d = load_digits(seed=seed)
    up = lambda x: F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)  # noqa: E731
    return Dataset(f"digits-{size}x{size}", up(d.x_train), d.y_train, up(d.x_test), d.y_test)


# -- the workload ----------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """Model, data, optimizer, loss and metric of one family; :meth:`reached` compares the metric with a target."""

    model_name: str
    family: str
    data: Any  # dgt.experiment.data.Dataset or TextData: x_train, y_train, x_test, y_test, describe()
    model: nn.Module
    metric: str
    make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
    optimizer_name: str

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.dim() == 3:  # [B, T, V] next-token logits
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return F.cross_entropy(out, y)

    def evaluate(self, model: nn.Module | None = None, batch: int = 256) -> float:
        """Test accuracy (classification) or mean validation loss per byte (gpt), eval mode, no gradients."""
        m = self.model if model is None else model
        data = self.data
        was = m.training
        m.eval()
        total, correct, n = 0.0, 0, 0
        with torch.no_grad():
            for i in range(0, len(data.y_test), batch):
                x, y = data.x_test[i : i + batch], data.y_test[i : i + batch]
                out = m(x)
                if self.metric == "val_loss":
                    total += float(self.loss(out, y)) * y.numel()
                    n += y.numel()
                else:
                    correct += int((out.argmax(1) == y).sum())
                    n += len(y)
        m.train(was)
        return total / n if self.metric == "val_loss" else correct / n

    def reached(self, value: float, target: float) -> bool:
        return reached(self.metric, value, target)


def reached(metric: str, value: float, target: float) -> bool:
    """Accuracy at or above the target; a validation loss at or below it."""
    return value <= target if metric == "val_loss" else value >= target


def build_workload(model: str, dataset: str = "digits", data_dir: str | None = None, seed: int = 0, width: int = 1,
                   lr: float | None = None, momentum: float | None = None) -> Workload:
    """The named model with its data and optimizer; initial weights fixed by ``seed`` (every rank starts from the
    same point). ``lr``/``momentum`` None: the family's defaults. ``dataset`` matters for alexnet/vgg11 only."""
    fam = family(model)
    d = DEFAULTS[fam]
    lr = d.lr if lr is None else lr
    momentum = d.momentum if momentum is None else momentum
    if fam in ("alexnet", "vgg11"):
        from dgt.experiment.data import load_dataset
        from dgt.experiment.models import build_model

        data: Any = load_dataset(dataset, data_dir, seed)
        net = build_model(model, data.shape, data.num_classes, width, seed=seed)
        return Workload(model, fam, data, net, "acc",
                        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum),
                        "SGD" + (f", momentum {momentum:g}" if momentum else ""))
    if dataset not in ("digits", "auto") and fam == "resnet":
        raise DgtError(f"resnet trains on the digits upsampled to 16x16, not {dataset!r}")
    if fam == "resnet":
        data = upsampled_digits(seed)
        torch.manual_seed(seed)
        net = ResNetSmall(data.shape, data.num_classes, RESNET_WIDTHS[model])
        wd = 5e-4
        return Workload(model, fam, data, net, "acc",
                        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=wd),
                        f"SGD, momentum {momentum:g}, weight decay {wd:g}")
    data = load_stdlib_text()
    torch.manual_seed(seed)
    dm, layers, heads = GPT_SIZES[model]
    net = GPTSmall(VOCAB, GPT_CONTEXT, dm, layers, heads)
    return Workload(model, fam, data, net, "val_loss",
                    lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
                    "AdamW, betas (0.9, 0.95), weight decay 0.1")
