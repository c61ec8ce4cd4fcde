"""A lossy ring hop's round on the stream lane and the hop socket (dgt.transport.hop_round): end to end, ranks in
processes on loopback. Its frames ride the hop's first stream message, its datagrams the hop socket; the sans-IO
receiver lands and closes it, the drop report goes back on the session link."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgt.collectives.launch import run_ranks
from dgt.layout import DEFAULT_BLOCK
from dgt.transport.config import PeerAddress

SEGMENTS = [3000, 5, 20000, 1500]
NUMEL = sum(SEGMENTS)


def data(rank: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed * 100 + rank))


def _worker(rank, world, cfg_kwargs, rounds, meddle=None):
    """``rounds`` DGT ring calls; ``meddle``: "stranger" (rank 0 floods rank 1's hop socket from a socket of its
    own during the calls), "tamper" (rank 1 flips a payload byte of the first datagram each hop read), "busy" or
    "idle" (every rank's threads read as waiting for a CPU 40 % of the time, or never: the CPU gate's input)."""
    import socket
    import threading

    import trio

    from dgt.collectives import Group, RingAllReduce
    from dgt.transport import TransportConfig
    from dgt.transport.hop_round import HopRounds

    if meddle == "tamper" and rank == 1:
        land = HopRounds._land_reads

        def tampered(self, rx, off):
            if rx.reads:
                start = rx.reads[0][0]
                rx.buf[start + 60] ^= 0xFF  # in the payload of the first datagram read: its MAC no longer holds
            return land(self, rx, off)

        HopRounds._land_reads = tampered
    if meddle in ("busy", "idle"):
        import dgt.channels.hop_datagrams as hdm

        # every hop's reading is exactly (share * span, span): the runqueue is readable (a number, not None, also on
        # a host without schedstat) and its wait is set from the span the hop measured itself. (A fake runqueue
        # clock read beside the span's own reads drifted from it by whatever the thread waited between the two, a
        # GIL hand-off on a loaded host: a hop read as 0 % now and then.)
        share = 0.4 if meddle == "busy" else 0.0
        hdm.runqueue_seconds = lambda: 0.0
        finish = hdm.HopDatagrams.finish

        def read_finish(self, *a, **k):
            try:
                return finish(self, *a, **k)
            finally:
                if self.queued is not None:
                    self.queued = share * self.span

        hdm.HopDatagrams.finish = read_finish

    transfers: list[float] = []  # each hop's transfer time as the worker measured it (DatagramSend.window)
    sent = HopRounds.sent

    def hop_round_sent(self, hs, failed=False):
        if hs.datagrams is not None and hs.datagrams.window is not None:
            transfers.append(hs.datagrams.window)
        return sent(self, hs, failed)

    HopRounds.sent = hop_round_sent

    import dgt.transport.lossy_hop as ring_lossy

    halves = [0]  # hops whose sum was made in two halves (the stream lane's part beside the datagram reads)
    add = ring_lossy.add_blocks

    def add_blocks(*a, **k):
        halves[0] += 1
        return add(*a, **k)

    ring_lossy.add_blocks = add_blocks

    async def main():
        cfg = TransportConfig(**cfg_kwargs)
        async with Group.open(rank, world, config=cfg, timeout=30) as g:
            ring = RingAllReduce(g, "dgt:p=0.3")
            stop = threading.Event()
            flood = None
            outs = []
            hop_tx: list[int] = []  # datagrams the hop socket sent, after each call
            for rnd in range(rounds):
                res = await ring.allreduce(data(rank, rnd), 0, SEGMENTS)
                outs.append((res.tensor, res.stats.to_dict()))
                hop_tx.append(g.endpoint.streams.hop.counters.tx_datagrams)
                if meddle == "stranger" and rank == 0 and flood is None:  # the links are up after the first call
                    target = ("127.0.0.1", g.endpoint.links.table[1].address.hop_port)
                    junk = np.zeros(2000, np.uint8).tobytes()

                    def spam(junk: bytes, target: tuple[str, int]) -> None:
                        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                            while not stop.wait(0.001):
                                s.sendto(junk, target)

                    flood = threading.Thread(target=spam, args=(junk, target), daemon=True)
                    flood.start()
            stop.set()
            if flood is not None:
                flood.join()
            st = g.endpoint.stats()
            hop = g.endpoint.streams.hop
            lane1 = next(ln for ln in st.lanes if ln.lane == 1)
            return {"outs": outs, "hop_tx": hop.counters.tx_datagrams, "hop_rx": hop.counters.rx_datagrams,
                    "hop_strangers": hop.counters.rx_unknown_source,
                    "lane_tx": g.endpoint.sockets.udp[1].counters.tx_datagrams,
                    "lane1_tx_frames": lane1.tx_frames, "closed_by": st.closed_by, "rejects": st.reject_reasons,
                    "hop_port": g.endpoint.address.hop_port, "transfers": transfers,
                    "window": g.endpoint.links.table[(rank + 1) % world].window.value, "halves": halves[0],
                    "hop_tx_after": hop_tx, "gated": st.rounds_cpu_gated, "cpu_wait": st.cpu_wait,
                    "kept": _kept_back(g, world, rank)}

    return trio.run(main)


def _kept_back(g, world, rank):
    """What this rank's error feedback still holds after its calls, laid over the bucket: hop s of every call sent
    chunk rank - s, and its residual (to the next rank) holds what it kept back or lost of that chunk's sum."""
    from dgt.collectives.chunks import Chunking
    from dgt.collectives.parts import transport_key
    from dgt.layout import BucketLayout

    ch = Chunking(BucketLayout.of(SEGMENTS, DEFAULT_BLOCK), world)
    kept = torch.zeros(NUMEL)
    sender = g.endpoint.links.table[(rank + 1) % world].sender
    for s in range(world - 1):
        res = sender.residual(transport_key(0, "rs", s, 0))
        if res is not None:
            a = (rank - s) % world
            kept[ch.edges[a] : ch.edges[a + 1]] += res.reshape(-1)
    return kept


