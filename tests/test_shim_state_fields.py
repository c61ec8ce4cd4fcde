"""DGTState's wire dtype and chooser are explicit fields (issue 44): ``wire_dtype=`` and ``chooser=`` set them,
``DGTState()`` is the default spelt out, and the keywords of before (``wire=``, ``choose=``) warn and still work."""

from __future__ import annotations

import pytest
import torch

from dgt.shim import DGTState
from dgt.shim.chooser import DropChooser
from dgt.shim.state import DEFAULT_CODEC


def test_the_default_state_is_the_explicit_fields_spelt_out() -> None:
    default = DGTState()
    spelt = DGTState(codec=DEFAULT_CODEC, wire_dtype="fp16",
                     chooser=DropChooser(start=1, modes=("lowrank", "lossy", "lossless")))
    assert default.wire_dtype == spelt.wire_dtype == torch.float16
    assert isinstance(default.chooser, DropChooser) and default.chooser == spelt.chooser
    assert default.lowrank_codec is not None and default.lowrank_codec.name == spelt.lowrank_codec.name
    assert DGTState(chooser="lowrank").chooser == default.chooser
    assert default.codec.name == spelt.codec.name and default.warmup_iters == spelt.warmup_iters
    assert "wire_dtype='float16'" in repr(default) and "chooser=DropChooser(...)" in repr(default)


def test_the_fields_can_be_set_for_any_codec_and_off_for_the_default() -> None:
    st = DGTState(codec="dgt:p=0.3", wire_dtype="bf16", chooser=DropChooser(probe=5))
    assert st.wire_dtype == torch.bfloat16 and st.chooser is not None and st.chooser.probe == 5
    off = DGTState(wire_dtype=None, chooser=None)
    assert off.wire_dtype is None and off.chooser is None
    assert DGTState(wire_dtype="native", chooser=False).chooser is None
    explicit = DGTState(codec="dgt:p=0.3")  # "auto": an explicit codec keeps its dtype, no chooser (as before)
    assert explicit.wire_dtype is None and explicit.chooser is None
    assert DGTState(codec="dense", chooser=True).chooser is None  # a lossless codec has nothing to choose
    with pytest.raises(ValueError, match="chooser must be"):
        DGTState(chooser="sometimes")
    with pytest.raises(ValueError, match="wire_dtype"):
        DGTState(wire_dtype="int8")
    with pytest.raises(TypeError, match="unexpected keyword"):
        DGTState(wires="fp16")


def test_the_keywords_of_before_warn_and_do_what_they_did() -> None:
    with pytest.warns(DeprecationWarning, match=r"DGTState\(wire_dtype=\.\.\.\)"):
        st = DGTState(codec="dgt:p=0.3", wire="fp16")
    assert st.wire_dtype == torch.float16
    with pytest.warns(DeprecationWarning, match=r"DGTState\(chooser=\.\.\.\)"):
        st = DGTState(codec="dgt:p=0.3", choose=True, warmup_iters=3)
    assert st.chooser is not None and st.chooser.start == 3
    with pytest.warns(DeprecationWarning):
        assert isinstance(DGTState(choose=None).chooser, DropChooser)  # None meant "auto" then
