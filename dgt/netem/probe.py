"""Ask the running kernel what it can emulate, by trying it in a throwaway namespace.

Kernels differ (this project's CI kernel has HTB and u32 but no netem), so nothing is assumed: each feature is
tried once per process and the answer cached. A missing feature turns into EmulationUnsupported naming it.
"""

from __future__ import annotations

import errno
import functools
import os
import re

from pyroute2 import IPRoute, NetlinkError

from dgt.errors import DgtError, EmulationUnsupported
from dgt.netem import nsutil

# feature -> (what it is, kernel config option, module to load)
FEATURES: dict[str, tuple[str, str, str]] = {
    "sch_htb": ("HTB qdisc: rate shaping and priority classes", "CONFIG_NET_SCH_HTB", "sch_htb"),
    "sch_pfifo": ("pfifo qdisc: per-class queue limit", "CONFIG_NET_SCH_FIFO", "sch_fifo"),
    "cls_u32": ("u32 classifier: DSCP filters", "CONFIG_NET_CLS_U32", "cls_u32"),
    "sch_netem": ("netem qdisc: delay, jitter, loss, reordering", "CONFIG_NET_SCH_NETEM", "sch_netem"),
    "nft_numgen": ("nftables netdev ingress chain with numgen random: loss without netem",
                   "CONFIG_NF_TABLES_NETDEV and CONFIG_NFT_NUMGEN", "nft_numgen"),
}


def _missing_kind(exc: NetlinkError) -> bool:
    # the kernel answers ENOENT for an unknown qdisc/classifier kind (EOPNOTSUPP on some builds)
    return exc.code in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL)


def _probe_tc(ns: str) -> dict[str, bool]:
    out: dict[str, bool] = {}
    with IPRoute(netns=ns) as ipr:
        ipr.link("add", ifname="pa", kind="veth", peer="pb")
        ipr.link("add", ifname="pc", kind="veth", peer="pd")
        a = ipr.link_lookup(ifname="pa")[0]
        c = ipr.link_lookup(ifname="pc")[0]
        try:
            ipr.tc("add", "htb", a, 0x10000, default=0x10)
            ipr.tc("add-class", "htb", a, 0x10001, parent=0x10000, rate="10mbit", ceil="10mbit", quantum=1514)
            out["sch_htb"] = True
        except NetlinkError as exc:
            if not _missing_kind(exc):
                raise
            out["sch_htb"] = False
        if out["sch_htb"]:
            try:
                ipr.tc("add", "pfifo", a, 0x100000, parent=0x10001, limit=10)
                out["sch_pfifo"] = True
            except NetlinkError as exc:
                if not _missing_kind(exc):
                    raise
                out["sch_pfifo"] = False
            try:
                ipr.tc("add-filter", "u32", a, parent=0x10000, prio=1, protocol=0x0800, target=0x10001,
                       keys=["0x00b80000/0x00fc0000+0"])
                out["cls_u32"] = True
            except NetlinkError as exc:
                if not _missing_kind(exc):
                    raise
                out["cls_u32"] = False
        else:
            out["sch_pfifo"] = out["cls_u32"] = False
        try:
            ipr.tc("add", "netem", c, 0x10000, delay=1000, limit=10)
            out["sch_netem"] = True
        except NetlinkError as exc:
            if not _missing_kind(exc):
                raise
            out["sch_netem"] = False
    return out


def _probe_nft(ns: str) -> bool:
    from dgt.netem import loss

    try:
        nsutil.run_in_ns(ns, loss.install_probe, "pb")
        return True
    except NetlinkError as exc:
        if exc.code in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
            return False
        raise
    except OSError as exc:
        if exc.errno in (errno.EPROTONOSUPPORT, errno.EAFNOSUPPORT):
            return False
        raise


PROBE_PREFIX = "dgtprobe"


def _remove_stale_probes() -> None:
    """A probe namespace whose process died mid-probe would otherwise stay forever."""
    for name in nsutil.list_ns():
        m = re.match(rf"^{PROBE_PREFIX}(\d+)-x$", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            nsutil.remove_ns(name)


@functools.lru_cache(maxsize=1)
def probe() -> dict[str, bool]:
    """Which emulation features this kernel has: {'sch_htb': True, 'sch_netem': False, ...}."""
    nsutil.require_privilege()
    _remove_stale_probes()
    ns = f"{PROBE_PREFIX}{os.getpid()}-x"
    nsutil.remove_ns(ns)
    try:
        nsutil.create_ns(ns)
    except PermissionError as exc:
        raise nsutil.privilege_error(exc) from exc
    except (OSError, DgtError) as exc:
        raise EmulationUnsupported(f"network namespaces cannot be created here (CONFIG_NET_NS): {exc}") from exc
    try:
        result = {**_probe_tc(ns), "nft_numgen": _probe_nft(ns)}
    finally:
        nsutil.remove_ns(ns)
    return result


def has(feature: str) -> bool:
    return bool(probe().get(feature))


def require(feature: str, why: str) -> None:
    """Raise EmulationUnsupported naming the kernel feature if this kernel lacks it."""
    if has(feature):
        return
    what, config, module = FEATURES[feature]
    raise EmulationUnsupported(
        f"{why} needs the kernel feature {feature} ({what}), which this kernel does not provide: creating it in a "
        f"test namespace failed. Load it (modprobe {module}) or use a kernel built with {config}."
    )
