"""A synchronous face for an endpoint: trio runs in a background thread, callers block on results or take a
``concurrent.futures.Future`` (the DDP hook completes a torch Future from it without blocking autograd)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch
import trio

from dgt.errors import PeerClosed
from dgt.layout import BucketLayout
from dgt.transport.config import PeerAddress, TransportConfig
from dgt.transport.endpoint import Endpoint
from dgt.transport.stats import RoundResult, SendStats, TransportStats


class BlockingEndpoint:
    """The :class:`Endpoint` API, blocking. Every method is safe from any thread except the endpoint's own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint: Endpoint | None = None  # the async endpoint, for coroutines passed to submit()

    @classmethod
    def open(
        cls,
        rank: int,
        token: int,
        cfg: TransportConfig | None = None,
        host: str = "127.0.0.1",
        *,
        timeout: float = 30.0,
    ) -> BlockingEndpoint:
        """Start the trio thread and open the endpoint in it."""
        self = cls()
        self._thread = threading.Thread(
            target=trio.run, args=(self._main, rank, token, cfg, host), name=f"dgt-endpoint-{rank}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the endpoint thread did not start")
        if self._error is not None:
            raise self._error
        return self

    async def _main(self, rank, token, cfg, host) -> None:
        try:
            self._stop = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as n:
                self._nursery = n
                self.endpoint = await Endpoint.open(rank, token, cfg, host, nursery=n)
                self._ready.set()
                await self._stop.wait()
                await self.endpoint.aclose()
                n.cancel_scope.cancel()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()

    # -- generic
    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Run ``fn(*args, **kwargs)`` (an async function, e.g. ``self.endpoint.recv_round``) on the endpoint's
        thread; returns at once with a Future for its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            raise RuntimeError("BlockingEndpoint methods block: call them from another thread, or await the async "
                               "endpoint (self.endpoint) directly on this one")  # fmt: skip
        if self._token is None or self._nursery is None:
            fut.set_exception(PeerClosed("the endpoint is not running"))
            return fut
        try:
            trio.from_thread.run_sync(self._nursery.start_soon, self._run, fut, functools.partial(fn, *args, **kwargs),
                                      trio_token=self._token)  # fmt: skip
        except (trio.RunFinishedError, RuntimeError) as exc:
            fut.set_exception(PeerClosed(f"the endpoint is not running ({exc})"))
        return fut

    @staticmethod
    async def _run(fut: concurrent.futures.Future, call: Callable[[], Awaitable[Any]]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = await call()
        except trio.Cancelled:
            fut.set_exception(PeerClosed("the endpoint closed before the operation finished"))
            raise
        except BaseException as exc:  # the caller's thread re-raises it from Future.result()
            fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            fut.set_result(result)

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """``submit(...).result(timeout)``."""
        return self.submit(fn, *args, **kwargs).result(timeout)

    # -- the endpoint API
    @property
    def address(self) -> PeerAddress:
        return self.endpoint.address

    @property
    def rank(self) -> int:
        return self.endpoint.rank

    def connect(self, peers: Mapping[int, PeerAddress | dict], timeout: float | None = None) -> None:
        self.call(self.endpoint.connect, peers, timeout)

    def send_round(
        self,
        peer: int,
        bucket: int,
        round: int,
        flat: torch.Tensor,
        layout: BucketLayout | None = None,
        cls: torch.Tensor | int = 0,
        order: torch.Tensor | None = None,
        **kw: Any,
    ) -> SendStats:
        return self.call(self.endpoint.send_round, peer, bucket, round, flat, layout, cls, order, **kw)

    def recv_round(self, peer: int, bucket: int, round: int, **kw: Any) -> RoundResult:
        return self.call(self.endpoint.recv_round, peer, bucket, round, **kw)

    def send_bytes(self, peer: int, data: bytes, tag: int = 0) -> None:
        self.call(self.endpoint.send_bytes, peer, data, tag)

    def recv_bytes(self, peer: int, tag: int = 0, timeout: float | None = None) -> bytes:
        return self.call(self.endpoint.recv_bytes, peer, tag, timeout)

    def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        self.call(self.endpoint.send_tensor, peer, tensor, tag)

    def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        return self.call(self.endpoint.recv_tensor, peer, tag, timeout)

    def stats(self) -> TransportStats:
        return trio.from_thread.run_sync(self.endpoint.stats, trio_token=self._token)

    def socket_info(self) -> dict:
        return trio.from_thread.run_sync(self.endpoint.socket_info, trio_token=self._token)

    def close(self, timeout: float = 10.0) -> None:
        """Close the endpoint (goodbye to peers) and join the thread."""
        if self._thread is None:
            return
        if self._stop is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> BlockingEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
