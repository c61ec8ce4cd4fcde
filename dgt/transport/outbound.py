"""What leaves (part of :class:`dgt.transport.endpoint.Endpoint`): the send APIs, framing a round into reliable
frames and datagram jobs (the datagram scheduler is this part's), pacing and the drop reports that steer it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import trio

from dgt import wire
from dgt.channels.slot import Slot
from dgt.channels.udp import UdpChannel
from dgt.channels.udp_scheduler import DatagramJob, DatagramScheduler
from dgt.errors import (
    InputRejected,
    PeerClosed,
    PeerTimeout,
    ProtocolError,
    RankMismatch,
    WireError,
    open_nursery,
    shape_mismatch,
)
from dgt.layout import BucketLayout
from dgt.protocol.bulk import bulk_frames
from dgt.protocol.congestion import round_feedback
from dgt.protocol.cpu_gate import CpuGate
from dgt.protocol.pacing import Pacer
from dgt.protocol.sender import DropInfo, RoundPlan
from dgt.protocol.stats import lane_counts
from dgt.transport import control
from dgt.transport.checks import check_classes
from dgt.transport.links import Links
from dgt.transport.records import Link, SendTrack
from dgt.transport.session import Key, Session
from dgt.transport.stats import SendStats

BYTES_BUCKET = 0xFFFF0000  # buckets at and above this id carry send_bytes messages (tag in the low 16 bits)


class PendingSend:
    """A lossless message queued by :meth:`Endpoint.post_send`; the writer task sends it while the caller goes on."""

    __slots__ = ("stats", "_slot", "_t0", "_pacer")

    def __init__(self, stats: SendStats, slot: Slot, t0: float, pacer: Pacer | None) -> None:
        self.stats = stats
        self._slot = slot
        self._t0 = t0
        self._pacer = pacer

    @property
    def done(self) -> bool:
        return self._slot.done

    async def wait(self, timeout: float | None = None) -> SendStats:
        """Once the kernel took the last byte: the message's stats (``elapsed`` counts to this return). PeerClosed
        if the connection failed first; PeerTimeout after ``timeout``."""
        st = self.stats
        try:
            with trio.fail_after(timeout) if timeout else nullcontext():
                await self._slot.wait()
        except trio.TooSlowError:
            raise PeerTimeout(f"round {st.round} of bucket {st.bucket} to rank {st.peer}: not sent in "
                              f"{timeout} s") from None  # fmt: skip
        st.elapsed = trio.current_time() - self._t0
        st.pace_rate = None if self._pacer is None else self._pacer.rate
        return st


class Outbound:
    """The send APIs, drop reports, congestion feedback and the send budget: ``sending`` (the rounds on their way,
    by key, until their drop report), ``scheduler`` (the UDP lanes' datagrams), the send counters per lane."""

    def __init__(self, session: Session, links: Links, udp: dict[int, UdpChannel]) -> None:
        self.session = session
        self.cfg = session.cfg
        self.rank = session.rank
        self.token = session.token
        self.receiver = session.receiver
        self.links = links
        self.sending: dict[Key, SendTrack] = {}
        self.scheduler = DatagramScheduler(udp, links.round_closed, links.pacer_of)
        self._bytes_tx: dict[tuple[int, int], int] = {}
        self.tx_abandoned: dict[int, int] = dict.fromkeys(udp, 0)
        self.tx_unsent: dict[int, int] = dict.fromkeys(udp, 0)  # blocks the send budget kept back
        self.tx_lost: dict[int, int] = dict.fromkeys(udp, 0)  # blocks sent that the peers reported missing
        links.watch(self)
        links.on(control.STALE, self._on_stale)

    def peer_failed(self, rank: int, error: BaseException, closed: bool) -> None:
        """(:class:`~dgt.transport.links.PeerWatcher`) the rounds to ``rank`` fail; a closed link stops its
        datagrams and forgets the rounds nobody waits for."""
        if closed:
            self.scheduler.drop_peer(rank, error)
        for key in [k for k in self.sending if k[0] == rank]:
            track = self.sending[key]
            track.report.fail(error)
            if closed and track.detached:
                del self.sending[key]

    def close(self, error: BaseException) -> None:
        """The endpoint is closing: every round on its way fails with ``error``."""
        for track in list(self.sending.values()):
            track.report.fail(error)
        self.scheduler.fail_all(error)

    def _on_stale(self, link: Link, msg: dict[str, Any]) -> None:
        """A receiver refused one of our rounds (control STALE): its send fails with the reason."""
        key = (link.rank, int(msg.get("bucket", -1)), int(msg.get("round", -1)))
        track = self.sending.get(key)
        if track is None:
            return
        if msg.get("why") == "mismatch":  # the receiver refused the round (issue 45)
            detail = str(msg.get("detail", ""))[:2000]
            track.report.fail(RankMismatch(shape_mismatch(key[2]), remote=link.rank, detail=detail))
        else:
            why = str(msg.get("why", "already closed"))
            hint = ": round keys must not be reused" if why == "already closed" else ""
            what = f"round {key[2]} of bucket {key[1]} was {why} at rank {link.rank}{hint}"
            track.report.fail(ProtocolError(what))
        for job in track.jobs:
            self.scheduler.cancel(job)

    def on_drop_report(self, frame: wire.Frame) -> None:
        """A receiver closed one of our rounds: fold its losses into error feedback, steer pacing, stop sending."""
        peer = frame.rank
        link = self.links.table.get(peer)
        if link is None:
            self.receiver.counters.reject("report-from-stranger")
            return
        try:
            info = link.sender.on_drop_report(frame)
        except WireError:
            self.receiver.counters.reject("drop-report")
            return
        track = self.sending.get((peer, frame.bucket, frame.round))
        if track is not None:
            self.account_report(link, track, info)
            track.report.set(info)
            if track.detached:
                del self.sending[(peer, frame.bucket, frame.round)]
        if info.folded_elems:
            link.dirty.add(frame.bucket)
        self.scheduler.poke()

    def account_report(self, link: Link, track: SendTrack, info: DropInfo) -> None:
        """Per-lane loss counts; the congestion controller's feedback and the round window of the send budget."""
        if info.lost_mask is not None and info.missing_blocks and track.cls is not None:
            for lane, n in lane_counts(track.cls[info.lost_mask]).items():
                self.tx_lost[lane] = self.tx_lost.get(lane, 0) + n
        if link.pacer is None or link.pacer.cc is None or info.timing is None or not track.jobs:
            return
        now = trio.current_time()
        t = info.timing
        sends = [s for job in track.jobs for s in job.sends]  # one entry per GSO call, not per datagram
        planned = sum(job.rows.size + sum(map(len, job.odd)) for job in track.jobs)
        # a hop round's budget window is what its important blocks took on the stream lane, measured where they were
        # sent: from the round's start to the report it also holds the hop's planning, the peer's landing and the
        # report's trip back through a busy trio thread, several times the transfer (a budget for that long sends
        # datagrams that arrive long after the important blocks, and the receiver holds the hop open for them). Its
        # slowdown still reads the whole round, which more datagrams make longer on a CPU-bound host.
        slowdown = link.window.observe(now - track.t0, t.wait, info.bucket, now, planned, track.window)
        link.pacer.on_feedback(round_feedback(sends, t, link.pacer.cc.base.value, planned, slowdown), now)

    async def send_round(
        self,
        peer: int,
        bucket: int,
        round: int,
        flat: torch.Tensor,
        layout: BucketLayout | None = None,
        cls: torch.Tensor | int = 0,
        order: torch.Tensor | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,
        op: int = 0,
    ) -> SendStats:
        """Send one round of ``bucket`` to ``peer``: blocks of class 0 over TCP (with the round's opening and
        closing frames), class k >= 1 over UDP lane k in ``order`` (most important first). ``cls=0`` sends
        everything reliably (lossless). With ``wait`` (default) returns once the receiver's drop report is in,
        so the stats say what was lost and error feedback has already folded it in; otherwise once every frame
        was handed to the kernel (the bucket is then copied, since error feedback needs it later). ``op``: a
        collective's call code (its reduce op), carried in the frame headers' codec byte: the receiver's
        ``RoundResult.codec``.
        The hops of a lossy ring plan their rounds with :meth:`HopRounds.plan` instead (dgt.transport.hop_round)."""
        if not 0 <= bucket < BYTES_BUCKET:
            raise ValueError(f"bucket ids must be in [0, {BYTES_BUCKET:#x}); higher ids carry send_bytes")
        return await self._send(peer, bucket, round, flat, layout, cls, order, wait, timeout, op)

    @staticmethod
    async def _jobs_done(track: SendTrack) -> None:
        for job in track.jobs:
            try:
                await job.done.wait()
            except OSError:
                pass  # the lane could not send: those datagrams are lost, the deadline covers them

    async def _jobs_until_report(self, track: SendTrack) -> None:
        """Wait for the round's datagrams, or for its drop report, whichever comes first: once the receiver has
        closed the round the datagrams still queued (a pacer slowed by loss) are abandoned, not waited for. Waiting
        for them outlived a receiver that had reported and closed its endpoint (PeerClosed on a finished round).
        A report and the peer's goodbye read in one pass fail the queued datagrams (the link closed) before this task
        runs again: a round already reported is complete all the same (seen under load, `dgt bench transport`)."""
        async with open_nursery() as nursery:
            async def on_report() -> None:
                try:
                    await track.report.wait()
                except Exception:
                    pass  # a failed report: the caller reads it from the slot (one error, not a group of two)
                finally:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(on_report)
            try:
                await self._jobs_done(track)
            except PeerClosed:
                # the report came in, then the peer closed (it had reported, so it may): its goodbye failed the
                # jobs still queued in the same scheduler batch as the report woke on_report. Not an error.
                if not track.report.done or track.report.error is not None:
                    raise
            nursery.cancel_scope.cancel()

    async def _send(self, peer: int, bucket: int, round: int, flat: torch.Tensor, layout: BucketLayout | None,
                    cls: torch.Tensor | int, order: torch.Tensor | None, wait: bool, timeout: float | None,
                    op: int = 0) -> SendStats:
        link = self.links.link(peer)
        t0 = trio.current_time()
        flat = flat.detach().reshape(-1)
        if flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to("cpu").contiguous()
        layout = layout or self.session.layout(flat.numel())
        if flat.numel() != layout.numel:
            raise InputRejected(f"bucket has {flat.numel()} elements, its layout {layout.numel}")
        check_classes(cls, order, layout)
        key = (peer, bucket, round)
        if key in self.sending and not self.sending[key].detached:
            raise ValueError(f"round {round} of bucket {bucket} to rank {peer} is already in flight")
        lossless = (cls == 0) if isinstance(cls, int) else not bool((cls != 0).any())
        if lossless and not wait:  # no report to wait for: no round state at all (BULK frames)
            return await self.post_send(peer, bucket, round, flat, op=op).wait(timeout)
        quiet = lossless and not wait  # nothing to learn from a report nobody waits for: ask for none
        plan, copy = self.plan_round(link, bucket, round, flat, layout, cls, order, lossless, wait, op)
        stats = SendStats(peer, bucket, round, plan.important_blocks, plan.unimportant_blocks,
                          len(plan.reliable), plan.reliable_bytes, copied=copy,
                          unsent_blocks=plan.unsent_blocks, unsent_bytes=plan.unsent_bytes)  # fmt: skip
        for lane, n in plan.unsent_lanes.items():
            self.tx_unsent[lane] = self.tx_unsent.get(lane, 0) + n
        if plan.unsent_blocks and self.cfg.error_feedback:
            link.dirty.add(bucket)  # the blocks kept back are in the residual: the next round adds it
        track = self.sending[key] = SendTrack(t0=t0, cls=plan.cls)
        finished = False
        try:
            with trio.fail_after(timeout) if timeout else nullcontext():
                begin = link.writer.push_frames(plan.reliable[:1], urgent=True)
                rest = link.writer.push_frames(plan.reliable[1:])
                if link.pacer is not None:  # pace_shared: the TCP bytes come off the budget the datagrams draw from
                    link.pacer.charge_reliable(plan.reliable_bytes, trio.current_time())
                await begin.wait()  # datagrams only after the round's opening frame is on the wire
                for lane in sorted(set(plan.datagrams) | set(plan.odd)):
                    rows = plan.datagrams.get(lane, np.zeros((0, 1), np.uint8))
                    job = DatagramJob(peer, lane, bucket, round, rows, plan.odd.get(lane, []),  # type: ignore[arg-type]
                                      link.udp_addrs[lane - 1])  # (rows: DatagramRows too; scheduler/ says ndarray)
                    track.jobs.append(job)
                    self.scheduler.submit(job)
                await rest.wait()
                await (self._jobs_until_report(track) if wait else self._jobs_done(track))
                if wait:
                    info = await track.report.wait()
                    stats.report = True
                    stats.lost_blocks, stats.folded_elems = info.missing_blocks, info.folded_elems
            finished = True
        except trio.TooSlowError:
            raise PeerTimeout(f"round {round} of bucket {bucket} to rank {peer}: not done in {timeout} s") from None
        finally:
            self._send_over(key, track, stats, keep=not (wait or not finished or track.report.done or quiet))
        self.session.stats.rounds_sent += 1
        stats.elapsed = trio.current_time() - t0
        stats.pace_rate = None if link.pacer is None else link.pacer.rate
        return stats

    def _send_over(self, key: tuple[int, int, int], track: SendTrack, stats: SendStats, keep: bool) -> None:
        """A round's send is over (done, failed or cancelled): its datagram jobs counted into ``stats`` (and those
        still queued stopped), its track kept for the drop report to come (``keep``) or dropped."""
        for job in track.jobs:
            lane = job.lane
            stats.datagrams[lane] = stats.datagrams.get(lane, 0) + job.sent
            stats.datagram_bytes[lane] = stats.datagram_bytes.get(lane, 0) + job.sent_bytes
            stats.abandoned[lane] = stats.abandoned.get(lane, 0) + job.abandoned
            self.tx_abandoned[lane] = self.tx_abandoned.get(lane, 0) + job.abandoned
            if not job.done.done:  # cancelled mid-round: stop its datagrams
                self.scheduler.cancel(job, PeerClosed("send cancelled"))
        if keep:
            track.detached = True  # the drop report removes it (pacing still wants the loss estimate)
        elif self.sending.get(key) is track:
            del self.sending[key]

    def plan_round(self, link: Link, bucket: int, round: int, flat: torch.Tensor, layout: BucketLayout,
                    cls: torch.Tensor | int, order: torch.Tensor | None, lossless: bool, wait: bool, op: int,
                    stage: Callable[[torch.Tensor], None] | None = None,
                    gate: CpuGate | None = None) -> tuple[RoundPlan, bool]:
        """The round's plan under the link's send budget (zero while ``gate`` is closed), and whether it sends from
        a private copy."""
        quiet = lossless and not wait  # nothing to learn from a report nobody waits for: ask for none
        budget: int | None = None  # only with error feedback, which carries the blocks kept back (else: lost)
        if not lossless and self.cfg.error_feedback and link.pacer is not None and link.pacer.cc is not None:
            debt = link.pacer.debt(trio.current_time())
            if link.pacer.shared is not None:  # the round's important bytes go first on the budget TCP shares
                debt += _important_bytes(cls, layout, flat.element_size())
            budget = link.window.budget(link.pacer.rate, debt)
            if gate is not None and not gate.admit():
                budget = 0
        if stage is not None:  # residual, pack and private copy in one pass (RoundSender.plan_split)
            link.dirty.discard(bucket)
            return link.sender.plan_split(bucket, round, flat, layout, cls, order, not quiet, budget, op,
                                          stage)[0], True
        # Copy only when needed: to add a non-zero residual, or to keep the bucket for a report we do not wait for.
        copy = self.cfg.error_feedback and (bucket in link.dirty or (not wait and not lossless))
        link.dirty.discard(bucket)
        if copy and flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.is_contiguous():
            # the copy, the residual added and the blocks the budget keeps back folded, in one pass
            return link.sender.plan_split(bucket, round, flat, layout, cls, order, not quiet, budget, op,
                                          None)[0], True
        data = link.sender.prepare(bucket, flat) if copy else flat
        return link.sender.plan(bucket, round, data, layout, cls, order, report=not quiet, budget=budget,
                                codec=op), copy

    def post_send(self, peer: int, bucket: int, round: int, flat: torch.Tensor, op: int = 0) -> PendingSend:
        """Queue round ``round`` of ``bucket`` to ``peer`` losslessly, without waiting: it goes out as BULK frames
        (see dgt.protocol.bulk) behind whatever the connection's writer already holds, and lands on the peer like a
        complete round (``recv_round``). ``flat`` is sent from in place: leave it unchanged until
        :meth:`PendingSend.wait` returned. A bucket whose residual holds folded losses is sent with that residual
        added (from a copy), as ``send_round`` would. Nothing here awaits, so a caller can start a send and a
        receive from one task (a ring hop) without spawning one."""
        if not 0 <= bucket < BYTES_BUCKET:
            raise ValueError(f"bucket ids must be in [0, {BYTES_BUCKET:#x}); higher ids carry send_bytes")
        link = self.links.link(peer)
        t0 = trio.current_time()
        flat = flat.detach().reshape(-1)
        if flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to("cpu").contiguous()
        copied = self.cfg.error_feedback and bucket in link.dirty
        if copied:
            flat = link.sender.prepare(bucket, flat)
            link.dirty.discard(bucket)
        frames = bulk_frames(self.token, self.rank, bucket, round, flat, self.cfg.sockets.reliable_frame_bytes, op)
        nblocks = self.session.layout(flat.numel()).nblocks
        stats = SendStats(peer, bucket, round, nblocks, 0, len(frames),
                          flat.numel() * flat.element_size() + len(frames) * wire.HEADER_SIZE, copied=copied)
        slot = link.writer.push_frames(frames)
        if link.pacer is not None:  # pace_shared: the TCP bytes come off the budget the datagrams draw from
            link.pacer.charge_reliable(stats.reliable_bytes, t0)
        self.session.stats.rounds_sent += 1
        return PendingSend(stats, slot, t0, link.pacer)

    async def send_bytes(self, peer: int, data: bytes | bytearray | memoryview, tag: int = 0) -> None:
        """Send a message losslessly (all TCP); messages with the same tag arrive in order at recv_bytes."""
        if not 0 <= tag < 1 << 16:
            raise ValueError("tag must be in [0, 65536)")
        seq = self._bytes_tx.get((peer, tag), 0)
        self._bytes_tx[(peer, tag)] = seq + 1
        buf = bytearray(data)
        t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.zeros(0, dtype=torch.uint8)
        await self._send(peer, BYTES_BUCKET | tag, seq & 0xFFFFFFFF, t, None, 0, None, True, None)

    async def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        """Lossless send of a small tensor with its shape and dtype (e.g. a model broadcast)."""
        meta = f"{wire.wire_dtype(tensor.dtype).value}:{','.join(map(str, tensor.shape))}".encode()
        await self.send_bytes(peer, meta, tag)
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        await self.send_bytes(peer, flat.view(torch.uint8).numpy().tobytes(), tag)


def _important_bytes(cls: torch.Tensor | int, layout: BucketLayout, itemsize: int) -> int:
    """Payload bytes of a round's important (class 0) blocks, before its plan: what the reliable lane will carry of
    it (one pass over the class array)."""
    if not isinstance(cls, torch.Tensor):  # one class for the whole bucket
        return layout.numel * itemsize if int(cls) == 0 else 0
    imp = cls.detach().to("cpu") == 0
    return int(layout.block_len[imp].sum()) * itemsize
