"""dgt.netem pieces that need no root: units, link specs, DSCP classes, kernel-feature errors, CLI wiring."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from dgt.errors import DgtError, EmulationUnsupported
from dgt.netem import probe, runner, shaping
from dgt.netem.spec import LinkSpec, format_rate, parse_fraction, parse_rate, parse_time

ALL_FEATURES = {"sch_htb": True, "sch_pfifo": True, "cls_u32": True, "sch_netem": True, "nft_numgen": True}


def test_parse_units() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert parse_rate("10mbps") == 80_000_000  # tc: mbps = megabytes/s
    assert parse_rate(None) is None
    assert parse_time("5ms") == pytest.approx(0.005)
    assert parse_time("250us") == pytest.approx(0.00025)
    assert parse_time(0) == 0.0
    assert parse_fraction("0.5%") == pytest.approx(0.005)
    assert parse_fraction(0.02) == pytest.approx(0.02)
    assert format_rate(100_000_000) == "100mbit"
    for bad in ("100", "fast", "-1mbit"):
        with pytest.raises(DgtError):
            parse_rate(bad)
    with pytest.raises(DgtError):
        parse_time("5")  # unit required
    with pytest.raises(DgtError, match="%"):
        parse_fraction(5)  # a bare 5 would be 500%


def test_linkspec_validation_and_roundtrip() -> None:
    spec = LinkSpec.make(rate="100mbit", delay="5ms", jitter="1ms", loss="0.5%", limit=200)
    assert spec.needs_netem and spec.shaped
    assert LinkSpec.from_dict(spec.to_dict()) == spec
    assert "100mbit" in spec.describe() and "loss 0.5%" in spec.describe()
    assert not LinkSpec.make(rate="1gbit", loss="1%").needs_netem  # loss alone can go through nftables
    with pytest.raises(DgtError, match="jitter needs a delay"):
        LinkSpec.make(jitter="1ms")
    with pytest.raises(DgtError, match="reordering needs a delay"):
        LinkSpec.make(reorder="1%")
    with pytest.raises(DgtError):
        LinkSpec.make(shares={"EF": 0.9, "LE": 0.5})


def test_dscp_classes_and_u32_keys() -> None:
    assert shaping.class_of_dscp(46) == "EF"
    assert shaping.class_of_dscp(34) == "AF"  # AF41
    assert shaping.class_of_dscp(0) == "BE"
    assert shaping.class_of_dscp(1) == "LE" and shaping.class_of_dscp(8) == "LE"  # LE and CS1
    # EF = 46 -> TOS byte 0xb8, the second byte of the first IPv4 header word
    assert shaping.u32_keys(46) == ["0x00b80000/0x00fc0000+0"]
    assert shaping.u32_keys(46, shaping.ETH_P_IPV6) == ["0x0b800000/0x0fc00000+0"]
    with pytest.raises(ValueError):
        shaping.class_of_dscp(64)


def test_missing_netem_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dgt.netem.topology import Topology

    monkeypatch.setattr(probe, "probe", lambda: ALL_FEATURES | {"sch_netem": False})
    topo = Topology(hosts=2, rate="100mbit", delay="5ms", prefix="dgtunit", delay_backend="netem")
    with pytest.raises(EmulationUnsupported, match="sch_netem") as err:
        topo.check_kernel()  # the check runs before anything is created
    assert "CONFIG_NET_SCH_NETEM" in str(err.value) and "delay" in str(err.value)
    # without netem, auto delays through the relay (and netem is used for nothing)
    topo = Topology(hosts=2, rate="100mbit", delay="5ms", loss="1%", prefix="dgtunit")
    topo.check_kernel()
    assert topo.relay_delay and not topo.use_netem and topo.nft_loss
    assert [name for name, _ in topo.relayed_links] == ["h0", "h1"]
    # with netem, auto keeps netem; relay is chosen only when asked for
    monkeypatch.setattr(probe, "probe", lambda: ALL_FEATURES)
    topo = Topology(hosts=2, delay="5ms", prefix="dgtunit")
    topo.check_kernel()
    assert topo.use_netem and not topo.relay_delay and topo.relayed_links == []
    topo = Topology(hosts=3, dumbbell=True, bottleneck=LinkSpec.make(delay="5ms"), prefix="dgtunit",
                    delay_backend="relay")
    topo.check_kernel()
    assert not topo.use_netem and [name for name, _ in topo.relayed_links] == ["bottleneck"]
    with pytest.raises(DgtError, match="delay_backend"):
        Topology(hosts=2, delay="5ms", prefix="dgtunit", delay_backend="tc")
    monkeypatch.setattr(probe, "probe", lambda: ALL_FEATURES | {"sch_netem": False})
    # loss alone falls back to nftables; with neither backend the message names both
    Topology(hosts=2, loss="1%", prefix="dgtunit").check_kernel()
    monkeypatch.setattr(probe, "probe", lambda: ALL_FEATURES | {"sch_netem": False, "nft_numgen": False})
    with pytest.raises(EmulationUnsupported, match="sch_netem.*CONFIG_NFT_NUMGEN"):
        Topology(hosts=2, loss="1%", prefix="dgtunit").check_kernel()
    monkeypatch.setattr(probe, "probe", lambda: ALL_FEATURES | {"cls_u32": False})
    with pytest.raises(EmulationUnsupported, match="cls_u32"):
        Topology(hosts=2, rate="10mbit", prefix="dgtunit").check_kernel()
    Topology(hosts=2, rate="10mbit", priority=False, prefix="dgtunit").check_kernel()


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from dgt.netem.topology import Topology

    monkeypatch.setattr(probe, "probe", lambda: ALL_FEATURES)
    t = Topology(hosts=2, loss="1%", prefix="dgtunit")
    t.check_kernel()
    assert t.use_netem and not t.nft_loss  # netem preferred where present
    t = Topology(hosts=2, loss="1%", prefix="dgtunit", loss_backend="nft")
    t.check_kernel()
    assert t.nft_loss and not t.use_netem


def test_layout_names_and_addresses() -> None:
    from dgt.netem.topology import Topology

    t = Topology(hosts=5, dumbbell=True, bottleneck=LinkSpec.make(rate="50mbit"), prefix="dgtunit")
    assert [h.ns for h in t.hosts] == [f"dgtunit-h{i}" for i in range(5)]
    assert [h.addr for h in t.hosts] == [f"10.77.0.{i + 1}" for i in range(5)]
    assert {h.switch_ns for h in t.hosts[:3]} == {"dgtunit-sw0"} and t.hosts[4].switch_ns == "dgtunit-sw1"
    assert all(ns.startswith("dgtunit-") for ns in t.namespaces)
    assert sum(d.role == "bottleneck" for d in t.directions) == 2
    with pytest.raises(DgtError):
        Topology(hosts=2, prefix="Bad-Prefix")
    with pytest.raises(DgtError):
        Topology(hosts=300, prefix="dgtunit")


def test_runner_env_and_placeholders() -> None:
    from dgt.netem.topology import Topology

    t = Topology(hosts=3, prefix="dgtunit")
    env = runner.rank_env(t, 1, [2, 0], master_port=1234)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.77.0.3" and env["MASTER_PORT"] == "1234"
    assert env["DGT_NETEM_ADDR"] == "10.77.0.1" and env["DGT_RENDEZVOUS"] == "10.77.0.3:1234"
    vals = {"rank": "1", "world": "2", "addr": "a", "host": "h0", "master_addr": "m", "master_port": "1"}
    assert runner.fill(["--rank={rank}", "d={}", "{world}{addr}"], vals) == ["--rank=1", "d={}", "2a"]


def test_cli_parser() -> None:
    from dgt.netem import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["netem", "up", "--hosts", "4", "--rate", "100mbit", "--delay", "5ms", "--loss", "0.5%"])
    assert a.func is cli.cmd_up and a.hosts == 4
    spec = cli._spec(a)
    assert spec.rate == 100_000_000 and spec.delay == pytest.approx(0.005) and spec.loss == pytest.approx(0.005)
    a = parser.parse_args(["netem", "run", "--prefix", "x1", "--", "python", "-c", "print(1)"])
    assert a.func is cli.cmd_run and cli._command(a.command) == ["python", "-c", "print(1)"]
    for sub in ("status", "down", "probe", "traffic", "exec"):
        assert callable(parser.parse_args(["netem", sub]).func)


class _RecordingIPRoute:
    """Stands in for pyroute2.IPRoute: records tc calls instead of sending them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def tc(self, command: str, kind: str, index: int, handle: int = 0, **kwargs: object) -> None:
        self.calls.append((command, kind, handle, kwargs))


