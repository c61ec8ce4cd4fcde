"""Start one run's K worker processes in a network, follow rank 0's progress, and collect every rank's result.

Bounded: the whole run is killed at ``hard_timeout``; a rank that fails stops the others; every process group is
killed on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from dgt.collectives.launch import free_port
from dgt.experiment.network import MASTER_PORT, Network
from dgt.experiment.worker import PROGRESS, decisions_dir


class RunFailed(RuntimeError):
    """A rank failed or the run overran its hard timeout; the message carries the ranks' log tails."""


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def launch(net: Network, spec: Any, run_dir: str, on_progress: Callable[[dict[str, Any]], None] | None = None,
           hard_timeout: float = 600.0, module: str = "dgt.experiment.worker") -> list[dict[str, Any]]:
    """Run ``spec`` (a :class:`RunSpec`, or any spec with ``workers``, ``out_dir``, ``pace_rate`` and ``to_json``)
    on ``net`` with one process per rank running ``python -m module SPEC.json``; return the ranks' result dicts
    (rank order)."""
    os.makedirs(run_dir, exist_ok=True)
    spec.out_dir = run_dir
    spec.pace_rate = net.pace_rate
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w") as f:
        f.write(spec.to_json())
    for r in range(spec.workers):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, f"rank{r}.json"))
    # rank 0's evaluation decisions (worker.publish_decision): a previous run's in this directory would be read as
    # this run's
    decisions = decisions_dir(run_dir)
    shutil.rmtree(decisions, ignore_errors=True)
    port = MASTER_PORT if net.mode == "netem" else free_port()
    base = dict(os.environ)
    base.update({"WORLD_SIZE": str(spec.workers), "MASTER_ADDR": net.master_addr, "MASTER_PORT": str(port),
                 "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    argv = [sys.executable, "-m", module, spec_path]
    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    deadline = time.monotonic() + hard_timeout
    try:
        for r in range(spec.workers):
            env = base | {"RANK": str(r), "LOCAL_RANK": "0", "DGT_BIND": net.bind_addr(r)}
            log_path = os.path.join(run_dir, f"rank{r}.log")
            logs.append(log_path)
            with open(log_path, "wb") as log:
                stdout = subprocess.PIPE if r == 0 else log
                procs.append(net.popen(r, argv, env, stdout=stdout, stderr=log, stdin=subprocess.DEVNULL,
                                       start_new_session=True))
        _follow(procs, logs, on_progress, deadline)
    finally:
        for p in procs:
            _kill(p)
        if procs and procs[0].stdout is not None:
            procs[0].stdout.close()
        shutil.rmtree(decisions, ignore_errors=True)
    results = []
    for r in range(spec.workers):
        path = os.path.join(run_dir, f"rank{r}.json")
        if not os.path.exists(path):
            raise RunFailed(f"rank {r} wrote no result; its log ends:\n{_tail(logs[r])}")
        with open(path) as f:
            results.append(json.load(f))
    return results


def _follow(procs: list[subprocess.Popen], logs: list[str], on_progress: Callable[[dict[str, Any]], None] | None,
            deadline: float) -> None:
    """Read rank 0's progress lines until every rank exited; fail fast on a failing rank or the hard timeout."""
    out = procs[0].stdout
    assert out is not None
    buf = b""
    fd = out.fileno()
    eof = False
    while True:
        if time.monotonic() > deadline:
            raise RunFailed("the run overran its hard timeout; rank 0's log ends:\n" + _tail(logs[0]))
        bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            r = bad[0]
            raise RunFailed(f"rank {r} exited with code {procs[r].returncode}; its log ends:\n{_tail(logs[r])}")
        if eof and all(p.poll() is not None for p in procs):
            return
        if eof:
            time.sleep(0.05)
            continue
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            eof = True
            continue
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith(PROGRESS) and on_progress is not None:
                with contextlib.suppress(json.JSONDecodeError):
                    on_progress(json.loads(text[len(PROGRESS):]))
