"""The default hook's lossless fallback (dgt/shim/chooser.py): the decision logic with injected timings, and a
loopback run whose ranks switch between the lossless and the lossy path and back while the results stay right."""

from __future__ import annotations

import math

import pytest
import torch

from dgt.collectives.launch import run_ranks
from dgt.shim.chooser import LOSSLESS, LOSSY, LOWRANK, DropChooser


def _run(ch: DropChooser, iters: range, seconds, buckets: int = 2) -> list[str]:
    """Drive ``ch`` as the hook does: per iteration ``buckets`` rounds of ``seconds(it, mode) / buckets`` each; at
    a window's close it decides on its own figures (one rank: the agreed mean is its own). Returns the modes."""
    modes = []
    for it in iters:
        mode = ch.mode(it)
        modes.append(mode)
        for b in range(buckets):
            ch.observe(it, seconds(it, mode) / buckets, b == buckets - 1)
        if ch.due(it):
            ch.decide(it, ch.local())
    return modes


def _run_screened(ch: DropChooser, iters: range, seconds, buckets: int = 2) -> list[str]:
    """:func:`_run` with the hook's screening (DGTState.after_round): at a screening point the ranks agree on their
    figures and the chooser cuts; at a window's close it decides. Iterations before ``ch.start`` are the dense
    warm-up (mode "warmup", timed as ``seconds(it, LOSSLESS)``)."""
    modes = []
    for it in iters:
        mode = ch.mode(it) if it >= ch.start else "warmup"
        modes.append(mode)
        for b in range(buckets):
            ch.observe(it, seconds(it, LOSSLESS if mode == "warmup" else mode) / buckets, b == buckets - 1)
        if it < ch.start:
            continue
        agreed = ch.local() if ch.screening(it) else None
        if agreed is not None:
            ch.cut(it, agreed)
        if ch.due(it):
            ch.decide(it, agreed if agreed is not None else ch.local())
    return modes


# at 40 Mbit, 4 workers, AlexNet (2026-12-07, fifo seed 0, the default's first window): seconds per iteration
ALEX = {LOWRANK: 0.035, LOSSY: 0.137, "lossy-direct": 0.136, LOSSLESS: 0.21, "lossless-direct": 0.27}


def test_a_screened_window_cuts_the_probes_of_paths_that_cannot_win():
    """The default's first window on a bottleneck: the low-rank path probed first; every other path's probe is cut
    after its first (cold) iteration because it took more than ``screen`` (2) times the best figure so far, and the
    lossless ring's is not run at all: its figure is the dense warm-up's last iteration. 7 iterations instead of 20,
    and the decision is the same as with full probes."""
    from dgt.shim.chooser import LOSSLESS_DIRECT, LOSSY_DIRECT, SCREEN_ORDER

    cold = {LOWRANK: 0.06, LOSSY: 0.25, LOSSY_DIRECT: 0.25, LOSSLESS_DIRECT: 0.30}  # each path's first iteration
    seen: dict[str, int] = {}  # each path's first iteration (the warm-up's lossless ones are not cold)

    def secs(it, m):
        return cold.get(m, ALEX[m]) if it >= 2 and seen.setdefault(m, it) == it else ALEX[m]

    ch = DropChooser(start=2, hold=50, modes=SCREEN_ORDER)
    assert ch.screen == 2.0 and ch.window == [LOWRANK] * 4 + [LOSSY_DIRECT] * 4 + [LOSSY] * 4 + [LOSSLESS] * 4 + [
        LOSSLESS_DIRECT] * 4
    modes = _run_screened(ch, range(0, 9), secs)
    assert modes == ["warmup"] * 2 + [LOWRANK] * 4 + [LOSSY_DIRECT, LOSSY, LOSSLESS_DIRECT]
    d = ch.decisions[0]
    assert d["iter"] == 8 and d["chosen"] == LOWRANK
    # lossless cut at the low-rank path's first iteration (0.21 > 2 x 0.06 x 1.5), the others at their own first
    assert d["cut"] == [LOSSLESS, LOSSY_DIRECT, LOSSY, LOSSLESS_DIRECT]
    assert d["seconds"][LOSSLESS] == pytest.approx(0.21) and d["seconds"][LOWRANK] == pytest.approx(0.035)
    assert d["seconds"][LOSSY] == pytest.approx(0.25)  # a cut probe keeps its first (cold) iteration's figure
    # the full window decides the same
    full = DropChooser(start=2, hold=50, modes=SCREEN_ORDER, screen=math.inf)
    seen.clear()
    assert len(_run_screened(full, range(0, 22), secs)) == 22 and full.decisions[0]["iter"] == 21
    assert full.decisions[0]["chosen"] == LOWRANK and "cut" not in full.decisions[0]
    # the re-probe (every other path lost by far: only the nearest by its figure, here the warm-up's lossless one,
    # after a doubled hold) is cut after one iteration
    assert ch.window_start == 8 + 1 + 100 and ch.window == [LOSSLESS] * 4
    modes = _run_screened(ch, range(9, 111), secs)
    assert modes[-3:] == [LOWRANK, LOSSLESS, LOWRANK] and ch.decisions[1]["iter"] == 109
    assert ch.decisions[1]["cut"] == [LOSSLESS] and ch.chosen == LOWRANK and ch.mode(110) == LOWRANK


