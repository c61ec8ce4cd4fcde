"""The delay line's core, sans-IO: frames go in with a clock reading, come out when they are due.

Used by the relay (relay.py) that stands in for sch_netem on kernels without it. Each pushed frame is due at
``now + delay + U(-jitter, +jitter)`` (uniform, which is also what netem draws without a distribution table;
never before ``now``).
Frames leave in the order they came: a draw that would overtake the frame ahead is raised to that frame's due
time, so jitter spreads the delay but never reorders by itself. With ``reorder = p`` a share p of the frames is
sent at once, without the delay, overtaking those held (netem's semantics for ``reorder``).

Everything is done per pushed batch with numpy (draws, order clamp, the due-time search); frames are held as
chunks of (due times, frames), one per push, so releasing is a searchsorted and a slice, not a loop per frame.
The line holds at most ``capacity`` frames: more are dropped at the tail and counted (memory stays bounded).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from dgt.errors import DgtError


@dataclass
class LineCounters:
    """What one direction of a delay line has done so far."""

    received: int = 0
    sent: int = 0
    reordered: int = 0  # sent at once, without the delay
    overflow: int = 0  # dropped because the line held `capacity` frames
    held: int = 0  # frames inside the line now
    max_held: int = 0
    late_sum: float = 0.0  # seconds released frames left after their due time, summed (caller's lateness)
    late_max: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class DelayLine:
    """One direction of one link: hold frames for delay ± jitter, release in order of due time."""

    def __init__(self, delay: float, jitter: float = 0.0, reorder: float = 0.0, capacity: int = 50_000,
                 seed: int | None = None) -> None:
        if delay < 0 or jitter < 0:
            raise DgtError(f"delay and jitter must not be negative (delay {delay}, jitter {jitter})")
        if not 0.0 <= reorder <= 1.0:
            raise DgtError(f"reorder must be a fraction in [0, 1], got {reorder}")
        if capacity < 1:
            raise DgtError(f"capacity must be at least one frame, got {capacity}")
        self.delay, self.jitter, self.reorder, self.capacity = float(delay), float(jitter), float(reorder), capacity
        self.rng = np.random.default_rng(seed)
        self.counters = LineCounters()
        self._chunks: deque[tuple[np.ndarray, list[bytes]]] = deque()
        self._head = 0  # frames of the first chunk already released
        self._last_due = -np.inf

    def push(self, frames: list[bytes], now: float) -> list[bytes]:
        """Take a batch that arrived at `now`; return the frames to send at once (reordered ones), in order."""
        n = len(frames)
        if n == 0:
            return []
        c = self.counters
        c.received += n
        due = np.full(n, now + self.delay)
        if self.jitter:
            due += self.rng.uniform(-self.jitter, self.jitter, n)
            np.maximum(due, now, out=due)  # jitter larger than the delay: never before arrival
        now_out: list[bytes] = []
        if self.reorder:
            jump = self.rng.random(n) < self.reorder
            if jump.any():
                idx = np.flatnonzero(jump)
                now_out = [frames[i] for i in idx]
                keep = np.flatnonzero(~jump)
                frames = [frames[i] for i in keep]
                due = due[keep]
                c.reordered += len(now_out)
                c.sent += len(now_out)
        room = self.capacity - c.held
        if len(frames) > room:
            c.overflow += len(frames) - max(room, 0)
            frames, due = frames[:max(room, 0)], due[:max(room, 0)]
        if frames:
            due[0] = max(due[0], self._last_due)
            due = np.maximum.accumulate(due)  # never overtake the frame ahead
            self._last_due = float(due[-1])
            self._chunks.append((due, frames))
            c.held += len(frames)
            c.max_held = max(c.max_held, c.held)
        return now_out

    def pop_due(self, now: float) -> list[bytes]:
        """Frames whose due time is <= now, in order."""
        out: list[bytes] = []
        while self._chunks:
            due, frames = self._chunks[0]
            k = int(np.searchsorted(due, now, side="right"))
            if k <= self._head:
                break
            out.extend(frames[self._head:k])
            late = now - due[self._head:k]
            self.counters.late_sum += float(late.sum())
            self.counters.late_max = max(self.counters.late_max, float(late.max()))
            if k == len(frames):
                self._chunks.popleft()
                self._head = 0
            else:
                self._head = k
                break
        self.counters.held -= len(out)
        self.counters.sent += len(out)
        return out

    def next_due(self) -> float | None:
        """When the next held frame is due (None when the line is empty)."""
        if not self._chunks:
            return None
        return float(self._chunks[0][0][self._head])

    def __len__(self) -> int:
        return self.counters.held
