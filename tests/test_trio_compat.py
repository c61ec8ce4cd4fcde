"""The same errors in the same places on every trio the package accepts (issue #41): trio 0.22 raised a lone task
error out of a nursery as itself, trio >= 0.25 always wraps it in an exception group. Every nursery inside dgt is
``dgt.errors.open_nursery``, so a caller's ``except PeerClosed`` works on both; and what dgt imports is declared."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import trio

from dgt.errors import PeerClosed, PeerTimeout, RankMismatch, open_nursery

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the check of the declarations runs there

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dgt"


def test_no_plain_trio_nursery_inside_dgt():
    """A plain ``trio.open_nursery()`` would leak an exception group to a caller on trio >= 0.25."""
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(PKG.rglob("*.py")) if p.name != "errors.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if "trio.open_nursery(" in line]
    assert not offenders, offenders


async def test_a_tasks_error_leaves_the_nursery_as_itself():
    async def fail() -> None:
        raise PeerClosed("rank 1 closed its endpoint")

    with pytest.raises(PeerClosed, match="rank 1 closed"):
        async with open_nursery() as n:
            n.start_soon(fail)
            await trio.sleep(5)


async def test_the_bodys_error_leaves_the_nursery_as_itself():
    with pytest.raises(PeerTimeout, match="body"):
        async with open_nursery() as n:
            n.start_soon(trio.sleep, 5)
            raise PeerTimeout("body")


async def test_several_errors_give_the_rank_mismatch_with_the_group_as_its_cause():
    async def fail(exc: Exception) -> None:
        raise exc

    with pytest.raises(RankMismatch) as info:
        async with open_nursery() as n:
            n.start_soon(fail, PeerClosed("closed"))
            n.start_soon(fail, RankMismatch("sizes differ"))
    assert isinstance(info.value.__cause__, BaseExceptionGroup)
    assert len(info.value.__cause__.exceptions) == 2


async def test_cancellation_from_outside_still_works():
    with trio.move_on_after(0.05) as scope:
        async with open_nursery() as n:
            n.start_soon(trio.sleep, 5)
            await trio.sleep(5)
    assert scope.cancelled_caught


# import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "yaml": "pyyaml"}


def _declared() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) + [r for extra in meta["optional-dependencies"].values() for r in extra]
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}


def _third_party_imports() -> dict[str, str]:
    """Every top-level module dgt imports that is neither stdlib nor dgt, with one place that imports it."""
    found: dict[str, str] = {}
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "dgt" and top not in sys.stdlib_module_names:
                    found.setdefault(top, f"{p.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_third_party_module_dgt_imports_is_declared():
    declared = _declared()
    missing = {mod: where for mod, where in _third_party_imports().items()
               if DISTRIBUTIONS.get(mod, mod).lower() not in declared}
    assert not missing, f"imported but not in pyproject's dependencies or extras: {missing}"
    assert "exceptiongroup" in _third_party_imports()  # the check above covers it (Python 3.10's backport)
