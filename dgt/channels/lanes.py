"""Lane classes: which transport and DSCP each priority class uses. Lane 0 is the reliable TCP lane; lanes 1.. are
unreliable UDP lanes in descending importance (the DGT paper's "more channels" future work)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dgt.channels.sockopts import default_priority, parse_dscp


@dataclass(frozen=True)
class LaneSpec:
    """One priority class. ``priority`` (SO_PRIORITY) defaults to what the DSCP implies."""

    name: str
    kind: str  # "tcp" or "udp"
    dscp: int
    priority: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("tcp", "udp"):
            raise ValueError(f"lane kind must be 'tcp' or 'udp', not {self.kind!r}")
        object.__setattr__(self, "dscp", parse_dscp(self.dscp))

    @property
    def so_priority(self) -> int:
        return default_priority(self.dscp) if self.priority is None else self.priority

    @classmethod
    def parse(cls, text: str, name: str | None = None) -> LaneSpec:
        """``"tcp:EF"``, ``"udp:AF21"``, ``"udp:1"``, optionally ``":prio=N"`` at the end."""
        parts = text.split(":")
        if len(parts) < 2:
            raise ValueError(f"lane spec {text!r} must look like 'udp:LE' or 'tcp:46'")
        prio = None
        for extra in parts[2:]:
            key, _, val = extra.partition("=")
            if key != "prio":
                raise ValueError(f"unknown lane option {extra!r}")
            prio = int(val)
        return cls(name or text, parts[0].lower(), parse_dscp(parts[1]), prio)

    def to_dict(self) -> dict:
        return asdict(self) | {"so_priority": self.so_priority}


def default_lanes() -> list[LaneSpec]:
    """The paper's two channels: important blocks over TCP EF, the rest over UDP Lower-Effort."""
    return [LaneSpec("critical", "tcp", 46), LaneSpec("bulk", "udp", 1)]


def three_lanes() -> list[LaneSpec]:
    """Critical TCP EF, then UDP AF21 for the better half of the unimportant blocks, UDP LE for the rest."""
    return [LaneSpec("critical", "tcp", 46), LaneSpec("assured", "udp", 18), LaneSpec("bulk", "udp", 1)]


def validate_lanes(lanes: list[LaneSpec]) -> list[LaneSpec]:
    if len(lanes) < 2:
        raise ValueError("need the reliable lane and at least one unreliable lane")
    if lanes[0].kind != "tcp" or any(ln.kind != "udp" for ln in lanes[1:]):
        raise ValueError("lane 0 must be the TCP lane and every further lane a UDP lane")
    return lanes
