"""The worker-side datagram loop of a lossy ring hop (dgt.channels.hop_datagrams), on real loopback UDP sockets.

What it must do whatever the peer or the network does: count only the round's own datagrams, drop strangers, stop at
the deadline when datagrams are missing, never write past the buffer it was given, pace at the rate it was given,
and stop when cancelled.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from dgt import wire
from dgt.channels.hop_datagrams import (
    NAME,
    SLOT,
    DatagramRecv,
    DatagramSend,
    HopDatagrams,
    HopDatagramsCancelled,
    PacerThread,
    _count,
)
from dgt.protocol.deadline import FixedGrace

SEG = 1000


def run(sock, tx, rx, pacer, cancel_fd=-1):
    """Both halves at once, no stream message in between (what a hop does around its messages)."""
    hd = HopDatagrams(sock, tx, pacer)
    hd.start()
    hd.finish(rx, cancel_fd)


def _sock() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return s


def _addr(s: socket.socket) -> tuple[str, int]:
    return s.getsockname()[:2]


def _rows(k: int, rank: int = 1, bucket: int = 7, round: int = 3, seg: int = SEG) -> np.ndarray:
    """``k`` datagrams whose headers name (rank, round, bucket) and whose payload bytes count up."""
    rows = np.zeros((k, seg), np.uint8)
    h = wire.headers(k)
    h["rank"], h["round"], h["bucket"], h["block"] = rank, round, bucket, np.arange(k)
    rows[:, : wire.HEADER_SIZE] = h.view(np.uint8).reshape(k, -1)
    rows[:, wire.HEADER_SIZE :] = (np.arange(k)[:, None] + np.arange(seg - wire.HEADER_SIZE)) % 251
    return rows


def _name(rank: int = 1, bucket: int = 7, round: int = 3) -> bytes:
    h = wire.headers(1)
    h["rank"], h["round"], h["bucket"] = rank, round, bucket
    return h.tobytes()[NAME]


def _send(rows: np.ndarray, tx: socket.socket, rx: socket.socket, rate: float = 1e12, burst: int = 1 << 30,
          odd: list[bytes] | None = None) -> DatagramSend:
    return DatagramSend(rows, odd or [], _addr(rx), rate, burst, float(burst), segments=16, gso=True)


def _recv(rx_from: socket.socket, expect: int, grace: float = 0.05, nbytes: int | None = None,
          name: bytes | None = None) -> DatagramRecv:
    buf = np.zeros(nbytes if nbytes is not None else expect * SEG + 2 * SLOT, np.uint8)
    return DatagramRecv(buf, _addr(rx_from), name or _name(), expect, FixedGrace(grace).deadline)


def _payloads(rx: DatagramRecv) -> np.ndarray:
    """The datagrams read, as [k, SEG] rows (all of SEG bytes here)."""
    return rx.buf[: rx.pos].reshape(-1, SEG)


@pytest.fixture
def pair():
    a, b = _sock(), _sock()
    yield a, b
    a.close()
    b.close()


def test_every_datagram_arrives_byte_exact_and_the_receive_ends_when_all_are_in(pair):
    a, b = pair
    rows = _rows(40)
    tx = _send(rows, a, b)
    run(a, tx, None, PacerThread())
    assert tx.sent == 40 and tx.sent_bytes == rows.size and tx.abandoned == 0
    rx = _recv(a, 40, grace=5.0)  # a long deadline: it must end because all are in, not because of it
    t0 = time.perf_counter()
    HopDatagrams(b, None, PacerThread()).finish(rx)
    assert time.perf_counter() - t0 < 1.0
    assert rx.got == 40 and rx.stale == 0 and not rx.full
    got = _payloads(rx)
    order = np.argsort(got[:, 28:32].view(">u4").ravel())  # the block field: GRO keeps order, but do not rely on it
    assert np.array_equal(got[order], rows)
    assert sum(n for _, n, _ in rx.reads) == rows.size
    assert rx.drains and rx.drains[-1][0] == len(rx.reads)


def test_datagrams_of_another_round_do_not_count_as_this_rounds(pair):
    a, b = pair
    run(a, _send(_rows(3, round=2), a, b), None, PacerThread())  # late ones of an earlier round
    run(a, _send(_rows(5), a, b), None, PacerThread())
    rx = _recv(a, 5, grace=5.0)
    HopDatagrams(b, None, PacerThread()).finish(rx)
    assert (rx.got, rx.stale) == (5, 3)


def test_datagrams_from_a_stranger_are_dropped_and_counted(pair):
    a, b = pair
    stranger = _sock()
    try:
        stranger.sendto(_rows(1)[0].tobytes(), _addr(b))  # names the round, comes from elsewhere
        run(a, _send(_rows(2), a, b), None, PacerThread())
        rx = _recv(a, 2, grace=5.0)
        HopDatagrams(b, None, PacerThread()).finish(rx)
        assert rx.got == 2 and rx.strangers == 1
        assert rx.pos == 2 * SEG  # nothing of the stranger's was kept
    finally:
        stranger.close()


def test_missing_datagrams_end_the_receive_at_the_deadline(pair):
    a, b = pair
    run(a, _send(_rows(2), a, b), None, PacerThread())
    rx = _recv(a, 5, grace=0.15)  # 5 announced, 2 sent
    HopDatagrams(b, None, PacerThread()).finish(rx)
    assert rx.got == 2
    assert rx.closed_at is not None and 0.15 <= rx.closed_at - rx.imp_at < 2.0


def test_the_wait_never_passes_its_longest_whatever_the_policy(pair):
    a, b = pair
    run(a, _send(_rows(2), a, b), None, PacerThread())
    rx = _recv(a, 5, grace=30.0)  # a policy that would wait 30 s for the 3 missing
    rx.longest = 0.2  # the stream hub's bound: half the exchange's progress timeout
    HopDatagrams(b, None, PacerThread()).finish(rx)
    assert rx.got == 2 and rx.closed_at is not None and 0.2 <= rx.closed_at - rx.imp_at < 2.0


def test_nothing_expected_ends_at_once(pair):
    a, b = pair
    rx = _recv(a, 0, grace=5.0)
    t0 = time.perf_counter()
    HopDatagrams(b, None, PacerThread()).finish(rx)
    assert time.perf_counter() - t0 < 0.5 and rx.got == 0


def test_reads_never_pass_the_buffer_whatever_the_peer_sends(pair):
    a, b = pair
    run(a, _send(_rows(200), a, b), None, PacerThread())  # far more than announced and than the buffer holds
    rx = _recv(a, 3, grace=0.1, nbytes=SLOT + 5000)
    rx.expect = 10**6  # a peer that announces anything
    HopDatagrams(b, None, PacerThread()).finish(rx)
    assert rx.full and rx.pos <= len(rx.buf)
    assert all(start + n <= len(rx.buf) for start, n, _ in rx.reads)


def test_the_send_half_keeps_the_rate_it_was_given(pair):
    a, b = pair
    rows = _rows(100)  # 100 kB at 1 MB/s after a 10 kB burst: ~90 ms
    tx = _send(rows, a, b, rate=1e6, burst=10_000)
    t0 = time.perf_counter()
    hd = HopDatagrams(a, tx, PacerThread())
    hd.start()  # everything from the pacer thread: the burst at once, the rest at the rate
    assert tx.sent < 100
    hd.finish(None)
    took = time.perf_counter() - t0
    assert tx.sent == 100 and 0.07 <= took < 2.0, (tx.sent, took)
    times = [t for t, _, _ in tx.sends]
    assert times == sorted(times) and times[-1] - times[0] >= 0.07


def test_cancel_stops_both_halves_promptly(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        tx = _send(_rows(100), a, b, rate=1e4, burst=1000)  # would take ~10 s
        rx = _recv(a, 5, grace=10.0)
        hd = HopDatagrams(b, tx, PacerThread())
        hd.start()
        threading.Timer(0.1, lambda: os.write(w, b"x")).start()
        t0 = time.perf_counter()
        with pytest.raises(HopDatagramsCancelled):
            hd.finish(rx, cancel_fd=r)
        assert time.perf_counter() - t0 < 1.0
        sent = tx.sent
        time.sleep(0.05)
        assert tx.sent == sent  # the pacer stopped with it
    finally:
        os.close(r)
        os.close(w)


def test_a_cancel_ends_a_long_pacing_sleep_at_once(pair):
    """At a crawl a GSO call's tokens are seconds away: the pacer's sleep must not hold the cancel (or the hop)."""
    a, b = pair
    r, w = os.pipe()
    try:
        tx = _send(_rows(100), a, b, rate=100.0, burst=1000)  # after the first datagram: 16 kB calls at 100 B/s
        hd = HopDatagrams(b, tx, PacerThread())
        hd.start()
        threading.Timer(0.1, lambda: os.write(w, b"x")).start()
        t0 = time.perf_counter()
        with pytest.raises(HopDatagramsCancelled):
            hd.finish(_recv(a, 5, grace=10.0), cancel_fd=r)
        assert time.perf_counter() - t0 < 1.0  # the send half ended too (finish waits for it)
        assert tx.sent < 100 and tx.abandoned == 0  # cancelled: the call fails, nothing is accounted as abandoned
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("grace", [0.05, 0.2])
def test_the_send_half_abandons_what_its_peer_no_longer_takes(pair, grace):
    """The peer's round closes at most its policy's longest wait after its important blocks: what the send half
    still holds that long after this rank's were in, plus one transfer time (its stream messages' ``window``), is
    abandoned (counted), not paced out for minutes."""
    a, b = pair
    rows = _rows(400)
    tx = _send(rows, a, b, rate=1e4, burst=10_000)  # 10 rows at once, then one every 0.1 s: ~40 s in all
    rx = _recv(b, 0, grace=grace)
    rx.peer_wait = grace
    hd = HopDatagrams(a, tx, PacerThread())
    hd.start()
    t0 = time.perf_counter()
    hd.finish(rx)
    assert time.perf_counter() - t0 < grace + tx.window + 0.5
    assert 10 <= tx.sent < 400 and tx.abandoned == 400 - tx.sent and tx.errors == 0
    assert max(t for t, _, _ in tx.sends) <= rx.imp_at + grace + tx.window  # nothing left after the cutoff
    assert hd.cutoff == rx.imp_at + grace + tx.window
    sent = tx.sent
    time.sleep(0.15)
    assert tx.sent == sent


def test_a_policy_without_a_longest_wait_keeps_sending_until_the_limit(pair):
    a, b = pair
    tx = _send(_rows(40), a, b, rate=2e5, burst=10_000)  # 10 at once, the rest over ~0.15 s
    rx = _recv(b, 0, grace=0.01)  # peer_wait unknown (inf): no cutoff
    hd = HopDatagrams(a, tx, PacerThread())
    hd.start()
    hd.finish(rx)
    assert tx.sent == 40 and tx.abandoned == 0


def test_a_send_to_a_closed_port_is_lost_not_fatal(pair):
    a, b = pair
    gone = _sock()
    addr = _addr(gone)
    gone.close()
    a.connect(addr)  # connected: the kernel reports the ICMP error on the next call
    a.send(b"x")
    time.sleep(0.05)
    tx = DatagramSend(_rows(3), [b"odd"], addr, 1e12, 1 << 30, float(1 << 30))
    run(a, tx, None, PacerThread())
    assert tx.sent + tx.errors == 4 and tx.errors >= 1


def test_counting_reads_with_short_last_datagrams():
    buf = np.zeros(1000, np.uint8)
    name = _name()
    for start in (0, 100, 200, 260):
        buf[start + 16 : start + 28] = np.frombuffer(name, np.uint8)
    buf[116] ^= 1  # the second datagram of the first read names another round
    total, mine, others = _count(buf, [(0, 260, 100), (260, 50, 50)], name)
    assert (total, mine) == (4, 3)
    other = bytearray(name)
    other[0] ^= 1
    assert others == {bytes(other): 1}
    assert _count(buf, [(0, 20, 100)], name)[:2] == (1, 0)  # too short to name anything


def test_datagrams_read_ahead_of_their_round_count_for_it():
    """A peer ahead: the next round's datagrams arrive while this hop still reads its own. The hop that reads them
    counts them for their round (the receiver buffers their data until the round opens), so that round's own hop
    does not wait for its deadline for what was already read."""
    from dgt.channels.lanes import LaneSpec
    from dgt.channels.udp import UdpChannel
    from dgt.transport.streams import Hop, StreamHub

    peer = _sock()
    hop = UdpChannel("127.0.0.1", LaneSpec("bulk", "udp", 1))
    hub = StreamHub(0, 1, 5.0, dial=None, link_error=lambda p: None, hop=hop)  # type: ignore[arg-type]
    try:
        addr = ("127.0.0.1", hop.port)
        for rows in (_rows(2, round=3), _rows(3, round=4)):
            for r in rows:
                peer.sendto(r.tobytes(), addr)
        time.sleep(0.05)
        first = _recv(peer, 2, grace=5.0, name=_name(round=3))
        hub._datagrams_rest(Hop(0, 3, datagrams_in=lambda: first), HopDatagrams(hop.sock, None, hub._pacer))
        assert first.got == 2 and first.stale == 3  # it read all five
        second = _recv(peer, 3, grace=5.0, name=_name(round=4))
        t0 = time.perf_counter()
        hub._datagrams_rest(Hop(0, 4, datagrams_in=lambda: second), HopDatagrams(hop.sock, None, hub._pacer))
        assert second.got == 3 and time.perf_counter() - t0 < 1.0  # counted: no wait for the deadline
        assert not hub._carried
    finally:
        peer.close()
        hub._pacer.close()
        hop.sock.close()


def test_the_pacer_thread_runs_jobs_in_order_and_ends_on_close():
    p = PacerThread()
    seen: list[int] = []
    done = [p.submit(lambda i=i: seen.append(i)) for i in range(5)]
    assert all(d.wait(2.0) for d in done) and seen == list(range(5))
    p.close()
    assert p.submit(lambda: seen.append(9)).wait(2.0) and seen[-1] == 9  # a later submit starts a new thread
    p.close()


def test_the_send_half_measures_how_long_the_stream_messages_took(pair):
    """``DatagramSend.window``: from the hop's start to the moment its stream messages were done (finish is called
    then), the sample the send budget learns a hop round's window from (not the drop report's round trip)."""
    a, b = pair
    tx = _send(_rows(3), a, b)
    hd = HopDatagrams(a, tx, PacerThread())
    hd.start()
    time.sleep(0.05)  # the stream messages
    t_messages = time.perf_counter()
    hd.finish(None)
    assert tx.window is not None and 0.05 <= tx.window <= t_messages - hd.t0 + 1e-3


def test_the_hop_reads_its_threads_runqueue_wait_while_the_messages_travel(pair, monkeypatch):
    """``queued`` / ``span``: the CPU gate's reading (dgt.protocol.cpu_gate), from the kernel's runqueue wait of the
    thread that carries the hop's messages, read as the hop starts and again when they are done; None where the
    kernel keeps none."""
    import dgt.channels.hop_datagrams as hdm

    a, _ = pair
    waits = iter([2.0, 2.0125])  # seconds runnable but not running: 12.5 ms during the hop
    monkeypatch.setattr(hdm, "runqueue_seconds", lambda: next(waits))
    hd = HopDatagrams(a, None, PacerThread())
    time.sleep(0.03)  # the stream messages
    hd.finish(None)
    assert hd.queued == pytest.approx(0.0125) and 0.03 <= hd.span < 1.0
    monkeypatch.setattr(hdm, "runqueue_seconds", lambda: None)
    hd = HopDatagrams(a, None, PacerThread())
    hd.finish(None)
    assert hd.queued is None


def test_runqueue_seconds_reads_the_second_schedstat_field(tmp_path):
    from dgt.channels.hop_datagrams import SCHEDSTAT, runqueue_seconds

    f = tmp_path / "schedstat"
    f.write_text("353912732 4500000000 19\n")
    assert runqueue_seconds(str(f)) == 4.5
    f.write_text("garbage\n")
    assert runqueue_seconds(str(f)) is None
    assert runqueue_seconds(str(tmp_path / "missing")) is None
    if not os.path.exists(SCHEDSTAT):
        pytest.skip(f"{SCHEDSTAT} is absent (not Linux, or schedstats off): the gate never closes here")
    first = runqueue_seconds()
    assert first is not None and 0.0 <= first <= runqueue_seconds()  # this thread's, and it only grows
