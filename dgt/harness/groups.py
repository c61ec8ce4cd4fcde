"""Many ranks' groups in one process (tests of the lazy links and of scale): one store, every group created at once,
their endpoints' service tasks in one nursery of the caller's block."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from dgt.collectives.group import Group
from dgt.errors import open_nursery


@asynccontextmanager
async def local_groups(world: int, store: Any, **create: Any) -> AsyncIterator[list[Group]]:
    """``async with local_groups(world, store, config=..., prefix=...) as groups:`` ranks 0..world-1, each a
    :meth:`Group.create` with ``create`` (all but ``nursery``) on ``store`` (a ``torch.distributed.HashStore``); all are
    closed, and every task of theirs ended, when the block ends."""
    groups: list[Group | None] = [None] * world

    async with open_nursery() as services:
        async def one(r: int) -> None:
            groups[r] = await Group.create(r, world, store=store, nursery=services, **create)

        async with open_nursery() as n:
            for r in range(world):
                n.start_soon(one, r)
        made = [g for g in groups if g is not None]
        try:
            yield made
        finally:
            async with open_nursery() as n:
                for g in made:
                    n.start_soon(g.aclose)
