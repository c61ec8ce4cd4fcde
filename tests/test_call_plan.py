"""One plan per call and one transport call per lossy hop (issue 44, points 1 and 3).

- :func:`dgt.collectives.plan.plan_call` decides a call's path once (no traffic needed to check it: an offline
  group), the call's statistics record it, and its code rides in the call code every message carries;
- a lossy ring hop crosses the collective <-> transport line once (``lossy_hop`` and its return): a recording
  wrapper around each rank's transport, in-process 2- and 3-rank rings;
- two ranks forced onto different plans raise RankMismatch on every rank, with one reason, well before any timeout.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import pytest
import torch
import torch.distributed as dist
import trio

from dgt.collectives import Group, ParameterServer, RingAllReduce
from dgt.collectives.plan import plan_call
from dgt.errors import PLAN_SHIFT, RankMismatch, call_code, path_mismatch
from dgt.harness.groups import local_groups
from dgt.harness.offline import OfflineTransport
from dgt.transport import TransportConfig

SEGMENTS = [3000, 5, 20000, 1500]
NUMEL = sum(SEGMENTS)
BOUND = 60.0


def _offline(world: int = 2, **cfg) -> Group:
    return Group(OfflineTransport(0, TransportConfig(**cfg)), 0, world, 1)


# -- the plan, decided once -----------------------------------------------------------------------------------------
def test_the_plan_names_each_ring_schedule_and_why_a_faster_one_was_not_taken():
    g = _offline()
    x32, x16 = torch.zeros(NUMEL), torch.zeros(NUMEL, dtype=torch.float16)
    dense = plan_call(RingAllReduce(g, "dense"), x32)
    assert (dense.schedule, dense.gather, dense.direct, dense.code, dense.streams) == \
        ("ring-streams", "in-exchange", True, 1, True)
    assert plan_call(RingAllReduce(g, "dense"), x32.double()).schedule == "ring-rounds"
    lossy = RingAllReduce(g, "dgt:p=0.3")
    ch = lossy.chunking(SEGMENTS, lossy.codec.capabilities.block, 2)
    p = plan_call(lossy, x32, chunks=ch)
    # the offline transport has no hop socket: the plan says so
    assert (p.schedule, p.gather, p.code, p.note) == ("ring-rounds", "streams", 0, "a ring neighbour has no hop socket")
    # the hook's default fp16 wire: the lossy stream hops carry float32 only (issue 44 asks for it to be visible)
    p16 = plan_call(lossy, x16, chunks=ch, sparse_gather=True)
    assert (p16.schedule, p16.gather, p16.wire_dtype, p16.code) == ("ring-rounds", "sparse-streams", "float16", 2)
    assert "float32" in p16.note and "float16" in p16.note
    off = plan_call(RingAllReduce(_offline(stream_hops="off"), "dgt:p=0.3"), x32, chunks=ch)
    assert (off.schedule, off.gather, off.note) == ("ring-rounds", "rounds", "stream hops are off")
    assert plan_call(RingAllReduce(_offline(1), "dense"), x32).schedule == "local"
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: what was decided is not changed on the way
        dense.schedule = "ring-rounds"  # type: ignore[misc]


def test_the_parameter_server_plans_its_path_in_the_same_function():
    g = _offline(3)
    ps = ParameterServer(g, "dense", server="sharded")
    x = torch.zeros(NUMEL)
    assert plan_call(ps, x, servers=ps.servers, sharded=True).schedule == "ps-streams"
    few = ParameterServer(g, "dense", server="sharded", shards=2)
    p = plan_call(few, x, servers=few.servers, sharded=True)
    assert p.schedule == "ps-rounds" and "shards on fewer ranks" in p.note
    lossy = ParameterServer(g, "dgt:p=0.3")
    assert plan_call(lossy, x, servers=lossy.servers).schedule == "ps-rounds"


def test_the_plan_code_rides_in_the_call_code_and_names_the_disagreement():
    base = call_code("mean", "dgt")
    assert call_code("mean", "dgt", 3) == base | 3 << PLAN_SHIFT and base < 1 << PLAN_SHIFT
    from dgt.errors import op_mismatch

    assert op_mismatch(call_code("mean", "dgt", 1), base, 5) == path_mismatch(5)
    assert "all-gather" in op_mismatch(call_code("mean", "dgt", 3), call_code("mean", "dgt", 1), 5)
    assert "different ops" in op_mismatch(call_code("sum", "dgt", 1), base, 5)  # the op still comes first


# -- one transport call per lossy hop -------------------------------------------------------------------------------
HOP_PLUMBING = {"hop_rounds", "plan_hop_round", "hop_receipt", "hop_round_sent", "land_hop_round", "recv_round",
                "post_recv", "important_in", "send_round", "post_send"}


class Recorder:
    """A rank's transport with every method call its collectives make recorded by name (nothing else changed)."""

    def __init__(self, ep) -> None:
        self.ep = ep
        self.calls: list[str] = []

    def __getattr__(self, name):
        v = getattr(self.ep, name)
        if name.startswith("_") or not callable(v):
            return v
        calls = self.calls
        if inspect.iscoroutinefunction(v):
            async def acall(*a, **k):
                calls.append(name)
                return await v(*a, **k)
            return acall

        def call(*a, **k):
            calls.append(name)
            return v(*a, **k)
        return call


