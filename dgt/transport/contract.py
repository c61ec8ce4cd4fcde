"""What a collective may use of a rank's transport: the :class:`Transport` protocol (issue #24).

Collectives (dgt.collectives), the group that connects them and the codecs' part movers are written against this
protocol, not against :class:`dgt.transport.endpoint.Endpoint`; the endpoint satisfies it structurally (checked by
mypy in dgt.collectives.group and by tests/test_architecture.py at run time). Anything a collective needs from the
transport and this protocol does not name is a new seam: add it here first.

The five ways a bucket can leave, from the most general to the fastest:

- ``send_round`` / ``recv_round``: a round of blocks with per-block classes (lossy lanes, deadlines, error feedback);
- ``post_send`` / ``post_recv``: a lossless round queued on the session link without awaiting (BULK frames),
  landed in place;
- ``exchange``: an ordered sequence of :class:`~dgt.transport.streams.Hop` on the stream lanes, run off the trio
  loop (the lossless ring, the lossy ring's all-gather), its place in the call order reservable with
  ``reserve_exchange`` (given back with ``forfeit_exchange`` when it will never run);
- ``lossy_hop``: one reduce-scatter hop of a lossy ring, whole, in one call and its return
  (:class:`~dgt.transport.lossy_hop.LossyHopSpec` in, :class:`~dgt.transport.lossy_hop.LossyHopResult` out:
  planning, the send budget, the mask message, the exchange, landing, the drop report and the sum happen inside);
  ``hop_ready`` says whether a peer can be reached that way (the call's plan asks it);
- ``send_tensor`` / ``recv_tensor``: small tagged lossless messages with shape and dtype (LGC's variable-length
  transfers, model broadcasts).

Beside them: the session (``rank``, ``cfg``, ``address``, ``peers``, ``connect``, ``aclose``) and the failure and
agreement notices (``abort_peers``, ``failure``, ``call_failed``, ``enter_round``, ``refuse_round``, ``aborted``).
The hop-round plumbing ``lossy_hop`` is made of (plan, receipt, sent, land) is the endpoint's hop-round part's
(:class:`dgt.transport.hop_round.HopRounds`), not the collectives' (:class:`dgt.transport.lossy_hop.HopEndpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from dgt.errors import RankMismatch
    from dgt.layout import BucketLayout
    from dgt.transport.config import PeerAddress, TransportConfig
    from dgt.transport.lossy_hop import LossyHopResult, LossyHopSpec
    from dgt.transport.outbound import PendingSend
    from dgt.transport.stats import RoundResult, SendStats
    from dgt.transport.streams import Hop, HopResult


class Transport(Protocol):
    """A rank's session with its peers, as the collectives see it."""

    rank: int
    cfg: TransportConfig

    @property
    def address(self) -> PeerAddress:
        """Where peers reach this rank (what the rendezvous publishes)."""
        ...

    @property
    def peers(self) -> list[int]:
        """Ranks with a live connection."""
        ...

    async def connect(self, peers: Mapping[int, PeerAddress | dict[str, object]], timeout: float | None = None) -> None:
        ...

    async def aclose(self) -> None:
        ...

    async def send_round(self, peer: int, bucket: int, round: int, flat: torch.Tensor,
                         layout: BucketLayout | None = None, cls: torch.Tensor | int = 0,
                         order: torch.Tensor | None = None, *, wait: bool = True, timeout: float | None = None,
                         op: int = 0) -> SendStats:
        ...

    async def recv_round(self, peer: int, bucket: int, round: int, *, out: torch.Tensor | None = None,
                         timeout: float | None = None) -> RoundResult:
        ...

    def post_send(self, peer: int, bucket: int, round: int, flat: torch.Tensor, op: int = 0) -> PendingSend:
        ...

    def post_recv(self, peer: int, bucket: int, round: int, out: torch.Tensor | None, *,
                  zero_lost: bool = True, hold: bool = False) -> None:
        ...

    async def exchange(self, hops: list[Hop], timeout: float | None = None, family: int = 0xFFFFFFFF,
                       ticket: int | None = None) -> list[HopResult]:
        ...

    def reserve_exchange(self) -> int:
        """A place in the order of stream exchanges, for an ``exchange`` started later (or ``forfeit_exchange``)."""
        ...

    def forfeit_exchange(self, ticket: int) -> None:
        """Give back a place reserved with ``reserve_exchange`` that will never run."""
        ...

    def hop_ready(self, peer: int) -> bool:
        """Whether ``lossy_hop`` can reach ``peer`` (both ends have a hop socket): a query the call's plan asks."""
        ...

    async def lossy_hop(self, spec: LossyHopSpec) -> LossyHopResult:
        """One reduce-scatter hop of a lossy ring, whole (dgt.transport.lossy_hop): the encoded chunk out to
        ``spec.send_to`` (important blocks on the stream lane, the rest a DGT round on the hop socket) while the
        chunk from ``spec.recv_from`` lands and is summed into ``spec.mine``; returns the sum's block scores, the
        arrival mask and the statistics."""
        ...

    async def send_tensor(self, peer: int, tensor: torch.Tensor, tag: int = 0) -> None:
        ...

    async def recv_tensor(self, peer: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        ...

    def abort_peers(self, why: str) -> None:
        """Tell every connected peer that this rank's collective failed for ``why``."""
        ...

    async def failure(self, peers: Iterable[int], within: float = 0.0) -> BaseException | None:
        """The error naming why one of ``peers`` is gone (None: all alive), once one of them has ended or reported
        its own failure (waiting up to ``within`` s for that)."""
        ...

    def call_failed(self, why: str) -> None:
        """Tell every connected peer that this rank's collective failed on a failed peer (``why``)."""
        ...

    def enter_round(self, family: str, bucket: int, rnd: int) -> None:
        """This rank starts round ``rnd`` of ``family``/``bucket``: RankMismatch if a peer refused that call already."""
        ...

    def refuse_round(self, family: str, bucket: int, rnd: int, why: str, peers: Iterable[int]) -> None:
        """This rank refused its input to that round: tell ``peers`` (control REFUSED, scoped to the round)."""
        ...

    def announce_on_link(self, peer: int, bucket: int, round: int) -> None:
        """Tell ``peer`` that this rank runs ``bucket``/``round`` on the session link (a central server that receives
        first: a peer on stream lanes for the same call then fails with RankMismatch, issue 22)."""
        ...

    async def aborted(self, within: float, dead: Iterable[int] | None = None) -> RankMismatch | None:
        """The mismatch a peer reported, waiting up to ``within`` s for one (less once one of ``dead`` is gone)."""
        ...
