"""What arrives (part of :class:`dgt.transport.endpoint.Endpoint`): UDP ingress into the sans-IO receiver,
landing buffers (``post_recv``), closed rounds and lossless messages delivered to waiters or buffered.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import trio

from dgt import wire
from dgt.channels.slot import Slot
from dgt.channels.udp import UdpChannel
from dgt.errors import PeerClosed, PeerTimeout, RankMismatch, shape_mismatch
from dgt.protocol.datagram_decode import decode_datagrams
from dgt.protocol.events import BulkDone, DropReportIn, Event, RoundDone, RoundRefused
from dgt.protocol.stats import RoundLaneStats, RoundStats
from dgt.transport import control
from dgt.transport.outbound import BYTES_BUCKET
from dgt.transport.session import EndpointState
from dgt.transport.stats import RoundResult


class InboundMixin(EndpointState):
    """UDP ingress, receiver feeding, early buffers, results and the receive APIs."""

    async def _udp_ingress(self, lane: int, chan: UdpChannel) -> None:
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
            if self._drop_rng is not None:
                keep = self._drop_rng.random(len(sizes)) >= frac
                self._rx_dropped_hook[lane] += int((~keep).sum())
                batch = wire.Batch(batch.headers[keep], batch.payload_pos[keep], batch.reason[keep], batch.buf)
            for _ in range(3):  # their round's ROUND_BEGIN may be in the link's socket: let its reader run first
                if not self.receiver.opening_pending(batch):
                    break
                await trio.lowlevel.checkpoint()
            events = self.receiver.receive_datagrams(batch, lane, trio.current_time())
            if events:
                self._handle(events)
            self.deadlines.poke()

    def _accept_source(self, addr: tuple[Any, ...]) -> bool:
        return (addr[0], addr[1]) in self._sources

    def _allocate(self, key: tuple[int, int, int], numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        out = self._out.pop(key, None)  # the round opened: the receiver holds its buffer from now on
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
        link = self._links.get(key[0])
        if link is not None and link.error is None:
            _, bucket, round = key
            msg = control.control(self.token, self.rank, control.STALE, bucket=bucket, round=round, why="mismatch",
                                  detail=f"rank {self.rank} expects {mine}, rank {key[0]} sent {theirs}")
            link.writer.push([msg], urgent=True)

    def _handle(self, events: Sequence[Event]) -> None:
        """What the receivers said (dgt.protocol.events), dispatched by kind."""
        done = []
        for ev in events:
            if isinstance(ev, RoundDone):
                done.append(ev)
            elif isinstance(ev, DropReportIn):
                self._on_drop_report(ev.frame)
            elif isinstance(ev, BulkDone):
                self._bulk_done(ev)
            elif isinstance(ev, RoundRefused):
                self._refused(ev)
        if done:
            self._finished(done)

    def _refused(self, ev: RoundRefused) -> None:
        """A ROUND_BEGIN the receiver did not open: its sender would wait forever for the round; tell it now."""
        link = self._links.get(ev.key[0])
        if link is not None and link.error is None:
            _, bucket, round = ev.key
            msg = control.control(self.token, self.rank, control.STALE, bucket=bucket, round=round, why=ev.why)
            link.writer.push([msg], urgent=True)

    def _finished(self, done: list[RoundDone]) -> None:
        """Rounds the receiver closed: report back to their senders, account, deliver or buffer the results."""
        now = trio.current_time()
        st = self._stats
        for d in done:
            key = (d.sender, d.bucket, d.round)
            opened = self._opened.pop(key, None)
            elapsed = max(now - opened, 0.0) if opened is not None else 0.0
            why = d.stats.closed_by
            link = self._links.get(d.sender)
            if link is not None and link.error is None and why not in ("aborted", "sender-gone") and d.report:
                link.writer.push([d.report], urgent=True)
            st.closed_by[why] = st.closed_by.get(why, 0) + 1
            if why == "aborted":
                waiter = self._recv_waiters.pop(key, None)
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
                acc = self._lane_delivered.setdefault(lane, [0, 0])
                acc[0] += ls.blocks
                acc[1] += ls.bytes
            self._deliver(key, RoundResult(d.data, d.mask, d.stats, d.layout, d.sender, d.bucket, d.round, elapsed,
                                           codec=d.codec))

    def _bulk_done(self, d: BulkDone) -> None:
        """A lossless message is in: account it like a complete round (every block received on the TCP lane)."""
        sender, bucket, round = d.key
        layout = self._layout(d.data.numel())
        n = layout.nblocks
        st = self._stats
        stats = RoundStats(sender, bucket, round, blocks=n, important=n, closed_by="complete",
                           lanes={0: RoundLaneStats(d.frames, n, d.nbytes)})  # fmt: skip
        st.closed_by["complete"] = st.closed_by.get("complete", 0) + 1
        st.rounds_received += 1
        st.blocks_received += n
        st.receive_seconds += d.elapsed
        acc = self._lane_delivered.setdefault(0, [0, 0])
        acc[0] += n
        acc[1] += d.nbytes
        mask = torch.ones(n, dtype=torch.bool)
        self._deliver(d.key, RoundResult(d.data, mask, stats, layout, sender, bucket, round, d.elapsed, bulk=True,
                                         codec=d.codec))

    def _deliver(self, key: tuple[int, int, int], res: RoundResult) -> None:
        waiter = self._recv_waiters.pop(key, None)
        if waiter is not None:
            waiter.set(res)
            return
        if self._stream_watch.expected(key):  # (i22) the peer took the round path for a call we run on streams
            self._stream_conflict(key)
        self._results[key] = res
        while len(self._results) > self.cfg.max_buffered_results:
            self._results.popitem(last=False)
            self._stats.results_evicted += 1

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
            self._out.pop(key, None)
            return
        if key in self._results or self.receiver.is_open(key) or self.receiver.is_closed(key) or self.bulk.is_open(key):
            return  # already open or done: too late to land in place
        self._out[key] = out
        if not zero_lost:
            self.receiver.leave_lost(key)
        while len(self._out) > 4 * self.cfg.limits.max_open_rounds * max(1, len(self._links)):
            self._out.popitem(last=False)

    def important_in(self, peer: int, bucket: int, round: int) -> None:
        """The important blocks of a round posted with ``hold`` are in: its deadline may start."""
        self._handle(self.receiver.important_in((peer, bucket, round), trio.current_time()))
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
        res = self._results.pop(key, None)
        if res is None:
            link = self._link(peer)
            if key in self._recv_waiters:
                raise ValueError(f"round {round} of bucket {bucket} from rank {peer} is already awaited")
            slot = self._recv_waiters[key] = Slot()
            if out is not None and not self.receiver.is_open(key) and not self.bulk.is_open(key):
                self._out[key] = out
            try:
                timeout = timeout or self.cfg.timeouts.round
                with trio.fail_after(timeout) if timeout else nullcontext():
                    res = await slot.wait()
            except trio.TooSlowError:
                raise PeerTimeout(f"round {round} of bucket {bucket} from rank {link.rank}: "
                                  f"nothing within {timeout} s") from None  # fmt: skip
            finally:
                if self._recv_waiters.get(key) is slot:
                    del self._recv_waiters[key]
                self._out.pop(key, None)
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
            self._stats.rounds_copied += 1
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
