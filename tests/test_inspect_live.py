"""Live captures (scapy AsyncSniffer) of real DGT traffic on loopback and inside a network namespace: the summary's
counts equal the receiver's own statistics, the DSCP on the wire is EF / the configured low class, and tshark
(where installed) agrees on DSCP and port counts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from dgt.cli import main as dgt_main
from dgt.inspect.capture import LiveCapture
from dgt.inspect.summary import Options, summarize
from dgt.inspect.traffic import TrafficSpec, run_traffic

ROUND_KEYS = ("important", "unimportant_received", "dropped", "partial", "duplicated", "rejected", "lanes")
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="packet capture needs root (CAP_NET_RAW)")


def _ours(truth) -> Options:
    """Only this test's flows: other tests may run DGT traffic on loopback at the same time."""
    return Options(auto=False, tcp_ports=(truth.tcp_port,), udp_ports=tuple(truth.udp_ports))


def _check(s: dict, truth, low_dscp: int) -> None:
    assert len(s["rounds"]) == len(truth.stats) > 0
    for got, want in zip(s["rounds"], truth.stats):
        assert {k: got[k] for k in ROUND_KEYS} == {k: want[k] for k in ROUND_KEYS}
    assert s["totals"]["late_frames"] == truth.late > 0
    assert s["totals"]["dropped"] > 0 and s["totals"]["duplicated"] > 0
    assert s["lanes"]["0"]["dscp"] == {"46": s["lanes"]["0"]["packets"]}
    for lane in range(1, len(truth.udp_ports) + 1):
        v = s["lanes"][str(lane)]
        assert v["dscp"] == {str(low_dscp): v["packets"]} and v["dscp_ok"]
    assert s["malformed"]["total"] == 0 and s["warnings"] == []


@needs_root
@pytest.mark.parametrize("low_dscp,lanes", [(1, 2), (8, 3)], ids=["LE", "CS1-two-lanes"])
def test_loopback_capture_matches_transport_stats(tmp_path, low_dscp, lanes):
    path = str(tmp_path / "lo.pcap")
    cap = LiveCapture(path, "lo").start()
    try:
        truth = run_traffic(TrafficSpec(rounds=3, lanes=lanes, low_dscp=low_dscp, seed=low_dscp))
        time.sleep(0.2)
    finally:
        res = cap.stop()
    assert res.kernel_drops == 0 and res.packets > 0
    s = summarize(path, _ours(truth))
    _check(s, truth, low_dscp)
    # without flags, the same flows are found by the magic at the start of their payloads
    auto = summarize(path)
    ports = {truth.tcp_port, *truth.udp_ports}
    mine = [f for f in auto["flows"] if {f["sport"], f["dport"]} & ports]
    assert mine and all(f["detected_by"] == "magic" for f in mine)
    if tshark := shutil.which("tshark"):
        _cross_check_tshark(tshark, path, s)


