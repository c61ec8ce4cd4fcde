"""Network emulation with pyroute2: namespaces, shaped links, DSCP priority queues.

Public API (imported lazily so `python -m dgt.netem.crosstraffic` children stay light)::

    from dgt.netem import Topology, LinkSpec, Flow, cross_traffic, run, teardown, probe
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Topology": "dgt.netem.topology",
    "Host": "dgt.netem.topology",
    "teardown": "dgt.netem.topology",
    "LinkSpec": "dgt.netem.spec",
    "Flow": "dgt.netem.crosstraffic",
    "FlowResult": "dgt.netem.crosstraffic",
    "cross_traffic": "dgt.netem.crosstraffic",
    "run": "dgt.netem.runner",
    "HostRun": "dgt.netem.runner",
    "probe": "dgt.netem.probe",
    "class_of_dscp": "dgt.netem.shaping",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        mod = importlib.import_module(_EXPORTS[name])
        return mod if name == "probe" else getattr(mod, name)
    raise AttributeError(f"module 'dgt.netem' has no attribute {name!r}")