def test_on_a_long_lossy_path_the_direct_lossy_figure_cuts_the_rings_probes():
    """The ``wan`` profile (20 ms and 0.5 % loss per link direction, 4 workers, AlexNet; figures of 2026-12-07's
    runs): the low-rank path is only a little faster per iteration than the direct lossy one, so its weighed figure
    does not screen the ring's lossy path out (0.95 s < 2 x 0.32 x 1.5). The direct lossy path is probed before the
    ring's (SCREEN_ORDER), so the ring's lossy probe, at almost 3x its figure, is cut after its first iteration
    instead of running 4 iterations of about 1 s."""
    from dgt.shim.chooser import LOSSLESS_DIRECT, LOSSY_DIRECT, SCREEN_ORDER

    wan = {LOWRANK: 0.32, LOSSY_DIRECT: 0.34, LOSSY: 0.95, LOSSLESS: 1.0, LOSSLESS_DIRECT: 0.5}
    ch = DropChooser(start=2, hold=50, modes=SCREEN_ORDER)
    modes = _run_screened(ch, range(0, 17), lambda it, m: wan[m])
    assert modes == ["warmup"] * 2 + [LOWRANK] * 4 + [LOSSY_DIRECT] * 4 + [LOSSY] + [LOSSLESS_DIRECT] * 4 + [
        LOSSY_DIRECT] * 2
    d = ch.decisions[0]
    assert d["iter"] == 14 and d["chosen"] == LOSSY_DIRECT and d["cut"] == [LOSSLESS, LOSSY]
    # probed in the other order, the ring's lossy path would have run in full (its figure within 2x of the best)
    ring_first = DropChooser(start=2, hold=50, modes=(LOWRANK, LOSSY, LOSSY_DIRECT, LOSSLESS, LOSSLESS_DIRECT))
    assert _run_screened(ring_first, range(0, 10), lambda it, m: wan[m])[6:10] == [LOSSY] * 4


def test_the_ring_twins_bound_drops_the_direct_lossless_probe():
    """On 4 ranks (``world``) a direct mode takes at least 1/3 of its ring twin's time (the same bytes in 2 of the
    ring's 6 rounds in series). AlexNet at 40 Mbit with the bfloat16 factors (2026-12-07, second session: low rank
    0.015-0.02 s per iteration): the warm-up's lossless ring (0.21 s) bounds the lossless direct all-reduce at 0.07 s,
    more than 2x the low-rank path's weighed figure, so its probe (0.27 s) is dropped at the lossy direct path's
    screening point and never runs. The decision is the same, the bound is not a figure in it (NaN), and the
    dropped path sits out the next re-probe (its bound is far too); the re-probe goes to the nearest measured path.
    Without the world size the probe runs as before."""
    from dgt.shim.chooser import LOSSLESS_DIRECT, LOSSY_DIRECT, SCREEN_ORDER

    figs = {LOWRANK: 0.018, LOSSY: 0.11, LOSSY_DIRECT: 0.115, LOSSLESS: 0.21, LOSSLESS_DIRECT: 0.27}
    cold = {LOWRANK: 0.027, LOSSY: 0.16, LOSSY_DIRECT: 0.17}
    seen: dict[str, int] = {}

    def secs(it, m):
        return cold.get(m, figs[m]) if it >= 2 and seen.setdefault(m, it) == it else figs[m]

    ch = DropChooser(start=2, hold=50, modes=SCREEN_ORDER, world=4)
    modes = _run_screened(ch, range(0, 8), secs)
    assert modes == ["warmup"] * 2 + [LOWRANK] * 4 + [LOSSY_DIRECT, LOSSY]
    d = ch.decisions[0]
    assert d["iter"] == 7 and d["chosen"] == LOWRANK
    assert d["cut"] == [LOSSLESS, LOSSY_DIRECT, LOSSLESS_DIRECT, LOSSY]
    assert math.isnan(d["seconds"][LOSSLESS_DIRECT]) and d["seconds"][LOSSLESS] == pytest.approx(0.21)
    assert LOSSLESS_DIRECT in d["skip_next"] and ch.window == [LOSSY] * 4  # the nearest measured path: 0.16 s
    # the same figures without the world size: the lossless direct probe runs (one iteration, then cut)
    seen.clear()
    old = DropChooser(start=2, hold=50, modes=SCREEN_ORDER)
    assert _run_screened(old, range(0, 9), secs)[6:] == [LOSSY_DIRECT, LOSSY, LOSSLESS_DIRECT]
    assert old.decisions[0]["chosen"] == LOWRANK
    # on 2 ranks there is no bound (and no direct mode: the hook offers them from 3 ranks on)
    assert DropChooser(modes=SCREEN_ORDER, world=2)._bounded({LOSSLESS: 1.0, LOSSLESS_DIRECT: math.nan})[
        LOSSLESS_DIRECT] != 0.5


