"""Emulated hosts on a switch (or two switches joined by a bottleneck), each host in its own network namespace.

Layout, all of it inside namespaces named PREFIX-*, nothing in the caller's namespace::

    PREFIX-h0: eth0 10.77.0.1 ──veth── p0 ┐
    PREFIX-h1: eth0 10.77.0.2 ──veth── p1 ┼ br0  in PREFIX-sw0
    ...                                   ┘
    dumbbell: hosts split over PREFIX-sw0 and PREFIX-sw1, whose bridges are joined by the veth pair bn0 ── bn1.

Every link is shaped in both directions at the sending end's egress (shaping.apply) and, without netem, loses
packets at the receiving end's ingress (loss.install). Delay comes from netem, or (delay_backend "relay", the
default where the kernel has no sch_netem) from a relay process in the link's own namespace PREFIX-d<link> that
sits between the two shaped ends (delaylink.py, relay.py): shape, then delay. Removing the namespaces removes
everything, relays included, which is what makes cleanup reliable: `teardown(prefix)` needs no saved state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import multiprocessing
import os
import re
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pyroute2 import IPRoute

from dgt.errors import DgtError, EmulationUnsupported
from dgt.netem import delaylink, nsutil, offload, probe, shaping, state
from dgt.netem import loss as nft_loss
from dgt.netem.spec import DEFAULT_PREFIX, DEFAULT_SUBNET, LinkSpec

PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
HOST_IF = "eth0"
BRIDGE = "br0"


def check_prefix(prefix: str) -> str:
    if not PREFIX_RE.match(prefix):
        raise DgtError(f"bad prefix {prefix!r}: 1-12 lowercase letters/digits starting with a letter (no '-')")
    return prefix


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, interface and address; rank = index."""

    index: int
    ns: str
    addr: str
    switch_ns: str
    port: str
    ifname: str = HOST_IF

    @property
    def name(self) -> str:
        return f"h{self.index}"


@dataclass(frozen=True)
class Direction:
    """One direction of one link: shaped at (tx_ns, tx_dev) egress, lossy at (rx_ns, rx_dev) ingress."""

    link: str
    label: str
    tx_ns: str
    tx_dev: str
    rx_ns: str
    rx_dev: str
    role: str  # "host" or "bottleneck"


