"""Where an endpoint's sockets bind: any free port (0), or the first free one of a configured range, for clusters
whose firewalls open only a range (``TransportConfig.lanes.port_range`` or ``DGT_PORT_RANGE=LO-HI``)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
ENV = "DGT_PORT_RANGE"


def parse_port_range(text: str | None) -> tuple[int, int] | None:
    """'30000-30999' -> (30000, 30999); None or '' -> None (any port). A bad range is a clear ValueError."""
    if not text:
        return None
    try:
        lo, hi = (int(p) for p in text.replace(":", "-").split("-"))
    except ValueError:
        raise ValueError(f"port range {text!r}: expected LO-HI, e.g. 30000-30999") from None
    return check_port_range((lo, hi))


def check_port_range(pr: tuple[int, int] | None) -> tuple[int, int] | None:
    if pr is None:
        return None
    lo, hi = int(pr[0]), int(pr[1])
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"port range {lo}-{hi}: need 1 <= LO <= HI <= 65535")
    return lo, hi


def env_port_range() -> tuple[int, int] | None:
    return parse_port_range(os.environ.get(ENV))


def bind_in_range(make: Callable[[int], T], port_range: tuple[int, int] | None, what: str = "socket") -> T:
    """``make(port)`` on port 0 (no range), else on each port of the range until one is free (in use or not
    permitted: the next). OSError naming the range when none is."""
    if port_range is None:
        return make(0)
    lo, hi = port_range
    for port in range(lo, hi + 1):
        try:
            return make(port)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
    raise OSError(errno.EADDRINUSE, f"no free port for the {what} in the range {lo}-{hi} ({ENV})")
