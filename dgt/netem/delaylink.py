"""Links delayed by a relay instead of sch_netem: build the cut veth pairs, start the relay, read its counters.

A relayed link has a namespace of its own, PREFIX-d<link> (PREFIX-dh0 for host h0's link, PREFIX-dbn for the
bottleneck), holding the two inner veth ends `l` and `r` and the relay process (relay.py). The outer ends keep the
names an undelayed link has (eth0 and pN, or bn0 and bn1), so shaping, the DSCP classes, nftables loss and status
work on them unchanged. `l` faces the host (or sw0), so frames on the direction host→switch (sw0→sw1) go l->r.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import time
from typing import Any

from pyroute2 import IPRoute

import dgt
from dgt.errors import DgtError
from dgt.netem import nsutil, offload, state
from dgt.netem.spec import LinkSpec

LEFT, RIGHT = "l", "r"
READY_TIMEOUT = 15.0


def relay_ns(prefix: str, link: str) -> str:
    """Namespace of the relay of link 'h3' or 'bottleneck'."""
    return f"{prefix}-d{'bn' if link == 'bottleneck' else link}"


def stats_path(prefix: str, link: str) -> str:
    return os.path.join(state.STATE_DIR, f"{prefix}.relay-{link}.json")


def log_path(prefix: str, link: str) -> str:
    return os.path.join(state.STATE_DIR, f"{prefix}.relay-{link}.log")


def build(ns: str, left_ns: str, left_dev: str, right_ns: str, right_dev: str, offloads_off: bool) -> None:
    """Create ns with veth l ── left_dev (in left_ns) and r ── right_dev (in right_ns), inner ends up."""
    nsutil.create_ns(ns)
    with contextlib.suppress(OSError):
        nsutil.write_sysctl(ns, "net.ipv6.conf.all.disable_ipv6", "1")
        nsutil.write_sysctl(ns, "net.ipv6.conf.default.disable_ipv6", "1")
    with IPRoute(netns=ns) as ipr:
        ipr.link("add", ifname=LEFT, kind="veth", peer={"ifname": left_dev, "net_ns_fd": left_ns})
        ipr.link("add", ifname=RIGHT, kind="veth", peer={"ifname": right_dev, "net_ns_fd": right_ns})
        for dev in ("lo", LEFT, RIGHT):
            ipr.link("set", index=ipr.link_lookup(ifname=dev)[0], state="up")
    if offloads_off:
        for dev in (LEFT, RIGHT):
            nsutil.run_in_ns(ns, offload.disable_segmentation, dev)


def start(prefix: str, link: str, spec: LinkSpec, capacity: int) -> subprocess.Popen:
    """Start the relay of `link` in its namespace and wait until its sockets are bound (first stats write)."""
    ns = relay_ns(prefix, link)
    os.makedirs(state.STATE_DIR, exist_ok=True)
    stats, log = stats_path(prefix, link), log_path(prefix, link)
    with contextlib.suppress(FileNotFoundError):
        os.remove(stats)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(dgt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "dgt.netem.relay", "--left", LEFT, "--right", RIGHT, "--delay", repr(spec.delay),
            "--jitter", repr(spec.jitter), "--reorder", repr(spec.reorder), "--capacity", str(capacity),
            "--stats", stats]
    with open(log, "w") as logf:
        proc = nsutil.popen_in_ns(ns, argv, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT
    while not os.path.exists(stats):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            with open(log) as f:
                raise DgtError(f"the delay relay of {link} in {ns} did not start: {f.read()[-2000:]}")
        time.sleep(0.02)
    return proc


def read_stats(prefix: str, link: str) -> dict[str, Any] | None:
    """The relay's last counters (None if it never wrote any)."""
    try:
        with open(stats_path(prefix, link)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def alive(pid: int) -> bool:
    """Whether the relay process still runs (zombies count as gone)."""
    return nsutil._alive(pid)


def direction_key(toward_right: bool) -> str:
    return f"{LEFT}->{RIGHT}" if toward_right else f"{RIGHT}->{LEFT}"


def remove_files(prefix: str) -> None:
    for path in glob.glob(os.path.join(state.STATE_DIR, f"{prefix}.relay-*")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
