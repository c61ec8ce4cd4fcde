"""RoundSender.plan_split (the lossy ring hop's send side in one pass) against the three steps it replaces, sans-IO:
``prepare(bucket, flat)``, ``plan(..., elsewhere=True)`` and ``pack_blocks`` of the prepared copy's important
blocks. Two senders fed the same buckets, classes, orders, budgets and drop reports (which lose datagrams, on time or
a round late) must hand over the same packed important blocks, put the same bytes on the wire, keep the same residual
and read the reports alike. Then conservation: per round, what the stage got + what the receiver reports received +
the residual after the report is the input plus the residual before, element for element."""

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.layout import BucketLayout
from dgt.protocol.datagram_mac import DatagramMac
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.packed_blocks import pack_blocks, unpack_blocks
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.sender import DropInfo, RoundPlan, RoundSender

TOKEN = 0x5917
KEY = b"plan-split-test-session-key-0123"
GEOMS = {  # (sizes, block, datagram payload)
    "tails": ([3000, 1024, 7, 5000, 1500, 2100], 1024, 1400),  # starts at several residues mod 1024, partial tails
    "flat": ([16384], 1024, 1400),
    "small": ([300] * 9 + [0, 5, 1000], 256, 1024 + wire.HEADER_SIZE),
}


def _sender(block: int, payload: int, ef: bool, mac: bool) -> RoundSender:
    return RoundSender(TOKEN, rank=1, datagram_payload=payload, lanes=3, error_feedback=ef,
                       mac=DatagramMac(KEY) if mac else None, peer=0)


def _effective(tx: RoundSender) -> torch.Tensor | None:
    """The sender's residual as it reads (a spent one reads as zero), without touching its state (``residual()``
    zeroes a spent residual, which would change the path the next round takes)."""
    res = tx._residual.get(0)
    if res is None:
        return None
    return torch.zeros_like(res) if 0 in tx._spent else res.clone()


def _same_residual(a: RoundSender, b: RoundSender, when: str) -> None:
    ra, rb = _effective(a), _effective(b)
    assert (ra is None) == (rb is None), when
    if ra is not None:
        assert torch.equal(ra.view(torch.int32), rb.view(torch.int32)), when


def _flags_hold(tx: RoundSender, layout: BucketLayout) -> int:
    """plan_split's residual flags (RoundSender._live) are true: every block flagged 0 is zero in the (unspent)
    residual. Returns how many blocks the next plan_split will neither read nor re-zero."""
    entry, res = tx._live.get(0), tx._residual.get(0)
    live = None if entry is None else entry[1]
    assert entry is None or entry[0] == (layout.block, layout.sizes), "flags kept for another geometry"
    if live is None or res is None or 0 in tx._spent:
        return 0
    for b in np.flatnonzero(live == 0).tolist():
        a, k = int(layout.block_start[b]), int(layout.block_len[b])
        assert not res[a : a + k].any(), f"block {b} is flagged zero but holds values"
    return int((live == 0).sum())


def _wire(plan: RoundPlan) -> tuple[bytes, dict[int, np.ndarray], dict[int, list[bytes]]]:
    """Everything the plan puts on the wire, copied now (datagrams read the round's copy when packed)."""
    reliable = b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)
    return reliable, {ln: np.asarray(r).copy() for ln, r in plan.datagrams.items()}, \
        {ln: list(o) for ln, o in plan.odd.items()}


def _same_plan(pa: RoundPlan, pb: RoundPlan) -> None:
    for f in ("bucket", "round", "important_blocks", "unimportant_blocks", "unsent_blocks", "unsent_lanes",
              "unsent_bytes"):
        assert getattr(pa, f) == getattr(pb, f), f
    assert np.array_equal(pa.cls, pb.cls) and np.array_equal(pa.elsewhere, pb.elsewhere)
    wa, wb = _wire(pa), _wire(pb)
    assert wa[0] == wb[0]  # reliable frames: ROUND_BEGIN, ROUND_END
    assert wa[1].keys() == wb[1].keys() and wa[2].keys() == wb[2].keys()
    for ln in wa[1]:
        assert np.array_equal(wa[1][ln], wb[1][ln]), f"datagrams of lane {ln}"
        assert wa[2][ln] == wb[2][ln], f"odd datagrams of lane {ln}"


def _same_info(ia: DropInfo, ib: DropInfo) -> None:
    for f in ("bucket", "round", "missing_blocks", "folded_elems", "unsent_blocks", "timing"):
        assert getattr(ia, f) == getattr(ib, f), f
    assert (ia.lost_mask is None) == (ib.lost_mask is None)
    if ia.lost_mask is not None:
        assert np.array_equal(ia.lost_mask, ib.lost_mask)


