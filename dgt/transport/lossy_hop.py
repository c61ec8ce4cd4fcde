"""One reduce-scatter hop of a lossy ring (DGT), as one transport call: :func:`lossy_hop` (``Transport.lossy_hop``).

A lossy hop as one DGT round on the session link costs about 16 copies of its chunk in protocol work, most of it the
important blocks: framed, written and read frame by frame by the link's trio tasks, landed and marked run by run
(docs/history/transport-journal.md, issue 26). Here a hop is split by lane, as the paper splits it:

- the **important blocks** (class 0) go as one packed message on the stream lane to the next rank (TCP, marked EF
  like lane 0), in the native hop loop off the trio thread, preceded by a mask message (a byte per block of the
  chunk) that tells the receiver which blocks they are (:mod:`dgt.protocol.packed_blocks`: no offsets on the wire);
- the **unimportant blocks** go as a DGT round (UDP, low priority, paced, the send budget, the deadline, the drop
  report and error feedback) whose frames ride the first stream message and whose datagrams leave from the hop socket
  (:mod:`dgt.transport.hop_round`), planned with ``elsewhere``: the round announces no important block.

Both halves are taken from one copy of the chunk with the error-feedback residual added (the sender's ``stage``),
so an important block carries what earlier rounds kept back, exactly as it did in the round. The receiver lands the
round (its lost and unsent blocks left as the landing held them), and adds the packed important blocks and the
round's received blocks to its own chunk in one pass (:class:`_HopSum`, ``combine_blocks``).

The collective hands over, in a :class:`LossyHopSpec`, what it owns: the encoded chunk (data, per-block classes, send
order), the peers, the layouts, the keys and round, where the round lands and the chunk the sum goes into, and its
reserved place in the order of stream exchanges (``ticket``, reserved when its call started, before its first
await). Everything between (planning, the mask message, the receipt for the worker thread, the exchange, landing
and closing the round, the drop report, the sum, the statistics) happens here, on the endpoint it is given, and
comes back as one :class:`LossyHopResult`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import trio

from dgt.channels.hop_datagrams import DatagramRecv
from dgt.errors import RankMismatch, op_mismatch, shape_mismatch
from dgt.layout import BucketLayout
from dgt.protocol.block_ops import add_blocks, combine_blocks, packed_offsets
from dgt.protocol.packed_blocks import packed_numel
from dgt.protocol.stats import RoundStats
from dgt.transport.config import TransportConfig
from dgt.transport.hop_round import HopRounds, HopRoundSend, control_bytes
from dgt.transport.inbound import Inbound
from dgt.transport.stats import RoundResult
from dgt.transport.streams import Hop, HopResult


class HopEndpoint(Protocol):
    """What :func:`lossy_hop` uses of an endpoint (the hop-round plumbing; not part of the collectives' contract)."""

    cfg: TransportConfig
    inbound: Inbound  # where a round posted with ``hold`` learns that its important blocks are in
    hop_rounds: HopRounds  # the part that plans, receives, accounts and lands a hop's round

    def post_recv(self, peer: int, bucket: int, round: int, out: torch.Tensor | None, *,
                  zero_lost: bool = True, hold: bool = False) -> None: ...

    def forfeit_exchange(self, ticket: int) -> None: ...

    async def exchange(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]: ...


    async def recv_round(self, peer: int, bucket: int, round: int, *, out: torch.Tensor | None = None,
                         timeout: float | None = None) -> RoundResult: ...


@dataclass
class _HopBuffers:
    """Per step, reused across calls: the first messages sent and received (a byte per block, then the round's
    ROUND_BEGIN and ROUND_END), the packed blocks received (the sender's packed blocks live in its RoundSender), and
    where the round's datagrams are read (grown to the largest round seen)."""

    tx_msg: torch.Tensor
    rx_msg: torch.Tensor
    rx_pack: torch.Tensor
    rx_dgrams: np.ndarray

    def dgrams(self, nbytes: int) -> np.ndarray:
        """At least ``nbytes`` to read datagrams into (in the worker thread: nothing else uses it meanwhile)."""
        if len(self.rx_dgrams) < nbytes:
            self.rx_dgrams = np.empty(nbytes + nbytes // 4, np.uint8)
        return self.rx_dgrams


class LossyHopPool:
    """The buffers of one lossy ring's hops, reused across its calls (its owner, the collective, keeps one)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, int, int, int], _HopBuffers] = {}

    def buffers(self, step: int, n: int, tx: int, rx: int) -> _HopBuffers:
        key = (step, n, tx, rx)
        buf = self._bufs.get(key)
        if buf is None:
            if len(self._bufs) >= 64:
                self._bufs.clear()
            buf = self._bufs[key] = _HopBuffers(torch.zeros(tx, dtype=torch.uint8), torch.zeros(rx, dtype=torch.uint8),
                                                torch.empty(n, dtype=torch.float32), np.empty(0, np.uint8))
        return buf


@dataclass(frozen=True)
class LossyHopSpec:
    """One lossy ring hop, as the collective describes it (see the module docstring).

    ``keys``: the transport keys of the hop's round (its part 0), its mask message and its packed message; ``data``:
    the encoded chunk (contiguous float32 on the CPU) with ``layout``, ``cls`` (int8 per block, 0 = important) and
    ``order`` (the send order, or None); ``recv_layout``: the layout of the chunk that comes from ``recv_from``,
    landing in ``land`` (posted here with ``hold``); the sum ``mine_src + received`` goes into ``mine``. ``ticket``:
    this hop's reserved place in the order of stream exchanges, owned by the call from here on (given back if it
    fails first). ``family``: the key bits that name the call's messages (a session-link round of that family from
    ``recv_from`` means the peer took another path: RankMismatch). ``step``: which of ``pool``'s buffers it uses;
    ``label``: the hop in error messages (e.g. "rs step 0 of bucket 3")."""

    send_to: int
    recv_from: int
    keys: tuple[int, int, int]
    round: int
    data: torch.Tensor
    layout: BucketLayout
    cls: torch.Tensor
    order: torch.Tensor | None
    op: int
    recv_layout: BucketLayout
    land: torch.Tensor
    mine_src: torch.Tensor
    mine: torch.Tensor
    ticket: int | None
    family: int
    pool: LossyHopPool
    step: int = 0
    label: str = ""


@dataclass
class LossyHopResult:
    """What one lossy hop did: ``means``, the block scores (mean |x|) of the sum it wrote into ``mine`` (the next
    hop's codec reads them); ``mask``, the round's arrival mask (a bool per block of ``recv_layout``; the blocks that
    came on the stream lane are ``important``); the receiver's ``round`` statistics; payload bytes handed over per
    lane (``sent``: 0 the packed important blocks, 1 the round's datagrams), those the send budget kept back
    (``unsent_bytes``) and bytes the stream lane received (``received``); ``arrived``: a bool per block of
    ``recv_layout``, whether any value came for it (on the stream lane or in the round)."""

    means: torch.Tensor
    mask: torch.Tensor
    important: int
    round: RoundStats
    sent: dict[int, int] = field(default_factory=dict)
    unsent_bytes: int = 0
    received: int = 0
    arrived: torch.Tensor | None = None


class _HopSum:
    """The receiving end of a hop: this rank's chunk plus the packed important blocks plus the round's blocks that
    came in time (``combine_blocks``). With idle cores (``overlap``: this rank may run more than one thread) it is
    made in two halves: the stream lane's part in the trio thread as soon as the worker has both messages
    (``post``; the C pass releases the GIL, so it runs beside the worker's reads of the round's datagrams, whose
    arrival times feed the congestion control), then once the round closed only the blocks that came as datagrams
    (``add_blocks``). Without, in one pass once the round closed (no second thread to run beside)."""

    def __init__(self, src: torch.Tensor, out: torch.Tensor, layout: BucketLayout, rx_pack: torch.Tensor,
                 mask: np.ndarray, overlap: bool) -> None:
        self.src, self.out, self.layout, self.rx_pack, self.mask = src, out, layout, rx_pack, mask
        self.token = trio.lowlevel.current_trio_token() if overlap else None
        self.early: torch.Tensor | None = None  # the blocks' mean |out| after the first half
        self.error: Exception | None = None
        self.live = True  # False once the hop failed: a late callback writes nothing

    @property
    def important(self) -> np.ndarray:
        """The blocks that came on the stream lane (once the first message is in)."""
        return np.asarray(self.mask != 0, dtype=bool)

    def post(self) -> None:
        """(Worker thread.) Both messages are in."""
        if self.token is not None:
            try:
                self.token.run_sync_soon(self._first_half)
            except trio.RunFinishedError:
                pass  # finish() makes it in one pass

    def _combine(self, land: torch.Tensor, received: np.ndarray) -> torch.Tensor:
        """``combine_blocks`` of this hop with the round's ``received`` blocks of ``land``."""
        imp = self.important
        return combine_blocks(self.src, land, self.rx_pack[: packed_numel(self.layout, imp)], self.out, self.layout,
                              received & ~imp, packed_offsets(self.layout, imp))

    def _first_half(self) -> None:
        if not self.live or self.early is not None:
            return
        try:
            self.early = self._combine(self.src, np.zeros(len(self.mask), bool))
        except Exception as exc:  # a callback must not raise into trio: finish() raises it
            self.error = exc

    def finish(self, land: torch.Tensor, received: np.ndarray) -> torch.Tensor:
        """(Trio thread, the round closed.) The sum with the round's ``received`` blocks of ``land``; returns the
        blocks' mean |out| (the next hop's scores)."""
        self.live = False
        if self.error is not None:
            raise self.error
        if self.early is None:
            return self._combine(land, received)
        add_blocks(self.out, land, self.layout, np.flatnonzero(received & ~self.important), self.early)
        return self.early


@dataclass
class _Hop:
    """A hop on its way: the planned round, the exchange's hops, the sum, and what the worker thread saw (when the
    first message was in, then the datagram receipt)."""

    hs: HopRoundSend
    hops: list[Hop]
    early: _HopSum
    rx: np.ndarray
    seen: list[Any]


def _prepare(ep: HopEndpoint, spec: LossyHopSpec) -> _Hop:
    """Plan the round (nothing sent), fill the mask message and build the exchange's two hops."""
    key, rnd, op = spec.keys[0], spec.round, spec.op
    lay, lay_c = spec.layout, spec.recv_layout
    hs = ep.hop_rounds.plan(spec.send_to, key, rnd, spec.data, lay, spec.cls, spec.order, op)  # nothing sent yet
    nb, nb_c = lay.nblocks, lay_c.nblocks
    buf = spec.pool.buffers(spec.step, spec.mine.numel(), nb + len(hs.control), nb_c + control_bytes(lay_c))
    tx = buf.tx_msg.numpy()
    tx[:nb] = (spec.cls == 0).numpy()
    tx[nb:] = np.frombuffer(hs.control, np.uint8)
    rx = buf.rx_msg.numpy()
    seen: list[Any] = []  # in the worker thread: when the first message was in, then the datagram receipt

    def land_packed() -> torch.Tensor:  # in the worker thread, once the first message is in
        seen.append(time.perf_counter())
        return buf.rx_pack[: packed_numel(lay_c, rx[:nb_c] != 0)]

    receipt = ep.hop_rounds.receipt(spec.recv_from, key, rnd, lay_c, 4, lambda: rx[nb_c:].data, buf.dgrams)
    early = _HopSum(spec.mine_src, spec.mine, lay_c, buf.rx_pack, rx[:nb_c], torch.get_num_threads() > 1)

    def datagrams_in() -> DatagramRecv:  # in the worker thread, once both messages are in
        early.post()
        seen.append(receipt())
        return seen[-1]  # type: ignore[no-any-return]

    hops = [Hop(spec.keys[1], rnd, spec.send_to, buf.tx_msg, spec.recv_from, buf.rx_msg, op=op),
            Hop(spec.keys[2], rnd, spec.send_to, hs.packed, spec.recv_from, land_later=land_packed, op=op,
                datagrams=hs.datagrams, datagrams_in=datagrams_in)]
    return _Hop(hs, hops, early, rx, seen)


async def lossy_hop(ep: HopEndpoint, spec: LossyHopSpec) -> LossyHopResult:
    """Run one lossy ring hop (see the module docstring) on ``ep``: send ``spec.data`` to ``spec.send_to`` while
    the chunk from ``spec.recv_from`` lands and is summed into ``spec.mine``. Raises RankMismatch when the peer took
    another path, another op, or another geometry (every rank of the call then fails at once)."""
    prv, key, rnd = spec.recv_from, spec.keys[0], spec.round
    ticket = spec.ticket
    try:
        # the hop reads the round's mask, and starts its deadline once the stream lane's blocks are in
        ep.post_recv(prv, key, rnd, spec.land, zero_lost=False, hold=True)
        h = _prepare(ep, spec)
    except BaseException:
        if ticket is not None:  # the exchange never ran: later exchanges must not wait for it
            ep.forfeit_exchange(ticket)
        _withdraw(ep, spec)
        raise
    try:
        try:
            # family: a round of this call from ``prv`` on the session link means it took the round path (another
            # dtype or layout): RankMismatch on every rank at once, not a hop waiting for a mask that never comes
            done = await ep.exchange(h.hops, ticket=ticket, family=spec.family)
        except BaseException:
            h.early.live = False  # the call fails: nothing more is written to this rank's chunk
            ep.hop_rounds.sent(h.hs, failed=True)  # what left is accounted; no report is waited for
            raise
        return await _land(ep, spec, h, done)
    except BaseException:
        _withdraw(ep, spec)
        raise


def _withdraw(ep: HopEndpoint, spec: LossyHopSpec) -> None:
    """A failed hop: nothing lands in its buffer any more, and its round waits for no stream lane."""
    ep.post_recv(spec.recv_from, spec.keys[0], spec.round, None)
    ep.inbound.important_in(spec.recv_from, spec.keys[0], spec.round)


async def _land(ep: HopEndpoint, spec: LossyHopSpec, h: _Hop, done: list[HopResult]) -> LossyHopResult:
    """After the exchange: account what was sent, land and close the round, check it, and make the sum."""
    prv, key, rnd, lay_c = spec.recv_from, spec.keys[0], spec.round, spec.recv_layout
    st = ep.hop_rounds.sent(h.hs)
    ep.hop_rounds.land(prv, key, rnd, h.rx[lay_c.nblocks:].data, h.seen[1], h.seen[0])
    res = await ep.recv_round(prv, key, rnd, out=spec.land)  # closed just now: returned at once
    if spec.op and res.codec != spec.op:
        raise RankMismatch(op_mismatch(res.codec, spec.op, rnd))
    isz = spec.data.element_size()
    packed = h.hs.packed.numel() * isz
    dst = res.data.reshape(-1)
    if dst.numel() != lay_c.numel or dst.dtype != spec.mine.dtype or res.mask.numel() != lay_c.nblocks:
        what = spec.label or f"hop {spec.step}"
        raise RankMismatch(shape_mismatch(rnd), detail=f"rank {prv} sent {dst.numel()} x {dst.dtype} for {what}, "
                           f"this rank expects {lay_c.numel} x {spec.mine.dtype}")
    imp = h.early.important
    means = h.early.finish(dst, res.mask.numpy())
    return LossyHopResult(means, res.mask, int(imp.sum()), res.stats,
                          sent={1: spec.data.numel() * isz - packed - st.unsent_bytes, 0: packed},
                          unsent_bytes=st.unsent_bytes, received=sum(d.received for d in done),
                          arrived=torch.from_numpy(imp | res.mask.numpy().astype(bool)))
