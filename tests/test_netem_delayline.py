"""DelayLine (the relay's sans-IO core) with a fake clock: delay, order, jitter distribution, reordering, bounds."""

from __future__ import annotations

import numpy as np
import pytest

from dgt.errors import DgtError
from dgt.netem.delayline import DelayLine


def frames(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(4, "big") for i in range(start, start + n)]


def ids(out: list[bytes]) -> list[int]:
    return [int.from_bytes(f, "big") for f in out]


def run_line(line: DelayLine, arrivals: list[tuple[float, int]], tick: float = 1e-4) -> list[tuple[float, int]]:
    """Feed (time, batch size) arrivals and poll every `tick`; return (release time, frame id) in release order."""
    released: list[tuple[float, int]] = []
    pending = sorted(arrivals)
    seq = 0
    t = 0.0
    while pending or len(line):
        while pending and pending[0][0] <= t:
            _, n = pending.pop(0)
            released += [(t, i) for i in ids(line.push(frames(n, seq), t))]
            seq += n
        released += [(t, i) for i in ids(line.pop_due(t))]
        t = round(t + tick, 9)
        assert t < 100, "line never drained"
    return released


def test_constant_delay_in_order_and_counted() -> None:
    line = DelayLine(0.025)
    assert line.push(frames(3), 1.0) == [] and len(line) == 3 and line.next_due() == pytest.approx(1.025)
    assert line.pop_due(1.0249) == []
    line.push(frames(2, 3), 1.010)
    assert ids(line.pop_due(1.025)) == [0, 1, 2]
    assert line.next_due() == pytest.approx(1.035)
    assert ids(line.pop_due(2.0)) == [3, 4] and line.next_due() is None
    c = line.counters
    assert c.late_max == pytest.approx(2.0 - 1.035) and c.late_sum == pytest.approx(2 * 2.0 - 1.035 - 1.035)
    assert (c.received, c.sent, c.held, c.max_held, c.reordered, c.overflow) == (5, 5, 0, 5, 0, 0)


def test_release_across_chunk_boundaries() -> None:
    line = DelayLine(0.010)
    for k in range(4):  # four batches, 1 ms apart
        line.push(frames(3, 3 * k), k * 0.001)
    assert ids(line.pop_due(0.0105)) == [0, 1, 2]
    assert ids(line.pop_due(0.0125)) == [3, 4, 5, 6, 7, 8]
    assert ids(line.pop_due(0.0135)) == [9, 10, 11]


def test_jitter_is_uniform_and_never_reorders() -> None:
    line = DelayLine(0.025, jitter=0.005, seed=1)
    # sparse arrivals (one frame every 20 ms, longer than the jitter span): delays are the raw draws
    out = run_line(line, [(k * 0.020, 1) for k in range(2000)])
    assert [i for _, i in out] == list(range(2000))
    delays = np.array([t for t, _ in out]) - np.arange(2000) * 0.020
    assert delays.min() >= 0.020 - 1e-9 and delays.max() <= 0.030 + 1e-4
    assert delays.mean() == pytest.approx(0.025 + 5e-5, abs=4e-4)  # + half a poll tick
    assert delays.std() == pytest.approx(0.005 / np.sqrt(3), rel=0.08)  # uniform: sigma = jitter / sqrt(3)
    # dense arrivals (a frame every 0.1 ms): still in order, each no earlier than its own draw allows
    line = DelayLine(0.025, jitter=0.005, seed=2)
    out = run_line(line, [(k * 1e-4, 1) for k in range(3000)])
    assert [i for _, i in out] == list(range(3000)) and line.counters.reordered == 0


def test_reorder_sends_a_share_at_once() -> None:
    line = DelayLine(0.025, reorder=0.25, seed=3)
    out = run_line(line, [(k * 0.001, 1) for k in range(4000)])
    order = [i for _, i in out]
    assert sorted(order) == list(range(4000))
    c = line.counters
    assert c.reordered == pytest.approx(1000, abs=4 * np.sqrt(4000 * 0.25 * 0.75))
    late = sum(1 for a, b in zip(order, order[1:]) if b < a)
    assert late > 500  # frames overtaken by ones sent at once are observable as sequence inversions
    immediate = [t - i * 0.001 for t, i in out if t - i * 0.001 < 0.001]
    assert len(immediate) == c.reordered and c.sent == 4000


def test_capacity_bounds_memory_and_counts_overflow() -> None:
    line = DelayLine(1.0, capacity=10)
    line.push(frames(6), 0.0)
    line.push(frames(6, 6), 0.1)
    assert len(line) == 10 and line.counters.overflow == 2
    assert ids(line.pop_due(5.0)) == list(range(10))
    line.push(frames(3, 12), 6.0)
    assert len(line) == 3 and line.counters.overflow == 2


def test_jitter_larger_than_delay_never_releases_before_arrival() -> None:
    dues = []
    for seed in range(20):
        line = DelayLine(0.001, jitter=0.010, seed=seed)
        line.push(frames(1), 3.0)
        dues.append(line.next_due())
    assert min(dues) == 3.0 and max(dues) <= 3.011  # draws below zero delay are clamped to the arrival time
    assert 3 <= dues.count(3.0) <= 17  # P(draw < -delay) = 0.45


def test_bad_parameters() -> None:
    with pytest.raises(DgtError, match="negative"):
        DelayLine(-0.001)
    with pytest.raises(DgtError, match="reorder"):
        DelayLine(0.01, reorder=1.5)
    with pytest.raises(DgtError, match="capacity"):
        DelayLine(0.01, capacity=0)
