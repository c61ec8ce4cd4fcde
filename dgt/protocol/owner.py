"""One owner thread per sans-IO object, and a check of it that the tests switch on (docs/architecture.md, "Threads").

The sans-IO classes take no locks: each instance belongs to one thread, the one that first calls into it (the trio
thread of the endpoint that built it), and another thread hands it values instead (a worker's measurement comes back
in the worker's result and the owner feeds it in; a worker that needs a policy gets its own copy,
:meth:`dgt.protocol.deadline.DeadlinePolicy.frozen`).

The classes marked :func:`owned` are checked only while :func:`checking` is on: it wraps their methods with one that
records the first calling thread in the instance and fails (:class:`WrongThread`, also kept in :data:`violations`,
in case the caller swallows it) when another thread calls in. Off (always, outside tests), the classes are untouched:
nothing on the hot path pays for it.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T", bound=type)

ATTR = "_dgt_owner_thread"
"""The instance attribute that holds (thread id, thread name) of its owner while checking."""

_classes: list[type] = []
_saved: dict[tuple[type, str], Any] = {}
_lock = threading.Lock()
violations: list[str] = []
"""Every wrong-thread call seen while checking (cleared when checking starts)."""
calls: Counter[str] = Counter()
"""Checked calls per class name while checking (so a test can see that the objects were exercised at all)."""


class WrongThread(AssertionError):
    """A thread called into a sans-IO object that another thread owns."""


def owned(cls: T) -> T:
    """Class decorator: instances of ``cls`` belong to one thread (checked while :func:`checking`)."""
    _classes.append(cls)
    return cls


def release(obj: object) -> None:
    """Forget ``obj``'s owner (a fresh copy made for another thread: whoever uses it first owns it)."""
    vars(obj).pop(ATTR, None)


def _check(obj: object, name: str) -> None:
    me = threading.current_thread()
    owner = vars(obj).setdefault(ATTR, (me.ident, me.name))
    with _lock:
        calls[type(obj).__name__] += 1
    if owner[0] != me.ident:
        msg = (f"{type(obj).__name__}.{name} called in thread {me.name!r}; the object belongs to thread "
               f"{owner[1]!r} (docs/architecture.md, Threads)")
        with _lock:
            violations.append(msg)
        raise WrongThread(msg)


def _wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def checked(self: object, *args: Any, **kwargs: Any) -> Any:
        _check(self, name)
        return fn(self, *args, **kwargs)

    return checked


def _enable() -> None:
    for cls in _classes:
        for name, fn in list(vars(cls).items()):
            if inspect.isfunction(fn) and not (name.startswith("__") and name.endswith("__")):
                _saved[(cls, name)] = fn
                setattr(cls, name, _wrap(fn, name))


def _disable() -> None:
    for (cls, name), fn in _saved.items():
        setattr(cls, name, fn)
    _saved.clear()


@contextmanager
def checking() -> Iterator[None]:
    """Check the owner thread of every :func:`owned` object while the block runs (tests only: the methods are
    wrapped in place, for every thread of the process)."""
    if _saved:
        raise RuntimeError("owner checks are already on")
    violations.clear()
    calls.clear()
    _enable()
    try:
        yield
    finally:
        _disable()
