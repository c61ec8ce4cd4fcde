"""The background trio thread behind the blocking collectives, the DDP hook and the backend.

DDP calls communication hooks on its autograd threads and expects a ``torch.futures.Future`` back at once; the DGT
transport is trio code. A :class:`TrioWorker` owns one :class:`~dgt.transport.bridge.TrioThread`: it connects the
:class:`~dgt.collectives.Group` (rendezvous included) inside that thread, then runs submitted jobs one at a time in
submission order, so every rank issues its collectives in the same order. ``submit`` never waits for I/O: it hands
the job over with the bridge's ``soon`` (``TrioToken.run_sync_soon``, a thread-safe, non-blocking wake-up) and
returns the future that the trio thread completes with ``set_result`` or ``set_exception``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dgt.errors import DgtError, root_cause

if TYPE_CHECKING:  # imported when the thread starts: the shim imports this module where only codecs are needed
    import trio

    from dgt.transport.bridge import TrioThread

Connect = Callable[..., Awaitable[Any]]
"""Async factory of the group the jobs run on, called as ``connect(nursery=...)`` with the nursery its endpoint's
service tasks run in (``Group.create`` bound to its other arguments)."""
Job = Callable[[Any], Awaitable[Any]]
"""An async function of the group; its return value becomes the future's result."""


class WorkerClosed(DgtError):
    """A job was submitted to, or still queued in, a worker that has been closed."""


class TrioWorker:
    """One trio thread (a :class:`~dgt.transport.bridge.TrioThread`), one group, one sequential job queue.

    The thread starts on the first ``submit`` (or ``start``). If connecting the group or any job fails, the worker
    is broken: that job's future and every later one fail with the same error, since a collective that failed on
    one rank has left its peers mid-round and further rounds could not line up.
    """

    def __init__(self, connect: Connect, name: str = "dgt-worker") -> None:
        self._connect = connect
        self._name = name
        self._lock = threading.Lock()
        self._bridge: TrioThread[None] | None = None
        self._send: Any = None
        self._closed = False
        self._error: BaseException | None = None
        self.group: Any = None
        self.jobs_done = 0

    # -- life cycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread (idempotent); returns once trio runs, without waiting for the group to connect."""
        with self._lock:
            if self._closed:
                raise WorkerClosed(f"{self._name} is closed")
            if self._bridge is not None:
                return
            from dgt.transport.bridge import TrioThread

            self._bridge = TrioThread(self._name, closed=WorkerClosed)
            try:
                self._bridge.start(self._open)
            except BaseException as exc:  # trio.run failed before the job loop could start
                self._error = self._error or exc
                raise WorkerClosed(f"{self._name} failed to start: {exc!r}") from exc

    @property
    def running(self) -> bool:
        return self._bridge is not None and self._bridge.running

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, let queued ones finish, close the group and join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bridge = self._bridge
        if bridge is None:
            return
        try:
            bridge.soon(self._send.close)  # the job loop drains the queue, closes the group and ends the run
        except Exception:  # trio already finished (it failed): nothing to wake
            pass
        bridge.join(timeout)

    def transport_stats(self) -> Any:
        """The group's transport counters (``Endpoint.stats()``, a ``TransportStats``), read on the worker's trio
        thread, which owns them: a snapshot between two of its steps, never a round half counted (docs/architecture.md,
        Threads). None before the group connected; once the thread has ended (nothing counts any more), read here."""
        group, bridge = self.group, self._bridge
        if group is None:
            return None
        if bridge is not None and bridge.running and not bridge.in_thread:
            import trio

            try:
                return bridge.call_sync(group.endpoint.stats)
            except trio.RunFinishedError:  # it ended meanwhile
                pass
        return group.endpoint.stats()

    # -- jobs -------------------------------------------------------------------------------------------------
    def submit(self, job: Job, devices: Sequence[torch.device] | None = None) -> torch.futures.Future:
        """Queue ``job`` and return its future at once. ``devices``: the CUDA devices of the result tensors, so the
        future records and waits CUDA events for them (the consumer's stream waits, the CPU does not)."""
        fut: torch.futures.Future = torch.futures.Future(devices=list(devices)) if devices else torch.futures.Future()
        if self._closed:
            fut.set_exception(WorkerClosed(f"{self._name} is closed"))
            return fut
        if self._error is not None:
            fut.set_exception(self._error)
            return fut
        self.start()
        assert self._bridge is not None
        try:
            self._bridge.soon(self._enqueue, job, fut)
        except Exception as exc:  # trio.RunFinishedError: the thread has ended
            fut.set_exception(self._error or self._bridge.error
                              or WorkerClosed(f"{self._name} is no longer running ({exc!r})"))
        return fut

    def run(self, job: Job, timeout: float | None = None) -> Any:
        """Submit and wait (for setup and tests; never on an autograd thread)."""
        fut = self.submit(job)
        if timeout is None:
            return fut.wait()
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        if not done.wait(timeout):
            raise TimeoutError(f"{self._name}: job did not finish within {timeout} s")
        return fut.wait()

    # -- the trio side ----------------------------------------------------------------------------------------
    def _enqueue(self, job: Job, fut: torch.futures.Future) -> None:
        try:
            self._send.send_nowait((job, fut))
        except Exception:  # the channel is closed: the worker is shutting down or broke
            fut.set_exception(self._error or WorkerClosed(f"{self._name} is closed"))

    async def _open(self, nursery: trio.Nursery) -> None:
        """The bridge's setup: the job queue, and the loop that connects the group and then runs the jobs."""
        import trio

        send, recv = trio.open_memory_channel(math.inf)
        self._send = send
        nursery.start_soon(self._loop, recv, nursery)

    async def _loop(self, recv: Any, nursery: trio.Nursery) -> None:
        import trio

        try:
            async with recv:
                try:
                    self.group = await self._connect(nursery=nursery)
                except BaseException as exc:
                    self._error = root_cause(exc)
                async for job, fut in recv:
                    if self._error is not None:
                        _fail(fut, self._error)
                        continue
                    try:
                        result = await job(self.group)
                    except BaseException as exc:
                        self._error = root_cause(exc)
                        _fail(fut, exc)
                        if not isinstance(exc, Exception):
                            raise
                        continue
                    self.jobs_done += 1
                    fut.set_result(result)
        finally:
            if self.group is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await self.group.aclose()
            assert self._bridge is not None
            self._bridge.finish()


def for_cpp(fut: torch.futures.Future) -> torch.futures.Future:
    """The future to hand to C++ consumers (DDP's reducer, c10d ``Work``).

    ``torch.futures.Future.set_exception`` stores the exception as the *value* plus a Python unwrap function, so C++
    sees a value it cannot cast ("Unable to cast ... to Tensor"). A ``then`` callback that re-raises turns it into
    a real error of the child future, which DDP reports with the exception's type and message.
    """
    return fut.then(_unwrap)


def _unwrap(fut: torch.futures.Future) -> Any:
    return fut.wait()


def _fail(fut: torch.futures.Future, exc: BaseException) -> None:
    if fut.done():
        return
    exc = root_cause(exc)
    if not isinstance(exc, Exception):
        exc = WorkerClosed(f"worker stopped: {exc!r}")
    fut.set_exception(exc)
