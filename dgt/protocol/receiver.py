"""Sans-IO receiver: consumes frames in any order (with loss, duplication, reordering), knows when all important
blocks are in, closes the round at a deadline from an injected clock, and produces the result and a drop report.

It never reads a socket or a clock itself: channels hand it frames (or batches of datagrams) and ``now``.
Reliable-lane payloads can be received zero-copy: :meth:`payload_target` returns where to ``recv_into``.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# np.unique imports numpy.ma on its first call (numpy 2): 50-65 ms measured on an H100 host, inside the first lossy
# round's receive step, which held back this rank's own datagram sends until the peer's 50 ms deadline had passed
import numpy.ma  # noqa: F401
import torch

from dgt import wire
from dgt.errors import WireError
from dgt.layout import BucketLayout
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.datagram_rows import scatter_rows
from dgt.protocol.deadline import AdaptiveGrace, DeadlinePolicy, DeadlineState
from dgt.protocol.geometry import Geometry
from dgt.protocol.report import Timing, encode_timing
from dgt.protocol.stats import ReceiverCounters, RoundStats
from dgt.wire import Flags, FrameType

Key = tuple[int, int, int]  # (sender rank, bucket, round)
# (key, numel, dtype) -> a caller-owned contiguous CPU tensor to reassemble into, or None for a fresh one
Allocator = Callable[[Key, int, torch.dtype], "torch.Tensor | None"]


HUGE_BYTES = 4 << 20  # fresh buffers from this size on are anonymous mappings advised to use transparent huge pages


def zeroed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the kernel zeroes on first touch: no memset pass over the bucket before its first
    byte arrives (torch.zeros touches every page up front, which costs as much as receiving a large bucket).

    Large buffers are anonymous mappings advised MADV_HUGEPAGE: first touch then faults one 2 MiB page at a time
    instead of one 4 KiB page, which made a fresh 100 MB round's receive cost ~200 ms of page faults (measured);
    where the kernel has no transparent huge pages the advice is a no-op (or refused) and this is calloc's cost."""
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_BYTES or _MADV_HUGEPAGE is None:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(_MADV_HUGEPAGE)
    except OSError:
        pass  # no THP on this kernel: plain pages, still zero-filled on demand
    return torch.from_numpy(np.frombuffer(m, dtype=np.uint8)).view(dtype)  # the array keeps the mapping alive


_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


@lru_cache(maxsize=64)
def _timing(r: _Round) -> Timing:
    """The drop report's timing trailer: what arrived on the unreliable lanes and when (dgt.protocol.report)."""
    unimp = [ls for lane, ls in r.stats.lanes.items() if lane > 0]
    return Timing(sum(ls.frames for ls in unimp), r.first_arrival, r.last_arrival, r.stats.deadline_wait,
                  sum(ls.bytes for ls in unimp))


def _layout(sizes: tuple[int, ...], block: int) -> BucketLayout:
    """Layouts by geometry: a bucket keeps its shape round after round (bounded: sizes come off the wire)."""
    return BucketLayout(list(sizes), block)


@dataclass
class RoundDone:
    """A finalised round: the tensor (zeros where blocks were lost), the per-block received mask, the statistics,
    and the DROP_REPORT frame to send back to the sender on the reliable lane."""

    sender: int
    bucket: int
    round: int
    data: torch.Tensor
    mask: torch.Tensor
    stats: RoundStats
    report: bytes | None  # the DROP_REPORT frame for the sender; None when the sender asked for none
    layout: BucketLayout
    codec: int = 0  # the ROUND_BEGIN header's codec byte (a collective's call code: its op)


@dataclass
class DropReportIn:
    """A drop report from a peer, for this endpoint's sender."""

    frame: wire.Frame


def _reencode(f: wire.Frame) -> bytes:
    """A frame back to bytes (for the early buffer: frames that overtook their round's ROUND_BEGIN)."""
    h = wire.headers(1)
    h[0] = (wire.MAGIC, wire.VERSION, f.ftype, f.flags, f.dtype, f.codec, f.lane, f.token, f.rank, f.round,
            f.bucket, f.block, f.offset, f.count, len(f.payload))
    return h.tobytes() + bytes(f.payload)


