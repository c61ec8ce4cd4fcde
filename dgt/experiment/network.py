"""The network a run trains over: an emulated netem topology (root) or paced loopback (anyone), behind one
interface that starts the ranks' processes and reports what the network saw.

netem: host r (namespace PREFIX-hR, address 10.77.0.r+1) runs rank r; every host link is shaped to the configured
rate in both directions by HTB with DSCP priority classes EF > AF > BE > LE, so the parameter server's link is the
bottleneck (K-1 workers push into it, it sends K-1 pulls out of it) and important blocks (TCP, EF) overtake
unimportant ones (UDP, LE) in its queues. Optional cross traffic: an extra host sends UDP or TCP at a paced rate
into the server's link through the whole run; what it got is measured at its sink.

loopback: all ranks on 127.0.0.1; each pair of ranks has one budget of rate / (K - 1) bytes/s per direction that
its TCP connection and its UDP lanes share: what one peer gets when a host's K - 1 peers share a link of the
configured rate, so a host's budgets add up to the link rate for the baseline and DGT alike. The kernel paces the
TCP socket to it (SO_MAX_PACING_RATE); the transport paces the UDP lanes from a token bucket at the same rate that
the TCP bytes come off too (TransportConfig.pacing.shared), and its send budget counts a round's important bytes
before the unimportant ones. There is no shared queue and no priority: a weaker emulation, and the report says so.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from dgt.experiment.config import NetworkConfig

MASTER_PORT = 29611
CROSS_BIN_S = 0.02  # resolution of the cross flow's arrival series
CROSS_BURST_S = 0.1  # the cross flow's pacing credit: it wants its rate at every moment, it does not catch up
CROSS_IDLE_S = 30.0  # a UDP cross flow's sink outlasts any gap in arrivals a run can cause (it is stopped at the end)


def netem_unavailable_reason() -> str | None:
    """None when namespaces with HTB priority shaping can be built here, else why not."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_NET_ADMIN)"
    try:
        from dgt.netem import probe

        for feature in ("sch_htb", "cls_u32", "sch_pfifo"):
            if not probe.has(feature):
                return f"the kernel lacks {feature}"
    except Exception as exc:  # noqa: BLE001 - any failure to probe means: use loopback
        return f"namespaces unavailable ({type(exc).__name__}: {exc})"
    return None


def resolve_mode(cfg: NetworkConfig) -> tuple[str, str | None]:
    """(mode, why netem was not used) for the configured mode; netem asked for explicitly must work."""
    if cfg.mode == "loopback":
        return "loopback", "loopback requested"
    why = netem_unavailable_reason()
    if cfg.mode == "netem" and why:
        raise RuntimeError(f"--network netem: {why}")
    return ("loopback", why) if why else ("netem", None)


def cross_rate(value: str | None) -> str | None:
    """The cross flow's pacing rate: ``unpaced`` (a TCP flow then takes what congestion control gives it) -> None."""
    return None if value in (None, "unpaced") else value


def rate_bytes(rate: str) -> float:
    from dgt.netem.spec import parse_rate

    bps = parse_rate(rate)
    assert bps is not None
    return bps / 8.0


