"""Whether dropping blocks pays, decided from measurement: the default hook's lossless fallback.

Dropping blocks saves link time only where the link is the bottleneck. Where it is not (loopback, a fast LAN), the
lossy path costs more than it saves: the codec's classification, the datagram lanes and the receivers' wait for
droppable blocks come on top of a round the reliable lane would have carried faster. :class:`DropChooser` times the
rounds of both paths and keeps the faster one:

- after the dense warm-up, a **probe window** runs ``settle + probe`` iterations lossless, then ``settle + probe``
  lossy, and times the last ``probe`` of each (the first iteration after a switch pays for a cold path: the lossy
  path's deadline and pacing learn over its first rounds; measured at 40 Mbit: 0.24-0.30 s against 0.17-0.19 s);
- at the window's last iteration every rank contributes the median seconds per iteration it measured for each path
  (the sum of its collective times over the iteration's buckets); the ranks **agree** on the mean over ranks (one
  tiny all-reduce on the reliable lane, whose result is bit-identical on every rank), and the lossy path is chosen
  when its agreed median is below ``gain`` times the lossless one (dropping blocks also costs some accuracy per step,
  so it must buy a clear speed-up);
- the choice holds for ``hold`` iterations, timed all along; then a **re-probe** runs ``settle + probe`` iterations
  of the other path and compares the last ``probe`` with the last ``probe`` iterations of the chosen one. While the
  choice stands the hold doubles (up to ``hold_max``); when it flips it falls back to ``hold``;
- a path whose agreed figure was more than ``skip`` (2) times the chosen one's **sits out the next re-probe**: its
  probe iterations cost the most and it is the least likely to win (at 40 Mbit the lossless paths take 2-2.5x the
  lossy one per iteration). It is re-probed one window later (a path that sat out has no figure, so it is never
  skipped twice in a row). When every other path lost by that much (two paths at 40 Mbit; the low-rank path against
  all four of DGT's on a bottleneck: GPT at 40 Mbit, 3.8x and 7-8x its weighed time per iteration), only the nearest of
  them is re-probed, and after a doubled hold: a re-probe is there to notice that the network changed, and the
  nearest path is the one that would win first. When a window had no figure for the other side, the fastest path on
  the chosen one's side is kept.

With ``LOWRANK`` among the modes (``DGTState()``'s default, ``chooser="lowrank"``; ``chooser=True`` leaves it out)
the chooser also times the low-rank path (PowerSGD's P/Q factors, :class:`~dgt.collectives.lowrank.LowRankAllReduce`
on the direct all-reduce).
Its seconds per iteration are weighed by ``lowrank_steps`` before the comparison: a low-rank step carries less of the
gradient, so it needs more of them to the same accuracy. ``lowrank_steps`` is a prior, not a measurement of this run
(the hook sees no loss): PowerSGD rank 1 needed 1.26-1.70x Gloo's steps to target on the three model families
(docs/experiment-ddp.md), and the DGT lossy path about 1.0x. Low rank is treated as a lossy mode (it must also beat
``gain`` times the lossless baseline).

With ``modes`` naming more paths (the hook's ``collective="auto"`` on 3 or more ranks adds the direct all-reduce,
lossless and lossy: ``LOSSLESS_DIRECT``, ``LOSSY_DIRECT``), a window probes every mode and a re-probe every mode but
the chosen one; the decision takes the fastest lossless mode as the baseline and the fastest lossy mode, which wins
when it is below ``gain`` times that baseline (so between two lossless schedules the faster one is kept, and
dropping must still buy a clear speed-up).

**Screening** (``screen``, 2; ``math.inf``: off): the first iteration of each probe in a window is a screening
point, at which the ranks agree on their figures so far (the same tiny all-reduce); a path whose figure is more than
``screen`` times the best other one is cut short there, and a later probe whose path already has a figure that far
behind is dropped from the window. Its first iteration is cold, so that figure overestimates it, but by less than
``screen`` (the lossy path's first iteration at 40 Mbit: 1.3-1.6x its later ones), so a path that would win the
window is not cut. The dense warm-up's last iteration gives the lossless ring its first figure (the default's
warm-up is DDP's first iteration alone, whose connections the hook opens before it starts the clock: AlexNet at
40 Mbit 0.25 s against 0.21 s for the next dense iteration, a cold figure too), and the default windows run the
paths that win on a bottleneck first (``SCREEN_ORDER``: low rank, lossy direct, lossy, then lossless), so the
cheapest figure is known early. The direct lossy path goes before the ring's:
on a bottleneck the two are level (AlexNet at 40 Mbit, ``fifo``: 0.136 s and 0.137 s per iteration), on a long lossy
path (``wan``: 80 ms round trips, 0.5 % loss per link direction) the direct one takes a third of the ring's time
(0.31-0.40 s against 0.81-1.0 s), and probed first it cuts the ring's probe after one iteration, which the low-rank
path's weighed figure did not always do (4-5 ring iterations of ~1 s in 4 of 11 runs probed in the other order).
Measured in the default's first window at 40 Mbit on AlexNet (4 workers): lossless 0.21 s and lossless direct 0.27 s
per iteration, lossy 0.14 s, low rank 0.035 s; the full window's 20 iterations cost 3.2 s of collective time, about
2.5 s more than 20 low-rank ones. Screened, the window is the low-rank probe and one iteration of each other path
but the lossless ring (7 iterations). On loopback (no bottleneck) the warm-up's lossless figure screens the low-rank
path out after one iteration (``dgt bench ddp``: 65-67 ms against lossless 5-6 ms).

**The direct twin's bound** (``world``, set by the hook once it knows the group's size; 0: unknown). A direct mode
moves the same bytes per rank as its ring twin (``LOSSLESS_DIRECT`` and ``LOSSLESS``, ``LOSSY_DIRECT`` and ``LOSSY``)
in 2 rounds in series where the ring has ``2 (world - 1)``, so it takes at least ``1 / (world - 1)`` of the ring's
time: equal where bytes are the bottleneck, that fraction where every round waits on latency. Where a direct mode has
no figure yet and its twin has one, that bound stands in for it when a screening point weighs the later probes
(:meth:`cut`) and when :meth:`decide` picks the modes that sit out the next re-probe; it never enters a decision
(the chosen path is always a measured one). Measured on the first window at 40 Mbit on 4 workers, the lossless ring
took 0.21 s per iteration (AlexNet) and 2.0-2.1 s (GPT), the lossless direct all-reduce 0.24-0.30 s and 1.9-2.2 s, the
low-rank path 0.015-0.02 s and 0.11-0.12 s: the bound (0.07 s, 0.7 s) is beyond ``screen`` times the low-rank path's
weighed figure, so the lossless direct probe (one iteration of 0.24-0.30 s and ~2 s) is dropped from the window.

Every rank runs the same schedule (a function of the iteration number and the agreed decisions and cuts), so their
rounds line up. The class holds no clock and no network: :meth:`observe` takes measured seconds, :meth:`decide` and
:meth:`cut` the agreed figures, so its logic is tested with injected timings (tests/test_shim_chooser.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import MISSING, dataclass, field, fields

LOSSLESS, LOSSY = "lossless", "lossy"
LOSSLESS_DIRECT, LOSSY_DIRECT = "lossless-direct", "lossy-direct"  # the same on the direct all-reduce
LOWRANK = "lowrank"  # PowerSGD's rank-r factors (DGTState()'s default chooser): a lossy mode, weighed by lowrank_steps
LOSSY_MODES = frozenset({LOSSY, LOSSY_DIRECT, LOWRANK})
DIRECT_MODES = frozenset({LOSSLESS_DIRECT, LOSSY_DIRECT})
RING_TWIN = {LOSSLESS_DIRECT: LOSSLESS, LOSSY_DIRECT: LOSSY}  # a direct mode's ring twin: the same bytes, more rounds
ALL_MODES = (LOSSLESS, LOSSY, LOSSLESS_DIRECT, LOSSY_DIRECT)  # what collective="auto" offers on 3+ ranks
KNOWN_MODES = ALL_MODES + (LOWRANK,)
# the order of a screened window (DropChooser.screen): the paths that win on a bottleneck first, so that the cheapest
# figure is known early and the expensive paths' probes are cut after one iteration; the direct lossy path before the
# ring's (level on a bottleneck, 3x faster on a long lossy path); lossless last (its figure from the dense warm-up is
# there from the start)
SCREEN_ORDER = (LOWRANK, LOSSY_DIRECT, LOSSY, LOSSLESS, LOSSLESS_DIRECT)
DEFAULT_MODES = (LOWRANK, LOSSY, LOSSLESS)  # DGTState()'s chooser (chooser="lowrank"); collective="auto" adds direct
# the low-rank mode's prior: its steps to target relative to the other paths' (PowerSGD rank 1 against Gloo, medians of
# 3 seeds at 40 Mbit: ResNet 146/116 = 1.26x, GPT 252/148 = 1.70x; AlexNet/digits 180/136 = 1.32x, one seed)
LOWRANK_STEPS = 1.5
# a mode whose figure was more than SKIP times the chosen one's sits out the next re-probe (see DropChooser.decide)
SKIP = 2.0
# a probe whose first iteration took more than SCREEN times the best figure so far is cut short (DropChooser.cut)
SCREEN = 2.0


def screen_order(modes: tuple[str, ...]) -> tuple[str, ...]:
    """``modes`` in :data:`SCREEN_ORDER` (the order of the default's probe windows)."""
    return tuple(m for m in SCREEN_ORDER if m in modes)


@dataclass
class DropChooser:
    """Chooses between the lossless and the lossy path per iteration (see the module docstring).

    ``screen``: a probe whose first iteration's figure is more than this times the best other figure is cut short
    (``math.inf``: every probe runs in full).
    ``start``: the first iteration it governs (the hook's ``warmup_iters``; earlier iterations are dense anyway).
    ``modes``: the paths it chooses between, in this order in a probe window (the default's: ``SCREEN_ORDER``).
    ``lowrank_steps``: the weight of the ``LOWRANK`` mode's seconds per iteration in the decision (module docstring).
    ``world``: the group's size (the hook sets it on its first call; 0: unknown): bounds a direct mode's figure by its
    ring twin's (module docstring, "The direct twin's bound").
    """

    probe: int = 3
    settle: int = 1
    gain: float = 0.9
    hold: int = 50
    hold_max: int = 800
    start: int = 0
    modes: tuple[str, ...] = (LOSSLESS, LOSSY)
    lowrank_steps: float = LOWRANK_STEPS
    skip: float = SKIP
    screen: float = SCREEN
    world: int = 0
    chosen: str | None = None  # None until the first window was decided
    window_start: int = -1  # the current (or next) probe window: its first iteration and its modes
    window: list[str] = field(default_factory=list)
    timed: list[bool] = field(default_factory=list)  # per window iteration: whether it is sampled (not settling)
    _hold: int = 0
    _samples: dict[str, list[float]] = field(default_factory=dict)  # this window's per-iteration seconds
    _recent: list[float] = field(default_factory=list)  # the chosen path's last ``probe`` iterations outside windows
    _first: dict[str, float] = field(default_factory=dict)  # this window's first (screened) iteration of each mode
    _cut: list[str] = field(default_factory=list)  # the modes whose probe this window cut short
    _acc: dict[int, float] = field(default_factory=dict)  # seconds so far of iterations not yet complete
    decisions: list[dict] = field(default_factory=list)
    iters: dict[str, int] = field(default_factory=lambda: {LOSSLESS: 0, LOSSY: 0})

    def __post_init__(self) -> None:
        if (self.probe < 1 or self.settle < 0 or self.hold < 1 or self.hold_max < self.hold or not 0 < self.gain
                or not 0 < self.lowrank_steps < math.inf or not self.skip > 1 or not self.screen > 1):
            raise ValueError("DropChooser needs probe >= 1, settle >= 0, 1 <= hold <= hold_max, gain > 0, a finite "
                             "lowrank_steps > 0, skip > 1 and screen > 1 (math.inf: never skip, never screen)")
        self.modes = tuple(self.modes)
        if (len(set(self.modes)) != len(self.modes) or not set(self.modes) <= set(KNOWN_MODES)
                or not any(m not in LOSSY_MODES for m in self.modes) or not any(m in LOSSY_MODES for m in self.modes)):
            raise ValueError(f"DropChooser modes: distinct, of {KNOWN_MODES}, at least one lossless and one lossy")
        if not self.window and self.chosen is None:
            self._plan(self.start, list(self.modes))
            self._hold = self.hold

    def __setstate__(self, state: dict) -> None:
        """Unpickle (a checkpoint of the hook's state): a chooser pickled before a field existed (``skip``,
        ``screen`` and their state) gets that field's default."""
        for f in fields(self):
            if f.name not in state:
                state[f.name] = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        self.__dict__.update(state)

    def offer(self, modes: tuple[str, ...]) -> bool:
        """Choose between ``modes`` instead, if no iteration was observed yet (the hook learns the world size on its
        first call); returns whether it took them. Every rank calls it at the same point, so windows stay aligned."""
        if self.chosen is not None or any(self.iters.values()) or self._acc or tuple(modes) == self.modes:
            return False
        old = self.modes
        self.modes = tuple(modes)
        try:
            self.__post_init__()
        except ValueError:
            self.modes = old
            raise
        self.window = []
        self._plan(self.start, list(self.modes))
        return True

    def _plan(self, first: int, modes: list[str]) -> None:
        """The probe window from iteration ``first``: ``settle`` untimed then ``probe`` timed iterations per mode."""
        self.window_start = first
        self.window = [m for m in modes for _ in range(self.settle + self.probe)]
        self.timed = [i >= self.settle for _ in modes for i in range(self.settle + self.probe)]

    # -- the schedule -------------------------------------------------------------------------------------------
    def mode(self, it: int) -> str:
        """The path of iteration ``it`` (>= ``start``): from the probe window, else the chosen one."""
        k = it - self.window_start
        if 0 <= k < len(self.window):
            return self.window[k]
        return self.chosen or LOSSLESS  # (before the first window: cannot happen for it >= start)

    def window_first(self, it: int) -> int | None:
        """The first iteration of the probe window that iteration ``it`` belongs to; None outside a window. (The
        hook's warm-up of p holds p at that iteration's value through a window, so every path is timed at one p.)"""
        return self.window_start if 0 <= it - self.window_start < len(self.window) else None

    def due(self, it: int) -> bool:
        """Whether iteration ``it`` closes a probe window: after its last bucket the ranks agree and decide."""
        return bool(self.window) and it == self.window_start + len(self.window) - 1

    # -- measurements -------------------------------------------------------------------------------------------
    def observe(self, it: int, seconds: float, last: bool) -> None:
        """One bucket's collective took ``seconds`` in iteration ``it``; ``last``: the iteration's last bucket."""
        self._acc[it] = self._acc.get(it, 0.0) + seconds
        if not last:
            return
        total = self._acc.pop(it)
        for old in [k for k in self._acc if k < it]:  # an iteration whose last bucket never came (cannot happen)
            del self._acc[old]
        if it < self.start:  # the dense warm-up (the lossless ring): its last iteration is lossless's first figure
            if it == self.start - 1 and self.chosen is None and LOSSLESS in self.modes:
                self._first[LOSSLESS] = total
            return
        mode = self.mode(it)
        self.iters[mode] = self.iters.get(mode, 0) + 1
        k = it - self.window_start
        if 0 <= k < len(self.window):
            if k == 0 or self.window[k - 1] != mode:
                self._first[mode] = total
            if self.timed[k]:
                self._samples.setdefault(mode, []).append(total)
        elif mode == self.chosen:
            self._recent = (self._recent + [total])[-self.probe :]

    def local(self) -> list[float]:
        """This rank's median seconds per iteration of each of ``modes`` ([lossless, lossy] by default) for the
        window that just closed (from the window's own timed iterations, else, for the chosen path, from its last
        iterations before the window, else the mode's first iteration in the window when its probe was cut short,
        or, for the lossless path in the first window, the last iteration of the dense warm-up)."""
        return [self._figure(mode) for mode in self.modes]

    def _figure(self, mode: str) -> float:
        """:meth:`local`'s figure for ``mode``; NaN when it has none."""
        xs = self._samples.get(mode) or (self._recent if mode == self.chosen else [])
        return statistics.median(xs) if xs else self._first.get(mode, math.nan)

    # -- screening: a probe cut short after its first iteration ------------------------------------------------
    def _later(self, k: int) -> list[str]:
        """The modes of the window after the block that window index ``k`` belongs to, in order."""
        return list(dict.fromkeys(m for m in self.window[k + 1 :] if m != self.window[k]))

    def _has_figure(self, mode: str) -> bool:
        """Whether :meth:`local` has a figure for ``mode`` now."""
        return not math.isnan(self._figure(mode))

    def _has_bound(self, mode: str) -> bool:
        """Whether ``mode`` has a figure now, or a lower bound from its ring twin's (:meth:`_bounded`)."""
        twin = RING_TWIN.get(mode)
        return self._has_figure(mode) or (self.world >= 3 and twin in self.modes and self._has_figure(twin))

    def _bounded(self, cost: dict[str, float]) -> dict[str, float]:
        """``cost`` with a direct mode that has no figure given its ring twin's divided by ``world - 1`` (a lower
        bound: the same bytes in 1/(world - 1) of the rounds in series); NaN where neither has one."""
        out = dict(cost)
        if self.world >= 3:
            for m, twin in RING_TWIN.items():
                if m in out and out[m] != out[m] and out.get(twin, math.nan) == out.get(twin, math.nan):
                    out[m] = out[twin] / (self.world - 1)
        return out

    def _weigh(self, agreed: list[float]) -> dict[str, float]:
        """What each mode's agreed seconds per iteration count for in :meth:`cut` and :meth:`decide`: the low-rank
        mode's weighed by its steps prior (``lowrank_steps``); NaN stays NaN (no figure)."""
        return {m: float(v) * self.lowrank_steps if m == LOWRANK else float(v) for m, v in zip(self.modes, agreed)}

    def screening(self, it: int) -> bool:
        """Whether iteration ``it`` is a screening point: the first iteration of a mode's probe in the current window
        (``screen`` finite), with a figure of another mode to compare it with and something left to cut (the rest of
        this probe, or a later probe whose mode has a figure already: the warm-up's lossless one). After its last
        bucket the ranks agree on :meth:`local` and call :meth:`cut`. A function of the schedule: every rank agrees
        at the same iterations."""
        k = it - self.window_start
        if self.screen == math.inf or not 0 <= k < len(self.window) or (k and self.window[k - 1] == self.window[k]):
            return False
        mode = self.window[k]
        rest = k + 1 < len(self.window) and self.window[k + 1] == mode
        others = any(self._has_figure(m) for m in self.modes if m != mode)
        return others and (rest or any(self._has_bound(m) for m in self._later(k)))

    def cut(self, it: int, agreed: list[float]) -> list[str]:
        """At a screening point ``it``, with the figures every rank agreed on (the mean of :meth:`local` over ranks):
        cut the probe of this iteration's mode short, and drop a later probe from the window, when that mode's
        figure (weighed, as in :meth:`decide`) is more than ``screen`` times the best other figure. A path that slow
        cannot win the window (its first iteration is cold, so its figure is an overestimate, but by less than
        ``screen``: the lossy path's first iteration at 40 Mbit takes 1.3-1.6x its later ones), and its probe
        iterations are the window's most expensive ones (at 40 Mbit on AlexNet: 0.21-0.27 s lossless against
        0.035 s low rank). A later direct probe without a figure is weighed by its ring twin's bound (module
        docstring). Returns the modes cut; the figure a cut mode keeps is its first iteration's (none for a probe
        dropped before it ran)."""
        k = it - self.window_start
        real = self._weigh(agreed)
        cost = self._bounded(real)
        cut = []
        for m in [self.window[k]] + self._later(k):
            others = [v for x, v in real.items() if x != m and v == v]  # measured figures only
            if cost[m] == cost[m] and others and cost[m] > self.screen * min(others):
                cut.append(m)
        if cut:
            keep = [i for i in range(len(self.window)) if i <= k or self.window[i] not in cut]
            self.window = [self.window[i] for i in keep]
            self.timed = [self.timed[i] for i in keep]
            self._cut += [m for m in cut if m not in self._cut]
        return cut

    # -- the decision -------------------------------------------------------------------------------------------
    def decide(self, it: int, agreed: list[float]) -> str:
        """Apply the figures every rank agreed on (the mean of :meth:`local` over ranks) at the close of the window
        ending at ``it``; plans the next window. Returns the chosen path."""
        secs = {m: float(v) for m, v in zip(self.modes, agreed)}
        cost = self._weigh(agreed)
        # the fastest lossless and the fastest lossy mode with a figure (a NaN: that mode has none)
        safe = min(((v, m) for m, v in cost.items() if m not in LOSSY_MODES and v == v), default=None)
        risky = min(((v, m) for m, v in cost.items() if m in LOSSY_MODES and v == v), default=None)
        if safe is not None and risky is not None:
            choice = risky[1] if risky[0] < self.gain * safe[0] else safe[1]
        elif self.chosen is not None and not math.isnan(cost.get(self.chosen, math.nan)):
            # the other side sat out this window (it lost by more than ``skip`` last time): the fastest mode on the
            # chosen path's side, the chosen one's own figure included
            side = risky if self.chosen in LOSSY_MODES else safe
            assert side is not None  # the chosen mode's own figure is on its side
            choice = side[1]
        else:  # (no figure on one side keeps the previous choice)
            choice = self.chosen or self.modes[0]
        if self.chosen is not None:
            self._hold = min(self.hold_max, self._hold * 2) if choice == self.chosen else self.hold
        # the modes that lost to the choice by more than ``skip`` sit out the next re-probe (a NaN figure, i.e. a
        # mode that sat out this one, is never far): they cost the most per probe iteration and are the least
        # likely to win; when all lost by that much only the nearest is re-probed, after the hold doubles once more
        others = [m for m in self.modes if m != choice]
        est = self._bounded(cost)  # (a direct mode dropped unprobed: its twin's bound)
        far = [m for m in others if est[m] > self.skip * est[choice]] if est.get(choice, math.nan) > 0 else []
        nxt = [m for m in others if m not in far]
        if not nxt:  # every other mode lost by far: only the nearest is re-probed, after a doubled hold
            measured = [m for m in others if cost[m] == cost[m]] or others  # (nearest by a measured figure first)
            nxt = [min(measured, key=lambda m: est[m])]
            self._hold = min(self.hold_max, self._hold * 2)
        entry = {"iter": it, "lossless_s": secs.get(LOSSLESS, math.nan), "lossy_s": secs.get(LOSSY, math.nan),
                 "chosen": choice, "hold": self._hold}
        if set(self.modes) != {LOSSLESS, LOSSY}:
            entry["seconds"] = secs
        if LOWRANK in secs:
            entry["lowrank_weighed_s"] = cost[LOWRANK]
        if far:
            entry["skip_next"] = far
        if self._cut:
            entry["cut"] = list(self._cut)
        self.decisions.append(entry)
        if choice != self.chosen:
            self._recent = []
        self.chosen = choice
        self._samples, self._first, self._cut = {}, {}, []
        self._plan(it + 1 + self._hold, nxt)
        return choice

    def summary(self) -> dict:
        """Iterations per path, the current choice and every decision (for statistics and reports)."""
        return {"chosen": self.chosen, "iters": dict(self.iters), "decisions": list(self.decisions)}
