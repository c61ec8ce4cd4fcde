"""What every ``dgt`` command line shares for bad input: argparse types for counts and ranges, and ``BadOption``.

A value the shell hands over is checked where it is read: ``--world 0``, ``--p 2`` or ``--repeat -1`` is the parser's
usage error (exit status 2, naming the option and the value), not a traceback from inside a run or a run that starts
and fails in each of its processes. Values whose check needs more than their own text (a codec spec, a list of modes,
a device that must exist) raise ``BadOption`` from the command before anything starts; ``dgt.cli.main`` turns it
into that command's usage error.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from dgt.errors import DgtError


class BadOption(DgtError):
    """A command-line value its option's type let through that the command cannot run (the message names the
    option): the command's usage error, exit status 2."""


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (either bound may be open-ended)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is outside {_span(lo, hi)}")
        return value

    parse.__name__ = "integer"
    return parse


def number(lo: float | None = None, hi: float | None = None, *, above: bool = False,
           below: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [lo, hi]; ``above``/``below`` make that end open ((lo, ...), (..., hi))."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        bad = not math.isfinite(value)
        if lo is not None:
            bad = bad or value < lo or (above and value == lo)
        if hi is not None:
            bad = bad or value > hi or (below and value == hi)
        if bad:
            raise argparse.ArgumentTypeError(f"{text} is outside {_span(lo, hi, above, below)}")
        return value

    parse.__name__ = "number"
    return parse


def _span(lo: float | None, hi: float | None, above: bool = False, below: bool = False) -> str:
    left = "(-inf" if lo is None else ("(" if above else "[") + f"{lo:g}"
    right = "inf)" if hi is None else f"{hi:g}" + (")" if below else "]")
    return f"{left}, {right}"


COUNT = integer(1)
"""At least 1: ranks, steps, repeats, elements."""
NON_NEGATIVE = integer(0)
"""At least 0: warm-up steps, seeds, thread counts where 0 means the default."""
POSITIVE = number(0.0, above=True)
"""A finite number above 0: sizes in MB, seconds, learning rates."""
FRACTION = number(0.0, 1.0)
"""A fraction in [0, 1]."""


def codec_spec(option: str, spec: str) -> str:
    """``spec`` if a codec can be built from it (dgt.codecs.make_codec), else ``BadOption`` naming ``option``."""
    from dgt.codecs import make_codec

    try:
        make_codec(spec)
    except (ValueError, TypeError) as exc:
        raise BadOption(f"{option} {spec!r}: {exc}") from None
    return spec


def torch_device(option: str, text: str, auto: bool = False) -> str:
    """``cpu`` or ``cuda`` (``auto``: also ``auto``, cuda where there is one), else ``BadOption``; ``cuda`` on a
    machine without a CUDA device is one too (the run would fail in its first tensor op)."""
    import torch

    allowed = ("auto", "cpu", "cuda") if auto else ("cpu", "cuda")
    if text not in allowed and not text.startswith("cuda:"):
        raise BadOption(f"{option}: one of {', '.join(allowed)}, got {text!r}")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise BadOption(f"{option} {text}: this machine has no CUDA device torch can use")
    return text
