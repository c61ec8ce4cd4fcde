"""Per-round receive state of :class:`dgt.protocol.receiver.RoundReceiver`: the reassembly buffer, which fragments and
blocks are in, arrival times, and the geometry checks and batch helpers that the landing code shares."""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np

# np.unique imports numpy.ma on its first call (numpy 2): 50-65 ms measured on an H100 host, inside the first lossy
# round's receive step, which held back this rank's own datagram sends until the peer's 50 ms deadline had passed
import numpy.ma  # noqa: F401
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.events import Key
from dgt.protocol.geometry import Geometry
from dgt.protocol.stats import RoundStats

# (key, numel, dtype) -> a caller-owned contiguous CPU tensor to reassemble into, or None for a fresh one
Allocator = Callable[[Key, int, torch.dtype], "torch.Tensor | None"]


HUGE_BYTES = 4 << 20  # fresh buffers from this size on are anonymous mappings advised to use transparent huge pages


def zeroed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the kernel zeroes on first touch: no memset pass over the bucket before its first
    byte arrives (torch.zeros touches every page up front, which costs as much as receiving a large bucket).

    Large buffers are anonymous mappings advised MADV_HUGEPAGE: first touch then faults one 2 MiB page at a time
    instead of one 4 KiB page; where the kernel has no transparent huge pages the advice is a no-op (or refused) and
    this is calloc's cost. Once the tensor (and every view of it) is gone, the mapping goes to :data:`POOL`, from
    which :func:`recycled` hands it out again."""
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
    return POOL.wrap(m, dtype)


class BufferPool:
    """Receive buffers whose rounds' results were dropped, for the next rounds of the same size to land in.

    A fresh bucket-sized buffer costs its page faults on every round (first touch inside the kernel's receive copy:
    measured 15-30 ms per 100 MB on a quiet 2-core VM, 150-220 ms on a loaded one). A mapping handed out by
    :func:`zeroed` comes back here when its numpy array dies, i.e. when no tensor, view or array uses its memory any
    more (torch keeps the array alive as long as any storage made from it); at most ``keep`` wait, newest first.
    A recycled buffer is not zero: its round must zero every block it does not receive (``OpenRound.fresh`` False)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()  # finalizers run on whichever thread drops the last reference

    def wrap(self, m: mmap.mmap, dtype: torch.dtype) -> torch.Tensor:
        arr = np.frombuffer(m, dtype=np.uint8)
        weakref.finalize(arr, self._put, m)
        return torch.from_numpy(arr).view(dtype)

    def _put(self, m: mmap.mmap) -> None:
        with self._lock:
            self._free.append(m)
            if len(self._free) > self.keep:
                del self._free[: len(self._free) - self.keep]

    def take(self, nbytes: int) -> mmap.mmap | None:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # a handful at most
                if len(self._free[i]) == nbytes:
                    return self._free.pop(i)
        return None


POOL = BufferPool()
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def _field_bytes(*names: str) -> slice:
    """The byte range of adjacent header fields, from :data:`dgt.wire.HEADER_DTYPE` (no offsets written out here)."""
    fields = wire.HEADER_DTYPE.fields
    assert fields is not None
    spans = sorted((fields[n][1], fields[n][0].itemsize) for n in names)
    first, last = spans[0][0], spans[-1][0] + spans[-1][1]
    if last - first != sum(size for _, size in spans):
        raise AssertionError(f"header fields {names} are not adjacent")
    return slice(first, last)


def recycled(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A buffer of ``numel`` elements from :data:`POOL` (not zeroed), or None when none of that size is free."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_BYTES:
        return None
    m = POOL.take(nbytes)
    return None if m is None else POOL.wrap(m, dtype)


_KEY_BYTES = _field_bytes("rank", "round", "bucket")  # the round key: one comparison of 12 adjacent bytes


def group_by_round(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (rank, bucket, round) keys of a header batch and each header's key index; the common case of one
    key is one comparison of the 12 key bytes of every header with the first's (the row-wise unique is slow)."""
    raw = h.view(np.uint8).reshape(-1, wire.HEADER_SIZE)[:, _KEY_BYTES]
    if len(h) and bool((raw == raw[0]).all()):
        one = np.array([[int(h["rank"][0]), int(h["bucket"][0]), int(h["round"][0])]], dtype=np.int64)
        return one, np.zeros(len(h), dtype=np.int64)
    keys = np.stack([h["rank"].astype(np.int64), h["bucket"].astype(np.int64), h["round"].astype(np.int64)], 1)
    ukeys, inv = np.unique(keys, axis=0, return_inverse=True)
    return ukeys, inv.reshape(-1)


def first_of(ids: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """A mask with True at exactly one position per distinct value of ``ids`` (all < len(scratch)), in O(n) with no
    sort: each position writes its index into ``scratch[id]``, and the position whose index stuck is the one kept."""
    at = np.arange(len(ids), dtype=scratch.dtype)
    scratch[ids] = at
    kept: np.ndarray = scratch[ids] == at
    return kept


class OpenRound:
    """One open round: its reassembly buffer, per-fragment and per-block arrival state, statistics and timings."""

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
        self.geom = Geometry.of(layout, frag)
        self.dtype = dtype
        self.codec = codec
        self.want_report = True
        if buffer is None:
            buffer = recycled(layout.numel, wire.TORCH_OF[dtype])  # a result dropped earlier: dirty, no page faults
            self.fresh = buffer is None  # a fresh buffer is all zeros; any other must have its lost blocks zeroed
        else:
            self.fresh = False
        self.zero_lost = True  # zero the blocks that did not arrive at close (RoundReceiver.leave_lost: not)
        self.held = False  # important blocks elsewhere, not in yet (RoundReceiver.hold / important_in)
        self.data = zeroed(layout.numel, wire.TORCH_OF[dtype]) if buffer is None else buffer
        self.raw: np.ndarray = self.data.view(torch.uint8).numpy()
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
        return int(self.raw.nbytes + self.got.nbytes + 4 * (self.got.size + len(self.nfrag)))

    def important_complete(self) -> bool:
        if self.end is None or self.held:
            return False
        return self.n_imp_done >= self.end[0]

    def complete(self) -> bool:
        return self.end is not None and self.n_done >= self.end[0] + self.end[1]

    def check_run(self, block: int, offset: int, count: int, dtype: int) -> str | None:
        """Why a reliable-lane run (whole blocks, ``offset``/``count`` in elements) does not fit this round, or None."""
        g = self.geom
        if dtype != self.dtype:
            return "dtype"
        if not 0 <= block < g.nblocks or offset != g.block_start[block] or count <= 0:
            return "offset"
        last = int(np.searchsorted(g.block_end, offset + count))
        if last >= g.nblocks or g.block_end[last] != offset + count:
            return "count"
        return None


def dense_wait(r: OpenRound, remaining: int | None) -> float | None:
    """Seconds the unimportant frames still missing would take at the rate the important blocks came in (opening
    frame to the last important block); None when that rate is unknown."""
    if remaining is None or r.opened_at is None or r.end is None or not r.end[0] or r.imp_done_at is None:
        return None
    span = r.imp_done_at - r.opened_at
    if span <= 0:
        return None
    return remaining * r.geom.frag * r.isz * span / (r.end[0] * r.layout.block * r.isz)
