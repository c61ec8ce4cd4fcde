"""Delay, jitter and reordering against the real kernel: netem where the kernel has it, else the relay. Root.

Each test builds its own prefix and removes it in a finally (the `prefix` fixture). Ping is a raw ICMP echo from
Python (no ping binary needed); TCP and UDP run between the namespaces only. Delay figures include the relay's own
overhead, measured, not subtracted.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dgt.errors import EmulationUnsupported

pytestmark = pytest.mark.root

RUN_TAG = f"dgtd{os.getpid() % 1_000_000}"
_n = [0]


@pytest.fixture(scope="module")
def kernel() -> dict[str, bool]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces")
    from dgt.netem import probe

    try:
        return probe.probe()
    except EmulationUnsupported as exc:
        pytest.skip(str(exc))


@pytest.fixture
def prefix(kernel: dict[str, bool]) -> Iterator[str]:
    from dgt.netem import nsutil, teardown

    _n[0] += 1
    p = f"{RUN_TAG}{'abcdefghijklmnopqrstuvwxyz'[_n[0] % 26]}"
    teardown(p)
    try:
        yield p
    finally:
        teardown(p)
        assert nsutil.list_ns(p) == []


# ---- probes run inside the hosts (through Topology.call) ---------------------------------------------------------


def _csum(b: bytes) -> int:
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF


def icmp_ping(dst: str, count: int, interval: float) -> list[float]:
    """RTTs in seconds of `count` ICMP echos, one at a time (raw socket; the kernel of dst answers)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2.0)
    ident = os.getpid() & 0xFFFF
    rtts = []
    for seq in range(count):
        body = b"dgt-ping" * 7
        hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        pkt = struct.pack("!BBHHH", 8, 0, _csum(hdr + body), ident, seq) + body
        t0 = time.monotonic()
        s.sendto(pkt, (dst, 0))
        while True:
            data = s.recv(2048)
            ihl = (data[0] & 0xF) * 4
            typ, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            if typ == 0 and rid == ident and rseq == seq:
                rtts.append(time.monotonic() - t0)
                break
        time.sleep(interval)
    s.close()
    return rtts


def tcp_sink(port: int, timeout: float) -> list[tuple[float, int]]:
    """Accept one TCP connection and return (time, bytes so far) samples until the sender closes."""
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(1)
    ls.settimeout(timeout)
    c, _ = ls.accept()
    c.settimeout(timeout)
    buf = bytearray(1 << 20)
    total, samples, last = 0, [], 0.0
    while True:
        n = c.recv_into(buf)
        if not n:
            break
        total += n
        now = time.monotonic()
        if now - last >= 0.02:
            samples.append((now, total))
            last = now
    samples.append((time.monotonic(), total))
    return samples


def tcp_send(dst: str, port: int, duration: float) -> int:
    deadline = time.monotonic() + duration
    while True:
        try:
            s = socket.create_connection((dst, port), timeout=2.0)
            break
        except (ConnectionRefusedError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    chunk = bytes(1 << 18)
    sent = 0
    while time.monotonic() < deadline:
        sent += s.send(chunk)
    s.close()
    return sent


def tcp_rate(topo: Any, src: int, dst: int, duration: float, warmup: float, port: int = 5601) -> float:
    """Receiver's rate in bit/s after `warmup` seconds (the window has grown by then)."""
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(s=topo.call(dst, tcp_sink, port, 10.0, timeout=duration + 20)))
    t.start()
    topo.call(src, tcp_send, topo.hosts[dst].addr, port, duration, timeout=duration + 20)
    t.join(30)
    samples = np.array(box["s"], dtype=float)
    t0 = samples[0, 0] + warmup
    late = samples[samples[:, 0] >= t0]
    assert len(late) >= 10, f"too few samples after the warm-up: {len(late)}"
    return float((late[-1, 1] - late[0, 1]) * 8 / (late[-1, 0] - late[0, 0]))


