"""Rendezvous at scale (#23): O(1) store operations per rank (set, add, one blocking wait; a multi_get of just the
addresses a rank dials), and a timeout that names the ranks that never came, as ranges."""

import threading

import pytest
import torch.distributed as dist

from dgt.collectives.rendezvous import Rendezvous, _ranges
from dgt.errors import RendezvousTimeout


def _meet(store, world, ranks, timeout):
    out, threads = {}, []

    def one(r):
        rv = Rendezvous(r, world, store, timeout, "t")
        try:
            rv.token()
            rv.exchange({"rank": r})
            out[r] = ("ok", rv)
        except RendezvousTimeout as exc:
            out[r] = ("timeout", str(exc))

    for r in ranks:
        threads.append(threading.Thread(target=one, args=(r,)))
        threads[-1].start()
    for t in threads:
        t.join(60)
    return out


def test_store_operations_per_rank_do_not_grow_with_the_world():
    for world in (4, 64):
        out = _meet(dist.HashStore(), world, range(world), 30.0)
        rvs = [out[r][1] for r in range(world)]
        assert all(out[r][0] == "ok" for r in range(world))
        # per rank: wait/get the token, publish, add, wait; rank 0 also sets the token, the last to arrive sets
        # ready (rank 0 may be that one: 7)
        assert max(rv.ops for rv in rvs) <= 7
        assert sum(rv.ops for rv in rvs) == 5 * world + 2
        assert rvs[5 % world].addresses([1, 2]) == {1: {"rank": 1}, 2: {"rank": 2}}


def test_timeout_names_the_missing_ranks():
    out = _meet(dist.HashStore(), 12, [0, 1, 2, 3, 5, 9, 10], 1.0)
    for r in out:
        status, msg = out[r]
        assert status == "timeout"
        assert "ranks [4, 6-8, 11] did not show up within 1.0 s (5 of 12 missing)" in msg


def test_ranges():
    assert _ranges([1, 2, 3, 7]) == "1-3, 7"
    assert _ranges([]) == ""
    assert _ranges(list(range(1000))) == "0-999"


def test_missing_token_times_out_clearly():
    rv = Rendezvous(3, 4, dist.HashStore(), 0.5, "t")
    with pytest.raises(RendezvousTimeout, match="rank 0's session token did not show up within 0.5 s"):
        rv.token()
