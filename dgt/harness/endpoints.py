"""Two endpoints on loopback, connected to each other: the fixture of the transport's tests and benches."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dgt.errors import open_nursery
from dgt.transport import Endpoint, Timeouts, TransportConfig


@asynccontextmanager
async def connected_pair(token: int, cfg_a: TransportConfig | None = None, cfg_b: TransportConfig | None = None,
                         host: str = "127.0.0.1",
                         token_b: int | None = None) -> AsyncIterator[tuple[Endpoint, Endpoint]]:
    """``async with connected_pair(token, cfg) as (a, b):`` ranks 0 and 1 opened on ``host`` (``cfg_b`` defaults to
    ``cfg_a``, ``token_b`` to ``token``) and connected both ways; both are closed (rank 0 first) when the block ends
    and their service tasks end with it (:meth:`Endpoint.open`)."""
    cfg_a = cfg_a or TransportConfig(timeouts=Timeouts(peer=5))
    token_b = token if token_b is None else token_b
    async with Endpoint.open(0, token, cfg_a, host=host) as a, Endpoint.open(1, token_b, cfg_b or cfg_a, host) as b:
        try:
            async with open_nursery() as n:
                n.start_soon(a.connect, {1: b.address})
                n.start_soon(b.connect, {0: a.address})
            yield a, b
        finally:
            await a.aclose()