def _data(rank: int, it: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * it + rank))


async def _every_rank(world: int, fn, cfg: TransportConfig | None = None):
    """``fn(rank, group)`` on every rank of fresh in-process groups at once: per rank, its result or its DgtError
    and the seconds it took."""
    cfg = cfg or TransportConfig(peer_timeout=20, cpu_gate=0.0)
    out: list = [None] * world
    with trio.fail_after(BOUND):
        async with local_groups(world, dist.HashStore(), config=cfg, timeout=BOUND, prefix="plan") as groups:
            async def one(r: int) -> None:
                t0 = time.monotonic()
                try:
                    out[r] = (await fn(r, groups[r]), time.monotonic() - t0)
                except RankMismatch as exc:
                    out[r] = (exc, time.monotonic() - t0)

            async with trio.open_nursery() as n:
                for r in range(world):
                    n.start_soon(one, r)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_lossy_ring_hop_is_one_transport_call(world):
    calls = 2

    async def rank(r: int, g: Group):
        rec = g.endpoint = Recorder(g.endpoint)
        ring = RingAllReduce(g, "dgt:p=0.3")
        per_call, plans, outs = [], [], []
        for it in range(calls):
            rec.calls.clear()
            res = await ring.allreduce(_data(r, it), 0, SEGMENTS)
            per_call.append(list(rec.calls))
            plans.append(res.stats.plan)
            outs.append(res.tensor)
        return per_call, plans, outs

    res = trio.run(_every_rank, world, rank)
    for r in range(world):
        per_call, plans, outs = res[r][0]
        for it in range(calls):
            names = per_call[it]
            assert plans[it].schedule == "ring-lossy-streams", plans[it]
            assert names.count("lossy_hop") == world - 1, names  # one call per reduce-scatter hop
            assert not HOP_PLUMBING & set(names), names  # and none of the hop's plumbing
            assert names.count("exchange") == 1, names  # the all-gather: one stream exchange for the call
            assert names.count("reserve_exchange") == world, names  # the call's places, taken before its first await
            allowed = {"hop_ready", "reserve_exchange", "lossy_hop", "exchange", "enter_round"}
            allowed |= {"connect"} if it == 0 else set()  # the first call connects the neighbours (lazily)
            assert set(names) <= allowed, names
            # the all-gather is lossless: every rank ends with the same bits
            assert torch.equal(outs[it].view(torch.int32), res[0][0][2][it].view(torch.int32)), (r, it)


def test_two_ranks_on_different_plans_raise_rank_mismatch_on_every_rank():
    """Rank 0 plans a sparse all-gather, the others a dense one (the ring's ``sparse_gather`` differs): the plan
    code in the first hop's messages differs, and every rank fails at once with one reason."""
    world = 3

    async def rank(r: int, g: Group):
        ring = RingAllReduce(g, "dgt:p=0.3")
        ring.sparse_gather = r == 0
        return await ring.allreduce(_data(r, 0), 0, SEGMENTS)

    res = trio.run(_every_rank, world, rank)
    reasons = set()
    for r in range(world):
        exc, took = res[r]
        assert isinstance(exc, RankMismatch), (r, exc)
        assert took < 10, (r, took)  # not a timeout (peer_timeout 20 s)
        msg = str(exc)
        assert "different all-gather plans" in msg, (r, msg)
        reasons.add(msg.split("aborted: ")[-1])
    assert len(reasons) == 1, reasons


def test_a_rank_whose_plan_takes_the_round_path_meets_rank_mismatch_on_every_rank():
    """Rank 1 cannot reach its neighbours' hop sockets (its transport says so): its plan takes the round path,
    the others the lossy stream hops; the reason is the one a path disagreement always gives."""
    world = 3

    class NoHops(Recorder):
        def hop_ready(self, peer: int) -> bool:
            return False

    async def rank(r: int, g: Group):
        if r == 1:
            g.endpoint = NoHops(g.endpoint)
        return await RingAllReduce(g, "dgt:p=0.3").allreduce(_data(r, 0), 0, SEGMENTS)

    res = trio.run(_every_rank, world, rank)
    for r in range(world):
        exc, took = res[r]
        assert isinstance(exc, RankMismatch), (r, exc)
        assert took < 10, (r, took)
        assert "take different paths" in str(exc), (r, str(exc))
