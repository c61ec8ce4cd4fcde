"""Where this rank's DGT endpoint listens, and how the shim's groups meet.

torchrun and ``init_process_group`` only tell a rank where the store is (MASTER_ADDR), not which of its own
addresses peers can reach. The address the kernel would use to reach the store host is the one to advertise; on a
single machine that is loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any


def local_host(master: str | None = None) -> str:
    """``DGT_HOST`` if set; else the local address that routes to MASTER_ADDR (127.0.0.1 when that is local)."""
    env = os.environ.get("DGT_HOST")
    if env:
        return env
    master = master or os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        infos = socket.getaddrinfo(master, None, socket.AF_INET, socket.SOCK_DGRAM)
        ip = infos[0][4][0]
    except OSError:
        return "127.0.0.1"
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # no packet is sent: connect() on UDP only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def group_connector(rank: int, world: int, *, store: Any, config: Any = None, host: str | None = None,
                    timeout: float = 60.0, prefix: str = "dgt") -> Callable[..., Awaitable[Any]]:
    """The async factory a :class:`~dgt.collectives.worker.TrioWorker` calls in its thread to build its group, with
    the nursery its endpoint runs in (``config``: anything :func:`transport_config` takes)."""

    async def connect(nursery: Any) -> Any:
        from dgt.collectives import Group

        return await Group.create(rank, world, store=store, config=transport_config(config), host=host or local_host(),
                                  timeout=timeout, prefix=prefix, nursery=nursery)

    return connect


def checked_transport(config: Any) -> Any:
    """``config`` as given (None, a dict of ``TransportConfig`` fields, or one), once a ``TransportConfig`` can be
    built from it: an unknown field or a bad value is the TypeError/ValueError of ``DGTState(transport=...)``, not
    an error in the first backward pass on every rank. (A deprecated flat keyword warns where it is used, not here.)"""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        transport_config(config)
    return config


def transport_config(config: Any) -> Any:
    """A ``TransportConfig`` from None, a dict of its fields, or an instance (imported lazily: the shim must import
    where only the codecs are needed, e.g. when a checkpoint is unpickled)."""
    from dgt.transport import TransportConfig

    if config is None:
        return TransportConfig()
    if isinstance(config, dict):
        return TransportConfig(**config)
    return config
