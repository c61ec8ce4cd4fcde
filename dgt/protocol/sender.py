"""Sans-IO sender: (bucket, per-block lane classes) -> ordered frames per lane; drop reports -> error feedback."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.block_ops import IMPORTANT, KEPT, SENT, packed_offsets, split_blocks
from dgt.protocol.block_rows import keep_blocks
from dgt.protocol.budget import fold_blocks, split_budget
from dgt.protocol.datagram_mac import DatagramMac, slots, tag_bytes
from dgt.protocol.datagram_rows import DatagramRows, gather_rows
from dgt.protocol.geometry import Geometry, fragment_elems
from dgt.protocol.owner import owned
from dgt.protocol.packed_blocks import packed_numel
from dgt.protocol.report import Timing, decode_report
from dgt.protocol.stats import lane_counts
from dgt.wire import Flags, FrameType

LONG_RUN = 8
"""Runs of at least this many consecutive important blocks are sent zero-copy; shorter ones are packed."""


@dataclass
class RoundPlan:
    """Everything one round puts on the wire, per lane, in send order.

    reliable: (header, payload view) pairs for the reliable lane, to be written back to back: ROUND_BEGIN, the
        important DATA frames, ROUND_END. A pair may carry several whole frames in its payload with an empty header
        (packed scattered blocks); the byte stream is always a valid sequence of frames.
    datagrams: per unreliable lane, the equal-size datagrams (header + fragment, most important block first; ready
        for UDP GSO) as :class:`DatagramRows`: headers plus views of the bucket, packed only when sent (reads like a
        [k, seg] uint8 array); and a list of odd-size datagrams (partial tensor tails). Like the reliable lane's
        zero-copy runs, they read the bucket when sent: it must stay unchanged until then (``Endpoint.send_round``
        returns only once every datagram job is sent or abandoned).
    """

    bucket: int
    round: int
    reliable: list[tuple[bytes, memoryview]]
    datagrams: dict[int, DatagramRows] = field(default_factory=dict)
    odd: dict[int, list[bytes]] = field(default_factory=dict)
    important_blocks: int = 0
    unimportant_blocks: int = 0  # those sent (announced in ROUND_END)
    unsent_blocks: int = 0  # beyond the send budget: folded into error feedback, never sent
    unsent_lanes: dict[int, int] = field(default_factory=dict)  # lane class -> unsent blocks
    unsent_bytes: int = 0  # payload bytes of the unsent blocks
    cls: np.ndarray | None = None  # lane class per block (int8)
    elsewhere: np.ndarray | None = None  # important blocks left to the caller (``plan(..., elsewhere=True)``)

    @property
    def reliable_bytes(self) -> int:
        return sum(len(h) + len(p) for h, p in self.reliable)

    def unreliable_bytes(self, lane: int | None = None) -> int:
        lanes = self.datagrams.keys() | self.odd.keys() if lane is None else [lane]
        total = 0
        for ln in lanes:
            d = self.datagrams.get(ln)
            total += 0 if d is None else d.size
            total += sum(len(b) for b in self.odd.get(ln, []))
        return total

    def unreliable_frames(self) -> int:
        return sum(len(d) for d in self.datagrams.values()) + sum(len(o) for o in self.odd.values())


@dataclass
class DropInfo:
    bucket: int
    round: int
    missing_blocks: int  # sent but lost (unsent blocks are not counted here)
    folded_elems: int
    unsent_blocks: int = 0  # missing because the send budget kept them back (folded when the round was planned)
    timing: Timing | None = None  # the report's timing trailer, for the congestion controller
    lost_mask: np.ndarray | None = None  # per block: sent and lost


@dataclass
class Selection:
    """Where a round's blocks go (:meth:`RoundSender.select`): block indices, sent unimportant most important first."""

    geom: Geometry
    cls_np: np.ndarray  # lane class per block, capped at the sender's lanes
    important: np.ndarray
    unimp: np.ndarray  # sent on the unreliable lanes
    unsent: np.ndarray  # kept back by the send budget

    def unsent_mask(self) -> np.ndarray | None:
        if not len(self.unsent):
            return None
        mask = np.zeros(len(self.cls_np), dtype=bool)
        mask[self.unsent] = True
        return mask


