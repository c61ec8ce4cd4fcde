"""Which ``pip install 'dgt[EXTRA]'`` brings an optional package, for the error a command gives when it is missing.

The transport needs only torch, numpy and trio; the tools around it (emulation, capture, benchmarks, experiments)
are extras (pyproject.toml). A command that reaches a missing one stops with this message, not a traceback."""

from __future__ import annotations

# importable name -> (distribution, the extras that carry it)
OPTIONAL: dict[str, tuple[str, tuple[str, ...]]] = {
    "pyroute2": ("pyroute2", ("netem", "experiment")),
    "scapy": ("scapy", ("inspect",)),
    "rich": ("rich", ("netem", "inspect", "bench", "experiment")),
    "matplotlib": ("matplotlib", ("inspect", "experiment")),
    "sklearn": ("scikit-learn", ("bench", "experiment")),
}

COMMAND_EXTRA = {"netem": "netem", "inspect": "inspect", "capture": "inspect", "bench": "bench",
                 "experiment": "experiment", "demo": "experiment"}


def missing_extra_message(exc: ModuleNotFoundError, command: str | None) -> str | None:
    """The message for a missing optional package, or None when ``exc`` is not about one."""
    top = (exc.name or "").split(".")[0]
    if top not in OPTIONAL:
        return None
    dist, extras = OPTIONAL[top]
    extra = COMMAND_EXTRA.get(command or "", extras[0])
    if extra not in extras:
        extra = extras[0]
    what = f"`dgt {command}`" if command else "this"
    return (f"{what} needs {dist}, which is optional: install it with  pip install 'dgt[{extra}]'  "
            f"(or 'dgt[all]' for every tool)")
