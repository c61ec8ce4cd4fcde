"""The receiver's early buffer (datagrams that overtook their round's opening) is bounded per peer and expires
(issue 22: forged datagrams naming future rounds were kept forever and replayed into those rounds). Sans-IO, fake
clock."""

import torch

from dgt import wire
from dgt.estimator import ContributionEstimator
from dgt.harness.endpoints import connected_pair
from dgt.layout import BucketLayout
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender

TOKEN = 0xC0FFEE


def _plan(rnd, value, sender):
    layout = BucketLayout([8 * 1024])
    g = torch.full((layout.numel,), float(value))
    est = ContributionEstimator(layout)
    est.update(g + torch.arange(layout.numel) * 1e-3)
    c = est.classify(0.25)
    return g, sender.plan(0, rnd, sender.prepare(0, g), layout, c.cls, c.order)


def _dgrams(plan):
    return [(lane, arr[i].tobytes()) for lane, arr in plan.datagrams.items() for i in range(len(arr))]


def _feed_udp(rx, items, t):
    for lane, b in items:
        rx.receive_datagrams(wire.decode_datagrams(b, [len(b)], token=TOKEN), lane, t)


def test_forged_future_rounds_are_bounded_per_peer_and_expire_before_the_round_opens():
    rx = RoundReceiver(TOKEN, early_ttl=5.0, early_rounds_per_peer=8)
    forger = RoundSender(TOKEN, rank=3)  # knows the token, speaks as rank 3
    for rnd in range(1, 21):  # forged blocks for 20 future rounds
        _feed_udp(rx, _dgrams(_plan(rnd, 1000.0, forger)[1]), t=0.0)
    held = {e[0] for e in rx._early}
    assert held == {(3, 0, r) for r in range(1, 9)} and rx.counters.early_refused > 0  # rounds 9-20: refused
    # 6 s later the real rank 3 opens round 5 (one of those held): the forged copies expired, nothing is replayed
    real = RoundSender(TOKEN, rank=3)
    g, plan = _plan(5, 1.0, real)
    events = []
    t = 6.0
    for h, p in plan.reliable:
        events += rx.receive_bytes(h + bytes(p), 0, t)
    for lane, b in _dgrams(plan):
        events += rx.receive_datagrams(wire.decode_datagrams(b, [len(b)], token=TOKEN), lane, t)
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    assert rx.counters.early_expired >= 8
    assert torch.equal(done.data, g), "forged blocks were replayed into the real round"


def test_a_genuine_early_datagram_is_still_replayed_within_the_ttl():
    rx = RoundReceiver(TOKEN)
    g, plan = _plan(0, 2.0, RoundSender(TOKEN, rank=1))
    _feed_udp(rx, _dgrams(plan), t=0.0)  # datagrams overtake the opening
    events = []
    for h, p in plan.reliable:
        events += rx.receive_bytes(h + bytes(p), 0, 0.1)
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    assert done.stats.closed_by == "complete" and torch.equal(done.data, g)


def test_forged_future_rounds_sent_to_a_real_endpoint_never_reach_its_rounds():
    """The attack of issue 22 against real endpoints on loopback: a process that read the token from the store (but
    lacks DGT_SECRET) sends rank 1 datagrams in rank 0's name for rounds 1-20, before rank 0 sends them
    (``check_source`` off stands for an attacker that spoofs rank 0's address). Once, 107 of 110 such rounds
    delivered the forged blocks; now every round rank 0 sends arrives exactly as sent, and the forgeries are counted
    (``bad-mac``)."""
    import socket

    import trio

    from dgt.protocol.datagram_mac import DatagramMac
    from dgt.transport import Security, Timeouts, TransportConfig, auth

    cfg = TransportConfig(timeouts=Timeouts(peer=5), security=Security(check_source=False, secret=b"members only"),
                          deadline="fixed:2")

    async def main():
        async with connected_pair(TOKEN, cfg) as (a, b):
            guess = DatagramMac(auth.session_key(TOKEN, None))  # the key as derived without a secret
            # the endpoints' own datagram size, so the forgeries match the genuine rounds' geometry and reach the MAC
            forger = RoundSender(TOKEN, rank=0, mac=guess, peer=1, datagram_payload=cfg.payload_for("127.0.0.1"))
            ports = dict(zip(b.sockets.udp, b.address.udp_ports))
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for rnd in range(1, 21):
                    layout = BucketLayout([8 * 1024])
                    est = ContributionEstimator(layout)
                    est.update(torch.arange(layout.numel) * 1e-3)
                    c = est.classify(0.25)
                    g = torch.full((layout.numel,), 1000.0)
                    plan = forger.plan(0, rnd, forger.prepare(0, g), layout, c.cls, c.order)
                    for lane, b_ in _dgrams(plan):
                        s.sendto(b_, ("127.0.0.1", ports[lane]))
            await trio.sleep(0.2)
            for rnd in range(1, 6):  # the genuine rounds, with the same lossy classes
                x = torch.randn(8 * 1024)
                layout = BucketLayout([x.numel()])
                est = ContributionEstimator(layout)
                est.update(torch.arange(layout.numel) * 1e-3)
                c = est.classify(0.25)
                async with trio.open_nursery() as n:
                    n.start_soon(a.send_round, 1, 0, rnd, x, layout, c.cls, c.order)
                    res = await b.recv_round(0, 0, rnd, timeout=10)
                assert bool(res.mask.all()) and torch.equal(res.data, x), rnd
            assert b.receiver.counters.reasons.get("bad-mac", 0) > 0, b.receiver.counters.reasons

    trio.run(main)


