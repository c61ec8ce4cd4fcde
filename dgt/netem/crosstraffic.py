"""Bounded bulk flows between emulated hosts: cross traffic for congestion, and the measuring stick for tests.

A flow is two small processes started inside the hosts' namespaces: a sink on the destination that counts what
arrives, and a sender on the source that sends TCP or UDP at a DSCP and (optionally) a paced rate for a fixed
duration. Both stop by themselves; the parent also kills them at a hard deadline. Each prints one JSON line.

Run directly: ``python -m dgt.netem.crosstraffic sink|send ...`` (that is what Flow does inside namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from dgt.netem.topology import Topology

UDP_PAYLOAD = 1400  # stays under a 1500 MTU with IP/UDP headers
TCP_CHUNK = 64 * 1024
_SEQ = struct.Struct("!Q")


def _rate_arg(value: str | int | None) -> int | None:
    from dgt.netem.spec import parse_rate  # light import, keeps the child fast

    return parse_rate(value) if value not in (None, "", "0") else None


# ---- the child programs ----------------------------------------------------------------------------------


def host_steal_s() -> float | None:
    """CPU seconds the hypervisor has taken from this (virtual) machine since boot, summed over its CPUs (the
    ``steal`` column of /proc/stat); None where the kernel does not say. While it grows, nothing in the machine ran:
    not the flows, not the shaper's timers, so a rate measured across such a gap is the host's doing, not the
    emulator's."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


def disturbed(steal_s: float | None, wall_s: float | None, share: float = 0.02) -> bool:
    """Whether ``steal_s`` CPU seconds taken by the hypervisor over ``wall_s`` seconds are more than ``share`` of this
    machine's CPU time (all its CPUs); False without figures."""
    if steal_s is None or not wall_s:
        return False
    return steal_s > share * wall_s * (os.cpu_count() or 1)


def _udp_rcvbuf_errors() -> int:
    """UDP RcvbufErrors of this namespace: datagrams the sink itself was too slow for (not emulated loss)."""
    try:
        with open("/proc/net/snmp") as f:
            rows = [ln.split() for ln in f if ln.startswith("Udp:")]
        return int(rows[1][rows[0].index("RcvbufErrors")])
    except (OSError, IndexError, ValueError):
        return 0


class _SinkTally:
    """What a sink has received: bytes, packets, the first and last arrival, bytes per ``bin_s`` bin (``bin_s`` > 0),
    and the UDP sequence numbers seen."""

    def __init__(self, proto: str, start: float, bin_s: float) -> None:
        self.proto, self.start, self.bin_s = proto, start, bin_s
        self.stats: dict[str, Any] = {"proto": proto, "bytes": 0, "packets": 0, "first": None, "last": None}
        self.seqs: set[int] = set()
        self.bins: list[int] = []

    def add(self, data: bytes, t: float) -> None:
        stats = self.stats
        if stats["first"] is None:
            stats["first"] = t
        stats["last"] = t
        stats["bytes"] += len(data)
        stats["packets"] += 1
        if self.bin_s > 0:
            i = int((t - self.start) / self.bin_s)
            if i >= len(self.bins):
                self.bins.extend([0] * (i + 1 - len(self.bins)))
            self.bins[i] += len(data)
        if self.proto == "udp" and len(data) >= _SEQ.size:
            self.seqs.add(_SEQ.unpack_from(data)[0])

    def result(self, rcvbuf_errors: int) -> dict[str, Any]:
        """The sink's report; ``rcvbuf_errors``: the namespace's UDP RcvbufErrors when the sink started."""
        stats = self.stats
        first, last = stats.pop("first"), stats.pop("last")
        span = (last - first) if first is not None and last is not None else 0.0
        stats["span_s"] = span
        stats["goodput_bps"] = stats["bytes"] * 8 / span if span > 0 else 0.0
        stats["first_at"], stats["last_at"] = first, last
        if self.bin_s > 0:
            stats["series"] = {"t0": self.start, "bin_s": self.bin_s, "bytes": self.bins}
        if self.proto == "udp":
            stats["unique"] = len(self.seqs)
            stats["rcvbuf_errors"] = _udp_rcvbuf_errors() - rcvbuf_errors
        return stats