def test_the_default_warm_up_is_ddps_first_iteration_and_gives_the_lossless_figure():
    """``DGTState()``: one dense iteration (DDP's first; its connections opened before the clock starts), whose time
    is the lossless ring's first figure, so the first window's first iteration is already a screening point."""
    from dgt.shim import DGTState
    from dgt.shim.state import DEFAULT_WARMUP_ITERS

    st = DGTState()
    assert DEFAULT_WARMUP_ITERS == st.warmup_iters == st.chooser.start == 1 and st.chooser.window_start == 1
    ch = st.chooser
    ch.observe(0, 0.15, False)
    ch.observe(0, 0.10, True)  # two buckets: 0.25 s
    assert ch.local()[ch.modes.index(LOSSLESS)] == pytest.approx(0.25)
    assert ch.mode(1) == LOWRANK and ch.screening(1)


def test_the_twins_bound_keeps_the_direct_probe_where_it_may_win():
    """``wan`` (80 ms round trips): the lossless ring's 1.0 s bounds the direct one at 0.33 s on 4 ranks, within 2x of
    the best figure (the direct lossy path's 0.34 s), so its probe runs and the window is the one without the bound."""
    from dgt.shim.chooser import LOSSLESS_DIRECT, LOSSY_DIRECT, SCREEN_ORDER

    wan = {LOWRANK: 0.32, LOSSY_DIRECT: 0.34, LOSSY: 0.95, LOSSLESS: 1.0, LOSSLESS_DIRECT: 0.5}
    with_world = DropChooser(start=2, hold=50, modes=SCREEN_ORDER, world=4)
    without = DropChooser(start=2, hold=50, modes=SCREEN_ORDER)
    a = _run_screened(with_world, range(0, 17), lambda it, m: wan[m])
    b = _run_screened(without, range(0, 17), lambda it, m: wan[m])
    assert a == b and a.count(LOSSLESS_DIRECT) == 4
    assert with_world.decisions[0]["chosen"] == without.decisions[0]["chosen"] == LOSSY_DIRECT


def test_screening_on_loopback_keeps_the_slow_iterations_few():
    """Loopback, 2 ranks (no bottleneck): the warm-up's lossless figure screens out the low-rank and the lossy path
    after one iteration each; the lossless path is probed in full and kept. 2 slow iterations instead of 8."""
    secs = {LOSSLESS: 0.008, LOSSY: 0.025, LOWRANK: 0.040}
    ch = DropChooser(start=2, modes=(LOWRANK, LOSSY, LOSSLESS))
    modes = _run_screened(ch, range(0, 8), lambda it, m: secs[m])
    assert modes == ["warmup"] * 2 + [LOWRANK, LOSSY] + [LOSSLESS] * 4
    assert ch.decisions[0]["chosen"] == LOSSLESS and ch.decisions[0]["cut"] == [LOWRANK, LOSSY]
    assert ch.decisions[0]["iter"] == 7


def test_a_cold_first_iteration_within_the_factor_is_not_cut():
    """The lossy path's first iteration at 40 Mbit takes 1.3-1.6x its later ones: a path that would win is not cut
    by its cold start (0.3 s against the warm-up's 0.2 s lossless), and DDP's own first iteration (iteration 0:
    bucket rebuild) is never a figure."""
    ch = DropChooser(start=2, modes=(LOSSY, LOSSLESS))
    first = {0: 5.0, 2: 0.3}
    modes = _run_screened(ch, range(0, 10), lambda it, m: first.get(it, 0.2 if m == LOSSLESS else 0.15))
    assert modes == ["warmup"] * 2 + [LOSSY] * 4 + [LOSSLESS] * 4
    assert ch.chosen == LOSSY and "cut" not in ch.decisions[0]
    # screening needs another figure: with no warm-up (start 0) the first probe runs in full
    ch = DropChooser(start=0, modes=(LOSSY, LOSSLESS))
    assert not ch.screening(0) and not ch.screening(1)
    with pytest.raises(ValueError, match="screen > 1"):
        DropChooser(screen=1.0)