def test_the_early_buffer_byte_bound_holds_and_its_refusals_are_counted():
    rx = RoundReceiver(TOKEN, early_bytes=64 * 1024, early_rounds_per_peer=8)
    forger = RoundSender(TOKEN, rank=2)
    for rnd in range(1, 5):  # ~4 x 24 KiB of datagrams for rounds not open yet: more than 64 KiB
        _feed_udp(rx, _dgrams(_plan(rnd, 1000.0, forger)[1]), t=0.0)
    assert 0 < rx._early.size <= 64 * 1024
    assert rx.counters.early_refused > 0  # the input dropped for lack of room is counted, not silently lost


def test_one_round_cannot_take_the_whole_early_buffer():
    """(i22) bounded per round too: a forger flooding one future round gets at most a quarter of the buffer, and a
    genuine early round of another peer still finds room."""
    rx = RoundReceiver(TOKEN, early_bytes=64 * 1024, early_rounds_per_peer=8)
    forger = RoundSender(TOKEN, rank=2)
    for _ in range(4):  # ~4 x 24 KiB of datagrams, all for one round not open yet
        _feed_udp(rx, _dgrams(_plan(1, 1000.0, forger)[1]), t=0.0)
    held = sum(len(e.data) for e in rx._early if e.key[0] == 2)
    assert 0 < held <= 16 * 1024 and rx.counters.early_refused > 0
    genuine = RoundSender(TOKEN, rank=1)
    refused = rx.counters.early_refused
    _feed_udp(rx, _dgrams(_plan(1, 1000.0, genuine)[1])[:8], t=0.0)
    assert rx.counters.early_refused == refused and any(e.key[0] == 1 for e in rx._early)


def test_opening_pending_says_which_batches_would_go_to_the_early_buffer():
    """The ingress lets the reliable lane's reader run before it feeds a batch whose round is not open yet
    (``opening_pending``), so datagrams that overtook their ROUND_BEGIN land without the early buffer's copy."""
    rx = RoundReceiver(TOKEN)
    tx = RoundSender(TOKEN, rank=1)
    g, plan = _plan(0, 2.0, tx)
    ((lane, b),) = _dgrams(plan)[:1]
    batch = wire.decode_datagrams(b, [len(b)], token=TOKEN)
    assert rx.opening_pending(batch)  # round (1, 0, 0) not open: its datagrams would be buffered
    junk = wire.decode_datagrams(b"\0" * len(b), [len(b)], token=TOKEN)
    assert not rx.opening_pending(junk)  # a malformed datagram never makes the ingress wait
    assert not rx.opening_pending(wire.decode_datagrams(b"", [], token=TOKEN))
    events = []
    for h, p in plan.reliable[:1]:  # ROUND_BEGIN: the round opens
        events += rx.receive_bytes(h + bytes(p), 0, 0.0)
    assert (1, 0, 0) in rx.rounds and not rx.opening_pending(batch)
    for h, p in plan.reliable[1:]:
        events += rx.receive_bytes(h + bytes(p), 0, 0.0)
    for ln, d in _dgrams(plan):
        events += rx.receive_datagrams(wire.decode_datagrams(d, [len(d)], token=TOKEN), ln, 0.0)
    (done,) = [e for e in events if isinstance(e, RoundDone)]
    assert torch.equal(done.data, g) and rx.counters.early_buffered == 0
    assert not rx.opening_pending(batch)  # closed: late, never waited for