def _cross_check_tshark(tshark: str, path: str, s: dict) -> None:
    """Per flow: packets per DSCP value as tshark counts them == our flow table."""
    out = subprocess.run(
        [
            tshark,
            "-r",
            path,
            "-T",
            "fields",
            "-E",
            "separator=,",
            "-e",
            "ip.dsfield.dscp",
            "-e",
            "udp.srcport",
            "-e",
            "udp.dstport",
            "-e",
            "tcp.srcport",
            "-e",
            "tcp.dstport",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs: Counter = Counter()
    for line in out.splitlines():
        dscp, us, ud, ts, td = (line.split(",") + [""] * 5)[:5]
        if us:
            theirs[("udp", int(us), int(ud), int(dscp))] += 1
        elif ts:
            theirs[("tcp", int(ts), int(td), int(dscp))] += 1
    for f in s["flows"]:
        for dscp, n in f["dscp"].items():
            assert theirs[(f["proto"], f["sport"], f["dport"], int(dscp))] == n, f
        assert sum(v for k, v in theirs.items() if k[:3] == (f["proto"], f["sport"], f["dport"])) == f["packets"]


@needs_root
@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed (apt-get install tshark)")
def test_tshark_agrees_on_dscp_and_ports(tmp_path):
    path = str(tmp_path / "ts.pcap")
    with LiveCapture(path, "lo"):
        truth = run_traffic(TrafficSpec(rounds=2, lanes=2, low_dscp=8, seed=4))
        time.sleep(0.2)
    s = summarize(path, _ours(truth))
    assert len(s["flows"]) == 3  # reliable both ways + one datagram flow
    _cross_check_tshark(shutil.which("tshark"), path, s)


@needs_root
@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 (ip) is not installed")
def test_capture_inside_a_network_namespace(tmp_path):
    ns = f"dgtinsp{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if add.returncode:
        pytest.skip(f"cannot create a network namespace: {add.stderr.strip()}")
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=10)
        path = str(tmp_path / "ns.pcap")
        cap = LiveCapture(path, "lo", netns=ns).start()
        try:
            run = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "dgt.inspect.traffic",
                    "--rounds",
                    "2",
                    "--low-dscp",
                    "8",
                    "--seed",
                    "9",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            time.sleep(0.2)
        finally:
            res = cap.stop()
        assert res.netns == ns and res.kernel_drops == 0
        d = json.loads(run.stdout)
        truth = type("T", (), d)
        s = summarize(path)  # the namespace holds only this traffic: auto-detection, no flags
        _check(s, truth, 8)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@needs_root
@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 (ip) is not installed")
def test_capture_on_a_namespace_eth0_that_the_root_namespace_also_has(tmp_path):
    """`dgt capture --netns HOST -i eth0` failed with ENODEV: the child imported scapy (which caches interface indexes)
    before entering the namespace, so eth0 resolved to the root namespace's index. Two namespaces joined by a veth
    pair whose ends are both called eth0; datagrams from one are captured on the other's eth0."""
    a, b = f"dgtca{os.getpid()}", f"dgtcb{os.getpid()}"
    va, vb = f"dca{os.getpid()}"[:15], f"dcb{os.getpid()}"[:15]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        for ns in (a, b):
            add = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if add.returncode:
                pytest.skip(f"cannot create a network namespace: {add.stderr.strip()}")
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((a, va, "10.254.7.1/24"), (b, vb, "10.254.7.2/24")):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "link", "set", dev, "name", "eth0")
            ip("-n", ns, "addr", "add", addr, "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        path = str(tmp_path / "eth0.pcap")
        cap = LiveCapture(path, "eth0", netns=a, udp_ports=[47111]).start()
        try:
            send = ("import socket, time\n"
                    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                    "for _ in range(20):\n"
                    "    s.sendto(b'x' * 100, ('10.254.7.1', 47111)); time.sleep(0.005)\n")
            subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", send], check=True, timeout=30,
                           capture_output=True)
            time.sleep(0.3)
        finally:
            res = cap.stop()
        assert res.netns == a and res.iface == "eth0"
        assert res.packets >= 20, res
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@needs_root
def test_capture_command_is_bounded_and_summarises(tmp_path, capsys):
    path = str(tmp_path / "cli.pcap")
    result: dict = {}

    def traffic() -> None:
        time.sleep(1.0)
        result["truth"] = run_traffic(TrafficSpec(rounds=2, seed=7))

    th = threading.Thread(target=traffic)
    th.start()
    t = time.monotonic()
    rc = dgt_main(["capture", "-i", "lo", "-w", path, "--duration", "2.5", "--json"])
    took = time.monotonic() - t
    th.join(30)
    assert rc == 0 and 2.4 < took < 15
    s = json.loads(capsys.readouterr().out)
    truth = result["truth"]
    assert s["capture"]["packets"] > 0 and s["capture"]["iface"] == "lo"
    _check(summarize(path, _ours(truth)), truth, 1)
    assert (
        dgt_main(["capture", "-i", "lo", "-w", path, "--count", "1", "--duration", "1", "--udp-port", "9", "--json"])
        == 0
    )  # nothing on port 9: ends at the duration with an empty, valid pcap
    assert json.loads(capsys.readouterr().out)["packets"] == 0
