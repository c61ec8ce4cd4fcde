"""Egress shaping of one interface: HTB rate, DSCP priority classes with u32 filters, per-class queue, netem.

Layout with priority classes (handles in hex, as `tc` prints them)::

    1: htb (default 1:30)
     └ 1:1   rate R ceil R
        ├ 1:10 EF  prio 0  rate shares[EF]*R ceil R  → 10: pfifo limit L (or netem)
        ├ 1:20 AF  prio 1  ...                        → 20:
        ├ 1:30 BE  prio 2  ...                        → 30:
        └ 1:40 LE  prio 3  ...                        → 40:

Each class is assured only its small share; the rest of the link is lent to classes strictly in priority order,
which is how HTB gives strict-priority-like service: EF takes what it needs, LE gets the leftovers and its queue
overflows first. Without priority classes there is a single class 1:1 with one FIFO. u32 filters match the DS
field (IPv4 TOS byte, IPv6 traffic class) against the code points below.
"""

from __future__ import annotations

from typing import Any

from pyroute2 import IPRoute

from dgt.netem.spec import CLASS_NAMES, LinkSpec

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
MTU = 1514

# DSCP code point -> class. Unlisted code points (CS0 and the rest) are best effort.
DSCP_CLASS: dict[int, str] = {
    46: "EF", 44: "EF", 40: "EF", 48: "EF", 56: "EF",  # EF, VOICE-ADMIT, CS5, CS6, CS7
    10: "AF", 12: "AF", 14: "AF", 18: "AF", 20: "AF", 22: "AF",
    26: "AF", 28: "AF", 30: "AF", 34: "AF", 36: "AF", 38: "AF", 16: "AF", 24: "AF", 32: "AF",  # AFxy, CS2-CS4
    1: "LE", 8: "LE",  # LE (RFC 8622), CS1 (old lower effort)
}
CLASS_MINOR: dict[str, int] = {"EF": 0x10, "AF": 0x20, "BE": 0x30, "LE": 0x40}
FIFO_MINOR = 0x1  # the one class when priority classes are off


def class_of_dscp(dscp: int) -> str:
    """Priority class a DSCP value lands in."""
    if not 0 <= dscp < 64:
        raise ValueError(f"DSCP must be 0..63, got {dscp}")
    return DSCP_CLASS.get(dscp, "BE")


def u32_keys(dscp: int, family: int = ETH_P_IP) -> list[str]:
    """u32 key matching the DSCP: IPv4 TOS is byte 1; IPv6 traffic class spans bits 20..27 of word 0."""
    if family == ETH_P_IP:
        return [f"0x{dscp << 18:08x}/0x00fc0000+0"]
    return [f"0x{dscp << 22:08x}/0x0fc00000+0"]


def handle(major: int, minor: int) -> int:
    return (major << 16) | minor


def _quantum(rate_bytes: float) -> int:
    # HTB's default rate/r2q gets huge at high rates (and the kernel complains); keep it between 1 and ~130 MTUs
    return int(min(max(rate_bytes / 10, MTU), 200_000))


def _burst(rate_bytes: float) -> int:
    # about 1 ms at the rate, at least two full frames: enough to keep a shaped veth busy, small enough to be fair
    return int(max(rate_bytes * 0.001 + MTU, 2 * MTU))


def _netem_args(spec: LinkSpec, with_loss: bool) -> dict[str, Any]:
    args: dict[str, Any] = {"limit": spec.limit, "delay": int(round(spec.delay * 1e6))}
    if spec.jitter:
        args["jitter"] = int(round(spec.jitter * 1e6))
    if with_loss and spec.loss:
        args["loss"] = spec.loss * 100.0
    if spec.reorder:
        args["prob_reorder"] = spec.reorder * 100.0
    return args