def test_shaping_tree_with_priority_classes() -> None:
    ipr = _RecordingIPRoute()
    shaping.apply(ipr, 7, LinkSpec.make(rate="100mbit", limit=50), use_netem=False, netem_loss=False)  # type: ignore
    qdiscs = [(c[1], hex(c[2]), c[3].get("parent")) for c in ipr.calls if c[0] == "add"]
    assert qdiscs[0] == ("htb", "0x10000", None)
    assert sorted(q[1] for q in qdiscs[1:]) == ["0x100000", "0x200000", "0x300000", "0x400000"]
    classes = {hex(c[2]): c[3] for c in ipr.calls if c[0] == "add-class"}
    assert classes["0x10001"]["rate"] == "100000000bit"
    assert [classes[h]["prio"] for h in ("0x10010", "0x10020", "0x10030", "0x10040")] == [0, 1, 2, 3]
    assert all(classes[h]["ceil"] == "100000000bit" for h in classes)
    filters = [c[3] for c in ipr.calls if c[0] == "add-filter"]
    ef = [f for f in filters if f["keys"] == ["0x00b80000/0x00fc0000+0"]]
    assert len(ef) == 1 and ef[0]["target"] == 0x10010 and ef[0]["protocol"] == shaping.ETH_P_IP
    le = {f["keys"][0] for f in filters if f["target"] == 0x10040 and f["protocol"] == shaping.ETH_P_IP}
    assert le == {"0x00040000/0x00fc0000+0", "0x00200000/0x00fc0000+0"}  # LE (1) and CS1 (8)


