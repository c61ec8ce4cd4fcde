"""Random packet loss with nftables, for kernels without netem.

Each lossy link end gets a netdev-family ingress chain on the receiving interface: one rule counts every frame,
the next draws `numgen random mod 1000000` and drops the frame when the draw is below loss * 1e6. Loss on the
receiving side means the frame has used the sender's shaped link first, as on a real wire. Built through
pyroute2's nfnetlink socket; these functions run inside the target namespace (see nsutil.run_in_ns).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

from pyroute2.netlink.nfnetlink.nftsocket import NFPROTO_NETDEV
from pyroute2.nftables.main import NFTables

TABLE = "dgt_netem"
MODULUS = 1_000_000
NF_DROP = 0
NFT_NG_RANDOM = 1
NFT_BYTEORDER_HTON = 1
NFT_CMP_LT = 2
NF_NETDEV_INGRESS = 0


def _expr(name: str, data: list[tuple[str, Any]]) -> dict[str, Any]:
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": data})]}


def _counter() -> dict[str, Any]:
    return _expr("counter", [("NFTA_COUNTER_BYTES", 0), ("NFTA_COUNTER_PACKETS", 0)])


def _drop() -> dict[str, Any]:
    verdict = {"attrs": [("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", NF_DROP)]})]}
    return _expr("immediate", [("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", verdict)])


def _random_below(threshold: int) -> list[dict[str, Any]]:
    # numgen leaves a host-order u32 in reg 1; convert to big endian so cmp's bytewise "<" orders it numerically
    return [
        _expr("numgen", [("NFTA_NG_DREG", 1), ("NFTA_NG_MODULUS", MODULUS), ("NFTA_NG_TYPE", NFT_NG_RANDOM),
                         ("NFTA_NG_OFFSET", 0)]),
        _expr("byteorder", [("NFTA_BYTEORDER_SREG", 1), ("NFTA_BYTEORDER_DREG", 1),
                            ("NFTA_BYTEORDER_OP", NFT_BYTEORDER_HTON), ("NFTA_BYTEORDER_LEN", 4),
                            ("NFTA_BYTEORDER_SIZE", 4)]),
        _expr("cmp", [("NFTA_CMP_SREG", 1), ("NFTA_CMP_OP", NFT_CMP_LT),
                      ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE", struct.pack(">I", threshold))]})]),
    ]


def chain_name(dev: str) -> str:
    return f"loss_{dev}"


def install(dev: str, loss: float) -> None:
    """Drop each frame arriving on dev with probability loss (call inside the namespace)."""
    threshold = round(loss * MODULUS)
    with NFTables(nfgen_family=NFPROTO_NETDEV) as nft:
        nft.table("add", name=TABLE)
        chain = OrderedDict()
        chain["table"] = TABLE
        chain["name"] = chain_name(dev)
        chain["hook"] = {"attrs": [["NFTA_HOOK_HOOKNUM", NF_NETDEV_INGRESS], ["NFTA_HOOK_PRIORITY", 0],
                                   ["NFTA_HOOK_DEV", dev]]}
        chain["type"] = "filter"
        nft.chain("add", kwarg=chain)
        nft.rule("add", table=TABLE, chain=chain_name(dev), expressions=[[_counter()]])
        nft.rule("add", table=TABLE, chain=chain_name(dev),
                 expressions=[_random_below(threshold) + [_counter(), _drop()]])


def install_probe(dev: str) -> None:
    """Build a zero-loss chain and remove the table again: proves netdev ingress + numgen exist."""
    install(dev, 0.0)
    with NFTables(nfgen_family=NFPROTO_NETDEV) as nft:
        nft.table("del", name=TABLE)


def counters() -> dict[str, dict[str, int]]:
    """{dev: {'seen': frames, 'dropped': frames}} for every loss chain in this namespace (inside the namespace)."""
    out: dict[str, dict[str, int]] = {}
    with NFTables(nfgen_family=NFPROTO_NETDEV) as nft:
        rules = nft.get_rules()
    for msg in rules:
        if msg.get_attr("NFTA_RULE_TABLE") != TABLE:
            continue
        chain = msg.get_attr("NFTA_RULE_CHAIN") or ""
        if not chain.startswith("loss_"):
            continue
        exprs = msg.get_attr("NFTA_RULE_EXPRESSIONS") or []
        names = [e.get_attr("NFTA_EXPR_NAME") for e in exprs]
        packets = 0
        for e in exprs:
            if e.get_attr("NFTA_EXPR_NAME") == "counter":
                packets = int(e.get_attr("NFTA_EXPR_DATA").get_attr("NFTA_COUNTER_PACKETS") or 0)
        entry = out.setdefault(chain[len("loss_"):], {"seen": 0, "dropped": 0})
        entry["dropped" if "numgen" in names else "seen"] = packets
    return out
