"""Send order on the reliable lane (the TCP channel's writer): one writer task per connection, urgent frames
(round openings, drop reports, control) ahead of bulk data, bulk data first-in first-out at frame granularity."""

from __future__ import annotations

from collections import deque

import trio

from dgt.channels.slot import Slot
from dgt.channels.tcp import TcpChannel
from dgt.errors import PeerClosed


class ReliableWriter:
    """Queues frames for one :class:`TcpChannel`. A queued item is a list of buffers sent back to back; its slot
    (if any) is set once the kernel took its last byte. After a failure every queued and future slot fails."""

    def __init__(self, chan: TcpChannel) -> None:
        self.chan = chan
        self._urgent: deque[tuple[list, Slot | None]] = deque()
        self._bulk: deque[tuple[list, Slot | None]] = deque()
        self._wake = trio.Event()
        self._error: BaseException | None = None
        self.frames = 0

    def push(self, bufs: list, *, urgent: bool = False, slot: Slot | None = None) -> Slot | None:
        if self._error is not None:
            if slot is not None:
                slot.fail(self._error)
            return slot
        (self._urgent if urgent else self._bulk).append((bufs, slot))
        self._wake.set()
        return slot

    def push_frames(self, frames: list[tuple[bytes, memoryview]], *, urgent: bool = False) -> Slot:
        """Queue (header, payload) frames; the returned slot completes when the last one is written."""
        done = Slot()
        if not frames:
            done.set()
            return done
        for i, (hdr, payload) in enumerate(frames):
            self.push([hdr, payload], urgent=urgent, slot=done if i == len(frames) - 1 else None)
        return done

    def _take(self, max_bufs: int = 64, small: int = 64 << 10) -> tuple[list, list[Slot]]:
        """Queued items for one send: urgent first, then bulk, up to ``max_bufs`` buffers (IOV_MAX is 1024). Only
        small items join a batch, so an urgent frame queued meanwhile still waits behind at most one large frame."""
        bufs: list = []
        slots: list[Slot] = []
        for q in (self._urgent, self._bulk):
            while q and (not bufs or (len(bufs) + len(q[0][0]) <= max_bufs and _nbytes(q[0][0]) <= small)):
                item, slot = q.popleft()
                bufs += item
                self.frames += 1
                if slot is not None:
                    slots.append(slot)
        return bufs, slots

    @property
    def queued(self) -> int:
        return len(self._urgent) + len(self._bulk)

    def fail(self, error: BaseException) -> None:
        """Fail every queued item and refuse new ones."""
        if self._error is None:
            self._error = error
        for q in (self._urgent, self._bulk):
            while q:
                _, slot = q.popleft()
                if slot is not None:
                    slot.fail(error)
        self._wake.set()

    async def run(self) -> None:
        """Write queued items until failure (raises the channel's error after failing the queue). Items queued
        together go out in one scatter-gather send (urgent ones first), so a round's frames cost one syscall, not
        one each."""
        try:
            while self._error is None:
                if not self._urgent and not self._bulk:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                bufs, slots = self._take()
                waits = self.chan.waits
                try:
                    await self.chan.send_buffers(bufs)
                except BaseException as exc:
                    for slot in slots:
                        slot.fail(exc if isinstance(exc, Exception) else PeerClosed("the connection writer stopped"))
                    raise
                for slot in slots:
                    slot.set()
                if self.chan.waits == waits:  # the kernel took it all at once: yield to the others now and then
                    await trio.lowlevel.checkpoint()
        except BaseException as exc:
            self.fail(exc if isinstance(exc, Exception) else PeerClosed("the connection writer stopped"))
            raise


def _nbytes(bufs: list) -> int:
    return sum(memoryview(b).nbytes for b in bufs)
