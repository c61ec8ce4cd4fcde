"""Deprecated: the transport's public face moved to :mod:`dgt.transport` (issue #24). Every name this module had is
still here for one release, each access warning with its new place; see docs/api.md ("Changing the public API")."""

from __future__ import annotations

import warnings
from typing import Any

import dgt.transport as _transport

__all__ = list(_transport.__all__)


def __getattr__(name: str) -> Any:
    if name in __all__:
        warnings.warn(f"dgt.endpoint.{name} is deprecated: import it from dgt.transport (dgt.endpoint goes away in "
                      f"the release after 0.1)", DeprecationWarning, stacklevel=2)
        return getattr(_transport, name)
    raise AttributeError(f"module 'dgt.endpoint' has no attribute {name!r} (the transport's names are in "
                         f"dgt.transport)")
