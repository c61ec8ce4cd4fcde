"""Known DGT traffic on real sockets: rounds planned by ``RoundSender`` go over TCP (DSCP EF) and UDP (a low DSCP)
on loopback, with chosen datagrams dropped, duplicated, swapped and sent late, and a ``RoundReceiver`` consumes
them and sends its drop reports back. Its statistics are the ground truth a capture of the same traffic must match.

Used by the tests of the inspection tool and to check a capture setup (``python -m dgt.inspect.traffic``).
Single-threaded and bounded: every wait has a deadline.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dgt import wire
from dgt.inspect.dissect import frames_end
from dgt.layout import BucketLayout
from dgt.protocol.receiver import RoundDone, RoundReceiver
from dgt.protocol.sender import RoundSender

EF = 46


@dataclass
class TrafficSpec:
    rounds: int = 3
    sizes: tuple[int, ...] = (12000, 3000, 700)  # float32 elements per tensor of the bucket
    block: int = 512
    lanes: int = 2  # reliable + unreliable lanes
    important: float = 0.25  # fraction of blocks sent on the reliable lane
    drop: float = 0.15  # fraction of datagrams never sent (a lossy network or a sender deadline)
    duplicate: float = 0.05
    swap: float = 0.05  # fraction of datagrams swapped with the next one (reordering)
    late: int = 3  # dropped datagrams sent anyway after the drop report
    low_dscp: int = 1
    host: str = "127.0.0.1"
    seed: int = 0
    token: int = 0x5EED_0D67_0000_0001
    timeout: float = 20.0
    budget: int | None = None  # send budget in datagram bytes per round (dgt.protocol.budget); None: send all


@dataclass
class TrafficResult:
    stats: list[dict] = field(default_factory=list)  # RoundStats.to_dict() per round, in order
    late: int = 0  # receiver counter: frames for rounds already closed
    rejected: int = 0
    tcp_port: int = 0  # receiver's listening port
    udp_ports: list[int] = field(default_factory=list)  # receiver's datagram ports, one per unreliable lane
    sent_datagrams: int = 0
    sent_reliable_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _tos(sock: socket.socket, dscp: int) -> None:
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)


class _Link:
    """Both ends on loopback: sender sockets, receiver sockets and the receiver state machine."""

    def __init__(self, spec: TrafficSpec) -> None:
        self.spec = spec
        self.rx = RoundReceiver(spec.token, rank=1)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tos(self.listener, EF)
        self.listener.bind((spec.host, 0))
        self.listener.listen(1)
        self.tx_tcp = socket.create_connection(self.listener.getsockname(), timeout=spec.timeout)
        _tos(self.tx_tcp, EF)
        self.rx_tcp, _ = self.listener.accept()
        _tos(self.rx_tcp, EF)
        self.rx_tcp.setblocking(False)
        self.tx_tcp.setblocking(False)
        self.rx_udp: dict[int, socket.socket] = {}
        self.tx_udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _tos(self.tx_udp, spec.low_dscp)
        for lane in range(1, spec.lanes):
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            u.bind((spec.host, 0))
            u.setblocking(False)
            self.rx_udp[lane] = u
        self.rx_buf = bytearray()
        self.tx_buf = bytearray()
        self.rx_frames = 0
        self.rx_datagrams = 0
        self.done: list[RoundDone] = []
        self.reports: list[wire.Frame] = []

    def close(self) -> None:
        for s in (self.listener, self.tx_tcp, self.rx_tcp, self.tx_udp, *self.rx_udp.values()):
            s.close()

    def _events(self, events: list) -> None:
        for e in events:
            if isinstance(e, RoundDone):
                self.done.append(e)
                self.send_all(self.rx_tcp, e.report)

    def pump(self, wait: float = 0.0) -> None:
        """Move whatever has arrived into the receiver (TCP first, so ROUND_BEGIN precedes its datagrams)."""
        socks = [self.rx_tcp, self.tx_tcp, *self.rx_udp.values()]
        ready, _, _ = select.select(socks, [], [], wait)
        now = time.monotonic()
        if self.rx_tcp in ready:
            while True:
                try:
                    chunk = self.rx_tcp.recv(1 << 20)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                self.rx_buf += chunk
            end = frames_end(bytes(self.rx_buf))
            if end:
                for f in wire.decode_frames(bytes(self.rx_buf[:end])):
                    self.rx_frames += 1
                    self._events(self.rx.receive_frame(f, 0, now))
                del self.rx_buf[:end]
        for lane, u in self.rx_udp.items():
            if u not in ready:
                continue
            grams = []
            while True:
                try:
                    grams.append(u.recv(65536))
                except BlockingIOError:
                    break
            if grams:
                self.rx_datagrams += len(grams)
                batch = wire.decode_datagrams(b"".join(grams), [len(g) for g in grams])
                self._events(self.rx.receive_datagrams(batch, lane, now))
        if self.tx_tcp in ready:
            while True:
                try:
                    chunk = self.tx_tcp.recv(1 << 20)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                self.tx_buf += chunk
            end = frames_end(bytes(self.tx_buf))
            if end:
                self.reports += wire.decode_frames(bytes(self.tx_buf[:end]))
                del self.tx_buf[:end]

    def send_all(self, sock: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + self.spec.timeout
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError("loopback TCP send stalled") from None
                self.pump(0.01)

    def until(self, cond, what: str) -> None:
        deadline = time.monotonic() + self.spec.timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"loopback traffic: timed out waiting for {what}")
            self.pump(0.01)


def schedule(
    rng: np.random.Generator, spec: TrafficSpec, lane: int, grams: list[bytes], late: list[tuple[int, bytes]]
) -> list[bytes]:
    """The datagrams actually sent, in order: some dropped (the first ``spec.late`` of them kept in ``late`` to be
    sent after the round closed), some duplicated, some swapped with their successor."""
    out: list[bytes] = []
    for g in grams:
        u = rng.random()
        if u < spec.drop:
            if len(late) < spec.late:
                late.append((lane, g))
            continue
        out.append(g)
        if u > 1 - spec.duplicate:
            out.append(g)
    for i in range(len(out) - 1):
        if rng.random() < spec.swap:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def plan_round(rng: np.random.Generator, spec: TrafficSpec, tx: RoundSender, layout: BucketLayout, rnd: int):
    """One round of random gradients, blocks classed important with probability ``spec.important``."""
    flat = torch.from_numpy(rng.standard_normal(layout.numel).astype(np.float32))
    cls = torch.from_numpy(
        np.where(rng.random(layout.nblocks) < spec.important, 0, rng.integers(1, spec.lanes, layout.nblocks))
    )
    return tx.plan(0, rnd, flat, layout, cls, budget=spec.budget)


def datagrams_of(plan, lane: int) -> list[bytes]:
    d = plan.datagrams.get(lane)
    rows = [] if d is None else [bytes(r) for r in d]
    return rows + [bytes(b) for b in plan.odd.get(lane, [])]


def run_traffic(spec: TrafficSpec | None = None) -> TrafficResult:
    """Send ``spec.rounds`` rounds of one bucket over loopback and return the receiver's own account of them."""
    spec = spec or TrafficSpec()
    rng = np.random.default_rng(spec.seed)
    layout = BucketLayout(list(spec.sizes), spec.block)
    tx = RoundSender(spec.token, 0, lanes=spec.lanes)
    link = _Link(spec)
    res = TrafficResult(
        tcp_port=link.listener.getsockname()[1], udp_ports=[u.getsockname()[1] for u in link.rx_udp.values()]
    )
    try:
        for rnd in range(spec.rounds):
            plan = plan_round(rng, spec, tx, layout, rnd)
            stream = b"".join(bytes(h) + bytes(p) for h, p in plan.reliable)
            res.sent_reliable_bytes += len(stream)
            frames_before = link.rx_frames
            ndone = len(link.done)
            nframes = len(wire.decode_frames(stream))
            link.send_all(link.tx_tcp, stream)
            link.until(lambda n=nframes, b=frames_before: link.rx_frames >= b + n, "reliable frames")
            late: list[tuple[int, bytes]] = []
            sent = 0
            before = link.rx_datagrams
            for lane in range(1, spec.lanes):
                out = schedule(rng, spec, lane, datagrams_of(plan, lane), late)
                dst = link.rx_udp[lane].getsockname()
                for k, g in enumerate(out):
                    link.tx_udp.sendto(g, dst)
                    if k % 32 == 31:
                        link.pump()
                sent += len(out)
            res.sent_datagrams += sent
            link.until(lambda n=sent, b=before: link.rx_datagrams >= b + n, "datagrams")
            link._events(link.rx.on_time(time.monotonic() + 3600.0))  # the deadline passes: finalise the round
            link.until(lambda n=ndone: len(link.done) > n, "the round to close")
            link.until(lambda r=rnd: any(f.round == r for f in link.reports), "the drop report")
            for f in link.reports:
                if f.round == rnd:
                    tx.on_drop_report(f)
            before = link.rx_datagrams
            for lane, g in late:
                link.tx_udp.sendto(g, link.rx_udp[lane].getsockname())
            res.sent_datagrams += len(late)
            link.until(lambda n=len(late), b=before: link.rx_datagrams >= b + n, "late datagrams")
        res.stats = [d.stats.to_dict() for d in link.done]
        res.late = link.rx.counters.late
        res.rejected = link.rx.counters.rejected
    finally:
        link.close()
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m dgt.inspect.traffic`` (e.g. inside ``ip netns exec``): run the traffic, print the result JSON."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--low-dscp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-delay", type=float, default=0.0, help="seconds to sleep first (let a capture start)")
    a = p.parse_args(argv)
    time.sleep(a.start_delay)
    res = run_traffic(TrafficSpec(rounds=a.rounds, lanes=a.lanes, low_dscp=a.low_dscp, seed=a.seed))
    json.dump(res.to_dict(), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