def _sink_socket(proto: str, port: int) -> tuple[socket.socket, socket.socket | None]:
    """(the socket to read, the TCP listener or None for UDP)."""
    if proto == "udp":
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.bind(("0.0.0.0", port))
        return sock, None
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("0.0.0.0", port))
    listen.listen(16)
    return listen, listen


def run_sink(proto: str, port: int, duration: float, idle: float = 0.5, bin_s: float = 0.0) -> dict[str, Any]:
    """Count bytes (and UDP sequence numbers) until duration is up, the sender has gone quiet, or SIGTERM.

    ``bin_s`` > 0 also records the bytes that arrived in every ``bin_s`` seconds since the sink started (``series``,
    with the start as ``t0`` on the system-wide monotonic clock, which every namespace shares), so the goodput of any
    window of the flow can be taken afterwards (:meth:`FlowResult.goodput_during`)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    rcvbuf_errors = _udp_rcvbuf_errors()
    start = time.monotonic()
    deadline = start + duration
    tally = _SinkTally(proto, start, bin_s)
    sock, listen = _sink_socket(proto, port)
    conns: list[socket.socket] = []
    print(json.dumps({"ready": True}), flush=True)
    had_conn = False
    while True:
        now = time.monotonic()
        if now >= deadline or stop:
            break
        if tally.stats["last"] is not None and now - tally.stats["last"] > idle and not conns:
            break
        readable, _, _ = select.select([sock, *conns], [], [], min(0.2, deadline - now))
        for s in readable:
            if s is listen:
                c, _ = listen.accept()
                c.setblocking(False)
                conns.append(c)
                had_conn = True
                continue
            try:
                data = s.recv(1 << 20) if proto == "tcp" else s.recv(65536)
            except BlockingIOError:
                continue
            t = time.monotonic()
            if proto == "tcp" and not data:
                conns.remove(s)
                s.close()
                continue
            tally.add(data, t)
        if proto == "tcp" and had_conn and not conns:
            break
    return tally.result(rcvbuf_errors)


def run_sender(proto: str, dst: str, port: int, duration: float, rate: int | None, dscp: int,
               size: int = UDP_PAYLOAD, count: int | None = None, burst: float | None = None) -> dict[str, Any]:
    """Send for duration seconds (or count datagrams, or until SIGTERM), paced to rate bit/s, marked with dscp.

    ``burst``: the pacing credit a sender held back by the network may build up, in seconds of ``rate`` (None: no
    bound, the average since the start is held to ``rate``, so time lost is made up later at full speed; a bound
    makes the flow a source that wants ``rate`` at every moment, like a video call or a rate-limited backup)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # Flow.stop(): end early but still report
    fam_type = socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM
    sock = socket.socket(socket.AF_INET, fam_type)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    start = time.monotonic()
    deadline = start + duration
    connected = proto == "udp"
    while not connected and time.monotonic() < deadline and not stop:
        # the sink may still be binding, and under congestion a SYN can be lost: retry until the deadline
        sock.settimeout(max(0.1, min(1.5, deadline - time.monotonic())))
        try:
            sock.connect((dst, port))
            connected = True
        except (ConnectionRefusedError, TimeoutError):
            sock.close()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
            time.sleep(0.05)
    sock.settimeout(0.5)
    sent = 0
    packets = 0
    chunk = bytearray(TCP_CHUNK if proto == "tcp" else size)
    origin = start  # pacing reference: moves forward when a bounded credit is exceeded
    while connected:
        now = time.monotonic()
        if now >= deadline or stop or (count is not None and packets >= count):
            break
        if rate is not None:
            ahead = sent * 8 / rate - (now - origin)
            if burst is not None and ahead < -burst:
                origin += -burst - ahead
                ahead = -burst
            if ahead > 0:
                time.sleep(min(ahead, deadline - now))
                continue
        try:
            if proto == "udp":
                _SEQ.pack_into(chunk, 0, packets)
                n = sock.sendto(chunk, (dst, port))
            else:
                n = sock.send(chunk)
        except (TimeoutError, BlockingIOError):
            continue
        except OSError:
            break  # ENOBUFS/ECONNRESET: the flow is over
        sent += n
        packets += 1
    elapsed = time.monotonic() - start
    sock.close()
    return {"proto": proto, "connected": connected, "bytes": sent, "packets": packets, "elapsed_s": elapsed,
            "rate_bps": sent * 8 / elapsed if elapsed > 0 else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.netem.crosstraffic")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--duration", type=float, default=10.0)
    s.add_argument("--idle", type=float, default=0.5)
    s.add_argument("--bin", type=float, default=0.0)
    t = sub.add_parser("send")
    t.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    t.add_argument("--dst", required=True)
    t.add_argument("--port", type=int, default=5201)
    t.add_argument("--duration", type=float, default=5.0)
    t.add_argument("--rate", default=None)
    t.add_argument("--dscp", type=int, default=0)
    t.add_argument("--size", type=int, default=UDP_PAYLOAD)
    t.add_argument("--count", type=int, default=None)
    t.add_argument("--burst", type=float, default=None)
    a = p.parse_args(argv)
    if a.role == "sink":
        out = run_sink(a.proto, a.port, a.duration, a.idle, a.bin)
    else:
        out = run_sender(a.proto, a.dst, a.port, a.duration, _rate_arg(a.rate), a.dscp, a.size, a.count, a.burst)
    # the work is done: a late SIGTERM from Flow.wait() must not kill us during interpreter shutdown, where Python
    # puts its own handlers back to the default (a loaded CI box once lost a finished sink's report that way)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(json.dumps(out), flush=True)
    return 0


