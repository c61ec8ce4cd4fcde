"""Run a function on N ranks in separate OS processes that meet through a c10d TCPStore (tests, benchmarks, the
experiment). Every child is killed when the call returns, fails or times out: nothing is left running."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank raised; carries every rank's outcome so tests can check what the others saw."""

    def __init__(self, message: str, outcomes: dict[int, tuple[str, Any]]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def _child(fn, rank: int, world: int, env: dict, args: tuple, out: mp.Queue) -> None:
    os.environ.update(env)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    try:
        import torch

        torch.set_num_threads(int(env.get("DGT_THREADS", "1")))
        result = fn(rank, world, *args)
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:  # report every failure to the parent, with its type
        out.put((rank, "error", pickle.dumps((type(exc).__name__, str(exc), traceback.format_exc()))))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, env: dict | None = None,
              allow_fail: bool = False) -> dict[int, Any] | dict[int, tuple[str, Any]]:
    """Call ``fn(rank, world, *args)`` in ``world`` spawned processes with MASTER_ADDR/MASTER_PORT set.

    Returns {rank: result}. If any rank fails: raises RankFailed (or, with ``allow_fail``, returns
    {rank: ("ok", result) | ("error", (type, message, traceback)) | ("missing", None)}).
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    procs = [ctx.Process(target=_child, args=(fn, r, world, base, args, out), daemon=True) for r in range(world)]
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(outcomes) < world and time.monotonic() < deadline:
            try:
                rank, status, blob = out.get(timeout=0.2)
                outcomes[rank] = (status, pickle.loads(blob))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(5)
    for r in range(world):
        outcomes.setdefault(r, ("missing", None))
    if allow_fail:
        return outcomes
    bad = {r: o for r, o in outcomes.items() if o[0] != "ok"}
    if bad:
        lines = [f"rank {r}: {o[0]} {o[1][0] + ': ' + o[1][1] if o[1] else ''}" for r, o in sorted(bad.items())]
        detail = next((o[1][2] for o in bad.values() if o[1]), "")
        raise RankFailed("; ".join(lines) + "\n" + detail, outcomes)
    return {r: o[1] for r, o in outcomes.items()}
