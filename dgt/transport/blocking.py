"""A synchronous face for an endpoint: trio runs in a background thread, callers block on results or take a
``concurrent.futures.Future`` (the DDP hook completes a torch Future from it without blocking autograd)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import torch
import trio

from dgt.errors import PeerClosed
from dgt.transport.bridge import TrioThread
from dgt.transport.config import PeerAddress, TransportConfig
from dgt.transport.endpoint import Endpoint
from dgt.transport.stats import RoundResult, SendStats, TransportStats

R = TypeVar("R")


class BlockingEndpoint:
    """The :class:`Endpoint` API, blocking. Every method is safe from any thread except the endpoint's own (the
    :class:`~dgt.transport.bridge.TrioThread` it runs in)."""

    def __init__(self, bridge: TrioThread[Endpoint], endpoint: Endpoint) -> None:
        self._bridge = bridge
        self.endpoint = endpoint  # the async endpoint, for coroutines passed to submit()

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
        """Start the trio thread and open the endpoint in it (its service tasks in the thread's nursery)."""
        bridge: TrioThread[Endpoint] = TrioThread(f"dgt-endpoint-{rank}", closed=PeerClosed)

        async def setup(nursery: trio.Nursery) -> Endpoint:
            return await Endpoint.start(rank, token, cfg, host, nursery=nursery)

        return cls(bridge, bridge.start(setup, teardown=Endpoint.aclose, timeout=timeout))

    # -- generic
    def submit(self, fn: Callable[..., Awaitable[R]], *args: Any, **kwargs: Any) -> concurrent.futures.Future[R]:
        """Run ``fn(*args, **kwargs)`` (an async function, e.g. ``self.endpoint.recv_round``) on the endpoint's
        thread; returns at once with a Future for its result."""
        if self._bridge.in_thread:
            raise RuntimeError("BlockingEndpoint methods block: call them from another thread, or await the async "
                               "endpoint (self.endpoint) directly on this one")  # fmt: skip
        return self._bridge.spawn(fn, *args, **kwargs)

    def call(self, fn: Callable[..., Awaitable[R]], *args: Any, timeout: float | None = None, **kwargs: Any) -> R:
        """``submit(...).result(timeout)``."""
        return self.submit(fn, *args, **kwargs).result(timeout)

    # -- the endpoint API
    @property
    def address(self) -> PeerAddress:
        return self.endpoint.address

    @property
    def rank(self) -> int:
        return self.endpoint.rank

    def connect(self, peers: Mapping[int, PeerAddress | dict[str, Any]], timeout: float | None = None) -> None:
        self.call(self.endpoint.connect, peers, timeout)

    def send_round(self, peer: int, bucket: int, round: int, flat: torch.Tensor, *args: Any, **kw: Any) -> SendStats:
        """:meth:`Endpoint.send_round`, blocking (the same arguments; ``timeout`` bounds the wait here)."""
        return self.call(self.endpoint.send_round, peer, bucket, round, flat, *args, **kw)

    def recv_round(self, peer: int, bucket: int, round: int, **kw: Any) -> RoundResult:
        return self.call(self.endpoint.recv_round, peer, bucket, round, **kw)

    def send_bytes(self, peer: int, data: bytes, tag: int = 0) -> None:
        self.call(self.endpoint.outbound.send_bytes, peer, data, tag)

    def recv_bytes(self, peer: int, tag: int = 0, timeout: float | None = None) -> bytes:
        return self.call(self.endpoint.inbound.recv_bytes, peer, tag, timeout)

    def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        self.call(self.endpoint.send_tensor, peer, tensor, tag)

    def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        return self.call(self.endpoint.recv_tensor, peer, tag, timeout)

    def stats(self) -> TransportStats:
        return self._bridge.call_sync(self.endpoint.stats)

    def socket_info(self) -> dict[str, Any]:
        return self._bridge.call_sync(self.endpoint.links.socket_info)

    def close(self, timeout: float = 10.0) -> None:
        """Close the endpoint (goodbye to peers) and join the thread."""
        self._bridge.stop(timeout)

    def __enter__(self) -> BlockingEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
