"""The batched lossy path end to end, sans-IO: datagrams planned as headers + views of the bucket (DatagramRows),
packed a GSO batch at a time into one reused staging buffer, lost / duplicated / reordered, laid back to back as GRO
reads deliver them, decoded and scattered in bulk. The receiver must deliver exactly the blocks it reports: every
block whose fragments all arrived, bit-exact, zeros for the rest, and the drop report and the sender's error feedback
must agree with that, block for block."""

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.estimator import ContributionEstimator
from dgt.layout import BucketLayout
from dgt.protocol.datagram_rows import DatagramRows, byte_rows, scatter_rows
from dgt.protocol.deadline import FixedGrace
from dgt.protocol.receiver import RoundDone, RoundReceiver, _first_of, zeroed
from dgt.protocol.sender import RoundSender

TOKEN = 0xC0FFEE
SIZES = [3000, 1024, 5, 20000, 777, 40960]  # odd tails (odd-size datagrams) and a long aligned tensor


def _plan(p: float, seed: int, block: int = 1024, payload: int = 1400):  # 4 fragments a block
    torch.manual_seed(seed)
    layout = BucketLayout(SIZES, block)
    x = torch.randn(layout.numel)
    est = ContributionEstimator(layout)
    est.update(x)
    c = est.classify(p)
    tx = RoundSender(TOKEN, rank=1, datagram_payload=payload)
    flat = tx.prepare(0, x)
    return layout, flat, tx, tx.plan(0, 0, flat, layout, c.cls, c.order)


def _reliable(plan) -> bytes:
    return b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)


