"""Whether this host has CPU to spare for a lossy ring hop's unimportant datagrams, sans-IO.

DGT's unimportant blocks ride along only while they are free: the spare capacity of a path whose bottleneck is the
network (the paper's setting). On a host whose bottleneck is its CPU (more ranks than cores: 4 ranks on a 2-core
machine over loopback, or ranks whose cores the training itself keeps busy) they are not: every datagram costs both
ends CPU time the important blocks' transfer and the sums need, and the step takes longer by about that time. The
congestion controller cannot see this (no queue builds: a datagram is late because a process was not scheduled, not
because a link was full), and the slowdown of the important blocks it reads is drowned by the scheduling jitter of
such a host (issue 26: docs/transport.md, docs/history/transport-journal.md).

The direct measure is the kernel's: how long the thread that carries a hop's important blocks was *runnable but
waiting for a CPU* while they travelled (``/proc/thread-self/schedstat``, read at the I/O edge,
:func:`dgt.channels.hop_datagrams.runqueue_seconds`). On a host with a core to spare it is ~0 whatever the network
does; where the cores are all taken it is a large part of every transfer (~25 % of a hop's time on the 2-core VM
with 4 ranks). :class:`CpuGate` keeps an EWMA of that fraction and closes above ``threshold``: a closed gate makes
the hop's send budget zero (its unimportant blocks go straight into error feedback, as when the lane's rate is used
up), so nothing is sent that the CPU cannot afford. It reopens once the average falls under ``threshold * reopen``
(hysteresis: a host near the threshold does not flip every hop). The measure needs no datagram to be sent, so a
closed gate keeps measuring and reopens by itself when the cores free up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dgt.protocol.owner import owned


@owned
@dataclass
class CpuGate:
    """EWMA (weight ``alpha``) of the fraction of a transfer's time its thread waited for a CPU; closed above
    ``threshold``, open again under ``threshold * reopen``; it never closes before ``warm`` readings (a link's first
    transfers pay its start-up: slow start, first-touch page faults). Transfers shorter than ``min_span`` seconds
    are not read (the kernel's accounting is too coarse for them). ``closes``: how often it closed; ``gated``:
    rounds it kept from sending (counted by the caller through :meth:`admit`). It belongs to the endpoint's trio thread,
    which feeds it the readings the hops' worker thread returns (docs/architecture.md, Threads)."""

    threshold: float = 0.1
    alpha: float = 0.25
    reopen: float = 0.5
    warm: int = 3
    min_span: float = 0.0002
    value: float | None = None
    closed: bool = False
    closes: int = 0
    readings: int = 0
    gated: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0 or not 0.0 < self.alpha <= 1.0 or not 0.0 <= self.reopen <= 1.0:
            raise ValueError("need 0 < threshold <= 1, 0 < alpha <= 1, 0 <= reopen <= 1")

    def observe(self, queued: float | None, span: float) -> None:
        """One transfer: ``queued`` seconds runnable but not running (None: not known here) over ``span`` seconds."""
        if queued is None or not (math.isfinite(queued) and math.isfinite(span)) or span < self.min_span:
            return
        frac = min(max(queued, 0.0) / span, 1.0)
        self.readings += 1
        self.value = frac if self.value is None else self.value + self.alpha * (frac - self.value)
        if self.closed and self.value < self.threshold * self.reopen:
            self.closed = False
        elif not self.closed and self.value > self.threshold and self.readings >= self.warm:
            self.closed = True
            self.closes += 1

    def admit(self) -> bool:
        """Whether the next round may send unimportant datagrams (counts the rounds kept back)."""
        if self.closed:
            self.gated += 1
        return not self.closed