@pytest.mark.parametrize("hops,threads", [("auto", 1), ("auto", 2), ("python", 1)])
def test_the_rounds_travel_on_the_hop_socket_and_lose_nothing_when_nothing_drops(hops, threads):
    """With the native hop loop and with its Python twin (the datagram loop is Python in both); with one torch
    thread per rank (the hop's sum in one pass) and two (in two halves, the first beside the datagram reads)."""
    world = 3
    # a long fixed deadline: every datagram sent is in before a round closes; the CPU gate off (cpu_gate 0): this is
    # about the datagram path, which a busy CI host would otherwise close (test_a_host_with_no_cpu_to_spare_...)
    res = run_ranks(_worker, world, {"deadline": "fixed:10", "stream_hops": hops, "cpu_gate": 0.0}, 3, timeout=120,
                    env={"DGT_THREADS": str(threads)})
    ref = [torch.stack([data(r, k) for r in range(world)]).mean(0) for k in range(3)]  # the ring averages
    for r in range(world):
        info = res[r]
        assert info["hop_port"] > 0
        assert info["lane_tx"] == 0  # no datagram of the ring went on the session's UDP lane
        assert info["lane1_tx_frames"] == info["hop_tx"]  # the lane's stats include the hop socket's
        assert sum(info["closed_by"].values()) == (world - 1) * 3  # one round per reduce-scatter hop, each closed
        for k, (t, st) in enumerate(info["outs"]):
            assert st["dropped"] == 0, st
            assert torch.equal(t, res[0]["outs"][k][0])  # every rank holds the same tensor
        # the send budget's window to the next rank was learnt from the hops' transfers (the EWMA stays within the
        # samples it was fed), not from round start to drop report, which also holds this rank's planning and the
        # peer's landing
        assert info["transfers"] and info["window"] is not None
        assert min(info["transfers"]) - 1e-9 <= info["window"] <= max(info["transfers"]) + 1e-9, info
        assert info["halves"] == (0 if threads == 1 else (world - 1) * 3)  # every hop's sum took the path asked for
    # every datagram sent was read (loopback, nothing dropped), and none came from anywhere else
    assert sum(res[r]["hop_rx"] for r in range(world)) == sum(res[r]["hop_tx"] for r in range(world))
    if all(res[r]["outs"][0][1]["unsent"] == 0 for r in range(world)):  # call 0 kept nothing back: the exact mean
        torch.testing.assert_close(res[0]["outs"][0][0], ref[0], rtol=1e-5, atol=1e-5)


def test_a_crawling_fixed_pace_does_not_hold_the_ring():
    """No congestion control, so no send budget: every unimportant block is planned as a datagram, at 300 B/s after
    an 8 kB burst (~50 s a hop). Each hop's send half gives up once its peer's round must have closed (the adaptive
    policy's longest wait and a transfer time after the important blocks): the calls end in seconds, the blocks not
    sent count as dropped (error feedback carries them), every rank holds the same sum."""
    world = 3
    cfg = {"congestion_control": False, "pace_rate": 300.0, "pace_burst": 8192}
    res = run_ranks(_worker, world, cfg, 2, timeout=60)
    for r in range(world):
        for k, (t, st) in enumerate(res[r]["outs"]):
            assert st["dropped"] > 0, st  # announced, abandoned by the send half
            assert torch.isfinite(t).all() and torch.equal(t, res[0]["outs"][k][0])
        assert sum(res[r]["closed_by"].values()) == (world - 1) * 2


