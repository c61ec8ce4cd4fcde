"""Closing a round for :class:`dgt.protocol.receiver.RoundReceiver`: zero what was lost, fill in the round's
statistics, teach the deadline policy, and build the DROP_REPORT frame (bitmap and timing trailer) for the sender."""

from __future__ import annotations

import numpy as np
import torch

from dgt import wire
from dgt.protocol.block_rows import zero_rows
from dgt.protocol.deadline import DeadlinePolicy
from dgt.protocol.events import RoundDone
from dgt.protocol.report import Timing, encode_timing
from dgt.protocol.round_state import OpenRound
from dgt.protocol.stats import RoundStats, lane_counts
from dgt.wire import Flags, FrameType


def timing(r: OpenRound, close: float) -> Timing:
    """The drop report's timing trailer: what arrived on the unreliable lanes and when, and ``close``, when the round
    closed (dgt.protocol.report). Not cached: a cache keyed by the round kept up to 64 closed rounds, their result
    buffers included, alive."""
    unimp = [ls for lane, ls in r.stats.lanes.items() if lane > 0]
    return Timing(sum(ls.frames for ls in unimp), r.first_arrival, r.last_arrival, r.stats.deadline_wait,
                  sum(ls.bytes for ls in unimp), close)  # fmt: skip


def zero_blocks(r: OpenRound, sel: np.ndarray) -> None:
    """Zero the selected blocks in place: row fills over ``[rows, block]`` views for full blocks
    (:func:`dgt.protocol.block_rows.zero_rows`), a slice per short tensor tail."""
    blocks = np.flatnonzero(sel)
    if len(blocks) == 0:
        return
    g, isz = r.geom, r.isz
    full = g.block_len[blocks] == r.layout.block
    if full.any():
        zero_rows(r.data.view(-1), g.block_start[blocks[full]], r.layout.block)
    for b in blocks[~full].tolist():  # at most one short block per tensor
        r.raw[g.block_start[b] * isz : g.block_end[b] * isz] = 0


def _fill_stats(r: OpenRound, mask: np.ndarray, partial: np.ndarray, now: float, why: str) -> RoundStats:
    g, st = r.geom, r.stats
    st.important = int((mask & r.important).sum())
    st.unimportant_received = int((mask & ~r.important).sum())
    missing = g.nblocks - int(mask.sum())
    st.unsent = 0 if r.end is None else min(max(g.nblocks - r.end[0] - r.end[1], 0), missing)
    st.dropped = missing - st.unsent  # sent and lost; unsent: kept back by the sender's send budget
    st.partial = int(partial.sum())
    st.deadline_wait = 0.0 if r.imp_done_at is None else max(now - r.imp_done_at, 0.0)
    st.closed_by = why
    return st


def finalise(r: OpenRound, now: float, why: str, deadline: DeadlinePolicy, token: int, rank: int) -> RoundDone:
    """Close round ``r`` (``why``: closed_by) and build its result; the receiver forgets the round itself."""
    g = r.geom
    mask = r.nfrag >= g.frags_needed
    partial = (r.nfrag > 0) & ~mask
    if r.zero_lost:  # else the caller reads only the blocks of ``mask`` (RoundReceiver.leave_lost)
        zero_blocks(r, partial if r.fresh else ~mask)
    st = _fill_stats(r, mask, partial, now, why)
    if why in ("complete", "deadline") and r.imp_done_at is not None and r.end is not None and r.end[1]:
        deadline.observe(st.deadline_wait, why == "complete")  # rounds with unimportant blocks teach it
    for lane, n in lane_counts(r.lane_of[mask]).items():
        st.lane(lane).blocks = n
    sender, bucket, round_ = r.key
    report = None
    if r.want_report or st.dropped:  # a lossless round that lost blocks would be a protocol breach: say so
        report = wire.encode_frame(
            FrameType.DROP_REPORT, np.packbits(mask).tobytes() + encode_timing(timing(r, now)), token=token,
            rank=rank, round=round_, bucket=bucket, count=g.nblocks, flags=Flags.CLOSED | Flags.TIMING,
        )  # fmt: skip
    return RoundDone(sender, bucket, round_, r.data, torch.from_numpy(mask), st, report, r.layout, r.codec)