class Network:
    """One run's network: start rank processes in it, read its counters, tear it down (context manager)."""

    def __init__(self, cfg: NetworkConfig, workers: int, mode: str, tag: str = "") -> None:
        self.cfg = cfg
        self.workers = workers
        self.mode = mode
        self.topo: Any = None
        self.flow: Any = None
        self.prefix = f"{cfg.prefix}{os.getpid() % 100000}{tag}"[:12]

    # -- lifecycle
    def __enter__(self) -> Network:
        if self.mode == "netem":
            from dgt.netem import Topology

            extra = 1 if self.cfg.cross_traffic else 0
            self.topo = Topology(hosts=self.workers + extra, rate=self.cfg.rate, limit=self.cfg.queue_limit,
                                 priority=self.cfg.priority, loss=self.cfg.loss or None, delay=self.cfg.delay,
                                 prefix=self.prefix, replace=True)
            self.topo.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.flow is not None:
            with contextlib.suppress(Exception):
                self.flow.kill()
            self.flow = None
        if self.topo is not None:
            self.topo.down()  # removes every namespace of the prefix and what runs inside
            self.topo = None

    # -- ranks
    @property
    def master_addr(self) -> str:
        return self.topo.hosts[0].addr if self.topo is not None else "127.0.0.1"

    def bind_addr(self, rank: int) -> str:
        return self.topo.hosts[rank].addr if self.topo is not None else "127.0.0.1"

    @property
    def pace_rate(self) -> float | None:
        """Bytes/s every connection is paced to (loopback mode only; netem shapes the links instead): the fair share
        of one of the K - 1 flows a host has."""
        return rate_bytes(self.cfg.rate) / (self.workers - 1) if self.mode == "loopback" else None

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
        if self.topo is not None:
            return self.topo.popen(rank, argv, env=env, **kwargs)
        return subprocess.Popen(list(argv), env=env, **kwargs)

    def start_cross_traffic(self, duration: float) -> None:
        """Traffic from the extra host into the server's link for ``duration`` seconds at most (netem only); the
        sink records what arrives in 20 ms bins, so the flow's goodput during the training iterations can be taken
        (:meth:`stop_cross_traffic`, :func:`dgt.experiment.metrics.cross_flow`)."""
        if self.topo is None or not self.cfg.cross_traffic:
            return
        from dgt.netem import cross_traffic

        self.flow = cross_traffic(self.topo, self.workers, 0, proto=self.cfg.cross_proto, dscp=self.cfg.cross_dscp,
                                  rate=cross_rate(self.cfg.cross_traffic), duration=duration, bin_s=CROSS_BIN_S,
                                  burst=CROSS_BURST_S, idle=CROSS_IDLE_S)

    def stop_cross_traffic(self) -> Any:
        """End the cross flow now and return its :class:`dgt.netem.FlowResult` (None: there was none)."""
        if self.flow is None:
            return None
        flow, self.flow = self.flow, None
        try:
            return flow.stop()
        finally:
            flow.kill()

    # -- reporting
    def describe(self) -> str:
        if self.mode == "netem":
            cross = (f"; cross traffic {self.cfg.cross_traffic} {self.cfg.cross_proto.upper()} DSCP "
                     f"{self.cfg.cross_dscp} into the server's link") if self.cfg.cross_traffic else ""
            queues = (f"HTB, DSCP classes EF > AF > BE > LE, {self.cfg.queue_limit}-packet queue per class"
                      if self.cfg.priority else f"HTB, one FIFO queue of {self.cfg.queue_limit} packets, DSCP ignored")
            extra = (f", {self.cfg.loss * 100:g} % random loss" if self.cfg.loss else "") + \
                (f", {self.cfg.delay} delay" if self.cfg.delay else "")
            return (f"netem: {self.workers} hosts in network namespaces on one switch, every link shaped to "
                    f"{self.cfg.rate} each way ({queues}){extra}{cross}")
        share = self.pace_rate or 0.0
        return (f"loopback: each pair of ranks has one budget of {self.cfg.rate} / {self.workers - 1} = "
                f"{share * 8 / 1e6:.3g} Mbit/s per direction that its TCP connection and its UDP lanes share (TCP "
                f"paced by the kernel, UDP by the transport from what the TCP bytes left), so a host's budgets, "
                f"one per peer, add up to {self.cfg.rate} for the baseline and DGT alike; no shared "
                f"bottleneck queue and no DSCP priority (run as root for the netem emulation)")

    def budget(self) -> dict[str, Any] | None:
        """For results.json: the budget each pair of ranks' TCP and UDP share (loopback), None under netem (the
        shaped links are the budget there)."""
        if self.mode != "loopback":
            return None
        return {"shared_by": ["tcp", "udp"], "per_peer_bytes_per_s": self.pace_rate,
                "per_host_bytes_per_s": rate_bytes(self.cfg.rate)}

    def counters(self) -> dict[str, Any] | None:
        """Per priority class bytes/packets/drops on the server's link, both directions (netem only)."""
        if self.topo is None:
            return None
        st = self.topo.stats()
        out: dict[str, Any] = {}
        for link in st["links"]:
            if link["link"] != "h0":
                continue
            way = "into_server" if link["direction"].endswith("h0") else "from_server"
            out[way] = {c["class"]: {k: c[k] for k in ("bytes", "packets", "drops")}
                        for c in link["classes"] if c["class"] in ("EF", "AF", "BE", "LE", "FIFO")}
        return out