# ---- the parent side --------------------------------------------------------------------------------------


@dataclass
class FlowResult:
    """What the sender sent and the sink received; goodput is measured at the sink."""

    sent: dict[str, Any]
    received: dict[str, Any]
    host_steal_s: float | None = None  # CPU seconds the hypervisor took from this machine while the flow ran
    wall_s: float | None = None  # seconds from start() to the end of wait()

    def disturbed(self, share: float = 0.02) -> bool:
        """Whether the hypervisor took more than ``share`` of this machine's CPU time (all its CPUs) while the flow
        ran: the flow, the shaper's timers and the sink all stood still meanwhile, so a rate below the link's says
        more about the host than about the emulation. False where the kernel reports no steal time."""
        return disturbed(self.host_steal_s, self.wall_s, share)

    @property
    def goodput_bps(self) -> float:
        return float(self.received.get("goodput_bps", 0.0))

    @property
    def loss(self) -> float:
        """UDP only: fraction of sent datagrams that never arrived."""
        sent = self.sent.get("packets", 0)
        return 1.0 - self.received.get("unique", 0) / sent if sent else 0.0

    def bytes_during(self, starts: Sequence[float], ends: Sequence[float]) -> np.ndarray:
        """Bytes the sink received in each window [starts[i], ends[i]] (monotonic clock), from its binned series
        (the sink must have run with ``bin_s`` > 0); a bin that a window covers in part counts in proportion."""
        import numpy as np  # not at the top: the child programs start without it
        ser = self.received.get("series")
        if not ser:
            raise ValueError("the sink recorded no series (start the flow with bin_s > 0)")
        counts = np.asarray(ser["bytes"], dtype=np.float64)
        edges = ser["t0"] + ser["bin_s"] * np.arange(len(counts) + 1)
        cum = np.concatenate(([0.0], np.cumsum(counts)))
        return np.interp(np.asarray(ends, float), edges, cum) - np.interp(np.asarray(starts, float), edges, cum)

    def goodput_during(self, starts: Sequence[float], ends: Sequence[float]) -> float | None:
        """Bit/s the flow got within the windows (their bytes over their total length); None: no time in them."""
        import numpy as np
        length = float(np.sum(np.asarray(ends, float) - np.asarray(starts, float)))
        if length <= 0:
            return None
        return float(self.bytes_during(starts, ends).sum()) * 8 / length

    def spans(self, start: float, end: float) -> bool:
        """Whether data arrived at the sink both at or before ``start`` and at or after ``end`` (monotonic clock):
        the flow covered the whole of that window."""
        first, last = self.received.get("first_at"), self.received.get("last_at")
        return first is not None and last is not None and first <= start and last >= end


