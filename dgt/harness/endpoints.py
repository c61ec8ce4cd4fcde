"""Two endpoints on loopback, connected to each other: the fixture of the transport's tests and benches."""

from __future__ import annotations

import trio

from dgt.transport import Endpoint, TransportConfig


async def connected_pair(token: int, cfg_a: TransportConfig | None = None, cfg_b: TransportConfig | None = None,
                         host: str = "127.0.0.1", token_b: int | None = None) -> tuple[Endpoint, Endpoint]:
    """Ranks 0 and 1 opened on ``host`` (``cfg_b`` defaults to ``cfg_a``, ``token_b`` to ``token``) and connected
    both ways; the caller closes them."""
    cfg_a = cfg_a or TransportConfig(peer_timeout=5)
    a = await Endpoint.open(0, token, cfg_a, host=host)
    b = await Endpoint.open(1, token if token_b is None else token_b, cfg_b or cfg_a, host=host)
    async with trio.open_nursery() as n:
        n.start_soon(a.connect, {1: b.address})
        n.start_soon(b.connect, {0: a.address})
    return a, b