def _deliver(rx: RoundReceiver, plan: RoundPlan, rnd: int, loss: float, rng: np.random.Generator) -> RoundDone:
    """The round through the receiver: reliable frames, then every datagram (as GRO reads) unless lost, then the
    deadline."""
    reliable, rows, odd = _wire(plan)
    now = 10.0 * rnd
    ev = rx.receive_bytes(reliable, 0, now)
    for ln in rows:
        dgrams = [r.tobytes() for r in rows[ln]] + odd[ln]
        kept = [d for d in dgrams if rng.random() >= loss]
        if kept:
            ev += rx.receive_datagrams(wire.decode_datagrams(b"".join(kept), [len(d) for d in kept], token=TOKEN),
                                       ln, now + 0.001)
    ev += rx.on_time(now + 5.0)
    (done,) = [e for e in ev if isinstance(e, RoundDone)]
    return done


def _round_reports(a: RoundSender, b: RoundSender, rx: RoundReceiver, plan: RoundPlan, rnd: int,
                   rng: np.random.Generator, late: bool, pending, not_counted: np.ndarray):
    """The report held back from the previous round if any (read after this round's plan: the ring does not wait),
    this round through the receiver, then its report read now or held for the next round (``late``). Both senders
    read every report and must keep the same residual. Returns the report held back (or None) and the blocks lost,
    ``not_counted`` left out."""
    if pending is not None:
        _same_info(a.on_drop_report(pending), b.on_drop_report(pending))
        _same_residual(a, b, f"round {rnd - 1}'s late report")
    done = _deliver(rx, plan, rnd, float(rng.choice([0.0, 0.2, 0.6])), rng)
    lost = int((~done.mask.numpy() & ~not_counted).sum())
    if done.report is None:  # a round that sent no datagram (budget 0) asks for none (NO_REPORT): nothing to fold
        assert plan.unimportant_blocks == 0 and not any(len(r) for r in plan.datagrams.values()), plan
        return None, lost
    report = wire.decode_frames(done.report)[0]
    if late:
        return report, lost
    _same_info(a.on_drop_report(report), b.on_drop_report(report))
    _same_residual(a, b, f"round {rnd}'s report")
    return None, lost


