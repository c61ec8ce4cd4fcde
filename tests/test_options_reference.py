"""docs/options.md lists every setting: each field of TransportConfig and of each of its groups (Lanes, Pacing, ...,
walked from dgt.transport.config.GROUPS), DropChooser, DGTBackendOptions and wire.Limits, each argument of DGTState,
and each DGT_* environment variable named in dgt/; the defaults it states in a parseable form are the code's (issues 41
and 44)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import operator
import os
import re
from pathlib import Path
from typing import Any

import pytest

from dgt import wire
from dgt.shim.backend import DGTBackendOptions
from dgt.shim.chooser import DropChooser
from dgt.shim.state import DGTState
from dgt.transport.config import GROUPS, TransportConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "options.md"
ENV_NAME = re.compile(r"DGT_[A-Z0-9_]+")
CODE_SPAN = re.compile(r"`([^`]+)`")
NO_VALUE = object()  # a default the doc gives in words only, or the code gives no literal for


# -- reading the doc ----------------------------------------------------------------------------------------------

def sections(text: str) -> dict[str, str]:
    """'## heading' -> the text up to the next '## ' heading."""
    out: dict[str, str] = {}
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    for head, body in zip(parts[1::2], parts[2::2], strict=True):
        out[head.strip()] = body
    return out


def section_of(text: str, name: str) -> str:
    """The section whose heading starts with `name` in backticks (or with `name` itself)."""
    found = [body for head, body in sections(text).items() if head.startswith((f"`{name}`", name))]
    assert len(found) == 1, f"docs/options.md needs exactly one '## `{name}` ...' section, found {len(found)}"
    return found[0]


def rows(body: str) -> dict[str, str]:
    """Table rows of a section: every name in the first cell's code spans -> the row's second cell (the default)."""
    out: dict[str, str] = {}
    for line in body.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        for name in CODE_SPAN.findall(cells[0]):
            assert name not in out, f"{name} listed twice in one section"
            out[name] = cells[1]
    return out


_BINOPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                            ast.Div: operator.truediv, ast.LShift: operator.lshift, ast.Pow: operator.pow}


def literal(expr: str) -> Any:
    """The value of a small constant expression (``256 << 10``, ``12.5e6``, ``"auto"``, ``[]``, ``{"a": 0}``), or
    NO_VALUE for anything else (a call, a name, prose)."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return NO_VALUE

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, (ast.List, ast.Tuple)):
            vals = [ev(e) for e in n.elts]
            return vals if isinstance(n, ast.List) else tuple(vals)
        if isinstance(n, ast.Dict) and all(k is not None for k in n.keys):
            return {ev(k): ev(v) for k, v in zip(n.keys, n.values, strict=True)}  # type: ignore[arg-type]
        raise ValueError(ast.dump(n))

    try:
        return ev(tree)
    except (ValueError, TypeError):
        return NO_VALUE


def doc_default(cell: str) -> Any:
    """The default a doc cell states: its first code span, when that is a constant expression."""
    spans = CODE_SPAN.findall(cell)
    return literal(spans[0]) if spans else NO_VALUE


def is_plain(value: Any) -> bool:
    """Whether a code default is a plain literal the doc must state parseably (not an object, a factory's
    instance, a class)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


def same(a: Any, b: Any) -> bool:
    """Equal values; a bool equals only a bool (``0`` is not ``False``), an int may stand for an equal float."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# -- reading the code ---------------------------------------------------------------------------------------------