def _gso_batches(rows: DatagramRows, rng: np.random.Generator) -> list[np.ndarray]:
    """The datagrams as the channel sends them: slices of at most 61 rows, each packed into the same stage."""
    stage = np.empty((61, rows.seg), np.uint8)
    out, i = [], 0
    while i < len(rows):
        k = int(rng.integers(1, 62))
        out += list(rows[i : i + k].pack(stage).copy())  # the stage is reused: copy what "the kernel" took
        i += k
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fresh", [True, False])
def test_batched_round_under_loss_delivers_exactly_the_reported_blocks(seed, fresh):
    rng = np.random.default_rng(seed)
    layout, flat, tx, plan = _plan(p=0.3, seed=seed)
    rows = plan.datagrams[1]
    assert isinstance(rows, DatagramRows) and len(rows) > 100 and plan.odd[1]
    assert tx.geometry(layout, 4).frags_per_block == 4
    dgrams = [d.tobytes() for d in _gso_batches(rows, rng)] + list(plan.odd[1])
    kept = [d for d in dgrams if rng.random() >= 0.2]  # 20 % loss
    kept = [kept[i] for i in rng.permutation(len(kept))]  # reordering
    for i in sorted(rng.integers(0, len(kept), 40).tolist(), reverse=True):
        kept.insert(i + 1, kept[i])  # duplicates, next to their originals: most land in the same read

    out = torch.full((layout.numel,), 7.0)  # a caller's buffer full of stale values
    rx = RoundReceiver(TOKEN, rank=0, deadline=FixedGrace(0.01), allocator=None if fresh else lambda *_: out)
    events = rx.receive_bytes(_reliable(plan), 0, 0.0)
    assert not events  # the round waits for its datagrams
    pos = 0
    while pos < len(kept):  # GRO reads: a random number of datagrams back to back in one buffer
        k = int(rng.integers(1, 200))
        chunk = kept[pos : pos + k]
        pos += k
        events += rx.receive_datagrams(wire.decode_datagrams(b"".join(chunk), [len(d) for d in chunk], token=TOKEN),
                                       1, 0.001)
    events += rx.on_time(1.0)
    (done,) = [e for e in events if isinstance(e, RoundDone)]

    # what arrived, computed independently of the receiver: the (block, offset) of every delivered fragment
    frags_in: dict[int, set[int]] = {}
    for d in kept:
        h = np.frombuffer(d[: wire.HEADER_SIZE], wire.HEADER_DTYPE)[0]
        frags_in.setdefault(int(h["block"]), set()).add(int(h["offset"]))
    length = layout.block_len.numpy()
    frag = tx.geometry(layout, 4).frag
    need = -(-length // frag)
    expect = np.array([len(frags_in.get(b, ())) == need[b] for b in range(layout.nblocks)])
    expect[np.asarray(plan_important(plan, layout))] = True  # the reliable lane delivered the important blocks
    mask = done.mask.numpy()
    assert np.array_equal(mask, expect)
    assert 0 < done.stats.dropped == int((~mask).sum()) < layout.nblocks

    elem_in = np.repeat(mask, length)
    got, sent = done.data.numpy(), flat.numpy()
    assert np.array_equal(got[elem_in].view(np.uint32), sent[elem_in].view(np.uint32))  # bit-exact where reported
    assert not got[~elem_in].any()  # zeros elsewhere (a caller's stale values included)
    assert (done.data.data_ptr() == out.data_ptr()) == (not fresh)  # reassembled in the caller's buffer

    report = wire.decode_frames(done.report)[0]
    assert np.array_equal(np.unpackbits(np.frombuffer(report.payload, np.uint8), count=layout.nblocks) == 1, mask)
    info = tx.on_drop_report(report)
    assert info.missing_blocks == int((~mask).sum()) and info.folded_elems == int((~elem_in).sum())
    res = tx.residual(0).numpy()
    assert np.array_equal(res[~elem_in], sent[~elem_in]) and not res[elem_in].any()


def plan_important(plan, layout) -> list[int]:
    """Blocks of the plan's reliable DATA frames (whole-block runs)."""
    out = []
    end = layout.block_start.numpy() + layout.block_len.numpy()
    for f in wire.decode_frames(_reliable(plan)):
        if f.ftype == wire.FrameType.DATA:
            last = int(np.searchsorted(end, f.offset + f.count))
            out += list(range(f.block, last + 1))
    return out


def test_datagram_rows_read_like_the_packed_array():
    _, flat, _, plan = _plan(p=0.2, seed=5)
    rows = plan.datagrams[1]
    packed = np.asarray(rows)
    assert packed.shape == rows.shape == (len(rows), rows.seg) and rows.size == packed.size
    raw = flat.view(torch.uint8).numpy()
    for i in (0, 1, len(rows) // 2, len(rows) - 1, -1):
        o = int(rows.offsets[i])
        assert np.array_equal(rows[i], packed[i])
        assert np.array_equal(packed[i, wire.HEADER_SIZE :], raw[o : o + rows.payload])
        h = np.frombuffer(packed[i, : wire.HEADER_SIZE].tobytes(), wire.HEADER_DTYPE)[0]
        assert int(h["offset"]) * 4 == o and int(h["length"]) == rows.payload
    assert np.array_equal(np.asarray(rows[10:20]), packed[10:20])
    assert [r.tobytes() for r in rows[:3]] == [packed[i].tobytes() for i in range(3)]
    with pytest.raises(IndexError):
        rows[len(rows)]
    with pytest.raises(ValueError):
        rows.pack(np.empty((2, rows.seg), np.uint8))  # a stage too small is refused, never overrun
    with pytest.raises(ValueError):
        DatagramRows(rows.headers[:1], raw, np.array([len(raw) - 10]), rows.payload)  # payload outside the bucket


@pytest.mark.parametrize("regular", [True, False])
def test_scatter_rows_matches_a_loop(regular):
    rng = np.random.default_rng(1)
    n, row, seg = 300, 64, 100
    src = rng.integers(0, 256, n * seg + 7, dtype=np.uint8)
    pos = 7 + np.arange(n) * seg if regular else np.sort(rng.choice(n * seg - row, n, replace=False))
    dst_off = rng.choice(5000, n, replace=False) * 3  # unaligned destinations
    dst, ref = np.zeros(15000 + row, np.uint8), np.zeros(15000 + row, np.uint8)
    scatter_rows(dst, dst_off, src, pos, row)
    for o, p in zip(dst_off, pos):
        ref[o : o + row] = src[p : p + row]
    assert np.array_equal(dst, ref)
    assert np.array_equal(byte_rows(src, row, seg, 7, 2)[1], src[7 + seg : 7 + seg + row])


def test_first_of_keeps_one_of_each_value():
    ids = np.array([5, 3, 5, 5, 0, 3, 9])
    keep = _first_of(ids, np.empty(10, np.int32))
    assert sorted(ids[keep].tolist()) == [0, 3, 5, 9]


def test_zeroed_large_buffers_are_zero_and_writable():
    t = zeroed((8 << 20) // 4 + 3, torch.float32)
    assert t.numel() == (8 << 20) // 4 + 3 and not t.any()
    t[-1] = 2.0
    assert float(t.sum()) == 2.0


@pytest.mark.parametrize("offload", [True, False])
async def test_udp_channel_sends_datagram_rows_byte_exact(offload):
    """DatagramRows through a real UDP socket pair (GSO/GRO on and off): the datagrams that arrive are the packed
    rows, byte for byte, and the staging buffer is the one reused by every send."""
    import trio

    from dgt.channels.lanes import default_lanes
    from dgt.channels.udp import UdpChannel

    lane = default_lanes()[1]
    a = UdpChannel("127.0.0.1", lane, rcvbuf=8 << 20, gso=offload, gro=offload)
    b = UdpChannel("127.0.0.1", lane, rcvbuf=8 << 20, gso=offload, gro=offload)
    try:
        _, _, _, plan = _plan(p=0.3, seed=3)
        rows = plan.datagrams[1][:200]
        per = a.segments_per_send(rows.seg)
        stages = set()
        for i in range(0, len(rows), per):
            await a.send_rows(rows[i : i + per], ("127.0.0.1", b.port))
            stages.add(id(a._stage))
        assert len(stages) == 1
        got = []
        with trio.fail_after(5):
            while len(got) < len(rows):
                mv, sz = await b.recv_batch()
                starts = np.concatenate(([0], np.cumsum(sz)[:-1])).astype(np.int64)
                got += [bytes(mv[s : s + n]) for s, n in zip(starts.tolist(), sz.tolist())]
        assert got == [r.tobytes() for r in np.asarray(rows)]
        assert (a.counters.tx_gso_calls > 0) == offload and a.counters.tx_datagrams == len(rows)
    finally:
        a.close()
        b.close()
