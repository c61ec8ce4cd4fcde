"""An endpoint's service runs in a nursery its caller owns (issue #24): ``async with Endpoint.open(...)`` (or
``Group.open``) brings one, ``Endpoint.start(nursery=...)`` uses the caller's. Leaving the block leaves no task and no
socket behind; an error in the service reaches the caller."""

import pytest
import torch.distributed as dist
import trio

from dgt.collectives import Group
from dgt.errors import open_nursery
from dgt.harness.endpoints import connected_pair
from dgt.transport import Endpoint, PeerClosed, Timeouts, TransportConfig

TOKEN = 0x24_0024


def _tasks() -> set:
    """Every task of this run, system tasks included (they hang off the root task's nurseries too)."""

    def walk(task):
        yield task
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                yield from walk(child)

    return set(walk(trio.lowlevel.current_root_task()))


def _service_tasks(tasks: set) -> list[str]:
    return sorted(t.name for t in tasks if "_service" in t.name or "_guard" in t.name or "dgt-endpoint" in t.name)


async def test_leaving_the_block_ends_every_service_task_and_closes_the_sockets():
    before = _tasks()
    async with connected_pair(TOKEN) as (a, b):
        inside = _tasks()
        assert len(_service_tasks(inside - before)) >= 2 * 6, inside - before  # service + accept, udp, timers...
        assert not [t for t in inside if "dgt-endpoint" in t.name]  # no hidden system task
        assert a.peers == [1] and b.peers == [0]
    assert _tasks() == before
    for ep in (a, b):
        assert ep.sockets.listener.sock.fileno() == -1 and all(ch.closed for ch in ep.sockets.udp.values())


async def test_a_group_opened_with_a_block_leaves_nothing_behind():
    before = _tasks()
    async with Group.open(0, 1, store=dist.HashStore(), timeout=10) as g:
        assert _service_tasks(_tasks() - before)
        assert g.endpoint.address.tcp_port > 0
    assert _tasks() == before


class _Broken(Endpoint):
    """An endpoint whose liveness monitor fails once ``trip`` is set: a service task's unexpected error."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trip = trio.Event()
        self.links.liveness = self._broken_liveness  # the links part's service task, replaced on this instance

    async def _broken_liveness(self) -> None:
        await self.trip.wait()
        raise RuntimeError("liveness monitor broke")


async def test_an_error_in_the_service_cancels_the_block_and_is_raised_from_it():
    before = _tasks()
    t0 = trio.current_time()
    with pytest.raises(RuntimeError, match="liveness monitor broke"):
        async with _Broken.open(0, TOKEN, TransportConfig(timeouts=Timeouts(peer=5))) as ep:
            ep.trip.set()
            await trio.sleep(30)  # cancelled by the service's error, not slept out
    assert trio.current_time() - t0 < 10
    assert ep.sockets.listener.sock.fileno() == -1
    assert _tasks() == before


async def test_in_a_callers_nursery_an_error_in_the_service_fails_pending_operations_and_reaches_the_owner():
    cfg = TransportConfig(timeouts=Timeouts(peer=5))
    got = []

    async def pending(ep):
        try:
            await ep.recv_round(0, 5, 0, timeout=30)  # a round the peer never sends
        except Exception as exc:
            got.append(exc)

    async with Endpoint.open(0, TOKEN, cfg) as a:
        t0 = trio.current_time()
        with pytest.raises(RuntimeError, match="liveness monitor broke"):
            # the caller's nursery opened with dgt.errors.open_nursery: the error itself on every trio (a plain
            # trio >= 0.25 nursery delivers it inside an exception group, as it does any task's error)
            async with open_nursery() as nursery:
                b = await _Broken.start(1, TOKEN, cfg, nursery=nursery)
                async with trio.open_nursery() as n:
                    n.start_soon(a.connect, {1: b.address})
                    n.start_soon(b.connect, {0: a.address})
                nursery.start_soon(pending, b)
                await trio.sleep(0.2)
                assert not got
                b.trip.set()
                await trio.sleep(30)  # cancelled: the nursery's owner gets the error
        assert trio.current_time() - t0 < 10
        # the wait failed at once, not at its timeout (the links end as the service does: PeerClosed)
        assert len(got) == 1 and isinstance(got[0], (PeerClosed, RuntimeError)), got
        assert b.sockets.listener.sock.fileno() == -1


async def test_awaiting_open_the_old_way_says_how_to_open_an_endpoint_now():
    with pytest.raises(TypeError, match="async with Endpoint.open"):
        await Endpoint.open(0, TOKEN, TransportConfig(timeouts=Timeouts(peer=5)))


async def test_an_endpoint_started_in_a_callers_nursery_closes_with_async_with():
    before = _tasks()
    async with trio.open_nursery() as nursery:
        async with await Endpoint.start(0, TOKEN, TransportConfig(timeouts=Timeouts(peer=5)), nursery=nursery) as ep:
            assert ep.address.tcp_port > 0
        assert ep.sockets.listener.sock.fileno() == -1
    assert _tasks() == before