def test_shaping_netem_leaves_and_fifo() -> None:
    from pyroute2.netlink.rtnl.tcmsg import sched_netem
    from pyroute2.netlink.rtnl.tcmsg.common import percent2u32, time2tick

    spec = LinkSpec.make(rate="10mbit", delay="5ms", jitter="1ms", loss="2%", reorder="1%", limit=80, priority=False)
    ipr = _RecordingIPRoute()
    shaping.apply(ipr, 3, spec, use_netem=True, netem_loss=True)  # type: ignore[arg-type]
    leaves = [c for c in ipr.calls if c[0] == "add" and c[1] != "htb"]
    assert [(c[1], c[2], c[3]["parent"]) for c in leaves] == [("netem", 0x100000, 0x10001)]
    assert not [c for c in ipr.calls if c[0] == "add-filter"]  # one FIFO class: nothing to classify
    opts = sched_netem.get_parameters({k: v for k, v in leaves[0][3].items() if k != "parent"})
    assert opts["delay"] == time2tick(5000) and opts["jitter"] == time2tick(1000) and opts["limit"] == 80
    assert opts["loss"] == percent2u32(2.0)
    assert dict(opts["attrs"])["TCA_NETEM_REORDER"]["prob_reorder"] == percent2u32(1.0)
    # unshaped link with loss only: netem at the root; with the nftables backend netem leaves out the loss
    ipr = _RecordingIPRoute()
    shaping.apply(ipr, 3, LinkSpec.make(delay="1ms", loss="1%"), use_netem=True, netem_loss=False)  # type: ignore
    assert [(c[1], c[2]) for c in ipr.calls] == [("netem", 0x10000)] and "loss" not in ipr.calls[0][3]


@pytest.mark.parametrize("link", [[], ["--rate", "10mbit"]])
def test_up_without_the_privilege_says_so_and_does_not_blame_the_kernel(
        link: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41 (5): `dgt netem up` without CAP_NET_ADMIN/CAP_SYS_ADMIN (simulated: these tests may run as root)
    says what is missing, with or without --rate, and builds nothing."""
    import errno
    import os

    from dgt.cli import main
    from dgt.netem import nsutil

    # what an unprivileged process sees: not uid 0, no capability, and the kernel's EPERM on a namespace
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(nsutil, "missing_capabilities", lambda: ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"], raising=False)

    def refused(*a: object, **k: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(nsutil._netns, "create", refused)
    probe.probe.cache_clear()  # a probe cached as root earlier in this process must not answer for this one
    try:
        assert main(["netem", "up", "--hosts", "2", "--prefix", "dgtpriv", *link]) == 4
    finally:
        probe.probe.cache_clear()
    err = capsys.readouterr().err
    assert "dgt netem up: building an emulated network needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)" in err, err
    assert "kernel" not in err and "Traceback" not in err
    assert nsutil.list_ns("dgtpriv") == []


def test_a_refusal_while_building_is_a_privilege_error(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Capabilities that look present but the kernel refuses with EPERM (a container's user namespace, seccomp):
    the same message, not a raw PermissionError."""
    import errno

    from dgt.cli import main
    from dgt.netem import nsutil, topology

    monkeypatch.setattr(nsutil, "missing_capabilities", lambda: [])

    def refused(name: str) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(nsutil, "create_ns", refused)
    monkeypatch.setattr(topology, "teardown", lambda prefix: [])  # nothing was built (and nothing real is touched)
    assert main(["netem", "up", "--hosts", "2", "--prefix", "dgtpriv"]) == 4
    err = capsys.readouterr().err
    assert "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): the kernel refused it" in err, err
    assert "Traceback" not in err


def test_missing_capabilities_reads_the_effective_set(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    from dgt.netem import nsutil

    real_open = open

    def status(eff: str):
        def fake(path, *a, **k):
            if path == "/proc/self/status":
                p = tmp_path / "status"
                p.write_text(f"Name:\tpython\nCapInh:\t0\nCapPrm:\t{eff}\nCapEff:\t{eff}\n")
                return real_open(p, *a, **k)
            return real_open(path, *a, **k)
        return fake

    import builtins

    for eff, missing in (("000001ffffffffff", []), ("0000000000000000", ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]),
                         (f"{1 << 12:016x}", ["CAP_SYS_ADMIN"]), (f"{1 << 21:016x}", ["CAP_NET_ADMIN"])):
        monkeypatch.setattr(builtins, "open", status(eff))
        assert nsutil.missing_capabilities() == missing, eff
