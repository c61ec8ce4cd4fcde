"""The owner's own contribution held back where nothing arrived: a lossy ring whose update is as sparse as its
reduce-scatter (issue 42 point 1).

After a lossy reduce-scatter the owner of a chunk adds the sum that reached it (the other ranks' important blocks,
and the droppable ones that came in time) to its own input chunk. Its own input is dense, so the reduced chunk is
dense even where nothing arrived, and the ring's sparse all-gather (dgt.collectives.ring_gather) has no empty block
to leave out. With ``RingAllReduce.hold_own`` the owner treats its own contribution as the others' were treated: on
the blocks for which the last hop brought nothing (a block every sender kept back or lost), it keeps its own value in
this error-feedback store instead of the sum, and adds it to its input chunk at the next lossy call of the bucket.
Those blocks of the result are zero on every rank, so the all-gather carries only the blocks that arrived; what is
held is delayed, never lost (applied + held + the transport's error feedback = the inputs).

One store per ring, keyed by (bucket id, chunk index); an entry whose size or dtype no longer matches (the caller
changed the bucket) is dropped rather than added to the wrong elements. Memory: at most one chunk per bucket id.
"""

from __future__ import annotations

import torch

from dgt.layout import BucketLayout


class HeldBack:
    """This rank's held-back own contributions (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], torch.Tensor] = {}

    def add_to(self, bucket_id: int, chunk: int, src: torch.Tensor) -> torch.Tensor:
        """``src`` (this rank's input for its own chunk) plus what was held back for it: a new tensor, or ``src``
        itself when nothing is held. The entry is taken out (the call about to run carries it)."""
        held = self._held.pop((bucket_id, chunk), None)
        if held is None or held.numel() != src.numel() or held.dtype != src.dtype or held.device != src.device:
            return src
        return src + held

    def keep(self, bucket_id: int, chunk: int, src: torch.Tensor, out: torch.Tensor, arrived: torch.Tensor,
             layout: BucketLayout) -> int:
        """``out`` = ``src`` + what arrived, already; ``arrived``: a bool per block of ``layout`` (the chunk's).
        On the blocks where nothing arrived, ``src``'s values are held and ``out`` is zeroed. Returns the number of
        blocks held."""
        missing = ~arrived.to(torch.bool).reshape(-1)
        n = int(missing.sum())
        if n == 0:
            return 0
        em = layout.expand(missing.cpu()).to(out.device)
        self._held[(bucket_id, chunk)] = torch.where(em, src, torch.zeros((), dtype=src.dtype, device=src.device))
        out.masked_fill_(em, 0)
        return n

    def total(self) -> torch.Tensor | None:
        """(For tests) every held value, concatenated in key order; None when nothing is held."""
        if not self._held:
            return None
        return torch.cat([self._held[k].reshape(-1).float() for k in sorted(self._held)])

    def held(self, bucket_id: int, chunk: int) -> torch.Tensor | None:
        """What is held for ``chunk`` of ``bucket_id`` (None: nothing)."""
        return self._held.get((bucket_id, chunk))

    def clear(self) -> None:
        self._held.clear()
