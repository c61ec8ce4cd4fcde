"""The important blocks' slowdown as a congestion signal (issue 26): the send budget lets unimportant blocks ride
along in the time the important ones take (budget.RoundWindow); where they are not free (a CPU-bound host, a FIFO
bottleneck that ignores DSCP) they lengthen that time, which raised the budget, which sent more. The window now
reports how much longer than its bucket's fastest recent window a round took, and the controller reads that like
queuing delay. Sans-IO, fake clock."""

from __future__ import annotations

import pytest

from dgt.protocol.budget import RoundWindow
from dgt.protocol.congestion import Feedback, LedbatRate

OFFSET, PROP = 1234.5, 0.001


def test_round_window_slowdown_is_relative_to_the_buckets_fastest_recent_window():
    w = RoundWindow(interval=1.0, history=3, warm=4, slack=0.0)
    for d in (0.012, 0.010, 0.011, 0.013):  # bucket 7 warming up: no reading yet
        assert w.observe(d, 0.0, bucket=7) is None
    assert w.observe(0.015, 0.0, bucket=7) == pytest.approx(0.5)  # 15 ms against the best 10 ms
    assert w.observe(0.009, 0.0, bucket=7) == pytest.approx(0.0)  # faster than the base: no slowdown
    assert w.observe(0.0135, 0.0045, bucket=7) == pytest.approx(0.0)  # the receiver's wait is not the window
    assert w.observe(0.018, 0.0, bucket=7) == pytest.approx(1.0)  # against the new base, 9 ms
    # buckets are apart: another bucket's long windows are its own base, not a slowdown of bucket 7's
    for _ in range(4):
        assert w.observe(0.2, 0.0, bucket=8) is None
    assert w.observe(0.2, 0.0, bucket=8) == pytest.approx(0.0)
    assert w.observe(0.2, 0.0) is None  # no bucket: no reading (the EWMA still learns)
    # the base is the shortest window of the last 3 one-second intervals: old ones age out
    assert w.observe(0.030, 0.0, bucket=7, now=2.5) == pytest.approx(30 / 9 - 1)
    assert w.observe(0.030, 0.0, bucket=7, now=3.0) == pytest.approx(0.0)  # interval 0 is gone: 30 ms is the base


def test_round_window_slack_absorbs_the_jitter_of_small_rounds():
    w = RoundWindow(warm=1, slack=0.002)
    w.observe(0.001, 0.0, bucket=1)  # a 1 ms round
    assert w.observe(0.0028, 0.0, bucket=1) == pytest.approx(0.0)  # 1.8 ms late: within the slack, not a slowdown
    assert w.observe(0.005, 0.0, bucket=1) == pytest.approx(2.0)  # (5 - 1 - 2) / 1


def test_round_window_tracks_a_bounded_number_of_buckets():
    w = RoundWindow(max_buckets=3, warm=1)
    for b in range(10):
        w.observe(0.01, 0.0, bucket=b)
    assert list(w._base) == [7, 8, 9]
    w.observe(0.01, 0.0, bucket=7)  # reported again: the most recent
    w.observe(0.01, 0.0, bucket=10)
    assert list(w._base) == [9, 7, 10]