def dataclass_defaults(cls: type) -> dict[str, Any]:
    """Public fields -> their default (a factory's product) with no DGT_* variable set."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("DGT_")}
    try:
        out = {}
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = NO_VALUE
        return out
    finally:
        os.environ.update(saved)


def init_defaults(cls: type) -> dict[str, Any]:
    """Constructor arguments (a class that is not a dataclass) -> their defaults."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: (NO_VALUE if p.default is inspect.Parameter.empty else p.default) for p in params
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def env_variables() -> dict[str, Any]:
    """Every DGT_* name written as a whole string literal in dgt/ (read with os.environ / getenv, or set for a child
    process) -> the default of an ``X.get("DGT_..", DEFAULT)`` / ``getenv`` read of it (NO_VALUE where none is
    given). Module-level string constants are followed (``ENV = "DGT_PORT_RANGE"``)."""
    found: dict[str, Any] = {}
    for path in sorted((ROOT / "dgt").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}

        def value(n: ast.AST, consts: dict[str, str] = consts) -> Any:
            if isinstance(n, ast.Constant):
                return n.value
            if isinstance(n, ast.Name) and n.id in consts:
                return consts[n.id]
            return NO_VALUE

        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and ENV_NAME.fullmatch(n.value):
                found.setdefault(n.value, NO_VALUE)
        for n in ast.walk(tree):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "getenv")
                    and len(n.args) == 2):
                name = value(n.args[0])
                if isinstance(name, str) and ENV_NAME.fullmatch(name):
                    default = value(n.args[1])
                    old = found.get(name, NO_VALUE)
                    assert old is NO_VALUE or default is NO_VALUE or old == default, \
                        f"{name} read with two defaults in dgt/: {old!r}, {default!r}"
                    if default is not NO_VALUE:
                        found[name] = default
    return found


SETTINGS: list[tuple[str, Any]] = [
    ("TransportConfig", lambda: dataclass_defaults(TransportConfig)),
    # every group of TransportConfig but wire.Limits (its own section below) has a section named after its class
    *[(cls.__name__, lambda cls=cls: dataclass_defaults(cls)) for cls in GROUPS.values() if cls is not wire.Limits],
    ("DGTState", lambda: init_defaults(DGTState)),
    ("DropChooser", lambda: dataclass_defaults(DropChooser)),
    ("DGTBackendOptions", lambda: dataclass_defaults(DGTBackendOptions)),
    ("wire.Limits", lambda: dataclass_defaults(wire.Limits)),
]


def check(section: str, code: dict[str, Any], what: str, env: bool = False) -> list[str]:
    """Problems of one section against the code: missing names, stale names, defaults that differ."""
    documented = rows(section)
    problems = [f"{what}: `{n}` is not in docs/options.md" for n in code if n not in documented]
    problems += [f"{what}: docs/options.md lists `{n}`, which the code has not" for n in documented if n not in code]
    for name, default in code.items():
        if name not in documented:
            continue
        stated = doc_default(documented[name])
        if stated is NO_VALUE:
            if is_plain(default) and not env:
                problems.append(f"{what}.{name}: the doc's default {documented[name]!r} should start with the "
                                f"code's default in backticks, `{default!r}`")
            continue
        if default is NO_VALUE:
            continue
        if env:  # environment values are strings: `65536` and "65536" are the same default
            stated, default = str(stated), str(default)
        if not same(stated, default):
            problems.append(f"{what}.{name}: docs/options.md says {stated!r}, the code {default!r}")
    return problems