def test_probe_window_then_the_faster_path_holds():
    # (skip=inf: the losing path re-probed after every hold; test_a_path_that_lost_by_far_sits_out_one_reprobe)
    ch = DropChooser(probe=3, settle=0, gain=0.9, hold=5, hold_max=20, start=2, skip=math.inf)
    modes = _run(ch, range(2, 10), lambda it, m: 0.010 if m == LOSSLESS else 0.030)  # loopback: dropping costs
    assert modes[:6] == [LOSSLESS] * 3 + [LOSSY] * 3
    assert modes[6:] == [LOSSLESS] * 2 and ch.chosen == LOSSLESS
    assert ch.decisions[0] == {"iter": 7, "lossless_s": pytest.approx(0.010), "lossy_s": pytest.approx(0.030),
                               "chosen": LOSSLESS, "hold": 5}
    # at a bottleneck the lossy path wins
    ch2 = DropChooser(probe=3, settle=0, gain=0.9, hold=5, start=0)
    _run(ch2, range(6), lambda it, m: 0.25 if m == LOSSLESS else 0.15)
    assert ch2.chosen == LOSSY and ch2.mode(6) == LOSSY


def test_gain_margin_keeps_lossless_when_dropping_barely_pays():
    ch = DropChooser(probe=2, settle=0, gain=0.9, hold=4, start=0)
    _run(ch, range(4), lambda it, m: 0.100 if m == LOSSLESS else 0.095)  # 5 % faster: not worth the drops
    assert ch.chosen == LOSSLESS
    ch = DropChooser(probe=2, settle=0, gain=0.9, hold=4, start=0)
    _run(ch, range(4), lambda it, m: 0.100 if m == LOSSLESS else 0.085)
    assert ch.chosen == LOSSY


def test_median_ignores_one_slow_probe_iteration():
    ch = DropChooser(probe=3, settle=0, hold=4, start=0)
    slow_first = {3: 0.5}  # the first lossy iteration pays for a cold deadline: one outlier
    _run(ch, range(6), lambda it, m: slow_first.get(it, 0.2 if m == LOSSLESS else 0.1))
    assert ch.chosen == LOSSY


def test_settling_iterations_after_a_switch_are_not_timed():
    # the first iteration on a path is cold (measured at 40 Mbit: the first lossy step 0.24-0.30 s, then 0.17-0.19 s)
    ch = DropChooser(probe=3, settle=1, gain=0.9, hold=5, start=2)
    cold = {2: 0.9, 6: 0.9}  # each path's first iteration in the window
    modes = _run(ch, range(2, 12), lambda it, m: cold.get(it, 0.20 if m == LOSSLESS else 0.15))
    assert modes[:8] == [LOSSLESS] * 4 + [LOSSY] * 4
    assert ch.decisions[0]["iter"] == 9 and ch.decisions[0]["lossy_s"] == pytest.approx(0.15)
    assert ch.chosen == LOSSY
    # the re-probe: settle + probe iterations of the other path, 5 iterations after the decision
    assert ch.window_start == 15 and ch.window == [LOSSLESS] * 4 and ch.timed == [False, True, True, True]
    ch2 = DropChooser(probe=3, settle=0, gain=0.9, hold=5, start=2)  # without settling the cold iteration counts
    _run(ch2, range(2, 8), lambda it, m: {2: 0.9, 5: 0.9, 6: 0.19}.get(it, 0.20 if m == LOSSLESS else 0.15))
    assert ch2.chosen == LOSSLESS  # lossy median 0.19 > 0.9 * 0.20


def test_reprobe_follows_a_changing_network_and_the_hold_doubles_while_the_choice_stands():
    ch = DropChooser(probe=2, settle=0, gain=0.9, hold=3, hold_max=12, start=0, skip=math.inf)
    # the link is the bottleneck until iteration 40 (lossy faster), then it is not (lossless faster)
    modes = _run(ch, range(80), lambda it, m: (0.2 if m == LOSSLESS else 0.1) if it < 40 else
                 (0.05 if m == LOSSLESS else 0.15))
    first = ch.decisions[0]
    assert first["iter"] == 3 and first["chosen"] == LOSSY
    # re-probes of the other path (lossless, 2 iterations) after holds of 3, 6, 12, 12... while lossy stands
    holds = [d["hold"] for d in ch.decisions]
    assert holds[:4] == [3, 6, 12, 12]
    assert modes[4:7] == [LOSSY] * 3 and modes[7:9] == [LOSSLESS] * 2
    # after iteration 40 the next re-probe sees lossless win; from then on lossless holds
    flip = next(d for d in ch.decisions if d["chosen"] == LOSSLESS)
    assert 40 <= flip["iter"] < 40 + 12 + 2 + 1
    assert flip["hold"] == 3
    assert ch.chosen == LOSSLESS and modes[-1] in (LOSSLESS, LOSSY)
    assert ch.iters[LOSSLESS] + ch.iters[LOSSY] == 80
    # the agreed figures compare the re-probed path with the chosen one's last iterations before the window
    assert flip["lossless_s"] == pytest.approx(0.05) and flip["lossy_s"] == pytest.approx(0.15)


