"""The transport across two OS processes over loopback: lossless and lossy rounds with error feedback, a peer that
dies or stalls mid-round, and DSCP marks seen on captured packets."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from dgt.estimator import ContributionEstimator
from dgt.harness.endpoints import connected_pair
from dgt.layout import BucketLayout
from dgt.transport import Endpoint, Faults, PeerAddress, PeerClosed, PeerTimeout, Timeouts, TransportConfig

TOKEN = 0xABCD_0042
SIZES = [40000, 1024, 9, 25000]

# The peer process: rank 1. Prints its address, reads rank 0's, connects, then runs a scenario.
CHILD = textwrap.dedent(
    """
    import json, sys, torch, trio
    from dgt.transport import Endpoint, PeerAddress, TransportConfig
    from dgt.estimator import ContributionEstimator
    from dgt.layout import BucketLayout

    scenario, cfg = sys.argv[1], json.loads(sys.argv[2])
    SIZES = [40000, 1024, 9, 25000]

    async def main():
        async with Endpoint.open(1, 0xABCD0042, TransportConfig(**cfg)) as ep:
            print(ep.address.to_json(), flush=True)
            peer = PeerAddress.from_json(await trio.to_thread.run_sync(sys.stdin.readline))
            await ep.connect({0: peer})
            layout = BucketLayout(SIZES)
            x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5))
            if scenario == "rounds":
                out = [(await ep.send_round(0, 4, 0, x, layout)).to_dict()]
                est = ContributionEstimator(layout)
                est.update(x)
                c = est.classify(0.3)
                out.append((await ep.send_round(0, 4, 1, x, layout, c.cls, c.order)).to_dict())
                out.append((await ep.send_round(0, 4, 2, torch.zeros(layout.numel), layout)).to_dict())
                echo = await ep.recv_round(0, 9, 0)
                await ep.send_round(0, 9, 1, echo.data * 2)
                print(json.dumps(out), flush=True)
                await trio.to_thread.run_sync(sys.stdin.readline)
                await ep.aclose()
            else:  # "stall": open a round, send half its important frames, then wait to be killed or stopped
                link = ep.links.table[0]
                plan = link.sender.plan(4, 0, x, layout, 0)
                link.writer.push_frames(plan.reliable[: len(plan.reliable) // 2])
                print("stalled", flush=True)
                await trio.sleep(120)

    trio.run(main)
    """
)


class Child:
    """The peer process; killed in any case when the test ends."""

    def __init__(self, scenario: str, cfg: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, scenario, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        )  # fmt: skip

    async def line(self, timeout: float = 60) -> str:
        with trio.fail_after(timeout):
            text = await trio.to_thread.run_sync(self.proc.stdout.readline)
        if not text:
            raise RuntimeError(f"peer process exited ({self.proc.poll()})")
        return text

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@asynccontextmanager
async def start(scenario: str, cfg0: TransportConfig, cfg1: dict) -> AsyncIterator[tuple[Endpoint, Child]]:
    """Rank 0 here, rank 1 in a child process running ``scenario``, connected; the child is killed and the endpoint
    closed on the way out."""
    child = Child(scenario, cfg1)
    try:
        async with Endpoint.open(0, TOKEN, cfg0) as ep:
            try:
                addr = PeerAddress.from_json(await child.line())
                child.send(ep.address.to_json())
                await ep.connect({1: addr})
                yield ep, child
            finally:
                child.kill()  # before the endpoint says goodbye
    finally:
        child.kill()


async def test_two_processes_lossless_and_lossy_rounds_with_error_feedback():
    cfg = TransportConfig(timeouts=Timeouts(peer=10), faults=Faults(drop_fraction=0.2, drop_seed=3),
                          deadline="fixed:0.05")
    async with start("rounds", cfg, {"peer_timeout": 10}) as (ep, child):
        layout = BucketLayout(SIZES)
        x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(5))
        r0 = await ep.recv_round(1, 4, 0)
        assert torch.equal(r0.data, x) and r0.mask.all(), "lossless round is bit-identical"
        r1 = await ep.recv_round(1, 4, 1)
        est = ContributionEstimator(layout)
        est.update(x)
        imp = est.classify(0.3).important
        assert r1.mask[imp].all() and not r1.mask.all()
        assert r1.stats.closed_by == "deadline" and r1.stats.deadline_wait < 1.0
        got = layout.expand(r1.mask)
        assert torch.equal(r1.data[got], x[got]) and (r1.data[~got] == 0).all()
        r2 = await ep.recv_round(1, 4, 2)  # zeros + the residual: exactly what round 1 lost
        assert torch.equal(r1.data + r2.data, x)
        await ep.send_round(1, 9, 0, x)
        assert torch.equal((await ep.recv_round(1, 9, 1)).data, 2 * x)
        sends = json.loads(await child.line())
        assert sends[1]["lost_blocks"] == r1.stats.dropped == int((~r1.mask).sum())
        assert sends[2]["copied"] and sends[2]["folded_elems"] == 0
        assert ep.stats().lanes[1].rx_dropped_hook > 0
        child.send("done")
        with trio.fail_after(10):
            await trio.to_thread.run_sync(child.proc.wait)


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_peer_that_dies_or_stalls_mid_round_fails_pending_operations(how):
    timeout = 2.0
    async with start("stall", TransportConfig(timeouts=Timeouts(peer=timeout)), {"peer_timeout": 30}) as (ep, child):
        assert (await child.line()).strip() == "stalled"
        with trio.fail_after(5):
            while not ep.receiver.open_rounds():  # the round is open, its important blocks half in
                await trio.sleep(0.01)
        async with trio.open_nursery() as n:
            n.start_soon(trio.to_thread.run_sync, os.kill, child.proc.pid, signal.SIGKILL if how == "kill" else
                         signal.SIGSTOP)  # fmt: skip
            t0 = trio.current_time()
            with pytest.raises(PeerClosed if how == "kill" else PeerTimeout):
                await ep.recv_round(1, 4, 0)
            elapsed = trio.current_time() - t0
        assert elapsed <= (1.0 if how == "kill" else timeout + 0.5)  # slack for a loaded CI box
        assert not ep.receiver.open_rounds()
        with pytest.raises(PeerClosed if how == "kill" else PeerTimeout):
            await ep.send_round(1, 0, 0, torch.zeros(4))


def _no_capture() -> str | None:
    """Why this host cannot capture loopback packets (None: it can)."""
    try:
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003)) as cap:
            cap.bind(("lo", 0))
    except (PermissionError, OSError, AttributeError) as exc:
        return f"no packet capture here (needs CAP_NET_RAW): {exc}"
    return None


# (a marker, not pytest.skip() in the body: pytest-trio reports a skip raised inside an async test without its reason)
@pytest.mark.skipif(_no_capture() is not None, reason=_no_capture() or "")
async def test_dscp_marks_on_captured_packets():
    """Capture loopback traffic with an AF_PACKET socket: TCP frames carry EF (46), UDP datagrams LE (1)."""
    cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    cap.bind(("lo", 0))
    cap.setblocking(False)
    cap.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    try:
        async with connected_pair(TOKEN, TransportConfig(timeouts=Timeouts(peer=5))) as (a, b):
            layout = BucketLayout([60000])
            x = torch.randn(layout.numel)
            est = ContributionEstimator(layout)
            est.update(x)
            c = est.classify(0.3)
            async with trio.open_nursery() as n:
                n.start_soon(a.send_round, 1, 0, 0, x, layout, c.cls, c.order)
                await b.recv_round(0, 0, 0)
            tcp_ports = {a.address.tcp_port, b.address.tcp_port}
            udp_ports = set(a.address.udp_ports) | set(b.address.udp_ports)
            seen = {"tcp": set(), "udp": set()}
            while True:
                try:
                    pkt = cap.recv(256)
                except BlockingIOError:
                    break
                ip = pkt[14:]
                if len(ip) < 24 or ip[0] >> 4 != 4:
                    continue
                ihl, proto, tos = (ip[0] & 15) * 4, ip[9], ip[1] >> 2
                sport, dport = int.from_bytes(ip[ihl : ihl + 2], "big"), int.from_bytes(ip[ihl + 2 : ihl + 4], "big")
                if proto == 6 and {sport, dport} & tcp_ports and (sport in tcp_ports or dport in tcp_ports):
                    seen["tcp"].add(tos)
                elif proto == 17 and dport in udp_ports:
                    seen["udp"].add(tos)
            # the listener's accepted socket inherits EF; the dialer marks before connect: every TCP packet is EF
            assert seen["tcp"] == {46}, seen
            assert seen["udp"] == {1}, seen
    finally:
        cap.close()
