"""The background trio thread behind the blocking collectives, the DDP hook and the backend.

DDP calls communication hooks on its autograd threads and expects a ``torch.futures.Future`` back at once; the DGT
transport is trio code. A :class:`TrioWorker` owns one daemon thread running ``trio.run``: it connects the
:class:`~dgt.collectives.Group` (rendezvous included) inside that thread, then runs submitted jobs one at a time in
submission order, so every rank issues its collectives in the same order. ``submit`` never waits for I/O: it hands
the job over with ``TrioToken.run_sync_soon`` (a thread-safe, non-blocking wake-up) and returns the future that the
trio thread completes with ``set_result`` or ``set_exception``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from dgt.errors import DgtError, root_cause

Connect = Callable[[], Awaitable[Any]]
"""Async factory of the group the jobs run on (``Group.create(...)`` bound to its arguments)."""
Job = Callable[[Any], Awaitable[Any]]
"""An async function of the group; its return value becomes the future's result."""


class WorkerClosed(DgtError):
    """A job was submitted to, or still queued in, a worker that has been closed."""


class TrioWorker:
    """One trio thread, one group, one sequential job queue.

    The thread starts on the first ``submit`` (or ``start``). If connecting the group or any job fails, the worker
    is broken: that job's future and every later one fail with the same error, since a collective that failed on
    one rank has left its peers mid-round and further rounds could not line up.
    """

    def __init__(self, connect: Connect, name: str = "dgt-worker") -> None:
        self._connect = connect
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: Any = None
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
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._token is None:  # trio.run failed before it could hand out its token
            raise WorkerClosed(f"{self._name} failed to start: {self._error!r}")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, let queued ones finish, close the group and join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        try:
            self._token.run_sync_soon(self._send.close)
        except Exception:  # trio already finished (it failed): nothing to wake
            pass
        thread.join(timeout)

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
        try:
            self._token.run_sync_soon(self._enqueue, job, fut)
        except Exception as exc:  # trio.RunFinishedError: the thread has ended
            fut.set_exception(self._error or WorkerClosed(f"{self._name} is no longer running ({exc!r})"))
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

    def _run(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as exc:  # keep the thread quiet; the error travels in the futures
            self._error = self._error or exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        import trio

        send, recv = trio.open_memory_channel(math.inf)
        self._send = send
        self._token = trio.lowlevel.current_trio_token()
        self._ready.set()
        try:
            async with recv:
                try:
                    self.group = await self._connect()
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