def test_a_path_that_lost_by_far_sits_out_one_reprobe():
    """A mode whose figure was more than ``skip`` (2) times the chosen one's sits out the next re-probe: at 40 Mbit
    the lossless paths take 2-2.5x the lossy ones per iteration, and each lossless probe iteration costs that much.
    The modes that were close are re-probed as before, the skipped ones in the window after; with two modes and
    the other one skipped, the hold doubles once more instead."""
    from dgt.shim.chooser import ALL_MODES, LOSSLESS_DIRECT, LOSSY_DIRECT

    secs = {LOSSLESS: 0.25, LOSSLESS_DIRECT: 0.24, LOSSY: 0.10, LOSSY_DIRECT: 0.11}
    ch = DropChooser(probe=1, settle=0, hold=4, hold_max=64, start=0, modes=ALL_MODES)
    _run(ch, range(4), lambda it, m: secs[m])
    first = ch.decisions[0]
    assert first["chosen"] == LOSSY and first["skip_next"] == [LOSSLESS, LOSSLESS_DIRECT] and first["hold"] == 4
    assert ch.window_start == 8 and ch.window == [LOSSY_DIRECT]  # only the close one, after the hold
    _run(ch, range(4, 9), lambda it, m: secs[m])
    second = ch.decisions[1]
    assert second["iter"] == 8 and second["chosen"] == LOSSY and "skip_next" not in second
    assert math.isnan(second["seconds"][LOSSLESS])  # it sat out: no figure, so it is not skipped again
    assert ch.window_start == 8 + 1 + 8 and ch.window == [LOSSLESS, LOSSLESS_DIRECT, LOSSY_DIRECT]
    # the network changes: the lossy-direct path becomes the fastest; found at the next re-probe of the close mode
    secs[LOSSY_DIRECT] = 0.05
    _run(ch, range(9, 20), lambda it, m: secs[m])
    assert ch.decisions[2]["chosen"] == LOSSY_DIRECT and ch.decisions[2]["skip_next"] == [LOSSLESS, LOSSLESS_DIRECT]
    # two modes (2 ranks): lossless lost by 2.5x, so the re-probe comes after two holds instead of one
    ch2 = DropChooser(probe=1, settle=0, hold=4, hold_max=64, start=0)
    _run(ch2, range(2), lambda it, m: secs[m])
    assert ch2.chosen == LOSSY and ch2.decisions[0]["hold"] == 8 and ch2.window_start == 1 + 1 + 8
    assert ch2.window == [LOSSLESS]
    # within the factor: re-probed after one hold (2.0x is not more than 2)
    ch3 = DropChooser(probe=1, settle=0, hold=4, start=0)
    _run(ch3, range(2), lambda it, m: 0.2 if m == LOSSLESS else 0.1)
    assert ch3.chosen == LOSSY and ch3.decisions[0]["hold"] == 4 and "skip_next" not in ch3.decisions[0]
    with pytest.raises(ValueError):
        DropChooser(skip=1.0)


def test_when_every_other_path_lost_by_far_only_the_nearest_is_reprobed():
    """The low-rank path against DGT's four on a bottleneck (GPT at 40 Mbit, fifo: lossless 1.9-2.1 s, lossy
    0.74-1.07 s, low rank 0.18 s weighed 1.5x): every other path lost by more than ``skip``. The re-probe then runs
    only the nearest (the one that would win first if the network changed), after a doubled hold, instead of all
    four (8 lossless iterations of 2 s each in that run); the ones that sat out are re-probed one window later."""
    from dgt.shim.chooser import ALL_MODES, LOSSLESS_DIRECT, LOSSY_DIRECT

    modes = ALL_MODES + (LOWRANK,)
    secs = {LOSSLESS: 1.9, LOSSLESS_DIRECT: 2.1, LOSSY: 1.03, LOSSY_DIRECT: 1.07, LOWRANK: 0.18}
    ch = DropChooser(probe=1, settle=0, hold=4, hold_max=64, start=0, modes=modes)
    _run(ch, range(5), lambda it, m: secs[m])
    first = ch.decisions[0]
    assert first["chosen"] == LOWRANK and set(first["skip_next"]) == set(ALL_MODES)
    assert first["hold"] == 8 and ch.window_start == 5 + 8 and ch.window == [LOSSY]  # the nearest only
    _run(ch, range(5, 14), lambda it, m: secs[m])
    second = ch.decisions[1]
    assert second["iter"] == 13 and second["chosen"] == LOWRANK and second["skip_next"] == [LOSSY]
    assert math.isnan(second["seconds"][LOSSLESS]) and second["hold"] == 16
    # the three that sat out have no figure, so they are not far: the window after re-probes them, not LOSSY again
    assert ch.window_start == 14 + 16 and ch.window == [LOSSLESS, LOSSLESS_DIRECT, LOSSY_DIRECT]
    # the network changes while low rank holds: the lossy path is now the fastest and wins at that window
    secs.update({LOSSY: 0.1, LOSSY_DIRECT: 0.09})
    modes_run = _run(ch, range(14, 33), lambda it, m: secs[m])
    assert modes_run[-3:] == [LOSSLESS, LOSSLESS_DIRECT, LOSSY_DIRECT]
    assert ch.decisions[2]["chosen"] == LOSSY_DIRECT and ch.mode(33) == LOSSY_DIRECT
    # two modes: the same rule re-probes the one other path (after a doubled hold), as before
    ch2 = DropChooser(probe=1, settle=0, hold=4, hold_max=64, start=0)
    _run(ch2, range(2), lambda it, m: 0.25 if m == LOSSLESS else 0.1)
    assert ch2.window == [LOSSLESS] and ch2.decisions[0]["hold"] == 8