def teardown(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace named PREFIX-* (processes inside are stopped) and the saved state. Idempotent."""
    check_prefix(prefix)
    removed = [ns for ns in nsutil.list_ns(prefix) if nsutil.remove_ns(ns)]
    state.remove(prefix)
    delaylink.remove_files(prefix)
    return removed


class Topology:
    """N emulated hosts with shaped links; a context manager that builds on enter and removes on exit.

    >>> with Topology(hosts=4, rate="100mbit", loss="0.5%", prefix="exp1") as topo:
    ...     topo.popen(0, ["python", "train.py"], env=...)

    rate/limit/delay/jitter/loss/reorder/priority describe every host link (or pass link=LinkSpec(...));
    dumbbell=True splits hosts over two switches joined by a bottleneck (bottleneck=LinkSpec or bottleneck_rate...).
    loss_backend: "auto" (netem where the kernel has it, else nftables), "netem" or "nft".
    offloads_off: turn TSO/GSO/GRO off on every link end so queues and loss act on wire-size packets.
    delay_backend: "auto" (netem where the kernel has it, else the relay), "netem" or "relay" (delaylink.py).
    relay_capacity: frames a relay holds at most per direction (more are dropped and counted).
    """

    def __init__(
        self,
        hosts: int = 2,
        rate: str | int | None = None,
        delay: str | float | None = None,
        jitter: str | float | None = None,
        loss: str | float | None = None,
        reorder: str | float | None = None,
        limit: int = 1000,
        priority: bool = True,
        shares: dict[str, float] | None = None,
        link: LinkSpec | None = None,
        dumbbell: bool = False,
        bottleneck: LinkSpec | None = None,
        prefix: str = DEFAULT_PREFIX,
        subnet: str = DEFAULT_SUBNET,
        loss_backend: str = "auto",
        replace: bool = False,
        offloads_off: bool = True,
        delay_backend: str = "auto",
        relay_capacity: int = 50_000,
    ) -> None:
        self.prefix = check_prefix(prefix)
        if hosts < 1 or (dumbbell and hosts < 2):
            raise DgtError("need at least one host (two for a dumbbell)")
        if loss_backend not in ("auto", "netem", "nft"):
            raise DgtError(f"loss_backend must be auto, netem or nft, not {loss_backend!r}")
        self.n = hosts
        self.link = link or LinkSpec.make(rate=rate, limit=limit, delay=delay, jitter=jitter, loss=loss,
                                          reorder=reorder, priority=priority, shares=shares)
        self.dumbbell = dumbbell
        self.bottleneck = (bottleneck or LinkSpec()) if dumbbell else None
        self.subnet = ipaddress.ip_network(subnet)
        if self.subnet.num_addresses - 2 < hosts:
            raise DgtError(f"subnet {subnet} is too small for {hosts} hosts")
        self.loss_backend = loss_backend
        if delay_backend not in ("auto", "netem", "relay"):
            raise DgtError(f"delay_backend must be auto, netem or relay, not {delay_backend!r}")
        self.delay_backend = delay_backend
        self.relay_capacity = relay_capacity
        self.relay_delay = False  # decided in check_kernel: delayed links go through a relay
        self.relays: dict[str, subprocess.Popen] = {}
        self.replace = replace
        self.offloads_off = offloads_off
        self.use_netem = False
        self.nft_loss = False
        self.hosts: list[Host] = []
        self.directions: list[Direction] = []
        self._layout()

    # ---- naming -------------------------------------------------------------------------------------------

    def _layout(self) -> None:
        plen = self.subnet.prefixlen
        self.plen = plen
        left = (self.n + 1) // 2 if self.dumbbell else self.n
        self.switches = [f"{self.prefix}-sw0"] + ([f"{self.prefix}-sw1"] if self.dumbbell else [])
        self.hosts = []
        for i in range(self.n):
            sw = self.switches[0] if i < left else self.switches[-1]
            self.hosts.append(Host(i, f"{self.prefix}-h{i}", str(self.subnet[i + 1]), sw, f"p{i}"))
        self.directions = []
        for h in self.hosts:
            sw = h.switch_ns.rsplit("-", 1)[1]
            self.directions.append(Direction(h.name, f"{h.name}→{sw}", h.ns, h.ifname, h.switch_ns, h.port, "host"))
            self.directions.append(Direction(h.name, f"{sw}→{h.name}", h.switch_ns, h.port, h.ns, h.ifname, "host"))
        if self.dumbbell:
            a, b = self.switches
            self.directions.append(Direction("bottleneck", "sw0→sw1", a, "bn0", b, "bn1", "bottleneck"))
            self.directions.append(Direction("bottleneck", "sw1→sw0", b, "bn1", a, "bn0", "bottleneck"))

    @property
    def namespaces(self) -> list[str]:
        return self.switches + [h.ns for h in self.hosts]

    def relayed(self, spec: LinkSpec) -> bool:
        """Whether links of this spec are delayed by a relay (not netem)."""
        return self.relay_delay and spec.needs_netem

    @property
    def relayed_links(self) -> list[tuple[str, LinkSpec]]:
        links = [(h.name, self.link) for h in self.hosts]
        if self.bottleneck is not None:
            links.append(("bottleneck", self.bottleneck))
        return [(name, spec) for name, spec in links if self.relayed(spec)]

    def spec_for(self, d: Direction) -> LinkSpec:
        return self.link if d.role == "host" or self.bottleneck is None else self.bottleneck

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Topology:
        """Check the privileges, then that the kernel can do what was asked, then build; on any failure remove what
        was built. Without root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): PrivilegeRequired, before anything else."""
        nsutil.require_privilege("building an emulated network")
        self.check_kernel()
        if nsutil.list_ns(self.prefix):
            if not self.replace:
                raise DgtError(f"namespaces with prefix {self.prefix!r} exist: {nsutil.list_ns(self.prefix)}; "
                               f"run `dgt netem down --prefix {self.prefix}` or pass replace=True")
            teardown(self.prefix)
        try:
            self._build()
        except PermissionError as exc:
            self.down()
            raise nsutil.privilege_error(exc, "building an emulated network") from exc
        except BaseException:
            self.down()
            raise
        state.save(self.prefix, self.to_state())
        return self

    def down(self) -> list[str]:
        """Remove all namespaces of this prefix (idempotent)."""
        removed = teardown(self.prefix)
        for proc in self.relays.values():  # already stopped with their namespaces; reap them
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
        self.relays.clear()
        return removed

    def check_kernel(self) -> None:
        """Before anything is created: EmulationUnsupported, naming what is missing, where this kernel cannot build
        the topology (and the delay and loss backends chosen for it)."""
        specs = [("host links", self.link)] + ([("the bottleneck", self.bottleneck)] if self.bottleneck else [])
        backend = self.delay_backend
        if backend == "auto" and any(s.needs_netem for _, s in specs):
            backend = "netem" if probe.has("sch_netem") else "relay"
        self.relay_delay = backend == "relay"
        want_netem = any(s.needs_netem for _, s in specs) and not self.relay_delay
        want_loss = any(s.loss for _, s in specs)
        for where, s in specs:
            if s.needs_netem and not self.relay_delay:
                what = ", ".join(k for k, v in (("delay", s.delay), ("jitter", s.jitter), ("reorder", s.reorder)) if v)
                probe.require("sch_netem", f"{what} on {where}")
            if s.shaped:
                probe.require("sch_htb", f"rate {s.describe()} on {where}")
                if s.priority:
                    probe.require("cls_u32", f"DSCP priority classes on {where}")
                if not s.needs_netem or self.relay_delay:
                    probe.require("sch_pfifo", f"a queue limit on {where}")
        if want_loss:
            backend = self.loss_backend
            if backend == "auto":
                backend = "netem" if want_netem or probe.has("sch_netem") else "nft"
            if backend == "netem":
                probe.require("sch_netem", "random loss through netem")
            else:
                if not probe.has("nft_numgen"):
                    raise EmulationUnsupported(
                        "random loss needs either the netem qdisc (sch_netem, CONFIG_NET_SCH_NETEM) or nftables "
                        "netdev ingress chains with numgen (CONFIG_NF_TABLES_NETDEV, CONFIG_NFT_NUMGEN); this "
                        "kernel has neither")
            self.nft_loss = backend == "nft"
        self.use_netem = want_netem or (want_loss and not self.nft_loss)

    def _build(self) -> None:
        for ns in self.namespaces:
            nsutil.create_ns(ns)
            with contextlib.suppress(OSError):  # no IPv6 chatter (DAD, router solicitations) in the counters
                nsutil.write_sysctl(ns, "net.ipv6.conf.all.disable_ipv6", "1")
                nsutil.write_sysctl(ns, "net.ipv6.conf.default.disable_ipv6", "1")
        for sw in self.switches:
            with IPRoute(netns=sw) as ipr:
                _up(ipr, "lo")
                ipr.link("add", ifname=BRIDGE, kind="bridge", br_stp_state=0, br_forward_delay=0)
                _up(ipr, BRIDGE)
        if self.dumbbell:
            a, b = self.switches
            if self.bottleneck is not None and self.relayed(self.bottleneck):
                delaylink.build(delaylink.relay_ns(self.prefix, "bottleneck"), a, "bn0", b, "bn1", self.offloads_off)
                with IPRoute(netns=a) as ipr:
                    _enslave(ipr, "bn0")
            else:
                with IPRoute(netns=a) as ipr:
                    ipr.link("add", ifname="bn0", kind="veth", peer={"ifname": "bn1", "net_ns_fd": b})
                    _enslave(ipr, "bn0")
            with IPRoute(netns=b) as ipr:
                _enslave(ipr, "bn1")
        for h in self.hosts:
            if self.relayed(self.link):
                delaylink.build(delaylink.relay_ns(self.prefix, h.name), h.ns, h.ifname, h.switch_ns, h.port,
                                self.offloads_off)
            with IPRoute(netns=h.switch_ns) as ipr:
                if not self.relayed(self.link):
                    ipr.link("add", ifname=h.port, kind="veth", peer={"ifname": h.ifname, "net_ns_fd": h.ns})
                _enslave(ipr, h.port)
            with IPRoute(netns=h.ns) as ipr:
                _up(ipr, "lo")
                idx = ipr.link_lookup(ifname=h.ifname)[0]
                ipr.addr("add", index=idx, address=h.addr, prefixlen=self.plen)
                ipr.link("set", index=idx, state="up")
        if self.relayed_links:  # frames a relay copies must carry finished checksums
            for h in self.hosts:
                nsutil.run_in_ns(h.ns, offload.disable_tx_checksum, h.ifname)
        for d in self.directions:
            spec = self.spec_for(d)
            if self.offloads_off or self.relayed(spec):  # a relay forwards wire-size frames only
                nsutil.run_in_ns(d.tx_ns, offload.disable_segmentation, d.tx_dev)
            if self.relayed(spec):  # the relay delays; netem (if any) only loses
                spec = dataclasses.replace(spec, delay=0.0, jitter=0.0, reorder=0.0)
            with IPRoute(netns=d.tx_ns) as ipr:
                idx = ipr.link_lookup(ifname=d.tx_dev)[0]
                shaping.apply(ipr, idx, spec, use_netem=self.use_netem and (spec.needs_netem or (
                    bool(spec.loss) and not self.nft_loss)), netem_loss=not self.nft_loss)
            if spec.loss and self.nft_loss:
                nsutil.run_in_ns(d.rx_ns, nft_loss.install, d.rx_dev, spec.loss)
        for name, spec in self.relayed_links:
            self.relays[name] = delaylink.start(self.prefix, name, spec, self.relay_capacity)

    # ---- state ----------------------------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix, "hosts": self.n, "dumbbell": self.dumbbell, "subnet": str(self.subnet),
            "link": self.link.to_dict(), "bottleneck": self.bottleneck.to_dict() if self.bottleneck else None,
            "loss_backend": self.loss_backend, "use_netem": self.use_netem, "nft_loss": self.nft_loss,
            "delay_backend": self.delay_backend, "relay_delay": self.relay_delay,
            "addrs": [h.addr for h in self.hosts], "created": time.time(),
        }

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> Topology:
        """The running topology of this prefix, from the state `up` saved (for status/run/down in later commands)."""
        data = state.load(check_prefix(prefix))
        if data is None or not nsutil.list_ns(prefix):
            raise DgtError(f"no emulated network with prefix {prefix!r} is up (start one with `dgt netem up`)")
        topo = cls(hosts=data["hosts"], link=LinkSpec.from_dict(data["link"]), dumbbell=data["dumbbell"],
                   bottleneck=LinkSpec.from_dict(data["bottleneck"]) if data["bottleneck"] else None,
                   prefix=prefix, subnet=data["subnet"], loss_backend=data["loss_backend"],
                   delay_backend=data.get("delay_backend", "auto"))
        topo.use_netem, topo.nft_loss = data["use_netem"], data["nft_loss"]
        topo.relay_delay = data.get("relay_delay", False)
        return topo

    def __repr__(self) -> str:
        bn = f", bottleneck {self.bottleneck.describe()}" if self.bottleneck else ""
        return f"Topology({self.prefix!r}, {self.n} hosts, link {self.link.describe()}{bn})"

    # ---- running things inside ----------------------------------------------------------------------------

    def host(self, i: int) -> Host:
        return self.hosts[i]

    def popen(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start argv inside host i's namespace (like `ip netns exec`); kwargs go to subprocess.Popen."""
        return nsutil.popen_in_ns(self.hosts[i].ns, argv, env=env, **kwargs)

    @contextlib.contextmanager
    def enter(self, i: int) -> Iterator[Host]:
        """Run the block with this thread in host i's namespace: sockets created there belong to host i."""
        with nsutil.in_ns(self.hosts[i].ns):
            yield self.hosts[i]

    def call(self, i: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run fn(*args, **kwargs) in a forked child inside host i's namespace and return its (picklable) result."""
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_call, args=(self.hosts[i].ns, send, fn, args, kwargs), daemon=True)
        proc.start()
        send.close()
        try:
            if not recv.poll(timeout):
                raise TimeoutError(f"call in {self.hosts[i].ns} did not finish within {timeout}s")
            ok, value = recv.recv()
        except EOFError:
            ok, value = False, "child exited without a result"
        finally:
            if proc.is_alive() and timeout is not None:
                proc.kill()
            proc.join(5)
            recv.close()
        if not ok:
            raise DgtError(f"call in {self.hosts[i].ns} failed: {value}")
        return value

    # ---- statistics -------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per direction of every link: qdisc and class counters (EF/AF/BE/LE or FIFO) and nftables loss counters."""
        loss_counters: dict[str, dict[str, dict[str, int]]] = {}
        if self.nft_loss:
            for ns in self.namespaces:
                loss_counters[ns] = nsutil.run_in_ns(ns, nft_loss.counters)
        out: list[dict[str, Any]] = []
        for d in self.directions:
            spec = self.spec_for(d)
            if self.offloads_off:
                nsutil.run_in_ns(d.tx_ns, offload.disable_segmentation, d.tx_dev)
            with IPRoute(netns=d.tx_ns) as ipr:
                found = ipr.link_lookup(ifname=d.tx_dev)
                tc = shaping.read_stats(ipr, found[0]) if found else {"qdiscs": [], "classes": []}
            out.append({
                "link": d.link, "direction": d.label, "ns": d.tx_ns, "dev": d.tx_dev, "spec": spec.describe(),
                "rate_bps": spec.rate, **tc,
                "loss": loss_counters.get(d.rx_ns, {}).get(d.rx_dev) if self.nft_loss and spec.loss else None,
                "delay": self._delay_stats(d, spec, tc),
            })
        return {"prefix": self.prefix, "hosts": [asdict(h) | {"name": h.name} for h in self.hosts],
                "netem": self.use_netem, "nft_loss": self.nft_loss, "relay_delay": self.relay_delay, "links": out}

    def _delay_stats(self, d: Direction, spec: LinkSpec, tc: dict[str, Any]) -> dict[str, Any] | None:
        """Delay of one link direction and the frames it holds now (relay counters, or netem's queue)."""
        if not spec.needs_netem:
            return None
        out: dict[str, Any] = {"delay_s": spec.delay, "jitter_s": spec.jitter, "reorder": spec.reorder}
        if not self.relayed(spec):
            held = sum(q["qlen"] for q in tc["qdiscs"] if q["kind"] == "netem")
            return out | {"backend": "netem", "held": held}
        rel = delaylink.read_stats(self.prefix, d.link)
        key = delaylink.direction_key(toward_right=d.tx_dev in (HOST_IF, "bn0"))
        counters = (rel or {}).get("directions", {}).get(key)
        return out | {"backend": "relay", "ns": delaylink.relay_ns(self.prefix, d.link),
                      "alive": bool(rel) and delaylink.alive(rel["pid"]), **(counters or {"held": None})}


def _up(ipr: IPRoute, ifname: str) -> int:
    idx = ipr.link_lookup(ifname=ifname)[0]
    ipr.link("set", index=idx, state="up")
    return idx


def _enslave(ipr: IPRoute, ifname: str) -> None:
    br = ipr.link_lookup(ifname=BRIDGE)[0]
    idx = ipr.link_lookup(ifname=ifname)[0]
    ipr.link("set", index=idx, master=br)
    ipr.link("set", index=idx, state="up")


def _child_call(ns: str, send: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        fd = os.open(nsutil.ns_path(ns), os.O_RDONLY)
        nsutil.setns_fd(fd)
        os.close(fd)
        send.send((True, fn(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        send.send((False, traceback.format_exc()))
    finally:
        send.close()