def udp_sink(port: int, count: int, timeout: float) -> list[int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    s.settimeout(timeout)
    seqs: list[int] = []
    try:
        while len(seqs) < count:
            seqs.append(struct.unpack("!I", s.recv(2048)[:4])[0])
    except TimeoutError:
        pass
    return seqs


def udp_send(dst: str, port: int, count: int, gap: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = bytes(200)
    start = time.monotonic()
    for i in range(count):
        while time.monotonic() < start + i * gap:
            time.sleep(gap / 4)
        s.sendto(struct.pack("!I", i) + pad, (dst, port))


def inversions(topo: Any, count: int = 400, gap: float = 0.0005, port: int = 5701) -> tuple[int, int]:
    """Send `count` numbered datagrams h0 -> h1; return (received, adjacent sequence inversions)."""
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(s=topo.call(1, udp_sink, port, count, 1.0, timeout=30)))
    t.start()
    time.sleep(0.3)  # the sink binds first: nothing is sent into a closed port
    topo.call(0, udp_send, topo.hosts[1].addr, port, count, gap, timeout=30)
    t.join(30)
    seqs = box["s"]
    return len(seqs), sum(1 for a, b in zip(seqs, seqs[1:]) if b < a)


def _delay_rows(topo: Any) -> list[dict[str, Any]]:
    return [ln["delay"] for ln in topo.stats()["links"] if ln["delay"]]


def _late(topo: Any, since: list[tuple[float, int]] | None = None) -> Any:
    """The relays' (late_sum, sent) per link direction, fresh (one stats period is waited for); with `since`, the
    mean lateness per frame in each direction since then, summed over the directions: what a frame crossing each
    direction once was held past its due time."""
    if not topo.relay_delay:
        return [] if since is None else 0.0
    time.sleep(0.6)  # the relays rewrite their counters every 0.5 s
    now = [(float(r["late_sum"]), int(r["sent"])) for r in _delay_rows(topo)]
    if since is None:
        return now
    return sum((a[0] - b[0]) / (a[1] - b[1]) for a, b in zip(now, since) if a[1] > b[1])


# ---- acceptance ------------------------------------------------------------------------------------------------


def test_ping_rtt_status_and_cleanup(prefix: str) -> None:
    """25 ms on each of 4 link crossings: RTT 100 ms ± 2 ms (+3 ms with the relay); status shows each direction's
    delay and holdings."""
    from dgt.netem import Topology, nsutil

    with Topology(hosts=2, delay="25ms", prefix=prefix) as topo:
        # the relay backend is a user-space process per direction: each of the 4 crossings adds its wake-up and
        # copy time, 1.5-1.9 ms in all on this 2-core VM (median of 10 pings, main d62e7d8 and after, 4 runs each).
        # On a loaded host the relay also wakes late: it counts, per frame, how long after its due time it let the
        # frame go (late_sum), and that measured lateness is allowed on top. A delay line that held frames too
        # long would not be excused by it (lateness is counted from the due time). CI at 469695c saw a median of
        # 103.2 ms on a loaded host, so up to three rounds of pings are tried.
        for _ in range(3):
            before = _late(topo)
            rtts = np.array(topo.call(0, icmp_ping, topo.hosts[1].addr, 12, 0.02, timeout=30))[2:]  # ARP first
            late = _late(topo, since=before)
            slack = 0.003 + late if topo.relay_delay else 0.002
            print(f"ping RTT ms: median {np.median(rtts) * 1e3:.2f} min {rtts.min() * 1e3:.2f} "
                  f"max {rtts.max() * 1e3:.2f} (backend {'relay' if topo.relay_delay else 'netem'}; the relays' "
                  f"measured lateness {late * 1e3:.2f} ms per round trip)")
            if -0.002 <= np.median(rtts) - 0.100 <= slack:
                break
        assert -0.002 <= np.median(rtts) - 0.100 <= slack, rtts
        assert rtts.min() >= 0.100 - 0.0005, rtts
        rows = _delay_rows(topo)
        assert len(rows) == 4 and all(r["delay_s"] == 0.025 for r in rows)
        if topo.relay_delay:
            time.sleep(0.6)  # one stats period
            rows = _delay_rows(topo)
            assert all(r["backend"] == "relay" and r["alive"] and r["held"] == 0 for r in rows), rows
            assert all(r["sent"] >= 10 and r["received"] == r["sent"] and r["max_held"] >= 1 for r in rows), rows
            relay_ns = [f"{prefix}-dh0", f"{prefix}-dh1"]
            assert set(relay_ns) <= set(nsutil.list_ns(prefix))
            pids = [pid for ns in relay_ns for pid in nsutil.pids_in_ns(ns)]
            assert len(pids) == 2
    assert nsutil.list_ns(prefix) == []
    if topo.relay_delay:
        time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                       for pid in pids)
        from dgt.netem import delaylink

        assert delaylink.read_stats(prefix, "h0") is None  # the stats files went with the topology


