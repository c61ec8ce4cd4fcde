"""Lossless messages on the reliable lane without round state: BULK frames.

A wholly reliable round nobody waits a drop report for (a ring hop, a parameter pull) needs none of a round's
machinery: no ROUND_BEGIN layout, no per-block masks, no ROUND_END, no deadline, no report. It travels as BULK frames:
each carries elements ``[offset, offset+count)`` of a message of ``block`` elements, in order on one TCP stream, and
lands straight in the receiver's buffer. Sans-IO like the rest of dgt.protocol: :func:`bulk_frames` builds frames,
:class:`BulkReceiver` says where each payload goes and when a message is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dgt import wire
from dgt.errors import ProtocolError
from dgt.protocol.events import BulkDone, Event, Key
from dgt.protocol.owner import owned
from dgt.protocol.sender import raw_bytes
from dgt.wire import FrameType


def bulk_frames(token: int, rank: int, bucket: int, round: int, flat: torch.Tensor,
                frame_bytes: int, codec: int = 0) -> list[tuple[bytes, memoryview]]:
    """(header, payload view) frames for a contiguous 1-D CPU tensor; each payload at most ``frame_bytes`` (whole
    elements). An empty tensor is one frame with no payload, so the receiver still completes the message. A message
    is a handful of multi-MiB frames, so headers are packed one by one (numpy's per-call cost would dominate)."""
    isz = flat.element_size()
    n = flat.numel()
    per = max(1, frame_bytes // isz)
    dt = wire.wire_dtype(flat.dtype)
    mv = raw_bytes(flat).data
    frames = []
    for a in range(0, max(n, 1), per):
        c = min(per, n - a)
        hdr = wire.encode_header(FrameType.BULK, token=token, rank=rank, round=round, bucket=bucket, block=n,
                                 offset=a, count=c, length=c * isz, dtype=dt, codec=codec)
        frames.append((hdr, mv[a * isz : (a + c) * isz]))
    return frames


@dataclass
class BulkMessage:
    """A message being received: where it lands, how much has."""

    data: torch.Tensor  # flat
    buf: memoryview  # its bytes
    got: int = 0  # elements landed
    frames: int = 0
    opened: float = 0.0
    owned: int = 0  # bytes this receiver allocated for it (0: a posted landing buffer)
    codec: int = 0  # the header's codec byte (a collective's call code: its op), from the first frame

    @property
    def total(self) -> int:
        return self.data.numel()


@owned
class BulkReceiver:
    """Where BULK payloads go. Frames of one message must come in order and fit it; anything else is a protocol
    violation of that peer (:class:`ProtocolError`, which ends its connection with that error), since a TCP stream
    from a well-behaved sender cannot produce it. Memory stays bounded whatever a header says: at most
    ``max_open`` messages in progress per peer, and at most ``max_bytes`` of buffers this receiver allocates itself (a
    posted landing buffer is the caller's memory)."""

    def __init__(self, max_open: int, max_bytes: int,
                 landing: Callable[[Key, int, torch.dtype], torch.Tensor | None]) -> None:
        self.max_open = max_open
        self.max_bytes = max_bytes
        self.landing = landing  # a posted buffer for (key, numel, dtype), or None
        self.open: dict[Key, BulkMessage] = {}
        self.allocated = 0

    def target(self, rank: int, h: np.void, now: float) -> memoryview:
        """The bytes the payload of header ``h`` (from ``rank``, already validated) lands in."""
        key = (rank, int(h["bucket"]), int(h["round"]))
        offset, count, total = int(h["offset"]), int(h["count"]), int(h["block"])
        dtype = wire.TORCH_OF[wire.WireDType(int(h["dtype"]))]
        msg = self.open.get(key)
        if msg is None:
            if offset != 0:
                raise ProtocolError(f"rank {rank}: bulk message {key[1:]} starts at element {offset}, not 0")
            if sum(1 for k in self.open if k[0] == rank) >= self.max_open:  # per peer: a world's worth may be open
                raise ProtocolError(f"rank {rank}: more than {self.max_open} bulk messages in progress")
            data, need = self.landing(key, total, dtype), 0
            if data is None:
                need = total * int(wire.ITEMSIZE[int(h["dtype"])])
                if self.allocated + need > self.max_bytes:
                    raise ProtocolError(f"rank {rank}: bulk message of {need} bytes exceeds the receive budget "
                                        f"({self.allocated} of {self.max_bytes} bytes in use)")
                data = torch.empty(total, dtype=dtype)
                self.allocated += need
            msg = self.open[key] = BulkMessage(data, raw_bytes(data).data, opened=now, owned=need,
                                               codec=int(h["codec"]))
        elif offset != msg.got or total != msg.total or dtype != msg.data.dtype:
            raise ProtocolError(f"rank {rank}: bulk frame for elements [{offset}, {offset + count}) of {total} does "
                                f"not continue message {key[1:]} ({msg.got} of {msg.total} {msg.data.dtype} in)")
        isz = msg.data.element_size()
        return msg.buf[offset * isz : (offset + count) * isz]

    def landed(self, rank: int, h: np.void, now: float) -> list[Event]:
        """The payload of ``h`` is in place (after :meth:`target`); the message (:class:`BulkDone`) if that
        completed it."""
        key = (rank, int(h["bucket"]), int(h["round"]))
        msg = self.open[key]
        msg.got += int(h["count"])
        msg.frames += 1
        if msg.got < msg.total:
            return []
        del self.open[key]
        self._release(msg)
        nbytes = msg.data.numel() * msg.data.element_size() + msg.frames * wire.HEADER_SIZE
        return [BulkDone(key, msg.data, msg.frames, nbytes, max(now - msg.opened, 0.0), msg.codec)]

    def is_open(self, key: Key) -> bool:
        """Whether a message under ``key`` is being received."""
        return key in self.open

    def open_keys(self) -> list[Key]:
        return list(self.open)

    def abort(self, rank: int) -> None:
        """The peer is gone: forget its partial messages."""
        for key in [k for k in self.open if k[0] == rank]:
            self._release(self.open.pop(key))

    def _release(self, msg: BulkMessage) -> None:
        self.allocated -= msg.owned  # once complete (or aborted) the buffer is no longer ours to count