_KEY_BYTES = slice(16, 28)  # rank, round, bucket: adjacent in the header (docs/protocol.md)


def _group_by_round(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (rank, bucket, round) keys of a header batch and each header's key index; the common case of one
    key is one comparison of the 12 key bytes of every header with the first's (the row-wise unique is slow)."""
    raw = h.view(np.uint8).reshape(-1, wire.HEADER_SIZE)[:, _KEY_BYTES]
    if len(h) and bool((raw == raw[0]).all()):
        one = np.array([[int(h["rank"][0]), int(h["bucket"][0]), int(h["round"][0])]], dtype=np.int64)
        return one, np.zeros(len(h), dtype=np.int64)
    keys = np.stack([h["rank"].astype(np.int64), h["bucket"].astype(np.int64), h["round"].astype(np.int64)], 1)
    ukeys, inv = np.unique(keys, axis=0, return_inverse=True)
    return ukeys, inv.reshape(-1)


def _first_of(ids: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """A mask with True at exactly one position per distinct value of ``ids`` (all < len(scratch)), in O(n) with no
    sort: each position writes its index into ``scratch[id]``, and the position whose index stuck is the one kept."""
    at = np.arange(len(ids), dtype=scratch.dtype)
    scratch[ids] = at
    return scratch[ids] == at


class _Round:
    def __init__(
        self,
        key: Key,
        layout: BucketLayout,
        frag: int,
        dtype: wire.WireDType,
        codec: int,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.key = key
        self.layout = layout
        self.geom = Geometry(layout, frag)
        self.dtype = dtype
        self.codec = codec
        self.want_report = True
        self.fresh = buffer is None  # a fresh buffer is all zeros; a caller's buffer must have lost blocks zeroed
        self.data = zeroed(layout.numel, wire.TORCH_OF[dtype]) if buffer is None else buffer
        self.raw = self.data.view(torch.uint8).numpy()
        self.isz = self.data.element_size()
        nb = layout.nblocks
        self.got = np.zeros((nb, self.geom.frags_per_block), dtype=bool)
        self.nfrag = np.zeros(nb, dtype=np.int64)
        self.n_done = 0  # blocks with every fragment in (kept incrementally: no O(blocks) pass per frame)
        self.n_imp_done = 0  # of those, blocks flagged important
        self.important = np.zeros(nb, dtype=bool)
        self.lane_of = np.zeros(nb, dtype=np.int8)
        self.stats = RoundStats(sender=key[0], bucket=key[1], round=key[2], blocks=nb)
        self.end: tuple[int, int, int, int] | None = None
        self.imp_done_at: float | None = None
        self.opened_at: float | None = None  # the round's opening frame (the important blocks' rate starts here)
        self.last_arrival: float | None = None
        self.first_arrival: float | None = None  # of the unimportant datagrams (the report's timing trailer)
        self.mean_gap: float | None = None
        self.batch_gap: float | None = None  # EWMA of the time between batches (GSO/GRO make arrivals bursty)
        self.unimp_frames = 0
        self.pads: np.ndarray | None = None  # the datagram MAC's pads of this round's fragment slots (on first use)

        self._scratch: dict[str, np.ndarray] = {}

    def scratch_frag(self) -> np.ndarray:
        """Per-fragment int32 scratch for de-duplicating a batch without a sort (made on the first datagram)."""
        if "frag" not in self._scratch:
            self._scratch["frag"] = np.empty(self.got.size, np.int32)
        return self._scratch["frag"]

    def scratch_block(self) -> np.ndarray:
        if "block" not in self._scratch:
            self._scratch["block"] = np.empty(len(self.nfrag), np.int32)
        return self._scratch["block"]

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes + self.got.nbytes + 4 * (self.got.size + len(self.nfrag))

    def important_complete(self) -> bool:
        if self.end is None:
            return False
        return self.n_imp_done >= self.end[0]

    def complete(self) -> bool:
        return self.end is not None and self.n_done >= self.end[0] + self.end[1]


def _dense_wait(r: _Round, remaining: int | None) -> float | None:
    """Seconds the unimportant frames still missing would take at the rate the important blocks came in (opening
    frame to the last important block); None when that rate is unknown."""
    if remaining is None or r.opened_at is None or r.end is None or not r.end[0]:
        return None
    span = r.imp_done_at - r.opened_at
    if span <= 0:
        return None
    return remaining * r.geom.frag * r.isz * span / (r.end[0] * r.layout.block * r.isz)


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
        self.early_bytes = early_bytes
        self.early_ttl = early_ttl
        self.early_rounds_per_peer = early_rounds_per_peer
        self.max_open_bytes = max_open_bytes
        self.rounds: dict[Key, _Round] = {}
        self.closed: OrderedDict[Key, None] = OrderedDict()
        self.counters = ReceiverCounters()
        # (key, lane, bytes, datagram sizes or None for one frame, arrival): input for rounds not open yet, replayed
        # in order; bounded in bytes, in rounds per peer, and in age (forged future rounds must not wait forever)
        self._early: list[tuple[Key, int, bytes, np.ndarray | None, float]] = []
        self._early_size = 0
        self._senders: set[int] = set()  # ranks that opened rounds: the closed-round memory grows with them

    # -- helpers
    def _expire_early(self, now: float) -> None:
        """Drop early-buffer entries older than ``early_ttl`` (counted): a round whose opening never came in time
        was forged or abandoned, and must not be filled from them later."""
        if self._early and now - self._early[0][4] > self.early_ttl:  # entries are in arrival order
            keep = [e for e in self._early if now - e[4] <= self.early_ttl]
            self.counters.early_expired += len(self._early) - len(keep)
            self._early = keep
            self._early_size = sum(len(e[2]) for e in keep)

    def _admit_early(self, key: Key, nbytes: int, now: float) -> bool:
        """Whether ``nbytes`` more of round ``key`` fit the early buffer (after expiring old entries): a peer may
        hold at most ``early_rounds_per_peer`` rounds there, all peers together ``early_bytes``."""
        self._expire_early(now)
        if self._early_size + nbytes > self.early_bytes:
            return False
        rounds = {e[0] for e in self._early if e[0][0] == key[0]}
        if key not in rounds and len(rounds) >= self.early_rounds_per_peer:
            self.counters.early_refused += 1
            return False
        return True

    def _late_or_unknown(self, key: Key, lane: int, frame_bytes: bytes | None, now: float) -> None:
        if key in self.closed:
            self.counters.late += 1
            return
        if frame_bytes is not None and self._admit_early(key, len(frame_bytes), now):
            self._early.append((key, lane, frame_bytes, None, now))
            self._early_size += len(frame_bytes)
            self.counters.early_buffered += 1
        else:
            self.counters.unknown += 1

    def open_rounds(self) -> list[Key]:
        return list(self.rounds)

    def _open(self, f: wire.Frame, now: float) -> list:
        key = (f.rank, f.bucket, f.round)
        numel, block, frag, sizes = wire.decode_round_begin(f.payload, self.limits)
        layout = _layout(tuple(sizes), block)
        if key in self.closed:
            self.counters.late += 1
            return []
        if key in self.rounds:
            r = self.rounds[key]
            if r.layout != layout or r.geom.frag != frag or r.dtype != f.dtype:
                self.counters.reject("begin-mismatch")
            return []
        if sum(1 for k in self.rounds if k[0] == f.rank) >= self.limits.max_open_rounds:  # per sender (#23)
            self.counters.reject("too-many-rounds")
            return []
        self._senders.add(f.rank)
        need = numel * int(wire.ITEMSIZE[f.dtype]) + layout.nblocks * -(-block // frag)
        if sum(r.nbytes for r in self.rounds.values()) + need > self.max_open_bytes:
            self.counters.reject("memory-budget")
            return []
        self.rounds[key] = r = _Round(key, layout, frag, f.dtype, f.codec, self._buffer(key, numel, f.dtype))
        r.opened_at = now
        r.want_report = not f.flags & Flags.NO_REPORT
        events: list = []
        self._expire_early(now)
        if self._early:
            replay = [e for e in self._early if e[0] == key]
            self._early = [e for e in self._early if e[0] != key]
            self._early_size = sum(len(e[2]) for e in self._early)
            for _, lane, data, sizes, _t in replay:
                if sizes is None:
                    events += self.receive_bytes(data, lane, now)
                else:
                    batch = wire.decode_datagrams(data, sizes, self.limits, self.token)
                    events += self.receive_datagrams(batch, lane, now)
        return events

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
    def receive_bytes(self, data: bytes | bytearray | memoryview, lane: int, now: float) -> list:
        """Back-to-back frames (a datagram, or a chunk of a reliable stream). Invalid bytes are counted, not raised."""
        try:
            frames = wire.decode_frames(data, self.limits, self.token)
        except WireError as exc:
            self.counters.reject(str(exc).split(":")[0])
            return []
        events: list = []
        for f in frames:
            events += self.receive_frame(f, lane, now)
        return events

    def receive_frame(self, f: wire.Frame, lane: int, now: float) -> list:
        if f.token != self.token:
            self.counters.reject("token")
            return []
        if f.ftype == FrameType.DATA:
            return self._data_frame(f, lane, now)
        if f.ftype == FrameType.ROUND_BEGIN:
            try:
                return self._open(f, now)
            except WireError as exc:
                self.counters.reject(str(exc))
                return []
        if f.ftype == FrameType.ROUND_END:
            return self._end(f, now)
        if f.ftype == FrameType.DROP_REPORT:
            return [DropReportIn(f)]
        if f.ftype == FrameType.BULK:  # the endpoint's reader takes these off the TCP stream; never in a datagram
            self.counters.reject("bulk-not-on-stream")
        return []  # CONTROL frames belong to the endpoint

    def _end(self, f: wire.Frame, now: float) -> list:
        key = (f.rank, f.bucket, f.round)
        r = self.rounds.get(key)
        if r is None:
            self._late_or_unknown(key, 0, _reencode(f), now)
            return []
        try:
            r.end = wire.decode_round_end(f.payload)
        except WireError:
            self.counters.reject("round-end")
            return []
        return self._progress(r, now)

    def _progress(self, r: _Round, now: float) -> list:
        if r.imp_done_at is None and r.important_complete():
            r.imp_done_at = now
        if r.complete():
            return [self._finalise(r, now, "complete")]
        return []

    # -- reliable lane: one frame at a time, payload zero-copy
    def _check_run(self, r: _Round, block: int, offset: int, count: int, dtype: int) -> str | None:
        g = r.geom
        if dtype != r.dtype:
            return "dtype"
        if not 0 <= block < g.nblocks or offset != g.block_start[block] or count <= 0:
            return "offset"
        last = int(np.searchsorted(g.block_end, offset + count))
        if last >= g.nblocks or g.block_end[last] != offset + count:
            return "count"
        return None

    def payload_target(self, h: np.void, lane: int = 0) -> memoryview | None:
        """Where the payload of DATA header ``h`` (a run of whole blocks) should be received, or None to discard it."""
        key = (int(h["rank"]), int(h["bucket"]), int(h["round"]))
        r = self.rounds.get(key)
        if r is None or int(h["token"]) != self.token:
            return None
        off, cnt = int(h["offset"]), int(h["count"])
        if self._check_run(r, int(h["block"]), off, cnt, int(h["dtype"])) is not None:
            return None
        return memoryview(r.raw)[off * r.isz : (off + cnt) * r.isz]

    def commit(self, h: np.void, lane: int, now: float, landed: bool) -> list:
        """After the payload of ``h`` was read: into :meth:`payload_target` (``landed``) or into scratch (discarded)."""
        key = (int(h["rank"]), int(h["bucket"]), int(h["round"]))
        r = self.rounds.get(key)
        if r is None:
            self._late_or_unknown(key, lane, None, now)
            return []
        if not landed:
            r.stats.rejected += 1
            return []
        return self._mark_run(r, h, lane, now)

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

    def receive_runs(self, batch: wire.Batch, lane: int, now: float) -> list:
        """A batch of reliable-lane DATA runs already in memory (small frames staged together by the channel):
        validated, copied and marked in one vectorised pass, as :meth:`receive_datagrams` does for fragments."""
        h = batch.headers
        idx = self._screen(batch, fragments=False)
        if len(idx) == 0:
            return []
        src = np.frombuffer(batch.buf, np.uint8)
        ukeys, inv = _group_by_round(h[idx])
        events: list = []
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
            events += self._runs(r, h[sel], src, batch.payload_pos[sel], lane, now)
        return events

    def _runs(self, r: _Round, h: np.ndarray, src: np.ndarray, pos: np.ndarray, lane: int, now: float) -> list:
        """Check runs against the layout (start on a block start, end on a block end), copy them, mark their blocks."""
        g, isz, nb = r.geom, r.isz, r.geom.nblocks
        blk = h["block"].astype(np.int64)
        off = h["offset"].astype(np.int64)
        cnt = h["count"].astype(np.int64)
        b = np.where(blk < nb, blk, 0)
        last = np.searchsorted(g.block_end, off + cnt)
        lastc = np.minimum(last, max(nb - 1, 0))
        good = (
            (blk < nb) & (h["dtype"] == r.dtype) & (cnt > 0) & (off == g.block_start[b]) & (last < nb)
            & (g.block_end[lastc] == off + cnt)
        )  # fmt: skip
        r.stats.rejected += int((~good).sum())
        h, b, last, off, cnt, pos = h[good], b[good], last[good], off[good], cnt[good], pos[good]
        if len(b) == 0:
            return []
        nbytes = cnt * isz
        if (nbytes == nbytes[0]).all():
            scatter_rows(r.raw, off * isz, src, pos, int(nbytes[0]))
        else:  # runs of different lengths: one slice copy per frame
            for o, p, n in zip(off.tolist(), pos.tolist(), nbytes.tolist()):
                r.raw[o * isz : o * isz + n] = src[p : p + n]
        per = last - b + 1  # blocks per run
        first_of = np.repeat(np.cumsum(per) - per, per)
        allb = np.repeat(b, per) + (np.arange(int(per.sum())) - first_of)
        ub, first = np.unique(allb, return_index=True)
        again = np.ones(len(allb), dtype=bool)
        again[first] = False  # a block seen earlier in this batch
        dup = again | (r.nfrag[allb] >= g.frags_needed[allb])
        r.stats.duplicated += int(np.logical_or.reduceat(dup, np.cumsum(per) - per).sum())
        done_before = r.nfrag[ub] >= g.frags_needed[ub]
        imp_done_before = int((done_before & r.important[ub]).sum())
        r.nfrag[ub] = g.frags_needed[ub]
        imp = np.repeat((h["flags"] & Flags.IMPORTANT) != 0, per)
        r.important[allb[imp]] = True
        r.lane_of[allb] = lane
        r.n_done += int((~done_before).sum())
        r.n_imp_done += int(r.important[ub].sum()) - imp_done_before
        ls = r.stats.lane(lane)
        ls.frames += len(b)
        ls.bytes += int((nbytes + wire.HEADER_SIZE).sum())
        return self._progress(r, now)

    def _mark_run(self, r: _Round, h, lane: int, now: float) -> list:
        b0 = int(h["block"])
        off, cnt = int(h["offset"]), int(h["count"])
        b1 = int(np.searchsorted(r.geom.block_end, off + cnt)) + 1
        fresh = r.nfrag[b0:b1] < r.geom.frags_needed[b0:b1]
        n_fresh = int(fresh.sum())
        if n_fresh < b1 - b0:
            r.stats.duplicated += 1
        imp_done_before = int((r.important[b0:b1] & ~fresh).sum())
        r.nfrag[b0:b1] = r.geom.frags_needed[b0:b1]
        if int(h["flags"]) & Flags.IMPORTANT:
            r.important[b0:b1] = True
        r.n_done += n_fresh  # every block of the run is complete now
        r.n_imp_done += int(r.important[b0:b1].sum()) - imp_done_before
        r.lane_of[b0:b1] = lane
        ls = r.stats.lane(lane)
        ls.frames += 1
        ls.bytes += wire.HEADER_SIZE + cnt * r.isz
        return self._progress(r, now)

    def _data_frame(self, f: wire.Frame, lane: int, now: float) -> list:
        key = (f.rank, f.bucket, f.round)
        r = self.rounds.get(key)
        if r is None:
            self._late_or_unknown(key, lane, _reencode(f), now)
            return []
        if f.flags & Flags.FRAGMENT:
            if self.mac is not None:  # a lone frame has no MAC trailer to check: only datagram batches carry one
                self.counters.reject("bad-mac")
                return []
            h = wire.headers(1)
            h["flags"], h["block"], h["offset"], h["count"] = f.flags, f.block, f.offset, f.count
            h["length"], h["rank"], h["bucket"], h["round"], h["dtype"] = len(f.payload), *key, f.dtype
            src = np.frombuffer(f.payload, np.uint8)
            return self._fragments(r, h, src, np.zeros(1, np.int64), lane, now)
        problem = self._check_run(r, f.block, f.offset, f.count, f.dtype)
        if problem:
            r.stats.rejected += 1
            return []
        r.raw[f.offset * r.isz : (f.offset + f.count) * r.isz] = np.frombuffer(f.payload, np.uint8)
        h = wire.headers(1)
        h["flags"], h["block"], h["offset"], h["count"] = f.flags, f.block, f.offset, f.count
        return self._mark_run(r, h[0], lane, now)

    # -- unreliable lanes: batches of datagrams, vectorised
    def receive_datagrams(self, batch: wire.Batch, lane: int, now: float) -> list:
        """A batch of datagrams (one GRO read or several reads) from an unreliable lane."""
        h = batch.headers
        idx = self._screen(batch, fragments=True)
        if len(idx) == 0:
            return []
        src = np.frombuffer(batch.buf, np.uint8)
        every = len(idx) == len(h)  # the common case: no header to leave out, no copy of the headers
        ukeys, inv = _group_by_round(h if every else h[idx])
        events: list = []
        for j, kk in enumerate(ukeys.tolist()):
            key = (kk[0], kk[1], kk[2])
            one = len(ukeys) == 1
            sel = idx if one else idx[inv == j]
            r = self.rounds.get(key)
            if r is None:
                self._early_datagrams(key, lane, batch, sel, now)
                continue
            hsel, psel = (h, batch.payload_pos) if one and every else (h[sel], batch.payload_pos[sel])
            events += self._fragments(r, hsel, src, psel, lane, now)
        return events

    def _early_datagrams(self, key: Key, lane: int, batch: wire.Batch, sel: np.ndarray, now: float) -> None:
        """Datagrams of a round that is not open (yet): late if it closed, else kept as one block that is replayed
        through this vectorised path when its ROUND_BEGIN arrives (datagrams often overtake it)."""
        if key in self.closed:
            self.counters.late += len(sel)
            return
        hsel = batch.headers[sel]
        sizes = hsel["length"].astype(np.int64) + wire.HEADER_SIZE + ((hsel["flags"] & Flags.MAC) != 0) * wire.MAC_TAG
        total = int(sizes.sum())
        if not self._admit_early(key, total, now):
            self.counters.unknown += len(sel)
            return
        src = np.frombuffer(batch.buf, np.uint8)
        starts = batch.payload_pos[sel] - wire.HEADER_SIZE
        if (sizes == sizes[0]).all():
            n = int(sizes[0])
            rows = np.lib.stride_tricks.as_strided(src, shape=(len(src) - n + 1, n), strides=(1, 1))
            data = rows[starts].tobytes()
        else:  # odd-size tails mixed in: rare, a slice per datagram
            data = b"".join(src[a : a + n].tobytes() for a, n in zip(starts.tolist(), sizes.tolist()))
        self._early.append((key, lane, data, sizes, now))
        self._early_size += total
        self.counters.early_buffered += len(sel)

    def _fragments(self, r: _Round, h: np.ndarray, src: np.ndarray, pos: np.ndarray, lane: int, now: float) -> list:
        """Validate, de-duplicate and scatter fragments into the round buffer (vectorised over the fragments)."""
        g = r.geom
        blk = h["block"].astype(np.int64)
        off = h["offset"].astype(np.int64)
        cnt = h["count"].astype(np.int64)
        inb = blk < g.nblocks
        b = np.where(inb, blk, 0)
        rel = off - g.block_start[b]
        fidx = rel // g.frag
        good = (
            inb
            & (h["dtype"] == r.dtype)
            & (rel >= 0)
            & (rel % g.frag == 0)
            & (fidx < g.frags_needed[b])
            & (cnt == np.minimum(g.frag, g.block_end[b] - off))
        )
        if not good.all():
            r.stats.rejected += int((~good).sum())
            b, fidx, off, cnt, pos, h = b[good], fidx[good], off[good], cnt[good], pos[good], h[good]
        if self.mac is not None and len(b):  # before de-duplication: a forged copy must not shut out the genuine one
            if r.pads is None:
                g = r.geom
                r.pads = self.mac.pads(r.key[0], self.rank, r.key[1], r.key[2], g.nblocks * g.frags_per_block)
            ok = self.mac.check_fragments(h, src, pos, r.pads, b, fidx, cnt, r.geom.frag, r.isz, r.geom.frags_per_block)
            if not ok.all():
                self.counters.reject("bad-mac", int((~ok).sum()))
                r.stats.rejected += int((~ok).sum())
                b, fidx, off, cnt, pos, h = b[ok], fidx[ok], off[ok], cnt[ok], pos[ok], h[ok]
        hs = h
        if len(b) == 0:
            return []
        fresh = _first_of(b * g.frags_per_block + fidx, r.scratch_frag()) & ~r.got[b, fidx]
        if not fresh.all():
            r.stats.duplicated += int((~fresh).sum())
            b, fidx, off, cnt, pos = b[fresh], fidx[fresh], off[fresh], cnt[fresh], pos[fresh]
        if len(b):
            touched = b[_first_of(b, r.scratch_block())]
            done_before = r.nfrag[touched] >= g.frags_needed[touched]
            imp_done_before = int((done_before & r.important[touched]).sum())
            isz = r.isz
            full = cnt == g.frag
            fb = g.frag * isz
            if full.all():
                scatter_rows(r.raw, off * isz, src, pos, fb)
            elif full.any():
                scatter_rows(r.raw, off[full] * isz, src, pos[full], fb)
            for i in np.flatnonzero(~full).tolist():
                r.raw[off[i] * isz : (off[i] + cnt[i]) * isz] = src[pos[i] : pos[i] + cnt[i] * isz]
            r.got[b, fidx] = True
            np.add.at(r.nfrag, b, 1)
            r.lane_of[b] = lane
            r.important[b] |= (hs["flags"][fresh] & Flags.IMPORTANT) != 0
            done_after = r.nfrag[touched] >= g.frags_needed[touched]
            r.n_done += int(done_after.sum()) - int(done_before.sum())
            r.n_imp_done += int((done_after & r.important[touched]).sum()) - imp_done_before
        ls = r.stats.lane(lane)
        ls.frames += len(hs)
        ls.bytes += int((hs["length"].astype(np.int64) + wire.HEADER_SIZE).sum())
        k = len(hs)
        if r.last_arrival is not None:
            gap = max(now - r.last_arrival, 0.0) / k
            r.mean_gap = gap if r.mean_gap is None else 0.8 * r.mean_gap + 0.2 * gap
            span = max(now - r.last_arrival, 0.0)
            r.batch_gap = span if r.batch_gap is None else 0.8 * r.batch_gap + 0.2 * span
        r.last_arrival = now
        if r.first_arrival is None:
            r.first_arrival = now
        r.unimp_frames += k
        return self._progress(r, now)

    # -- time
    def _deadline_of(self, r: _Round) -> float | None:
        if r.imp_done_at is None:
            return None
        remaining = None if r.end is None else max(r.end[3] - r.unimp_frames, 0)
        return self.deadline.deadline(
            DeadlineState(r.imp_done_at, r.last_arrival, r.mean_gap, remaining, r.batch_gap, _dense_wait(r, remaining))
        )

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`on_time` will finalise a round (None: nothing is waiting on time)."""
        ds = [d for d in (self._deadline_of(r) for r in self.rounds.values()) if d is not None]
        return min(ds) if ds else None

    def on_time(self, now: float) -> list[RoundDone]:
        """Finalise every round whose important blocks are in and whose deadline has passed."""
        out = []
        for r in list(self.rounds.values()):
            d = self._deadline_of(r)
            if d is not None and now >= d:
                out.append(self._finalise(r, now, "deadline"))
        return out

    def abort(self, sender: int, now: float) -> list[RoundDone]:
        """Finalise every open round of ``sender`` as it stands (the peer is gone). A round whose important blocks
        were all in is as good as one closed by its deadline and closes as "sender-gone"; the others as "aborted"."""
        out = []
        for k, r in list(self.rounds.items()):
            if k[0] == sender:
                out.append(self._finalise(r, now, "sender-gone" if r.imp_done_at is not None else "aborted"))
        return out

    def _zero_blocks(self, r: _Round, sel: np.ndarray) -> None:
        """Zero the selected blocks in place: one strided scatter for full blocks, a slice per short tensor tail."""
        blocks = np.flatnonzero(sel)
        if len(blocks) == 0:
            return
        g, isz = r.geom, r.isz
        full = g.block_len[blocks] == r.layout.block
        fb = r.layout.block * isz
        if full.any():
            rows = np.lib.stride_tricks.as_strided(r.raw, shape=(len(r.raw) - fb + 1, fb), strides=(1, 1))
            rows[g.block_start[blocks[full]] * isz] = 0
        for b in blocks[~full].tolist():  # at most one short block per tensor
            r.raw[g.block_start[b] * isz : g.block_end[b] * isz] = 0

    def _finalise(self, r: _Round, now: float, why: str) -> RoundDone:
        g = r.geom
        mask = r.nfrag >= g.frags_needed
        partial = (r.nfrag > 0) & ~mask
        self._zero_blocks(r, partial if r.fresh else ~mask)
        st = r.stats
        st.important = int((mask & r.important).sum())
        st.unimportant_received = int((mask & ~r.important).sum())
        missing = g.nblocks - int(mask.sum())
        st.unsent = 0 if r.end is None else min(max(g.nblocks - r.end[0] - r.end[1], 0), missing)
        st.dropped = missing - st.unsent  # sent and lost; unsent: kept back by the sender's send budget
        st.partial = int(partial.sum())
        st.deadline_wait = 0.0 if r.imp_done_at is None else max(now - r.imp_done_at, 0.0)
        st.closed_by = why
        if why in ("complete", "deadline") and r.imp_done_at is not None and r.end is not None and r.end[1]:
            self.deadline.observe(st.deadline_wait, why == "complete")  # rounds with unimportant blocks teach it
        for lane, n in zip(*np.unique(r.lane_of[mask], return_counts=True)):
            st.lane(int(lane)).blocks = int(n)
        del self.rounds[r.key]
        self.closed[r.key] = None
        while len(self.closed) > 16 * (self.limits.max_open_rounds + len(self._senders)):
            self.closed.popitem(last=False)
        sender, bucket, round_ = r.key
        report = None
        if r.want_report or st.dropped:  # a lossless round that lost blocks would be a protocol breach: say so
            report = wire.encode_frame(
                FrameType.DROP_REPORT, np.packbits(mask).tobytes() + encode_timing(_timing(r)), token=self.token,
                rank=self.rank, round=round_, bucket=bucket, count=g.nblocks, flags=Flags.CLOSED | Flags.TIMING,
            )
        return RoundDone(sender, bucket, round_, r.data, torch.from_numpy(mask), st, report, r.layout, r.codec)
