"""The configuration of a running topology, saved as JSON so later `dgt netem` commands can find it.

The namespaces themselves are the truth (teardown works from their names alone); the state only adds what
cannot be read back cheaply: the requested link specs and which loss backend was chosen.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

STATE_DIR = os.environ.get("DGT_NETEM_STATE_DIR", "/run/dgt-netem")


def path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"{prefix}.json")


def save(prefix: str, data: dict[str, Any]) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = path(prefix) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path(prefix))


def load(prefix: str) -> dict[str, Any] | None:
    try:
        with open(path(prefix)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def remove(prefix: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path(prefix))
