"""The one bridge between plain threads and the trio transport (issue #24).

Whatever drives the transport from synchronous code (the blocking endpoint, the blocking collectives and the DDP
hook's worker, LGC's Comm) owns one :class:`TrioThread`: a daemon thread running ``trio.run`` around one nursery.
:meth:`TrioThread.start` runs a setup coroutine in that thread with the nursery (an endpoint's or a group's service
tasks live there, not in a hidden system task) and returns its result; the run then lasts until :meth:`stop` (or
:meth:`finish` from inside), which runs the teardown and cancels what is left. Other threads reach the run four ways:

- :meth:`call` / :meth:`call_sync`: run an async / sync function in the trio thread and block for its result;
- :meth:`spawn`: start an async function as a task of the nursery, return a ``concurrent.futures.Future`` at once;
- :meth:`soon`: queue a sync function with ``TrioToken.run_sync_soon`` (never blocks, safe from any thread: the
  DDP hook hands jobs over this way from autograd threads).

What goes wrong in the thread is kept in :attr:`error` (and raised by :meth:`start` if setup failed), never printed
by the thread: each owner reports it through its own futures or calls.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio

from dgt.errors import open_nursery

T = TypeVar("T")
R = TypeVar("R")


class TrioThread(Generic[T]):
    """One daemon thread running trio; ``closed(message)`` builds the error that calls get once it has ended (the
    owner's own kind: ``PeerClosed`` for an endpoint, ``WorkerClosed`` for a collective worker)."""

    def __init__(self, name: str, closed: Callable[[str], BaseException] = RuntimeError) -> None:
        self.name = name
        self._closed = closed
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self.value: T | None = None  # what setup returned
        self.error: BaseException | None = None

    # -- life cycle ---------------------------------------------------------------------------------------------
    def start(self, setup: Callable[[trio.Nursery], Awaitable[T]],
              teardown: Callable[[T], Awaitable[None]] | None = None, timeout: float | None = None) -> T:
        """Start the thread, run ``setup(nursery)`` in it and return its result (or raise its error). At the end
        of the run (:meth:`stop`), ``teardown(result)`` runs before the nursery is cancelled."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was started already")
        self._thread = threading.Thread(target=self._run, args=(setup, teardown), name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name}: the trio thread did not start within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]  # set by setup when no error was

    def _run(self, setup: Callable[[trio.Nursery], Awaitable[T]],
             teardown: Callable[[T], Awaitable[None]] | None) -> None:
        try:
            trio.run(self._main, setup, teardown)
        except BaseException as exc:  # keep the thread quiet: the owner reports it (futures, start, calls)
            self.error = self.error or exc
        finally:
            self._ready.set()

    async def _main(self, setup: Callable[[trio.Nursery], Awaitable[T]],
                    teardown: Callable[[T], Awaitable[None]] | None) -> None:
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        async with open_nursery() as n:
            self._nursery = n
            try:
                value = self.value = await setup(n)
            except BaseException as exc:
                self.error = exc
                raise
            self._ready.set()
            await self._stop.wait()
            if teardown is not None:
                await teardown(value)
            n.cancel_scope.cancel()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_thread(self) -> bool:
        """Whether the caller is this bridge's own trio thread (where blocking on it would deadlock)."""
        return threading.current_thread() is self._thread

    def finish(self) -> None:
        """From inside the run: end it (teardown, then the nursery is cancelled)."""
        if self._stop is not None:
            self._stop.set()

    def stop(self, timeout: float | None = 10.0) -> None:
        """From another thread: end the run (teardown, then the nursery is cancelled) and join the thread."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive() and self._token is not None:
            try:
                trio.from_thread.run_sync(self.finish, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # -- reaching the run from other threads ---------------------------------------------------------------------
    def call(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """Run ``fn(*args)`` in the trio thread and block for its result (its error is raised here)."""
        return trio.from_thread.run(fn, *args, trio_token=self._live_token())  # type: ignore[no-any-return]

    def call_sync(self, fn: Callable[..., R], *args: Any) -> R:
        """Run the sync ``fn(*args)`` in the trio thread and block for its result."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._live_token())  # type: ignore[no-any-return]

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue the sync ``fn(*args)`` in the trio thread without waiting (``trio.RunFinishedError`` if the run has
        ended)."""
        self._live_token().run_sync_soon(fn, *args)

    def spawn(self, fn: Callable[..., Awaitable[R]], *args: Any, **kwargs: Any) -> concurrent.futures.Future[R]:
        """Start ``fn(*args, **kwargs)`` as a task of the nursery; returns at once with a Future of its result. A
        run that has ended, or one that ends before the task does, fails the Future with the ``closed`` error."""
        fut: concurrent.futures.Future[R] = concurrent.futures.Future()
        if self._token is None or self._nursery is None:
            fut.set_exception(self._closed(f"{self.name} is not running"))
            return fut
        call = functools.partial(fn, *args, **kwargs)
        try:
            trio.from_thread.run_sync(self._nursery.start_soon, self._complete, fut, call, trio_token=self._token)
        except (trio.RunFinishedError, RuntimeError) as exc:
            fut.set_exception(self._closed(f"{self.name} is not running ({exc})"))
        return fut

    async def _complete(self, fut: concurrent.futures.Future[R], call: Callable[[], Awaitable[R]]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = await call()
        except trio.Cancelled:
            fut.set_exception(self._closed(f"{self.name} closed before the operation finished"))
            raise
        except BaseException as exc:  # the caller's thread re-raises it from Future.result()
            fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            fut.set_result(result)

    def _live_token(self) -> trio.lowlevel.TrioToken:
        if self._token is None:
            raise trio.RunFinishedError(f"{self.name} has not started")
        return self._token