@pytest.mark.parametrize("name,defaults", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_every_field_is_documented_with_its_default(name: str, defaults: Any) -> None:
    text = DOC.read_text()
    code = defaults()
    assert code, f"{name} has no fields?"
    problems = check(section_of(text, name), code, name)
    assert not problems, "\n".join(problems)


def test_every_environment_variable_is_documented_with_its_default() -> None:
    env = env_variables()
    # the variables the code is known to read must be found, or the scan itself is broken
    assert {"DGT_SECRET", "DGT_SECRET_FILE", "DGT_PORT_RANGE", "DGT_HOST", "DGT_BACKEND_CODEC"} <= set(env)
    assert env["DGT_BACKEND_LOSSY_MIN_NUMEL"] == "65536" and env["DGT_NETEM_STATE_DIR"] == "/run/dgt-netem"
    problems = check(section_of(DOC.read_text(), "Environment variables"), env, "environment", env=True)
    assert not problems, "\n".join(problems)


# -- the checker itself -------------------------------------------------------------------------------------------

def test_every_group_of_transport_config_is_a_field_with_a_section() -> None:
    """The walk covers the groups: each GROUPS entry is a TransportConfig field of that class, and each class but
    wire.Limits has its own section (checked field by field above)."""
    fields = {f.name: f for f in dataclasses.fields(TransportConfig)}
    text = DOC.read_text()
    top = rows(section_of(text, "TransportConfig"))
    for name, cls in GROUPS.items():
        assert name in fields and isinstance(getattr(TransportConfig(), name), cls)
        assert name in top, f"TransportConfig.{name} (the {cls.__name__} group) is not in docs/options.md"
        if cls is not wire.Limits:
            assert rows(section_of(text, cls.__name__)), f"docs/options.md: the {cls.__name__} section has no rows"
    assert {cls.__name__ for _, cls in GROUPS.items()} - {"Limits"} <= {s[0] for s in SETTINGS}


def _row_starting(body: str, start: str) -> str:
    (line,) = [ln for ln in body.splitlines() if ln.startswith(start)]
    return line


def test_a_field_missing_from_the_doc_or_a_wrong_default_is_caught() -> None:
    text = DOC.read_text()
    body = section_of(text, "TransportConfig")
    code = dataclass_defaults(TransportConfig)
    assert check(body, code, "TransportConfig") == []
    without = "\n".join(ln for ln in body.splitlines() if not ln.startswith("| `pacing` |"))
    assert check(without, code, "TransportConfig") == ["TransportConfig: `pacing` is not in docs/options.md"]
    cong = section_of(text, "Congestion")
    cong_code = dataclass_defaults(GROUPS["congestion"])
    assert check(cong, cong_code, "Congestion") == []
    without = "\n".join(ln for ln in cong.splitlines() if not ln.startswith("| `cpu_gate`"))
    assert check(without, cong_code, "Congestion") == ["Congestion: `cpu_gate` is not in docs/options.md"]
    tout = section_of(text, "Timeouts")
    tout_code = dataclass_defaults(GROUPS["timeouts"])
    row = _row_starting(tout, "| `peer`")
    wrong = tout.replace(row, row.replace("| `10.0` |", "| `5.0` |"))
    assert wrong != tout
    assert check(wrong, tout_code, "Timeouts") == ["Timeouts.peer: docs/options.md says 5.0, the code 10.0"]
    pace = section_of(text, "Pacing")
    row = _row_starting(pace, "| `burst`")
    shifted = pace.replace(row, row.replace("`256 << 10`", "`256 << 11`"))
    assert len(check(shifted, dataclass_defaults(GROUPS["pacing"]), "Pacing")) == 1
    socks = section_of(text, "Sockets")
    row = _row_starting(socks, "| `gso_segments`")
    prose = socks.replace(row, row.replace("| `64` |", "| sixty-four |"))
    assert len(check(prose, dataclass_defaults(GROUPS["sockets"]), "Sockets")) == 1  # stated parseably
    extra = body + "| `no_such_field` | `1` | x | y |\n"
    assert check(extra, code, "TransportConfig") == [
        "TransportConfig: docs/options.md lists `no_such_field`, which the code has not"]
    env_body = section_of(text, "Environment variables")
    env = env_variables()
    gone = "\n".join(ln for ln in env_body.splitlines() if not ln.startswith("| `DGT_THREADS` |"))
    assert check(gone, env, "environment", env=True) == ["environment: `DGT_THREADS` is not in docs/options.md"]


def test_the_expression_reader() -> None:
    assert literal("256 << 10") == 262144 and literal("12.5e6") == 12.5e6 and literal("-1") == -1
    assert literal('{"lossless": 0, "lossy": 0}') == {"lossless": 0, "lossy": 0} and literal("[]") == []
    assert literal("None") is None and literal('""') == ""
    for text in ("default_lanes()", "wire.DEFAULT_LIMITS", "unset", "__import__('os')", "2 ** 'a'"):
        assert literal(text) is NO_VALUE