@dataclass
class Flow:
    """One bounded flow src -> dst inside a topology; start() then wait(), or use as a context manager."""

    topo: Topology
    src: int
    dst: int
    proto: str = "tcp"
    dscp: int = 0
    rate: str | int | None = None
    duration: float = 2.0
    port: int = 5201
    size: int = UDP_PAYLOAD
    count: int | None = None
    bin_s: float = 0.0  # > 0: the sink records bytes per bin_s seconds (FlowResult.goodput_during)
    burst: float | None = None  # pacing credit bound in seconds (run_sender)
    idle: float = 0.5  # the sink stops after this long without data once some has arrived (UDP, or no connection)
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _steal0: float | None = field(default=None, repr=False)
    _t0: float = field(default=0.0, repr=False)

    def start(self) -> Flow:
        if self.proto not in ("tcp", "udp"):
            raise ValueError("proto must be tcp or udp")
        py = [sys.executable, "-m", "dgt.netem.crosstraffic"]
        self._steal0, self._t0 = host_steal_s(), time.monotonic()
        sink = self.topo.popen(self.dst, py + ["sink", "--proto", self.proto, "--port", str(self.port),
                                              "--duration", str(self.duration + 3.0), "--bin", str(self.bin_s),
                                              "--idle", str(self.idle)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._procs.append(sink)
        ready, _, _ = select.select([sink.stdout], [], [], 10.0)
        line = sink.stdout.readline() if ready else ""
        if '"ready"' not in line:
            self.kill()
            raise RuntimeError(f"flow sink on host {self.dst} did not start: {line!r} {sink.stderr.read()!r}")
        cmd = py + ["send", "--proto", self.proto, "--dst", self.topo.hosts[self.dst].addr, "--port",
                    str(self.port), "--duration", str(self.duration), "--dscp", str(self.dscp), "--size",
                    str(self.size)]
        if self.rate is not None:
            cmd += ["--rate", str(self.rate)]
        if self.count is not None:
            cmd += ["--count", str(self.count)]
        if self.burst is not None:
            cmd += ["--burst", str(self.burst)]
        self._procs.append(self.topo.popen(self.src, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return self

    def wait(self, grace: float = 10.0, drain: float = 1.0) -> FlowResult:
        """Wait for both ends and parse their reports. Both stop by themselves; the sink is told to stop `drain`
        seconds after the sender has finished, and anything still running after duration + grace is killed."""
        sink, sender = self._procs
        out = {}
        for name, proc in (("sent", sender), ("received", sink)):
            if proc is sink:
                try:
                    sink.wait(drain)
                except subprocess.TimeoutExpired:
                    sink.send_signal(signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=self.duration + grace)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"flow {name} side did not stop in time") from None
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{") and '"ready"' not in ln]
            if name == "sent" and self._stopped and proc.returncode == -signal.SIGTERM:
                # stopped before its handler was installed: it sent nothing worth reporting
                out[name] = {"bytes": 0, "packets": 0, "elapsed_s": 0.0, "rate_bps": 0.0, "connected": False}
                continue
            if proc.returncode == -signal.SIGTERM and lines and (proc is sink or self._stopped):
                pass  # we signalled it after it had reported (it was already on its way out)
            elif proc.returncode != 0 or not lines:
                raise RuntimeError(f"flow {name} side failed (rc {proc.returncode}): {stderr.strip()[-500:]}")
            out[name] = json.loads(lines[-1])
        steal = host_steal_s()
        stolen = None if steal is None or self._steal0 is None else steal - self._steal0
        return FlowResult(sent=out["sent"], received=out["received"], host_steal_s=stolen,
                          wall_s=time.monotonic() - self._t0)

    def stop(self, wait: bool = True) -> FlowResult | None:
        """End the flow now: the sender stops and reports, the sink reports once the data has drained.
        wait=False only signals, so several flows can be stopped together and then wait()ed."""
        self._stopped = True
        if len(self._procs) == 2 and self._procs[1].poll() is None:
            self._procs[1].send_signal(signal.SIGTERM)
        return self.wait() if wait else None

    def kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Flow:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def cross_traffic(topo: Topology, src: int, dst: int, proto: str = "udp", dscp: int = 1,
                  rate: str | int | None = "1gbit", duration: float = 5.0, port: int = 5301, bin_s: float = 0.0,
                  burst: float | None = None, idle: float = 0.5) -> Flow:
    """Start background load (LE-marked UDP by default) from src to dst; bounded by duration. Returns the Flow."""
    return Flow(topo, src, dst, proto=proto, dscp=dscp, rate=rate, duration=duration, port=port, bin_s=bin_s,
                burst=burst, idle=idle).start()


if __name__ == "__main__":
    sys.exit(main())
