"""What arrives (part of :class:`dgt.transport.endpoint.Endpoint`): each session link's reader, UDP ingress into the
sans-IO receiver, landing buffers (``post_recv``), closed rounds and lossless messages delivered to waiters or
buffered, and the deadline timer that closes rounds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import trio

from dgt import wire
from dgt.channels.framing import KEEP
from dgt.channels.slot import Slot
from dgt.channels.udp import UdpChannel
from dgt.errors import PeerClosed, PeerTimeout, RankMismatch, shape_mismatch
from dgt.protocol.datagram_decode import decode_datagrams
from dgt.protocol.events import BulkDone, DropReportIn, Event, RoundDone, RoundRefused
from dgt.protocol.stats import RoundLaneStats, RoundStats
from dgt.transport import control
from dgt.transport.deadline_timer import DeadlineTimer
from dgt.transport.links import Links
from dgt.transport.outbound import BYTES_BUCKET, Outbound
from dgt.transport.records import Link
from dgt.transport.session import Key, Session
from dgt.transport.stats import PendingRounds, RoundResult
from dgt.wire import Flags, FrameType


class Inbound:
    """UDP ingress, the links' readers, receiver feeding, landing buffers, results and the receive APIs:
    ``waiters`` (receives under way), ``results`` (closed rounds nobody awaited yet, bounded), ``landing`` (posted
    buffers), ``opened`` (when each round opened), the receive counters, and ``deadlines`` (the receiver's timer).
    It installs its landing buffers as the session's receivers' allocator."""

    def __init__(self, session: Session, links: Links, outbound: Outbound, lanes: Sequence[int]) -> None:
        self.session = session
        self.cfg = session.cfg
        self.rank = session.rank
        self.token = session.token
        self.receiver = session.receiver
        self.bulk = session.bulk
        self.links = links
        self.outbound = outbound
        c = session.cfg
        self.waiters: dict[Key, Slot] = {}
        self.results: OrderedDict[Key, RoundResult] = OrderedDict()
        self.landing: OrderedDict[Key, torch.Tensor] = OrderedDict()  # landing buffers, see post_recv
        self.opened: OrderedDict[Key, float] = OrderedDict()
        self._bytes_rx: dict[tuple[int, int], int] = {}
        self.drop_rng = np.random.default_rng(c.faults.drop_seed) if c.faults.drop_fraction > 0 else None
        self.rx_dropped_hook: dict[int, int] = dict.fromkeys(lanes, 0)
        self.lane_delivered: dict[int, list[int]] = {}
        session.receiver.allocator = self._allocate
        session.bulk.landing = self._allocate
        self.deadlines = DeadlineTimer(session.receiver, self.handle)
        links.watch(self)

    def peer_failed(self, rank: int, error: BaseException, closed: bool) -> None:
        """(:class:`~dgt.transport.links.PeerWatcher`) the receives from ``rank`` fail; a closed link frees its
        open rounds and messages."""
        for key in [k for k in self.waiters if k[0] == rank]:
            self.waiters.pop(key).fail(error)
        if closed:
            self.handle(self.receiver.abort(rank, trio.current_time()))
            self.bulk.abort(rank)

    def close(self, error: BaseException) -> None:
        """The endpoint is closing: every receive under way fails with ``error``."""
        for slot in list(self.waiters.values()):
            slot.fail(error)

    def note_opened(self, key: Key, at: float) -> None:
        """Round ``key`` opened at ``at`` (trio's clock): its receive time counts from there (bounded)."""
        self.opened[key] = at
        while len(self.opened) > self.session.bound(len(self.links.table)):
            self.opened.popitem(last=False)

    def pending_rounds(self, limit: int = 20) -> PendingRounds:
        """What this endpoint waits for (see :class:`PendingRounds`), for the error message of a stuck call."""
        return PendingRounds(list(self.waiters)[:limit], list(self.outbound.sending)[:limit],
                             list(self.results)[:limit], self.receiver.progress(limit))

    def _frame_routes(self, rank: int) -> tuple[Callable[[np.void], memoryview | object | None],
                                                Callable[[np.ndarray], np.ndarray]]:
        """For the reader of ``rank``'s link: where a frame's payload lands (``place``: the receiver's buffer for
        a data frame, the bulk receiver's for a BULK one, None to drop it, KEEP to read it into a frame), and which
        staged frames go to the receiver in one vectorised pass (``batchable``)."""
        recv = self.receiver

        def place(h: np.void) -> memoryview | object | None:
            if int(h["rank"]) != rank:
                return None  # a peer may only speak for itself
            ftype = int(h["ftype"])
            if ftype == FrameType.DATA and not int(h["flags"]) & Flags.FRAGMENT:
                return recv.payload_target(h, 0)
            if ftype == FrameType.BULK:
                return self.bulk.target(rank, h, trio.current_time())
            return KEEP

        def batchable(h: np.ndarray) -> np.ndarray:
            mask: np.ndarray = ((h["ftype"] == FrameType.DATA) & ((h["flags"] & Flags.FRAGMENT) == 0)
                                & (h["rank"] == rank))
            return mask

        return place, batchable

    async def read(self, link: Link) -> None:
        """``link``'s reader task (:meth:`Links.run`): frames into the receivers, control messages to the links."""
        recv = self.receiver
        rank = link.rank
        place, batchable = self._frame_routes(rank)
        budget = 0  # bytes handled since the last checkpoint: yield every so often, not per frame
        events: Sequence[Event] | None
        waits = link.chan.waits
        while True:
            staged = link.reader.take_staged(batchable)
            if staged is not None:  # many small data frames already in memory: one vectorised pass
                batch = wire.Batch(staged.headers, staged.payload_pos, np.zeros(len(staged), np.int8), staged.buf)
                events = recv.receive_runs(batch, 0, trio.current_time())
                if events:
                    self.handle(events)
                budget += int(staged.headers["length"].astype(np.int64).sum())
                self.deadlines.poke()  # cheap (one look at the open rounds); the next read may block
                continue
            if budget >= 1 << 20:
                budget = 0
                self.deadlines.poke()
                if link.chan.waits == waits:  # no read waited since the last time: yield to the other tasks
                    await trio.lowlevel.checkpoint()
                waits = link.chan.waits
            rf = await link.reader.next(place)
            now = trio.current_time()
            h = rf.header
            ftype = int(h["ftype"])
            events = []
            if int(h["rank"]) != rank:
                recv.counters.reject("rank-mismatch")
            elif ftype == FrameType.DATA and not int(h["flags"]) & Flags.FRAGMENT:
                events = recv.commit(h, 0, now, rf.landed)
            elif ftype == FrameType.BULK:
                events = self.bulk.landed(rank, h, now)
            elif ftype == FrameType.CONTROL:
                self.links.on_control(link, rf.frame)
            else:
                if ftype == FrameType.ROUND_BEGIN:
                    key = (rank, int(h["bucket"]), int(h["round"]))
                    self.note_opened(key, now)
                    if self.links.stream_watch.expected(key):  # (i22) the peer runs on the round path what we run on
                        self.links.stream_conflict(key)  # stream lanes (a lossy ring's held round never closes itself)
                assert rf.frame is not None  # place() keeps every frame that reaches this branch
                events = recv.receive_bytes(rf.frame, 0, now)  # a refused ROUND_BEGIN: RoundRefused (handle)
            if events:
                self.handle(events)
            budget += 4096 + int(h["length"])
            # every path reaches this check (a CONTROL frame right behind a ROUND_END must not skip it): a round whose
            # deadline just started would otherwise wait for the next frame that happens to leave the buffer empty
            if rf.idle:  # (no checkpoint of its own: the next read finds nothing and waits, which yields)
                budget = 0
                self.deadlines.poke()

    async def udp_ingress(self, lane: int, chan: UdpChannel) -> None:
        accept = self._accept_source if self.cfg.security.check_source else None
        frac = self.cfg.faults.drop_fraction
        while True:
            try:
                mv, sizes = await chan.recv_batch(accept)
            except trio.ClosedResourceError:
                return
            if len(sizes) == 0:
                continue
            batch = decode_datagrams(mv, sizes, self.cfg.limits, self.token)  # one C pass when built
            if self.drop_rng is not None:
                keep = self.drop_rng.random(len(sizes)) >= frac
                self.rx_dropped_hook[lane] += int((~keep).sum())
                batch = wire.Batch(batch.headers[keep], batch.payload_pos[keep], batch.reason[keep], batch.buf)
            for _ in range(3):  # their round's ROUND_BEGIN may be in the link's socket: let its reader run first
                if not self.receiver.opening_pending(batch):
                    break
                await trio.lowlevel.checkpoint()
            events = self.receiver.receive_datagrams(batch, lane, trio.current_time())
            if events:
                self.handle(events)
            self.deadlines.poke()

    def _accept_source(self, addr: tuple[Any, ...]) -> bool:
        return (addr[0], addr[1]) in self.links.sources

    def _allocate(self, key: tuple[int, int, int], numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        out = self.landing.pop(key, None)  # the round opened: the receiver holds its buffer from now on
        if out is None:
            return None
        if out.numel() == numel and out.dtype == dtype and out.is_contiguous():
            return out.view(-1)
        if out.numel() != numel or out.dtype != dtype:  # recv_round will refuse it (RankMismatch): say so now
            self._refuse_round(key, f"{out.numel()} x {out.dtype}", f"{numel} x {dtype}")
        return None

    def _refuse_round(self, key: tuple[int, int, int], mine: str, theirs: str) -> None:
        """Tell a round's sender that this rank refuses it (its landing is another size or dtype): a ``send_round``
        that waits for the round's report fails with the :class:`RankMismatch` this rank raises, instead of
        returning as if the round had been taken (a control STALE, ``why="mismatch"``)."""
        link = self.links.table.get(key[0])
        if link is not None and link.error is None:
            _, bucket, round = key
            msg = control.control(self.token, self.rank, control.STALE, bucket=bucket, round=round, why="mismatch",
                                  detail=f"rank {self.rank} expects {mine}, rank {key[0]} sent {theirs}")
            link.writer.push([msg], urgent=True)

    def handle(self, events: Sequence[Event]) -> None:
        """What the receivers said (dgt.protocol.events), dispatched by kind."""
        done = []
        for ev in events:
            if isinstance(ev, RoundDone):
                done.append(ev)
            elif isinstance(ev, DropReportIn):
                self.outbound.on_drop_report(ev.frame)
            elif isinstance(ev, BulkDone):
                self._bulk_done(ev)
            elif isinstance(ev, RoundRefused):
                self._refused(ev)
        if done:
            self._finished(done)

    def _refused(self, ev: RoundRefused) -> None:
        """A ROUND_BEGIN the receiver did not open: its sender would wait forever for the round; tell it now."""
        link = self.links.table.get(ev.key[0])
        if link is not None and link.error is None:
            _, bucket, round = ev.key
            msg = control.control(self.token, self.rank, control.STALE, bucket=bucket, round=round, why=ev.why)
            link.writer.push([msg], urgent=True)

    def _finished(self, done: list[RoundDone]) -> None:
        """Rounds the receiver closed: report back to their senders, account, deliver or buffer the results."""
        now = trio.current_time()
        st = self.session.stats
        for d in done:
            key = (d.sender, d.bucket, d.round)
            opened = self.opened.pop(key, None)
            elapsed = max(now - opened, 0.0) if opened is not None else 0.0
            why = d.stats.closed_by
            link = self.links.table.get(d.sender)
            if link is not None and link.error is None and why not in ("aborted", "sender-gone") and d.report:
                link.writer.push([d.report], urgent=True)
            st.closed_by[why] = st.closed_by.get(why, 0) + 1
            if why == "aborted":
                waiter = self.waiters.pop(key, None)
                if waiter is not None:
                    err = link.error if link is not None and link.error is not None else PeerClosed("round aborted")
                    waiter.fail(err)
                continue
            st.rounds_received += 1
            st.blocks_received += int(d.mask.sum())
            st.blocks_dropped += d.stats.dropped
            st.deadline_wait_total += d.stats.deadline_wait
            st.deadline_wait_max = max(st.deadline_wait_max, d.stats.deadline_wait)
            st.receive_seconds += elapsed
            for lane, ls in d.stats.lanes.items():
                acc = self.lane_delivered.setdefault(lane, [0, 0])
                acc[0] += ls.blocks
                acc[1] += ls.bytes
            self._deliver(key, RoundResult(d.data, d.mask, d.stats, d.layout, d.sender, d.bucket, d.round, elapsed,
                                           codec=d.codec))

    def _bulk_done(self, d: BulkDone) -> None:
        """A lossless message is in: account it like a complete round (every block received on the TCP lane)."""
        sender, bucket, round = d.key
        layout = self.session.layout(d.data.numel())
        n = layout.nblocks
        st = self.session.stats
        stats = RoundStats(sender, bucket, round, blocks=n, important=n, closed_by="complete",
                           lanes={0: RoundLaneStats(d.frames, n, d.nbytes)})  # fmt: skip
        st.closed_by["complete"] = st.closed_by.get("complete", 0) + 1
        st.rounds_received += 1
        st.blocks_received += n
        st.receive_seconds += d.elapsed
        acc = self.lane_delivered.setdefault(0, [0, 0])
        acc[0] += n
        acc[1] += d.nbytes
        mask = torch.ones(n, dtype=torch.bool)
        self._deliver(d.key, RoundResult(d.data, mask, stats, layout, sender, bucket, round, d.elapsed, bulk=True,
                                         codec=d.codec))

    def _deliver(self, key: tuple[int, int, int], res: RoundResult) -> None:
        waiter = self.waiters.pop(key, None)
        if waiter is not None:
            waiter.set(res)
            return
        if self.links.stream_watch.expected(key):  # (i22) the peer took the round path for a call we run on streams
            self.links.stream_conflict(key)
        self.results[key] = res
        while len(self.results) > self.cfg.max_buffered_results:
            self.results.popitem(last=False)
            self.session.stats.results_evicted += 1

    def post_recv(self, peer: int, bucket: int, round: int, out: torch.Tensor | None, *,
                  zero_lost: bool = True, hold: bool = False) -> None:
        """Name the contiguous CPU tensor a future round lands in, before :meth:`recv_round` is called for it.

        A round that opens before its receiver is ready would otherwise be reassembled into a fresh buffer and copied
        at the end; a collective that knows its next rounds (ring steps) posts them up front. ``recv_round`` for the
        round must then pass the same ``out`` (or none: the data is in ``out`` either way). At most a bounded number
        of posts are kept (the oldest are forgotten, which only costs that copy). ``out=None`` withdraws a post that
        will not be awaited (a collective that failed half-way): a round that opens later gets a buffer of its own.
        ``zero_lost=False``: the blocks the round does not get are left as ``out`` held them, not zeroed (a caller
        that reads only the blocks of the result's mask saves the pass); a round that opened before the post lands
        in a zeroed buffer of its own and is copied as usual. ``hold``: the round's important blocks travel
        elsewhere; its deadline starts at :meth:`important_in`, not at its ROUND_END."""
        key = (peer, bucket, round)
        if hold:
            self.receiver.hold(key)
        if out is None:
            self.landing.pop(key, None)
            return
        if key in self.results or self.receiver.is_open(key) or self.receiver.is_closed(key) or self.bulk.is_open(key):
            return  # already open or done: too late to land in place
        self.landing[key] = out
        if not zero_lost:
            self.receiver.leave_lost(key)
        while len(self.landing) > self.session.bound(len(self.links.table)):
            self.landing.popitem(last=False)

    def important_in(self, peer: int, bucket: int, round: int) -> None:
        """The important blocks of a round posted with ``hold`` are in: its deadline may start."""
        self.handle(self.receiver.important_in((peer, bucket, round), trio.current_time()))
        self.deadlines.poke()

    async def recv_round(
        self,
        peer: int,
        bucket: int,
        round: int,
        *,
        out: torch.Tensor | None = None,
        timeout: float | None = None,
    ) -> RoundResult:
        """The round ``round`` of ``bucket`` from ``peer`` once it closed (complete, or by its deadline once all
        important blocks were in). Rounds that closed before the call are buffered and returned at once. With
        ``out`` (called before the round opens), the data is reassembled straight into ``out``; otherwise it is
        copied there at the end. PeerClosed/PeerTimeout when the peer goes away; PeerTimeout after ``timeout``
        (default: the config's ``round_timeout``, so no receive waits unbounded)."""
        key = (peer, bucket, round)
        res = self.results.pop(key, None)
        if res is None:
            link = self.links.link(peer)
            if key in self.waiters:
                raise ValueError(f"round {round} of bucket {bucket} from rank {peer} is already awaited")
            slot = self.waiters[key] = Slot()
            if out is not None and not self.receiver.is_open(key) and not self.bulk.is_open(key):
                self.landing[key] = out
            try:
                timeout = timeout or self.cfg.timeouts.round
                with trio.fail_after(timeout) if timeout else nullcontext():
                    res = await slot.wait()
            except trio.TooSlowError:
                raise PeerTimeout(f"round {round} of bucket {bucket} from rank {link.rank}: "
                                  f"nothing within {timeout} s") from None  # fmt: skip
            finally:
                if self.waiters.get(key) is slot:
                    del self.waiters[key]
                self.landing.pop(key, None)
        if out is not None and res.data.data_ptr() == out.data_ptr():
            res.data = out  # reassembled in place: hand back the caller's tensor itself (its shape too)
        elif out is not None:
            if out.numel() != res.data.numel() or out.dtype != res.data.dtype:
                # (a round that landed before ``out`` was given: its sender hears of it if it still waits)
                self._refuse_round(key, f"{out.numel()} x {out.dtype}", f"{res.data.numel()} x {res.data.dtype}")
                raise RankMismatch(shape_mismatch(round), detail=f"rank {self.rank}: round {round} of bucket "
                                   f"{bucket} from rank {peer} holds {res.data.numel()} x {res.data.dtype}, this rank "
                                   f"expects {out.numel()} x {out.dtype}")
            out.view(-1).copy_(res.data)
            res.data = out
            self.session.stats.rounds_copied += 1
        return res

    async def recv_bytes(self, peer: int, tag: int = 0, timeout: float | None = None) -> bytes:
        """The next message from ``peer`` with ``tag``."""
        seq = self._bytes_rx.get((peer, tag), 0)
        self._bytes_rx[(peer, tag)] = seq + 1
        res = await self.recv_round(peer, BYTES_BUCKET | tag, seq & 0xFFFFFFFF, timeout=timeout)
        return res.data.numpy().tobytes()

    async def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        meta = (await self.recv_bytes(peer, tag, timeout)).decode()
        dt, _, shape = meta.partition(":")
        dims = [int(s) for s in shape.split(",") if s]
        raw = bytearray(await self.recv_bytes(peer, tag, timeout))
        dtype = wire.TORCH_OF[wire.WireDType(int(dt))]
        if not raw:
            return torch.zeros(dims, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(dims)
