"""Run one command per emulated host, torchrun-style: rank/world/rendezvous in the environment, logs collected.

Rank r runs in host r's namespace with RANK, WORLD_SIZE, LOCAL_RANK=0, MASTER_ADDR (rank 0's address),
MASTER_PORT and the DGT_* equivalents set, so a torch.distributed or dgt job rendezvouses across the emulated
network. Placeholders {rank} {world} {addr} {host} {master_addr} {master_port} in argv are filled in per rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dgt.netem.topology import Topology

DEFAULT_MASTER_PORT = 29500
PLACEHOLDERS = ("rank", "world", "addr", "host", "master_addr", "master_port")


@dataclass
class HostRun:
    """Outcome of one rank: exit code (None if it had to be killed), where its log is, and the log's text."""

    rank: int
    host: str
    ns: str
    addr: str
    returncode: int | None
    log: str
    output: str
    seconds: float
    killed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rank_env(topo: Topology, rank: int, hosts: Sequence[int], master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
    """The variables rank `rank` (running on host hosts[rank]) gets on top of the caller's environment."""
    h = topo.hosts[hosts[rank]]
    master = topo.hosts[hosts[0]].addr
    world = str(len(hosts))
    return {
        "RANK": str(rank), "WORLD_SIZE": world, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
        "MASTER_ADDR": master, "MASTER_PORT": str(master_port),
        "DGT_RANK": str(rank), "DGT_WORLD_SIZE": world, "DGT_RENDEZVOUS": f"{master}:{master_port}",
        "DGT_NETEM_PREFIX": topo.prefix, "DGT_NETEM_HOST": h.name, "DGT_NETEM_ADDR": h.addr,
        # gloo/NCCL pick their interface by name; inside the namespace it is eth0
        "GLOO_SOCKET_IFNAME": h.ifname, "NCCL_SOCKET_IFNAME": h.ifname, "TP_SOCKET_IFNAME": h.ifname,
    }


def fill(argv: Sequence[str], values: dict[str, str]) -> list[str]:
    """Replace the known {placeholders} only, so other braces in a command survive."""
    out = []
    for arg in argv:
        for key in PLACEHOLDERS:
            arg = arg.replace("{" + key + "}", values[key])
        out.append(arg)
    return out


def _stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """TERM then KILL the rank's whole process group (torchrun-like launchers fork workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)


def run(
    topo: Topology,
    argv: Sequence[str],
    hosts: Sequence[int] | None = None,
    env: dict[str, str] | None = None,
    logdir: str | None = None,
    timeout: float | None = None,
    fail_fast: bool = True,
    master_port: int = DEFAULT_MASTER_PORT,
) -> list[HostRun]:
    """Start argv on every host (or the listed ones, rank = position), wait, and return each rank's outcome.

    fail_fast: once a rank exits non-zero the others are stopped (they would wait forever on it).
    timeout: seconds until every remaining rank is stopped.
    """
    if not argv:
        raise ValueError("no command to run")
    hosts = list(range(topo.n)) if hosts is None else list(hosts)
    if not hosts or any(not 0 <= h < topo.n for h in hosts):
        raise ValueError(f"hosts must be indices in 0..{topo.n - 1}")
    logdir = logdir or tempfile.mkdtemp(prefix=f"dgt-netem-{topo.prefix}-run-")
    os.makedirs(logdir, exist_ok=True)
    base = dict(os.environ if env is None else env)
    base.setdefault("PYTHONUNBUFFERED", "1")  # so a killed rank's log still has what it printed
    procs: list[tuple[subprocess.Popen, Any, float]] = []
    ended: dict[int, float] = {}
    killed: set[int] = set()
    try:
        for rank, hi in enumerate(hosts):
            procs.append(_start(topo, argv, hosts, rank, hi, base, logdir, master_port))
        _wait(procs, None if timeout is None else time.monotonic() + timeout, fail_fast, ended, killed)
    finally:
        for proc, log, _ in procs:
            if proc.poll() is None:
                _stop(proc)
            log.close()
    results = []
    for rank, (hi, (proc, log, _)) in enumerate(zip(hosts, procs, strict=True)):
        with open(log.name, errors="replace") as f:
            text = f.read()
        h = topo.hosts[hi]
        results.append(HostRun(rank=rank, host=h.name, ns=h.ns, addr=h.addr,
                               returncode=None if rank in killed else proc.returncode, log=log.name, output=text,
                               seconds=round(ended.get(rank, 0.0), 3), killed=rank in killed))
    return results


def _start(topo: Topology, argv: Sequence[str], hosts: list[int], rank: int, hi: int, base: dict[str, str],
           logdir: str, master_port: int) -> tuple[subprocess.Popen, Any, float]:
    """Start ``rank`` on host ``hi`` in its own session, output to its log: (process, log file, start time)."""
    extra = rank_env(topo, rank, hosts, master_port)
    values = {"rank": str(rank), "world": str(len(hosts)), "addr": topo.hosts[hi].addr,
              "host": topo.hosts[hi].name, "master_addr": extra["MASTER_ADDR"], "master_port": str(master_port)}
    log = open(os.path.join(logdir, f"{topo.hosts[hi].name}.log"), "wb")
    proc = topo.popen(hi, fill(argv, values), env=base | extra, stdout=log, stderr=subprocess.STDOUT,
                      stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, log, time.monotonic()


def _wait(procs: list[tuple[subprocess.Popen, Any, float]], deadline: float | None, fail_fast: bool,
          ended: dict[int, float], killed: set[int]) -> None:
    """Wait for every process; on a failure (``fail_fast``) or past ``deadline`` stop the rest (into ``killed``).
    ``ended``: index -> seconds it ran."""
    while len(ended) < len(procs):
        for i, (proc, _, started) in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic() - started
        failed = fail_fast and any(procs[i][0].returncode not in (0, None) for i in ended)
        late = deadline is not None and time.monotonic() > deadline
        if (failed or late) and len(ended) < len(procs):
            for i, (proc, _, started) in enumerate(procs):
                if i not in ended:
                    _stop(proc)
                    killed.add(i)
                    ended[i] = time.monotonic() - started
            return
        time.sleep(0.05)


def exit_code(results: Sequence[HostRun]) -> int:
    """0 if every rank succeeded, else the first failing rank's own code; 124 if ranks only had to be killed."""
    for r in results:
        if not r.killed and r.returncode:
            return r.returncode if r.returncode > 0 else 128 - r.returncode
    return 124 if any(r.killed for r in results) else 0
