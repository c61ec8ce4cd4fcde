"""Sans-IO receiver: consumes frames in any order (with loss, duplication, reordering), knows when all important
blocks are in, closes the round at a deadline from an injected clock, and produces the result and a drop report.

It never reads a socket or a clock itself: channels hand it frames (or batches of datagrams) and ``now``.
Reliable-lane payloads can be received zero-copy: :meth:`payload_target` returns where to ``recv_into``.

The parts live in modules of their own: per-round state and batch helpers in :mod:`dgt.protocol.round_state`, the
early buffer in :mod:`dgt.protocol.early_buffer`, fragment and run landing in :mod:`dgt.protocol.landing`, closing
a round and its drop report in :mod:`dgt.protocol.closing`; the names callers import from here stay here.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from dgt import wire
from dgt.errors import WireError
from dgt.layout import BucketLayout
from dgt.protocol.closing import finalise
from dgt.protocol.datagram_decode import all_fragments
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.deadline import AdaptiveGrace, DeadlinePolicy, DeadlineState
from dgt.protocol.early_buffer import EarlyBuffer, datagram_sizes, pack_datagrams, reencode
from dgt.protocol.events import ALREADY_CLOSED, DropReportIn, Event, Key, RoundDone, RoundRefused
from dgt.protocol.landing import land_fragments, land_runs, mark_run
from dgt.protocol.owner import owned
from dgt.protocol.round_state import (
    HUGE_BYTES,
    Allocator,
    OpenRound,
    dense_wait,
    first_of,
    group_by_round,
    zeroed,
)
from dgt.protocol.stats import ReceiverCounters, RoundProgress
from dgt.wire import Flags, FrameType

# names callers import from this module (tests take the batch helper and the buffer maker from here)
_first_of = first_of
__all__ = ["HUGE_BYTES", "Allocator", "DropReportIn", "Event", "Key", "RoundDone", "RoundReceiver", "RoundRefused",
           "zeroed"]


@owned
class RoundReceiver:
    """Receiver state machine for one endpoint; rounds from several senders and buckets can be open at once."""

    def __init__(
        self,
        token: int,
        rank: int = 0,
        *,
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        deadline: DeadlinePolicy | None = None,
        early_bytes: int = 16 << 20,
        early_ttl: float = 5.0,
        early_rounds_per_peer: int = 8,
        max_open_bytes: int = 4 << 30,
        allocator: Allocator | None = None,
        mac: DatagramMac | None = None,
    ) -> None:
        self.token = token
        self.mac = mac  # when set, every fragment must come as a datagram with a good MAC trailer (else "bad-mac")
        self.allocator = allocator
        self.rank = rank
        self.limits = limits
        self.deadline = deadline or AdaptiveGrace()
        self.max_open_bytes = max_open_bytes
        self.rounds: dict[Key, OpenRound] = {}
        self.closed: OrderedDict[Key, None] = OrderedDict()
        self._leave_lost: OrderedDict[Key, None] = OrderedDict()  # rounds whose caller reads the mask (leave_lost)
        self._held: OrderedDict[Key, None] = OrderedDict()  # rounds whose important blocks come elsewhere (hold)
        self.counters = ReceiverCounters()
        # input for rounds not open yet, replayed in order; bounded in bytes, in rounds per peer, and in age
        self._early = EarlyBuffer(self.counters, early_bytes, early_ttl, early_rounds_per_peer)
        self._senders: set[int] = set()  # ranks that opened rounds: the closed-round memory grows with them

    @property
    def early_bytes(self) -> int:
        return self._early.max_bytes

    @property
    def early_ttl(self) -> float:
        return self._early.ttl

    @property
    def early_rounds_per_peer(self) -> int:
        return self._early.rounds_per_peer

    # -- helpers
    def _late_or_unknown(self, key: Key, lane: int, frame_bytes: bytes | None, now: float) -> None:
        if key in self.closed:
            self.counters.late += 1
            return
        if frame_bytes is not None and self._early.admit(key, len(frame_bytes), now):
            self._early.add(key, lane, frame_bytes, None, now)
            self.counters.early_buffered += 1
        else:
            self.counters.unknown += 1

    def open_rounds(self) -> list[Key]:
        return list(self.rounds)

    def progress(self, limit: int = 20) -> list[RoundProgress]:
        """How far the first ``limit`` open rounds have come (for the error message of a call that waits too long)."""
        return [RoundProgress(key, r.end, r.n_imp_done, r.n_done, r.imp_done_at)
                for key, r in list(self.rounds.items())[:limit]]

    def is_open(self, key: Key) -> bool:
        """Whether round ``key`` is open (its ROUND_BEGIN was accepted, it has not closed yet)."""
        return key in self.rounds

    def leave_lost(self, key: Key) -> None:
        """Round ``key``, when it opens, leaves the blocks it did not get as its buffer held them (no zero-fill at
        close): its caller reads only the blocks the result's mask says arrived. Bounded (the oldest are forgotten,
        which only costs the zero-fill)."""
        self._leave_lost[key] = None
        while len(self._leave_lost) > 4096:
            self._leave_lost.popitem(last=False)

    def hold(self, key: Key) -> None:
        """Round ``key``'s important blocks travel outside it (a lossy ring hop's stream lane: its ROUND_END
        announces none): its deadline does not start at ROUND_END but when :meth:`important_in` says they are in,
        as DGT's deadline starts once every important block is in. (It still closes as soon as it is complete.)
        Bounded like :meth:`leave_lost`."""
        self._held[key] = None
        while len(self._held) > 4096:
            self._held.popitem(last=False)

    def important_in(self, key: Key, now: float) -> list[Event]:
        """The important blocks of held round ``key`` are in (see :meth:`hold`): its deadline may start."""
        self._held.pop(key, None)  # not open yet: it opens unheld
        r = self.rounds.get(key)
        if r is None or not r.held:
            return []
        r.held = False
        return self._progress(r, now)

    def is_closed(self, key: Key) -> bool:
        """Whether round ``key`` closed recently (the closed-round memory is bounded)."""
        return key in self.closed

    def _open(self, f: wire.Frame, now: float) -> list[Event]:
        key = (f.rank, f.bucket, f.round)
        numel, block, frag, sizes = wire.decode_round_begin(f.payload, self.limits)
        layout = BucketLayout.of(sizes, block)  # shared: a bucket keeps its shape round after round
        if key in self.closed:
            self.counters.late += 1
            return [RoundRefused(key, ALREADY_CLOSED)]
        if key in self.rounds:  # a repeated ROUND_BEGIN: the round stays open as it was
            r = self.rounds[key]
            if r.layout != layout or r.geom.frag != frag or r.dtype != f.dtype:
                self.counters.reject("begin-mismatch")
            return []
        if sum(1 for k in self.rounds if k[0] == f.rank) >= self.limits.max_open_rounds:  # per sender (#23)
            return self._refuse(key, "too-many-rounds")
        self._senders.add(f.rank)
        need = numel * int(wire.ITEMSIZE[f.dtype]) + layout.nblocks * -(-block // frag)
        if sum(r.nbytes for r in self.rounds.values()) + need > self.max_open_bytes:
            return self._refuse(key, "memory-budget")
        self.rounds[key] = r = OpenRound(key, layout, frag, f.dtype, f.codec, self._buffer(key, numel, f.dtype))
        r.opened_at = now
        r.want_report = not f.flags & Flags.NO_REPORT
        if key in self._leave_lost:
            del self._leave_lost[key]
            r.zero_lost = False
        if key in self._held:
            del self._held[key]
            r.held = True
        events: list[Event] = []
        for e in self._early.take(key, now):
            if e.sizes is None:
                events += self.receive_bytes(e.data, e.lane, now)
            else:
                batch = wire.decode_datagrams(e.data, e.sizes, self.limits, self.token)
                events += self.receive_datagrams(batch, e.lane, now)
        return events

    def _refuse(self, key: Key, reason: str) -> list[Event]:
        """Count a refused ROUND_BEGIN and say so (its sender would otherwise wait for the round forever)."""
        self.counters.reject(reason)
        return [RoundRefused(key, reason)]

    def _buffer(self, key: Key, numel: int, dtype: wire.WireDType) -> torch.Tensor | None:
        """The allocator's buffer for a new round if it fits exactly (contiguous CPU, same size and dtype)."""
        if self.allocator is None:
            return None
        tdt = wire.TORCH_OF[dtype]
        buf = self.allocator(key, numel, tdt)
        if buf is None:
            return None
        if buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() != numel or buf.dtype != tdt:
            self.counters.reject("buffer-mismatch")
            return None
        return buf.view(-1)

    # -- frame input
    def receive_bytes(self, data: bytes | bytearray | memoryview, lane: int, now: float) -> list[Event]:
        """Back-to-back frames (a datagram, or a chunk of a reliable stream). Invalid bytes are counted, not raised."""
        try:
            frames = wire.decode_frames(data, self.limits, self.token)
        except WireError as exc:
            self.counters.reject(str(exc).split(":")[0])
            return []
        events: list[Event] = []
        for f in frames:
            events += self.receive_frame(f, lane, now)
        return events

    def receive_frame(self, f: wire.Frame, lane: int, now: float) -> list[Event]:
        """One decoded frame; a ROUND_BEGIN that does not open its round answers :class:`RoundRefused`."""
        if f.token != self.token:
            self.counters.reject("token")
            return [RoundRefused((f.rank, f.bucket, f.round), "token")] if f.ftype == FrameType.ROUND_BEGIN else []
        if f.ftype == FrameType.DATA:
            return self._data_frame(f, lane, now)
        if f.ftype == FrameType.ROUND_BEGIN:
            try:
                return self._open(f, now)
            except WireError as exc:
                key = (f.rank, f.bucket, f.round)
                self.counters.reject(str(exc))
                return [RoundRefused(key, ALREADY_CLOSED if key in self.closed else str(exc))]
        if f.ftype == FrameType.ROUND_END:
            return self._end(f, now)
        if f.ftype == FrameType.DROP_REPORT:
            return [DropReportIn(f)]
        if f.ftype == FrameType.BULK:  # the endpoint's reader takes these off the TCP stream; never in a datagram
            self.counters.reject("bulk-not-on-stream")
        return []  # CONTROL frames belong to the endpoint

    def _end(self, f: wire.Frame, now: float) -> list[Event]:
        key = (f.rank, f.bucket, f.round)
        r = self.rounds.get(key)
        if r is None:
            self._late_or_unknown(key, 0, reencode(f), now)
            return []
        try:
            r.end = wire.decode_round_end(f.payload)
        except WireError:
            self.counters.reject("round-end")
            return []
        return self._progress(r, now)

    def _progress(self, r: OpenRound, now: float) -> list[Event]:
        if r.imp_done_at is None and r.important_complete():
            r.imp_done_at = now
        if r.complete():
            return [self._finalise(r, now, "complete")]
        return []

    def _progressed(self, r: OpenRound, landed: bool, now: float) -> list[Event]:
        return self._progress(r, now) if landed else []

    # -- reliable lane: one frame at a time, payload zero-copy
    def payload_target(self, h: np.void, lane: int = 0) -> memoryview | None:
        """Where the payload of DATA header ``h`` (a run of whole blocks) should be received, or None to discard it."""
        key = (int(h["rank"]), int(h["bucket"]), int(h["round"]))
        r = self.rounds.get(key)
        if r is None or int(h["token"]) != self.token:
            return None
        off, cnt = int(h["offset"]), int(h["count"])
        if r.check_run(int(h["block"]), off, cnt, int(h["dtype"])) is not None:
            return None
        return r.raw.data[off * r.isz : (off + cnt) * r.isz]

    def commit(self, h: np.void, lane: int, now: float, landed: bool) -> list[Event]:
        """After the payload of ``h`` was read: into :meth:`payload_target` (``landed``) or into scratch (discarded)."""
        key = (int(h["rank"]), int(h["bucket"]), int(h["round"]))
        r = self.rounds.get(key)
        if r is None:
            self._late_or_unknown(key, lane, None, now)
            return []
        if not landed:
            r.stats.rejected += 1
            return []
        return self._progressed(r, mark_run(r, h, lane), now)

    def _screen(self, batch: wire.Batch, fragments: bool) -> np.ndarray:
        """Count invalid headers (by reason) and DATA frames of the other kind; the indices of the wanted frames:
        fragments on unreliable lanes, whole-block runs on the reliable lane."""
        h, ok = batch.headers, batch.valid
        if (~ok).any():
            for code, n in zip(*np.unique(batch.reason[~ok], return_counts=True)):
                self.counters.reject(wire.REASONS[int(code)], int(n))
        frag = (h["flags"] & Flags.FRAGMENT) != 0
        wanted = ok & (h["ftype"] == FrameType.DATA) & (frag if fragments else ~frag)
        if (ok & ~wanted).any():
            self.counters.reject("not-a-fragment" if fragments else "not-a-run", int((ok & ~wanted).sum()))
        return np.flatnonzero(wanted)

    def receive_runs(self, batch: wire.Batch, lane: int, now: float) -> list[Event]:
        """A batch of reliable-lane DATA runs already in memory (small frames staged together by the channel):
        validated, copied and marked in one vectorised pass, as :meth:`receive_datagrams` does for fragments."""
        h = batch.headers
        idx = self._screen(batch, fragments=False)
        if len(idx) == 0:
            return []
        src = np.frombuffer(batch.buf, np.uint8)
        ukeys, inv = group_by_round(h[idx])
        events: list[Event] = []
        for j, kk in enumerate(ukeys.tolist()):
            key = (kk[0], kk[1], kk[2])
            sel = idx[inv == j]
            r = self.rounds.get(key)
            if r is None:
                if key in self.closed:
                    self.counters.late += len(sel)
                else:
                    self.counters.unknown += len(sel)
                continue
            events += self._progressed(r, land_runs(r, h[sel], src, batch.payload_pos[sel], lane), now)
        return events

    def _data_frame(self, f: wire.Frame, lane: int, now: float) -> list[Event]:
        key = (f.rank, f.bucket, f.round)
        r = self.rounds.get(key)
        if r is None:
            self._late_or_unknown(key, lane, reencode(f), now)
            return []
        if f.flags & Flags.FRAGMENT:
            if self.mac is not None:  # a lone frame has no MAC trailer to check: only datagram batches carry one
                self.counters.reject("bad-mac")
                return []
            h = wire.headers(1)
            h["flags"], h["block"], h["offset"], h["count"] = f.flags, f.block, f.offset, f.count
            h["length"], h["rank"], h["bucket"], h["round"], h["dtype"] = len(f.payload), *key, f.dtype
            src = np.frombuffer(f.payload, np.uint8)
            return self._progressed(r, land_fragments(r, h, src, np.zeros(1, np.int64), lane, now), now)
        problem = r.check_run(f.block, f.offset, f.count, f.dtype)
        if problem:
            r.stats.rejected += 1
            return []
        r.raw[f.offset * r.isz : (f.offset + f.count) * r.isz] = np.frombuffer(f.payload, np.uint8)
        h = wire.headers(1)
        h["flags"], h["block"], h["offset"], h["count"] = f.flags, f.block, f.offset, f.count
        return self._progressed(r, mark_run(r, h[0], lane), now)

    # -- unreliable lanes: batches of datagrams, vectorised
    def receive_datagrams(self, batch: wire.Batch, lane: int, now: float) -> list[Event]:
        """A batch of datagrams (one GRO read or several reads) from an unreliable lane."""
        h = batch.headers
        # the common case (every datagram a valid fragment) in one C call; else the screening counts what is not
        idx = np.arange(len(h)) if len(h) and all_fragments(batch) else self._screen(batch, fragments=True)
        if len(idx) == 0:
            return []
        src = np.frombuffer(batch.buf, np.uint8)
        every = len(idx) == len(h)  # the common case: no header to leave out, no copy of the headers
        ukeys, inv = group_by_round(h if every else h[idx])
        mac = None if self.mac is None else (self.mac, self.rank, self.counters)
        events: list[Event] = []
        for j, kk in enumerate(ukeys.tolist()):
            key = (kk[0], kk[1], kk[2])
            one = len(ukeys) == 1
            sel = idx if one else idx[inv == j]
            r = self.rounds.get(key)
            if r is None:
                self._early_datagrams(key, lane, batch, sel, now)
                continue
            hsel, psel = (h, batch.payload_pos) if one and every else (h[sel], batch.payload_pos[sel])
            events += self._progressed(r, land_fragments(r, hsel, src, psel, lane, now, mac), now)
        return events

    def opening_pending(self, batch: wire.Batch) -> bool:
        """Whether the first or the last datagram of ``batch`` is a well-formed one of a round that is neither open nor
        closed: datagrams often overtake their round's ROUND_BEGIN on the reliable lane, and a caller that lets that
        lane's reader run first has them land at once instead of through the early buffer (a copy of the batch, then
        a second pass). A hint from two headers, not a check: what is not open when the batch is fed is buffered."""
        h = batch.headers
        if len(h) == 0:
            return False
        for i in (0, len(h) - 1):
            if batch.reason[i] == 0:
                key = (int(h["rank"][i]), int(h["bucket"][i]), int(h["round"][i]))
                if key not in self.rounds and key not in self.closed:
                    return True
        return False

    def _early_datagrams(self, key: Key, lane: int, batch: wire.Batch, sel: np.ndarray, now: float) -> None:
        """Datagrams of a round that is not open (yet): late if it closed, else kept as one block that is replayed
        through this vectorised path when its ROUND_BEGIN arrives (datagrams often overtake it)."""
        if key in self.closed:
            self.counters.late += len(sel)
            return
        sizes = datagram_sizes(batch, sel)
        if not self._early.admit(key, int(sizes.sum()), now):
            self.counters.unknown += len(sel)
            return
        self._early.add(key, lane, pack_datagrams(batch, sel, sizes), sizes, now)
        self.counters.early_buffered += len(sel)

    # -- time
    def _deadline_of(self, r: OpenRound) -> float | None:
        if r.imp_done_at is None:
            return None
        remaining = None if r.end is None else max(r.end[3] - r.unimp_frames, 0)
        return self.deadline.deadline(
            DeadlineState(r.imp_done_at, r.last_arrival, r.mean_gap, remaining, r.batch_gap, dense_wait(r, remaining))
        )

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`on_time` will finalise a round (None: nothing is waiting on time)."""
        ds = [d for d in (self._deadline_of(r) for r in self.rounds.values()) if d is not None]
        return min(ds) if ds else None

    def on_time(self, now: float) -> list[Event]:
        """Finalise every round whose important blocks are in and whose deadline has passed."""
        out: list[Event] = []
        for r in list(self.rounds.values()):
            d = self._deadline_of(r)
            if d is not None and now >= d:
                out.append(self._finalise(r, now, "deadline"))
        return out

    def expire(self, key: Key, now: float) -> list[Event]:
        """Close open round ``key`` now, as its deadline would (a caller that waited for its datagrams itself:
        dgt.transport.hop_round). Nothing for a round that is not open."""
        r = self.rounds.get(key)
        return [] if r is None else [self._finalise(r, now, "deadline")]

    def abort(self, sender: int, now: float) -> list[Event]:
        """Finalise every open round of ``sender`` as it stands (the peer is gone). A round whose important blocks
        were all in is as good as one closed by its deadline and closes as "sender-gone"; the others as "aborted"."""
        out: list[Event] = []
        for k, r in list(self.rounds.items()):
            if k[0] == sender:
                out.append(self._finalise(r, now, "sender-gone" if r.imp_done_at is not None else "aborted"))
        return out

    def _finalise(self, r: OpenRound, now: float, why: str) -> RoundDone:
        """Close ``r`` (its result and drop report: :func:`dgt.protocol.closing.finalise`) and remember it closed."""
        done = finalise(r, now, why, self.deadline, self.token, self.rank)
        del self.rounds[r.key]
        self.closed[r.key] = None
        while len(self.closed) > 16 * (self.limits.max_open_rounds + len(self._senders)):
            self.closed.popitem(last=False)
        return done
