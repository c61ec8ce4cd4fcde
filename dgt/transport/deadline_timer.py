"""Drives the receiver's deadlines: sleeps until the sans-IO receiver's next deadline (or until new frames may have
moved it) and then lets it finalise whatever is due. The policy itself lives in dgt.protocol.deadline (this
module is the trio timer, not a policy)."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from dgt.protocol.events import Event
from dgt.protocol.receiver import RoundReceiver


class DeadlineTimer:
    """Calls ``receiver.on_time(now)`` at the receiver's next deadline and hands the finished rounds on."""

    def __init__(self, receiver: RoundReceiver, on_done: Callable[[list[Event]], None]) -> None:
        self.receiver = receiver
        self.on_done = on_done
        self._wake = trio.Event()
        self._armed = math.inf  # the deadline the timer sleeps toward
        self.fired = 0

    def poke(self) -> None:
        """Frames were fed to the receiver: wake the timer if its next deadline moved earlier (a later one is
        picked up when the timer fires and finds nothing due)."""
        due = self.receiver.next_deadline()
        if due is not None and due < self._armed:
            self._wake.set()

    async def run(self) -> None:
        while True:
            due = self.receiver.next_deadline()
            self._armed = math.inf if due is None else due
            with trio.move_on_at(self._armed):
                await self._wake.wait()
            self._wake = trio.Event()
            done = self.receiver.on_time(trio.current_time())
            if done:
                self.fired += len(done)
                self.on_done(done)
