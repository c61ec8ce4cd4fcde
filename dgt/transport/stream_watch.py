"""Which messages this rank expects on stream lanes, so that one arriving on the session link instead is seen as what
it is: the peer took the round path for the same call (its tensor has another dtype, device or layout, or it runs
with stream hops off), and both sides would otherwise wait for each other until ``peer_timeout``.

A message *family* is a bucket id under a mask (a collective passes the bits that name the bucket and phase, so a
parameter server's shard pushes and its stream hops' step keys fall in one family) plus the round and the peer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dgt.transport.streams import Hop

Key = tuple[int, int, int]  # (peer, bucket, round)


class StreamWatch:
    def __init__(self) -> None:
        self._expect: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (peer, round) -> [(mask, bucket & mask)]

    def watch(self, hops: Iterable[Hop], mask: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Register the receiving hops of an exchange; returns the entries for :meth:`unwatch`."""
        entries = [((h.recv_from, h.round), (mask, h.bucket & mask)) for h in hops if h.recv_from is not None]
        for k, v in entries:
            self._expect.setdefault(k, []).append(v)
        return entries

    def unwatch(self, entries: list[tuple[tuple[int, int], tuple[int, int]]]) -> None:
        for k, v in entries:
            lst = self._expect.get(k)
            if lst is not None and v in lst:
                lst.remove(v)
                if not lst:
                    del self._expect[k]

    def expected(self, key: Key) -> bool:
        """Whether a session-link message ``key`` belongs to a family this rank awaits on a stream lane."""
        peer, bucket, round = key
        return any(bucket & m == b for m, b in self._expect.get((peer, round), ()))

    def first_expected(self, keys: Iterable[Key]) -> Key | None:
        """The first of ``keys`` (messages already in or under way on the session link) that :meth:`expected`."""
        if not self._expect:
            return None
        return next((k for k in keys if self.expected(k)), None)
