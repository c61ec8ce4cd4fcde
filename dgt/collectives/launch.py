"""Run a function on N ranks in separate OS processes that meet through a c10d TCPStore (tests, benchmarks, the
experiment). Every child is killed when the call returns, fails or times out: nothing is left running."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import tempfile
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


def _stacks_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"dgt-rank-{pid}.stacks")


def _child(fn, rank: int, world: int, env: dict, args: tuple, out: mp.Queue) -> None:
    # SIGUSR1 dumps every thread's stack: the parent asks for it before killing a rank that ran out of time
    dump = open(_stacks_file(os.getpid()), "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    # the fork server's environment is the one the parent had when the server started: take the parent's of now
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    try:
        import torch

        torch.set_num_threads(int(env["DGT_THREADS"]))
        result = fn(rank, world, *args)
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:  # report every failure to the parent, with its type
        out.put((rank, "error", pickle.dumps((type(exc).__name__, str(exc), traceback.format_exc()))))


def _dump_stacks(stuck: dict[int, mp.Process]) -> dict[int, str]:
    """Every thread's stack of each rank still running (SIGUSR1 to its faulthandler), for the failure message."""
    for p in stuck.values():
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
    if stuck:
        time.sleep(0.5)
    stacks = {}
    for r, p in stuck.items():
        try:
            with open(_stacks_file(p.pid)) as f:
                stacks[r] = f.read()[-20000:]
        except OSError:
            stacks[r] = ""
    return stacks


def rank_threads(world: int) -> int:
    """Torch intra-op threads for each of ``world`` ranks on this host: DGT_THREADS when set, else an equal share of
    the cores this process may run on (at least 1). The ranks stand for ``world`` machines, each of which would have
    all of its cores: a share keeps the ranks from oversubscribing the host, and still gives a lossy hop's C passes
    (:func:`dgt.layout.pass_threads`) the idle cores of a large host."""
    given = os.environ.get("DGT_THREADS")
    if given:
        return max(1, int(given))
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world))


def _context() -> Any:
    """A fork server that has imported torch once, so a rank starts in milliseconds instead of importing torch
    (~2 s of CPU each); the server forks before any torch thread pool exists. Where there is none (not Linux),
    spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "trio"])
    return ctx


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, env: dict | None = None,
              allow_fail: bool = False) -> dict[int, Any] | dict[int, tuple[str, Any]]:
    """Call ``fn(rank, world, *args)`` in ``world`` new processes (forked from a server that has imported torch, see
    :func:`_context`) with the caller's environment of now plus MASTER_ADDR/MASTER_PORT and ``env``, each with
    :func:`rank_threads` torch threads (``env``'s DGT_THREADS overrides).

    Returns {rank: result}. If any rank fails: raises RankFailed (or, with ``allow_fail``, returns
    {rank: ("ok", result) | ("error", (type, message, traceback)) | ("missing", None)}). A rank still running at
    the timeout is ("missing", ("Timeout", message, stacks)): every thread's stack, taken just before it is killed.
    """
    ctx = _context()
    out = ctx.Queue()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "DGT_THREADS": str(rank_threads(world)), **(env or {})}
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
        stuck = {r: p for r, p in enumerate(procs) if p.pid is not None and p.is_alive() and r not in outcomes}
        stacks = _dump_stacks(stuck)
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(5)
            try:
                os.unlink(_stacks_file(p.pid))
            except OSError:
                pass
    for r in range(world):
        if r in stacks:  # ran out of time: say where it was
            outcomes.setdefault(r, ("missing", ("Timeout", f"no result within {timeout:g} s", stacks[r])))
        outcomes.setdefault(r, ("missing", None))
    if allow_fail:
        return outcomes
    bad = {r: o for r, o in outcomes.items() if o[0] != "ok"}
    if bad:
        lines = [f"rank {r}: {o[0]} {o[1][0] + ': ' + o[1][1] if o[1] else ''}" for r, o in sorted(bad.items())]
        detail = "\n".join(f"--- rank {r} ({o[1][0]}):\n{o[1][2]}" for r, o in sorted(bad.items()) if o[1])
        raise RankFailed("; ".join(lines) + "\n" + detail, outcomes)
    return {r: o[1] for r, o in outcomes.items()}
