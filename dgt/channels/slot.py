"""A one-shot result that tasks can wait on: set once with a value or an exception (a trio Event plus payload).

The channel writers complete one per queued send (:mod:`dgt.channels.tcp_writer`, :mod:`dgt.channels.udp_scheduler`)
and the transport hands them to whoever waits on a round or a peer."""

from __future__ import annotations

from typing import Any

import trio


class Slot:
    """Completed by :meth:`set` or :meth:`fail`; later completions are ignored, so racing paths need no checks."""

    __slots__ = ("_event", "_value", "_error")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._event.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def peek(self) -> Any:
        """The value once set (None before, or after a failure), without waiting."""
        return self._value if self._event.is_set() and self._error is None else None

    def set(self, value: Any = None) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self) -> Any:
        """The value (or the error, raised). A slot already complete answers without a trip through the scheduler:
        callers await slots that are usually done by then (a send queued before a receive)."""
        if not self._event.is_set():
            await self._event.wait()
        if self._error is not None:
            raise self._error.with_traceback(None)  # shared by every waiter: do not pile up their tracebacks
        return self._value
