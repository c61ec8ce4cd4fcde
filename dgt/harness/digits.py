"""scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), in the variants the library's harnesses use.

The variants differ in split and scaling on purpose: each keeps the numbers its users were measured with
(docs/codecs.md, docs/lgc.md, the Table 1 reproduction), so they are not merged into one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch


@dataclass
class Data:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@lru_cache(maxsize=1)
def digits() -> Data:
    """Flat 64-pixel rows scaled to [0, 1], stratified 70/30 split with a fixed seed (cached): the codec
    simulations (:mod:`dgt.harness.simulate`) and the model-server tests."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.3, random_state=0, stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    i = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return Data(f(xtr), i(ytr), f(xte), i(yte))


def digits_images(test_fraction: float = 0.3, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """8x8 images scaled to [0, 1] as float32 numpy arrays, a stratified split fixed by ``seed``:
    (x_train, x_test, y_train, y_test), for the experiment runner (dgt.experiment.data.load_digits)."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x = d.images.astype(np.float32) / 16.0
    return tuple(train_test_split(x, d.target, test_size=test_fraction, random_state=seed, stratify=d.target))


def digits_split_standardised(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """1x8x8 image tensors standardised with the training split's statistics, a stratified 75/25 split fixed by
    ``seed``: (x_train, y_train, x_test, y_test), for the LGC benchmark (dgt bench lgc)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.int64)
    idx_tr, idx_te = train_test_split(range(len(y)), test_size=0.25, stratify=data.target, random_state=seed)
    tr, te = torch.tensor(idx_tr), torch.tensor(idx_te)
    mean, std = x[tr].mean(), x[tr].std()  # standardised with the training split's statistics
    x = (x - mean) / std
    return x[tr], y[tr], x[te], y[te]
