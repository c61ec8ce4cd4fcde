"""What a link should look like: rate, queue, delay, jitter, loss, reordering, priority classes.

Parsing lives here so the CLI, the Python API and the saved state all agree on units: rates in bit/s, times in
seconds, loss and reordering as fractions in [0, 1].
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dgt.errors import DgtError

_RATE_UNITS = {
    "bit": 1,
    "kbit": 1_000,
    "mbit": 1_000_000,
    "gbit": 1_000_000_000,
    "bps": 8,
    "kbps": 8_000,
    "mbps": 8_000_000,
    "gbps": 8_000_000_000,
}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_rate(value: str | int | float | None) -> int | None:
    """Rate in bit/s from tc-style text ('100mbit', '1gbit', '12mbps' = megabytes/s) or a number of bit/s."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        bps = float(value)
    else:
        m = _NUM_UNIT.match(value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _RATE_UNITS:
            raise DgtError(f"bad rate {value!r}: use a number with one of {', '.join(_RATE_UNITS)} (e.g. 100mbit)")
        bps = float(m.group(1)) * _RATE_UNITS[unit]
    if bps <= 0:
        raise DgtError(f"rate must be positive, got {value!r}")
    return int(bps)


def parse_time(value: str | int | float | None) -> float:
    """Duration in seconds from '5ms', '200us', '1s', or a number of seconds."""
    if value is None:
        return 0.0
    if isinstance(value, (int, float)):
        secs = float(value)
    else:
        m = _NUM_UNIT.match(value)
        unit = m.group(2).lower() if m else ""
        if m and unit == "" and float(m.group(1)) == 0:
            return 0.0
        if not m or unit not in _TIME_UNITS:
            raise DgtError(f"bad time {value!r}: use a number with one of {', '.join(_TIME_UNITS)} (e.g. 5ms)")
        secs = float(m.group(1)) * _TIME_UNITS[unit]
    if secs < 0:
        raise DgtError(f"time must not be negative, got {value!r}")
    return secs


def parse_fraction(value: str | int | float | None) -> float:
    """A probability: '0.5%' (percent) or a fraction in [0, 1] given as a number."""
    if value is None:
        return 0.0
    if isinstance(value, str):
        m = _NUM_UNIT.match(value)
        if not m or m.group(2) not in ("", "%"):
            raise DgtError(f"bad probability {value!r}: use a percentage such as 0.5%")
        frac = float(m.group(1)) / 100.0 if m.group(2) == "%" else float(m.group(1))
    else:
        frac = float(value)
    if not 0.0 <= frac <= 1.0:
        raise DgtError(f"probability {value!r} is outside [0, 1]; write percentages with a % sign (e.g. '5%')")
    return frac


def format_rate(bps: int | None) -> str:
    """Human text for a rate in bit/s."""
    if bps is None:
        return "unlimited"
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= mult:
            return f"{bps / mult:g}{unit}"
    return f"{bps}bit"


DEFAULT_PREFIX = "dgt"
DEFAULT_SUBNET = "10.77.0.0/24"

# The four priority classes, highest first; HTB prio = index. Shares are each class's assured fraction of the link
# rate; the rest is lent strictly by priority, so EF takes what it needs and LE gets only what is left.
CLASS_NAMES: tuple[str, ...] = ("EF", "AF", "BE", "LE")
DEFAULT_SHARES: dict[str, float] = {"EF": 0.01, "AF": 0.01, "BE": 0.01, "LE": 0.01}


@dataclass(frozen=True)
class LinkSpec:
    """One link's emulated properties, applied to each direction of that link.

    rate: bit/s or None (unshaped). limit: queue length in packets per class. delay/jitter: seconds (netem).
    loss/reorder: fractions (netem, or nftables for loss where netem is absent). priority: DSCP classes EF > AF >
    BE > LE in HTB with u32 filters; without it one FIFO class. shares: assured rate fractions per class.
    """

    rate: int | None = None
    limit: int = 1000
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    reorder: float = 0.0
    priority: bool = True
    shares: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SHARES))

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise DgtError(f"queue limit must be at least 1 packet, got {self.limit}")
        if self.jitter and not self.delay:
            raise DgtError("jitter needs a delay (netem varies the delay around it)")
        if self.reorder and not self.delay:
            raise DgtError("reordering needs a delay: netem reorders by sending some packets without the delay")
        unknown = set(self.shares) - set(CLASS_NAMES)
        if unknown:
            raise DgtError(f"unknown priority classes in shares: {sorted(unknown)}; known: {CLASS_NAMES}")
        if any(not 0.0 < s <= 1.0 for s in self.shares.values()) or sum(self.shares.values()) > 1.0:
            raise DgtError("class shares must each lie in (0, 1] and sum to at most 1")

    @classmethod
    def make(
        cls,
        rate: str | int | float | None = None,
        limit: int = 1000,
        delay: str | float | None = None,
        jitter: str | float | None = None,
        loss: str | float | None = None,
        reorder: str | float | None = None,
        priority: bool = True,
        shares: dict[str, float] | None = None,
    ) -> LinkSpec:
        """Build from user units ('100mbit', '5ms', '0.5%')."""
        return cls(
            rate=parse_rate(rate),
            limit=int(limit),
            delay=parse_time(delay),
            jitter=parse_time(jitter),
            loss=parse_fraction(loss),
            reorder=parse_fraction(reorder),
            priority=priority,
            shares=dict(DEFAULT_SHARES if shares is None else shares),
        )

    @property
    def needs_netem(self) -> bool:
        """Delay, jitter and reordering exist only in netem."""
        return bool(self.delay or self.jitter or self.reorder)

    @property
    def shaped(self) -> bool:
        return self.rate is not None

    @property
    def impaired(self) -> bool:
        return self.shaped or self.needs_netem or bool(self.loss)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkSpec:
        return cls(**d)

    def describe(self) -> str:
        parts = [format_rate(self.rate)]
        if self.delay:
            parts.append(f"delay {self.delay * 1e3:g}ms" + (f"±{self.jitter * 1e3:g}ms" if self.jitter else ""))
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        if self.reorder:
            parts.append(f"reorder {self.reorder * 100:g}%")
        if self.shaped:
            parts.append(f"limit {self.limit}p")
            parts.append("EF>AF>BE>LE" if self.priority else "fifo")
        return ", ".join(parts)
