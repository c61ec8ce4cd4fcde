"""The transport imports without the optional tools' packages; a command that needs one names the extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK = "import sys\nfor m in ('pyroute2', 'scapy', 'rich', 'matplotlib', 'sklearn'):\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_the_transport_needs_none_of_the_optional_packages():
    proc = _run("import dgt.shim, dgt.collectives, dgt.transport, dgt.codecs, dgt.protocol\n"
                "from dgt.cli import main\n"
                "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
                "print('ok')\n")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


@pytest.mark.parametrize("argv,extra", [(["netem", "status"], "netem"), (["inspect", "/nonexistent.pcap"], "inspect")])
def test_a_command_without_its_extra_says_which_to_install(argv, extra):
    proc = _run(f"from dgt.cli import main\nsys.exit(main({argv!r}))\n")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"pip install 'dgt[{extra}]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_other_import_errors_are_not_hidden():
    from dgt.extras import missing_extra_message

    assert missing_extra_message(ModuleNotFoundError("x", name="dgt.nonexistent"), "bench") is None
    msg = missing_extra_message(ModuleNotFoundError("x", name="sklearn.datasets"), "bench")
    assert msg is not None and "scikit-learn" in msg and "dgt[bench]" in msg