@pytest.mark.slow  # (8-12 s; default suite time: the delay line's own timing is covered by the ping RTT test)
def test_jitter_spread_matches_uniform(prefix: str) -> None:
    """jitter 5 ms on each of 4 crossings: RTT = 100 ms + sum of 4 U(±5 ms), sigma = 2 * 5 / sqrt(3) = 5.8 ms."""
    from dgt.netem import Topology

    with Topology(hosts=2, delay="25ms", jitter="5ms", prefix=prefix) as topo:
        rtts = np.array(topo.call(0, icmp_ping, topo.hosts[1].addr, 42, 0.005, timeout=60))[2:] * 1e3
        # the relay's wake-ups add latency on each crossing, more on a loaded host (as in the ping test above):
        # 103.5 ms measured once in the full suite on a loaded 2-core VM
        bias = 3.0 if topo.relay_delay else 0.0
    print(f"jitter RTT ms: mean {rtts.mean():.2f} std {rtts.std():.2f} min {rtts.min():.2f} max {rtts.max():.2f}")
    assert rtts.min() >= 80 - 0.5 and rtts.max() <= 120 + 3, rtts
    assert -3.0 <= rtts.mean() - 100 <= 3.0 + bias, rtts  # 40 samples: standard error 0.9 ms
    assert 3.5 <= rtts.std() <= 8.5, rtts  # 5.8 expected; 40 samples


def test_tcp_through_shaped_delayed_link(prefix: str) -> None:
    """100 Mbit/s, 25 ms each link direction (RTT 100 ms): >= 90 % of the rate once the window has grown."""
    from dgt.netem import Topology
    from dgt.netem.crosstraffic import disturbed, host_steal_s

    # up to three flows before calling the emulation off (CI at ba34ff2: 70.5 Mbit/s once, on an otherwise passing
    # run); a shortfall while the hypervisor took the VM's CPUs in every try skips with the figures (test_netem.py)
    tries = []
    with Topology(hosts=2, rate="100mbit", delay="25ms", prefix=prefix) as topo:
        for port in (5601, 5611, 5621):
            steal0, t0 = host_steal_s(), time.monotonic()
            rate = tcp_rate(topo, 0, 1, duration=4.0, warmup=2.0, port=port)
            steal = None if steal0 is None else host_steal_s() - steal0
            tries.append((rate, steal, time.monotonic() - t0))
            print(f"tcp shaped 100mbit + 25ms/link: {rate / 1e6:.1f} Mbit/s after 2 s (host steal {steal} s)")
            if rate >= 0.90 * 100e6:
                break
        rows = _delay_rows(topo)
    if rate < 0.90 * 100e6 and all(disturbed(st, wall) for _, st, wall in tries):
        pytest.skip(f"every try ran while the host took this VM's CPUs away: {tries}")
    assert rate >= 0.90 * 100e6, tries
    assert all(r.get("overflow", 0) == 0 for r in rows), rows


