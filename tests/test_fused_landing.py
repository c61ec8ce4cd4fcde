"""The fused C landing of datagram fragments (issue 26, ``_nh.land``) and its numpy twin
(``land_fragments_numpy``) fed the same batches: valid, duplicated (the same bytes, and a different payload for the
same fragment), out of the round's blocks, misaligned, short of their fragment, of the wrong dtype, forged (MAC on),
truncated, of three rounds mixed in one read (one not open yet: early-buffered, then replayed). Both must land the same
bytes and leave the same masks, per-block state and counters, at every step and in the finished rounds."""

import dataclasses
import struct

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.harness import planned
from dgt.protocol import datagram_mac as dm
from dgt.protocol import landing
from dgt.protocol.datagram_decode import all_fragments, decode_datagrams
from dgt.protocol.receiver import RoundDone, RoundReceiver

pytestmark = pytest.mark.skipif(not landing.FUSED, reason="the C extension (dgt.protocol._nh) is not built")

TOKEN = 0xC0FFEE
KEY = bytes(range(32))
SIZES = planned.SIZES
SENDER, RECEIVER = 3, 1


def plan_round(mac, bucket, dtype, seed):
    return planned.plan_round(TOKEN, SENDER, RECEIVER, mac, 0, bucket, seed, dtype, SIZES)[2]


def datagrams(plan):
    return [(lane, bytes(b)) for lane, b in planned.plan_datagrams(plan)]


def _set(b, at, fmt, value):
    b = bytearray(b)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def mutants(items, rng, dtype, mac):
    """Malformed copies of some datagrams, each of one kind; the genuine ones stay in too."""
    isz = torch.empty(0, dtype=dtype).element_size()
    other = [d for d in range(len(wire.ITEMSIZE)) if wire.ITEMSIZE[d] == isz and d != wire.WIRE_OF[dtype]]
    out = []
    for lane, b in (items[i] for i in rng.choice(len(items), 40, replace=False)):
        block, off, cnt = struct.unpack_from(">I", b, 28)[0], struct.unpack_from(">Q", b, 32)[0], b[40:44]
        tail = wire.MAC_TAG if mac else 0
        out += [
            (lane, b),  # a plain duplicate
            (lane, _set(b, 28, ">I", block + 10_000)),  # past the round's blocks
            (lane, _set(b, 32, ">Q", off + 1)),  # not on a fragment start
            (lane, b[:-3]),  # truncated: the size no longer matches the header's length
        ]
        n = struct.unpack(">I", cnt)[0]
        if n > 1:  # one element short of its fragment: header consistent, geometry not
            s = _set(_set(b, 40, ">I", n - 1), 44, ">I", (n - 1) * isz)
            out.append((lane, s[: len(s) - isz - tail] + s[len(s) - tail :] if tail else s[: len(s) - isz]))
        if other:
            out.append((lane, _set(b, 5, "B", other[0])))  # same item size, another dtype
        f = bytearray(b)
        f[48] ^= 0x40  # a changed payload: bad-mac with the MAC on, else a second version of the fragment
        out.append((lane, bytes(f)))
    return out