def test_nan_figures_keep_the_choice_and_bad_settings_are_refused():
    ch = DropChooser(probe=1, settle=0, hold=2, start=0)
    _run(ch, range(2), lambda it, m: 0.2 if m == LOSSLESS else 0.1)
    assert ch.chosen == LOSSY
    ch.decide(5, [math.nan, 0.1])
    assert ch.chosen == LOSSY
    with pytest.raises(ValueError):
        DropChooser(probe=0)
    with pytest.raises(ValueError):
        DropChooser(hold=10, hold_max=5)
    with pytest.raises(ValueError):
        DropChooser(settle=-1)


def test_the_low_rank_mode_is_weighed_by_its_steps_prior():
    """A low-rank iteration counts lowrank_steps (default 1.5) times its seconds: it needs more steps to target."""
    modes = (LOSSLESS, LOSSY, LOWRANK)
    secs = {LOSSLESS: 1.0, LOSSY: 0.8, LOWRANK: 0.5}
    ch = DropChooser(probe=1, settle=0, hold=4, start=0, modes=modes)
    assert ch.lowrank_steps == 1.5
    assert _run(ch, range(3), lambda it, m: secs[m]) == list(modes)
    d = ch.decisions[0]
    assert ch.chosen == LOWRANK  # 0.5 x 1.5 = 0.75 < 0.8 (lossy) and < 0.9 x 1.0 (lossless)
    assert d["lowrank_weighed_s"] == pytest.approx(0.75) and d["seconds"][LOWRANK] == pytest.approx(0.5)
    ch = DropChooser(probe=1, settle=0, hold=4, start=0, modes=modes, lowrank_steps=1.7)
    _run(ch, range(3), lambda it, m: secs[m])
    assert ch.chosen == LOSSY  # 0.85 > 0.8
    # against the lossless path alone it must still clear the gain: 0.62 x 1.5 = 0.93 > 0.9
    ch = DropChooser(probe=1, settle=0, hold=4, start=0, modes=(LOSSLESS, LOWRANK))
    _run(ch, range(2), lambda it, m: 1.0 if m == LOSSLESS else 0.62)
    assert ch.chosen == LOSSLESS
    ch = DropChooser(probe=1, settle=0, hold=4, start=0, modes=(LOSSLESS, LOWRANK))
    _run(ch, range(2), lambda it, m: 1.0 if m == LOSSLESS else 0.58)
    assert ch.chosen == LOWRANK and ch.mode(2) == LOWRANK and ch.iters[LOWRANK] == 1
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="lowrank_steps"):
            DropChooser(modes=modes, lowrank_steps=bad)
    with pytest.raises(ValueError, match="at least one lossless"):
        DropChooser(modes=(LOSSY, LOWRANK))


def test_state_chooser_lowrank_adds_the_low_rank_path():
    import pickle

    from dgt.codecs.lowrank import LowRankCodec
    from dgt.shim import DGTState
    from dgt.shim.state import CHOOSER_LOW_RANK

    st = DGTState(chooser="lowrank")  # (in the screened window's order: the paths that win on a bottleneck first)
    assert st.chooser.modes == (LOWRANK, LOSSY, LOSSLESS) and st.chooser.start == 1
    assert isinstance(st.lowrank_codec, LowRankCodec) and st.lowrank_codec.name == "lowrank"
    assert CHOOSER_LOW_RANK == "lowrank:rank=4,min_ratio=2,wire=bf16" and st.lowrank_codec.rank == 4
    assert st.lowrank_codec.wire_dtype == torch.bfloat16
    assert st.needs_shapes and not st.low_rank and st.wire_dtype == torch.float16
    # the README line's DGTState() is that chooser; chooser=True is lossless and lossy DGT only (the default before)
    plain = DGTState()
    assert plain.chooser.modes == (LOWRANK, LOSSY, LOSSLESS) and plain.needs_shapes
    assert isinstance(plain.lowrank_codec, LowRankCodec) and plain.lowrank_codec.rank == 4
    two = DGTState(chooser=True)
    assert two.lowrank_codec is None and not two.needs_shapes and LOWRANK not in two.chooser.modes
    # the parameter server cannot run the low-rank path: its default chooser leaves it out, asking for it is refused
    ps = DGTState(collective="ps")
    assert ps.chooser.modes == (LOSSY, LOSSLESS) and ps.lowrank_codec is None
    assert DGTState(chooser="lowrank", warmup_iters=5).chooser.start == 5
    assert DGTState(warmup_iters=5).chooser.start == 5
    # a DropChooser given with the mode gets the codec too; a lossless codec has nothing to choose
    assert DGTState(chooser=DropChooser(modes=(LOSSLESS, LOWRANK))).lowrank_codec is not None
    dense = DGTState(codec="dense", chooser="lowrank")
    assert dense.chooser is None and dense.lowrank_codec is None
    with pytest.raises(ValueError, match="collective 'ring', 'direct' or 'auto'"):
        DGTState(chooser="lowrank", collective="ps")
    with pytest.raises(ValueError, match="'auto' or 'lowrank'"):
        DGTState(chooser="fastest")
    back = pickle.loads(pickle.dumps(st))
    assert back.chooser.modes == st.chooser.modes and isinstance(back.lowrank_codec, LowRankCodec)
    assert back._lowrank is None


