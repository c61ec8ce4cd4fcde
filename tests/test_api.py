"""The public API of docs/api.md (issue 45): every name it lists imports from its face, the faces' ``__all__`` are
all listed, and a moved public name keeps working for a release with a DeprecationWarning that names its new place."""

import importlib
import re
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
FACES = ["dgt.transport", "dgt.collectives", "dgt.shim", "dgt.codecs"]


@pytest.mark.parametrize("face", FACES)
def test_every_name_a_face_exports_is_listed_in_the_api_doc_and_imports(face):
    mod = importlib.import_module(face)
    row = next(line for line in DOC.splitlines() if line.startswith(f"| `{face}`"))
    for name in mod.__all__:
        assert getattr(mod, name) is not None
        assert f"`{name}`" in row, (face, name)


def test_the_listed_harness_helpers_and_errors_import():
    from dgt.harness.endpoints import connected_pair  # noqa: F401
    from dgt.harness.groups import local_groups  # noqa: F401
    from dgt.harness.offline import OfflineTransport  # noqa: F401

    errors = importlib.import_module("dgt.errors")
    row = next(line for line in DOC.splitlines() if line.startswith("| `dgt.errors`"))
    for name in re.findall(r"`(\w+)`", row):
        if name[0].isupper() or name in ("single_error", "one_error"):
            assert hasattr(errors, name), name
    assert issubclass(errors.InputRejected, errors.DgtError) and issubclass(errors.RankMismatch, errors.DgtError)


def test_the_old_dgt_endpoint_module_still_works_with_a_deprecation_warning():
    import dgt.transport

    old = importlib.import_module("dgt.endpoint")
    for name in dgt.transport.__all__:
        with pytest.warns(DeprecationWarning, match=f"dgt.endpoint.{name} is deprecated: import it from dgt.transport"):
            assert getattr(old, name) is getattr(dgt.transport, name)
    with pytest.raises(AttributeError, match="dgt.transport"):
        old.NoSuchName  # noqa: B018


async def test_awaiting_endpoint_open_says_what_to_write():
    from dgt.transport import Endpoint

    with pytest.raises(TypeError, match="async with Endpoint.open"):
        await Endpoint.open(0, 1)
