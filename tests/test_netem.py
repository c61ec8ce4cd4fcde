"""dgt.netem against the real kernel: namespaces, shaping, priority, loss, jobs, CLI. Needs root.

Every test uses its own prefix (dgtt<pid><letter>) and removes it in a finally, so nothing is left behind even when
an assertion fails; the last test checks that no namespace of this run survived. Only addresses inside the
namespaces these tests create are ever sent to.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from dgt.errors import DgtError, EmulationUnsupported

pytestmark = pytest.mark.root

RUN_TAG = f"dgtt{os.getpid() % 1_000_000}"


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces"
    try:
        from dgt.netem import probe

        probe.probe()
    except EmulationUnsupported as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def kernel() -> dict[str, bool]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from dgt.netem import probe

    return probe.probe()


@pytest.fixture
def prefix(request: pytest.FixtureRequest, kernel: dict[str, bool]) -> Iterator[str]:
    """A prefix unique to this test; whatever carries it is removed afterwards, pass or fail."""
    from dgt.netem import teardown

    letter = "abcdefghijklmnopqrstuvwxyz"[_counter() % 26]
    p = f"{RUN_TAG}{letter}"
    teardown(p)
    try:
        yield p
    finally:
        teardown(p)


_n = [0]


def _counter() -> int:
    _n[0] += 1
    return _n[0]


def _mbit(bps: float) -> float:
    return round(bps / 1e6, 1)


def _host_took_every_try(tries: list) -> None:
    """Skip, naming the figures, when every try of a rate measurement fell short while the hypervisor was taking
    this VM's CPUs away (FlowResult.disturbed): nothing in the machine ran then, shaper timers included, so the
    shortfall cannot be put on the emulator. A try that fell short on an undisturbed host fails the test."""
    if tries and all(r.disturbed() for r in tries):
        pytest.skip("every try ran while the host took this VM's CPUs away (steal " +
                    ", ".join(f"{r.host_steal_s:.2f} s in {r.wall_s:.1f} s" for r in tries) + ")")


# ---- topology lifecycle ---------------------------------------------------------------------------------------


def test_up_connect_down_and_cleanup_after_exception(prefix: str) -> None:
    from dgt.netem import Topology, nsutil, state, teardown

    with Topology(hosts=3, rate="100mbit", prefix=prefix) as topo:
        assert sorted(nsutil.list_ns(prefix)) == sorted(topo.namespaces)
        assert len(topo.namespaces) == 4 and state.load(prefix) is not None
        # a socket made in h1's namespace accepts a connection made from h0's namespace, at h1's address
        with topo.enter(1):
            srv = socket.create_server((topo.hosts[1].addr, 7000))
        with topo.enter(0):
            cli = socket.create_connection((topo.hosts[1].addr, 7000), timeout=5)
        conn, peer = srv.accept()
        assert peer[0] == topo.hosts[0].addr
        for s in (cli, conn, srv):
            s.close()
        assert sorted(name for _, name in topo.call(2, socket.if_nameindex)) == ["eth0", "lo"]
        sleeper = topo.popen(2, ["sleep", "30"])
    assert nsutil.list_ns(prefix) == [] and state.load(prefix) is None
    assert sleeper.wait(timeout=5) != 0  # processes inside were stopped with their namespace

    with pytest.raises(RuntimeError, match="boom"), Topology(hosts=2, rate="10mbit", prefix=prefix):
        assert len(nsutil.list_ns(prefix)) == 3
        raise RuntimeError("boom")
    assert nsutil.list_ns(prefix) == []
    assert teardown(prefix) == [] and teardown(prefix) == []  # idempotent


def test_failure_while_building_removes_partial_topology(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dgt.netem import Topology, nsutil, shaping

    def broken(*args: object, **kwargs: object) -> None:
        assert nsutil.list_ns(prefix), "namespaces should exist when shaping starts"
        raise OSError("simulated netlink failure")

    monkeypatch.setattr(shaping, "apply", broken)
    with pytest.raises(OSError, match="simulated"):
        Topology(hosts=2, rate="100mbit", prefix=prefix).up()
    assert nsutil.list_ns(prefix) == []
    monkeypatch.undo()
    with pytest.raises(DgtError, match="exist"):  # a live prefix is not silently reused
        with Topology(hosts=1, prefix=prefix):
            Topology(hosts=1, prefix=prefix).up()
    assert nsutil.list_ns(prefix) == []


def test_delay_needs_netem(prefix: str, kernel: dict[str, bool]) -> None:
    """delay_backend="netem" is refused without sch_netem (auto then uses the relay: tests/test_netem_delay.py)."""
    from dgt.netem import Topology, nsutil

    if not kernel["sch_netem"]:
        for kwargs in ({"delay": "5ms"}, {"delay": "5ms", "jitter": "1ms"}, {"delay": "5ms", "reorder": "1%"}):
            with pytest.raises(EmulationUnsupported, match="sch_netem") as err:
                Topology(hosts=2, rate="100mbit", prefix=prefix, delay_backend="netem", **kwargs).up()
            assert "CONFIG_NET_SCH_NETEM" in str(err.value)
            assert nsutil.list_ns(prefix) == []
        return
    # this kernel has netem: a 10 ms one-way delay per link gives a host-to-host RTT of 4 x 10 ms
    with Topology(hosts=2, delay="10ms", prefix=prefix) as topo:
        with topo.enter(1):
            srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            srv.bind((topo.hosts[1].addr, 7001))
        with topo.enter(0):
            cli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        cli.settimeout(2)
        srv.settimeout(2)
        rtts = []
        for _ in range(5):
            t0 = time.monotonic()
            cli.sendto(b"x", (topo.hosts[1].addr, 7001))
            _, addr = srv.recvfrom(16)
            srv.sendto(b"y", addr)
            cli.recvfrom(16)
            rtts.append(time.monotonic() - t0)
        cli.close()
        srv.close()
        assert 0.036 <= min(rtts) <= 0.2, rtts


# ---- shaping and priority ---------------------------------------------------------------------------------------


def test_tcp_bulk_rate_matches_100mbit(prefix: str) -> None:
    from dgt.netem import Flow, Topology

    tries = []
    with Topology(hosts=2, rate="100mbit", prefix=prefix) as topo:
        # up to four flows before calling the shaper off: see test_dumbbell_bottleneck (CI at 469695c: 64.3 and
        # 58.0 Mbit/s in two tries, the runs before it 95)
        for port in (5201, 5211, 5221, 5231):
            res = Flow(topo, 0, 1, proto="tcp", duration=2.5, port=port).start().wait()
            tries.append(res)
            got = res.goodput_bps
            print(f"TCP goodput through a 100mbit link: {_mbit(got)} Mbit/s (sender {_mbit(res.sent['rate_bps'])}; "
                  f"host steal {res.host_steal_s} s in {res.wall_s:.1f} s)")
            if 90e6 <= got <= 110e6 or got > 110e6:
                break
    assert got <= 110e6, got  # above the rate is the shaper's fault whatever the host does
    if got < 90e6:
        _host_took_every_try(tries)
    # goodput is below the L2 rate by the headers (1448/1514 = 95.6 %); the tolerance is 10 % of the rate
    assert 90e6 <= got <= 110e6, [(_mbit(r.goodput_bps), r.host_steal_s) for r in tries]


def _ef_under_le_flood(prefix: str, priority: bool) -> tuple[float, dict]:
    from dgt.netem import Flow, Topology, cross_traffic

    with Topology(hosts=4, rate="100mbit", priority=priority, prefix=prefix) as topo:
        # two LE sources (DSCP LE=1 and CS1=8) each fill their own 100mbit uplink toward h2, so the port to h2 is
        # oversubscribed twice over and stays saturated even when one sender is briefly descheduled
        floods = [cross_traffic(topo, src, 2, proto="udp", dscp=dscp, rate="200mbit", duration=10, port=port)
                  for src, dscp, port in ((1, 1, 5301), (3, 8, 5302))]
        try:
            time.sleep(0.5)  # the LE queue toward h2 is full before the EF flow starts
            ef = Flow(topo, 0, 2, proto="tcp", dscp=46, duration=2.0, port=5202).start().wait()
            for f in floods:  # the floods outlast the EF flow, then end at once
                f.stop(wait=False)
            le = [f.wait() for f in floods]
        finally:
            for f in floods:
                f.kill()
        stats = topo.stats()
    offered = sum(r.sent["rate_bps"] for r in le)
    delivered = sum(r.received["bytes"] for r in le) / sum(r.sent["bytes"] for r in le)
    print(f"priority={priority}: EF TCP {_mbit(ef.goodput_bps)} Mbit/s; LE UDP offered {_mbit(offered)} Mbit/s, "
          f"{delivered:.0%} of it delivered")
    return ef.goodput_bps, stats


def test_ef_keeps_its_share_under_le_saturation(prefix: str) -> None:
    from dgt.netem.spec import DEFAULT_SHARES
    from dgt.netem.status import drops_by_class

    with_prio, stats = _ef_under_le_flood(prefix, priority=True)
    # EF is entitled to the link minus what LE is assured; ask for 80 % of that, in goodput terms
    entitled = 100e6 * (1 - DEFAULT_SHARES["LE"]) * 1448 / 1514
    assert with_prio >= 0.8 * entitled, f"EF got {_mbit(with_prio)} of {_mbit(entitled)} Mbit/s"
    drops = drops_by_class(stats)
    assert drops["LE"] > 100 and drops["EF"] == 0, drops
    toward_h2 = next(link for link in stats["links"] if link["direction"] == "sw0→h2")
    le = next(c for c in toward_h2["classes"] if c["class"] == "LE")
    assert le["drops"] > 100

    without_prio, stats = _ef_under_le_flood(prefix, priority=False)
    # in one FIFO the unresponsive UDP crowds TCP out; here it gets a small fraction of what priority gives it
    assert without_prio < 0.6 * with_prio, (without_prio, with_prio)
    assert [c["class"] for c in stats["links"][0]["classes"]] == ["FIFO"]


def test_dumbbell_bottleneck(prefix: str) -> None:
    from dgt.netem import Flow, LinkSpec, Topology

    def attempt(topo):
        """One UDP flow offered at twice the bottleneck; what the shaper passed per second it was busy."""
        before = next(lk for lk in topo.stats()["links"] if lk["direction"] == "sw0→sw1")["classes"][0]["bytes"]
        across = Flow(topo, 0, 3, proto="udp", rate="80mbit", duration=1.5).start().wait()
        bn = next(lk for lk in topo.stats()["links"] if lk["direction"] == "sw0→sw1")
        crossed = bn["classes"][0]["bytes"] - before  # the root class: everything that left through the bottleneck
        # the shaper's own count: the link was busy while the sender ran plus the time to drain a full queue
        # (1000 packets of 1442 B at 40 Mbit/s); this does not depend on how fast the sink process was scheduled
        busy_s = across.sent["elapsed_s"] + 1000 * 1442 * 8 / 40e6
        shaped = crossed * 8 / busy_s
        print(f"  the bottleneck passed {crossed} B = {_mbit(shaped)} Mbit/s; sender: {across.sent}; "
              f"sink: {across.received}; host steal {across.host_steal_s} s in {across.wall_s:.1f} s")
        return across, bn, shaped

    with Topology(hosts=4, dumbbell=True, bottleneck=LinkSpec.make(rate="40mbit"), prefix=prefix) as topo:
        assert topo.hosts[0].switch_ns != topo.hosts[3].switch_ns
        # UDP offered at twice the bottleneck: what arrives is the shaper's rate, free of TCP's loss-recovery swings
        # (a TCP flow through the 1000-packet queue measured 16-38 Mbit/s over six runs on this 2-core box). HTB
        # releases packets from kernel timers, which lag while the VM's host takes its CPUs away (10.8 and 32.4
        # Mbit/s seen that way, 40.0 in the runs around them; CI at 469695c: 33.2 and 33.0): up to four flows are
        # tried before calling the shaper off, and when every one ran while the host took the CPUs away the test
        # skips with the figures.
        tries = []
        for _ in range(4):
            across, bn, shaped = attempt(topo)
            tries.append(across)
            if shaped >= 0.85 * 40e6:
                break
        if shaped < 0.85 * 40e6:
            _host_took_every_try(tries)
        beside = Flow(topo, 0, 1, proto="tcp", duration=1.0, port=5203).start().wait().goodput_bps
    got = across.goodput_bps
    print(f"dumbbell: UDP at 80mbit across a 40mbit bottleneck arrives at {_mbit(got)} Mbit/s; "
          f"TCP beside it {_mbit(beside)} Mbit/s")
    assert 0.85 * 40e6 <= shaped <= 1.05 * 40e6, shaped
    assert sum(c["drops"] for c in bn["classes"][1:]) > 1000, bn  # the leaves: what the shaper turned away
    assert across.received["bytes"] < 0.75 * across.sent["bytes"]
    # the sink sees at most the shaped rate (under CPU load it may see less: its own socket buffer overflows)
    assert got <= 1.05 * 40e6
    # two hosts on the same switch do not cross the bottleneck
    assert beside > 2 * 40e6, beside


# ---- loss --------------------------------------------------------------------------------------------------------


def test_random_loss_within_statistical_tolerance(prefix: str, kernel: dict[str, bool]) -> None:
    from dgt.netem import Flow, Topology

    p = 0.02
    n = 20000
    with Topology(hosts=2, loss="2%", prefix=prefix) as topo:
        res = Flow(topo, 0, 1, proto="udp", rate="60mbit", count=n, size=500, duration=10).start().wait()
        stats = topo.stats()
    sent = res.sent["packets"]
    assert sent == n
    lost = sent - res.received["unique"] - res.received["rcvbuf_errors"]  # sink overruns are not emulated loss
    measured = lost / sent
    expected = 1 - (1 - p) ** 2  # h0 -> sw0 -> h1 crosses two lossy links
    sigma = math.sqrt(expected * (1 - expected) / sent)
    print(f"loss per link {p:.1%}: end-to-end measured {measured:.3%} vs expected {expected:.3%} "
          f"(5 sigma = {5 * sigma:.3%}); backend {'nftables' if topo.nft_loss else 'netem'}")
    assert abs(measured - expected) <= 5 * sigma
    if topo.nft_loss:
        for link in stats["links"]:
            if link["direction"] in ("h0→sw0", "sw0→h1"):
                seen, dropped = link["loss"]["seen"], link["loss"]["dropped"]
                assert seen >= 0.9 * n
                assert abs(dropped / seen - p) <= 5 * math.sqrt(p * (1 - p) / seen), link


# ---- jobs and CLI ---------------------------------------------------------------------------------------------------

RENDEZVOUS = r"""
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
print(f"rank {rank}/{world} on {os.environ['DGT_NETEM_HOST']} {os.environ['DGT_NETEM_ADDR']} arg={sys.argv[1]}")
if rank == 0:
    srv = socket.create_server((addr, port))
    srv.settimeout(15)
    got = sorted(int(srv.accept()[0].recv(16)) for _ in range(world - 1))
    print("rendezvous", got)
