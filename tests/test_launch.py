"""run_ranks: a rank that never finishes is killed at the timeout and reported with where it was stuck; each rank gets
its share of the host's cores as torch threads."""

import os
import time
from multiprocessing import forkserver

import pytest

from dgt.collectives.launch import RankFailed, rank_threads, run_ranks


def _stuck_on_odd_ranks(rank: int, world: int) -> int:
    if rank % 2:
        time.sleep(300)  # never returns within the test's timeout
    return rank


# Ranks fork from a server that has imported torch, but a cold server imports it first (seconds on a loaded 2-core CI
# machine): the timeout leaves room for that, so the odd rank is surely inside its sleep (and the even one done) when
# the time runs out.
@pytest.mark.slow  # default suite time (CI 10:20); the slow set runs it in CI
def test_a_rank_past_the_timeout_is_reported_with_its_stack():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="(?s)rank 1: missing Timeout.*_stuck_on_odd_ranks") as failed:
        run_ranks(_stuck_on_odd_ranks, 2, timeout=10)
    assert time.monotonic() - t0 < 30
    out = failed.value.outcomes  # what allow_fail=True returns
    assert out[0] == ("ok", 0)
    status, (kind, message, stacks) = out[1]
    assert status == "missing" and kind == "Timeout" and "10 s" in message
    assert "_stuck_on_odd_ranks" in stacks and "test_launch.py" in stacks


def _threads(rank: int, world: int) -> int:
    import torch

    return torch.get_num_threads()


def test_each_rank_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("DGT_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert rank_threads(1) == cores
    assert rank_threads(2) == max(1, cores // 2)
    assert rank_threads(4 * cores) == 1  # never none
    monkeypatch.setenv("DGT_THREADS", "3")  # the shell's setting wins, and reaches every rank
    assert rank_threads(2) == 3
    assert run_ranks(_threads, 2, timeout=60) == {0: 3, 1: 3}


def _env(rank: int, world: int) -> tuple:
    return os.environ.get("DGT_LAUNCH_SET"), os.environ.get("DGT_LAUNCH_GONE"), os.environ["RANK"]


def test_ranks_see_the_callers_environment_of_now(monkeypatch):
    # the fork server keeps the environment it started with; each rank must still see the caller's as it is now
    monkeypatch.setenv("DGT_LAUNCH_GONE", "old")
    forkserver._forkserver._stop()  # (CPython's own tests stop it so) the next call starts one with DGT_LAUNCH_GONE
    run_ranks(_threads, 1, timeout=60)
    monkeypatch.delenv("DGT_LAUNCH_GONE")
    monkeypatch.setenv("DGT_LAUNCH_SET", "new")
    assert run_ranks(_env, 2, timeout=60) == {0: ("new", None, "0"), 1: ("new", None, "1")}
