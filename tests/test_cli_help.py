"""Every ``dgt ... --help`` exits 0 with a usage line: the parser tree is walked, so a new subcommand is covered."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dgt.cli import build_parser, main


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                paths.extend(_command_paths(child, prefix + (name,)))
    return paths


PATHS = _command_paths(build_parser([]))


def test_the_tree_has_every_area():
    tops = {p[0] for p in PATHS if p}
    assert {"demo", "experiment", "bench", "netem", "inspect", "capture"} <= tops
    assert ("bench", "transport") in PATHS and ("netem", "up") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "dgt")
def test_help_exits_zero(path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*path, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dgt"), out[:200]


def test_a_group_without_its_subcommand_prints_help_not_a_traceback():
    # `dgt bench` with no NAME used to crash formatting a help string with an unescaped '%'
    proc = subprocess.run([sys.executable, "-m", "dgt", "bench"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "transport" in proc.stdout and "Traceback" not in proc.stderr