def test_a_host_with_no_cpu_to_spare_sends_no_datagrams_and_loses_nothing():
    """Every hop's thread reads as waiting for a CPU 40 % of its transfer: the CPU gate (default 0.1) closes once it
    has three readings (call 2's second hop, a little later if a hop was too short to read), and from then on no hop
    sends a datagram (calls 4 and 5 here): its unimportant blocks are all kept back (unsent, into error feedback),
    none is lost, every rank holds the same sum, and the stats say why. With the same calls on an idle host the
    gate stays open and datagrams flow in every call."""
    world, calls = 3, 5
    busy = run_ranks(_worker, world, {"deadline": "fixed:10"}, calls, "busy", timeout=120)
    idle = run_ranks(_worker, world, {"deadline": "fixed:10"}, calls, "idle", timeout=120)
    for r in range(world):
        b, i = busy[r], idle[r]
        assert b["cpu_wait"] == pytest.approx(0.4) and i["cpu_wait"] == pytest.approx(0.0, abs=1e-6)
        assert b["hop_tx_after"][0] > 0 and b["hop_tx_after"][4] == b["hop_tx_after"][2], b["hop_tx_after"]
        assert b["gated"] >= 2 * (world - 1) and i["gated"] == 0
        for k in range(3, calls):
            st = b["outs"][k][1]
            assert st["dropped"] == 0 and st["unsent"] > 0, st
            assert torch.equal(b["outs"][k][0], busy[0]["outs"][k][0])
            assert torch.isfinite(b["outs"][k][0]).all()
        assert all(x < y for x, y in zip(i["hop_tx_after"], i["hop_tx_after"][1:])), i["hop_tx_after"]
    # nothing lost on the busy host: over the calls, the sums (the ring averages) plus what error feedback still
    # keeps back on every rank are the whole input
    total = sum(data(r, k) for r in range(world) for k in range(calls))
    held = world * sum(busy[0]["outs"][k][0] for k in range(calls)) + sum(busy[r]["kept"] for r in range(world))
    assert sum(busy[r]["kept"].abs().sum() for r in range(world)) > 0  # (something was kept back)
    torch.testing.assert_close(held, total, rtol=1e-4, atol=1e-4)
    # call 1 of the idle host (no rank kept anything back then) gives the exact mean
    if all(idle[r]["outs"][0][1]["unsent"] == 0 for r in range(world)):
        ref = torch.stack([data(r, 0) for r in range(world)]).mean(0)
        torch.testing.assert_close(idle[0]["outs"][0][0], ref, rtol=1e-5, atol=1e-5)


def test_a_stranger_flooding_the_hop_socket_is_counted_and_changes_nothing():
    world = 3
    noisy = run_ranks(_worker, world, {"deadline": "fixed:10", "cpu_gate": 0.0}, 3, "stranger", timeout=120)
    assert noisy[1]["hop_strangers"] > 0  # dropped before landing, and counted
    assert not noisy[1]["rejects"]  # none of it reached the receiver
    for k in range(3):
        for r in range(world):
            assert noisy[r]["outs"][k][1]["dropped"] == 0  # nothing the peers sent was lost to the flood
            assert torch.equal(noisy[r]["outs"][k][0], noisy[0]["outs"][k][0])
        assert np.isfinite(noisy[0]["outs"][k][0].numpy()).all()


def test_a_tampered_datagram_is_refused_by_its_mac_and_counted_as_lost():
    world = 2
    # no congestion control, so no send budget (and no CPU gate): every unimportant block goes as a datagram, unpaced
    # (as in test_a_crawling_fixed_pace_does_not_hold_the_ring); the long fixed deadline lets each one land
    res = run_ranks(_worker, world, {"deadline": "fixed:10", "congestion_control": False}, 2, "tamper", timeout=120)
    info = res[1]
    assert info["hop_rx"] > 0 and res[0]["hop_tx"] > 0  # the datagrams were sent and read: there was one to tamper
    assert res[0]["outs"][0][1]["unsent"] == 0  # nothing kept back by a budget
    assert info["rejects"].get("bad-mac", 0) >= 1, info["rejects"]
    assert sum(st["dropped"] for _, st in info["outs"]) >= 1  # the block it carried is lost, not landed wrong
    assert all(torch.equal(res[0]["outs"][k][0], res[1]["outs"][k][0]) for k in range(2))


def test_the_hop_port_travels_in_the_peer_address():
    a = PeerAddress("10.0.0.1", 5000, (5001,), 3, 5002)
    assert PeerAddress.from_dict(a.to_dict()) == a
    assert PeerAddress.from_json(a.to_json()).hop_port == 5002
    legacy = {"host": "10.0.0.1", "tcp_port": 5000, "udp_ports": [5001], "rank": 3}  # no hop socket
    assert PeerAddress.from_dict(legacy).hop_port == 0