def _inputs(layout: BucketLayout, rng: np.random.Generator, integer: bool = False):
    if integer:
        x = torch.from_numpy(rng.integers(-50, 50, layout.numel).astype(np.float32))
    else:
        x = torch.from_numpy(rng.standard_normal(layout.numel).astype(np.float32))
    pick = rng.integers(0, 6)
    if pick == 0:
        cls: torch.Tensor | int = int(rng.integers(0, 3))  # one class for every block
    else:
        cls = torch.from_numpy(rng.choice(4, size=layout.nblocks, p=[0.3, 0.4, 0.2, 0.1]))  # 3 is capped to 2
    order = None if rng.random() < 0.3 else torch.from_numpy(rng.permutation(layout.nblocks))
    total = layout.numel * 4
    budget = [None, 0, 1, 3000, total // 3, 10**9][int(rng.integers(0, 6))]
    return x, cls, order, budget


def _keep(into: list[torch.Tensor]):
    """A stage callback that keeps a copy of the packed blocks (the view is reused by the bucket's next round)."""
    return lambda packed: into.append(packed.clone())


def _important(layout: BucketLayout, cls: torch.Tensor | int) -> np.ndarray:
    if isinstance(cls, int):
        return np.full(layout.nblocks, cls == 0)
    return cls.numpy() == 0


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("late", [False, True], ids=["report-on-time", "report-a-round-late"])
@pytest.mark.parametrize("ef,mac", [(True, False), (True, True), (False, False)], ids=["ef", "ef-mac", "no-ef"])
@pytest.mark.parametrize("seed", range(3))
def test_plan_split_equals_prepare_plan_elsewhere_and_pack(geom, late, ef, mac, seed):
    sizes, block, payload = GEOMS[geom]
    layout = BucketLayout(sizes, block)
    rng = np.random.default_rng(seed)
    a, b = _sender(block, payload, ef, mac), _sender(block, payload, ef, mac)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01), mac=DatagramMac(KEY) if mac else None)
    pending = None
    seen = {"res_in": 0, "kept": 0, "lost": 0, "skipped": 0}
    for rnd in range(8):
        x, cls, order, budget = _inputs(layout, rng)
        x_before = x.clone()
        staged: list[torch.Tensor] = []
        seen["res_in"] += _effective(a) is not None and bool(_effective(a).any())
        pa, data_a = a.plan_split(0, rnd, x, layout, cls, order, True, budget, None, _keep(staged))
        assert torch.equal(x, x_before)  # the caller's bucket is only read
        data_b = b.prepare(0, x)
        pb = b.plan(0, rnd, data_b, layout, cls, order, budget=budget, elsewhere=True)
        imp = _important(layout, cls)
        want = pack_blocks(data_b, layout, imp, torch.empty(layout.numel))
        assert len(staged) == 1 and np.array_equal(staged[0].view(torch.int32).numpy(),
                                                   want.view(torch.int32).numpy())
        _same_plan(pa, pb)
        seen["kept"] += pa.unsent_blocks
        _same_residual(a, b, f"round {rnd} planned")
        _flags_hold(a, layout)
        pending, lost = _round_reports(a, b, rx, pa, rnd, rng, late, pending, imp)
        seen["lost"] += lost
        seen["skipped"] += _flags_hold(a, layout)  # the losses folded back are flagged
    if pending is not None:
        _same_info(a.on_drop_report(pending), b.on_drop_report(pending))
    _same_residual(a, b, "the end")
    _flags_hold(a, layout)
    ra, rb = a.residual(0), b.residual(0)
    assert (ra is None) == (rb is None) and (ra is None or torch.equal(ra, rb))
    # the paths under test ran (the flags skip blocks wherever a residual is kept)
    assert seen["lost"] and (not ef or (seen["kept"] and seen["res_in"] and seen["skipped"]))


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("late", [False, True], ids=["report-on-time", "report-a-round-late"])
@pytest.mark.parametrize("mac", [False, True], ids=["no-mac", "mac"])
@pytest.mark.parametrize("seed", range(3))
def test_plan_split_without_a_stage_equals_prepare_and_plan(geom, late, mac, seed):
    """A session-link round (stage None: the important blocks framed from the private copy): the same frames,
    datagrams, residual and report handling as ``prepare`` then ``plan``, the kept-back blocks never copied."""
    sizes, block, payload = GEOMS[geom]
    layout = BucketLayout(sizes, block)
    rng = np.random.default_rng(200 + seed)
    a, b = _sender(block, payload, True, mac), _sender(block, payload, True, mac)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01), mac=DatagramMac(KEY) if mac else None)
    pending = None
    seen = {"res_in": 0, "kept": 0, "lost": 0, "important": 0}
    for rnd in range(8):
        x, cls, order, budget = _inputs(layout, rng)
        x_before = x.clone()
        seen["res_in"] += _effective(a) is not None and bool(_effective(a).any())
        pa, data_a = a.plan_split(0, rnd, x, layout, cls, order, True, budget, None, None)
        assert torch.equal(x, x_before)
        pb = b.plan(0, rnd, b.prepare(0, x), layout, cls, order, budget=budget)
        _same_plan(pa, pb)
        assert pa.important_blocks == int(_important(layout, cls).sum()) and pa.elsewhere is None
        seen["important"] += pa.important_blocks
        seen["kept"] += pa.unsent_blocks
        _same_residual(a, b, f"round {rnd} planned")
        pending, lost = _round_reports(a, b, rx, pa, rnd, rng, late, pending, np.zeros(layout.nblocks, bool))
        seen["lost"] += lost
    if pending is not None:
        _same_info(a.on_drop_report(pending), b.on_drop_report(pending))
    _same_residual(a, b, "the end")
    assert seen["lost"] and seen["kept"] and seen["res_in"] and seen["important"]  # the paths under test ran


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("leave_lost", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_conservation_over_rounds_with_loss(geom, leave_lost, seed):
    """Per round and element: stage's blocks + the blocks the receiver reports received + the residual after the
    report == input + residual before (float32, exactly: each element is y = x + r in exactly one of the three);
    integer-valued data, so over all rounds the sum delivered plus the last residual is the sum of the inputs."""
    sizes, block, payload = GEOMS[geom]
    layout = BucketLayout(sizes, block)
    rng = np.random.default_rng(100 + seed)
    tx = _sender(block, payload, True, False)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01))
    total_in = np.zeros(layout.numel, np.float64)
    total_out = np.zeros(layout.numel, np.float64)
    seen = {"kept": 0, "lost": 0, "received": 0, "carried": 0, "unreported": 0}
    for rnd in range(10):
        x, cls, order, budget = _inputs(layout, rng, integer=True)
        before = _effective(tx)
        r0 = torch.zeros(layout.numel) if before is None else before
        seen["carried"] += bool(r0.any())
        staged: list[torch.Tensor] = []
        plan, _ = tx.plan_split(0, rnd, x, layout, cls, order, True, budget, None, _keep(staged))
        if leave_lost:
            rx.leave_lost((1, 0, rnd))
        done = _deliver(rx, plan, rnd, float(rng.choice([0.1, 0.3, 0.7])), rng)
        if done.report is not None:
            tx.on_drop_report(wire.decode_frames(done.report)[0])
        else:  # no datagram sent (budget 0): the round asked for no report, its kept-back blocks are folded already
            assert plan.unimportant_blocks == 0
            seen["unreported"] += 1
        after = _effective(tx)
        r1 = torch.zeros(layout.numel) if after is None else after

        imp = plan.cls == 0
        got = done.mask.numpy()
        assert not (got & imp).any()  # the important blocks are not the round's: never counted twice
        recv = layout.expand(torch.from_numpy(got & ~imp))
        imp_e = layout.expand(torch.from_numpy(imp))
        assert not r1[recv | imp_e].any()  # the residual holds neither what was received nor what was staged
        pieces = torch.zeros(layout.numel)
        (stage,) = staged
        unpack_blocks(pieces, stage, layout, imp)
        pieces[recv] += done.data[recv]
        pieces += r1
        want = x + r0
        assert torch.equal(pieces, want), f"round {rnd}"
        assert np.allclose(pieces.double().numpy(), x.double().numpy() + r0.double().numpy(), rtol=1e-6, atol=0)
        if not r0.any():
            assert torch.equal(pieces, x)
        total_in += x.double().numpy()
        total_out += pieces.double().numpy() - r1.double().numpy()  # delivered this round
        seen["kept"] += plan.unsent_blocks
        seen["lost"] += int((~got & ~imp).sum()) - plan.unsent_blocks
        seen["received"] += int((got & ~imp).sum())
    final = _effective(tx)
    assert np.array_equal(total_out + (0 if final is None else final.double().numpy()), total_in)
    assert seen["kept"] and seen["lost"] and seen["received"] and seen["carried"]  # every path ran


