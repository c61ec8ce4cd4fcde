"""Live capture of DGT traffic to a pcap file with scapy's AsyncSniffer, on an interface of this namespace or of a
named network namespace (a child process enters it, so this process never changes namespace).

The sniffer reads raw frames (no per-packet dissection, so it keeps up with a loopback transport), skips the
outgoing copy the kernel shows a loopback listener (else every packet appears twice), and uses a kernel BPF filter
when libpcap can compile one, otherwise the same filter in Python.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from scapy.arch.linux import L2ListenSocket
from scapy.config import conf
from scapy.data import ETH_P_ALL
from scapy.error import Scapy_Exception
from scapy.sendrecv import AsyncSniffer
from scapy.utils import RawPcapWriter

from dgt.inspect import pcapio

PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_RCVBUFFORCE = 33
ARPHRD_LINKTYPE = {1: pcapio.ETHERNET, 772: pcapio.ETHERNET, 65534: pcapio.RAW, 65535: pcapio.RAW}
SNAPLEN = 1 << 18


def bpf_filter(tcp_ports: Iterable[int] = (), udp_ports: Iterable[int] = ()) -> str:
    """The capture filter: the given DGT ports, or all TCP and UDP when none are given (auto-detected later)."""
    tcp, udp = sorted(set(tcp_ports)), sorted(set(udp_ports))
    parts = []
    if tcp:
        parts.append("(tcp and (" + " or ".join(f"port {p}" for p in tcp) + "))")
    if udp:
        parts.append("(udp and (" + " or ".join(f"port {p}" for p in udp) + "))")
    return " or ".join(parts) if parts else "tcp or udp"


class _RawListen(L2ListenSocket):
    """A packet socket that returns raw frames, without loopback's duplicate outgoing copies, with a big buffer."""

    def __init__(self, iface: str, filter: str | None = None, nofilter: int = 0) -> None:
        super().__init__(iface=iface, type=ETH_P_ALL, filter=filter, nofilter=nofilter)
        for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
            try:
                self.ins.setsockopt(socket.SOL_SOCKET, opt, 64 << 20)
                break
            except OSError:
                continue
        hatype = self.ins.getsockname()[3]
        self.loopback = hatype == 772
        self.linktype = ARPHRD_LINKTYPE.get(hatype, pcapio.ETHERNET)
        self.kernel_stats()  # reading resets the counters: drops while scapy set the socket up do not count

    def recv_raw(self, x: int = SNAPLEN):
        pkt, sa_ll, ts = self._recv_raw(self.ins, SNAPLEN)
        if self.loopback and sa_ll[2] == PACKET_OUTGOING:
            return None, None, None
        if ts is None:
            from scapy.arch.linux import get_last_packet_timestamp

            ts = get_last_packet_timestamp(self.ins)
        return conf.raw_layer, pkt, ts

    def kernel_stats(self) -> tuple[int, int]:
        """(packets, drops) the kernel counted for this socket since the last call."""
        try:
            raw = self.ins.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
            return int.from_bytes(raw[:4], "little"), int.from_bytes(raw[4:8], "little")
        except OSError:
            return 0, 0


@dataclass
class CaptureResult:
    path: str
    iface: str
    netns: str | None
    filter: str
    kernel_filter: bool  # False: libpcap missing, filtered in Python instead
    packets: int  # written to the pcap
    kernel_drops: int  # packets the kernel dropped because the sniffer fell behind
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _python_filter(linktype: int, tcp_ports: set[int], udp_ports: set[int]):
    def keep(pkt) -> bool:
        raw = bytes(pkt)
        head = np.frombuffer(raw[: pcapio.HEAD].ljust(pcapio.HEAD, b"\0"), np.uint8).reshape(1, -1)
        c = pcapio._parse(head, np.array([len(raw)]), np.array([linktype]))
        if not c["ok"][0]:
            return False
        ports = {int(c["sport"][0]), int(c["dport"][0])}
        if c["proto"][0] == pcapio.TCP:
            return not (tcp_ports or udp_ports) or bool(ports & tcp_ports)
        if c["proto"][0] == pcapio.UDP:
            return not (tcp_ports or udp_ports) or bool(ports & udp_ports)
        return False

    return keep