def batches(items, rng):
    order = rng.permutation(len(items))
    cuts = np.sort(rng.choice(np.arange(1, len(items)), size=len(items) // 30, replace=False))
    for part in np.split(order, cuts):
        lanes = [items[i][0] for i in part]
        for lane in sorted(set(lanes)):
            chosen = [items[i][1] for i, ln in zip(part, lanes) if ln == lane]
            yield lane, b"".join(chosen), [len(c) for c in chosen]


def state(rx):
    out = {"counters": dataclasses.asdict(rx.counters)}
    for key, r in rx.rounds.items():
        out[key] = (r.raw.tobytes(), r.got.tobytes(), r.nfrag.tobytes(), r.important.tobytes(), r.lane_of.tobytes(),
                    r.n_done, r.n_imp_done, r.unimp_frames, repr(r.stats))
    return out


def feed(fused, mac, dtype, seed, monkeypatch):
    monkeypatch.setattr(landing, "FUSED", fused)
    rng = np.random.default_rng(seed)
    m = dm.DatagramMac(KEY) if mac else None
    plans = [plan_round(m, bucket, dtype, seed + bucket) for bucket in range(3)]
    items = [it for p in plans for it in datagrams(p)]
    items += mutants(items, rng, dtype, mac)
    rx = RoundReceiver(TOKEN, rank=RECEIVER, mac=dm.DatagramMac(KEY, native=fused) if mac else None)
    events, states = [], []
    for p in plans[:2]:  # bucket 2 opens only after its datagrams came: they wait in the early buffer
        for h, pl in p.reliable:
            events += rx.receive_bytes(h + bytes(pl), 0, 0.0)
    for lane, buf, sizes in batches(items, rng):
        events += rx.receive_datagrams(wire.decode_datagrams(buf, sizes, token=TOKEN), lane, 0.001)
        states.append(state(rx))
    for h, pl in plans[2].reliable:
        events += rx.receive_bytes(h + bytes(pl), 0, 0.002)
    states.append(state(rx))
    events += rx.on_time(10.0)
    done = sorted((e for e in events if isinstance(e, RoundDone)), key=lambda e: e.bucket)
    assert len(done) == 3
    return states, [(d.data.view(torch.uint8).numpy().tobytes(), d.mask.numpy().tobytes(),
                     dataclasses.asdict(d.stats), d.report) for d in done], rx


@pytest.mark.parametrize("mac", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_fused_landing_and_its_numpy_twin_agree(mac, dtype, seed, monkeypatch):
    calls = []
    real = landing.land_fragments_c
    monkeypatch.setattr(landing, "land_fragments_c", lambda *a: calls.append(1) or real(*a))
    s_c, done_c, rx_c = feed(True, mac, dtype, seed, monkeypatch)
    assert calls, "the fused path was not taken"
    n_fused = len(calls)
    s_n, done_n, _ = feed(False, mac, dtype, seed, monkeypatch)
    assert len(calls) == n_fused, "the numpy run went through the C landing"
    assert len(s_c) == len(s_n) and all(a == b for a, b in zip(s_c, s_n))
    assert done_c == done_n
    # the batches really held every kind of bad input, and each was counted
    reasons = rx_c.counters.reasons
    assert reasons.get("length", 0) + reasons.get("truncated", 0) > 0
    assert (reasons.get("bad-mac", 0) > 0) == mac
    assert rx_c.counters.early_buffered > 0
    stats = [d[2] for d in done_c]
    assert sum(s["rejected"] for s in stats) > 0 and sum(s["duplicated"] for s in stats) > 0


def test_genuine_rounds_land_bit_exact_through_the_fused_path():
    m = dm.DatagramMac(KEY)
    plan = plan_round(m, 0, torch.float32, 5)
    rx = RoundReceiver(TOKEN, rank=RECEIVER, mac=dm.DatagramMac(KEY))
    events = []
    for h, pl in plan.reliable:
        events += rx.receive_bytes(h + bytes(pl), 0, 0.0)
    items = datagrams(plan)
    for lane, buf, sizes in batches(items, np.random.default_rng(0)):
        events += rx.receive_datagrams(wire.decode_datagrams(buf, sizes, token=TOKEN), lane, 0.001)
    (done,) = [e for e in events if isinstance(e, RoundDone)]  # complete without waiting for a deadline
    assert bool(done.mask.all()) and done.stats.rejected == 0 and done.stats.duplicated == 0


def test_the_c_landing_refuses_a_payload_outside_its_buffer():
    plan = plan_round(None, 0, torch.float32, 2)
    rx = RoundReceiver(TOKEN, rank=RECEIVER)
    for h, pl in plan.reliable:
        rx.receive_bytes(h + bytes(pl), 0, 0.0)
    lane, b = datagrams(plan)[0]
    batch = wire.decode_datagrams(b, [len(b)], token=TOKEN)
    (r,) = rx.rounds.values()
    before = (r.got.copy(), r.nfrag.copy(), r.raw.copy())
    src = np.frombuffer(b, np.uint8)[:-4]  # the payload runs 4 bytes past what the C call is handed
    with pytest.raises(ValueError, match="outside"):
        landing.land_fragments_c(r, batch.headers, src, batch.payload_pos, lane, 0.0)
    assert all(np.array_equal(a, b) for a, b in zip(before, (r.got, r.nfrag, r.raw)))  # nothing written


def _decoded(batch):
    return (batch.headers.tobytes(), batch.payload_pos.tolist(), batch.reason.tolist(), bytes(batch.buf))


@pytest.mark.parametrize("mac", [False, True])
@pytest.mark.parametrize("token", [TOKEN, None, TOKEN + 1])
def test_the_c_decode_and_wire_decode_datagrams_agree(mac, token):
    """Every reason code: genuine datagrams, each header field broken, the size off, truncated, a read cut short,
    batches of 1..9 (the small-batch path of ``validate``) and of many."""
    rng = np.random.default_rng(3)
    plan = plan_round(dm.DatagramMac(KEY) if mac else None, 0, torch.float32, 4)
    items = [b for _, b in datagrams(plan)][:60]
    broken = []
    for b in items[:12]:
        broken += [
            _set(b, 0, ">H", 0x1234), _set(b, 2, "B", 9), _set(b, 3, "B", 200), _set(b, 5, "B", 99),
            _set(b, 44, ">I", 1 << 30), _set(b, 40, ">I", 3), _set(b, 32, ">Q", (1 << 64) - 2),
            _set(b, 8, ">Q", 7), _set(b, 16, ">I", 1 << 20), _set(b, 4, "B", b[4] ^ wire.Flags.MAC),
            _set(_set(b, 3, "B", int(wire.FrameType.BULK)), 28, ">I", 1), b[:-5], b[:30], b"",
        ]
    pool = items + broken
    reads = [[pool[i] for i in rng.choice(len(pool), size=k)] for k in (1, 3, 7, 9, 64, 200)]
    reads.append(pool)
    for grams in reads:
        buf, sizes = b"".join(grams), [len(g) for g in grams]
        want = wire.decode_datagrams(buf, sizes, token=token)
        assert _decoded(decode_datagrams(buf, sizes, token=token)) == _decoded(want)
        assert _decoded(decode_datagrams(buf, sizes, token=token, native=False)) == _decoded(want)
    every = wire.decode_datagrams(b"".join(pool), [len(g) for g in pool], token=token)
    want_codes = set(range(len(wire.REASONS)))
    if token is None:  # no token check
        want_codes -= {wire.REASONS.index("token")}
    elif token != TOKEN:  # every header passing the earlier checks fails on the token: none valid, none past it
        want_codes -= {0, wire.REASONS.index("rank")}
    assert set(every.reason.tolist()) == want_codes  # the reads held every reason the decode can give
    cut = b"".join(items[:5])  # the sizes claim more than the read holds
    sizes = [len(g) for g in items[:5]] + [100]
    want = wire.decode_datagrams(cut, sizes, token=token)
    assert _decoded(decode_datagrams(cut, sizes, token=token)) == _decoded(want)


@pytest.mark.parametrize("native", [True, False])
def test_all_fragments_says_whether_screening_has_anything_to_count(native):
    plan = plan_round(None, 0, torch.float32, 6)
    items = [b for _, b in datagrams(plan)][:20]
    control = _set(items[0], 3, "B", int(wire.FrameType.CONTROL))
    run = _set(items[0], 4, "B", items[0][4] & ~wire.Flags.FRAGMENT)  # a DATA run, not a fragment

    def check(grams):
        return all_fragments(wire.decode_datagrams(b"".join(grams), [len(g) for g in grams], token=TOKEN), native)

    assert check(items) and check(items[:1]) and check([])
    assert not check(items + [items[0][:-1]])  # one of the wrong size
    assert not check([control] + items)
    assert not check(items[:5] + [run] + items[5:])
