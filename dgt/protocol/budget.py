"""The send budget of the unreliable lanes, sans-IO.

Per round and peer the sender puts on the unreliable lanes only as many unimportant blocks, most important first,
as the lane's current rate (:mod:`dgt.protocol.congestion`) can deliver before the round is expected to close. The
rest are *unsent*: they go straight into the error-feedback residual (:func:`fold_blocks`) at planning time, so
nothing is lost whether or not a drop report ever comes, and the round's ROUND_END announces only the blocks that
are sent, so the receiver can close the round "complete" as soon as those are in.

The pacer's debt (bytes it still owes from earlier rounds) comes off the budget: at a low rate a round sends one
block, then none until the pacer has paid for it, rather than queueing blocks that can only miss their rounds (a
rate pinned at its floor then got no feedback at all: every datagram was abandoned when its round closed).

The expected close is learnt from the drop reports: a round ends for the sender when its report is in, and the
report's timing trailer says how long the receiver waited after the important blocks were complete. The difference
is the time the reliable lane took (:class:`RoundWindow`); the unimportant blocks that fit in it at the lane's rate
ride along without holding the round open.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.block_rows import add_rows
from dgt.protocol.congestion import BaseDelay
from dgt.protocol.geometry import Geometry


@dataclass
class RoundWindow:
    """The seconds from a round's start to the moment its important blocks were all in at the receiver: a shorter
    round is taken at once (the budget must not hold rounds open), a longer one through an EWMA of weight ``alpha``.
    Before the first report the budget covers ``initial`` seconds. A lossy ring hop's round gives the transfer time
    its sender measured instead (``observe(transfer=)``): its start-to-report time also holds its own planning and its
    peer's landing, several times the transfer.

    Per bucket it also keeps the shortest window of the last ``history`` intervals of ``interval`` seconds (the
    *base window*, aged out like LEDBAT's base delay: a bucket moves the same bytes every step, so its fastest recent
    window is what its important blocks need with the path to themselves) and :meth:`observe` returns how much
    longer this round's window was, relative to that base: the *slowdown*. (A base over a count of recent windows
    instead ratchets up: where the lane keeps the important blocks a little slower, every window in it is.)
    The unimportant blocks ride along only if they are free; when they are not (a FIFO bottleneck that
    ignores DSCP, or a CPU-bound host such as 4 ranks on 2 cores over loopback, where every datagram costs the
    important transfer CPU time), the important blocks take longer, the window grows, and through it the budget:
    more datagrams, slower important blocks, a longer window again. The congestion controller reads the slowdown
    like queuing delay (:class:`dgt.protocol.congestion.LedbatRate`, ``slowdown_target``) and so breaks that loop."""

    alpha: float = 0.25
    # the budget never covers less than this much time (so the lane keeps probing). 1 ms: a lossy ring hop's
    # window on loopback is ~1-2 ms; a 5 ms floor paced its datagrams over 5 ms, the receiver holding the hop open
    # ~3 ms for them after the important blocks were in
    floor: float = 0.001
    initial: float = 0.05
    value: float | None = None
    interval: float = 60.0  # seconds per base-window interval
    history: int = 10  # intervals the base window is the minimum over (older ones age out)
    warm: int = 4  # windows of a bucket before its slowdown is read
    slack: float = 0.002  # seconds over the base that are not a slowdown (scheduling jitter of small rounds)
    min_bytes: int = 64 << 10  # datagram bytes below which a round gives no slowdown: a few cannot cause one
    max_buckets: int = 256  # buckets tracked (least recently reported dropped first): memory stays bounded
    _base: OrderedDict[int, BaseDelay] = field(default_factory=OrderedDict, repr=False)

    def observe(self, duration: float, wait: float, bucket: int | None = None, now: float = 0.0,
                datagram_bytes: int | None = None, transfer: float | None = None) -> float | None:
        """``duration``: round start to drop report (sender clock); ``wait``: the receiver's deadline wait; ``now``:
        the sender's clock; ``datagram_bytes``: what the round put on the datagram lanes (None: not known);
        ``transfer``: how long the important blocks' transfer took, where the sender measured it (a lossy ring hop:
        its stream messages), the budget's window sample then (None: ``duration - wait``). Returns the round's
        slowdown against its bucket's base window (``(window - base - slack) / base``, >= 0, from ``duration -
        wait`` always: it holds the planning and landing that more datagrams make longer), or None before ``warm``
        windows of the bucket were seen, without a bucket, or under ``min_bytes`` of datagrams (the window still
        counts towards the base)."""
        whole = max(duration - max(wait, 0.0), 0.0)
        slow = None if bucket is None else self._slowdown(bucket, whole, now)
        if datagram_bytes is not None and datagram_bytes < self.min_bytes:
            slow = None
        sample = whole if transfer is None else max(transfer, 0.0)
        if self.value is None or sample <= self.value:
            self.value = sample
        else:
            self.value = (1 - self.alpha) * self.value + self.alpha * sample
        return slow

    def _slowdown(self, bucket: int, sample: float, now: float) -> float | None:
        b = self._base.get(bucket)
        if b is None:
            b = self._base[bucket] = BaseDelay(self.interval, self.history)
            while len(self._base) > self.max_buckets:
                self._base.popitem(last=False)
        else:
            self._base.move_to_end(bucket)
        b.update(sample, now)  # (a sample below the old base is the new base: no slowdown either way)
        base = b.value
        if b.samples <= self.warm or base is None:
            return None
        return max(sample - base - self.slack, 0.0) / max(base, 1e-3)

    def budget(self, rate: float, debt: float = 0.0) -> int:
        """Bytes the unreliable lanes may carry in the next round at ``rate``, less ``debt``: bytes the pacer still
        owes from earlier rounds (they leave first, so the round's own datagrams could not go out in time). Zero or
        less: the round sends no unimportant block at all."""
        return int(rate * max(self.initial if self.value is None else self.value, self.floor) - max(debt, 0.0))


def wire_bytes_of_blocks(geom: Geometry, blocks: np.ndarray, itemsize: int) -> np.ndarray:
    """Datagram bytes (payload + one header per fragment) each of ``blocks`` costs on an unreliable lane."""
    cost: np.ndarray = geom.block_len[blocks] * itemsize + geom.frags_needed[blocks] * wire.HEADER_SIZE
    return cost


def split_budget(geom: Geometry, unimp: np.ndarray, itemsize: int, budget: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(sent, unsent): the longest prefix of ``unimp`` (most important first) whose datagrams fit in ``budget``
    bytes, and the rest. A positive budget smaller than the first block still sends that block (the lane keeps
    probing at a low rate); a budget of zero or less (the pacer is still paying off earlier rounds) sends none, so
    a slow lane does not pile up datagrams that can only miss their rounds."""
    if budget is None or len(unimp) == 0:
        return unimp, unimp[:0]
    if budget <= 0:
        return unimp[:0], unimp
    cum = np.cumsum(wire_bytes_of_blocks(geom, unimp, itemsize))
    k = max(int(np.searchsorted(cum, budget, side="right")), 1)
    return unimp[:k], unimp[k:]


def fold_blocks(residual: torch.Tensor, sent: torch.Tensor, layout: BucketLayout, blocks: torch.Tensor) -> int:
    """``residual[b] += sent[b]`` for every (distinct) block in ``blocks``; the work follows the number of blocks, not
    the bucket size. Full blocks of a CPU bucket: chunked row-wise adds over ``[rows, block]`` views
    (:func:`dgt.protocol.block_rows.add_rows`: no temporary as large as the blocks); the rest (partial tensor tails,
    other devices): one index_add over their elements. Returns the elements folded."""
    if len(blocks) == 0:
        return 0
    if residual.device.type == "cpu" and sent.device.type == "cpu" and residual.is_contiguous() \
            and sent.is_contiguous() and residual.dtype == sent.dtype:
        full = layout.block_len[blocks] == layout.block
        if bool(full.any()):
            starts = layout.block_start[blocks[full]].numpy()
            add_rows(residual.view(-1), sent.view(-1), starts, layout.block)
            return len(starts) * layout.block + _fold_elems(residual, sent, layout, blocks[~full])
    return _fold_elems(residual, sent, layout, blocks)


def _fold_elems(residual: torch.Tensor, sent: torch.Tensor, layout: BucketLayout, blocks: torch.Tensor) -> int:
    if len(blocks) == 0:
        return 0
    lens = layout.block_len[blocks]
    folded = int(lens.sum())
    first = torch.cumsum(lens, 0) - lens
    idx = torch.repeat_interleave(layout.block_start[blocks] - first, lens, output_size=folded)
    idx += torch.arange(folded)
    residual.index_add_(0, idx, sent[idx])
    return folded
