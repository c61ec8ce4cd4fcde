"""The endpoint's records of its peers and of its rounds on their way: a session link (:class:`Link`, filled by
the handshake) and a round sent (:class:`SendTrack`, by the send APIs). Declared apart from the parts that fill them
(dgt.transport.handshake, dgt.transport.outbound), so that the declarations every part shares
(dgt.transport.session) import no part: the endpoint's modules import one another without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import trio

from dgt.channels.framing import FrameReader
from dgt.channels.slot import Slot
from dgt.channels.tcp import TcpChannel
from dgt.channels.tcp_writer import ReliableWriter
from dgt.channels.udp_scheduler import DatagramJob
from dgt.protocol.budget import RoundWindow
from dgt.protocol.pacing import Pacer
from dgt.protocol.sender import RoundSender
from dgt.transport.config import PeerAddress


@dataclass
class Link:
    """One connected peer."""

    rank: int
    address: PeerAddress
    chan: TcpChannel
    reader: FrameReader
    writer: ReliableWriter
    sender: RoundSender
    pacer: Pacer | None
    udp_addrs: list[tuple[str, int]]
    error: BaseException | None = None
    scope: trio.CancelScope | None = None
    last_ping: float = 0.0
    said_bye: bool = False
    dirty: set[int] = field(default_factory=set)  # buckets whose residual holds folded losses
    window: RoundWindow = field(default_factory=RoundWindow)  # expected round length, for the send budget


@dataclass
class SendTrack:
    """A round on its way to a peer: the drop report slot and the datagram jobs (for the loss estimate)."""

    report: Slot = field(default_factory=Slot)
    jobs: list[DatagramJob] = field(default_factory=list)
    detached: bool = False  # send_round returned without waiting for the report
    t0: float = 0.0  # when the round started (the send budget learns the round's length from its report)
    cls: np.ndarray | None = None  # lane class per block (per-lane loss accounting)
    window: float | None = None  # a hop round's: the seconds its stream messages took (the budget's window sample)
