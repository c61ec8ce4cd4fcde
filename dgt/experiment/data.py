"""Datasets: scikit-learn's handwritten digits (shipped with the package, always there) and Fashion-MNIST from the
IDX files a user downloads (plain or gzip), split into per-worker shards."""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from dgt.errors import DgtError

# IDX type codes (the third magic byte) -> numpy big-endian dtype
_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass
class Dataset:
    """Normalised float images [N, C, H, W] and int64 labels, train and test."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1

    def describe(self) -> dict:
        return {"name": self.name, "train": len(self.y_train), "test": len(self.y_test), "shape": list(self.shape),
                "classes": self.num_classes}


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (the MNIST/Fashion-MNIST format), gzip-compressed or not, checking its header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DgtError(f"{path}: not an IDX file (bad magic)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DgtError(f"{path}: unknown IDX element type 0x{code:02x}")
    if ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise DgtError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = _IDX_DTYPES[code]
    count = int(np.prod(dims))
    body = raw[4 + 4 * ndim :]
    if len(body) != count * dtype.itemsize:
        raise DgtError(f"{path}: header promises {dims} ({count * dtype.itemsize} bytes), file holds {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _find(directory: str, stem: str) -> str:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise DgtError(f"{directory}: no {stem}[.gz]; download the four Fashion-MNIST IDX files there "
                   f"(https://github.com/zalandoresearch/fashion-mnist)")


def load_fashion_mnist(directory: str, limit_train: int | None = None, limit_test: int | None = None) -> Dataset:
    """Fashion-MNIST from the four IDX files in ``directory`` (names as distributed, optionally .gz)."""
    arrays = {key: read_idx(_find(directory, stem)) for key, stem in FASHION_FILES.items()}
    for split in ("train", "test"):
        imgs, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if imgs.ndim != 3 or labels.ndim != 1 or len(imgs) != len(labels):
            raise DgtError(f"{directory}: {split} images {imgs.shape} do not match labels {labels.shape}")
    xtr, ytr = arrays["train_images"][:limit_train], arrays["train_labels"][:limit_train]
    xte, yte = arrays["test_images"][:limit_test], arrays["test_labels"][:limit_test]
    return _normalised("fashion-mnist", xtr.astype(np.float32) / 255.0, ytr, xte.astype(np.float32) / 255.0, yte)


def load_digits(test_fraction: float = 0.3, seed: int = 0) -> Dataset:
    """scikit-learn's 8x8 handwritten digits (1797 images), a stratified train/test split fixed by ``seed``."""
    from dgt.harness.digits import digits_images

    xtr, xte, ytr, yte = digits_images(test_fraction, seed)
    return _normalised("digits", xtr, ytr, xte, yte)


def _normalised(name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray) -> Dataset:
    mean, std = float(xtr.mean()), float(xtr.std()) or 1.0
    conv = lambda a: torch.from_numpy((a - mean) / std).float().unsqueeze(1)  # noqa: E731
    return Dataset(name, conv(xtr), torch.from_numpy(ytr.astype(np.int64)), conv(xte),
                   torch.from_numpy(yte.astype(np.int64)))


def load_dataset(name: str, path: str | None = None, seed: int = 0, limit_train: int | None = None,
                 limit_test: int | None = None) -> Dataset:
    """``digits`` (built in) or ``fashion-mnist`` (needs ``path``, the directory of the IDX files)."""
    if name == "digits":
        return load_digits(seed=seed)
    if name in ("fashion-mnist", "fashion"):
        if not path:
            raise DgtError("fashion-mnist needs --data-dir, the directory holding its four IDX files")
        return load_fashion_mnist(path, limit_train, limit_test)
    raise DgtError(f"unknown dataset {name!r}; choose digits or fashion-mnist")


class ShardSampler:
    """Each worker draws minibatches from its own disjoint shard, reshuffled every epoch (seeded per rank)."""

    def __init__(self, n: int, rank: int, world: int, batch: int, seed: int = 0) -> None:
        if n < world:
            raise DgtError(f"{n} training samples cannot be split over {world} workers")
        self.indices = torch.arange(rank, n, world)
        self.batch = min(batch, len(self.indices))
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)
        self._perm = torch.empty(0, dtype=torch.int64)
        self._pos = 0

    def next(self) -> torch.Tensor:
        if self._pos + self.batch > len(self._perm):
            self._perm = self.indices[torch.randperm(len(self.indices), generator=self.gen)]
            self._pos = 0
        out = self._perm[self._pos : self._pos + self.batch]
        self._pos += self.batch
        return out
