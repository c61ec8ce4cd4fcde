"""Validation of what a caller hands the transport, before any frame leaves: a round must cover every block of its
bucket exactly once, or the receiver would close it with blocks missing and the sender keep no residual for them."""

from __future__ import annotations

import numpy as np
import torch

from dgt.errors import InputRejected
from dgt.layout import BucketLayout


def check_classes(cls: torch.Tensor | int, order: torch.Tensor | None, layout: BucketLayout) -> None:
    """Raise :class:`InputRejected` unless ``cls`` is one non-negative class, or one non-negative integer class per
    block of ``layout``, and ``order`` (if given) lists every droppable block (class >= 1) exactly once and nothing
    else. Vectorised: one pass over the class array and one bincount over the order."""
    n = layout.nblocks
    if isinstance(cls, (int, np.integer)) and not isinstance(cls, bool):
        if cls < 0:
            raise InputRejected(f"lane class {cls} is negative")
        droppable = None if cls == 0 else np.ones(n, dtype=bool)
    else:
        if not isinstance(cls, torch.Tensor) or cls.dtype.is_floating_point or cls.dtype.is_complex \
                or cls.dtype == torch.bool:
            raise InputRejected(f"lane classes must be an int or an integer tensor, not {type(cls).__name__}"
                                f"{'' if not isinstance(cls, torch.Tensor) else ' of ' + str(cls.dtype)}")
        if cls.dim() != 1 or cls.numel() != n:
            raise InputRejected(f"lane classes have shape {tuple(cls.shape)}; the bucket has {n} blocks of "
                                f"{layout.block} elements: one class per block is needed")
        c = cls.detach().to("cpu").numpy()
        if n and int(c.min()) < 0:
            raise InputRejected(f"lane classes must be >= 0; block {int(np.argmin(c))} has {int(c.min())}")
        droppable = c > 0
    if order is None:
        return
    o = order.detach().to("cpu").numpy() if isinstance(order, torch.Tensor) else np.asarray(order)
    if o.ndim != 1 or not np.issubdtype(o.dtype, np.integer):
        raise InputRejected(f"order must be a 1-D integer tensor of block indices, not {o.dtype} of shape {o.shape}")
    if len(o) and (int(o.min()) < 0 or int(o.max()) >= n):
        raise InputRejected(f"order names block indices outside [0, {n})")
    seen = np.bincount(o, minlength=n)
    if (seen > 1).any():
        raise InputRejected(f"order names block {int(np.argmax(seen > 1))} more than once")
    if droppable is not None and not (seen[:n] > 0)[droppable].all():
        missing = int(np.flatnonzero(droppable & (seen[:n] == 0))[0])
        raise InputRejected(f"order leaves out droppable block {missing}: every block of class >= 1 must be listed")