@pytest.mark.parametrize("bad", ["bfloat16", "float64", "strided", "short"])
def test_plan_split_refuses_a_bucket_it_cannot_split_before_touching_anything(bad):
    layout = BucketLayout([3000, 1024], 1024)
    tx = _sender(1024, 1400, True, False)
    cls = torch.from_numpy(np.array([0, 1, 1, 2] * 2)[: layout.nblocks])
    # one block sent (so a report is awaited: a round that sends none asks for none), the rest kept back
    tx.plan_split(0, 0, torch.ones(layout.numel), layout, cls, None, True, 1, None, lambda p: None)
    res = _effective(tx).clone()
    x = {"bfloat16": torch.ones(layout.numel, dtype=torch.bfloat16), "float64": torch.ones(layout.numel).double(),
         "strided": torch.ones(2 * layout.numel)[::2], "short": torch.ones(layout.numel - 1)}[bad]
    staged: list[torch.Tensor] = []
    with pytest.raises(ValueError, match="plan_split|elements"):
        tx.plan_split(0, 1, x, layout, cls, None, True, 0, None, staged.append)
    assert not staged and torch.equal(_effective(tx), res) and list(tx._pending) == [(0, 0)]


@pytest.mark.parametrize("seed", range(3))
def test_a_bucket_whose_geometry_changes_between_rounds(seed):
    """The same bucket id with another layout (a residual, private copy and packing buffer of the wrong size left
    from the last round): plan_split still matches prepare + plan + pack, and the residual is rebuilt alike."""
    # the last two: the same elements and block count, other block boundaries (the residual's flags must not carry)
    layouts = [BucketLayout([3000, 1024, 7, 5000], 1024), BucketLayout([16384], 1024), BucketLayout([2500], 1024),
               BucketLayout([1500, 1000], 1024)]
    rng = np.random.default_rng(seed)
    a, b = _sender(1024, 1400, True, False), _sender(1024, 1400, True, False)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01))
    for rnd in range(9):
        layout = layouts[int(rng.integers(0, 4))]
        x, cls, order, budget = _inputs(layout, rng)
        staged: list[torch.Tensor] = []
        pa, _ = a.plan_split(0, rnd, x, layout, cls, order, True, budget, None, _keep(staged))
        data_b = b.prepare(0, x)
        pb = b.plan(0, rnd, data_b, layout, cls, order, budget=budget, elsewhere=True)
        want = pack_blocks(data_b, layout, _important(layout, cls), torch.empty(layout.numel))
        assert torch.equal(staged[0].view(torch.int32), want.view(torch.int32))
        _same_plan(pa, pb)
        _same_residual(a, b, f"round {rnd} planned")
        _flags_hold(a, layout)
        done = _deliver(rx, pa, rnd, 0.3, rng)
        if done.report is None:  # no datagram sent (budget 0): no report asked for, nothing to fold
            assert pa.unimportant_blocks == 0
            continue
        report = wire.decode_frames(done.report)[0]
        _same_info(a.on_drop_report(report), b.on_drop_report(report))
        _same_residual(a, b, f"round {rnd}'s report")
        _flags_hold(a, layout)


