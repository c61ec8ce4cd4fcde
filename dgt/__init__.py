"""dgt: Differential Gradient Transmission — important gradient blocks over reliable TCP (DSCP EF), the rest over
best-effort UDP (low DSCP), dropped at a deadline, folded back by error feedback."""

from dgt.errors import (
    CodecMismatch,
    DgtError,
    EmulationUnsupported,
    PeerClosed,
    PeerTimeout,
    ProtocolError,
    RendezvousTimeout,
    WireError,
)

__version__ = "0.1.0"

__all__ = [
    "CodecMismatch", "DgtError", "EmulationUnsupported", "PeerClosed", "PeerTimeout", "ProtocolError",
    "RendezvousTimeout", "WireError", "__version__",
]
