"""The datagram MAC (issue 22): genuine datagrams all pass; a flipped payload bit, a changed header field, a replay
into another round, a wrong key, a stripped tag are all refused (counted ``bad-mac``) and reach error feedback as
lost, never the sum; a forged first copy does not shut out the genuine fragment; C and numpy NH agree."""

import shutil

import numpy as np
import pytest
import torch

from dgt import wire
from dgt.estimator import ContributionEstimator
from dgt.harness import planned
from dgt.harness.endpoints import connected_pair
from dgt.layout import BucketLayout
from dgt.protocol import datagram_mac as dm
from dgt.protocol import landing
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.transport import Security, Timeouts

TOKEN = 0xC0FFEE
KEY = bytes(range(32))
SIZES = planned.SIZES
SENDER, RECEIVER = 3, 1


def test_the_nh_extension_is_built_where_a_compiler_is():
    """An install on a machine with a C compiler must not silently fall back to numpy NH and the numpy landing (the
    C-only tests here and tests/test_fused_landing.py would all be skipped): the extension imports, has every entry
    point dgt calls, and the fused landing is on."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: numpy NH and the numpy landing are the expected paths")
    assert dm._nh is not None, "dgt.protocol._nh was not built (setup.py builds it with optional=True)"
    missing = [f for f in ("nh", "tags", "land", "decode", "all_fragments") if not hasattr(dm._nh, f)]
    assert not missing, f"dgt.protocol._nh lacks {missing}: a stale build"
    assert landing.FUSED


def plan_round(mac, rnd=0, bucket=0, seed=0, dtype=torch.float32):
    return planned.plan_round(TOKEN, SENDER, RECEIVER, mac, rnd, bucket, seed, dtype, SIZES)


datagrams = planned.plan_datagrams


def run(rx, plan, items, t=0.0):
    """Reliable frames, then the datagrams (one batch per datagram), then time: the finished round."""
    events = []
    for h, p in plan.reliable:
        events += rx.receive_bytes(h + bytes(p), 0, t)
    for lane, b in items:
        events += rx.receive_datagrams(wire.decode_datagrams(bytes(b), [len(b)], token=TOKEN), lane, t)
    events += rx.on_time(t + 10.0)
    done = [e for e in events if isinstance(e, RoundDone)]
    assert len(done) == 1
    return done[0]


def receiver(key=KEY, native=True):
    return RoundReceiver(TOKEN, rank=RECEIVER, mac=dm.DatagramMac(key, native=native))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_genuine_datagrams_all_pass_and_the_round_is_exact(dtype, native):
    layout, flat, plan = plan_round(dm.DatagramMac(KEY, native=native), dtype=dtype)
    items = datagrams(plan)
    assert items and all(int(np.frombuffer(b[:48], wire.HEADER_DTYPE)["flags"][0]) & wire.Flags.MAC for _, b in items)
    assert any(len(b) != len(items[0][1]) for _, b in items)  # odd-size tails are tagged too
    rx = receiver(native=native)
    done = run(rx, plan, items)
    assert rx.counters.reasons.get("bad-mac", 0) == 0
    assert bool(done.mask.all()) and done.stats.dropped == 0
    assert torch.equal(done.data, flat)


def _flip_payload(b):
    b[60] ^= 1


def _flip_header_flag(b):  # a header field the round's geometry checks cannot catch (IMPORTANT): the MAC does
    b[4] ^= int(wire.Flags.IMPORTANT)


def _flip_tag(b):
    b[-1] ^= 0x80


@pytest.mark.parametrize("tamper", [_flip_payload, _flip_header_flag, _flip_tag])
def test_tampered_datagrams_are_refused_and_counted_as_lost(tamper):
    layout, flat, plan = plan_round(dm.DatagramMac(KEY))
    items = datagrams(plan)
    bad = set(range(0, len(items), 3))
    for i in bad:
        tamper(items[i][1])
    rx = receiver()
    done = run(rx, plan, items)
    assert rx.counters.reasons["bad-mac"] == len(bad)
    assert done.stats.dropped > 0 and not bool(done.mask.all())
    got = done.mask  # every block that arrived is exact; the refused ones are zeros (lost, for error feedback)
    exp = layout.expand(got)
    assert torch.equal(done.data[exp], flat[exp]) and bool((done.data[~exp] == 0).all())


def test_replay_into_another_round_and_a_wrong_key_are_refused():
    mac = dm.DatagramMac(KEY)
    _, flat0, plan0 = plan_round(mac, rnd=0)
    _, flat1, plan1 = plan_round(mac, rnd=1, seed=1)
    replay = []
    for lane, b in datagrams(plan0):  # round 0's genuine datagrams relabelled as round 1's
        h = np.frombuffer(bytes(b[:48]), wire.HEADER_DTYPE).copy()
        h["round"] = 1
        replay.append((lane, bytearray(h.tobytes()) + b[48:]))
    rx = receiver()
    done = run(rx, plan1, replay)
    assert rx.counters.reasons["bad-mac"] == len(replay)
    assert done.stats.unimportant_received == 0
    rx = receiver(key=bytes(32))  # a receiver with another session key refuses every datagram
    items = datagrams(plan0)
    done = run(rx, plan0, items)
    assert rx.counters.reasons["bad-mac"] == len(items) and done.stats.unimportant_received == 0


def test_datagrams_without_a_tag_are_refused_when_the_mac_is_on():
    _, flat, plan = plan_round(None)  # a sender without the MAC (or an attacker who strips it)
    items = datagrams(plan)
    rx = receiver()
    done = run(rx, plan, items)
    assert rx.counters.reasons["bad-mac"] == len(items) and done.stats.unimportant_received == 0


def test_a_forged_first_copy_does_not_shut_out_the_genuine_fragment():
    layout, flat, plan = plan_round(dm.DatagramMac(KEY))
    items = datagrams(plan)
    forged = []
    for lane, b in items:
        f = bytearray(b)
        f[48:-8] = bytes(len(f) - 56)  # zeros instead of the data, tag kept: a forgery that knows the token
        forged.append((lane, f))
    rx = receiver()
    done = run(rx, plan, forged + items)  # every forgery arrives first
    assert rx.counters.reasons["bad-mac"] == len(forged)
    assert bool(done.mask.all()) and torch.equal(done.data, flat)


def test_early_datagrams_keep_their_tags_through_the_early_buffer():
    layout, flat, plan = plan_round(dm.DatagramMac(KEY))
    items = datagrams(plan)
    rx = receiver()
    events = []
    for lane, b in items:  # before the round's opening frame: buffered whole, checked when replayed
        events += rx.receive_datagrams(wire.decode_datagrams(bytes(b), [len(b)], token=TOKEN), lane, 0.0)
    assert rx.counters.early_buffered == len(items)
    done = run(rx, plan, [])
    assert rx.counters.reasons.get("bad-mac", 0) == 0 and torch.equal(done.data, flat)


@pytest.mark.parametrize("nbytes", [1, 7, 8, 13, 48, 1072, 1080])
def test_c_and_numpy_nh_agree(nbytes):
    if dm._nh is None:
        pytest.skip("the C extension dgt.protocol._nh is not built")
    rng = np.random.default_rng(nbytes)
    data = rng.integers(0, 256, 20_000, dtype=np.uint8)
    starts = rng.integers(0, len(data) - nbytes, 300)  # any alignment
    key = dm.DatagramMac(KEY).key
    assert np.array_equal(dm.nh_rows(data, starts, nbytes, key), dm.nh_rows_numpy(data, starts, nbytes, key))


def test_nh_matches_its_definition_and_padding_is_hashed_at_full_length():
    mac = dm.DatagramMac(KEY, native=False)
    msg = np.arange(60, dtype=np.uint8)
    w = np.zeros(dm.MESSAGE_MAX // 4, np.uint64)
    w[:15] = msg.view("<u4")
    k = mac.key.astype(np.uint64)
    want = 0
    for i in range(0, len(w), 2):  # the definition, word pair by word pair, over the whole padded length
        want = (want + ((int(w[i]) + int(k[i])) % 2**32) * ((int(w[i + 1]) + int(k[i + 1])) % 2**32)) % 2**64
    assert int(mac.hash_packed(msg, np.array([0]), 60)[0]) == want
    assert int(mac.hash(msg[:48].reshape(1, 48), msg, np.array([48]), 12)[0]) == want  # header + payload split



@pytest.mark.parametrize("on", [True, False])
async def test_endpoints_tag_every_datagram_and_the_receiver_takes_them_all(on):
    """Real endpoints on loopback: a lossy round's datagrams all carry a MAC and all pass it (no loss hook, no
    deadline loss: every block arrives, none counted bad-mac); with the MAC off nothing is tagged."""
    import trio

    from dgt.transport import Security, Timeouts, TransportConfig

    cfg = TransportConfig(timeouts=Timeouts(peer=5), security=Security(datagram_mac=on), deadline="fixed:2")
    async with connected_pair(TOKEN, cfg) as (a, b):
        layout = BucketLayout(SIZES)
        x = torch.randn(layout.numel)
        est = ContributionEstimator(layout)
        est.update(x)
        c = est.classify(0.3)
        out = {}

        async def send():
            out["sent"] = await a.send_round(1, 2, 0, x, layout, c.cls, c.order)

        async with trio.open_nursery() as n:
            n.start_soon(send)
            res = await b.recv_round(0, 2, 0)
        assert sum(out["sent"].datagrams.values()) > 0
        assert b.receiver.counters.reasons.get("bad-mac", 0) == 0
        assert bool(res.mask.all()) and torch.equal(res.data, x)
        assert (b.receiver.mac is not None) == on and (a.links.table[1].sender.mac is not None) == on


async def test_endpoints_that_disagree_on_the_mac_refuse_to_connect():
    """One rank with the MAC and one without would refuse each other's every datagram: the handshake says so."""
    import trio

    from dgt.errors import DgtError, open_nursery
    from dgt.transport import Endpoint, TransportConfig

    async with (Endpoint.open(0, TOKEN, TransportConfig(timeouts=Timeouts(peer=5),
                                                        security=Security(datagram_mac=True))) as a,
                Endpoint.open(1, TOKEN, TransportConfig(timeouts=Timeouts(peer=5),
                                                        security=Security(datagram_mac=False))) as b):
        with pytest.raises(DgtError, match="datagram_mac"):
            with trio.fail_after(10):
                # dgt's nursery: the refusal itself, not trio >= 0.25's exception group of it (a plain trio nursery
                # of the caller's wraps it there, as trio does for any task's error)
                async with open_nursery() as n:
                    n.start_soon(a.connect, {1: b.address})
                    n.start_soon(b.connect, {0: a.address})


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_datagrams_never_reach_the_sum(seed):
    """Random byte changes anywhere in a datagram (header, payload, tag), delivered before the genuine copies: every
    changed one is refused (bad-mac or an invalid header), and every block the round holds is the genuine one."""
    layout, flat, plan = plan_round(dm.DatagramMac(KEY))
    items = datagrams(plan)
    rng = np.random.default_rng(seed)
    fuzzed = []
    for i in rng.choice(len(items), 40, replace=False):
        lane, b = items[i]
        f = bytearray(b)
        for pos in rng.integers(0, len(f), int(rng.integers(1, 4))):
            f[pos] ^= int(rng.integers(1, 256))
        fuzzed.append((lane, f))
    rx = receiver()
    genuine = items[::2]  # half of them: some blocks are lost, none may be wrong
    done = run(rx, plan, fuzzed + genuine)
    assert rx.counters.reasons["bad-mac"] > 0
    assert done.stats.lanes[1].frames == len(genuine)  # not one changed datagram was taken (some named other rounds)
    exp = layout.expand(done.mask)
    assert torch.equal(done.data[exp], flat[exp]) and bool((done.data[~exp] == 0).all())


def test_c_and_numpy_tags_agree_and_verify_each_other():
    if dm._nh is None:
        pytest.skip("the C extension dgt.protocol._nh is not built")
    packed = {}
    for native in (True, False):
        _, _, plan = plan_round(dm.DatagramMac(KEY, native=native))
        packed[native] = np.asarray(plan.datagrams[1])
    assert np.array_equal(packed[True], packed[False])
    rows = packed[True]
    k, seg = rows.shape
    starts = np.arange(0, k * seg, seg, dtype=np.int64)
    pads = dm.DatagramMac(KEY).pads(SENDER, RECEIVER, 0, 0, 1)[:1].repeat(k)  # wrong pads: every tag fails
    for native in (True, False):
        mac = dm.DatagramMac(KEY, native=native)
        assert not mac.verify(rows.reshape(-1), starts, seg - dm.TAG, pads).any()
