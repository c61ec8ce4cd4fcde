"""Print the oldest versions pyproject.toml allows, one ``name==version`` a line, for CI's oldest-versions step.

Reads ``[project].dependencies`` and the extras named on the command line; every requirement must have a ``>=``
lower bound (a requirement without one is an error: CI could not tell what "oldest" means). Environment markers are
kept, so a pin for Python 3.10 only stays that way."""

import re
import sys
from pathlib import Path

import tomllib

meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
reqs = list(meta["dependencies"])
for extra in sys.argv[1:]:
    reqs += [r for r in meta["optional-dependencies"][extra] if not r.startswith("dgt[")]
seen = set()
for req in reqs:
    spec, _, marker = req.partition(";")
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(,.*)?", spec)
    if m is None:
        sys.exit(f"oldest.py: {req!r} has no '>=' lower bound")
    if m.group(1).lower() in seen:
        continue
    seen.add(m.group(1).lower())
    print(f"{m.group(1)}=={m.group(2)}" + (f"; {marker.strip()}" if marker else ""))
