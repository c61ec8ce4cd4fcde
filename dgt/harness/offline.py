"""A transport with no peers, for code that builds a :class:`~dgt.collectives.group.Group` and its collectives
without moving data: construction-time checks (codec capabilities, refused dtypes and options) in tests.

:class:`OfflineTransport` implements :class:`dgt.transport.contract.Transport` (mypy checks it in
dgt.harness.offline itself; tests/test_offline_transport.py checks the signatures at run time): it answers ``rank``,
``cfg``, ``address`` and ``peers`` (none), closes, and reports no abort; every operation that would move data raises
:class:`~dgt.errors.PeerClosed` saying the transport is offline, so a check that should have refused an input first
fails with that error instead of passing unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NoReturn

from dgt.errors import PeerClosed
from dgt.transport.config import PeerAddress, TransportConfig

if TYPE_CHECKING:
    import torch

    from dgt.errors import RankMismatch
    from dgt.layout import BucketLayout
    from dgt.transport.contract import Transport
    from dgt.transport.lossy_hop import LossyHopResult, LossyHopSpec
    from dgt.transport.outbound import PendingSend
    from dgt.transport.stats import RoundResult, SendStats
    from dgt.transport.streams import Hop, HopResult


class OfflineTransport:
    """Rank ``rank``'s transport with no peers and no sockets (see the module docstring)."""

    def __init__(self, rank: int = 0, cfg: TransportConfig | None = None) -> None:
        self.rank = int(rank)
        self.cfg = cfg or TransportConfig()

    def _offline(self, what: str) -> NoReturn:
        raise PeerClosed(f"rank {self.rank}: {what} on an offline transport (dgt.harness.offline: no peers, no "
                         f"traffic; a Group for real traffic comes from Group.open / Group.create)")

    @property
    def address(self) -> PeerAddress:
        return PeerAddress("0.0.0.0", 0, (0,) * (len(self.cfg.lanes.specs) - 1), self.rank)

    @property
    def peers(self) -> list[int]:
        return []

    async def connect(self, peers: Mapping[int, PeerAddress | dict[str, object]], timeout: float | None = None) -> None:
        self._offline(f"connect to ranks {sorted(peers)}")

    async def aclose(self) -> None:
        return None

    async def send_round(self, peer: int, bucket: int, round: int, flat: torch.Tensor,
                         layout: BucketLayout | None = None, cls: torch.Tensor | int = 0,
                         order: torch.Tensor | None = None, *, wait: bool = True, timeout: float | None = None,
                         op: int = 0) -> SendStats:
        self._offline("send_round")

    async def recv_round(self, peer: int, bucket: int, round: int, *, out: torch.Tensor | None = None,
                         timeout: float | None = None) -> RoundResult:
        self._offline("recv_round")

    def post_send(self, peer: int, bucket: int, round: int, flat: torch.Tensor, op: int = 0) -> PendingSend:
        self._offline("post_send")

    def post_recv(self, peer: int, bucket: int, round: int, out: torch.Tensor | None, *,
                  zero_lost: bool = True, hold: bool = False) -> None:
        self._offline("post_recv")

    def hop_ready(self, peer: int) -> bool:
        return False  # no hop socket: a lossy ring takes the session-link path (and meets _offline there)

    async def lossy_hop(self, spec: LossyHopSpec) -> LossyHopResult:
        self._offline("lossy_hop")

    async def exchange(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]:
        self._offline("exchange")

    def reserve_exchange(self) -> int:
        self._offline("reserve_exchange")

    def forfeit_exchange(self, ticket: int) -> None:
        self._offline("forfeit_exchange")

    async def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        self._offline("send_tensor")

    async def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        self._offline("recv_tensor")

    def abort_peers(self, why: str) -> None:
        return None  # no peer to tell

    async def failure(self, peers: Iterable[int], within: float = 0.0) -> BaseException | None:
        return None  # no peer to lose

    def call_failed(self, why: str) -> None:
        return None  # no peer to tell

    def announce_on_link(self, peer: int, bucket: int, round: int) -> None:
        return None  # no peer to tell

    def enter_round(self, family: str, bucket: int, rnd: int) -> None:
        return None  # no peer to have refused it

    def refuse_round(self, family: str, bucket: int, rnd: int, why: str, peers: Iterable[int]) -> None:
        return None  # no peer to tell

    async def aborted(self, within: float, dead: Iterable[int] | None = None) -> RankMismatch | None:
        return None  # no peer to report one


if TYPE_CHECKING:
    _IS_A_TRANSPORT: Transport = OfflineTransport()  # mypy: the protocol is implemented in full
