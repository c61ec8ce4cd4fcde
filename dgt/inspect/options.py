"""What ``dgt inspect`` cannot learn from a capture (:class:`Options`), apart from the summary that reads them
(dgt.inspect.summary) so that the flow detection (dgt.inspect.flows) can take them too without an import cycle."""

from __future__ import annotations

from dataclasses import dataclass, field

from dgt import wire


@dataclass
class Options:
    """What the tool cannot learn from the capture: extra DGT ports, and the DSCP each lane was configured with."""

    tcp_ports: tuple[int, ...] = ()
    udp_ports: tuple[int, ...] = ()
    auto: bool = True  # also detect DGT flows by the magic/version at the start of payloads and streams
    expect_dscp: dict[int, tuple[int, ...]] = field(default_factory=dict)  # lane -> acceptable DSCP values
    bin_s: float | None = None  # timeline bin width (None: about 60 bins over the capture)
    limits: wire.Limits = wire.DEFAULT_LIMITS