def test_default_state_chooses_and_an_explicit_codec_does_not():
    from dgt.shim import DGTState

    assert isinstance(DGTState().chooser, DropChooser)
    assert DGTState().chooser.start == 1  # governs the iterations after the dense warm-up (DDP's first iteration)
    assert DGTState(codec="dgt:p=0.3").chooser is None
    assert DGTState(codec="dgt:p=0.3", chooser=True).chooser is not None
    assert DGTState(codec="dense", chooser=True).chooser is None  # nothing to choose
    assert DGTState(chooser=False).chooser is None


@pytest.mark.parametrize("spec", ["dgt:idle_p=0.1", "dgt:idle_p=0.10", "dgt: idle_p = 0.1", "dgt:idle_p=1e-1"])
def test_the_default_is_recognised_by_its_parsed_spec_not_its_text(spec):
    """Issue 41 (5): the chooser and the fp16 wire follow the default codec's meaning, not its spelling."""
    from dgt.shim import DGTState
    from dgt.shim.state import is_default_codec

    st = DGTState(codec=spec)
    assert is_default_codec(spec)
    assert isinstance(st.chooser, DropChooser) and st.wire_dtype == torch.float16
    for other in ("dgt:idle_p=0.2", "dgt", "dgt:idle_p=0.1,p=0.3", "dense", "nonsense:x"):
        assert not is_default_codec(other)
    assert DGTState(codec="dgt:idle_p=0.2").chooser is None and DGTState(codec="dgt:idle_p=0.2").wire_dtype is None