@pytest.mark.parametrize("seed", range(4))
def test_a_late_report_of_another_geometry_drops_the_residual_flags(seed):
    """Round r planned with one layout, round r + 1 with another of the same elements and block count (other block
    boundaries), then round r's report: its lost blocks are folded by r's layout, so the flags (for r + 1's blocks)
    are dropped, and the next round reads the whole residual. Equal to prepare + plan throughout."""
    layouts = [BucketLayout([2500], 1024), BucketLayout([1500, 1000], 1024)]
    rng = np.random.default_rng(seed)
    a, b = _sender(1024, 1400, True, False), _sender(1024, 1400, True, False)
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01))
    pending, folded = None, 0
    for rnd in range(10):
        layout = layouts[rnd % 2]
        x = torch.from_numpy(rng.standard_normal(layout.numel).astype(np.float32))
        cls = torch.from_numpy(rng.choice(3, size=layout.nblocks, p=[0.2, 0.6, 0.2]))
        staged: list[torch.Tensor] = []
        pa, _ = a.plan_split(0, rnd, x, layout, cls, None, True, 3000, None, _keep(staged))
        pb = b.plan(0, rnd, b.prepare(0, x), layout, cls, None, budget=3000, elsewhere=True)
        _same_plan(pa, pb)
        _flags_hold(a, layout)
        if pending is not None:  # the previous round's report, of the other layout
            ia = a.on_drop_report(pending)
            _same_info(ia, b.on_drop_report(pending))
            folded += ia.folded_elems
            if ia.folded_elems:
                assert 0 not in a._live  # folded by another geometry's blocks: the flags are gone
            _same_residual(a, b, f"round {rnd - 1}'s late report")
        done = _deliver(rx, pa, rnd, 0.5, rng)
        pending = wire.decode_frames(done.report)[0]
    assert folded  # the case under test ran


def test_a_split_round_that_sends_no_datagram_asks_for_no_report():
    """Budget 0 (a lossy ring hop while the CPU gate is closed, or its pacer in debt): the important blocks go to the
    stage, every other one into the residual, nothing on the datagram lanes. Nothing of the round can be lost and
    nothing waits to be folded, so its ROUND_BEGIN carries NO_REPORT, the receiver closes it complete without a
    report, and the sender keeps no pending entry; stage + residual is the input. With one block's budget the same
    round asks for its report as before."""
    layout = BucketLayout([3000, 1024, 7, 5000], 1024)
    cls = torch.from_numpy(np.array([0, 1, 1, 2, 0, 1, 1, 2, 1, 0])[: layout.nblocks])
    x = torch.from_numpy(np.random.default_rng(5).standard_normal(layout.numel).astype(np.float32))
    for budget, quiet in [(0, True), (1, False)]:
        tx = _sender(1024, 1400, True, False)
        rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01))
        staged: list[torch.Tensor] = []
        plan, _ = tx.plan_split(0, 0, x, layout, cls, None, True, budget, None, _keep(staged))
        begin = wire.decode_frames(bytes(plan.reliable[0][0]) + bytes(plan.reliable[0][1]))[0]
        assert bool(begin.flags & wire.Flags.NO_REPORT) == quiet
        assert (plan.unimportant_blocks == 0) == quiet and plan.unsent_blocks > 0
        done = _deliver(rx, plan, 0, 0.0, np.random.default_rng(0))
        assert (done.report is None) == quiet and done.stats.closed_by == "complete" and done.stats.dropped == 0
        assert (list(tx._pending) == []) == quiet
        if quiet:
            imp = _important(layout, cls)
            pieces = tx.residual(0).clone()
            unpack_blocks(pieces, staged[0], layout, imp)
            assert torch.equal(pieces, x)  # every element either staged or kept back, none lost
