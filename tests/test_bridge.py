"""The one thread <-> trio bridge (dgt.transport.bridge.TrioThread) that the blocking endpoint, the collective worker
and LGC's TransportComm run on (issue #24)."""

from __future__ import annotations

import threading

import pytest
import trio

from dgt.errors import PeerClosed
from dgt.transport.bridge import TrioThread


def test_setup_value_calls_from_other_threads_and_teardown():
    torn: list[str] = []

    async def setup(nursery: trio.Nursery) -> str:
        assert isinstance(nursery, trio.Nursery)
        return "resource"

    async def teardown(value: str) -> None:
        await trio.sleep(0)
        torn.append(value)

    b: TrioThread[str] = TrioThread("t-bridge", closed=PeerClosed)
    assert b.start(setup, teardown, timeout=10) == "resource"
    assert b.running and not b.in_thread

    async def add(x: int, y: int) -> int:
        await trio.sleep(0)
        return x + y

    assert b.call(add, 2, 3) == 5
    assert b.call_sync(lambda: threading.current_thread().name) == "t-bridge"
    assert b.spawn(add, 4, y=5).result(10) == 9
    seen = threading.Event()
    b.soon(seen.set)
    assert seen.wait(10)

    async def boom() -> None:
        raise ValueError("in the task")

    with pytest.raises(ValueError, match="in the task"):
        b.call(boom)
    with pytest.raises(ValueError, match="in the task"):
        b.spawn(boom).result(10)

    slow = b.spawn(trio.sleep_forever)  # still running when the run ends: its future fails with the closed error
    b.stop(10)
    assert torn == ["resource"] and not b.running
    with pytest.raises(PeerClosed, match="closed before"):
        slow.result(10)
    with pytest.raises(PeerClosed):
        b.spawn(add, 1, 1).result(10)
    with pytest.raises(trio.RunFinishedError):
        b.call(add, 1, 1)
    b.stop(10)  # idempotent


def test_a_failed_setup_is_raised_by_start_and_kept():
    async def setup(nursery: trio.Nursery) -> None:
        raise ConnectionRefusedError("rendezvous failed")

    b: TrioThread[None] = TrioThread("t-fail")
    with pytest.raises(ConnectionRefusedError, match="rendezvous failed"):
        b.start(setup, timeout=10)
    b.join(10)
    assert not b.running and isinstance(b.error, ConnectionRefusedError)


def test_blocking_endpoint_runs_its_service_in_the_bridge_nursery():
    """No hidden system task: the endpoint's service tasks are children of the bridge's nursery."""
    from dgt.transport import BlockingEndpoint, Timeouts, TransportConfig

    with BlockingEndpoint.open(0, 7, TransportConfig(timeouts=Timeouts(peer=5))) as ep:
        bridge = ep._bridge
        names = bridge.call_sync(lambda: [t.name for t in bridge._nursery.child_tasks])
        assert any(n.endswith("Endpoint._service") for n in names), names
        system = bridge.call_sync(lambda: [t.name for t in trio.lowlevel.current_root_task().child_nurseries[0]
                                           .child_tasks])
        assert not any("_service" in n for n in system), system
        with pytest.raises(RuntimeError, match="block"):
            bridge.call_sync(lambda: ep.submit(trio.sleep, 0))  # from the endpoint's own thread it would deadlock
    assert not bridge.running
