"""How busy the machine was with other work while a run trained: timings on a shared 2-core machine are only
comparable when nothing else competed for the cores, so every run records it and the report shows it."""

from __future__ import annotations

import os
import resource
import time


def _busy_seconds() -> float | None:
    """CPU seconds all cores spent not idle since boot (from /proc/stat), None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadMeter:
    """Start before a run, ``stop()`` after its processes were reaped: the average number of cores other processes
    kept busy meanwhile (an upper bound: the kernel's network work for the run counts as other)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = _busy_seconds()
        self.own0 = _own_seconds()

    def stop(self) -> dict[str, float | None]:
        wall = time.monotonic() - self.t0
        busy1 = _busy_seconds()
        own = _own_seconds() - self.own0
        if self.busy0 is None or busy1 is None or wall <= 0:
            return {"wall": wall, "own_cores": own / wall if wall > 0 else None, "other_cores": None}
        other = max(0.0, (busy1 - self.busy0) - own)
        return {"wall": wall, "own_cores": own / wall, "other_cores": other / wall, "cpus": float(os.cpu_count() or 1)}
