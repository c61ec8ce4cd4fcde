"""Every sans-IO object belongs to one thread (docs/architecture.md, "Threads"; dgt.protocol.owner): the check
itself, and lossy ring hops (whose datagrams a worker thread sends and reads) run with it switched on."""

from __future__ import annotations

import threading

import pytest
import torch

from dgt.collectives.launch import run_ranks
from dgt.protocol import owner
from dgt.protocol.cpu_gate import CpuGate
from dgt.protocol.deadline import AdaptiveGrace, DeadlineState
from dgt.protocol.receiver import RoundReceiver

SEGMENTS = [3000, 5, 20000, 1500]
NUMEL = sum(SEGMENTS)


def _in_thread(fn):
    """``fn()`` in another thread; its exception (or None)."""
    out: list[BaseException | None] = [None]

    def run():
        try:
            fn()
        except BaseException as exc:
            out[0] = exc

    t = threading.Thread(target=run, name="not the owner")
    t.start()
    t.join()
    return out[0]


def test_a_call_from_another_thread_is_caught_and_recorded():
    gate = CpuGate()
    with owner.checking():
        gate.admit()  # this thread owns it from here
        err = _in_thread(lambda: gate.observe(0.5, 1.0))
        assert isinstance(err, owner.WrongThread) and "CpuGate.observe" in str(err) and "not the owner" in str(err)
        assert len(owner.violations) == 1
        gate.observe(0.5, 1.0)  # the owner still may
        recv = RoundReceiver(token=1)  # built here, but its first caller owns it (an endpoint built elsewhere)
        assert _in_thread(recv.open_rounds) is None
        with pytest.raises(owner.WrongThread, match="RoundReceiver.is_open"):
            recv.is_open((0, 0, 0))
    assert len(owner.violations) == 2
    assert owner.calls["CpuGate"] == 3 and owner.calls["RoundReceiver"] == 2


def test_nothing_is_wrapped_outside_the_check():
    before = CpuGate.observe
    with owner.checking():
        assert CpuGate.observe is not before
        with pytest.raises(RuntimeError):  # not twice at once
            with owner.checking():
                pass
    assert CpuGate.observe is before
    gate = CpuGate()
    gate.admit()
    assert _in_thread(lambda: gate.observe(0.0, 1.0)) is None  # unchecked: no owner recorded, nothing raised
    assert owner.ATTR not in vars(gate)


def test_a_frozen_policy_belongs_to_the_thread_that_uses_it():
    policy = AdaptiveGrace()
    st = DeadlineState(1.0, None, None, 3)
    with owner.checking():
        policy.observe(0.01, True)  # the receiver's thread owns the policy
        twin = policy.frozen()
        assert _in_thread(lambda: twin.deadline(st)) is None  # the copy is the worker's
        assert isinstance(_in_thread(lambda: policy.deadline(st)), owner.WrongThread)  # the original is not
        policy.observe(0.02, True)
        assert twin.seen == 1 and policy.seen == 2  # the copy learns nothing later
    assert len(owner.violations) == 1


def _ring(rank, world, calls):
    """``calls`` DGT ring all-reduces of lossy ring hops with the owner check on; every hop's thread reads as never
    waiting for a CPU (so the gate stays open and is fed a reading per hop)."""
    import time

    import trio

    import dgt.channels.hop_datagrams as hdm
    from dgt.collectives import Group, RingAllReduce
    from dgt.transport import TransportConfig

    hdm.runqueue_seconds = lambda: 0.0 * time.perf_counter()

    async def main():
        async with Group.open(rank, world, config=TransportConfig(), timeout=30) as g:
            ring = RingAllReduce(g, "dgt:p=0.3")
            for k in range(calls):
                x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * k + rank))
                res = await ring.allreduce(x, 0, SEGMENTS)
                assert torch.isfinite(res.tensor).all()
            ep = g.endpoint
            return {"hop_tx": ep.streams.hop.counters.tx_datagrams, "hop_rx": ep.streams.hop.counters.rx_datagrams,
                    "readings": ep.cpu_gate.readings, "closed": sum(ep.stats().closed_by.values())}

    with owner.checking():
        out = trio.run(main)
        return {**out, "violations": list(owner.violations), "calls": dict(owner.calls)}


def test_lossy_ring_hops_keep_every_sans_io_object_on_its_thread():
    """The hop's worker thread sends and reads datagrams and decides its round's deadline, while the trio thread
    plans, lands and closes the rounds and feeds the CPU gate: no object is called from two threads."""
    world, calls = 3, 3
    res = run_ranks(_ring, world, calls, timeout=120)
    for r in range(world):
        info = res[r]
        assert info["violations"] == [], info["violations"]
        assert info["closed"] == (world - 1) * calls  # every reduce-scatter hop's round landed and closed
        # the gate was fed the hops' readings on the trio thread (one per reduce-scatter hop, those long enough)
        assert 0 < info["readings"] <= (world - 1) * calls
        for cls in ("RoundReceiver", "RoundSender", "CpuGate", "AdaptiveGrace"):
            assert info["calls"].get(cls, 0) > 0, (cls, info["calls"])  # checked, not just never reached
    assert sum(res[r]["hop_tx"] for r in range(world)) > 0  # the worker threads did send datagrams
    assert sum(res[r]["hop_rx"] for r in range(world)) > 0


def test_the_worker_reads_the_transport_stats_on_its_trio_thread():
    """DGTState.transport_stats (the training thread) reads the endpoint's counters through the worker's trio
    thread, which owns them; before the group connected there are none."""
    from dgt.collectives.worker import TrioWorker

    seen = []

    class Endpoint:
        def stats(self):
            seen.append(threading.current_thread())
            return "stats"

    class Group:
        endpoint = Endpoint()

        async def aclose(self):
            pass

    async def connect(nursery):
        return Group()

    w = TrioWorker(connect, name="owner-test")
    assert w.transport_stats() is None  # not started: no group
    try:
        w.run(lambda g: _noop(), timeout=10)  # the group is connected once a job ran
        assert w.transport_stats() == "stats"
        assert seen[-1].name == "owner-test" and seen[-1] is not threading.current_thread()
        assert w.run(lambda g: _stats_inside(w), timeout=10) == "stats"  # from the trio thread itself: directly
        assert seen[-1].name == "owner-test"
    finally:
        w.close()
    assert w.transport_stats() == "stats" and seen[-1] is threading.current_thread()  # the thread is gone


async def _noop():
    return None


async def _stats_inside(w):
    return w.transport_stats()
