"""Turn off segmentation offloads on emulated links so every queue, filter and loss draw sees wire-size packets.

veth hands 64 KB TSO/GSO super-packets straight to its peer; a loss rule would then drop ~45 segments at once
and HTB would shape in bursts. With TSO/GSO/GRO off the stack builds MTU-size packets, as on a real wire.
Uses pyroute2's ethtool (ioctl); call inside the interface's namespace.
"""

from __future__ import annotations

from pyroute2.ethtool import Ethtool

OFF = ("tx-tcp-segmentation", "tx-tcp6-segmentation", "tx-tcp-ecn-segmentation", "tx-tcp-mangleid-segmentation",
       "tx-generic-segmentation", "rx-gro", "tx-udp-segmentation", "rx-gro-list", "rx-udp-gro-forwarding")


def _disable(ifname: str, names: tuple[str, ...]) -> list[str]:
    """Switch off those of ``names`` the device has on; returns the ones changed."""
    with Ethtool() as eth:
        feats = eth.get_features(ifname)
        changed = []
        for name in names:
            f = feats.features.get(name)
            if f is not None and f.enable and f.available:
                f.enable = False
                changed.append(name)
        if changed:
            eth.set_features(ifname, feats)
    return changed


def disable_segmentation(ifname: str) -> list[str]:
    """Switch off the segmentation/GRO features the device has on; returns the ones changed."""
    return _disable(ifname, OFF)


TX_CSUM = ("tx-checksum-ip-generic", "tx-checksum-ipv4", "tx-checksum-ipv6", "tx-checksum-sctp")


def disable_tx_checksum(ifname: str) -> list[str]:
    """Have the stack fill in checksums itself. Needed on every sender whose frames may cross a delay relay:
    veth passes checksum-offloaded frames on with the checksum left unfinished, and a raw AF_PACKET copy (the
    relay's) would carry that wrong checksum to a receiver that then drops the segment."""
    return _disable(ifname, TX_CSUM)