class LiveCapture:
    """Capture to ``out`` until :meth:`stop`, ``duration`` seconds or ``count`` packets, whichever comes first."""

    def __init__(
        self,
        out: str,
        iface: str = "lo",
        *,
        tcp_ports: Iterable[int] = (),
        udp_ports: Iterable[int] = (),
        netns: str | None = None,
        duration: float | None = None,
        count: int | None = None,
        filter: str | None = None,
    ) -> None:
        self.out, self.iface, self.netns = out, iface, netns
        self.tcp_ports, self.udp_ports = set(tcp_ports), set(udp_ports)
        self.duration, self.count = duration, count
        self.filter = filter or bpf_filter(self.tcp_ports, self.udp_ports)
        self._sniffer: AsyncSniffer | None = None
        self._sock: _RawListen | None = None
        self._writer: RawPcapWriter | None = None
        self._child: subprocess.Popen | None = None
        self._written = 0
        self._t0 = 0.0
        self._kernel_filter = True
        self._result: CaptureResult | None = None

    # -- in this namespace
    def _start_here(self, ready_timeout: float) -> None:
        try:
            self._sock = _RawListen(self.iface, filter=self.filter)
        except Scapy_Exception:  # libpcap cannot compile filters here: filter in Python
            self._sock = _RawListen(self.iface, nofilter=1)
            self._kernel_filter = False
        lt = self._sock.linktype
        self._writer = RawPcapWriter(self.out, linktype=lt, snaplen=SNAPLEN, nano=True, sync=False)
        self._writer.write_header(None)
        lfilter = None if self._kernel_filter else _python_filter(lt, self.tcp_ports, self.udp_ports)
        started = threading.Event()

        def write(pkt) -> None:
            t = float(pkt.time)
            sec = int(t)
            self._writer.write_packet(bytes(pkt), sec=sec, usec=int(round((t - sec) * 1e9)))
            self._written += 1

        self._sniffer = AsyncSniffer(
            opened_socket=self._sock,
            prn=write,
            store=False,
            lfilter=lfilter,
            count=self.count or 0,
            started_callback=started.set,
        )
        self._t0 = time.monotonic()
        self._sniffer.start()
        if not started.wait(ready_timeout):
            raise TimeoutError("the sniffer did not start")

    def _finish_here(self) -> CaptureResult:
        assert self._sniffer is not None and self._sock is not None and self._writer is not None
        try:
            self._sniffer.stop()
        except Scapy_Exception:  # it had already stopped by itself (packet count reached)
            self._sniffer.join()
        _, drops = self._sock.kernel_stats()
        self._writer.close()
        self._sock.close()
        return CaptureResult(
            self.out,
            self.iface,
            self.netns,
            self.filter,
            self._kernel_filter,
            self._written,
            drops,
            round(time.monotonic() - self._t0, 3),
        )

    # -- in a named network namespace, through a child process
    def _start_child(self, ready_timeout: float) -> None:
        args = dict(
            out=os.path.abspath(self.out),
            iface=self.iface,
            netns=self.netns,
            tcp=sorted(self.tcp_ports),
            udp=sorted(self.udp_ports),
            duration=self.duration,
            count=self.count,
            filter=self.filter,
        )
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_BOOTSTRAP, self.netns, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._read_child(ready_timeout)
        if line.get("state") != "ready":
            raise RuntimeError(f"capture in netns {self.netns!r} failed: {line.get('error', line)}")

    def _read_child(self, timeout: float) -> dict:
        assert self._child is not None and self._child.stdout is not None
        ready, _, _ = select.select([self._child.stdout], [], [], timeout)
        if not ready:
            self._child.kill()
            raise TimeoutError("the capture child did not answer")
        line = self._child.stdout.readline()
        if not line:
            err = self._child.stderr.read() if self._child.stderr else ""
            self._child.wait(5)
            raise RuntimeError(f"capture child exited: {err.strip()[-2000:]}")
        return json.loads(line)

    # -- public
    def start(self, ready_timeout: float = 30.0) -> LiveCapture:
        """Begin capturing; returns once the socket is open, so traffic sent afterwards is seen."""
        if self.netns:
            self._start_child(ready_timeout)
        else:
            self._start_here(ready_timeout)
        return self

    def wait(self, timeout: float | None = None) -> CaptureResult:
        """Block until the duration or packet count is reached (or ``timeout``), then finish."""
        if self.netns:
            limit = timeout if timeout is not None else (self.duration or 0) + 30
            return self._stop_child(limit, send_stop=False)
        assert self._sniffer is not None
        left = self.remaining()
        if timeout is not None:
            left = timeout if left is None else min(left, timeout)
        self._sniffer.join(left)
        return self.stop()

    def remaining(self) -> float | None:
        """Seconds left of the capture's duration (None: no duration)."""
        if self.duration is None:
            return None
        return max(0.0, self._t0 + self.duration - time.monotonic())

    def stop(self) -> CaptureResult:
        """Stop now, flush the pcap, and return what was captured."""
        if self._result is None:
            self._result = self._stop_child(30, send_stop=True) if self.netns else self._finish_here()
        return self._result

    def _stop_child(self, timeout: float, send_stop: bool) -> CaptureResult:
        if self._result is not None:
            return self._result
        assert self._child is not None and self._child.stdin is not None
        if send_stop:
            try:
                self._child.stdin.write("stop\n")
                self._child.stdin.flush()
            except BrokenPipeError:
                pass
        msg = self._read_child(timeout)
        self._child.wait(10)
        if msg.get("state") != "done":
            raise RuntimeError(f"capture in netns {self.netns!r} failed: {msg.get('error', msg)}")
        self._result = CaptureResult(**msg["result"])
        return self._result

    def __enter__(self) -> LiveCapture:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# The child enters the namespace before anything imports scapy: scapy resolves interface names to indexes at import
# (its interface cache and ioctl socket belong to the namespace it was imported in), so a name that exists in both
# namespaces (eth0) bound the packet socket to the root namespace's index: ENODEV in the netns. `lo` (index 1 in
# every namespace) hid it.
_CHILD_BOOTSTRAP = (
    "import sys\n"
    "from pyroute2 import netns\n"
    "netns.setns(sys.argv[1], flags=0)\n"
    "from dgt.inspect.capture import _child_main\n"
    "sys.exit(_child_main(sys.argv[2]))\n"
)


def _child_main(spec: str) -> int:
    """Child side of a namespace capture (already inside the namespace): capture, report over stdout, stop on
    'stop'."""
    a = json.loads(spec)

    def say(**kw) -> None:
        print(json.dumps(kw), flush=True)

    try:
        cap = LiveCapture(
            a["out"],
            a["iface"],
            tcp_ports=a["tcp"],
            udp_ports=a["udp"],
            duration=a["duration"],
            count=a["count"],
            filter=a["filter"],
        )
        cap.start()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        say(state="error", error=f"{type(exc).__name__}: {exc}")
        return 1
    say(state="ready")
    assert cap._sniffer is not None
    while cap._sniffer.running and cap.remaining() != 0.0:
        r, _, _ = select.select([sys.stdin], [], [], 0.05)
        if r and sys.stdin.readline().strip() in ("stop", ""):
            break
    res = cap.stop()
    res.netns = a["netns"]
    say(state="done", result=res.to_dict())
    return 0
