"""Equal-size datagrams of a round as headers plus views of the bucket: nothing is copied until a send packs a batch.

The sender used to gather every unreliable fragment of a round into one fresh ``[k, seg]`` array at plan time: a
second copy of the bucket's unimportant part, and on every round a fresh allocation whose first touch page-faults
(about 100 ms of a 100 MB round's 240 ms of planning, profiled with py-spy). :class:`DatagramRows` keeps the headers
(built for the whole round with numpy in one step) and each payload's byte offset in the bucket; a send packs only the
rows it hands to the kernel, with one vectorised gather, into a small staging buffer that is reused and stays in
cache (:meth:`pack`). It still behaves like the ``[k, seg]`` uint8 array it replaces where callers read it: ``len``,
``shape``, ``size``, row indexing and iteration, slicing, ``np.asarray``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, SupportsIndex, overload

import numpy as np
import torch
from numpy.typing import DTypeLike

from dgt import wire

if TYPE_CHECKING:
    from dgt.protocol.datagram_mac import DatagramMac


def gather_rows(raw: np.ndarray, byte_offsets: np.ndarray, row_bytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """Copy equal byte ranges of ``raw`` into the rows of ``out`` with one vectorised gather (index_select over an
    overlapping strided view: one copy, no Python loop)."""
    if out is None:
        out = np.empty((len(byte_offsets), row_bytes), np.uint8)
    if len(byte_offsets) == 0:
        return out
    src = torch.from_numpy(raw)
    rows = src.as_strided((len(raw) - row_bytes + 1, row_bytes), (1, 1))
    torch.index_select(rows, 0, torch.from_numpy(np.ascontiguousarray(byte_offsets, dtype=np.int64)),
                       out=torch.from_numpy(out))
    return out


class DatagramRows:
    """``len(offsets)`` datagrams of ``HEADER_SIZE + payload`` bytes each: header ``i`` is ``headers[i]`` (uint8
    ``[k, 48]``), its payload the ``payload`` bytes of ``raw`` (the bucket as uint8) from ``offsets[i]``; with
    ``mac`` (a dgt.protocol.datagram_mac.DatagramMac) and ``pads`` (its one-time pad per datagram) each is followed
    by its 8-byte MAC trailer, computed as the datagrams are packed (in cache, batch by batch, in step with the
    sends rather than all before the first one)."""

    __slots__ = ("headers", "raw", "offsets", "payload", "_rows", "mac", "pads")

    def __init__(self, headers: np.ndarray, raw: np.ndarray, offsets: np.ndarray, payload: int,
                 mac: DatagramMac | None = None, pads: np.ndarray | None = None) -> None:
        if headers.ndim != 2 or headers.shape[1] != wire.HEADER_SIZE or len(headers) != len(offsets):
            raise ValueError("headers must be [k, HEADER_SIZE] uint8, one per payload offset")
        if len(offsets) and (int(offsets.min()) < 0 or int(offsets.max()) + payload > len(raw)):
            raise ValueError("a payload reaches outside the bucket")
        self.headers = headers
        self.raw = raw
        self.offsets = offsets
        self.payload = payload
        self._rows = byte_rows(raw, payload)  # every payload-sized row of the bucket (a view, made once)
        if mac is not None and (pads is None or len(pads) != len(offsets)):
            raise ValueError("a MAC needs one pad per datagram")
        self.mac, self.pads = mac, pads

    def _part(self, i: slice) -> DatagramRows:
        """Rows ``i`` of these (checked already: no second pass over the offsets, no new strided view)."""
        part = object.__new__(DatagramRows)
        part.headers, part.raw, part.offsets = self.headers[i], self.raw, self.offsets[i]
        part.payload, part._rows = self.payload, self._rows
        part.mac, part.pads = self.mac, None if self.pads is None else self.pads[i]
        return part

    @property
    def seg(self) -> int:
        return wire.HEADER_SIZE + self.payload + (0 if self.mac is None else wire.MAC_TAG)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.offsets), self.seg)

    @property
    def size(self) -> int:
        return len(self.offsets) * self.seg

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: slice) -> DatagramRows: ...
    @overload
    def __getitem__(self, i: SupportsIndex) -> np.ndarray: ...

    def __getitem__(self, i: SupportsIndex | slice) -> DatagramRows | np.ndarray:
        if isinstance(i, slice):
            return self._part(i)
        j = operator.index(i)
        j = j + len(self) if j < 0 else j
        if not 0 <= j < len(self):
            raise IndexError(f"datagram {i} of {len(self)}")
        row: np.ndarray = self.pack(np.empty((1, self.seg), np.uint8), j)[0]
        return row

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        out = self.pack(np.empty(self.shape, np.uint8))
        return out if dtype is None else out.astype(dtype)

    def pack(self, out: np.ndarray, start: int | None = None) -> np.ndarray:
        """The datagrams (all, or just row ``start``) packed back to back into ``out`` (``[>= k, seg]`` uint8):
        the headers with one copy, the payloads with one gather. Returns the filled ``[k, seg]`` prefix."""
        pads = self.pads
        if start is None:
            h, offs = self.headers, self.offsets
        else:
            h, offs = self.headers[start : start + 1], self.offsets[start : start + 1]
            pads = None if pads is None else pads[start : start + 1]
        k = len(offs)
        if out.ndim != 2 or out.shape[1] != self.seg or len(out) < k:
            raise ValueError(f"staging buffer {out.shape} cannot hold {k} datagrams of {self.seg} bytes")
        dst = out[:k]
        dst[:, : wire.HEADER_SIZE] = h
        # numpy, not torch's index_select: a batch is small (<= 64 KiB), and index_select into this strided
        # destination ran 20x slower with more than one torch thread on a loaded 2-core host (measured)
        end = wire.HEADER_SIZE + self.payload
        dst[:, wire.HEADER_SIZE : end] = self._rows[offs]
        if self.mac is not None and pads is not None:
            self.mac.tag_rows(dst, end, pads)
        return dst


def byte_rows(buf: np.ndarray, row_bytes: int, step: int = 1, start: int = 0, count: int | None = None) -> np.ndarray:
    """A read/write ``[count, row_bytes]`` view of uint8 ``buf`` whose row ``i`` starts at byte ``start + i*step``
    (rows overlap when ``step < row_bytes``); by default every row that fits."""
    if count is None:
        count = max((len(buf) - start - row_bytes) // step + 1, 0)
    return np.lib.stride_tricks.as_strided(buf[start:], shape=(count, row_bytes), strides=(step, 1))


def scatter_rows(dst: np.ndarray, dst_off: np.ndarray, src: np.ndarray, src_pos: np.ndarray, row_bytes: int) -> None:
    """``dst[dst_off[i] : +row_bytes] = src[src_pos[i] : +row_bytes]`` for every ``i`` with one vectorised copy.

    When the source rows are evenly spaced (a GRO read of equal datagrams, or a run of them: the common case) they
    are read through a strided view, so the payloads go from the receive buffer into the bucket in one pass, with
    no temporary; otherwise they are gathered first (one more copy of the batch, still no Python loop). Offsets must
    be in range (the receiver checked them against the round's geometry)."""
    n = len(src_pos)
    if n == 0:
        return
    p0 = int(src_pos[0])
    step = int(src_pos[1]) - p0 if n > 1 else row_bytes
    if step > 0 and (n == 1 or bool((src_pos - p0 == step * np.arange(n)).all())):
        rows = byte_rows(src, row_bytes, step, p0, n)
    else:
        rows = byte_rows(src, row_bytes)[src_pos]
    byte_rows(dst, row_bytes)[dst_off] = rows