def raw_bytes(flat: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a CPU contiguous tensor (works for bfloat16 too)."""
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("the sender packs from a contiguous CPU tensor; copy device buckets to (pinned) host first")
    return flat.view(torch.uint8).numpy()


@owned
class RoundSender:
    """Turns classified buckets into frames and keeps the error-feedback residual per bucket.

    lanes: number of lane classes including the reliable one (2 = the paper's TCP + UDP).
    error_feedback: keep what was sent on unreliable lanes until the drop report says what got lost, and add the
        lost values to the next round of the same bucket (``prepare``).
    """

    def __init__(
        self,
        token: int,
        rank: int,
        *,
        datagram_payload: int = 1400,
        reliable_frame_bytes: int = 1 << 20,
        lanes: int = 2,
        error_feedback: bool = True,
        max_pending: int = 64,
        codec: int = 0,
        mac: DatagramMac | None = None,
        peer: int = 0,
    ) -> None:
        if lanes < 2:
            raise ValueError("need the reliable lane and at least one unreliable lane")
        self.token = token
        self.rank = rank
        self.datagram_payload = datagram_payload
        self.reliable_frame_bytes = reliable_frame_bytes
        self.lanes = lanes
        self.error_feedback = error_feedback
        self.max_pending = max_pending
        self.codec = codec
        self.mac = mac  # datagrams carry a MAC trailer (dgt.protocol.datagram_mac); its nonce names ``peer``
        self.peer = peer
        self._residual: dict[int, torch.Tensor] = {}
        # buckets whose residual prepare() has already added into a copy: it reads as zero, but is only zeroed when
        # next used (plan() overwrites it whole when it keeps blocks back: one pass instead of zero + fold)
        self._spent: set[int] = set()
        # bucket -> (the geometry, a byte per block), 0 where its (unspent) residual is surely zero: plan_split
        # neither reads nor re-zeroes those blocks (it keeps the flags; any other writer of the residual drops them)
        self._live: dict[int, tuple[tuple[int, list[int]], np.ndarray]] = {}
        self._pending: OrderedDict[tuple[int, int],
                                   tuple[torch.Tensor, BucketLayout, np.ndarray | None, np.ndarray | None]] = \
            OrderedDict()
        self._closed: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._copies: dict[int, weakref.ref[torch.Tensor]] = {}  # bucket -> the latest private copy prepare made
        self._spare: dict[int, torch.Tensor] = {}  # bucket -> a copy whose round is over, for prepare to reuse
        self._stages: dict[tuple[int, int], np.ndarray] = {}  # pending round -> its packed important blocks
        self._stage_spare: dict[int, np.ndarray] = {}  # bucket -> a packing buffer whose round is over
        self._packed: dict[int, torch.Tensor] = {}  # bucket -> plan_split's packed important blocks
        self.unreported = 0  # rounds whose drop report never came (their losses were not folded back)

    # -- error feedback
    def prepare(self, bucket: int, flat: torch.Tensor) -> torch.Tensor:
        """A private contiguous CPU copy of ``flat`` with the bucket's residual added (and the residual cleared).
        The copy is written into the bucket's spare (the copy of an earlier round whose drop report is in) when
        there is one: no fresh bucket-sized allocation, whose first touch page-faults, per round."""
        flat = flat.detach()
        src = flat.reshape(-1)
        res = self._residual.get(bucket)
        if res is not None and (bucket in self._spent or res.numel() != src.numel() or res.dtype != src.dtype):
            res = None  # spent: its values are in an earlier copy already (it reads as zero)
        out = self._spare.pop(bucket, None)
        if out is not None and (out.numel() != src.numel() or out.dtype != src.dtype):
            out = None
        if res is not None and src.device.type == "cpu":
            out = torch.add(src, res) if out is None else torch.add(src, res, out=out)  # copy and add in one pass
        else:
            out = flat.to("cpu", copy=True).contiguous().view(-1) if out is None else out.copy_(src)
            if res is not None:
                out += res
        if res is not None:
            self._spent.add(bucket)  # instead of zeroing it now: see _live_residual and plan()
            self._live.pop(bucket, None)
        self._copies[bucket] = weakref.ref(out)
        return out

    def _recycle(self, bucket: int, sent: torch.Tensor) -> None:
        """``sent``'s round is over (its report is in): if it is the bucket's latest private copy, keep it as the
        spare the next :meth:`prepare` writes into (a caller's tensor, or an older copy, is never reused)."""
        ref = self._copies.get(bucket)
        if ref is not None and ref() is sent:
            del self._copies[bucket]
            self._spare[bucket] = sent

    def _stage_rows(self, bucket: int, round: int, n: int, row: int) -> np.ndarray:
        """``[n, row]`` uint8 rows to pack scattered important blocks into: the bucket's spare packing buffer (its
        round's report is in, so every frame of it was written) when it is large enough, else a new one with room
        to grow. A fresh buffer of the important part, every round, page-faulted on first touch (~30 MB of a
        100 MB p = 30 % round). Held under the round's key until its report (:meth:`plan` drops it at once if the
        round waits for none)."""
        spare = self._stage_spare.pop(bucket, None)
        if spare is None or spare.shape[1] != row or len(spare) < n:
            spare = np.empty((n + n // 4, row), np.uint8)
        self._stages[(bucket, round)] = spare
        return spare[:n]

    def residual(self, bucket: int) -> torch.Tensor | None:
        self._live.pop(bucket, None)  # the caller may write into it
        return self._live_residual(bucket)

    def _live_residual(self, bucket: int) -> torch.Tensor | None:
        """The bucket's residual, zeroed first if :meth:`prepare` already added it into a copy."""
        res = self._residual.get(bucket)
        if res is not None and bucket in self._spent:
            res.zero_()  # (a spent bucket has no flags: prepare and plan_split drop them as they spend it)
        self._spent.discard(bucket)
        return res

    def on_drop_report(self, frame: wire.Frame) -> DropInfo:
        """Fold the blocks the receiver missed into the residual; mark the round closed (stop sending its tail)."""
        key = (frame.bucket, frame.round)
        self._close(key)
        entry = self._pending.pop(key, None)
        if entry is None:
            timing = decode_report(frame)[1] if frame.flags & Flags.TIMING else None
            return DropInfo(frame.bucket, frame.round, 0, 0, timing=timing)
        sent, layout, unsent, skip = entry
        nb = layout.nblocks
        if frame.count != nb:
            raise wire.WireError(f"drop report covers {frame.count} blocks, round had {nb}")
        got, timing = decode_report(frame)
        missing_np = ~got
        n_unsent = 0
        if unsent is not None:  # kept back by the send budget: already folded when the round was planned
            n_unsent = int(missing_np[unsent].sum())
            missing_np[unsent] = False
        if skip is not None:  # carried outside the round (plan(elsewhere=True)): not this report's to judge
            missing_np[skip] = False
        missing = torch.from_numpy(missing_np)
        n_missing = int(missing.sum())
        folded = 0
        if n_missing and self.error_feedback:
            folded = fold_blocks(self._residual_for(frame.bucket, sent), sent, layout, torch.nonzero(missing).flatten())
            live = self._flags(frame.bucket, layout)
            if live is not None:
                live[missing_np] = 1
        self._recycle(frame.bucket, sent)
        stage = self._stages.pop(key, None)
        if stage is not None:
            self._stage_spare[frame.bucket] = stage
        return DropInfo(frame.bucket, frame.round, n_missing, folded, n_unsent, timing, missing_np)

    def _flags(self, bucket: int, layout: BucketLayout) -> np.ndarray | None:
        """The bucket's residual flags when they are for ``layout``'s blocks; else none (dropped)."""
        entry = self._live.get(bucket)
        if entry is not None and entry[0] != (layout.block, layout.sizes):
            del self._live[bucket]
            return None
        return None if entry is None else entry[1]

    def _residual_for(self, bucket: int, sent: torch.Tensor) -> torch.Tensor:
        res = self._live_residual(bucket)
        if res is None or res.numel() != sent.numel() or res.dtype != sent.dtype:
            res = torch.zeros_like(sent)
            self._residual[bucket] = res
            self._live.pop(bucket, None)
        return res

    def closed(self, bucket: int, round: int) -> bool:
        """True once the receiver finalised the round: unsent unimportant frames of it are stale."""
        return (bucket, round) in self._closed

    def _close(self, key: tuple[int, int]) -> None:
        self._closed[key] = None
        while len(self._closed) > 4 * self.max_pending:
            self._closed.popitem(last=False)

    # -- framing
    def geometry(self, layout: BucketLayout, itemsize: int) -> Geometry:
        room = self.datagram_payload - (0 if self.mac is None else wire.MAC_TAG)  # the tag rides in the payload's room
        return Geometry.of(layout, fragment_elems(layout.block, itemsize, room))

    def plan(
        self,
        bucket: int,
        round: int,
        flat: torch.Tensor,
        layout: BucketLayout,
        cls: torch.Tensor | int,
        order: torch.Tensor | None = None,
        report: bool = True,
        budget: int | None = None,
        codec: int | None = None,
        elsewhere: bool = False,
    ) -> RoundPlan:
        """Frames for one round. ``cls``: lane class per block (0 = reliable) or one class for all; ``order``: the
        unimportant blocks, most important first (default: block order). ``report=False`` asks the receiver for no
        drop report (only honoured for a round with every block on the reliable lane: it has nothing to report).
        ``budget``: datagram bytes the unreliable lanes may carry (None: no limit); the unimportant blocks beyond it
        are not sent and go straight into the error-feedback residual (``RoundPlan.unsent_blocks``).
        ``elsewhere``: the important blocks travel outside this round (a lossy ring hop's stream lane): no frame of
        them here, ROUND_END announces none, and the drop report's view of them is ignored (neither lost nor
        folded; ``RoundPlan.elsewhere`` lists them)."""
        sel = self.select(flat, layout, cls, order, budget)
        mask = sel.unsent_mask()
        if mask is not None and self.error_feedback:
            self._fold_unsent(bucket, flat, layout, sel.unsent, mask)
        return self._frame(bucket, round, flat, layout, sel, report, codec, elsewhere)

    def select(self, flat: torch.Tensor, layout: BucketLayout, cls: torch.Tensor | int,
               order: torch.Tensor | None, budget: int | None) -> Selection:
        """Which blocks of a round go where: important, unimportant sent (most important first), unsent."""
        if flat.numel() != layout.numel:
            raise ValueError(f"bucket has {flat.numel()} elements, layout {layout.numel}")
        isz = flat.element_size()
        geom = self.geometry(layout, isz)
        if isinstance(cls, int):
            cls_np = np.full(layout.nblocks, cls, dtype=np.int64)
        else:
            cls_np = cls.detach().to("cpu").numpy().astype(np.int64)
        cls_np = np.minimum(cls_np, self.lanes - 1)
        important = np.flatnonzero(cls_np == 0)
        if order is None:
            unimp = np.flatnonzero(cls_np > 0)
        else:
            unimp = order.detach().to("cpu").numpy().astype(np.int64)
            unimp = unimp[cls_np[unimp] > 0]
        unimp, unsent = split_budget(geom, unimp, isz, budget)
        return Selection(geom, cls_np, important, unimp, unsent)

    def plan_split(self, bucket: int, round: int, flat: torch.Tensor, layout: BucketLayout,
                   cls: torch.Tensor | int, order: torch.Tensor | None, report: bool, budget: int | None,
                   codec: int | None, stage: Callable[[torch.Tensor], None] | None) -> tuple[RoundPlan, torch.Tensor]:
        """:meth:`prepare` and :meth:`plan` with ``elsewhere`` in one pass over the bucket (float32): ``flat`` plus
        its residual goes to ``stage`` (the important blocks, packed as dgt.protocol.packed_blocks orders them; a
        view valid until this bucket's next round), to the residual (the blocks the budget keeps back; zero
        elsewhere) and to the round's private copy (the blocks sent as datagrams). Returns the plan and that copy.

        ``stage`` None: :meth:`prepare` and :meth:`plan` in one pass, the important blocks in the private copy with
        the datagrams' and framed from there (a round on the session link). Either way the blocks the budget keeps
        back are written to the residual only: no copy of them, no second pass to fold them."""
        sel = self.select(flat, layout, cls, order, budget)
        src = flat.detach().reshape(-1)
        if src.dtype != torch.float32 or src.device.type != "cpu" or not src.is_contiguous():
            raise ValueError("plan_split: a contiguous float32 CPU bucket")
        data = self._spare.pop(bucket, None)
        if data is None or data.numel() != src.numel() or data.dtype != src.dtype:
            data = torch.empty_like(src)
        self._copies[bucket] = weakref.ref(data)
        res = self._residual.get(bucket)
        if res is not None and (res.numel() != src.numel() or res.dtype != src.dtype):
            res = None
        res_in = None if res is None or bucket in self._spent else res
        kept = bool(len(sel.unsent)) and self.error_feedback
        res_out = (res if res is not None else torch.empty_like(src)) if kept else None
        imp = sel.cls_np == 0
        pack = stage is not None  # else the important blocks stay in the private copy, with the sent ones
        kind = np.full(layout.nblocks, SENT, dtype=np.uint8)
        if pack:
            kind[imp] = IMPORTANT
        if kept:
            kind[sel.unsent] = KEPT
        n_imp = packed_numel(layout, imp) if pack else 0
        packed = self._packed.get(bucket)
        if packed is None or packed.numel() < n_imp:
            packed = self._packed[bucket] = torch.empty(n_imp + n_imp // 4, dtype=src.dtype)
        at = packed_offsets(layout, imp) if pack else np.full(layout.nblocks, -1, np.int64)
        live = None  # which blocks of an unspent residual may be nonzero (all, when not known)
        if res_in is not None and res_out is res_in:
            live = self._flags(bucket, layout)
            if live is None:
                live = np.ones(layout.nblocks, np.uint8)
        split_blocks(src, res_in, packed, res_out, data, layout, kind, at, live=live)
        if res_out is not None:
            self._residual[bucket] = res_out
            self._spent.discard(bucket)
            flags = (kind == KEPT).astype(np.uint8) if live is None else live
            self._live[bucket] = ((layout.block, list(layout.sizes)), flags)
        else:
            if res_in is not None:
                self._spent.add(bucket)  # consumed: it reads as zero from now on
            self._live.pop(bucket, None)
        if stage is not None:
            stage(packed[:n_imp])
        plan = self._frame(bucket, round, data, layout, sel, report, codec, elsewhere=pack)
        if pack and (bucket, round) not in self._pending:  # no report will recycle it (a hop's
            self._recycle(bucket, data)  # datagrams leave before its call returns; a session round's frames may not)
        return plan, data

    def _frame(self, bucket: int, round: int, flat: torch.Tensor, layout: BucketLayout, sel: Selection,
               report: bool, codec: int | None, elsewhere: bool) -> RoundPlan:
        """The frames of a round whose blocks ``sel`` sorted (see :meth:`plan`); its pending entry for the report."""
        raw = raw_bytes(flat)
        isz = flat.element_size()
        dt = wire.wire_dtype(flat.dtype)
        geom, cls_np, important, unimp, unsent = sel.geom, sel.cls_np, sel.important, sel.unimp, sel.unsent
        codec = self.codec if codec is None else codec  # the header's codec byte (a collective's call code)
        common = dict(token=self.token, rank=self.rank, round=round, bucket=bucket, codec=codec)

        reliable: list[tuple[bytes, memoryview]] = []
        begin = wire.encode_round_begin(layout.numel, layout.block, geom.frag, layout.sizes)
        # a round that sends no block as a datagram, its important ones carried elsewhere (a lossy ring hop whose
        # budget was zero): nothing of it can be lost and the blocks kept back are folded already, so no report
        nothing_out = elsewhere and not len(unimp)
        quiet = Flags.NO_REPORT if (not report and len(important) == layout.nblocks) or nothing_out else 0
        begin_hdr = wire.encode_header(FrameType.ROUND_BEGIN, length=len(begin), dtype=dt, flags=quiet, **common)
        reliable.append((begin_hdr, memoryview(begin)))
        if elsewhere:
            plan = RoundPlan(bucket, round, reliable, unimportant_blocks=len(unimp), unsent_blocks=len(unsent),
                             cls=cls_np.astype(np.int8), elsewhere=important)
        else:
            reliable += self._runs(raw, isz, dt, geom, important, common)
            plan = RoundPlan(bucket, round, reliable, important_blocks=len(important),
                             unimportant_blocks=len(unimp), unsent_blocks=len(unsent), cls=cls_np.astype(np.int8))
        if len(unsent):
            plan.unsent_lanes = lane_counts(cls_np[unsent])
            plan.unsent_bytes = int(geom.block_len[unsent].sum()) * isz
        pads = None  # the MAC's one-time pads of this round's fragment slots: one SHAKE call for every lane
        if self.mac is not None and len(unimp):
            pads = self.mac.pads(self.rank, self.peer, bucket, round, geom.nblocks * geom.frags_per_block)
        for lane in range(1, self.lanes):
            blocks = unimp[cls_np[unimp] == lane]
            if len(blocks):
                self._datagrams(plan, lane, raw, isz, dt, geom, blocks, common, pads)
        end = wire.encode_round_end(plan.important_blocks, len(unimp), len(reliable) - 1, plan.unreliable_frames())
        reliable.append((wire.encode_header(FrameType.ROUND_END, length=len(end), **common), memoryview(end)))
        if self.error_feedback and (len(unimp) or (len(unsent) and not nothing_out)):
            skip = None
            if elsewhere and len(important):
                skip = np.zeros(layout.nblocks, dtype=bool)
                skip[important] = True
            # its packing buffer is reused at the report
            self._pending[(bucket, round)] = (flat, layout, sel.unsent_mask(), skip)
            while len(self._pending) > self.max_pending:
                self._stages.pop(self._pending.popitem(last=False)[0], None)
                self.unreported += 1
        else:  # no report will free it
            self._stages.pop((bucket, round), None)
        return plan

    def _fold_unsent(self, bucket: int, flat: torch.Tensor, layout: BucketLayout, unsent: np.ndarray,
                     mask: np.ndarray) -> None:
        """The blocks the send budget kept back go into the residual. When the residual reads as zero (spent by
        this round's prepare, or none yet), it is written whole in one pass (``flat`` on those blocks, zero
        elsewhere) instead of being zeroed and then added to block by block."""
        res = self._residual.get(bucket)
        fresh = res is None or bucket in self._spent
        self._live.pop(bucket, None)
        if fresh and flat.device.type == "cpu" and flat.is_contiguous() and flat.dim() == 1:
            if res is None or res.numel() != flat.numel() or res.dtype != flat.dtype:
                res = self._residual[bucket] = torch.empty_like(flat)
            keep_blocks(res, flat, layout, mask)
            self._spent.discard(bucket)
            return
        fold_blocks(self._residual_for(bucket, flat), flat, layout, torch.from_numpy(unsent))

    def _data_headers(self, n: int, flags: int, lane: int, dt: int, common: dict[str, int], blk: np.ndarray,
                      off: np.ndarray, cnt: np.ndarray, isz: int) -> np.ndarray:
        h = wire.headers(n)
        h["ftype"] = FrameType.DATA
        h["flags"] = flags
        h["dtype"] = dt
        h["lane"] = lane
        for k in ("token", "rank", "round", "bucket", "codec"):
            h[k] = common[k]
        h["block"] = blk
        h["offset"] = off
        h["count"] = cnt
        h["length"] = cnt * isz
        return h

    def _runs(self, raw: np.ndarray, isz: int, dt: int, geom: Geometry, blocks: np.ndarray,
              common: dict[str, int]) -> list[tuple[bytes, memoryview]]:
        """Important blocks for the reliable lane. Runs of >= ``LONG_RUN`` consecutive blocks become zero-copy frames
        of at most ``reliable_frame_bytes``; scattered full blocks are packed one block per frame into a single buffer
        by one vectorised gather, so the Python work is per long run, never per block."""
        if len(blocks) == 0:
            return []
        if len(blocks) >= LONG_RUN and len(blocks) == len(geom.block_len) and blocks[-1] == len(blocks) - 1:
            return self._whole(raw, isz, dt, geom, len(blocks), common)  # a lossless round: one long run
        return self._run_frames(raw, isz, dt, geom, blocks, common)

    def _run_frames(self, raw: np.ndarray, isz: int, dt: int, geom: Geometry, blocks: np.ndarray,
                    common: dict[str, int]) -> list[tuple[bytes, memoryview]]:
        brk = np.ones(len(blocks), dtype=bool)
        brk[1:] = np.diff(blocks) != 1
        run_id = np.cumsum(brk) - 1
        run_first = np.flatnonzero(brk)
        run_len = np.diff(np.append(run_first, len(blocks)))
        long_blk = run_len[run_id] >= LONG_RUN
        block = geom.layout.block  # the round's own block size (its layout's: the codec's)
        full = geom.block_len[blocks] == block
        out: list[tuple[bytes, memoryview]] = []
        hs = wire.HEADER_SIZE
        single = blocks[~long_blk & full]
        if len(single):
            off = geom.block_start[single]
            cnt = np.full(len(single), block, dtype=np.int64)
            h = self._data_headers(len(single), Flags.IMPORTANT, 0, dt, common, single, off, cnt, isz)
            buf = self._stage_rows(common["bucket"], common["round"], len(single), hs + block * isz)
            buf[:, :hs] = h.view(np.uint8).reshape(-1, hs)
            gather_rows(raw, off * isz, block * isz, buf[:, hs:])
            out.append((b"", buf.data.cast("B")))
        # zero-copy frames: long runs (cut at reliable_frame_bytes) and the partial blocks of short runs
        zc = blocks[long_blk | ~full]
        if len(zc):
            per_frame = max(1, self.reliable_frame_bytes // (block * isz))
            zbrk = np.ones(len(zc), dtype=bool)
            zbrk[1:] = (np.diff(zc) != 1) | ~long_blk[long_blk | ~full][1:]
            zrun = np.cumsum(zbrk) - 1
            pos = np.arange(len(zc)) - np.flatnonzero(zbrk)[zrun]
            starts = np.flatnonzero(zbrk | (pos % per_frame == 0))
            ends = np.append(starts[1:], len(zc)) - 1
            first, last = zc[starts], zc[ends]
            off = geom.block_start[first]
            cnt = geom.block_end[last] - off
            hb = self._data_headers(len(starts), Flags.IMPORTANT, 0, dt, common, first, off, cnt, isz).tobytes()
            mv = raw.data
            out += [
                (hb[i * hs : (i + 1) * hs], mv[o * isz : (o + c) * isz])
                for i, (o, c) in enumerate(zip(off.tolist(), cnt.tolist()))
            ]
        return out

    def _whole(self, raw: np.ndarray, isz: int, dt: int, geom: Geometry, nb: int,
               common: dict[str, int]) -> list[tuple[bytes, memoryview]]:
        """Every block important (the frames :meth:`_runs` would cut from one long run, without its run finding)."""
        per_frame = max(1, self.reliable_frame_bytes // (geom.layout.block * isz))
        first = np.arange(0, nb, per_frame)
        last = np.minimum(first + per_frame - 1, nb - 1)
        off = geom.block_start[first]
        cnt = geom.block_end[last] - off
        hb = self._data_headers(len(first), Flags.IMPORTANT, 0, dt, common, first, off, cnt, isz).tobytes()
        mv, hs = raw.data, wire.HEADER_SIZE
        return [
            (hb[i * hs : (i + 1) * hs], mv[o * isz : (o + c) * isz])
            for i, (o, c) in enumerate(zip(off.tolist(), cnt.tolist()))
        ]

    def _datagrams(self, plan: RoundPlan, lane: int, raw: np.ndarray, isz: int, dt: int, geom: Geometry,
                   blocks: np.ndarray, common: dict[str, int], pads: np.ndarray | None = None) -> None:
        """One fragment per datagram: the equal-size ones as headers (built in one numpy step) plus the byte offsets
        of their payloads in the bucket; nothing is copied here (the channel packs each GSO batch as it sends).
        With a MAC, each datagram's pad is picked here (one SHAKE call per round drew them all)."""
        blk, off, cnt = geom.fragments_of(blocks)
        flags = Flags.FRAGMENT | (0 if pads is None else Flags.MAC)
        h = self._data_headers(len(blk), flags, lane, dt, common, blk, off, cnt, isz)
        full = cnt == geom.frag
        hs = wire.HEADER_SIZE
        hrows = h[full].view(np.uint8).reshape(-1, hs)
        if pads is not None:  # each datagram's one-time pad; the tags are made as the rows are packed
            pads = pads[slots(blk, (off - geom.block_start[blk]) // geom.frag, geom.frags_per_block)]
        mac = None if pads is None else self.mac
        plan.datagrams[lane] = DatagramRows(hrows, raw, off[full] * isz, geom.frag * isz, mac,
                                            None if pads is None else pads[full])
        odd = np.flatnonzero(~full)
        plan.odd[lane] = [self._odd(h[i : i + 1], raw, int(off[i]) * isz, int(cnt[i]) * isz, pads, int(i))
                          for i in odd]

    def _odd(self, h: np.ndarray, raw: np.ndarray, start: int, nbytes: int, pads: np.ndarray | None, i: int) -> bytes:
        """One odd-size datagram (a partial tensor tail), with its MAC trailer when the round has pads."""
        out = h.tobytes() + raw[start : start + nbytes].tobytes()
        if pads is None:
            return out
        hrow = h.view(np.uint8).reshape(1, wire.HEADER_SIZE)
        assert self.mac is not None  # pads are drawn only when the sender has a MAC
        tag = self.mac.tags(hrow, raw, np.array([start], np.int64), int(nbytes), pads[i : i + 1])
        return out + tag_bytes(tag).tobytes()