else:
    for _ in range(150):
        try:
            socket.create_connection((addr, port), timeout=1).sendall(str(rank).encode())
            break
        except OSError:
            time.sleep(0.1)
"""


def test_run_collects_every_host(prefix: str, tmp_path: os.PathLike) -> None:
    from dgt.netem import Topology, run
    from dgt.netem.runner import exit_code

    with Topology(hosts=3, rate="100mbit", prefix=prefix) as topo:
        results = run(topo, [sys.executable, "-c", RENDEZVOUS, "{addr}"], logdir=str(tmp_path), timeout=30)
        assert [r.returncode for r in results] == [0, 0, 0], [r.output for r in results]
        for r in results:
            assert f"rank {r.rank}/3 on h{r.rank} {topo.hosts[r.rank].addr} arg={topo.hosts[r.rank].addr}" in r.output
            assert os.path.exists(r.log)
        assert "rendezvous [1, 2]" in results[0].output
        # one rank fails: its code is reported and the others, left waiting, are stopped
        t0 = time.monotonic()
        failing = "import os, sys, time; r = int(os.environ['RANK']); print('rank', r); " \
                  "time.sleep(0.5); sys.exit(3) if r == 1 else time.sleep(30)"
        results = run(topo, [sys.executable, "-c", failing], logdir=str(tmp_path), timeout=20)
        assert time.monotonic() - t0 < 15
        assert results[1].returncode == 3 and results[0].killed and results[2].killed
        assert exit_code(results) == 3
        assert all(f"rank {r.rank}" in r.output for r in results)


def _table_rows(text: str) -> dict[tuple[str, str], int]:
    """(direction, class) -> drops, read back from the status table."""
    rows: dict[tuple[str, str], int] = {}
    direction = ""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) < 7 or not cells[5].isdigit():
            continue
        direction = cells[1] or direction
        rows[(direction, cells[2])] = int(cells[5])
    return rows


def test_cli_up_status_run_down(prefix: str, capsys: pytest.CaptureFixture[str], tmp_path: os.PathLike) -> None:
    from dgt.netem import Flow, Topology, cross_traffic, nsutil
    from dgt.netem.cli import main as netem_main

    def main(argv: list[str]) -> int:  # `dgt netem ...` without importing the other (torch-heavy) subcommands
        assert argv[0] == "netem"
        return netem_main(argv[1:])

    from dgt.netem.status import drops_by_class

    assert main(["netem", "up", "--prefix", prefix, "--hosts", "3", "--rate", "100mbit", "--loss", "0.1%"]) == 0
    try:
        assert len(nsutil.list_ns(prefix)) == 4  # still up after the command returned
        topo = Topology.attach(prefix)
        # a CS1 flood at twice the link rate beside an EF flow: LE must drop, EF not. Under the host's CPU steal the
        # Python flood sender has been seen to fall short of the link rate (no LE drop at all), so a second round is
        # tried before calling that a failure; the drop counters add up over both
        tries = []
        for attempt in range(2):
            flood = cross_traffic(topo, 1, 2, dscp=8, rate="200mbit", duration=10)  # CS1 lands in LE
            try:
                Flow(topo, 0, 2, proto="tcp", dscp=46, duration=1.0, port=5202 + attempt).start().wait()
                flood.stop()
            finally:
                flood.kill()
            capsys.readouterr()
            assert main(["netem", "status", "--prefix", prefix]) == 0
            text = capsys.readouterr().out
            rows = _table_rows(text)
            tries.append(rows)
            if rows.get(("sw0→h2", "LE"), 0) > 0:
                break
        assert "sw0→h2" in text and "LE" in text and "EF" in text
        assert rows[("sw0→h2", "LE")] > 0 and rows.get(("sw0→h2", "EF"), 0) == 0, tries
        assert main(["netem", "status", "--prefix", prefix, "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        drops = drops_by_class(stats)
        assert drops["LE"] > 0 and drops["EF"] == 0, drops

        code = main(["netem", "run", "--prefix", prefix, "--timeout", "20", "--logdir", str(tmp_path), "--",
                     sys.executable, "-c",
                     "import os; print('hello from', os.environ['RANK'])"])
        out = capsys.readouterr().out
        assert code == 0 and all(f"hello from {r}" in out for r in range(3)), out
    finally:
        assert main(["netem", "down", "--prefix", prefix]) == 0
    assert main(["netem", "down", "--prefix", prefix]) == 0  # idempotent
    assert nsutil.list_ns(prefix) == []
    assert main(["netem", "status", "--prefix", prefix]) == 2  # nothing up: a clear error, not a traceback


def test_zz_nothing_left_behind(kernel: dict[str, bool]) -> None:
    from dgt.netem import nsutil

    leftovers = [ns for ns in nsutil.list_ns() if ns.startswith(RUN_TAG)]
    assert leftovers == []
    if shutil.which("ip"):
        assert RUN_TAG not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
