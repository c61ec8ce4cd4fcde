"""``ae_replay``: the bounded buffer of past training rounds the autoencoder also trains on at every step."""

from __future__ import annotations

from typing import Any

import torch

REPLAY_ROUNDS = 256  # training rounds kept (host memory: at most REPLAY_ROUNDS x K x mu floats per tensor kept)


def replay_batch(values: dict[str, Any], n: int, seed: int, *rounds: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The current round's tensors stacked with ``n`` past rounds drawn (seeded, with replacement) from the last
    REPLAY_ROUNDS rounds kept in ``values`` (a codec state's dict); the current round is appended afterwards, so it
    is first in the batch and never drawn for itself. ``n=0``: the current round alone, unstacked."""
    if not n:
        return rounds
    buf = values.setdefault("srv_replay", [])
    gen = values.setdefault("srv_replay_gen", torch.Generator().manual_seed(seed + 17))
    pick = [buf[i] for i in torch.randint(len(buf), (n,), generator=gen).tolist()] if buf else []
    buf.append(tuple(t.detach() for t in rounds))
    del buf[:-REPLAY_ROUNDS]
    return tuple(torch.stack([cur] + [p[j] for p in pick]) for j, cur in enumerate(rounds))