@pytest.mark.slow  # the delay line's own capacity; the shaped case above covers delay with a rate in the default run
def test_tcp_through_unshaped_delayed_link(prefix: str) -> None:
    """Unshaped, 25 ms each link direction: the delay line is not the bottleneck (>= 200 Mbit/s)."""
    from dgt.netem import Topology

    with Topology(hosts=2, delay="25ms", prefix=prefix) as topo:
        rate = tcp_rate(topo, 0, 1, duration=4.0, warmup=2.0)
        rows = _delay_rows(topo)
    print(f"tcp unshaped + 25ms/link: {rate / 1e6:.1f} Mbit/s after 2 s; relay {rows}")
    assert rate >= 200e6, rate


@pytest.mark.slow  # (8 s; default suite time)
def test_reordering_only_when_asked(prefix: str) -> None:
    from dgt.netem import Topology

    with Topology(hosts=2, delay="10ms", jitter="5ms", prefix=prefix) as topo:
        topo.call(0, icmp_ping, topo.hosts[1].addr, 1, 0.0, timeout=10)  # ARP resolved before counting
        got, inv = inversions(topo)
    assert got == 400 and inv == 0, (got, inv)
    with Topology(hosts=2, delay="10ms", reorder="25%", prefix=prefix, replace=True) as topo:
        topo.call(0, icmp_ping, topo.hosts[1].addr, 1, 0.0, timeout=10)
        got, inv = inversions(topo)
    print(f"reorder 25%/link: {inv} inversions in {got} datagrams")
    assert got == 400 and inv >= 40, (got, inv)


def test_dumbbell_bottleneck_delay_and_cli(prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`up --dumbbell --bottleneck-delay` delays only the bottleneck; `status` prints delay and held frames."""
    from dgt.netem import Topology, nsutil
    from dgt.netem.cli import main

    assert main(["up", "--prefix", prefix, "--hosts", "2", "--dumbbell", "--bottleneck-rate", "100mbit",
                 "--bottleneck-delay", "25ms", "--bottleneck-jitter", "2ms"]) == 0
    try:
        topo = Topology.attach(prefix)
        rtts = np.array(topo.call(0, icmp_ping, topo.hosts[1].addr, 8, 0.02, timeout=30))[2:]
        assert abs(np.median(rtts) - 0.050) <= 0.006, rtts  # 2 crossings of 25 ± 2 ms
        capsys.readouterr()
        assert main(["status", "--prefix", prefix]) == 0
        out = capsys.readouterr().out
        assert "delay 25ms±2ms" in out and "held" in out, out
        if topo.relay_delay:
            assert f"{prefix}-dbn" in nsutil.list_ns(prefix) and f"{prefix}-dh0" not in nsutil.list_ns(prefix)
    finally:
        assert main(["down", "--prefix", prefix]) == 0
    assert nsutil.list_ns(prefix) == []


def test_backends_against_each_other(prefix: str, kernel: dict[str, bool]) -> None:
    """Where the kernel has sch_netem: both backends give the same RTT; where not, asking for netem is refused."""
    from dgt.netem import Topology, nsutil

    if not kernel["sch_netem"]:
        with pytest.raises(EmulationUnsupported, match="sch_netem"):
            Topology(hosts=2, delay="5ms", prefix=prefix, delay_backend="netem").up()
        assert nsutil.list_ns(prefix) == []
        return
    medians = {}
    for backend in ("netem", "relay"):
        with Topology(hosts=2, delay="10ms", prefix=prefix, delay_backend=backend, replace=True) as topo:
            assert topo.relay_delay == (backend == "relay")
            medians[backend] = float(np.median(topo.call(0, icmp_ping, topo.hosts[1].addr, 10, 0.02,
                                                         timeout=30)[2:]))
    assert abs(medians["netem"] - medians["relay"]) <= 0.002, medians
