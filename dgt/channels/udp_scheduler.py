"""Send order on the unreliable lanes: one task interleaves every round's datagram jobs, most important lane class
first, first-in first-out within a class, paced per peer, and drops a job the moment the receiver has closed its
round, so a newer round never waits behind a stale round's unimportant blocks. The pacing it applies is the sans-IO
token bucket of :mod:`dgt.protocol.pacing`, fed trio's clock here."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from dgt.channels.slot import Slot
from dgt.channels.udp import UdpChannel
from dgt.protocol.pacing import Pacer


@dataclass
class DatagramJob:
    """The datagrams one round sends to one peer on one lane: ``rows`` [k, seg] then the odd-size ``odd``."""

    peer: int
    lane: int
    bucket: int
    round: int
    rows: np.ndarray
    odd: list[bytes]
    addr: tuple
    done: Slot = field(default_factory=Slot)
    pos: int = 0
    odd_pos: int = 0
    sent: int = 0
    sent_bytes: int = 0
    abandoned: int = 0
    seq: int = 0
    # (clock when the call started, datagrams, bytes) per send call: the congestion controller's send times
    # (dgt.protocol.congestion.round_feedback)
    sends: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.rows) + len(self.odd)

    @property
    def finished(self) -> bool:
        return self.pos >= len(self.rows) and self.odd_pos >= len(self.odd)


class DatagramScheduler:
    """Owns the send side of every UDP lane channel. ``is_closed(peer, bucket, round)`` says a round is closed
    at its receiver; ``pacer_of(peer)`` gives the peer's pacer or None (unpaced)."""

    def __init__(
        self,
        channels: dict[int, UdpChannel],
        is_closed: Callable[[int, int, int], bool],
        pacer_of: Callable[[int], Pacer | None],
        step_bytes: int = 1 << 20,
        batch_bytes: int = 256 << 10,
    ) -> None:
        self.channels = channels
        self.is_closed = is_closed
        self.pacer_of = pacer_of
        self.jobs: list[DatagramJob] = []
        self.step_bytes = step_bytes
        self.batch_bytes = batch_bytes  # rows packed and sent in one step of a job (whole GSO sends)
        self._wake = trio.Event()
        self._seq = 0
        self.abandoned_jobs = 0

    def submit(self, job: DatagramJob) -> Slot:
        """Queue a job; its slot completes with the job once every datagram is sent or the job is abandoned."""
        if job.total == 0:
            job.done.set(job)
            return job.done
        self._seq += 1
        job.seq = self._seq
        self.jobs.append(job)
        self.jobs.sort(key=lambda j: (j.lane, j.seq))
        self._wake.set()
        return job.done

    def cancel(self, job: DatagramJob, error: BaseException | None = None) -> None:
        """Take ``job`` off the queue (if it is still there) and complete its slot: with the job itself, or with
        ``error`` for its waiters."""
        if job in self.jobs:
            self.jobs.remove(job)
        if error is None:
            job.done.set(job)
        else:
            job.done.fail(error)

    def fail_all(self, error: BaseException) -> None:
        """The endpoint is closing: every queued job's waiters get ``error``."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job.done.fail(error)

    def drop_peer(self, peer: int, error: BaseException) -> None:
        """Forget a failed peer's jobs; their waiters get ``error``."""
        for job in [j for j in self.jobs if j.peer == peer]:
            self.jobs.remove(job)
            job.done.fail(error)

    def poke(self) -> None:
        """Something changed (a round closed, a rate moved): re-evaluate the queue."""
        self._wake.set()

    def _abandon(self, job: DatagramJob) -> None:
        job.abandoned = job.total - job.sent
        self.jobs.remove(job)
        self.abandoned_jobs += 1
        job.done.set(job)

    def _pick(self, now: float) -> tuple[DatagramJob | None, float]:
        """The first sendable job in priority order, or the earliest time a paced one becomes sendable."""
        wake_at = math.inf
        for job in list(self.jobs):
            if self.is_closed(job.peer, job.bucket, job.round):
                self._abandon(job)
                continue
            pacer = self.pacer_of(job.peer)
            if pacer is not None:
                ready = pacer.ready_at(now)
                if ready > now:
                    wake_at = min(wake_at, ready)
                    continue
            return job, wake_at
        return None, wake_at

    async def run(self) -> None:
        while True:
            now = trio.current_time()
            job, wake_at = self._pick(now)
            if job is None:
                if wake_at == math.inf:  # nothing paced to wait for: no cancel scope (trio's cost ~10 us per scope)
                    await self._wake.wait()
                else:
                    with trio.move_on_at(wake_at):
                        await self._wake.wait()
                self._wake = trio.Event()
                continue
            budget = self.step_bytes  # several sends per scheduling step: a trio round trip costs ~GSO send
            while job is not None and budget > 0:
                try:
                    budget -= await self._send_chunk(job, now)
                except OSError as exc:  # this lane cannot send to that peer: fail the job, keep serving the others
                    if job in self.jobs:
                        self.jobs.remove(job)
                    job.done.fail(exc)
                if job.finished and job in self.jobs:
                    self.jobs.remove(job)
                    job.done.set(job)
                now = trio.current_time()
                job, _ = self._pick(now)  # priorities, closed rounds and pacing are re-checked every send
            if job is not None:  # the step's bytes are spent and more could go: let the other tasks run first
                await trio.lowlevel.checkpoint()  # (with nothing sendable the wait at the top yields)

    async def _send_chunk(self, job: DatagramJob, now: float) -> int:
        """One GSO send of rows; with the last rows also the odd-size tails (a handful), so a round's final
        datagrams leave together instead of one scheduling step later. Returns the bytes sent."""
        before, n_before = job.sent_bytes, job.sent
        try:
            await self._send_rows_then_odd(job, now)
        finally:  # what left in this call, stamped for the congestion controller (dgt.protocol.congestion)
            if job.sent > n_before:
                job.sends.append((now, job.sent - n_before, job.sent_bytes - before))
        return job.sent_bytes - before

    async def _send_rows_then_odd(self, job: DatagramJob, now: float) -> None:
        chan = self.channels[job.lane]
        pacer = self.pacer_of(job.peer)
        if job.pos < len(job.rows):
            rows = job.rows[job.pos : job.pos + self._batch_rows(job, chan, pacer, now)]
            if pacer is not None:
                pacer.consume(rows.size, now)
            await chan.send_rows(rows, job.addr)
            job.pos += len(rows)
            job.sent += len(rows)
            job.sent_bytes += rows.size
            if job.pos < len(job.rows):
                return
        while job.odd_pos < len(job.odd):
            dgram = job.odd[job.odd_pos]
            if pacer is not None:
                pacer.consume(len(dgram), now)
            await chan.send_datagram(dgram, job.addr)
            job.odd_pos += 1
            job.sent += 1
            job.sent_bytes += len(dgram)

    def _batch_rows(self, job: DatagramJob, chan: UdpChannel, pacer: Pacer | None, now: float) -> int:
        """How many of the job's rows one step packs and sends: whole GSO sends, at least one, as many as the
        pacer's tokens cover (all its burst at most) and never more than ``batch_bytes``; packing and sending a
        batch costs one Python round trip instead of one per 64 KiB send (the sends themselves stay GSO-sized)."""
        seg = job.rows.shape[1]
        per = chan.segments_per_send(seg)
        cap = max(self.batch_bytes // (per * seg), 1)
        if pacer is not None:
            cap = min(cap, max(int(pacer.tokens(now) // (per * seg)), 1))
        return per * cap