def test_the_example_runs_the_readme_line_by_default():
    """Issue 41 (5): examples/ddp_dgt.py with no options builds DGTState() (chooser, fp16 wire), as the README's
    one line; an explicit --codec is used as given."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "ddp_dgt.py"
    spec = importlib.util.spec_from_file_location("ddp_dgt_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from dgt.shim import DGTState

    st, readme = mod.make_state(mod.parse_args([])), DGTState()
    assert isinstance(st.chooser, DropChooser) and st.wire_dtype == torch.float16
    assert (st.collective, st.warmup_iters, st.transport) == (readme.collective, readme.warmup_iters, None)
    assert type(st.codec) is type(readme.codec)
    explicit = mod.make_state(mod.parse_args(["--codec", "dgt:p=0.3", "--collective", "ps", "--drop", "0.1"]))
    assert explicit.chooser is None and explicit.wire_dtype is None and explicit.collective == "ps"
    assert explicit.transport == {"faults": {"drop_fraction": 0.1}}


# -- loopback: the ranks switch paths and the results stay right -------------------------------------------------
class Scripted(DropChooser):
    """Real rounds, scripted timings: lossy looks faster until iteration 6, slower after; each rank reports its own
    figures, so the decision rests on their agreed mean."""

    def observe(self, it: int, seconds: float, last: bool) -> None:
        fast, slow = 0.01, 0.05
        lossy_fast = it < 6
        mode = self.mode(it)
        t = fast if (mode == LOSSY) == lossy_fast else slow
        super().observe(it, t * (1 + 0.1 * RANK[0]), last)  # the ranks disagree a little


RANK = [0]
ITERS = 14
SIZES = (3000, 20000)  # two buckets per iteration


def _bucket(rank: int, it: int, b: int) -> torch.Tensor:
    return torch.randn(SIZES[b], generator=torch.Generator().manual_seed(1000 * it + 10 * b + rank))


def _switching_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dgt.shim import DGTState
    from dgt.shim.hook import submit

    RANK[0] = rank
    dist.init_process_group("gloo", rank=rank, world_size=world)
    st = DGTState(codec="dgt:p=0.3", warmup_iters=1, transport={"drop_fraction": 0.3, "drop_seed": rank},
                  chooser=Scripted(probe=1, hold=2, hold_max=2, start=1))
    out: dict = {"results": [], "modes": []}
    for it in range(ITERS):
        # the previous iteration's rounds are done, so its decision (if any) is in: this is the path it runs
        out["modes"].append(st.chooser.mode(it) if it >= 1 else "warmup")
        futs = [submit(st, _bucket(rank, it, b), b, use_codec=it >= 1, it=it, last=b == len(SIZES) - 1)
                for b in range(len(SIZES))]
        out["results"].append([f.wait() for f in futs])
    out["decisions"] = st.chooser.decisions
    out["world"] = st.chooser.world  # (set by the state on its first call: the direct modes' bound)
    out["totals"] = dict(st.totals)
    st.close()
    dist.destroy_process_group()
    return out


def test_ranks_switch_paths_together_and_lossless_rounds_stay_exact():
    res = run_ranks(_switching_rank, 2, timeout=120)
    r0, r1 = res[0], res[1]
    assert repr(r0["decisions"]) == repr(r1["decisions"]), "both ranks decide on the same agreed figures (NaN-safe)"
    assert r0["modes"] == r1["modes"] and r0["world"] == r1["world"] == 2
    chosen = [d["chosen"] for d in r0["decisions"]]
    assert LOSSY in chosen and LOSSLESS in chosen and chosen.index(LOSSY) < len(chosen) - 1 - chosen[::-1].index(
        LOSSLESS), f"a switch to lossy and back: {chosen}"
    # the re-probes of the path that is 5x slower were cut after their first iteration, on both ranks alike
    assert any(d.get("cut") for d in r0["decisions"]), r0["decisions"]
    # per iteration: two buckets of 0.01 (rank 0) and 0.011 (rank 1) s, averaged over the ranks
    assert r0["decisions"][0]["lossy_s"] == pytest.approx(2 * 0.0105, rel=1e-5)
    dropped = 0
    for it in range(ITERS):
        for b in range(len(SIZES)):
            exact = (_bucket(0, it, b) + _bucket(1, it, b)) / 2
            a, c = r0["results"][it][b], r1["results"][it][b]
            assert torch.equal(a, c), f"iteration {it} bucket {b}: the ranks' results differ"
            assert torch.isfinite(a).all()
            if r0["modes"][it] in ("warmup", LOSSLESS):
                torch.testing.assert_close(a, exact, rtol=1e-6, atol=1e-6)  # lossless after lossy: exact
            elif not torch.allclose(a, exact, rtol=1e-6, atol=1e-6):
                dropped += 1
    assert dropped > 0, "the lossy iterations dropped blocks (30 % datagram loss)"
    assert r0["totals"]["choice"]["iters"][LOSSY] > 0 and r0["totals"]["choice"]["iters"][LOSSLESS] > 0


def test_ddps_first_iteration_opens_the_connections_of_the_direct_paths():
    """DGTState.open_paths (called by the hook in iteration 0 before it starts the clock: that iteration's time is
    the lossless ring's first figure): with a path on the direct all-reduce among the chooser's modes it connects to
    every other rank, so no probe iteration pays for a handshake (on the `lossy` profile a lost handshake packet made
    the low-rank path's first iteration 0.7-1.1 s); with ring paths only, to the ring's two neighbours (so the
    warm-up's figure has no handshake in it either); the parameter server's, or no chooser: nothing."""
    import trio

    from dgt.shim import DGTState
    from dgt.shim.chooser import ALL_MODES, screen_order

    class Group:
        world, rank = 4, 1

        def __init__(self) -> None:
            self.calls: list[list[int]] = []

        async def links(self, peers) -> None:
            self.calls.append(list(peers))

    default = DGTState()
    default.chooser.offer(screen_order(ALL_MODES + (LOWRANK,)))  # what collectives() offers on 4 ranks
    ring_only = DGTState(collective="ring", chooser=True)
    lowrank_auto = DGTState()  # 2 ranks: no direct DGT modes, but the low-rank path's P and Q go direct
    lowrank_ring = DGTState(collective="ring")  # the low-rank path on the ring
    got = {}
    for name, st in {"default": default, "ring_only": ring_only, "lowrank_auto": lowrank_auto,
                     "lowrank_ring": lowrank_ring, "none": DGTState(chooser=None),
                     "ps": DGTState(collective="ps")}.items():
        g = Group()
        trio.run(st.open_paths, g)
        got[name] = [sorted(c) for c in g.calls]
    assert got == {"default": [[0, 2, 3]], "ring_only": [[0, 2]], "lowrank_auto": [[0, 2, 3]],
                   "lowrank_ring": [[0, 2]], "none": [], "ps": []}


def test_a_chooser_pickled_before_skip_and_screen_loads_with_their_defaults():
    import pickle

    ch = DropChooser(start=2, modes=(LOWRANK, LOSSY, LOSSLESS))
    old = pickle.loads(pickle.dumps(ch))
    for name in ("skip", "screen", "_first", "_cut"):  # fields added after the chooser's first checkpoints
        del old.__dict__[name]
    back = pickle.loads(pickle.dumps(old))
    assert back.skip == 2.0 and back.screen == 2.0 and back._first == {} and back._cut == []
    assert back == ch and back.window == ch.window and back.mode(2) == LOWRANK
