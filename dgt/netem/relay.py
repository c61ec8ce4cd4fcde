"""The delay relay: a process in a link's own namespace that forwards frames between two veth ends, delayed.

Where the kernel has no sch_netem, a delayed link is cut in two and this relay sits in the middle, in namespace
PREFIX-d<link> (so teardown, which removes every PREFIX-* namespace and its processes, also stops it)::

    host eth0 ──veth── l  [relay: DelayLine each way]  r ──veth── p0 (bridge port)

HTB shaping and the DSCP classes stay on eth0 and p0 exactly as on an undelayed link, so frames are shaped first
and delayed after (shape, then delay). Two AF_PACKET sockets (one per end, outgoing frames ignored) read whole
bursts without blocking; each burst goes into the DelayLine as one batch, and due frames are written to the other
end. The loop sleeps in select() until the next frame is due or a frame arrives (microsecond timeouts).

Counters are written every STATS_EVERY seconds (atomically) to the stats file given on the command line, which
`dgt netem status` reads; the first write also tells the parent the relay is ready.

    python -m dgt.netem.relay --left l --right r --delay 0.025 [--jitter 0.002] [--reorder 0.01] --stats FILE
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from dgt.netem.delayline import DelayLine

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23  # Linux >= 4.20: do not hand our own transmitted frames back to us
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
BURST = 256  # frames read from one socket before the loop looks at the other and at due frames
FRAME_MAX = 65536
STATS_EVERY = 0.5
SOCK_BUF = 16 << 20


def open_port(ifname: str) -> socket.socket:
    """A non-blocking raw AF_PACKET socket on ifname that sees every frame arriving there, but not its own."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    for opt, fallback in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except PermissionError:
            s.setsockopt(socket.SOL_SOCKET, fallback, SOCK_BUF)
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def drain(sock: socket.socket, buf: bytearray, view: memoryview, limit: int = BURST) -> list[bytes]:
    """Up to `limit` waiting frames, without blocking."""
    out: list[bytes] = []
    recv_into = sock.recv_into
    try:
        for _ in range(limit):
            n = recv_into(buf)
            out.append(bytes(view[:n]))
    except BlockingIOError:
        pass
    return out


def send_all(sock: socket.socket, frames: list[bytes], counters: dict[str, int]) -> None:
    """Write frames to the other end; a frame the kernel refuses (no buffer) is counted, never retried forever."""
    send = sock.send
    for f in frames:
        try:
            send(f)
        except (BlockingIOError, OSError):
            counters["send_errors"] += 1


class Relay:
    """Both directions of one link: left→right and right→left, each with its own DelayLine."""

    def __init__(self, left: str, right: str, delay: float, jitter: float, reorder: float, capacity: int,
                 stats_path: str | None, seed: int | None = None) -> None:
        self.names = (left, right)
        self.socks = (open_port(left), open_port(right))
        self.lines = (DelayLine(delay, jitter, reorder, capacity, seed),
                      DelayLine(delay, jitter, reorder, capacity, None if seed is None else seed + 1))
        self.errors = [{"send_errors": 0}, {"send_errors": 0}]
        self.stats_path = stats_path
        self.spec = {"delay": delay, "jitter": jitter, "reorder": reorder, "capacity": capacity}
        self._buf = bytearray(FRAME_MAX)
        self._view = memoryview(self._buf)

    def stats(self) -> dict[str, Any]:
        dirs = {}
        for i, (src, dst) in enumerate((self.names, self.names[::-1])):
            dirs[f"{src}->{dst}"] = self.lines[i].counters.to_dict() | self.errors[i]
        return {"pid": os.getpid(), "time": time.time(), **self.spec, "directions": dirs}

    def write_stats(self) -> None:
        if not self.stats_path:
            return
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, self.stats_path)

    def step(self, timeout: float) -> None:
        """One turn: wait for frames or the next due time, take what arrived, send what is due."""
        ready, _, _ = select.select(self.socks, [], [], max(timeout, 0.0))
        now = time.monotonic()
        for i, sock in enumerate(self.socks):
            if sock in ready:
                frames = drain(sock, self._buf, self._view)
                send_all(self.socks[1 - i], self.lines[i].push(frames, now), self.errors[i])
        now = time.monotonic()
        for i, line in enumerate(self.lines):
            send_all(self.socks[1 - i], line.pop_due(now), self.errors[i])

    def run(self, until: float | None = None) -> None:
        self.write_stats()
        next_stats = time.monotonic() + STATS_EVERY
        while until is None or time.monotonic() < until:
            now = time.monotonic()
            wake = next_stats
            for line in self.lines:
                due = line.next_due()
                if due is not None and due < wake:
                    wake = due
            self.step(wake - now)
            if time.monotonic() >= next_stats:
                self.write_stats()
                next_stats = time.monotonic() + STATS_EVERY


def prioritise(realtime: bool) -> str:
    """The relay stands in for a wire (netem works in softirq, ahead of every process): wake it on time.
    Timer slack 1 ns (PR_SET_TIMERSLACK); SCHED_FIFO priority 1 if `realtime` and allowed (the kernel's RT
    throttling still keeps 5 % of each core for others), else nice -10. Returns the policy in use."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    if realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            return "fifo"
        except (OSError, AttributeError):
            pass
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice-10"
    return "normal"


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.netem.relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--left", required=True)
    p.add_argument("--right", required=True)
    p.add_argument("--delay", type=float, required=True, help="one-way delay in seconds")
    p.add_argument("--jitter", type=float, default=0.0, help="uniform ± seconds")
    p.add_argument("--reorder", type=float, default=0.0, help="share of frames sent at once (fraction)")
    p.add_argument("--capacity", type=int, default=50_000, help="frames held at most per direction")
    p.add_argument("--stats", default=None, help="JSON counters file, rewritten every 0.5 s")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-realtime", action="store_true", help="stay a normal process (nice -10), not SCHED_FIFO")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    policy = prioritise(not a.no_realtime)
    relay = Relay(a.left, a.right, a.delay, a.jitter, a.reorder, a.capacity, a.stats, a.seed)
    relay.spec["sched"] = policy
    try:
        relay.run()
    finally:
        relay.write_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