def _fb(sent: int, t: float, slowdown: float = 0.0) -> Feedback:
    n = max(sent // 4096, 1)
    return Feedback(n, sent, n, sent, t, t, t + OFFSET + PROP, t + OFFSET + PROP, 0.0, None, 0, slowdown)


def test_controller_backs_off_for_a_slowdown_above_its_target_and_probes_below_it():
    cc = LedbatRate(10e6, slowdown_target=0.2, current_filter=1)
    cc.slow_start = False
    cc.on_feedback(_fb(100_000, 0.0, slowdown=0.4), 0.0)  # twice the target: reads as 2 x the delay target
    assert cc.behind == pytest.approx(2 * cc.target) and cc.rate == pytest.approx(10e6 * (1 - cc.gain))
    r = cc.rate
    cc.on_feedback(_fb(100_000, 0.1, slowdown=0.0), 0.1)
    assert cc.behind == pytest.approx(0.0) and cc.rate == pytest.approx(r * (1 + cc.gain))
    cc.on_feedback(_fb(100_000, 0.2, slowdown=0.1), 0.2)  # half the target: half the probing step
    assert cc.behind == pytest.approx(cc.target / 2)
    with pytest.raises(ValueError, match="slowdown_target"):
        LedbatRate(1e6, slowdown_target=0.0)


def _cpu_bound_host(slowdown_target: float, rounds: int = 300, slack: float = 0.0) -> tuple[float, float]:
    """A host where every unimportant byte costs the important transfer time (4 ranks on 2 cores over loopback, or
    a FIFO bottleneck): a round's important blocks take ``W0 * (1 + sent / C)``; the path itself never queues or
    loses anything. Returns the mean bytes sent per round and the mean important time over W0 in the last 100 rounds."""
    W0, C, U = 0.010, 2e6, 4.4e6  # the important blocks alone; bytes that double their time; unimportant bytes
    cc = LedbatRate(12.5e6, slowdown_target=slowdown_target)
    win = RoundWindow(slack=slack)
    t, sent_tail, stretch = 0.0, [], []
    for i in range(rounds):
        sent = min(U, max(win.budget(cc.rate), 4096))
        window = W0 * (1 + sent / C)
        slow = win.observe(window, 0.0, bucket=i % 3, now=t)  # three hops' buckets, as a 4-rank ring's link
        t += window
        cc.on_feedback(_fb(int(sent), t - window, slow or 0.0), t)
        if i >= rounds - 100:
            sent_tail.append(sent)
            stretch.append(window / W0)
    return sum(sent_tail) / len(sent_tail), sum(stretch) / len(stretch)


def test_the_slowdown_breaks_the_loop_of_budget_and_window_on_a_cpu_bound_host():
    # without the signal (a target no slowdown reaches) the budget runs away: every unimportant block is sent and the
    # important blocks take three times as long as they need
    sent, stretch = _cpu_bound_host(slowdown_target=1e9)
    assert sent == pytest.approx(4.4e6) and stretch == pytest.approx(3.2)
    # with it the lane settles where it slows the important blocks by about its target
    sent, stretch = _cpu_bound_host(slowdown_target=0.2)
    assert sent < 1.5e6 and stretch < 1.7  # (its base: the first rounds, which already sent some)
    # with the default 2 ms of slack (a fifth of these 10 ms windows) it settles a little higher, far from the runaway
    sent, stretch = _cpu_bound_host(slowdown_target=0.2, slack=RoundWindow().slack)
    assert sent < 2.2e6 and stretch < 2.1


def test_a_hop_rounds_window_is_its_stream_time_not_its_reports_round_trip():
    """The endpoint's report accounting: a session round's window is start to report less the receiver's wait; a
    lossy ring hop's round (its track holds the worker's ``window``) learns what its stream messages took. From the
    round's start to its report a hop also holds its encode, its planning, the peer's landing and the report's trip
    back through a busy trio thread: a 4-rank ring learnt ~8-10 ms windows for ~1 ms transfers, and its datagrams,
    paced over that window, arrived long after the important blocks while the receiver held the hop open."""
    from types import SimpleNamespace

    import numpy as np
    import trio

    from dgt.protocol.pacing import Pacer
    from dgt.protocol.report import Timing
    from dgt.transport.outbound import Outbound
    from dgt.transport.records import SendTrack

    learnt: list[float | None] = []

    async def account(hop_window: float | None) -> None:
        now = trio.current_time()
        link = SimpleNamespace(pacer=Pacer(10e6, 1 << 18, LedbatRate(10e6)), window=RoundWindow())
        track = SendTrack(t0=now - 0.050, window=hop_window)  # started 50 ms ago; the receiver waited 10 ms
        track.jobs.append(SimpleNamespace(sends=[(now - 0.049, 1, 4096)], rows=np.zeros((1, 4096), np.uint8), odd=[]))
        info = SimpleNamespace(lost_mask=None, missing_blocks=0, bucket=3,
                               timing=Timing(1, 100.0, 100.0, 0.010, 4096, 100.01))
        Outbound.account_report(SimpleNamespace(tx_lost={}), link, track, info)  # type: ignore[arg-type]
        learnt.append(link.window.value)
        assert link.window.budget(10e6) == int(10e6 * max(link.window.value, link.window.floor))

    trio.run(account, 0.002)
    trio.run(account, None)
    assert learnt[0] == pytest.approx(0.002)  # the hop: its stream messages' 2 ms
    assert learnt[1] == pytest.approx(0.040, abs=0.005)  # the session round: 50 ms less the 10 ms wait


def test_a_transfer_sample_sets_the_budget_window_while_the_slowdown_reads_the_whole_round():
    w = RoundWindow(warm=1, slack=0.0)
    w.observe(0.010, 0.0, bucket=1, transfer=0.001)  # base: a 10 ms round whose important blocks took 1 ms
    slow = w.observe(0.020, 0.0, bucket=1, transfer=0.001)  # planning and landing twice as long, same transfer
    assert slow == pytest.approx(1.0)  # the CPU-bound slowdown is seen
    assert w.value == pytest.approx(0.001)  # the budget covers the transfer, not the round