def apply(ipr: IPRoute, index: int, spec: LinkSpec, use_netem: bool, netem_loss: bool) -> None:
    """Install the qdisc tree for spec on interface index (egress). use_netem: put netem at the leaves."""
    if spec.rate is None:
        if use_netem:
            ipr.tc("add", "netem", index, handle(1, 0), **_netem_args(spec, netem_loss))
        return
    rate_bytes = spec.rate / 8
    common = {"burst": _burst(rate_bytes), "cburst": _burst(rate_bytes)}
    default = CLASS_MINOR["BE"] if spec.priority else FIFO_MINOR
    ipr.tc("add", "htb", index, handle(1, 0), default=default)
    ipr.tc("add-class", "htb", index, handle(1, 1), parent=handle(1, 0), rate=f"{spec.rate}bit",
           ceil=f"{spec.rate}bit", quantum=_quantum(rate_bytes), **common)
    leaves: list[int] = [FIFO_MINOR]
    if spec.priority:
        leaves = []
        for prio, name in enumerate(CLASS_NAMES):
            minor = CLASS_MINOR[name]
            share = max(int(spec.rate * spec.shares.get(name, 0.0)), 8000)
            ipr.tc("add-class", "htb", index, handle(1, minor), parent=handle(1, 1), rate=f"{share}bit",
                   ceil=f"{spec.rate}bit", prio=prio, quantum=_quantum(rate_bytes), **common)
            leaves.append(minor)
    for minor in leaves:
        leaf = handle(max(minor, 0x10), 0)  # the FIFO class 1:1 gets qdisc 10: (1: is the root)
        if use_netem:
            ipr.tc("add", "netem", index, leaf, parent=handle(1, minor), **_netem_args(spec, netem_loss))
        else:
            ipr.tc("add", "pfifo", index, leaf, parent=handle(1, minor), limit=spec.limit)
    if spec.priority:
        # one filter preference per protocol (tc wants one protocol per preference); u32 chains the keys
        for pref, proto in ((1, ETH_P_IP), (2, ETH_P_IPV6)):
            for dscp, name in sorted(DSCP_CLASS.items()):
                ipr.tc("add-filter", "u32", index, parent=handle(1, 0), prio=pref, protocol=proto,
                       target=handle(1, CLASS_MINOR[name]), keys=u32_keys(dscp, proto))


def _stats(msg: Any) -> dict[str, int]:
    s2 = msg.get_attr("TCA_STATS2")
    basic = s2.get_attr("TCA_STATS_BASIC") if s2 is not None else None
    queue = s2.get_attr("TCA_STATS_QUEUE") if s2 is not None else None
    out = {"bytes": 0, "packets": 0, "drops": 0, "overlimits": 0, "backlog_bytes": 0, "qlen": 0, "requeues": 0}
    if basic is not None:
        out["bytes"], out["packets"] = int(basic["bytes"]), int(basic["packets"])
    if queue is not None:
        out["drops"], out["overlimits"] = int(queue["drops"]), int(queue["overlimits"])
        out["backlog_bytes"], out["qlen"], out["requeues"] = int(queue["backlog"]), int(queue["qlen"]), \
            int(queue["requeues"])
    return out


def fmt_handle(h: int) -> str:
    return f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"


def read_stats(ipr: IPRoute, index: int) -> dict[str, Any]:
    """Counters of the qdiscs and classes on one interface, leaf classes named EF/AF/BE/LE (or FIFO)."""
    names = {handle(1, m): n for n, m in CLASS_MINOR.items()} | {handle(1, FIFO_MINOR): "FIFO"}
    qdiscs = []
    leaf_drops: dict[int, int] = {}
    for msg in ipr.get_qdiscs(index):
        if msg["index"] != index:
            continue
        st = _stats(msg)
        qdiscs.append({"kind": msg.get_attr("TCA_KIND"), "handle": fmt_handle(msg["handle"]),
                       "parent": fmt_handle(msg["parent"]), **st})
        leaf_drops[msg["parent"]] = st["drops"]
    classes = []
    leaf_parents = set(leaf_drops)
    for msg in ipr.get_classes(index):
        if msg["index"] != index:
            continue
        h = msg["handle"]
        st = _stats(msg)
        name = names.get(h, fmt_handle(h))
        if h == handle(1, 1) and any(handle(1, m) in leaf_parents for m in CLASS_MINOR.values()):
            name = "link"
        # a leaf's own qdisc (pfifo/netem) sees every drop, including netem's random loss
        st["drops"] = max(st["drops"], leaf_drops.get(h, 0))
        classes.append({"class": name, "handle": fmt_handle(h), **st})
    order = {n: i for i, n in enumerate(("link", "FIFO", *CLASS_NAMES))}
    classes.sort(key=lambda c: order.get(c["class"], 99))
    return {"qdiscs": qdiscs, "classes": classes}
