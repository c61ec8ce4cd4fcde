"""One budget per peer for TCP and UDP (TransportConfig.pace_shared; issue 41 point 4): the loopback fallback of the
experiments paced the UDP lanes beside TCP at the same rate, so DGT had up to twice the baseline's capacity. With a
shared budget the reliable lane's bytes come off the bucket the datagrams draw from, and the send budget counts a
round's important bytes before it sizes the unimportant ones."""

from __future__ import annotations

import pytest
import torch
import trio

from dgt.harness.endpoints import connected_pair
from dgt.layout import BucketLayout
from dgt.protocol.pacing import Pacer, TokenBucket
from dgt.transport import Pacing, Timeouts, TransportConfig

RATE = 1e6  # bytes/s
BURST = 64 << 10
DGRAM = 1400


def _offered(shared: bool, tcp_share: float, seconds: float = 5.0, dt: float = 0.001) -> tuple[float, float]:
    """(TCP bytes, UDP bytes) over ``seconds``: TCP sends ``tcp_share`` of RATE (the kernel paces it to RATE at
    most), the UDP lanes as much as their pacer lets them (greedy, datagram by datagram)."""
    pacer = Pacer(RATE, BURST, None, 0.0, shared=TokenBucket(RATE, BURST, 0.0) if shared else None)
    tcp = udp = 0.0
    steps = int(seconds / dt)
    for i in range(1, steps + 1):
        now = i * dt
        chunk = int(tcp_share * RATE * dt)
        pacer.charge_reliable(chunk, now)
        tcp += chunk
        while pacer.ready_at(now) <= now:
            pacer.consume(DGRAM, now)
            udp += DGRAM
    return tcp, udp


@pytest.mark.parametrize("tcp_share", [1.0, 0.5, 0.0])
def test_tcp_and_udp_together_stay_within_one_budget(tcp_share):
    seconds = 5.0
    tcp, udp = _offered(True, tcp_share, seconds)
    assert tcp + udp <= RATE * seconds + BURST + DGRAM  # the shared budget's rate, its burst, one overdraw
    assert udp >= (1 - tcp_share) * RATE * seconds - DGRAM  # and the UDP lanes get what TCP leaves
    # apart (before issue 41): the UDP lanes had the whole rate again beside TCP's
    tcp_apart, udp_apart = _offered(False, tcp_share, seconds)
    assert udp_apart >= RATE * seconds - DGRAM
    if tcp_share:
        assert tcp_apart + udp_apart > RATE * seconds + BURST + DGRAM


def test_the_pacer_answers_for_both_buckets():
    shared = TokenBucket(RATE, BURST, 0.0)
    pacer = Pacer(2 * RATE, BURST, None, 0.0, shared=shared)
    assert pacer.rate == RATE  # the lower of the two
    pacer.charge_reliable(BURST + 100_000, 0.0)  # TCP overdrew the shared budget by 100 kB
    assert pacer.debt(0.0) == pytest.approx(100_000) and pacer.tokens(0.0) == pytest.approx(-100_000)
    assert pacer.ready_at(0.0) == pytest.approx(0.1)  # datagrams wait until TCP's bytes are paid for
    assert pacer.bucket.available(0.0) == BURST  # the UDP bucket itself was not charged
    pacer.consume(1000, 0.2)
    assert shared.available(0.2) == pytest.approx(BURST - 1000)  # paid off, refilled to its burst, less 1000
    alone = Pacer(RATE, BURST, None, 0.0)
    alone.charge_reliable(10**9, 0.0)  # no shared budget: TCP bytes are nobody's business
    assert alone.debt(0.0) == 0.0 and alone.ready_at(0.0) == 0.0


def test_pace_shared_needs_a_rate():
    with pytest.raises(ValueError, match="Pacing.shared needs Pacing.rate"):
        TransportConfig(pacing=Pacing(shared=True))


async def _round(cfg: TransportConfig, token: int) -> tuple[object, object, list[int], object]:
    """One round, half important (512 kB over TCP) and half unimportant, from rank 0 to rank 1: (send stats, the
    receiver's result, the bytes charged to the link's shared budget, the link's pacer)."""
    layout = BucketLayout([256 * 1024])
    x = torch.randn(layout.numel)
    cls = torch.zeros(layout.nblocks, dtype=torch.int64)
    cls[layout.nblocks // 2 :] = 1
    order = torch.arange(layout.nblocks // 2, layout.nblocks)
    async with connected_pair(token, cfg, cfg) as (a, b):
        pacer = a.links.table[1].pacer
        charged: list[int] = []
        charge = pacer.charge_reliable
        pacer.charge_reliable = lambda n, now: (charged.append(n), charge(n, now))[1]
        out = {}

        async def send() -> None:
            out["send"] = await a.send_round(1, 0, 0, x, layout, cls, order)

        async with trio.open_nursery() as n:
            n.start_soon(send)
            res = await b.recv_round(0, 0, 0)
    return out["send"], res, charged, pacer


async def test_an_endpoints_tcp_bytes_come_off_the_peers_shared_budget():
    """Over loopback: the link's pacer has the shared bucket, the round's reliable bytes are charged to it, and the
    send budget (the rate x its first 50 ms window, 100 kB) counts the round's 512 kB of important blocks first, so
    every unimportant block is held back (unsent, not lost). Apart, the same round sends 100 kB of them."""
    rate, blocks = 2e6, 128
    cfg = TransportConfig(timeouts=Timeouts(peer=10), pacing=Pacing(rate=rate, shared=True), deadline="fixed:0.01")
    sent, res, charged, pacer = await _round(cfg, 0x5EED_0041)
    assert pacer.shared is not None and pacer.shared.rate == rate
    assert sent.reliable_bytes > 512 * 1024 and charged == [sent.reliable_bytes]
    assert sent.unsent_blocks == blocks and sum(sent.datagrams.values()) == 0
    assert res.stats.unsent == blocks and res.stats.dropped == 0 and res.mask.sum() == blocks
    apart = TransportConfig(timeouts=Timeouts(peer=10), pacing=Pacing(rate=rate), deadline="fixed:0.01")
    sent, res, charged, pacer = await _round(apart, 0x5EED_0042)
    assert pacer.shared is None  # without pace_shared the UDP lanes have their own budget beside TCP's
    assert 0 < sent.unsent_blocks < blocks and sum(sent.datagrams.values()) > 0
    assert sent.unimportant_blocks == blocks - sent.unsent_blocks
